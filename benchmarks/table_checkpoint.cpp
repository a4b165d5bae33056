// SPDX-License-Identifier: MIT
// A checkpoint of an embedding table, end to end in one process: ps tasks (in-process, Async,
// Adagrad: one slot per row) holding `--rows` rows of dim `--dim`, created by a worker's
// pulls; then, in alternating rounds:
//
//   cut       Chief::save_state: every ps paused while the dense parts are read, then its
//             rows read chunk by chunk (ReadRows) as they were at the cut while training
//             goes on. Meanwhile a second worker trains (pulls and pushes 4096 of the rows,
//             over and over): the longest it waited for a step during the cut is how long
//             training stood still, printed as a share of the time between checkpoints
//             every 60 s (the budget is 5 %), beside its usual step time.
//   write     CheckpointDirectory::save of that state (data file, index, fsync, rename);
//             against one plain write() of as many bytes into a new file on the same
//             filesystem, then fsync (the disk's sequential speed, as the page cache and the
//             disk give it here).
//   restore   Chief::restore of the state into fresh ps tasks (every row to every ps, each
//             keeping its own).
//
// Then incremental checkpoints: after a full one, a worker touches 1 % of the rows, then
// 10 %, and each time an incremental checkpoint (the rows touched since the one before) is
// cut and written: its size against the full one's, beside the share of rows touched.
//
//   table_checkpoint [--rows 10000000] [--dim 16] [--ps 2] [--rounds 3] [--dir /tmp]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pulley/pulley.hpp"
#include "support/rows_only.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Server = pulley::ParameterServer<pulley::RoundRobin, pulley::Adagrad, pulley::Async>;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Seconds to write `bytes` bytes into a new file in `dir` and flush it.
double plain_write(const std::filesystem::path& dir, std::size_t bytes) {
  std::vector<char> buffer(std::size_t{64} << 20U, 1);
  const auto path = dir / "plain";
  ::sync();
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path.string());
  for (std::size_t left = bytes; left > 0;) {
    const auto n = ::write(fd, buffer.data(), std::min(left, buffer.size()));
    if (n <= 0) throw std::runtime_error("cannot write " + path.string());
    left -= static_cast<std::size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  const double s = seconds_since(start);
  std::filesystem::remove(path);
  return s;
}

/// ps tasks on `network` with an empty table, registered by `chief`.
void serve(pulley::InProcessNetwork& network, std::uint32_t num_ps) {
  for (std::uint32_t i = 0; i < num_ps; ++i) network.serve(Server(i, num_ps, pulley::Adagrad{0.1F}, pulley::Async{}));
}

int run(int argc, char** argv) {
  std::size_t rows = 10'000'000, dim = 16;
  std::uint32_t num_ps = 2;
  int rounds = 3;
  std::filesystem::path base = std::filesystem::temp_directory_path();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (arg == "--rows") {
      rows = std::strtoull(value().c_str(), nullptr, 10);
    } else if (arg == "--dim") {
      dim = std::strtoull(value().c_str(), nullptr, 10);
    } else if (arg == "--ps") {
      num_ps = static_cast<std::uint32_t>(std::strtoul(value().c_str(), nullptr, 10));
    } else if (arg == "--rounds") {
      rounds = std::max(1, std::atoi(value().c_str()));
    } else if (arg == "--dir") {
      base = value();
    } else {
      std::fprintf(stderr, "usage: table_checkpoint [--rows 10000000] [--dim 16] [--ps 2] [--rounds 3] [--dir /tmp]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  if (rows == 0 || dim == 0 || num_ps == 0) {
    std::fprintf(stderr, "table_checkpoint: --rows, --dim and --ps must be positive\n");
    return 2;
  }
  std::string pattern = (base / "pulley-table-checkpoint-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::fprintf(stderr, "table_checkpoint: cannot create a directory under %s\n", base.c_str());
    return 1;
  }
  const std::filesystem::path dir = pattern;
  std::printf("pulley table checkpoint: %zu rows of dim %zu with Adagrad (1 slot) on %u in-process ps tasks, "
              "%d alternating rounds (medians), in %s\n\n", rows, dim, num_ps, rounds, dir.c_str());

  pulley::InProcessNetwork network(num_ps);
  serve(network, num_ps);
  pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), 1);
  const pulley::bench::RowsOnly shape(dim);
  chief.initialize(shape.variables(), shape.tables());
  {
    const auto start = Clock::now();
    pulley::Worker worker(0, pulley::bench::RowsOnly(dim), pulley::InProcess(network, pulley::Node::worker(0)));
    worker.wait_ready();
    constexpr std::size_t kBatch = std::size_t{1} << 17U;
    pulley::bench::RowsOnly::Batch batch;
    for (std::size_t first = 0; first < rows; first += kBatch) {
      batch.clear();
      for (std::size_t id = first; id < std::min(rows, first + kBatch); ++id) batch.push_back(pulley::mix_id(id));
      (void)worker.step(batch);
    }
    std::printf("created %zu rows in %.1f s\n", rows, seconds_since(start));
  }

  // A worker that trains during every cut: 4096 rows pulled and pushed a step.
  pulley::Worker trainer(1, pulley::bench::RowsOnly(dim), pulley::InProcess(network, pulley::Node::worker(1)));
  trainer.wait_ready();
  pulley::bench::RowsOnly::Batch trained;
  for (std::size_t i = 0; i < std::min<std::size_t>(rows, 4096); ++i) trained.push_back(pulley::mix_id(i * 2654435761U % rows));
  std::sort(trained.begin(), trained.end());
  trained.erase(std::unique(trained.begin(), trained.end()), trained.end());
  std::vector<double> cut, paused, step_time, write, plain, restore;
  std::uint64_t bytes = 0;
  for (int r = 0; r < rounds; ++r) {
    auto ours = [&] {
      std::atomic<bool> stop{false};
      std::vector<Clock::time_point> steps{Clock::now()};
      std::thread training([&] {
        while (!stop.load()) {
          (void)trainer.step(trained);
          steps.push_back(Clock::now());
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its usual pace first
      auto start = Clock::now();
      const pulley::ModelState state = chief.save_state();
      const auto end = Clock::now();
      cut.push_back(seconds_since(start));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      stop = true;
      training.join();
      // The longest wait between two steps that overlaps the cut, and the median wait before it.
      double longest = 0.0;
      std::vector<double> before;
      for (std::size_t k = 1; k < steps.size(); ++k) {
        const double gap = std::chrono::duration<double>(steps[k] - steps[k - 1]).count();
        if (steps[k] > start && steps[k - 1] < end) longest = std::max(longest, gap);
        if (steps[k] <= start && k > 1) before.push_back(gap);
      }
      paused.push_back(longest);
      if (!before.empty()) step_time.push_back(median(before));
      std::filesystem::remove_all(dir / "ckpt");
      pulley::CheckpointDirectory directory(dir / "ckpt", 1);
      ::sync();
      start = Clock::now();
      const auto path = directory.save(state);
      write.push_back(seconds_since(start));
      bytes = std::filesystem::file_size(path / "data") + std::filesystem::file_size(path / "index");
      pulley::InProcessNetwork fresh(num_ps);
      serve(fresh, num_ps);
      pulley::Chief restorer(pulley::InProcess(fresh, pulley::Node::chief()), 1);
      start = Clock::now();
      restorer.restore(state);
      restore.push_back(seconds_since(start));
      restorer.shutdown();
    };
    auto reference = [&] { plain.push_back(plain_write(dir, bytes == 0 ? rows * (dim * 8 + 12) : bytes)); };
    if (r % 2 == 0) {
      ours();
      reference();
    } else {
      reference();
      ours();
    }
  }
  // Incremental checkpoints over a full one, each after a share of the rows was touched.
  struct Delta {
    double share, cut, write;
    std::uint64_t bytes, rows;
  };
  std::vector<Delta> deltas;
  {
    pulley::CheckpointDirectory directory(dir / "incremental", 0);
    const pulley::ModelState full = chief.save_state();
    directory.save(full);
    std::int64_t since = full.global_step;
    pulley::Worker worker(0, pulley::bench::RowsOnly(dim), pulley::InProcess(network, pulley::Node::worker(0)));
    worker.wait_ready();
    std::size_t next = 0;  // touch rows next, next + 1, ...
    for (const double share : {0.01, 0.1}) {
      const auto touch = static_cast<std::size_t>(share * static_cast<double>(rows));
      constexpr std::size_t kBatch = std::size_t{1} << 16U;
      pulley::bench::RowsOnly::Batch batch;
      for (std::size_t done = 0; done < touch;) {
        batch.clear();
        for (; batch.size() < kBatch && done < touch; ++done) batch.push_back(pulley::mix_id((next++) % rows));
        (void)worker.step(batch);
      }
      auto start = Clock::now();
      const pulley::ModelState delta = chief.save_state(pulley::CutRows{since, since});
      const double cut_s = seconds_since(start);
      ::sync();
      start = Clock::now();
      const auto path = directory.save(delta);
      const double write_s = seconds_since(start);
      deltas.push_back({share, cut_s, write_s,
                        std::filesystem::file_size(path / "data") + std::filesystem::file_size(path / "index"),
                        delta.tables.at(0).ids.size()});
      since = delta.global_step;
    }
  }
  chief.shutdown();
  std::filesystem::remove_all(dir);
  const double mb = static_cast<double>(bytes) / 1e6;
  std::printf("checkpoint size      %10.1f MB\n", mb);
  std::printf("cut (rows read)      %10.3f s\n", median(cut));
  std::printf("training paused      %10.3f s   %5.2f %% of 60 s between checkpoints (longest step during the "
              "cut; a step takes %.3f s otherwise)\n",
              median(paused), 100.0 * median(paused) / 60.0, step_time.empty() ? 0.0 : median(step_time));
  std::printf("write                %10.3f s   %7.1f MB/s   plain write+fsync %7.1f MB/s   ratio %.2f\n",
              median(write), mb / median(write), mb / median(plain), median(plain) / median(write));
  std::printf("restore              %10.3f s   %7.1f M rows/s\n", median(restore),
              static_cast<double>(rows) / 1e6 / median(restore));
  for (const Delta& d : deltas) {
    std::printf("incremental, %4.1f %% of the rows touched: %9zu rows, %8.1f MB = %5.2f %% of the full checkpoint; "
                "cut %.3f s, write %.3f s\n",
                100.0 * d.share, static_cast<std::size_t>(d.rows), static_cast<double>(d.bytes) / 1e6,
                100.0 * static_cast<double>(d.bytes) / static_cast<double>(bytes), d.cut, d.write);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "table_checkpoint: %s\n", e.what());
    return 1;
  }
}
