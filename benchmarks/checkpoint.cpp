// SPDX-License-Identifier: MIT
// pulley's checkpoint write and read speed, each printed with its ratio to the disk measured
// in the same run, and CRC-32C's own speed for context:
//
//   save        CheckpointDirectory::save of a model state of ~100 MB (four variables of
//               8.4 M floats in all, each with Adam's "m" and "v" slots and a "t" counter):
//               the temporary directory, the data file and the index, each file and both
//               directories flushed (fsync), the rename; against one plain write() of as many
//               bytes into a new file on the same filesystem, then fsync.
//   read back   CheckpointDirectory::latest (every tensor read and its CRC-32C checked, into
//               a new ModelState); against one plain read() of the reference file, as large,
//               into a buffer allocated once (the disk's, or the page cache's, speed), and
//               against one plain read() into memory allocated for it (what a process pays
//               to fill memory it has not touched yet, as a restore does). Twice: with the
//               files in the page cache (as they are right after writing), and with them
//               evicted from it (posix_fadvise DONTNEED, which needs no root;
//               `--drop-caches` also writes 3 to /proc/sys/vm/drop_caches, which does). The
//               share of each file in the page cache is checked (mincore) before it is
//               read, and printed.
//   read again  checkpoint::read_checkpoint_into a state that holds the same variables (an
//               evaluator following a directory, a ps restored again): every tensor read
//               into memory already touched; against the plain read() into a buffer
//               allocated once. Cached and not, as above.
//   CRC-32C     over the 100 MB state (out of the processor's caches) and over 256 KiB
//               again and again (in cache).
//
// Each case and its reference are measured in alternating rounds, taking turns to go first;
// the medians are compared, and the range of the rounds' own ratios and the ratio of the
// fastest rounds follow each line. Before each timed write the disk is flushed (sync), and
// the files of earlier rounds are removed untimed, so a save pays neither for another's
// dirty pages nor for pruning. Everything is written in a fresh temporary directory (under
// /tmp, or under --dir), removed at the end.
//
//   checkpoint [--rounds 9] [--dir /tmp] [--drop-caches]
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "pulley/checkpoint/crc32c.hpp"
#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/model_state.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

/// Thrown for anything the benchmark itself cannot do; main prints it and exits non-zero.
struct Failure {
  std::string what;
};

[[noreturn]] void fail(const std::string& what) {
  throw Failure{what + ": " + std::strerror(errno)};
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// A model of ~100 MB as a chief saves it: each variable with Adam's slots and counter.
pulley::ModelState make_state() {
  struct Shape {
    const char* name;
    std::vector<std::size_t> shape;
  };
  const std::vector<Shape> shapes = {{"embedding", {16384, 256}},
                                     {"dense_1/kernel", {2048, 1024}},
                                     {"dense_2/kernel", {1024, 2048}},
                                     {"dense_2/bias", {2048}}};
  pulley::ModelState state;
  state.global_step = 1;
  state.pacer = {1, 0};
  std::uint32_t seed = 12345;
  auto fill = [&](std::vector<float>& v, std::size_t n) {
    v.resize(n);
    for (float& x : v) {
      seed = seed * 1664525U + 1013904223U;
      x = static_cast<float>(seed >> 8U) * 1e-7F - 0.8F;
    }
  };
  for (const Shape& s : shapes) {
    pulley::VariableState v;
    v.spec = {s.name, s.shape, pulley::Initializer::glorot_uniform()};
    fill(v.values, v.spec.size());
    for (const char* slot : {"m", "v"}) {
      v.slots.push_back({slot, {}});
      fill(v.slots.back().values, v.spec.size());
    }
    v.counter_names = {"t"};
    v.counters.push_back({{0, v.spec.rows()}, {1}});
    state.variables.push_back(std::move(v));
  }
  return state;
}

std::size_t floats_of(const pulley::ModelState& state) {
  std::size_t n = 0;
  for (const pulley::VariableState& v : state.variables)
    n += v.values.size() * (1 + v.slots.size());
  return n;
}

/// Bytes of every regular file under `dir`.
std::uint64_t bytes_under(const fs::path& dir) {
  std::uint64_t n = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) n += entry.file_size();
  }
  return n;
}

/// Writes `bytes` into the new file `path` with plain write() calls, then fsync: the disk's
/// sequential speed as any program gets it. Returns seconds.
double plain_write(const fs::path& path, std::span<const std::byte> bytes) {
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create " + path.string());
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("cannot write " + path.string());
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
  if (::fsync(fd) != 0) fail("cannot flush " + path.string());
  ::close(fd);
  return seconds_since(start);
}

/// Reads all of `path` with plain read() calls into `into` (allocated once, as large).
/// Returns seconds.
double plain_read(const fs::path& path, std::span<std::byte> into) {
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open " + path.string());
  for (;;) {
    const ssize_t n = ::read(fd, into.data(), into.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot read " + path.string());
    if (n == 0) break;
    into = into.subspan(static_cast<std::size_t>(n));
  }
  ::close(fd);
  if (!into.empty()) throw Failure{path.string() + " is shorter than written"};
  return seconds_since(start);
}

/// Reads all of `path` as plain_read does, into memory allocated for it (and not zeroed):
/// what a process pays to bring a file into memory it did not touch before, as a restore
/// does. Returns seconds, the allocation included and its release not.
double plain_read_new_memory(const fs::path& path, std::size_t size) {
  const auto start = Clock::now();
  const std::unique_ptr<std::byte[]> into(new std::byte[size]);
  plain_read(path, std::span(into.get(), size));
  return seconds_since(start);
}

/// The share (0 to 1) of the regular files under `path` (a file or a directory) that is in
/// the page cache.
double cached_share(const fs::path& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::recursive_directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
  } else {
    files.push_back(path);
  }
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::size_t pages = 0, resident = 0;
  for (const fs::path& file : files) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open " + file.string());
    struct stat info {};
    if (::fstat(fd, &info) != 0) fail("cannot stat " + file.string());
    const auto size = static_cast<std::size_t>(info.st_size);
    if (size > 0) {
      void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (map == MAP_FAILED) fail("cannot map " + file.string());
      std::vector<unsigned char> in((size + page - 1) / page);
      if (::mincore(map, size, in.data()) != 0) fail("mincore " + file.string());
      for (const unsigned char c : in) resident += c & 1U;
      pages += in.size();
      ::munmap(map, size);
    }
    ::close(fd);
  }
  return pages == 0 ? 1.0 : static_cast<double>(resident) / static_cast<double>(pages);
}

bool g_drop_caches = false;

/// Takes the files under `path` out of the page cache (they are clean: written and flushed).
void evict(const fs::path& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::recursive_directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
  } else {
    files.push_back(path);
  }
  for (const fs::path& file : files) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open " + file.string());
    errno = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    if (errno != 0) fail("posix_fadvise " + file.string());
    ::close(fd);
  }
  if (g_drop_caches) {
    ::sync();
    const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || ::write(fd, "3\n", 2) != 2) fail("cannot write /proc/sys/vm/drop_caches (root?)");
    ::close(fd);
  }
}

/// A case and its reference over the rounds: seconds, one per round each.
struct Rounds {
  std::vector<double> ours, reference;
  std::vector<double> ours_cached, reference_cached;  ///< share in the page cache, if read
};

/// One line: both figures (medians, MB/s or GB/s of `bytes`), the ratio of the medians, the
/// range of the rounds' ratios, and the ratio of the fastest rounds (the least disturbed by
/// the machine's other work). Returns the ratio of the medians.
double print(const char* what, const char* ref, const Rounds& r, double bytes, double unit,
             const char* unit_name) {
  std::vector<double> ratios;
  for (std::size_t i = 0; i < r.ours.size(); ++i) ratios.push_back(r.reference[i] / r.ours[i]);
  const double ours = bytes / median(r.ours) / unit;
  const double reference = bytes / median(r.reference) / unit;
  const double ratio = median(r.reference) / median(r.ours);
  const double fastest = *std::min_element(r.reference.begin(), r.reference.end()) /
                         *std::min_element(r.ours.begin(), r.ours.end());
  std::printf("%-31s %8.0f %-4s ref %-32s %8.0f %-4s ratio %.2f (rounds %.2f-%.2f, fastest %.2f)\n",
              what, ours, unit_name, ref, reference, unit_name, ratio,
              *std::min_element(ratios.begin(), ratios.end()),
              *std::max_element(ratios.begin(), ratios.end()), fastest);
  if (!r.ours_cached.empty()) {
    auto range = [](const std::vector<double>& v) {
      return std::to_string(static_cast<int>(100.0 * *std::min_element(v.begin(), v.end()))) + "-" +
             std::to_string(static_cast<int>(100.0 * *std::max_element(v.begin(), v.end()))) + " %";
    };
    std::printf("%-31s in the page cache before reading: checkpoint %s, reference %s\n", "",
                range(r.ours_cached).c_str(), range(r.reference_cached).c_str());
  }
  return ratio;
}

const char* filesystem_name(const fs::path& dir) {
  struct statfs info {};
  if (::statfs(dir.c_str(), &info) != 0) fail("statfs " + dir.string());
  switch (static_cast<unsigned long>(info.f_type)) {
    case 0xEF53UL:
      return "ext2/3/4";
    case 0x58465342UL:
      return "xfs";
    case 0x9123683EUL:
      return "btrfs";
    case 0x01021994UL:
      return "tmpfs (fsync writes nothing to a disk)";
    case 0x794C7630UL:
      return "overlayfs";
    default:
      return "other";
  }
}

/// The temporary directory, removed when the benchmark ends, however it ends.
class Scratch {
 public:
  explicit Scratch(const fs::path& parent) {
    std::string name = (parent / "pulley-checkpoint-bench-XXXXXX").string();
    if (::mkdtemp(name.data()) == nullptr) fail("cannot create a directory in " + parent.string());
    path_ = name;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  [[nodiscard]] const fs::path& path() const noexcept { return path_; }

 private:
  fs::path path_;
};

int run(int argc, char** argv) {
  int rounds = 9;
  fs::path parent = "/tmp";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--dir" && i + 1 < argc) {
      parent = argv[++i];
    } else if (arg == "--drop-caches") {
      g_drop_caches = true;
    } else {
      std::fprintf(stderr, "usage: checkpoint [--rounds 9] [--dir /tmp] [--drop-caches]\n");
      return 2;
    }
  }
  const Scratch scratch(parent);
  pulley::ModelState state = make_state();
  const fs::path root = scratch.path() / "checkpoints";
  pulley::CheckpointDirectory checkpoints(root, 0);  // keeps all; old ones go untimed

  // A first save, untimed: what a checkpoint of this state weighs, and that it reads back.
  const fs::path first = checkpoints.save(state);
  const std::uint64_t bytes = bytes_under(first);
  {
    const auto back = checkpoints.latest();
    if (!back || back->first != state) throw Failure{"the checkpoint did not read back as written"};
  }
  fs::remove_all(first);
  const std::size_t floats = floats_of(state);
  std::printf(
      "pulley checkpoint benchmark (%d alternating rounds, medians; MB = 10^6 bytes)\n"
      "state: %zu variables, %zu floats with their Adam slots (%.1f MB of tensors); a "
      "checkpoint is %llu bytes (data + index)\n"
      "in %s, on %s%s\n\n",
      rounds, state.variables.size(), floats, static_cast<double>(floats * sizeof(float)) / 1e6,
      static_cast<unsigned long long>(bytes), scratch.path().c_str(),
      filesystem_name(scratch.path()),
      g_drop_caches ? "; uncached reads also drop the caches" : "");

  // The reference writes as many bytes (their values matter to no disk here) from memory
  // already touched, as the state's is.
  std::vector<std::byte> source(static_cast<std::size_t>(bytes));
  std::memcpy(source.data(), state.variables[0].values.data(),
              std::min(source.size(), state.variables[0].values.size() * sizeof(float)));
  std::vector<std::byte> sink(source.size(), std::byte{1});  // faulted in once
  Rounds write, read_cached, read_uncached, crc;
  Rounds fresh_cached, fresh_uncached;  // the same reads against read() into new memory
  Rounds again_cached, again_uncached;  // read_checkpoint_into the last state read
  pulley::ModelState again = state;     // its memory touched, as an evaluator's is
  std::vector<std::byte> small(std::size_t{256} << 10U);
  std::memcpy(small.data(), source.data(), small.size());
  const std::size_t repeats = source.size() / small.size();
  volatile std::uint32_t crc_sink = 0;

  for (int r = 0; r < rounds; ++r) {
    std::printf("round %d of %d ...\n", r + 1, rounds);
    std::fflush(stdout);
    // The case and its reference take turns going first: what one leaves behind (pages
    // freed, the disk busy) falls on both alike.
    auto in_turn = [&](const std::function<void()>& reference, const std::function<void()>& ours) {
      if (r % 2 == 0) {
        reference();
        ours();
      } else {
        ours();
        reference();
      }
    };
    const fs::path plain = scratch.path() / ("plain-" + std::to_string(r));
    state.global_step = r + 2;  // a new step: a step already saved is kept as it is
    const fs::path saved = root / pulley::CheckpointDirectory::name_of(state.global_step);

    // Writes, each after the disk is flushed, so neither pays for the other's dirty pages.
    in_turn(
        [&] {
          ::sync();
          write.reference.push_back(plain_write(plain, source));
        },
        [&] {
          ::sync();
          const auto start = Clock::now();
          checkpoints.save(state);
          write.ours.push_back(seconds_since(start));
        });

    auto read_back = [&](Rounds& rounds_of, Rounds& fresh_of, bool cached) {
      if (!cached) evict(saved);
      rounds_of.ours_cached.push_back(cached_share(saved));
      const auto start = Clock::now();
      auto back = checkpoints.latest();
      rounds_of.ours.push_back(seconds_since(start));
      fresh_of.ours.push_back(rounds_of.ours.back());
      if (!back || back->first.global_step != state.global_step)
        throw Failure{"read back the wrong checkpoint"};
    };
    auto read_plain = [&](Rounds& rounds_of, Rounds& fresh_of, bool cached) {
      if (!cached) evict(plain);
      rounds_of.reference_cached.push_back(cached_share(plain));
      rounds_of.reference.push_back(plain_read(plain, sink));
      if (!cached) evict(plain);
      fresh_of.reference.push_back(plain_read_new_memory(plain, sink.size()));
    };
    auto read_again = [&](Rounds& rounds_of, bool cached) {
      if (!cached) evict(saved);
      rounds_of.ours_cached.push_back(cached_share(saved));
      const auto start = Clock::now();
      pulley::checkpoint::read_checkpoint_into(saved, again);
      rounds_of.ours.push_back(seconds_since(start));
      if (again.global_step != state.global_step) throw Failure{"read again the wrong checkpoint"};
    };
    auto read_plain_again = [&](Rounds& rounds_of, bool cached) {
      if (!cached) evict(plain);
      rounds_of.reference_cached.push_back(cached_share(plain));
      rounds_of.reference.push_back(plain_read(plain, sink));
    };
    // Reads with the files in the page cache, as written, then out of it.
    in_turn([&] { read_plain(read_cached, fresh_cached, true); },
            [&] { read_back(read_cached, fresh_cached, true); });
    in_turn([&] { read_plain(read_uncached, fresh_uncached, false); },
            [&] { read_back(read_uncached, fresh_uncached, false); });
    in_turn([&] { read_plain_again(again_cached, true); }, [&] { read_again(again_cached, true); });
    in_turn([&] { read_plain_again(again_uncached, false); },
            [&] { read_again(again_uncached, false); });

    // CRC-32C alone; the "reference" of these lines is the other one.
    auto start = Clock::now();
    crc_sink = pulley::checkpoint::crc32c(source);
    crc.ours.push_back(seconds_since(start));
    start = Clock::now();
    for (std::size_t i = 0; i < repeats; ++i)
      crc_sink = pulley::checkpoint::crc32c(small, crc_sink);
    crc.reference.push_back(seconds_since(start));

    fs::remove_all(saved);
    fs::remove(plain);
  }
  (void)crc_sink;

  const auto b = static_cast<double>(bytes);
  std::printf("\n");
  const double w = print("save (write + fsync)", "plain write() + fsync", write, b, 1e6, "MB/s");
  const double rc = print("read back + CRC, in page cache", "plain read(), in page cache",
                          read_cached, b, 1e6, "MB/s");
  const double fc = print("", "read() into new memory, cached", fresh_cached, b, 1e6, "MB/s");
  const double ru = print("read back + CRC, not cached", "plain read(), not cached", read_uncached,
                          b, 1e6, "MB/s");
  const double fu = print("", "read() into new memory, uncached", fresh_uncached, b, 1e6, "MB/s");
  const double ac = print("read again + CRC, in page cache", "plain read(), in page cache",
                          again_cached, b, 1e6, "MB/s");
  const double au = print("read again + CRC, not cached", "plain read(), not cached",
                          again_uncached, b, 1e6, "MB/s");
  std::printf("%-31s %8.2f GB/s (in cache, 256 KiB again and again: %.2f GB/s)\n",
              "CRC-32C over the state in memory", b / median(crc.ours) / 1e9,
              static_cast<double>(repeats * small.size()) / median(crc.reference) / 1e9);
  std::printf(
      "\nratios (target >= 0.5): save %.2f; read back, in page cache %.2f, not cached %.2f; "
      "read back against read() into new memory, in page cache %.2f, not cached %.2f; "
      "read again (into memory already touched), in page cache %.2f, not cached %.2f\n",
      w, rc, ru, fc, fu, ac, au);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Failure& e) {
    std::fprintf(stderr, "checkpoint benchmark: %s\n", e.what.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint benchmark: %s\n", e.what());
  }
  return 1;
}
