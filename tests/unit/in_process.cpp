// SPDX-License-Identifier: MIT
// The in-process transport and its fault injector, and the worker's pull variants.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/evaluator.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"
#include "support/wait.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::LinearModel;

namespace {

// A ps that notes who sent each request and on which thread it was handled, and holds
// the first one until released (`Shared::release`).
struct NotesThreads {
  struct Shared {
    std::mutex mutex;
    std::condition_variable changed;
    bool holding = false;  // the first request is being handled
    bool release = false;
    std::vector<std::pair<std::uint32_t, std::thread::id>> handled;  // sender's index, thread
  };
  std::shared_ptr<Shared> shared = std::make_shared<Shared>();

  void handle(Request&& /*request*/, const RequestContext& context, Responder reply) noexcept {
    std::unique_lock lock(shared->mutex);
    if (shared->handled.empty() && !shared->holding) {
      shared->holding = true;
      shared->changed.notify_all();
      shared->changed.wait(lock, [&] { return shared->release; });
    }
    shared->handled.emplace_back(context.peer->index, std::this_thread::get_id());
    lock.unlock();
    reply(Ack{});
  }
  [[nodiscard]] std::uint32_t task() const { return 0; }
  [[nodiscard]] bool stopped() const { return false; }
};

ErrorCode code_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  FAIL("no pulley::Error thrown");
  return ErrorCode::kInvalidArgument;
}

}  // namespace

TEST_CASE("a dropped request ends in deadline_exceeded and the next one goes through") {
  Cluster<RoundRobin, Sgd, Async> cluster(2, Sgd{}, Async{});
  ClientOptions fast;
  fast.request_timeout = std::chrono::milliseconds(100);
  Chief chief(cluster.endpoint(Node::chief()), 1, fast);
  chief.initialize(LinearModel(3, 2).variables());
  cluster.network().drop_next(1, 1, Node::chief());
  CHECK(code_of([&] { chief.stats(); }) == ErrorCode::kDeadlineExceeded);
  CHECK(chief.stats().size() == 2);
  chief.shutdown();
}

TEST_CASE("a pull that timed out never writes into the caller's buffers afterwards") {
  Cluster<RoundRobin, Sgd, Async> cluster(2, Sgd{}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(3, 2).variables());
  ClientOptions impatient;
  impatient.request_timeout = std::chrono::milliseconds(20);
  Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)), impatient);
  worker.wait_ready();
  cluster.network().delay(Node::ps(1), std::chrono::milliseconds(150));  // holds the bias
  CHECK(code_of([&] { worker.pull(); }) == ErrorCode::kDeadlineExceeded);
  auto bias = worker.model().parameter(1);
  std::fill(bias.begin(), bias.end(), -7.0F);
  (void)chief.stats();  // queued behind the pull at ps 1: once answered, the pull was too
  CHECK(bias[0] == -7.0F);
  CHECK(bias[1] == -7.0F);
  cluster.network().delay(Node::ps(1), std::chrono::microseconds(0));
  worker.pull();
  CHECK(bias[0] != -7.0F);
  chief.shutdown();
}

TEST_CASE("a killed ps fails the calls waiting on it and every later call") {
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(3, 2).variables());
  const testing::LinearData data(4, 3, 2, 1);
  const testing::LinearBatch batch{data.x, data.y};
  ClientOptions options;
  options.recovery_timeout = std::chrono::milliseconds(300);
  Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)), options);
  worker.wait_ready();
  // Worker 1 never comes: after its push, the step's pull waits for step 1 until ps 0 dies.
  // The step waits for the ps to be back, and gives up at the recovery timeout.
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cluster.network().kill(Node::ps(0));
  });
  std::string why;
  CHECK(code_of([&] {
          try {
            worker.step(batch);
          } catch (const Error& e) {
            why = e.what();
            throw;
          }
        }) == ErrorCode::kUnavailable);
  CHECK(why.find("worker 0: the ps tasks were not back within") != std::string::npos);
  killer.join();
  CHECK(code_of([&] { worker.pull(); }) == ErrorCode::kUnavailable);
  CHECK(cluster.network().is_dead(Node::ps(0)));
}

TEST_CASE("a killed worker's own calls fail as a dead process's would") {
  Cluster<RoundRobin, Sgd, Async> cluster(1, Sgd{}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(3, 2).variables());
  Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  cluster.network().kill(Node::worker(0));
  CHECK(code_of([&] { worker.pull(); }) == ErrorCode::kUnavailable);
  CHECK(chief.stats().size() == 1);  // everyone else is unaffected
  chief.shutdown();
}

TEST_CASE("a worker pulls all variables, one variable, or a row range of one") {
  // kernel [10, 3] split over 3 ps in parts of rows 0-3, 4-6, 7-9; bias [3] on its own.
  Cluster<FixedShards, Sgd, Async> cluster(3, Sgd{}, Async{}, FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 5);
  chief.initialize(LinearModel(10, 3).variables());
  const auto truth = chief.read_variables();
  Worker worker(0, LinearModel(10, 3), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  CHECK(worker.placement().parts_of(0).size() == 3);
  auto kernel = worker.model().parameter(0);
  auto bias = worker.model().parameter(1);
  auto reset = [&] {
    std::fill(kernel.begin(), kernel.end(), -99.0F);
    std::fill(bias.begin(), bias.end(), -99.0F);
  };

  SUBCASE("rows 2..7 cross three parts; nothing else is touched") {
    reset();
    worker.pull("linear/kernel", {2, 8});
    for (std::size_t i = 0; i < kernel.size(); ++i) {
      const std::size_t row = i / 3;
      CHECK(kernel[i] == (row >= 2 && row < 8 ? truth[0][i] : -99.0F));
    }
    CHECK(bias[0] == -99.0F);
  }
  SUBCASE("one variable") {
    reset();
    worker.pull("linear/bias");
    CHECK(std::equal(bias.begin(), bias.end(), truth[1].begin()));
    CHECK(kernel[0] == -99.0F);
  }
  SUBCASE("everything") {
    reset();
    worker.pull();
    CHECK(std::equal(kernel.begin(), kernel.end(), truth[0].begin()));
    CHECK(std::equal(bias.begin(), bias.end(), truth[1].begin()));
  }
  SUBCASE("unknown variable and bad rows are refused with a clear error") {
    CHECK(code_of([&] { worker.pull("linear/nope"); }) == ErrorCode::kNotFound);
    CHECK(code_of([&] { worker.pull("linear/kernel", {8, 11}); }) == ErrorCode::kInvalidArgument);
    CHECK(code_of([&] { worker.pull("linear/kernel", {4, 4}); }) == ErrorCode::kInvalidArgument);
  }
  chief.shutdown();
}

TEST_CASE("ps tasks that disagree on the placement are caught by the chief") {
  InProcessNetwork network(2);
  network.serve(ParameterServer<RoundRobin, Sgd, Async>(0, 2, Sgd{}, Async{}));
  network.serve(ParameterServer<FixedShards, Sgd, Async>(1, 2, Sgd{}, Async{}, FixedShards{2}));
  Chief chief(InProcess(network, Node::chief()), 1);
  CHECK(code_of([&] { chief.initialize(LinearModel(4, 2).variables()); }) ==
        ErrorCode::kFailedPrecondition);
  chief.shutdown();
}

TEST_CASE("a model whose variables differ from the registered ones is refused") {
  Cluster<RoundRobin, Sgd, Async> cluster(1, Sgd{}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(4, 2).variables());
  Worker worker(0, LinearModel(5, 2), cluster.endpoint(Node::worker(0)));
  CHECK(code_of([&] { worker.wait_ready(); }) == ErrorCode::kFailedPrecondition);
  chief.shutdown();
}

TEST_CASE("an evaluator follows training: waits for steps and reads snapshots, taking no token") {
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{0.05F}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(3, 2).variables());
  Evaluator evaluator(cluster.endpoint(Node::evaluator()));
  evaluator.wait_ready(LinearModel(3, 2).variables());
  const auto before = evaluator.read_variables();
  CHECK(before == chief.read_variables());

  std::int64_t seen = -1;
  std::thread watcher([&] { seen = evaluator.wait_for_step(5); });
  const testing::LinearData data(4, 3, 2, 1);
  Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  // With R = N = 1 a worker's every step needs its own token: an evaluator that took one
  // would stall it here.
  while (worker.step({data.x, data.y}, 10)) {
  }
  watcher.join();
  CHECK(seen >= 5);
  const auto after = evaluator.read_variables();
  CHECK(after == chief.read_variables());
  CHECK(after != before);
  CHECK(evaluator.stats().at(0).global_step == 10);
  chief.shutdown();
}

TEST_CASE("push_pull applies the push and brings back the updated parameters in one call") {
  Cluster<RoundRobin, Sgd, Async> cluster(2, Sgd{0.5F}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(3, 2).variables());
  const auto before = chief.read_variables();
  Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  worker.pull();
  const testing::LinearData data(4, 3, 2, 1);
  worker.model().compute_gradients({data.x, data.y});
  CHECK(worker.push_pull(0, 0) == 0);
  const auto after = chief.read_variables();
  for (std::size_t v = 0; v < 2; ++v) {
    const auto g = worker.model().gradient(v);
    const auto w = worker.model().parameter(v);
    for (std::size_t i = 0; i < w.size(); ++i) {
      CHECK(w[i] == doctest::Approx(before[v][i] - 0.5F * g[i]));
      CHECK(w[i] == after[v][i]);  // what the ps holds now, not the values pushed against
    }
  }
  chief.shutdown();
}

namespace {

/// SyncReplicas(2, 2) that refuses every push (its policy throws pulley::Error).
struct RefusingSync : SyncReplicas {
  RefusingSync() : SyncReplicas(2, 2) {}
  Verdict on_push(Pacer&, std::uint32_t, std::int64_t) const {
    throw Error(ErrorCode::kFailedPrecondition, "refused on purpose");
  }
};

}  // namespace

TEST_CASE("a refused push is reported at once, not after its pull's wait for the step") {
  Cluster<RoundRobin, Sgd, RefusingSync> cluster(1, Sgd{}, RefusingSync{});
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(3, 2).variables());
  ClientOptions patient;
  patient.wait_timeout = std::chrono::seconds(60);
  Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)), patient);
  worker.wait_ready();
  const testing::LinearData data(4, 3, 2, 1);
  // The step's pull waits for step 1, which never comes: worker 1 does not exist.
  const auto start = std::chrono::steady_clock::now();
  try {
    worker.step({data.x, data.y});
    FAIL("the refused push went unnoticed");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("refused on purpose") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  chief.shutdown();
}

TEST_CASE("a non-finite gradient reaches no ps, so the ps tasks stay in step") {
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{0.1F}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(4, 2).variables());
  Worker worker(0, LinearModel(4, 2), cluster.endpoint(Node::worker(0)));
  worker.wait_ready();
  testing::LinearData data(4, 4, 2, 1);
  data.y[3] = std::numeric_limits<float>::quiet_NaN();  // poisons both variables' gradients
  try {
    worker.step({data.x, data.y});
    FAIL("a NaN gradient was pushed");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK(std::string(e.what()).find("nothing was pushed") != std::string::npos);
  }
  for (const Stats& s : chief.stats()) {
    CHECK(s.gradients_accepted == 0);
    CHECK(s.requests_rejected == 0);  // refused before sending: no ps saw it
    CHECK(s.global_step == 0);
  }

  chief.shutdown();
}

TEST_CASE("an endpoint that outlives its network gets kUnavailable, not a dangling network") {
  std::optional<Chief<InProcess>> chief;
  {
    InProcessNetwork network(1);
    network.serve(ParameterServer<RoundRobin, Sgd, Async>(0, 1, Sgd{}, Async{}));
    chief.emplace(InProcess(network, Node::chief()), 1);
    chief->initialize(LinearModel(3, 2).variables());
  }  // the network and its ps are gone; the chief is not
  CHECK(code_of([&] { chief->stats(); }) == ErrorCode::kUnavailable);
}

TEST_CASE("the network owns its ps tasks: destroying it mid-training is safe") {
  // Whatever still runs or waits when the network goes (a worker's gated pull, the ps
  // threads) ends; nothing is left pointing at a destroyed ps.
  std::thread worker_thread;
  ErrorCode worker_error = ErrorCode::kInvalidArgument;
  {
    InProcessNetwork network(2);
    for (std::uint32_t i = 0; i < 2; ++i) {
      network.serve(ParameterServer<RoundRobin, Sgd, SyncReplicas>(i, 2, Sgd{}, SyncReplicas(2, 2)));
    }
    Chief chief(InProcess(network, Node::chief()), 1);
    chief.initialize(LinearModel(3, 2).variables());
    worker_thread =
        std::thread([endpoint = InProcess(network, Node::worker(0)), &worker_error]() mutable {
          const testing::LinearData data(4, 3, 2, 1);
          ClientOptions options;
          options.recovery_timeout = std::chrono::milliseconds(300);
          Worker worker(0, LinearModel(3, 2), std::move(endpoint), options);
          // Worker 1 never comes: the step's pull waits until the network goes away.
          worker_error = code_of([&] {
            worker.wait_ready();
            worker.step({data.x, data.y});
          });
        });
    // Gone once worker 0 pushed and waits.
    CHECK(testing::wait_until([&] {
      const std::vector<Stats> stats = chief.stats();
      return stats.at(0).gradients_accepted + stats.at(1).gradients_accepted >= 2;
    }));
  }
  worker_thread.join();
  CHECK(worker_error == ErrorCode::kUnavailable);
}

TEST_CASE("a snapshot is one global step on every ps, even while one ps lags behind") {
  constexpr std::int64_t kSteps = 120;
  constexpr float kRate = 0.1F;
  const testing::LinearData data(4 * kSteps, 3, 2, 9);
  auto batch_of = [&](std::int64_t step) {
    const auto row = static_cast<std::size_t>(step % kSteps) * 4;
    return testing::LinearBatch{std::span(data.x).subspan(row * 3, 12),
                                std::span(data.y).subspan(row * 2, 8)};
  };
  // The kernel lives on ps 0, the bias on ps 1, which is slowed down: read naively, the two
  // would come from different steps.
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{kRate}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), 4);
  chief.initialize(LinearModel(3, 2).variables());
  cluster.network().delay(Node::ps(1), std::chrono::microseconds(300));
  std::thread training([&] {
    Worker worker(0, LinearModel(3, 2), cluster.endpoint(Node::worker(0)));
    worker.wait_ready();
    for (std::int64_t k = 0;; ++k) {
      if (!worker.step(batch_of(k), kSteps)) break;
    }
  });
  std::vector<Snapshot> shots;
  for (std::int64_t step : {10, 40, 70}) shots.push_back(chief.snapshot(step));
  training.join();

  for (const Snapshot& shot : shots) {
    REQUIRE(shot.consistent);
    // Single-process SGD over the same batches, to the snapshot's step: equal, bit for bit
    // (R = 1: the ps applies each gradient as the reference does).
    LinearModel reference(3, 2);
    reference.initialize(4);
    for (std::int64_t k = 0; k < shot.step; ++k) {
      reference.compute_gradients(batch_of(k));
      for (std::size_t v = 0; v < 2; ++v) {
        auto w = reference.parameter(v);
        auto g = reference.gradient(v);
        for (std::size_t i = 0; i < w.size(); ++i) w[i] -= kRate * g[i];
      }
    }
    for (std::size_t v = 0; v < 2; ++v) {
      const auto expected = reference.parameter(v);
      CHECK(std::equal(expected.begin(), expected.end(), shot.values[v].begin()));
    }
  }
  CHECK(shots[0].step >= 10);
  chief.shutdown();
}

TEST_CASE("with clip_norm a worker pushes its gradients scaled to that global norm") {
  Cluster<RoundRobin, Sgd, SyncReplicas> cluster(2, Sgd{1.0F}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(LinearModel(4, 2).variables());
  const auto before = chief.read_variables();
  ClientOptions clipping;
  clipping.clip_norm = 0.5F;
  Worker worker(0, LinearModel(4, 2), cluster.endpoint(Node::worker(0)), clipping);
  worker.wait_ready();
  testing::LinearData data(4, 4, 2, 1);
  for (float& y : data.y) y *= 1000.0F;  // a gradient far beyond the clip norm
  REQUIRE(worker.step({data.x, data.y}).has_value());
  CHECK(worker.clipped_steps() == 1);
  CHECK(worker.last_gradient_norm() > 10.0);
  // With rate 1, the update is the clipped gradient itself: its norm across both
  // variables (on both ps tasks) is the clip norm.
  const auto after = chief.read_variables();
  double squares = 0.0;
  for (std::size_t v = 0; v < after.size(); ++v) {
    for (std::size_t i = 0; i < after[v].size(); ++i) {
      const double d = static_cast<double>(after[v][i]) - before[v][i];
      squares += d * d;
    }
  }
  CHECK(std::sqrt(squares) == doctest::Approx(0.5).epsilon(1e-4));
  // A gradient within the norm goes as it is.
  ClientOptions loose;
  loose.clip_norm = 1e9F;
  Worker other(0, LinearModel(4, 2), cluster.endpoint(Node::worker(0)), loose);
  other.wait_ready();
  REQUIRE(other.step({data.x, data.y}).has_value());
  CHECK(other.clipped_steps() == 0);
  CHECK(other.last_gradient_norm() > 0.0);
  chief.shutdown();
}

TEST_CASE(
    "requests that found the ps busy are handled next, in order, by the sender that held it") {
  // Worker 0's request is handled on its own thread and held there; requests of workers 1
  // and 2 sent meanwhile are queued. Worker 0's thread takes them on in their order once
  // its own is done: no hand-off to the ps's own thread.
  InProcessNetwork network(1);
  NotesThreads ps;
  const std::shared_ptr<NotesThreads::Shared> shared = ps.shared;
  network.serve(std::move(ps));
  InProcess w0(network, Node::worker(0));
  InProcess w1(network, Node::worker(1));
  InProcess w2(network, Node::worker(2));
  std::thread::id holder;
  std::thread first([&] {
    holder = std::this_thread::get_id();
    CHECK(std::holds_alternative<Ack>(w0.call(0, GetStats{}).get()));
  });
  {
    std::unique_lock lock(shared->mutex);
    REQUIRE(
        shared->changed.wait_for(lock, std::chrono::seconds(10), [&] { return shared->holding; }));
  }
  std::vector<PendingCall> queued;
  queued.push_back(w1.call(0, GetStats{}));
  queued.push_back(w2.call(0, GetStats{}));
  queued.push_back(w1.call(0, GetStats{}));
  for (PendingCall& call : queued) CHECK_FALSE(call.ready());  // the ps is busy: queued
  {
    std::scoped_lock lock(shared->mutex);
    shared->release = true;
  }
  shared->changed.notify_all();
  first.join();
  for (PendingCall& call : queued) {
    REQUIRE(call.wait_for(std::chrono::seconds(10)));
    CHECK(std::holds_alternative<Ack>(call.take()));
  }
  std::scoped_lock lock(shared->mutex);
  REQUIRE(shared->handled.size() == 4);
  const std::vector<std::uint32_t> senders{0, 1, 2, 1};
  for (std::size_t i = 0; i < senders.size(); ++i) {
    CHECK(shared->handled[i].first == senders[i]);
    CHECK(shared->handled[i].second == holder);
  }
}
