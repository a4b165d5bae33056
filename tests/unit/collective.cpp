// SPDX-License-Identifier: MIT
// The ring all-reduce over threads of one process: every rank ends with the exact sum (in the
// order the ring adds), bit-identical on every rank, for any ring size, tensor size and
// segment size; ranks out of step fail instead of adding unrelated bytes; a lost rank fails
// its neighbours; and AllReduceWorker replicas trained many steps stay bit-identical and
// equal a single process applying the same mean gradients.

#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/client/all_reduce_worker.hpp"
#include "pulley/collective/ring_all_reduce.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "support/linear_model.hpp"

using namespace pulley;

namespace {

/// Runs `body(rank, link)` on one thread per rank; returns each rank's exception text, "" if
/// none. A rank that throws leaves the ring.
std::vector<std::string> on_ring(std::vector<InProcessRing>& ring,
                                 const std::function<void(std::size_t, InProcessRing&)>& body) {
  std::vector<std::string> failures(ring.size());
  std::vector<std::jthread> threads;
  for (std::size_t r = 0; r < ring.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, ring[r]);
      } catch (const std::exception& e) {
        failures[r] = e.what();
        ring[r].leave();  // as a process that fails closes its sockets
      } catch (...) {  // a REQUIRE that failed on this thread
        failures[r] = "a check failed on rank " + std::to_string(r);
        ring[r].leave();
      }
    });
  }
  threads.clear();
  return failures;
}

float value(std::size_t rank, std::size_t i) {
  return static_cast<float>((rank * 7919 + i * 104729) % 1000) / 37.0F - 13.0F;
}

/// The sum the ring computes: chunk c's elements are added starting at rank c, around the ring.
std::vector<float> ring_order_sum(std::size_t ranks, std::size_t n) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t c = 0;
    while (n * (c + 1) / ranks <= i) ++c;
    float s = value(c, i);
    for (std::size_t k = 1; k < ranks; ++k) s += value((c + k) % ranks, i);
    out[i] = s;
  }
  return out;
}

}  // namespace

TEST_CASE("every rank ends with the ring's sum, bit for bit, for any ring, tensor and segment size") {
  for (std::size_t ranks : {1U, 2U, 3U, 5U}) {
    for (std::size_t n : {0U, 1U, 4U, 7U, 1000U, 65537U}) {
      for (std::size_t segment : {1U, 3U, 1024U, 1U << 15U}) {
        if (segment < 16 && n > 1000) continue;  // a million tiny segments prove nothing more
        CAPTURE(ranks);
        CAPTURE(n);
        CAPTURE(segment);
        auto ring = InProcessRing::make(ranks);
        std::vector<std::vector<float>> data(ranks, std::vector<float>(n));
        for (std::size_t r = 0; r < ranks; ++r) {
          for (std::size_t i = 0; i < n; ++i) data[r][i] = value(r, i);
        }
        const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
          RingAllReduce reduce(segment);
          reduce.sum(link, data[r]);
          reduce.sum(link, std::span<float>());  // an empty call keeps the ranks in step
        });
        for (const std::string& f : failures) CHECK(f == "");
        const std::vector<float> expected = ring_order_sum(ranks, n);
        for (std::size_t r = 0; r < ranks; ++r) {
          REQUIRE(data[r].size() == n);
          CHECK((n == 0 || std::memcmp(data[r].data(), expected.data(), n * sizeof(float)) == 0));
        }
      }
    }
  }
}

TEST_CASE("each rank sends 2 (N - 1) / N of the tensor, and a broadcast copies the root's values") {
  constexpr std::size_t kRanks = 4;
  constexpr std::size_t kN = 4096;
  auto ring = InProcessRing::make(kRanks);
  std::vector<std::uint64_t> sent(kRanks);
  std::vector<std::vector<float>> data(kRanks, std::vector<float>(kN));
  for (std::size_t r = 0; r < kRanks; ++r) {
    for (std::size_t i = 0; i < kN; ++i) data[r][i] = value(r, i);
  }
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    RingAllReduce reduce;
    reduce.sum(link, data[r]);
    sent[r] = reduce.bytes_sent();
    reduce.broadcast(link, data[r], 2);
  });
  for (const std::string& f : failures) CHECK(f == "");
  for (std::size_t r = 0; r < kRanks; ++r) {
    CHECK(sent[r] == 2 * (kRanks - 1) * (kN / kRanks) * sizeof(float) + 32);  // + the header
  }
  for (std::size_t r = 0; r < kRanks; ++r) {
    for (std::size_t i = 0; i < kN; ++i) data[r][i] = value(r, i);
  }
  const auto again = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    RingAllReduce reduce;
    reduce.broadcast(link, data[r], 2);
  });
  for (const std::string& f : again) CHECK(f == "");
  for (std::size_t r = 0; r < kRanks; ++r) CHECK(data[r] == data[2]);
  CHECK(data[0][5] == value(2, 5));
}

TEST_CASE("ranks out of step fail the call, naming both calls, instead of adding unrelated bytes") {
  auto ring = InProcessRing::make(3, std::chrono::seconds(5));
  std::vector<std::vector<float>> data(3, std::vector<float>(100, 1.0F));
  data[1].resize(99);  // rank 1 sums another tensor
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    RingAllReduce reduce;
    reduce.sum(link, data[r]);
  });
  // Rank 2 reads rank 1's header and refuses it; the others then wait for it in vain
  // (their neighbour failed) or refuse too: nobody completes.
  CHECK(failures[2].find("out of step") != std::string::npos);
  CHECK(failures[2].find("99 floats") != std::string::npos);
  CHECK(failures[1].find("100 floats") != std::string::npos);
}

TEST_CASE("after a failed call every later call on the link fails: its streams cannot be followed") {
  auto ring = InProcessRing::make(2, std::chrono::seconds(5));
  std::vector<std::string> again(2);
  std::vector<ErrorCode> codes(2, ErrorCode::kInternal);
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    RingAllReduce reduce;
    std::vector<float> data(r == 0 ? 100 : 99, 1.0F);
    try {
      reduce.sum(link, data);
    } catch (const Error&) {
      try {
        reduce.sum(link, data);
      } catch (const Error& e) {
        codes[r] = e.code();
        again[r] = e.what();
      }
      throw;
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(failures[r].find("out of step") != std::string::npos);
    CHECK(codes[r] == ErrorCode::kFailedPrecondition);
    CHECK(again[r].find("an earlier call on this link failed") != std::string::npos);
  }
}

TEST_CASE("a broadcast whose ranks disagree on the root fails instead of leaving replicas apart") {
  auto ring = InProcessRing::make(2, std::chrono::seconds(5));
  std::vector<std::vector<float>> data{{1, 2}, {3, 4}};
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    RingAllReduce().broadcast(link, data[r], r);  // each names itself
  });
  CHECK(failures[0].find("broadcast from rank 1") != std::string::npos);
  CHECK(failures[1].find("broadcast from rank 0") != std::string::npos);
}

TEST_CASE("a rank that leaves fails its neighbours at once with kUnavailable, naming it") {
  auto ring = InProcessRing::make(3, std::chrono::seconds(30));
  std::vector<std::vector<float>> data(3, std::vector<float>(1U << 16U, 1.0F));
  std::vector<ErrorCode> codes(3, ErrorCode::kInternal);
  const auto start = std::chrono::steady_clock::now();
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    RingAllReduce reduce(1024);
    if (r == 1) {
      link.leave();  // lost before its first call
      return;
    }
    try {
      reduce.sum(link, data[r]);
    } catch (const Error& e) {
      codes[r] = e.code();
      throw;
    }
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));  // not the timeout
  CHECK(codes[0] == ErrorCode::kUnavailable);
  CHECK(codes[2] == ErrorCode::kUnavailable);
  // Whoever finds rank 1 gone first names it and leaves too (as its thread ends), so the
  // other may find that one gone instead: the failure spreads without waiting for a timeout.
  const auto names = [&](std::size_t r, const char* who) { return failures[r].find(who) != std::string::npos; };
  CHECK((names(0, "rank 1") || names(2, "rank 1")));
  CHECK((names(0, "rank 1") || names(0, "rank 2")));
  CHECK((names(2, "rank 1") || names(2, "rank 0")));
}

TEST_CASE("a silent neighbour is given up after the ring's timeout with kDeadlineExceeded") {
  auto ring = InProcessRing::make(2, std::chrono::milliseconds(200));
  std::vector<float> data(10, 1.0F);
  RingAllReduce reduce;
  try {
    reduce.sum(ring[0], data);  // rank 1 never calls
    FAIL("the sum returned without rank 1");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kDeadlineExceeded);
    CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
  }
}

namespace {

/// Rank r's batch at step s: rows of a fixed linear target with rank- and step-dependent inputs.
struct Shard {
  std::vector<float> x, y;
  Shard(std::size_t rank, std::size_t step, std::size_t rows = 8) : x(rows * 3), y(rows * 2) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(rank * 131 + step, i) / 10.0F;
    for (std::size_t r = 0; r < rows; ++r) {
      y[r * 2] = 0.5F * x[r * 3] - x[r * 3 + 1] + 0.25F;
      y[r * 2 + 1] = x[r * 3 + 2] * 2.0F - 1.0F;
    }
  }
  testing::LinearBatch batch() const { return {x, y}; }
};

template <class O>
std::vector<std::vector<float>> train_replicas(std::size_t ranks, std::size_t steps, O optimizer,
                                               std::vector<float>* losses = nullptr) {
  auto ring = InProcessRing::make(ranks);
  std::vector<std::vector<float>> out(ranks);
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    AllReduceWorker worker(testing::LinearModel(3, 2), optimizer, std::move(link), 5);
    worker.initialize(42);
    for (std::size_t s = 0; s < steps; ++s) {
      const AllReduceStep step = worker.step(Shard(r, s).batch());
      REQUIRE(step.applied);
      REQUIRE(step.global_step == static_cast<std::int64_t>(s + 1));
      if (losses != nullptr && r == 0) losses->push_back(step.loss);
    }
    for (std::size_t v = 0; v < 2; ++v) {
      const auto p = worker.model().parameter(v);
      out[r].insert(out[r].end(), p.begin(), p.end());
    }
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  return out;
}

}  // namespace

TEST_CASE("AllReduceWorker replicas stay bit-identical over many Adam steps, and learn") {
  std::vector<float> losses;
  const auto replicas = train_replicas(3, 300, Adam{0.02F}, &losses);
  for (std::size_t r = 1; r < replicas.size(); ++r) {
    REQUIRE(replicas[r].size() == replicas[0].size());
    CHECK(std::memcmp(replicas[r].data(), replicas[0].data(), replicas[0].size() * sizeof(float)) == 0);
  }
  CHECK(losses.back() < losses.front() * 0.05F);
}

TEST_CASE("AllReduceWorker applies the ranks' mean gradient, as one process applying it does") {
  constexpr std::size_t kRanks = 2;
  constexpr std::size_t kSteps = 20;
  const Sgd sgd{0.1F};
  const auto replicas = train_replicas(kRanks, kSteps, sgd);
  // One process: the same model, each step's gradient the mean of the two ranks' (a ring of
  // two adds a + b in either order, which is the same sum).
  testing::LinearModel a(3, 2);
  testing::LinearModel b(3, 2);
  for (std::size_t v = 0; v < 2; ++v) {
    initialize(a.variables()[v], 42, a.parameter(v));
    initialize(b.variables()[v], 42, b.parameter(v));
  }
  auto state = sgd.make_state(0);
  for (std::size_t s = 0; s < kSteps; ++s) {
    (void)a.compute_gradients(Shard(0, s).batch());
    (void)b.compute_gradients(Shard(1, s).batch());
    for (std::size_t v = 0; v < 2; ++v) {
      std::vector<float> mean(a.gradient(v).size());
      for (std::size_t i = 0; i < mean.size(); ++i) mean[i] = (a.gradient(v)[i] + b.gradient(v)[i]) / 2.0F;
      sgd.apply(state, a.parameter(v), mean);
      sgd.apply(state, b.parameter(v), mean);
    }
  }
  std::vector<float> expected;
  for (std::size_t v = 0; v < 2; ++v) expected.insert(expected.end(), a.parameter(v).begin(), a.parameter(v).end());
  CHECK(replicas[0] == expected);
}

namespace {

/// A model whose gradient turns infinite at a chosen step on one rank.
class Exploding : public testing::LinearModel {
 public:
  Exploding(std::size_t rank, std::size_t at) : LinearModel(3, 2), rank_(rank), at_(at) {}
  float compute_gradients(const Batch& batch) {
    const float loss = LinearModel::compute_gradients(batch);
    if (rank_ == 1 && step_++ == at_) {
      bad_ = std::vector<float>(gradient(0).size(), std::numeric_limits<float>::infinity());
    } else {
      bad_.reset();
    }
    return loss;
  }
  std::span<const float> gradient(std::size_t i) const {
    return i == 0 && bad_ ? std::span<const float>(*bad_) : LinearModel::gradient(i);
  }

 private:
  std::size_t rank_, at_, step_ = 0;
  std::optional<std::vector<float>> bad_;
};

}  // namespace

TEST_CASE("a step whose mean gradient is not finite is applied by no rank, and training goes on") {
  auto ring = InProcessRing::make(2);
  std::vector<std::vector<float>> after(2), before(2);
  std::vector<std::int64_t> refused(2);
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    AllReduceWorker worker(Exploding(r, 3), Adam{}, std::move(link));
    worker.initialize(7);
    for (std::size_t s = 0; s < 6; ++s) {
      if (s == 3) {
        const auto p = worker.model().parameter(0);
        before[r].assign(p.begin(), p.end());
      }
      const AllReduceStep step = worker.step(Shard(r, s).batch());
      CHECK(step.applied == (s != 3));
      if (s == 3) {
        const auto p = worker.model().parameter(0);
        after[r].assign(p.begin(), p.end());
      }
    }
    refused[r] = worker.refused_steps();
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  CHECK(after[0] == before[0]);
  CHECK(after[1] == before[1]);
  CHECK(refused == std::vector<std::int64_t>{1, 1});
}

TEST_CASE("a checkpoint of one replica restores every rank, and training goes on bit for bit") {
  constexpr std::size_t kRanks = 2;
  const auto dir = std::filesystem::temp_directory_path() / ("pulley_collective_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  // Undisturbed: 30 steps. Interrupted: 12 steps, rank 0 saves, every worker ends; new
  // workers restore (rank 0 only, then synchronize) and take the 18 steps left.
  auto train = [&](std::size_t from, std::size_t to, bool save, bool restore) {
    auto ring = InProcessRing::make(kRanks);
    std::vector<ModelState> out(kRanks);
    const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
      AllReduceWorker worker(testing::LinearModel(3, 2), Adam{0.05F}, std::move(link));
      if (restore) {
        if (r == 0) worker.restore(CheckpointDirectory(dir).latest()->first);
        worker.synchronize(0);
      } else {
        worker.initialize(9);
      }
      for (std::size_t s = from; s < to; ++s) REQUIRE(worker.step(Shard(r, s).batch()).applied);
      if (save && r == 0) CheckpointDirectory(dir).save(worker.state());
      out[r] = worker.state();  // values, Adam's slots and counters, the step
    });
    for (const std::string& f : failures) REQUIRE(f == "");
    for (const ModelState& state : out) CHECK(state.global_step == static_cast<std::int64_t>(to));
    return out;
  };
  const auto undisturbed = train(0, 30, false, false);
  (void)train(0, 12, true, false);
  const auto resumed = train(12, 30, false, true);
  REQUIRE(undisturbed[0].variables[0].slots.size() == 2);  // m and v
  for (std::size_t r = 0; r < kRanks; ++r) CHECK(resumed[r] == undisturbed[0]);
  CHECK(undisturbed[1] == undisturbed[0]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("restore refuses a checkpoint of another model or another optimizer, naming what differs") {
  auto ring = InProcessRing::make(1);
  AllReduceWorker adam(testing::LinearModel(3, 2), Adam{}, std::move(ring[0]));
  adam.initialize(1);
  ModelState state = adam.state();
  auto other = InProcessRing::make(1);
  AllReduceWorker sgd(testing::LinearModel(3, 2), Sgd{}, std::move(other[0]));
  sgd.restore(state);  // Sgd keeps no slots: Adam's are not needed
  CHECK(sgd.global_step() == 0);
  ModelState sgd_state = sgd.state();
  CHECK_THROWS_WITH_AS(adam.restore(sgd_state), doctest::Contains("no slot"), Error);
  state.variables[1].spec.name = "linear/other";
  CHECK_THROWS_WITH_AS(adam.restore(state), doctest::Contains("linear/other"), Error);
}

namespace {

/// Plain SGD that cannot predict finiteness: AllReduceWorker checks its update in a copy.
struct UncheckedSgd {
  struct State {};
  float learning_rate = 0.1F;
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }
  void apply(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= learning_rate * g[i];
  }
};
static_assert(Optimizer<UncheckedSgd> && !PredictsFiniteness<UncheckedSgd>);

}  // namespace

TEST_CASE("an update that would overflow is undone from its copy on every rank, for an optimizer that cannot predict it") {
  auto ring = InProcessRing::make(2);
  std::vector<std::vector<float>> before(2), after(2);
  std::vector<int> applied(2, 1);  // not vector<bool>: its bits share a word between threads
  const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
    AllReduceWorker worker(testing::LinearModel(3, 2), UncheckedSgd{3e38F}, std::move(link));
    worker.initialize(5);
    for (std::size_t v = 0; v < 2; ++v) {
      const auto p = worker.model().parameter(v);
      before[r].insert(before[r].end(), p.begin(), p.end());
    }
    applied[r] = worker.step(Shard(r, 0).batch()).applied ? 1 : 0;  // |g| > 1 somewhere: w - 3e38 g overflows
    for (std::size_t v = 0; v < 2; ++v) {
      const auto p = worker.model().parameter(v);
      after[r].insert(after[r].end(), p.begin(), p.end());
    }
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  CHECK(applied == std::vector<int>{0, 0});
  CHECK(after[0] == before[0]);
  CHECK(after[1] == before[1]);
}

TEST_CASE("barrier returns on no rank before the last rank has called it, and refuses ranks a step apart") {
  SUBCASE("the last rank to arrive holds every rank") {
    auto ring = InProcessRing::make(3, std::chrono::seconds(10));
    std::atomic<bool> late_arrived{false};
    std::vector<int> saw_late(3, 0);
    const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
      AllReduceWorker worker(testing::LinearModel(3, 2), Sgd{0.1F}, std::move(link));
      worker.initialize(1);
      (void)worker.step(Shard(r, 0).batch());
      if (r == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        late_arrived = true;
      }
      worker.barrier();
      saw_late[r] = late_arrived.load() ? 1 : 0;
    });
    for (const std::string& f : failures) REQUIRE(f == "");
    CHECK(saw_late == std::vector<int>{1, 1, 1});
  }
  SUBCASE("a rank a step behind fails the barrier on every rank that completes it") {
    auto ring = InProcessRing::make(3, std::chrono::seconds(10));
    std::vector<std::string> refused(3);
    const auto failures = on_ring(ring, [&](std::size_t r, InProcessRing& link) {
      AllReduceWorker worker(testing::LinearModel(3, 2), Sgd{0.1F}, std::move(link));
      worker.initialize(1);
      (void)worker.step(Shard(r, 0).batch());
      // Rank 2 restores a replica of step 0 (as a rank that missed the last step holds).
      if (r == 2) {
        ModelState state = worker.state();
        state.global_step = 0;
        worker.restore(state);
      }
      try {  // caught here: a rank that threw would leave the ring before the others finish
        worker.barrier();
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kFailedPrecondition) refused[r] = e.what();
      }
    });
    for (std::size_t r = 0; r < 3; ++r) {
      CAPTURE(r);
      CHECK(failures[r] == "");
      CHECK(refused[r].find("reached the barrier at global step " + std::string(r == 2 ? "0" : "1")) !=
            std::string::npos);
    }
  }
}
