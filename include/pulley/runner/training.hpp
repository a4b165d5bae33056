// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/client/options.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/transport/tcp_options.hpp"

namespace pulley {

/// What the chief (or the evaluator) knows at an evaluation.
struct Evaluation {
  Node::Role role = Node::Role::kChief;  ///< who evaluates: kChief or kEvaluator
  std::int64_t step = 0;               ///< the global step of the parameters (Snapshot::step)
  bool consistent = true;              ///< every ps was read at that step (Snapshot::consistent)
  bool last = false;                   ///< the evaluation at the last step
  double seconds = 0.0;                ///< since the chief initialized the variables (chief)
  double samples_per_s = 0.0;          ///< step × samples_per_step / seconds (chief)
  std::vector<Stats> stats;            ///< every member ps's counters, in member order (the chief's last evaluation)
  /// The job's workers at the last step, ascending, once workers joined or left (the
  /// chief's last evaluation); empty while they are the cluster spec's.
  std::vector<std::uint32_t> workers;
  /// For a model with embedding tables: writes the rows of `ids` of table `table` (its
  /// index in `model.tables()`) into `out` (`ids.size() × dim` floats), a row not held
  /// reading as its initial value. They are the evaluated checkpoint's (an evaluator task
  /// on a checkpoint directory; the chief at a step it checkpointed), else the ps tasks'
  /// as they are when read (the chief; an evaluator on live snapshots). Valid during the
  /// `evaluate` call only; empty for a model without tables.
  std::function<void(std::size_t table, std::span<const std::uint64_t> ids, std::span<float> out)> rows;
  /// Records a score of this evaluation (`report("test_accuracy", 0.88)`) in the task's
  /// metrics (`Training::metrics`: the JSON lines and the Prometheus port), beside the
  /// step it was made at (`evaluation_step`). A name is [a-zA-Z_][a-zA-Z0-9_]*. Does
  /// nothing when the job reports no metrics. Valid during the `evaluate` call only.
  std::function<void(std::string_view name, double value)> report = [](std::string_view, double) {};
};

/// Which of a job's data a worker reads, and from where. A source reads by `batch()` when
/// the sync policy numbers batches, else by `share()` and `start_step`.
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
  /// The job's workers now, ascending, once workers joined or left (Chief::change_workers);
  /// empty while they are 0 .. count - 1, or when nobody tracks it. See `share`.
  std::function<std::vector<std::uint32_t>()> workers;
  /// See `batch`.
  std::function<std::int64_t()> number;

  /// The number of the batch the call of the source in progress reads, counted from the
  /// job's start (Token::batch; -1 when the sync policy does not number batches, as Async
  /// does not, or outside a call). SyncReplicas numbers each step's batches by the step and
  /// BoundedStaleness by each worker's clock, the same in every worker: a source that
  /// reads batch b as position b mod B of epoch b div B, B batches an epoch, in an order
  /// every worker derives alike, gives each step the same examples whoever reads them. So
  /// under SyncReplicas a lost worker's batches are read by the others within the epoch (a
  /// returning worker reads its own again), and a resumed job reads what the
  /// uninterrupted one would have, without `start_step`.
  [[nodiscard]] std::int64_t batch() const { return number ? number() : -1; }

  /// This worker's share among the job's workers not lost: {its rank among them, their
  /// count}, for a source of unnumbered batches (`batch()` is -1). A source that splits
  /// each epoch's data by `share()` at the epoch's start hands a lost worker's data to the
  /// others from the next epoch on (and takes it back when it returns), and shares it with
  /// workers that joined, or among those left after one left for good; with no worker lost
  /// and none changed it is {index, count}. While workers disagree on who is lost (a
  /// heartbeat apart), an epoch may read a few batches twice or not at all.
  [[nodiscard]] std::pair<std::uint32_t, std::uint32_t> share() const {
    const std::vector<std::uint32_t> gone = lost ? lost() : std::vector<std::uint32_t>{};
    std::vector<std::uint32_t> all = workers ? workers() : std::vector<std::uint32_t>{};
    if (all.empty()) {
      for (std::uint32_t w = 0; w < count; ++w) all.push_back(w);
    }
    if (std::binary_search(gone.begin(), gone.end(), index) ||
        !std::binary_search(all.begin(), all.end(), index)) {
      return {index % static_cast<std::uint32_t>(std::max<std::size_t>(all.size(), 1)),
              static_cast<std::uint32_t>(std::max<std::size_t>(all.size(), 1))};
    }
    std::uint32_t rank = 0, live = 0;
    for (const std::uint32_t w : all) {
      if (std::binary_search(gone.begin(), gone.end(), w)) continue;
      ++live;
      if (w < index) ++rank;
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
  /// Checkpoints kept, newest first (0: all), and those they need.
  std::size_t keep = 5;
  /// Every how many checkpoints one is full, for a model with embedding tables: those
  /// between are incremental, their tables holding only the rows touched since the
  /// checkpoint before (and the ids evicted since), so their size follows the rows
  /// training touched, not the table's. A restore reads the newest full checkpoint and
  /// applies the incremental ones after it. 1: every checkpoint is full. The first
  /// checkpoint after a resume or a rollback is always full.
  std::int64_t full_every = 1;
};

/// What a training job sets that does not depend on its model: its schedule, checkpoints,
/// metrics, seed and the transports' deadlines. `Training<M>` adds the model-typed parts,
/// and a runner that trains a wrapped model copies these whole.
struct TrainingOptions {
  /// Checkpoints: where, how often, how many kept; and resuming from them.
  CheckpointOptions checkpoint;
  /// Training ends when the global step reaches it.
  std::int64_t last_step = 0;
  /// Global steps between evaluations; 0 evaluates at the end only.
  std::int64_t evaluate_every = 0;
  /// Examples per global step, for samples/s (batch × batches aggregated into a step).
  std::int64_t samples_per_step = 0;
  /// Global steps an epoch has, for the chief's progress line (0: it shows no epoch).
  std::int64_t steps_per_epoch = 0;
  /// Where every task reports its figures, and how often the chief prints its progress.
  MetricsOptions metrics;
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

  /// With copies of every shard (`tcp.replicas`): how long a ps process serves the tasks
  /// without hearing the chief (ShardCopies::set_chief_lease), three quarters of the
  /// shorter of the copy timeout (after which the chief may rule it lost) and the worker
  /// timeout (after which it may hold lost a worker cut off with the chief, and complete a
  /// step without it); zero without copies.
  [[nodiscard]] std::chrono::milliseconds chief_lease() const noexcept {
    return tcp.replicas == 0 ? std::chrono::milliseconds(0) : std::min(tcp.copy_timeout, worker_timeout) * 3 / 4;
  }
  /// How often the chief beats: `client.heartbeat_interval`, and with copies at least
  /// every sixth of the time its lease is three quarters of. A beat round waits up to an
  /// interval for a ps that does not answer, so a ps that does hears the chief at least
  /// every third of it: twice within its lease.
  [[nodiscard]] std::chrono::milliseconds chief_heartbeat_interval() const noexcept {
    if (tcp.replicas == 0) return client.heartbeat_interval;
    return std::min(client.heartbeat_interval,
                    std::max(std::min(tcp.copy_timeout, worker_timeout) / 6, std::chrono::milliseconds(1)));
  }
};

/// A training job as the role runner needs it: everything but where its tasks run.
template <Model M>
struct Training : TrainingOptions {
  /// Makes a fresh model. Every task makes its own; their variables must be the same.
  std::function<M()> model;
  /// A worker's batches: a function that gives the next batch each time it is called (the
  /// batch may view storage the function owns until the next call), for its share of the
  /// data and the step it starts at (DataShard).
  std::function<std::function<typename M::Batch()>(const DataShard& shard)> data;
  /// Called by the chief (and an evaluator task) with `model` holding the parameters of one
  /// global step; optional (without it the chief logs its progress).
  std::function<void(M& model, const Evaluation& evaluation)> evaluate;
};

}  // namespace pulley
