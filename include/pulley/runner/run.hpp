// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/detail/recovery.hpp"
#include "pulley/client/evaluator.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/runner/job.hpp"
#include "pulley/transport/in_process.hpp"
#include "pulley/transport/tcp.hpp"

namespace pulley {

/// What the chief (or the evaluator) knows at an evaluation.
struct Evaluation {
  Node::Role role = Node::Role::kChief;  ///< who evaluates: kChief or kEvaluator
  std::int64_t step = 0;               ///< the global step of the parameters (Snapshot::step)
  bool consistent = true;              ///< every ps was read at that step (Snapshot::consistent)
  bool last = false;                   ///< the evaluation at the last step
  double seconds = 0.0;                ///< since the chief initialized the variables (chief)
  double samples_per_s = 0.0;          ///< step × samples_per_step / seconds (chief)
  std::vector<Stats> stats;            ///< every ps's counters (the chief's last evaluation)
};

/// Which of a job's data a worker reads, and from where.
struct DataShard {
  std::uint32_t index = 0;     ///< this worker's share, out of `count`
  std::uint32_t count = 1;     ///< the shares the data is split into
  /// The global step the job is at when the worker starts: 0 for a new job, the restored
  /// step for a resumed one. A source that gives one batch per worker per global step
  /// (sync, R = N) skips that many batches, and a resumed job then reads what the
  /// uninterrupted one would have.
  std::int64_t start_step = 0;
  /// The workers the ps tasks hold lost now (their heartbeats stopped), ascending; empty
  /// when none is, or when nobody tracks it. See `share`.
  std::function<std::vector<std::uint32_t>()> lost;

  /// This worker's share among the workers not lost: {its rank among them, their count}.
  /// A source that splits each epoch's data by `share()` at the epoch's start hands a lost
  /// worker's data to the others from the next epoch on (and takes it back when it
  /// returns); with no worker lost it is {index, count}. While workers disagree on who is
  /// lost (a heartbeat apart), an epoch may read a few batches twice or not at all.
  [[nodiscard]] std::pair<std::uint32_t, std::uint32_t> share() const {
    const std::vector<std::uint32_t> gone = lost ? lost() : std::vector<std::uint32_t>{};
    if (std::binary_search(gone.begin(), gone.end(), index)) return {index, count};
    std::uint32_t rank = index, live = count;
    for (const std::uint32_t w : gone) {
      if (w >= count) continue;
      --live;
      if (w < index) --rank;
    }
    return {rank, live};
  }
};

/// Where and how often the chief writes checkpoints (TensorFlow's MonitoredTrainingSession
/// arguments, and its defaults).
struct CheckpointOptions {
  /// The checkpoint directory; "" writes none. A job started with one that holds a
  /// checkpoint resumes from the newest that reads back whole. An evaluator task given one
  /// follows it, as TensorFlow's evaluator does: it scores each checkpoint written there
  /// once, oldest first, reading it from disk (never from the ps tasks, so it never slows
  /// training), and ends after the one at `Training::last_step`; one that does not read back
  /// whole, or that `keep` removed before it was read, is skipped with a log line. Without
  /// one, an evaluator reads live snapshots from the ps at the chief's evaluation steps.
  std::string directory;
  /// Global steps between checkpoints (0: not by steps).
  std::int64_t save_steps = 0;
  /// Seconds between checkpoints (0: not by time).
  std::chrono::seconds save_secs{600};
  /// Checkpoints kept, newest first (0: all).
  std::size_t keep = 5;
};

/// A training job as the role runner needs it: everything but where its tasks run.
template <Model M>
struct Training {
  /// Makes a fresh model. Every task makes its own; their variables must be the same.
  std::function<M()> model;
  /// A worker's batches: a function that gives the next batch each time it is called (the
  /// batch may view storage the function owns until the next call), for its share of the
  /// data and the step it starts at (DataShard).
  std::function<std::function<typename M::Batch()>(const DataShard& shard)> data;
  /// Checkpoints: where, how often, how many kept; and resuming from them.
  CheckpointOptions checkpoint;
  /// Training ends when the global step reaches it.
  std::int64_t last_step = 0;
  /// Global steps between evaluations; 0 evaluates at the end only.
  std::int64_t evaluate_every = 0;
  /// Called by the chief (and an evaluator task) with `model` holding the parameters of one
  /// global step; optional (without it the chief logs its progress).
  std::function<void(M& model, const Evaluation& evaluation)> evaluate;
  /// Examples per global step, for samples/s (batch × batches aggregated into a step).
  std::int64_t samples_per_step = 0;
  /// The chief initializes the variables from it.
  std::uint64_t seed = 1;
  ClientOptions client;     ///< every client's deadlines
  /// How clients connect, in a cluster of processes (its credentials are the Job's).
  TcpOptions tcp;
  /// How a ps serves, in a cluster of processes (its credentials are the Job's).
  TcpServerOptions server;
  /// The ps tasks hold a worker lost when its heartbeats (every `client.heartbeat_interval`)
  /// stop for this long, and training goes on without it (SyncReplicas, BoundedStaleness).
  std::chrono::milliseconds worker_timeout{std::chrono::seconds(5)};
};

namespace runner_detail {

using Clock = std::chrono::steady_clock;

/// The global steps at which the chief and the evaluator evaluate: every `evaluate_every`,
/// and the last step.
inline std::vector<std::int64_t> evaluation_steps(std::int64_t every, std::int64_t last) {
  std::vector<std::int64_t> steps;
  if (every > 0) {
    for (std::int64_t s = every; s < last; s += every) steps.push_back(s);
  }
  steps.push_back(last);
  return steps;
}

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

/// A worker: steps until training is over, beating its heart on a transport of its own
/// (`connect()` makes each).
template <Model M, class Connect>
void work(const Training<M>& training, std::uint32_t index, std::uint32_t num_workers,
          Connect connect) {
  HeartbeatSender heartbeat(index, connect(), training.client.heartbeat_interval);
  Worker worker(index, training.model(), connect(), training.client);
  std::int64_t start_step = 0;
  try {
    worker.wait_ready();
    start_step = worker.stats().at(0).global_step;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfRange) throw;
    log(LogLevel::kInfo, "worker " + std::to_string(index) + ": training finished before it began");
    return;
  }
  auto next = training.data(
      DataShard{index, num_workers, start_step, [&heartbeat] { return heartbeat.lost(); }});
  std::int64_t steps = 0;
  while (worker.step(next(), training.last_step)) ++steps;
  log(LogLevel::kInfo, "worker " + std::to_string(index) + ": training finished after " +
                           std::to_string(steps) + " steps here (last global step seen: " +
                           std::to_string(worker.global_step()) + ")");
}

/// Saves a checkpoint of the job (cut the moment every ps completes `at_step`; 0: now),
/// logs it, and returns what it saved.
template <Transport T>
ModelState save_checkpoint(Chief<T>& chief, CheckpointDirectory& directory, std::int64_t at_step) {
  const auto began = Clock::now();
  ModelState state = chief.save_state_at(at_step);
  const auto cut = Clock::now();
  const std::filesystem::path path = directory.save(state);
  const auto saved = Clock::now();
  std::uint64_t floats = 0;
  for (const VariableState& v : state.variables) floats += v.values.size() * (1 + v.slots.size());
  auto ms = [](Clock::duration d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  log(LogLevel::kInfo, "chief: checkpoint at global step " + std::to_string(state.global_step) +
                           ": " + path.string() + " (" + std::to_string(floats * 4 >> 20U) +
                           " MiB; read in " + ms(cut - began) + " ms, written in " +
                           ms(saved - cut) + " ms)");
  return state;
}

/// After losing a ps (`lost`): waits until every ps answers again (a restarted one, or a
/// new one on its address), then restores them all from the newest checkpoint in
/// `checkpoints` (or `initial`), at a new epoch; returns its global step. The updates
/// applied since that checkpoint are lost (each ps logs how many). Throws kUnavailable once
/// `ClientOptions::recovery_timeout` passes without every ps back.
template <Transport T>
std::int64_t roll_back(Chief<T>& chief, const Error& lost, const CheckpointDirectory* checkpoints,
                       const std::optional<ModelState>& initial, const ClientOptions& options) {
  std::optional<std::pair<ModelState, std::filesystem::path>> latest;
  if (checkpoints != nullptr) latest = checkpoints->latest();
  if (!latest && !initial) throw lost;  // nothing to roll back to
  const ModelState& target = latest ? latest->first : *initial;
  const std::string from = latest ? latest->second.string() : std::string("the initial values");
  detail::Recovery recovery("chief", options);
  for (Error failure = lost;;) {
    recovery.wait(failure);
    try {
      chief.restore(target);
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

/// The chief: initializes (or resumes from the newest checkpoint), evaluates and saves
/// checkpoints along the way, and ends training (or aborts it, with the reason, when
/// anything fails). A checkpoint due at an evaluation's step is cut exactly there, and the
/// evaluation reads its values.
template <Model M, Transport T>
void lead(const Training<M>& training, T transport) {
  Chief chief(std::move(transport), training.seed, training.client);
  try {
    M model = training.model();
    std::optional<CheckpointDirectory> checkpoints;
    const CheckpointOptions& every = training.checkpoint;
    if (!every.directory.empty()) checkpoints.emplace(every.directory, every.keep);
    const bool by_steps = checkpoints && every.save_steps > 0;
    const bool by_time = checkpoints && every.save_secs.count() > 0;
    std::int64_t step = 0;
    // Where a lost ps rolls the job back to: the newest checkpoint, or (without a
    // checkpoint directory) the initial values, kept here.
    std::optional<ModelState> initial;
    if (auto latest = checkpoints ? checkpoints->latest() : std::nullopt) {
      chief.restore(latest->first);
      step = latest->first.global_step;
      log(LogLevel::kInfo, "chief: resumed from " + latest->second.string() + " at global step " +
                               std::to_string(step));
    } else {
      chief.initialize(model.variables());
      if (checkpoints) {
        save_checkpoint(chief, *checkpoints, 0);  // step 0, as TensorFlow's saver does
      } else {
        initial = chief.save_state();
      }
    }
    const auto start = Clock::now();
    const std::int64_t start_step = step;
    std::int64_t saved_step = step;
    auto last_save = start;
    const auto evaluations = evaluation_steps(training.evaluate_every, training.last_step);
    auto next = std::upper_bound(evaluations.begin(), evaluations.end(), step);
    if (step >= training.last_step) next = std::prev(evaluations.end());
    while (next != evaluations.end()) {
     try {
      const bool last = std::next(next) == evaluations.end();
      // What is due next: an evaluation, a checkpoint by steps (the last step has one),
      // or by time.
      std::int64_t checkpoint_step = std::numeric_limits<std::int64_t>::max();
      if (by_steps) checkpoint_step = (saved_step / every.save_steps + 1) * every.save_steps;
      if (checkpoints && last) checkpoint_step = std::min(checkpoint_step, *next);
      const std::int64_t target = std::min(*next, checkpoint_step);
      const auto deadline = by_time ? last_save + every.save_secs : Clock::time_point::max();
      // A checkpoint due at the target is cut there (and is the evaluation's snapshot too);
      // otherwise the evaluation's snapshot is what waits for the target.
      std::optional<ModelState> saved;
      std::optional<Snapshot> shot;
      bool reached = true;
      if (target == checkpoint_step) {
        reached = chief.wait_for_step_until(target, deadline).has_value();
        if (reached) saved = save_checkpoint(chief, *checkpoints, target);
      } else {
        shot = chief.snapshot_until(target, deadline);
        reached = shot.has_value();
      }
      if (!reached) saved = save_checkpoint(chief, *checkpoints, 0);  // by time, wherever it is
      if (saved) {
        saved_step = std::max(saved_step, saved->global_step);
        last_save = Clock::now();
      }
      if (!reached || target < *next) continue;
      if (!shot) {
        if (saved && saved->global_step == *next) {  // the checkpoint is this step's values
          shot.emplace();
          shot->step = saved->global_step;
          shot->consistent = true;
          for (VariableState& v : saved->variables) shot->values.push_back(std::move(v.values));
        } else {
          shot = chief.snapshot(*next);
        }
      }
      check_finite(*shot, chief.variables());
      Evaluation evaluation;
      evaluation.step = shot->step;
      evaluation.consistent = shot->consistent;
      evaluation.last = last;
      evaluation.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      evaluation.samples_per_s =
          static_cast<double>((shot->step - start_step) * training.samples_per_step) /
          std::max(evaluation.seconds, 1e-9);
      if (evaluation.last) evaluation.stats = chief.stats();
      if (training.evaluate) {
        load(model, *shot);
        training.evaluate(model, evaluation);
      } else {
        log(LogLevel::kInfo, "chief: global step " + std::to_string(shot->step) + " of " +
                                 std::to_string(training.last_step) + ", " +
                                 std::to_string(static_cast<long long>(evaluation.samples_per_s)) +
                                 " samples/s");
      }
      ++next;
     } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable) throw;
      // A ps was lost: once it (or a task in its place) is back, every ps is restored from
      // the newest checkpoint, as TensorFlow's chief does, and training goes on from there.
      step = roll_back(chief, e, checkpoints ? &*checkpoints : nullptr, initial, training.client);
      saved_step = step;
      last_save = Clock::now();
      next = std::upper_bound(evaluations.begin(), evaluations.end(), step);
      if (step >= training.last_step) next = std::prev(evaluations.end());
     }
    }
    chief.shutdown();
    log(LogLevel::kInfo, "chief: training finished at global step " +
                             std::to_string(training.last_step) + "; the ps tasks are shut down");
  } catch (const std::exception& e) {
    try {
      chief.abort(e.what());
    } catch (const std::exception&) {  // the ps tasks may be what failed
    }
    throw;
  }
}

/// How often an evaluator that follows a checkpoint directory looks for a new checkpoint:
/// listing a directory is cheap, and a checkpoint is scored at most this late.
inline constexpr std::chrono::milliseconds kCheckpointPoll{250};

/// Throws kFailedPrecondition unless `state` (read from `path`) holds the variables of
/// `variables`, by name and shape, in order: values of another model must not be copied in.
inline void check_variables(const ModelState& state, std::span<const VariableSpec> variables,
                            const std::filesystem::path& path) {
  bool same = state.variables.size() == variables.size();
  for (std::size_t v = 0; same && v < variables.size(); ++v) {
    same = state.variables[v].spec.name == variables[v].name &&
           state.variables[v].spec.shape == variables[v].shape;
  }
  if (!same) {
    throw Error(ErrorCode::kFailedPrecondition,
                "checkpoint " + path.string() + " holds " + std::to_string(state.variables.size()) +
                    " variables that are not the model's " + std::to_string(variables.size()) +
                    " (by name and shape): is it another model's checkpoint directory?");
  }
}

/// An evaluator task on `training.checkpoint.directory` (TensorFlow's evaluator): scores
/// every checkpoint that appears there newer than the last one it looked at, each once,
/// oldest first (a checkpoint removed by the chief's `keep` before it is read is skipped:
/// so a slow evaluator falls behind by `keep` checkpoints at most); one that does not read
/// back whole is skipped with a log line. Scoring loads the checkpoint's values into a model
/// and calls `training.evaluate` with its global step (consistent: a checkpoint is one cut).
/// It reads from disk only, never the ps tasks, so it never slows training, and can score
/// a finished job's directory. Ends once it has looked at the checkpoint of
/// `training.last_step` (the chief always writes one there); throws kDeadlineExceeded when
/// no new checkpoint appears for `ClientOptions::wait_timeout` before then (the chief
/// failed, or writes too seldom).
template <Model M>
void follow_checkpoints(const Training<M>& training) {
  const std::filesystem::path root = training.checkpoint.directory;
  M model = training.model();
  std::int64_t seen = -1;  // the newest step looked at (scored or skipped)
  auto last_new = Clock::now();
  ModelState state;  // each checkpoint is read into the last one's memory
  while (seen < training.last_step) {
    const auto found = CheckpointDirectory::list(root);  // newest first
    bool any = false;
    for (auto it = found.rbegin(); it != found.rend() && seen < training.last_step; ++it) {
      const auto& [step, path] = *it;
      if (step <= seen) continue;
      seen = step;
      any = true;
      try {
        checkpoint::read_checkpoint_into(path, state);
      } catch (const Error& e) {  // pruned since listed, or damaged: it will not heal
        log(LogLevel::kWarning, "evaluator: skipping checkpoint " + path.string() + ": " + e.what());
        continue;
      }
      check_variables(state, model.variables(), path);
      for (std::size_t v = 0; v < state.variables.size(); ++v) {
        const auto into = model.parameter(v);
        std::copy(state.variables[v].values.begin(), state.variables[v].values.end(), into.begin());
      }
      Evaluation evaluation;
      evaluation.role = Node::Role::kEvaluator;
      evaluation.step = state.global_step;
      evaluation.consistent = true;
      evaluation.last = state.global_step >= training.last_step;
      log(LogLevel::kInfo, "evaluator: scoring " + path.string() + " (global step " +
                               std::to_string(state.global_step) + ")");
      if (training.evaluate) training.evaluate(model, evaluation);
    }
    if (seen >= training.last_step) break;
    const auto now = Clock::now();
    if (any) {
      last_new = now;
    } else if (now - last_new >= training.client.wait_timeout) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "no new checkpoint in " + root.string() + " for " +
                      std::to_string(training.client.wait_timeout.count()) +
                      " ms (--wait-timeout-ms; the newest looked at: " +
                      (seen < 0 ? std::string("none") : "global step " + std::to_string(seen)) +
                      ", training ends at " + std::to_string(training.last_step) + ")");
    }
    std::this_thread::sleep_for(std::min(kCheckpointPoll, training.client.wait_timeout));
  }
  log(LogLevel::kInfo, "evaluator: scored the checkpoints up to global step " +
                           std::to_string(training.last_step));
}

/// An evaluator task. With a checkpoint directory (`training.checkpoint.directory`, the
/// chief's `--checkpoint-dir`) it follows the checkpoints there (follow_checkpoints), as
/// TensorFlow's evaluator does, and never connects to the ps tasks. Without one it reads
/// live snapshots (each one global step on every ps) at the chief's evaluation steps, over
/// a transport `connect()` makes, until training is over.
template <Model M, class Connect>
void follow(const Training<M>& training, Connect connect) {
  if (!training.checkpoint.directory.empty()) {
    follow_checkpoints(training);
    return;
  }
  Evaluator evaluator(connect(), training.client);
  M model = training.model();
  try {
    evaluator.wait_ready(model.variables());
    const auto steps = evaluation_steps(training.evaluate_every, training.last_step);
    for (const std::int64_t step : steps) {
      std::optional<detail::Recovery> recovery;  // a lost ps: wait until the job is back
      std::optional<Snapshot> read;
      while (!read) {
        try {
          if (recovery) evaluator.wait_ready(model.variables());  // at the new epoch
          read = evaluator.snapshot(step);
        } catch (const Error& e) {
          // A read refused kFailedPrecondition: the job was rolled back since it looked.
          if (!detail::Recovery::may_recover(e.code()) && e.code() != ErrorCode::kFailedPrecondition) throw;
          if (!recovery) recovery.emplace("evaluator", training.client);
          recovery->wait(e);
        }
      }
      const Snapshot& shot = *read;
      Evaluation evaluation;
      evaluation.role = Node::Role::kEvaluator;
      evaluation.step = shot.step;
      evaluation.consistent = shot.consistent;
      evaluation.last = step == steps.back();
      load(model, shot);
      if (training.evaluate) training.evaluate(model, evaluation);
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfRange) throw;  // the chief ended training first
  }
  log(LogLevel::kInfo, "evaluator: training finished");
}

/// `options` with `credentials` in place of its own.
template <class Options>
Options with(Options options, const Credentials& credentials) {
  options.credentials = credentials;
  return options;
}

/// A ps task of a cluster of processes, until the chief shuts it down.
template <Model M, Sharding S, Optimizer O, SyncPolicy P>
void serve(const Training<M>& training, const TfConfig& config, const Credentials& credentials,
           S sharding, O optimizer, P sync) {
  const auto& hosts = config.cluster.tasks("ps");
  const std::uint32_t task = config.task.index;
  const Address address = parse_address(hosts.at(task));
  // A loopback cluster stays on loopback; otherwise listen on every interface, as
  // TensorFlow's servers do (under Kubernetes a task's name may be a service address).
  const bool loopback =
      address.host == "localhost" || address.host.starts_with("127.") || address.host == "::1";
  const std::string bind =
      loopback ? address.host : (address.host.find(':') != std::string::npos ? "::" : "0.0.0.0");
  ParameterServer<S, O, P> ps(task, static_cast<std::uint32_t>(hosts.size()), std::move(optimizer),
                              std::move(sync), std::move(sharding));
  ps.set_worker_timeout(training.worker_timeout);
  TcpServer server(std::move(ps), bind, address.port, with(training.server, credentials));
  log(LogLevel::kInfo, "ps " + std::to_string(task) + " serving on " + address.to_string() +
                           " (listening on " + bind + ":" + std::to_string(server.port()) + ")");
  server.run();
  const std::optional<ErrorReply>& end = server.service().ended();
  if (!end && server.orphaned()) {
    throw Error(ErrorCode::kUnavailable,
                "every client has been gone for " +
                    std::to_string(training.server.orphaned_after.count() / 1000) +
                    " s and the chief never ended training (did it fail?)");
  }
  if (!end) throw Error(ErrorCode::kInternal, "ps " + std::to_string(task) + " stopped serving");
  if (end->code != ErrorCode::kOutOfRange) throw Error(end->code, end->message);
  log(LogLevel::kInfo, end->message);
}

/// Ends training as failed, for `reason`, as the chief would: every ps answers `kAborted`
/// from now on, so every task hears why. Best effort: a ps that is gone heard another way.
template <Transport T>
void abort_training(T& transport, const std::string& reason, std::chrono::milliseconds timeout) {
  try {
    CallGroup group;
    for (std::size_t ps = 0; ps < transport.num_ps(); ++ps) {
      group.add(transport.call(ps, Shutdown{true, reason}, {}));
    }
    group.wait(timeout, "abort training");
  } catch (const Error&) {
  }
}

/// The first failure of an in-process job, which ends it.
class Failure {
 public:
  /// Records `what` of `who` unless a failure came first; true if this one is the first.
  bool record(const std::string& who, const char* what) {
    std::scoped_lock lock(mutex_);
    if (!first_.empty()) return false;
    first_ = who + " failed: " + what;
    return true;
  }
  [[nodiscard]] std::string first() const {
    std::scoped_lock lock(mutex_);
    return first_;
  }

 private:
  mutable std::mutex mutex_;
  std::string first_;
};

/// Every task as a thread of this process, on the in-process transport. The first failure
/// aborts the job (every other task then stops) and is the one reported.
template <Model M, Sharding S, Optimizer O, SyncPolicy P>
void run_in_process(const Job& job, const Training<M>& training, S sharding, O optimizer,
                    P sync) {
  InProcessNetwork network(job.local_ps);
  for (std::uint32_t i = 0; i < job.local_ps; ++i) {
    ParameterServer<S, O, P> ps(i, job.local_ps, optimizer, sync, sharding);
    ps.set_worker_timeout(training.worker_timeout);
    network.serve(std::move(ps));
  }
  Failure failure;
  auto fail = [&](const std::string& who, const std::exception& e) {
    if (!failure.record(who, e.what())) return;  // a consequence of the first failure
    InProcess endpoint(network, Node::chief());
    abort_training(endpoint, failure.first(), training.client.request_timeout);
  };
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < job.local_workers; ++w) {
    workers.emplace_back([&, w] {
      try {
        work(training, w, job.local_workers, [&] { return InProcess(network, Node::worker(w)); });
      } catch (const std::exception& e) {
        fail("worker " + std::to_string(w), e);
      }
    });
  }
  try {
    lead(training, InProcess(network, Node::chief()));
  } catch (const std::exception& e) {
    fail("chief", e);
  }
  for (std::thread& t : workers) t.join();
  network.join();
  if (const std::string first = failure.first(); !first.empty()) {
    throw Error(ErrorCode::kAborted, first);
  }
}

/// This process's task of a cluster of processes.
template <Model M, Sharding S, Optimizer O, SyncPolicy P>
void run_task(const TfConfig& config, const Credentials& credentials, const Training<M>& training,
              S sharding, O optimizer, P sync) {
  const std::string& type = config.task.type;
  const std::vector<std::string>& ps = config.cluster.tasks("ps");
  const auto num_workers = static_cast<std::uint32_t>(config.cluster.tasks("worker").size());
  const TcpOptions tcp = with(training.tcp, credentials);
  auto transport = [&](Node self) { return Tcp(self, ps, tcp); };
  if (type == "ps") {
    serve(training, config, credentials, std::move(sharding), std::move(optimizer),
          std::move(sync));
  } else if (type == "chief") {
    lead(training, transport(Node::chief()));
  } else if (type == "evaluator") {
    follow(training, [&] { return transport(Node{Node::Role::kEvaluator, config.task.index}); });
  } else if (type == "worker" && config.task.index == 0 && !config.cluster.jobs.contains("chief")) {
    // No chief task: worker 0 is also the chief (TensorFlow's convention), on a thread.
    std::exception_ptr chief_failure;
    std::thread chief([&] {
      try {
        lead(training, transport(Node::chief()));
      } catch (...) {
        chief_failure = std::current_exception();
      }
    });
    try {
      work(training, 0, num_workers, [&] { return transport(Node::worker(0)); });
    } catch (const std::exception& e) {
      // The chief thread may be waiting for steps this worker will not push: end the job.
      try {
        Tcp aborting = transport(Node::chief());
        abort_training(aborting, std::string("worker 0 failed: ") + e.what(),
                       training.client.request_timeout);
      } catch (const std::exception&) {  // the ps tasks are unreachable: the chief hears that
      }
      chief.join();
      throw;
    }
    chief.join();
    if (chief_failure) std::rethrow_exception(chief_failure);
  } else {
    work(training, config.task.index, num_workers,
         [&] { return transport(Node::worker(config.task.index)); });
  }
}

}  // namespace runner_detail

/// Runs this process's part of `job`: a ps task (serving until the chief ends training), a
/// worker (stepping until training is over), the chief (initializing, evaluating every
/// `training.evaluate_every` steps, ending training at `training.last_step`) or an
/// evaluator; or, for an in-process job, all of them as threads. In a cluster without a
/// chief task, worker 0 is also the chief, as in TensorFlow.
///
/// Returns the process's exit status: 0 once training finished, 1 after logging one line
/// that names the failure (so a launcher such as Slurm's `srun -K` can stop the job). A
/// failed chief aborts training, and every task then fails naming the chief's reason; a
/// failed worker or ps fails its own task only (other workers go on, or stall and report
/// why at their deadline).
///
/// @tparam M the Model (made by `training.model`)
/// @tparam S, O, P the ps's Sharding, Optimizer and SyncPolicy, as in ParameterServer
template <Model M, Sharding S, Optimizer O, SyncPolicy P>
int run(const Job& job, const Training<M>& training, S sharding, O optimizer, P sync) {
  try {
    if (training.last_step <= 0) {
      throw Error(ErrorCode::kInvalidArgument, "Training::last_step must be positive");
    }
    if (!training.model || !training.data) {
      throw Error(ErrorCode::kInvalidArgument, "Training needs a model and a data source");
    }
    if (job.in_process()) {
      runner_detail::run_in_process(job, training, std::move(sharding), std::move(optimizer),
                                    std::move(sync));
    } else {
      runner_detail::run_task(*job.cluster, job.credentials, training, std::move(sharding),
                              std::move(optimizer), std::move(sync));
    }
    return 0;
  } catch (const std::exception& e) {
    log(LogLevel::kError, job.name() + " failed: " + e.what());
    return 1;
  }
}

}  // namespace pulley
