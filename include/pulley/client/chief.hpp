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
#include <variant>
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
  // The longer bodies are defined in client/impl/ (included at the end of this header), by
  // concern: initializing, taking over and ending the job in chief_state.hpp; the job's
  // shape (ps tasks and workers that leave, join or come back, and the copies) in
  // chief_membership.hpp.

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
                                 std::span<const TableSpec> tables = {});

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
  [[nodiscard]] bool ps_serving();

  /// Takes over a job that every ps serves (`ps_serving`), in place of a lost chief:
  /// learns where each variable lives and the epoch (kFailedPrecondition when the ps tasks
  /// hold another model), and returns the lowest global step of the ps tasks.
  std::int64_t adopt(std::span<const VariableSpec> variables,
                     std::span<const TableSpec> tables = {});

  /// Ends training as failed, for `reason`: the ps tasks answer `kAborted` with it, so every
  /// task stops with an error naming it.
  void abort(const std::string& reason) { end({true, reason}); }

  /// The member ps tasks that do not answer within `timeout` (each asked alone), ascending.
  std::vector<std::uint32_t> unreachable(std::chrono::milliseconds timeout);

  /// Takes the member ps tasks `gone` out of the job for good: the next `restore` places
  /// the model over the others, each part of theirs on the member that holds least
  /// (sharding/rebalance.hpp), at a membership one newer, and the workers follow when they
  /// get ready again. Throws kInvalidArgument for a ps that is not a member, or when none
  /// would be left (with copies, fewer than 2: Tcp::place_copies), with nothing changed.
  void leave(std::span<const std::uint32_t> gone);

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
  std::uint32_t join(const std::string& address, const I& sharding = {});

  /// The member ps tasks some of whose copies this chief's transport gave up (lost for
  /// good: their shards are served by one copy only), ascending; none without copies
  /// (a CopyingTransport's `given_up`).
  [[nodiscard]] std::vector<std::uint32_t> given_up() const;
  /// True when this chief's transport gave up every copy member ps `ps`'s process holds
  /// (a CopyingTransport's optional `given_up_whole`): no shard is read there as its last
  /// copy, so that process, if it lives on, may start again empty (Shutdown::restart) and
  /// be taken back. False without copies.
  [[nodiscard]] bool given_up_whole(std::uint32_t ps) const;

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
  bool take_back(std::uint32_t ps, const I& sharding = {});

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
  bool align_copies(const I& sharding = {});

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
  void retire(std::uint32_t ps, const I& sharding = {});

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
  std::int64_t change_workers(std::vector<std::uint32_t> workers);

  /// The workers some member ps holds lost now (their heartbeats stopped), ascending. Each
  /// ps is asked alone; one that does not answer within `timeout` (stopped, or gone: the
  /// chief learns that elsewhere) says nothing. With `all_answered`, whether every member
  /// answered.
  [[nodiscard]] std::vector<std::uint32_t> lost_workers(
      std::chrono::milliseconds timeout = std::chrono::seconds(2), bool* all_answered = nullptr);

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
  [[nodiscard]] std::size_t join_index(const std::string& address) const;

  /// The ps tasks the job has known, members or not: the cluster spec's, and those that
  /// joined since (the next to join gets this index).
  [[nodiscard]] std::size_t num_ps() const { return client_.num_ps(); }
  /// Where each of them serves, by task index (`GrowingTransport::address`).
  [[nodiscard]] std::vector<std::string> ps_addresses() const;

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
  std::optional<ModelState> paused_cut(const std::string& what);

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
  std::optional<Error> move_state(
      const ModelState& cut, std::vector<std::uint32_t> members,
      const std::vector<std::uint32_t>& before, const std::vector<std::string>& addresses,
      const I& sharding, Undo undo = [](const Error&) {});

  [[nodiscard]] const ClientOptions& timeouts() const { return client_.options(); }

  /// `request` to ps task `ps` alone, its answer awaited until `timeout` passes (then the
  /// call is given up, and the answer is kDeadlineExceeded).
  Response ask_one(std::uint32_t ps, Request request, std::chrono::milliseconds timeout);

  /// Every variable filled by its initializer, from the job's seed.
  std::vector<std::vector<float>> initial_values(std::span<const VariableSpec> variables) const;

  /// Registers the model and sends each ps its parts' values (`hold`: see Initialize::hold).
  const Placement& send_initial(std::span<const VariableSpec> variables,
                                std::span<const std::vector<float>> values,
                                std::span<const TableSpec> tables, bool hold);

  /// Resumes every ps that answers (after a failed `initialize_and_save`).
  void resume_all() noexcept;

  /// Tells every member ps `message`, each answer awaited for `request_timeout` (else
  /// kDeadlineExceeded is thrown, as any refusal is). Shutdown (not an abort: that is told
  /// once) is sent again to a ps whose link broke on the way, every kEndRetry for
  /// kEndPatience: a ps that took it already answers that training finished. One that
  /// still refuses connections then is named in a warning, not thrown: it may have taken
  /// the message and stopped (a ps that ended takes connections for its end grace after
  /// its last client left: TcpServerOptions::end_grace), and one that did not fails on
  /// its own once it hears nothing from the chief.
  void end(const Shutdown& message);

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

// Chief's member functions' definitions, by concern.
#include "pulley/client/impl/chief_membership.hpp"
#include "pulley/client/impl/chief_state.hpp"
