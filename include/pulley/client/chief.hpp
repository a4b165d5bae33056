// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/client/checkpoint_cut.hpp"
#include "pulley/client/client.hpp"
#include "pulley/client/snapshot.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/sharding/ids.hpp"

namespace pulley {

/// The chief task: registers the model with the ps tasks, initializes every variable from a
/// seed, releases the workers (the ps tasks turn ready), reads variables back for
/// evaluation and checkpoints, and ends training: `shutdown` when it is complete (every
/// task then learns so and ends successfully), `abort` when it failed.
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Chief {
 public:
  /// @param seed initial values depend only on it and the variables' names
  Chief(T transport, std::uint64_t seed, ClientOptions options = {})
      : seed_(seed), client_(std::move(transport), options) {}

  /// Registers `variables`, fills them with their initializers and sends the values to the
  /// ps tasks that hold them. When it returns, every ps is ready and workers proceed.
  ///
  /// `tables` are the model's embedding tables: registered with the same seed, their rows
  /// are created by the ps tasks as they are first pulled (nothing is sent for them).
  const Placement& initialize(std::span<const VariableSpec> variables,
                              std::span<const TableSpec> tables = {}) {
    return send_initial(variables, initial_values(variables), tables, false);
  }

  /// Same with explicit initial values, one vector per variable (e.g. a restored checkpoint).
  const Placement& initialize(std::span<const VariableSpec> variables,
                              std::span<const std::vector<float>> values,
                              std::span<const TableSpec> tables = {}) {
    return send_initial(variables, values, tables, false);
  }

  /// Initializes as `initialize` does and returns the job's state at global step 0 exactly,
  /// optimizer slots included: every ps holds the workers' first pushes until it is read
  /// (however fast they start). It is the checkpoint TensorFlow's saver writes before the
  /// first step, and what a lost ps rolls the job back to when there is no checkpoint.
  ModelState initialize_and_save(std::span<const VariableSpec> variables,
                                 std::span<const TableSpec> tables = {}) {
    try {
      send_initial(variables, initial_values(variables), tables, true);
    } catch (const Error&) {
      resume_all();  // the ps tasks that were initialized, and so paused, go on
      throw;
    }
    return read_state(client_);  // resumes every ps, whatever happens
  }

  /// Current values of every variable, as each ps holds them now (while training runs, the
  /// ps tasks may be at different steps: use `snapshot` for one step's values).
  std::vector<std::vector<float>> read_variables() { return pulley::read_variables(client_); }

  /// Every variable at one global step of at least `step`, read from every ps at that same
  /// step (see Snapshot); waits until the ps tasks reach it.
  Snapshot snapshot(std::int64_t step) { return pulley::snapshot(client_, step); }

  /// Like snapshot, but nullopt if `deadline` passes before the ps tasks reach `step`, or
  /// `meanwhile` (run while it waits) voided the wait: see pulley::snapshot_until.
  std::optional<Snapshot> snapshot_until(std::int64_t step, std::chrono::steady_clock::time_point deadline,
                                         const std::function<bool()>& meanwhile = {}) {
    return pulley::snapshot_until(client_, step, deadline, meanwhile);
  }

  /// Blocks until every ps task has completed `step` global steps; returns the lowest
  /// global step they report.
  std::int64_t wait_for_step(std::int64_t step) { return client_.wait_for_step(step); }

  /// Like wait_for_step, but gives up at `deadline`, or when `meanwhile` (run while it
  /// waits) voided the wait: nullopt then. See Client::wait_for_step_until.
  std::optional<std::int64_t> wait_for_step_until(std::int64_t step, std::chrono::steady_clock::time_point deadline,
                                                  const std::function<bool()>& meanwhile = {}) {
    return client_.wait_for_step_until(step, deadline, meanwhile);
  }

  /// Counters of every member ps, in member order (Client::stats).
  std::vector<Stats> stats() { return client_.stats(); }

  /// The current rows `ids` of embedding table `table` (ids.size() × dim floats, in order)
  /// under id sharding `sharding` (the ps tasks'); see pulley::read_rows. For evaluation and
  /// tests: training never needs the chief to read rows.
  template <IdSharding I = HashIds>
  std::vector<float> read_rows(std::string_view table, std::span<const std::uint64_t> ids,
                               I sharding = {}) {
    return pulley::read_rows(client_, table, ids, std::move(sharding));
  }

  /// Every variable with its optimizer state and the sync policy's state, as one consistent
  /// cut across all ps tasks, for a checkpoint (`CheckpointDirectory::save`). How the cut is
  /// made: every ps is paused (pushes that arrive wait, unanswered), tells how many pushes
  /// of each worker it has taken, and is brought to the largest of those counts (taking the
  /// pushes that were on their way to it) before it is read and resumed. So every ps holds
  /// the same pushes at the cut, under any sync policy: Async and BoundedStaleness, whose
  /// ps tasks apply pushes as they come, included. Training stands still while the state
  /// is read, not while it is written. `rows` makes the tables' part incremental: the rows
  /// changed since an earlier checkpoint (CutRows, ModelState::base_step).
  ModelState save_state(CutRows rows = {}) { return read_state(client_, 0, rows); }

  /// The same, cut the moment every ps completes global step `step` (waiting for it as long
  /// as training progresses): under SyncReplicas every ps is then exactly at that step, with
  /// nothing of the next one taken.
  ModelState save_state_at(std::int64_t step, CutRows rows = {}) { return read_state(client_, step, rows); }

  /// Sets every ps from `state` (a checkpoint): registers its model, and restores values,
  /// optimizer state and the sync policy's state, at a new epoch. Use it in place of
  /// `initialize` to resume a job, or while training runs to roll every ps back to the
  /// checkpoint (after a ps was lost): what waited on the ps tasks is refused, and their
  /// clients start their step again. When it returns, every ps is ready.
  /// `sharding`: where the ps tasks' Tables policy puts rows (each row is then sent to its
  /// ps only; another sharding sends every row to every ps, which is slower, not wrong).
  template <IdSharding I = HashIds>
  void restore(const ModelState& state, const I& sharding = {}) {
    restore_state(client_, state, seed_, sharding);
  }

  /// Ends training successfully: every ps answers what waits there and everything sent
  /// later with `kOutOfRange` ("training finished"), so workers and the evaluator stop
  /// cleanly (`Worker::step` returns nullopt); the ps tasks then stop serving.
  void shutdown() { end({false, {}}); }

  /// True if every ps task answers that it serves training already, all at the same
  /// epoch: this chief was started again in place of a lost one, and may go on from their
  /// live state (`adopt`). False when any does not (a restore its predecessor left half
  /// done, a ps restarted), or cannot be reached within the request timeout.
  [[nodiscard]] bool ps_serving() {
    try {
      (void)client_.learn_membership();  // a ps its predecessor let go is not waited for
      const auto replies = client_.template broadcast<StatsReply>([](std::size_t) { return GetStats{}; },
                                                                  timeouts().request_timeout, "look at the ps tasks");
      for (const StatsReply& r : replies) client_.set_workers(r.workers);  // as its predecessor left them
      return std::all_of(replies.begin(), replies.end(), [&](const StatsReply& r) {
        return r.ready && r.epoch == replies.front().epoch;
      });
    } catch (const Error&) {
      return false;
    }
  }

  /// Takes over a job that every ps serves (`ps_serving`), in place of a lost chief:
  /// learns where each variable lives and the epoch (kFailedPrecondition when the ps tasks
  /// hold another model), and returns the lowest global step of the ps tasks.
  std::int64_t adopt(std::span<const VariableSpec> variables, std::span<const TableSpec> tables = {}) {
    client_.wait_ready(variables, tables);
    return client_.wait_for_step(0);
  }

  /// Ends training as failed, for `reason`: the ps tasks answer `kAborted` with it, so every
  /// task stops with an error naming it.
  void abort(const std::string& reason) { end({true, reason}); }

  /// The member ps tasks that do not answer within `timeout` (each asked alone), ascending.
  std::vector<std::uint32_t> unreachable(std::chrono::milliseconds timeout) {
    const auto answers = client_.ask_each(timeout);
    std::vector<std::uint32_t> gone;
    for (std::size_t k = 0; k < answers.size(); ++k) {
      if (!answers[k]) gone.push_back(client_.members()[k]);
    }
    return gone;
  }

  /// Takes the member ps tasks `gone` out of the job for good: the next `restore` places
  /// the model over the others, each part of theirs on the member that holds least
  /// (sharding/rebalance.hpp), at a membership one newer, and the workers follow when they
  /// get ready again. Throws kInvalidArgument for a ps that is not a member, or when none
  /// would be left (with copies, fewer than 2: Tcp::place_copies), with nothing changed.
  void leave(std::span<const std::uint32_t> gone) {
    const auto members = client_.members();
    for (const std::uint32_t ps : gone) {
      if (!std::binary_search(members.begin(), members.end(), ps)) {
        throw Error(ErrorCode::kInvalidArgument, "ps " + std::to_string(ps) + " is not a member of the job");
      }
    }
    std::vector<std::uint32_t> left;
    std::copy_if(members.begin(), members.end(), std::back_inserter(left),
                 [&](std::uint32_t ps) { return std::find(gone.begin(), gone.end(), ps) == gone.end(); });
    if (left.empty()) throw Error(ErrorCode::kInvalidArgument, "a job cannot go on without any ps task");
    client_.change_members(std::move(left), client_.membership() + 1);
  }

  /// Takes the ps task serving at `address` into the job, as task `num_ps()` (the next
  /// index), and returns that index. The new ps is reached first (and must hold no model
  /// yet). Then every ps is paused and read at one cut (dense parts, optimizer slots and
  /// counters, table rows, the sync policy's state: read_state, held), the model is
  /// registered over the members and the new task at a membership one newer (placed for
  /// that many ps tasks: the sharding policy's placement for the count, rebalanced over
  /// the members; rows by the IdSharding over them), and every ps is restored from the
  /// cut. No update is lost: training stands still from the cut to the end of the
  /// restore, and the workers follow when they get ready again. `sharding`: the ps tasks'
  /// IdSharding, as for `restore`.
  ///
  /// Throws, with the job as it was (every ps serving, nothing lost):
  ///   - kFailedPrecondition before the model is registered, for a transport that cannot
  ///     grow (a GrowingTransport can), for a new ps that
  ///     holds a model, or that refused the registration or its restore: then the members
  ///     before are restored from the same cut, at a membership newer still, and the new
  ///     ps is told to end (Shutdown, aborted, with the reason);
  ///   - kFailedPrecondition for an address it cannot reach (nothing changed).
  /// Throws kUnavailable when a ps was lost on the way: the ps tasks may then wait for a
  /// restore (roll them back, as ChiefLoop does); a join tried again takes the same index.
  template <IdSharding I = HashIds>
  std::uint32_t join(const std::string& address, const I& sharding = {}) {
    if constexpr (!GrowingTransport<T>) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "ps at " + address + " cannot join: this chief's transport cannot reach ps tasks beyond those "
                  "it was made with (not a GrowingTransport)");
    } else {
      if (!client_.has_placement()) {
        throw Error(ErrorCode::kFailedPrecondition, "a ps joins a job whose model is registered: initialize first");
      }
      T& transport = client_.transport();
      const std::vector<std::uint32_t> before(client_.members().begin(), client_.members().end());
      const auto task = static_cast<std::uint32_t>(join_index(address));
      if (task == transport.num_ps()) {
        try {
          transport.add_ps(address, true);
        } catch (const Error& e) {  // nothing changed: not a lost ps of the job
          throw Error(ErrorCode::kFailedPrecondition, "ps at " + address + " cannot join: " + e.message());
        }
      }
      unfinished_join_.emplace(task, address);  // until it joined, or was told to end
      const std::string who = "ps " + std::to_string(task) + " at " + address;
      const auto refuse = [&](const std::string& why) {  // the new ps ends, saying why
        unfinished_join_.reset();
        (void)ask_one(task, Shutdown{true, who + " could not join the job: " + why}, std::chrono::seconds(2));
        return Error(ErrorCode::kFailedPrecondition, who + " cannot join: " + why + "; the job goes on as it was");
      };
      {
        const Response answer = ask_one(task, GetStats{}, timeouts().request_timeout);
        const auto* stats = std::get_if<StatsReply>(&answer);
        if (const auto* error = std::get_if<ErrorReply>(&answer)) throw refuse("it answered: " + error->message);
        if (stats == nullptr) throw refuse("it answered GetStats with something else");
        if (stats->ready || !stats->members.empty()) throw refuse("it holds a model already (another job's?)");
      }
      std::vector<std::string> addresses;
      for (std::uint32_t ps = 0; ps <= task; ++ps) addresses.push_back(transport.address(ps));
      std::vector<std::uint32_t> members = before;
      members.push_back(task);
      std::optional<ModelState> cut;
      try {
        cut = read_state(client_, 0, {}, true);  // the ps tasks stay paused (resumed if it throws)
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kUnavailable) throw;  // a ps of the job lost: tried again after
        throw refuse(std::string("the cut failed: ") + e.message());
      }
      std::optional<Error> failed;
      try {
        failed = move_state(*cut, std::move(members), before, addresses, sharding);
      } catch (const Error& e) {
        (void)refuse(e.message());
        throw Error(ErrorCode::kUnavailable, who + " was registered: " + e.message());
      }
      if (failed) throw refuse(failed->message());
      unfinished_join_.reset();
      return task;
    }
  }

  /// The member ps tasks some of whose copies this chief's transport gave up (lost for
  /// good: their shards are served by one copy only), ascending; none without copies
  /// (a CopyingTransport's `given_up`).
  [[nodiscard]] std::vector<std::uint32_t> given_up() const {
    if constexpr (CopyingTransport<T>) {
      std::vector<std::uint32_t> members;
      for (const std::uint32_t ps : client_.transport().given_up()) {
        if (std::binary_search(client_.members().begin(), client_.members().end(), ps)) members.push_back(ps);
      }
      return members;
    } else {
      return {};
    }
  }

  /// Takes member ps `ps` back into a job whose ps tasks keep copies of each other's shards,
  /// after it was lost and a process was started in its place (beyond TensorFlow; a
  /// CopyingTransport). The new process is reached first (one attempt: false while none is
  /// there, the job going on as it was). Then every ps is paused and read at one cut, from the
  /// copies that served meanwhile (dense parts, slots and counters, table rows, the sync
  /// policy's state); the new process's copies serve again, the model is registered over
  /// the same members at a membership one newer, and every ps, both copies of every
  /// shard, is restored from the cut. No update is lost: training stands still from the
  /// cut to the end of the restore; the workers, the evaluator and every heartbeat follow
  /// when they learn the membership (their transports' `renew_copies`), before their first
  /// request of the new epoch. Every shard has two copies again, so the job survives the
  /// next lost ps without a rollback. `sharding`: the ps tasks' IdSharding.
  ///
  /// True once taken back. False (logged) when the cut fails (the ps tasks go on as they
  /// were), or when its registration or restore fails: its copies are given up again and
  /// the others go on as they were (resumed, or restored from the same cut at a membership
  /// and epoch newer still: move_state). Throws kUnavailable when a ps was lost on the way
  /// (roll them back).
  template <IdSharding I = HashIds>
  bool take_back(std::uint32_t ps, const I& sharding = {}) {
    if constexpr (!CopyingTransport<T>) {
      (void)ps;
      (void)sharding;
      return false;
    } else {
      T& transport = client_.transport();
      if (!transport.reach_again(ps, false, true)) return false;
      const std::string who = "ps " + std::to_string(ps);
      const std::vector<std::uint32_t> members(client_.members().begin(), client_.members().end());
      const std::optional<ModelState> cut = paused_cut(who + " cannot take its shards back yet");
      if (!cut) return false;
      transport.serve_again(ps);
      const std::optional<Error> failed = move_state(*cut, members, members, {}, sharding, [&](const Error& e) {
        transport.give_up(ps, std::string("taking it back failed: ") + e.message());
      });
      const std::vector<std::uint32_t> still = transport.given_up();
      if (!failed && !std::binary_search(still.begin(), still.end(), ps)) return true;
      // A copy it holds was given up again on the way (lost, or not ready in time): the
      // restore went to the other copies alone.
      log(LogLevel::kWarning, "chief: " + who + " could not take its shards back (" +
                                  (failed ? std::string(failed->message()) : "a copy it holds was given up on the way") +
                                  "): they stay served by one copy each");
      return false;
    }
  }

  /// Makes both copies of every shard alike again, in a job whose ps tasks keep copies of
  /// each other's shards (beyond TensorFlow; a CopyingTransport). Each copy judges the
  /// workers on its own clock, so the two may part where a worker was lost: a push it sent
  /// just before it died (or was cut off from one ps) can reach one copy only, which counts
  /// it in its step while the other completes the step without it. Every ps is paused and
  /// read at one cut, from the copies the tasks read (each shard's own, unless given up),
  /// the model is registered over the same members at a membership one newer, and both
  /// copies of every shard are restored from the cut, as `take_back` does; training stands
  /// still from the cut to the end of the restore, and nothing the tasks read changes.
  /// `sharding`: the ps tasks' IdSharding.
  ///
  /// True once done; false (logged) without copies, or when the cut or the restore failed
  /// (the ps tasks go on as they were, or restored from the same cut: move_state). Throws
  /// kUnavailable when a ps was lost on the way (roll them back).
  template <IdSharding I = HashIds>
  bool align_copies(const I& sharding = {}) {
    if constexpr (!CopyingTransport<T>) {
      (void)sharding;
      return false;
    } else {
      const std::vector<std::uint32_t> members(client_.members().begin(), client_.members().end());
      const std::optional<ModelState> cut =
          paused_cut("cannot make the copies of every shard alike");
      if (!cut) return false;
      if (const std::optional<Error> failed = move_state(*cut, members, members, {}, sharding)) {
        log(LogLevel::kWarning,
            std::string("chief: could not make the copies of every shard alike: ") +
                failed->message());
        return false;
      }
      return true;
    }
  }

  /// Takes member ps `ps` out of the job with its share moved to the other members (it
  /// asked to leave: the operator scaled the job down). Every ps is paused and read at one
  /// cut (as `join` reads it), the model is registered over the other members at a
  /// membership one newer (the part placement rebalanced over them, rows where the
  /// IdSharding puts them over them), and they are restored from the cut. Nothing trained
  /// is lost: training stands still from the cut to the end of the restore, and the
  /// workers follow when they get ready again. `ps` stays paused (what is sent to it waits
  /// there, never taken) until it ends; with copies (a CopyingTransport) the copy it held
  /// of another's shard moves to the member after it (copy_holder), and the copy of its
  /// own shard that the member after it held is let go. `sharding`: the ps tasks' IdSharding.
  ///
  /// Throws, with the job as it was: kInvalidArgument for a ps that is no member;
  /// kFailedPrecondition for the job's last ps, for tables whose IdSharding places rows
  /// over ps tasks 0 .. n-1 only and a ps that is not the last (nothing is cut), or when
  /// the others refuse the registration or the restore (with copies, also when fewer than
  /// 2 members would be left: the transport refuses to place the copies, after the cut):
  /// then every member, `ps` among them, is resumed or restored from the same cut at a
  /// membership newer still. Throws kUnavailable
  /// when a ps was lost on the way and that restore failed too (roll them back).
  template <IdSharding I = HashIds>
  void retire(std::uint32_t ps, const I& sharding = {}) {
    const std::vector<std::uint32_t> before(client_.members().begin(), client_.members().end());
    if (!std::binary_search(before.begin(), before.end(), ps)) {
      throw Error(ErrorCode::kInvalidArgument, "ps " + std::to_string(ps) + " is not a member of the job");
    }
    const std::string who = "ps " + std::to_string(ps);
    if (before.size() == 1) throw Error(ErrorCode::kFailedPrecondition, who + " is the job's last ps task: it cannot leave");
    std::vector<std::uint32_t> after;
    std::copy_if(before.begin(), before.end(), std::back_inserter(after), [ps](std::uint32_t m) { return m != ps; });
    if constexpr (!ElasticIdSharding<I>) {
      if (!client_.tables().empty() && !first_tasks(after)) {
        throw Error(ErrorCode::kFailedPrecondition,
                    who + " cannot leave: the tables' IdSharding places rows over ps tasks 0 .. n-1 only (an "
                          "ElasticIdSharding, HashIds or RangeIds, can place them over the others)");
      }
    }
    const ModelState cut = read_state(client_, 0, {}, true);  // the ps tasks stay paused (resumed if it throws)
    std::optional<Error> failed;
    try {
      failed = move_state(cut, std::move(after), before, {}, sharding);
    } catch (const Error& e) {
      throw Error(ErrorCode::kUnavailable, who + " could not leave: " + e.message());
    }
    if (failed) {
      throw Error(ErrorCode::kFailedPrecondition,
                  who + " cannot leave: " + failed->message() + "; the job goes on as it was");
    }
  }

  /// The job's workers are `workers` (task indices, ascending, not empty) from the next
  /// global step on: workers joined (a worker started beyond the cluster spec's asks the
  /// chief, runner/join_desk.hpp) or left for good. Every member ps is paused at once (no
  /// step completes meanwhile), the step after the furthest one a ps reached or took a push
  /// for is chosen (under BoundedStaleness a worker pushes up to s steps ahead), and each ps
  /// is told (ChangeWorkers) and resumed: each counts the new workers from that step on
  /// (SyncPolicy::reshape; under SyncReplicas every ps at the same step boundary), and lets
  /// a new worker connect at once. Nothing is read or moved: training stands still for a few
  /// round trips. Restores from then on (a rollback, a ps joining) carry the workers.
  /// Returns the step they count from.
  ///
  /// Throws, the ps tasks counting the workers as before: kInvalidArgument for an empty or
  /// unordered set; the refusal of a ps that cannot (kFailedPrecondition: its sync policy
  /// has no SyncPolicy::reshape), the others taking the change back. Throws kUnavailable
  /// when a ps was lost on the way, or one that took the change cannot be told to take it
  /// back: it may then count the new workers from that step alone, until the next change
  /// (the ChiefLoop tries again) or a restore (which carries the workers) sets them all.
  std::int64_t change_workers(std::vector<std::uint32_t> workers) {
    require_task_set(workers, "worker");
    const std::span<const std::uint32_t> members = client_.members();
    std::int64_t furthest = 0;
    try {
      const auto paused = client_.template broadcast<PauseReply>([](std::size_t) { return Pause{0}; },
                                                                 timeouts().request_timeout, "pause the ps tasks");
      for (const PauseReply& p : paused) furthest = std::max({furthest, p.global_step, p.furthest_pushed});
      const std::int64_t from = furthest + 1;
      const std::vector<std::uint32_t> before(client_.workers().begin(), client_.workers().end());
      // Each ps is asked alone: every answer is looked at. One that refused is told to take
      // the change back too: with no answer in time it may have taken it (the change is
      // given up as a lost ps's would be, and tried again), and with copies one copy may
      // have taken what the other refused. Taking back a change never taken changes nothing.
      std::vector<std::uint32_t> took;
      std::optional<Error> refused;
      for (const std::uint32_t ps : members) {
        const Response answer = ask_one(ps, ChangeWorkers{workers, from, before}, timeouts().request_timeout);
        took.push_back(ps);
        if (std::holds_alternative<Ack>(answer)) continue;
        const auto* error = std::get_if<ErrorReply>(&answer);
        const ErrorCode code = error != nullptr ? error->code : ErrorCode::kInternal;
        refused.emplace(code == ErrorCode::kDeadlineExceeded ? ErrorCode::kUnavailable : code,
                        "ps " + std::to_string(ps) + " cannot count the workers " + describe_members(workers) + ": " +
                            (error != nullptr ? error->message : std::string("it answered something else")));
        break;
      }
      if (refused) {  // those that took it take it back, before anyone trains on
        for (const std::uint32_t ps : took) {
          if (!std::holds_alternative<Ack>(ask_one(ps, ChangeWorkers{{}, from}, timeouts().request_timeout))) {
            throw Error(ErrorCode::kUnavailable, std::string(refused->message()) + "; and ps " + std::to_string(ps) +
                                                     ", which took the change, could not be told to take it back");
          }
        }
        throw *refused;
      }
      client_.template broadcast<Ack>([](std::size_t) { return Resume{}; }, timeouts().request_timeout,
                                      "resume the ps tasks");
      client_.set_workers(std::move(workers));
      return from;
    } catch (const Error&) {
      resume_all();  // a ps that is gone resumes when the chief's link closes
      throw;
    }
  }

  /// The workers some member ps holds lost now (their heartbeats stopped), ascending. Each
  /// ps is asked alone; one that does not answer within `timeout` (stopped, or gone: the
  /// chief learns that elsewhere) says nothing. With `all_answered`, whether every member
  /// answered.
  [[nodiscard]] std::vector<std::uint32_t> lost_workers(
      std::chrono::milliseconds timeout = std::chrono::seconds(2), bool* all_answered = nullptr) {
    std::vector<std::uint32_t> lost;
    bool all = true;
    for (const std::optional<StatsReply>& r : client_.ask_each(std::min(timeouts().request_timeout, timeout))) {
      if (r) {
        lost.insert(lost.end(), r->lost.begin(), r->lost.end());
      } else {
        all = false;
      }
    }
    if (all_answered != nullptr) *all_answered = all;
    std::sort(lost.begin(), lost.end());
    lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
    return lost;
  }

  /// Takes `workers` (ascending) as the job's, before this chief hears the ps tasks (the
  /// cluster spec's): restores carry them, and the ps tasks' own word replaces them
  /// (`ps_serving`). An empty list changes nothing.
  void set_workers(std::vector<std::uint32_t> workers) { client_.set_workers(std::move(workers)); }

  /// The job's workers, once they changed (change_workers, or as the ps tasks said when
  /// this chief took over); empty while they are the cluster spec's.
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return client_.workers(); }

  /// The task index a `join(address)` takes now: the next one (`num_ps()`), or the last
  /// one known when it has that address and is no member (a join tried again after a ps
  /// was lost on the way).
  [[nodiscard]] std::size_t join_index(const std::string& address) const {
    if (unfinished_join_ && unfinished_join_->second == address) return unfinished_join_->first;
    return client_.num_ps();
  }

  /// The ps tasks the job has known, members or not: the cluster spec's, and those that
  /// joined since (the next to join gets this index).
  [[nodiscard]] std::size_t num_ps() const { return client_.num_ps(); }
  /// Where each of them serves, by task index (`GrowingTransport::address`).
  [[nodiscard]] std::vector<std::string> ps_addresses() const {
    std::vector<std::string> addresses;
    for (std::size_t ps = 0; ps < client_.num_ps(); ++ps) addresses.push_back(client_.transport().address(ps));
    return addresses;
  }

  /// The job's ps tasks (ascending) and their version (Client::members).
  [[nodiscard]] std::span<const std::uint32_t> members() const noexcept { return client_.members(); }
  [[nodiscard]] std::uint64_t membership() const noexcept { return client_.membership(); }

  /// Where each variable lives, after `initialize`.
  [[nodiscard]] const Placement& placement() const noexcept { return client_.placement(); }
  /// The registered variables, after `initialize`.
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept {
    return client_.variables();
  }

 private:
  /// Every ps paused and read at one cut, and left paused (a take-back's or an alignment's
  /// move follows); resumed if the cut fails: nullopt then, logged as "chief: `what`, the
  /// cut failed: ...". Throws kUnavailable when a ps was lost (roll them back).
  std::optional<ModelState> paused_cut(const std::string& what) {
    try {
      return read_state(client_, 0, {}, true);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) throw;
      log(LogLevel::kWarning, "chief: " + what + ", the cut failed: " + e.message());
      return std::nullopt;
    }
  }

  /// Moves the state of the paused ps tasks, read at `cut`, to `members`: the model
  /// registered over them at a membership one newer (reaching `addresses` first), then
  /// every member restored from the cut (a join's, a leave's or a take-back's move). Returns
  /// nullopt once done, else why not, with nothing lost: a registration that failed leaves
  /// the ps tasks as they were (resumed); a restore that failed is followed by the members
  /// `before` taking the same cut back at a membership and epoch newer still (what the first
  /// restore began is refused as late). `undo(error)` runs first on either failure (a
  /// take-back gives the copies it served again up). Throws kUnavailable when that restore
  /// fails too (a ps lost: roll them back).
  template <IdSharding I, class Undo = void (*)(const Error&)>
  std::optional<Error> move_state(const ModelState& cut, std::vector<std::uint32_t> members,
                                  const std::vector<std::uint32_t>& before, const std::vector<std::string>& addresses,
                                  const I& sharding, Undo undo = [](const Error&) {}) {
    try {
      client_.change_members(std::move(members), client_.membership() + 1, addresses);
    } catch (const Error& e) {
      undo(e);
      resume_all();
      return e;
    }
    try {
      restore_state(client_, cut, seed_, sharding);
      return std::nullopt;
    } catch (const Error& e) {
      undo(e);
      try {
        client_.adopt_epoch(client_.epoch() + 1);
        client_.change_members(before, client_.membership() + 1, addresses);
        restore_state(client_, cut, seed_, sharding);
      } catch (const Error& again) {
        throw Error(ErrorCode::kUnavailable, "its restore failed (" + std::string(e.message()) +
                                                 "), and so did restoring the ps tasks before: " + again.message());
      }
      return e;
    }
  }

  [[nodiscard]] const ClientOptions& timeouts() const { return client_.options(); }

  /// `request` to ps task `ps` alone, its answer awaited until `timeout` passes (then the
  /// call is given up, and the answer is kDeadlineExceeded).
  Response ask_one(std::uint32_t ps, Request request, std::chrono::milliseconds timeout) {
    PendingCall call = client_.transport().call(ps, std::move(request), {});
    if (call.wait_until(std::chrono::steady_clock::now() + timeout)) return call.take();
    call.cancel();
    return ErrorReply{ErrorCode::kDeadlineExceeded, "no answer within " + std::to_string(timeout.count()) + " ms"};
  }

  /// Every variable filled by its initializer, from the job's seed.
  std::vector<std::vector<float>> initial_values(std::span<const VariableSpec> variables) const {
    std::vector<std::vector<float>> values;
    values.reserve(variables.size());
    for (const VariableSpec& spec : variables) {
      values.emplace_back(spec.size());
      pulley::initialize(spec, seed_, values.back());
    }
    return values;
  }

  /// Registers the model and sends each ps its parts' values (`hold`: see Initialize::hold).
  const Placement& send_initial(std::span<const VariableSpec> variables,
                                std::span<const std::vector<float>> values,
                                std::span<const TableSpec> tables, bool hold) {
    if (values.size() != variables.size()) {
      throw Error(ErrorCode::kInvalidArgument, "initialize needs one value vector per variable");
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      if (values[v].size() != variables[v].size()) {
        throw Error(ErrorCode::kInvalidArgument, "initial value of '" + variables[v].name +
                                                     "' has " + std::to_string(values[v].size()) +
                                                     " elements, expected " +
                                                     std::to_string(variables[v].size()));
      }
      if (!detail::all_finite(values[v])) {
        throw Error(ErrorCode::kInvalidArgument,
                    "initial value of '" + variables[v].name + "' is not finite (NaN or Inf)");
      }
    }
    client_.register_model(variables, tables, seed_);
    const Placement& placement = client_.placement();
    std::vector<Initialize> messages(client_.num_ps());
    for (Initialize& m : messages) m.hold = hold;
    for (const Part& part : placement.parts) {
      const std::size_t row_size = variables[part.variable].row_size();
      messages[part.ps].parts.push_back(
          {static_cast<std::uint32_t>(&part - placement.parts.data()),
           std::span<const float>(values[part.variable])
               .subspan(part.rows.begin * row_size, part.rows.size() * row_size)});
    }
    client_.template broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); },
                                    timeouts().request_timeout, "initialize");
    return placement;
  }

  /// Resumes every ps that answers (after a failed `initialize_and_save`).
  void resume_all() noexcept {
    try {
      client_.template broadcast<Ack>([](std::size_t) { return Resume{}; }, timeouts().request_timeout,
                                      "resume the ps tasks");
    } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
    }
  }

  /// Tells every member ps `message`, each answer awaited for `request_timeout` (else
  /// kDeadlineExceeded is thrown, as any refusal is). Shutdown (not an abort: that is told
  /// once) is sent again to a ps whose link broke on the way, every kEndRetry for
  /// kEndPatience: a ps that took it already answers that training finished. One that
  /// still refuses connections then is named in a warning, not thrown: it may have taken
  /// the message and stopped (a ps that ended takes connections for its end grace after
  /// its last client left: TcpServerOptions::end_grace), and one that did not fails on
  /// its own once it hears nothing from the chief.
  void end(const Shutdown& message) {
    using Clock = std::chrono::steady_clock;
    const auto answer_by = Clock::now() + timeouts().request_timeout;
    const auto retry_until = Clock::now() + std::min(timeouts().request_timeout, kEndPatience);
    // What a ps that ended already answers: finished, or (to an abort) either end.
    const auto ended = [&](ErrorCode code) {
      return code == ErrorCode::kOutOfRange || (message.aborted && code == ErrorCode::kAborted);
    };
    std::vector<std::uint32_t> left(client_.members().begin(), client_.members().end());
    std::vector<std::string> why;
    while (!left.empty()) {
      std::vector<PendingCall> calls;
      for (const std::uint32_t ps : left)
        calls.push_back(client_.transport().call(ps, Request{message}, {}));
      std::vector<std::uint32_t> again;
      why.clear();
      for (std::size_t k = 0; k < calls.size(); ++k) {
        const std::string ps = "ps " + std::to_string(left[k]);
        if (!calls[k].wait_until(answer_by)) {
          calls[k].cancel();
          throw Error(ErrorCode::kDeadlineExceeded,
                      "shutdown: " + ps + ": no answer within " +
                          std::to_string(timeouts().request_timeout.count()) + " ms");
        }
        const Response answer = calls[k].take();
        const auto* error = std::get_if<ErrorReply>(&answer);
        if (error == nullptr || ended(error->code)) continue;
        if (error->code != ErrorCode::kUnavailable)
          throw Error(error->code, "shutdown: " + ps + ": " + error->message);
        again.push_back(left[k]);
        why.push_back(ps + ": " + error->message);
      }
      left = std::move(again);
      if (left.empty() || message.aborted || Clock::now() + kEndRetry >= retry_until) break;
      std::this_thread::sleep_for(kEndRetry);
    }
    if (!left.empty()) {
      std::string reasons;
      for (const std::string& w : why) reasons += (reasons.empty() ? "" : "; ") + w;
      log(LogLevel::kWarning, "chief: the ps tasks " + describe_members(left) +
                                  " could not be told that training " +
                                  (message.aborted ? "was aborted" : "finished") + " (" + reasons +
                                  "): each ended with its answer lost, or is gone");
    }
    // A ps that left the job and lives on (cut off for a while, or started again) ends too.
    client_.tell_others(Request{message}, std::min(timeouts().request_timeout, std::chrono::milliseconds(2000)));
  }

  /// How long `end` sends Shutdown again to a ps whose link broke (a ps that ended takes
  /// connections for its end grace, 1 s by default, and a connection attempt may take
  /// TcpOptions::attempt_timeout), and how often.
  static constexpr std::chrono::milliseconds kEndPatience{std::chrono::seconds(4)};
  static constexpr std::chrono::milliseconds kEndRetry{100};

  std::uint64_t seed_;
  Client<T> client_;
  /// A join that added its ps task and was cut short by a lost ps: its index and address.
  std::optional<std::pair<std::uint32_t, std::string>> unfinished_join_;
};

}  // namespace pulley
