// SPDX-License-Identifier: MIT
// A checkpoint of an embedding table, end to end in one process: ps tasks (in-process, Async,
// Adagrad: one slot per row) holding `--rows` rows of dim `--dim`, created by a worker's
// pulls; then, in alternating rounds:
//
//   cut       Chief::save_state: every ps paused, its rows read chunk by chunk (ReadRows),
//             resumed. Training stands still for this long: printed as a share of the time
//             between checkpoints every 60 s (the budget is 5 %).
//   write     CheckpointDirectory::save of that state (data file, index, fsync, rename);
//             against one plain write() of as many bytes into a new file on the same
//             filesystem, then fsync (the disk's sequential speed, as the page cache and the
//             disk give it here).
//   restore   Chief::restore of the state into fresh ps tasks (every row to every ps, each
//             keeping its own).
//
//   table_checkpoint [--rows 10000000] [--dim 16] [--ps 2] [--rounds 3] [--dir /tmp]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
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

  std::vector<double> cut, write, plain, restore;
  std::uint64_t bytes = 0;
  for (int r = 0; r < rounds; ++r) {
    auto ours = [&] {
      auto start = Clock::now();
      const pulley::ModelState state = chief.save_state();
      cut.push_back(seconds_since(start));
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
  chief.shutdown();
  std::filesystem::remove_all(dir);
  const double mb = static_cast<double>(bytes) / 1e6;
  std::printf("checkpoint size      %10.1f MB\n", mb);
  std::printf("cut (training paused) %9.3f s   %5.2f %% of 60 s between checkpoints\n", median(cut),
              100.0 * median(cut) / 60.0);
  std::printf("write                %10.3f s   %7.1f MB/s   plain write+fsync %7.1f MB/s   ratio %.2f\n",
              median(write), mb / median(write), mb / median(plain), median(plain) / median(write));
  std::printf("restore              %10.3f s   %7.1f M rows/s\n", median(restore),
              static_cast<double>(rows) / 1e6 / median(restore));
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
