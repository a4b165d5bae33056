// SPDX-License-Identifier: MIT
// Trains a 784-128-10 MLP on Fashion-MNIST with an in-process parameter-server cluster:
// ps tasks, workers and the chief are threads of this process exchanging pulley's messages.
//
//   fashion_mnist [--ps 2] [--workers 2] [--optimizer adam|sgd|momentum|adagrad]
//                 [--learning-rate 1e-3] [--mode sync|async] [--replicas-to-aggregate R]
//                 [--total-num-replicas N] [--epochs 10] [--batch 64] [--seed 1]
//                 [--data /usr/share/datasets/fashion-mnist]
//
// It prints one line per epoch and ends with a machine-readable line:
//   final: test_accuracy=0.8812 samples_per_s=71234 epochs=10 workers=2 ps=2 mode=sync

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fashion_mnist/idx.hpp"
#include "pulley/models/mlp.hpp"
#include "pulley/pulley.hpp"

#ifndef PULLEY_FASHION_MNIST_DIR
#define PULLEY_FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#endif

// OpenBLAS starts a thread pool per call site by default; with one worker thread per core
// that only adds contention. Weak, so another BLAS links too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::uint32_t ps = 2;
  std::uint32_t workers = 2;
  std::string optimizer = "adam";
  float learning_rate = 1e-3F;
  std::string mode = "sync";
  int replicas_to_aggregate = 0;  // 0: = total_num_replicas
  int total_num_replicas = 0;     // 0: = workers
  int epochs = 10;
  std::size_t batch = 64;
  std::uint64_t seed = 1;
  std::string data = PULLEY_FASHION_MNIST_DIR;
};

[[noreturn]] void usage(const std::string& problem) {
  if (!problem.empty()) std::fprintf(stderr, "fashion_mnist: %s\n\n", problem.c_str());
  std::fprintf(
      stderr,
      "usage: fashion_mnist [--ps N] [--workers N] [--optimizer adam|sgd|momentum|adagrad]\n"
      "                     [--learning-rate X] [--mode sync|async]\n"
      "                     [--replicas-to-aggregate R] [--total-num-replicas N]\n"
      "                     [--epochs N] [--batch N] [--seed N] [--data DIR]\n");
  std::exit(problem.empty() ? 0 : 2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("");
    if (i + 1 >= argc) usage("flag " + std::string(flag) + " needs a value");
    const std::string value = argv[++i];
    auto number = [&](long min) {
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      if (*end != '\0' || v < min) {
        usage(std::string(flag) + " needs an integer >= " + std::to_string(min) + ", got '" +
              value + "'");
      }
      return v;
    };
    if (flag == "--ps")
      o.ps = static_cast<std::uint32_t>(number(1));
    else if (flag == "--workers")
      o.workers = static_cast<std::uint32_t>(number(1));
    else if (flag == "--optimizer")
      o.optimizer = value;
    else if (flag == "--learning-rate") {
      char* end = nullptr;
      o.learning_rate = std::strtof(value.c_str(), &end);
      if (*end != '\0' || !(o.learning_rate > 0.0F)) usage("--learning-rate needs a number > 0");
    } else if (flag == "--mode")
      o.mode = value;
    else if (flag == "--replicas-to-aggregate")
      o.replicas_to_aggregate = static_cast<int>(number(1));
    else if (flag == "--total-num-replicas")
      o.total_num_replicas = static_cast<int>(number(1));
    else if (flag == "--epochs")
      o.epochs = static_cast<int>(number(1));
    else if (flag == "--batch")
      o.batch = static_cast<std::size_t>(number(1));
    else if (flag == "--seed")
      o.seed = static_cast<std::uint64_t>(number(0));
    else if (flag == "--data")
      o.data = value;
    else
      usage("unknown flag " + std::string(flag));
  }
  if (o.mode != "sync" && o.mode != "async") usage("--mode is sync or async");
  if (o.total_num_replicas == 0) o.total_num_replicas = static_cast<int>(o.workers);
  if (o.replicas_to_aggregate == 0) o.replicas_to_aggregate = o.total_num_replicas;
  if (o.total_num_replicas != static_cast<int>(o.workers)) {
    usage("--total-num-replicas must equal --workers (every worker is a replica)");
  }
  return o;
}

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

// Trains with one optimizer and sync policy; returns the final test accuracy.
template <class Optimizer, class Sync>
int train(const Options& o, const Data& data, Optimizer optimizer, Sync sync,
          std::int64_t updates_per_epoch_divisor) {
  using Server = pulley::ParameterServer<pulley::RoundRobin, Optimizer, Sync>;
  const std::vector<std::size_t> layers{784, 128, 10};
  const std::size_t per_worker = data.train.labels.size() / o.workers;
  const std::int64_t batches_per_worker = static_cast<std::int64_t>(per_worker / o.batch);
  // Sync: a step averages R batches; async: every batch is a step.
  const std::int64_t steps_per_epoch = batches_per_worker * o.workers / updates_per_epoch_divisor;
  const std::int64_t last_step = steps_per_epoch * o.epochs;

  std::deque<Server> servers;
  pulley::InProcessNetwork network(o.ps);
  for (std::uint32_t i = 0; i < o.ps; ++i)
    network.serve(servers.emplace_back(i, o.ps, optimizer, sync));

  pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), o.seed);
  pulley::models::Mlp evaluator(layers);
  chief.initialize(evaluator.variables());

  std::atomic<std::int64_t> samples{0};
  std::mutex loss_mutex;
  double loss_sum = 0.0;
  std::int64_t loss_count = 0;
  std::vector<std::exception_ptr> failures(o.workers);
  // Kills every ps task: everything waiting on one fails at once instead of at its deadline.
  auto stop_cluster = [&network, &o] {
    for (std::uint32_t i = 0; i < o.ps; ++i) network.kill(pulley::Node::ps(i));
  };
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < o.workers; ++w) {
    workers.emplace_back([&, w] {
      try {
        // Worker w's shard: examples w, w + workers, ...; reshuffled every pass.
        std::vector<std::size_t> shard;
        for (std::size_t i = w; i < data.train.labels.size(); i += o.workers) shard.push_back(i);
        shard.resize(per_worker);
        pulley::SplitMix64 rng(o.seed * 7919 + w);
        std::vector<float> features(o.batch * 784);
        std::vector<std::int32_t> labels(o.batch);
        pulley::Worker worker(w, pulley::models::Mlp(layers),
                              pulley::InProcess(network, pulley::Node::worker(w)));
        worker.wait_ready();
        for (std::size_t next = shard.size();; next += o.batch) {
          if (next + o.batch > shard.size()) {
            for (std::size_t i = shard.size() - 1; i > 0; --i) {  // Fisher–Yates
              std::swap(shard[i], shard[rng.next() % (i + 1)]);
            }
            next = 0;
          }
          for (std::size_t r = 0; r < o.batch; ++r) {
            const std::size_t e = shard[next + r];
            std::copy_n(data.train.images.pixels.begin() + static_cast<std::ptrdiff_t>(e * 784),
                        784, features.begin() + static_cast<std::ptrdiff_t>(r * 784));
            labels[r] = data.train.labels[e];
          }
          const auto result = worker.step({features, labels}, last_step);
          if (!result) break;
          samples += static_cast<std::int64_t>(o.batch);
          std::scoped_lock lock(loss_mutex);
          loss_sum += result->loss;
          ++loss_count;
        }
      } catch (...) {
        failures[w] = std::current_exception();
        stop_cluster();  // the others would wait for this worker's gradients forever
      }
    });
  }

  const pulley::models::MlpBatch test{data.test.images.pixels, data.test.labels};
  auto evaluate = [&] {
    const auto values = chief.read_variables();
    for (std::size_t v = 0; v < values.size(); ++v) {
      std::copy(values[v].begin(), values[v].end(), evaluator.parameter(v).begin());
    }
    return evaluator.evaluate(test);
  };

  const auto start = Clock::now();
  std::printf(
      "training 784-128-10 on %zu examples: %u ps, %u workers, %s, %s R=%d N=%d, "
      "batch %zu, %d epochs (%lld steps)\n",
      data.train.labels.size(), o.ps, o.workers, o.optimizer.c_str(), o.mode.c_str(),
      o.replicas_to_aggregate, o.total_num_replicas, o.batch, o.epochs,
      static_cast<long long>(last_step));
  std::fflush(stdout);
  double accuracy = 0.0;
  double samples_per_s = 0.0;
  try {
    for (int epoch = 1; epoch <= o.epochs; ++epoch) {
      const std::int64_t step = chief.wait_for_step(steps_per_epoch * epoch);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      samples_per_s = static_cast<double>(samples.load()) / seconds;
      double train_loss = 0.0;
      {
        std::scoped_lock lock(loss_mutex);
        train_loss = loss_count ? loss_sum / static_cast<double>(loss_count) : 0.0;
        loss_sum = 0.0;
        loss_count = 0;
      }
      const auto eval = evaluate();
      accuracy = eval.accuracy;
      std::printf(
          "epoch %2d/%d  step %6lld  train_loss %.4f  test_loss %.4f  test_accuracy %.4f  "
          "samples/s %.0f  elapsed %.1f s\n",
          epoch, o.epochs, static_cast<long long>(step), train_loss, eval.loss, eval.accuracy,
          samples_per_s, seconds);
      std::fflush(stdout);
    }
  } catch (...) {
    stop_cluster();
    for (auto& t : workers) t.join();
    for (const auto& failure : failures) {
      if (failure) std::rethrow_exception(failure);  // the cause, not the symptom
    }
    throw;
  }
  for (auto& t : workers) t.join();
  for (const auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
  accuracy = evaluate().accuracy;  // the parameters after the very last update
  std::int64_t stale = 0;
  for (const pulley::Stats& s : chief.stats()) stale += s.stale_gradients_dropped;
  chief.shutdown();
  network.join();
  std::printf("stale gradients dropped: %lld\n", static_cast<long long>(stale));
  std::printf("final: test_accuracy=%.4f samples_per_s=%.0f epochs=%d workers=%u ps=%u mode=%s\n",
              accuracy, samples_per_s, o.epochs, o.workers, o.ps, o.mode.c_str());
  return 0;
}

template <class Optimizer>
int train_with(const Options& o, const Data& data, Optimizer optimizer) {
  if (o.mode == "async") return train(o, data, optimizer, pulley::Async{}, 1);
  return train(o, data, optimizer,
               pulley::SyncReplicas(o.replicas_to_aggregate, o.total_num_replicas),
               o.replicas_to_aggregate);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(1);
  try {
    Data data{fashion_mnist::load_split(o.data, "train"),
              fashion_mnist::load_split(o.data, "t10k")};
    standardize(data);
    if (data.train.labels.size() / o.workers < o.batch) {
      std::fprintf(stderr, "fashion_mnist: %u workers leave fewer than one batch each\n",
                   o.workers);
      return 2;
    }
    const float lr = o.learning_rate;
    if (o.optimizer == "adam") return train_with(o, data, pulley::Adam{lr});
    if (o.optimizer == "sgd") return train_with(o, data, pulley::Sgd{lr});
    if (o.optimizer == "momentum") return train_with(o, data, pulley::Momentum{lr, 0.9F});
    if (o.optimizer == "adagrad") return train_with(o, data, pulley::Adagrad{lr});
    usage("unknown optimizer '" + o.optimizer + "' (adam, sgd, momentum, adagrad)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
}
