// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/call_group.hpp"
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

/// The values of every variable, read from every ps task at one global step.
struct Snapshot {
  /// The global step every ps had completed when it was read (the lowest of them when
  /// `consistent` is false).
  std::int64_t step = 0;
  /// Every ps was read at the same global step. Under SyncReplicas that makes the values
  /// one step's: `step` updates applied on every ps, nothing after them. Under Async and
  /// BoundedStaleness a ps's global step counts what that ps has seen, so even equal steps
  /// may hold different pushes, and while training runs they seldom agree.
  bool consistent = false;
  std::vector<std::vector<float>> values;  ///< one vector per variable, in variable order
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
    CallGroup group;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      group.add(transport_.call(ps, Request{make_request(ps)}, {}));
    }
    group.wait(timeout, what);
    std::vector<R> replies;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) replies.push_back(group.take_as<R>(ps));
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

  /// Takes a sync token from ps 0, which paces the workers.
  TokenReply take_token(std::uint32_t worker) {
    CallGroup group;
    group.add(transport_.call(0, TakeToken{worker}, {}));
    wait_progressing(group, "take a sync token");
    return group.take_as<TokenReply>(0);
  }

  /// Pulls every request's rows into its destination, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported: every value pulled is at least that recent.
  std::int64_t pull(std::span<const PullRequest> requests, std::int64_t min_step) {
    CallGroup group;
    send(group, split_pulls(requests, min_step));
    wait_gated(group, min_step, "pull");
    return lowest_step(group, 0);
  }

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which counts towards its step.
  /// Returns the number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients) {
    CallGroup group;
    send_pushes(group, worker, local_step, gradients);
    group.wait(options_.request_timeout, "push");
    return stale_parts(group, 0, group.size());
  }

  /// What push_pull did.
  struct PushPullResult {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::int64_t pulled_step = 0;   ///< lowest global step of the pulled values
  };

  /// `push`, then `pull` once each ps has completed `min_step` steps, in one round trip:
  /// both requests go out together, and each ps handles the pull after the push (requests
  /// from one client to one ps keep their order). A refused push ends the wait at once,
  /// although its pull may be waiting for a step that will not come. Both are checked
  /// before either is sent.
  PushPullResult push_pull(std::uint32_t worker, std::int64_t local_step,
                           std::span<const std::span<const float>> gradients,
                           std::span<const PullRequest> requests, std::int64_t min_step) {
    PullsPerPs pulls = split_pulls(requests, min_step);
    CallGroup group;
    send_pushes(group, worker, local_step, gradients);
    const std::size_t pushes = group.size();
    send(group, std::move(pulls));
    wait_gated(group, min_step, "push and pull");
    return {stale_parts(group, 0, pushes), lowest_step(group, pushes)};
  }

  /// Current values of every variable, pulled from every ps at once once it has completed
  /// `min_step` steps.
  std::vector<std::vector<float>> read_variables(std::int64_t min_step = 0) {
    std::vector<std::vector<float>> values;
    read_into(values, min_step, true);
    return values;
  }

  /// Every variable at one global step of at least `step`, the same on every ps when the
  /// ps tasks can agree (see Snapshot): each ps is read once it reaches the target step, and
  /// answers at that step's end (pulls waiting for a step are answered the moment it
  /// completes). A ps read past the target sets the next round's target; a few rounds
  /// settle it while sync training runs. A later round that does not complete at once (the
  /// ps tasks count pushes that will never agree) leaves the last read as it is.
  Snapshot snapshot(std::int64_t step) {
    constexpr int kRounds = 8;
    Snapshot shot;
    auto steps = *read_into(shot.values, step, true);  // (lowest, highest)
    for (int round = 1; round < kRounds && steps.first != steps.second; ++round) {
      std::vector<std::vector<float>> again;
      const auto read = read_into(again, steps.second, false);
      if (!read) break;
      steps = *read;
      shot.values = std::move(again);
    }
    shot.step = steps.first;
    shot.consistent = steps.first == steps.second;
    return shot;
  }

  /// Blocks until every ps has completed `step` steps; returns the lowest global step they
  /// report.
  std::int64_t wait_for_step(std::int64_t step) {
    CallGroup group;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) group.add(transport_.call(ps, Pull{step, {}}, {}));
    wait_gated(group, step, "wait for step " + std::to_string(step));
    return lowest_step(group, 0);
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

 private:
  /// Waits for `group`, whose calls wait for the ps tasks to complete global step
  /// `min_step` (none when it is 0).
  void wait_gated(CallGroup& group, std::int64_t min_step, std::string_view what) {
    if (min_step <= 0) return group.wait(options_.request_timeout, what);
    wait_progressing(group, what);
  }

  /// Waits for `group`, whose calls wait for other tasks, for as long as the ps tasks make
  /// progress: every so often it asks them their global steps, and gives up
  /// (kDeadlineExceeded, cancelling the calls) once none has moved for `wait_timeout`. The
  /// error says what the ps tasks wait for ("worker 2 at clock 5"), so a stall names its
  /// cause; a long wait for a step far ahead is no stall.
  void wait_progressing(CallGroup& group, std::string_view what) {
    using Clock = std::chrono::steady_clock;
    const auto patience = options_.wait_timeout;
    const auto look_every = std::min(patience, std::chrono::milliseconds(10000));
    std::vector<std::int64_t> steps;  // the ps tasks' global steps when last looked at
    auto still_since = Clock::now();
    for (;;) {
      if (group.wait_for(look_every)) return;
      std::string why;
      const std::vector<std::int64_t> now_steps = global_steps(why);
      const auto now = Clock::now();
      if (!now_steps.empty()) {
        if (!steps.empty() && now_steps != steps) still_since = now;
        steps = now_steps;
      }
      if (now - still_since >= patience) {
        group.cancel();
        throw Error(ErrorCode::kDeadlineExceeded,
                    std::string(what) + ": no progress for " +
                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                           now - still_since)
                                           .count()) +
                        " ms" + why);
      }
    }
  }

  /// Every ps's global step, and in `why` what each waits for; empty if a ps does not
  /// answer in time (the question is a courtesy: the wait is what matters).
  std::vector<std::int64_t> global_steps(std::string& why) {
    std::vector<std::int64_t> steps;
    try {
      CallGroup group;
      for (std::size_t ps = 0; ps < num_ps(); ++ps) group.add(transport_.call(ps, GetStats{}, {}));
      group.wait(std::min(options_.request_timeout, std::chrono::milliseconds(5000)),
                 "ask the ps tasks what they wait for");
      for (std::size_t ps = 0; ps < group.size(); ++ps) {
        const StatsReply reply = group.take_as<StatsReply>(ps);
        steps.push_back(reply.stats.global_step);
        why += "; ps " + std::to_string(ps) + " is at step " +
               std::to_string(reply.stats.global_step) + ", waiting for " + reply.waiting_for;
      }
    } catch (const Error& e) {
      why += std::string("; the ps tasks do not say why (") + e.what() + ")";
      steps.clear();
    }
    return steps;
  }

  /// Reads every variable into `values` once every ps has completed `min_step` steps, and
  /// returns the lowest and highest global step the ps tasks were read at. `patient`: as
  /// long as training makes progress; otherwise only briefly, and nullopt (the values
  /// half read) if the ps tasks do not answer at once.
  std::optional<std::pair<std::int64_t, std::int64_t>> read_into(
      std::vector<std::vector<float>>& values, std::int64_t min_step, bool patient) {
    std::vector<PullRequest> requests;
    values.resize(variables_.size());
    for (std::size_t v = 0; v < variables_.size(); ++v) {
      values[v].resize(variables_[v].size());
      requests.push_back({v, {0, variables_[v].rows()}, values[v]});
    }
    CallGroup group;
    send(group, split_pulls(requests, min_step));
    if (patient) {
      wait_gated(group, min_step, "read the variables");
    } else if (!group.wait_for(std::min(options_.request_timeout, std::chrono::milliseconds(2000)))) {
      return std::nullopt;  // the group cancels the reads as it goes
    }
    std::int64_t lowest = std::numeric_limits<std::int64_t>::max();
    std::int64_t highest = std::numeric_limits<std::int64_t>::min();
    for (std::size_t i = 0; i < group.size(); ++i) {
      const std::int64_t step = group.take_as<PullReply>(i).global_step;
      lowest = std::min(lowest, step);
      highest = std::max(highest, step);
    }
    if (group.size() == 0) lowest = highest = 0;
    return std::pair{lowest, highest};
  }

  /// Each ps's share of `requests` (checked against the variables' shapes), as a Pull and
  /// the targets its reply goes to.
  struct PullsPerPs {
    std::vector<Pull> pulls;
    std::vector<PullTargets> targets;
  };
  PullsPerPs split_pulls(std::span<const PullRequest> requests, std::int64_t min_step) {
    PullsPerPs out{std::vector<Pull>(num_ps(), Pull{min_step, {}}), std::vector<PullTargets>(num_ps())};
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
        out.pulls[part.ps].slices.push_back({global_index(part), {begin, end}});
        out.targets[part.ps].push_back(r.into.subspan((begin - r.rows.begin) * spec.row_size(),
                                                      (end - begin) * spec.row_size()));
      }
    }
    return out;
  }

  /// Sends each ps its pull, if it has one.
  void send(CallGroup& group, PullsPerPs&& split) {
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      if (split.pulls[ps].slices.empty()) continue;
      group.add(transport_.call(ps, std::move(split.pulls[ps]), std::move(split.targets[ps])));
    }
  }

  /// Sends every ps the gradients of the parts it holds (checked: one finite gradient of the
  /// right size per variable, before anything is sent).
  void send_pushes(CallGroup& group, std::uint32_t worker, std::int64_t local_step,
                   std::span<const std::span<const float>> gradients) {
    if (gradients.size() != variables_.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    if (options_.clip_norm > 0.0F) gradients = clipped(gradients);
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
    // Checked here, before anything is sent: a push refused by one ps but applied by another
    // would leave the ps tasks on different steps.
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      if (!detail::all_finite(gradients[v])) {
        throw Error(ErrorCode::kInvalidArgument, "non-finite (NaN or Inf) gradient for '" +
                                                     variables_[v].name + "'; nothing was pushed");
      }
    }
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      group.add(transport_.call(ps, std::move(pushes[ps]), {}));
    }
  }

  /// `gradients` scaled by clip_norm / their global norm when that norm is larger (TF's
  /// clip_by_global_norm), copied into buffers of this client; as they are otherwise. A
  /// non-finite norm leaves them as they are, for the finiteness check to refuse.
  std::span<const std::span<const float>> clipped(std::span<const std::span<const float>> gradients) {
    double squares = 0.0;
    for (const std::span<const float> g : gradients) {
      for (const float x : g) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    const double norm = std::sqrt(squares);
    last_norm_ = norm;
    if (!(norm > options_.clip_norm) || !std::isfinite(norm)) return gradients;
    const auto scale = static_cast<float>(options_.clip_norm / norm);
    clipped_.resize(gradients.size());
    clipped_views_.clear();
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      clipped_[v].resize(gradients[v].size());
      std::transform(gradients[v].begin(), gradients[v].end(), clipped_[v].begin(),
                     [scale](float x) { return x * scale; });
      clipped_views_.emplace_back(clipped_[v]);
    }
    ++clipped_steps_;
    return clipped_views_;
  }

 public:
  /// Pushes whose gradients `ClientOptions::clip_norm` scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return clipped_steps_; }
  /// The global norm of the last push's gradients, when clipping is on (else 0).
  [[nodiscard]] double last_gradient_norm() const noexcept { return last_norm_; }

 private:
  /// The lowest global step reported by the pull replies from index `first` on.
  static std::int64_t lowest_step(CallGroup& group, std::size_t first) {
    std::int64_t step = std::numeric_limits<std::int64_t>::max();
    for (std::size_t i = first; i < group.size(); ++i) {
      step = std::min(step, group.take_as<PullReply>(i).global_step);
    }
    return first == group.size() ? 0 : step;
  }

  static std::uint32_t stale_parts(CallGroup& group, std::size_t first, std::size_t end) {
    std::uint32_t stale = 0;
    for (std::size_t i = first; i < end; ++i) stale += group.take_as<PushReply>(i).stale_parts;
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
    if (replies.empty()) throw Error(ErrorCode::kInvalidArgument, "the cluster has no ps task");
    for (std::size_t ps = 1; ps < replies.size(); ++ps) {
      if (!(replies[ps].placement == replies[0].placement)) {
        throw Error(ErrorCode::kFailedPrecondition,
                    "ps 0 and ps " + std::to_string(ps) +
                        " place the variables differently: are they configured with the same "
                        "sharding policy and number of ps tasks?");
      }
    }
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
    for (const Part& part : replies[0].placement.parts) {
      if (part.ps >= num_ps()) {
        throw Error(ErrorCode::kFailedPrecondition,
                    "the ps tasks place parts on ps " + std::to_string(part.ps) + ", but this "
                    "client knows " + std::to_string(num_ps()) + " ps tasks: are they configured "
                    "with the same cluster?");
      }
    }
    if (replies[0].placement.num_variables() != variables.size()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks' placement does not cover this model's variables");
    }
    placement_ = std::move(replies[0].placement);
    variables_ = std::move(variables);
  }

  T transport_;
  ClientOptions options_;
  std::vector<std::vector<float>> clipped_;           ///< gradients scaled by clipping
  std::vector<std::span<const float>> clipped_views_;  ///< views of them, by variable
  std::int64_t clipped_steps_ = 0;
  double last_norm_ = 0.0;
  Placement placement_;
  std::vector<VariableSpec> variables_;
};

}  // namespace detail
}  // namespace pulley
