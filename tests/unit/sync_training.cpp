// SPDX-License-Identifier: MIT
// End-to-end aggregation semantics on the in-process cluster: SyncReplicas in its three
// regimes and Async, with workers as threads.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/wait.hpp"

using namespace pulley;
using namespace std::chrono_literals;
using pulley::testing::Cluster;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using pulley::testing::LogCapture;

namespace {

constexpr std::size_t kIn = 5, kOut = 3, kBatch = 4;
constexpr std::uint64_t kSeed = 7;
constexpr float kLearningRate = 0.1F;

LinearBatch rows_of(const LinearData& data, std::size_t first, std::size_t count) {
  return {std::span(data.x).subspan(first * kIn, count * kIn),
          std::span(data.y).subspan(first * kOut, count * kOut)};
}

// SyncReplicas with R = N over 2 ps (variables split with FixedShards) must equal
// single-process SGD on the union of the workers' batches, step for step.
void check_sync_equals_union_sgd(std::uint32_t workers) {
  constexpr std::int64_t kSteps = 100;
  const LinearData data(workers * kBatch * kSteps, kIn, kOut, 42);
  // Worker w's batch at step s is rows [(s*workers + w)*kBatch, +kBatch), so step s's union
  // is the contiguous block [s*workers*kBatch, +workers*kBatch).
  LinearModel reference(kIn, kOut);
  reference.initialize(kSeed);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    reference.compute_gradients(rows_of(data, s * workers * kBatch, workers * kBatch));
    for (std::size_t v = 0; v < 2; ++v) {
      auto w = reference.parameter(v);
      auto g = reference.gradient(v);
      for (std::size_t i = 0; i < w.size(); ++i) w[i] -= kLearningRate * g[i];
    }
  }

  Cluster<FixedShards, Sgd, SyncReplicas> cluster(
      2, Sgd{kLearningRate}, SyncReplicas(static_cast<int>(workers), static_cast<int>(workers)),
      FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());

  std::vector<std::vector<std::int64_t>> local_steps(workers);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = 0;; ++k) {
        const auto batch = rows_of(data, ((k % kSteps) * workers + w) * kBatch, kBatch);
        const auto result = worker.step(batch, kSteps);
        if (!result) break;
        local_steps[w].push_back(result->local_step);
      }
    });
  }
  for (auto& t : threads) t.join();

  // One batch per worker per step, in order.
  for (std::uint32_t w = 0; w < workers; ++w) {
    REQUIRE(local_steps[w].size() == static_cast<std::size_t>(kSteps));
    for (std::int64_t k = 0; k < kSteps; ++k) CHECK(local_steps[w][k] == k);
  }
  const auto values = chief.read_variables();
  float max_diff = 0.0F;
  for (std::size_t v = 0; v < 2; ++v) {
    for (std::size_t i = 0; i < values[v].size(); ++i) {
      max_diff = std::max(max_diff, std::abs(values[v][i] - reference.parameter(v)[i]));
    }
  }
  CHECK(max_diff <= 1e-5F);
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == kSteps);
    CHECK(s.stale_gradients_dropped == 0);
  }
  chief.shutdown();
}

}  // namespace

TEST_CASE("sync R = N with 2 workers equals single-process SGD on the union of batches") {
  check_sync_equals_union_sgd(2);
}

TEST_CASE("sync R = N with 3 workers equals single-process SGD on the union of batches") {
  check_sync_equals_union_sgd(3);
}

TEST_CASE("sync R < N: a slow backup worker's gradients are dropped as stale, never applied") {
  // Worker 2 computes each gradient only once workers 0 and 1 have had 4 more gradients
  // taken (R = 2: at least one more step completed after its token's): each of its pushes
  // lands after its step, however the threads are scheduled. Workers 0 and 1 wait halfway
  // until worker 2 waits so (holding a token) or has pushed, so that it pushes before the
  // end however late its thread starts.
  constexpr std::int64_t kSteps = 150;
  const LinearData data(64, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(1, Sgd{0.01F}, SyncReplicas(2, 3));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());

  std::mutex mutex;
  std::condition_variable progressed;
  std::int64_t taken = 0;  // gradients of workers 0 and 1 not dropped
  int finished = 0;        // of workers 0 and 1
  bool backup_waiting = false;  // worker 2 holds a token and waits to compute
  bool gave_up = false;    // worker 2 waited 30 s for them, or they for it
  struct HeldBack : LinearModel {
    using LinearModel::LinearModel;
    std::function<void()> before;
    float compute_gradients(const Batch& batch) {
      before();
      return LinearModel::compute_gradients(batch);
    }
  };

  std::vector<std::vector<StepResult>> results(3);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      HeldBack model(kIn, kOut);
      model.before = [&, w] {
        if (w != 2) return;
        std::unique_lock lock(mutex);
        const std::int64_t until = taken + 4;
        backup_waiting = true;
        progressed.notify_all();
        if (!progressed.wait_for(lock, 30s, [&] { return taken >= until || finished == 2; })) gave_up = true;
        backup_waiting = false;
      };
      Worker worker(w, std::move(model), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::size_t k = 0;; ++k) {
        if (w != 2 && k == kSteps / 2) {
          std::unique_lock lock(mutex);
          if (!progressed.wait_for(lock, 30s, [&] { return backup_waiting || !results[2].empty(); })) gave_up = true;
        }
        const auto result = worker.step(rows_of(data, (k * 4) % 60, 4), kSteps);
        const std::lock_guard lock(mutex);
        if (!result) {
          finished += w != 2 ? 1 : 0;
          progressed.notify_all();
          break;
        }
        results[w].push_back(*result);
        taken += w != 2 && result->stale_parts == 0 ? 1 : 0;
        progressed.notify_all();
      }
    });
  }
  for (auto& t : threads) t.join();

  CHECK_FALSE(gave_up);
  const Stats stats = chief.stats().at(0);
  CHECK(stats.global_step == kSteps);
  CHECK(stats.updates_applied == 2 * kSteps);  // two parts, one application per step each
  REQUIRE_FALSE(results[2].empty());
  for (const StepResult& r : results[2]) CHECK(r.stale_parts == 2);
  CHECK(stats.stale_gradients_dropped >= 2 * static_cast<std::int64_t>(results[2].size()));
  chief.shutdown();
}

TEST_CASE("sync R < N: a dead backup worker does not stall training") {
  constexpr std::int64_t kSteps = 50;
  const LinearData data(16, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{0.01F}, SyncReplicas(2, 3));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());
  cluster.network().kill(Node::worker(2));

  std::vector<std::thread> threads;
  std::vector<int> failed(3, 0);
  for (std::uint32_t w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      try {
        worker.wait_ready();
        while (worker.step(rows_of(data, 4 * w, 4), kSteps)) {
        }
      } catch (const Error& e) {
        failed[w] = e.code() == ErrorCode::kUnavailable ? 1 : 2;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failed == std::vector<int>{0, 0, 1});
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kSteps);
  chief.shutdown();
}

TEST_CASE("sync R < N: a worker that dies holding a token of step 0 does not stall training") {
  constexpr std::int64_t kSteps = 30;
  const LinearData data(16, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{0.01F}, SyncReplicas(2, 3));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());
  {  // worker 2 takes its token of step 0, then its process dies
    InProcess doomed = cluster.endpoint(Node::worker(2));
    PendingCall token = doomed.call(0, TakeToken{2});
    REQUIRE(std::holds_alternative<TokenReply>(token.get()));
    cluster.network().kill(Node::worker(2));
  }
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      while (worker.step(rows_of(data, 4 * w, 4), kSteps)) {
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kSteps);
  chief.shutdown();
}

TEST_CASE("sync R > N: a fast worker contributes several gradients to one step") {
  constexpr std::int64_t kSteps = 10;
  const LinearData data(16, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(1, Sgd{0.01F}, SyncReplicas(3, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());
  cluster.network().delay(Node::worker(1), std::chrono::milliseconds(3));

  std::vector<std::vector<StepResult>> results(2);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::size_t k = 0;; ++k) {
        const auto result = worker.step(rows_of(data, (k % 4) * 4, 4), kSteps);
        if (!result) break;
        results[w].push_back(*result);
      }
    });
  }
  for (auto& t : threads) t.join();

  const Stats stats = chief.stats().at(0);
  CHECK(stats.global_step == kSteps);
  CHECK(stats.updates_applied == 2 * kSteps);
  // Every applied update averaged exactly R = 3 fresh gradients.
  CHECK(stats.gradients_accepted == 3 * stats.updates_applied);
  // Three fresh gradients from two workers at every step: each step took two of one worker's
  // (whichever ran faster there, so the check holds however the threads are scheduled).
  std::map<std::int64_t, std::array<int, 2>> fresh_per_step;
  for (std::uint32_t w = 0; w < 2; ++w) {
    for (const StepResult& r : results[w]) {
      if (r.stale_parts == 0) ++fresh_per_step[r.local_step][w];
    }
  }
  CHECK(fresh_per_step.size() == static_cast<std::size_t>(kSteps));
  for (const auto& [step, fresh] : fresh_per_step) {
    CAPTURE(step);
    CHECK(fresh[0] + fresh[1] == 3);
  }
  chief.shutdown();
}

namespace {

// A model whose gradient is all ones: W workers x K pushes move a zero variable to
// exactly W*K*(-lr) under async SGD (no update may be lost or applied twice).
class Ones {
 public:
  struct Batch {};
  std::span<const VariableSpec> variables() const { return variables_; }
  std::span<float> parameter(std::size_t) { return values_; }
  std::span<const float> gradient(std::size_t) const { return ones_; }
  float compute_gradients(const Batch&) { return 0.0F; }

 private:
  std::vector<VariableSpec> variables_{{"v", {6}, Initializer::zeros()}};
  std::vector<float> values_ = std::vector<float>(6);
  std::vector<float> ones_ = std::vector<float>(6, 1.0F);
};

}  // namespace

TEST_CASE("async: W workers x K pushes of ones end at exactly W*K*(-lr)") {
  constexpr std::uint32_t kWorkers = 3;
  constexpr int kPushes = 50;
  Cluster<FixedShards, Sgd, Async> cluster(2, Sgd{0.25F}, Async{}, FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(Ones{}.variables());
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, Ones{}, cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (int k = 0; k < kPushes; ++k) CHECK(worker.step(Ones::Batch{}).has_value());
    });
  }
  for (auto& t : threads) t.join();
  const auto values = chief.read_variables();
  for (float v : values.at(0)) CHECK(v == -0.25F * kWorkers * kPushes);
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == kWorkers * kPushes);
    CHECK(s.updates_applied == kWorkers * kPushes);  // one part per ps
  }
  chief.shutdown();
}

TEST_CASE("a step's staleness counts the other pushes applied between its pull and the pull that ends it") {
  Cluster<FixedShards, Sgd, Async> cluster(2, Sgd{0.25F}, Async{}, FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(Ones{}.variables());
  // Async, two workers stepping in turn from one thread: after each one's first step, every
  // gradient was computed on parameters one push older than its own push found.
  Worker first(0, Ones{}, cluster.endpoint(Node::worker(0)));
  Worker second(1, Ones{}, cluster.endpoint(Node::worker(1)));
  first.wait_ready();
  second.wait_ready();
  std::vector<std::int64_t> seen;
  for (int k = 0; k < 5; ++k) {
    for (Worker<Ones, InProcess>* worker : {&first, &second}) {
      const auto result = worker->step(Ones::Batch{});
      REQUIRE(result.has_value());
      seen.push_back(result->staleness);
    }
  }
  // The first worker's first step saw nothing in between; the second's first step pulled
  // fresh parameters; every later step saw the other worker's push.
  CHECK(seen == std::vector<std::int64_t>{0, 0, 1, 1, 1, 1, 1, 1, 1, 1});
  // One worker alone: nothing comes in between.
  for (int k = 0; k < 3; ++k) CHECK(first.step(Ones::Batch{})->staleness == (k == 0 ? 1 : 0));
  chief.shutdown();
}

TEST_CASE("bounded staleness: no worker ever runs more than s clocks ahead of the slowest") {
  constexpr std::int64_t kStaleness = 2;
  constexpr std::int64_t kSteps = 60;
  const LinearData data(64, kIn, kOut, 1);
  Cluster<FixedShards, Sgd, BoundedStaleness> cluster(2, Sgd{0.01F},
                                                      BoundedStaleness(kStaleness, 3), FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());
  // Three speeds: without the bound, worker 0 would finish many clocks before worker 2.
  cluster.network().delay(Node::worker(1), std::chrono::microseconds(300));
  cluster.network().delay(Node::worker(2), std::chrono::milliseconds(2));

  std::vector<std::vector<StepResult>> results(3);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::size_t k = 0;; ++k) {
        const auto result = worker.step(rows_of(data, (k * 4) % 60, 4), kSteps);
        if (!result) break;
        results[w].push_back(*result);
      }
    });
  }
  for (auto& t : threads) t.join();

  bool bound_reached = false;
  for (std::uint32_t w = 0; w < 3; ++w) {
    REQUIRE(results[w].size() >= static_cast<std::size_t>(kSteps));
    for (std::size_t k = 0; k < results[w].size(); ++k) {
      const StepResult& r = results[w][k];
      CHECK(r.local_step == static_cast<std::int64_t>(k));  // one clock per step
      // Every token: this worker's clock minus the slowest worker's, when it was granted.
      CHECK(r.local_step - r.global_step <= kStaleness);
      CHECK(r.local_step - r.global_step >= 0);
      bound_reached = bound_reached || r.local_step - r.global_step == kStaleness;
      CHECK(r.stale_parts == 0);  // nothing is dropped under SSP
    }
  }
  CHECK(bound_reached);  // the fast worker was held back, not merely lucky
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == kSteps);
    CHECK(s.stale_gradients_dropped == 0);
  }
  chief.shutdown();
}

TEST_CASE("bounded staleness: a dead worker is reported by name, not waited on forever") {
  const LinearData data(16, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, BoundedStaleness> cluster(2, Sgd{0.01F}, BoundedStaleness(3, 3));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());
  cluster.network().kill(Node::worker(2));
  ClientOptions options;
  options.wait_timeout = std::chrono::milliseconds(500);
  std::vector<std::string> errors(2);
  std::vector<std::int64_t> steps(2, 0);
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)), options);
      worker.wait_ready();
      try {
        while (worker.step(rows_of(data, 4 * w, 4), 1000)) ++steps[w];
      } catch (const Error& e) {
        errors[w] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  for (std::uint32_t w = 0; w < 2; ++w) {
    // Clocks 0..3 are at most three ahead of worker 2; clock 3's push goes in, and the pull
    // that comes back with it (of step 1, what clock 4 must read) is where the wait starts.
    CHECK(steps[w] == 3);
    CHECK(errors[w].find("deadline_exceeded") != std::string::npos);
    CHECK(errors[w].find("worker 2 at clock 0") != std::string::npos);
  }
  chief.shutdown();
}

TEST_CASE("a long wait for a step while training advances is not reported as a stall") {
  // The chief reads the variables at a step about a second ahead of a worker stepping every
  // 10 ms, with stall reports due after 500 ms: the ps tasks move all the while, so nothing
  // may be reported (the first look once took "no step seen yet" for "no step since") --
  // and once the worker stops, the stall is reported while it lasts, then given up.
  const LinearData data(16, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, Async> cluster(2, Sgd{0.01F}, Async{});
  ClientOptions options;
  options.stall_report = std::chrono::milliseconds(500);
  options.wait_timeout = std::chrono::seconds(3);  // more than the wait, were it stalled
  Chief chief(cluster.endpoint(Node::chief()), kSeed, options);
  chief.initialize(LinearModel(kIn, kOut).variables());
  LogCapture log;
  constexpr std::int64_t kSteps = 100;
  std::atomic<std::int64_t> stepped{0};
  std::chrono::steady_clock::duration longest_gap{};  // between two steps: a report is due past 500 ms
  std::thread stepping([&] {
    Worker worker(0, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(0)));
    worker.wait_ready();
    auto last = std::chrono::steady_clock::now();
    for (std::int64_t s = 0; s < kSteps; ++s) {
      CHECK(worker.step(rows_of(data, 0, 4)).has_value());
      const auto now = std::chrono::steady_clock::now();
      if (s > 0) longest_gap = std::max(longest_gap, now - last);
      last = now;
      ++stepped;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  for (int i = 0; i < 2000 && stepped == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(stepped > 0);  // the worker is stepping: the wait starts while the steps move
  const Snapshot shot = chief.snapshot(kSteps);
  CHECK(shot.step >= kSteps);
  stepping.join();
  if (longest_gap < std::chrono::milliseconds(400)) {
    CHECK(log.find(LogLevel::kWarning, "no progress").empty());
  } else {  // the machine held the worker back long enough that a report was right
    MESSAGE("a step took " << std::chrono::duration_cast<std::chrono::milliseconds>(longest_gap).count()
                           << " ms on this loaded machine: whether a stall was reported is not checked");
  }
  // Nothing moves now: a wait for a step never reached is reported while it lasts, then
  // given up after wait_timeout.
  std::optional<ErrorCode> code;
  std::string error;
  try {
    (void)chief.snapshot(kSteps + 1);
  } catch (const Error& e) {
    code = e.code();
    error = e.what();
  }
  CHECK(code == ErrorCode::kDeadlineExceeded);
  CHECK(error.find("no progress") != std::string::npos);
  CHECK(!log.find(LogLevel::kWarning, "no progress").empty());
  chief.shutdown();
}

TEST_CASE("a worker waiting for a step stops cleanly when the chief ends training") {
  const LinearData data(16, kIn, kOut, 1);
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(1, Sgd{0.01F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(LinearModel(kIn, kOut).variables());
  std::optional<bool> stepped;
  bool finished = false;
  std::thread lonely([&] {  // worker 1 never comes: worker 0's step 0 never completes
    Worker worker(0, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(0)));
    worker.wait_ready();
    stepped = worker.step(rows_of(data, 0, 4)).has_value();  // pushes, then waits for step 1
    stepped = stepped.value() && worker.step(rows_of(data, 0, 4)).has_value();
    finished = worker.finished();
  });
  // Ended once worker 0 pushed and waits (not before it is ready: that is another case).
  CHECK(testing::wait_until([&] { return chief.stats().at(0).gradients_accepted > 0; }));
  chief.shutdown();
  lonely.join();
  CHECK(stepped == false);  // the end of training, not an error
  CHECK(finished);
}

namespace {

/// Two variables (one per ps under RoundRobin) whose gradient is all ones: under Sgd{1}
/// every push lowers every parameter by exactly 1, so a parameter's value counts the pushes
/// applied before it was read. Records that count at each step, per variable.
class PushCounter {
 public:
  struct Batch {};
  std::span<const VariableSpec> variables() const { return variables_; }
  std::span<float> parameter(std::size_t i) { return values_[i]; }
  std::span<const float> gradient(std::size_t) const { return ones_; }
  float compute_gradients(const Batch&) {
    seen.push_back({-values_[0][0], -values_[1][0]});
    return 0.0F;
  }
  std::vector<std::array<float, 2>> seen;  ///< pushes counted on ps 0 and ps 1, by step

 private:
  std::vector<VariableSpec> variables_{{"a", {1}, Initializer::zeros()},
                                       {"b", {1}, Initializer::zeros()}};
  std::vector<std::vector<float>> values_{std::vector<float>(1), std::vector<float>(1)};
  std::vector<float> ones_ = std::vector<float>(1, 1.0F);
};

}  // namespace

TEST_CASE("bounded staleness: a step reads every update of clocks before c - s, on every ps") {
  constexpr std::int64_t kStaleness = 1;
  constexpr std::uint32_t kWorkers = 3;
  constexpr std::int64_t kSteps = 40;
  Cluster<RoundRobin, Sgd, BoundedStaleness> cluster(2, Sgd{1.0F},
                                                     BoundedStaleness(kStaleness, kWorkers));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.initialize(PushCounter{}.variables());
  // ps 1 lags: its pushes land late, and a read of it must wait for the clocks it needs.
  cluster.network().delay(Node::ps(1), std::chrono::microseconds(400));
  cluster.network().delay(Node::worker(2), std::chrono::microseconds(700));
  std::vector<std::vector<std::int64_t>> clocks(kWorkers);
  std::vector<std::vector<std::array<float, 2>>> seen(kWorkers);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, PushCounter{}, cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      while (const auto result = worker.step({}, kSteps)) clocks[w].push_back(result->local_step);
      seen[w] = worker.model().seen;
    });
  }
  for (auto& t : threads) t.join();
  for (std::uint32_t w = 0; w < kWorkers; ++w) {
    REQUIRE(seen[w].size() >= clocks[w].size());
    for (std::size_t k = 0; k < clocks[w].size(); ++k) {
      // Clock c reads step c - s: every worker's pushes of clocks before it, on both ps.
      const std::int64_t must = kWorkers * std::max<std::int64_t>(clocks[w][k] - kStaleness, 0);
      CHECK(seen[w][k][0] >= static_cast<float>(must));
      CHECK(seen[w][k][1] >= static_cast<float>(must));
    }
  }
  chief.shutdown();
}
