// SPDX-License-Identifier: MIT
// The ring all-reduce among N processes on one host (TcpRing, linked through shared memory,
// through local sockets and over TCP loopback) and N threads (InProcessRing): bus bandwidth, the standard
// 2 (N - 1) / N x bytes / time, for 16 MB, against one raw TCP stream (and one raw
// local-socket stream) of the same bytes measured in the same run; and the time per ring
// step for 4 KB tensors against one TCP round trip. Prints figures and ratios; asserts
// nothing.
//
//   all_reduce [--ranks 2,4] [--mb 16] [--iterations 10] [--segment FLOATS]

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pulley/collective/ring_all_reduce.hpp"
#include "pulley/transport/in_process_ring.hpp"
#include "pulley/transport/tcp_ring.hpp"
#include "support/references.hpp"

using namespace pulley;
using Clock = std::chrono::steady_clock;

namespace {
std::size_t g_segment = RingAllReduce::kDefaultSegment;  // --segment
}  // namespace

namespace {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The median of `runs` timings of `body`, in seconds.
template <class Body>
double median_seconds(int runs, Body body) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto start = Clock::now();
    body();
    t.push_back(seconds_since(start));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<std::string> free_addresses(std::size_t n) {
  asio::io_context io;
  std::vector<asio::ip::tcp::acceptor> held;
  std::vector<std::string> out;
  for (std::size_t i = 0; i < n; ++i) {
    held.emplace_back(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    out.push_back("127.0.0.1:" + std::to_string(held.back().local_endpoint().port()));
  }
  return out;
}

/// What rank 0 measured: seconds per all-reduce of the big tensor and of the small one.
struct Timing {
  double big = 0;
  double small = 0;
};

/// Times `iterations` sums of `floats` (after 2 warm-up calls), and 200 sums of 1 Ki floats.
template <Ring R>
Timing time_ring(R& ring, std::size_t floats, int iterations) {
  RingAllReduce reduce(g_segment);
  std::vector<float> data(floats, 1.0F);
  std::vector<float> small(1024, 1.0F);
  for (int i = 0; i < 2; ++i) reduce.sum(ring, data);
  Timing t;
  t.big = median_seconds(iterations, [&] { reduce.sum(ring, data); });
  for (int i = 0; i < 20; ++i) reduce.sum(ring, small);
  const auto start = Clock::now();
  for (int i = 0; i < 200; ++i) reduce.sum(ring, small);
  t.small = seconds_since(start) / 200;
  return t;
}

/// How a TcpRing's ranks link.
enum class Link { kShared, kLocal, kTcp };

/// N processes, each a rank of a TcpRing linked as `link` says; rank 0's timing comes back
/// through a pipe.
Timing tcp_processes(std::size_t ranks, std::size_t floats, int iterations, Link link) {
  const auto addresses = free_addresses(ranks);
  int fds[2];
  if (::pipe(fds) != 0) std::exit(2);
  std::vector<pid_t> children;
  for (std::size_t r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      try {
        TcpRingOptions options;
        options.local_sockets = link != Link::kTcp;
        options.shared_memory = link == Link::kShared;
        TcpRing ring(r, addresses, Credentials{"bench", "secret"}, options);
        if (ring.local() != (link != Link::kTcp) || ring.shared() != (link == Link::kShared)) {
          std::fprintf(stderr, "rank %zu: not linked as asked (local %d, shared %d)\n", r, ring.local() ? 1 : 0,
                       ring.shared() ? 1 : 0);
          ::_exit(1);
        }
        const Timing t = time_ring(ring, floats, iterations);
        if (r == 0 && ::write(fds[1], &t, sizeof t) != static_cast<ssize_t>(sizeof t)) ::_exit(3);
        ::_exit(0);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %zu: %s\n", r, e.what());
        ::_exit(1);
      }
    }
    children.push_back(pid);
  }
  Timing t;
  const bool got = ::read(fds[0], &t, sizeof t) == static_cast<ssize_t>(sizeof t);
  for (pid_t pid : children) ::waitpid(pid, nullptr, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  if (!got) {
    std::fprintf(stderr, "all_reduce: the TCP ring of %zu failed\n", ranks);
    std::exit(1);
  }
  return t;
}

Timing in_process_threads(std::size_t ranks, std::size_t floats, int iterations) {
  auto ring = InProcessRing::make(ranks);
  Timing t;
  std::vector<std::jthread> threads;
  for (std::size_t r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      const Timing mine = time_ring(ring[r], floats, iterations);
      if (r == 0) t = mine;
    });
  }
  threads.clear();
  return t;
}

std::vector<std::size_t> parse_list(const std::string& text) {
  std::vector<std::size_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoul(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> rank_counts{2, 4};
  std::size_t mb = 16;
  int iterations = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--ranks") {
      rank_counts = parse_list(argv[i + 1]);
    } else if (flag == "--mb") {
      mb = std::stoul(argv[i + 1]);
    } else if (flag == "--segment") {
      g_segment = std::stoul(argv[i + 1]);
    } else if (flag == "--iterations") {
      iterations = std::stoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "usage: all_reduce [--ranks 2,4] [--mb 16] [--iterations 10] [--segment FLOATS]\n");
      return 2;
    }
  }
  const std::size_t bytes = mb << 20U;
  const std::size_t floats = bytes / sizeof(float);
  std::printf("ring all-reduce of %zu MB in segments of %zu floats, %u cores; references measured first, in this run\n",
              mb, g_segment, std::thread::hardware_concurrency());
  double stream = 0;
  double local_stream = 0;
  double round_trip = 0;
  {
    bench::RawLoopback one_way(bytes, 1);
    stream = static_cast<double>(bytes) / median_seconds(iterations, [&] { one_way.exchange(); });
    bench::RawLocal local_way(bytes, 1);
    local_stream = static_cast<double>(bytes) / median_seconds(iterations, [&] { local_way.exchange(); });
    bench::RawLoopback ping(1, 1);
    for (int i = 0; i < 100; ++i) ping.exchange();
    const auto start = Clock::now();
    for (int i = 0; i < 2000; ++i) ping.exchange();
    round_trip = seconds_since(start) / 2000;
  }
  std::printf("one raw TCP stream (loopback, %zu MB then 1 byte back): %.2f GB/s\n", mb, stream / 1e9);
  std::printf("one raw local-socket stream (the same): %.2f GB/s\n", local_stream / 1e9);
  std::printf("TCP round trip (1 byte each way): %.1f us\n", round_trip * 1e6);
  std::printf("(bus / stream divides by the raw TCP stream's figure)\n\n");
  std::printf("%-23s %5s %12s %14s %16s %16s\n", "ring", "ranks", "time (ms)", "bus GB/s", "bus / stream",
              "4 KB step (us)");
  for (std::size_t n : rank_counts) {
    const double factor = 2.0 * static_cast<double>(n - 1) / static_cast<double>(n);
    // A 4 KB call is 2 (N - 1) ring steps, plus the header's.
    const double steps = 2.0 * static_cast<double>(n - 1) + 1.0;
    for (const char* kind :
         {"TcpRing, shared memory", "TcpRing, local sockets", "TcpRing, TCP", "InProcessRing, threads"}) {
      const std::string name = kind;
      const Link link = name == "TcpRing, shared memory" ? Link::kShared
                        : name == "TcpRing, TCP"         ? Link::kTcp
                                                         : Link::kLocal;
      const Timing t = name == "InProcessRing, threads" ? in_process_threads(n, floats, iterations)
                                                        : tcp_processes(n, floats, iterations, link);
      const double bus = factor * static_cast<double>(bytes) / t.big;
      std::printf("%-23s %5zu %12.2f %14.2f %16.2f %10.1f (%.2f x RTT)\n", kind, n, t.big * 1e3, bus / 1e9,
                  bus / stream, t.small / steps * 1e6, t.small / steps / round_trip);
    }
  }
  return 0;
}
