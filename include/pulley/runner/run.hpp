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
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/runner/chief_loop.hpp"
#include "pulley/runner/job.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/runner/tasks.hpp"
#include "pulley/runner/training.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/tables/tables.hpp"
#include "pulley/transport/in_process.hpp"
#include "pulley/transport/tcp.hpp"

namespace pulley {
namespace runner_detail {

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

/// What a task started in a job with copies (`TcpOptions::replicas`) finds at the ps
/// tasks (look_at_copies).
struct CopiesLook {
  /// Training is under way: some ps serves, and it has been initialized (it serves
  /// training). A chief started in a lost one's place, or a worker or evaluator started
  /// again, then waits for a ps that does not answer (gone, or gone between the look and
  /// its connection) one connection attempt, not the connect timeout (meant for ps tasks
  /// that are still starting), before the chief's rulings decide whether its process is
  /// lost, as they would during training. False at a job's start.
  bool under_way = false;
  /// Training ended before the task started: what a ps answers since (kOutOfRange, training
  /// finished; kAborted, with the chief's reason). The task has nothing to do: a ps of the
  /// job may be gone for good, and so may the chief that could rule on it.
  std::optional<ErrorReply> ended;
  /// The ps tasks that served at the look, ascending.
  std::vector<std::uint32_t> serving;
};

/// One look at every ps address (probe_ps), as task `self`, then a GetStats of one that
/// serves. While no ps serves and some is silent (a process stopped a while: neither
/// serving nor gone), it looks again, for up to the copy timeout.
inline CopiesLook look_at_copies(const Node& self, const std::vector<std::string>& ps,
                                 const TcpOptions& tcp) {
  const auto until = std::chrono::steady_clock::now() + tcp.copy_timeout;
  std::vector<std::uint32_t> serving;
  for (;;) {
    bool silent = false;
    for (std::uint32_t k = 0; k < ps.size(); ++k) {
      const auto kind = probe_ps(ps[k], k, self, tcp.credentials, tcp.attempt_timeout).kind;
      if (kind == ProbeResult::Kind::kServes) serving.push_back(k);
      silent = silent || kind == ProbeResult::Kind::kSilent;
    }
    if (!serving.empty() || !silent || std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (serving.empty()) return {};
  try {
    TcpOptions once = tcp;
    once.copy_referee = nullptr;
    once.connect_timeout = tcp.attempt_timeout;
    Tcp look(self, ps, once, serving);
    PendingCall call = look.call(serving.front(), GetStats{}, {});
    if (!call.wait_for(tcp.attempt_timeout)) {
      call.cancel();
      return {};
    }
    const Response answer = call.take();
    if (const auto* stats = std::get_if<StatsReply>(&answer))
      return {stats->ready, std::nullopt, serving};
    const auto* error = std::get_if<ErrorReply>(&answer);
    if (error != nullptr &&
        (error->code == ErrorCode::kOutOfRange || error->code == ErrorCode::kAborted)) {
      return {true, *error, serving};
    }
    return {};
  } catch (const Error&) {  // not reached after all: the task waits as at a start
    return {};
  }
}

/// A task that found training ended (CopiesLook::ended) before it started: returns when it
/// finished (the task has nothing to do), throws the chief's reason when it was aborted.
inline void nothing_to_do(const Node& self, const ErrorReply& ended) {
  if (ended.code != ErrorCode::kOutOfRange) throw Error(ended.code, ended.message);
  log(LogLevel::kInfo, self.name() + ": training finished before this task started (" +
                           ended.message + "): nothing to do");
}

/// Fits the transport options `tcp` of task `self`, started in a job with copies, to what
/// look_at_copies finds: in a job under way (started again, say) a ps that does not answer
/// is waited for one connection attempt (`copy_connect_timeout`), then the chief rules
/// whether its process is lost (the chief itself, or a task that asks it); a shard neither
/// of whose copies answers is waited for as at a start. A task that joins (`join`) joins a
/// job under way, and the ps tasks refuse it as itself until the chief counted it in: it
/// does not look. Returns the look (`ended`: what a ps answered if training ended before the
/// task started, for nothing_to_do).
inline CopiesLook fit_to_copies(const Node& self, const std::vector<std::string>& ps,
                                TcpOptions& tcp, bool join) {
  CopiesLook look = join ? CopiesLook{true, std::nullopt, {}} : look_at_copies(self, ps, tcp);
  if (look.ended) return look;
  if (look.under_way) {
    const bool chief = self.role == Node::Role::kChief;
    log(LogLevel::kInfo,
        (chief ? std::string("chief") : self.name()) +
            ": the ps tasks serve a job under way: a ps that does not answer is waited "
            "for one connection attempt, then " +
            (chief ? "the chief rules" : "this task asks the chief") +
            " whether its process is lost");
    tcp.copy_connect_timeout = std::chrono::milliseconds(1);  // one attempt (TcpOptions)
  }
  return look;
}

/// Where the ps tasks of table policy `tables` hold rows: its IdSharding (HashIds for
/// NoTables, whose ps tasks hold none).
template <TablesOrNone T>
auto id_sharding_of(const T& tables) {
  if constexpr (TablePolicy<T>) {
    return tables.sharding;
  } else {
    return HashIds{};
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
/// aborts the job (every other task then stops) and is the one reported. Worker `w` runs
/// `work_as(w, connect, id_sharding, metrics)` (`work` with its Training); `dense`: a
/// hybrid job's dense variables, the chief's (null in a ps job).
template <Model M, Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T, class WorkAs>
void run_in_process(const Job& job, const Training<M>& training, S sharding, O optimizer,
                    P sync, T tables, WorkAs work_as, DensePart* dense = nullptr) {
  const auto id_sharding = id_sharding_of(tables);
  if (training.tcp.replicas != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "--ps-replicas keeps each ps's shard on another ps process: it needs a cluster of "
                "processes (TF_CONFIG, --ps-hosts/--worker-hosts or Slurm), not one process");
  }
  MetricsReporter reporter(training.metrics, "in-process");
  Metrics* metrics = reporter.enabled() ? &reporter.metrics() : nullptr;
  InProcessNetwork network(job.local_ps);
  for (std::uint32_t i = 0; i < job.local_ps; ++i) {
    ParameterServer<S, O, P, T> ps(i, job.local_ps, optimizer, sync, sharding, tables);
    ps.set_worker_timeout(training.worker_timeout);
    ps.set_chief_wait(training.client.recovery_timeout);
    if (metrics != nullptr) {
      ps.report_stats([metrics, name = Node::ps(i).name()](const Stats& s) { record_stats(*metrics, name, s); });
    }
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
        work_as(w, [&] { return InProcess(network, Node::worker(w)); }, id_sharding, metrics);
      } catch (const std::exception& e) {
        fail("worker " + std::to_string(w), e);
      }
    });
  }
  try {
    const auto connect = [&] { return InProcess(network, Node::chief()); };
    lead(training, connect, connect, id_sharding, metrics, nullptr, dense);
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
template <Model M, Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void run_task(const TfConfig& config, const Credentials& credentials, bool join, const Training<M>& training,
              S sharding, O optimizer, P sync, T tables) {
  const auto id_sharding = id_sharding_of(tables);
  const std::string& type = config.task.type;
  const std::vector<std::string>& ps = config.cluster.tasks("ps");
  const auto num_workers = static_cast<std::uint32_t>(config.cluster.tasks("worker").size());
  const bool chief_worker = type == "worker" && config.task.index == 0 && !config.cluster.roles.contains("chief");
  TcpOptions tcp = with(training.tcp, credentials);
  // With copies the chief rules which ps processes are lost (CopyRulings): its own
  // transports' findings stand, and every other task asks it at its desk (AskChief).
  std::shared_ptr<CopyRulings> rulings;
  // Where the chief looks for a ruling: the spec's ps tasks, and those that joined since.
  struct Known {
    std::mutex mutex;
    std::vector<std::string> addresses;
  };
  const auto known = std::make_shared<Known>();
  known->addresses = ps;
  TcpOptions chief_tcp = tcp;
  std::vector<std::uint32_t>
      beat_now;  // a worker's heartbeats: these ps tasks at once (none: as reach_now)
  if (tcp.replicas != 0 && type != "ps") {
    if (type == "chief" || chief_worker) {
      const auto addresses = [known] {
        const std::scoped_lock lock(known->mutex);
        return known->addresses;
      };
      using Kind = CopyRulings::Sight::Kind;
      const auto sight = [](const ProbeResult& seen, std::string detail) {
        const Kind kind = seen.kind == ProbeResult::Kind::kServes ? Kind::kServes
                          : seen.kind == ProbeResult::Kind::kGone ? Kind::kGone
                                                                  : Kind::kSilent;
        return CopyRulings::Sight{kind, seen.process, std::move(detail), seen.reached};
      };
      rulings = std::make_shared<CopyRulings>(
          static_cast<std::uint32_t>(ps.size()),
          [=](std::uint32_t k) {
            const ProbeResult look =
                probe_ps(addresses().at(k), k, Node::chief(), tcp.credentials, tcp.attempt_timeout);
            return sight(look, look.detail);
          },
          tcp.copy_timeout,
          [=](std::uint32_t k, const std::set<std::uint64_t>& only, bool restart) {
            const std::vector<std::string> all = addresses();
            // At the end, each shard whose copy it may hold; a restart, its own shard alone.
            std::vector<std::uint32_t> copies(restart ? 0 : all.size());
            std::iota(copies.begin(), copies.end(), 0U);
            return sight(
                tell_ps(all.at(k), k, Node::chief(), tcp.credentials,
                        Request{Shutdown{false, {}, restart}}, tcp.attempt_timeout, only, copies),
                "at " + all.at(k));
          });
      chief_tcp.copy_referee = rulings->referee();
      if (const CopiesLook look = fit_to_copies(Node::chief(), ps, chief_tcp, false); look.ended) {
        return nothing_to_do(Node::chief(), *look.ended);
      }
    }
    if (type != "chief") {
      const Node self{type == "evaluator" ? Node::Role::kEvaluator : Node::Role::kWorker, config.task.index};
      tcp.copy_referee = AskChief::referee(
          std::make_shared<AskChief>(self, chief_address(config.cluster), tcp, std::chrono::seconds(10)));
      const CopiesLook look = fit_to_copies(self, ps, tcp, join);
      if (look.ended) return nothing_to_do(self, *look.ended);
      // A worker started again beats the ps tasks that served at its look at once, and the
      // others from its next beat on: its other transports wait for the chief's ruling on a
      // ps process gone, and the ps tasks must hear it before their worker timeout.
      if (look.under_way && !look.serving.empty() && look.serving.size() < ps.size())
        beat_now = look.serving;
    }
  }
  std::optional<std::span<const std::uint32_t>> reach_now;  // none: every ps of the spec at once
  auto transport = [&](Node self) { return Tcp(self, ps, self.role == Node::Role::kChief ? chief_tcp : tcp, reach_now); };
  // Heartbeats go on a transport of their own, which leaves the copies' log lines to the
  // one the task works on; `reach`: as reach_now.
  const auto beats = [&](Node self, std::optional<std::span<const std::uint32_t>> reach) {
    TcpOptions options = self.role == Node::Role::kChief ? chief_tcp : tcp;
    options.logs_copies = false;
    return Tcp(self, ps, std::move(options), reach);
  };
  const auto count = [&](std::string_view role) { return static_cast<std::uint32_t>(config.cluster.tasks(role).size()); };
  MetricsReporter reporter(training.metrics, type + "-" + std::to_string(config.task.index),
                           metrics_port_offset(type, config.task.index, count("ps"), count("chief"), num_workers, join));
  Metrics* metrics = reporter.enabled() ? &reporter.metrics() : nullptr;
  // SIGTERM asks a ps task, or a worker whose sync policy counts workers that change, to
  // leave the job through the chief once it serves or trains (LeaveWatch): a job scaled
  // down (not worker 0 acting as the chief).
  const bool may_leave = type == "ps" || (type == "worker" && !chief_worker && kReshapes<P>);
  // The chief's part, with the desk where tasks ask to join.
  const auto lead_taking_joins = [&](JoinQueue* joins) {
    if (joins != nullptr && rulings != nullptr) {  // a ps that joins is ruled on as the others
      joins->on_expect([known, rulings](const std::vector<std::string>& addresses) {
        {
          const std::scoped_lock lock(known->mutex);
          if (addresses.size() > known->addresses.size()) known->addresses = addresses;
        }
        rulings->grow(static_cast<std::uint32_t>(addresses.size()));
      });
      joins->on_may_restart([rulings](std::uint32_t k) { rulings->revive(k); });
    }
    lead(
        training, [&] { return transport(Node::chief()); },
        [&] { return beats(Node::chief(), reach_now); }, id_sharding, metrics, joins);
    // A process given up that lives on hears it too (one stopped, within the recovery timeout).
    if (rulings != nullptr) rulings->finish(training.client.recovery_timeout);
  };
  if (type == "ps") {
    serve(training, config, credentials, std::move(sharding), std::move(optimizer),
          std::move(sync), std::move(tables), metrics, join, may_leave);
  } else if (type == "chief") {
    with_join_desk(chief_address(config.cluster), with(training.server, credentials), num_workers,
                   training.last_step, rulings, lead_taking_joins);
  } else if (type == "evaluator") {
    const Node self{Node::Role::kEvaluator, config.task.index};
    std::vector<std::uint32_t> members;  // a joiner reads the job's members: a ps listed may have left
    if (join && training.checkpoint.directory.empty()) {  // one that follows a directory reads no ps
      members = ask_shape(self, chief_address(config.cluster), tcp, training.client.recovery_timeout).members;
      reach_now = members;
    }
    naming_a_lost_chief(chief_address(config.cluster), tcp, [&] {
      follow(
          training, [&] { return transport(self); }, id_sharding, metrics);
    });
  } else if (chief_worker) {
    // No chief task: worker 0 is also the chief (TensorFlow's convention), on a thread.
    std::exception_ptr chief_failure;
    std::thread chief([&] {
      try {
        with_join_desk(chief_address(config.cluster), with(training.server, credentials),
                       num_workers, training.last_step, rulings, lead_taking_joins);
      } catch (...) {
        chief_failure = std::current_exception();
      }
    });
    try {
      const auto connect = [&] { return transport(Node::worker(0)); };
      work(
          training, 0, num_workers, connect, [&] { return beats(Node::worker(0), reach_now); },
          id_sharding, metrics);
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
    std::optional<std::pair<std::string, TcpOptions>> leave;
    if (may_leave) leave.emplace(chief_address(config.cluster), tcp);
    const auto worker = [&](const Training<M>& as) {
      const Node self = Node::worker(config.task.index);
      naming_a_lost_chief(chief_address(config.cluster), tcp, [&] {
        const auto connect_beats = [&] {
          return beats(self,
                       beat_now.empty() ? reach_now : std::span<const std::uint32_t>(beat_now));
        };
        work(
            as, config.task.index, num_workers, [&] { return transport(self); }, connect_beats,
            id_sharding, metrics, leave);
      });
    };
    if (!join) return worker(training);
    // Counted in before it reaches a ps (which lets in the job's workers only), it runs the
    // job's schedule: its own flags may derive another from its cluster spec's workers. It
    // connects to the job's members: a ps task its cluster lists may have left the job.
    const std::string chief = chief_address(config.cluster);
    const JoinReply job = ask_to_work(chief, config.task.index, tcp, training.client.recovery_timeout);
    const std::vector<std::uint32_t> members =
        ask_shape(Node::worker(config.task.index), chief, tcp, training.client.recovery_timeout).members;
    reach_now = members;
    if (job.last_step <= 0 || job.last_step == training.last_step) return worker(training);
    log(LogLevel::kInfo, "worker " + std::to_string(config.task.index) + " follows the chief's schedule: the job "
                             "ends at global step " + std::to_string(job.last_step) + " (this task's own flags give " +
                             std::to_string(training.last_step) + ")");
    Training<M> as_the_job = training;
    as_the_job.last_step = job.last_step;
    worker(as_the_job);
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
/// A model with embedding tables (TableModel) is served the same way: the chief registers
/// its tables, workers pull and push their batches' rows, checkpoints hold the rows, and
/// `Evaluation::rows` reads them.
///
/// @tparam M the Model (made by `training.model`)
/// @tparam S, O, P the ps's Sharding, Optimizer and SyncPolicy, as in ParameterServer
/// @tparam T the ps's table policy (Tables<RowOptimizer, IdSharding, RowAggregation>);
///           workers, the chief and the evaluator use its IdSharding. The overload without
///           one takes ParameterServer's default: Tables<O> with `optimizer`'s settings when
///           O can update rows.
template <Model M, Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
int run(const Job& job, const Training<M>& training, S sharding, O optimizer, P sync, T tables) {
  static_assert(!TableModel<M> || TablePolicy<T>,
                "a model with embedding tables needs a Tables policy: pass one to pulley::run, or "
                "an optimizer that can update rows");
  try {
    if (training.last_step <= 0) {
      throw Error(ErrorCode::kInvalidArgument, "Training::last_step must be positive");
    }
    if (!training.model || !training.data) {
      throw Error(ErrorCode::kInvalidArgument, "Training needs a model and a data source");
    }
    const ClientOptions& client = training.client;
    if (client.ps_leave_after.count() > 0) {
      if (client.ps_leave_after >= client.recovery_timeout) {
        throw Error(ErrorCode::kInvalidArgument,
                    "--ps-leave-secs must be below the recovery timeout (--recovery-timeout-ms): the workers "
                    "wait for the job to go on without the ps only that long");
      }
    }
    if (!job.in_process() && job.num_ps() == 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "the cluster has no \"ps\" task: a parameter-server job needs one (a cluster of workers only "
                  "is an all-reduce job's: run_all_reduce, runner/all_reduce.hpp)");
    }
    if constexpr (!kReshapes<P>) {
      if (client.worker_leave_after.count() > 0 || (job.join && job.cluster->task.type == "worker")) {
        throw Error(ErrorCode::kInvalidArgument,
                    "--worker-leave-secs, and a worker's --join, need a sync policy that counts workers that "
                    "join or leave (SyncPolicy::reshape)");
      }
    }
    // Every task, not only the ps tasks, refuses bad settings at once: nobody waits for a
    // ps that will not start.
    check_optimizer_settings(optimizer);
    if constexpr (TablePolicy<T>) check_optimizer_settings(tables.optimizer, "the tables' optimizer");
    if (job.in_process()) {
      runner_detail::run_in_process(
          job, training, std::move(sharding), std::move(optimizer), std::move(sync),
          std::move(tables), [&](std::uint32_t w, auto connect, auto ids, Metrics* metrics) {
            runner_detail::work(training, w, job.local_workers, connect, connect, ids, metrics);
          });
    } else {
      runner_detail::run_task(*job.cluster, job.credentials, job.join, training, std::move(sharding),
                              std::move(optimizer), std::move(sync), std::move(tables));
    }
    return 0;
  } catch (const std::exception& e) {
    log(LogLevel::kError, job.name() + " failed: " + e.what());
    return 1;
  }
}

template <Model M, Sharding S, Optimizer O, SyncPolicy P>
int run(const Job& job, const Training<M>& training, S sharding, O optimizer, P sync) {
  auto tables = default_table_policy<DefaultTables<O>>(optimizer);
  return run(job, training, std::move(sharding), std::move(optimizer), std::move(sync), std::move(tables));
}

}  // namespace pulley
