// SPDX-License-Identifier: MIT
// TcpRing on 127.0.0.1: the ring forms whatever order its ranks start in, sums as the
// in-process ring does (the same bits), refuses ranks without the job's secret and
// strangers (which do not hold it up), and fails a rank's neighbours when it dies; a
// TcpRingRendezvous forms it again without a lost worker and takes a newcomer in.

#include <doctest/doctest.h>

#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/all_reduce_worker.hpp"
#include "pulley/collective/ring_all_reduce.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "pulley/transport/tcp_ring.hpp"
#include "pulley/transport/tcp_ring_rendezvous.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/tcp.hpp"
#include "support/wait.hpp"

using namespace pulley;
using pulley::testing::free_addresses;

namespace {

/// Runs `body(rank)` on one thread per rank; returns each rank's exception text, "" if none.
std::vector<std::string> on_ranks(std::size_t n, const std::function<void(std::size_t)>& body) {
  std::vector<std::string> failures(n);
  std::vector<std::jthread> threads;
  for (std::size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      } catch (...) {  // a REQUIRE that failed on this thread
        failures[r] = "a check failed on rank " + std::to_string(r);
      }
    });
  }
  threads.clear();
  return failures;
}

float value(std::size_t rank, std::size_t i) {
  return static_cast<float>((rank * 7919 + i * 104729) % 1000) / 37.0F - 13.0F;
}

TcpRingOptions quick() {
  TcpRingOptions o;
  o.form_timeout = std::chrono::seconds(20);
  o.timeout = std::chrono::seconds(10);
  return o;
}

/// Calls `attempt` until it returns true (it reached a rank, which may not listen yet), for
/// up to 5 s, then sets `done`: a stranger goes first, and rank 0 waits for it
/// (`wait_for`), however late a loaded host starts rank 1. (A rank accepts its previous
/// rank's connection once it has reached its next rank: strangers that connected before
/// rank 0 started are accepted before it.)
void as_stranger(const std::function<bool()>& attempt, std::atomic<bool>& done) {
  (void)testing::wait_until(attempt, std::chrono::seconds(5));
  done = true;
}

/// Waits until `done`, for up to 6 s.
void wait_for(const std::atomic<bool>& done) {
  (void)testing::wait_until([&] { return done.load(); }, std::chrono::seconds(6));
}

}  // namespace

TEST_CASE("a TCP ring sums as the in-process ring does, bit for bit, whatever order its ranks start in") {
  for (std::size_t ranks : {2U, 3U, 4U}) {
    CAPTURE(ranks);
    constexpr std::size_t kN = (1U << 18U) + 3;  // segments, uneven chunks
    const auto addresses = free_addresses(ranks);
    std::vector<std::vector<float>> tcp(ranks, std::vector<float>(kN));
    std::vector<std::vector<float>> local(ranks, std::vector<float>(kN));
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t i = 0; i < kN; ++i) tcp[r][i] = local[r][i] = value(r, i);
    }
    const auto failures = on_ranks(ranks, [&](std::size_t r) {
      // The last rank starts 300 ms late: the others wait for it.
      if (r + 1 == ranks) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      TcpRing link(r, addresses, testing::test_credentials(), quick());
      CHECK(link.rank() == r);
      CHECK(link.size() == ranks);
      RingAllReduce reduce(4096);
      for (int repeat = 0; repeat < 3; ++repeat) reduce.sum(link, std::span<float>(tcp[r]).first(1000));
      // Each link carries more than a shared ring holds, at offsets no float aligns to its end.
      for (int repeat = 0; repeat < 4; ++repeat) reduce.sum(link, tcp[r]);
    });
    for (const std::string& f : failures) CHECK(f == "");
    auto in_process = InProcessRing::make(ranks);
    std::vector<std::jthread> threads;
    for (std::size_t r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        RingAllReduce reduce(4096);
        for (int repeat = 0; repeat < 3; ++repeat) reduce.sum(in_process[r], std::span<float>(local[r]).first(1000));
        for (int repeat = 0; repeat < 4; ++repeat) reduce.sum(in_process[r], local[r]);
      });
    }
    threads.clear();
    for (std::size_t r = 0; r < ranks; ++r) {
      CHECK(std::memcmp(tcp[r].data(), local[0].data(), kN * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("a rank without the job's secret is refused, and its neighbour names the reason") {
  testing::LogCapture log;
  const auto addresses = free_addresses(2);
  std::vector<ErrorCode> codes(2, ErrorCode::kInternal);
  const auto failures = on_ranks(2, [&](std::size_t r) {
    Credentials credentials = testing::test_credentials();
    if (r == 1) credentials.secret = "a guess";
    TcpRingOptions o = quick();
    o.form_timeout = std::chrono::seconds(3);
    try {
      TcpRing link(r, addresses, credentials, o);
    } catch (const Error& e) {
      codes[r] = e.code();
      throw;
    }
  });
  // Each rank refuses the other's hello (or sees its proof fail): neither forms a ring.
  CHECK(failures[0] != "");
  CHECK(failures[1] != "");
  CHECK(codes[1] == ErrorCode::kUnauthenticated);
  CHECK(!log.find(LogLevel::kWarning, "did not prove the job's shared secret").empty());
}

TEST_CASE("a stranger that connects first is refused and the ring forms around it") {
  testing::LogCapture log;
  const auto addresses = free_addresses(2);
  std::atomic<bool> connected{false};
  std::jthread stranger([&] {
    // Connects to rank 1 before rank 0 does (rank 1 accepts once it reached rank 0, the
    // stranger first) and answers the challenge as another job.
    const auto port = static_cast<std::uint16_t>(std::stoi(addresses[1].substr(10)));
    std::optional<testing::RawClient> raw;
    as_stranger(
        [&] {
          raw.emplace();
          try {
            raw->connect(port);
            return true;
          } catch (...) {
            return false;  // rank 1 does not listen yet
          }
        },
        connected);
    try {
      (void)raw->handshake(Node::worker(0), Credentials{"another-job", "x"});
    } catch (...) {
    }
  });
  std::vector<std::vector<float>> data(2, std::vector<float>(100, 1.0F));
  const auto failures = on_ranks(2, [&](std::size_t r) {
    if (r == 0) wait_for(connected);
    TcpRingOptions o = quick();
    o.local_sockets = false;  // (rank 0 would come in on the local socket, ahead of the stranger)
    TcpRing link(r, addresses, testing::test_credentials(), o);
    RingAllReduce().sum(link, data[r]);
  });
  for (const std::string& f : failures) CHECK(f == "");
  CHECK(data[0] == std::vector<float>(100, 2.0F));
  CHECK(data[1] == data[0]);
  CHECK(!log.find(LogLevel::kWarning, "another-job").empty());
}

TEST_CASE("strangers that hang up, or send what is no handshake, are dropped and the ring forms") {
  testing::LogCapture log;
  const auto addresses = free_addresses(2);
  const auto port = static_cast<std::uint16_t>(std::stoi(addresses[1].substr(10)));
  std::atomic<bool> queued{false};  // every stranger reached rank 1
  std::jthread strangers([&] {
    const auto probe = [&] {  // a port probe: connect, close
      testing::RawClient raw;
      try {
        raw.connect(port);
        return true;
      } catch (...) {
        return false;  // rank 1 does not listen yet
      }
    };
    std::atomic<bool> listening{false};
    as_stranger(probe, listening);
    for (int i = 0; i < 2; ++i) (void)probe();
    testing::RawClient talker;  // answers the challenge with bytes of another protocol
    try {
      talker.connect(port);
      asio::write(talker.socket, asio::buffer(std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n")));
    } catch (...) {
    }
    queued = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  std::vector<std::vector<float>> data(2, std::vector<float>(10, 1.0F));
  const auto failures = on_ranks(2, [&](std::size_t r) {
    if (r == 0) wait_for(queued);
    TcpRingOptions o = quick();
    o.local_sockets = false;
    TcpRing link(r, addresses, testing::test_credentials(), o);
    RingAllReduce().sum(link, data[r]);
  });
  for (const std::string& f : failures) CHECK(f == "");
  CHECK(data[1] == std::vector<float>(10, 2.0F));
  CHECK(!log.find(LogLevel::kWarning, "dropped a connection").empty());
}

TEST_CASE("ranks on one host link through shared memory over local sockets, which strangers cannot pass either, or through the sockets or TCP when told to") {
  struct Mode {
    bool local;
    bool shared;
    bool rank_1_shares;  // a rank set apart: the links share memory only where both ends do
  };
  for (const auto [local, shared, rank_1_shares] :
       {Mode{true, true, true}, Mode{true, true, false}, Mode{true, false, false}, Mode{false, false, false}}) {
    CAPTURE(local);
    CAPTURE(shared);
    CAPTURE(rank_1_shares);
    testing::LogCapture log;
    const auto addresses = free_addresses(3);
    std::atomic<bool> spoke{false};
    std::jthread stranger([&] {
      // Before rank 0 is up, something of this host reaches rank 1's local socket (none
      // listens when local sockets are off) and speaks another protocol there.
      asio::io_context io;
      asio::local::stream_protocol::socket socket(io);
      as_stranger(
          [&] {
            asio::error_code ec;
            socket.close(ec);
            socket.connect(asio::local::stream_protocol::endpoint(transport_detail::ring_socket_name(addresses[1])),
                           ec);
            if (ec) return !local;
            asio::write(socket, asio::buffer(std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n")), ec);
            return true;
          },
          spoke);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
    std::vector<std::vector<float>> data(3, std::vector<float>(1000, 1.0F));
    std::vector<int> linked_locally(3, -1);
    std::vector<int> linked_shared(3, -1);
    std::vector<int> shares_with_next(3, -1);
    const auto failures = on_ranks(3, [&](std::size_t r) {
      if (r == 0) wait_for(spoke);
      TcpRingOptions o = quick();
      o.local_sockets = local;
      o.shared_memory = r == 1 ? rank_1_shares : shared;
      TcpRing link(r, addresses, testing::test_credentials(), o);
      RingAllReduce().sum(link, data[r]);
      linked_locally[r] = link.local() ? 1 : 0;
      linked_shared[r] = link.shared() ? 1 : 0;
      shares_with_next[r] = link.shares_with_next() ? 1 : 0;
    });
    for (const std::string& f : failures) CHECK(f == "");
    for (std::size_t r = 0; r < 3; ++r) {
      CHECK(data[r] == std::vector<float>(1000, 3.0F));
      CHECK(linked_locally[r] == (local ? 1 : 0));
      CHECK(linked_shared[r] == (local && shared && rank_1_shares && transport_detail::kSharedRings ? 1 : 0));
      // Rank r's link to the next shares when both ends of it would.
      const bool ends_share = shared && (r == 1 || r == 0 ? rank_1_shares : true);
      CHECK(shares_with_next[r] == (local && ends_share && transport_detail::kSharedRings ? 1 : 0));
    }
    CHECK(log.find(LogLevel::kWarning, "dropped a connection").empty() == !local);
  }
}

TEST_CASE("a chunk larger than a shared ring waits for room and arrives whole") {
  // 2 ranks, 24 MiB: each chunk of 12 MiB is three rings' worth, so each writer fills its
  // ring and sleeps until the reader makes room, while reading its own previous rank.
  const auto addresses = free_addresses(2);
  constexpr std::size_t kN = (std::size_t{6} << 20U) + 5;
  std::vector<std::vector<float>> data(2, std::vector<float>(kN));
  for (std::size_t r = 0; r < 2; ++r) {
    for (std::size_t i = 0; i < kN; ++i) data[r][i] = value(r, i);
  }
  std::vector<float> expected(kN);
  // Two terms add alike in either order; the second sum doubles the first's, exactly.
  for (std::size_t i = 0; i < kN; ++i) expected[i] = 2.0F * (value(0, i) + value(1, i));
  std::vector<int> shared(2, -1);
  const auto failures = on_ranks(2, [&](std::size_t r) {
    TcpRing link(r, addresses, testing::test_credentials(), quick());
    shared[r] = link.shared() ? 1 : 0;
    RingAllReduce(std::size_t{1} << 22U).sum(link, data[r]);  // segments of 16 MiB: whole chunks
    RingAllReduce().sum(link, data[r]);                        // and again in small segments
  });
  for (const std::string& f : failures) CHECK(f == "");
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(shared[r] == (transport_detail::kSharedRings ? 1 : 0));
    CHECK(std::memcmp(data[r].data(), expected.data(), kN * sizeof(float)) == 0);
  }
}

TEST_CASE("a ring without a secret is refused unless asked for") {
  const auto addresses = free_addresses(1);
  CHECK_THROWS_WITH_AS(TcpRing(0, addresses, Credentials{"job", ""}), doctest::Contains("no shared secret"), Error);
  TcpRingOptions o;
  o.allow_no_secret = true;
  TcpRing alone(0, addresses, Credentials{"job", ""}, o);
  CHECK(alone.size() == 1);
}

TEST_CASE("a rank that dies mid-ring fails its neighbours with kUnavailable, naming it") {
  const auto addresses = free_addresses(3);
  std::vector<ErrorCode> codes(3, ErrorCode::kInternal);
  std::vector<float> big(1U << 20U, 1.0F);
  const auto failures = on_ranks(3, [&](std::size_t r) {
    std::vector<float> data = big;
    TcpRing link(r, addresses, testing::test_credentials(), quick());
    RingAllReduce reduce;
    reduce.sum(link, data);  // one whole call
    if (r == 1) return;      // then rank 1's sockets close, as a killed process's do
    try {
      for (int i = 0; i < 3; ++i) reduce.sum(link, data);
    } catch (const Error& e) {
      codes[r] = e.code();
      throw;
    }
  });
  CHECK(codes[0] == ErrorCode::kUnavailable);
  CHECK(codes[2] == ErrorCode::kUnavailable);
  // Whoever finds rank 1 gone first names it and closes its own sockets as its thread ends,
  // so the other may find that one gone instead: the failure spreads without a timeout.
  const auto names = [&](std::size_t r, const char* who) { return failures[r].find(who) != std::string::npos; };
  CHECK((names(0, "rank 1") || names(2, "rank 1")));
}

TEST_CASE("a stopped rank is given up after the ring's timeout") {
  const auto addresses = free_addresses(2);
  std::vector<float> data(10, 1.0F);
  std::vector<std::string> failures(2);
  TcpRingOptions o = quick();
  o.timeout = std::chrono::milliseconds(300);
  std::jthread quiet([&] {
    TcpRing link(1, addresses, testing::test_credentials(), o);
    std::this_thread::sleep_for(std::chrono::seconds(2));  // holds its sockets, sends nothing
  });
  TcpRing link(0, addresses, testing::test_credentials(), o);
  try {
    RingAllReduce().sum(link, data);
    FAIL("the sum returned without rank 1");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kDeadlineExceeded);
    CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
  }
}

TEST_CASE("AllReduceWorker replicas over TCP stay bit-identical") {
  const auto addresses = free_addresses(3);
  std::vector<std::vector<float>> out(3);
  const auto failures = on_ranks(3, [&](std::size_t r) {
    AllReduceWorker worker(testing::LinearModel(3, 2), Adam{0.01F},
                           TcpRing(r, addresses, testing::test_credentials(), quick()));
    worker.initialize(3);
    std::vector<float> x(12), y(8);
    for (std::size_t s = 0; s < 100; ++s) {
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(r + s, i) / 10.0F;
      for (std::size_t i = 0; i < y.size(); ++i) y[i] = value(s, i) / 10.0F;
      REQUIRE(worker.step({x, y}).applied);
    }
    for (std::size_t v = 0; v < 2; ++v) {
      const auto p = worker.model().parameter(v);
      out[r].insert(out[r].end(), p.begin(), p.end());
    }
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  CHECK(out[1] == out[0]);
  CHECK(out[2] == out[0]);
}

TEST_CASE("a ring rank pointed at a ps by mistake is refused by the ps, and says so") {
  testing::LogCapture log;
  using Server = ParameterServer<RoundRobin, Sgd, Async>;
  TcpServerOptions serving = testing::test_server_options();
  TcpServer<Server> ps(Server(1, 2, Sgd{0.1F}, Async{}), "127.0.0.1", 0, serving);  // ps 1, as rank 1
  std::jthread serving_thread([&] { ps.run(); });
  auto addresses = free_addresses(1);
  addresses.push_back("127.0.0.1:" + std::to_string(ps.port()));  // rank 1 "is" the ps
  TcpRingOptions o = quick();
  o.form_timeout = std::chrono::seconds(3);
  try {
    TcpRing link(0, addresses, testing::test_credentials(), o);
    FAIL("a ring formed with a ps");
  } catch (const Error& e) {
    INFO(std::string(e.what()));
    CHECK(e.code() == ErrorCode::kUnauthenticated);
    CHECK(std::string(e.what()).find("connected as a ring's worker") != std::string::npos);
  }
  CHECK(log.wait_for(LogLevel::kWarning, "connected as a ring's worker"));
  ps.stop();
}

namespace {

/// Steps `worker` `steps` times on rank-dependent batches, serving check-ins at each step
/// boundary; returns the first step that voted to regroup, or -1.
template <class W>
std::int64_t run_steps(W& worker, TcpRingRendezvous& rendezvous, const RingView& view, int steps) {
  std::vector<float> x(12), y(8);
  for (int s = 0; s < steps; ++s) {
    const auto step = static_cast<std::size_t>(worker.global_step());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(worker.rank() + step, i) / 10.0F;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = value(step, i) / 10.0F;
    const bool vote = rendezvous.serve(view);
    if (worker.step({x, y}, vote).regroup) return worker.global_step();
  }
  return -1;
}

using LinearWorker = AllReduceWorker<testing::LinearModel, Adam, TcpRing>;

std::vector<float> parameters_of(LinearWorker& worker) {
  std::vector<float> out;
  for (std::size_t v = 0; v < 2; ++v) {
    const auto p = worker.model().parameter(v);
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

}  // namespace

TEST_CASE("a rendezvous forms the ring again without a lost worker, from the replica furthest on") {
  const auto addresses = free_addresses(3);
  std::vector<RingView> views(3);
  std::vector<std::vector<float>> out(3);
  std::vector<std::int64_t> steps(3);
  const auto failures = on_ranks(3, [&](std::size_t r) {
    TcpRingRendezvous rendezvous(addresses[r], testing::test_credentials(), quick());
    RingView view = TcpRingRendezvous::first(static_cast<std::uint32_t>(r), addresses);
    TcpRing first = rendezvous.form(view);
    CHECK(first.local());  // workers on one host: through the rendezvous' local sockets
    LinearWorker worker(testing::LinearModel(3, 2), Adam{0.01F}, std::move(first));
    worker.initialize(3);
    REQUIRE(run_steps(worker, rendezvous, view, 20) == -1);
    if (r == 1) return;  // worker 1 is lost: its listeners and links close, as a killed process's do
    try {
      run_steps(worker, rendezvous, view, 1);
      FAIL("a step went through without worker 1");
    } catch (const Error& e) {
      CHECK((e.code() == ErrorCode::kUnavailable || e.code() == ErrorCode::kDeadlineExceeded));
    }
    view = rendezvous.regroup(view, RingProgress{worker.global_step(), worker.global_step() * 3});
    views[r] = view;
    worker.reform(rendezvous.form(view));
    worker.synchronize(view.source);
    REQUIRE(run_steps(worker, rendezvous, view, 10) == -1);
    out[r] = parameters_of(worker);
    steps[r] = worker.global_step();
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  for (const std::size_t r : {0U, 2U}) {
    CAPTURE(r);
    CHECK(views[r].generation == 1);
    CHECK(views[r].addresses == std::vector<std::string>{addresses[0], addresses[2]});
    CHECK(views[r].incarnations.size() == 2);
    CHECK(views[r].step == 20);
    CHECK(views[r].batches == 60);
    CHECK(steps[r] == 30);
  }
  CHECK(views[0].rank == 0);
  CHECK(views[2].rank == 1);
  CHECK(out[0] == out[2]);
}

TEST_CASE("a rendezvous copies the replica of the member furthest on, and a lost rank 0's place is taken") {
  // Worker 0 is lost; worker 1 coordinates. Worker 2 says it is a step further on (it
  // finished a step the others did not): the view starts every rank from its replica.
  const auto addresses = free_addresses(3);
  std::vector<RingView> views(3);
  std::vector<std::vector<float>> out(3);
  std::vector<float> furthest;
  const auto failures = on_ranks(3, [&](std::size_t r) {
    TcpRingRendezvous rendezvous(addresses[r], testing::test_credentials(), quick());
    RingView view = TcpRingRendezvous::first(static_cast<std::uint32_t>(r), addresses);
    LinearWorker worker(testing::LinearModel(3, 2), Adam{0.01F}, rendezvous.form(view));
    worker.initialize(3);
    REQUIRE(run_steps(worker, rendezvous, view, 5) == -1);
    if (r == 0) return;
    CHECK_THROWS_AS(run_steps(worker, rendezvous, view, 1), Error);
    if (r == 2) {  // its replica differs from worker 1's, as one a step further on would
      worker.model().parameter(0)[0] += 1.0F;
      furthest = parameters_of(worker);
    }
    const std::int64_t step = worker.global_step() + (r == 2 ? 1 : 0);
    view = rendezvous.regroup(view, RingProgress{step, step * 3});
    views[r] = view;
    worker.reform(rendezvous.form(view));
    worker.synchronize(view.source);
    out[r] = parameters_of(worker);
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  CHECK(views[1].addresses == std::vector<std::string>{addresses[1], addresses[2]});
  CHECK(views[1].rank == 0);
  CHECK(views[2].rank == 1);
  CHECK(views[1].source == 1);  // worker 2, now rank 1
  CHECK(views[1].step == 6);
  CHECK(views[2].step == 6);
  CHECK(out[1] == furthest);
  CHECK(out[2] == furthest);
}

TEST_CASE("a newcomer checks in, is taken in at a step boundary, and copies the replica") {
  const auto addresses = free_addresses(3);
  const std::vector<std::string> members{addresses[0], addresses[1]};
  std::vector<RingView> views(3);
  std::vector<std::vector<float>> out(3);
  std::vector<std::int64_t> voted(3, -2);
  std::atomic<bool> joining{false};
  const auto failures = on_ranks(3, [&](std::size_t r) {
    TcpRingRendezvous rendezvous(addresses[r], testing::test_credentials(), quick());
    RingView view;
    std::optional<LinearWorker> worker;
    if (r == 2) {
      for (int i = 0; i < 2000 && !joining; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      REQUIRE(joining);
      view = rendezvous.join(members);
      worker.emplace(testing::LinearModel(3, 2), Adam{0.01F}, rendezvous.form(view));
    } else {
      view = TcpRingRendezvous::first(static_cast<std::uint32_t>(r), members);
      worker.emplace(testing::LinearModel(3, 2), Adam{0.01F}, rendezvous.form(view));
      worker->initialize(3);
      REQUIRE(run_steps(*worker, rendezvous, view, 10) == -1);
      joining = true;
      // Steps until the vote comes (the newcomer's check-in reached rank 0), 30 s at most.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (voted[r] < 0 && std::chrono::steady_clock::now() < until) voted[r] = run_steps(*worker, rendezvous, view, 20);
      view = rendezvous.regroup(view, RingProgress{worker->global_step(), 0});
      worker->reform(rendezvous.form(view));
    }
    views[r] = view;
    worker->synchronize(view.source);
    REQUIRE(run_steps(*worker, rendezvous, view, 5) == -1);
    out[r] = parameters_of(*worker);
  });
  for (const std::string& f : failures) REQUIRE(f == "");
  CHECK(voted[0] > 10);
  CHECK(voted[0] == voted[1]);  // every rank saw the vote after the same step
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(views[r].generation == 1);
    CHECK(views[r].rank == r);
    CHECK(views[r].addresses == addresses);
    CHECK(views[r].step == voted[0]);
  }
  CHECK(out[1] == out[0]);
  CHECK(out[2] == out[0]);
}

TEST_CASE("a newcomer without the job's secret is refused at its check-in") {
  const auto addresses = free_addresses(2);
  testing::LogCapture log;
  std::atomic<bool> done{false};
  std::jthread member([&] {
    TcpRingRendezvous rendezvous(addresses[0], testing::test_credentials(), quick());
    const RingView view = TcpRingRendezvous::first(0, {addresses[0]});
    while (!done) {
      CHECK(!rendezvous.serve(view));  // the stranger is never held for a regroup
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  Credentials guess = testing::test_credentials();
  guess.secret = "a guess";
  TcpRingRendezvous stranger(addresses[1], guess, quick());
  try {
    (void)stranger.join({addresses[0]});
    FAIL("a newcomer without the secret was taken in");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnauthenticated);
  }
  done = true;
  CHECK(log.wait_for(LogLevel::kWarning, "did not prove the job's shared secret"));
}

TEST_CASE("a worker that reaches half the ring without its lowest forms no ring of its own") {
  // A worker that listens and never answers is one stopped, or cut off by a partition: the
  // side without a quorum waits for the other instead of training on its own beside it.
  testing::LogCapture log;
  const auto addresses = free_addresses(2);
  TcpRingOptions o = quick();
  o.timeout = std::chrono::milliseconds(300);
  o.form_timeout = std::chrono::seconds(2);
  {
    TcpRingRendezvous silent(addresses[0], testing::test_credentials(), o);
    TcpRingRendezvous one(addresses[1], testing::test_credentials(), o);
    try {
      (void)one.regroup(TcpRingRendezvous::first(1, addresses), RingProgress{5, 10});
      FAIL("worker 1 formed a ring of its own");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kDeadlineExceeded);
    }
    CHECK(!log.find(LogLevel::kWarning, "no quorum").empty());
  }
  {
    TcpRingRendezvous zero(addresses[0], testing::test_credentials(), o);
    TcpRingRendezvous silent(addresses[1], testing::test_credentials(), o);
    const RingView view = zero.regroup(TcpRingRendezvous::first(0, addresses), RingProgress{5, 10});
    CHECK(view.generation == 1);
    CHECK(view.addresses == std::vector<std::string>{addresses[0]});
    CHECK(view.step == 5);
    CHECK(view.batches == 10);
  }
}
