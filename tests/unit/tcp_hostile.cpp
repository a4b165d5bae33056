// SPDX-License-Identifier: MIT
// Careless and hostile peers against a real TcpServer, while a job trains: each attack of
// issue 9's table, sent by a raw client that speaks the wire format. Every one must leave
// the ps serving, its memory under the stated bound (read from this process's own RSS: the
// ps runs here), the job's result equal to an unattacked run's (sync R = N over TCP is
// deterministic), and a log line that names the reason.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/runner/run.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/tcp.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/tcp.hpp"

using namespace pulley;
using pulley::testing::client;
// Checks (and prints, for the record) how far resident memory rose during an attack.
#define CHECK_GROWTH(what, before, bound_mib)                                             \
  do {                                                                                   \
    const std::int64_t grown = growth_since(before);                                     \
    std::printf("memory: %s: peak +%.1f MiB (bound %d MiB)\n", what,                     \
                static_cast<double>(grown) / (1 << 20), bound_mib);                      \
    if (kMeasureMemory) CHECK(grown < (std::int64_t{bound_mib} << 20U));                 \
  } while (false)
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using pulley::testing::LogCapture;
using pulley::testing::RawClient;
using pulley::testing::test_credentials;
using pulley::testing::test_server_options;

namespace {

constexpr std::size_t kIn = 5, kOut = 3, kBatch = 4;
constexpr std::int64_t kSteps = 60;
constexpr std::int64_t kPauseAt = 20;  // the workers wait here until the attack is done

using SyncServer = ParameterServer<RoundRobin, Adam, SyncReplicas>;
using AsyncServer = ParameterServer<RoundRobin, Sgd, Async>;

// Under AddressSanitizer freed memory is quarantined and shadowed: resident memory says
// nothing about what the ps holds, so the memory bounds are checked in plain builds only.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kMeasureMemory = false;
#else
constexpr bool kMeasureMemory = true;
#endif

/// Bytes this process holds in memory now, and at most since `reset_peak`.
std::uint64_t status_kib(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::stoull(line.substr(std::strlen(field))) << 10U;
  }
  return 0;
}
std::uint64_t resident() { return status_kib("VmRSS:"); }
std::uint64_t peak_resident() { return status_kib("VmHWM:"); }
/// How far the peak rose above `before` (the kernel's counters are approximate: a peak
/// may read a little below a later reading).
std::int64_t growth_since(std::uint64_t before) {
  return static_cast<std::int64_t>(peak_resident()) - static_cast<std::int64_t>(before);
}
/// Starts a new peak (Linux: writing 5 to clear_refs resets VmHWM to the current RSS).
void reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
}

/// One ps of the test job, served on a thread; stopped (if still running) when destroyed.
template <class Server>
struct Ps {
  explicit Ps(Server service, TcpServerOptions options = test_server_options())
      : server(std::move(service), "127.0.0.1", 0, options),
        port(server.port()),
        address("127.0.0.1:" + std::to_string(port)),
        thread([this] { server.run(); }) {}
  ~Ps() {
    server.stop();
    thread.join();
  }
  TcpServer<Server> server;
  std::uint16_t port;
  std::string address;
  std::thread thread;
};

/// Opens the workers' gate once.
class Gate {
 public:
  void open() {
    std::scoped_lock lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }
  void pass() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;
};

struct Outcome {
  std::vector<std::vector<float>> values;
  Stats stats;
};

/// An attack: gets the ps (port, address) and the workers' gate, which it opens when the
/// workers may go on (it is opened for it when it returns).
using Attack = std::function<void(Ps<SyncServer>& ps, Gate& gate)>;

/// Sync R = N = 2 training of a linear model with Adam against one ps over TCP. The workers
/// stop at step kPauseAt until `attack` is done (or opens the gate), so it strikes
/// mid-training; the result does not depend on timing. With `restart_worker_1`, worker 1's
/// process "restarts" there: its Worker (and its connection) goes before the attack, and a
/// new one carries on after it.
Outcome train(const Attack& attack = {}, bool restart_worker_1 = false) {
  Ps<SyncServer> ps(SyncServer(0, 1, Adam{0.01F}, SyncReplicas(2, 2)));
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  Chief chief(client(Node::chief(), {ps.address}), 7);
  chief.initialize(LinearModel(kIn, kOut).variables());
  Gate gate;
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      auto worker = std::make_unique<Worker<LinearModel, Tcp>>(
          w, LinearModel(kIn, kOut), client(Node::worker(w), {ps.address}));
      worker->wait_ready();
      for (std::int64_t k = 0;; ++k) {
        if (k == kPauseAt) {
          const bool restart = restart_worker_1 && w == 1;
          if (restart) worker.reset();
          gate.pass();
          if (restart) {
            worker = std::make_unique<Worker<LinearModel, Tcp>>(
                w, LinearModel(kIn, kOut), client(Node::worker(w), {ps.address}));
            worker->wait_ready();
          }
        }
        const std::size_t row = static_cast<std::size_t>(((k % kSteps) * 2 + w) * kBatch);
        const LinearBatch batch{std::span(data.x).subspan(row * kIn, kBatch * kIn),
                                std::span(data.y).subspan(row * kOut, kBatch * kOut)};
        if (!worker->step(batch, kSteps)) break;
      }
    });
  }
  if (attack) {
    CHECK(chief.wait_for_step(kPauseAt) >= kPauseAt);
    attack(ps, gate);
  }
  gate.open();
  for (auto& t : workers) t.join();
  Outcome outcome{chief.read_variables(), chief.stats().at(0)};
  chief.shutdown();
  return outcome;
}

/// The mean loss of the linear model with `values` over the training data.
float loss(const std::vector<std::vector<float>>& values) {
  const LinearData data(2 * kBatch * kSteps, kIn, kOut, 42);
  LinearModel model(kIn, kOut);
  for (std::size_t v = 0; v < values.size(); ++v) {
    std::copy(values[v].begin(), values[v].end(), model.parameter(v).begin());
  }
  return model.compute_gradients({data.x, data.y});
}

/// The variables as the chief initializes them (seed 7).
std::vector<std::vector<float>> initial_values() {
  std::vector<std::vector<float>> values;
  const LinearModel model(kIn, kOut);
  for (const VariableSpec& spec : model.variables()) {
    values.emplace_back(spec.size());
    initialize(spec, 7, values.back());
  }
  return values;
}

const Outcome& unattacked() {
  static const Outcome outcome = train();
  return outcome;
}

/// The job trained to the end, to the unattacked result, bit for bit.
void check_unharmed(const Outcome& attacked) {
  CHECK(attacked.stats.global_step == kSteps);
  CHECK(attacked.values == unattacked().values);
}

}  // namespace

TEST_CASE("a TcpServer without a secret refuses to start, unless told that anyone who knows the job's name may join") {
  using Server = ParameterServer<RoundRobin, Sgd, Async>;
  TcpServerOptions options;  // the defaults: job "pulley", no secret
  CHECK_THROWS_WITH_AS((TcpServer<Server>(Server(0, 1, Sgd{0.1F}, Async{}), "127.0.0.1", 0, options)),
                       doctest::Contains("allow_no_secret"), Error);
  LogCapture log;
  options.allow_no_secret = true;
  TcpServer<Server> open(Server(0, 1, Sgd{0.1F}, Async{}), "127.0.0.1", 0, options);
  CHECK(log.find(LogLevel::kWarning, "no shared secret is set").size() == 1);
  std::thread serving([&] { open.run(); });
  RawClient anyone;  // knows the default job name, proves nothing: let in, as the log warned
  CHECK(anyone.join(open.port(), Node::chief(), Credentials{}) == "");
  open.stop();
  serving.join();
}

TEST_CASE("a peer without the job's secret, or of another job, never reaches the ps") {
  LogCapture log;
  const Outcome outcome = train([&](Ps<SyncServer>& ps, Gate&) {
    RawClient stranger;  // the right job, a guessed secret
    const std::string refused = stranger.join(ps.port, Node::chief(), {"test-job", "guess"});
    CHECK(refused.find("did not prove the job's shared secret") != std::string::npos);
    RawClient other_job;  // another job's task with the same secret (two jobs, one port)
    Credentials other = test_credentials();
    other.job = "another-job";
    CHECK(other_job.join(ps.port, Node::worker(0), other).find("another-job") != std::string::npos);
    // A real client of the other job fails at once, naming both jobs, and is not retried.
    TcpOptions options;
    options.credentials = other;
    options.connect_timeout = std::chrono::seconds(30);
    const auto start = std::chrono::steady_clock::now();
    try {
      Tcp tcp(Node::worker(1), {ps.address}, options);
      FAIL("connected to another job's ps");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kUnauthenticated);
      CHECK(std::string(e.what()).find("'test-job'") != std::string::npos);
      CHECK(std::string(e.what()).find("'another-job'") != std::string::npos);
    }
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  });
  check_unharmed(outcome);
  CHECK(log.find(LogLevel::kWarning, "did not prove the job's shared secret").size() == 1);
  CHECK(log.find(LogLevel::kWarning, "a task of job 'another-job'").size() == 1);
}

TEST_CASE("Shutdown, Register and Initialize from a task that is not the chief are refused") {
  LogCapture log;
  const Outcome outcome = train([&](Ps<SyncServer>& ps, Gate&) {
    RawClient worker;
    REQUIRE(worker.join(ps.port, Node::worker(1)).empty());
    std::vector<char> body;
    worker.send(Shutdown{}, 1);
    wire::Header h = worker.receive(body);
    REQUIRE(h.call == 1);
    const Response answer = wire::decode_response(h, std::span(body).first(h.meta_bytes), {});
    REQUIRE(std::holds_alternative<ErrorReply>(answer));
    CHECK(std::get<ErrorReply>(answer).code == ErrorCode::kPermissionDenied);
    worker.send(Register{}, 2);
    h = worker.receive(body);
    CHECK(std::get<ErrorReply>(wire::decode_response(h, std::span(body).first(h.meta_bytes), {})).code ==
          ErrorCode::kPermissionDenied);
    RawClient evaluator;  // an evaluator may read, but not push or take tokens
    REQUIRE(evaluator.join(ps.port, Node::evaluator()).empty());
    evaluator.send(TakeToken{0}, 1);
    h = evaluator.receive(body);
    CHECK(std::get<ErrorReply>(wire::decode_response(h, std::span(body).first(h.meta_bytes), {})).code ==
          ErrorCode::kPermissionDenied);
    evaluator.send(GetStats{}, 2);
    h = evaluator.receive(body);
    CHECK(std::holds_alternative<StatsReply>(
        wire::decode_response(h, std::span(body).first(h.meta_bytes), {})));
  });
  check_unharmed(outcome);
  CHECK_FALSE(log.find(LogLevel::kWarning, "refused Shutdown from worker:1").empty());
  CHECK_FALSE(log.find(LogLevel::kWarning, "refused TakeToken from evaluator:0").empty());
}

TEST_CASE("a token taken by a connection that closes before pushing is given back") {
  LogCapture log;
  const Outcome outcome = train(
      [&](Ps<SyncServer>& ps, Gate& gate) {
        // Worker 1's process is gone (restarting). A process claiming worker 1 takes the
        // token of the step worker 1 needs next, and vanishes without pushing.
        RawClient taker;
        REQUIRE(taker.join(ps.port, Node::worker(1)).empty());
        taker.send(TakeToken{1}, 1);
        std::vector<char> body;
        REQUIRE(taker.receive(body).call == 1);
        // Its tokens are worker 1's only: asking for worker 0's is refused.
        taker.send(TakeToken{0}, 2);
        const wire::Header h = taker.receive(body);
        CHECK(std::get<ErrorReply>(wire::decode_response(h, std::span(body).first(h.meta_bytes), {}))
                  .code == ErrorCode::kPermissionDenied);
        gate.open();  // the restarted worker 1 asks for the token another process holds...
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        taker.socket.close();  // ...which comes back when that process's connection closes
      },
      /*restart_worker_1=*/true);
  check_unharmed(outcome);
  CHECK(log.wait_for(LogLevel::kInfo, "worker:1 disconnected holding its token: given back"));
  CHECK(log.find(LogLevel::kWarning, "refused TakeToken for worker 0 from worker:1").size() == 1);
}

TEST_CASE("a push that would overflow Adam's moments is rolled back, named and counted") {
  LogCapture log;
  const Outcome outcome = train([&](Ps<SyncServer>& ps, Gate&) {
    RawClient rogue;  // worker 0's identity, pushing for the step under way
    REQUIRE(rogue.join(ps.port, Node::worker(0)).empty());
    std::vector<char> body;
    rogue.send(GetStats{}, 1);
    wire::Header h = rogue.receive(body);
    const auto stats = std::get<StatsReply>(wire::decode_response(h, std::span(body).first(h.meta_bytes), {}));
    const std::vector<float> huge_kernel(kIn * kOut, 3e38F), huge_bias(kOut, 3e38F);
    rogue.send(Push{0, stats.stats.global_step, {{0, huge_kernel}, {1, huge_bias}}}, 2);
    REQUIRE(rogue.receive(body).call == 2);  // one of the step's R; its mean is checked
  });
  // The step it joined was rolled back (its mean would overflow Adam's second moment) and
  // nothing of it applied; worker 0's own batch of that step went to the next step.
  // Training ended as well as without it, every parameter finite.
  CHECK(outcome.stats.global_step == kSteps);
  CHECK(outcome.stats.updates_refused == 1);
  for (const auto& v : outcome.values) {
    for (const float x : v) CHECK(std::isfinite(x));
  }
  CHECK(loss(outcome.values) == doctest::Approx(loss(unattacked().values)).epsilon(0.05));
  CHECK(loss(outcome.values) < 0.5 * loss(initial_values()));
  const auto lines = log.find(LogLevel::kWarning, "rolled back the update of global step");
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("worker 0") != std::string::npos);
  CHECK(lines[0].find("linear/") != std::string::npos);
}

TEST_CASE("a pull listing the largest part over and over is refused before any reply") {
  LogCapture log;
  const Outcome outcome = train([&](Ps<SyncServer>& ps, Gate&) {
    RawClient greedy;
    REQUIRE(greedy.join(ps.port, Node::evaluator()).empty());
    Pull pull{0, std::vector<Slice>(200000, Slice{0, {0, kIn}})};  // ~4 MB of metadata
    reset_peak();
    const std::uint64_t before = resident();
    greedy.send(pull, 1);
    std::vector<char> body;
    const wire::Header h = greedy.receive(body);
    REQUIRE(h.call == 1);
    const Response answer = wire::decode_response(h, std::span(body).first(h.meta_bytes), {});
    REQUIRE(std::holds_alternative<ErrorReply>(answer));
    CHECK(std::get<ErrorReply>(answer).code == ErrorCode::kInvalidArgument);
    CHECK(std::get<ErrorReply>(answer).message.find("twice") != std::string::npos);
    // The request itself (4 MB, read into the ps's buffer and decoded): tens of MiB at
    // most, never the reply's 48 MB.
    CHECK_GROWTH("a pull of 200 000 slices", before, 32);
  });
  check_unharmed(outcome);
  CHECK(log.find(LogLevel::kWarning, "a pull asks for rows of variable 'linear/kernel' part 0 twice").size() == 1);
}

TEST_CASE("a client that never reads its replies costs the ps at most its buffer budget") {
  LogCapture log;
  constexpr std::size_t kFloats = (16U << 20U) / sizeof(float);  // a 16 MiB variable
  TcpServerOptions options = test_server_options();
  options.max_buffered_bytes = 24U << 20U;
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  Chief chief(client(Node::chief(), {ps.address}), 1);
  chief.initialize(std::vector<VariableSpec>{{"blob", {kFloats}, Initializer::constant(1.0F)}});
  const std::vector<float> gradient(kFloats, 1.0F);
  RawClient greedy;
  REQUIRE(greedy.join(ps.port, Node::evaluator()).empty());
  reset_peak();
  const std::uint64_t before = resident();
  for (std::uint64_t call = 1; call <= 4; ++call) greedy.send(Pull{0, {{0, {0, kFloats}}}}, call);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // A worker pushes: the greedy client's unread replies (~64 MB, viewing the parameters)
  // would have to be copied, which the 24 MiB budget cannot hold: that connection goes.
  {
    Tcp worker = client(Node::worker(0), {ps.address});
    for (int i = 0; i < 3; ++i) {
      Response r = worker.call(0, Push{0, 0, {{0, gradient}}}).get();
      REQUIRE(std::holds_alternative<PushReply>(r));
    }
  }
  CHECK(greedy.closed_by_ps());
  CHECK_GROWTH("64 MB of replies never read, 24 MiB budget", before, 40);  // + a push
  CHECK(log.wait_for(LogLevel::kWarning, "max_buffered_bytes"));
  const auto values = chief.read_variables();
  CHECK(values.at(0).front() == doctest::Approx(1.0F - 3 * 0.5F));
  CHECK(values.at(0).back() == doctest::Approx(1.0F - 3 * 0.5F));
  chief.shutdown();
}

TEST_CASE("a frame that claims more than the ps holds, or than its budget, is cut off") {
  LogCapture log;
  constexpr std::size_t kFloats = (64U << 20U) / sizeof(float);  // a 64 MiB variable
  TcpServerOptions options = test_server_options();
  options.max_buffered_bytes = 16U << 20U;
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  Tcp chief_link = client(Node::chief(), {ps.address});
  const std::vector<VariableSpec> model{{"blob", {kFloats}, Initializer::zeros()}};
  REQUIRE(std::holds_alternative<PlacementReply>(chief_link.call(0, Register{model}).get()));
  const std::vector<char> chunk(std::size_t{1} << 20U);

  // Claims 4 GiB - 4 and sends 256 MiB: refused at the header (the ps holds 64 MiB).
  reset_peak();
  std::uint64_t before = resident();
  {
    RawClient liar;
    REQUIRE(liar.join(ps.port, Node::worker(0)).empty());
    wire::Header claim;
    claim.kind = wire::kind_of<Push>();
    claim.payload_bytes = (std::uint64_t{4} << 30U) - 4;
    std::error_code ec;
    asio::write(liar.socket, asio::buffer(&claim, sizeof claim), ec);
    std::uint64_t sent = 0;
    while (!ec && sent < (std::uint64_t{256} << 20U)) sent += asio::write(liar.socket, asio::buffer(chunk), ec);
    CHECK(ec);  // cut off long before
  }
  CHECK_GROWTH("a 4 GiB claim, 256 MiB sent", before, 16);
  CHECK(log.wait_for(LogLevel::kWarning, "more than the 67108864 bytes a request to this ps can carry"));

  // Claims 64 MiB (what the ps holds) and sends it: the 16 MiB budget stops it midway.
  reset_peak();
  before = resident();
  {
    RawClient heavy;
    REQUIRE(heavy.join(ps.port, Node::worker(0)).empty());
    wire::Header claim;
    claim.kind = wire::kind_of<Push>();
    claim.payload_bytes = std::uint64_t{64} << 20U;
    std::error_code ec;
    asio::write(heavy.socket, asio::buffer(&claim, sizeof claim), ec);
    std::uint64_t sent = 0;
    while (!ec && sent < claim.payload_bytes) sent += asio::write(heavy.socket, asio::buffer(chunk), ec);
    CHECK(ec);
  }
  CHECK_GROWTH("a 64 MiB push against a 16 MiB budget", before, 24);
  CHECK(log.wait_for(LogLevel::kWarning, "memory budget (16 MiB across all connections)"));

  // The ps serves on.
  CHECK(std::holds_alternative<StatsReply>(chief_link.call(0, GetStats{}).get()));
  CHECK(std::holds_alternative<Ack>(chief_link.call(0, Shutdown{}).get()));
}

TEST_CASE("silent, stalled and trickling connections are closed at their deadlines") {
  LogCapture log;
  TcpServerOptions options = test_server_options();
  // Deadlines a loaded host (or the sanitizer build) meets with room for the test's own
  // handshakes, and well below the trickle's 3.2 s (the ps sweeps every 250 ms here).
  options.handshake_timeout = std::chrono::milliseconds(1000);
  options.frame_timeout = std::chrono::milliseconds(1000);
  options.idle_timeout = std::chrono::milliseconds(1500);
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  Tcp chief_link = client(Node::chief(), {ps.address});

  RawClient silent;  // connects and says nothing
  silent.connect(ps.port);
  CHECK(silent.closed_by_ps(std::chrono::seconds(5)));
  CHECK(log.wait_for(LogLevel::kWarning, "no handshake within 1000 ms"));

  RawClient stalled;  // half a frame, then nothing
  REQUIRE(stalled.join(ps.port, Node::worker(0)).empty());
  wire::Header half = wire::encode(Request{Shutdown{}}, 1).header;
  asio::write(stalled.socket, asio::buffer(&half, sizeof half));  // its metadata never comes
  CHECK(stalled.closed_by_ps(std::chrono::seconds(5)));

  RawClient trickle;  // one byte every 100 ms: the 32-byte header alone would take 3.2 s
  REQUIRE(trickle.join(ps.port, Node::worker(0)).empty());
  const wire::Frame frame = wire::encode(Request{GetStats{}}, 1);
  const auto* bytes = reinterpret_cast<const char*>(&frame.header);
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  for (std::size_t i = 0; i < sizeof frame.header && !ec; ++i) {
    asio::write(trickle.socket, asio::buffer(bytes + i, 1), ec);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(ec);  // cut off before the header was whole
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(3000));
  CHECK(log.find(LogLevel::kWarning, "is still not complete").size() == 2);

  RawClient idle;  // in, and then idle
  REQUIRE(idle.join(ps.port, Node::evaluator()).empty());
  CHECK(idle.closed_by_ps(std::chrono::seconds(5)));
  CHECK(log.wait_for(LogLevel::kInfo, "closing idle connection from evaluator:0"));

  // The chief's own connection went idle too; its next call reconnects, and is served.
  CHECK(std::holds_alternative<StatsReply>(chief_link.call(0, GetStats{}).get()));
  CHECK(std::holds_alternative<Ack>(chief_link.call(0, Shutdown{}).get()));
}

TEST_CASE("connections over the limit are closed at once, and the ps serves on") {
  LogCapture log;
  TcpServerOptions options = test_server_options();
  options.max_connections = 3;
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<RawClient>());
    REQUIRE(held.back()->join(ps.port, Node::worker(static_cast<std::uint32_t>(i))).empty());
  }
  RawClient one_more;  // proves the secret, and finds the job's connections full
  CHECK(one_more.join(ps.port, Node::worker(3)) == "no answer to the hello");
  CHECK(log.wait_for(LogLevel::kWarning, "3 connections of the job are open (TcpServerOptions::max_connections)"));
  held.clear();  // they leave; there is room again
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Tcp chief_link = client(Node::chief(), {ps.address});
  CHECK(std::holds_alternative<StatsReply>(chief_link.call(0, GetStats{}).get()));
  CHECK(std::holds_alternative<Ack>(chief_link.call(0, Shutdown{}).get()));
}

TEST_CASE("connections that never finish the handshake cannot keep the job's tasks out") {
  LogCapture log;
  TcpServerOptions options = test_server_options();
  options.max_handshaking = 4;
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  RawClient worker;  // a task of the job, connected before the flood
  REQUIRE(worker.join(ps.port, Node::worker(0)).empty());
  std::vector<std::unique_ptr<RawClient>> flood;
  for (int i = 0; i < 12; ++i) {  // three times the cap, none of them answering the challenge
    flood.push_back(std::make_unique<RawClient>());
    flood.back()->connect(ps.port);
  }
  // The chief connects in the middle of the flood: the oldest silent ones make room.
  Tcp chief_link = client(Node::chief(), {ps.address});
  CHECK(std::holds_alternative<StatsReply>(chief_link.call(0, GetStats{}).get()));
  int closed = 0;
  for (auto& f : flood) closed += f->closed_by_ps(std::chrono::milliseconds(200)) ? 1 : 0;
  CHECK(closed >= 8);  // at most 4 wait in the handshake at a time
  CHECK(log.wait_for(LogLevel::kWarning, "4 connections are in the handshake (TcpServerOptions::max_handshaking)"));
  // The task connected before is still served.
  worker.send(GetStats{}, 5);
  std::vector<char> body;
  CHECK(worker.receive(body).call == 5);
  CHECK(std::holds_alternative<Ack>(chief_link.call(0, Shutdown{}).get()));
}

TEST_CASE("a client with the job's secret that claims a task outside the cluster is refused") {
  LogCapture log;
  TcpServerOptions options = test_server_options();
  options.tasks = {{Node::Role::kWorker, 2}, {Node::Role::kChief, 1}};
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  RawClient seventh;
  CHECK(seventh.join(ps.port, Node::worker(7)) == "worker:7 is not a task of this job (it has 2 worker tasks)");
  RawClient evaluator;
  CHECK(evaluator.join(ps.port, Node::evaluator()) == "evaluator:0 is not a task of this job (it has 0 evaluator tasks)");
  RawClient second;
  CHECK(second.join(ps.port, Node::worker(1)).empty());
  // A real client claiming worker 7 fails at once, naming why.
  try {
    Tcp tcp(Node::worker(7), {ps.address}, [] {
      TcpOptions o = pulley::testing::test_client_options();
      o.credentials = test_credentials();
      return o;
    }());
    FAIL("worker:7 was let in");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnauthenticated);
    CHECK(std::string(e.what()).find("worker:7 is not a task of this job") != std::string::npos);
  }
  Tcp chief_link = client(Node::chief(), {ps.address});
  CHECK(std::holds_alternative<Ack>(chief_link.call(0, Shutdown{}).get()));
}

TEST_CASE("a second process claiming a live task is refused, and one in place of a dead one gets in") {
  LogCapture log;
  TcpServerOptions options = test_server_options();
  // Long enough that a loaded host's pauses cannot pass for a process's silence: the
  // checks below that a live process keeps its task rely on it.
  options.takeover_after = std::chrono::milliseconds(2500);
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}), options);
  RawClient first, second_link, impostor, later;
  CHECK(first.join(ps.port, Node::worker(1), test_credentials(), 11).empty());
  CHECK(second_link.join(ps.port, Node::worker(1), test_credentials(), 11).empty());  // same process
  const std::string refused = impostor.join(ps.port, Node::worker(1), test_credentials(), 22);
  CHECK(refused.find("worker:1 is another live process's") != std::string::npos);
  CHECK(log.wait_for(LogLevel::kWarning, "one process per task"));
  // A hello that names no process is refused (else it would pass for any).
  RawClient unnamed;
  CHECK(unnamed.join(ps.port, Node::worker(1), test_credentials(), 0).find("names no process") != std::string::npos);
  // Another task of the job is not held by it.
  RawClient other;
  CHECK(other.join(ps.port, Node::worker(0), test_credentials(), 22).empty());
  // The first process's connections go silent: after takeover_after another process may be
  // worker 1 (a restarted task whose old host is gone).
  std::this_thread::sleep_for(options.takeover_after + std::chrono::milliseconds(200));
  CHECK(later.join(ps.port, Node::worker(1), test_credentials(), 33).empty());
  // The silent connections of the process before are closed: one process is worker 1.
  CHECK(first.closed_by_ps(std::chrono::milliseconds(500)));
  CHECK(second_link.closed_by_ps(std::chrono::milliseconds(500)));
  // And a process whose old connections closed gets in at once.
  RawClient next;
  CHECK(next.join(ps.port, Node::worker(2), test_credentials(), 44).empty());
  next.socket.close();
  // Refused only until the ps has seen it close: then let in, long before takeover_after.
  std::optional<RawClient> restarted;
  std::string refusal = "not tried";
  const auto closed_at = std::chrono::steady_clock::now();
  for (int i = 0; i < 100 && !refusal.empty(); ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    restarted.emplace();
    refusal = restarted->join(ps.port, Node::worker(2), test_credentials(), 55);
  }
  CHECK(refusal.empty());
  CHECK(std::chrono::steady_clock::now() - closed_at < options.takeover_after);  // not let in by takeover
  // A real client refused so retries, and fails kUnavailable (recoverable) naming why
  // (worker 2's process was just heard, and stays live for takeover_after).
  restarted->send(GetStats{}, 1);
  std::vector<char> body;
  REQUIRE(restarted->receive(body).call == 1);
  try {
    Tcp tcp(Node::worker(2), {ps.address}, [] {
      TcpOptions o = pulley::testing::test_client_options();
      o.credentials = test_credentials();
      o.connect_timeout = std::chrono::milliseconds(600);
      return o;
    }());
    FAIL("a second process was let in as worker:2");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.what()).find("worker:2 is another live process's") != std::string::npos);
  }
}

TEST_CASE("a task of another job fails at once and exits non-zero, naming both jobs") {
  LogCapture log;
  Ps<AsyncServer> ps(AsyncServer(0, 1, Sgd{0.5F}, Async{}));
  Job job;
  job.cluster = TfConfig{ClusterSpec{{{"ps", {ps.address}}, {"worker", {"127.0.0.1:1"}}}},
                         TaskSpec{"worker", 0}};
  job.credentials = {"the-other-job", test_credentials().secret};
  Training<LinearModel> training;
  training.model = [] { return LinearModel(kIn, kOut); };
  const LinearData data(kBatch, kIn, kOut, 1);
  training.data = [&](const DataShard&) {
    return [&] { return LinearBatch{data.x, data.y}; };
  };
  training.last_step = 10;
  training.tcp.connect_timeout = std::chrono::seconds(30);
  const auto start = std::chrono::steady_clock::now();
  CHECK(run(job, training, RoundRobin{}, Sgd{0.1F}, Async{}) == 1);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  CHECK_FALSE(log.find(LogLevel::kError, "it serves job 'test-job', and this task belongs to job "
                                         "'the-other-job'").empty());
}
