// SPDX-License-Identifier: MIT
// Trains a 784-H-10 MLP (H: --hidden, 128 by default) on Fashion-MNIST with a
// parameter-server job: every task as a thread of this process (the default), or this
// process as one task of a TCP cluster
// (TF_CONFIG, --role/--task/--*-hosts, or --slurm-roles under srun). The role runner
// (pulley/runner/run.hpp) does the rest; `fashion_mnist --help` lists the flags. With
// --mode allreduce there are no ps tasks: the workers sum their gradients in a ring
// (pulley/runner/all_reduce.hpp), in threads or as a cluster of workers only. --mode plain
// trains the same model in one thread with no ps: the baseline a job's speed is set against.
//
// It prints one line per epoch and ends with a machine-readable line:
//   final: test_accuracy=0.8812 samples_per_s=71234 epochs=10 workers=2 ps=2 mode=sync parameters_crc32c=1f2e3d4c
// (ps: the ps tasks the job ended with, fewer than it started with when one left it:
// --ps-leave-secs).

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fashion_mnist/idx.hpp"
#include "pulley/checkpoint/crc32c.hpp"
#include "pulley/models/mlp.hpp"
#include "pulley/pulley.hpp"
#include "pulley/runner/all_reduce.hpp"
#include "pulley/runner/flags.hpp"
#include "pulley/runner/run.hpp"

#ifndef PULLEY_FASHION_MNIST_DIR
#define PULLEY_FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#endif

// OpenBLAS runs each gemm on a thread per core by default; with one worker thread per core
// that only adds contention. Weak, so another BLAS links too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

struct Options {
  std::string optimizer = "adam";
  float learning_rate = 1e-3F;
  std::string mode = "sync";
  int replicas_to_aggregate = 0;  // 0: every worker
  std::int64_t staleness = 3;
  int epochs = 10;
  std::int64_t max_steps = 0;  // 0: every epoch's steps
  std::size_t batch = 64;
  std::size_t shards = 1;      // parts per variable (FixedShards); 1: whole variables
  std::size_t hidden = 128;  // the hidden layer's width: the model's size
  std::uint64_t seed = 1;
  std::string data = PULLEY_FASHION_MNIST_DIR;
  pulley::CheckpointOptions checkpoint;  // --checkpoint-dir, --save-checkpoint-steps, ...
  pulley::ClientOptions client;     // --request-timeout-ms, --clip-norm, ...
  pulley::TcpOptions tcp;           // --connect-timeout-ms, ...
  pulley::TcpServerOptions server;  // --ps-max-buffered-bytes, ...
  pulley::MetricsOptions metrics;   // --metrics-file, --metrics-port, --progress-secs, ...
  std::chrono::milliseconds worker_timeout{std::chrono::seconds(5)};  // --worker-timeout-ms
};

struct Data {
  fashion_mnist::Split train;
  fashion_mnist::Split test;
};

// Standardizes pixels with the training set's mean and standard deviation (both splits,
// the same constants), which speeds up early training of a ReLU MLP.
void standardize(Data& data) {
  const auto& train = data.train.images.pixels;
  const double mean =
      std::accumulate(train.begin(), train.end(), 0.0) / static_cast<double>(train.size());
  double var = 0.0;
  for (float p : train) var += (p - mean) * (p - mean);
  const auto inv_std = static_cast<float>(1.0 / std::sqrt(var / static_cast<double>(train.size())));
  for (auto* pixels : {&data.train.images.pixels, &data.test.images.pixels}) {
    for (float& p : *pixels) p = (p - static_cast<float>(mean)) * inv_std;
  }
}

/// A worker's batches.
///   - Numbered (sync and bounded staleness: DataShard::batch): batch b is position b mod B
///     of epoch b div B, each epoch one shuffle of every example seeded by the job's seed
///     and the epoch, alike in every worker. A step reads the same examples whoever takes
///     its tokens: a lost worker's batches are read by the others within the epoch.
///   - Unnumbered (async): its share of the examples (rank, rank + count, ... among the
///     workers not lost), reshuffled every pass, starting `start_step` batches in, so that a
///     resumed job reads what the uninterrupted one would have. Each pass splits the
///     examples anew over the workers then alive: a lost worker's examples go to the others.
class Shard {
 public:
  Shard(const Data& data, std::size_t batch, std::uint64_t seed, pulley::DataShard shard)
      : data_(&data), shard_(std::move(shard)), seed_(seed), rng_(seed * 7919 + shard_.index),
        features_(batch * 784), labels_(batch) {}

  pulley::models::MlpBatch operator()() {
    const std::int64_t number = shard_.batch();
    const std::size_t first = number >= 0 ? numbered(number) : advance();
    const auto& pixels = data_->train.images.pixels;
    for (std::size_t r = 0; r < labels_.size(); ++r) {
      const std::size_t e = (number >= 0 ? epoch_order_ : order_)[first + r];
      std::copy_n(pixels.begin() + static_cast<std::ptrdiff_t>(e * 784), 784,
                  features_.begin() + static_cast<std::ptrdiff_t>(r * 784));
      labels_[r] = data_->train.labels[e];
    }
    return {features_, labels_};
  }

 private:
  /// Where batch `number` starts in its epoch's order (shuffled here when it is new).
  std::size_t numbered(std::int64_t number) {
    const std::size_t examples = data_->train.labels.size();
    const auto per_epoch = static_cast<std::int64_t>(examples / labels_.size());
    if (const std::int64_t epoch = number / per_epoch; epoch != epoch_) {
      epoch_ = epoch;
      epoch_order_.resize(examples);
      std::iota(epoch_order_.begin(), epoch_order_.end(), std::size_t{0});
      pulley::SplitMix64 rng(seed_ * 104729 + static_cast<std::uint64_t>(epoch));
      for (std::size_t i = examples - 1; i > 0; --i) std::swap(epoch_order_[i], epoch_order_[rng.next() % (i + 1)]);
    }
    return static_cast<std::size_t>(number % per_epoch) * labels_.size();
  }

  /// Moves on by one batch (reshuffling when a pass is done), after skipping the batches of
  /// the steps before `start_step` on the first call; returns where it starts.
  std::size_t advance() {
    if (!skipped_) {
      skipped_ = true;
      for (std::int64_t s = 0; s < shard_.start_step; ++s) (void)advance();
    }
    const std::size_t batch = labels_.size();
    if (next_ + batch > order_.size()) {
      if (const auto share = shard_.share(); share != share_ || order_.empty()) {
        share_ = share;
        order_.clear();
        const std::size_t examples = data_->train.labels.size();
        for (std::size_t i = share.first; i < examples; i += share.second) order_.push_back(i);
        order_.resize(examples / share.second);
      }
      for (std::size_t i = order_.size() - 1; i > 0; --i) {  // Fisher–Yates
        std::swap(order_[i], order_[rng_.next() % (i + 1)]);
      }
      next_ = 0;
    }
    next_ += batch;
    return next_ - batch;
  }

 private:
  const Data* data_;
  pulley::DataShard shard_;
  std::uint64_t seed_;
  std::int64_t epoch_ = -1;               ///< numbered: the epoch `epoch_order_` holds
  std::vector<std::size_t> epoch_order_;  ///< ... its order of every example
  std::pair<std::uint32_t, std::uint32_t> share_;  ///< unnumbered: the share `order_` holds
  pulley::SplitMix64 rng_;
  std::vector<std::size_t> order_;
  std::size_t next_ = 0;
  bool skipped_ = false;  ///< the batches before start_step were skipped
  std::vector<float> features_;
  std::vector<std::int32_t> labels_;
};

/// The global step training ends at: every epoch's, or --max-steps where that is fewer.
std::int64_t last_step(const Options& o, std::int64_t steps_per_epoch) {
  const std::int64_t all = steps_per_epoch * o.epochs;
  return o.max_steps > 0 && o.max_steps < all ? o.max_steps : all;
}

/// Trains with `sync` pacing; `batches_per_step` batches make one global step, which the
/// epoch is counted in.
template <class Optimizer, class Sync>
int train(const pulley::Job& job, const Options& o, const Data& data, Optimizer optimizer,
          Sync sync, std::int64_t batches_per_step) {
  const std::uint32_t workers = job.num_workers();
  const auto batches_per_worker = static_cast<std::int64_t>(data.train.labels.size() / workers / o.batch);
  const std::int64_t steps_per_epoch = batches_per_worker * workers / batches_per_step;
  if (steps_per_epoch == 0) {
    throw std::runtime_error("an epoch has fewer batches than one step aggregates: lower "
                             "--replicas-to-aggregate or --batch");
  }
  const pulley::models::MlpBatch test{data.test.images.pixels, data.test.labels};

  pulley::Training<pulley::models::Mlp> training;
  training.model = [hidden = o.hidden] { return pulley::models::Mlp({784, hidden, 10}); };
  training.data = [&](const pulley::DataShard& shard) { return Shard(data, o.batch, o.seed, shard); };
  training.last_step = last_step(o, steps_per_epoch);
  training.evaluate_every = steps_per_epoch;
  training.samples_per_step = static_cast<std::int64_t>(o.batch) * batches_per_step;
  training.steps_per_epoch = steps_per_epoch;
  training.metrics = o.metrics;
  training.seed = o.seed;
  training.checkpoint = o.checkpoint;
  training.client = o.client;
  training.tcp = o.tcp;
  training.server = o.server;
  training.worker_timeout = o.worker_timeout;
  training.evaluate = [&](pulley::models::Mlp& model, const pulley::Evaluation& e) {
    const auto scores = model.evaluate(test);
    e.report("test_loss", scores.loss);
    e.report("test_accuracy", scores.accuracy);
    if (e.role == pulley::Node::Role::kEvaluator) {
      std::printf("evaluation at step %lld: test_loss %.4f test_accuracy %.4f\n",
                  static_cast<long long>(e.step), scores.loss, scores.accuracy);
    } else {
      std::printf(
          "epoch %2lld/%d  step %6lld  test_loss %.4f  test_accuracy %.4f  samples/s %.0f  "
          "elapsed %.1f s%s\n",
          static_cast<long long>(e.step / steps_per_epoch), o.epochs, static_cast<long long>(e.step),
          scores.loss, scores.accuracy, e.samples_per_s, e.seconds,
          e.consistent ? "" : "  (ps tasks read at different steps)");
    }
    if (e.last && e.role == pulley::Node::Role::kChief) {  // the chief's summary of the job
      std::int64_t stale = 0, applied = 0, refused = 0, repeated = 0;
      const bool ps_job = o.mode != "allreduce";
      for (const pulley::Stats& s : e.stats) {
        stale += s.stale_gradients_dropped;
        applied += s.updates_applied;
        refused += s.updates_refused;
        repeated += s.pushes_repeated;
      }
      if (ps_job) {
        std::printf("updates applied: %lld, stale gradients dropped: %lld, updates refused: %lld, "
                    "pushes sent again after a lost connection: %lld\n",
                    static_cast<long long>(applied), static_cast<long long>(stale),
                    static_cast<long long>(refused), static_cast<long long>(repeated));
      }
      // The parameters' CRC-32C: two runs that end bit for bit alike print the same.
      std::uint32_t fingerprint = 0;
      for (std::size_t v = 0; v < model.variables().size(); ++v) {
        fingerprint = pulley::checkpoint::crc32c(std::span<const float>(model.parameter(v)), fingerprint);
      }
      std::printf(
          "final: test_accuracy=%.4f samples_per_s=%.0f epochs=%d workers=%u ps=%u mode=%s "
          "parameters_crc32c=%08x\n",
          scores.accuracy, e.samples_per_s, o.epochs,
          e.workers.empty() ? workers : static_cast<unsigned>(e.workers.size()),  // joined or left: the job's now
          static_cast<unsigned>(e.stats.size()), o.mode.c_str(), fingerprint);
    }
    std::fflush(stdout);
  };
  const bool all_reduce = o.mode == "allreduce";
  const bool reports = job.in_process() || job.cluster->task.type == (all_reduce ? "worker" : "chief");
  if (reports && (!all_reduce || job.in_process() || job.cluster->task.index == 0)) {
    std::printf("training 784-%zu-10 on %zu examples: %s, %u ps, %u workers, %s, %s, batch %zu, "
                "%d epochs (%lld steps)\n",
                o.hidden, data.train.labels.size(), job.name().c_str(), all_reduce ? 0U : job.num_ps(), workers,
                o.optimizer.c_str(), o.mode.c_str(), o.batch, o.epochs,
                static_cast<long long>(training.last_step));
    std::fflush(stdout);
  }
  if (all_reduce) return pulley::run_all_reduce(job, training, optimizer);
  // FixedShards{1} places as RoundRobin does: whole variables, dealt to the ps tasks in turn.
  return pulley::run(job, training, pulley::FixedShards{o.shards}, optimizer, sync);
}

/// --mode plain: the same model, data and optimizer in one thread and no ps, the baseline
/// the job's samples/s is measured against (BENCHMARKS.md, "Two workers on two cores").
/// Each step is one batch of workers × batch examples, as many as a sync step of the job
/// applies (from each epoch's shuffled order, as the job's workers read), and the optimizer
/// updates every variable in place. Evaluates and prints as the chief does, at every
/// epoch; samples/s counts the time up to the last step, as the job's does (the
/// evaluations before it included: one after another here, beside the workers in the job).
/// Its final line also gives the mean time of a step's optimizer updates
/// (update_us_per_step), which benchmarks/scaling.py sets apart from the step's compute.
template <class Optimizer>
int train_plain(const Options& o, const Data& data, Optimizer optimizer, std::uint32_t workers) {
  const std::size_t batch = o.batch * workers;
  const auto steps_per_epoch = static_cast<std::int64_t>(data.train.labels.size() / batch);
  const std::int64_t last = last_step(o, steps_per_epoch);
  std::int64_t step = 0;
  pulley::DataShard numbered;
  numbered.number = [&step] { return step; };
  Shard shard(data, batch, o.seed, std::move(numbered));
  pulley::models::Mlp model({784, o.hidden, 10});
  model.initialize(o.seed);
  std::vector<typename Optimizer::State> states;
  for (std::size_t v = 0; v < model.variables().size(); ++v) states.push_back(optimizer.make_state(model.parameter(v).size()));
  const pulley::models::MlpBatch test{data.test.images.pixels, data.test.labels};
  std::printf("training 784-%zu-10 on %zu examples: one thread, no ps, %s, batch %zu (%u x %zu), %d epochs (%lld steps)\n",
              o.hidden, data.train.labels.size(), o.optimizer.c_str(), batch, workers, o.batch, o.epochs,
              static_cast<long long>(last));
  const auto start = std::chrono::steady_clock::now();
  double seconds = 0.0;
  double update_seconds = 0.0;  // of them in the optimizer's updates
  pulley::models::Mlp::Evaluation scores;
  for (; step < last;) {
    (void)model.compute_gradients(shard());
    const pulley::UpdateContext context{step, {}, {}, 0};
    const auto updating = std::chrono::steady_clock::now();
    for (std::size_t v = 0; v < states.size(); ++v) {
      pulley::apply_update(optimizer, states[v], model.parameter(v), model.gradient(v), context);
    }
    update_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - updating).count();
    if (++step % steps_per_epoch == 0 || step == last) {
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      scores = model.evaluate(test);
      std::printf("epoch %2lld/%d  step %6lld  test_loss %.4f  test_accuracy %.4f  samples/s %.0f  elapsed %.1f s\n",
                  static_cast<long long>(step / steps_per_epoch), o.epochs, static_cast<long long>(step), scores.loss,
                  scores.accuracy, static_cast<double>(step) * static_cast<double>(batch) / seconds, seconds);
      std::fflush(stdout);
    }
  }
  std::uint32_t fingerprint = 0;
  for (std::size_t v = 0; v < model.variables().size(); ++v) {
    fingerprint = pulley::checkpoint::crc32c(std::span<const float>(model.parameter(v)), fingerprint);
  }
  std::printf("final: test_accuracy=%.4f samples_per_s=%.0f epochs=%d workers=1 ps=0 mode=plain batch=%zu "
              "update_us_per_step=%.1f parameters_crc32c=%08x\n",
              scores.accuracy, static_cast<double>(last) * static_cast<double>(batch) / seconds, o.epochs, batch,
              update_seconds / static_cast<double>(last) * 1e6, fingerprint);
  return 0;
}

template <class Optimizer>
int train_with(const pulley::Job& job, const Options& o, const Data& data, Optimizer optimizer) {
  const auto workers = static_cast<int>(job.num_workers());
  if (o.mode == "plain") {
    if (!job.in_process()) throw std::runtime_error("--mode plain trains in this one process: it takes no cluster");
    return train_plain(o, data, optimizer, job.num_workers());
  }
  if (o.mode == "async") return train(job, o, data, optimizer, pulley::Async{}, 1);
  // No ps tasks: the workers sum their gradients in a ring, every step one batch of each.
  if (o.mode == "allreduce") return train(job, o, data, optimizer, pulley::SyncReplicas(workers, workers), workers);
  if (o.mode == "ssp") {  // a global step is every worker's next batch
    return train(job, o, data, optimizer, pulley::BoundedStaleness(o.staleness, workers), workers);
  }
  // Without --replicas-to-aggregate, R = N: one batch of every worker, however many join
  // or leave the running job.
  const int r = o.replicas_to_aggregate > 0 ? o.replicas_to_aggregate : workers;
  const int asked = o.replicas_to_aggregate > 0 ? r : pulley::SyncReplicas::kEveryWorker;
  return train(job, o, data, optimizer, pulley::SyncReplicas(asked, workers), r);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trains a 784-128-10 MLP on Fashion-MNIST with a parameter-server job."};
  Options o;
  pulley::JobFlags job_flags;
  job_flags.ps = 2;  // in-process default: 2 ps tasks and 2 workers
  app.add_option("--optimizer", o.optimizer)->check(CLI::IsMember({"adam", "sgd", "momentum", "adagrad"}));
  app.add_option("--learning-rate", o.learning_rate)->check(CLI::PositiveNumber);
  app.add_option("--mode", o.mode,
                 "sync (SyncReplicas), async, ssp (BoundedStaleness), allreduce (no ps tasks: "
                 "a ring all-reduce among the workers, a cluster of workers only), or plain (one "
                 "thread, no ps: the baseline; a step is one batch of --workers x --batch examples)")
      ->check(CLI::IsMember({"sync", "async", "ssp", "allreduce", "plain"}));
  app.add_option("--replicas-to-aggregate", o.replicas_to_aggregate,
                 "sync: gradients per step, R (default: every worker); R < workers adds backups "
                 "(an epoch then counts the R*batch examples each step applies)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--staleness", o.staleness, "ssp: clocks a worker may run ahead of the slowest")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--epochs", o.epochs)->check(CLI::Range(1, 1000));
  app.add_option("--max-steps", o.max_steps,
                 "end training at this global step, before the last epoch ends (0: every epoch)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  app.add_option("--batch", o.batch, "examples per batch, per worker")->check(CLI::Range(1, 60000));
  app.add_option("--shards", o.shards,
                 "parts each variable is split into along its rows, dealt to the ps tasks in turn "
                 "(FixedShards; 1: whole variables, as RoundRobin places them)")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--hidden", o.hidden, "units of the hidden layer (the model's size: 795 floats per unit, plus 10)")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--seed", o.seed);
  app.add_option("--data", o.data, "directory of the *-ubyte.gz files");
  pulley::add_job_flags(app, job_flags);
  pulley::add_checkpoint_flags(app, o.checkpoint);
  pulley::add_limit_flags(app, o.client, o.tcp, o.server, o.worker_timeout);
  pulley::add_metrics_flags(app, o.metrics);
  CLI11_PARSE(app, argc, argv);
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(1);
  try {
    const pulley::Job job = pulley::resolve_job(job_flags);
    // A ps task neither trains nor scores: the labels give it the schedule (steps per
    // epoch), and the images (220 MB as floats) would only fill its memory.
    Data data;
    if (!job.in_process() && job.cluster->task.type == "ps") {
      const std::filesystem::path dir(o.data);
      data.train.labels = fashion_mnist::load_labels(dir / "train-labels-idx1-ubyte.gz");
      data.test.labels = fashion_mnist::load_labels(dir / "t10k-labels-idx1-ubyte.gz");
    } else {
      data = Data{fashion_mnist::load_split(o.data, "train"), fashion_mnist::load_split(o.data, "t10k")};
      standardize(data);
    }
    if (data.train.labels.size() / job.num_workers() < o.batch) {
      throw std::runtime_error(std::to_string(job.num_workers()) +
                               " workers leave fewer than one batch each");
    }
    const float lr = o.learning_rate;
    if (o.optimizer == "adam") return train_with(job, o, data, pulley::Adam{lr});
    if (o.optimizer == "sgd") return train_with(job, o, data, pulley::Sgd{lr});
    if (o.optimizer == "momentum") return train_with(job, o, data, pulley::Momentum{lr, 0.9F});
    return train_with(job, o, data, pulley::Adagrad{lr});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
}
