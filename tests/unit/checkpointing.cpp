// SPDX-License-Identifier: MIT
// Reading a job's state as one cut and restoring it, in-process: a sync R = N job resumed
// from a checkpoint ends bit for bit where the uninterrupted one does; an async job's cut
// holds the same pushes on every ps while training runs; a restore may change the number of
// ps tasks; and, message by message, what a pause holds, what a restore refuses, and a push
// sent twice.
#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/detail/copies.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/two_workers.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using namespace pulley::testing::two_workers;

namespace {

using SyncAdam = Cluster<FixedShards, Adam, SyncReplicas>;

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pulley-resume-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("a sync R = N job resumed from a checkpoint ends bit for bit where the uninterrupted one does") {
  const LinearData data(2 * kBatch * 60, kIn, kOut, 5);
  // Uninterrupted: 60 steps.
  std::vector<std::vector<float>> straight;
  {
    SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
    Chief chief(cluster.endpoint(Node::chief()), 3);
    chief.initialize(LinearModel(kIn, kOut).variables());
    run_steps(cluster, data, 0, 60);
    straight = chief.read_variables();
    chief.shutdown();
  }
  // Interrupted at step 25: saved to disk, the job gone, then a new job resumed from it.
  TempDir tmp;
  {
    SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
    Chief chief(cluster.endpoint(Node::chief()), 3);
    chief.initialize(LinearModel(kIn, kOut).variables());
    run_steps(cluster, data, 0, 25);
    const ModelState state = chief.save_state();
    CHECK(state.global_step == 25);
    CHECK(state.pacer == std::vector<std::int64_t>{25});
    REQUIRE(state.variables.size() == 2);
    CHECK(state.variables[0].slots.size() == 2);  // Adam's m and v
    CHECK(state.variables[0].counters.size() == 2);  // one per part (FixedShards{2})
    CHECK(state.variables[0].counters[0].values == std::vector<std::int64_t>{25});  // t
    CheckpointDirectory(tmp.path).save(state);
    chief.shutdown();
  }
  std::vector<std::vector<float>> resumed;
  {
    SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
    Chief chief(cluster.endpoint(Node::chief()), 99);  // another seed: nothing comes from it
    const auto latest = CheckpointDirectory(tmp.path).latest();
    REQUIRE(latest.has_value());
    chief.restore(latest->first);
    CHECK(chief.stats().at(0).global_step == 25);
    run_steps(cluster, data, 25, 60);
    resumed = chief.read_variables();
    chief.shutdown();
  }
  CHECK(resumed == straight);
}

TEST_CASE("the state the chief saves at initialization is step 0's, with workers already waiting") {
  const LinearData data(2 * kBatch * 5, kIn, kOut, 5);
  SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  std::thread workers([&] { run_steps(cluster, data, 0, 5); });  // they start the moment it is ready
  const ModelState initial = chief.initialize_and_save(LinearModel(kIn, kOut).variables());
  workers.join();
  CHECK(initial.global_step == 0);
  CHECK(initial.pacer == std::vector<std::int64_t>{0});
  // The values the chief's seed gives, and Adam's slots untouched.
  REQUIRE(initial.variables.size() == 2);
  for (const VariableState& v : initial.variables) {
    std::vector<float> expected(v.spec.size());
    initialize(v.spec, 3, expected);
    CHECK(v.values == expected);
    for (const SlotState& slot : v.slots) CHECK(slot.values == std::vector<float>(v.spec.size(), 0.0F));
  }
  CHECK(chief.stats().at(0).global_step == 5);  // and training went on
  chief.shutdown();
}

namespace {

/// Sgd with a step counter it does not name: a checkpoint cannot hold it.
struct CountingSgd {
  float learning_rate = 0.01F;
  struct State {
    std::int64_t applied = 0;
  };
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    ++state.applied;
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= learning_rate * g[i];
  }
};

}  // namespace

TEST_CASE("state the optimizer does not name is warned about in a cut after step 0, not at initialization") {
  pulley::testing::LogCapture captured;
  const LinearData data(2 * kBatch * 3, kIn, kOut, 5);
  Cluster<RoundRobin, CountingSgd, SyncReplicas> cluster(2, CountingSgd{}, SyncReplicas(2, 2), RoundRobin{});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  std::thread workers([&] { run_steps(cluster, data, 0, 3); });
  (void)chief.initialize_and_save(LinearModel(kIn, kOut).variables());  // what every job does first
  workers.join();
  const std::string warning = "the optimizer keeps state it does not name";
  CHECK(captured.find(LogLevel::kWarning, warning).empty());  // step 0: nothing to lose
  const ModelState later = chief.save_state();
  CHECK(later.global_step == 3);
  const auto lines = captured.find(LogLevel::kWarning, warning);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("global step 3") != std::string::npos);
  chief.shutdown();
}

TEST_CASE("an async job's cut holds the same pushes on every ps, read while it trains") {
  // Sgd at rate 1 with gradients of ones: every element of every part ends at minus the
  // number of pushes it took, so a cut is consistent exactly when all elements agree.
  using Server = Cluster<FixedShards, Sgd, Async>;
  Server cluster(3, Sgd{1.0F}, Async{}, FixedShards{3});
  struct Ones {
    struct Batch {};
    std::vector<VariableSpec> specs{{"w", {9, 2}, Initializer::zeros()}};
    std::vector<float> w = std::vector<float>(18), g = std::vector<float>(18, 1.0F);
    std::span<const VariableSpec> variables() const { return specs; }
    std::span<float> parameter(std::size_t) { return w; }
    std::span<const float> gradient(std::size_t) const { return g; }
    float compute_gradients(const Batch&) { return 0.0F; }
  };
  Chief chief(cluster.endpoint(Node::chief()), 1);
  chief.initialize(Ones{}.variables());
  std::atomic<bool> stop{false};
  std::atomic<int> pushed{0};
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 3; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, Ones{}, cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      while (!stop) {
        worker.push(0);
        ++pushed;
      }
    });
  }
  while (pushed == 0) std::this_thread::yield();  // the first cut is taken after a push
  for (int cut = 0; cut < 20; ++cut) {
    const ModelState state = chief.save_state();
    const auto& values = state.variables.at(0).values;
    CHECK(values.front() < 0.0F);
    for (const float x : values) CHECK(x == values.front());
    // Async counts pushes: every ps at the cut took as many as the values say.
    CHECK(state.global_step == static_cast<std::int64_t>(-values.front()));
    CHECK(state.pacer == std::vector<std::int64_t>{state.global_step});
  }
  stop = true;
  for (auto& t : workers) t.join();
  chief.shutdown();
}

TEST_CASE("a ps killed and started again is restored with the others, and the workers go on") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  run_steps(cluster, data, 0, 10);
  const ModelState checkpoint = chief.save_state();
  REQUIRE(checkpoint.global_step == 10);
  chief.restore(checkpoint);  // the first workers' tokens of step 10 go with their epoch
  std::atomic<int> failures{0};
  constexpr std::int64_t kLast = 200;
  // Training is still on when ps 1 is killed at step 20.
  std::vector<std::thread> workers = start_steps(cluster, data, 10, kLast, failures);
  REQUIRE(chief.wait_for_step(20) < kLast - 20);
  cluster.network().kill(Node::ps(1));  // the workers wait for it
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  cluster.network().restart(ParameterServer<FixedShards, Adam, SyncReplicas>(
      1, 2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2}));
  chief.restore(checkpoint);  // both ps back at step 10, at a new epoch
  for (auto& t : workers) t.join();
  CHECK(failures == 0);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kLast);
  chief.shutdown();
}

TEST_CASE("a checkpoint restores onto another number of ps tasks") {
  const LinearData data(2 * kBatch * 30, kIn, kOut, 8);
  ModelState state;
  {
    SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
    Chief chief(cluster.endpoint(Node::chief()), 3);
    chief.initialize(LinearModel(kIn, kOut).variables());
    run_steps(cluster, data, 0, 10);
    state = chief.save_state();
    chief.shutdown();
  }
  SyncAdam three(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(three.endpoint(Node::chief()), 3);
  chief.restore(state);
  const ModelState back = chief.save_state();
  CHECK(back.global_step == 10);
  for (std::size_t v = 0; v < state.variables.size(); ++v) {
    CHECK(back.variables[v].values == state.variables[v].values);
    CHECK(back.variables[v].slots == state.variables[v].slots);
    CHECK(back.variables[v].counters.size() == 3);  // three parts now, each with t = 10
    for (const PartCounters& c : back.variables[v].counters) CHECK(c.values == std::vector<std::int64_t>{10});
  }
  run_steps(three, data, 10, 20);  // and it trains on
  CHECK(chief.stats().at(0).global_step == 20);
  chief.shutdown();
}

namespace {

using SgdSync = ParameterServer<RoundRobin, Sgd, SyncReplicas>;

template <class PS>
Response ask(PS& ps, Request request, Node from, std::uint64_t session = 1) {
  std::optional<Response> out;
  ps.handle(std::move(request), RequestContext{false, from, session},
            [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

template <class PS>
std::shared_ptr<std::optional<Response>> ask_later(PS& ps, Request request, Node from,
                                                   std::uint64_t session = 1) {
  auto out = std::make_shared<std::optional<Response>>();
  ps.handle(std::move(request), RequestContext{false, from, session},
            [out](Response&& r) { *out = std::move(r); });
  return out;
}

const std::vector<VariableSpec> kModel{{"w", {2}, {}}};
const Node kChief = Node::chief(), kW0 = Node::worker(0), kW1 = Node::worker(1);

}  // namespace

TEST_CASE("a pause holds pushes, a cut takes the ones on their way, resume takes the rest") {
  SgdSync ps(0, 1, Sgd{1.0F}, SyncReplicas(1, 2));  // every push is a step
  ask(ps, Register{kModel}, kChief);
  const std::vector<float> w{0, 0}, g{1, 1};
  ask(ps, Initialize{{{0, w}}}, kChief);
  ask(ps, Push{0, 0, {{0, g}}}, kW0);
  const auto paused = std::get<PauseReply>(ask(ps, Pause{}, kChief));
  CHECK(paused.pushes == std::vector<std::uint64_t>{1});
  // While paused, pushes wait; a cut that wants one more of worker 1 takes it, not worker 0's.
  auto held0 = ask_later(ps, Push{0, 1, {{0, g}}}, kW0);
  auto cut = ask_later(ps, ReadState{{1, 1}}, kChief);
  CHECK_FALSE(held0->has_value());
  CHECK_FALSE(cut->has_value());  // worker 1's push is still on its way
  auto held1 = ask_later(ps, Push{1, 1, {{0, g}}}, kW1);
  REQUIRE(cut->has_value());
  REQUIRE(held1->has_value());  // taken for the cut
  CHECK_FALSE(held0->has_value());
  const auto state = std::get<StateReply>(**cut);
  CHECK(state.global_step == 2);
  CHECK(std::vector<float>(state.parts.at(0).values.begin(), state.parts.at(0).values.end()) ==
        std::vector<float>{-2, -2});
  // Resume takes what waited.
  CHECK(std::holds_alternative<Ack>(ask(ps, Resume{}, kChief)));
  REQUIRE(held0->has_value());
  CHECK(std::get<PushReply>(**held0).stale_parts == 1);  // of step 1, which the cut completed
  CHECK(ps.stats().global_step == 2);
  // A chief that pauses and leaves does not leave the ps paused.
  ask(ps, Pause{}, kChief, 7);
  auto waits = ask_later(ps, Push{0, 3, {{0, g}}}, kW0);
  CHECK_FALSE(waits->has_value());
  ps.disconnected(kChief, 7);
  CHECK(waits->has_value());
}

TEST_CASE("a cut holds each ps to the furthest count, less a push lost with an earlier process") {
  // Worker 0's last push is number 5 of series 9 on every ps; this ps took 11 of worker 0's
  // pushes, another 12: one of the process before, which this one never took and never will.
  PushLedger ledger;
  for (int i = 0; i < 11; ++i) ledger.count(0, i);
  ledger.answered(0, 5, {}, 9);
  for (int i = 0; i < 4; ++i) ledger.count(1, i);
  ledger.answered(1, 4, {}, 3);
  const auto cut = [](std::vector<std::uint64_t> sequences, std::vector<std::uint64_t> series) {
    ReadState r;
    r.until = {12, 4};
    r.last_sequences = std::move(sequences);
    r.last_series = std::move(series);
    return r;
  };
  using Counts = std::vector<std::uint64_t>;
  CHECK(CheckpointCut::own_until(ledger, cut({5, 4}, {9, 3})) == Counts{11, 4});
  // The furthest ps's last is another push (another number, or the same number of another
  // series): it is on its way here, and this ps waits for that one push, and only that one.
  CHECK(CheckpointCut::own_until(ledger, cut({6, 4}, {9, 3})) == Counts{12, 4});
  CHECK(CheckpointCut::own_until(ledger, cut({5, 4}, {10, 3})) == Counts{12, 4});
  ReadState two_short = cut({6, 4}, {9, 3});
  two_short.until = {13, 4};  // one lost before, and the last on its way
  CHECK(CheckpointCut::own_until(ledger, two_short) == Counts{12, 4});
  // Unnumbered pushes say nothing of which: the cut's count, as a cut always took (even
  // two short of it).
  ReadState unnumbered = cut({0, 0}, {0, 0});
  unnumbered.until = {13, 4};
  CHECK(CheckpointCut::own_until(ledger, unnumbered) == Counts{13, 4});
  unnumbered.last_sequences.clear();
  unnumbered.last_series.clear();
  CHECK(CheckpointCut::own_until(ledger, unnumbered) == Counts{13, 4});
  // At the cut's count already: it stays there, whatever the furthest's last push.
  CHECK(CheckpointCut::own_until(ledger, cut({5, 9}, {9, 3})) == Counts{11, 4});
  // A worker this ps never heard of: its pushes are on their way.
  ReadState more = cut({5, 4, 2}, {9, 3, 1});
  more.until = {11, 4, 1};
  CHECK(CheckpointCut::own_until(ledger, more) == Counts{11, 4, 1});

  // The chief's half: the furthest count of each worker, with that ps's last push.
  PauseReply first{}, second{};
  first.pushes = {12, 4};
  first.last_sequences = {6, 4};
  first.last_series = {9, 3};
  second.pushes = {11, 5, 2};
  second.last_sequences = {5, 7};
  second.last_series = {9, 3};
  const ReadState named = detail::cut_of(std::vector<PauseReply>{first, second});
  CHECK(named.until == Counts{12, 5, 2});
  CHECK(named.last_sequences == Counts{6, 7, 0});
  CHECK(named.last_series == Counts{9, 3, 0});
}

TEST_CASE("a cut that stands still for a worker's push is told once, naming the worker") {
  PushLedger ledger;
  ledger.count(0, 0);
  ledger.count(1, 0);
  CheckpointCut cut;
  cut.pause(1);
  Responder reply = [](Response&&) {};
  const auto asked = CheckpointCut::Clock::now();
  cut.read_at({1, 2}, reply);
  const auto awaited = [](std::uint32_t) { return true; };
  const std::chrono::seconds patience{2};
  CHECK_FALSE(cut.overdue(ledger, asked, patience, awaited).has_value());  // not yet
  const auto later = asked + std::chrono::seconds(3);
  CHECK_FALSE(
      cut.overdue(ledger, later, patience, [](std::uint32_t) { return false; }).has_value());
  const auto waits = cut.overdue(ledger, later, patience, awaited);
  REQUIRE(waits.has_value());
  CHECK(waits->first == 1);  // worker 0 is at the cut
  CHECK(waits->second == 2);
  CHECK_FALSE(cut.overdue(ledger, later, patience, awaited).has_value());  // told once
}

TEST_CASE(
    "a cut over copies waits for the push that one copy of a shard took and the other ps not") {
  // Shard X has two copies, `xa` (the copy read from) and `xb`; shard Y one, `y`. Worker 0's
  // push 2 reached xb only, and is on its way to xa and y. Both copies' pause answers fold
  // into one (the transport's merge_copy_answers); the cut must hold every ps to push 2.
  using SgdAsync = ParameterServer<RoundRobin, Sgd, Async>;
  SgdAsync xa(0, 1, Sgd{1.0F}, Async{}), xb(0, 1, Sgd{1.0F}, Async{}), y(0, 1, Sgd{1.0F}, Async{});
  const std::vector<float> w{0, 0}, g{1, 1};
  for (SgdAsync* ps : {&xa, &xb, &y}) {
    ask(*ps, Register{kModel}, kChief);
    ask(*ps, Initialize{{{0, w}}}, kChief);
    ask(*ps, Push{0, 0, {{0, g}}, 0, 1, {}, 7}, kW0);
  }
  ask(xb, Push{0, 1, {{0, g}}, 0, 2, {}, 7}, kW0);
  Response x = ask(xa, Pause{}, kChief);
  transport_detail::merge_copy_answers(x, ask(xb, Pause{}, kChief));
  CHECK(std::get<PauseReply>(x).pushes == std::vector<std::uint64_t>{2});
  CHECK(std::get<PauseReply>(x).last_sequences == std::vector<std::uint64_t>{2});
  const std::vector<PauseReply> paused{std::get<PauseReply>(x),
                                       std::get<PauseReply>(ask(y, Pause{}, kChief))};
  const ReadState cut = detail::cut_of(paused);
  auto cut_xa = ask_later(xa, cut, kChief), cut_xb = ask_later(xb, cut, kChief),
       cut_y = ask_later(y, cut, kChief);
  REQUIRE(cut_xb->has_value());
  CHECK_FALSE(cut_xa->has_value());
  CHECK_FALSE(cut_y->has_value());  // a cut with xa's last push would read y a push short
  for (SgdAsync* ps : {&xa, &y}) ask_later(*ps, Push{0, 1, {{0, g}}, 0, 2, {}, 7}, kW0);
  for (const auto* answer : {&cut_xa, &cut_xb, &cut_y}) {
    REQUIRE((*answer)->has_value());
    CHECK(std::get<StateReply>(***answer).global_step == 2);
  }
}

TEST_CASE(
    "under Async a cut does not wait for a push lost with its worker's process once no push "
    "comes") {
  // Two ps holding the same parts, as the two copies of a shard do (or two shards: each
  // ps counts every worker's pushes). Worker 0's process pushes to both, then writes its
  // second push to the first ps only and dies; the process started in its place pushes to
  // both. The ps counts differ by one for good, and no push is on its way (the end of
  // training): the cut must not wait for one.
  using SgdAsync = ParameterServer<RoundRobin, Sgd, Async>;
  SgdAsync a(0, 1, Sgd{1.0F}, Async{}), b(0, 1, Sgd{1.0F}, Async{});
  const std::vector<float> w{0, 0}, g{1, 1};
  for (SgdAsync* ps : {&a, &b}) {
    ask(*ps, Register{kModel}, kChief);
    ask(*ps, Initialize{{{0, w}}}, kChief);
    ask(*ps, Push{0, 0, {{0, g}}, 0, 1, {}, 7}, kW0);
  }
  ask(a, Push{0, 1, {{0, g}}, 0, 2, {}, 7}, kW0);  // lost with its process on the way to b
  for (SgdAsync* ps : {&a, &b}) ask(*ps, Push{0, 1, {{0, g}}, 0, 1, {}, 9}, kW0);
  const std::vector<PauseReply> paused{std::get<PauseReply>(ask(a, Pause{}, kChief)),
                                       std::get<PauseReply>(ask(b, Pause{}, kChief))};
  CHECK(paused[0].pushes == std::vector<std::uint64_t>{3});
  CHECK(paused[1].pushes == std::vector<std::uint64_t>{2});
  CHECK(paused[1].last_sequences == std::vector<std::uint64_t>{1});
  CHECK(paused[1].last_series == std::vector<std::uint64_t>{9});
  ReadState cut = detail::cut_of(paused);
  pulley::testing::LogCapture captured;
  auto cut_a = ask_later(a, cut, kChief);
  auto cut_b = ask_later(b, cut, kChief);
  REQUIRE(cut_a->has_value());
  REQUIRE(cut_b->has_value());  // at once: nothing of worker 0's is to come
  // The operator is told which ps was held short of the furthest, and why.
  CHECK(captured.find(LogLevel::kInfo, "the cut holds worker:0 at the 2 pushes taken here, 1 fewer")
            .size() == 1);
  CHECK(std::get<StateReply>(**cut_a).global_step == 3);
  CHECK(std::get<StateReply>(**cut_b).global_step == 2);
  for (SgdAsync* ps : {&a, &b}) CHECK(std::holds_alternative<Ack>(ask(*ps, Resume{}, kChief)));

  // The next push reaches the first ps and is on its way to the second: that one push is
  // waited for, and the second takes it while paused (its worker waits on the first).
  ask(a, Push{0, 2, {{0, g}}, 0, 2, {}, 9}, kW0);
  const std::vector<PauseReply> again{std::get<PauseReply>(ask(a, Pause{}, kChief)),
                                      std::get<PauseReply>(ask(b, Pause{}, kChief))};
  cut = detail::cut_of(again);
  CHECK(cut.until == std::vector<std::uint64_t>{4});
  cut_a = ask_later(a, cut, kChief);
  cut_b = ask_later(b, cut, kChief);
  REQUIRE(cut_a->has_value());
  CHECK_FALSE(cut_b->has_value());
  auto pushed = ask_later(b, Push{0, 2, {{0, g}}, 0, 2, {}, 9}, kW0);
  REQUIRE(cut_b->has_value());
  CHECK(pushed->has_value());  // taken for the cut
  CHECK(std::get<StateReply>(**cut_b).global_step == 3);
  for (SgdAsync* ps : {&a, &b}) CHECK(std::holds_alternative<Ack>(ask(*ps, Resume{}, kChief)));
}

TEST_CASE("a cut does not wait for a push that a worker held lost sent to another ps only") {
  SgdSync ps(0, 1, Sgd{1.0F}, SyncReplicas(1, 2));  // every push is a step
  ps.set_worker_timeout(std::chrono::milliseconds(50));
  ask(ps, Register{kModel}, kChief);
  const std::vector<float> w{0, 0}, g{1, 1};
  ask(ps, Initialize{{{0, w}}}, kChief);
  ask(ps, Heartbeat{0}, kW0);
  ask(ps, Heartbeat{1}, kW1);
  ask(ps, Push{0, 0, {{0, g}}}, kW0);
  // Worker 1 falls silent (it died), and is held lost.
  for (int i = 0; i < 200 && std::get<StatsReply>(ask(ps, GetStats{}, kChief)).lost.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ask(ps, Heartbeat{0}, kW0);
    ps.tick();
  }
  REQUIRE(std::get<StatsReply>(ask(ps, GetStats{}, kChief)).lost == std::vector<std::uint32_t>{1});
  // Another ps took one push of worker 1 before it died; this one never will: the cut does
  // not wait for it. It waits for worker 0's, who lives.
  REQUIRE(std::get<PauseReply>(ask(ps, Pause{}, kChief)).pushes == std::vector<std::uint64_t>{1});
  auto cut = ask_later(ps, ReadState{{2, 1}}, kChief);
  CHECK_FALSE(cut->has_value());
  auto held0 = ask_later(ps, Push{0, 1, {{0, g}}}, kW0);
  REQUIRE(cut->has_value());
  const auto state = std::get<StateReply>(**cut);
  CHECK(state.global_step == 2);
  CHECK(std::vector<float>(state.parts.at(0).values.begin(), state.parts.at(0).values.end()) ==
        std::vector<float>{-2, -2});
  CHECK(std::holds_alternative<Ack>(ask(ps, Resume{}, kChief)));
}

TEST_CASE("a cut stops waiting for a push of a worker that falls silent while the ps is paused") {
  SgdSync ps(0, 1, Sgd{1.0F}, SyncReplicas(1, 2));  // every push is a step
  ps.set_worker_timeout(std::chrono::milliseconds(200));
  ask(ps, Register{kModel}, kChief);
  const std::vector<float> w{0, 0}, g{1, 1};
  ask(ps, Initialize{{{0, w}}}, kChief);
  ask(ps, Heartbeat{0}, kW0);
  ask(ps, Heartbeat{1}, kW1);
  const auto heard1 = std::chrono::steady_clock::now();
  ask(ps, Push{0, 0, {{0, g}}}, kW0);
  // The cut begins while worker 1 lives; it dies having pushed to another ps only. A paused
  // ps holds nobody lost, but the read stops waiting once worker 1 was silent for the
  // worker timeout while worker 0 was heard.
  REQUIRE(std::get<PauseReply>(ask(ps, Pause{}, kChief)).pushes == std::vector<std::uint64_t>{1});
  auto cut = ask_later(ps, ReadState{{2, 1}}, kChief);
  auto held0 = ask_later(ps, Push{0, 1, {{0, g}}}, kW0);
  ps.tick();
  if (std::chrono::steady_clock::now() - heard1 < std::chrono::milliseconds(200)) {
    CHECK_FALSE(cut->has_value());  // worker 1 was heard just now: its push may still come
  }
  for (int i = 0; i < 200 && !cut->has_value(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ask(ps, Heartbeat{0}, kW0);
    ps.tick();
  }
  REQUIRE(cut->has_value());
  const auto state = std::get<StateReply>(**cut);
  CHECK(state.global_step == 2);
  CHECK(std::vector<float>(state.parts.at(0).values.begin(), state.parts.at(0).values.end()) ==
        std::vector<float>{-2, -2});
  CHECK(std::get<StatsReply>(ask(ps, GetStats{}, kChief)).lost.empty());  // not while paused
  CHECK(std::holds_alternative<Ack>(ask(ps, Resume{}, kChief)));
  ask(ps, Heartbeat{0}, kW0);  // (worker 0 beats on: the silence is worker 1's alone)
  CHECK(std::get<StatsReply>(ask(ps, GetStats{}, kChief)).lost == std::vector<std::uint32_t>{1});
}

TEST_CASE("an Initialize that holds pauses the ps at once: the cut reads step 0 however fast the workers are") {
  SgdSync ps(0, 1, Sgd{1.0F}, SyncReplicas(1, 2));  // every push is a step
  ask(ps, Register{kModel}, kChief);
  const std::vector<float> w{3, 4}, g{1, 1};
  Initialize initialize{{{0, w}}};
  initialize.hold = true;
  ask(ps, initialize, kChief);
  // A worker that saw the ps ready pulls the initial values, and its push waits.
  CHECK(std::holds_alternative<PlacementReply>(ask(ps, WaitReady{}, kW0)));
  auto early = ask_later(ps, Push{0, 0, {{0, g}}}, kW0);
  CHECK_FALSE(early->has_value());
  CHECK(ps.stats().global_step == 0);
  const auto paused = std::get<PauseReply>(ask(ps, Pause{}, kChief));
  CHECK(paused.global_step == 0);
  const auto state = std::get<StateReply>(ask(ps, ReadState{{0}}, kChief));
  CHECK(state.global_step == 0);
  CHECK(std::vector<float>(state.parts.at(0).values.begin(), state.parts.at(0).values.end()) == w);
  CHECK_FALSE(early->has_value());
  CHECK(std::holds_alternative<Ack>(ask(ps, Resume{}, kChief)));
  REQUIRE(early->has_value());
  CHECK(std::holds_alternative<PushReply>(**early));
  CHECK(ps.stats().global_step == 1);
  // Without hold, the same push is taken at once.
  SgdSync plain(0, 1, Sgd{1.0F}, SyncReplicas(1, 2));
  ask(plain, Register{kModel}, kChief);
  ask(plain, Initialize{{{0, w}}}, kChief);
  CHECK(std::holds_alternative<PushReply>(ask(plain, Push{0, 0, {{0, g}}}, kW0)));
  CHECK(plain.stats().global_step == 1);
}

TEST_CASE("a restore refuses what waited and what comes from an earlier epoch") {
  SgdSync ps(0, 1, Sgd{1.0F}, SyncReplicas(2, 2));
  ask(ps, Register{kModel}, kChief);
  const std::vector<float> w{0, 0}, g{1, 1}, saved{5, 6};
  ask(ps, Initialize{{{0, w}}}, kChief);
  auto token = std::get<TokenReply>(ask(ps, TakeToken{0, 0}, kW0));
  ask(ps, Push{0, 0, {{0, g}}}, kW0);  // half of step 0
  auto gated = ask_later(ps, Pull{1, {{0, {0, 2}}}, 0}, kW0);  // waits for step 1
  CHECK_FALSE(gated->has_value());
  const auto restored = ask(ps, Restore{1, {40}, {{0, saved, {}, {}}}}, kChief);
  REQUIRE(std::holds_alternative<Ack>(restored));
  REQUIRE(gated->has_value());
  CHECK(std::get<ErrorReply>(**gated).code == ErrorCode::kFailedPrecondition);
  CHECK(ps.stats().global_step == 40);
  // Epoch 0's requests are refused; epoch 1's served, from the restored values.
  CHECK(std::get<ErrorReply>(ask(ps, Push{1, 0, {{0, g}}, 0}, kW1)).code == ErrorCode::kFailedPrecondition);
  CHECK(std::get<ErrorReply>(ask(ps, TakeToken{1, 0}, kW1)).code == ErrorCode::kFailedPrecondition);
  // A request of an epoch this ps has not reached (another ps was restored first): try
  // again, not start over.
  CHECK(std::get<ErrorReply>(ask(ps, TakeToken{1, 2}, kW1)).code == ErrorCode::kUnavailable);
  const auto fresh = std::get<TokenReply>(ask(ps, TakeToken{1, 1}, kW1));
  CHECK(fresh.token.local_step == 40);
  const auto read = std::get<PullReply>(ask(ps, Pull{0, {{0, {0, 2}}}, 1}, kW1));
  CHECK(read.values.at(0)[1] == 6.0F);
  CHECK(std::get<PlacementReply>(ask(ps, WaitReady{}, kW1)).epoch == 1);
  (void)token;
}

TEST_CASE("a push sent again is answered as the first time and counted once") {
  SgdSync ps(0, 1, Sgd{1.0F}, SyncReplicas(2, 2));
  ask(ps, Register{kModel}, kChief);
  const std::vector<float> w{0, 0}, g{1, 1};
  ask(ps, Initialize{{{0, w}}}, kChief);
  CHECK(std::holds_alternative<PushReply>(ask(ps, Push{0, 0, {{0, g}}, 0, 77}, kW0)));
  CHECK(std::holds_alternative<PushReply>(ask(ps, Push{0, 0, {{0, g}}, 0, 77}, kW0)));  // again
  CHECK(ps.stats().global_step == 0);  // one push of two: the step waits
  CHECK(ps.stats().gradients_accepted == 1);
  CHECK(std::holds_alternative<PushReply>(ask(ps, Push{1, 0, {{0, g}}, 0, 5}, kW1)));
  CHECK(ps.stats().global_step == 1);
}
