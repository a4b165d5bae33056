// SPDX-License-Identifier: MIT
// Exactly-once pushes, in-process: a connection lost between a request taking effect and
// its answer (InProcessNetwork::lose_replies) makes the worker send the same push again,
// which every ps counts once, so a sync R = N job whose replies are lost at random ends bit
// for bit where the clean job ends; and, message by message, what a ps answers a push it
// took or holds.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <latch>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;

namespace {

constexpr std::size_t kIn = 6, kOut = 4, kBatch = 4;
constexpr std::int64_t kSteps = 60;

LinearBatch batch_of(const LinearData& data, std::uint32_t w, std::int64_t k) {
  const std::size_t row = static_cast<std::size_t>((k * 2 + w) * static_cast<std::int64_t>(kBatch));
  return {std::span(data.x).subspan(row * kIn, kBatch * kIn),
          std::span(data.y).subspan(row * kOut, kBatch * kOut)};
}

using SyncAdam = Cluster<FixedShards, Adam, SyncReplicas>;

struct Outcome {
  std::vector<std::vector<float>> variables;
  std::vector<Stats> stats;
};

/// A sync R = N = 2 job over 2 ps tasks for kSteps steps, where each ps breaks the
/// connection of a worker's request (a token, a pull, a push) with probability `loss`,
/// after the request took effect.
Outcome train(double loss) {
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 5);
  SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  std::latch ready(3);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      ready.arrive_and_wait();
      for (std::int64_t k = 0; worker.step(batch_of(data, w, k), kSteps); ++k) {
      }
    });
  }
  // Each ps breaks the connection of a worker's request with probability `loss`, after
  // taking it.
  for (std::uint32_t ps = 0; ps < 2; ++ps) {
    for (std::uint32_t w = 0; w < 2; ++w) {
      cluster.network().lose_replies_at_random(ps, loss, 11 + 2 * ps + w, Node::worker(w));
    }
  }
  ready.arrive_and_wait();
  for (auto& t : threads) t.join();
  for (std::uint32_t ps = 0; ps < 2; ++ps) {
    for (std::uint32_t w = 0; w < 2; ++w) cluster.network().lose_replies_at_random(ps, 0.0, 0, Node::worker(w));
  }
  Outcome outcome{chief.read_variables(), chief.stats()};
  chief.shutdown();
  return outcome;
}

ErrorCode error_of(const Response& r) {
  REQUIRE(std::holds_alternative<ErrorReply>(r));
  return std::get<ErrorReply>(r).code;
}

Response call(InProcess& endpoint, std::uint32_t ps, Request request) {
  PendingCall pending = endpoint.call(ps, std::move(request));
  REQUIRE(pending.wait_for(std::chrono::seconds(5)));
  return pending.take();
}

}  // namespace

TEST_CASE("a sync R = N job whose replies are lost at random ends bit for bit where the clean one does") {
  const Outcome clean = train(0);
  const Outcome faulted = train(0.04);
  std::int64_t repeated = 0;
  for (std::size_t ps = 0; ps < 2; ++ps) {
    CHECK(faulted.stats[ps].global_step == kSteps);
    // Every ps took the same pushes: as many part gradients as the clean job's.
    CHECK(faulted.stats[ps].gradients_accepted == clean.stats[ps].gradients_accepted);
    CHECK(faulted.stats[ps].stale_gradients_dropped == 0);
    CHECK(clean.stats[ps].pushes_repeated == 0);
    repeated += faulted.stats[ps].pushes_repeated;
  }
  CHECK(repeated > 0);  // pushes were sent again, and counted once
  CHECK(faulted.variables == clean.variables);
}

TEST_CASE("a push whose answer was lost is answered again as it was, and counted once") {
  SyncAdam cluster(1, Adam{0.01F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  InProcess one = cluster.endpoint(Node::worker(0));
  const std::vector<float> gw(kIn * kOut, 0.5F), gb(kOut, 0.25F);
  const Push push{0, 0, {{0, gw}, {1, gb}}, 0, 77};
  // Worker 0 takes its token, and the connection breaks as its push is handled.
  REQUIRE(std::holds_alternative<TokenReply>(call(one, 0, TakeToken{0, 0})));
  cluster.network().lose_replies(0, 1, Node::worker(0));
  const Response lost = call(one, 0, Push(push));
  REQUIRE(std::holds_alternative<ErrorReply>(lost));
  CHECK(std::get<ErrorReply>(lost).code == ErrorCode::kUnavailable);
  // The same push again, on a new connection: answered as taken, not counted again.
  const Response again = call(one, 0, Push(push));
  REQUIRE(std::holds_alternative<PushReply>(again));
  CHECK(std::get<PushReply>(again).stale_parts == 0);
  Stats stats = chief.stats().at(0);
  CHECK(stats.pushes_repeated == 1);
  CHECK(stats.gradients_accepted == 2);  // its two parts, once
  CHECK(stats.global_step == 0);         // R = 2: one push is not a step
  // Another push of the same worker (a new number) for the same step is its second.
  Push second = push;
  second.sequence = 78;
  REQUIRE(std::holds_alternative<PushReply>(call(one, 0, std::move(second))));
  stats = chief.stats().at(0);
  CHECK(stats.pushes_repeated == 1);
  CHECK(stats.gradients_accepted == 4);
  chief.shutdown();
}

TEST_CASE("a late copy of a push its worker sent again and went past is refused, never counted") {
  // Under Async every push is applied as it comes: a copy that arrives late on a connection
  // its worker gave up, after the worker's next push, must not be applied a second time.
  Cluster<FixedShards, Adam, Async> cluster(1, Adam{0.01F}, Async{});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  InProcess one = cluster.endpoint(Node::worker(0));
  const std::vector<float> gw(kIn * kOut, 0.5F), gb(kOut, 0.25F);
  const Push first{0, 0, {{0, gw}, {1, gb}}, 0, 10, {}, 5};
  Push next = first;
  next.sequence = 11;
  REQUIRE(std::holds_alternative<PushReply>(call(one, 0, Push(first))));
  REQUIRE(std::holds_alternative<PushReply>(call(one, 0, Push(next))));
  const std::vector<std::vector<float>> before = chief.read_variables();
  const Response late = call(one, 0, Push(first));
  REQUIRE(std::holds_alternative<ErrorReply>(late));
  CHECK(std::get<ErrorReply>(late).code == ErrorCode::kAborted);
  CHECK(std::get<ErrorReply>(late).message.find("a late copy") != std::string::npos);
  CHECK(chief.read_variables() == before);
  Stats stats = chief.stats().at(0);
  CHECK(stats.global_step == 2);
  CHECK(stats.pushes_repeated == 1);
  // Another client of the same worker (a process started again) numbers its own series,
  // from anywhere: its pushes count.
  Push restarted = first;
  restarted.sequence = 3;
  restarted.series = 9;
  REQUIRE(std::holds_alternative<PushReply>(call(one, 0, std::move(restarted))));
  stats = chief.stats().at(0);
  CHECK(stats.global_step == 3);
  chief.shutdown();
}

TEST_CASE("a push sent again while a checkpoint's cut holds the first is held once") {
  SyncAdam cluster(1, Adam{0.01F}, SyncReplicas(1, 1));
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  InProcess chief_link = cluster.endpoint(Node::chief());
  InProcess one = cluster.endpoint(Node::worker(0));
  const std::vector<float> gw(kIn * kOut, 0.5F), gb(kOut, 0.25F);
  const Push push{0, 0, {{0, gw}, {1, gb}}, 0, 91};
  REQUIRE(std::holds_alternative<PauseReply>(call(chief_link, 0, Pause{})));
  // Held by the pause; its connection breaks, and it comes again on a new one.
  cluster.network().lose_replies(0, 1, Node::worker(0));
  PendingCall first = one.call(0, Push(push));
  PendingCall second = one.call(0, Push(push));
  REQUIRE(first.wait_for(std::chrono::seconds(5)));
  CHECK(error_of(first.take()) == ErrorCode::kUnavailable);
  CHECK_FALSE(second.wait_for(std::chrono::milliseconds(50)));  // held
  REQUIRE(std::holds_alternative<Ack>(call(chief_link, 0, Resume{})));
  REQUIRE(second.wait_for(std::chrono::seconds(5)));
  CHECK(std::holds_alternative<PushReply>(second.take()));
  const Stats stats = chief.stats().at(0);
  CHECK(stats.pushes_repeated == 1);
  CHECK(stats.global_step == 1);  // taken once: R = 1, one step
  CHECK(stats.gradients_accepted == 2);
  chief.shutdown();
}

TEST_CASE("a token asked again on the connection that took it is the same token, on another it waits") {
  SyncAdam cluster(1, Adam{0.01F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  InProcess one = cluster.endpoint(Node::worker(0));
  const Response first = call(one, 0, TakeToken{0, 0});
  REQUIRE(std::holds_alternative<TokenReply>(first));
  // Its answer was lost on the way (another ps's connection broke, say): asked again on
  // the same connection, the same token, and no second one is taken.
  const Response again = call(one, 0, TakeToken{0, 0});
  REQUIRE(std::holds_alternative<TokenReply>(again));
  CHECK(std::get<TokenReply>(again).token.local_step == std::get<TokenReply>(first).token.local_step);
  InProcess chief_link = cluster.endpoint(Node::chief());
  const Response stats = call(chief_link, 0, GetStats{});
  REQUIRE(std::holds_alternative<StatsReply>(stats));
  CHECK(std::get<StatsReply>(stats).waiting_for.find("1 of 2 tokens left") != std::string::npos);
  // A second process claiming worker 0 (another connection) waits for the first's to go.
  InProcess other = cluster.endpoint(Node::worker(0));
  PendingCall waiting = other.call(0, TakeToken{0, 0});
  CHECK_FALSE(waiting.wait_for(std::chrono::milliseconds(50)));
  chief.shutdown();
  REQUIRE(waiting.wait_for(std::chrono::seconds(5)));
  CHECK(std::holds_alternative<ErrorReply>(waiting.take()));  // training ended
}
