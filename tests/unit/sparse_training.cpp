// SPDX-License-Identifier: MIT
// Embedding tables end to end: workers that pull only their batch's rows and push only
// their gradients, through ps tasks that create rows lazily, in-process and over TCP; sync
// R = N against one process applying TensorFlow's sparse-accumulator rule; async; a slow
// backup worker's stale rows dropped; bounded staleness applying every push once;
// admission; a ps whose optimizer cannot serve a table.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/shard_copies.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/tcp.hpp"
#include "support/cluster.hpp"
#include "support/table_model.hpp"
#include "support/tcp.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::TableBatchOf;
using pulley::testing::TinyTableModel;
using namespace pulley::testing::table_job;

namespace {

/// Trains TinyTableModel with sync R = N = 2 on `batches` (worker w's batch at step s is
/// batches[2s + w]) through `make_transport`; checks the result against the reference and
/// returns the rows of every id used, in id order.
/// Then calls `then(chief)` before it ends training. `at_step(w, k)` runs before worker w's
/// step k.
template <class MakeTransport, class Then>
std::vector<float> train_sync(MakeTransport make_transport, const std::vector<TableBatchOf>& batches, Then then,
                              const std::function<void(std::uint32_t, std::int64_t)>& at_step = {}) {
  Chief chief(make_transport(Node::chief()), kSeed);
  const TinyTableModel shape;
  chief.initialize(shape.variables(), shape.tables());
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, TinyTableModel(), make_transport(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = 0;; ++k) {
        if (at_step) at_step(w, k);
        if (!worker.step(batches[static_cast<std::size_t>((k % kSteps) * kWorkers + w)], kSteps)) break;
      }
    });
  }
  for (auto& t : threads) t.join();

  pulley::testing::SyncReference reference(kSeed, kLearningRate);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    reference.step({&batches[static_cast<std::size_t>(s * 2)], &batches[static_cast<std::size_t>(s * 2 + 1)]});
  }
  const auto dense = chief.read_variables();
  for (std::size_t v = 0; v < 2; ++v) {
    for (std::size_t i = 0; i < dense[v].size(); ++i) {
      CHECK(dense[v][i] == doctest::Approx(reference.model.parameter(v)[i]).epsilon(1e-5));
    }
  }
  std::vector<std::uint64_t> ids;
  for (const auto& [id, r] : reference.rows) ids.push_back(id);
  const std::vector<float> rows = chief.read_rows("emb", ids);
  float max_diff = 0.0F;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto& expected = reference.rows[ids[i]];
    for (std::size_t k = 0; k < expected.size(); ++k) {
      max_diff = std::max(max_diff, std::abs(rows[i * TinyTableModel::kDim + k] - expected[k]));
    }
  }
  CHECK(max_diff <= 1e-6F);
  std::int64_t held = 0;
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == kSteps);
    CHECK(s.table_rows_dropped == 0);
    held += s.table_rows;
  }
  CHECK(held == static_cast<std::int64_t>(ids.size()));  // exactly the rows some batch used
  then(chief);
  chief.shutdown();
  return rows;
}

}  // namespace

TEST_CASE("sync R = N with tables over 2 ps equals one process applying the sparse accumulator's rule") {
  const auto batches = pulley::testing::table_batches(kSteps * kWorkers, 8, 200, 3);
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{kLearningRate}, SyncReplicas(2, 2));
  (void)train_sync([&](Node self) { return cluster.endpoint(self); }, batches, [](auto&) {});
}

TEST_CASE("sync training with tables over TCP gives exactly the in-process result") {
  const auto batches = pulley::testing::table_batches(kSteps * kWorkers, 8, 200, 5);
  std::vector<float> in_process;
  {
    Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{kLearningRate}, SyncReplicas(2, 2));
    in_process = train_sync([&](Node self) { return cluster.endpoint(self); }, batches, [](auto&) {});
  }
  using Server = ParameterServer<RoundRobin, Sgd, SyncReplicas>;
  std::vector<std::unique_ptr<TcpServer<Server>>> listeners;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < 2; ++i) {
    listeners.push_back(std::make_unique<TcpServer<Server>>(
        Server(i, 2, Sgd{kLearningRate}, SyncReplicas(2, 2)), "127.0.0.1", 0,
        pulley::testing::test_server_options()));
    addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
  }
  std::vector<std::thread> serving;
  for (auto& l : listeners) serving.emplace_back([&l] { l->run(); });
  const auto over_tcp = train_sync(
      [&](Node self) { return pulley::testing::client(self, addresses); }, batches, [](auto& chief) {
        // More ids than one message carries (a TCP frame's metadata): split into several
        // pulls; rows no batch used read as their initial values, and are not created.
        std::vector<std::uint64_t> many(kMaxIdsPerMessage * 2 + 5);
        for (std::size_t i = 0; i < many.size(); ++i) many[i] = mix_id(i + 1'000'000);
        const std::vector<float> rows = chief.read_rows("emb", many);
        REQUIRE(rows.size() == many.size() * TinyTableModel::kDim);
        std::vector<float> last(TinyTableModel::kDim);
        initialize_row(TinyTableModel().tables()[0], kSeed, many.back(), last);
        CHECK(std::vector<float>(rows.end() - TinyTableModel::kDim, rows.end()) == last);
      });
  for (auto& l : listeners) l->stop();
  for (auto& t : serving) t.join();
  CHECK(over_tcp == in_process);
}

TEST_CASE("with a copy of every shard, a ps killed mid-training: the rows and parts end as in-process") {
  const auto batches = pulley::testing::table_batches(kSteps * kWorkers, 8, 200, 5);
  std::vector<float> in_process;
  {
    Cluster<RoundRobin, Sgd, SyncReplicas> cluster(3, Sgd{kLearningRate}, SyncReplicas(2, 2));
    in_process = train_sync([&](Node self) { return cluster.endpoint(self); }, batches, [](auto&) {});
  }
  using Server = ParameterServer<RoundRobin, Sgd, SyncReplicas>;
  constexpr std::uint32_t kPs = 3;
  std::vector<std::unique_ptr<TcpServer<ShardCopies<Server>>>> listeners;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < kPs; ++i) {
    listeners.push_back(std::make_unique<TcpServer<ShardCopies<Server>>>(
        ShardCopies<Server>(Server(i, kPs, Sgd{kLearningRate}, SyncReplicas(2, 2)),
                            Server((i + kPs - 1) % kPs, kPs, Sgd{kLearningRate}, SyncReplicas(2, 2))),
        "127.0.0.1", 0, pulley::testing::test_server_options()));
    addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
  }
  std::vector<std::thread> serving;
  for (auto& l : listeners) serving.emplace_back([&l] { l->run(); });
  TcpOptions copies = pulley::testing::test_client_options();
  copies.replicas = 1;
  const auto over_tcp = train_sync(
      [&](Node self) { return pulley::testing::client(self, addresses, copies); }, batches, [](auto&) {},
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 0 || k != kSteps / 2) return;
        listeners[1]->stop();  // lost for good: its port refuses
        serving[1].join();
        listeners[1].reset();
      });
  for (auto& l : listeners) {
    if (l) l->stop();
  }
  for (auto& t : serving) {
    if (t.joinable()) t.join();
  }
  CHECK(over_tcp == in_process);
}

TEST_CASE("async with tables: every push is applied as it comes, rows created once") {
  const auto batches = pulley::testing::table_batches(40, 8, 100, 9);
  Cluster<RoundRobin, Adagrad, Async> cluster(3, Adagrad{0.1F}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape;
  chief.initialize(shape.variables(), shape.tables());
  std::set<std::uint64_t> used;
  for (const auto& b : batches) {
    for (const auto& e : b) used.insert(e.ids.begin(), e.ids.end());
  }
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, TinyTableModel(), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::size_t k = w; k < batches.size(); k += 2) REQUIRE(worker.step(batches[k]));
    });
  }
  for (auto& t : threads) t.join();
  std::int64_t held = 0;
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == 40);  // every ps counts every push (each push reaches every ps)
    held += s.table_rows;
  }
  CHECK(held == static_cast<std::int64_t>(used.size()));
  // A row no batch used reads as its initial value; every used row moved.
  const std::vector<std::uint64_t> fresh{12345678};
  std::vector<float> initial(TinyTableModel::kDim);
  initialize_row(shape.tables()[0], kSeed, fresh[0], initial);
  CHECK(chief.read_rows("emb", fresh) == initial);
  const std::uint64_t first = *used.begin();
  initialize_row(shape.tables()[0], kSeed, first, initial);
  const std::vector<float> first_row = chief.read_rows("emb", std::span(&first, 1));
  CHECK(first_row != initial);
  // Ids named more than once (a ps refuses that in one request): each gets its row.
  const std::uint64_t last = *used.rbegin();
  const std::vector<float> last_row = chief.read_rows("emb", std::span(&last, 1));
  const std::vector<std::uint64_t> repeated{first, last, first, first, last};
  const std::vector<float> rows = chief.read_rows("emb", repeated);
  REQUIRE(rows.size() == repeated.size() * TinyTableModel::kDim);
  for (std::size_t i = 0; i < repeated.size(); ++i) {
    const std::vector<float> row(rows.begin() + static_cast<std::ptrdiff_t>(i * TinyTableModel::kDim),
                                 rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * TinyTableModel::kDim));
    CHECK(row == (repeated[i] == first ? first_row : last_row));
  }
  chief.shutdown();
}

TEST_CASE("admission over the cluster: rows pulled fewer than k times are not created, their pushes counted") {
  TableSpec spec{"emb", TinyTableModel::kDim, Initializer::uniform(0.5F), 3, 0};
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(1, Sgd{0.1F}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape(spec);
  chief.initialize(shape.variables(), shape.tables());
  const TableBatchOf rare{{{mix_id(1)}, 1.0F}};
  Worker worker(0, TinyTableModel(spec), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  REQUIRE(worker.step(rare));  // first pull: not admitted, its push dropped
  REQUIRE(worker.step(rare));  // second
  CHECK(chief.stats()[0].table_rows == 0);
  CHECK(chief.stats()[0].table_rows_dropped == 2);
  REQUIRE(worker.step(rare));  // third pull admits it: the push is applied
  CHECK(chief.stats()[0].table_rows == 1);
  CHECK(chief.stats()[0].table_rows_dropped == 2);
  chief.shutdown();
}

TEST_CASE("a ps whose optimizer has no row-wise apply refuses a model with tables, naming the fix") {
  Cluster<RoundRobin, Momentum, Async> cluster(1, Momentum{}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape;
  try {
    chief.initialize(shape.variables(), shape.tables());
    FAIL("a ps that serves no tables took a model with one");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kFailedPrecondition);
    CHECK(std::string(e.what()).find("Tables<") != std::string::npos);
  }
  // The same optimizer for the dense variables, Adagrad for the table: served.
  using Mixed = ParameterServer<RoundRobin, Momentum, Async, Tables<Adagrad>>;
  InProcessNetwork network(1);
  network.serve(Mixed(0, 1, Momentum{}, Async{}, RoundRobin{}, Tables<Adagrad>{Adagrad{0.1F}}));
  Chief mixed(InProcess(network, Node::chief()), kSeed);
  mixed.initialize(shape.variables(), shape.tables());
  const std::uint64_t id = 5;
  CHECK(mixed.read_rows("emb", std::span(&id, 1)).size() == TinyTableModel::kDim);
  mixed.shutdown();
  chief.shutdown();
}

TEST_CASE("a worker or a reader whose id sharding differs from the ps tasks' is refused, naming the fix") {
  using RangeTables = Tables<Sgd, RangeIds>;
  using Server = ParameterServer<RoundRobin, Sgd, Async, RangeTables>;
  InProcessNetwork network(2);
  for (std::uint32_t i = 0; i < 2; ++i) network.serve(Server(i, 2, Sgd{kLearningRate}, Async{}));
  Chief chief(InProcess(network, Node::chief()), kSeed);
  const TinyTableModel shape;
  chief.initialize(shape.variables(), shape.tables());
  // The default (HashIds) against ps tasks that spread rows by range: refused at once.
  Worker astray(0, TinyTableModel{}, InProcess(network, Node::worker(0)));
  try {
    astray.wait_ready();
    FAIL("a worker with another id sharding got ready");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kFailedPrecondition);
    CHECK(std::string(e.what()).find("MyTables::Sharding") != std::string::npos);
  }
  const std::uint64_t id = 5;
  CHECK_THROWS_AS((void)chief.read_rows("emb", std::span(&id, 1)), Error);
  // The ps tasks' own, named once through the policy: served.
  Worker<TinyTableModel, InProcess, RangeTables::Sharding> worker(0, TinyTableModel{},
                                                                  InProcess(network, Node::worker(0)));
  worker.wait_ready();
  CHECK(chief.read_rows("emb", std::span(&id, 1), RangeTables::Sharding{}).size() == TinyTableModel::kDim);
  chief.shutdown();
}

TEST_CASE("ids at the edges and one id many times in a batch: the worker sums its gradient once") {
  const std::uint64_t top = ~std::uint64_t{0};
  TableBatchOf batch;
  for (int i = 0; i < 50; ++i) batch.push_back({{7, 7, top}, i % 2 == 0 ? 1.0F : 0.0F});
  batch.push_back({{0}, 1.0F});
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{kLearningRate}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape;
  chief.initialize(shape.variables(), shape.tables());
  Worker worker(0, TinyTableModel(), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  REQUIRE(worker.step(batch));
  pulley::testing::SyncReference reference(kSeed, kLearningRate);
  reference.step({&batch});
  const std::vector<std::uint64_t> ids{0, 7, top};
  const std::vector<float> rows = chief.read_rows("emb", ids);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    for (std::size_t k = 0; k < TinyTableModel::kDim; ++k) {
      CHECK(rows[i * TinyTableModel::kDim + k] == doctest::Approx(reference.rows[ids[i]][k]).epsilon(1e-6));
    }
  }
  std::int64_t held = 0;
  for (const Stats& s : chief.stats()) held += s.table_rows;
  CHECK(held == 3);  // one row each, whatever the repeats
  chief.shutdown();
}

namespace {

/// A model whose every row gradient is 1 wherever a batch uses the row (and whose dense
/// gradient is 0): with Sgd at rate 1, a row's value counts the updates applied to it,
/// which makes what a sync policy applied or dropped exact to check.
class CountingModel {
 public:
  using Batch = std::vector<std::uint64_t>;  ///< distinct ids
  [[nodiscard]] std::span<const VariableSpec> variables() const { return variables_; }
  [[nodiscard]] std::span<const TableSpec> tables() const { return tables_; }
  std::span<float> parameter(std::size_t) { return bias_; }
  [[nodiscard]] std::span<const float> gradient(std::size_t) const { return zero_; }
  void lookup(const Batch& batch, std::size_t, std::vector<std::uint64_t>& ids) const {
    ids.insert(ids.end(), batch.begin(), batch.end());
  }
  float compute_gradients(const Batch& batch, std::span<const TableBatch> tables) {
    if (before_compute) before_compute();
    for (const std::uint64_t id : batch) tables[0].gradient(id)[0] += 1.0F;
    return 0.0F;
  }
  /// Runs before each gradient is computed (between the step's pull and its push), if set.
  std::function<void()> before_compute;

 private:
  std::vector<VariableSpec> variables_{{"b", {1}, Initializer::zeros()}};
  std::vector<TableSpec> tables_{{"emb", 1, Initializer::zeros()}};
  std::vector<float> bias_ = std::vector<float>(1), zero_ = std::vector<float>(1);
};
static_assert(TableModel<CountingModel>);

/// Worker w's batch at its k-th step: a row every worker uses, and rows of its own.
CountingModel::Batch counting_batch(std::uint32_t w, std::int64_t k) {
  const auto c = static_cast<std::uint64_t>(k);
  return {mix_id(999), mix_id(1000 * (w + 1) + c % 7), mix_id(1000 * (w + 1) + 100 + c % 3)};
}

/// Where a test may hold a worker of `train_counting` back (each optional): before its k-th
/// step, before it computes a gradient, and after a step (nullptr: training is over).
struct Pace {
  std::function<void(std::uint32_t, std::int64_t)> before_step;
  std::function<void(std::uint32_t)> before_compute;
  std::function<void(std::uint32_t, const StepResult*)> after_step;
};

/// `workers` workers train CountingModel on `cluster` until global step `last`; returns
/// each worker's step results.
template <class C>
std::vector<std::vector<StepResult>> train_counting(C& cluster, std::uint32_t workers, std::int64_t last,
                                                    const Pace& pace = {}) {
  std::vector<std::vector<StepResult>> results(workers);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      CountingModel model;
      if (pace.before_compute) model.before_compute = [&, w] { pace.before_compute(w); };
      Worker worker(w, std::move(model), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = 0;; ++k) {
        if (pace.before_step) pace.before_step(w, k);
        const auto result = worker.step(counting_batch(w, k), last);
        if (pace.after_step) pace.after_step(w, result ? &*result : nullptr);
        if (!result) break;
        results[w].push_back(*result);
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

/// The rows `expected` names (id → value) read back from the ps tasks as exactly those values.
void check_rows(Chief<InProcess>& chief, const std::map<std::uint64_t, float>& expected) {
  std::vector<std::uint64_t> ids;
  std::vector<float> want;
  for (const auto& [id, value] : expected) {
    ids.push_back(id);
    want.push_back(value);
  }
  CHECK(chief.read_rows("emb", ids) == want);
}

}  // namespace

TEST_CASE("sync R < N with tables: a slow backup worker's rows are dropped as stale, the others' applied once a step") {
  // Worker 2 (the backup) computes each gradient only once workers 0 and 1 had 4 more
  // fresh pushes taken (two steps completed after its token's), so each of its pushes lands
  // late however the threads run; workers 0 and 1 wait halfway until worker 2 waits so
  // (holding a token), or pushed late already, so that it pushes late before the end. They
  // never wait for a push of its to complete (one could be waiting for them). Once one of
  // them finished it is held no more: the other may need its push to end. Which pushes were
  // fresh is the ps tasks' word (StepResult::stale_parts).
  constexpr std::int64_t kSteps = 60;
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{1.0F}, SyncReplicas(2, 3));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const CountingModel shape;
  chief.initialize(shape.variables(), shape.tables());
  std::mutex mutex;
  std::condition_variable changed;
  std::int64_t fresh_taken = 0;  // workers 0 and 1's fresh pushes
  int finished = 0;              // workers 0 and 1 done
  bool backup_waiting = false;   // worker 2 holds a token and waits to compute
  std::int64_t backup_late = 0;  // worker 2's pushes dropped as stale
  bool backup_done = false;      // worker 2 heard that training is over
  bool gave_up = false;
  Pace pace;
  pace.before_compute = [&](std::uint32_t w) {
    if (w != 2) return;
    std::unique_lock lock(mutex);
    const std::int64_t until = fresh_taken + 4;
    backup_waiting = true;
    changed.notify_all();
    gave_up |= !changed.wait_for(lock, std::chrono::seconds(30), [&] { return fresh_taken >= until || finished > 0; });
    backup_waiting = false;
  };
  pace.before_step = [&](std::uint32_t w, std::int64_t k) {
    if (w == 2 || k != kSteps / 2) return;
    std::unique_lock lock(mutex);
    gave_up |= !changed.wait_for(lock, std::chrono::seconds(30),
                                 [&] { return backup_waiting || backup_late > 0 || backup_done; });
  };
  pace.after_step = [&](std::uint32_t w, const StepResult* result) {
    const std::lock_guard lock(mutex);
    if (w == 2) {
      backup_late += result != nullptr && result->stale_parts > 0 ? 1 : 0;
      backup_done = result == nullptr;
    } else if (result == nullptr) {
      ++finished;
    } else {
      fresh_taken += result->stale_parts == 0 ? 1 : 0;
    }
    changed.notify_all();
  };
  const auto results = train_counting(cluster, 3, kSteps, pace);
  CHECK_FALSE(gave_up);
  // A row's value is minus the steps whose fresh pushes used it (a row both fresh pushes of
  // a step carry is their mean: one update); rows only stale pushes carried stay at 0.
  std::map<std::int64_t, std::set<std::uint64_t>> used;  // by the step the push was for
  std::set<std::uint64_t> late_rows;
  std::int64_t fresh = 0, late = 0;
  for (std::uint32_t w = 0; w < 3; ++w) {
    for (std::size_t k = 0; k < results[w].size(); ++k) {
      const StepResult& r = results[w][k];
      CAPTURE(w);
      CAPTURE(k);
      const auto batch = counting_batch(w, static_cast<std::int64_t>(k));
      if (r.stale_parts == 0) {
        ++fresh;
        used[r.local_step].insert(batch.begin(), batch.end());
      } else {
        ++late;
        late_rows.insert(batch.begin(), batch.end());
      }
    }
  }
  CHECK(fresh == 2 * kSteps);  // R = 2 fresh pushes made each step
  CHECK(late > 0);
  std::map<std::uint64_t, float> expected;
  for (const auto& [step, ids] : used) {
    for (const std::uint64_t id : ids) expected[id] -= 1.0F;
  }
  for (const std::uint64_t id : late_rows) expected.emplace(id, 0.0F);
  check_rows(chief, expected);
  CHECK(expected.at(mix_id(999)) == -static_cast<float>(kSteps));
  std::int64_t stale = 0;
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == kSteps);
    stale += s.stale_gradients_dropped;
  }
  CHECK(stale > 0);
  chief.shutdown();
}

TEST_CASE("bounded staleness with tables: every push's rows applied exactly once, no worker more than s clocks ahead") {
  constexpr std::int64_t kStaleness = 1;
  constexpr std::int64_t kSteps = 40;
  Cluster<RoundRobin, Sgd, BoundedStaleness> cluster(2, Sgd{1.0F}, BoundedStaleness(kStaleness, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const CountingModel shape;
  chief.initialize(shape.variables(), shape.tables());
  cluster.network().delay(Node::worker(1), std::chrono::milliseconds(2));
  const auto results = train_counting(cluster, 2, kSteps);
  // Each push is applied on its own: a row's value is minus the pushes that used it.
  std::map<std::uint64_t, float> expected;
  bool bound_reached = false;
  for (std::uint32_t w = 0; w < 2; ++w) {
    REQUIRE(results[w].size() >= static_cast<std::size_t>(kSteps));
    for (std::size_t k = 0; k < results[w].size(); ++k) {
      const StepResult& r = results[w][k];
      CHECK(r.stale_parts == 0);
      CHECK(r.local_step - r.global_step <= kStaleness);
      bound_reached = bound_reached || r.local_step - r.global_step == kStaleness;
      for (const std::uint64_t id : counting_batch(w, static_cast<std::int64_t>(k))) expected[id] -= 1.0F;
    }
  }
  CHECK(bound_reached);  // the fast worker was held back
  check_rows(chief, expected);
  for (const Stats& s : chief.stats()) {
    CHECK(s.stale_gradients_dropped == 0);
    CHECK(s.table_rows_dropped == 0);
  }
  chief.shutdown();
}
