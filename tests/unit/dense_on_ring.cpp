// SPDX-License-Identifier: MIT
// The hybrid of the two architectures: embedding tables on ps tasks, dense variables
// all-reduced among the workers (DenseOnRing). Sync R = N over 2 ps tasks and a ring of 2
// workers ends where one process applying TensorFlow's sync rule ends, the ps tasks hold
// rows only, and the dense replicas stay bit-identical.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/dense_on_ring.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "support/cluster.hpp"
#include "support/table_model.hpp"

using namespace pulley;
using pulley::testing::TableBatchOf;
using pulley::testing::TinyTableModel;
using namespace pulley::testing::table_job;

namespace {

using Hybrid = DenseOnRing<TinyTableModel, Sgd, InProcessRing>;
static_assert(TableModel<Hybrid>);

}  // namespace

TEST_CASE("tables on 2 ps and dense variables on a ring of 2 workers end where one process applying sync R = N ends") {
  const auto batches = pulley::testing::table_batches(kSteps * kWorkers, 8, 200, 3);
  testing::Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{kLearningRate}, SyncReplicas(kWorkers, kWorkers));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape;
  chief.initialize({}, shape.tables());  // the ps tasks hold the tables only

  auto ring = InProcessRing::make(kWorkers, std::chrono::seconds(10));
  std::vector<std::vector<float>> replicas(kWorkers);
  std::vector<std::int64_t> dense_steps(kWorkers);
  std::vector<std::string> failures(kWorkers);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      try {
        Worker worker(w, Hybrid(TinyTableModel(), Sgd{kLearningRate}, std::move(ring[w]), kSeed),
                      cluster.endpoint(Node::worker(w)));
        worker.wait_ready();
        // The call that finds training over reads a batch it does not use.
        for (std::int64_t k = 0; worker.step(batches[static_cast<std::size_t>((k % kSteps) * kWorkers + w)], kSteps);
             ++k) {
        }
        auto& dense = worker.model().dense();
        dense_steps[w] = dense.global_step();
        for (std::size_t v = 0; v < 2; ++v) {
          const auto p = dense.model().parameter(v);
          replicas[w].insert(replicas[w].end(), p.begin(), p.end());
        }
      } catch (const std::exception& e) {
        failures[w] = e.what();
      } catch (...) {
        failures[w] = "a check failed on worker " + std::to_string(w);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& f : failures) REQUIRE(f == "");

  pulley::testing::SyncReference reference(kSeed, kLearningRate);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    reference.step({&batches[static_cast<std::size_t>(s * 2)], &batches[static_cast<std::size_t>(s * 2 + 1)]});
  }
  // The dense variables: every replica took every step, bit-identical to the others, and
  // equal to the reference's (a ring of two adds a + b as the reference does).
  CHECK(dense_steps == std::vector<std::int64_t>(kWorkers, kSteps));
  REQUIRE(replicas[0].size() == 1 + TinyTableModel::kDim);
  CHECK(std::memcmp(replicas[0].data(), replicas[1].data(), replicas[0].size() * sizeof(float)) == 0);
  std::vector<float> expected(reference.model.parameter(0).begin(), reference.model.parameter(0).end());
  expected.insert(expected.end(), reference.model.parameter(1).begin(), reference.model.parameter(1).end());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(replicas[0][i] == doctest::Approx(expected[i]).epsilon(1e-5));
  }
  CHECK(replicas[0] != std::vector<float>{0.0F, 0.3F, 0.3F, 0.3F});  // it learnt

  // The tables: on the ps tasks, as the reference's rows; no dense variable there.
  CHECK(chief.read_variables().empty());
  std::vector<std::uint64_t> ids;
  for (const auto& [id, r] : reference.rows) ids.push_back(id);
  const std::vector<float> rows = chief.read_rows("emb", ids);
  float max_diff = 0.0F;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    for (std::size_t k = 0; k < TinyTableModel::kDim; ++k) {
      max_diff = std::max(max_diff, std::abs(rows[i * TinyTableModel::kDim + k] - reference.rows[ids[i]][k]));
    }
  }
  CHECK(max_diff <= 1e-6F);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kSteps);
  chief.shutdown();
}

TEST_CASE("DenseOnRing shows the ps tasks its tables and no variable, and says why when one is asked for") {
  auto ring = InProcessRing::make(1);
  Hybrid model(TinyTableModel(), Sgd{0.1F}, std::move(ring[0]), kSeed);
  CHECK(model.variables().empty());
  REQUIRE(model.tables().size() == 1);
  CHECK(model.tables()[0].name == "emb");
  CHECK_THROWS_WITH_AS(model.parameter(0), doctest::Contains("all-reduced"), std::out_of_range);
  CHECK_THROWS_AS((void)model.gradient(1), std::out_of_range);
  std::vector<std::uint64_t> ids;
  model.lookup(TableBatchOf{{{7, 9}, 1.0F}}, 0, ids);
  CHECK(ids == std::vector<std::uint64_t>{7, 9});
}
