// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/client_options.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/detail/finite.hpp"
#include "pulley/messages.hpp"

namespace pulley {

/// One destination of a pull: rows `rows` of variable `variable`, written to `into`.
struct PullRequest {
  std::size_t variable = 0;
  RowRange rows;
  std::span<float> into;
};

namespace detail {

/// What workers, the chief and the evaluator share: the placement, and turning
/// variable-level pulls and pushes into per-ps requests sent concurrently.
template <Transport T>
class Client {
 public:
  Client(T transport, ClientOptions options)
      : transport_(std::move(transport)), options_(options) {}

  [[nodiscard]] std::size_t num_ps() const { return transport_.num_ps(); }
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept { return variables_; }
  [[nodiscard]] bool has_placement() const noexcept { return !placement_.first_part.empty(); }
  T& transport() noexcept { return transport_; }
  [[nodiscard]] const ClientOptions& options() const noexcept { return options_; }

  /// Index of the variable called `name`; throws kNotFound naming it.
  [[nodiscard]] std::size_t variable_index(std::string_view name) const {
    for (std::size_t i = 0; i < variables_.size(); ++i) {
      if (variables_[i].name == name) return i;
    }
    throw Error(ErrorCode::kNotFound, "unknown variable '" + std::string(name) + "'");
  }

  /// Sends `make_request(ps)` to every ps at once and returns the replies of type R.
  template <class R, class MakeRequest>
  std::vector<R> broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                           std::string_view what) {
    std::vector<PendingCall> calls;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      calls.push_back(transport_.call(ps, Request{make_request(ps)}, {}));
    }
    return collect<R>(calls, timeout, what);
  }

  /// Registers the model on every ps and checks that their placements agree.
  void register_model(std::span<const VariableSpec> variables) {
    std::vector<VariableSpec> list(variables.begin(), variables.end());
    adopt(broadcast<PlacementReply>([&](std::size_t) { return Register{list}; },
                                    options_.request_timeout, "register"),
          list);
  }

  /// Waits until every ps is initialized and learns the placement.
  void wait_ready(std::span<const VariableSpec> variables) {
    std::vector<VariableSpec> list(variables.begin(), variables.end());
    adopt(broadcast<PlacementReply>([](std::size_t) { return WaitReady{}; }, options_.wait_timeout,
                                    "wait for initialization"),
          list);
  }

  /// Takes a sync token from ps 0, which keeps the global step.
  TokenReply take_token(std::uint32_t worker) {
    std::vector<PendingCall> calls;
    calls.push_back(transport_.call(0, TakeToken{worker}, {}));
    return collect<TokenReply>(calls, options_.wait_timeout, "take a sync token").front();
  }

  /// Pulls every request's rows into its destination, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported: every value pulled is at least that recent.
  std::int64_t pull(std::span<const PullRequest> requests, std::int64_t min_step) {
    std::vector<PendingCall> calls = send_pulls(requests, min_step);
    return lowest_step(collect<PullReply>(calls, pull_timeout(min_step), "pull"));
  }

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which is its step vote. Returns the
  /// number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients) {
    std::vector<PendingCall> calls = send_pushes(worker, local_step, gradients);
    return stale_parts(collect<PushReply>(calls, options_.request_timeout, "push"));
  }

  /// What push_pull did.
  struct PushPullResult {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::int64_t pulled_step = 0;   ///< lowest global step of the pulled values
  };

  /// `push`, then `pull` once each ps has completed `min_step` steps, in one round trip:
  /// both requests go out together, and each ps handles the pull after the push (requests
  /// from one client to one ps keep their order).
  PushPullResult push_pull(std::uint32_t worker, std::int64_t local_step,
                           std::span<const std::span<const float>> gradients,
                           std::span<const PullRequest> requests, std::int64_t min_step) {
    std::vector<PendingCall> pushes = send_pushes(worker, local_step, gradients);
    std::vector<PendingCall> pulls;
    std::vector<std::optional<Response>> pushed(pushes.size());
    try {
      pulls = send_pulls(requests, min_step);
      std::vector<std::optional<Response>> pulled(pulls.size());
      // Each ps answers the pull after the push, so the pulls are awaited: one wake-up of
      // this thread, not two. Meanwhile every 50 ms the answers so far are looked at, since
      // a refused push (or a dead ps) leaves a pull waiting for a step that never comes.
      const auto timeout = pull_timeout(min_step);
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!take_answers<PullReply>(pulls, pulled)) {
        take_answers<PushReply>(pushes, pushed);
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) {
          throw Error(ErrorCode::kDeadlineExceeded,
                      "pull: no answer within " + std::to_string(timeout.count()) + " ms");
        }
        const auto waiting =
            std::find_if(pulled.begin(), pulled.end(), [](const auto& answer) { return !answer; });
        pulls[static_cast<std::size_t>(waiting - pulled.begin())].wait_until(
            std::min(deadline, now + std::chrono::milliseconds(50)));
      }
      PushPullResult result;
      result.pulled_step = std::numeric_limits<std::int64_t>::max();
      for (auto& answer : pulled) {
        result.pulled_step = std::min(result.pulled_step, std::get<PullReply>(*answer).global_step);
      }
      if (pulled.empty()) result.pulled_step = 0;
      const auto push_deadline = std::chrono::steady_clock::now() + options_.request_timeout;
      for (std::size_t i = 0; i < pushes.size(); ++i) {
        if (!pushed[i]) pushes[i].wait_until(push_deadline);
      }
      if (!take_answers<PushReply>(pushes, pushed)) {
        throw Error(
            ErrorCode::kDeadlineExceeded,
            "push: no answer within " + std::to_string(options_.request_timeout.count()) + " ms");
      }
      for (auto& answer : pushed) result.stale_parts += std::get<PushReply>(*answer).stale_parts;
      return result;
    } catch (...) {  // no call may outlive the gradients or the pull targets
      for (PendingCall& c : pulls) c.cancel();
      for (PendingCall& c : pushes) c.cancel();
      throw;
    }
  }

  /// Current values of every variable, pulled from every ps at once.
  std::vector<std::vector<float>> read_variables() {
    std::vector<std::vector<float>> values;
    std::vector<PullRequest> requests;
    values.reserve(variables_.size());
    for (std::size_t v = 0; v < variables_.size(); ++v) {
      values.emplace_back(variables_[v].size());
      requests.push_back({v, {0, variables_[v].rows()}, values.back()});
    }
    pull(requests, 0);
    return values;
  }

  /// Blocks until ps 0 (which keeps the global step) has completed `step` steps; returns
  /// the global step it reports.
  std::int64_t wait_for_step(std::int64_t step) {
    std::vector<PendingCall> calls;
    calls.push_back(transport_.call(0, Pull{step, {}}, {}));
    return collect<PullReply>(calls, options_.wait_timeout, "wait for step").front().global_step;
  }

  /// Counters of every ps task, by task index.
  std::vector<Stats> stats() {
    std::vector<Stats> all;
    for (auto& r : broadcast<StatsReply>([](std::size_t) { return GetStats{}; },
                                         options_.request_timeout, "stats")) {
      all.push_back(r.stats);
    }
    return all;
  }

  /// Waits for every call (one shared deadline) and returns their replies as R, in order.
  /// Never returns or throws while a call may still touch the caller's buffers: at the
  /// deadline, or at the first error (a dead ps need not wait for the others' answers), the
  /// unfinished calls are cancelled first.
  template <class R>
  std::vector<R> collect(std::vector<PendingCall>& calls, std::chrono::milliseconds timeout,
                         std::string_view what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<R> replies;
    replies.reserve(calls.size());
    try {
      for (PendingCall& call : calls) {
        if (!call.wait_until(deadline)) {
          throw Error(ErrorCode::kDeadlineExceeded, std::string(what) + ": no answer within " +
                                                        std::to_string(timeout.count()) + " ms");
        }
        replies.push_back(expect<R>(call.take()));
      }
    } catch (...) {
      for (PendingCall& c : calls) c.cancel();
      throw;
    }
    return replies;
  }

 private:
  /// Takes the answers that have arrived into `answers`; true once all have. Throws the first
  /// error among them, or a reply of another kind than R.
  template <class R>
  static bool take_answers(std::vector<PendingCall>& calls,
                           std::vector<std::optional<Response>>& answers) {
    bool all = true;
    for (std::size_t i = 0; i < calls.size(); ++i) {
      if (!answers[i] && calls[i].ready()) {
        answers[i] = calls[i].take();
        if (const auto* e = std::get_if<ErrorReply>(&*answers[i])) throw Error(e->code, e->message);
        if (!std::holds_alternative<R>(*answers[i])) {
          throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind from server");
        }
      }
      all = all && answers[i].has_value();
    }
    return all;
  }

  /// Sends each ps its share of `requests` (checked against the variables' shapes).
  std::vector<PendingCall> send_pulls(std::span<const PullRequest> requests,
                                      std::int64_t min_step) {
    std::vector<Pull> pulls(num_ps(), Pull{min_step, {}});
    std::vector<PullTargets> targets(num_ps());
    for (const PullRequest& r : requests) {
      const VariableSpec& spec = checked_variable(r.variable);
      if (r.rows.empty() || r.rows.end > spec.rows() ||
          r.into.size() != r.rows.size() * spec.row_size()) {
        throw Error(ErrorCode::kInvalidArgument,
                    "pull of '" + spec.name + "' rows [" + std::to_string(r.rows.begin) + ", " +
                        std::to_string(r.rows.end) + ") into " + std::to_string(r.into.size()) +
                        " floats does not fit its shape");
      }
      for (const Part& part : placement_.parts_of(r.variable)) {
        const std::size_t begin = std::max(part.rows.begin, r.rows.begin);
        const std::size_t end = std::min(part.rows.end, r.rows.end);
        if (begin >= end) continue;
        pulls[part.ps].slices.push_back({global_index(part), {begin, end}});
        targets[part.ps].push_back(r.into.subspan((begin - r.rows.begin) * spec.row_size(),
                                                  (end - begin) * spec.row_size()));
      }
    }
    std::vector<PendingCall> calls;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      if (pulls[ps].slices.empty()) continue;
      calls.push_back(transport_.call(ps, std::move(pulls[ps]), std::move(targets[ps])));
    }
    return calls;
  }

  /// Sends every ps the gradients of the parts it holds (checked: one finite gradient of the
  /// right size per variable, before anything is sent).
  std::vector<PendingCall> send_pushes(std::uint32_t worker, std::int64_t local_step,
                                       std::span<const std::span<const float>> gradients) {
    if (gradients.size() != variables_.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    std::vector<Push> pushes(num_ps(), Push{worker, local_step, {}, /*finite_checked=*/true});
    for (const Part& part : placement_.parts) {
      const std::size_t row_size = variables_[part.variable].row_size();
      const std::span<const float> g = gradients[part.variable];
      if (g.size() != variables_[part.variable].size()) {
        throw Error(ErrorCode::kInvalidArgument,
                    "gradient of '" + variables_[part.variable].name + "' has " +
                        std::to_string(g.size()) + " elements, expected " +
                        std::to_string(variables_[part.variable].size()));
      }
      pushes[part.ps].gradients.push_back(
          {global_index(part), g.subspan(part.rows.begin * row_size, part.rows.size() * row_size)});
    }
    // Checked here, before anything is sent: a push refused by one ps but applied by another
    // would leave the ps tasks on different steps.
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      if (!detail::all_finite(gradients[v])) {
        throw Error(ErrorCode::kInvalidArgument, "non-finite (NaN or Inf) gradient for '" +
                                                     variables_[v].name + "'; nothing was pushed");
      }
    }
    std::vector<PendingCall> calls;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      calls.push_back(transport_.call(ps, std::move(pushes[ps]), {}));
    }
    return calls;
  }

  std::chrono::milliseconds pull_timeout(std::int64_t min_step) const {
    return min_step > 0 ? options_.wait_timeout : options_.request_timeout;
  }

  static std::int64_t lowest_step(const std::vector<PullReply>& replies) {
    std::int64_t step = std::numeric_limits<std::int64_t>::max();
    for (const PullReply& r : replies) step = std::min(step, r.global_step);
    return replies.empty() ? 0 : step;
  }

  static std::uint32_t stale_parts(const std::vector<PushReply>& replies) {
    std::uint32_t stale = 0;
    for (const PushReply& r : replies) stale += r.stale_parts;
    return stale;
  }

  const VariableSpec& checked_variable(std::size_t v) const {
    if (!has_placement()) {
      throw Error(ErrorCode::kFailedPrecondition, "no placement yet: call wait_ready() first");
    }
    if (v >= variables_.size()) {
      throw Error(ErrorCode::kNotFound, "unknown variable index " + std::to_string(v));
    }
    return variables_[v];
  }

  std::uint32_t global_index(const Part& part) const {
    return static_cast<std::uint32_t>(&part - placement_.parts.data());
  }

  void adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables) {
    for (std::size_t ps = 1; ps < replies.size(); ++ps) {
      if (!(replies[ps].placement == replies[0].placement)) {
        throw Error(ErrorCode::kFailedPrecondition,
                    "ps 0 and ps " + std::to_string(ps) +
                        " place the variables differently: are they configured with the same "
                        "sharding policy and number of ps tasks?");
      }
    }
    if (replies.empty()) throw Error(ErrorCode::kInvalidArgument, "the cluster has no ps task");
    const auto& registered = replies[0].variables;
    if (registered.size() != variables.size()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks hold " + std::to_string(registered.size()) +
                      " variables but this model has " + std::to_string(variables.size()));
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      if (!(registered[v] == variables[v])) {
        throw Error(ErrorCode::kFailedPrecondition,
                    "variable " + std::to_string(v) + " of this model ('" + variables[v].name +
                        "') differs from the one the chief registered ('" + registered[v].name +
                        "'): name, shape and initializer must match");
      }
    }
    placement_ = std::move(replies[0].placement);
    variables_ = std::move(variables);
  }

  T transport_;
  ClientOptions options_;
  Placement placement_;
  std::vector<VariableSpec> variables_;
};

}  // namespace detail
}  // namespace pulley
