// SPDX-License-Identifier: MIT
// A click-through-rate model with embedding tables, trained by a parameter-server job on
// Criteo-shaped data with a known answer (ctr/data.hpp): a wide-and-deep model
// (ctr/wide_deep.hpp) whose two tables hold a row per categorical value, spread over the ps
// tasks by id; each worker pulls and pushes only the rows its batch uses. Every task runs
// as a thread of this process (the default), or this process is one task of a TCP cluster
// (TF_CONFIG, --role/--task/--*-hosts, or --slurm-roles under srun; scripts/launch_local.sh
// starts one on 127.0.0.1). The role runner (pulley/runner/run.hpp) does the rest, the
// checkpoints (--checkpoint-dir) hold the tables' rows, and `--score-checkpoint DIR` scores
// the newest one with no cluster; `ctr --help` lists the flags.
//
// `--dense allreduce` trains the dense layers on a ring of the workers instead (run_hybrid:
// the tables stay on the ps tasks), as recommender systems do.
//
// Ends with `final: auc=... planted_auc=... logloss=... samples_per_s=... workers=... ps=...
// mode=... parameters_crc32c=...`, planted_auc being the planted model's own AUC on the same
// held-out examples, ps the ps tasks the job ended with, and the CRC-32C that of the dense
// parameters and the rows scored (two jobs that end bit for bit alike print the same).
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ctr/data.hpp"
#include "ctr/wide_deep.hpp"
#include "pulley/checkpoint/crc32c.hpp"
#include "pulley/pulley.hpp"
#include "pulley/runner/flags.hpp"
#include "pulley/runner/hybrid.hpp"
#include "pulley/runner/run.hpp"

// OpenBLAS runs each gemm on a thread per core by default; with one worker thread per core
// that only adds contention. Weak, so another BLAS links too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string mode = "sync";
  std::string dense = "ps";  ///< where the dense layers train: "ps", or "allreduce" (run_hybrid)
  std::size_t train_examples = 4'000'000;
  std::size_t test_examples = 200'000;
  std::uint32_t vocabulary = 400'000;
  int epochs = 1;
  std::size_t batch = 128;
  std::uint32_t admit_after = 1;
  float table_learning_rate = 0.1F;
  /// Adagrad's starting sum of squares for the tables' rows. Keras' 0.1 is far larger than
  /// the squared gradients of a row a few examples of a batch use (a batch's mean loss
  /// spreads each example's gradient over the batch), and would keep the long tail of
  /// values from learning anything.
  float table_initial_accumulator = 0.001F;
  float dense_learning_rate = 0.001F;
  std::uint64_t max_rows = 0;  ///< per table and ps; 0: no cap
  std::uint64_t ps_table_bytes = 0;  ///< each ps's budget for its tables; 0: none
  int progress = 4;            ///< progress lines per epoch, each with a quick AUC
  std::uint64_t seed = 1;
  std::string data_dir = "/tmp/pulley-ctr";
  pulley::CheckpointOptions checkpoint;  // --checkpoint-dir, --save-checkpoint-steps, ...
  pulley::ClientOptions client;          // --request-timeout-ms, ...
  pulley::TcpOptions tcp;                // --connect-timeout-ms, ...
  pulley::TcpServerOptions server;       // --ps-max-buffered-bytes, ...
  pulley::MetricsOptions metrics;        // --metrics-file, --metrics-port, --progress-secs, ...
  std::chrono::milliseconds worker_timeout{std::chrono::seconds(5)};
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The data, generated into a directory of `--data-dir` once (train.bin, test.bin; one
/// process generates while the others of the job wait on a lock), and read from there when
/// a task first needs it: a worker the training examples, the chief and the evaluator the
/// held-out ones, a ps neither.
class Data {
 public:
  Data(const Options& o) : o_(o), planted_{o.seed} {
    dir_ = std::filesystem::path(o.data_dir) / ("v" + std::to_string(o.vocabulary) + "-n" +
                                                std::to_string(o.train_examples) + "-t" +
                                                std::to_string(o.test_examples));
  }

  const ctr::Planted& planted() const { return planted_; }
  const std::vector<ctr::Example>& train() {
    std::call_once(train_once_, [&] { train_ = read("train.bin"); });
    return train_;
  }
  const std::vector<ctr::Example>& test() {
    std::call_once(test_once_, [&] { test_ = read("test.bin"); });
    return test_;
  }

 private:
  std::vector<ctr::Example> read(const char* name) {
    namespace fs = std::filesystem;
    const fs::path train = dir_ / "train.bin", test = dir_ / "test.bin";
    if (!fs::exists(train) || !fs::exists(test)) {
      fs::create_directories(dir_);
      const int lock = ::open((dir_ / ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
      if (lock < 0 || ::flock(lock, LOCK_EX) != 0) throw std::runtime_error("cannot lock " + (dir_ / ".lock").string());
      if (!fs::exists(train) || !fs::exists(test)) {  // nobody generated it while we waited
        const auto start = Clock::now();
        ctr::write(train, ctr::generate(o_.train_examples, o_.vocabulary, planted_, o_.seed + 100));
        ctr::write(test, ctr::generate(o_.test_examples, o_.vocabulary, planted_, o_.seed + 200));
        std::printf("generated %zu + %zu examples into %s in %.1f s\n", o_.train_examples,
                    o_.test_examples, dir_.c_str(), seconds_since(start));
      }
      ::close(lock);
    }
    const auto start = Clock::now();
    auto examples = ctr::read(dir_ / name);
    std::printf("read %zu examples from %s in %.1f s\n", examples.size(), (dir_ / name).c_str(),
                seconds_since(start));
    std::fflush(stdout);
    return examples;
  }

  const Options& o_;
  ctr::Planted planted_;
  std::filesystem::path dir_;
  std::once_flag train_once_, test_once_;
  std::vector<ctr::Example> train_, test_;
};

/// A worker's batches. Numbered (sync: DataShard::batch): batch b is the examples of
/// position b mod B of the training set in order, whoever reads it. Unnumbered (async): a
/// contiguous block of the training examples, its share among the workers not lost (taken
/// anew each epoch), in order; a resumed job starts where this worker's batches of the
/// steps before would end (`batches_per_step` batches of all the workers make a global
/// step).
class Shard {
 public:
  Shard(const std::vector<ctr::Example>& examples, std::size_t batch, std::int64_t batches_per_step,
        pulley::DataShard shard)
      : examples_(examples), batch_(batch), shard_(std::move(shard)) {
    next_block();
    const auto done = static_cast<std::size_t>(shard_.start_step * batches_per_step / shard_.count);
    next_ = done % (block_.size() / batch_) * batch_;
  }

  ctr::WideDeep::Batch operator()() {
    if (const std::int64_t number = shard_.batch(); number >= 0) {
      const std::size_t per_epoch = examples_.size() / batch_;
      return {examples_.subspan(static_cast<std::size_t>(number) % per_epoch * batch_, batch_)};
    }
    if (next_ + batch_ > block_.size()) next_block();
    next_ += batch_;
    return {block_.subspan(next_ - batch_, batch_)};
  }

 private:
  void next_block() {
    const auto [rank, live] = shard_.share();
    const std::size_t per = examples_.size() / live / batch_ * batch_;
    if (per == 0) throw std::runtime_error("fewer examples per worker than one batch");
    block_ = std::span(examples_).subspan(rank * per, per);
    next_ = 0;
  }

  std::span<const ctr::Example> examples_;
  std::size_t batch_;
  pulley::DataShard shard_;
  std::span<const ctr::Example> block_;
  std::size_t next_ = 0;
};

/// The held-out scores of `model` (its dense parameters loaded) on the first `count`
/// held-out examples, the rows read through `evaluation.rows`.
struct Scores {
  double auc = 0.0, planted_auc = 0.0, logloss = 0.0;
  /// CRC-32C of the dense parameters, then of the rows scored (every held-out id, sorted):
  /// two runs that end bit for bit alike on what was scored print the same.
  std::uint32_t crc32c = 0;
};
Scores score(ctr::WideDeep& model, const pulley::Evaluation& evaluation,
             std::span<const ctr::Example> test, const ctr::Planted& planted) {
  std::vector<std::uint64_t> ids;
  ids.reserve(test.size() * ctr::kFields);
  for (const ctr::Example& e : test) {
    for (std::size_t f = 0; f < ctr::kFields; ++f) ids.push_back(ctr::id_of(f, e.value[f]));
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  std::vector<float> wide(ids.size()), emb(ids.size() * ctr::WideDeep::kDim);
  evaluation.rows(0, ids, wide);
  evaluation.rows(1, ids, emb);
  const auto at = [&](std::uint64_t id) {
    return static_cast<std::size_t>(std::lower_bound(ids.begin(), ids.end(), id) - ids.begin());
  };
  const auto logits = model.predict(
      test, [&](std::uint64_t id) { return wide[at(id)]; },
      [&](std::uint64_t id) { return std::span<const float>(emb).subspan(at(id) * ctr::WideDeep::kDim, ctr::WideDeep::kDim); });
  std::vector<float> labels;
  std::vector<double> planted_logits;
  Scores s;
  for (std::size_t i = 0; i < test.size(); ++i) {
    labels.push_back(test[i].label);
    planted_logits.push_back(planted.logit(test[i]));
    const double z = logits[i];
    const double softplus = z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
    s.logloss += test[i].label > 0.5F ? softplus - z : softplus;
  }
  s.logloss /= static_cast<double>(test.size());
  s.auc = ctr::auc(logits, labels);
  s.planted_auc = ctr::auc(planted_logits, labels);
  for (std::size_t v = 0; v < model.variables().size(); ++v) {
    s.crc32c = pulley::checkpoint::crc32c(std::span<const float>(model.parameter(v)), s.crc32c);
  }
  s.crc32c = pulley::checkpoint::crc32c(std::span<const float>(wide), s.crc32c);
  s.crc32c = pulley::checkpoint::crc32c(std::span<const float>(emb), s.crc32c);
  return s;
}

/// Scores the newest checkpoint in `directory` on every held-out example with no cluster:
/// the model's parameters and rows are the checkpoint's (a full one and the incremental
/// ones after it), looked up as an evaluator task looks them up.
int score_checkpoint(const Options& o, Data& data, const std::filesystem::path& directory) {
  const auto found = pulley::CheckpointDirectory::list(directory);
  if (found.empty()) throw std::runtime_error("no checkpoint in " + directory.string());
  const auto& [step, path] = found.front();
  const pulley::ModelState state = pulley::CheckpointDirectory::load(path);
  if (state.tables.size() != 2) {
    throw std::runtime_error(path.string() + " holds " + std::to_string(state.tables.size()) +
                             " tables, not the model's 2 (wide, emb)");
  }
  ctr::WideDeep model(o.admit_after, o.max_rows);
  pulley::load_parameters(state, model, path);
  const std::vector<pulley::CheckpointRows> tables = pulley::checkpoint_rows(state);
  pulley::Evaluation evaluation;
  evaluation.role = pulley::Node::Role::kEvaluator;
  evaluation.step = step;
  evaluation.rows = [&tables](std::size_t t, std::span<const std::uint64_t> ids, std::span<float> out) {
    tables.at(t).lookup(ids, out);
  };
  std::size_t rows = 0;
  for (const pulley::TableState& t : state.tables) rows += t.ids.size();
  const Scores s = score(model, evaluation, data.test(), data.planted());
  std::printf("checkpoint of global step %lld (%s, %zu rows): auc=%.4f planted_auc=%.4f logloss=%.4f "
              "parameters_crc32c=%08x on %zu held-out examples, no cluster\n",
              static_cast<long long>(step), path.string().c_str(), rows, s.auc, s.planted_auc, s.logloss,
              s.crc32c, data.test().size());
  return 0;
}

/// Trains with `sync` pacing; `batches_per_step` batches make one global step.
template <class Sync>
int train(const pulley::Job& job, const Options& o, Data& data, Sync sync, std::int64_t batches_per_step) {
  const std::uint32_t workers = job.num_workers();
  const auto batches_per_worker = static_cast<std::int64_t>(o.train_examples / workers / o.batch);
  if (batches_per_worker == 0) throw std::runtime_error("fewer examples per worker than one batch");
  const std::int64_t steps_per_epoch = batches_per_worker * workers / batches_per_step;

  pulley::Training<ctr::WideDeep> training;
  training.model = [&o] { return ctr::WideDeep(o.admit_after, o.max_rows); };
  training.data = [&](const pulley::DataShard& shard) {
    return Shard(data.train(), o.batch, batches_per_step, shard);
  };
  training.last_step = steps_per_epoch * o.epochs;
  training.evaluate_every = std::max<std::int64_t>(1, steps_per_epoch / std::max(o.progress, 1));
  if (o.progress == 0) training.evaluate_every = 0;
  training.samples_per_step = static_cast<std::int64_t>(o.batch) * batches_per_step;
  training.steps_per_epoch = steps_per_epoch;
  training.metrics = o.metrics;
  training.seed = o.seed;
  training.checkpoint = o.checkpoint;
  training.client = o.client;
  training.tcp = o.tcp;
  training.server = o.server;
  training.worker_timeout = o.worker_timeout;
  training.evaluate = [&](ctr::WideDeep& model, const pulley::Evaluation& e) {
    if (!e.rows) {
      std::printf("global step %lld: no rows to score with\n", static_cast<long long>(e.step));
      return;
    }
    const std::vector<ctr::Example>& test = data.test();
    // A quick look on a tenth of the held-out examples while training, all of them at the end.
    const std::size_t count = e.last ? test.size() : std::max<std::size_t>(test.size() / 10, 1);
    const Scores s = score(model, e, std::span(test).first(count), data.planted());
    e.report("auc", s.auc);
    e.report("logloss", s.logloss);
    if (e.role == pulley::Node::Role::kEvaluator) {
      std::printf("evaluation at global step %lld: auc %.4f logloss %.4f (%zu held-out examples)\n",
                  static_cast<long long>(e.step), s.auc, s.logloss, count);
    } else if (!e.last) {
      std::printf("global step %lld of %lld: auc %.4f on %zu held-out examples, %.0f samples/s, %.1f s\n",
                  static_cast<long long>(e.step), static_cast<long long>(training.last_step), s.auc,
                  count, e.samples_per_s, e.seconds);
    } else {
      std::int64_t rows = 0, dropped = 0, capped = 0;
      for (const pulley::Stats& st : e.stats) {
        rows += st.table_rows;
        dropped += st.table_rows_dropped;
        capped += st.table_rows_capped;
      }
      std::printf("trained %lld global steps in %.1f s; the ps tasks hold %lld rows of each table "
                  "(%lld pushed rows dropped, %lld rows capped)\n",
                  static_cast<long long>(e.step), e.seconds, static_cast<long long>(rows / 2),
                  static_cast<long long>(dropped), static_cast<long long>(capped));
      std::printf("final: auc=%.4f planted_auc=%.4f logloss=%.4f samples_per_s=%.0f workers=%u ps=%u mode=%s "
                  "parameters_crc32c=%08x\n",
                  s.auc, s.planted_auc, s.logloss, e.samples_per_s,
                  e.workers.empty() ? workers : static_cast<unsigned>(e.workers.size()),  // joined or left: the job's now
                  static_cast<unsigned>(e.stats.size()), o.mode.c_str(), s.crc32c);
    }
    std::fflush(stdout);
  };
  if (job.in_process() || job.cluster->task.type == "chief") {
    std::printf("training wide-and-deep on %zu examples (vocabulary %u per field): %s, %u ps, %u "
                "workers, %s, dense layers on %s, batch %zu, %d epochs (%lld global steps)\n",
                o.train_examples, o.vocabulary, job.name().c_str(), job.num_ps(), workers,
                o.mode.c_str(), o.dense == "allreduce" ? "a ring of the workers" : "the ps tasks", o.batch, o.epochs,
                static_cast<long long>(training.last_step));
    std::fflush(stdout);
  }
  using Tables = pulley::Tables<pulley::Adagrad>;
  const Tables tables{pulley::Adagrad{o.table_learning_rate, o.table_initial_accumulator, 1e-7F}, {}, {},
                      o.ps_table_bytes};
  if (o.dense == "allreduce") {  // the tables on the ps tasks, the MLP all-reduced (sync R = N)
    return pulley::run_hybrid(job, training, pulley::Adam{o.dense_learning_rate}, tables);
  }
  return pulley::run(job, training, pulley::RoundRobin{}, pulley::Adam{o.dense_learning_rate}, sync, tables);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Trains a wide-and-deep click model with embedding tables on planted Criteo-shaped data."};
  pulley::JobFlags job_flags;
  job_flags.ps = 2;  // in-process default: 2 ps tasks and 2 workers
  app.add_option("--mode", o.mode, "sync (R = N) or async")->check(CLI::IsMember({"sync", "async"}));
  app.add_option("--dense", o.dense,
                 "where the dense layers train: ps (beside the tables), or allreduce (a ring of the workers and "
                 "the chief, the tables on the ps tasks: sync only)")
      ->check(CLI::IsMember({"ps", "allreduce"}));
  app.add_option("--train-examples", o.train_examples, "training examples")->check(CLI::Range(1000, 100'000'000));
  app.add_option("--test-examples", o.test_examples, "held-out examples")->check(CLI::Range(1000, 10'000'000));
  app.add_option("--vocabulary", o.vocabulary, "values per categorical field")->check(CLI::Range(100, 100'000'000));
  app.add_option("--epochs", o.epochs, "passes over the training data")->check(CLI::Range(1, 100));
  app.add_option("--batch", o.batch, "examples per worker step")->check(CLI::Range(1, 65536));
  app.add_option("--admit-after", o.admit_after, "pulls of a value before it gets rows (1: at once)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--max-rows", o.max_rows, "rows per table on each ps, the least recently used evicted (0: no cap)");
  app.add_option("--ps-table-bytes", o.ps_table_bytes,
                 "bytes each ps's tables may hold, rows and admission counts (0: no budget)");
  app.add_option("--table-learning-rate", o.table_learning_rate, "Adagrad's, for the tables")
      ->check(CLI::PositiveNumber);
  app.add_option("--table-initial-accumulator", o.table_initial_accumulator, "Adagrad's, for the tables")
      ->check(CLI::Range(1e-12, 10.0));
  app.add_option("--dense-learning-rate", o.dense_learning_rate, "Adam's, for the MLP")->check(CLI::PositiveNumber);
  app.add_option("--progress", o.progress, "progress lines per epoch, each with an AUC on a tenth of the held-out examples (0: none)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--seed", o.seed, "of the data, the planted model and the initial values");
  app.add_option("--data-dir", o.data_dir, "where the generated data is written and read");
  std::string score_dir;
  app.add_option("--score-checkpoint", score_dir,
                 "score the newest checkpoint in this directory on the held-out examples, with no "
                 "cluster, and exit");
  pulley::add_job_flags(app, job_flags);
  pulley::add_checkpoint_flags(app, o.checkpoint);
  pulley::add_limit_flags(app, o.client, o.tcp, o.server, o.worker_timeout);
  pulley::add_metrics_flags(app, o.metrics);
  CLI11_PARSE(app, argc, argv);
  if (o.dense == "allreduce" && o.mode != "sync") {
    std::fprintf(stderr, "ctr: --dense allreduce trains in sync (R = N): the ring takes every worker's step\n");
    return 2;
  }
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(1);
  try {
    if (!score_dir.empty()) {
      Data data(o);
      return score_checkpoint(o, data, score_dir);
    }
    const pulley::Job job = pulley::resolve_job(job_flags);
    Data data(o);
    // Read (or generate) what this task needs before it joins the job, so that the chief's
    // clock does not run while workers read their data.
    const std::string role = job.in_process() ? "" : job.cluster->task.type;
    if (role.empty() || role == "worker") (void)data.train();
    if (role.empty() || role == "chief" || role == "evaluator" ||
        (role == "worker" && job.cluster->task.index == 0 && !job.cluster->cluster.roles.contains("chief"))) {
      (void)data.test();
    }
    const auto workers = static_cast<int>(job.num_workers());
    if (o.mode == "sync") return train(job, o, data, pulley::SyncReplicas(pulley::SyncReplicas::kEveryWorker, workers), workers);
    return train(job, o, data, pulley::Async{}, 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ctr: %s\n", e.what());
    return 2;
  }
}
