// SPDX-License-Identifier: MIT
// A ps task that joins a running job, in-process: the chief pauses every ps at one cut,
// registers the model over one more ps task and restores them all from the cut, so the
// new ps holds its balanced share of every value, slot, counter and table row as they
// were, and nothing trained is lost (a sync R = N job ends bit for bit where the job
// without the new ps ends); workers that knew fewer ps tasks follow; what cannot join is
// refused with the job left as it was; and what the chief's JoinDesk and a ps refuse.
// Workers that join or leave: every ps counts them from the step the chief chose, and the
// chief's loop counts one in while it waits for its next evaluation. A ps or a worker that
// asks to leave (SIGTERM, runner/leave.hpp) is taken out with nothing trained lost. The
// chief's loop gives up on ps tasks that answer its probe but break all its other work.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/runner/chief_loop.hpp"
#include "pulley/runner/join_desk.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/rebalance.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"
#include "support/membership.hpp"
#include "support/table_model.hpp"
#include "support/two_workers.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using namespace pulley::testing::two_workers;
using namespace pulley::testing::membership;
using pulley::testing::TinyTableModel;

namespace {

using SyncAdam = Cluster<FixedShards, Adam, SyncReplicas>;

std::vector<std::uint32_t> members_of(const Chief<InProcess>& chief) {
  return {chief.members().begin(), chief.members().end()};
}

/// The most bytes of values any ps holds over the least, for the members.
double imbalance(const Chief<InProcess>& chief) {
  const std::vector<std::uint64_t> bytes = bytes_per_ps(chief.placement(), chief.variables());
  std::uint64_t most = 0, least = ~std::uint64_t{0};
  for (const std::uint32_t ps : chief.members()) {
    const std::uint64_t b = ps < bytes.size() ? bytes[ps] : 0;
    most = std::max(most, b);
    least = std::min(least, b);
  }
  return least == 0 ? 1e9 : static_cast<double>(most) / static_cast<double>(least);
}

/// Two ps tasks and a third that may join (start_ps(2)), sync R = N = 2, the chief with
/// the linear model initialized.
struct Job {
  SyncAdam cluster{2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3}, std::chrono::seconds(5), 1};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  Job() { chief.initialize(LinearModel(kIn, kOut).variables()); }
};

}  // namespace

TEST_CASE("a ps that joins takes a balanced share, every value and slot as at the cut") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  Job job;
  auto& [cluster, chief] = job;
  run_steps(cluster, data, 0, 10);
  const ModelState before = chief.save_state();
  CHECK(chief.num_ps() == 2);

  cluster.start_ps(2);
  CHECK(chief.join("in-process:2") == 2);
  CHECK(chief.membership() == 1);
  CHECK(members_of(chief) == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(chief.num_ps() == 3);
  CHECK(chief.stats().size() == 3);
  // Placed as a job started on three ps tasks is: one part of each variable on each, as
  // balanced as rows allow (a 4-row bias splits 2 / 1 / 1).
  CHECK(chief.placement() == FixedShards{3}.place(chief.variables(), 3));
  CHECK(imbalance(chief) <= 1.12);
  check_same_dense(chief.save_state(), before);
  CHECK(chief.stats().at(2).global_step == 10);

  run_steps(cluster, data, 10, 14);  // workers that know two ps tasks learn of the third
  CHECK(chief.stats().at(2).global_step == 14);
  chief.shutdown();
}

TEST_CASE("a sync R = N job that a ps joins ends bit for bit where the job without it ends") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  const ModelState alone = undisturbed_state(data, 2, 30);
  Job job;
  auto& [cluster, chief] = job;
  run_steps(cluster, data, 0, 12);
  cluster.start_ps(2);
  (void)chief.join("in-process:2");
  run_steps(cluster, data, 12, 30);
  check_same_dense(chief.save_state(), alone);
  chief.shutdown();
}

TEST_CASE("workers training while a ps joins pause, follow the job onto three ps tasks, and finish") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  Job job;
  auto& [cluster, chief] = job;
  std::atomic<int> failures{0};
  constexpr std::int64_t kLast = 120;
  std::vector<std::thread> workers = start_steps(cluster, data, 0, kLast, failures);
  REQUIRE(chief.wait_for_step(20) < kLast - 20);
  cluster.start_ps(2);
  (void)chief.join("in-process:2");
  const std::int64_t at_join = chief.wait_for_step(0);
  for (auto& t : workers) t.join();
  CHECK(failures == 0);
  CHECK(at_join < kLast);
  const std::vector<Stats> stats = chief.stats();
  REQUIRE(stats.size() == 3);
  for (const Stats& s : stats) CHECK(s.global_step == kLast);
  CHECK(stats[2].pushes_taken > 0);  // the new ps took the workers' gradients
  chief.shutdown();
}

TEST_CASE("a joined ps lost and started again is restored with the others, as any ps") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  Job job;
  auto& [cluster, chief] = job;
  run_steps(cluster, data, 0, 6);
  cluster.start_ps(2);
  (void)chief.join("in-process:2");
  run_steps(cluster, data, 6, 10);
  const ModelState saved = chief.save_state();
  cluster.network().kill(Node::ps(2));
  cluster.network().restart(ParameterServer<FixedShards, Adam, SyncReplicas>(2, 3, Adam{0.01F}, SyncReplicas(2, 2),
                                                                              FixedShards{3}));
  chief.restore(saved);  // what the chief's rollback does once every ps answers again
  CHECK(members_of(chief) == std::vector<std::uint32_t>{0, 1, 2});
  check_same_dense(chief.save_state(), saved);
  run_steps(cluster, data, 10, 14);
  CHECK(chief.stats().at(2).global_step == 14);
  chief.shutdown();
}

TEST_CASE("a new ps that refuses the job's registration is told to end, and the others go on from the same cut") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  Job job;
  auto& [cluster, chief] = job;
  run_steps(cluster, data, 0, 8);
  const ModelState before = chief.save_state();
  // Another sharding than the job's: its placement differs from the others'.
  cluster.network().serve(ParameterServer<FixedShards, Adam, SyncReplicas>(2, 3, Adam{0.01F}, SyncReplicas(2, 2),
                                                                           FixedShards{2}));
  CHECK_THROWS_WITH_AS((void)chief.join("in-process:2"), doctest::Contains("place the variables differently"), Error);
  CHECK(members_of(chief) == std::vector<std::uint32_t>{0, 1});
  CHECK(chief.membership() == 2);  // it took the new ps, then the old ones back
  check_same_dense(chief.save_state(), before);
  InProcess probe(cluster.network(), Node::chief());
  PendingCall asked = probe.call(2, GetStats{});
  REQUIRE(asked.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  const Response answer = asked.take();
  REQUIRE(std::holds_alternative<ErrorReply>(answer));
  CHECK(std::get<ErrorReply>(answer).code == ErrorCode::kAborted);  // told to end, with the reason
  run_steps(cluster, data, 8, 12);  // workers learn membership 2 and train on two ps tasks
  for (const Stats& s : chief.stats()) CHECK(s.global_step == 12);
  chief.shutdown();
}

using SyncTables = Cluster<RoundRobin, Adagrad, SyncReplicas>;

TEST_CASE("a ps that joins a job with tables takes the rows rendezvous hashing gives it, every row as it was") {
  SyncTables cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2), RoundRobin{}, std::chrono::seconds(5), 1);
  Chief chief(cluster.endpoint(Node::chief()), 21);
  const TinyTableModel shape(kSpec);
  chief.initialize(shape.variables(), shape.tables());
  train_tables(cluster, 0, 12);
  const ModelState before = chief.save_state();
  REQUIRE(before.tables.at(0).ids.size() > 30);
  cluster.start_ps(2);
  (void)chief.join("in-process:2");
  const ModelState after = chief.save_state();
  check_same_dense(after, before);
  CHECK(rows_of(after.tables.at(0)) == rows_of(before.tables.at(0)));
  CHECK(after.tables[0].candidate_ids.size() == before.tables[0].candidate_ids.size());
  const std::uint32_t members[] = {0, 1, 2};
  std::vector<std::int64_t> expected(3, 0);
  for (const std::uint64_t id : before.tables[0].ids) ++expected[HashIds{}.ps_of("emb", id, members)];
  const std::vector<Stats> stats = chief.stats();
  for (std::size_t ps = 0; ps < 3; ++ps) CHECK(stats.at(ps).table_rows == expected[ps]);
  CHECK(expected[2] > 0);
  train_tables(cluster, 12, 16);  // and training goes on over three ps tasks
  CHECK(chief.stats().at(2).global_step == 16);
  chief.shutdown();
}

TEST_CASE("a ps that cannot join leaves the job as it was, and training goes on") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});  // nothing joinable
  Chief chief(cluster.endpoint(Node::chief()), 3);
  CHECK_THROWS_WITH_AS((void)chief.join("in-process:2"), doctest::Contains("initialize first"), Error);
  chief.initialize(LinearModel(kIn, kOut).variables());
  std::atomic<int> failures{0};
  constexpr std::int64_t kLast = 60;
  std::vector<std::thread> workers = start_steps(cluster, data, 0, kLast, failures);
  REQUIRE(chief.wait_for_step(10) < kLast - 10);
  CHECK_THROWS_WITH_AS((void)chief.join("in-process:2"), doctest::Contains("no joinable ps task"), Error);
  CHECK(chief.membership() == 0);
  CHECK(chief.num_ps() == 2);
  for (auto& t : workers) t.join();  // the ps tasks were resumed: the workers finish
  CHECK(failures == 0);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kLast);
  chief.shutdown();
}

namespace {

Response ask_desk(JoinDesk& desk, Request request, Node peer) {
  std::optional<Response> out;
  desk.handle(std::move(request), RequestContext{false, peer, 1}, [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

std::string refusal(const Response& r) {
  const auto* e = std::get_if<ErrorReply>(&r);
  return e == nullptr ? std::string("(accepted)") : e->message;
}

}  // namespace

TEST_CASE("the chief's JoinDesk queues the next ps task once, leaves a known one alone, and refuses the rest") {
  auto queue = std::make_shared<JoinQueue>();
  JoinDesk desk(queue);
  CHECK(refusal(ask_desk(desk, Join{"h:1"}, Node::evaluator())).find("only a ps task or a worker") != std::string::npos);
  CHECK(refusal(ask_desk(desk, GetStats{}, Node::ps(2))).find("Join, Leave, Shape and LostPs requests") != std::string::npos);
  CHECK(refusal(ask_desk(desk, Join{""}, Node::ps(2))).find("names its address") != std::string::npos);
  queue->expect({"h:0", "h:1"});
  CHECK(refusal(ask_desk(desk, Join{"h:1"}, Node::ps(3))).find("the next ps task of the job is ps 2") !=
        std::string::npos);
  CHECK(std::holds_alternative<Ack>(ask_desk(desk, Join{"h:1"}, Node::ps(1))));  // known: left alone
  CHECK(std::holds_alternative<Ack>(ask_desk(desk, Join{"h:2"}, Node::ps(2))));
  CHECK(refusal(ask_desk(desk, Join{"h:2"}, Node::ps(2))).find("asked to join already") != std::string::npos);
  const auto asked = queue->take();
  REQUIRE(asked.has_value());
  CHECK(asked->task == 2);
  CHECK(asked->address == "h:2");
  CHECK_FALSE(queue->take().has_value());
}

TEST_CASE("a ps refuses a registration whose ps addresses do not fit the cluster, and places over them") {
  const LinearModel model(kIn, kOut);
  const std::vector<VariableSpec> list(model.variables().begin(), model.variables().end());
  using Ps = ParameterServer<FixedShards, Adam, SyncReplicas>;
  Ps ps(1, 2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  auto ask = [&](Register r) {
    std::optional<Response> out;
    ps.handle(std::move(r), RequestContext{false, Node::chief(), 1}, [&](Response&& a) { out = std::move(a); });
    REQUIRE(out.has_value());
    return std::move(*out);
  };
  CHECK(refusal(ask(Register{list, {}, 0, {0, 1}, 1, {"a:1"}})).find("not this ps 1") != std::string::npos);
  CHECK(refusal(ask(Register{list, {}, 0, {0, 1, 2}, 0, {"a:1", "b:1", "c:1"}})).find("membership above 0") !=
        std::string::npos);
  CHECK(refusal(ask(Register{list, {}, 0, {0, 1, 3}, 1, {"a:1", "b:1", "c:1"}})).find("not a ps task") !=
        std::string::npos);
  CHECK(refusal(ask(Register{list, {}, 0, {0, 1, 2}, 1, {"a:1", "", "c:1"}})).find("empty") != std::string::npos);
  const Response placed = ask(Register{list, {}, 0, {0, 1, 2}, 1, {"a:1", "b:1", "c:1"}});
  REQUIRE(std::holds_alternative<PlacementReply>(placed));
  const PlacementReply& reply = std::get<PlacementReply>(placed);
  CHECK(reply.ps_addresses == std::vector<std::string>{"a:1", "b:1", "c:1"});
  CHECK(reply.placement == FixedShards{3}.place(list, 3));  // placed for three ps tasks
}

namespace {

/// Worker w tells every ps it is leaving (its last heartbeat): the tokens it took and did
/// not push for go back, and it is forgotten rather than held lost once quiet.
template <class Net>
void say_leaving(Net& cluster, std::uint32_t w) {
  InProcess endpoint = cluster.endpoint(Node::worker(w));
  for (std::uint32_t ps = 0; ps < endpoint.num_ps(); ++ps) {
    PendingCall call = endpoint.call(ps, Heartbeat{w, true}, {});
    (void)call.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(5));
  }
}

/// Workers `workers` step on threads of their own until global step `last` (a worker's
/// own, if given: one the job no longer counts from then on is refused its next token),
/// then say they are leaving, as a worker process that ends does: the
/// tokens they took for a step they did not push for go back.
template <class Net>
void train(Net& cluster, const LinearData& data, const std::vector<std::uint32_t>& workers, std::int64_t last,
           const std::map<std::uint32_t, std::int64_t>& own_last = {}) {
  std::vector<std::thread> threads;
  for (const std::uint32_t w : workers) {
    const auto it = own_last.find(w);
    const std::int64_t until = it == own_last.end() ? last : it->second;
    threads.emplace_back([&cluster, &data, w, until] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      try {
        for (std::int64_t k = 0; worker.step(batch_of(data, w % 2, k % 20), until); ++k) {
        }
      } catch (const Error& e) {  // taken out of the job, it asked for a token past its last step
        CHECK(e.code() == ErrorCode::kPermissionDenied);
        CHECK(worker.global_step() >= until - 1);
      }
      say_leaving(cluster, w);
    });
  }
  for (auto& t : threads) t.join();
}

std::int64_t pushes_taken(Chief<InProcess>& chief) {
  std::int64_t pushes = -1;
  for (const Stats& s : chief.stats()) {
    if (pushes >= 0) CHECK(s.pushes_taken == pushes);  // every ps took the same pushes
    pushes = s.pushes_taken;
  }
  return pushes;
}

}  // namespace

TEST_CASE("a worker that joins is counted by every ps from the step the chief chose, and one that leaves no more") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster{2, Adam{0.01F}, SyncReplicas(SyncReplicas::kEveryWorker, 2), FixedShards{3}};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  chief.initialize(LinearModel(kIn, kOut).variables());
  train(cluster, data, {0, 1}, 5);
  CHECK(pushes_taken(chief) == 10);
  CHECK(chief.workers().empty());  // the cluster spec's
  // Worker 2 joins: the ps tasks are at step 5, so every ps counts it from step 6 on.
  CHECK(chief.change_workers({0, 1, 2}) == 6);
  CHECK(chief.workers().size() == 3);
  train(cluster, data, {0, 1, 2}, 12);
  // Step 5 took the two workers' pushes (worker 2 waited for a token), steps 6 .. 11 three each.
  CHECK(pushes_taken(chief) == 10 + 2 + 6 * 3);
  for (const Stats& s : chief.stats()) CHECK(s.stale_gradients_dropped == 0);
  // Worker 1 leaves for good; it still trains through step 12, the last step that counts it.
  CHECK(chief.change_workers({0, 2}) == 13);
  train(cluster, data, {0, 1, 2}, 18, {{1, 13}});
  CHECK(pushes_taken(chief) == 30 + 3 + 5 * 2);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == 18);
  // Out of the job now: its token request is refused, saying so.
  try {
    Worker w1(1, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(1)));
    w1.wait_ready();
    (void)w1.step(batch_of(data, 1, 0), 30);
    FAIL("worker 1 was not refused");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kPermissionDenied);
    CHECK(std::string(e.what()).find("not one of the job's workers {0, 2}") != std::string::npos);
  }
  // A chief started in place of this one learns the workers from the ps tasks.
  Chief<InProcess> next{cluster.endpoint(Node::chief()), 3};
  REQUIRE(next.ps_serving());
  CHECK(std::vector<std::uint32_t>(next.workers().begin(), next.workers().end()) == std::vector<std::uint32_t>{0, 2});
  chief.shutdown();
}

TEST_CASE("the workers the chief set survive a rollback: the restore carries them") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster{2, Adam{0.01F}, SyncReplicas(SyncReplicas::kEveryWorker, 2), FixedShards{3}};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  chief.initialize(LinearModel(kIn, kOut).variables());
  const ModelState at0 = chief.save_state();
  CHECK(chief.change_workers({0, 1, 2}) == 1);
  chief.restore(at0);  // every ps back at step 0, counting three workers at once
  train(cluster, data, {0, 1, 2}, 4);
  CHECK(pushes_taken(chief) == 4 * 3);
  chief.shutdown();
}

TEST_CASE("a ps refuses workers it cannot count, and a change that comes too late, and takes one back") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster{2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3}};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  chief.initialize(LinearModel(kIn, kOut).variables());
  CHECK_THROWS_AS(chief.change_workers({}), Error);
  CHECK_THROWS_AS(chief.change_workers({1, 0}), Error);
  // Without Pause, or for a step the ps has reached: refused.
  InProcess raw = cluster.endpoint(Node::chief());
  const auto ask = [&](std::uint32_t ps, Request request) {
    PendingCall call = raw.call(ps, std::move(request), {});
    REQUIRE(call.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(5)));
    return call.take();
  };
  CHECK(refusal(ask(0, ChangeWorkers{{0, 1, 2}, 1})).find("without Pause") != std::string::npos);
  REQUIRE(std::holds_alternative<PauseReply>(ask(0, Pause{0})));
  CHECK(refusal(ask(0, ChangeWorkers{{0, 1, 2}, 0})).find("at global step 0 already") != std::string::npos);
  CHECK(refusal(ask(0, ChangeWorkers{{2, 1}, 3})).find("ascending") != std::string::npos);
  CHECK(std::holds_alternative<Ack>(ask(0, ChangeWorkers{{0, 1, 2}, 1})));
  CHECK(std::holds_alternative<StatsReply>(ask(0, GetStats{})));
  CHECK(std::get<StatsReply>(ask(0, GetStats{})).workers == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(std::holds_alternative<Ack>(ask(0, ChangeWorkers{{}, 2})));  // another step's take-back: kept
  CHECK(std::get<StatsReply>(ask(0, GetStats{})).workers.size() == 3);
  CHECK(std::holds_alternative<Ack>(ask(0, ChangeWorkers{{}, 1})));  // taken back
  CHECK(std::get<StatsReply>(ask(0, GetStats{})).workers.empty());
  REQUIRE(std::holds_alternative<Ack>(ask(0, Resume{})));
  run_steps(cluster, data, 0, 3);  // the job trains with its two workers as before
  CHECK(pushes_taken(chief) == 6);
  chief.shutdown();
}

TEST_CASE("a worker counted in that never comes is held lost in time, and one that left is counted again") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster{2, Adam{0.01F}, SyncReplicas(SyncReplicas::kEveryWorker, 2), FixedShards{3},
                   std::chrono::milliseconds(1000)};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  chief.initialize(LinearModel(kIn, kOut).variables());
  CHECK(chief.change_workers({0, 1, 2}) == 1);  // worker 2 never starts
  std::atomic<bool> done{false};
  std::vector<InProcess> hearts{cluster.endpoint(Node::worker(0)), cluster.endpoint(Node::worker(1))};
  const auto beat = [&] {  // workers 0 and 1 beat their hearts, as their processes would
    for (std::uint32_t w = 0; w < 2; ++w) {
      for (std::uint32_t ps = 0; ps < 2; ++ps) {
        PendingCall call = hearts[w].call(ps, Heartbeat{w, false}, {});
        (void)call.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(1));
      }
    }
  };
  beat();  // before the first step: heard, as a worker process is before it trains
  std::thread beating([&] {
    while (!done) {
      beat();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  train(cluster, data, {0, 1}, 6);  // from step 1 on each step needs three: 0 and 1 take 2's token
  done = true;
  beating.join();
  for (const std::uint32_t w : {0U, 1U}) say_leaving(cluster, w);  // after their last beat
  for (const Stats& s : chief.stats()) {
    CHECK(s.global_step == 6);
    CHECK(s.workers_lost == 1);
  }
  CHECK(chief.lost_workers() == std::vector<std::uint32_t>{2});
  // A ps that does not answer (stopped, say) says nothing, and the chief looks on (the
  // chief's loop looks every half second while it waits).
  cluster.network().drop_next(1, 1);
  CHECK(chief.lost_workers(std::chrono::milliseconds(200)) == std::vector<std::uint32_t>{2});
  // Worker 2 leaves for good: forgotten, no longer lost; counted again later, it is awaited.
  CHECK(chief.change_workers({0, 1}) == 7);
  train(cluster, data, {0, 1}, 8);
  CHECK(chief.lost_workers().empty());
  CHECK(chief.change_workers({0, 1, 2}) == 9);
  const std::int64_t before = pushes_taken(chief);
  train(cluster, data, {0, 1, 2}, 12);
  CHECK(pushes_taken(chief) == before + 2 + 3 * 3);  // step 8 with two, steps 9 .. 11 with three each
  chief.shutdown();
}

TEST_CASE("the first change of a job takes a worker of the spec out: its waiting token request is refused") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster{2, Adam{0.01F}, SyncReplicas(SyncReplicas::kEveryWorker, 2), FixedShards{3}};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  chief.initialize(LinearModel(kIn, kOut).variables());
  chief.set_workers({0, 1});  // the cluster spec's, as the runner's chief says
  CHECK(chief.change_workers({0}) == 1);
  // Worker 1 pushes for step 0 and asks for a token of step 1, which it no longer has.
  train(cluster, data, {0, 1}, 5, {{1, 1}});
  CHECK(pushes_taken(chief) == 2 + 4);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == 5);
  chief.shutdown();
}

TEST_CASE("the chief's JoinDesk tells a worker to wait until the chief counts it in, then lets it in") {
  auto queue = std::make_shared<JoinQueue>(2, 900);
  JoinDesk desk(queue);
  const Response in = ask_desk(desk, Join{}, Node::worker(1));  // one of the job's
  REQUIRE(std::holds_alternative<JoinReply>(in));
  CHECK(std::get<JoinReply>(in).last_step == 900);  // the chief's schedule
  CHECK(std::get<JoinReply>(in).workers == std::vector<std::uint32_t>{0, 1});
  const Response waiting = ask_desk(desk, Join{}, Node::worker(2));
  REQUIRE(std::holds_alternative<ErrorReply>(waiting));
  CHECK(std::get<ErrorReply>(waiting).code == ErrorCode::kUnavailable);
  CHECK(refusal(ask_desk(desk, Join{}, Node::worker(4))).find("the next worker of the job is worker 3") !=
        std::string::npos);  // 2 is queued: 3 is next
  CHECK(std::get<ErrorReply>(ask_desk(desk, Join{}, Node::worker(3))).code == ErrorCode::kUnavailable);
  (void)ask_desk(desk, Join{}, Node::worker(2));  // asked again: queued once
  const auto asked = queue->take();
  REQUIRE(asked.has_value());
  CHECK(asked->role == Node::Role::kWorker);
  CHECK(asked->task == 2);
  const auto third = queue->take();
  REQUIRE(third.has_value());
  CHECK(third->task == 3);
  CHECK_FALSE(queue->take().has_value());
  queue->set_workers({0, 1, 2});
  CHECK(std::get<JoinReply>(ask_desk(desk, Join{}, Node::worker(2))).workers == std::vector<std::uint32_t>{0, 1, 2});
  // Worker 3 is refused by the chief; worker 1 left, and may ask again.
  (void)ask_desk(desk, Join{}, Node::worker(3));
  queue->refuse(Node::worker(3), "the sync policy cannot count workers that join");
  CHECK(refusal(ask_desk(desk, Join{}, Node::worker(3))).find("cannot count") != std::string::npos);
  CHECK(std::get<ErrorReply>(ask_desk(desk, Join{}, Node::worker(3))).code == ErrorCode::kUnavailable);  // told once
  queue->set_workers({0, 2});
  CHECK(std::get<ErrorReply>(ask_desk(desk, Join{}, Node::worker(1))).code == ErrorCode::kUnavailable);
}

TEST_CASE("the chief's loop takes a worker in, then a worker and a ps out at their request, while it waits for its next evaluation") {
  constexpr std::int64_t kLast = 1000;
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster{3, Adam{0.01F}, SyncReplicas(SyncReplicas::kEveryWorker, 2), FixedShards{3}};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  Training<LinearModel> training;
  training.model = [] { return LinearModel(kIn, kOut); };
  training.last_step = kLast;  // evaluated at the last step only
  JoinQueue queue(2, kLast);
  runner_detail::ChiefLoop loop(training, chief, HashIds{}, nullptr, &queue);
  std::thread chief_thread([&] { loop.run(); });
  std::atomic<std::int64_t> step{0};
  std::atomic<std::int64_t> joiner_steps{0};
  std::atomic<bool> joiner_left{false};
  std::atomic<bool> released{false};
  const auto work = [&](std::uint32_t w) {
    ClientOptions options;
    options.recovery_timeout = std::chrono::seconds(30);
    Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)), options);
    worker.wait_ready();
    try {
      for (std::int64_t k = 0; worker.step(batch_of(data, w % 2, k % 20), kLast); ++k) {
        step = std::max<std::int64_t>(step, worker.global_step());
        if (w == 2) ++joiner_steps;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a step takes a while
        // Short of the last step training waits until the changes are done, however slow
        // the machine: they must come while the chief waits for its only evaluation.
        while (worker.global_step() >= kLast - 20 && !released) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (const Error& e) {  // taken out at its request: its next token is refused
      CHECK(w == 2);
      CHECK(e.code() == ErrorCode::kPermissionDenied);
      joiner_left = true;
    }
    say_leaving(cluster, w);
  };
  const auto wait_for = [&](auto done) {
    for (int i = 0; i < 3000 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  };
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) workers.emplace_back(work, w);
  REQUIRE(wait_for([&] { return step >= 10; }));  // the chief waits for global step 1000 now
  std::string why;
  // Worker 2 asks to join.
  CHECK(queue.ask_worker(2, why) == JoinQueue::Standing::kWaiting);
  REQUIRE(wait_for([&] { return queue.ask_worker(2, why) == JoinQueue::Standing::kIn; }));
  CHECK(queue.workers() == std::vector<std::uint32_t>{0, 1, 2});
  workers.emplace_back(work, 2);
  REQUIRE(wait_for([&] { return joiner_steps >= 5; }));
  // Worker 2 asks to leave: it is out once the chief changed the workers, and its next
  // token request is refused.
  CHECK(queue.ask_leave(Node::worker(2), why) == JoinQueue::Standing::kWaiting);
  REQUIRE(wait_for([&] { return queue.ask_leave(Node::worker(2), why) == JoinQueue::Standing::kOut; }));
  CHECK(queue.workers() == std::vector<std::uint32_t>{0, 1});
  REQUIRE(wait_for([&] { return joiner_left.load(); }));
  // ps 1 asks to leave: the others take its share; it ends (its process exits: what
  // waited there fails, and the workers follow the job onto ps tasks {0, 2}).
  CHECK(queue.ask_leave(Node::ps(1), why) == JoinQueue::Standing::kWaiting);
  REQUIRE(wait_for([&] { return queue.ask_leave(Node::ps(1), why) == JoinQueue::Standing::kOut; }));
  cluster.network().kill(Node::ps(1));
  released = true;
  for (auto& t : workers) t.join();
  chief_thread.join();
  CHECK(members_of(chief) == std::vector<std::uint32_t>{0, 2});
  for (const Part& part : chief.placement().parts) CHECK(part.ps != 1);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kLast);
  // The last ps task and the last worker cannot leave.
  queue.set_workers({0});
  CHECK(queue.ask_leave(Node::worker(0), why) == JoinQueue::Standing::kRefused);
  CHECK(why.find("last worker") != std::string::npos);
  chief.shutdown();
}

TEST_CASE("a ps that leaves at its request hands its share to the others: sync R = N ends bit for bit where the job without the leave ends") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  const ModelState whole = undisturbed_state(data, 3, 30);
  for (const std::uint32_t leaving : {0U, 1U}) {  // the pacing ps, and another
    CAPTURE(leaving);
    SyncAdam cluster(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
    Chief chief(cluster.endpoint(Node::chief()), 3);
    chief.initialize(LinearModel(kIn, kOut).variables());
    run_steps(cluster, data, 0, 12);
    const ModelState at_cut = chief.save_state();
    chief.retire(leaving);
    CHECK(chief.membership() == 1);
    std::vector<std::uint32_t> others{0, 1, 2};
    std::erase(others, leaving);
    CHECK(members_of(chief) == others);
    for (const Part& part : chief.placement().parts) CHECK(part.ps != leaving);
    check_same_dense(chief.save_state(), at_cut);  // every value and slot as at the cut
    CHECK_THROWS_WITH_AS(chief.retire(leaving), doctest::Contains("not a member"), Error);
    cluster.network().kill(Node::ps(leaving));  // its process ends
    run_steps(cluster, data, 12, 30);
    check_same_dense(chief.save_state(), whole);
    chief.retire(others[0]);
    CHECK_THROWS_WITH_AS(chief.retire(others[1]), doctest::Contains("last ps task"), Error);
    chief.shutdown();
  }
}

TEST_CASE("the chief's JoinDesk takes a task's Leave: queued once, out once the chief took it out, refusals told once") {
  auto queue = std::make_shared<JoinQueue>(2, 900);
  JoinDesk desk(queue);
  const auto left = [&](Node who) {
    const Response answer = ask_desk(desk, Leave{}, who);
    REQUIRE(std::holds_alternative<LeaveReply>(answer));
    return std::get<LeaveReply>(answer).out;
  };
  CHECK_FALSE(left(Node::worker(1)));
  CHECK_FALSE(left(Node::worker(1)));  // queued once
  CHECK_FALSE(left(Node::ps(2)));
  std::vector<JoinQueue::Asked> asked;
  while (auto a = queue->take()) asked.push_back(*a);
  REQUIRE(asked.size() == 2);
  CHECK((asked[0].role == Node::Role::kWorker && asked[0].task == 1 && asked[0].leaving));
  CHECK((asked[1].role == Node::Role::kPs && asked[1].task == 2 && asked[1].leaving));
  // Out only once the chief says it took the task out, whatever the sets say meanwhile.
  queue->set_ps({0, 1});
  CHECK_FALSE(left(Node::ps(2)));
  queue->took_out(Node::ps(2));
  CHECK(left(Node::ps(2)));
  queue->set_workers({0});
  CHECK_FALSE(left(Node::worker(1)));
  queue->took_out(Node::worker(1));
  CHECK(left(Node::worker(1)));
  CHECK(refusal(ask_desk(desk, Leave{}, Node::worker(0))).find("worker 0 is the job's last worker") != std::string::npos);
  queue->set_workers({0, 1});  // worker 1 joined again: out no more
  CHECK_FALSE(left(Node::worker(1)));
  CHECK_FALSE(left(Node::ps(1)));
  queue->refuse(Node::ps(1), "the others refused its share");
  queue->set_ps({0, 1});  // the chief's next look at the ps tasks keeps the refusal
  CHECK(refusal(ask_desk(desk, Leave{}, Node::ps(1))).find("refused its share") != std::string::npos);
  CHECK_FALSE(left(Node::ps(1)));  // told once: asking again queues it again
  queue->set_ps({1});
  queue->refuse(Node::ps(1), "again");
  (void)ask_desk(desk, Leave{}, Node::ps(1));  // the refusal told
  CHECK(refusal(ask_desk(desk, Leave{}, Node::ps(1))).find("ps 1 is the job's last ps task") != std::string::npos);
  CHECK(std::get<ErrorReply>(ask_desk(desk, Leave{}, Node::chief())).code == ErrorCode::kPermissionDenied);
}

TEST_CASE("the chief's JoinDesk tells a task about to join the job's shape: every ps address, the members, the next indices") {
  auto queue = std::make_shared<JoinQueue>(2, 900);
  JoinDesk desk(queue);
  CHECK(std::get<ErrorReply>(ask_desk(desk, Shape{}, Node::worker(0))).code == ErrorCode::kUnavailable);  // not started
  queue->expect({"h:0", "h:1", "h:2"});
  queue->set_ps({0, 2});  // ps 1 left
  queue->set_workers({0, 1, 3});  // worker 2 left, worker 3 joined
  const auto shape = [&](Node who) {
    const Response answer = ask_desk(desk, Shape{}, who);
    REQUIRE(std::holds_alternative<ShapeReply>(answer));
    return std::get<ShapeReply>(answer);
  };
  ShapeReply s = shape(Node::worker(0));
  CHECK(s.ps == std::vector<std::string>{"h:0", "h:1", "h:2"});
  CHECK(s.members == std::vector<std::uint32_t>{0, 2});
  CHECK(s.workers == std::vector<std::uint32_t>{0, 1, 3});
  CHECK(s.next_worker == 4);
  std::string why;
  CHECK(queue->ask_worker(4, why) == JoinQueue::Standing::kWaiting);
  CHECK(shape(Node::ps(0)).next_worker == 5);  // one asks already: the next but one
  CHECK(shape(Node::evaluator()).members == std::vector<std::uint32_t>{0, 2});  // the ps tasks to read
  CHECK(std::get<ErrorReply>(ask_desk(desk, Shape{}, Node::chief())).code == ErrorCode::kPermissionDenied);
}

TEST_CASE("the chief's JoinDesk rules on a ps process a worker or the evaluator lost, once the chief has looked") {
  auto queue = std::make_shared<JoinQueue>(2, 900);
  JoinDesk without(queue);
  CHECK(std::get<ErrorReply>(ask_desk(without, LostPs{1, 77, "refused"}, Node::worker(0))).code ==
        ErrorCode::kFailedPrecondition);  // a job without copies gives nothing up
  auto rulings = std::make_shared<CopyRulings>(
      2,
      [](std::uint32_t ps) {
        using Kind = CopyRulings::Sight::Kind;
        return ps == 0 ? CopyRulings::Sight{Kind::kServes, 77, "it serves"} : CopyRulings::Sight{Kind::kGone, 0, "refused"};
      },
      std::chrono::seconds(30));
  JoinDesk desk(queue, rulings);
  CHECK(std::get<ErrorReply>(ask_desk(desk, LostPs{1, 77, "refused"}, Node::ps(0))).code == ErrorCode::kPermissionDenied);
  CHECK(std::get<ErrorReply>(ask_desk(desk, LostPs{1, 77, "refused"}, Node::chief())).code == ErrorCode::kPermissionDenied);
  const auto ruled = [&](LostPs lost, Node who) {
    for (int attempt = 0; attempt < 1000; ++attempt) {  // kUnavailable while the chief looks
      const Response answer = ask_desk(desk, lost, who);
      if (const auto* reply = std::get_if<LostPsReply>(&answer)) return std::optional<bool>(reply->lost);
      REQUIRE(std::get<ErrorReply>(answer).code == ErrorCode::kUnavailable);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return std::optional<bool>();
  };
  CHECK(ruled(LostPs{0, 77, "out of reach"}, Node::worker(1)) == std::optional<bool>(false));  // the chief reaches it
  CHECK(ruled(LostPs{1, 77, "refused"}, Node::evaluator()) == std::optional<bool>(true));
}

TEST_CASE("under Async, which takes no token a step, a worker taken out of the job has its next push refused") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  Cluster<FixedShards, Adam, Async> cluster{2, Adam{0.01F}, Async{}, FixedShards{3}};
  Chief<InProcess> chief{cluster.endpoint(Node::chief()), 3};
  chief.initialize(LinearModel(kIn, kOut).variables());
  Worker w0(0, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(0)));
  Worker w1(1, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(1)));
  w0.wait_ready();
  w1.wait_ready();
  for (std::int64_t k = 0; k < 3; ++k) {
    REQUIRE(w0.step(batch_of(data, 0, k), 100));
    REQUIRE(w1.step(batch_of(data, 1, k), 100));
  }
  const std::int64_t from = chief.change_workers({0});
  CHECK(from == 7);
  REQUIRE(w0.step(batch_of(data, 0, 3), 100));  // step 7: worker 1 is out from here
  try {
    (void)w1.step(batch_of(data, 1, 3), 100);
    FAIL("worker 1's push was taken");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kPermissionDenied);
    CHECK(std::string(e.what()).find("not one of the job's workers {0}") != std::string::npos);
  }
  REQUIRE(w0.step(batch_of(data, 0, 4), 100));
  for (const Stats& s : chief.stats()) CHECK(s.pushes_taken == 8);  // worker 1's last was not taken
  chief.shutdown();
}

namespace {

using SspPs = ParameterServer<RoundRobin, Sgd, BoundedStaleness>;

/// Hands `request` to `ps` as from `from`; the answer, once there is one.
std::shared_ptr<std::optional<Response>> hand(SspPs& ps, Request request, Node from, std::uint64_t session = 1) {
  auto out = std::make_shared<std::optional<Response>>();
  ps.handle(std::move(request), RequestContext{true, from, session}, [out](Response&& r) { *out = std::move(r); });
  return out;
}

std::vector<float> values_of(SspPs& ps) {
  const auto pulled = hand(ps, Pull{0, {Slice{0, {0, 2}}}}, Node::chief());
  REQUIRE(pulled->has_value());
  const auto& values = std::get<PullReply>(**pulled).values.at(0);
  return {values.begin(), values.end()};
}

}  // namespace

TEST_CASE("under BoundedStaleness, every ps takes the same pushes of a worker that joins or leaves, whichever counts the change first") {
  // Two ps tasks (each holding its own copy of w, so that their values can be compared):
  // `first` counts each change a clock before `late`, whose pushes come later.
  const std::vector<VariableSpec> model{{"w", {2}, {}}};
  const std::vector<float> g{1, 1};
  SspPs first(0, 1, Sgd{1.0F}, BoundedStaleness(1, 2));
  SspPs late(0, 1, Sgd{1.0F}, BoundedStaleness(1, 2));
  const auto push = [&](SspPs& ps, std::uint32_t w, std::int64_t clock) {
    const auto answer = hand(ps, Push{w, clock, {{0, g}}}, Node::worker(w));
    REQUIRE(answer->has_value());
    REQUIRE(std::holds_alternative<PushReply>(**answer));
    return std::get<PushReply>(**answer).stale_parts;
  };
  const auto change = [&](std::vector<std::uint32_t> workers, std::int64_t from_step) {
    for (SspPs* ps : {&first, &late}) {
      REQUIRE(std::holds_alternative<PauseReply>(**hand(*ps, Pause{}, Node::chief())));
      REQUIRE(std::holds_alternative<Ack>(**hand(*ps, ChangeWorkers{workers, from_step}, Node::chief())));
      REQUIRE(std::holds_alternative<Ack>(**hand(*ps, Resume{}, Node::chief())));
    }
  };
  for (SspPs* ps : {&first, &late}) {
    REQUIRE(hand(*ps, Register{model}, Node::chief())->has_value());
    REQUIRE(std::holds_alternative<Ack>(**hand(*ps, Initialize{{{0, std::vector<float>{0, 0}}}}, Node::chief())));
    for (std::uint32_t w = 0; w < 2; ++w) CHECK(push(*ps, w, 0) == 0);
  }
  // Worker 2 joins from step 2; `late` has not had worker 1's clock-1 push yet.
  change({0, 1, 2}, 2);
  for (std::uint32_t w = 0; w < 2; ++w) CHECK(push(first, w, 1) == 0);
  CHECK(push(late, 0, 1) == 0);
  const auto token = hand(first, TakeToken{2}, Node::worker(2));
  REQUIRE(token->has_value());
  const Token joined = std::get<TokenReply>(**token).token;
  CHECK(joined.local_step == 2);
  CHECK(joined.pull_step == 2);
  // Its pull waits at `late` until that ps is at step 2, and so counts worker 2 in.
  const auto pulled = hand(late, Pull{joined.pull_step, {Slice{0, {0, 2}}}}, Node::worker(2));
  CHECK_FALSE(pulled->has_value());
  CHECK(push(late, 1, 1) == 0);
  REQUIRE(pulled->has_value());
  CHECK(push(first, 2, joined.local_step) == 0);
  CHECK(push(late, 2, joined.local_step) == 0);  // taken: `late` counted worker 2 in first
  // Worker 0 runs a clock ahead (s = 1): a pause says so, and the chief sets a change past
  // it (Chief::change_workers).
  CHECK(push(first, 0, 2) == 0);
  CHECK(push(first, 0, 3) == 0);
  const auto paused = hand(first, Pause{}, Node::chief());
  CHECK(std::get<PauseReply>(**paused).global_step == 2);
  CHECK(std::get<PauseReply>(**paused).furthest_pushed == 3);
  REQUIRE(std::holds_alternative<Ack>(**hand(first, Resume{}, Node::chief())));
  // Worker 1 leaves from step 4, holding a token of clock 4 that `first` gave it before
  // it counted the change: no ps takes that push, nor counts it.
  change({0, 2}, 4);
  CHECK(push(first, 1, 2) == 0);
  CHECK(std::get<TokenReply>(**hand(first, TakeToken{1}, Node::worker(1))).token.local_step == 3);
  CHECK(push(first, 1, 3) == 0);
  CHECK(std::get<TokenReply>(**hand(first, TakeToken{1}, Node::worker(1))).token.local_step == 4);
  CHECK(push(first, 2, 3) == 0);  // `first` is at step 4: it counts the change
  const auto refused = [&](SspPs& ps) {
    const auto out = hand(ps, Push{1, 4, {{0, g}}}, Node::worker(1));
    REQUIRE(out->has_value());
    const auto* error = std::get_if<ErrorReply>(&**out);
    REQUIRE(error != nullptr);
    CHECK(error->code == ErrorCode::kPermissionDenied);
    CHECK(error->message.find("not one of the job's workers {0, 2}") != std::string::npos);
  };
  refused(first);
  CHECK(push(late, 1, 2) == 0);
  CHECK(push(late, 1, 3) == 0);
  refused(late);  // `late` has not counted the change yet
  CHECK(push(late, 0, 2) == 0);
  CHECK(push(late, 0, 3) == 0);
  CHECK(push(late, 2, 3) == 0);
  CHECK(values_of(first) == values_of(late));
  CHECK(values_of(first) == std::vector<float>{-10, -10});
  for (SspPs* ps : {&first, &late}) {
    const auto stats = hand(*ps, GetStats{}, Node::chief());
    CHECK(std::get<StatsReply>(**stats).stats.global_step == 4);
    CHECK(std::get<StatsReply>(**stats).stats.pushes_taken == 10);  // a checkpoint's cut finds them alike
    CHECK(std::get<StatsReply>(**stats).workers == std::vector<std::uint32_t>{0, 2});
  }
}

namespace {

/// A ps whose link breaks whenever the chief reads values: it answers the chief's probe (a
/// pull of no values) and every other request, and refuses each of the chief's reads of
/// values kUnavailable, as a ps out of reach does.
template <class Ps>
struct BreaksChiefReads {
  Ps ps;
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    const auto* pull = std::get_if<Pull>(&request);
    if (pull != nullptr && !pull->slices.empty() && context.peer &&
        context.peer->role == Node::Role::kChief) {
      return respond(reply, ErrorReply{ErrorCode::kUnavailable, "ps 0: the link broke (a test's)"});
    }
    ps.handle(std::move(request), context, std::move(reply));
  }
  void disconnected(Node node, std::uint64_t session) noexcept { ps.disconnected(node, session); }
  [[nodiscard]] std::uint32_t task() const { return ps.task(); }
  [[nodiscard]] bool stopped() const { return ps.stopped(); }
};

}  // namespace

TEST_CASE(
    "the chief's loop ends the job once the ps tasks answered again 20 times and its work broke "
    "after each") {
  // Each fault has its own recovery deadline (ChiefLoop::whole_again), so a ps that answers
  // the chief's probe at once and breaks each evaluation's read would keep the job going
  // for ever: the chief gives up after 20 such returns with no progress between them.
  InProcessNetwork network(1);
  network.serve(BreaksChiefReads<ParameterServer<FixedShards, Sgd, SyncReplicas>>{
      ParameterServer<FixedShards, Sgd, SyncReplicas>(0, 1, Sgd{0.1F}, SyncReplicas(1, 1),
                                                      FixedShards{1})});
  Chief<InProcess> chief{InProcess(network, Node::chief()), 1};
  Training<LinearModel> training;
  training.model = [] { return LinearModel(kIn, kOut); };
  training.last_step = 1000;
  training.evaluate_every = 10;
  training.client.recovery_timeout = std::chrono::seconds(30);  // never reached: each fault passes
  runner_detail::ChiefLoop loop(training, chief);
  const LinearData data(2 * kBatch * 20, kIn, kOut,
                        3);  // batch_of(data, 0, k) reads rows 2k·kBatch on
  std::thread worker_thread([&] {
    Worker worker(0, LinearModel(kIn, kOut), InProcess(network, Node::worker(0)));
    worker.wait_ready();
    for (std::int64_t k = 0; worker.step(batch_of(data, 0, k % 20), 12); ++k) {
    }
  });
  std::string failure;
  std::optional<ErrorCode> code;
  try {
    loop.run();
  } catch (const std::exception& e) {  // (any: the worker's thread is joined all the same)
    failure = e.what();
    if (const auto* error = dynamic_cast<const Error*>(&e)) code = error->code();
  }
  worker_thread.join();
  CHECK(code == ErrorCode::kUnavailable);
  CHECK(failure.find("answered again 20 times") != std::string::npos);
  CHECK(failure.find("the link broke (a test's)") != std::string::npos);  // the last failure, named
  chief.shutdown();
}
