// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/client/all_reduce_worker.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/ring.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/log.hpp"
#include "pulley/runner/job.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/runner/tasks.hpp"
#include "pulley/runner/training.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "pulley/transport/tcp_ring.hpp"
#include "pulley/transport/tcp_ring_rendezvous.hpp"

namespace pulley {
namespace runner_detail {

/// A ring's failure that forming it again mends: a lost or silent neighbour.
inline bool ring_lost(const Error& e) {
  return e.code() == ErrorCode::kUnavailable || e.code() == ErrorCode::kDeadlineExceeded;
}

/// Trains one worker of an all-reduce job over `ring` until `last_step`, recording its
/// figures under `task` in `metrics` (when not null). Every rank first
/// takes one replica (`view.step` -1: rank 0's, restored from the newest checkpoint or
/// initialized from the seed; else the furthest rank's, `view.source`); rank 0 evaluates,
/// checkpoints and reports as a chief does. With a `rendezvous` (processes), a ring that
/// breaks is formed again among the workers left (TcpRingRendezvous::regroup) and a worker
/// that checks in is taken in at a step boundary; without one (threads), a lost neighbour
/// ends the worker. Rank 0 also logs the progress line every `training.metrics.progress`.
template <Model M, Optimizer O, Ring R>
void train_on_ring(R ring, const Training<M>& training, O optimizer, const std::string& task, Metrics* metrics,
                   TcpRingRendezvous* rendezvous = nullptr, RingView view = {}) {
  AllReduceWorker worker(training.model(), std::move(optimizer), std::move(ring));
  const CheckpointOptions& saving = training.checkpoint;
  std::optional<CheckpointDirectory> directory;  // rank 0's, opened when it is rank 0
  auto checkpoints = [&]() -> CheckpointDirectory* {
    if (saving.directory.empty()) return nullptr;
    if (!directory) directory.emplace(saving.directory, saving.keep);
    return &*directory;
  };
  const auto name = [&] { return "all-reduce: rank " + std::to_string(worker.rank()); };

  // The data: batch b of the job reads as SyncReplicas with R = N numbers it, so a job of
  // N workers reads what a ps job of as many does, and a resumed one what it would have.
  // From each ring on, its ranks read the batches after those the job read before.
  bool holds_replica = false;
  std::int64_t base_step = 0;     // the step the current numbering starts at
  std::int64_t base_batches = 0;  // the batches the job read before it
  std::int64_t base_ranks = 1;    // the ranks that read them since
  auto progress = [&] {
    if (!holds_replica) return RingProgress{};
    return RingProgress{worker.global_step(), base_batches + (worker.global_step() - base_step) * base_ranks};
  };
  // Every rank takes one replica.
  auto begin = [&] {
    const auto ranks = static_cast<std::int64_t>(worker.num_workers());
    if (view.step < 0) {
      if (worker.rank() == 0) {
        std::optional<std::pair<ModelState, std::filesystem::path>> latest;
        if (CheckpointDirectory* d = checkpoints()) latest = d->latest();
        if (latest) {
          worker.restore(latest->first);
          log(LogLevel::kInfo, "all-reduce: resumed from " + latest->second.string() + " at global step " +
                                   std::to_string(latest->first.global_step));
        } else {
          const auto variables = std::span<const VariableSpec>(worker.model().variables());
          for (std::size_t v = 0; v < variables.size(); ++v) {
            initialize(variables[v], training.seed, worker.model().parameter(v));
          }
        }
      }
      holds_replica = false;
      worker.synchronize(0);
      base_batches = worker.global_step() * ranks;
    } else {
      if (worker.rank() != view.source && worker.global_step() != view.step) holds_replica = false;
      worker.synchronize(view.source);
      base_batches = view.batches;
    }
    holds_replica = true;
    base_step = worker.global_step();
    base_ranks = ranks;
  };
  auto say_where = [&](const std::string& since) {
    log(LogLevel::kInfo, name() + " of " + std::to_string(worker.num_workers()) + " (ring generation " +
                             std::to_string(view.generation) + ") goes on from global step " +
                             std::to_string(worker.global_step()) + since);
  };
  // Forms the ring again (it broke, or voted to take a worker in) and takes one replica.
  auto regroup = [&](const std::string& why) {
    log(LogLevel::kWarning, name() + " at global step " + std::to_string(worker.global_step()) + ": " + why +
                                ": forming the ring again");
    const auto left = std::chrono::steady_clock::now();
    for (int attempt = 1;; ++attempt) {
      try {
        view = rendezvous->regroup(view, progress());
        if constexpr (std::same_as<R, TcpRing>) {
          worker.reform(rendezvous->form(view));
        } else {  // (threads are never given a rendezvous)
          throw Error(ErrorCode::kInternal, "a ring of threads is not formed again");
        }
        begin();
        if (metrics != nullptr) metrics->add(task, "ring_regroups", 1);
        say_where(", " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::chrono::steady_clock::now() - left)
                                           .count()) +
                  " ms after it left the old ring");
        return;
      } catch (const Error& e) {
        if (!ring_lost(e) || attempt == 8) throw;
        log(LogLevel::kWarning, name() + ": forming the ring failed (" + e.what() + "): again");
      }
    }
  };
  // Runs `body`; a lost ring is formed again (false) when it can be.
  auto attempt = [&](auto body) {
    try {
      body();
      return true;
    } catch (const Error& e) {
      if (rendezvous == nullptr || !ring_lost(e)) throw;
      regroup(e.what());
      return false;
    }
  };
  if (attempt(begin) && view.generation > 0) say_where(", having joined");
  const std::int64_t start_step = worker.global_step();

  DataShard shard;
  shard.index = static_cast<std::uint32_t>(worker.rank());
  shard.count = static_cast<std::uint32_t>(worker.num_workers());
  shard.start_step = start_step;
  shard.number = [&] {
    return base_batches + (worker.global_step() - base_step) * base_ranks + static_cast<std::int64_t>(worker.rank());
  };
  auto source = training.data(shard);

  const auto started = std::chrono::steady_clock::now();
  auto last_save = started;
  auto evaluate = [&](bool last) {
    if (worker.rank() != 0 || !training.evaluate) return;
    Evaluation e;
    e.step = worker.global_step();
    e.last = last;
    e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    e.samples_per_s = e.seconds > 0 ? static_cast<double>((e.step - start_step) * training.samples_per_step) / e.seconds : 0.0;
    if (view.generation > 0) {  // the ring was formed again: the workers in it now, by rank
      for (std::uint32_t r = 0; r < worker.num_workers(); ++r) e.workers.push_back(r);
    }
    EvaluationScores scores(metrics, task, e.step);
    e.report = scores.reporter();
    training.evaluate(worker.model(), e);
    scores.commit();
  };
  // Rank 0's progress line; examples/s counts the workers in the ring now.
  const auto every = training.metrics.progress;
  auto next_line = started + every;
  std::pair<std::int64_t, std::chrono::steady_clock::time_point> last_line{start_step, started};
  auto progress_line = [&](std::int64_t step) {
    if (worker.rank() != 0 || every.count() <= 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_line) return;
    next_line = now + every;
    const double seconds = std::chrono::duration<double>(now - last_line.second).count();
    const double steps_per_s = seconds > 0 ? static_cast<double>(step - last_line.first) / seconds : 0.0;
    const double per_worker = static_cast<double>(training.samples_per_step) / static_cast<double>(shard.count);
    last_line = {step, now};
    log(LogLevel::kInfo, ChiefProgress::line(step, training.last_step, training.steps_per_epoch,
                                             steps_per_s * per_worker * static_cast<double>(worker.num_workers()),
                                             steps_per_s, "all-reduce") +
                             " (" + std::to_string(worker.num_workers()) + " workers)");
  };
  auto save = [&] {
    CheckpointDirectory* d = checkpoints();
    if (d == nullptr) return;
    const auto path = d->save(worker.state());
    last_save = std::chrono::steady_clock::now();
    log(LogLevel::kInfo, "all-reduce: saved " + path.string());
  };
  if (worker.rank() == 0) {
    log(LogLevel::kInfo, "all-reduce: " + std::to_string(worker.num_workers()) + " workers in the ring, from global step " +
                             std::to_string(start_step) + " to " + std::to_string(training.last_step));
  }
  while (worker.global_step() < training.last_step) {
    const bool vote = rendezvous != nullptr && rendezvous->serve(view);
    AllReduceStep done;
    if (!attempt([&] { done = worker.step(source(), vote); })) continue;
    if (!done.applied && worker.rank() == 0) {
      log(LogLevel::kWarning, "all-reduce: step " + std::to_string(done.global_step) +
                                  "'s mean gradient was not finite: no worker applied it");
    }
    const std::int64_t step = worker.global_step();
    if (step == training.last_step) break;
    if (metrics != nullptr) {
      metrics->set(task, {{"global_step", static_cast<double>(step)},
                          {"ring_workers", static_cast<double>(worker.num_workers())},
                          {"ring_rank", static_cast<double>(worker.rank())},
                          {"ring_generation", static_cast<double>(view.generation)}});
      metrics->add(task, "steps", 1, MetricKind::kRate);
      metrics->observe(task, "loss", done.loss);
      metrics->count(task, "bytes_sent", static_cast<double>(worker.bytes_sent()), MetricKind::kRate);
    }
    progress_line(step);
    if (training.evaluate_every > 0 && step % training.evaluate_every == 0) evaluate(false);
    const bool by_steps = saving.save_steps > 0 && step % saving.save_steps == 0;
    const bool by_time = saving.save_secs.count() > 0 && std::chrono::steady_clock::now() - last_save >= saving.save_secs;
    if (worker.rank() == 0 && (by_steps || by_time)) save();
    if (done.regroup) regroup("a worker checked in to join");
  }
  // No rank leaves before every rank has taken the last step. A ring that broke during it
  // may leave some ranks a step behind: they must copy that step from a rank that took it
  // (which stays until then), not take it again among themselves and checkpoint another
  // last step. A rank at the barrier has taken every step, so once any rank passes it, all
  // have; one that lost the ring in it forms the ring again and copies the furthest replica.
  while (!attempt([&] { worker.barrier(); })) {
  }
  if (worker.rank() == 0) save();
  evaluate(true);
}

}  // namespace runner_detail

/// Runs this process's part of an all-reduce job: the workers train without ps tasks,
/// summing their gradients in a ring (`AllReduceWorker`, `RingAllReduce`), the other
/// architecture of seed 004 beside `run`'s parameter servers. The same `Training` serves
/// both: swap `run(job, training, sharding, optimizer, sync)` for `run_all_reduce(job,
/// training, optimizer)`.
///
/// In-process (`job.in_process()`): `job.local_workers` threads, linked by an
/// `InProcessRing`. In a cluster: this process is worker `task.index` of a cluster of
/// workers only (TF_CONFIG, `--role worker --worker-hosts`, Slurm, mpirun), each listening
/// on its own address for the previous worker's link (`TcpRing`, proving the job's secret).
///
/// The failure rules of seed 004: a worker lost in a cluster (killed, its host gone, or
/// silent for `client.request_timeout`) is left out, the others are ranked again and form
/// the ring again (`TcpRingRendezvous`), every one copies the replica of the one furthest
/// on, and training goes on at the next step with one worker fewer (the mean is over the
/// workers left; the data is read on from where the job was). A worker started with
/// `job.join` (`--join`, its address in the cluster's worker list) checks in with the
/// running ring, is taken in at the next step boundary and copies the replica before its
/// first step; a lost worker started again joins that way. No worker leaves before every
/// worker has taken the last step (`AllReduceWorker::barrier`), so a ring that breaks
/// during it is formed again around the replica of a worker that took it. Every process of the job,
/// joiners too, needs the same job name (`--job-name`: the default one is made from the
/// cluster, which a joiner's list changes).
///
/// Worker 0 does a chief's work: it starts every replica (from the newest checkpoint in
/// `training.checkpoint.directory`, else from `training.seed`), evaluates every
/// `evaluate_every` steps and at the end (`Evaluation::role` kChief, no ps `stats`),
/// and checkpoints (by steps, by time, and at the end; `CheckpointDirectory`, the format a
/// ps job writes). Batches are numbered as SyncReplicas with R = N numbers them
/// (`DataShard::batch`). A worker waits for its neighbours `client.request_timeout`
/// (`--request-timeout-ms`: rank 0's evaluations and checkpoints must fit in it), and for
/// the ring to form `client.recovery_timeout`. `training.tcp`, `server` and
/// `worker_timeout` concern ps jobs and are not used.
///
/// Watching it: each worker records its figures under its task in `training.metrics`
/// (`--metrics-file`, `--metrics-port`: global_step, steps and steps_per_s, loss,
/// bytes_sent and its rate, ring_workers, ring_rank, ring_generation, ring_regroups, and
/// on rank 0 the scores of its evaluations), rank 0 logs the progress line every
/// `metrics.progress`, and an evaluator task beside the workers (a cluster of workers and
/// evaluators, no ps) scores the checkpoints rank 0 writes as they appear
/// (`follow_checkpoints`: it needs `training.checkpoint.directory`).
///
/// Returns 0, or 1 with one line naming the cause (the ring could not be formed again
/// within `client.recovery_timeout`, say); a job started again resumes from the newest
/// checkpoint. Threads (in-process) form no ring again: a lost one ends the job.
template <Model M, Optimizer O>
int run_all_reduce(const Job& job, const Training<M>& training, O optimizer) {
  static_assert(!TableModel<M>, "run_all_reduce trains dense models: a model with embedding tables needs ps tasks");
  try {
    if (training.last_step <= 0) throw Error(ErrorCode::kInvalidArgument, "Training::last_step must be positive");
    if (!training.model || !training.data) {
      throw Error(ErrorCode::kInvalidArgument, "Training needs a model and a data source");
    }
    check_optimizer_settings(optimizer);
    if (job.in_process()) {
      MetricsReporter reporter(training.metrics, "in-process");
      Metrics* metrics = reporter.enabled() ? &reporter.metrics() : nullptr;
      auto ring = InProcessRing::make(job.local_workers, training.client.request_timeout);
      std::vector<std::string> failures(ring.size());
      std::vector<bool> lost_neighbour(ring.size());
      std::vector<std::jthread> threads;
      for (std::size_t r = 0; r < ring.size(); ++r) {
        threads.emplace_back([&, r] {
          try {
            runner_detail::train_on_ring(std::move(ring[r]), training, optimizer,
                                         Node::worker(static_cast<std::uint32_t>(r)).name(), metrics);
          } catch (const std::exception& e) {
            failures[r] = "worker:" + std::to_string(r) + ": " + e.what();
            const auto* error = dynamic_cast<const Error*>(&e);
            lost_neighbour[r] = error != nullptr && (error->code() == ErrorCode::kUnavailable ||
                                                     error->code() == ErrorCode::kDeadlineExceeded);
          }
        });
      }
      threads.clear();
      // The cause, not its echo: a worker that failed on its own before those that lost it.
      for (const bool echo : {false, true}) {
        for (std::size_t r = 0; r < failures.size(); ++r) {
          if (!failures[r].empty() && lost_neighbour[r] == echo) throw std::runtime_error(failures[r]);
        }
      }
      return 0;
    }
    const TfConfig& cluster = *job.cluster;
    for (const char* role : {"ps", "chief"}) {
      if (!cluster.cluster.tasks(role).empty()) {
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("an all-reduce job's tasks are workers (and evaluators) only: its cluster has ") + role +
                        " tasks");
      }
    }
    const std::vector<std::string>& workers = cluster.cluster.tasks("worker");
    const auto num_workers = static_cast<std::uint32_t>(workers.size());
    if (cluster.task.type == "evaluator") {  // scores rank 0's checkpoints as they appear
      if (training.checkpoint.directory.empty()) {
        throw Error(ErrorCode::kInvalidArgument,
                    "an all-reduce job's evaluator scores the checkpoints worker 0 writes: give the job a "
                    "checkpoint directory (--checkpoint-dir), the same on every task");
      }
      MetricsReporter reporter(training.metrics, "evaluator-" + std::to_string(cluster.task.index),
                               metrics_port_offset("evaluator", cluster.task.index, 0, 0, num_workers, job.join));
      runner_detail::follow_checkpoints(training, reporter.enabled() ? &reporter.metrics() : nullptr);
      return 0;
    }
    if (cluster.task.type != "worker") {
      throw Error(ErrorCode::kInvalidArgument, "an all-reduce job's tasks are workers (and evaluators) only: this "
                                               "task is a " + cluster.task.type);
    }
    MetricsReporter reporter(training.metrics, "worker-" + std::to_string(cluster.task.index),
                             metrics_port_offset("worker", cluster.task.index, 0, 0, num_workers, job.join));
    TcpRingOptions options;
    options.form_timeout = training.client.recovery_timeout;
    options.timeout = training.client.request_timeout;
    options.local_sockets = training.tcp.local_sockets;
    options.shared_memory = training.tcp.shared_memory;
    TcpRingRendezvous rendezvous(workers.at(cluster.task.index), job.credentials, options);
    RingView view;
    if (job.join) {
      log(LogLevel::kInfo, "all-reduce: worker " + std::to_string(cluster.task.index) + " at " + rendezvous.address() +
                               " checks in to join the running ring");
      view = rendezvous.join(workers);
    } else {
      view = TcpRingRendezvous::first(cluster.task.index, workers);
    }
    // The first ring of a job that starts must form whole; a joiner's, whose members may be
    // lost meanwhile, is formed again without them.
    std::optional<TcpRing> ring;
    for (int attempt = 1; !ring; ++attempt) {
      try {
        ring.emplace(rendezvous.form(view));
      } catch (const Error& e) {
        if (view.generation == 0 || !runner_detail::ring_lost(e) || attempt == 8) throw;
        view = rendezvous.regroup(view, RingProgress{});
      }
    }
    runner_detail::train_on_ring(std::move(*ring), training, std::move(optimizer), Node::worker(cluster.task.index).name(),
                                 reporter.enabled() ? &reporter.metrics() : nullptr, &rendezvous, std::move(view));
    return 0;
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("all-reduce: ") + e.what());
    return 1;
  }
}

}  // namespace pulley
