// SPDX-License-Identifier: MIT
// Workers that die, stall and come back, in-process: the ps tasks hold a worker whose
// heartbeats stop lost, the step completes over the live workers and says whom it waited
// for; a worker back takes tokens and counts again; one that leaves is not held lost.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/client.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"

using namespace pulley;
using namespace std::chrono_literals;
using pulley::testing::Cluster;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;

namespace {

constexpr std::size_t kIn = 5, kOut = 3, kBatch = 4;
// The ps tasks' worker timeout here: 25 beats, so that a live worker whose threads a
// loaded host holds back for a while is not held lost.
constexpr auto kTimeout = 1000ms;
constexpr auto kBeat = 40ms;

LinearBatch batch_of(const LinearData& data, std::int64_t k) {
  const auto row = static_cast<std::size_t>(k % 16) * kBatch;
  return {std::span(data.x).subspan(row * kIn, kBatch * kIn),
          std::span(data.y).subspan(row * kOut, kBatch * kOut)};
}

/// Every ps's StatsReply.
template <class Net>
std::vector<StatsReply> stats_of(Net& cluster, std::uint32_t num_ps) {
  InProcess chief = cluster.endpoint(Node::chief());
  CallGroup group;
  for (std::uint32_t ps = 0; ps < num_ps; ++ps) group.add(chief.call(ps, GetStats{}, {}));
  group.wait(5s, "stats");
  std::vector<StatsReply> replies;
  for (std::uint32_t ps = 0; ps < num_ps; ++ps) replies.push_back(group.take_as<StatsReply>(ps));
  return replies;
}

/// A worker with heartbeats, stepping until `last_step`; returns its steps not stale.
template <class Net>
int train(Net& cluster, const LinearData& data, std::uint32_t w, std::int64_t last_step) {
  HeartbeatSender beat(w, cluster.endpoint(Node::worker(w)), kBeat);
  Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
  worker.wait_ready();
  int fresh = 0;
  for (std::int64_t k = 0;; ++k) {
    const auto result = worker.step(batch_of(data, k), last_step);
    if (!result) return fresh;
    if (result->stale_parts == 0) ++fresh;
  }
}

}  // namespace

TEST_CASE("a worker that dies holding its token does not stall sync training and counts again once back") {
  using Sync = Cluster<RoundRobin, Sgd, SyncReplicas>;
  Sync cluster(2, Sgd{0.05F}, SyncReplicas(3, 3), RoundRobin{}, kTimeout);
  const LinearData data(16 * kBatch, kIn, kOut, 4);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());

  // Worker 2 beats, takes the token of step 0, and once step 0 waits for it alone (and
  // says so) it is never heard again.
  InProcess ghost = cluster.endpoint(Node::worker(2));
  const auto ghost_beats = [&] {
    for (std::uint32_t ps = 0; ps < 2; ++ps) {
      CHECK(std::holds_alternative<StatsReply>(ghost.call(ps, Heartbeat{2, false}, {}).get()));
    }
  };
  ghost_beats();
  CHECK(std::holds_alternative<TokenReply>(ghost.call(0, TakeToken{2, 0}, {}).get()));

  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] { CHECK(train(cluster, data, w, 20) > 0); });
  }
  std::string waiting;
  for (int i = 0; i < 500 && waiting.find("waiting for worker:2 (last heard") == std::string::npos; ++i) {
    ghost_beats();
    std::this_thread::sleep_for(10ms);
    waiting = stats_of(cluster, 2).at(0).waiting_for;
  }
  CHECK(waiting.find("waiting for worker:2 (last heard") != std::string::npos);
  for (std::thread& t : workers) t.join();  // then 20 steps without it

  const auto lost = stats_of(cluster, 2);
  for (const StatsReply& r : lost) {
    CHECK(r.stats.global_step == 20);
    CHECK(r.stats.workers_lost == 1);
    CHECK(r.lost == std::vector<std::uint32_t>{2});
  }

  // All three, worker 2 back: its heartbeats make the steps wait for it again, and its
  // gradients count.
  workers.clear();
  int back = 0;
  workers.emplace_back([&] { back = train(cluster, data, 2, 40); });
  for (int i = 0; i < 500 && !(stats_of(cluster, 2)[0].lost.empty() && stats_of(cluster, 2)[1].lost.empty()); ++i) {
    std::this_thread::sleep_for(5ms);
  }
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] { (void)train(cluster, data, w, 40); });
  }
  for (std::thread& t : workers) t.join();
  CHECK(back == 20);  // every step waited for it again
  const auto after = stats_of(cluster, 2);
  CHECK(after.at(0).lost.empty());
  CHECK(after.at(0).stats.global_step == 40);
  chief.shutdown();
}

TEST_CASE("a lost worker's batches are read by the live workers, and one back reads its own again") {
  using Sync = Cluster<RoundRobin, Sgd, SyncReplicas>;
  Sync cluster(1, Sgd{0.05F}, SyncReplicas(2, 2), RoundRobin{}, kTimeout);
  const LinearData data(16 * kBatch, kIn, kOut, 8);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  // Worker 1 beats once and is never heard again.
  InProcess ghost = cluster.endpoint(Node::worker(1));
  CHECK(std::holds_alternative<StatsReply>(ghost.call(0, Heartbeat{1, false}, {}).get()));

  std::vector<std::int64_t> read0, read1;
  const auto run = [&](std::uint32_t w, std::vector<std::int64_t>& read, std::int64_t last_step) {
    HeartbeatSender beat(w, cluster.endpoint(Node::worker(w)), kBeat);
    Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
    worker.wait_ready();
    const auto source = [&](std::int64_t number) {
      read.push_back(number);
      return batch_of(data, number);
    };
    while (worker.step(source, last_step)) {
    }
  };
  run(0, read0, 6);
  // Step 0 began with both workers and completed on worker 0's batch once worker 1 was
  // lost; every step after began without it, and worker 0 read both batches of each.
  CHECK(read0 == std::vector<std::int64_t>{0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  CHECK(stats_of(cluster, 1).at(0).stats.global_step == 6);

  // Worker 1 comes back (a process started in its place): from then on each reads one
  // batch a step, and together they read every batch once.
  read0.clear();
  std::thread w1([&] { run(1, read1, 10); });
  for (int i = 0; i < 500 && !stats_of(cluster, 1)[0].lost.empty(); ++i) std::this_thread::sleep_for(5ms);
  std::thread w0([&] { run(0, read0, 10); });
  w1.join();
  w0.join();
  CHECK(read0.size() == 4);
  CHECK(read1.size() == 4);
  std::vector<std::int64_t> all = read0;
  all.insert(all.end(), read1.begin(), read1.end());
  std::sort(all.begin(), all.end());
  CHECK(all == std::vector<std::int64_t>{12, 13, 14, 15, 16, 17, 18, 19});
  chief.shutdown();
}

TEST_CASE("a worker that stalls under bounded staleness is passed by, and rejoins at the slowest clock") {
  using Ssp = Cluster<RoundRobin, Sgd, BoundedStaleness>;
  Ssp cluster(1, Sgd{0.05F}, BoundedStaleness(2, 2), RoundRobin{}, kTimeout);
  const LinearData data(16 * kBatch, kIn, kOut, 5);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  InProcess ghost = cluster.endpoint(Node::worker(1));
  CHECK(std::holds_alternative<StatsReply>(ghost.call(0, Heartbeat{1, false}, {}).get()));
  std::thread w0([&] { CHECK(train(cluster, data, 0, 30) > 0); });
  w0.join();  // 30 clocks while worker 1 stays at 0: it was held lost
  CHECK(stats_of(cluster, 1).at(0).stats.workers_lost == 1);
  int back = 0;
  std::thread w1([&] { back = train(cluster, data, 1, 35); });
  for (int i = 0; i < 500 && !stats_of(cluster, 1)[0].lost.empty(); ++i) std::this_thread::sleep_for(5ms);
  std::thread w0b([&] { (void)train(cluster, data, 0, 35); });
  w1.join();
  w0b.join();
  // From clock 30 (not 0) to the global step 35, and up to s = 2 clocks past it while
  // worker 0 finishes: none of them stale.
  CHECK(back >= 5);
  CHECK(back <= 7);
  CHECK(stats_of(cluster, 1).at(0).lost.empty());
  chief.shutdown();
}

TEST_CASE("a worker that leaves says goodbye and is not held lost") {
  using Sync = Cluster<RoundRobin, Sgd, SyncReplicas>;
  Sync cluster(1, Sgd{0.05F}, SyncReplicas(1, 1), RoundRobin{}, kTimeout);
  const LinearData data(16 * kBatch, kIn, kOut, 6);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  CHECK(train(cluster, data, 0, 5) == 5);
  std::this_thread::sleep_for(kTimeout + 200ms);
  const StatsReply r = stats_of(cluster, 1).at(0);
  CHECK(r.stats.workers_lost == 0);
  CHECK(r.lost.empty());
  chief.shutdown();
}

TEST_CASE("a worker that failed stops beating without the goodbye: held lost, it stalls nobody") {
  using Sync = Cluster<RoundRobin, Sgd, SyncReplicas>;
  Sync cluster(1, Sgd{0.05F}, SyncReplicas(2, 2), RoundRobin{}, kTimeout);
  const LinearData data(16 * kBatch, kIn, kOut, 6);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  std::thread survivor([&] { (void)train(cluster, data, 0, 20); });
  {
    HeartbeatSender beat(1, cluster.endpoint(Node::worker(1)), kBeat);
    Worker worker(1, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(1)));
    worker.wait_ready();
    for (std::int64_t k = 0; k < 3; ++k) REQUIRE(worker.step(batch_of(data, k), 20));
    beat.abandon();  // worker 1 failed: no goodbye as its sender goes
  }
  // Held lost once silent for the timeout (one that said goodbye would be forgotten while
  // the sync policy still waited for its pushes: worker 0 would wait forever at step 3).
  StatsReply r;
  for (int i = 0; i < 100 && (r = stats_of(cluster, 1).at(0)).stats.global_step < 20; ++i) std::this_thread::sleep_for(100ms);
  CHECK(r.stats.global_step == 20);
  CHECK(r.stats.workers_lost == 1);
  CHECK(r.lost == std::vector<std::uint32_t>{1});
  chief.shutdown();  // (ends a stalled worker 0 too)
  survivor.join();
}

TEST_CASE("a worker that fails before its heartbeat thread first runs is still held lost") {
  using Sync = Cluster<RoundRobin, Sgd, SyncReplicas>;
  Sync cluster(1, Sgd{0.05F}, SyncReplicas(2, 2), RoundRobin{}, kTimeout);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  {
    HeartbeatSender beat(1, cluster.endpoint(Node::worker(1)), kBeat);
    beat.abandon();  // at once: the sender's thread has most likely not beaten yet
  }
  // Its one beat made the ps track it; silent since, it is held lost after the timeout (a
  // worker never heard would never be, and a sync job would wait for it for ever).
  StatsReply r;
  for (int i = 0; i < 100 && (r = stats_of(cluster, 1).at(0)).stats.workers_lost == 0; ++i) std::this_thread::sleep_for(50ms);
  CHECK(r.stats.workers_lost == 1);
  CHECK(r.lost == std::vector<std::uint32_t>{1});
  chief.shutdown();
}

TEST_CASE(
    "a backup step that a push lost with its worker's process left short of R goes on, alike on "
    "every ps") {
  // R = 2, N = 3, two ps tasks (ps 0 hands out the tokens). Worker 2's process dies while it
  // writes its push of step 0: ps 0 takes it, ps 1 never does. Worker 0 pushes step 0 to
  // both, so ps 0 completes it with workers 0 and 2, and ps 1 holds worker 0's alone. Worker
  // 1, the backup, comes late and takes a token of step 1. Nobody will bring ps 1 a second
  // gradient of step 0: the pulls of step 1 say so.
  using Sync = Cluster<RoundRobin, Sgd, SyncReplicas>;
  Sync cluster(2, Sgd{0.05F}, SyncReplicas(2, 3), RoundRobin{},
               std::chrono::seconds(60));  // nobody held lost
  const LinearModel model(kIn, kOut);
  Chief chief(cluster.endpoint(Node::chief()), 7);
  chief.initialize(model.variables());
  const std::vector<VariableSpec> variables(model.variables().begin(), model.variables().end());
  std::vector<std::vector<float>> gradients, values;
  std::vector<std::span<const float>> views;
  std::vector<PullRequest> all;
  for (const VariableSpec& v : variables) {
    gradients.emplace_back(v.size(), 0.5F);
    values.emplace_back(v.size(), 0.0F);
  }
  for (std::size_t v = 0; v < variables.size(); ++v) {
    views.emplace_back(gradients[v]);
    all.push_back({v, {0, variables[v].rows()}, values[v]});
  }
  ClientOptions options;
  options.request_timeout = 5s;
  options.wait_timeout = 10s;  // a pull that stood still fails here, not hangs
  {
    ClientOptions quick = options;
    quick.request_timeout = 300ms;
    Client<InProcess> old(cluster.endpoint(Node::worker(2)), quick);
    old.wait_ready(variables);
    CHECK(old.take_token(2).token.local_step == 0);
    cluster.network().drop_next(1, 1, Node::worker(2));  // its push never reaches ps 1
    CHECK_THROWS_AS(old.push(2, 0, views), Error);
  }  // the process is gone
  Client<InProcess> first(cluster.endpoint(Node::worker(0)), options);
  first.wait_ready(variables);
  CHECK(first.take_token(0).token.local_step == 0);
  CHECK(first.push(0, 0, views) == 0);
  Client<InProcess> backup(cluster.endpoint(Node::worker(1)), options);
  backup.wait_ready(variables);
  const TokenReply late = backup.take_token(1);
  CHECK(late.token.local_step == 1);  // ps 0 completed step 0 without it
  CHECK(late.pushes_taken == 0);
  std::vector<std::vector<float>> backup_values = values;
  std::vector<PullRequest> backup_all = all;
  for (std::size_t v = 0; v < all.size(); ++v) backup_all[v].into = backup_values[v];
  auto backup_pull = std::async(std::launch::async, [&] { return backup.pull(backup_all, 1); });
  // Worker 2 could still bring ps 1 its second gradient: the backup's pull waits.
  CHECK(backup_pull.wait_for(300ms) == std::future_status::timeout);
  Client<InProcess> again(cluster.endpoint(Node::worker(2)), options);
  again.wait_ready(variables);
  const TokenReply token = again.take_token(2);
  CHECK(token.token.local_step == 1);
  CHECK(token.pushes_taken == 1);  // ps 0 took the push ps 1 lost
  CHECK(again.pull(all, 1) == 1);
  CHECK(backup_pull.get() == 1);
  // Both ps tasks count the same pushes: a checkpoint's cut finds them alike.
  InProcess chief_link = cluster.endpoint(Node::chief());
  CallGroup paused;
  for (std::uint32_t ps = 0; ps < 2; ++ps) paused.add(chief_link.call(ps, Pause{}, {}));
  paused.wait(5s, "pause");
  const PauseReply at0 = paused.take_as<PauseReply>(0), at1 = paused.take_as<PauseReply>(1);
  CHECK(at0.global_step == 1);
  CHECK(at1.global_step == 1);
  CHECK(at0.pushes == std::vector<std::uint64_t>{1, 0, 1});
  CHECK(at1.pushes == at0.pushes);
}
