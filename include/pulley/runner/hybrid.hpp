// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/client/all_reduce_worker.hpp"
#include "pulley/client/dense_on_ring.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/ring.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/log.hpp"
#include "pulley/runner/chief_loop.hpp"
#include "pulley/runner/job.hpp"
#include "pulley/runner/run.hpp"
#include "pulley/runner/tasks.hpp"
#include "pulley/runner/training.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/tables/tables.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "pulley/transport/tcp_ring.hpp"

namespace pulley {
namespace runner_detail {

/// The chief's replica of a hybrid job's dense variables: the last rank of the workers'
/// ring, which adds no gradient and takes every step with them (AllReduceWorker::follow),
/// on a thread of its own. The workers' replicas start as copies of it.
template <Model M, Optimizer O, Ring R>
class DenseFollower final : public DensePart {
 public:
  DenseFollower(M model, O optimizer, R ring, std::int64_t last_step, std::uint64_t seed)
      : replica_(std::move(model), std::move(optimizer), std::move(ring)), last_step_(last_step), seed_(seed) {}
  DenseFollower(const DenseFollower&) = delete;
  DenseFollower& operator=(const DenseFollower&) = delete;

  /// Waits for the thread: it ends at the last step, or once its ring fails (the workers
  /// of a job that failed leave it).
  ~DenseFollower() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      paused_ = false;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void begin(const ModelState* restored) override {
    if (restored != nullptr) {
      ModelState dense;
      dense.global_step = restored->global_step;
      dense.variables = restored->variables;
      replica_.restore(dense);
    } else {
      const auto variables = std::span<const VariableSpec>(replica_.model().variables());
      for (std::size_t v = 0; v < variables.size(); ++v) {
        initialize(variables[v], seed_, replica_.model().parameter(v));
      }
    }
    step_ = replica_.global_step();
  }

  void launch() override {
    in_step_ = true;  // the first broadcast (every worker takes it before its first step): pause() waits for it
    thread_ = std::thread([this] {
      try {
        follow();
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex_);
        failure_ = e.what();
      }
      std::lock_guard lock(mutex_);
      done_ = true;
      in_step_ = false;
      changed_.notify_all();
    });
  }

  std::int64_t pause() override {
    std::unique_lock lock(mutex_);
    paused_ = true;
    changed_.wait(lock, [&] { return !in_step_ || done_; });
    if (!failure_.empty()) {
      throw Error(ErrorCode::kAborted, "the chief's replica of the dense variables: " + failure_);
    }
    return step_;
  }

  void check() override {
    std::lock_guard lock(mutex_);
    if (!failure_.empty()) {
      throw Error(ErrorCode::kAborted, "the chief's replica of the dense variables: " + failure_);
    }
  }

  void resume() override {
    {
      std::lock_guard lock(mutex_);
      paused_ = false;
    }
    changed_.notify_all();
  }

  std::vector<VariableState> variables() override { return replica_.state().variables; }

 private:
  void follow() {
    replica_.synchronize(replica_.rank());  // every worker's replica is a copy of this one
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        in_step_ = false;
        step_ = replica_.global_step();
        changed_.notify_all();
        changed_.wait(lock, [&] { return !paused_ || stop_; });
        if (stop_ || step_ >= last_step_) return;
        in_step_ = true;
      }
      const AllReduceStep done = replica_.follow();
      if (!done.applied) {
        log(LogLevel::kWarning, "hybrid: step " + std::to_string(done.global_step) +
                                    "'s mean dense gradient was not finite: no replica applied it");
      }
    }
  }

  AllReduceWorker<M, O, R> replica_;
  std::int64_t last_step_;
  std::uint64_t seed_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::int64_t step_ = 0;  ///< the replica's step between steps
  bool in_step_ = false;   ///< a step (or the first broadcast) is in progress
  bool paused_ = false;
  bool stop_ = false;
  bool done_ = false;
  std::string failure_;
};

/// `training` for a worker of a hybrid job: the same but for its model, `make()`'s (the
/// user's model wrapped in a DenseOnRing), and no evaluation (the chief evaluates).
template <Model W, Model M, class Make>
Training<W> worker_training(const Training<M>& training, Make make) {
  Training<W> out;
  static_cast<TrainingOptions&>(out) = training;  // everything but the model-typed parts
  out.model = std::move(make);
  out.data = training.data;
  return out;
}

}  // namespace runner_detail

/// Runs this process's part of a hybrid job: the model's embedding tables on ps tasks, its
/// dense variables all-reduced among the workers, as recommender systems train (PERSIA,
/// HugeCTR, TorchRec). Each worker trains `DenseOnRing<M, O, Ring>`: it pulls and pushes
/// its batch's rows as in a ps job (`tables`, the ps tasks' Tables policy), and sums its
/// dense gradients with the others' on a ring, each applying the mean with `optimizer`.
/// The ps tasks hold no dense variable. The chief holds a replica of them too, the last
/// rank of the ring, which adds no gradient of its own and takes every step with the
/// workers (AllReduceWorker::follow): it starts the replicas (from the seed, or from the
/// newest checkpoint), and its checkpoints and evaluations hold the dense variables beside
/// the ps tasks' rows, in the format a ps job writes (an evaluator task on the checkpoint
/// directory scores them as it scores any).
///
/// A worker copies the chief's replica before it takes its first step (its model is made
/// with the copy), so it starts once the chief has initialized or restored the ps tasks:
/// no step of a worker is computed on a state the chief then replaces (a `DenseOnRing`
/// cannot compute a step twice).
///
/// Synchronous: SyncReplicas with R = N (every worker's step is every global step). In
/// one process, a thread per task on the in-process transport and an `InProcessRing`; in
/// a cluster (TF_CONFIG, flags, Slurm), ps tasks, workers and a chief task, the workers and
/// the chief linked by a `TcpRing` on their own addresses (proving the job's secret:
/// a hybrid job needs one), an evaluator only with `training.checkpoint.directory`.
///
/// A checkpoint holds training still while the ps tasks are read (the dense variables are
/// then copied); an evaluation takes the dense values and lets training go on. A lost
/// worker, ps or chief ends the job with one line naming it (the dense variables cannot
/// be rolled back with the tables, nor a worker's share handed on): started again, it
/// resumes from the newest checkpoint. No task joins or leaves a hybrid job.
///
/// Returns 0, or 1 after logging the failure, as `run` does.
template <TableModel M, Optimizer O, TablePolicy T, Sharding S = RoundRobin>
int run_hybrid(const Job& job, const Training<M>& training, O optimizer, T tables, S sharding = {}) {
  try {
    if (training.last_step <= 0) throw Error(ErrorCode::kInvalidArgument, "Training::last_step must be positive");
    if (!training.model || !training.data) {
      throw Error(ErrorCode::kInvalidArgument, "Training needs a model and a data source");
    }
    if (job.join) throw Error(ErrorCode::kInvalidArgument, "no task joins a hybrid job (--join)");
    if (training.tcp.replicas != 0) {
      throw Error(ErrorCode::kInvalidArgument, "a hybrid job keeps no copies of the ps tasks' shards (--ps-replicas)");
    }
    if (training.client.ps_leave_after.count() > 0 || training.client.worker_leave_after.count() > 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "a hybrid job's ps tasks and workers are fixed (--ps-leave-secs, --worker-leave-secs)");
    }
    if (!job.in_process() && job.num_ps() == 0) {
      throw Error(ErrorCode::kInvalidArgument, "a hybrid job's cluster needs a \"ps\" task: it holds the tables");
    }
    check_optimizer_settings(optimizer);
    check_optimizer_settings(tables.optimizer, "the tables' optimizer");
    const std::uint32_t num_workers = job.num_workers();
    const SyncReplicas sync(SyncReplicas::kEveryWorker, static_cast<int>(num_workers));
    const std::uint64_t seed = training.seed;
    // The ps tasks never hold a worker lost: a step of SyncReplicas without one would have
    // the others take its share, and their rings a sum more than the step. A lost worker
    // fails the ring instead, and the job.
    Training<M> fixed = training;
    fixed.worker_timeout = std::chrono::hours(24 * 365);
    if (job.in_process()) {
      auto ring = InProcessRing::make(num_workers + 1, training.client.request_timeout);
      using Dense = DenseOnRing<M, O, InProcessRing>;
      runner_detail::DenseFollower<M, O, InProcessRing> follower(training.model(), optimizer,
                                                                 std::move(ring[num_workers]), training.last_step, seed);
      // Links no worker took (one failed first) leave before the follower waits for its thread.
      struct LeaveAll {
        std::vector<InProcessRing>& links;
        ~LeaveAll() {
          for (InProcessRing& link : links) link.leave();
        }
      } leave_all{ring};
      runner_detail::run_in_process(
          job, fixed, std::move(sharding), optimizer, sync, std::move(tables),
          [&](std::uint32_t w, auto connect, auto ids, Metrics* metrics) {
            const auto mine = runner_detail::worker_training<Dense>(training, [&, w] {
              Dense dense(training.model(), optimizer, std::move(ring[w]), seed);
              dense.start_from(num_workers).start();
              return dense;
            });
            runner_detail::work(mine, w, num_workers, connect, connect, ids, metrics);
          },
          &follower);
      return 0;
    }
    const TfConfig& config = *job.cluster;
    const ClusterSpec& cluster = config.cluster;
    if (cluster.tasks("chief").empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "a hybrid job needs a chief task: it holds the dense variables' replica it checkpoints, on the "
                  "ring beside the workers");
    }
    const std::string& type = config.task.type;
    if (type == "evaluator" && training.checkpoint.directory.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "a hybrid job's evaluator scores the checkpoints (the ps tasks hold no dense variable): give the "
                  "job a checkpoint directory (--checkpoint-dir), the same on every task");
    }
    const auto id_sharding = tables.sharding;
    std::vector<std::string> ring_addresses = cluster.tasks("worker");
    ring_addresses.push_back(cluster.tasks("chief").front());
    TcpRingOptions ring_options;
    ring_options.form_timeout = training.client.recovery_timeout;
    ring_options.timeout = training.client.request_timeout;
    ring_options.local_sockets = training.tcp.local_sockets;
    ring_options.shared_memory = training.tcp.shared_memory;
    const TcpOptions tcp = runner_detail::with(training.tcp, job.credentials);
    auto transport = [&](Node self) { return Tcp(self, cluster.tasks("ps"), tcp); };
    const auto count = [&](std::string_view role) { return static_cast<std::uint32_t>(cluster.tasks(role).size()); };
    MetricsReporter reporter(training.metrics, type + "-" + std::to_string(config.task.index),
                             metrics_port_offset(type, config.task.index, count("ps"), count("chief"),
                                                                num_workers));
    Metrics* metrics = reporter.enabled() ? &reporter.metrics() : nullptr;
    if (type == "ps") {
      runner_detail::serve(fixed, config, job.credentials, std::move(sharding), std::move(optimizer), sync,
                           std::move(tables), metrics);
    } else if (type == "chief") {
      runner_detail::DenseFollower<M, O, TcpRing> follower(
          training.model(), optimizer, TcpRing(num_workers, ring_addresses, job.credentials, ring_options),
          training.last_step, seed);
      const auto connect = [&] { return transport(Node::chief()); };
      runner_detail::lead(training, connect, connect, id_sharding, metrics, nullptr, &follower);
    } else if (type == "evaluator") {
      runner_detail::follow_checkpoints(training, metrics);
    } else {
      using Dense = DenseOnRing<M, O, TcpRing>;
      const std::uint32_t index = config.task.index;
      const auto mine = runner_detail::worker_training<Dense>(training, [&] {
        Dense dense(training.model(), optimizer, TcpRing(index, ring_addresses, job.credentials, ring_options), seed);
        dense.start_from(num_workers).start();
        return dense;
      });
      const auto connect = [&] { return transport(Node::worker(index)); };
      runner_detail::work(mine, index, num_workers, connect, connect, id_sharding, metrics);
    }
    return 0;
  } catch (const std::exception& e) {
    log(LogLevel::kError, job.name() + " failed: " + e.what());
    return 1;
  }
}

}  // namespace pulley
