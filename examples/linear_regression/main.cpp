// SPDX-License-Identifier: MIT
// Learns y = 2 x0 - 3 x1 + 0.5 from noisy samples with a parameter-server job: the smallest
// complete use of the role runner. Every task in this process by default, or one task of a
// TCP cluster (TF_CONFIG, --role/--task/--*-hosts, --slurm-roles); `--help` lists the flags.
// It ends with a line such as
//   final: w0=2.0003 w1=-2.9991 b=0.4998 mse=0.0025 step=2000 mode=ssp

#include <CLI/CLI.hpp>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "pulley/pulley.hpp"
#include "pulley/runner/flags.hpp"
#include "pulley/runner/run.hpp"

namespace {

constexpr std::size_t kBatch = 32;

/// y = x w + b with x in R^2, mean squared error.
class Line {
 public:
  struct Batch {
    std::span<const float> x;  // kBatch x 2
    std::span<const float> y;  // kBatch
  };

  [[nodiscard]] std::span<const pulley::VariableSpec> variables() const { return variables_; }
  std::span<float> parameter(std::size_t i) { return i == 0 ? std::span(w_) : std::span(b_); }
  [[nodiscard]] std::span<const float> gradient(std::size_t i) const {
    return i == 0 ? std::span(dw_) : std::span(db_);
  }
  float compute_gradients(const Batch& batch) {
    dw_ = {0.0F, 0.0F};
    db_ = {0.0F};
    float loss = 0.0F;
    const auto n = static_cast<float>(batch.y.size());
    for (std::size_t i = 0; i < batch.y.size(); ++i) {
      const float error = batch.x[2 * i] * w_[0] + batch.x[2 * i + 1] * w_[1] + b_[0] - batch.y[i];
      loss += 0.5F * error * error / n;
      dw_[0] += error * batch.x[2 * i] / n;
      dw_[1] += error * batch.x[2 * i + 1] / n;
      db_[0] += error / n;
    }
    return loss;
  }

 private:
  std::vector<pulley::VariableSpec> variables_{{"w", {2}, pulley::Initializer::zeros()},
                                               {"b", {1}, pulley::Initializer::zeros()}};
  std::vector<float> w_ = {0.0F, 0.0F}, b_ = {0.0F}, dw_ = {0.0F, 0.0F}, db_ = {0.0F};
};

/// Fresh noisy samples of the line, different for every worker.
class Samples {
 public:
  explicit Samples(std::uint64_t seed) : rng_(seed), x_(2 * kBatch), y_(kBatch) {}
  Line::Batch operator()() {
    for (std::size_t i = 0; i < kBatch; ++i) {
      x_[2 * i] = static_cast<float>(2.0 * rng_.uniform() - 1.0);
      x_[2 * i + 1] = static_cast<float>(2.0 * rng_.uniform() - 1.0);
      const auto noise = static_cast<float>(0.1 * (rng_.uniform() - 0.5));
      y_[i] = 2.0F * x_[2 * i] - 3.0F * x_[2 * i + 1] + 0.5F + noise;
    }
    return {x_, y_};
  }

 private:
  pulley::SplitMix64 rng_;
  std::vector<float> x_, y_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Learns a line with a parameter-server job (the role runner's smallest use)."};
  pulley::JobFlags job_flags;
  std::string mode = "ssp";
  std::int64_t steps = 2000;
  app.add_option("--mode", mode, "sync, async or ssp")->check(CLI::IsMember({"sync", "async", "ssp"}));
  app.add_option("--steps", steps, "global steps to train")->check(CLI::Range(1, 1 << 30));
  pulley::add_job_flags(app, job_flags);
  pulley::Training<Line> training;
  pulley::add_checkpoint_flags(app, training.checkpoint);
  pulley::add_limit_flags(app, training.client, training.tcp, training.server,
                          training.worker_timeout);
  pulley::add_metrics_flags(app, training.metrics);
  CLI11_PARSE(app, argc, argv);

  pulley::Job job;
  try {
    job = pulley::resolve_job(job_flags);
  } catch (const pulley::Error& e) {
    std::fprintf(stderr, "linear_regression: %s\n", e.what());
    return 2;
  }
  training.model = [] { return Line(); };
  training.data = [](const pulley::DataShard& shard) { return Samples(shard.index + 1); };
  training.last_step = steps;
  training.evaluate = [&](Line& line, const pulley::Evaluation& e) {
    if (!e.last) return;
    Samples held_out(99);
    const float mse = 2.0F * line.compute_gradients(held_out());
    e.report("mse", mse);
    std::printf("final: w0=%.4f w1=%.4f b=%.4f mse=%.4f step=%lld mode=%s\n", line.parameter(0)[0],
                line.parameter(0)[1], line.parameter(1)[0], mse, static_cast<long long>(e.step),
                mode.c_str());
  };
  const int workers = static_cast<int>(job.num_workers());
  const pulley::Sgd sgd{0.1F};
  if (mode == "async") return pulley::run(job, training, pulley::RoundRobin{}, sgd, pulley::Async{});
  if (mode == "sync") {
    return pulley::run(job, training, pulley::RoundRobin{}, sgd, pulley::SyncReplicas(pulley::SyncReplicas::kEveryWorker, workers));
  }
  return pulley::run(job, training, pulley::RoundRobin{}, sgd, pulley::BoundedStaleness(2, workers));
}
