// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/rows.hpp"
#include "pulley/client/detail/recovery.hpp"
#include "pulley/client/evaluator.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/cluster/cluster_spec.hpp"
#include "pulley/cluster/tf_config.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/log.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/ps/shard_copies.hpp"
#include "pulley/runner/chief_loop.hpp"
#include "pulley/runner/join_desk.hpp"
#include "pulley/runner/leave.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/runner/schedule.hpp"
#include "pulley/runner/training.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/tables/tables.hpp"
#include "pulley/transport/tcp.hpp"

/// The tasks of a job other than the chief (runner/chief_loop.hpp): a worker, an evaluator,
/// a ps of a cluster of processes. `pulley::run` (runner/run.hpp) picks this process's.

namespace pulley {
namespace runner_detail {

/// A worker that does not leave the job at SIGTERM (`work`'s `leave`: none). A named
/// object, not a temporary: GCC 12 warns of the temporary's destructor once inlined.
inline const std::optional<std::pair<std::string, TcpOptions>> kStaysToTheEnd{};

/// A worker: steps until training is over (`connect()` makes its transport), beating its
/// heart on a transport of its own (`connect_beats()`, often `connect` again: one that need
/// not wait for every ps when a worker started again while a ps process is gone must be
/// heard by the others before the chief rules on that process); its rows go where
/// `id_sharding` (the ps tasks') puts them. Each step is recorded in `metrics` (if any) as
/// "worker:<index>": the global step, steps, the loss and the staleness (means over the
/// interval), stale gradients. With `leave` (the chief's address), a SIGTERM asks the chief
/// to take it out of the job (LeaveWatch), and it ends once the ps tasks count it no more.
/// A worker that fails stops beating without the goodbye (HeartbeatSender::abandon): the
/// ps tasks hold it lost once its silence lasts, and their sync policy stops waiting for it.
template <Model M, class Connect, class ConnectBeats, IdSharding I = HashIds>
void work(const Training<M>& training, std::uint32_t index, std::uint32_t num_workers,
          Connect connect, ConnectBeats connect_beats, I id_sharding = {},
          Metrics* metrics = nullptr,
          const std::optional<std::pair<std::string, TcpOptions>>& leave = kStaysToTheEnd) {
  HeartbeatSender heartbeat(index, connect_beats(), training.client.heartbeat_interval);
  // Failed (an exception leaves): held lost by the ps tasks, not forgotten as one that ended.
  using Sender = decltype(heartbeat);
  struct AbandonOnFailure {
    Sender& sender;
    int unwinding = std::uncaught_exceptions();
    ~AbandonOnFailure() {
      if (std::uncaught_exceptions() > unwinding) sender.abandon();
    }
  } abandon_on_failure{heartbeat};
  Worker worker(index, training.model(), connect(), training.client, std::move(id_sharding));
  std::int64_t start_step = 0;
  try {
    worker.wait_ready();
    start_step = worker.stats().at(0).global_step;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfRange) throw;
    log(LogLevel::kInfo, "worker " + std::to_string(index) + ": training finished before it began");
    return;
  }
  std::int64_t number = -1;  // the batch the source reads (DataShard::batch), during its call
  auto next = training.data(DataShard{index, num_workers, start_step, [&heartbeat] { return heartbeat.lost(); },
                                      [&heartbeat] { return heartbeat.workers(); }, [&number] { return number; }});
  const auto read = [&](std::int64_t batch) {
    number = batch;
    auto read_batch = next();
    number = -1;
    return read_batch;
  };
  std::int64_t steps = 0;
  const std::string task = Node::worker(index).name();
  std::optional<LeaveWatch> leaving;
  if (leave) leaving.emplace(Node::worker(index), leave->first, leave->second, training.client.recovery_timeout, [] {});
  try {
    do {  // after the last step, the chief ends training: until it does, the job may go back
      while (const std::optional<StepResult> step = worker.step(read, training.last_step)) {
        ++steps;
        if (metrics == nullptr) continue;
        metrics->set(task, "global_step", static_cast<double>(step->global_step));
        metrics->add(task, "steps", 1, MetricKind::kRate);
        metrics->observe(task, "loss", step->loss);
        metrics->observe(task, "staleness", static_cast<double>(step->staleness));
        metrics->add(task, "stale_gradients", step->stale_parts);
      }
    } while (!worker.wait_for_end());
  } catch (const Error& e) {
    // Taken out of the job at its request, the ps tasks refuse it from then on: once the
    // chief says it took it out (its watch asks every 200 ms), it has left.
    if (!leaving || !sigterm_received() || e.code() != ErrorCode::kPermissionDenied) throw;
    for (int i = 0; i < 50 && !leaving->out(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!leaving->out()) throw;
    log(LogLevel::kInfo, "worker " + std::to_string(index) + ": left the job at its request after " +
                             std::to_string(steps) + " steps here (last global step seen: " +
                             std::to_string(worker.global_step()) + ")");
    return;
  }
  log(LogLevel::kInfo, "worker " + std::to_string(index) + ": training finished after " +
                           std::to_string(steps) + " steps here (last global step seen: " +
                           std::to_string(worker.global_step()) + ")");
}

/// How often an evaluator that follows a checkpoint directory looks for a new checkpoint:
/// listing a directory is cheap, and a checkpoint is scored at most this late.
inline constexpr std::chrono::milliseconds kCheckpointPoll{250};

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
void follow_checkpoints(const Training<M>& training, Metrics* metrics = nullptr) {
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
        CheckpointDirectory::load_into(path, state);  // an incremental one over what it holds
      } catch (const Error& e) {  // pruned since listed, or damaged: it will not heal
        log(LogLevel::kWarning, "evaluator: skipping checkpoint " + path.string() + ": " + e.what());
        continue;
      }
      load_parameters(state, model, path);
      Evaluation evaluation;
      evaluation.role = Node::Role::kEvaluator;
      evaluation.step = state.global_step;
      evaluation.consistent = true;
      evaluation.last = state.global_step >= training.last_step;
      EvaluationScores scores(metrics, "evaluator", state.global_step);
      evaluation.report = scores.reporter();
      const std::vector<CheckpointRows> tables = checkpoint_rows(state);
      if (!tables.empty()) {
        evaluation.rows = [&tables](std::size_t t, std::span<const std::uint64_t> ids, std::span<float> out) {
          tables.at(t).lookup(ids, out);
        };
      }
      log(LogLevel::kInfo, "evaluator: scoring " + path.string() + " (global step " +
                               std::to_string(state.global_step) + ")");
      if (training.evaluate) training.evaluate(model, evaluation);
      scores.commit();
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
/// a transport `connect()` makes, until training is over; a table model's rows are then
/// read from the ps tasks (where `id_sharding` puts them) as they are when read.
template <Model M, class Connect, IdSharding I = HashIds>
void follow(const Training<M>& training, Connect connect, I id_sharding = {}, Metrics* metrics = nullptr) {
  if (!training.checkpoint.directory.empty()) {
    follow_checkpoints(training, metrics);
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
      EvaluationScores scores(metrics, "evaluator", shot.step);
      evaluation.report = scores.reporter();
      if constexpr (TableModel<M>) {
        evaluation.rows = [&](std::size_t t, std::span<const std::uint64_t> ids, std::span<float> out) {
          const std::vector<float> rows = evaluator.read_rows(model.tables()[t].name, ids, id_sharding);
          if (rows.size() != out.size()) throw Error(ErrorCode::kInvalidArgument, "rows: `out` does not fit the rows");
          std::copy(rows.begin(), rows.end(), out.begin());
        };
      }
      load(model, shot);
      if (training.evaluate) training.evaluate(model, evaluation);
      scores.commit();
    }
    // It ends successfully only once the chief ended training. (A job rolled back after its
    // last evaluation is not scored again: the chief evaluates its last step.)
    for (std::optional<detail::Recovery> recovery;;) {
      try {
        if (recovery) evaluator.wait_ready(model.variables());  // at the epoch of a rollback
        evaluator.wait_for_end();
        break;
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kOutOfRange) throw;
        if (!detail::Recovery::may_recover(e.code()) && e.code() != ErrorCode::kFailedPrecondition) throw;
        if (!recovery) recovery.emplace("evaluator", training.client);
        recovery->wait(e);
      }
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfRange) throw;  // the chief ended training
  }
  log(LogLevel::kInfo, "evaluator: training finished");
}

/// `options` with `credentials` in place of its own.
template <class Options>
Options with(Options options, const Credentials& credentials) {
  options.credentials = credentials;
  return options;
}

/// The tasks a ps of `cluster` lets in (TcpServerOptions::tasks): its workers, one chief
/// (a chief task, or worker 0 acting as one), its evaluators (one when the spec names none:
/// TensorFlow's evaluator is not in the cluster spec). ps tasks do not call each other.
inline std::map<Node::Role, std::uint32_t> job_tasks(const ClusterSpec& cluster) {
  const auto count = [&](std::string_view role) { return static_cast<std::uint32_t>(cluster.tasks(role).size()); };
  return {{Node::Role::kWorker, count("worker")},
          {Node::Role::kChief, 1},
          {Node::Role::kEvaluator, std::max<std::uint32_t>(1, count("evaluator"))}};
}

/// Where a task of address `address` listens: a loopback cluster stays on loopback;
/// otherwise every interface, as TensorFlow's servers do (under Kubernetes a task's name
/// may be a service address).
inline std::string listen_host(const Address& address) {
  const bool loopback =
      address.host == "localhost" || address.host.starts_with("127.") || address.host == "::1";
  return loopback ? address.host : (address.host.find(':') != std::string::npos ? "::" : "0.0.0.0");
}

/// The address of the task that leads `cluster`: its chief task, or worker 0 without one.
inline std::string chief_address(const ClusterSpec& cluster) {
  const auto& chief = cluster.tasks("chief");
  return chief.empty() ? cluster.tasks("worker").at(0) : chief.front();
}

/// Runs `body` (a worker's or an evaluator's part); when it fails since the ps tasks stayed
/// out of reach (kUnavailable) and the chief's address `chief` takes no connection either,
/// the error says so. Without a chief the ps tasks serve no task (with copies), or end once
/// it stays lost: what the task waited for comes back only with a chief. (The look is one
/// connection attempt: a task cut off from every other host hears nothing from the chief's
/// either, and says so.)
template <class Body>
void naming_a_lost_chief(const std::string& chief, const TcpOptions& tcp, Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnavailable || listens_at(chief, tcp.attempt_timeout)) throw;
    throw Error(e.code(), std::string(e.message()) + "; the chief's address " + chief +
                              " takes no connection either: the chief has ended or is lost");
  }
}

/// Asks the chief at `chief` to take ps `task`, serving at `address`, into the running job
/// (Join); tries again while the chief cannot be reached, for `patience`, or until `stop`
/// is set. Throws the chief's refusal, or kUnavailable.
inline void ask_to_join(const std::string& chief, std::uint32_t task, const std::string& address,
                        const TcpOptions& tcp, std::chrono::milliseconds patience, const std::atomic<bool>& stop) {
  if (!ask_desk<Ack>(Node::ps(task), chief, tcp, Join{address}, "to join the job", patience,
                     [&](const Error&) { return !stop; })) {
    return;
  }
  log(LogLevel::kInfo, "ps " + std::to_string(task) + " asked the chief at " + chief +
                           " to join the job: the chief takes it in as soon as it is free");
}

/// Asks the chief at `chief` to count worker `task` in (Join), and waits until it has: the
/// chief does as soon as it is free (ChiefLoop). Returns the job's schedule as the chief
/// runs it. Tries again while the chief cannot be reached, for `patience`. Throws the
/// chief's refusal, or kUnavailable (kDeadlineExceeded when the chief never counted it in
/// within `patience`).
inline JoinReply ask_to_work(const std::string& chief, std::uint32_t task, const TcpOptions& tcp,
                             std::chrono::milliseconds patience) {
  bool queued = false;
  JoinReply reply = *ask_desk<JoinReply>(Node::worker(task), chief, tcp, Join{}, "to join the job", patience,
                                         [&](const Error& e) {
                                           if (!std::exchange(queued, true)) {
                                             log(LogLevel::kInfo, e.message());  // "worker 2 waits for the chief..."
                                           }
                                           return true;
                                         });
  log(LogLevel::kInfo, "worker " + std::to_string(task) + ": the chief at " + chief +
                           " counted it in: it trains with the job's workers " + describe_members(reply.workers) +
                           " until global step " + std::to_string(reply.last_step));
  return reply;
}

/// Runs `body(queue)` while the chief's JoinDesk serves on `address` (a thread of its
/// own), where new ps tasks and workers ask to join the job, and tasks of a job with
/// copies whether a ps is lost (`rulings`, else null); `queue` is null when the desk
/// cannot listen there (logged: no task can join this job then, nor hear the chief's
/// rulings). `num_workers`: the cluster spec's workers; `last_step`: where the chief ends
/// training.
template <class Body>
void with_join_desk(const std::string& address, TcpServerOptions options, std::uint32_t num_workers,
                    std::int64_t last_step, std::shared_ptr<CopyRulings> rulings, Body&& body) {
  auto queue = std::make_shared<JoinQueue>(num_workers, last_step);
  const bool rules = rulings != nullptr;
  std::optional<TcpServer<JoinDesk>> desk;
  try {
    const Address where = parse_address(address);
    // New tasks are beyond the cluster spec, by design (the desk checks their indices).
    options.tasks = {{Node::Role::kPs, 4096}, {Node::Role::kWorker, 1U << 20U}, {Node::Role::kEvaluator, 1}};
    options.orphaned_after = std::chrono::hours(24 * 365);  // joiners come and go: it serves on
    desk.emplace(JoinDesk(queue, std::move(rulings)), listen_host(where), where.port, options);
    log(LogLevel::kInfo, "chief: ps tasks, workers and an evaluator may join job '" + options.credentials.job + "' at " + address +
                             " (--join --job-name " + options.credentials.job + " --chief-host " + address + ")");
  } catch (const Error& e) {
    log(LogLevel::kWarning, std::string("chief: no task can join this job") +
                                (rules ? ", nor hear the chief rule a ps lost (a lost ps is waited for, not given up)" : "") +
                                ": " + e.what());
  }
  std::thread serving;
  if (desk) serving = std::thread([&desk] { desk->run(); });
  struct Closer {
    std::optional<TcpServer<JoinDesk>>& desk;
    std::thread& serving;
    ~Closer() {
      if (!desk) return;
      desk->stop();
      serving.join();
    }
  } closer{desk, serving};
  body(desk ? queue.get() : nullptr);
}

/// A ps task of a cluster of processes, until the chief shuts it down. With `join`, it
/// asks the chief to take it into the running job once it listens (Job::join). With
/// `leave`, a SIGTERM asks the chief to take it out of the job (LeaveWatch): it ends once
/// the others hold its share. A process the chief gave up that came back (with copies: it
/// was stopped, hung or cut off past the copy timeout) is told to start again
/// (Shutdown::restart): it serves anew, empty, on the same address, and the chief takes it
/// back as a process started in its place.
template <Model M, Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void serve(const Training<M>& training, const TfConfig& config, const Credentials& credentials,
           S sharding, O optimizer, P sync, T tables, Metrics* metrics = nullptr, bool join = false,
           bool leave = false) {
  const auto& hosts = config.cluster.tasks("ps");
  const std::uint32_t task = config.task.index;
  const Address address = parse_address(hosts.at(task));
  const std::string bind = listen_host(address);
  const auto num_ps = static_cast<std::uint32_t>(hosts.size());
  auto make =
      [&](std::uint32_t shard) {  // (a copy may be of a ps that joined since: shard >= num_ps)
        ParameterServer<S, O, P, T> ps(shard, std::max(num_ps, shard + 1), optimizer, sync,
                                       sharding, tables);
        ps.set_worker_timeout(training.worker_timeout);
        ps.set_chief_wait(training.client.recovery_timeout);
        return ps;
      };
  TcpServerOptions options = with(training.server, credentials);
  if (options.tasks.empty()) options.tasks = job_tasks(config.cluster);
  std::optional<Error> refused;  // the chief's answer to a Join, when it refused
  std::atomic<bool> left{false};  // the chief took it out of the job at its request
  const auto run = [&](auto service, const std::string& holds) {
    TcpServer server(std::move(service), bind, address.port, options);
    log(LogLevel::kInfo, "ps " + std::to_string(task) + " serving " + holds + " on " + address.to_string() +
                             " (listening on " + bind + ":" + std::to_string(server.port()) + ")");
    std::thread asking;
    std::atomic<bool> served{false};
    if (join) {
      asking = std::thread([&] {
        try {
          ask_to_join(chief_address(config.cluster), task, hosts.at(task), with(training.tcp, credentials),
                      training.client.recovery_timeout, served);
        } catch (const Error& e) {
          if (served) return;  // the job ended meanwhile
          refused.emplace(e);
          server.stop();
        }
      });
    }
    std::optional<LeaveWatch> leaving;
    if (leave) {
      leaving.emplace(Node::ps(task), chief_address(config.cluster), with(training.tcp, credentials),
                      training.client.recovery_timeout, [&] {
                        left = true;
                        server.stop();
                      });
    }
    server.run();
    served = true;
    leaving.reset();
    if (asking.joinable()) asking.join();
    if (refused)
      throw Error(refused->code(),
                  "ps " + std::to_string(task) + " could not join the job: " + refused->message());
    return std::tuple{server.service().ended(), server.orphaned(), server.service().restarts()};
  };
  std::optional<ErrorReply> end;
  bool orphaned = false;
  bool restarts = false;  // the chief gave this process up, and it came back (Shutdown::restart)
  auto reported = [&](ParameterServer<S, O, P, T> ps) {
    if (metrics != nullptr) {
      ps.report_stats([metrics, name = Node::ps(task).name()](const Stats& s) { record_stats(*metrics, name, s); });
    }
    return ps;
  };
  if (training.tcp.replicas != 0 && num_ps < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                "--ps-replicas 1 keeps each ps's shard on another ps: it needs at "
                "least 2 ps tasks, the cluster has " +
                    std::to_string(num_ps));
  }
  do {
    if (training.tcp.replicas == 0) {
      std::tie(end, orphaned, restarts) = run(reported(make(task)), "its shard");
    } else {
      const std::uint32_t before = (task + num_ps - 1) % num_ps;
      ShardCopies copies(reported(make(task)), make(before),
                         make);  // (the copy moves when a ps leaves)
      copies.set_chief_lease(training.chief_lease());
      std::tie(end, orphaned, restarts) =
          run(std::move(copies), "its shard and a copy of ps " + std::to_string(before) + "'s");
    }
    // Again as a process started in its place: empty, on the same address, under a new name
    // (wire::Welcome::server: every task tells it from the one given up). A member already,
    // one that joined too: the chief takes it back, it asks to join nothing.
    if (restarts) log(LogLevel::kWarning, end->message);
    join = false;
  } while (restarts && !left);
  if (left) {
    log(LogLevel::kInfo, "ps " + std::to_string(task) + " left the job at its request: the others hold its share");
    return;
  }
  if (!end && orphaned) {
    throw Error(ErrorCode::kUnavailable,
                "every client has been gone for " +
                    std::to_string(training.server.orphaned_after.count() / 1000) +
                    " s and the chief never ended training (did it fail?)");
  }
  if (!end) throw Error(ErrorCode::kInternal, "ps " + std::to_string(task) + " stopped serving");
  if (end->code != ErrorCode::kOutOfRange) throw Error(end->code, end->message);
  log(LogLevel::kInfo, end->message);
}

}  // namespace runner_detail
}  // namespace pulley
