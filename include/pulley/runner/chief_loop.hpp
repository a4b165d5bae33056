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
#include "pulley/runner/join_desk.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/runner/schedule.hpp"
#include "pulley/runner/training.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/sharding/rebalance.hpp"

namespace pulley {
namespace runner_detail {

using Clock = std::chrono::steady_clock;

/// Copies a snapshot's values into `model`'s parameters.
template <Model M>
void load(M& model, const Snapshot& shot) {
  for (std::size_t v = 0; v < shot.values.size(); ++v) {
    const auto into = model.parameter(v);
    std::copy(shot.values[v].begin(), shot.values[v].end(), into.begin());
  }
}

/// Throws kInternal naming the first variable of `shot` with a value that is not finite: a
/// job whose parameters diverged ends with an error, never "successfully". (The ps tasks
/// refuse updates that would get there; this is the last line, for any that slipped by.)
inline void check_finite(const Snapshot& shot, const std::vector<VariableSpec>& variables) {
  for (std::size_t v = 0; v < shot.values.size(); ++v) {
    if (!detail::all_finite(shot.values[v])) {
      throw Error(ErrorCode::kInternal, "the parameters of '" + variables.at(v).name +
                                            "' are not finite at global step " +
                                            std::to_string(shot.step) + ": training diverged");
    }
  }
}

/// Throws kFailedPrecondition unless the checkpoint `state` (read from `path`) holds
/// `model`'s variables (by name and shape) and its embedding tables (by name and dim).
template <Model M>
void check_model(const ModelState& state, const M& model, const std::filesystem::path& path) {
  const std::span<const VariableSpec> variables = model.variables();
  bool same = state.variables.size() == variables.size();
  for (std::size_t v = 0; same && v < variables.size(); ++v) {
    same = state.variables[v].spec.name == variables[v].name && state.variables[v].spec.shape == variables[v].shape;
  }
  std::span<const TableSpec> tables;
  if constexpr (TableModel<M>) tables = model.tables();
  // A checkpoint without tables (of a dense job, or of format 1) restores the dense parts.
  if (!state.tables.empty()) {
    same = same && state.tables.size() == tables.size();
    for (std::size_t t = 0; same && t < tables.size(); ++t) {
      same = state.tables[t].spec.name == tables[t].name && state.tables[t].spec.dim == tables[t].dim;
    }
  }
  if (!same) {
    throw Error(ErrorCode::kFailedPrecondition,
                "checkpoint " + path.string() + " holds " + std::to_string(state.variables.size()) + " variables and " +
                    std::to_string(state.tables.size()) + " tables that are not the model's " +
                    std::to_string(variables.size()) + " and " + std::to_string(tables.size()) +
                    " (by name and shape): is it another model's checkpoint directory?");
  }
}

/// Saves the checkpoint `read()` cuts from the ps tasks to `directory`, logs it, and
/// returns what it saved.
template <class Read>
ModelState save_checkpoint(CheckpointDirectory& directory, Read&& read) {
  const auto began = Clock::now();
  ModelState state = read();
  const auto cut = Clock::now();
  const std::filesystem::path path = directory.save(state);
  const auto saved = Clock::now();
  std::uint64_t bytes = 0, rows = 0;
  for (const VariableState& v : state.variables) bytes += 4 * v.values.size() * (1 + v.slots.size());
  for (const TableState& t : state.tables) {
    bytes += 4 * t.rows.size() + 12 * t.ids.size() + 16 * t.candidate_ids.size();
    rows += t.ids.size();
  }
  auto ms = [](Clock::duration d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  log(LogLevel::kInfo, "chief: checkpoint at global step " + std::to_string(state.global_step) +
                           ": " + path.string() + " (" + std::to_string(bytes >> 20U) + " MiB" +
                           (state.tables.empty() ? std::string() : ", " + std::to_string(rows) + " rows") +
                           (state.incremental() ? ", incremental over global step " + std::to_string(state.base_step)
                                                : std::string()) +
                           "; read in " + ms(cut - began) + " ms, written in " +
                           ms(saved - cut) + " ms)");
  return state;
}

/// The member ps tasks that do not answer now, asked twice a second apart and given a few
/// seconds each time (a busy ps answers by then), leave the job for good (Chief::leave),
/// unless none would be left; logs the new shape once.
template <Transport T>
void leave_unreachable(Chief<T>& chief, const ClientOptions& options) {
  const auto patience = std::min(options.request_timeout, std::chrono::milliseconds(5000));
  const std::vector<std::uint32_t> first = chief.unreachable(patience);
  if (first.empty() || first.size() == chief.members().size()) return;
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::vector<std::uint32_t> gone;
  for (const std::uint32_t ps : chief.unreachable(patience)) {
    if (std::find(first.begin(), first.end(), ps) != first.end()) gone.push_back(ps);
  }
  if (gone.empty() || gone.size() == chief.members().size()) return;
  try {
    chief.leave(gone);
  } catch (const Error& e) {  // too few would be left to hold the copies of the shards
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    log(LogLevel::kWarning,
        std::string("chief: the ps tasks not back stay members of the job: ") + e.what());
    return;
  }
  const auto seconds = std::to_string(options.ps_leave_after.count() / 1000);
  std::string names;
  for (const std::uint32_t ps : gone) names += (names.empty() ? "ps " : ", ps ") + std::to_string(ps);
  log(LogLevel::kWarning, "chief: " + names + " not back within " + seconds + " s: " +
                              (gone.size() == 1 ? "it leaves" : "they leave") + " the job; membership " +
                              std::to_string(chief.membership()) + ": ps tasks " + describe_members(chief.members()) +
                              ", which take its shard from the checkpoint");
}

/// After losing a ps (`lost`): waits until every ps answers again (a restarted one, or a
/// new one on its address), then restores them all from the newest checkpoint in
/// `checkpoints` (or `initial`), at a new epoch; returns its global step. The updates
/// applied since that checkpoint are lost (each ps logs how many). With
/// `ClientOptions::ps_leave_after`, a ps still away after that long leaves the job for
/// good: the restore places the model over the others (Chief::leave), and nothing waits
/// for it again. Throws kUnavailable once `ClientOptions::recovery_timeout` passes without
/// every ps back.
template <Transport T, IdSharding I = HashIds>
std::int64_t roll_back(Chief<T>& chief, const Error& lost, const CheckpointDirectory* checkpoints,
                       const std::optional<ModelState>& initial, const ClientOptions& options,
                       const I& id_sharding = {}) {
  std::optional<std::pair<ModelState, std::filesystem::path>> latest;
  if (checkpoints != nullptr) latest = checkpoints->latest();
  if (!latest && !initial) throw lost;  // nothing to roll back to
  const ModelState& target = latest ? latest->first : *initial;
  const std::string from = latest ? latest->second.string() : std::string("the initial values");
  detail::Recovery recovery("chief", options);
  for (Error failure = lost;;) {
    recovery.wait(failure);
    if (options.ps_leave_after.count() > 0 && recovery.waited() >= options.ps_leave_after) {
      leave_unreachable(chief, options);
    }
    try {
      chief.restore(target, id_sharding);
      log(LogLevel::kWarning, "chief: every ps restored from " + from + " at global step " +
                                  std::to_string(target.global_step) + " after " +
                                  std::to_string(recovery.tries()) + " tries; training goes on");
      return target.global_step;
    } catch (const Error& e) {
      if (!detail::Recovery::may_recover(e.code())) throw;
      failure = e;
    }
  }
}

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
  /// After `failure` (kUnavailable): waits until every ps answers again, then true if each
  /// still holds the job (a connection broke; nothing was lost, and the schedule goes on
  /// where it was), false if one was restarted and is not initialized, or left the job
  /// (`ClientOptions::ps_leave_after`): every ps must be rolled back. Throws kUnavailable
  /// once the recovery timeout passes first, or when `failure` came after the ps tasks
  /// answered again `kMaxReconnects` times since the schedule last got anywhere (a link
  /// that breaks whenever the chief uses it ends the job; faults that each pass do not).
  bool whole_again(const Error& failure) {
    if (reconnects_ >= kMaxReconnects) {
      throw Error(ErrorCode::kUnavailable,
                  "chief: the ps tasks answered again " + std::to_string(reconnects_) +
                      " times since its last checkpoint or evaluation, and its work "
                      "failed after each; last: " +
                      failure.what());
    }
    // Each fault has its own deadline, counted from its first failure.
    detail::Recovery recovery("chief", training_.client);
    const ClientOptions& options = training_.client;
    for (Error last = failure;;) {
      recovery.wait(last);
      // (With copies a ps out of reach is ruled on, and leaves from its copies: take_back.)
      if (options.ps_leave_after.count() > 0 && training_.tcp.replicas == 0 &&
          recovery.waited() >= options.ps_leave_after) {
        const std::uint64_t before = chief_.membership();
        leave_unreachable(chief_, options);
        if (chief_.membership() != before) return false;  // the others take its shard: a rollback
      }
      try {
        (void)chief_.wait_for_step(0);  // a ready ps answers at once, a restarted one refuses
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kFailedPrecondition) return false;
        if (!detail::Recovery::may_recover(e.code())) throw;
        last = e;
        continue;
      }
      ++reconnects_;
      log(LogLevel::kInfo, "chief: every ps answers again and holds the job after " +
                               std::to_string(recovery.tries()) + " tries: training goes on");
      return true;
    }
  }

  /// Takes in every ps that asked to join (JoinQueue), one after the other (Chief::join),
  /// and out every ps that asked to leave (retire), then the workers that asked to join or
  /// leave and those held lost (change_workers), and logs each change once with the new
  /// shape. A ps that cannot be reached, or is not the next task, is left out with a log
  /// line, and the job goes on as it was; a failure once the ps tasks took the new
  /// membership is thrown (the caller rolls them back).
  void take_joins() {
    take_back();
    align_copies();
    if (joins_ == nullptr) return;
    joins_->set_ps({chief_.members().begin(), chief_.members().end()});
    std::vector<JoinQueue::Asked> workers;
    while (std::optional<JoinQueue::Asked> asked = joins_->take()) {
      if (asked->role == Node::Role::kWorker) {
        workers.push_back(std::move(*asked));
        continue;
      }
      if (asked->leaving) {
        retire(std::move(*asked));
        continue;
      }
      const std::string who = "ps " + std::to_string(asked->task) + " at " + asked->address;
      const std::size_t index = chief_.join_index(asked->address);
      if (asked->task != index) {
        log(LogLevel::kWarning, "chief: " + who + " cannot join: the next ps task is ps " + std::to_string(index));
        continue;
      }
      const std::uint64_t before = chief_.membership();
      const auto began = Clock::now();
      try {
        (void)chief_.join(asked->address, id_sharding_);
      } catch (const Error& e) {
        joins_->expect(chief_.ps_addresses());
        // A ps of the job lost on the way: it is rolled back, and the join tried after
        // (thrice at most), unless the new ps was registered and told to end already.
        if (e.code() == ErrorCode::kUnavailable) {
          if (chief_.membership() == before && ++asked->tries < 3) joins_->put_back(std::move(*asked));
          throw;
        }
        log(LogLevel::kWarning, std::string("chief: ") + e.what());
        continue;
      }
      joins_->expect(chief_.ps_addresses());
      joins_->set_ps({chief_.members().begin(), chief_.members().end()});
      log(LogLevel::kInfo, "chief: " + who + " joined the job; " + new_shape(began));
    }
    change_workers(workers);
  }

  /// A job whose ps tasks keep copies: takes back every member ps whose copies this
  /// chief's transport gave up and in whose place a process now serves (Chief::take_back),
  /// logged once with the new shape. Looked for kTakeBackEvery after the last look ended: a
  /// ps that is still gone costs one connection attempt (at most attempt_timeout) then.
  void take_back() {
    if (Clock::now() < next_take_back_) return;
    const std::vector<std::uint32_t> given_up = chief_.given_up();
    std::erase_if(given_up_since_, [&](const auto& seen) {
      return !std::binary_search(given_up.begin(), given_up.end(), seen.first);
    });
    for (const std::uint32_t ps : given_up) {
      const auto began = Clock::now();
      if (!chief_.take_back(ps, id_sharding_)) {
        leave_for_good(ps);
        continue;
      }
      given_up_since_.erase(ps);
      log(LogLevel::kInfo, "chief: ps " + std::to_string(ps) + " was started again and took its shards back (every "
                           "shard has two copies again); " + new_shape(began));
    }
    // Counted from the end: an attempt at a host that does not answer takes attempt_timeout.
    next_take_back_ = Clock::now() + kTakeBackEvery;
  }

  /// A job whose ps tasks keep copies, with `ClientOptions::ps_leave_after`: member `ps`,
  /// whose copies were given up (and not taken back: no process in its place, or its
  /// take-back failed), leaves the job for good once the chief has seen it so that long:
  /// its share moves from the copies that served it to the other members (Chief::retire),
  /// and its shard has two copies again, on the members left (as has every shard, unless
  /// another member is given up too). Nothing is lost or rolled back. A job of 2 ps tasks
  /// keeps both (one could hold no copy of its own shard): the one left serves both shards
  /// until a process takes the other's place.
  void leave_for_good(std::uint32_t ps) {
    const ClientOptions& options = training_.client;
    if (options.ps_leave_after.count() <= 0) return;
    const auto now = Clock::now();
    const auto seen = given_up_since_.try_emplace(ps, now).first;
    if (now - seen->second < options.ps_leave_after) return;
    const std::string who = "ps " + std::to_string(ps);
    if (chief_.members().size() <= 2) {
      if (told_stays_.insert(ps).second) {
        log(LogLevel::kWarning,
            "chief: " + who + " is still lost, and stays a member of the job: of 2 ps tasks " +
                "with copies, the other serves both shards until a process takes its place");
      }
      return;
    }
    const auto began = Clock::now();
    try {
      chief_.retire(ps, id_sharding_);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) throw;  // another ps lost on the way: rolled back
      log(LogLevel::kWarning, std::string("chief: ") + e.what());
      seen->second = Clock::now();  // tried again after the grace
      return;
    }
    given_up_since_.erase(ps);
    if (joins_ != nullptr) joins_->set_ps({chief_.members().begin(), chief_.members().end()});
    log(LogLevel::kWarning,
        "chief: " + who + " was lost for " + std::to_string(options.ps_leave_after.count() / 1000) +
            " s or more (--ps-leave-secs): it left the job, and its share moved from its copies "
            "to the other ps tasks (" +
            (chief_.given_up().empty() ? "every shard has two copies again, " : "") +
            "nothing rolled back); " + new_shape(began));
  }

  /// A job whose ps tasks keep copies: makes both copies of every shard alike again
  /// (Chief::align_copies), logged once, when the workers the ps tasks hold lost changed
  /// and stayed so for the worker timeout (by then every ps that stopped hearing a worker
  /// held it lost too, and went past the step it was at). Each copy judges the workers on
  /// its own clock, and a push a worker sent just before it was lost may have reached one
  /// copy of a shard only: that copy counted it, the other completed the step without it.
  /// Looked at every kLostLookEvery (a look that some ps did not answer in time, busy
  /// applying a large update, say, tells nothing); a move that failed is tried again
  /// kTakeBackEvery later.
  void align_copies() {
    if constexpr (CopyingTransport<T>) {
      if (training_.tcp.replicas == 0 || Clock::now() < next_lost_look_) return;
      bool all_answered = false;
      std::vector<std::uint32_t> lost = chief_.lost_workers(kLostLookEvery, &all_answered);
      const auto now = Clock::now();
      next_lost_look_ = now + kLostLookEvery;
      if (!all_answered) return;
      if (lost != lost_seen_) {
        lost_seen_ = std::move(lost);
        lost_changed_ = now;
        return;
      }
      if (!lost_changed_ || now - *lost_changed_ < training_.worker_timeout) return;
      if (!chief_.align_copies(id_sharding_)) {
        next_lost_look_ = Clock::now() + kTakeBackEvery;
        return;
      }
      lost_changed_.reset();
      log(LogLevel::kInfo,
          "chief: the workers held lost changed (now " + describe_members(lost_seen_) +
              "): both copies of every shard were made alike from the copy the tasks read (one "
              "may have counted a lost worker's last push that never reached the other); " +
              new_shape(now));
    }
  }

  /// Takes ps `asked.task`, which asked to leave, out of the job with its share moved to
  /// the others (Chief::retire), logged once; the desk then tells it it is out. A refusal
  /// is told to it (it ends as SIGTERM ends it), and the job goes on as it was; a ps lost
  /// on the way is thrown (it asks again).
  void retire(JoinQueue::Asked asked) {
    if (!std::binary_search(chief_.members().begin(), chief_.members().end(), asked.task)) {
      joins_->took_out(Node::ps(asked.task));  // out already
      return;
    }
    const std::string who = "ps " + std::to_string(asked.task);
    const auto began = Clock::now();
    try {
      chief_.retire(asked.task, id_sharding_);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) {
        if (++asked.tries < 3) joins_->put_back(std::move(asked));
        throw;
      }
      joins_->refuse(Node::ps(asked.task), e.message());
      log(LogLevel::kWarning, std::string("chief: ") + e.what());
      return;
    }
    joins_->set_ps({chief_.members().begin(), chief_.members().end()});
    joins_->took_out(Node::ps(asked.task));
    log(LogLevel::kInfo, "chief: " + who + " left the job at its request; " + new_shape(began));
  }

  /// The ps tasks' new shape after a change that began at `began` and restored them, for
  /// its log line: "membership 1: ps tasks {0, 1, 2}, holding 392.0 / 0.5 / 5.0 KiB of
  /// dense values; training stood still 7 ms while the state moved".
  std::string new_shape(Clock::time_point began) {
    const auto paused = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began);
    note_restored(chief_.wait_for_step(0));  // the next checkpoint is a full one
    std::vector<std::uint64_t> bytes = bytes_per_ps(chief_.placement(), chief_.variables());
    bytes.resize(chief_.num_ps(), 0);
    const std::uint64_t most = *std::max_element(bytes.begin(), bytes.end());
    const bool mib = most >= (std::uint64_t{1} << 20U);
    std::string held;
    for (const std::uint32_t ps : chief_.members()) {
      char text[32];
      std::snprintf(text, sizeof text, "%.1f", static_cast<double>(bytes[ps]) / (mib ? 1048576.0 : 1024.0));
      held += (held.empty() ? "" : " / ") + std::string(text);
    }
    return "membership " + std::to_string(chief_.membership()) + ": ps tasks " + describe_members(chief_.members()) +
           ", holding " + held + (mib ? " MiB" : " KiB") + " of dense values; training stood still " +
           std::to_string(paused.count()) + " ms while the state moved";
  }

  /// take_joins while the chief waits for the ps tasks to reach a step: a task that asks to
  /// join is taken within half a second (detail::kMeanwhileEvery), not at the next
  /// evaluation or checkpoint; so is a ps taken back (take_back). True when a ps joined or
  /// was taken back: the ps tasks were restored, and the wait (whose calls they answered as
  /// late) is done again.
  bool take_joins_meanwhile() {
    const std::uint64_t membership = chief_.membership();
    take_joins();
    voided_ = chief_.membership() != membership;
    return voided_;
  }

  /// Counts the workers in `asking` in (or out, those that asked to leave), and those
  /// held lost for `ClientOptions::worker_leave_after` out (one worker is always kept), in
  /// one change of the job's workers (Chief::change_workers), logged once. A change the ps
  /// tasks refuse is told to the workers that asked; a ps lost on the way is thrown (they
  /// ask again).
  void change_workers(const std::vector<JoinQueue::Asked>& asking) {
    const std::vector<std::uint32_t> before = joins_->workers();
    std::vector<std::uint32_t> after = before;
    std::string change;
    std::vector<JoinQueue::Asked> changing;  // those that asked and change the workers
    for (const JoinQueue::Asked& asked : asking) {
      const auto at = std::lower_bound(after.begin(), after.end(), asked.task);
      const bool in = at != after.end() && *at == asked.task;
      if (asked.leaving != in) {  // in already, or out already
        if (asked.leaving) joins_->took_out(Node::worker(asked.task));
        continue;
      }
      if (asked.leaving && after.size() == 1) {
        joins_->refuse(Node::worker(asked.task), "worker " + std::to_string(asked.task) +
                                                     " is the job's last worker: it cannot leave");
        continue;
      }
      if (asked.leaving) {
        after.erase(at);
      } else {
        after.insert(at, asked.task);
      }
      change += (change.empty() ? "worker " : ", worker ") + std::to_string(asked.task) +
                (asked.leaving ? " left at its request" : " joined");
      changing.push_back(asked);
    }
    if (const auto patience = training_.client.worker_leave_after; patience.count() > 0) {
      const auto now = Clock::now();
      std::vector<std::uint32_t> lost = chief_.lost_workers();
      std::erase_if(lost, [&](std::uint32_t w) {  // one that asked to join again, or to leave, is not lost
        return !std::binary_search(before.begin(), before.end(), w) ||
               std::any_of(changing.begin(), changing.end(), [w](const JoinQueue::Asked& a) { return a.task == w; });
      });
      std::erase_if(lost_since_, [&](const auto& entry) { return !std::binary_search(lost.begin(), lost.end(), entry.first); });
      for (const std::uint32_t w : lost) {
        const auto since = lost_since_.try_emplace(w, now).first->second;
        const auto at = std::lower_bound(after.begin(), after.end(), w);
        if (now - since < patience || at == after.end() || *at != w || after.size() == 1) continue;
        after.erase(at);
        lost_since_.erase(w);
        change += (change.empty() ? "worker " : ", worker ") + std::to_string(w) + " left (held lost for " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - since).count()) + " s)";
      }
    }
    if (after == before) return;
    const auto began = Clock::now();
    std::int64_t from = 0;
    try {
      from = chief_.change_workers(after);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) {
        for (const JoinQueue::Asked& asked : changing) joins_->put_back(asked);
        throw;
      }
      for (const JoinQueue::Asked& asked : changing) joins_->refuse(Node::worker(asked.task), e.message());
      log(LogLevel::kWarning, "chief: the job's workers stay " + describe_members(before) + " (" + change +
                                  " refused): " + e.message());
      return;
    }
    joins_->set_workers(after);
    for (const JoinQueue::Asked& asked : changing) {
      if (asked.leaving) joins_->took_out(Node::worker(asked.task));
    }
    const auto paused = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began);
    log(LogLevel::kInfo, "chief: " + change + "; the job's workers are " + describe_members(after) +
                             " from global step " + std::to_string(from) + " on; training stood still " +
                             std::to_string(paused.count()) + " ms");
  }

  /// Initializes every variable and reads global step 0's state (saved as checkpoint 0, as
  /// TensorFlow's saver does, or kept to roll back to), or restores the newest checkpoint;
  /// or, a chief started in place of a lost one while every ps still serves the job, goes
  /// on from their live state (nothing is rolled back). Returns the global step training
  /// starts from.
  std::int64_t begin() {
    const std::int64_t step = begin_tables();
    if (dense_ != nullptr) dense_->launch();
    return step;
  }

  /// What `begin` does for the ps tasks (and, in a hybrid job, `DensePart::begin`).
  std::int64_t begin_tables() {
    if (chief_.ps_serving() && dense_ != nullptr) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks still serve a hybrid job whose chief was lost: its dense variables were on the lost "
                  "chief's ring; start the whole job again, and it resumes from the newest checkpoint");
    }
    if (chief_.ps_serving()) {
      if constexpr (TableModel<M>) {
        start_step_ = chief_.adopt(model_.variables(), std::span<const TableSpec>(model_.tables()));
      } else {
        start_step_ = chief_.adopt(model_.variables());
      }
      note_restored(start_step_);  // the next checkpoint is a full one
      adopted_ = true;
      log(LogLevel::kInfo, "chief: every ps still serves the job, at global step " + std::to_string(start_step_) +
                               ": going on from their live state (the chief before this one was lost)");
      return start_step_;
    }
    if (auto latest = checkpoints_ ? checkpoints_->latest() : std::nullopt) {
      check_model(latest->first, model_, latest->second);
      if (dense_ != nullptr) {  // the tables go to the ps tasks, the variables to the replica
        ModelState tables = latest->first;
        tables.variables.clear();
        chief_.restore(tables, id_sharding_);
        dense_->begin(&latest->first);
      } else {
        chief_.restore(latest->first, id_sharding_);
      }
      start_step_ = latest->first.global_step;
      note_restored(start_step_);
      log(LogLevel::kInfo, "chief: resumed from " + latest->second.string() + " at global step " +
                               std::to_string(start_step_));
      return start_step_;
    }
    const auto initialize = [&] {
      if constexpr (TableModel<M>) {
        if (dense_ != nullptr) {
          dense_->begin(nullptr);
          ModelState state = chief_.initialize_and_save({}, std::span<const TableSpec>(model_.tables()));
          state.variables = dense_->variables();
          return state;
        }
        return chief_.initialize_and_save(model_.variables(), std::span<const TableSpec>(model_.tables()));
      } else {
        return chief_.initialize_and_save(model_.variables());
      }
    };
    if (checkpoints_) {
      note_saved(save_checkpoint(*checkpoints_, initialize));
    } else {
      initial_ = initialize();
    }
    return 0;
  }

  /// Waits for what is due next and does it: a checkpoint cut at its step (which is the
  /// evaluation's snapshot too), else the evaluation's snapshot; a checkpoint by time
  /// wherever training is when its deadline comes first.
  void step_to(ChiefSchedule& schedule) {
    if (dense_ != nullptr) return step_to_with_dense(schedule);
    const ChiefSchedule::Due due = schedule.next();
    std::optional<ModelState> saved;
    std::optional<Snapshot> shot;
    bool reached = true;
    voided_ = false;
    std::function<bool()> meanwhile;
    if (joins_ != nullptr || CopyingTransport<T>) meanwhile = [this] { return take_joins_meanwhile(); };
    if (due.checkpoint) {
      reached = chief_.wait_for_step_until(due.step, due.deadline, meanwhile).has_value();
      if (voided_) return;  // a ps joined: the ps tasks were restored, the wait is done again
      if (reached) saved = save_checkpoint(*checkpoints_, [&] { return chief_.save_state_at(due.step, cut_rows()); });
    } else {
      shot = chief_.snapshot_until(due.step, due.deadline, meanwhile);
      if (voided_) return;
      reached = shot.has_value();
    }
    if (!reached) saved = save_checkpoint(*checkpoints_, [&] { return chief_.save_state(cut_rows()); });  // by time
    if (saved) {
      note_saved(*saved);
      schedule.saved(saved->global_step, Clock::now());
    }
    if (!reached || !due.evaluation) return;
    if (!shot) {
      if (saved && saved->global_step == due.step) {  // the checkpoint is this step's values
        shot.emplace();
        shot->step = saved->global_step;
        shot->consistent = true;
        for (VariableState& v : saved->variables) shot->values.push_back(std::move(v.values));
      } else {
        shot = chief_.snapshot(due.step);
      }
    }
    evaluate(*shot, due.last, saved && saved->global_step == shot->step ? &*saved : nullptr);
    schedule.evaluated();
  }

  /// `step_to` in a hybrid job. Training is held at the step the chief's replica of the
  /// dense variables is at once the due step is reached (or, a checkpoint by time, at once):
  /// a checkpoint is that step's dense variables and the ps tasks' cut at the same step,
  /// read while training stands still and written once it goes on; an evaluation takes the
  /// dense values and lets training go on at once (its rows are read live, as in a ps job).
  /// So in a hybrid job a checkpoint or evaluation is of the due step, or of a step or so
  /// after it when the chief comes late.
  void step_to_with_dense(ChiefSchedule& schedule) {
    const ChiefSchedule::Due due = schedule.next();
    const bool reached = dense_step_until(due.step, due.deadline);
    const bool saving = !reached || due.checkpoint;
    const bool evaluating = reached && due.evaluation;
    if (!saving && !evaluating) return;
    const std::int64_t at = dense_->pause();
    std::vector<VariableState> dense;
    std::optional<ModelState> cut;
    try {  // only what must see training stand still: the replica's copy and the ps tasks' cut
      dense = dense_->variables();
      if (saving) {
        // The workers' pushes of that step (none comes after it), within a ring's timeout.
        if (!dense_step_until(at, Clock::now() + training_.client.request_timeout)) {
          throw Error(ErrorCode::kDeadlineExceeded, "the workers did not push global step " + std::to_string(at) +
                                                        " within " +
                                                        std::to_string(training_.client.request_timeout.count()) +
                                                        " ms of taking it (--request-timeout-ms): is one lost?");
        }
        cut = chief_.save_state_at(at, cut_rows());
      }
    } catch (...) {
      dense_->resume();
      throw;
    }
    dense_->resume();  // training goes on while the snapshot is taken and the checkpoint written
    Snapshot shot;
    shot.step = at;
    shot.consistent = true;  // the dense values are one step's
    if (evaluating) {
      for (VariableState& v : dense) shot.values.push_back(cut ? v.values : std::move(v.values));
    }
    std::optional<ModelState> saved;
    if (cut) {
      cut->variables = std::move(dense);
      saved = save_checkpoint(*checkpoints_, [&] { return std::move(*cut); });
      note_saved(*saved);
      schedule.saved(saved->global_step, Clock::now());
    }
    if (!evaluating) return;
    evaluate(shot, due.last, saved ? &*saved : nullptr);
    schedule.evaluated();
  }

  /// Waits until the ps tasks have taken global `step` or `deadline` passes, checking the
  /// ring meanwhile: a lost worker sends no step any more, and ends the wait with its error.
  bool dense_step_until(std::int64_t step, Clock::time_point deadline) {
    return chief_
        .wait_for_step_until(step, deadline,
                             [this] {
                               dense_->check();
                               return false;
                             })
        .has_value();
  }

  /// Which rows the next checkpoint's cut reads: those changed since the newest checkpoint
  /// (incremental), unless a full one is due (CheckpointOptions::full_every).
  [[nodiscard]] CutRows cut_rows() const {
    const std::int64_t every = std::max<std::int64_t>(training_.checkpoint.full_every, 1);
    if (base_ < 0 || incremental_in_a_row_ + 1 >= every) return CutRows{-1, base_};
    return CutRows{base_, base_};
  }
  /// `state` was saved: the next incremental checkpoint is over it (unless a checkpoint of
  /// its step was there already, which may hold something else: then the next is full).
  void note_saved(const ModelState& state) {
    if (!checkpoints_->wrote()) return note_restored(state.global_step);
    base_ = state.global_step;
    incremental_in_a_row_ = state.incremental() ? incremental_in_a_row_ + 1 : 0;
  }
  /// The ps tasks were restored at global step `step`: the next checkpoint is a full one.
  void note_restored(std::int64_t step) {
    base_ = step;
    incremental_in_a_row_ = std::numeric_limits<std::int64_t>::max() / 2;
  }

  /// Checks `shot` is finite and hands it to `training.evaluate` (or logs the progress);
  /// rows come from `saved`, the checkpoint of that step, if there is one and it is full.
  void evaluate(const Snapshot& shot, bool last, const ModelState* saved) {
    if (dense_ != nullptr) {
      const auto variables = std::span<const VariableSpec>(model_.variables());
      check_finite(shot, {variables.begin(), variables.end()});
    } else {
      check_finite(shot, chief_.variables());
    }
    Evaluation evaluation;
    evaluation.step = shot.step;
    evaluation.consistent = shot.consistent;
    evaluation.last = last;
    evaluation.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    evaluation.samples_per_s = static_cast<double>((shot.step - start_step_) * training_.samples_per_step) /
                               std::max(evaluation.seconds, 1e-9);
    if (evaluation.last) {
      evaluation.stats = chief_.stats();
      evaluation.workers.assign(chief_.workers().begin(), chief_.workers().end());
    }
    EvaluationScores scores(metrics_, "chief", shot.step);
    evaluation.report = scores.reporter();
    std::vector<CheckpointRows> saved_rows;
    if constexpr (TableModel<M>) {
      if (saved != nullptr && !saved->tables.empty() && !saved->incremental()) {
        saved_rows = checkpoint_rows(*saved);
        evaluation.rows = [&saved_rows](std::size_t t, std::span<const std::uint64_t> ids, std::span<float> out) {
          saved_rows.at(t).lookup(ids, out);
        };
      } else {
        evaluation.rows = [this](std::size_t t, std::span<const std::uint64_t> ids, std::span<float> out) {
          const std::vector<float> read = chief_.read_rows(model_.tables()[t].name, ids, id_sharding_);
          if (read.size() != out.size()) throw Error(ErrorCode::kInvalidArgument, "rows: `out` does not fit the rows");
          std::copy(read.begin(), read.end(), out.begin());
        };
      }
    }
    if (training_.evaluate) {
      load(model_, shot);
      training_.evaluate(model_, evaluation);
      scores.commit();
    } else {
      log(LogLevel::kInfo, "chief: global step " + std::to_string(shot.step) + " of " +
                               std::to_string(training_.last_step) + ", " +
                               std::to_string(static_cast<long long>(evaluation.samples_per_s)) + " samples/s");
    }
  }

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
