// SPDX-License-Identifier: MIT
// The TCP transport on 127.0.0.1: training over TCP gives the in-process result exactly;
// a ps that starts late is waited for; an unreachable one is named; a client sending
// garbage is cut off while real clients keep working.
#include "pulley/transport/tcp.hpp"

#include <doctest/doctest.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/in_process.hpp"
#include "support/cut_proxy.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/tcp.hpp"
#include "support/wait.hpp"

using namespace pulley;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using pulley::testing::RawClient;
using pulley::testing::client;
using pulley::testing::test_client_options;
using pulley::testing::test_server_options;
using Server = ParameterServer<FixedShards, Sgd, SyncReplicas>;

namespace {

constexpr std::size_t kIn = 5, kOut = 3, kBatch = 4;
constexpr std::int64_t kSteps = 40;

Server make_server(std::uint32_t task) {
  return Server(task, 2, Sgd{0.1F}, SyncReplicas(2, 2), FixedShards{2});
}

/// Two ps tasks served over TCP on ephemeral ports of 127.0.0.1.
struct TcpCluster {
  std::vector<std::unique_ptr<TcpServer<Server>>> listeners;
  std::vector<std::thread> threads;
  std::vector<std::string> addresses;

  TcpCluster() {
    for (std::uint32_t i = 0; i < 2; ++i) {
      listeners.push_back(
          std::make_unique<TcpServer<Server>>(make_server(i), "127.0.0.1", 0, test_server_options()));
      addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
    }
    for (auto& l : listeners) threads.emplace_back([&l] { l->run(); });
  }
  ~TcpCluster() {
    for (auto& l : listeners) l->stop();  // no-op after a Shutdown
    for (auto& t : threads) t.join();
  }
};

// Sync R = N = 2 training of a linear model; returns the final variables (and the ps
// tasks' counters in `stats`, if given).
template <class MakeTransport>
std::vector<std::vector<float>> train(MakeTransport make_transport, std::vector<Stats>* stats = nullptr) {
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  Chief chief(make_transport(Node::chief()), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), make_transport(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = 0;; ++k) {
        const std::size_t row = static_cast<std::size_t>(((k % kSteps) * 2 + w) * kBatch);
        const LinearBatch batch{std::span(data.x).subspan(row * kIn, kBatch * kIn),
                                std::span(data.y).subspan(row * kOut, kBatch * kOut)};
        if (!worker.step(batch, kSteps)) break;
      }
    });
  }
  for (auto& t : workers) t.join();
  auto values = chief.read_variables();
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kSteps);
  if (stats != nullptr) *stats = chief.stats();
  chief.shutdown();
  return values;
}

}  // namespace

TEST_CASE("sync training over TCP gives exactly the in-process result") {
  std::vector<std::vector<float>> in_process;
  {
    InProcessNetwork network(2);
    for (std::uint32_t i = 0; i < 2; ++i) network.serve(make_server(i));
    in_process = train([&](Node n) { return InProcess(network, n); });
  }
  TcpCluster cluster;
  const auto over_tcp = train([&](Node n) { return client(n, cluster.addresses); });
  // With R = 2 the accumulated sum is a + b either way round, so the results are identical.
  CHECK(over_tcp == in_process);
}

TEST_CASE("sync training over TCP whose connections break as answers come back gives the in-process result") {
  std::vector<std::vector<float>> in_process;
  {
    InProcessNetwork network(2);
    for (std::uint32_t i = 0; i < 2; ++i) network.serve(make_server(i));
    in_process = train([&](Node n) { return InProcess(network, n); });
  }
  TcpCluster cluster;
  // The workers reach each ps through a proxy that drops 1 in 20 of the ps's answers with
  // the connection (after the request took effect); the chief goes straight.
  std::vector<std::unique_ptr<pulley::testing::CutProxy>> proxies;
  std::vector<std::string> cut;
  for (std::uint32_t ps = 0; ps < 2; ++ps) {
    proxies.push_back(std::make_unique<pulley::testing::CutProxy>(cluster.listeners[ps]->port(), 0.05, 7 + ps));
    cut.push_back("127.0.0.1:" + std::to_string(proxies.back()->port()));
  }
  std::vector<Stats> stats;
  const auto over_tcp = train(
      [&](Node n) { return client(n, n.role == Node::Role::kWorker ? cut : cluster.addresses); }, &stats);
  int cuts = 0;
  for (const auto& p : proxies) cuts += p->cuts();
  std::int64_t repeated = 0;
  for (const Stats& s : stats) repeated += s.pushes_repeated;
  MESSAGE(cuts << " connections cut, " << repeated << " pushes sent again");
  CHECK(cuts > 0);
  CHECK(repeated > 0);  // pushes whose answer was lost came again, and were counted once
  CHECK(over_tcp == in_process);
}

TEST_CASE("a client waits for a ps that starts late, and names one that never comes") {
  auto listener =
      std::make_unique<TcpServer<Server>>(make_server(0), "127.0.0.1", 0, test_server_options());
  const std::string address = "127.0.0.1:" + std::to_string(listener->port());
  listener.reset();  // nobody listens yet; the port is free again
  std::unique_ptr<TcpServer<Server>> late;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto port = static_cast<std::uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
    late = std::make_unique<TcpServer<Server>>(make_server(0), "127.0.0.1", port,
                                               test_server_options());
    late->run();
  });
  TcpOptions patient;
  patient.connect_timeout = std::chrono::seconds(20);
  {
    Tcp tcp = client(Node::chief(), {address}, patient);  // blocks until the ps is up
    auto stats = tcp.call(0, GetStats{});
    REQUIRE(stats.wait_for(std::chrono::seconds(20)));
    CHECK(std::holds_alternative<StatsReply>(stats.get()));
    auto bye = tcp.call(0, Shutdown{});
    CHECK(std::holds_alternative<Ack>(bye.get()));
  }
  starter.join();

  TcpOptions impatient;
  impatient.connect_timeout = std::chrono::milliseconds(200);
  try {
    Tcp tcp = client(Node::chief(), {address}, impatient);
    FAIL("connected to nothing");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.what()).find(address) != std::string::npos);
  }
}

TEST_CASE("garbage, a 2^40-byte frame and a wrong version are cut off while others keep working") {
  TcpCluster cluster;
  Chief chief(client(Node::chief(), cluster.addresses), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  const auto port = static_cast<std::uint16_t>(cluster.listeners[0]->port());
  // Two workers train 400 steps meanwhile; the garbage arrives once they are under way.
  constexpr std::int64_t kLong = 400;
  const LinearData data(kBatch, kIn, kOut, 3);
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), client(Node::worker(w), cluster.addresses));
      worker.wait_ready();
      while (worker.step({data.x, data.y}, kLong)) {
      }
    });
  }
  CHECK(chief.wait_for_step(10) >= 10);

  auto send_raw = [&](const void* bytes, std::size_t size) {
    asio::io_context io;
    asio::ip::tcp::socket socket(io);
    socket.connect({asio::ip::make_address("127.0.0.1"), port});
    asio::write(socket, asio::buffer(bytes, size));
    // The ps must close the connection: reading (its challenge, then nothing) ends in EOF
    // instead of hanging.
    std::array<char, 64> reply{};
    std::error_code ec;
    while (!ec) socket.read_some(asio::buffer(reply), ec);
    // EOF, or a reset when the ps closed with our bytes still unread: cut off either way.
    return ec == asio::error::eof || ec == asio::error::connection_reset;
  };
  const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n...............";
  CHECK(send_raw(http.data(), http.size()));
  wire::Header huge;
  huge.kind = 5;  // Push
  huge.payload_bytes = std::uint64_t{1} << 40U;
  CHECK(send_raw(&huge, sizeof huge));
  wire::Header future_version;
  future_version.version = 99;
  CHECK(send_raw(&future_version, sizeof future_version));
  wire::Header lying;  // a Push whose metadata is garbage
  lying.kind = 5;
  lying.meta_bytes = 8;
  const std::array<char, 40> bytes = [&] {
    std::array<char, 40> b{};
    std::memcpy(b.data(), &lying, sizeof lying);
    std::memset(b.data() + 32, 0x7f, 8);
    return b;
  }();
  CHECK(send_raw(bytes.data(), bytes.size()));

  // The real clients were never disturbed: training ran to its end.
  CHECK(chief.wait_for_step(kLong) >= kLong);
  for (auto& t : workers) t.join();
  const auto stats = chief.stats();
  CHECK(stats.size() == 2);
  CHECK(stats.at(1).global_step == kLong);
  CHECK(chief.read_variables().size() == 2);
  chief.shutdown();
}

namespace {

using AsyncServer = ParameterServer<FixedShards, Sgd, Async>;

/// The number the next file descriptor of this process would get (the lowest free one).
rlim_t lowest_free_descriptor() {
  const int fd = dup(0);
  close(fd);
  return static_cast<rlim_t>(fd);
}

}  // namespace

TEST_CASE("a ps stops reading a client that does not read its replies, and loses none of them") {
  TcpServerOptions options = test_server_options();
  options.max_unsent_bytes = 2U << 20U;
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, options);
  std::thread serving([&] { listener.run(); });
  const std::string address = "127.0.0.1:" + std::to_string(listener.port());
  constexpr std::size_t kFloats = (1U << 20U) / sizeof(float);  // 1 MiB per reply
  Chief chief(client(Node::chief(), {address}), 1);
  chief.initialize(std::vector<VariableSpec>{{"blob", {kFloats}, Initializer::constant(2.0F)}});

  // A ramp gradient makes every parameter different: w[i] = 2 - 0.1 i.
  RawClient greedy;
  REQUIRE(greedy.join(listener.port(), Node::worker(0)).empty());
  std::vector<float> ramp(kFloats), expected(kFloats, 2.0F);
  for (std::size_t i = 0; i < kFloats; ++i) {
    ramp[i] = static_cast<float>(i);
    expected[i] -= 0.1F * ramp[i];
  }
  greedy.send(Push{0, 0, {{0, ramp}}}, 1000);
  std::vector<char> body;
  REQUIRE(greedy.receive(body).call == 1000);

  constexpr std::uint64_t kPulls = 64;
  for (std::uint64_t call = 1; call <= kPulls; ++call) {
    greedy.send(Pull{0, {{0, {0, kFloats}}}}, call);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The chief is still served, and the ps answered only what fits the limit plus what the
  // kernel's socket buffers took (a few MiB), not all 64 MiB.
  const std::int64_t answered = chief.stats().at(0).bytes_pulled;
  CHECK(answered > 0);
  CHECK(answered < std::int64_t{kPulls / 2} << 20U);

  // Once the client reads, every reply arrives, in order, byte for byte: the part the
  // kernel took at once and the part the ps kept for later join up exactly.
  std::vector<float> values(kFloats);
  for (std::uint64_t call = 1; call <= kPulls; ++call) {
    const wire::Header header = greedy.receive(body);
    REQUIRE(header.call == call);
    REQUIRE(header.payload_bytes == kFloats * sizeof(float));
    std::memcpy(values.data(), body.data() + wire::head_bytes(header) - sizeof header,
                header.payload_bytes);
    REQUIRE(values == expected);
  }
  CHECK(chief.stats().at(0).bytes_pulled == std::int64_t{kPulls} << 20U);
  chief.shutdown();
  serving.join();
}

TEST_CASE("a ps that ran out of file descriptors accepts again once one is free") {
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0,
                     test_server_options());
  std::thread serving([&] { listener.run(); });
  const asio::ip::tcp::endpoint endpoint{asio::ip::make_address("127.0.0.1"), listener.port()};
  RawClient first, second;
  first.socket.open(asio::ip::tcp::v4());
  second.socket.open(asio::ip::tcp::v4());

  // Room for exactly one more descriptor in this process: the ps's socket for `first`
  // (a process may open descriptors numbered below its limit only).
  rlimit saved{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
  rlimit tight = saved;
  tight.rlim_cur = lowest_free_descriptor() + 1;
  REQUIRE(setrlimit(RLIMIT_NOFILE, &tight) == 0);
  std::vector<char> body;
  const bool first_joined = first.join(listener.port(), Node::chief()).empty();
  first.send(GetStats{}, 1);
  const bool first_served = first.receive(body).call == 1;
  second.socket.connect(endpoint);  // the kernel completes it; the ps's accept fails (EMFILE)
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  first.socket.close();  // the ps sees EOF and frees its descriptor
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
  CHECK(first_joined);
  CHECK(first_served);

  // The ps accepts `second` now: its handshake completes and it is served.
  REQUIRE(second.handshake(Node::chief()).empty());
  second.send(GetStats{}, 2);
  CHECK(second.receive(body).call == 2);
  second.send(Shutdown{}, 3);
  CHECK(second.receive(body).call == 3);
  serving.join();
}

TEST_CASE("a ps listens on a host name, and a port in use is a clear error") {
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "localhost", 0,
                     test_server_options());
  std::thread serving([&] { listener.run(); });
  const std::string address = "localhost:" + std::to_string(listener.port());
  try {
    TcpServer<AsyncServer> twin(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}),
                                "127.0.0.1", listener.port());
    FAIL("bound a port in use");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.what()).find(std::to_string(listener.port())) != std::string::npos);
  }
  Tcp tcp = client(Node::chief(), {address});
  auto stats = tcp.call(0, GetStats{});
  REQUIRE(stats.wait_for(std::chrono::seconds(10)));
  CHECK(std::holds_alternative<StatsReply>(stats.get()));
  CHECK(std::holds_alternative<Ack>(tcp.call(0, Shutdown{}).get()));
  serving.join();
}

TEST_CASE("a client reconnects to a ps that restarted on the same address") {
  auto listener = std::make_unique<TcpServer<AsyncServer>>(
      AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, test_server_options());
  const std::uint16_t port = listener->port();
  std::thread serving([&] { listener->run(); });
  Tcp tcp = client(Node::chief(), {"127.0.0.1:" + std::to_string(port)});
  CHECK(std::holds_alternative<Ack>(tcp.call(0, Shutdown{}).get()));
  serving.join();
  listener.reset();

  // The ps is gone: calls fail fast and name it.
  const Response gone = tcp.call(0, GetStats{}).get();
  REQUIRE(std::holds_alternative<ErrorReply>(gone));
  CHECK(std::get<ErrorReply>(gone).code == ErrorCode::kUnavailable);
  CHECK(std::get<ErrorReply>(gone).message.find(std::to_string(port)) != std::string::npos);

  // A new ps on the same address is reached by the next call, with its own (fresh) state.
  TcpServer restarted(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", port,
                      test_server_options());
  std::thread serving_again([&] { restarted.run(); });
  auto back = tcp.call(0, GetStats{});
  REQUIRE(back.wait_for(std::chrono::seconds(10)));
  CHECK(std::holds_alternative<StatsReply>(back.get()));
  CHECK(std::holds_alternative<Ack>(tcp.call(0, Shutdown{}).get()));
  serving_again.join();
}

TEST_CASE("a ps started again that refuses a task it let in before is waited for, not taken as a verdict") {
  // Worker 2 joined the job after its cluster spec (which lists 2 workers): the first ps
  // process let it in, as the chief had counted it in.
  TcpServerOptions spec = test_server_options();
  spec.tasks = {{Node::Role::kWorker, 3}, {Node::Role::kChief, 1}};
  auto listener = std::make_unique<TcpServer<AsyncServer>>(
      AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, spec);
  const std::uint16_t port = listener->port();
  std::thread serving([&] { listener->run(); });
  Tcp tcp = client(Node::worker(2), {"127.0.0.1:" + std::to_string(port)});
  CHECK(std::holds_alternative<StatsReply>(tcp.call(0, GetStats{}).get()));
  listener->stop();
  serving.join();
  listener.reset();
  // A process started in its place knows the cluster spec's 2 workers only (until the
  // chief restores it): it refuses worker 2, and the call fails as a lost ps's does, so the
  // worker waits for the restore instead of ending.
  spec.tasks = {{Node::Role::kWorker, 2}, {Node::Role::kChief, 1}};
  TcpServer restarted(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", port, spec);
  std::thread serving_again([&] { restarted.run(); });
  const auto ask = [&] {
    auto call = tcp.call(0, GetStats{});
    REQUIRE(call.wait_for(std::chrono::seconds(10)));
    return call.get();
  };
  // (It may first hear that the old connection ended: "End of file" over TCP, "Broken
  // pipe" on a local socket, where a write to a closed peer fails at once.)
  Response answer = ask();
  if (auto* lost = std::get_if<ErrorReply>(&answer);
      lost != nullptr && (lost->message.find("lost: End of file") != std::string::npos ||
                          lost->message.find("lost: Broken pipe") != std::string::npos)) {
    answer = ask();
  }
  REQUIRE(std::holds_alternative<ErrorReply>(answer));
  const ErrorReply& error = std::get<ErrorReply>(answer);
  INFO(error.message);
  CHECK(error.code == ErrorCode::kUnavailable);
  CHECK(error.message.find("worker:2 is not a task of this job") != std::string::npos);
  // A task never let in is refused for good, as before.
  try {
    Tcp stranger = client(Node::worker(2), {"127.0.0.1:" + std::to_string(port)});
    FAIL("worker:2 was let in");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnauthenticated);
  }
  Tcp chief = client(Node::chief(), {"127.0.0.1:" + std::to_string(port)});
  CHECK(std::holds_alternative<Ack>(chief.call(0, Shutdown{}).get()));
  serving_again.join();
}

TEST_CASE("giving up on a push stalled mid-transfer returns, and closes that connection") {
  // A peer that accepts and never reads: a 64 MiB push fills the socket buffers and stalls.
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  std::vector<asio::ip::tcp::socket> accepted;
  std::thread accepting([&] {
    for (int i = 0; i < 2; ++i) {
      accepted.push_back(acceptor.accept());
      pulley::testing::welcome(io, accepted.back());  // a ps's handshake, then no reading
    }
  });
  Tcp tcp = client(Node::worker(0), {"127.0.0.1:" + std::to_string(acceptor.local_endpoint().port())});
  const std::vector<float> gradient(std::size_t{16} << 20U, 1.0F);
  PendingCall push = tcp.call(0, Push{0, 0, {{0, gradient}}});
  CHECK(!push.wait_for(std::chrono::milliseconds(300)));

  const auto start = std::chrono::steady_clock::now();
  push.cancel();  // returns although the peer never reads: the transfer is cut
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));

  // The connection was closed to stop the transfer; the next call opens a new one.
  PendingCall stats = tcp.call(0, GetStats{});
  CHECK(!stats.wait_for(std::chrono::milliseconds(300)));
  accepting.join();
  CHECK(accepted.size() == 2);
  stats.cancel();
}

TEST_CASE("a connection attempt that gets no answer gives up after attempt_timeout") {
  // A listener whose accept queue is full: the kernel drops further SYNs unanswered.
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, asio::ip::tcp::v4());
  acceptor.bind({asio::ip::make_address("127.0.0.1"), 0});
  acceptor.listen(0);
  const auto endpoint = acceptor.local_endpoint();
  std::vector<asio::ip::tcp::socket> fillers;
  for (int i = 0; i < 4; ++i) {
    asio::ip::tcp::socket s(io);
    s.open(asio::ip::tcp::v4());
    s.non_blocking(true);
    // In progress or done, either way the queue fills (asio's connect would wait for it).
    (void)::connect(s.native_handle(), endpoint.data(), static_cast<socklen_t>(endpoint.size()));
    fillers.push_back(std::move(s));
  }
  TcpOptions options;
  options.connect_timeout = std::chrono::milliseconds(600);
  options.attempt_timeout = std::chrono::milliseconds(200);
  const auto start = std::chrono::steady_clock::now();
  try {
    Tcp tcp = client(Node::chief(), {"127.0.0.1:" + std::to_string(endpoint.port())}, options);
    FAIL("connected to a full accept queue");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.what()).find("no connection within 200 ms") != std::string::npos);
  }
  // Without a bound per attempt, the first one alone would wait for the kernel's SYN retries.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

TEST_CASE("pulls waiting for a step count against a connection's limit") {
  TcpServerOptions options = test_server_options();
  options.max_unsent_bytes = 2U << 20U;
  options.max_unanswered_requests = 4;
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, options);
  std::thread serving([&] { listener.run(); });
  constexpr std::size_t kFloats = (1U << 20U) / sizeof(float);
  Chief chief(client(Node::chief(), {"127.0.0.1:" + std::to_string(listener.port())}), 1);
  chief.initialize(std::vector<VariableSpec>{{"blob", {kFloats}, Initializer::zeros()}});

  // 64 pulls that wait for step 1, then one push that releases them all at once.
  constexpr std::uint64_t kPulls = 64;
  RawClient greedy, pusher;
  REQUIRE(greedy.join(listener.port(), Node::evaluator()).empty());
  REQUIRE(pusher.join(listener.port(), Node::worker(0)).empty());
  for (std::uint64_t call = 1; call <= kPulls; ++call) {
    greedy.send(Pull{1, {{0, {0, kFloats}}}}, call);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::vector<float> gradient(kFloats, 1.0F);
  pusher.send(Push{0, 0, {{0, gradient}}}, 1);
  std::vector<char> body;
  REQUIRE(pusher.receive(body).call == 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Only 4 were read before the push; answering them let a few more in, until the unsent
  // replies passed 2 MiB (plus what the kernel's buffers took): far from all 64 MiB.
  CHECK(chief.stats().at(0).bytes_pulled < std::int64_t{kPulls / 2} << 20U);

  for (std::uint64_t call = 1; call <= kPulls; ++call) REQUIRE(greedy.receive(body).call == call);
  CHECK(chief.stats().at(0).bytes_pulled == std::int64_t{kPulls} << 20U);
  chief.shutdown();
  serving.join();
}

TEST_CASE("a ps shuts down even while a client does not read its replies") {
  TcpServerOptions options = test_server_options();
  options.linger = std::chrono::seconds(1);  // the greedy client never leaves on its own
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0,
                     options);
  auto serving = std::async(std::launch::async, [&] { listener.run(); });
  constexpr std::size_t kFloats = (4U << 20U) / sizeof(float);
  Chief chief(client(Node::chief(), {"127.0.0.1:" + std::to_string(listener.port())}), 1);
  chief.initialize(std::vector<VariableSpec>{{"blob", {kFloats}, Initializer::zeros()}});
  RawClient greedy;
  REQUIRE(greedy.join(listener.port(), Node::evaluator()).empty());
  for (std::uint64_t call = 1; call <= 8; ++call) greedy.send(Pull{0, {{0, {0, kFloats}}}}, call);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  chief.shutdown();
  const bool stopped = serving.wait_for(std::chrono::seconds(15)) == std::future_status::ready;
  CHECK(stopped);
  if (!stopped) listener.stop();
}

TEST_CASE("replies the kernel takes only in part, even mid-header, reach the client whole") {
  // 100 000 stats requests from a client that reads nothing at first: the ps's socket
  // buffers fill and its writes stop at any byte of a reply, header and metadata included.
  TcpServerOptions options = test_server_options();
  options.max_unsent_bytes = 64U << 10U;
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, options);
  std::thread serving([&] { listener.run(); });
  RawClient raw;
  raw.socket.open(asio::ip::tcp::v4());
  raw.socket.set_option(asio::socket_base::receive_buffer_size(16 << 10));
  raw.socket.connect({asio::ip::make_address("127.0.0.1"), listener.port()});
  REQUIRE(raw.handshake(Node::chief()).empty());
  constexpr std::uint64_t kCalls = 100000;
  std::vector<char> requests;
  const wire::Frame frame = wire::encode(Request{GetStats{}}, 0);
  for (std::uint64_t call = 1; call <= kCalls; ++call) {
    wire::Header h = frame.header;
    h.call = call;
    requests.insert(requests.end(), reinterpret_cast<const char*>(&h),
                    reinterpret_cast<const char*>(&h) + sizeof h);
  }
  // One thread drives both: the requests go out while the replies are read (after a pause
  // that lets the ps's buffers fill), each checked whole and in order.
  asio::async_write(raw.socket, asio::buffer(requests), [](std::error_code, std::size_t) {});
  std::uint64_t whole = 0;
  wire::Header header;
  std::vector<char> meta;
  std::function<void()> read_reply = [&] {
    asio::async_read(
        raw.socket, asio::buffer(&header, sizeof header), [&](std::error_code ec, std::size_t) {
          if (ec || header.call != whole + 1 || header.payload_bytes != 0) return;
          meta.resize(wire::head_bytes(header) - sizeof header);  // metadata and padding
          asio::async_read(
              raw.socket, asio::buffer(meta), [&](std::error_code ec2, std::size_t) {
                if (ec2) return;
                const Response r =
                    wire::decode_response(header, std::span(meta).first(header.meta_bytes), {});
                if (!std::holds_alternative<StatsReply>(r)) return;
                if (++whole < kCalls) read_reply();
              });
        });
  };
  asio::steady_timer pause(raw.io, std::chrono::milliseconds(300));
  pause.async_wait([&](std::error_code) { read_reply(); });
  raw.io.restart();
  raw.io.run_for(std::chrono::seconds(60));
  CHECK(whole == kCalls);
  std::vector<char> body;
  raw.send(Shutdown{}, kCalls + 1);
  CHECK(raw.receive(body).call == kCalls + 1);
  serving.join();
}

TEST_CASE("an answered call is cancelled at once while a larger one behind it is still sent") {
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0,
                     test_server_options());
  std::thread serving([&] { listener.run(); });
  const std::vector<std::string> address{"127.0.0.1:" + std::to_string(listener.port())};
  Tcp chief = client(Node::chief(), address);
  // Registered but not initialized: the ps takes a 64 MiB push, and refuses it.
  const std::vector<VariableSpec> model{{"big", {std::size_t{16} << 20U}, Initializer::zeros()}};
  REQUIRE(std::holds_alternative<PlacementReply>(chief.call(0, Register{model}).get()));
  Tcp tcp = client(Node::worker(0), address);
  // Both leave in one gather-write; the stats reply comes while the 64 MiB push is still
  // being written. The stats call's use of its buffers ended with its own frame.
  const std::vector<float> gradient(std::size_t{16} << 20U, 1.0F);
  PendingCall stats = tcp.call(0, GetStats{});
  PendingCall push = tcp.call(0, Push{0, 0, {{0, gradient}}});
  REQUIRE(stats.wait_for(std::chrono::seconds(10)));
  stats.cancel();  // must not wait for the push's write to end: nothing else would run it
  REQUIRE(push.wait_for(std::chrono::seconds(30)));
  const Response answer = push.get();  // the connection lived on: the ps's own verdict
  REQUIRE(std::holds_alternative<ErrorReply>(answer));
  CHECK(std::get<ErrorReply>(answer).code == ErrorCode::kFailedPrecondition);
  CHECK(std::holds_alternative<Ack>(chief.call(0, Shutdown{}).get()));
  serving.join();
}

TEST_CASE("a connection paused for its waiting requests is read again once they are answered") {
  TcpServerOptions options = test_server_options();
  options.max_unsent_bytes = 1U << 10U;  // the 4 KiB reply alone exceeds it...
  options.max_unanswered_requests = 1;   // ...and one waiting pull pauses the connection
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, options);
  std::thread serving([&] { listener.run(); });
  constexpr std::size_t kFloats = 1024;
  Chief chief(client(Node::chief(), {"127.0.0.1:" + std::to_string(listener.port())}), 1);
  chief.initialize(std::vector<VariableSpec>{{"blob", {kFloats}, Initializer::zeros()}});
  RawClient waiter;
  REQUIRE(waiter.join(listener.port(), Node::evaluator()).empty());
  waiter.send(Pull{1, {{0, {0, kFloats}}}}, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::vector<float> gradient(kFloats, 1.0F);
  RawClient pusher;
  REQUIRE(pusher.join(listener.port(), Node::worker(0)).empty());
  pusher.send(Push{0, 0, {{0, gradient}}}, 1);
  std::vector<char> body;
  REQUIRE(pusher.receive(body).call == 1);
  // The kernel takes the released reply at once; the pause must end with it.
  REQUIRE(waiter.receive(body).call == 1);
  waiter.send(GetStats{}, 2);
  CHECK(waiter.receive(body).call == 2);
  chief.shutdown();
  serving.join();
}

// Address sanitizers reserve terabytes of address space: a cap on it cannot apply there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PULLEY_NO_ADDRESS_SPACE_CAP 1
#endif

#ifndef PULLEY_NO_ADDRESS_SPACE_CAP
TEST_CASE("a ps that cannot hold a payload drops that connection and serves on") {
  // The ps runs in a child process whose address space leaves 96 MiB to spare: a 64 MiB
  // variable fits, but not also the buffer its 64 MiB initial value is received into.
  asio::io_context io;
  asio::ip::tcp::acceptor probe(io, {asio::ip::make_address("127.0.0.1"), 0});
  const std::uint16_t port = probe.local_endpoint().port();
  probe.close();
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the ps: exits 0 once shut down after the failed payload, never returns
    try {
      TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", port,
                         test_server_options());
      rlimit cap{};
      getrlimit(RLIMIT_AS, &cap);
      std::size_t mapped = 0;  // what the process has mapped now, from /proc/self/statm
      if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
        if (std::fscanf(statm, "%zu", &mapped) != 1) mapped = 0;
        std::fclose(statm);
      }
      cap.rlim_cur = mapped * static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) + (96U << 20U);
      setrlimit(RLIMIT_AS, &cap);
      listener.run();
    } catch (...) {
      _exit(1);
    }
    _exit(0);
  }
  const std::vector<std::string> address{"127.0.0.1:" + std::to_string(port)};
  {
    Chief chief(client(Node::chief(), address), 1);  // waits for the child to listen
    constexpr std::size_t kFloats = (64U << 20U) / sizeof(float);
    try {
      chief.initialize(std::vector<VariableSpec>{{"big", {kFloats}, Initializer::zeros()}});
      FAIL("a ps without the memory took the initial value");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kUnavailable);  // its connection was closed
    }
  }
  RawClient other;  // everyone else is still served
  REQUIRE(other.join(port, Node::chief()).empty());
  std::vector<char> body;
  other.send(GetStats{}, 1);
  CHECK(other.receive(body).call == 1);
  other.send(Shutdown{}, 2);
  CHECK(other.receive(body).call == 2);
  int status = -1;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
#endif

TEST_CASE("bounded staleness over TCP: tokens within the bound, every step applied") {
  using SspServer = ParameterServer<FixedShards, Sgd, BoundedStaleness>;
  constexpr std::int64_t kStaleness = 1;
  std::vector<std::unique_ptr<TcpServer<SspServer>>> listeners;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < 2; ++i) {
    listeners.push_back(std::make_unique<TcpServer<SspServer>>(
        SspServer(i, 2, Sgd{0.05F}, BoundedStaleness(kStaleness, 2), FixedShards{2}), "127.0.0.1",
        0, test_server_options()));
    addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
  }
  std::vector<std::thread> serving;
  for (auto& l : listeners) serving.emplace_back([&l] { l->run(); });
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  std::vector<std::vector<StepResult>> results(2);
  {
    Chief chief(client(Node::chief(), addresses), 7);
    chief.initialize(LinearModel(kIn, kOut).variables());
    std::vector<std::thread> workers;
    for (std::uint32_t w = 0; w < 2; ++w) {
      workers.emplace_back([&, w] {
        Worker worker(w, LinearModel(kIn, kOut), client(Node::worker(w), addresses));
        worker.wait_ready();
        for (std::int64_t k = 0;; ++k) {
          if (w == 1) std::this_thread::sleep_for(std::chrono::microseconds(500));  // slower
          const std::size_t row = static_cast<std::size_t>(((k % kSteps) * 2 + w) * kBatch);
          const LinearBatch batch{std::span(data.x).subspan(row * kIn, kBatch * kIn),
                                  std::span(data.y).subspan(row * kOut, kBatch * kOut)};
          const auto result = worker.step(batch, kSteps);
          if (!result) break;
          results[w].push_back(*result);
        }
      });
    }
    for (auto& t : workers) t.join();
    for (const Stats& s : chief.stats()) {
      CHECK(s.global_step == kSteps);
      CHECK(s.stale_gradients_dropped == 0);
    }
    chief.shutdown();
  }  // every client has left: the ps tasks end without waiting out their linger
  for (auto& t : serving) t.join();
  for (const auto& steps : results) {
    REQUIRE(steps.size() >= static_cast<std::size_t>(kSteps));
    for (const StepResult& r : steps) CHECK(r.local_step - r.global_step <= kStaleness);
  }
}

TEST_CASE("over TCP a worker hears that training ended, and the ps ends once clients left") {
  TcpServerOptions options = test_server_options();
  options.linger = std::chrono::seconds(60);  // far longer than the test may take
  TcpServer listener(Server(0, 1, Sgd{0.1F}, SyncReplicas(2, 2), FixedShards{1}), "127.0.0.1", 0,
                     options);
  auto serving = std::async(std::launch::async, [&] { listener.run(); });
  const std::vector<std::string> address{"127.0.0.1:" + std::to_string(listener.port())};
  const LinearData data(kBatch, kIn, kOut, 3);
  std::optional<bool> stepped;
  {
    Chief chief(client(Node::chief(), address), 7);
    chief.initialize(LinearModel(kIn, kOut).variables());
    std::thread lonely([&] {  // worker 1 never comes: worker 0 waits for step 1
      Worker worker(0, LinearModel(kIn, kOut), client(Node::worker(0), address));
      worker.wait_ready();
      stepped = worker.step({data.x, data.y}).has_value();
      // After the end, every later call hears it too, over a live connection.
      CHECK_FALSE(worker.step({data.x, data.y}).has_value());
      CHECK(worker.finished());
    });
    // Ended once worker 0 pushed and waits (not before it is ready: that is another case).
    CHECK(testing::wait_until([&] { return chief.stats().at(0).gradients_accepted > 0; }));
    chief.shutdown();
    lonely.join();
    CHECK(serving.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout);
  }  // the chief leaves last
  CHECK(stepped == false);
  CHECK(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(listener.service().ended()->code == ErrorCode::kOutOfRange);
}

TEST_CASE("a ps told to start again ends within a second though a client stays connected") {
  // A process the job gave up: whoever is still connected holds it given up, so it serves
  // anew at once instead of lingering for them (Shutdown::restart). A plain Shutdown waits
  // for that client, up to its linger.
  for (const bool restart : {true, false}) {
    CAPTURE(restart);
    TcpServerOptions options = test_server_options();
    options.linger = std::chrono::seconds(60);
    TcpServer listener(make_server(0), "127.0.0.1", 0, options);
    auto serving = std::async(std::launch::async, [&] { listener.run(); });
    RawClient bystander;
    REQUIRE(bystander.join(listener.port(), Node::worker(0)).empty());
    {
      Tcp chief = client(Node::chief(), {"127.0.0.1:" + std::to_string(listener.port())});
      CHECK(std::holds_alternative<Ack>(chief.call(0, Shutdown{false, {}, restart}).get()));
    }
    CHECK(listener.service().restarts() == restart);
    const auto ended = serving.wait_for(std::chrono::seconds(restart ? 5 : 2));
    CHECK((ended == std::future_status::ready) == restart);
    bystander.socket.close();
    CHECK(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  }
}

TEST_CASE(
    "a chief whose links break as the ps tasks answer its shutdown ends training all the same") {
  pulley::testing::LogCapture log;
  // ps 0 stops at once when its last client's link closes (no end_grace: as a ps that
  // ended, or died, before the chief came back); ps 1 serves on for a client that stays.
  TcpServerOptions at_once = test_server_options();
  at_once.end_grace = std::chrono::milliseconds(0);
  TcpServerOptions stays = test_server_options();
  stays.linger = std::chrono::seconds(60);
  std::vector<std::unique_ptr<TcpServer<Server>>> listeners;
  listeners.push_back(std::make_unique<TcpServer<Server>>(make_server(0), "127.0.0.1", 0, at_once));
  listeners.push_back(std::make_unique<TcpServer<Server>>(make_server(1), "127.0.0.1", 0, stays));
  std::vector<std::future<void>> serving;
  for (auto& l : listeners) serving.push_back(std::async(std::launch::async, [&l] { l->run(); }));
  // The chief reaches each ps through a proxy that will lose the Shutdown's answer with
  // the link, after the ps took it.
  std::vector<std::unique_ptr<pulley::testing::CutProxy>> proxies;
  std::vector<std::string> addresses;
  for (std::uint32_t ps = 0; ps < 2; ++ps) {
    proxies.push_back(std::make_unique<pulley::testing::CutProxy>(listeners[ps]->port(), 0.0, ps));
    addresses.push_back("127.0.0.1:" + std::to_string(proxies.back()->port()));
  }
  RawClient bystander;
  REQUIRE(bystander.join(listeners[1]->port(), Node::worker(0)).empty());
  ClientOptions quick;
  quick.request_timeout = std::chrono::seconds(3);
  {
    Chief chief(client(Node::chief(), addresses), 7, quick);
    chief.initialize(LinearModel(kIn, kOut).variables());
    for (auto& p : proxies) p->cut_next(1);
    chief.shutdown();  // does not throw
  }
  CHECK(proxies[0]->cuts() == 1);
  CHECK(proxies[1]->cuts() == 1);
  for (std::uint32_t ps = 0; ps < 2; ++ps) {
    INFO("ps " << ps);
    REQUIRE(listeners[ps]->service().ended().has_value());
    CHECK(listeners[ps]->service().ended()->code == ErrorCode::kOutOfRange);
  }
  // ps 0 stopped with its answer lost: named. ps 1 answered the Shutdown sent again with
  // its end: not named.
  const auto named = log.find(LogLevel::kWarning, "could not be told that training finished");
  REQUIRE(named.size() == 1);
  CHECK(named[0].find("ps tasks {0}") != std::string::npos);
  CHECK(serving[0].wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  bystander.socket.close();
  CHECK(serving[1].wait_for(std::chrono::seconds(10)) == std::future_status::ready);
}

TEST_CASE(
    "a worker whose link breaks as training ends comes back to hear it ended, though every client "
    "left") {
  TcpServerOptions options = test_server_options();
  options.linger = std::chrono::seconds(60);  // it ends with its clients, not before
  TcpServer listener(Server(0, 1, Sgd{0.1F}, SyncReplicas(2, 2), FixedShards{1}), "127.0.0.1", 0,
                     options);
  auto serving = std::async(std::launch::async, [&] { listener.run(); });
  const std::vector<std::string> address{"127.0.0.1:" + std::to_string(listener.port())};
  // Worker 0 reaches the ps through a proxy that loses the answer "training finished" with
  // the link; the chief goes straight, and leaves at once.
  pulley::testing::CutProxy proxy(listener.port(), 0.0, 3);
  const LinearData data(kBatch, kIn, kOut, 3);
  std::optional<std::optional<StepResult>> stepped;
  std::optional<Error> failed;
  std::thread lonely;
  {
    Chief chief(client(Node::chief(), address), 7);
    chief.initialize(LinearModel(kIn, kOut).variables());
    lonely = std::thread([&] {  // worker 1 never comes: worker 0 waits for step 1
      ClientOptions patience;
      patience.recovery_timeout =
          std::chrono::seconds(4);  // how long it tries to reach the ps again
      Worker worker(0, LinearModel(kIn, kOut),
                    client(Node::worker(0), {"127.0.0.1:" + std::to_string(proxy.port())}),
                    patience);
      worker.wait_ready();
      try {
        stepped.emplace(worker.step({data.x, data.y}));
        CHECK(worker.finished());
      } catch (const Error& e) {
        failed.emplace(e);
      }
    });
    CHECK(testing::wait_until([&] { return chief.stats().at(0).gradients_accepted > 0; }));
    proxy.cut_next(1);
    chief.shutdown();
  }  // the chief leaves: no client is left on the ps
  lonely.join();
  CHECK(proxy.cuts() == 1);
  CHECK_FALSE(failed.has_value());
  if (failed) MESSAGE(std::string(failed->what()));
  REQUIRE(stepped.has_value());
  CHECK_FALSE(stepped->has_value());  // it heard that training finished
  CHECK(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
}

TEST_CASE(
    "a ps that ended waits for a worker it heard until it says it is leaving, or is silent for the "
    "worker timeout") {
  TcpServerOptions options = test_server_options();
  options.end_grace = std::chrono::milliseconds(0);  // the wait below is the workers' alone
  options.linger = std::chrono::seconds(60);
  for (const bool comes_back : {true, false}) {
    INFO("worker 0 comes back: " << comes_back);
    Server ps(0, 1, Sgd{0.1F}, SyncReplicas(2, 2), FixedShards{1});
    ps.set_worker_timeout(std::chrono::milliseconds(comes_back ? 5000 : 600));
    TcpServer listener(std::move(ps), "127.0.0.1", 0, options);
    auto serving = std::async(std::launch::async, [&] { listener.run(); });
    std::vector<char> body;
    std::chrono::steady_clock::time_point heard;
    {
      RawClient worker;  // heard once; its link then breaks as training ends
      REQUIRE(worker.join(listener.port(), Node::worker(0)).empty());
      {
        Chief chief(client(Node::chief(), {"127.0.0.1:" + std::to_string(listener.port())}), 7);
        chief.initialize(LinearModel(kIn, kOut).variables());
        worker.send(Heartbeat{0}, 1);
        REQUIRE(worker.receive(body).call == 1);
        heard = std::chrono::steady_clock::now();
        chief.shutdown();
      }
      REQUIRE(listener.service().stopped());
    }  // every client has left, worker 0 without hearing the end
    if (comes_back) {
      // Stopped a while, worker 0 comes back: the ps still takes it, says training
      // finished, and ends once worker 0 says it leaves.
      CHECK(serving.wait_for(std::chrono::milliseconds(800)) == std::future_status::timeout);
      RawClient again;
      REQUIRE(again.join(listener.port(), Node::worker(0)).empty());
      again.send(Pull{0, {{0, {0, 1}}}, 0}, 2);
      const wire::Header header = again.receive(body);
      REQUIRE(header.call == 2);
      const Response answer =
          wire::decode_response(header, std::span(body).first(header.meta_bytes), {});
      REQUIRE(std::holds_alternative<ErrorReply>(answer));
      CHECK(std::get<ErrorReply>(answer).code == ErrorCode::kOutOfRange);
      again.send(Heartbeat{0, true}, 3);
      CHECK(again.receive(body).call == 3);
      again.socket.close();
      CHECK(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
    } else {
      // Silent for the worker timeout: held gone, and the ps ends (well before linger).
      REQUIRE(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
      CHECK(std::chrono::steady_clock::now() - heard >= std::chrono::milliseconds(550));
    }
  }
}

TEST_CASE("a ps whose clients all left without ending training gives up, and says so") {
  TcpServerOptions options = test_server_options();
  options.orphaned_after = std::chrono::milliseconds(300);
  TcpServer listener(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0,
                     options);
  auto serving = std::async(std::launch::async, [&] { listener.run(); });
  // No client yet: a ps waits as long as its job takes to start.
  CHECK(serving.wait_for(std::chrono::milliseconds(600)) == std::future_status::timeout);
  {
    Chief chief(client(Node::chief(), {"127.0.0.1:" + std::to_string(listener.port())}), 1);
    chief.initialize(std::vector<VariableSpec>{{"w", {4}, Initializer::zeros()}});
  }  // the chief is gone without a Shutdown (as if it had crashed)
  REQUIRE(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(listener.orphaned());
  CHECK_FALSE(listener.service().stopped());
}

TEST_CASE("a Tcp transport reaches a ps added later, and an address it cannot reach changes nothing") {
  TcpCluster cluster;  // ps 0 and ps 1
  TcpOptions quick;
  quick.connect_timeout = std::chrono::milliseconds(300);
  Tcp tcp = client(Node::chief(), {cluster.addresses[0]}, quick);
  REQUIRE(tcp.num_ps() == 1);
  tcp.add_ps(cluster.addresses[1]);
  CHECK(tcp.num_ps() == 2);
  CHECK(tcp.address(1) == cluster.addresses[1]);
  auto stats = tcp.call(1, GetStats{});
  REQUIRE(stats.wait_for(std::chrono::seconds(10)));
  CHECK(std::holds_alternative<StatsReply>(stats.get()));
  // ps 0 answers as ps 0, not as the ps 2 it is added as: refused, and nothing changes.
  CHECK_THROWS_AS(tcp.add_ps(cluster.addresses[0]), Error);
  CHECK(tcp.num_ps() == 2);
  auto unused = std::make_unique<TcpServer<Server>>(make_server(0), "127.0.0.1", 0, test_server_options());
  const std::string nobody = "127.0.0.1:" + std::to_string(unused->port());
  unused.reset();
  try {
    tcp.add_ps(nobody);
    FAIL("reached nobody");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.what()).find(nobody) != std::string::npos);
  }
  CHECK(tcp.num_ps() == 2);
  auto again = tcp.call(1, GetStats{});
  REQUIRE(again.wait_for(std::chrono::seconds(10)));
  CHECK(std::holds_alternative<StatsReply>(again.get()));
  // Added without connecting (a ps the job knew, gone since): its calls fail as a lost ps's.
  tcp.add_ps(nobody, false);
  CHECK(tcp.num_ps() == 3);
  auto gone = tcp.call(2, GetStats{});
  REQUIRE(gone.wait_for(std::chrono::seconds(10)));
  REQUIRE(std::holds_alternative<ErrorReply>(gone.get()));
  CHECK(std::get<ErrorReply>(gone.get()).code == ErrorCode::kUnavailable);
}

TEST_CASE("a Tcp transport told which ps tasks to reach now does not wait for the others") {
  TcpCluster cluster;  // ps 0 and ps 1
  auto unused = std::make_unique<TcpServer<Server>>(make_server(0), "127.0.0.1", 0, test_server_options());
  const std::string nobody = "127.0.0.1:" + std::to_string(unused->port());
  unused.reset();
  TcpOptions patient = pulley::testing::test_client_options();
  patient.connect_timeout = std::chrono::seconds(20);  // reaching ps 2 now would throw after it
  // The job's ps 2 left it (nobody listens there now); its ps tasks are {0, 1}.
  const std::vector<std::string> addresses{cluster.addresses[0], cluster.addresses[1], nobody};
  const std::vector<std::uint32_t> members{0, 1};
  Tcp tcp(Node::worker(0), addresses, patient, std::span<const std::uint32_t>(members));
  CHECK(tcp.num_ps() == 3);
  for (const std::uint32_t ps : members) {
    auto stats = tcp.call(ps, GetStats{});
    REQUIRE(stats.wait_for(std::chrono::seconds(10)));
    CHECK(std::holds_alternative<StatsReply>(stats.get()));
  }
  auto gone = tcp.call(2, GetStats{});  // reached at its first call, as a lost ps
  REQUIRE(gone.wait_for(std::chrono::seconds(30)));
  REQUIRE(std::holds_alternative<ErrorReply>(gone.get()));
  CHECK(std::get<ErrorReply>(gone.get()).code == ErrorCode::kUnavailable);
  // Without the list every address is reached at once: the constructor names the one
  // nobody serves (within a short patience here).
  TcpOptions quick = pulley::testing::test_client_options();
  quick.connect_timeout = std::chrono::milliseconds(300);
  try {
    Tcp all(Node::worker(0), addresses, quick);
    FAIL("reached nobody");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.what()).find(nobody) != std::string::npos);
  }
}

namespace {

/// True if /proc/net/unix lists the abstract socket name `name` (its leading NUL shown as
/// '@').
bool unix_socket_listed(const std::string& name) {
  std::FILE* f = std::fopen("/proc/net/unix", "r");
  if (f == nullptr) return false;
  const std::string shown = "@" + name.substr(1);
  char line[512];
  bool found = false;
  while (!found && std::fgets(line, sizeof line, f) != nullptr) {
    std::string text(line);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    found = text.size() >= shown.size() && text.compare(text.size() - shown.size(), shown.size(), shown) == 0;
  }
  std::fclose(f);
  return found;
}

}  // namespace

TEST_CASE("tasks on one host talk through the ps's local socket, proving themselves as over TCP, and over TCP where either side turns it off") {
  if (!transport_detail::kLocalSockets) return;  // (Linux only)
  for (const std::string host : {"127.0.0.1", "0.0.0.0"}) {
    CAPTURE(host);
    TcpServer<AsyncServer> server(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), host, 0,
                                  test_server_options());
    const std::string address = "127.0.0.1:" + std::to_string(server.port());
    std::thread serving([&] { server.run(); });
    const std::string name = transport_detail::local_socket_name(asio::ip::make_address(host), server.port());
    CHECK(unix_socket_listed(name));
    {
      Tcp tcp = client(Node::worker(0), {address});
      CHECK(std::holds_alternative<StatsReply>(tcp.call(0, GetStats{}).get()));
      CHECK(tcp.local(0));
    }
    {
      TcpOptions off = test_client_options();
      off.local_sockets = false;
      Tcp tcp = client(Node::worker(1), {address}, off);
      CHECK(std::holds_alternative<StatsReply>(tcp.call(0, GetStats{}).get()));
      CHECK_FALSE(tcp.local(0));
    }
    // The local socket asks for the job's secret as the port does.
    TcpOptions stranger = test_client_options();
    stranger.credentials.secret = "another secret";
    stranger.connect_timeout = std::chrono::milliseconds(2000);
    try {
      Tcp refused(Node::worker(0), {address}, stranger);
      FAIL("a client without the job's secret was let in");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kUnauthenticated);
    }
    // Garbage on the local socket closes that connection, and the ps serves on.
    {
      asio::io_context io;
      asio::local::stream_protocol::socket raw(io);
      raw.connect(asio::local::stream_protocol::endpoint(name));
      const std::string garbage(4096, 'x');
      std::error_code ec;
      asio::write(raw, asio::buffer(garbage), ec);
      std::array<char, 4096> sink{};
      std::size_t read = 0;
      while (!ec && read < (std::size_t{1} << 20U)) read += raw.read_some(asio::buffer(sink), ec);
      CHECK(ec);  // closed by the ps (its challenge read first)
    }
    Tcp after = client(Node::worker(0), {address});
    CHECK(std::holds_alternative<StatsReply>(after.call(0, GetStats{}).get()));
    CHECK(after.local(0));
    server.stop();
    serving.join();
  }
  // A ps without a local socket is reached over TCP.
  TcpServerOptions tcp_only = test_server_options();
  tcp_only.local_socket = false;
  TcpServer<AsyncServer> server(AsyncServer(0, 1, Sgd{0.1F}, Async{}, FixedShards{1}), "127.0.0.1", 0, tcp_only);
  std::thread serving([&] { server.run(); });
  CHECK_FALSE(unix_socket_listed(transport_detail::local_socket_name(asio::ip::make_address("127.0.0.1"), server.port())));
  Tcp tcp = client(Node::worker(0), {"127.0.0.1:" + std::to_string(server.port())});
  CHECK(std::holds_alternative<StatsReply>(tcp.call(0, GetStats{}).get()));
  CHECK_FALSE(tcp.local(0));
  server.stop();
  serving.join();
}

TEST_CASE(
    "tasks on one host move their bytes through shared memory, larger frames than its rings whole, "
    "and on the socket where either side turns it off") {
  if (!transport_detail::kLocalSockets || !transport_detail::kSharedRings) return;  // (Linux only)
  // 3 MiB a tensor: each push and each pull crosses the 1 MiB rings in several turns.
  constexpr std::size_t kFloats = std::size_t{3} << 18U;
  static_assert(kFloats * sizeof(float) > 2 * transport_detail::kLinkRingBytes);
  for (const bool server_shares : {true, false}) {
    for (const bool client_shares : {true, false}) {
      CAPTURE(server_shares);
      CAPTURE(client_shares);
      TcpServerOptions serving = test_server_options();
      serving.shared_memory = server_shares;
      auto server = std::make_unique<TcpServer<AsyncServer>>(
          AsyncServer(0, 1, Sgd{0.5F}, Async{}, FixedShards{1}), "127.0.0.1", 0, serving);
      const std::string address = "127.0.0.1:" + std::to_string(server->port());
      std::thread serving_thread([&] { server->run(); });
      TcpOptions options = test_client_options();
      options.shared_memory = client_shares;
      Chief chief(client(Node::chief(), {address}, options), 1);
      chief.initialize(std::vector<VariableSpec>{{"blob", {kFloats}, Initializer::constant(1.0F)}});
      Tcp worker = client(Node::worker(0), {address}, options);
      std::vector<float> ramp(kFloats), pulled(kFloats, -1.0F);
      for (std::size_t i = 0; i < kFloats; ++i) ramp[i] = static_cast<float>(i % 1024);
      for (int step = 1; step <= 3; ++step) {
        CAPTURE(step);
        PendingCall push = worker.call(0, Push{0, step - 1, {{0, ramp}}});
        PendingCall pull =
            worker.call(0, Pull{0, {{0, {0, kFloats}}}}, PullTargets{std::span<float>(pulled)});
        const Response pushed = push.get();
        if (const auto* error = std::get_if<ErrorReply>(&pushed)) MESSAGE(error->message);
        REQUIRE(std::holds_alternative<PushReply>(pushed));
        REQUIRE(std::holds_alternative<PullReply>(pull.get()));
        // w = 1 - 0.5 step ramp, exactly (halves of small integers), in every element.
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < kFloats; ++i) {
          wrong += pulled[i] != 1.0F - 0.5F * static_cast<float>(step) * ramp[i] ? 1 : 0;
        }
        CHECK(wrong == 0);
      }
      CHECK(worker.local(0));
      CHECK(worker.shared_memory(0) == (server_shares && client_shares));
      server->stop();
      serving_thread.join();
      // The ps's rings (one per client) are charged to its buffer budget while they last.
      if (server_shares && client_shares)
        CHECK(server->buffered_bytes() >= 2 * transport_detail::kLinkRingBytes);
      server.reset();
      // The ps is gone: a call through shared memory learns it from the socket, at once.
      PendingCall after = worker.call(0, GetStats{});
      REQUIRE(after.wait_for(std::chrono::seconds(5)));
      CHECK(std::holds_alternative<ErrorReply>(after.get()));
    }
  }
}

namespace {

/// A raw client on a ps's local socket (blocking, 5 s per receive), for what a real client
/// would not send once it offered shared memory.
struct RawLocal {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

  explicit RawLocal(const std::string& name) {
    sockaddr_un at{};
    at.sun_family = AF_UNIX;
    std::memcpy(at.sun_path, name.data(), name.size());
    REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&at),
                      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size())) == 0);
    const timeval limit{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  }
  RawLocal(const RawLocal&) = delete;
  RawLocal& operator=(const RawLocal&) = delete;
  ~RawLocal() { ::close(fd); }

  bool read_exact(void* into, std::size_t n) {
    auto* at = static_cast<char*>(into);
    while (n > 0) {
      const ssize_t got = ::recv(fd, at, n, 0);
      if (got <= 0) return false;
      at += got;
      n -= static_cast<std::size_t>(got);
    }
    return true;
  }
  void write_frame(const wire::Frame& frame) {
    transport_detail::GatherList list;
    list.append(frame);
    for (const asio::const_buffer& b : list.remaining()) {
      REQUIRE(::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size()));
    }
  }
  std::optional<wire::Header> read_frame(std::vector<char>& body) {
    wire::Header header;
    if (!read_exact(&header, sizeof header)) return std::nullopt;
    body.resize(wire::head_bytes(header) - sizeof header + header.payload_bytes);
    if (!read_exact(body.data(), body.size())) return std::nullopt;
    return header;
  }
  /// The handshake as `self`, its hello offering shared memory: the welcome's flags.
  std::uint32_t join_offering_shared_memory(Node self) {
    std::vector<char> body;
    const auto first = read_frame(body);
    REQUIRE(first);
    const auto challenge = wire::decode_handshake_as<wire::Challenge>(
        *first, std::span(body).first(first->meta_bytes));
    const Credentials job = pulley::testing::test_credentials();
    const std::string nonce = wire::make_nonce();
    wire::Frame hello = wire::encode(
        wire::Handshake{wire::Hello{job.job, self, nonce,
                                    wire::client_proof(job.secret, challenge, self, nonce),
                                    wire::incarnation()}},
        0);
    hello.header.flags = wire::kSharedMemoryFlag;
    write_frame(hello);
    const auto welcome = read_frame(body);
    REQUIRE(welcome);
    REQUIRE(std::holds_alternative<wire::Welcome>(
        wire::decode_handshake(*welcome, std::span(body).first(welcome->meta_bytes))));
    return welcome->flags;
  }
  /// The ps's answer to this side's ring (send_fd): its memory file, -1 for none; -2 if none came.
  int answer() {
    pollfd wait{fd, POLLIN, 0};
    if (::poll(&wait, 1, 5000) != 1) return -2;
    int ring = -1;
    return transport_detail::receive_fd(fd, ring) == 1 ? ring : -2;
  }
  /// True if a request sent on the socket, as call `call`, is answered there (stats).
  bool answers_on_socket(std::uint64_t call) {
    write_frame(wire::encode(Request{GetStats{}}, call));
    std::vector<char> body;
    const auto reply = read_frame(body);
    return reply && reply->call == call &&
           std::holds_alternative<StatsReply>(
               wire::decode_response(*reply, std::span(body).first(reply->meta_bytes), {}));
  }
  /// True once the ps closed the connection (within the receive limit).
  bool closed_by_ps() {
    std::array<char, 256> sink{};
    for (;;) {
      const ssize_t got = ::recv(fd, sink.data(), sink.size(), 0);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return true;
      if (got < 0 && errno != EINTR) return false;  // the limit passed
    }
  }
};

}  // namespace

TEST_CASE(
    "a ps refuses what is not a ring after a welcome that took shared memory, and reads a ring's "
    "garbage as it reads a socket's") {
  if (!transport_detail::kLocalSockets || !transport_detail::kSharedRings) return;  // (Linux only)
  TcpServer<AsyncServer> server(AsyncServer(0, 1, Sgd{0.5F}, Async{}, FixedShards{1}), "127.0.0.1",
                                0, test_server_options());
  const std::string address = "127.0.0.1:" + std::to_string(server.port());
  std::thread serving([&] { server.run(); });
  const std::string name =
      transport_detail::local_socket_name(asio::ip::make_address("127.0.0.1"), server.port());
  {  // A byte that brings no memory file, where one was due: the connection closes.
    RawLocal raw(name);
    REQUIRE(raw.join_offering_shared_memory(Node::worker(0)) == wire::kSharedMemoryFlag);
    REQUIRE(::send(raw.fd, "X", 1, MSG_NOSIGNAL) == 1);
    CHECK(raw.closed_by_ps());
  }
  {  // A file that is no ring (a pipe): the ps answers with none, and the socket's bytes serve.
    RawLocal raw(name);
    REQUIRE(raw.join_offering_shared_memory(Node::worker(0)) == wire::kSharedMemoryFlag);
    int pipe_ends[2];
    REQUIRE(::pipe(pipe_ends) == 0);
    REQUIRE(transport_detail::send_fd(raw.fd, pipe_ends[0]));
    ::close(pipe_ends[0]);
    ::close(pipe_ends[1]);
    CHECK(raw.answer() == -1);
    CHECK(raw.answers_on_socket(7));
  }
  {  // A ring larger than the ps's own: it maps none such (its pages would be had here,
     // beyond what the budget counts), answers with none, and the socket's bytes serve.
    RawLocal raw(name);
    REQUIRE(raw.join_offering_shared_memory(Node::worker(0)) == wire::kSharedMemoryFlag);
    const transport_detail::SharedRing large =
        transport_detail::SharedRing::make(4 * transport_detail::kLinkRingBytes);
    REQUIRE(large);
    REQUIRE(transport_detail::send_fd(raw.fd, large.fd()));
    CHECK(raw.answer() == -1);
    CHECK(raw.answers_on_socket(8));
  }
  {  // A ring, then garbage through it: the ps drops the connection, as for garbage on a socket.
    RawLocal raw(name);
    REQUIRE(raw.join_offering_shared_memory(Node::worker(0)) == wire::kSharedMemoryFlag);
    transport_detail::SharedRing mine =
        transport_detail::SharedRing::make(transport_detail::kLinkRingBytes);
    REQUIRE(mine);
    REQUIRE(transport_detail::send_fd(raw.fd, mine.fd()));
    const int theirs = raw.answer();
    REQUIRE(theirs >= 0);
    const transport_detail::SharedRing from_ps = transport_detail::SharedRing::open(theirs);
    CHECK(from_ps);
    const std::vector<std::byte> garbage(4096, std::byte{'x'});
    CHECK(mine.write(garbage, raw.fd) == garbage.size());
    ::send(raw.fd, "", 1, MSG_NOSIGNAL);  // (a doorbell, whether or not the ps sleeps yet)
    CHECK(raw.closed_by_ps());
  }
  // The ps serves on, through shared memory.
  Tcp after = client(Node::worker(0), {address});
  CHECK(std::holds_alternative<StatsReply>(after.call(0, GetStats{}).get()));
  CHECK(after.shared_memory(0));
  server.stop();
  serving.join();
}

TEST_CASE("an address of another host has no local socket names, this host's loopback and interfaces have") {
  CHECK(transport_detail::local_socket_names(asio::ip::make_address("192.0.2.7"), 2222).empty());  // TEST-NET-1
  if (!transport_detail::kLocalSockets) return;
  const auto names = transport_detail::local_socket_names(asio::ip::make_address("127.0.0.1"), 2222);
  REQUIRE(names.size() == 3);
  CHECK(names[0] == std::string("\0pulley/127.0.0.1:2222", 22));
  CHECK(names[1] == std::string("\0pulley/0.0.0.0:2222", 20));
  CHECK(names[2] == std::string("\0pulley/[::]:2222", 17));
  CHECK(transport_detail::local_socket_names(asio::ip::make_address("::1"), 2222).size() == 2);
}

TEST_CASE(
    "a connection attempt left behind by a wait that ended is begun again by the next call, not "
    "failed by it") {
  TcpServer listener(Server(0, 1, Sgd{0.1F}, SyncReplicas(1, 1), FixedShards{1}), "127.0.0.1", 0,
                     test_server_options());
  auto serving = std::async(std::launch::async, [&] { listener.run(); });
  pulley::testing::CutProxy proxy(listener.port(), 0.0, 5);
  TcpOptions options = test_client_options();
  options.attempt_timeout = std::chrono::milliseconds(1000);
  {
    Tcp tcp = client(Node::chief(), {"127.0.0.1:" + std::to_string(proxy.port())}, options);
    PendingCall first = tcp.call(0, GetStats{}, {});
    REQUIRE(first.wait_for(std::chrono::seconds(5)));
    CHECK(std::holds_alternative<StatsReply>(first.take()));
    // Cut off: the connection breaks (a call fails), and the attempt that follows hangs in
    // its handshake while its call's wait ends first.
    proxy.partition(true);
    bool broke = false, left_behind = false;
    for (int i = 0; i < 100 && !left_behind; ++i) {
      PendingCall call = tcp.call(0, GetStats{}, {});
      if (call.wait_for(std::chrono::milliseconds(100))) {
        broke = true;
      } else {
        left_behind = broke;
      }
    }
    REQUIRE(left_behind);
    // The caller pauses past attempt_timeout (a recovery's pause) while nobody waits on the
    // transport, and the ps is reachable again by the time it calls.
    std::this_thread::sleep_for(std::chrono::milliseconds(1300));
    proxy.partition(false);
    PendingCall again = tcp.call(0, GetStats{}, {});
    REQUIRE(again.wait_for(std::chrono::seconds(5)));
    const Response answer = again.take();
    if (const auto* error = std::get_if<ErrorReply>(&answer)) MESSAGE(error->message);
    CHECK(std::holds_alternative<StatsReply>(answer));
  }
  listener.stop();
  CHECK(serving.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
}
