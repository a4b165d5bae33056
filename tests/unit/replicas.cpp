// SPDX-License-Identifier: MIT
// A copy of every ps's shard on another ps (`TcpOptions::replicas`, ShardCopies), over TCP
// on 127.0.0.1: training with copies gives the result without them exactly; a ps lost
// mid-training is replaced by its copy, and training ends bit for bit where the unbroken run
// ends, with no rollback; a process started in the lost ps's place is not read from; a
// client that asks for a copy a ps does not hold is refused at the handshake; a worker is
// ready only once both copies of every shard are; a pull names the step both copies reached,
// a pause the furthest. With the chief ruling on lost processes (CopyRulings, as the role
// runner's tasks ask it), a lost ps is given up once the chief rules it lost, a worker cut
// off from a ps that the chief reaches gives nothing up (cut off for good, it fails within
// one recovery timeout), and a ps cut off from the chief
// serves no task past its lease, so that the tasks that still reach it give it up too. A
// worker lost after its push reached one copy of each shard only parts the copies, and the
// chief's align_copies makes them alike again.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/ps/shard_copies.hpp"
#include "pulley/runner/copy_rulings.hpp"
#include "pulley/runner/join_desk.hpp"
#include "pulley/runner/leave.hpp"
#include "pulley/runner/run.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/in_process.hpp"
#include "pulley/transport/tcp.hpp"
#include "support/cut_proxy.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/tcp.hpp"
#include "support/wait.hpp"

using namespace pulley;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using pulley::testing::client;
using pulley::testing::test_server_options;
using Server = ParameterServer<FixedShards, Adam, SyncReplicas>;
using Copies = ShardCopies<Server>;

namespace {

constexpr std::size_t kIn = 5, kOut = 3, kBatch = 4;
constexpr std::int64_t kSteps = 60;
constexpr std::uint32_t kPs = 3;

/// `worker_timeout`: nobody is held lost in most of these tests.
Server make_server(std::uint32_t task,
                   std::chrono::milliseconds worker_timeout = std::chrono::seconds(30)) {
  Server server(task, kPs, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{kPs});
  server.set_worker_timeout(worker_timeout);
  return server;
}

/// kPs ps tasks over TCP on ephemeral ports, each with its own shard and a copy of the one
/// before; `kill(i)` ends ps i as a lost process would (its port then refuses).
struct CopiesCluster {
  std::vector<std::unique_ptr<TcpServer<Copies>>> listeners;
  std::vector<std::thread> threads;
  std::vector<std::string> addresses;

  /// `chief_lease`: how long each ps process serves the tasks without hearing the chief
  /// (ShardCopies::set_chief_lease; zero: always); `worker_timeout`: each ps's; `server`:
  /// each ps's server options.
  explicit CopiesCluster(std::chrono::milliseconds chief_lease = std::chrono::milliseconds(0),
                         std::chrono::milliseconds worker_timeout = std::chrono::seconds(30),
                         const TcpServerOptions& server = test_server_options()) {
    for (std::uint32_t i = 0; i < kPs; ++i) {
      Copies copies(
          make_server(i, worker_timeout), make_server((i + kPs - 1) % kPs, worker_timeout),
          [worker_timeout](std::uint32_t shard) { return make_server(shard, worker_timeout); });
      copies.set_chief_lease(chief_lease);
      listeners.push_back(
          std::make_unique<TcpServer<Copies>>(std::move(copies), "127.0.0.1", 0, server));
      addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
    }
    for (auto& l : listeners) threads.emplace_back([&l] { l->run(); });
  }
  void kill(std::size_t i) {
    listeners[i]->stop();
    threads[i].join();
    listeners[i].reset();
  }
  ~CopiesCluster() {
    for (std::size_t i = 0; i < listeners.size(); ++i) {
      if (listeners[i]) listeners[i]->stop();
      if (threads[i].joinable()) threads[i].join();
    }
  }
};

TcpOptions with_copies() {
  TcpOptions options = pulley::testing::test_client_options();
  options.replicas = 1;
  return options;
}

/// Batch `number` of `data`: each token's number names its batch, the same examples whoever
/// pushes them.
LinearBatch batch_of(const LinearData& data, std::int64_t number) {
  const auto row = static_cast<std::size_t>(number % (2 * kSteps)) * kBatch;
  return LinearBatch{std::span(data.x).subspan(row * kIn, kBatch * kIn),
                     std::span(data.y).subspan(row * kOut, kBatch * kOut)};
}

/// Sync R = N = 2 training of a linear model with Adam; `at_step(w, k)` runs before worker
/// w's step k, and `chief_work(chief)` on the chief's thread while the workers train.
/// Returns the final variables.
template <class MakeTransport, class AtStep, class ChiefWork = void (*)(void*)>
std::vector<std::vector<float>> train(MakeTransport make_transport, AtStep at_step, ChiefWork chief_work = nullptr) {
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  Chief chief(make_transport(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), make_transport(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = 0;; ++k) {
        at_step(w, k);
        const auto read = [&](std::int64_t number) { return batch_of(data, number); };
        if (!worker.step(read, kSteps)) break;
      }
    });
  }
  if constexpr (!std::is_same_v<ChiefWork, void (*)(void*)>) chief_work(chief);
  for (auto& t : workers) t.join();
  std::vector<std::vector<float>> values;
  for (int attempt = 0; values.empty(); ++attempt) {  // a lost ps's connection fails one call
    try {
      values = chief.read_variables();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable || attempt > 0) throw;
    }
  }
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kSteps);
  chief.shutdown();
  return values;
}

std::vector<std::vector<float>> in_process_result() {
  InProcessNetwork network(kPs);
  for (std::uint32_t i = 0; i < kPs; ++i) network.serve(make_server(i));
  return train([&](Node n) { return InProcess(network, n); }, [](std::uint32_t, std::int64_t) {});
}

/// ps 1's process with copies, served by hand (no transport): ps 1's own shard and the copy
/// of ps 0's, two workers, a chief that registered and initialized both; `send` hands it a
/// request and keeps the answer.
struct HandServed {
  using Small = ParameterServer<RoundRobin, Sgd, SyncReplicas>;
  ShardCopies<Small> copies;

  HandServed(std::chrono::milliseconds worker_timeout, std::chrono::milliseconds lease)
      : copies(make(1, worker_timeout), make(0, worker_timeout)) {
    copies.set_chief_lease(lease);
    const std::vector<VariableSpec> model{{"a", {2}, {}}, {"b", {2}, {}}};
    for (const std::uint32_t part : {0U, 1U}) {  // RoundRobin: part 0 on ps 0 (the copy), 1 on ps 1
      const std::optional<std::uint32_t> shard = part == 0 ? std::optional<std::uint32_t>(0) : std::nullopt;
      REQUIRE(send(Register{model}, Node::chief(), shard)->has_value());
      const auto init = send(Initialize{{{part, std::vector<float>{0, 0}}}}, Node::chief(), shard);
      REQUIRE(init->has_value());
      REQUIRE(std::holds_alternative<Ack>(**init));
    }
  }
  std::shared_ptr<std::optional<Response>> send(Request request, Node from, std::optional<std::uint32_t> shard = {}) {
    auto out = std::make_shared<std::optional<Response>>();
    copies.handle(std::move(request), RequestContext{true, from, 1, shard}, [out](Response&& r) { *out = std::move(r); });
    return out;
  }

 private:
  static Small make(std::uint32_t task, std::chrono::milliseconds worker_timeout) {
    Small ps(task, 2, Sgd{0.1F}, SyncReplicas(2, 2), RoundRobin{});
    ps.set_worker_timeout(worker_timeout);
    return ps;
  }
};

}  // namespace

TEST_CASE("with a copy of every shard, training over TCP gives the result without copies exactly") {
  const auto expected = in_process_result();
  CopiesCluster cluster;
  const auto with = train([&](Node n) { return client(n, cluster.addresses, with_copies()); },
                          [](std::uint32_t, std::int64_t) {});
  CHECK(with == expected);
  // Both copies of every shard took every step.
  for (std::uint32_t i = 0; i < kPs; ++i) {
    CAPTURE(i);
    const Stats own = cluster.listeners[i]->service().own().stats();
    const Stats copy = cluster.listeners[i]->service().copy().stats();
    CAPTURE(copy.gradients_accepted);
    CAPTURE(copy.pushes_repeated);
    CAPTURE(copy.requests_rejected);
    CAPTURE(copy.stale_gradients_dropped);
    CAPTURE(own.gradients_accepted);
    CHECK(own.global_step == kSteps);
    CHECK(copy.global_step == kSteps);
  }
}

TEST_CASE("a ps lost mid-training is replaced by its copy: training ends bit for bit where the unbroken run ends") {
  const auto expected = in_process_result();
  for (const std::uint32_t lost : {0U, 2U}) {  // the pacing ps, and another
    CAPTURE(lost);
    CopiesCluster cluster;
    std::atomic<bool> killed{false};
    std::mutex killing;
    const auto with = train([&](Node n) { return client(n, cluster.addresses, with_copies()); },
                            [&](std::uint32_t w, std::int64_t k) {
                              if (w != 1 || k != kSteps / 2) return;
                              const std::scoped_lock lock(killing);
                              cluster.kill(lost);
                              killed = true;
                            });
    REQUIRE(killed);
    CHECK(with == expected);
    // The survivors served the lost ps's shard from its copy, with no rollback.
    const std::uint32_t holder = (lost + 1) % kPs;
    CHECK(cluster.listeners[holder]->service().copy().stats().global_step == kSteps);
    for (std::uint32_t i = 0; i < kPs; ++i) {
      if (i == lost) continue;
      CHECK(cluster.listeners[i]->service().own().stats().global_step == kSteps);
    }
  }
}

namespace {

/// What the chief reads of the ps tasks at the end of a job that lost a worker whose last
/// push reached one copy of each shard only: the variables from each shard's own copy, and
/// again with ps 0 gone (its shard then read from its copy on ps 1).
struct ReadBothWays {
  std::vector<std::vector<float>> own;
  std::vector<std::vector<float>> ps0_from_copy;
};

/// Sync R = N = 2 over copies, each ps holding a worker lost after 1 s of silence (20 beats):
/// worker 1 pushes its first step through a transport without copies (to the ps tasks' own
/// copies alone, as if it died between its sends to the two copies) and dies (its beats
/// stop, no goodbye); worker 0 trains to kSteps. So each own copy completes step 1 with
/// both gradients, and each other copy, once it holds worker 1 lost, with worker 0's alone.
/// `chief_work(chief)` runs once every ps holds worker 1 lost and worker 0 is 5 steps on.
template <class ChiefWork>
ReadBothWays lose_worker_after_one_copy_took_its_push(ChiefWork chief_work,
                                                      bool both_took_it = false) {
  CopiesCluster cluster(std::chrono::milliseconds(0), std::chrono::milliseconds(1000));
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  const auto read = [&](std::int64_t number) { return batch_of(data, number); };
  Chief chief(client(Node::chief(), cluster.addresses, with_copies()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  const auto beats = std::chrono::milliseconds(50);
  HeartbeatSender beat0(0, client(Node::worker(0), cluster.addresses, with_copies()), beats);
  std::thread dying([&] {
    HeartbeatSender beat1(1, client(Node::worker(1), cluster.addresses, with_copies()), beats);
    Worker lone(1, LinearModel(kIn, kOut),
                client(Node::worker(1), cluster.addresses,
                       both_took_it ? with_copies() : pulley::testing::test_client_options()));
    lone.wait_ready();
    CHECK(lone.step(read, kSteps));
    beat1.abandon();  // killed: held lost, not forgotten
  });
  std::thread training([&] {
    Worker worker(0, LinearModel(kIn, kOut),
                  client(Node::worker(0), cluster.addresses, with_copies()));
    worker.wait_ready();
    while (worker.step(read, kSteps)) {
    }
  });
  dying.join();
  CHECK(pulley::testing::wait_until([&] {
    const std::vector<Stats> stats = chief.stats();
    return chief.lost_workers() == std::vector<std::uint32_t>{1} &&
           std::all_of(stats.begin(), stats.end(),
                       [](const Stats& s) { return s.global_step >= 5; });
  }));
  chief_work(chief);
  training.join();
  ReadBothWays read_back;
  read_back.own = chief.read_variables();
  cluster.kill(0);
  for (int attempt = 0; read_back.ps0_from_copy.empty();
       ++attempt) {  // the lost ps's connection fails one call
    try {
      read_back.ps0_from_copy = chief.read_variables();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable || attempt > 0) throw;
    }
  }
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kSteps);
  chief.shutdown();
  return read_back;
}

}  // namespace

TEST_CASE(
    "a worker lost with a push that reached one copy only: the chief makes both copies of every "
    "shard alike") {
  // Left alone, the copies of each shard part for good: one counted the push, one did not.
  const ReadBothWays parted = lose_worker_after_one_copy_took_its_push([](auto&) {});
  CHECK(parted.own != parted.ps0_from_copy);
  // Made alike from the copies the tasks read, they end on the same values, and on what
  // the tasks read without the move: it changed nothing they read, and lost no update.
  const ReadBothWays alike =
      lose_worker_after_one_copy_took_its_push([](auto& chief) { CHECK(chief.align_copies()); });
  CHECK(alike.own == alike.ps0_from_copy);
  CHECK(alike.own == parted.own);
  // The same where worker 1's push reached both copies: they never part, and the move (made
  // while worker 1 is held lost, every step a refill step) changes nothing either.
  const ReadBothWays whole = lose_worker_after_one_copy_took_its_push([](auto&) {}, true);
  CHECK(whole.own == whole.ps0_from_copy);
  const ReadBothWays whole_moved = lose_worker_after_one_copy_took_its_push(
      [](auto& chief) { CHECK(chief.align_copies()); }, true);
  CHECK(whole_moved.own == whole.own);
  CHECK(whole_moved.own == whole_moved.ps0_from_copy);
}

/// The chief's desk serving its CopyRulings over `cluster`, and what the workers ask it: a
/// worker's transport asks through `referee` (AskChief), counted. The chief looks at the ps
/// tasks at `addresses` (its way to them: the cluster's by default), and rules a process
/// lost once its looks have seen nothing for `silence`.
struct RulingChief {
  explicit RulingChief(const CopiesCluster& cluster, std::vector<std::string> addresses = {},
                       std::chrono::milliseconds silence = std::chrono::seconds(30))
      : rulings(std::make_shared<CopyRulings>(
            kPs,
            [addresses = addresses.empty() ? cluster.addresses : std::move(addresses)](std::uint32_t ps) {
              const ProbeResult look = probe_ps(addresses[ps], ps, Node::chief(), pulley::testing::test_credentials(),
                                                std::chrono::milliseconds(500));
              using Kind = CopyRulings::Sight::Kind;
              return CopyRulings::Sight{look.kind == ProbeResult::Kind::kServes ? Kind::kServes
                                        : look.kind == ProbeResult::Kind::kGone ? Kind::kGone
                                                                                 : Kind::kSilent,
                                        look.process, look.detail};
            },
            silence)),
        desk(JoinDesk(std::make_shared<JoinQueue>(2, kSteps), rulings), "127.0.0.1", 0, test_server_options()),
        serving([this] { desk.run(); }) {}
  ~RulingChief() {
    desk.stop();
    serving.join();
  }

  /// The chief's transports' options: what they find lost is lost for the job. `quick`:
  /// they find a copy out of reach as quickly as the workers' do.
  TcpOptions chief_options(bool quick = false) const {
    TcpOptions options = with_copies();
    options.copy_referee = rulings->referee();
    if (quick) {
      options.attempt_timeout = std::chrono::milliseconds(300);
      options.copy_timeout = std::chrono::milliseconds(300);
    }
    return options;
  }
  /// A worker's: quick to find a copy out of reach, and asking the chief's desk about it.
  TcpOptions worker_options(Node self) {
    TcpOptions options = with_copies();
    options.attempt_timeout = std::chrono::milliseconds(300);
    options.copy_timeout = std::chrono::milliseconds(300);
    CopyReferee ask = runner_detail::AskChief::referee(std::make_shared<runner_detail::AskChief>(
        self, "127.0.0.1:" + std::to_string(desk.port()), with_copies(), std::chrono::seconds(10)));
    options.copy_referee = [this, ask](const LostProcess& lost, std::function<void(bool)> answer) {
      ++asked;
      ask(lost, [this, answer = std::move(answer)](bool ruled_lost) {
        if (ruled_lost) ++lost_rulings;
        answer(ruled_lost);
      });
    };
    return options;
  }

  std::shared_ptr<CopyRulings> rulings;
  TcpServer<JoinDesk> desk;
  std::thread serving;
  std::atomic<int> asked{0};         ///< questions the workers' transports asked
  std::atomic<int> lost_rulings{0};  ///< answers that a process is lost
};

TEST_CASE(
    "a task made in a job under way while a ps process is gone for good tries it once and asks the "
    "chief once, "
    "not once per copy it held") {
  // ps 1 holds shard 1 and the copy of shard 0: two links of a new task reach its address,
  // which refuses. A worker started again must be heard by the ps tasks within their worker
  // timeout: it may not wait a whole attempt for an address that refuses, nor once per link.
  CopiesCluster cluster;
  cluster.kill(1);
  RulingChief chief(cluster);
  TcpOptions options = chief.worker_options(Node::worker(0));
  options.attempt_timeout = std::chrono::seconds(5);
  options.connect_timeout = std::chrono::seconds(60);
  options.copy_connect_timeout =
      std::chrono::milliseconds(1);  // one attempt, as the role runner's (fit_to_copies)
  const auto began = std::chrono::steady_clock::now();
  Tcp tcp = client(Node::worker(0), cluster.addresses, options);
  const auto took = std::chrono::steady_clock::now() - began;
  CHECK(chief.asked == 1);
  CHECK(chief.lost_rulings == 1);
  CHECK(tcp.given_up() == std::vector<std::uint32_t>{1});
  CHECK(took < options.attempt_timeout);  // a refused attempt ends at once
  for (std::uint32_t ps = 0; ps < kPs;
       ++ps) {  // every shard answers, shard 1 from its copy on ps 2
    PendingCall call = tcp.call(ps, GetStats{}, {});
    REQUIRE(call.wait_for(std::chrono::seconds(10)));
    CHECK(std::holds_alternative<StatsReply>(call.take()));
  }
}

/// A referee that rules lost only ps 1's process `old` (and, when `unreached_lost`, any
/// question about a process the task never reached), and keeps the questions.
struct OldProcessReferee {
  std::uint64_t old = 0;
  bool unreached_lost = false;
  std::mutex mutex;
  std::vector<LostProcess> asked;

  CopyReferee referee() {
    return [this](const LostProcess& lost, std::function<void(bool)> answer) {
      {
        const std::scoped_lock lock(mutex);
        asked.push_back(lost);
      }
      answer(lost.process == 0 ? unreached_lost : lost.ps == 1 && lost.process == old);
    };
  }
  bool asked_about(std::uint64_t process) {
    const std::scoped_lock lock(mutex);
    return std::any_of(asked.begin(), asked.end(),
                       [&](const LostProcess& l) { return l.process == process; });
  }
};

/// Options of a task made in a job under way (one attempt first, as fit_to_copies sets),
/// quick to give up, asking `referee`.
TcpOptions under_way_options(OldProcessReferee& referee) {
  TcpOptions options = with_copies();
  options.attempt_timeout = std::chrono::milliseconds(300);
  options.copy_timeout = std::chrono::milliseconds(300);
  options.connect_timeout = std::chrono::seconds(30);
  options.copy_connect_timeout = std::chrono::milliseconds(1);
  options.copy_referee = referee.referee();
  return options;
}

std::uint64_t process_at(const std::string& address, std::uint32_t ps) {
  const ProbeResult look = probe_ps(address, ps, Node::chief(), pulley::testing::test_credentials(),
                                    std::chrono::seconds(5));
  REQUIRE(look.kind == ProbeResult::Kind::kServes);
  return look.process;
}

/// A cluster whose ps 1 is reached through a proxy that holds every new connection
/// unanswered, as a stopped process's address does, until it is continued.
struct Ps1Stopped {
  CopiesCluster cluster;
  pulley::testing::CutProxy proxy{cluster.listeners[1]->port(), 0.0, 1};
  std::vector<std::string> addresses;  ///< the cluster's, ps 1's through the proxy
  std::uint64_t process = process_at(cluster.addresses[1], 1);  ///< ps 1's
  std::thread continuing;

  Ps1Stopped() : addresses(cluster.addresses) {
    addresses[1] = "127.0.0.1:" + std::to_string(proxy.port());
    proxy.partition(true);
  }
  ~Ps1Stopped() {
    if (continuing.joinable()) continuing.join();
  }
  /// Lets connections through `after` from now, on a thread of its own.
  void continue_after(std::chrono::milliseconds after) {
    continuing = std::thread([this, after] {
      std::this_thread::sleep_for(after);
      proxy.partition(false);
    });
  }
};

TEST_CASE(
    "a task made while a ps process is stopped, which reaches it once continued, gives it up "
    "when it was ruled lost") {
  // ps 1 is behind a proxy that holds every new connection unanswered (a process stopped):
  // the task's first attempts miss, the referee cannot say of a process never reached, and
  // the task waits for it. Once it answers, the process it reaches is the one the job ruled
  // lost meanwhile (its copies are old): the task must not serve from it.
  Ps1Stopped stopped;
  OldProcessReferee referee;
  referee.old = stopped.process;
  stopped.continue_after(std::chrono::milliseconds(1200));
  Tcp tcp = client(Node::worker(0), stopped.addresses, under_way_options(referee));
  CHECK(referee.asked_about(referee.old));
  CHECK(tcp.given_up() == std::vector<std::uint32_t>{1});
  for (std::uint32_t ps = 0; ps < kPs; ++ps) {  // every shard answers, shard 1 from its copy
    PendingCall call = tcp.call(ps, GetStats{}, {});
    REQUIRE(call.wait_for(std::chrono::seconds(10)));
    CHECK(std::holds_alternative<StatsReply>(call.take()));
  }
  CHECK_FALSE(tcp.reach_again(1, false, true));  // still the process given up
}

TEST_CASE(
    "a ps copy given up before its process was ever reached is not reached again at that "
    "process if it was ruled lost, but a process started in its place is") {
  // The task gives ps 1 up unreached (its process stopped, ruled lost for the job). The
  // process continued answers there: the referee knows it, the task did not.
  Ps1Stopped stopped;
  OldProcessReferee referee;
  referee.old = stopped.process;
  referee.unreached_lost = true;
  Tcp tcp = client(Node::chief(), stopped.addresses, under_way_options(referee));
  CHECK(tcp.given_up() == std::vector<std::uint32_t>{1});
  stopped.proxy.partition(false);
  CHECK_FALSE(tcp.reach_again(1, false, true));
  CHECK(referee.asked_about(referee.old));
  // A process started in its place is reached again.
  const auto port = stopped.cluster.listeners[1]->port();
  stopped.cluster.kill(1);
  TcpServer<Copies> restarted(Copies(make_server(1), make_server(0)), "127.0.0.1", port,
                              test_server_options());
  std::thread serving([&] { restarted.run(); });
  const std::uint64_t fresh = process_at(stopped.cluster.addresses[1], 1);
  CHECK(fresh != referee.old);
  CHECK(tcp.reach_again(1, false, true));
  restarted.stop();
  serving.join();
}

TEST_CASE(
    "a task made while a ps process is stopped serves it once it answers, when the chief did not "
    "rule it lost") {
  // The same start, with the role runner's chief ruling: it reaches ps 1 itself (not through
  // the proxy), so the process the task reaches late is not lost, and nothing is given up.
  Ps1Stopped stopped;
  RulingChief chief(stopped.cluster);
  TcpOptions options = chief.worker_options(Node::worker(0));
  options.connect_timeout = std::chrono::seconds(30);
  options.copy_connect_timeout = std::chrono::milliseconds(1);
  std::atomic<int> asked_reached{0};
  options.copy_referee = [&asked_reached, ask = options.copy_referee](
                             const LostProcess& lost, std::function<void(bool)> answer) {
    if (lost.reached && lost.process != 0) ++asked_reached;
    ask(lost, std::move(answer));
  };
  stopped.continue_after(std::chrono::milliseconds(1200));
  Tcp tcp = client(Node::worker(0), stopped.addresses, options);
  CHECK(asked_reached == 1);
  CHECK(chief.lost_rulings == 0);
  CHECK(tcp.given_up().empty());
}

TEST_CASE("with the chief ruling, a ps lost mid-training is given up once the chief rules it lost: bit for bit") {
  const auto expected = in_process_result();
  CopiesCluster cluster;
  RulingChief ruling(cluster);
  std::atomic<bool> killed{false};
  const auto with = train(
      [&](Node n) {
        return client(n, cluster.addresses, n.role == Node::Role::kChief ? ruling.chief_options() : ruling.worker_options(n));
      },
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 1 || k != kSteps / 2) return;
        cluster.kill(0);  // the pacing ps
        killed = true;
      });
  REQUIRE(killed);
  CHECK(with == expected);
  CHECK(ruling.asked > 0);  // each worker asked the chief before it gave ps 0's copies up
  CHECK(ruling.lost_rulings > 0);
  CHECK(cluster.listeners[1]->service().copy().stats().global_step == kSteps);
}

TEST_CASE("a worker cut off from a ps the chief reaches gives nothing up: it waits, and training ends bit for bit") {
  // Worker 0 reaches ps 1 through a proxy, which cuts it off for 2.5 s (its connections
  // cut, new ones never answered) mid-training: well past its copy timeout. Without the
  // chief's ruling it would give ps 1's copies up and write the others alone, while
  // worker 1 still writes both: the copies would part. The chief reaches ps 1, so nothing
  // is given up: worker 0 waits, and the job ends as the unbroken one does.
  const auto expected = in_process_result();
  CopiesCluster cluster;
  RulingChief ruling(cluster);
  pulley::testing::CutProxy proxy(cluster.listeners[1]->port(), 0.0, 1);
  std::vector<std::string> behind_proxy = cluster.addresses;
  behind_proxy[1] = "127.0.0.1:" + std::to_string(proxy.port());
  std::thread cutting;
  const auto with = train(
      [&](Node n) {
        if (n.role == Node::Role::kChief) return client(n, cluster.addresses, ruling.chief_options());
        return client(n, n.index == 0 ? behind_proxy : cluster.addresses, ruling.worker_options(n));
      },
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 1 || k != kSteps / 3) return;
        cutting = std::thread([&] {
          proxy.partition(true);
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          proxy.partition(false);
        });
      });
  REQUIRE(cutting.joinable());
  cutting.join();
  CHECK(with == expected);
  CHECK(ruling.asked > 0);            // worker 0 found ps 1 out of reach, and asked
  CHECK(ruling.lost_rulings == 0);    // the chief reached it: nothing was given up
  for (std::uint32_t i = 0; i < kPs; ++i) {
    CAPTURE(i);
    CHECK(cluster.listeners[i]->service().own().stats().global_step == kSteps);
    CHECK(cluster.listeners[i]->service().copy().stats().global_step == kSteps);
  }
}

TEST_CASE(
    "a worker cut off for good from a ps the chief reaches gives up within its recovery timeout: "
    "the copy it still reads from does not make the ps tasks count as back") {
  // Worker 0 reaches ps 1 through a proxy that cuts it off for good. Every shard stays
  // readable (ps 1's from its copy on ps 2), so each of the worker's retries finds the ps
  // tasks ready; but its writes need ps 1's copies, which the chief does not give up. Were
  // that counted as the ps tasks answering again, each retry would start a fault of its own
  // (detail::Recovery::answered), and the worker would retry 20 recovery timeouts long.
  CopiesCluster cluster;
  RulingChief ruling(cluster);
  pulley::testing::CutProxy proxy(cluster.listeners[1]->port(), 0.0, 1);
  std::vector<std::string> behind_proxy = cluster.addresses;
  behind_proxy[1] = "127.0.0.1:" + std::to_string(proxy.port());
  Chief chief(client(Node::chief(), cluster.addresses, ruling.chief_options()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  ClientOptions options;
  options.recovery_timeout = std::chrono::milliseconds(1500);
  Worker worker(0, LinearModel(kIn, kOut),
                client(Node::worker(0), behind_proxy, ruling.worker_options(Node::worker(0))),
                options);
  worker.wait_ready();
  proxy.partition(true);
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  const auto read = [&](std::int64_t number) { return batch_of(data, number); };
  std::string failure;
  try {
    (void)worker.step(read, kSteps);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    failure = e.what();
  }
  CAPTURE(failure);
  CHECK(failure.find("were not back within 1 s") != std::string::npos);
  CHECK(ruling.lost_rulings == 0);  // the chief reaches ps 1: nothing was given up
  proxy.partition(false);
  chief.shutdown();
}

TEST_CASE("a ps process serves the tasks only within the chief's lease") {
  Copies copies(make_server(1), make_server(0));
  const Node worker = Node::worker(0);
  CHECK(copies.fenced(worker).empty());  // no lease: always
  copies.set_chief_lease(std::chrono::milliseconds(1000));
  CHECK(copies.fenced(worker).empty());  // no chief heard yet: nothing to lose
  const auto beat = [&](bool leaving) {
    copies.handle(Heartbeat{0, leaving}, RequestContext{true, Node::chief(), 1}, [](Response&&) {});
  };
  beat(false);
  CHECK(copies.fenced(worker).empty());  // within the lease
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  const std::string why = copies.fenced(worker);
  CHECK(why.find("has not heard the chief") != std::string::npos);
  CHECK(!copies.fenced(Node::evaluator()).empty());  // every task but the chief
  CHECK(copies.fenced(Node::chief()).empty());
  beat(false);  // heard again: serves again
  CHECK(copies.fenced(worker).empty());
  beat(true);   // the chief ended training: no lease runs any more
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  CHECK(copies.fenced(worker).empty());
}

TEST_CASE(
    "a process the chief tells to start again ends both copies it holds, and awaits no worker") {
  // The chief gave the process up (stopped past the copy timeout, then continued): its
  // copies are old. Told on one shard's connection, both end, and the role runner serves
  // anew at once, without waiting for workers that never come back to it.
  for (const bool restart : {false, true}) {
    CAPTURE(restart);
    HandServed ps(std::chrono::milliseconds(5000), std::chrono::milliseconds(0));
    REQUIRE(ps.send(Heartbeat{0, false}, Node::worker(0))->has_value());  // a worker it awaits
    const auto told = ps.send(Shutdown{false, {}, restart}, Node::chief());
    REQUIRE(told->has_value());
    CHECK(std::holds_alternative<Ack>(**told));
    CHECK(ps.copies.stopped() == restart);  // a plain Shutdown ends the shard it names only
    CHECK(ps.copies.restarts() == restart);
    CHECK(ps.copies.awaits_workers() == false);  // (a plain one: the copy still serves)
    REQUIRE(ps.copies.own().ended());
    CHECK(ps.copies.own().awaits_workers() == !restart);
    CHECK(ps.copies.own().ended()->code ==
          (restart ? ErrorCode::kUnavailable : ErrorCode::kOutOfRange));
    const auto asked = ps.send(GetStats{}, Node::worker(1), 0);  // the copy of ps 0's shard
    REQUIRE(asked->has_value());
    if (restart) {
      REQUIRE(std::holds_alternative<ErrorReply>(**asked));
      CHECK(std::get<ErrorReply>(**asked).code == ErrorCode::kUnavailable);
      CHECK(std::get<ErrorReply>(**asked).message.find("starts again empty") != std::string::npos);
    } else {
      CHECK(std::holds_alternative<StatsReply>(**asked));
    }
  }
}

TEST_CASE("a look of the chief's (GetStats) renews the lease on a ps but starts none") {
  // A chief started again looks at every ps before it begins (runner/run.hpp); at a job's
  // start that look must not start a lease that runs out while it waits for late ps tasks.
  Copies copies(make_server(1), make_server(0));
  copies.set_chief_lease(std::chrono::milliseconds(1000));
  const Node worker = Node::worker(0);
  const auto as_chief = [&](Request request) {
    copies.handle(std::move(request), RequestContext{true, Node::chief(), 1}, [](Response&&) {});
  };
  as_chief(GetStats{});
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  CHECK(copies.fenced(worker).empty());  // no lease started
  as_chief(Heartbeat{0, false});         // the lease starts
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  CHECK(!copies.fenced(worker).empty());
  as_chief(GetStats{});                  // and a look renews it
  CHECK(copies.fenced(worker).empty());
}

TEST_CASE(
    "a task started in a job with copies finds it under way whoever is gone, and ended once the "
    "chief ended it") {
  // runner/run.hpp: a task that finds the job under way waits one connection attempt for
  // a ps that does not answer, then asks for a ruling; at a job's start it waits as long
  // as ps tasks take to start. A ps may go between the look and the connection: the job
  // is under way whether every ps answered the look or not. A task started after the end
  // has nothing to do (the chief that could rule on a gone ps may be gone too).
  CopiesCluster cluster;
  const TcpOptions options = with_copies();
  const auto look = [&](Node self) {
    return runner_detail::look_at_copies(self, cluster.addresses, options);
  };
  CHECK_FALSE(look(Node::worker(1)).under_way);  // no model yet
  Chief chief(Tcp(Node::chief(), cluster.addresses, options), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  CHECK(look(Node::worker(1)).under_way);  // every ps there
  CHECK_FALSE(look(Node::worker(1)).ended);
  cluster.kill(2);
  CHECK(look(Node::worker(1)).under_way);  // one gone
  CHECK(look(Node::chief()).under_way);
  chief.shutdown();
  const runner_detail::CopiesLook after = look(Node::worker(1));
  REQUIRE(after.ended);
  CHECK(after.ended->code == ErrorCode::kOutOfRange);
}

TEST_CASE("workers a fenced ps refused are not held lost for that silence once it serves again") {
  // The chief stopped for longer than the worker timeout: the ps fenced itself and refused
  // the workers. When the chief is back, its first request (here a look, GetStats) must not
  // find the workers silent: the silence was the ps's doing.
  HandServed ps(std::chrono::milliseconds(1000), std::chrono::milliseconds(250));
  auto& copies = ps.copies;
  ps.send(Heartbeat{0, false}, Node::chief());
  for (std::uint32_t w = 0; w < 2; ++w) ps.send(Heartbeat{w, false}, Node::worker(w));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE(!copies.fenced(Node::worker(0)).empty());  // the workers are refused from here on
  const auto stopped = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - stopped < std::chrono::milliseconds(2000)) {
    copies.tick();  // the chief stopped two worker timeouts; the clock ticks
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const auto back = std::chrono::steady_clock::now();
  ps.send(GetStats{}, Node::chief());  // the chief is back: a look first
  ps.send(GetStats{}, Node::chief(), 0);
  if (std::chrono::steady_clock::now() - back < std::chrono::milliseconds(250)) {  // (else fenced again)
    CHECK(copies.fenced(Node::worker(0)).empty());
  }
  CHECK(copies.own().stats().workers_lost == 0);
  CHECK(copies.copy().stats().workers_lost == 0);
  // A worker that stays silent is still held lost, a timeout after the fence was lifted;
  // the one that beats is not.
  for (int i = 0; i < 250 && copies.own().stats().workers_lost + copies.copy().stats().workers_lost < 2; ++i) {
    ps.send(Heartbeat{1, false}, Node::worker(1));
    ps.send(Heartbeat{0, false}, Node::chief());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(copies.own().stats().workers_lost == 1);
  CHECK(copies.copy().stats().workers_lost == 1);
  const auto look = ps.send(GetStats{}, Node::chief());
  REQUIRE(look->has_value());
  REQUIRE(std::holds_alternative<StatsReply>(**look));
  CHECK(std::get<StatsReply>(**look).lost == std::vector<std::uint32_t>{0});
}

TEST_CASE("a ps stopped past its lease holds no worker lost for the time it was stopped") {
  // The ps itself was stopped 2 s (SIGSTOP; no tick, no request): its lease ran out 0.6 s
  // in. Run again, it fences itself off, then hears the chief. The whole 2 s were its own
  // silence, not only the 1.4 s after its lease ran out: the workers get a whole timeout.
  HandServed ps(std::chrono::milliseconds(800), std::chrono::milliseconds(600));
  auto& copies = ps.copies;
  ps.send(Heartbeat{0, false}, Node::chief());
  for (std::uint32_t w = 0; w < 2; ++w) ps.send(Heartbeat{w, false}, Node::worker(w));
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));  // stopped
  REQUIRE(!copies.fenced(Node::worker(0)).empty());
  const auto resumed = std::chrono::steady_clock::now();
  ps.send(Heartbeat{0, false}, Node::chief());
  // The chief beats, the workers do not: they are held lost a whole timeout (800 ms) after
  // the ps ran again, not 200 ms after, as they would be if only the fence were forgiven.
  // (A loaded machine only makes the verdict come later.)
  std::chrono::steady_clock::duration until_lost{};
  while (std::chrono::steady_clock::now() - resumed < std::chrono::seconds(5)) {
    ps.send(Heartbeat{0, false}, Node::chief());
    copies.tick();
    if (copies.own().stats().workers_lost == 2 && copies.copy().stats().workers_lost == 2) {
      until_lost = std::chrono::steady_clock::now() - resumed;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(until_lost.count() > 0);
  CHECK(until_lost >= std::chrono::milliseconds(800));
}

TEST_CASE("a ps that serves no task still gives a lost chief up after the chief wait: its clock ticks") {
  // Fenced off (its lease ran out), a ps hears no task, so nothing it is sent drives its
  // watch of the chief: the transport's tick (every second at most, from TcpServer's
  // sweep) does, and ends training as aborted once no chief came back in time.
  Copies copies(make_server(1), make_server(0));
  copies.set_chief_lease(std::chrono::milliseconds(50));
  for (Server* ps : {&copies.own(), &copies.copy()}) {
    ps->set_worker_timeout(std::chrono::milliseconds(100));
    ps->set_chief_wait(std::chrono::milliseconds(200));
  }
  pulley::testing::LogCapture captured;
  copies.handle(Heartbeat{0, false}, RequestContext{true, Node::chief(), 1}, [](Response&&) {});
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the whole wait, and more
  CHECK(!copies.stopped());  // no request came: nothing looked at the clock
  for (int i = 0; i < 250 && !copies.stopped(); ++i) {
    copies.tick();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(copies.stopped());
  // Its log does not tell the operator that the workers go on: it served none meanwhile.
  const auto lost = captured.find(LogLevel::kWarning, "the chief is lost");
  REQUIRE(lost.size() == 2);  // once for each copy
  for (const std::string& line : lost) CHECK(line.find("no task is served meanwhile") != std::string::npos);
  for (Server* ps : {&copies.own(), &copies.copy()}) {
    REQUIRE(ps->ended().has_value());
    CHECK(ps->ended()->code == ErrorCode::kAborted);
    CHECK(ps->ended()->message.find("no chief came back") != std::string::npos);
  }
}

TEST_CASE("a ps cut off from the chief serves no task: those that still reach it give it up too, bit for bit") {
  // The chief and worker 0 reach ps 1 through a proxy, which cuts them off from it for good
  // mid-training; worker 1 reaches ps 1 directly all along. Worker 0 asks the chief, which
  // cannot reach ps 1 either and rules it lost after a second of silence: worker 0 then
  // writes ps 1's shard to its other copy alone. ps 1's lease (0.6 s) ended before that
  // ruling could come, so ps 1 refuses worker 1 too, which asks and gives ps 1 up as well.
  // Without the lease worker 1 would go on writing both copies of ps 1's shard and reading
  // from ps 1's own, which misses worker 0's pushes: the copies would part (and worker 1
  // wait for ever, as nobody here is held lost).
  const auto expected = in_process_result();
  CopiesCluster cluster(std::chrono::milliseconds(600));
  pulley::testing::CutProxy proxy(cluster.listeners[1]->port(), 0.0, 1);
  std::vector<std::string> behind_proxy = cluster.addresses;
  behind_proxy[1] = "127.0.0.1:" + std::to_string(proxy.port());
  RulingChief ruling(cluster, behind_proxy, std::chrono::milliseconds(1000));
  std::optional<HeartbeatSender<Tcp>> chief_beats;  // the chief's, as the role runner's chief beats
  chief_beats.emplace(0, client(Node::chief(), behind_proxy, ruling.chief_options(true)),
                      std::chrono::milliseconds(100), "chief");
  std::atomic<bool> cut{false};
  const auto with = train(
      [&](Node n) {
        if (n.role == Node::Role::kChief) return client(n, behind_proxy, ruling.chief_options(true));
        return client(n, n.index == 0 ? behind_proxy : cluster.addresses, ruling.worker_options(n));
      },
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 1 || k != kSteps / 3) return;
        cut = true;
        proxy.partition(true);
      });
  chief_beats.reset();
  REQUIRE(cut);
  CHECK(with == expected);
  CHECK(ruling.lost_rulings >= 2);  // both workers heard that ps 1 is lost
  CHECK(cluster.listeners[2]->service().copy().stats().global_step == kSteps);  // ps 1's shard went on there
  CHECK(cluster.listeners[1]->service().own().stats().global_step < kSteps);
}

TEST_CASE(
    "a transport made while one ps process is gone and another stalled waits for the stalled one "
    "where it "
    "holds a shard's last copy") {
  // Either way round: the stalled process holds a shard's own copy, or its copy.
  for (const auto& [gone, stalled] : {std::pair<std::size_t, std::size_t>{2, 1}, {1, 2}}) {
    INFO("ps " << gone << " gone, ps " << stalled << " stalled");
    CopiesCluster cluster;
    cluster.kill(gone);  // its address refuses
    pulley::testing::CutProxy cut(
        static_cast<std::uint16_t>(std::stoi(cluster.addresses[stalled].substr(10))), 0.0, 1);
    std::vector<std::string> addresses = cluster.addresses;
    addresses[stalled] = "127.0.0.1:" + std::to_string(cut.port());
    TcpOptions options = with_copies();
    options.attempt_timeout = std::chrono::milliseconds(200);
    options.connect_timeout = std::chrono::seconds(20);
    options.copy_connect_timeout =
        std::chrono::milliseconds(200);  // as the runner's chief in a lost one's place
    cut.partition(true);                 // out of reach for a while (a stopped process)
    std::jthread back([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      cut.partition(false);
    });
    const auto began = std::chrono::steady_clock::now();
    {
      Tcp tcp = client(Node::chief(), addresses, options);
      const auto took = std::chrono::steady_clock::now() - began;
      CHECK(took >= std::chrono::milliseconds(1400));  // it waited for the stalled one
      CHECK(took < std::chrono::seconds(15));          // and not connect_timeout for the gone one
      CHECK(tcp.given_up() == std::vector<std::uint32_t>{static_cast<std::uint32_t>(gone)});
      PendingCall call = tcp.call(stalled, GetStats{}, {});
      REQUIRE(call.wait_for(std::chrono::seconds(5)));
      CHECK(std::holds_alternative<StatsReply>(call.take()));
    }
    back.join();
    // Waiting for every process one attempt alone (connect_timeout short) gives the stalled
    // one up, with the shard whose last copy it holds.
    options.copy_connect_timeout = std::chrono::milliseconds(0);
    options.connect_timeout = std::chrono::milliseconds(200);
    cut.partition(true);
    CHECK_THROWS_AS(client(Node::chief(), addresses, options), Error);
    cut.partition(false);
  }
}

TEST_CASE(
    "the chief's Shutdown reaches both copies of every shard, though one copy is out of reach a "
    "while") {
  TcpServerOptions lingers = test_server_options();
  lingers.linger =
      std::chrono::seconds(30);  // a ps that ended serves its clients on, as the runner's
  CopiesCluster cluster(std::chrono::milliseconds(0), std::chrono::seconds(30), lingers);
  // The chief reaches ps 1 (which holds shard 1 and the copy of shard 0) through a proxy
  // that takes its connections but passes nothing for 1.5 s as training ends.
  pulley::testing::CutProxy cut(
      static_cast<std::uint16_t>(std::stoi(cluster.addresses[1].substr(10))), 0.0, 1);
  std::vector<std::string> addresses = cluster.addresses;
  addresses[1] = "127.0.0.1:" + std::to_string(cut.port());
  TcpOptions options = with_copies();
  options.attempt_timeout = std::chrono::milliseconds(300);
  {
    Chief chief(client(Node::chief(), addresses, options), 7);
    chief.initialize(LinearModel(kIn, kOut).variables());
    cut.partition(true);
    std::jthread back([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      cut.partition(false);
    });
    std::this_thread::sleep_for(
        std::chrono::milliseconds(100));  // its connections cut: nothing sent gets through
    // Shard 0's own copy takes the Shutdown at once and then answers "finished"; its copy
    // on ps 1 must not be left out for that.
    CHECK_NOTHROW(chief.shutdown());
  }
  for (std::size_t k = 0; k < kPs; ++k) {
    INFO("ps " << k);
    CHECK(cluster.listeners[k]->service().own().stopped());
    CHECK(cluster.listeners[k]->service().copy().stopped());
  }
}

TEST_CASE("a process started in a lost ps's place holds nothing, and no task reads from it") {
  const auto expected = in_process_result();
  CopiesCluster cluster;
  std::unique_ptr<TcpServer<Copies>> restarted;
  std::thread serving;
  const auto with = train([&](Node n) { return client(n, cluster.addresses, with_copies()); },
                          [&](std::uint32_t w, std::int64_t k) {
                            if (w != 1 || k != kSteps / 2) return;
                            const auto port = cluster.listeners[1]->port();
                            cluster.kill(1);
                            restarted = std::make_unique<TcpServer<Copies>>(
                                Copies(make_server(1), make_server(0)), "127.0.0.1", port, test_server_options());
                            serving = std::thread([&] { restarted->run(); });
                          });
  CHECK(with == expected);
  REQUIRE(restarted);
  CHECK(restarted->service().own().stats().global_step == 0);  // never registered
  restarted->stop();
  serving.join();
}

TEST_CASE(
    "a task started after a take-back whose process is gone again serves its copies from the other "
    "alone") {
  // ps 1 is lost and a process started in its place is taken back (membership 1); that
  // process is lost too. A chief (or any task) started afterwards gives ps 1's copies up
  // when it is made, then learns membership 1: a take-back it did not live through, of a
  // process it cannot reach. Before, it served ps 1's copies again unreached (what a task
  // cut off from a process the chief just took back must do), and its calls waited for it.
  CopiesCluster cluster;
  {
    Chief chief(client(Node::chief(), cluster.addresses, with_copies()), 7);
    chief.initialize(LinearModel(kIn, kOut).variables());
    const auto port = cluster.listeners[1]->port();
    cluster.kill(1);
    TcpServer<Copies> restarted(Copies(make_server(1), make_server(0)), "127.0.0.1", port,
                                test_server_options());
    std::thread serving([&] { restarted.run(); });
    bool back = false;
    for (int i = 0; i < 1500 && !back; ++i) {
      try {
        (void)chief.stats();  // a call to ps 1 finds another process there: its copies are given up
      } catch (const Error&) {
      }
      if (!chief.given_up().empty()) back = chief.take_back(1);
      if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    REQUIRE(back);
    CHECK(chief.membership() == 1);
    restarted.stop();  // lost again
    serving.join();
  }
  pulley::testing::LogCapture captured;
  TcpOptions under_way = with_copies();  // as the role runner makes it for a job under way
  under_way.copy_connect_timeout = std::chrono::milliseconds(1);
  Chief next(client(Node::chief(), cluster.addresses, under_way), 7);
  REQUIRE(next.ps_serving());
  (void)next.adopt(LinearModel(kIn, kOut).variables());
  CHECK(next.membership() == 1);
  CHECK(next.given_up() == std::vector<std::uint32_t>{1});
  CHECK(captured.find(LogLevel::kInfo, "served by two copies again").empty());
  CHECK(next.stats().size() == kPs);  // answered, from ps 1's copies on ps 2 and ps 0
  // Nothing serves ps 1's address: the chief's looks to take it back fail, and say why
  // once, not at every look.
  CHECK_FALSE(next.take_back(1));
  CHECK_FALSE(next.take_back(1));
  CHECK(captured
            .find(LogLevel::kInfo, "ps 1 at " + cluster.addresses[1] + " is not reached again yet")
            .size() == 1);
  next.shutdown();
}

TEST_CASE("a process started in a lost ps's place is taken back by the chief: the job survives losing another") {
  // ps 1 is lost, and ps 2's copy serves shard 1 alone. A process started in ps 1's place
  // is taken back (Chief::take_back): restored from a cut, it holds shard 1 and the copy of
  // shard 0 again. Then ps 2 is lost too: shard 1 is served by the process taken back
  // alone (without the take-back it would be gone), and training ends bit for bit where
  // the unbroken run ends.
  const auto expected = in_process_result();
  CopiesCluster cluster;
  std::unique_ptr<TcpServer<Copies>> restarted;
  std::thread serving;
  std::atomic<bool> started{false}, tried{false}, taken{false}, killed{false};
  const auto bounded_wait = [](const std::atomic<bool>& flag) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!flag && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return flag.load();
  };
  const auto with = train(
      [&](Node n) { return client(n, cluster.addresses, with_copies()); },
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 1) return;
        if (k == kSteps / 4) {
          const auto port = cluster.listeners[1]->port();
          cluster.kill(1);
          restarted = std::make_unique<TcpServer<Copies>>(Copies(make_server(1), make_server(0)), "127.0.0.1", port,
                                                          test_server_options());
          serving = std::thread([&] { restarted->run(); });
          started = true;
        }
        if (k == kSteps * 3 / 4 && bounded_wait(tried) && taken) {
          cluster.kill(2);
          killed = true;
        }
      },
      [&](auto& chief) {
        bool back = false;
        if (!bounded_wait(started)) return;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (!back && std::chrono::steady_clock::now() < deadline) {
          try {
            (void)chief.stats();  // a call to ps 1 finds another process there: its copies are given up
          } catch (const Error&) {
          }
          if (!chief.given_up().empty()) {
            CHECK(chief.given_up() == std::vector<std::uint32_t>{1});
            back = chief.take_back(1);
          }
          if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        CHECK(chief.given_up().empty());
        CHECK(chief.membership() == 1);  // the same ps tasks, one change newer
        taken = back;
        tried = true;
      });
  REQUIRE(taken);
  REQUIRE(killed);
  CHECK(with == expected);
  REQUIRE(restarted);
  // The process taken back holds both shards it should, and took every step since.
  CHECK(restarted->service().own().stats().global_step == kSteps);
  CHECK(restarted->service().copy().stats().global_step == kSteps);
  restarted->stop();
  serving.join();
}

TEST_CASE(
    "a ps lost for good leaves the job: its share moves from its copies, and the job survives "
    "losing another") {
  // ps 1 is lost for good; ps 2's copy serves shard 1 alone, and shard 0 has one copy
  // left. The chief takes ps 1 out (Chief::retire): one cut from the copies that served,
  // the model placed over ps 0 and ps 2, each holding its shard and a copy of the other's
  // (ps 2's copy moved from shard 1 to shard 0). A third leave is refused (no copy of its
  // own shard could be kept). Then ps 0 is lost too: ps 2 serves both shards, shard 0 from
  // the copy that moved to it, and training ends bit for bit where the unbroken run ends.
  const auto expected = in_process_result();
  CopiesCluster cluster;
  std::atomic<bool> retired{false}, killed{false};
  const auto bounded_wait = [](const std::atomic<bool>& flag) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!flag && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return flag.load();
  };
  std::atomic<bool> lost{false};
  const auto with = train(
      [&](Node n) { return client(n, cluster.addresses, with_copies()); },
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 1) return;
        if (k == kSteps / 4) {
          cluster.kill(1);
          lost = true;
        }
        if (k == kSteps * 3 / 4 && bounded_wait(retired)) {
          cluster.kill(0);
          killed = true;
        }
      },
      [&](auto& chief) {
        if (!bounded_wait(lost)) return;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (chief.given_up().empty() && std::chrono::steady_clock::now() < deadline) {
          try {
            (void)chief
                .stats();  // a call to ps 1 finds its address refusing: its copies are given up
          } catch (const Error&) {
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        REQUIRE(chief.given_up() == std::vector<std::uint32_t>{1});
        chief.retire(1);
        CHECK(chief.membership() == 1);
        CHECK(std::vector<std::uint32_t>(chief.members().begin(), chief.members().end()) ==
              std::vector<std::uint32_t>{0, 2});
        CHECK(chief.given_up().empty());  // every member's shard has two copies again
        CHECK_THROWS_WITH_AS(chief.retire(2), doctest::Contains("keeps 2 ps tasks or more"), Error);
        CHECK(chief.membership() == 1);  // (the job went on as it was, from the same members)
        retired = true;
      });
  REQUIRE(retired);
  REQUIRE(killed);
  CHECK(with == expected);
  // ps 2 took every step with its own shard and the copy of ps 0's, which moved to it.
  CHECK(cluster.listeners[2]->service().copy().task() == 0);
  CHECK(cluster.listeners[2]->service().own().stats().global_step == kSteps);
  CHECK(cluster.listeners[2]->service().copy().stats().global_step == kSteps);
}

TEST_CASE(
    "a ps joins a job with copies: it holds its share and a copy, and the job survives losing "
    "another") {
  // Two ps processes with copies; a third (its own shard and a copy of ps 1's) joins
  // (Chief::join): the model is placed over three, ps 0's copy moves from shard 1 to shard
  // 2, and every task, the workers that knew two ps tasks included, writes both copies of
  // each shard. Then ps 1 is lost: ps 2 serves shard 1 from its copy, and training ends
  // bit for bit where the unbroken run ends.
  const auto expected = in_process_result();
  const auto make = [](std::uint32_t task, std::uint32_t num_ps) {
    Server server(task, num_ps, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{kPs});
    server.set_worker_timeout(std::chrono::seconds(30));
    return server;
  };
  const auto copies_of = [&](std::uint32_t task, std::uint32_t before, std::uint32_t num_ps) {
    return Copies(make(task, num_ps), make(before, num_ps),
                  [make](std::uint32_t shard) { return make(shard, std::max(kPs, shard + 1)); });
  };
  std::vector<std::unique_ptr<TcpServer<Copies>>> ps;
  ps.push_back(std::make_unique<TcpServer<Copies>>(copies_of(0, 1, 2), "127.0.0.1", 0,
                                                   test_server_options()));
  ps.push_back(std::make_unique<TcpServer<Copies>>(copies_of(1, 0, 2), "127.0.0.1", 0,
                                                   test_server_options()));
  ps.push_back(std::make_unique<TcpServer<Copies>>(copies_of(2, 1, 3), "127.0.0.1", 0,
                                                   test_server_options()));
  std::vector<std::thread> serving;
  for (auto& server : ps) serving.emplace_back([&server] { server->run(); });
  struct Stop {  // (however the test ends)
    std::vector<std::unique_ptr<TcpServer<Copies>>>& ps;
    std::vector<std::thread>& serving;
    ~Stop() {
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (ps[i]) ps[i]->stop();
        if (serving[i].joinable()) serving[i].join();
      }
    }
  } stop{ps, serving};
  const auto address = [&](std::size_t i) { return "127.0.0.1:" + std::to_string(ps[i]->port()); };
  const std::vector<std::string> two{address(0), address(1)};
  std::atomic<bool> joined{false}, killed{false};
  const auto with =
      train([&](Node n) { return client(n, two, with_copies()); },
            [&](std::uint32_t w, std::int64_t k) {
              if (w != 1 || k != kSteps * 3 / 4) return;
              const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
              while (!joined && std::chrono::steady_clock::now() < deadline)
                std::this_thread::sleep_for(std::chrono::milliseconds(10));
              if (!joined) return;
              ps[1]->stop();
              serving[1].join();
              ps[1].reset();
              killed = true;
            },
            [&](auto& chief) {
              CHECK(chief.join(address(2)) == 2);
              CHECK(chief.membership() == 1);
              CHECK(std::vector<std::uint32_t>(chief.members().begin(), chief.members().end()) ==
                    std::vector<std::uint32_t>{0, 1, 2});
              CHECK(chief.given_up().empty());
              joined = true;
            });
  REQUIRE(joined);
  REQUIRE(killed);
  CHECK(with == expected);
  // ps 2 took every step since it joined, with its shard and the copy of ps 1's; ps 0's
  // copy moved to shard 2.
  CHECK(ps[2]->service().copy().task() == 1);
  CHECK(ps[2]->service().own().stats().global_step == kSteps);
  CHECK(ps[2]->service().copy().stats().global_step == kSteps);
  CHECK(ps[0]->service().copy().task() == 2);
}

TEST_CASE("a worker that cannot reach the process the chief took back writes neither copy alone: it waits for it") {
  // ps 1 is lost and started again (a new process); worker 1 reaches ps 1 through a proxy
  // that cuts it off from then until 2 s after the chief took the new process back. Worker
  // 1 learns the new membership while it cannot reach the new process: it serves both
  // copies of ps 1's shards again all the same (the chief's take-back says they are whole)
  // and waits for the new process, instead of writing the other copies alone, which the
  // process taken back would then miss. The job ends bit for bit where the unbroken run ends.
  const auto expected = in_process_result();
  CopiesCluster cluster;
  RulingChief ruling(cluster);
  pulley::testing::CutProxy proxy(cluster.listeners[1]->port(), 0.0, 1);
  std::vector<std::string> behind_proxy = cluster.addresses;
  behind_proxy[1] = "127.0.0.1:" + std::to_string(proxy.port());
  std::unique_ptr<TcpServer<Copies>> restarted;
  std::thread serving, cutting;
  std::atomic<bool> started{false}, taken{false}, tried{false};
  const auto bounded_wait = [](const std::atomic<bool>& flag) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!flag && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return flag.load();
  };
  const auto with = train(
      [&](Node n) {
        if (n.role == Node::Role::kChief) return client(n, cluster.addresses, ruling.chief_options());
        TcpOptions options = ruling.worker_options(n);
        options.copy_grace = std::chrono::milliseconds(500);
        return client(n, n.index == 1 ? behind_proxy : cluster.addresses, options);
      },
      [&](std::uint32_t w, std::int64_t k) {
        if (w != 0 || k != kSteps / 4) return;
        proxy.partition(true);
        const auto port = cluster.listeners[1]->port();
        cluster.kill(1);
        restarted = std::make_unique<TcpServer<Copies>>(Copies(make_server(1), make_server(0)), "127.0.0.1", port,
                                                        test_server_options());
        serving = std::thread([&] { restarted->run(); });
        cutting = std::thread([&] {
          (void)bounded_wait(tried);
          std::this_thread::sleep_for(std::chrono::seconds(2));
          proxy.partition(false);
        });
        started = true;
      },
      [&](auto& chief) {
        bool back = false;
        if (bounded_wait(started)) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (!back && std::chrono::steady_clock::now() < deadline) {
            try {
              (void)chief.stats();  // a call to ps 1 finds it lost: its copies are given up
            } catch (const Error&) {
            }
            if (!chief.given_up().empty()) back = chief.take_back(1);
            if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }
        taken = back;
        tried = true;
      });
  REQUIRE(cutting.joinable());
  cutting.join();
  REQUIRE(taken);
  CHECK(with == expected);
  REQUIRE(restarted);
  // The process taken back took every step since, on both its shards: worker 1's pushes too.
  CHECK(restarted->service().own().stats().global_step == kSteps);
  CHECK(restarted->service().copy().stats().global_step == kSteps);
  restarted->stop();
  serving.join();
}

TEST_CASE("a copy ready at an older restore than its twin is not written to: it is dropped as a copy not ready") {
  // ps k's own copies are restored at a new epoch by a chief without copies; the copies ps
  // k + 1 holds stay at the epoch before (as a process whose take-back was given up).
  CopiesCluster cluster;
  Chief with(client(Node::chief(), cluster.addresses, with_copies()), 7);
  with.initialize(LinearModel(kIn, kOut).variables());
  const ModelState state = with.save_state();
  Chief plain(client(Node::chief(), cluster.addresses), 7);
  plain.restore(state);
  TcpOptions quick = with_copies();
  quick.copy_grace = std::chrono::milliseconds(300);
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  const auto read = [&](std::int64_t number) { return batch_of(data, number); };
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), client(Node::worker(w), cluster.addresses, quick));
      worker.wait_ready();
      CHECK(worker.step(read, kSteps));
    });
  }
  for (auto& t : workers) t.join();
  for (std::uint32_t i = 0; i < kPs; ++i) {
    CAPTURE(i);
    CHECK(cluster.listeners[i]->service().own().stats().global_step == 1);
    // Never sent a push: without the rule each refused both workers' (another epoch).
    CHECK(cluster.listeners[i]->service().copy().stats().requests_rejected == 0);
    CHECK(cluster.listeners[i]->service().copy().stats().global_step == 0);
  }
}

TEST_CASE("a client that asks a ps for a copy it does not hold is refused at the handshake") {
  std::vector<std::unique_ptr<TcpServer<Server>>> plain;
  std::vector<std::thread> threads;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < 2; ++i) {
    plain.push_back(std::make_unique<TcpServer<Server>>(
        Server(i, 2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2}), "127.0.0.1", 0, test_server_options()));
    addresses.push_back("127.0.0.1:" + std::to_string(plain.back()->port()));
  }
  for (auto& l : plain) threads.emplace_back([&l] { l->run(); });
  CHECK_THROWS_WITH_AS(client(Node::worker(0), addresses, with_copies()),
                       doctest::Contains("--ps-replicas"), Error);
  TcpOptions one_ps = with_copies();
  CHECK_THROWS_WITH_AS(client(Node::worker(0), {addresses[0]}, one_ps), doctest::Contains("at least 2 ps"), Error);
  for (auto& l : plain) l->stop();
  for (auto& t : threads) t.join();
}

TEST_CASE("a worker is ready only once both copies of every shard are: no push reaches a copy not yet initialized") {
  CopiesCluster cluster;
  // The chief's Initialize reached ps k's own copies and not yet the copies ps k + 1 holds
  // (they come on other connections, in no fixed order): a chief without copies does that.
  Chief plain(client(Node::chief(), cluster.addresses), 7);
  plain.initialize(LinearModel(kIn, kOut).variables());
  TcpOptions patient = with_copies();
  patient.copy_grace = std::chrono::minutes(2);  // no copy is dropped for being late here
  std::atomic<bool> ready{false};
  std::thread worker_thread([&] {
    Worker worker(0, LinearModel(kIn, kOut), client(Node::worker(0), cluster.addresses, patient));
    worker.wait_ready();
    ready = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK_FALSE(ready.load());  // ps k's own copies are ready; the others are not
  {
    // The same Initialize reaches the copies: ps k's own copies refuse it (initialized).
    Chief with(client(Node::chief(), cluster.addresses, with_copies()), 7);
    CHECK_THROWS_AS(with.initialize(LinearModel(kIn, kOut).variables()), Error);
  }
  worker_thread.join();  // no longer waits: both copies of every shard are ready
  CHECK(ready.load());
}

TEST_CASE("a pull answered by both copies names the step both reached, not the one the copy read from is at") {
  CopiesCluster cluster;
  Chief chief(client(Node::chief(), cluster.addresses, with_copies()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  const auto read = [&](std::int64_t number) { return batch_of(data, number); };
  // One step of both workers (R = N = 2), each over a transport of its own.
  const auto step_both = [&](const TcpOptions& options) {
    std::vector<std::thread> workers;
    for (std::uint32_t w = 0; w < 2; ++w) {
      workers.emplace_back([&, w] {
        Worker worker(w, LinearModel(kIn, kOut), client(Node::worker(w), cluster.addresses, options));
        worker.wait_ready();
        CHECK(worker.step(read, kSteps));
      });
    }
    for (auto& t : workers) t.join();
  };
  step_both(with_copies());                           // every copy completes step 0
  step_both(pulley::testing::test_client_options());  // only ps k's own copies complete step 1
  const Snapshot snapshot = chief.snapshot(1);        // a pull that waits for step 1
  CHECK(snapshot.step == 1);  // the copies ps k + 1 holds are at 1; ps k's own at 2
  for (const Stats& s : chief.stats()) CHECK(s.global_step == 2);  // (read from ps k's own)
}

TEST_CASE(
    "answers of both copies: a pull names the lower step, a pause the furthest step and the most "
    "pushes, with their last") {
  using transport_detail::merge_copy_answers;
  Response pull = PullReply{};
  std::get<PullReply>(pull).global_step = 5;
  Response twin_pull = PullReply{};
  std::get<PullReply>(twin_pull).global_step = 4;
  merge_copy_answers(pull, twin_pull);
  CHECK(std::get<PullReply>(pull).global_step == 4);

  // The copy read from is a step behind its twin: a change of workers from "the next step"
  // named by it alone would be a step the twin is in already (it would refuse the change).
  const auto pause_reply = [](std::int64_t step, std::vector<std::uint64_t> pushes, std::int64_t evictions_since) {
    PauseReply reply;
    reply.global_step = step;
    reply.epoch = 3;
    reply.pushes = std::move(pushes);
    reply.evictions_since = evictions_since;
    return reply;
  };
  Response paused = pause_reply(7, {14, 13}, 2);
  Response twin = pause_reply(8, {14, 15, 1}, 1);
  std::get<PauseReply>(twin).furthest_pushed = 9;
  // Each count goes with the last push of the copy that took it (a cut names it: with the
  // other copy's last, a ps one push short of it would not wait for that push).
  std::get<PauseReply>(paused).last_sequences = {3, 4};
  std::get<PauseReply>(paused).last_series = {1, 1};
  std::get<PauseReply>(twin).last_sequences = {8, 5, 6};
  std::get<PauseReply>(twin).last_series = {2, 1, 2};
  merge_copy_answers(paused, twin);
  CHECK(std::get<PauseReply>(paused).furthest_pushed == 9);
  const auto& merged = std::get<PauseReply>(paused);
  CHECK(merged.global_step == 8);
  CHECK(merged.pushes == std::vector<std::uint64_t>{14, 15, 1});
  CHECK(merged.last_sequences == std::vector<std::uint64_t>{3, 5, 6});  // a tie: the copy read's
  CHECK(merged.last_series == std::vector<std::uint64_t>{1, 1, 2});
  CHECK(merged.evictions_since == 2);
  CHECK(merged.epoch == 3);

  Response ack = Ack{};  // anything else stays as the copy read from answered
  merge_copy_answers(ack, twin);
  CHECK(std::holds_alternative<Ack>(ack));
}
