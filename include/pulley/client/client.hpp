// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/protocol/call_group.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/client/options.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// One destination of a pull: rows `rows` of variable `variable`, written to `into`.
struct PullRequest {
  std::size_t variable = 0;
  RowRange rows;
  std::span<float> into;
};

/// Rows of one embedding table to pull into `values`, or whose gradients in `values` to
/// push. The ids are grouped by the ps that holds them: `ps_begin[p]` to `ps_begin[p + 1]`
/// are ps p's (num_ps + 1 offsets), so each ps's share of `values` is one contiguous span
/// that a reply is written into, or a push sent from, with no copy.
struct RowRequest {
  std::size_t table = 0;
  std::span<const std::uint64_t> ids;
  std::span<const std::size_t> ps_begin;
  std::span<float> values;  ///< ids.size() × dim
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
  /// The embedding tables the ps tasks hold.
  [[nodiscard]] const std::vector<TableSpec>& tables() const noexcept { return tables_; }
  [[nodiscard]] bool has_placement() const noexcept { return !placement_.first_part.empty(); }
  /// The ps tasks' epoch (restores so far), as last learned.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// The optimizer's slot and counter names, as the ps tasks said at registration.
  [[nodiscard]] const std::vector<std::string>& slot_names() const noexcept { return slot_names_; }
  [[nodiscard]] const std::vector<std::string>& counter_names() const noexcept { return counter_names_; }

  static std::uint64_t random_start() { return detail::random_u64() >> 1U; }  // never wraps
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

  /// Registers the model (its variables, and its embedding tables with the seed of their
  /// rows) on every ps and checks that their placements agree.
  void register_model(std::span<const VariableSpec> variables,
                      std::span<const TableSpec> tables = {}, std::uint64_t table_seed = 0) {
    std::vector<VariableSpec> list(variables.begin(), variables.end());
    std::vector<TableSpec> table_list(tables.begin(), tables.end());
    adopt(broadcast<PlacementReply>(
              [&](std::size_t) { return Register{list, table_list, table_seed}; },
              options_.request_timeout, "register"),
          list, &table_list);
    table_seed_ = table_seed;
  }

  /// Waits until every ps is initialized and learns the placement; with `tables`, checks
  /// that the ps tasks hold exactly those embedding tables.
  void wait_ready(std::span<const VariableSpec> variables,
                  std::optional<std::span<const TableSpec>> tables = std::nullopt) {
    std::vector<VariableSpec> list(variables.begin(), variables.end());
    std::optional<std::vector<TableSpec>> table_list;
    if (tables) table_list.emplace(tables->begin(), tables->end());
    adopt(broadcast<PlacementReply>([](std::size_t) { return WaitReady{}; }, options_.wait_timeout,
                                    "wait for initialization"),
          list, table_list ? &*table_list : nullptr);
  }

  /// Pulls the rows of every request into its values, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported.
  std::int64_t pull_rows(std::span<const RowRequest> requests, std::int64_t min_step) {
    CallGroup group;
    send_row_pulls(group, requests, min_step);
    wait_gated(group, min_step, "pull rows");
    std::int64_t step = std::numeric_limits<std::int64_t>::max();
    for (std::size_t i = 0; i < group.size(); ++i) step = std::min(step, group.take_as<RowsReply>(i).global_step);
    return group.size() == 0 ? 0 : step;
  }

  /// Takes a sync token from ps 0, which paces the workers.
  TokenReply take_token(std::uint32_t worker) {
    CallGroup group;
    group.add(transport_.call(0, TakeToken{worker, epoch_}, {}));
    (void)wait_progressing(group, "worker " + std::to_string(worker) + ": take a sync token");
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

  /// `pull` and `pull_rows` together, in one round trip; returns the lowest global step
  /// the dense pulls reported (the rows' are as recent: they wait for the same step).
  std::int64_t pull_with_rows(std::span<const PullRequest> requests,
                              std::span<const RowRequest> rows, std::int64_t min_step) {
    // The rows first: a row pull counts as changing the ps (it may create rows), which makes
    // a TCP server copy whatever of the dense replies before it is still unsent.
    CallGroup group;
    send_row_pulls(group, rows, min_step);
    const std::size_t row_pulls = group.size();
    send(group, split_pulls(requests, min_step));
    wait_gated(group, min_step, "pull");
    std::int64_t step = std::numeric_limits<std::int64_t>::max();
    for (std::size_t i = 0; i < row_pulls; ++i) step = std::min(step, group.take_as<RowsReply>(i).global_step);
    for (std::size_t i = row_pulls; i < group.size(); ++i) step = std::min(step, group.take_as<PullReply>(i).global_step);
    return group.size() == 0 ? 0 : step;
  }

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which counts towards its step.
  /// Returns the number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients,
                     std::span<const RowRequest> rows = {}) {
    CallGroup group;
    send_pushes(group, worker, local_step, gradients, rows);
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
                           std::span<const PullRequest> requests, std::int64_t min_step,
                           std::span<const RowRequest> rows = {}) {
    PullsPerPs pulls = split_pulls(requests, min_step);
    CallGroup group;
    send_pushes(group, worker, local_step, gradients, rows);
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
    return *snapshot_until(step, std::chrono::steady_clock::time_point::max());
  }

  /// Like snapshot, but nullopt if `deadline` passes before the ps tasks reach `step`.
  std::optional<Snapshot> snapshot_until(std::int64_t step,
                                         std::chrono::steady_clock::time_point deadline) {
    constexpr int kRounds = 8;
    Snapshot shot;
    const auto first = read_into(shot.values, step, true, deadline);  // (lowest, highest)
    if (!first) return std::nullopt;
    auto steps = *first;
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
    return *wait_for_step_until(step, std::chrono::steady_clock::time_point::max());
  }

  /// Like wait_for_step, but nullopt once `deadline` passes first.
  std::optional<std::int64_t> wait_for_step_until(std::int64_t step,
                                                  std::chrono::steady_clock::time_point deadline) {
    CallGroup group;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      group.add(transport_.call(ps, Pull{step, {}, epoch_}, {}));
    }
    if (step <= 0) {
      group.wait(options_.request_timeout, "read the global step");
    } else if (!wait_progressing(group, "wait for step " + std::to_string(step), deadline)) {
      return std::nullopt;
    }
    return lowest_step(group, 0);
  }

  /// Every variable with its optimizer state, and the sync policy's state, as one cut across
  /// all ps tasks (a checkpoint): every ps is paused (at once, or the moment it completes
  /// `at_step`; pushes that arrive then wait), each is brought to the same count of pushes
  /// taken from every worker (the largest any had), read there, and resumed. Training
  /// stands still only while the state is read.
  ModelState read_state(std::int64_t at_step = 0) {
    if (!has_placement()) throw Error(ErrorCode::kFailedPrecondition, "no model registered yet");
    struct Resumer {  // whatever happens, the ps tasks go on
      Client* client;
      ~Resumer() {
        try {
          client->broadcast<Ack>([](std::size_t) { return Resume{}; },
                                 client->options_.request_timeout, "resume the ps tasks");
        } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
        }
      }
    } resumer{this};
    std::vector<PauseReply> paused;
    {
      CallGroup group;
      for (std::size_t ps = 0; ps < num_ps(); ++ps) group.add(transport_.call(ps, Pause{at_step}, {}));
      wait_gated(group, at_step, "pause the ps tasks at step " + std::to_string(at_step));
      for (std::size_t ps = 0; ps < num_ps(); ++ps) paused.push_back(group.take_as<PauseReply>(ps));
    }
    std::vector<std::uint64_t> until;
    for (const PauseReply& p : paused) {
      if (until.size() < p.pushes.size()) until.resize(p.pushes.size(), 0);
      for (std::size_t w = 0; w < p.pushes.size(); ++w) until[w] = std::max(until[w], p.pushes[w]);
    }
    if (!paused[0].whole) {
      log(LogLevel::kWarning, "the optimizer keeps state it does not name (slots, counters): a "
                              "checkpoint holds the rest, and a restore starts that afresh");
    }
    ModelState state;
    const std::size_t num_slots = paused[0].slot_names.size();
    for (const VariableSpec& spec : variables_) {
      VariableState v;
      v.spec = spec;
      v.values.resize(spec.size());
      for (const std::string& name : paused[0].slot_names) {
        v.slots.push_back({name, std::vector<float>(spec.size())});
      }
      v.counter_names = paused[0].counter_names;
      state.variables.push_back(std::move(v));
    }
    CallGroup group;
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      PullTargets targets;
      for (const Part& part : placement_.parts) {
        if (part.ps != ps) continue;
        VariableState& v = state.variables[part.variable];
        const std::size_t row = v.spec.row_size();
        const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
        targets.push_back(std::span(v.values).subspan(at, n));
        for (std::size_t k = 0; k < num_slots; ++k) {
          targets.push_back(std::span(v.slots[k].values).subspan(at, n));
        }
      }
      group.add(transport_.call(ps, ReadState{until}, std::move(targets)));
    }
    group.wait(options_.request_timeout, "read the ps tasks' state at one cut");
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      const StateReply reply = group.take_as<StateReply>(ps);
      if (ps == 0) {
        state.global_step = reply.global_step;
        state.pacer = reply.pacer;
      } else if (reply.pacer != state.pacer) {
        log(LogLevel::kWarning, "ps " + std::to_string(ps) + " and ps 0 disagree on the sync "
                                "policy's state at the cut: the checkpoint keeps ps 0's");
      }
      for (const PartState& p : reply.parts) {
        if (p.part >= placement_.parts.size() || placement_.parts[p.part].ps != ps) {
          throw Error(ErrorCode::kInternal, "ps " + std::to_string(ps) + " answered for a part it does not hold");
        }
        const Part& part = placement_.parts[p.part];
        state.variables[part.variable].counters.push_back({part.rows, p.counters});
      }
    }
    for (VariableState& v : state.variables) {
      std::sort(v.counters.begin(), v.counters.end(),
                [](const PartCounters& a, const PartCounters& b) { return a.rows.begin < b.rows.begin; });
    }
    return state;
  }

  /// Registers `state`'s model and sets every ps from it (Restore): values, optimizer state
  /// (slots and counters matched by name: a checkpoint of another optimizer restores the
  /// values alone), the sync policy's state, at a new epoch. The placement may differ from
  /// the checkpoint's (another number of ps tasks): tensors are split anew, and each part
  /// takes the counters of the saved part that held its first row.
  void restore(const ModelState& state) {
    register_model(state.specs(), std::vector<TableSpec>(tables_), table_seed_);
    const std::uint64_t epoch = epoch_ + 1;
    std::vector<Restore> messages(num_ps(), Restore{epoch, state.pacer, {}});
    bool whole = true;
    for (const Part& part : placement_.parts) {
      const VariableState& v = state.variables[part.variable];
      const std::size_t row = v.spec.row_size();
      const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
      PartState ps{global_index(part), std::span<const float>(v.values).subspan(at, n), {}, {}};
      for (const std::string& name : slot_names_) {
        const auto it = std::find_if(v.slots.begin(), v.slots.end(),
                                     [&](const SlotState& s) { return s.name == name; });
        if (it == v.slots.end() || v.slots.size() != slot_names_.size()) {
          ps.slots.clear();
          whole = false;
          break;
        }
        ps.slots.push_back(std::span<const float>(it->values).subspan(at, n));
      }
      const auto saved = std::find_if(v.counters.begin(), v.counters.end(), [&](const PartCounters& c) {
        return c.rows.begin <= part.rows.begin && part.rows.begin < c.rows.end;
      });
      for (const std::string& name : counter_names_) {
        const auto k = std::find(v.counter_names.begin(), v.counter_names.end(), name);
        if (saved == v.counters.end() || k == v.counter_names.end() ||
            v.counter_names.size() != counter_names_.size()) {
          ps.counters.clear();
          whole = false;
          break;
        }
        ps.counters.push_back(saved->values[static_cast<std::size_t>(k - v.counter_names.begin())]);
      }
      messages[part.ps].parts.push_back(std::move(ps));
    }
    if (!whole) {
      log(LogLevel::kWarning, "the checkpoint's optimizer state does not match this optimizer's "
                              "slots and counters: the values are restored, the optimizer starts afresh");
    }
    broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); }, options_.request_timeout,
                   "restore the ps tasks");
    epoch_ = epoch;
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
    (void)wait_progressing(group, what);
  }

  /// Waits for `group`, whose calls wait for other tasks, for as long as the ps tasks make
  /// progress: every so often it asks them their global steps, logs what they wait for once
  /// none has moved for `stall_report` ("worker 2 at clock 5", "worker:1 (last heard 14.2 s
  /// ago)"), and gives up (kDeadlineExceeded, cancelling the calls) once none has moved for
  /// `wait_timeout`, naming the same; a long wait for a step far ahead is no stall. With a
  /// `deadline`, returns false (the calls cancelled) when it passes first.
  bool wait_progressing(CallGroup& group, std::string_view what,
                        std::chrono::steady_clock::time_point deadline =
                            std::chrono::steady_clock::time_point::max()) {
    using Clock = std::chrono::steady_clock;
    const auto patience = options_.wait_timeout;
    const auto look_every = std::min({patience, options_.stall_report, std::chrono::milliseconds(10000)});
    std::vector<std::int64_t> steps;  // the ps tasks' global steps when last looked at
    auto still_since = Clock::now();
    for (;;) {
      const auto now0 = Clock::now();
      const auto slice = deadline == Clock::time_point::max()
                             ? look_every
                             : std::min<std::chrono::milliseconds>(
                                   look_every, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                   std::max(deadline - now0, Clock::duration::zero())));
      if (group.wait_for(slice)) return true;
      if (Clock::now() >= deadline) {
        group.cancel();
        return false;
      }
      std::string why;
      const std::vector<std::int64_t> now_steps = global_steps(why);
      const auto now = Clock::now();
      if (!now_steps.empty()) {
        if (!steps.empty() && now_steps != steps) still_since = now;
        steps = now_steps;
      }
      const auto stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - still_since);
      if (stalled >= patience) {
        group.cancel();
        throw Error(ErrorCode::kDeadlineExceeded,
                    std::string(what) + ": no progress for " + std::to_string(stalled.count()) +
                        " ms" + why);
      }
      if (stalled >= options_.stall_report) {  // a hang explains itself while it lasts
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%.1f", static_cast<double>(stalled.count()) / 1000.0);
        log(LogLevel::kWarning, std::string(what) + ": no progress for " + seconds + " s" + why);
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
      std::vector<std::vector<float>>& values, std::int64_t min_step, bool patient,
      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) {
    std::vector<PullRequest> requests;
    values.resize(variables_.size());
    for (std::size_t v = 0; v < variables_.size(); ++v) {
      values[v].resize(variables_[v].size());
      requests.push_back({v, {0, variables_[v].rows()}, values[v]});
    }
    CallGroup group;
    send(group, split_pulls(requests, min_step));
    if (patient) {
      if (min_step <= 0) {
        group.wait(options_.request_timeout, "read the variables");
      } else if (!wait_progressing(group, "read the variables at step " + std::to_string(min_step),
                                   deadline)) {
        return std::nullopt;
      }
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
    PullsPerPs out{std::vector<Pull>(num_ps(), Pull{min_step, {}, epoch_}),
                   std::vector<PullTargets>(num_ps())};
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
                   std::span<const std::span<const float>> gradients,
                   std::span<const RowRequest> rows = {}) {
    if (gradients.size() != variables_.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    for (const RowRequest& r : rows) check_rows(r);
    if (options_.clip_norm > 0.0F) gradients = clipped(gradients, rows);
    // One number for the push to every ps: a push sent again is recognized by it.
    const std::uint64_t sequence = ++sequence_;
    std::vector<Push> pushes(num_ps(), Push{worker, local_step, {}, epoch_, sequence});
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
    // One push per ps, whole: its rows must fit in one message.
    std::vector<std::size_t> ids_to(num_ps(), 0);
    for (const RowRequest& r : rows) {
      for (std::size_t ps = 0; ps < num_ps(); ++ps) {
        const std::size_t n = r.ps_begin[ps + 1] - r.ps_begin[ps];
        ids_to[ps] += n;
        if (ids_to[ps] > kMaxIdsPerMessage || n * tables_[r.table].dim * sizeof(float) > kMaxRowBytesPerMessage) {
          throw Error(ErrorCode::kInvalidArgument,
                      "a push to ps " + std::to_string(ps) + " of more rows than one message carries (" +
                          std::to_string(kMaxIdsPerMessage) + " ids, and 256 MiB of rows of a table): " +
                          "use smaller batches, or more ps tasks");
        }
      }
    }
    for (const RowRequest& r : rows) {
      if (!detail::all_finite(r.values)) {
        throw Error(ErrorCode::kInvalidArgument, "non-finite (NaN or Inf) row gradients for table '" +
                                                     tables_[r.table].name + "'; nothing was pushed");
      }
      const std::size_t dim = tables_[r.table].dim;
      for (std::size_t ps = 0; ps < num_ps(); ++ps) {
        const std::size_t begin = r.ps_begin[ps], end = r.ps_begin[ps + 1];
        if (begin == end) continue;
        pushes[ps].rows.push_back({static_cast<std::uint32_t>(r.table),
                                   std::vector<std::uint64_t>(r.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                                              r.ids.begin() + static_cast<std::ptrdiff_t>(end)),
                                   std::span<const float>(r.values).subspan(begin * dim, (end - begin) * dim)});
      }
    }
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      group.add(transport_.call(ps, std::move(pushes[ps]), {}));
    }
  }

  /// Checks a row request against the tables: a known table, ids grouped by ps as
  /// `ps_begin` says, values of ids × dim.
  void check_rows(const RowRequest& r) const {
    if (r.table >= tables_.size()) {
      throw Error(ErrorCode::kNotFound, "unknown table index " + std::to_string(r.table));
    }
    const TableSpec& spec = tables_[r.table];
    if (r.ps_begin.size() != num_ps() + 1 || r.ps_begin.front() != 0 ||
        r.ps_begin.back() != r.ids.size() || !std::is_sorted(r.ps_begin.begin(), r.ps_begin.end()) ||
        r.values.size() != r.ids.size() * spec.dim) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rows of table '" + spec.name + "': " + std::to_string(r.ids.size()) + " ids, " +
                      std::to_string(r.values.size()) + " values of dim " + std::to_string(spec.dim) +
                      ", grouped by " + std::to_string(r.ps_begin.size()) + " offsets for " +
                      std::to_string(num_ps()) + " ps tasks: they do not fit");
    }
  }

  /// Sends each ps PullRows of its share of `requests`, replies written into place: one
  /// request per kMaxIdsPerMessage ids (a larger share goes as several).
  void send_row_pulls(CallGroup& group, std::span<const RowRequest> requests, std::int64_t min_step) {
    for (const RowRequest& r : requests) check_rows(r);
    for (std::size_t ps = 0; ps < num_ps(); ++ps) {
      PullRows pull{min_step, epoch_, {}};
      PullTargets targets;
      std::size_t ids = 0;
      auto flush = [&] {
        if (pull.tables.empty()) return;
        group.add(transport_.call(ps, std::move(pull), std::move(targets)));
        pull = PullRows{min_step, epoch_, {}};
        targets = {};
        ids = 0;
      };
      for (const RowRequest& r : requests) {
        const std::size_t dim = tables_[r.table].dim;
        for (std::size_t begin = r.ps_begin[ps], end = r.ps_begin[ps + 1]; begin < end;) {
          if (ids == kMaxIdsPerMessage) flush();
          const std::size_t n = std::min({end - begin, kMaxIdsPerMessage - ids,
                                          std::max<std::size_t>(1, kMaxRowBytesPerMessage / (dim * sizeof(float)))});
          pull.tables.push_back({static_cast<std::uint32_t>(r.table),
                                 std::vector<std::uint64_t>(r.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                                            r.ids.begin() + static_cast<std::ptrdiff_t>(begin + n)),
                                 {}});
          targets.push_back(r.values.subspan(begin * dim, n * dim));
          ids += n;
          begin += n;
          // A table comes once per request: the next piece of this one goes in the next.
          if (begin < end) flush();
        }
      }
      flush();
    }
  }

  /// `gradients` scaled by clip_norm / their global norm when that norm is larger (TF's
  /// clip_by_global_norm), copied into buffers of this client; as they are otherwise. A
  /// non-finite norm leaves them as they are, for the finiteness check to refuse.
  /// The rows' gradients count in the norm too (as TensorFlow's clip_by_global_norm counts
  /// IndexedSlices), and are scaled where they are: they are the worker's own buffers.
  std::span<const std::span<const float>> clipped(std::span<const std::span<const float>> gradients,
                                                 std::span<const RowRequest> rows) {
    double squares = 0.0;
    for (const std::span<const float> g : gradients) {
      for (const float x : g) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    for (const RowRequest& r : rows) {
      for (const float x : r.values) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    const double norm = std::sqrt(squares);
    last_norm_ = norm;
    if (!(norm > options_.clip_norm) || !std::isfinite(norm)) return gradients;
    const auto scale = static_cast<float>(options_.clip_norm / norm);
    for (const RowRequest& r : rows) {
      for (float& x : r.values) x *= scale;
    }
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

  void adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables,
             const std::vector<TableSpec>* tables = nullptr) {
    if (replies.empty()) throw Error(ErrorCode::kInvalidArgument, "the cluster has no ps task");
    if (tables != nullptr && replies[0].tables != *tables) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks hold " + std::to_string(replies[0].tables.size()) +
                      " embedding table(s), and this model declares " + std::to_string(tables->size()) +
                      " that differ from them (name, dim, initializer, admission, eviction must match)");
    }
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
    epoch_ = 0;
    for (const PlacementReply& r : replies) epoch_ = std::max(epoch_, r.epoch);
    slot_names_ = std::move(replies[0].slot_names);
    counter_names_ = std::move(replies[0].counter_names);
    tables_ = std::move(replies[0].tables);
  }

  T transport_;
  ClientOptions options_;
  std::uint64_t epoch_ = 0;  ///< the ps tasks' restores so far, as last learned
  /// Numbers this client's pushes: from a random start, so that a client that restarts is
  /// not taken for the one before it.
  std::uint64_t sequence_ = random_start();
  std::vector<std::string> slot_names_;     ///< the optimizer's slots, as the ps tasks name them
  std::vector<std::string> counter_names_;  ///< the optimizer's counters
  std::vector<std::vector<float>> clipped_;           ///< gradients scaled by clipping
  std::vector<std::span<const float>> clipped_views_;  ///< views of them, by variable
  std::int64_t clipped_steps_ = 0;
  double last_norm_ = 0.0;
  Placement placement_;
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> tables_;   ///< the embedding tables the ps tasks hold
  std::uint64_t table_seed_ = 0;    ///< as registered (kept for a restore's registration)
};

}  // namespace detail
}  // namespace pulley
