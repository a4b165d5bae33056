// SPDX-License-Identifier: MIT
// Sparse pull + push between one worker and 1 or 2 ps tasks: a Worker step of a model whose
// batch uses 4096 × 26 ids of one embedding table (dim 16 and 64; ids drawn from 10 M, so
// nearly all distinct) and does no arithmetic of its own, under Async: the worker removes
// duplicate ids and groups them by ps, pulls their rows (PullRows), and pushes their
// gradients (Push), two round trips; the ps creates rows on first sight, then finds and
// updates them (Sgd). Figures: ids/s and bytes/s (rows both ways plus ids both ways), each
// against a reference measured in alternating rounds of the same run: over TCP a raw
// loopback exchange of as many bytes (the worker's bytes out, the ps's bytes back, twice),
// in-process memcpy of as many bytes. Raw exchanges: the pull's (ids out, rows back) and the
// push's (ids and gradients out, one byte back), one after the other.
//
//   sparse_push_pull [--rounds 5] [--steps-per-round 6]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pulley/pulley.hpp"
#include "pulley/transport/tcp.hpp"
#include "support/references.hpp"
#include "support/rows_only.hpp"

namespace {

namespace bench = pulley::bench;

using Clock = std::chrono::steady_clock;
constexpr std::size_t kIds = 4096 * 26;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using bench::RowsOnly;

using Server = pulley::ParameterServer<pulley::RoundRobin, pulley::Sgd, pulley::Async>;

/// Seconds per raw loopback exchange (bench::RawLoopback), over `times` of them.
double raw_exchange(std::size_t out_bytes, std::size_t back_bytes, int times) {
  bench::RawLoopback link(out_bytes, back_bytes);
  const auto start = Clock::now();
  for (int i = 0; i < times; ++i) link.exchange();
  return std::chrono::duration<double>(Clock::now() - start).count() / times;
}

double memcpy_time(std::size_t bytes, int times) {
  bench::Memcpy copy(bytes);
  const auto start = Clock::now();
  for (int i = 0; i < times; ++i) copy();
  return std::chrono::duration<double>(Clock::now() - start).count() / times;
}

/// Seconds per worker step on `batches` (cycled), after one warm-up pass over them (rows
/// created), through `transport`.
template <class Transport>
double steps(Transport transport, std::size_t dim, const std::vector<RowsOnly::Batch>& batches,
             int count) {
  pulley::Worker worker(0, RowsOnly(dim), std::move(transport));
  worker.wait_ready();
  for (const auto& b : batches) (void)worker.step(b);
  const auto start = Clock::now();
  for (int i = 0; i < count; ++i) (void)worker.step(batches[static_cast<std::size_t>(i) % batches.size()]);
  return std::chrono::duration<double>(Clock::now() - start).count() / count;
}

int run(int argc, char** argv) {
  int rounds = 5, per_round = 6;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--steps-per-round" && i + 1 < argc) {
      per_round = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: sparse_push_pull [--rounds 5] [--steps-per-round 6]\n");
      return 2;
    }
  }
  std::mt19937_64 rng(3);
  std::vector<RowsOnly::Batch> batches(3);
  for (auto& b : batches) {
    for (std::size_t i = 0; i < kIds; ++i) b.push_back(pulley::mix_id(rng() % 10'000'000));
  }
  std::printf("pulley sparse push+pull: a batch of %zu ids (drawn from 10 M) of one table, 1 worker, "
              "Async, %d alternating rounds of %d steps (medians)\n\n", kIds, rounds, per_round);
  const pulley::Credentials credentials{"bench", "bench secret"};
  for (const std::size_t dim : {std::size_t{16}, std::size_t{64}}) {
    for (const std::uint32_t num_ps : {1U, 2U}) {
      for (const bool tcp : {false, true}) {
        std::vector<double> ours, reference;
        // Bytes a step moves: the ids out twice (pull, push), the rows back, the gradients out.
        const std::size_t distinct = [&] {
          auto b = batches[0];
          std::sort(b.begin(), b.end());
          return static_cast<std::size_t>(std::unique(b.begin(), b.end()) - b.begin());
        }();
        const std::size_t row_bytes = distinct * dim * sizeof(float);
        const std::size_t out_bytes = 2 * distinct * sizeof(std::uint64_t) + row_bytes;
        const std::size_t step_bytes = out_bytes + row_bytes;
        for (int r = 0; r < rounds; ++r) {
          auto measure_ours = [&] {
            if (!tcp) {
              pulley::InProcessNetwork network(num_ps);
              for (std::uint32_t i = 0; i < num_ps; ++i) network.serve(Server(i, num_ps, pulley::Sgd{0.1F}, pulley::Async{}));
              pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), 1);
              const RowsOnly shape(dim);
              chief.initialize(shape.variables(), shape.tables());
              ours.push_back(steps(pulley::InProcess(network, pulley::Node::worker(0)), dim, batches, per_round));
              chief.shutdown();
              return;
            }
            pulley::TcpServerOptions server;
            server.credentials = credentials;
            std::vector<std::unique_ptr<pulley::TcpServer<Server>>> listeners;
            std::vector<std::string> addresses;
            for (std::uint32_t i = 0; i < num_ps; ++i) {
              listeners.push_back(std::make_unique<pulley::TcpServer<Server>>(
                  Server(i, num_ps, pulley::Sgd{0.1F}, pulley::Async{}), "127.0.0.1", 0, server));
              addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
            }
            std::vector<std::thread> threads;
            for (auto& l : listeners) threads.emplace_back([&l] { l->run(); });
            pulley::TcpOptions client;
            client.credentials = credentials;
            {
              pulley::Chief chief(pulley::Tcp(pulley::Node::chief(), addresses, client), 1);
              const RowsOnly shape(dim);
              chief.initialize(shape.variables(), shape.tables());
              ours.push_back(steps(pulley::Tcp(pulley::Node::worker(0), addresses, client), dim, batches, per_round));
              chief.shutdown();
            }
            for (auto& l : listeners) l->stop();
            for (auto& t : threads) t.join();
          };
          auto measure_reference = [&] {
            // The pull (ids out, rows back), then the push (ids and gradients out, a byte back).
            const std::size_t id_bytes = distinct * sizeof(std::uint64_t);
            reference.push_back(tcp ? raw_exchange(id_bytes, row_bytes, per_round) +
                                          raw_exchange(id_bytes + row_bytes, 1, per_round)
                                    : memcpy_time(step_bytes, per_round));
          };
          if (r % 2 == 0) {
            measure_reference();
            measure_ours();
          } else {
            measure_ours();
            measure_reference();
          }
        }
        const double t = median(ours), ref = median(reference);
        std::printf("dim %-3zu ps %u %-11s %6.2f M ids/s %7.1f MB/s   ref %-26s %8.1f MB/s   ratio %.2f\n",
                    dim, num_ps, tcp ? "TCP" : "in-process", static_cast<double>(distinct) / t / 1e6,
                    static_cast<double>(step_bytes) / t / 1e6,
                    tcp ? "raw loopback exchange" : "memcpy of the same bytes",
                    static_cast<double>(step_bytes) / ref / 1e6, ref / t);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparse_push_pull: %s\n", e.what());
    return 1;
  }
}
