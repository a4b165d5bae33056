// SPDX-License-Identifier: MIT
// Embedding tables on one ps, each figure with its reference measured in the same run:
//
//   apply     rows/s of EmbeddingTable::apply (sparse Adagrad: find each row by id and
//             update it in place, proven finite in advance; FTRL, whose rows are not proven
//             from magnitudes: update a copy, check it finite, write it back) on a batch of 4096 ×
//             26 distinct ids out of a table of 1 M rows, against a plain loop doing the same
//             optimizer math over as many rows stored contiguously, in batch order (what
//             the arithmetic costs with no lookup, no copy and no check); and against the
//             same loop over rows scattered over an array of the table's size, at known
//             addresses, prefetched (what memory costs such an update without a lookup).
//   pull      rows/s of EmbeddingTable::pull of the same batch (rows held), against memcpy
//             of as many rows from a contiguous array.
//   duplicate check  ids/s of IdPositions::first_duplicate over the batch cut into requests of
//             64 × 26 ids (the CTR example's), what a ps does with each table's ids of a
//             request, against std::unordered_set::insert of the same ids (reserved first).
//   memory    bytes per row the table holds for 10 M rows of dim 16 (values and Adagrad's
//             accumulator: 128 bytes), as TableStats::bytes counts it, beside the process's
//             resident memory growth while they were created.
//
// Case and reference alternate for `--rounds` rounds (medians, and the range of the rounds'
// ratios).
//
//   sparse [--rounds 5] [--dim 16] [--memory-rows 10000000]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "pulley/core/id_index.hpp"
#include "pulley/core/prefetch.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/ps/embedding_table.hpp"
#include "support/plain_ftrl.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds(const std::function<void()>& f) {
  const auto start = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Round `round`'s two runs, the reference first in even rounds and second in odd ones.
template <class Reference, class Ours>
void in_turn(int round, Reference&& reference, Ours&& ours) {
  if (round % 2 == 0) {
    reference();
    ours();
  } else {
    ours();
    reference();
  }
}

/// Prints one line: items/s of the case and the reference, their ratio, the rounds' range.
void report(const char* what, const char* ref, const std::vector<double>& ours,
            const std::vector<double>& reference, double items) {
  std::vector<double> ratios;
  for (std::size_t i = 0; i < ours.size(); ++i) ratios.push_back(reference[i] / ours[i]);
  std::printf("%-28s %12.0f rows/s   ref %-30s %12.0f rows/s   ratio %.2f (rounds %.2f-%.2f)\n",
              what, items / median(ours), ref, items / median(reference),
              median(reference) / median(ours), *std::min_element(ratios.begin(), ratios.end()),
              *std::max_element(ratios.begin(), ratios.end()));
}

/// Resident memory of this process, in bytes.
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4096.0;
}

std::vector<std::uint64_t> batch_ids(std::size_t n, std::uint64_t table_rows, std::uint64_t seed) {
  // Distinct ids drawn from the table's rows, in random order.
  std::vector<std::uint64_t> all(table_rows);
  for (std::uint64_t i = 0; i < table_rows; ++i) all[i] = pulley::mix_id(i);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

template <class O, class PlainLoop>
void bench_apply(const char* name, const O& optimizer, PlainLoop plain, std::size_t dim, int rounds,
                 const std::vector<std::uint64_t>& table_ids, const std::vector<std::uint64_t>& ids) {
  pulley::EmbeddingTable<O> table(pulley::TableSpec{"emb", dim, pulley::Initializer::normal(0.01F)},
                                  optimizer, 1);
  std::vector<float> rows(table_ids.size() * dim);
  table.pull(table_ids, rows, 0);
  std::vector<float> gradients(ids.size() * dim);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0F, 0.01F);
  for (float& g : gradients) g = normal(rng);
  // The reference: the same rows (values and slots) stored contiguously in batch order.
  const std::size_t stride = (1 + O::kRowSlots) * dim;
  std::vector<float> contiguous(ids.size() * stride, 0.1F);
  // The floor of memory: as many rows scattered over an array of the table's size, updated
  // through known addresses (no lookup), each row's lines prefetched 8 rows ahead.
  std::vector<float> scattered(table_ids.size() * stride, 0.1F);
  std::vector<std::size_t> at(table_ids.size());
  for (std::size_t i = 0; i < at.size(); ++i) at[i] = i * stride;
  std::shuffle(at.begin(), at.end(), std::mt19937_64(3));
  at.resize(ids.size());
  auto floor_loop = [&] {
    for (std::size_t i = 0; i < at.size(); ++i) {
      if (i + 8 < at.size()) pulley::prefetch(scattered.data() + at[i + 8], stride * sizeof(float));
      plain(scattered.data() + at[i], gradients.data() + i * dim, 1, dim);
    }
  };
  std::vector<double> ours, reference, floor;
  std::int64_t updates = 0;
  for (int r = 0; r < rounds; ++r) {
    auto run_ours = [&] {
      ours.push_back(seconds([&] { (void)table.apply(ids, gradients, updates, updates + 1); }));
      ++updates;
    };
    auto run_plain = [&] {
      reference.push_back(seconds([&] { plain(contiguous.data(), gradients.data(), ids.size(), dim); }));
      floor.push_back(seconds(floor_loop));
    };
    in_turn(r, run_plain, run_ours);
  }
  report(name, "plain loop, same math", ours, reference, static_cast<double>(ids.size()));
  report("", "the same, rows scattered", ours, floor, static_cast<double>(ids.size()));
}

int run(int argc, char** argv) {
  int rounds = 5;
  std::size_t dim = 16;
  std::size_t memory_rows = 10'000'000;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--dim" && i + 1 < argc) {
      dim = static_cast<std::size_t>(std::max(1, std::atoi(argv[++i])));
    } else if (arg == "--memory-rows" && i + 1 < argc) {
      memory_rows = static_cast<std::size_t>(std::max(1, std::atoi(argv[++i])));
    } else {
      std::fprintf(stderr, "usage: sparse [--rounds 5] [--dim 16] [--memory-rows 10000000]\n");
      return 2;
    }
  }
  constexpr std::size_t kTableRows = 1'000'000;
  const std::size_t batch = 4096 * 26;
  std::printf("pulley sparse benchmark: dim %zu, a batch of %zu distinct ids out of %zu rows, %d "
              "alternating rounds (medians)\n\n",
              dim, batch, kTableRows, rounds);
  std::vector<std::uint64_t> table_ids(kTableRows);
  for (std::uint64_t i = 0; i < kTableRows; ++i) table_ids[i] = pulley::mix_id(i);
  const std::vector<std::uint64_t> ids = batch_ids(batch, kTableRows, 7);

  const pulley::Adagrad adagrad{0.05F, 0.1F, 1e-7F};
  bench_apply(
      "sparse Adagrad apply", adagrad,
      [&](float* rows, const float* g, std::size_t n, std::size_t d) {
        for (std::size_t r = 0; r < n; ++r) {
          float* w = rows + r * 2 * d;
          float* acc = w + d;
          const float* gr = g + r * d;
          for (std::size_t k = 0; k < d; ++k) {
            acc[k] += gr[k] * gr[k];
            w[k] -= adagrad.learning_rate * gr[k] / (std::sqrt(acc[k]) + adagrad.epsilon);
          }
        }
      },
      dim, rounds, table_ids, ids);

  const pulley::Ftrl ftrl{};
  bench_apply(
      "sparse FTRL apply", ftrl,
      [&](float* rows, const float* g, std::size_t n, std::size_t d) {
        for (std::size_t r = 0; r < n; ++r) {  // each row: weights, accumulators, linear terms
          float* w = rows + r * 3 * d;
          pulley::bench::plain_ftrl(w, w + d, w + 2 * d, g + r * d, d, ftrl.learning_rate);
        }
      },
      dim, rounds, table_ids, ids);

  {
    pulley::EmbeddingTable<pulley::Adagrad> table(
        pulley::TableSpec{"emb", dim, pulley::Initializer::normal(0.01F)}, adagrad, 1);
    std::vector<float> all_rows(kTableRows * dim);
    table.pull(table_ids, all_rows, 0);
    std::vector<float> out(ids.size() * dim);
    std::vector<float> contiguous(kTableRows * dim, 0.5F);
    std::vector<double> ours, reference;
    for (int r = 0; r < rounds; ++r) {
      auto run_ours = [&] { ours.push_back(seconds([&] { table.pull(ids, out, 1); })); };
      auto run_copy = [&] {
        reference.push_back(seconds([&] {
          std::memcpy(out.data(), contiguous.data(), out.size() * sizeof(float));
        }));
      };
      in_turn(r, run_copy, run_ours);
    }
    report("pull (rows held)", "memcpy of as many rows", ours, reference, static_cast<double>(ids.size()));
  }

  {
    // What a ps does first with each table's ids of a request: find an id that comes twice
    // (TableShard::check). Requests of 64 examples × 26 ids (the CTR example's batch), all
    // distinct, against std::unordered_set told as many ids first.
    constexpr std::size_t kRequest = 64 * 26;
    pulley::IdPositions seen(12345);
    std::unordered_set<std::uint64_t> set;
    std::vector<double> ours, reference;
    const std::size_t requests = ids.size() / kRequest;
    const auto each = [&](auto&& check) {
      for (std::size_t r = 0; r < requests; ++r) check(std::span(ids).subspan(r * kRequest, kRequest));
    };
    bool twice = false;
    for (int r = 0; r < rounds; ++r) {
      auto run_ours = [&] {
        ours.push_back(seconds([&] { each([&](auto request) { twice |= seen.first_duplicate(request) != nullptr; }); }));
      };
      auto run_set = [&] {
        reference.push_back(seconds([&] {
          each([&](auto request) {
            set.clear();
            set.reserve(request.size());
            for (const std::uint64_t id : request) twice |= !set.insert(id).second;
          });
        }));
      };
      in_turn(r, run_set, run_ours);
    }
    if (twice) std::abort();  // the batch's ids are distinct
    report("duplicate check", "std::unordered_set", ours, reference, static_cast<double>(requests * kRequest));
  }

  {
    const double before = resident_bytes();
    pulley::EmbeddingTable<pulley::Adagrad> table(
        pulley::TableSpec{"emb", dim, pulley::Initializer::normal(0.01F)}, adagrad, 1);
    std::vector<std::uint64_t> chunk(100'000);
    std::vector<float> out(chunk.size() * dim);
    const auto start = Clock::now();
    for (std::size_t done = 0; done < memory_rows; done += chunk.size()) {
      const std::size_t n = std::min(chunk.size(), memory_rows - done);
      for (std::size_t i = 0; i < n; ++i) chunk[i] = pulley::mix_id(done + i + 123);
      table.pull(std::span(chunk).first(n), std::span(out).first(n * dim), 0);
    }
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    const double grew = resident_bytes() - before;
    const auto stats = table.stats();
    const double payload = static_cast<double>(2 * dim * sizeof(float));
    std::printf("\nmemory: %zu rows of dim %zu with Adagrad's accumulator (%.0f bytes of floats a row), "
                "created in %.1f s (%.2f M rows/s)\n",
                static_cast<std::size_t>(stats.rows), dim, payload, took,
                static_cast<double>(stats.rows) / took / 1e6);
    std::printf("memory: the table holds %.1f bytes a row (%.2fx the floats); resident memory "
                "grew %.1f bytes a row (%.2fx)\n",
                static_cast<double>(stats.bytes) / static_cast<double>(stats.rows),
                static_cast<double>(stats.bytes) / static_cast<double>(stats.rows) / payload,
                grew / static_cast<double>(stats.rows), grew / static_cast<double>(stats.rows) / payload);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
