// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/rows.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/detail/recovery.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/log.hpp"
#include "pulley/runner/detail/chief_steps.hpp"
#include "pulley/runner/join_desk.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/runner/schedule.hpp"
#include "pulley/runner/training.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/sharding/rebalance.hpp"

namespace pulley {
namespace runner_detail {

/// The dense variables of a hybrid job (runner/hybrid.hpp), which no ps holds: the
/// chief's replica of them, a rank of the workers' ring that follows training. The ChiefLoop
/// starts it with the tables, and takes it into every checkpoint and evaluation.
class DensePart {
 public:
  virtual ~DensePart() = default;
  /// Sets the replica from `restored` (a checkpoint's variables and step), or from the
  /// job's seed when null. Before `launch`.
  virtual void begin(const ModelState* restored) = 0;
  /// Starts following training: the workers' replicas are copied from this one, and it
  /// takes every step with them.
  virtual void launch() = 0;
  /// Holds training after the step in progress (the workers wait for this replica at the
  /// next) and returns this replica's global step; throws kAborted if the ring failed.
  virtual std::int64_t pause() = 0;
  /// Lets training go on after `pause`.
  virtual void resume() = 0;
  /// The replica's variables, values, slots and counters; before `launch` or while paused.
  virtual std::vector<VariableState> variables() = 0;
  /// Throws kAborted if following training failed (the ring lost a worker): the chief
  /// calls it while it waits for the ps tasks, which no worker pushes to any more.
  virtual void check() = 0;
};

/// The chief's part of a job: initializes the variables (or resumes from the newest
/// checkpoint), then follows its ChiefSchedule: waits for each step due, cuts the
/// checkpoints due there (or by time, wherever training is), evaluates, and rolls every ps
/// back to the newest checkpoint when one is lost. The caller ends training.
template <Model M, Transport T, IdSharding I = HashIds>
class ChiefLoop {
 public:
  /// @param id_sharding where the ps tasks hold the tables' rows (their Tables policy's)
  /// @param metrics     where evaluations report their scores (Evaluation::report); may be null
  /// @param joins       the ps tasks that asked to join (the chief's JoinDesk), taken in at
  ///                    each evaluation or checkpoint; may be null (none can join)
  /// @param dense       a hybrid job's dense variables, which the ps tasks do not hold
  ///                    (they hold the model's tables only); null in a ps job
  ChiefLoop(const Training<M>& training, Chief<T>& chief, I id_sharding = {}, Metrics* metrics = nullptr,
            JoinQueue* joins = nullptr, DensePart* dense = nullptr)
      : training_(training), chief_(chief), id_sharding_(std::move(id_sharding)), model_(training.model()),
        metrics_(metrics), joins_(joins), dense_(dense) {
    if (dense_ != nullptr && joins_ != nullptr) {
      throw Error(ErrorCode::kInvalidArgument, "a hybrid job's ps tasks and workers are fixed: no task joins it");
    }
    const CheckpointOptions& every = training.checkpoint;
    if (!every.directory.empty()) checkpoints_.emplace(every.directory, every.keep);
  }

  /// Runs the job from its first (or resumed) step to its last evaluation.
  void run() {
    // The spec's workers until the ps tasks say otherwise: every restore carries them, so
    // a ps started again counts the same workers as the others.
    if (joins_ != nullptr) chief_.set_workers(joins_->workers());
    ChiefSchedule schedule({training_.last_step, training_.evaluate_every, checkpoints_.has_value(),
                            training_.checkpoint.save_steps, training_.checkpoint.save_secs},
                           begin(), Clock::now());
    if (adopted_) {
      std::int64_t newest = -1;  // the checkpoints due since the newest on disk are due now
      if (checkpoints_) {
        const auto written = CheckpointDirectory::list(checkpoints_->root());  // newest first
        if (!written.empty()) newest = written.front().first;
      }
      schedule.last_checkpoint(newest);
    }
    start_ = Clock::now();
    if (joins_ != nullptr) {
      joins_->expect(chief_.ps_addresses());
      if (!chief_.workers().empty()) joins_->set_workers({chief_.workers().begin(), chief_.workers().end()});
    }
    while (!schedule.done()) {
      try {
        take_joins();
        step_to(schedule);
        reconnects_ = 0;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kUnavailable) throw;
        if (whole_again(e)) continue;  // only a connection broke: no ps lost its state
        if (dense_ != nullptr) {
          throw Error(ErrorCode::kAborted, std::string("a ps was lost (") + e.what() +
                                               "), and a hybrid job cannot roll its dense variables back with the "
                                               "tables: start the job again, and it resumes from the newest checkpoint");
        }
        // A ps was lost: once it (or a task in its place) is back, every ps is restored from
        // the newest checkpoint, as TensorFlow's chief does, and training goes on from there.
        reconnects_ = 0;
        const std::int64_t step =
            roll_back(chief_, e, checkpoints_ ? &*checkpoints_ : nullptr, initial_, training_.client, id_sharding_);
        note_restored(step);
        schedule.restart(step, Clock::now());
      }
    }
  }

 private:
  // The job's shape: ps tasks and workers that join, leave, are lost or taken back, and
  // the copies made alike (impl/chief_loop_membership.hpp).

  /// After `failure` (kUnavailable): waits until every ps answers again, then true if each
  /// still holds the job (a connection broke; nothing was lost, and the schedule goes on
  /// where it was), false if one was restarted and is not initialized, or left the job
  /// (`ClientOptions::ps_leave_after`): every ps must be rolled back. Throws kUnavailable
  /// once the recovery timeout passes first, or when `failure` came after the ps tasks
  /// answered again `kMaxReconnects` times since the schedule last got anywhere (a link
  /// that breaks whenever the chief uses it ends the job; faults that each pass do not).
  bool whole_again(const Error& failure);

  /// Takes in every ps that asked to join (JoinQueue), one after the other (Chief::join),
  /// and out every ps that asked to leave (retire), then the workers that asked to join or
  /// leave and those held lost (change_workers), and logs each change once with the new
  /// shape. A ps that cannot be reached, or is not the next task, is left out with a log
  /// line, and the job goes on as it was; a failure once the ps tasks took the new
  /// membership is thrown (the caller rolls them back).
  void take_joins();

  /// A job whose ps tasks keep copies: takes back every member ps whose copies this
  /// chief's transport gave up and in whose place a process now serves (Chief::take_back),
  /// logged once with the new shape. Where none does and every copy there is given up, a
  /// process given up that lives on may start again (JoinQueue::may_restart). Looked for
  /// kTakeBackEvery after the last look ended: a ps that is still gone costs one connection attempt
  /// (at most attempt_timeout) then.
  void take_back();

  /// A job whose ps tasks keep copies, with `ClientOptions::ps_leave_after`: member `ps`,
  /// whose copies were given up (and not taken back: no process in its place, or its
  /// take-back failed), leaves the job for good once the chief has seen it so that long:
  /// its share moves from the copies that served it to the other members (Chief::retire),
  /// and its shard has two copies again, on the members left (as has every shard, unless
  /// another member is given up too). Nothing is lost or rolled back. A job of 2 ps tasks
  /// keeps both (one could hold no copy of its own shard): the one left serves both shards
  /// until a process takes the other's place.
  void leave_for_good(std::uint32_t ps);

  /// A job whose ps tasks keep copies: makes both copies of every shard alike again
  /// (Chief::align_copies), logged once, when the workers the ps tasks hold lost changed
  /// and stayed so for the worker timeout (by then every ps that stopped hearing a worker
  /// held it lost too, and went past the step it was at). Each copy judges the workers on
  /// its own clock, and a push a worker sent just before it was lost may have reached one
  /// copy of a shard only: that copy counted it, the other completed the step without it.
  /// Looked at every kLostLookEvery (a look that some ps did not answer in time, busy
  /// applying a large update, say, tells nothing); a move that failed is tried again
  /// kTakeBackEvery later.
  void align_copies();

  /// Takes ps `asked.task`, which asked to leave, out of the job with its share moved to
  /// the others (Chief::retire), logged once; the desk then tells it it is out. A refusal
  /// is told to it (it ends as SIGTERM ends it), and the job goes on as it was; a ps lost
  /// on the way is thrown (it asks again).
  void retire(JoinQueue::Asked asked);

  /// The ps tasks' new shape after a change that began at `began` and restored them, for
  /// its log line: "membership 1: ps tasks {0, 1, 2}, holding 392.0 / 0.5 / 5.0 KiB of
  /// dense values; training stood still 7 ms while the state moved".
  std::string new_shape(Clock::time_point began);

  /// take_joins while the chief waits for the ps tasks to reach a step: a task that asks to
  /// join is taken within half a second (detail::kMeanwhileEvery), not at the next
  /// evaluation or checkpoint; so is a ps taken back (take_back). True when a ps joined or
  /// was taken back: the ps tasks were restored, and the wait (whose calls they answered as
  /// late) is done again.
  bool take_joins_meanwhile();

  /// Counts the workers in `asking` in (or out, those that asked to leave), and those
  /// held lost for `ClientOptions::worker_leave_after` out (one worker is always kept), in
  /// one change of the job's workers (Chief::change_workers), logged once. A change the ps
  /// tasks refuse is told to the workers that asked; a ps lost on the way is thrown (they
  /// ask again).
  void change_workers(const std::vector<JoinQueue::Asked>& asking);

  // Training's schedule: the first step, the waits for each step due, checkpoints and
  // evaluations (impl/chief_loop_training.hpp).

  /// Initializes every variable and reads global step 0's state (saved as checkpoint 0, as
  /// TensorFlow's saver does, or kept to roll back to), or restores the newest checkpoint;
  /// or, a chief started in place of a lost one while every ps still serves the job, goes
  /// on from their live state (nothing is rolled back). Returns the global step training
  /// starts from.
  std::int64_t begin();

  /// What `begin` does for the ps tasks (and, in a hybrid job, `DensePart::begin`).
  std::int64_t begin_tables();

  /// Waits for what is due next and does it: a checkpoint cut at its step (which is the
  /// evaluation's snapshot too), else the evaluation's snapshot; a checkpoint by time
  /// wherever training is when its deadline comes first.
  void step_to(ChiefSchedule& schedule);

  /// `step_to` in a hybrid job. Training is held at the step the chief's replica of the
  /// dense variables is at once the due step is reached (or, a checkpoint by time, at once):
  /// a checkpoint is that step's dense variables and the ps tasks' cut at the same step,
  /// read while training stands still and written once it goes on; an evaluation takes the
  /// dense values and lets training go on at once (its rows are read live, as in a ps job).
  /// So in a hybrid job a checkpoint or evaluation is of the due step, or of a step or so
  /// after it when the chief comes late.
  void step_to_with_dense(ChiefSchedule& schedule);

  /// Waits until the ps tasks have taken global `step` or `deadline` passes, checking the
  /// ring meanwhile: a lost worker sends no step any more, and ends the wait with its error.
  bool dense_step_until(std::int64_t step, Clock::time_point deadline);

  /// Which rows the next checkpoint's cut reads: those changed since the newest checkpoint
  /// (incremental), unless a full one is due (CheckpointOptions::full_every).
  [[nodiscard]] CutRows cut_rows() const;
  /// `state` was saved: the next incremental checkpoint is over it (unless a checkpoint of
  /// its step was there already, which may hold something else: then the next is full).
  void note_saved(const ModelState& state);
  /// The ps tasks were restored at global step `step`: the next checkpoint is a full one.
  void note_restored(std::int64_t step);

  /// Checks `shot` is finite and hands it to `training.evaluate` (or logs the progress);
  /// rows come from `saved`, the checkpoint of that step, if there is one and it is full.
  void evaluate(const Snapshot& shot, bool last, const ModelState* saved);

  const Training<M>& training_;
  Chief<T>& chief_;
  [[no_unique_address]] I id_sharding_;
  M model_;
  Metrics* metrics_;
  JoinQueue* joins_;
  DensePart* dense_;  ///< a hybrid job's dense variables; null in a ps job
  std::optional<CheckpointDirectory> checkpoints_;
  /// Where a lost ps rolls the job back to without a checkpoint directory: the initial values.
  std::optional<ModelState> initial_;
  Clock::time_point start_;
  std::int64_t start_step_ = 0;
  bool adopted_ = false;  ///< it went on from the live state of a lost chief's job
  bool voided_ = false;   ///< a ps joined (or was taken back) while step_to waited: its wait is done again
  /// How often a ps whose copies were given up is looked for (take_back), and when next.
  static constexpr std::chrono::seconds kTakeBackEvery{2};
  Clock::time_point next_take_back_{};
  /// Member ps tasks whose copies were given up, since when the chief has seen them so
  /// (leave_for_good), and those told to stay (one of 2 ps tasks).
  std::map<std::uint32_t, Clock::time_point> given_up_since_;
  std::set<std::uint32_t> told_stays_;
  /// How often the workers the ps tasks hold lost are looked at (align_copies), and when
  /// next; those seen last, and when they changed (until the copies were made alike).
  static constexpr std::chrono::milliseconds kLostLookEvery{500};
  Clock::time_point next_lost_look_{};
  std::vector<std::uint32_t> lost_seen_;
  std::optional<Clock::time_point> lost_changed_;
  std::int64_t base_ = -1;  ///< the newest checkpoint saved or restored from (-1: none)
  std::int64_t incremental_in_a_row_ = 0;  ///< checkpoints since the last full one
  /// Times the ps tasks answered again since the schedule last got anywhere (whole_again).
  static constexpr int kMaxReconnects = 20;
  int reconnects_ = 0;
  /// Workers the ps tasks hold lost, and since when the chief has seen them so.
  std::map<std::uint32_t, Clock::time_point> lost_since_;
};

/// The chief task: runs the ChiefLoop, then ends training (or aborts it, with the reason,
/// when anything fails: every task then hears why). It beats its heart on a transport of
/// its own (`connect_beats()`, often `connect` again: one that need not log what the other
/// does), so that the ps tasks notice when it is lost; what the beats bring back feeds its
/// progress line and its figures in `metrics` (ChiefProgress).
/// `joins`: the ps tasks that ask to join (the chief's JoinDesk); may be null. `dense`: a
/// hybrid job's dense variables (ChiefLoop); null in a ps job.
template <Model M, class Connect, class ConnectBeats, IdSharding I = HashIds>
void lead(const Training<M>& training, Connect connect, ConnectBeats connect_beats,
          I id_sharding = {}, Metrics* metrics = nullptr, JoinQueue* joins = nullptr,
          DensePart* dense = nullptr) {
  using T = decltype(connect());
  HeartbeatSender heartbeat(0, connect_beats(), training.chief_heartbeat_interval(), "chief");
  Chief chief(connect(), training.seed, training.client);
  ChiefProgress progress([&heartbeat] { return heartbeat.heard(); }, metrics, training.metrics,
                         training.last_step, training.samples_per_step, training.steps_per_epoch);
  try {
    ChiefLoop<M, T, I>(training, chief, std::move(id_sharding), metrics, joins, dense).run();
    progress.reached(training.last_step);
    chief.shutdown();
    log(LogLevel::kInfo, "chief: training finished at global step " + std::to_string(training.last_step) +
                             "; the ps tasks are shut down");
  } catch (const std::exception& e) {
    try {
      chief.abort(e.what());
    } catch (const std::exception&) {  // the ps tasks may be what failed
    }
    throw;
  }
}

}  // namespace runner_detail

/// Sets `model`'s parameters to those of the checkpoint `state` (read from `path`, which
/// errors name) after checking that it holds the model's variables and tables (else
/// kFailedPrecondition): what an evaluator task scores. With `checkpoint_rows(state)` for
/// the rows, a program scores a checkpoint with no cluster (serving, offline evaluation):
/// `CheckpointDirectory::load` reads it whole, a full checkpoint and the incremental ones
/// after it.
template <Model M>
void load_parameters(const ModelState& state, M& model, const std::filesystem::path& path) {
  runner_detail::check_model(state, model, path);
  for (std::size_t v = 0; v < state.variables.size(); ++v) {
    const auto into = model.parameter(v);
    std::copy(state.variables[v].values.begin(), state.variables[v].values.end(), into.begin());
  }
}

}  // namespace pulley

// ChiefLoop's member functions' definitions, by concern.
#include "pulley/runner/impl/chief_loop_membership.hpp"
#include "pulley/runner/impl/chief_loop_training.hpp"
