// SPDX-License-Identifier: MIT
// pulley's push/pull throughput and latency, in-process and over TCP loopback, each printed
// with its ratio to a reference measured in the same run: memcpy (in-process), a raw Asio
// echo of the same bytes (TCP push+pull, which is Worker::push_pull: one round trip), a raw
// one-way transfer with a 1-byte acknowledgement (TCP push alone, pull alone), a 64-byte TCP
// ping-pong (latency), a raw connect with a 64-byte exchange (a new connection: the TCP
// handshake's cost), and a plain loop doing the optimizer's math (server-side apply, alone
// and with the finiteness check the ps makes of every push).
//
// The machine may be shared and noisy, so each case and its reference are measured in
// alternating rounds, and the medians are compared: a ratio compares figures taken moments
// apart. The range of the rounds' own ratios follows each line.
//
//   push_pull [--seconds-per-case 1.0] [--rounds 5] [--apply-only] [--only TEXT]
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pulley/ps/shard.hpp"
#include "pulley/ps/update.hpp"
#include "pulley/pulley.hpp"
#include "pulley/transport/tcp.hpp"
#include "support/plain_ftrl.hpp"
#include "support/references.hpp"

namespace {

namespace bench = pulley::bench;

using Clock = std::chrono::steady_clock;
double g_seconds = 1.0;  ///< per case and side, over all rounds
int g_rounds = 5;

/// Runs `f` repeatedly for about one round's time (after one warm-up); returns seconds per
/// call.
/// One ps's Shard holding a variable of n floats, and the Update that applies pushes to
/// it under Async: a push is an update, as the ps takes it.
template <class O>
class PsOfOnePart {
 public:
  PsOfOnePart(const O& optimizer, std::size_t n) : shard_(0, optimizer, pulley::NoTables{}) {
    std::vector<pulley::VariableSpec> model{{"w", {n}, {}}};
    const std::uint32_t members[] = {0};
    auto placement = pulley::RoundRobin{}.place(model, 1);
    shard_.assign(pulley::Register{std::move(model), {}, 1}, std::move(placement), members, sync_);
    const std::vector<float> ones(n, 1.0F);
    shard_.initialize({pulley::PartValues{0, ones}});
  }
  /// Takes a push of `g`, no element larger than `largest` (+infinity: not known).
  void push(const std::vector<float>& g, float largest) {
    const auto out = update_.take(shard_, sync_, pulley::Push{0, step_, {{0, g}}}, pulley::Verdict::kReady,
                                  step_, stats_, largest);
    ++step_;
    if (!out.refused.empty()) std::abort();
  }

 private:
  pulley::Async sync_;
  pulley::Shard<O, pulley::Async, pulley::NoTables> shard_;
  pulley::Update<O, pulley::Async, pulley::NoTables> update_;
  pulley::Stats stats_;
  std::int64_t step_ = 0;
};

double time_per_call(const std::function<void()>& f) {
  f();
  int calls = 0;
  const auto start = Clock::now();
  double elapsed = 0.0;
  do {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < g_seconds / g_rounds);
  return elapsed / calls;
}

/// A case and its reference, measured in alternating rounds: seconds per call (medians),
/// and the lowest and highest of the rounds' ratios (reference time / case time).
struct Paired {
  double seconds = 0.0;
  double reference = 0.0;
  double low = 0.0;
  double high = 0.0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Each function returns seconds per call, measured for one round.
Paired paired(const std::function<double()>& measure, const std::function<double()>& reference) {
  std::vector<double> ours, refs, ratios;
  for (int r = 0; r < g_rounds; ++r) {
    refs.push_back(reference());
    ours.push_back(measure());
    ratios.push_back(refs.back() / ours.back());
  }
  return {median(ours), median(refs), *std::min_element(ratios.begin(), ratios.end()),
          *std::max_element(ratios.begin(), ratios.end())};
}

/// One variable of n floats; the gradient is constant.
class Blob {
 public:
  struct Batch {};
  explicit Blob(std::size_t n)
      : spec_{{"blob", {n}, pulley::Initializer::zeros()}}, w_(n), g_(n, 1e-3F) {}
  std::span<const pulley::VariableSpec> variables() const { return spec_; }
  std::span<float> parameter(std::size_t) { return w_; }
  std::span<const float> gradient(std::size_t) const { return g_; }
  float compute_gradients(const Batch&) { return 0.0F; }

 private:
  std::vector<pulley::VariableSpec> spec_;
  std::vector<float> w_, g_;
};

using Server = pulley::ParameterServer<pulley::RoundRobin, pulley::Sgd, pulley::Async>;

/// What one timed call does.
enum class Op { kPush, kPull, kPushPull };

/// Seconds per `op` on n floats by each of `workers` concurrent workers.
template <class MakeTransport>
double push_pull(std::size_t n, std::uint32_t workers, Op op, MakeTransport make) {
  pulley::Chief chief(make(pulley::Node::chief()), 1);
  chief.initialize(Blob(n).variables());
  std::vector<double> per_call(workers);
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      pulley::Worker worker(w, Blob(n), make(pulley::Node::worker(w)));
      worker.wait_ready();
      per_call[w] = time_per_call([&] {
        if (op == Op::kPush) worker.push(0);
        if (op == Op::kPull) worker.pull();
        if (op == Op::kPushPull) worker.push_pull(0, 0);  // one round trip
      });
    });
  }
  for (auto& t : threads) t.join();
  chief.shutdown();
  return *std::max_element(per_call.begin(), per_call.end());
}

double in_process(std::size_t n, std::uint32_t workers, Op op) {
  pulley::InProcessNetwork network(1);
  network.serve(Server(0, 1, pulley::Sgd{0.0F}, pulley::Async{}));
  return push_pull(n, workers, op,
                   [&](pulley::Node node) { return pulley::InProcess(network, node); });
}

/// How a client on the ps's host reaches it.
enum class Link {
  kTcp,     ///< TCP loopback
  kLocal,   ///< the ps's local socket, its bytes on the socket (TcpOptions::shared_memory off)
  kShared,  ///< the local socket, its bytes through shared memory (the default on one host)
};

double over_tcp(std::size_t n, std::uint32_t workers, Op op, Link link = Link::kTcp) {
  const pulley::Credentials job{"push-pull", "the benchmark's secret"};
  pulley::TcpServerOptions serving;
  serving.credentials = job;
  pulley::TcpServer listener(Server(0, 1, pulley::Sgd{0.0F}, pulley::Async{}), "127.0.0.1", 0,
                             serving);
  const std::string address = "127.0.0.1:" + std::to_string(listener.port());
  std::thread serving_thread([&] { listener.run(); });
  pulley::TcpOptions options;
  options.credentials = job;
  options.local_sockets = link != Link::kTcp;
  options.shared_memory = link == Link::kShared;
  const double t = push_pull(n, workers, op, [&](pulley::Node node) {
    return pulley::Tcp(node, {address}, options);
  });
  serving_thread.join();
  return t;
}

/// Seconds to open a Tcp to a ps (TCP connect and the handshake) and make a first call.
double tcp_first_call() {
  const pulley::Credentials job{"push-pull", "the benchmark's secret"};
  pulley::TcpServerOptions serving;
  serving.credentials = job;
  pulley::TcpServer listener(Server(0, 1, pulley::Sgd{0.0F}, pulley::Async{}), "127.0.0.1", 0,
                             serving);
  const std::string address = "127.0.0.1:" + std::to_string(listener.port());
  std::thread serving_thread([&] { listener.run(); });
  pulley::TcpOptions options;
  options.credentials = job;
  options.local_sockets = false;
  const double t = time_per_call([&] {
    pulley::Tcp tcp(pulley::Node::chief(), {address}, options);
    (void)tcp.call(0, pulley::GetStats{}).get();
  });
  listener.stop();
  serving_thread.join();
  return t;
}

/// Seconds to open a raw TCP connection and exchange 64 bytes each way: what a first call
/// costs with no protocol.
double raw_first_exchange() {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  std::atomic<bool> done{false};
  std::thread echo([&] {
    while (!done) {
      asio::ip::tcp::socket peer = acceptor.accept();
      std::array<char, 64> buffer{};
      std::error_code ec;
      asio::read(peer, asio::buffer(buffer), ec);
      if (!ec) asio::write(peer, asio::buffer(buffer), ec);
    }
  });
  std::array<char, 64> out{}, in{};
  const double t = time_per_call([&] {
    asio::ip::tcp::socket client(io);
    client.connect(acceptor.local_endpoint());
    client.set_option(asio::ip::tcp::no_delay(true));
    asio::write(client, asio::buffer(out));
    asio::read(client, asio::buffer(in));
  });
  done = true;
  asio::ip::tcp::socket last(io);  // wakes the accept loop to see `done`
  last.connect(acceptor.local_endpoint());
  last.close();
  echo.join();
  return t;
}

/// Seconds per raw exchange over loopback with no protocol at all (bench::RawLoopback).
double raw_exchange(std::size_t out_bytes, std::size_t back_bytes) {
  bench::RawLoopback link(out_bytes, back_bytes);
  return time_per_call([&] { link.exchange(); });
}

double memcpy_time(std::size_t bytes) {
  bench::Memcpy copy(bytes);
  return time_per_call(copy);
}

/// Only the cases whose name contains this are measured (`--only`; empty: every case): the
/// transport's, or with `--apply-only` the apply's.
std::string g_only;

/// One line: the case's figure, its reference's, their ratio (of medians) and the range of
/// the rounds' ratios, unless `--only` leaves the case out (then nothing is measured).
/// `measure` measures both (`paired`); `per_second` turns seconds per call into the figure
/// (e.g. GB/s); nullptr prints microseconds per call (latency) instead.
void print(const std::string& what, const std::function<Paired()>& measure,
           double (*per_second)(double), const char* unit, const char* ref) {
  if (what.find(g_only) == std::string::npos) return;
  const Paired p = measure();
  const bool latency = per_second == nullptr;
  const double value = latency ? p.seconds * 1e6 : per_second(p.seconds);
  const double reference = latency ? p.reference * 1e6 : per_second(p.reference);
  const double ratio = latency ? p.seconds / p.reference : p.reference / p.seconds;
  std::printf("%-40s %9.2f %-5s ref %-20s %9.2f %-5s ratio %.2f (rounds %.2f-%.2f)\n", what.c_str(),
              value, unit, ref, reference, unit, ratio, latency ? 1.0 / p.high : p.low,
              latency ? 1.0 / p.low : p.high);
  std::fflush(stdout);
}

std::size_t g_bytes = 0;  ///< the tensor size of the case being printed
double gb_per_s(double seconds) { return static_cast<double>(g_bytes) / seconds / 1e9; }
double two_gb_per_s(double seconds) { return 2.0 * gb_per_s(seconds); }  // pushed + pulled

}  // namespace

int main(int argc, char** argv) {
  const auto usage = [&](std::FILE* to) {
    std::fprintf(
        to,
        "usage: %s [--seconds-per-case S (1.0)] [--rounds N (5)] [--apply-only] [--only TEXT]\n"
        "  pulley's push/pull throughput and latency, in-process and over TCP loopback,\n"
        "  each beside a reference measured in the same run (memcpy, a raw Asio echo, ...);\n"
        "  then the ps's update of a 16M-float part (--apply-only: that alone);\n"
        "  --only TEXT: only the cases whose name contains TEXT, of the transport's (of the\n"
        "  apply's, with --apply-only)\n",
        argv[0]);
  };
  bool apply_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      usage(stdout);
      return 0;
    }
    if (flag == "--apply-only") {
      apply_only = true;
      continue;
    }
    char* end = nullptr;
    const bool has_value = i + 1 < argc;
    if (flag == "--seconds-per-case" && has_value) {
      g_seconds = std::strtod(argv[++i], &end);
      if (*end == '\0' && g_seconds > 0 && g_seconds < 1e6) continue;
    } else if (flag == "--only" && has_value) {
      g_only = argv[++i];
      continue;
    } else if (flag == "--rounds" && has_value) {
      g_rounds = static_cast<int>(std::strtol(argv[++i], &end, 10));
      if (*end == '\0' && g_rounds >= 1 && g_rounds <= 1000) continue;
    }
    const bool took_value = end != nullptr;  // argv[i] is then the flag's value
    std::fprintf(stderr, "push_pull: bad argument: %s%s%s\n", flag.c_str(), took_value ? " " : "",
                 took_value
                     ? argv[i]
                     : (flag == "--rounds" || flag == "--seconds-per-case" || flag == "--only"
                            ? " (no value)"
                            : ""));
    usage(stderr);
    return 2;
  }
  std::printf(
      "pulley push/pull benchmark (%g s per case and side, in %d alternating rounds; "
      "bandwidth = bytes pushed + pulled)\n\n",
      g_seconds, g_rounds);
  for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{1} << 20, std::size_t{16} << 20}) {
    if (apply_only) break;
    g_bytes = bytes;
    const std::size_t n = bytes / sizeof(float);
    const std::string size = bytes < (1 << 20) ? std::to_string(bytes >> 10) + " KB"
                                               : std::to_string(bytes >> 20) + " MB";
    // memcpy moving as many bytes as a push+pull does (2 x bytes), at memcpy's bandwidth.
    auto copy = [&] { return 2.0 * memcpy_time(bytes); };
    auto echo = [&] { return raw_exchange(bytes, bytes); };
    auto one_way = [&] { return raw_exchange(bytes, 1); };
    for (std::uint32_t workers : {1U, 2U}) {
      // Bandwidth over all workers: each moves 2 x bytes per call.
      const double w = workers;
      const std::string who =
          std::to_string(workers) + " worker" + (workers > 1 ? "s" : "") + ", " + size;
      print(
          "in-process push+pull, " + who,
          [&] { return paired([&] { return in_process(n, workers, Op::kPushPull) / w; }, copy); },
          two_gb_per_s, "GB/s", "memcpy");
      print(
          "TCP push+pull, " + who,
          [&] { return paired([&] { return over_tcp(n, workers, Op::kPushPull) / w; }, echo); },
          two_gb_per_s, "GB/s", "raw loopback echo");
      print(
          "local-socket push+pull, " + who,
          [&] {
            return paired([&] { return over_tcp(n, workers, Op::kPushPull, Link::kLocal) / w; },
                          echo);
          },
          two_gb_per_s, "GB/s", "raw loopback echo");
      print(
          "shared-memory push+pull, " + who,
          [&] {
            return paired([&] { return over_tcp(n, workers, Op::kPushPull, Link::kShared) / w; },
                          copy);
          },
          two_gb_per_s, "GB/s", "memcpy");
      if (workers == 1) {
        print(
            "TCP push, " + who,
            [&] { return paired([&] { return over_tcp(n, 1, Op::kPush); }, one_way); }, gb_per_s,
            "GB/s", "raw one-way + ack");
        print(
            "TCP pull, " + who,
            [&] { return paired([&] { return over_tcp(n, 1, Op::kPull); }, one_way); }, gb_per_s,
            "GB/s", "raw one-way + ack");
      }
      if (bytes == (std::size_t{4} << 10) && workers == 1) {
        auto ping_pong = [] { return raw_exchange(64, 64); };
        print(
            "TCP push+pull latency, " + size,
            [&] { return paired([&] { return over_tcp(n, 1, Op::kPushPull); }, ping_pong); },
            nullptr, "us", "64 B ping-pong");
        print(
            "in-process push+pull latency, " + size,
            [&] { return paired([&] { return in_process(n, 1, Op::kPushPull); }, ping_pong); },
            nullptr, "us", "64 B ping-pong");
      }
    }
  }

  // A connection's cost: TCP connect, the handshake (a nonce each way, two HMACs) and a
  // first round trip, against a raw connect and a 64-byte exchange.
  if (!apply_only) {
    print(
        "TCP connect + handshake + first call",
        [&] { return paired(tcp_first_call, raw_first_exchange); }, nullptr, "us",
        "connect + 64 B ping-pong");
  }

  // The transport's cases alone (`--only` without `--apply-only`): no apply case, and none
  // of their gigabyte of inputs either, whose page faults would weigh on a profile.
  if (!g_only.empty() && !apply_only) return 0;
  // Server-side application over 16M floats against a plain loop doing the same math.
  const std::size_t n = std::size_t{16} << 20;
  g_bytes = n;  // "bandwidth" in G floats per second
  std::vector<float> w(n, 1.0F), g(n, 1e-3F);
  const pulley::Sgd sgd{0.01F};
  auto sgd_state = sgd.make_state(n);
  print(
      "server Sgd::apply, 16M floats",
      [&] {
        return paired([&] { return time_per_call([&] { sgd.apply(sgd_state, w, g); }); },
                      [&] {
                        return time_per_call([&] {
                          for (std::size_t i = 0; i < n; ++i) w[i] -= 0.01F * g[i];
                        });
                      });
      },
      gb_per_s, "Gf/s", "plain loop");
  // What the ps does per push with a stock optimizer: ask it whether the update stays
  // finite (reads the weights, the slots and the gradient), then apply.
  print(
      "server Sgd check + apply, 16M floats",
      [&] {
        return paired(
            [&] {
              return time_per_call([&] {
                if (sgd.stays_finite(sgd_state, w, g)) sgd.apply(sgd_state, w, g);
              });
            },
            [&] {
              return time_per_call([&] {
                for (std::size_t i = 0; i < n; ++i) w[i] -= 0.01F * g[i];
              });
            });
      },
      gb_per_s, "Gf/s", "plain loop");
  // What the ps does now: its Update proves the push finite from magnitudes (the part's,
  // measured by its last update, and the gradient's: given by the TCP transport, which
  // measures a push as it checks it arrived finite, or by the client in the ps's process,
  // which measures it as it checks it before sending; read again for a push made by hand)
  // and reads the part once; the full check above runs only where that proves nothing.
  // Against the optimizer's apply alone, on a part of the same size.
  const auto ps_update = [&](const auto& optimizer, float largest) {
    return paired(
        [&] {
          PsOfOnePart ps(optimizer, n);
          ps.push(g, largest);  // bounds the part
          return time_per_call([&] { ps.push(g, largest); });
        },
        [&] {
          auto state = optimizer.make_state(n);
          return time_per_call([&] { optimizer.apply(state, w, g); });
        });
  };
  const float ordinary = pulley::kOrdinaryMagnitude;  // the gradient's bound, as TCP or the client tell it
  const float unknown = std::numeric_limits<float>::infinity();
  print(
      "ps Sgd update, gradient bound told (TCP, client)", [&] { return ps_update(sgd, ordinary); },
      gb_per_s, "Gf/s", "Sgd::apply alone");
  print(
      "ps Sgd update, gradient read again (hand-made push)",
      [&] { return ps_update(sgd, unknown); }, gb_per_s, "Gf/s", "Sgd::apply alone");
  const pulley::Adam adam{};
  auto adam_state = adam.make_state(n);
  std::vector<float> m(n), v(n);
  // Adam's rule as a plain loop, the reference of the Adam cases.
  const auto plain_adam = [&] {
    return time_per_call([&] {
      const float lr = 0.001F;
      for (std::size_t i = 0; i < n; ++i) {
        m[i] = 0.9F * m[i] + 0.1F * g[i];
        v[i] = 0.999F * v[i] + 0.001F * g[i] * g[i];
        w[i] -= lr * m[i] / (std::sqrt(v[i]) + 1e-7F);
      }
    });
  };
  print(
      "server Adam::apply, 16M floats",
      [&] {
        return paired([&] { return time_per_call([&] { adam.apply(adam_state, w, g); }); },
                      plain_adam);
      },
      gb_per_s, "Gf/s", "plain loop");
  // What Adam's check costs inside apply: its vector lanes alone, the same rule with no
  // check at all (what `apply` would be if nothing were checked).
  print(
      "server Adam::apply, 16M floats / no check",
      [&] {
        return paired([&] { return time_per_call([&] { adam.apply(adam_state, w, g); }); },
                      [&] {
                        return time_per_call([&] {
                          const float lr_t = 0.001F, b1 = adam.beta_1, b2 = adam.beta_2,
                                      eps = adam.epsilon;
                          pulley::detail::lanewise(
                              0, n,
                              [=](auto gi, auto& wi, auto& mi, auto& vi) {
                                using std::sqrt;
                                mi = b1 * mi + (1.0F - b1) * gi;
                                vi = b2 * vi + (1.0F - b2) * gi * gi;
                                wi -= lr_t * mi / (sqrt(vi) + eps);
                              },
                              g.data(), w.data(), m.data(), v.data());
                        });
                      });
      },
      gb_per_s, "Gf/s", "the same lanes, unchecked");
  print(
      "server Adam check + apply, 16M floats",
      [&] {
        return paired(
            [&] {
              return time_per_call([&] {
                if (adam.stays_finite(adam_state, w, g)) adam.apply(adam_state, w, g);
              });
            },
            plain_adam);
      },
      gb_per_s, "Gf/s", "plain loop");
  print(
      "ps Adam update, gradient bound told (TCP, client)",
      [&] { return ps_update(adam, ordinary); }, gb_per_s, "Gf/s", "Adam::apply alone");
  print(
      "ps Adam update, gradient read again (hand-made push)",
      [&] { return ps_update(adam, unknown); }, gb_per_s, "Gf/s", "Adam::apply alone");
  // FTRL (Keras' defaults: learning_rate_power -0.5, no regularization) proves its updates
  // from magnitudes too, the weights solved from slots at or above their start.
  const pulley::Ftrl ftrl{};
  auto ftrl_state = ftrl.make_state(n);
  std::vector<float> accumulator(n, ftrl.initial_accumulator_value), linear(n);
  print(
      "server Ftrl::apply, 16M floats",
      [&] {
        return paired([&] { return time_per_call([&] { ftrl.apply(ftrl_state, w, g); }); },
                      [&] {
                        return time_per_call([&] {
                          pulley::bench::plain_ftrl(w.data(), accumulator.data(), linear.data(),
                                                    g.data(), n, ftrl.learning_rate);
                        });
                      });
      },
      gb_per_s, "Gf/s", "plain loop");
  // What Ftrl's bound costs inside apply: the same rule in the same lanes with nothing
  // judged, as apply_row runs it (a row of 16M elements, its two slots side by side).
  std::vector<float> ftrl_slots(2 * n);
  ftrl.init_row(ftrl_slots);
  print(
      "server Ftrl::apply, 16M floats / no check",
      [&] {
        return paired(
            [&] { return time_per_call([&] { ftrl.apply(ftrl_state, w, g); }); },
            [&] {
              return time_per_call([&] { ftrl.apply_row(w, ftrl_slots, g, pulley::RowContext{}); });
            });
      },
      gb_per_s, "Gf/s", "the same lanes, unchecked");
  print(
      "ps Ftrl update, gradient bound told (TCP, client)",
      [&] { return ps_update(ftrl, ordinary); }, gb_per_s, "Gf/s", "Ftrl::apply alone");
  print(
      "ps Ftrl update, gradient read again (hand-made push)",
      [&] { return ps_update(ftrl, unknown); }, gb_per_s, "Gf/s", "Ftrl::apply alone");
  return 0;
}
