// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
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
#include "pulley/runner/training.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "pulley/transport/tcp_ring.hpp"

namespace pulley {
namespace runner_detail {

/// Rank `rank`'s training in an all-reduce job, over `ring`: start (from the newest
/// checkpoint, rank 0 reading it, or from the seed), then step until `last_step`; rank 0
/// evaluates, checkpoints and reports as a chief does.
template <Model M, Optimizer O, Ring R>
void train_on_ring(std::size_t rank, R ring, const Training<M>& training, O optimizer) {
  const std::size_t ranks = ring.size();
  AllReduceWorker worker(training.model(), std::move(optimizer), std::move(ring));
  const CheckpointOptions& saving = training.checkpoint;
  std::optional<CheckpointDirectory> directory;
  if (rank == 0 && !saving.directory.empty()) directory.emplace(saving.directory, saving.keep);
  if (rank == 0) {
    std::optional<std::pair<ModelState, std::filesystem::path>> latest;
    if (directory) latest = directory->latest();
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
  worker.synchronize(0);  // rank 0's replica, restored or fresh, on every rank
  const std::int64_t start_step = worker.global_step();

  DataShard shard;
  shard.index = static_cast<std::uint32_t>(rank);
  shard.count = static_cast<std::uint32_t>(ranks);
  shard.start_step = start_step;
  // Batch s × N + rank at step s: what SyncReplicas with R = N numbers, so the job reads
  // the examples a ps job of as many workers reads, and a resumed one what it would have.
  shard.number = [&] { return worker.global_step() * static_cast<std::int64_t>(ranks) + static_cast<std::int64_t>(rank); };
  auto source = training.data(shard);

  const auto started = std::chrono::steady_clock::now();
  auto last_save = started;
  auto evaluate = [&](bool last) {
    if (rank != 0 || !training.evaluate) return;
    Evaluation e;
    e.step = worker.global_step();
    e.last = last;
    e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    e.samples_per_s = e.seconds > 0 ? static_cast<double>((e.step - start_step) * training.samples_per_step) / e.seconds : 0.0;
    training.evaluate(worker.model(), e);
  };
  auto save = [&] {
    if (!directory) return;
    const auto path = directory->save(worker.state());
    last_save = std::chrono::steady_clock::now();
    log(LogLevel::kInfo, "all-reduce: saved " + path.string());
  };
  if (rank == 0) {
    log(LogLevel::kInfo, "all-reduce: " + std::to_string(ranks) + " workers in the ring, from global step " +
                             std::to_string(start_step) + " to " + std::to_string(training.last_step));
  }
  while (worker.global_step() < training.last_step) {
    const AllReduceStep done = worker.step(source());
    if (!done.applied && rank == 0) {
      log(LogLevel::kWarning, "all-reduce: step " + std::to_string(done.global_step) +
                                  "'s mean gradient was not finite: no worker applied it");
    }
    const std::int64_t step = worker.global_step();
    if (step == training.last_step) break;
    if (training.evaluate_every > 0 && step % training.evaluate_every == 0) evaluate(false);
    const bool by_steps = saving.save_steps > 0 && step % saving.save_steps == 0;
    const bool by_time = saving.save_secs.count() > 0 && std::chrono::steady_clock::now() - last_save >= saving.save_secs;
    if (rank == 0 && (by_steps || by_time)) save();
  }
  if (rank == 0) save();
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
/// Worker 0 does a chief's work: it starts every replica (from the newest checkpoint in
/// `training.checkpoint.directory`, else from `training.seed`), evaluates every
/// `evaluate_every` steps and at the end (`Evaluation::role` kChief, no ps `stats`),
/// and checkpoints (by steps, by time, and at the end; `CheckpointDirectory`, the format a
/// ps job writes). Batches are numbered as SyncReplicas with R = N numbers them
/// (`DataShard::batch`). A worker waits for its neighbours `client.request_timeout`
/// (`--request-timeout-ms`: rank 0's evaluations and checkpoints must fit in it), and for
/// the ring to form `client.recovery_timeout`. `training.metrics`, `tcp`, `server` and
/// `worker_timeout` concern ps jobs and are not used.
///
/// Returns 0, or 1 with one line naming the cause: a lost worker ends the job (the ring
/// is not rebuilt around it yet), and a job started again resumes from the newest
/// checkpoint.
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
      auto ring = InProcessRing::make(job.local_workers, training.client.request_timeout);
      std::vector<std::string> failures(ring.size());
      std::vector<bool> lost_neighbour(ring.size());
      std::vector<std::jthread> threads;
      for (std::size_t r = 0; r < ring.size(); ++r) {
        threads.emplace_back([&, r] {
          try {
            runner_detail::train_on_ring(r, std::move(ring[r]), training, optimizer);
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
    for (const char* role : {"ps", "chief", "evaluator"}) {
      if (!cluster.cluster.tasks(role).empty()) {
        throw Error(ErrorCode::kInvalidArgument, std::string("an all-reduce job's tasks are workers only: its cluster has ") +
                                                     role + " tasks");
      }
    }
    if (cluster.task.type != "worker") {
      throw Error(ErrorCode::kInvalidArgument, "an all-reduce job's tasks are workers only: this task is a " +
                                                   cluster.task.type);
    }
    TcpRingOptions options;
    options.form_timeout = training.client.recovery_timeout;
    options.timeout = training.client.request_timeout;
    TcpRing ring(cluster.task.index, cluster.cluster.tasks("worker"), job.credentials, options);
    runner_detail::train_on_ring(cluster.task.index, std::move(ring), training, std::move(optimizer));
    return 0;
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("all-reduce: ") + e.what());
    return 1;
  }
}

}  // namespace pulley
