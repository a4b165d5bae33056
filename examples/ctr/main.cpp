// SPDX-License-Identifier: MIT
// A click-through-rate model with embedding tables, trained by a parameter-server job on
// Criteo-shaped data with a known answer (ctr/data.hpp): a wide-and-deep model
// (ctr/wide_deep.hpp) whose two tables hold a row per categorical value, spread over the ps
// tasks by id; each worker pulls and pushes only the rows its batch uses. The ps tasks and
// workers are threads of this process, reached in-process or over TCP on 127.0.0.1.
//
//   ctr [--transport in-process|tcp] [--mode sync|async] [--ps 2] [--workers 2]
//       [--train-examples 4000000] [--test-examples 200000] [--vocabulary 400000]
//       [--epochs 1] [--batch 128] [--admit-after 1] [--data-dir /tmp/pulley-ctr]
//
// Ends with `final: auc=... planted_auc=... logloss=... samples_per_s=... workers=... ps=...
// mode=...`, planted_auc being the planted model's own AUC on the same held-out examples.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ctr/data.hpp"
#include "ctr/wide_deep.hpp"
#include "pulley/pulley.hpp"
#include "pulley/transport/tcp.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string transport = "in-process";
  std::string mode = "sync";
  std::uint32_t ps = 2;
  std::uint32_t workers = 2;
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
  std::uint64_t seed = 1;
  std::string data_dir = "/tmp/pulley-ctr";
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The data: generated into `dir` once (train.bin, test.bin), then read back from there.
std::pair<std::vector<ctr::Example>, std::vector<ctr::Example>> load(const Options& o,
                                                                     const ctr::Planted& planted) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(o.data_dir) / ("v" + std::to_string(o.vocabulary) + "-n" +
                                               std::to_string(o.train_examples) + "-t" +
                                               std::to_string(o.test_examples));
  const fs::path train = dir / "train.bin", test = dir / "test.bin";
  if (!fs::exists(train) || !fs::exists(test)) {
    const auto start = Clock::now();
    fs::create_directories(dir);
    ctr::write(train, ctr::generate(o.train_examples, o.vocabulary, planted, o.seed + 100));
    ctr::write(test, ctr::generate(o.test_examples, o.vocabulary, planted, o.seed + 200));
    std::printf("generated %zu + %zu examples into %s in %.1f s\n", o.train_examples,
                o.test_examples, dir.c_str(), seconds_since(start));
  }
  const auto start = Clock::now();
  auto data = std::pair{ctr::read(train), ctr::read(test)};
  std::printf("read %zu training and %zu held-out examples from %s in %.1f s\n", data.first.size(),
              data.second.size(), dir.c_str(), seconds_since(start));
  return data;
}

/// The ps tasks and a transport to them, in-process or over TCP on 127.0.0.1.
template <class Server>
class Cluster {
 public:
  Cluster(const Options& o, const std::function<Server(std::uint32_t)>& make) : tcp_(o.transport == "tcp") {
    if (!tcp_) {
      network_ = std::make_unique<pulley::InProcessNetwork>(o.ps);
      for (std::uint32_t i = 0; i < o.ps; ++i) network_->serve(make(i));
      return;
    }
    pulley::TcpServerOptions server;
    server.credentials = credentials_;
    for (std::uint32_t i = 0; i < o.ps; ++i) {
      listeners_.push_back(std::make_unique<pulley::TcpServer<Server>>(make(i), "127.0.0.1", 0, server));
      addresses_.push_back("127.0.0.1:" + std::to_string(listeners_.back()->port()));
    }
    for (auto& l : listeners_) threads_.emplace_back([&l] { l->run(); });
  }
  ~Cluster() {
    for (auto& l : listeners_) l->stop();
    for (auto& t : threads_) t.join();
  }

  /// Runs `f(transport)` with a transport for task `self`.
  template <class F>
  decltype(auto) with(pulley::Node self, F&& f) {
    if (tcp_) {
      pulley::TcpOptions options;
      options.credentials = credentials_;
      return f(pulley::Tcp(self, addresses_, options));
    }
    return f(pulley::InProcess(*network_, self));
  }

 private:
  bool tcp_;
  pulley::Credentials credentials_{"ctr-example", "a secret of this process"};
  std::unique_ptr<pulley::InProcessNetwork> network_;
  std::vector<std::unique_ptr<pulley::TcpServer<Server>>> listeners_;
  std::vector<std::string> addresses_;
  std::vector<std::thread> threads_;
};

/// Trains with sync policy `sync` and prints the final line.
template <class Sync>
int train(const Options& o, Sync sync, const std::vector<ctr::Example>& train_set,
          const std::vector<ctr::Example>& test_set, const ctr::Planted& planted) {
  using Server = pulley::ParameterServer<pulley::RoundRobin, pulley::Adam, Sync, pulley::Tables<pulley::Adagrad>>;
  Cluster<Server> cluster(o, [&](std::uint32_t i) {
    return Server(i, o.ps, pulley::Adam{o.dense_learning_rate}, sync, pulley::RoundRobin{},
                  pulley::Tables<pulley::Adagrad>{pulley::Adagrad{o.table_learning_rate, o.table_initial_accumulator, 1e-7F}});
  });
  return cluster.with(pulley::Node::chief(), [&](auto chief_transport) {
    pulley::Chief chief(std::move(chief_transport), o.seed);
    const ctr::WideDeep shape(o.admit_after);
    chief.initialize(shape.variables(), shape.tables());

    // Worker w trains on examples w, w + W, ...: its shard, in batches, for the epochs.
    const std::size_t per_worker = train_set.size() / o.workers;
    const std::size_t steps_per_epoch = per_worker / o.batch;
    const auto total_steps = static_cast<std::int64_t>(steps_per_epoch) * o.epochs;
    std::vector<std::vector<ctr::Example>> shards(o.workers);
    for (std::size_t i = 0; i < per_worker * o.workers; ++i) shards[i % o.workers].push_back(train_set[i]);
    std::atomic<std::int64_t> samples{0};
    std::mutex failure_lock;
    std::string failure;
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    for (std::uint32_t w = 0; w < o.workers; ++w) {
      threads.emplace_back([&, w] {
        try {
          cluster.with(pulley::Node::worker(w), [&](auto transport) {
            pulley::Worker worker(w, ctr::WideDeep(o.admit_after), std::move(transport));
            worker.wait_ready();
            double loss_sum = 0.0;
            std::int64_t losses = 0;
            for (std::int64_t k = 0; k < total_steps; ++k) {
              const std::size_t at = static_cast<std::size_t>(k) % steps_per_epoch * o.batch;
              const ctr::WideDeep::Batch batch{std::span(shards[w]).subspan(at, o.batch)};
              const auto result = worker.step(batch, o.mode == "sync" ? total_steps : std::numeric_limits<std::int64_t>::max());
              if (!result) break;
              samples += static_cast<std::int64_t>(o.batch);
              loss_sum += result->loss;
              ++losses;
              if (w == 0 && (k + 1) % std::max<std::int64_t>(1, total_steps / 10) == 0) {
                std::printf("worker 0: step %lld of %lld, loss %.4f, %.0f samples/s\n",
                            static_cast<long long>(k + 1), static_cast<long long>(total_steps),
                            loss_sum / static_cast<double>(losses),
                            static_cast<double>(samples.load()) / seconds_since(start));
                std::fflush(stdout);
                loss_sum = 0.0;
                losses = 0;
              }
            }
            return 0;
          });
        } catch (const std::exception& e) {
          const std::lock_guard lock(failure_lock);
          failure = "worker " + std::to_string(w) + ": " + e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    const double took = seconds_since(start);
    if (!failure.empty()) {
      chief.abort(failure);
      std::fprintf(stderr, "ctr: %s\n", failure.c_str());
      return 1;
    }

    // Held-out evaluation: the dense variables and the rows of every held-out id.
    ctr::WideDeep model(o.admit_after);
    const auto dense = chief.read_variables();
    for (std::size_t v = 0; v < dense.size(); ++v) std::copy(dense[v].begin(), dense[v].end(), model.parameter(v).begin());
    std::vector<std::uint64_t> ids;
    for (const ctr::Example& e : test_set) {
      for (std::size_t f = 0; f < ctr::kFields; ++f) ids.push_back(ctr::id_of(f, e.value[f]));
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    const std::vector<float> wide = chief.read_rows("wide", ids);
    const std::vector<float> emb = chief.read_rows("emb", ids);
    std::unordered_map<std::uint64_t, std::size_t> at;
    for (std::size_t i = 0; i < ids.size(); ++i) at.emplace(ids[i], i);
    const auto logits = model.predict(
        test_set, [&](std::uint64_t id) { return wide[at.at(id)]; },
        [&](std::uint64_t id) { return std::span<const float>(emb).subspan(at.at(id) * ctr::WideDeep::kDim, ctr::WideDeep::kDim); });
    std::vector<float> labels;
    std::vector<double> planted_logits;
    double logloss = 0.0;
    for (std::size_t i = 0; i < test_set.size(); ++i) {
      labels.push_back(test_set[i].label);
      planted_logits.push_back(planted.logit(test_set[i]));
      const double z = logits[i];
      const double softplus = z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
      logloss += test_set[i].label > 0.5F ? softplus - z : softplus;
    }
    logloss /= static_cast<double>(test_set.size());
    std::int64_t rows = 0, dropped = 0;
    for (const pulley::Stats& s : chief.stats()) {
      rows += s.table_rows;
      dropped += s.table_rows_dropped;
    }
    std::printf("trained %lld steps in %.1f s; the ps tasks hold %lld rows of each table (%lld pushed rows dropped)\n",
                static_cast<long long>(total_steps), took, static_cast<long long>(rows / 2),
                static_cast<long long>(dropped));
    std::printf("final: auc=%.4f planted_auc=%.4f logloss=%.4f samples_per_s=%.0f workers=%u ps=%u mode=%s\n",
                ctr::auc(logits, labels), ctr::auc(planted_logits, labels), logloss,
                static_cast<double>(samples.load()) / took, o.workers, o.ps, o.mode.c_str());
    chief.shutdown();
    return 0;
  });
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Trains a wide-and-deep click model with embedding tables on planted Criteo-shaped data."};
  app.add_option("--transport", o.transport, "in-process or tcp (127.0.0.1)")
      ->check(CLI::IsMember({"in-process", "tcp"}));
  app.add_option("--mode", o.mode, "sync (R = N) or async")->check(CLI::IsMember({"sync", "async"}));
  app.add_option("--ps", o.ps, "ps tasks")->check(CLI::Range(1, 64));
  app.add_option("--workers", o.workers, "workers")->check(CLI::Range(1, 64));
  app.add_option("--train-examples", o.train_examples, "training examples")->check(CLI::Range(1000, 100'000'000));
  app.add_option("--test-examples", o.test_examples, "held-out examples")->check(CLI::Range(1000, 10'000'000));
  app.add_option("--vocabulary", o.vocabulary, "values per categorical field")->check(CLI::Range(100, 100'000'000));
  app.add_option("--epochs", o.epochs, "passes over the training data")->check(CLI::Range(1, 100));
  app.add_option("--batch", o.batch, "examples per worker step")->check(CLI::Range(1, 65536));
  app.add_option("--admit-after", o.admit_after, "pulls of a value before it gets rows (1: at once)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--table-learning-rate", o.table_learning_rate, "Adagrad's, for the tables");
  app.add_option("--table-initial-accumulator", o.table_initial_accumulator, "Adagrad's, for the tables")
      ->check(CLI::Range(1e-12, 10.0));
  app.add_option("--dense-learning-rate", o.dense_learning_rate, "Adam's, for the MLP");
  app.add_option("--seed", o.seed, "of the data, the planted model and the initial values");
  app.add_option("--data-dir", o.data_dir, "where the generated data is written and read");
  CLI11_PARSE(app, argc, argv);
  try {
    const ctr::Planted planted{o.seed};
    const auto [train_set, test_set] = load(o, planted);
    if (train_set.size() / o.workers < o.batch) throw std::runtime_error("fewer examples per worker than one batch");
    if (o.mode == "sync") {
      return train(o, pulley::SyncReplicas(static_cast<int>(o.workers), static_cast<int>(o.workers)),
                   train_set, test_set, planted);
    }
    return train(o, pulley::Async{}, train_set, test_set, planted);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ctr: %s\n", e.what());
    return 1;
  }
}
