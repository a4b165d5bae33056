// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/concepts/transport.hpp"
#include "pulley/messages.hpp"

namespace pulley {

/// Deadlines of a client's requests.
struct ClientOptions {
  /// For requests a ps answers at once (push, ungated pull, stats, initialize).
  std::chrono::milliseconds request_timeout{std::chrono::seconds(60)};
  /// For requests that wait on other tasks: readiness, sync tokens, step-gated pulls.
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(30)};
};

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

  /// Sends `request(ps)` to every ps at once and returns the replies of type R.
  template <class R, class MakeRequest>
  std::vector<R> broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                           std::string_view what) {
    std::vector<std::future<Response>> futures;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      futures.push_back(transport_.call(ps, Request{make_request(ps)}, {}));
    }
    std::vector<R> replies;
    for (std::size_t ps = 0; ps < futures.size(); ++ps) {
      replies.push_back(wait<R>(futures[ps], ps, timeout, what));
    }
    return replies;
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
    auto future = transport_.call(0, TakeToken{worker}, {});
    return wait<TokenReply>(future, 0, options_.wait_timeout, "take a sync token");
  }

  /// Pulls every request's rows into its destination, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps.
  void pull(std::span<const PullRequest> requests, std::int64_t min_step) {
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
    std::vector<std::future<Response>> futures(num_ps());
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      if (pulls[ps].slices.empty()) continue;
      futures[ps] = transport_.call(ps, std::move(pulls[ps]), std::move(targets[ps]));
    }
    const auto timeout = min_step > 0 ? options_.wait_timeout : options_.request_timeout;
    for (std::size_t ps = 0; ps < futures.size(); ++ps) {
      if (futures[ps].valid()) wait<PullReply>(futures[ps], ps, timeout, "pull");
    }
  }

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which is its step vote. Returns the
  /// number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients) {
    if (gradients.size() != variables_.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    std::vector<Push> pushes(num_ps(), Push{worker, local_step, {}});
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
    std::vector<std::future<Response>> futures;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      futures.push_back(transport_.call(ps, std::move(pushes[ps]), {}));
    }
    std::uint32_t stale = 0;
    for (std::size_t ps = 0; ps < futures.size(); ++ps) {
      stale += wait<PushReply>(futures[ps], ps, options_.request_timeout, "push").stale_parts;
    }
    return stale;
  }

  /// Waits for the reply of `ps` and returns it as R, or throws the server's Error.
  template <class R>
  R wait(std::future<Response>& future, std::size_t ps, std::chrono::milliseconds timeout,
         std::string_view what) {
    if (future.wait_for(timeout) != std::future_status::ready) {
      throw Error(ErrorCode::kDeadlineExceeded, std::string(what) + ": ps " + std::to_string(ps) +
                                                    " did not answer within " +
                                                    std::to_string(timeout.count()) + " ms");
    }
    return expect<R>(future.get());
  }

 private:
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
