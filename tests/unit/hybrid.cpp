// SPDX-License-Identifier: MIT
// The hybrid job of the role runner (run_hybrid): tables on ps tasks, dense variables on a
// ring of the workers and the chief's replica. In one process it ends where one process
// applying sync R = N's rule ends; its checkpoints hold the dense variables beside the
// rows, and a job resumed from one ends bit for bit where the job undisturbed ends; one
// task per thread over TCP ends exactly as in-process.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/runner/hybrid.hpp"
#include "pulley/tables/tables.hpp"
#include "support/log_capture.hpp"
#include "support/table_model.hpp"
#include "support/tcp.hpp"

using namespace pulley;
using pulley::testing::TableBatchOf;
using pulley::testing::TinyTableModel;
using namespace pulley::testing::table_job;

namespace {

/// What the chief's last evaluation saw: the dense values and the rows of `ids`.
struct Seen {
  std::mutex mutex;
  std::int64_t step = -1;
  std::vector<float> dense;
  std::vector<float> rows;
  int evaluations = 0;
};

struct Fixture {
  std::vector<TableBatchOf> batches = pulley::testing::table_batches(kSteps * kWorkers, 8, 200, 3);
  std::vector<std::uint64_t> ids;  ///< every id a batch uses, ascending
  Seen seen;

  Fixture() {
    for (const TableBatchOf& b : batches) {
      for (const auto& e : b) ids.insert(ids.end(), e.ids.begin(), e.ids.end());
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }

  Training<TinyTableModel> training(std::int64_t last_step, const std::string& checkpoints = "") {
    Training<TinyTableModel> t;
    t.model = [] { return TinyTableModel(); };
    t.data = [this](const DataShard& shard) {
      return [this, shard] { return batches[static_cast<std::size_t>(shard.batch()) % batches.size()]; };
    };
    t.last_step = last_step;
    t.evaluate_every = 10;
    t.samples_per_step = 16;
    t.seed = kSeed;
    t.checkpoint.directory = checkpoints;
    t.checkpoint.save_steps = checkpoints.empty() ? 0 : 5;
    t.checkpoint.keep = 0;  // all
    t.client.request_timeout = std::chrono::seconds(20);
    t.evaluate = [this](TinyTableModel& model, const Evaluation& e) {
      std::vector<float> rows(ids.size() * TinyTableModel::kDim);
      e.rows(0, ids, rows);
      std::scoped_lock lock(seen.mutex);
      ++seen.evaluations;
      if (!e.last) return;
      seen.step = e.step;
      seen.dense.clear();
      for (std::size_t v = 0; v < 2; ++v) {
        const auto p = model.parameter(v);
        seen.dense.insert(seen.dense.end(), p.begin(), p.end());
      }
      seen.rows = std::move(rows);
    };
    return t;
  }
};

using TinyTables = Tables<Sgd>;

int run_in_process(const Training<TinyTableModel>& training) {
  Job job;
  job.local_ps = 2;
  job.local_workers = kWorkers;
  return run_hybrid(job, training, Sgd{kLearningRate}, TinyTables{Sgd{kLearningRate}});
}

}  // namespace

TEST_CASE("a hybrid job in one process ends where one process applying sync R = N ends, its checkpoints whole") {
  const auto dir = std::filesystem::temp_directory_path() / ("pulley-hybrid-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Fixture f;
  REQUIRE(run_in_process(f.training(kSteps, dir.string())) == 0);

  pulley::testing::SyncReference reference(kSeed, kLearningRate);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    reference.step({&f.batches[static_cast<std::size_t>(s * 2)], &f.batches[static_cast<std::size_t>(s * 2 + 1)]});
  }
  CHECK(f.seen.step == kSteps);
  CHECK(f.seen.evaluations == 3);  // steps 10, 20, 30
  std::vector<float> expected(reference.model.parameter(0).begin(), reference.model.parameter(0).end());
  expected.insert(expected.end(), reference.model.parameter(1).begin(), reference.model.parameter(1).end());
  REQUIRE(f.seen.dense.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(f.seen.dense[i] == doctest::Approx(expected[i]).epsilon(1e-5));
  }
  float max_diff = 0.0F;
  for (std::size_t i = 0; i < f.ids.size(); ++i) {
    for (std::size_t k = 0; k < TinyTableModel::kDim; ++k) {
      max_diff = std::max(max_diff, std::abs(f.seen.rows[i * TinyTableModel::kDim + k] - reference.rows[f.ids[i]][k]));
    }
  }
  CHECK(max_diff <= 1e-6F);

  // The last checkpoint: the dense variables (the values the chief evaluated, and the
  // optimizer's slots) beside the tables' rows, at the last step.
  const auto latest = CheckpointDirectory(dir.string(), 0).latest();
  REQUIRE(latest.has_value());
  const ModelState& state = latest->first;
  CHECK(state.global_step == kSteps);
  REQUIRE(state.variables.size() == 2);
  CHECK(state.variables[0].spec.name == "bias");
  std::vector<float> saved = state.variables[0].values;
  saved.insert(saved.end(), state.variables[1].values.begin(), state.variables[1].values.end());
  CHECK(saved == f.seen.dense);
  REQUIRE(state.tables.size() == 1);
  CHECK(state.tables[0].ids.size() == f.ids.size());  // every row a batch used
  std::filesystem::remove_all(dir);
}

TEST_CASE("a hybrid job resumed from a checkpoint cut mid-run ends bit for bit where the job undisturbed ends") {
  const auto dir = std::filesystem::temp_directory_path() / ("pulley-hybrid-resume-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Fixture whole;
  REQUIRE(run_in_process(whole.training(kSteps, dir.string())) == 0);
  // Keep the checkpoints up to step 17 only: the newest is one the chief cut while training
  // was held, mid-run, not the one after the last step.
  std::int64_t newest = -1;
  for (const auto& [step, path] : CheckpointDirectory::list(dir)) {
    if (step > 17) {
      std::filesystem::remove_all(path);
    } else {
      newest = std::max(newest, step);
    }
  }
  REQUIRE(newest >= 5);  // the chief cuts at the first step it holds training at, once the due one is reached
  REQUIRE(newest <= 17);
  Fixture resumed;
  REQUIRE(run_in_process(resumed.training(kSteps, dir.string())) == 0);
  CHECK(resumed.seen.step == kSteps);
  CHECK(resumed.seen.dense == whole.seen.dense);
  CHECK(resumed.seen.rows == whole.seen.rows);

  // Started again once more, at its last step's checkpoint: there is nothing to train, and
  // it ends at once with the same model.
  Fixture again;
  REQUIRE(run_in_process(again.training(kSteps, dir.string())) == 0);
  CHECK(again.seen.dense == whole.seen.dense);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a hybrid job as one task per thread over TCP ends exactly where it ends in one process") {
  Fixture local;
  REQUIRE(run_in_process(local.training(kSteps)) == 0);

  const auto addresses = pulley::testing::free_addresses(5);
  ClusterSpec cluster;
  cluster.roles["ps"] = {addresses[0], addresses[1]};
  cluster.roles["worker"] = {addresses[2], addresses[3]};
  cluster.roles["chief"] = {addresses[4]};
  Fixture f;
  const Training<TinyTableModel> training = f.training(kSteps);
  std::vector<std::pair<Job, int>> tasks;
  for (const auto& [type, count] : std::vector<std::pair<std::string, std::uint32_t>>{{"ps", 2}, {"worker", 2}, {"chief", 1}}) {
    for (std::uint32_t i = 0; i < count; ++i) {
      Job job;
      job.cluster = TfConfig{cluster, {type, i}};
      job.credentials = {"hybrid-test", "a secret only this test knows"};
      tasks.emplace_back(std::move(job), -1);
    }
  }
  std::vector<std::thread> threads;
  for (auto& [job, status] : tasks) {
    threads.emplace_back([&, &job = job, &status = status] {
      status = run_hybrid(job, training, Sgd{kLearningRate}, TinyTables{Sgd{kLearningRate}});
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& [job, status] : tasks) {
    INFO(job.name());
    CHECK(status == 0);
  }
  CHECK(f.seen.step == kSteps);
  CHECK(f.seen.dense == local.seen.dense);
  CHECK(f.seen.rows == local.seen.rows);
}

TEST_CASE("a hybrid cluster without a chief task, or with an evaluator but no checkpoints, is refused by name") {
  Fixture f;
  const auto addresses = pulley::testing::free_addresses(3);
  ClusterSpec cluster;
  cluster.roles["ps"] = {addresses[0]};
  cluster.roles["worker"] = {addresses[1], addresses[2]};
  Job job;
  job.cluster = TfConfig{cluster, {"worker", 0}};
  job.credentials = {"hybrid-test", "a secret only this test knows"};
  pulley::testing::LogCapture log;
  CHECK(run_hybrid(job, f.training(kSteps), Sgd{kLearningRate}, TinyTables{Sgd{kLearningRate}}) == 1);
  CHECK(log.find(LogLevel::kError, "a hybrid job needs a chief task").size() == 1);
  cluster.roles["chief"] = {addresses[2]};
  cluster.roles["worker"] = {addresses[1]};
  job.cluster = TfConfig{cluster, {"evaluator", 0}};
  CHECK(run_hybrid(job, f.training(kSteps), Sgd{kLearningRate}, TinyTables{Sgd{kLearningRate}}) == 1);
  CHECK(log.find(LogLevel::kError, "evaluator scores the checkpoints").size() == 1);
}
