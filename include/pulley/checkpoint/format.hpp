// SPDX-License-Identifier: MIT
#pragma once

/// One checkpoint on disk: a directory holding two files.
///
///   data   every tensor (each variable's values, then its slots), float32 little-endian,
///          each starting at a multiple of 64 bytes; then each embedding table's arrays
///          (ids, rows, last-touched steps, admission counts), each in chunks of at most
///          64 MiB, each chunk starting at a multiple of 64 bytes
///   index  what the tensors are: "PULLEYCK", the format version, the global step, the sync
///          policy's state, and per variable its name, shape, initializer, where each of its
///          tensors lies in `data` with its CRC-32C, its slot names and its counters by part;
///          then (version 2) the tables' seed, per table its spec, slot names, update
///          counts, and where each chunk of its arrays lies with its CRC-32C; (version 3)
///          the base step of an incremental checkpoint (-1: a full one) and per table the
///          ids evicted since it; last, the CRC-32C of everything before it
///
/// Versions 1 (pulley 0.2, no tables) and 2 (tables, no incremental checkpoints) still read.
///
/// `write_checkpoint` writes both files and flushes them to the disk (fsync) before it
/// returns; `read_checkpoint` checks every length against what is left and every CRC, and
/// throws `kDataLoss` naming what is wrong, so a checkpoint cut short by a crash or damaged
/// on disk is never taken for a good one. Integers are little-endian.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/checkpoint/crc32c.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "pulley's checkpoint format is little-endian; big-endian hosts are not supported");

namespace pulley::checkpoint {

inline constexpr char kMagic[8] = {'P', 'U', 'L', 'L', 'E', 'Y', 'C', 'K'};
inline constexpr std::uint32_t kFormatVersion = 3;  ///< bumped on any incompatible change
inline constexpr std::uint32_t kOldestVersion = 1;  ///< the oldest version read
inline constexpr std::size_t kChunkBytes = std::size_t{64} << 20U;  ///< of a table's arrays
inline constexpr std::size_t kAlignment = 64;       ///< of each tensor in the data file

namespace detail {

/// A file descriptor, closed when it goes.
class File {
 public:
  File(const std::filesystem::path& path, int flags, mode_t mode = 0644)
      : fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)), path_(path) {
    if (fd_ < 0) fail("cannot open");
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Writes all of `bytes`.
  void write(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("cannot write");
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
  }
  /// Reads exactly `out.size()` bytes at `offset`; throws kDataLoss if the file ends first.
  void read_at(std::span<std::byte> out, std::uint64_t offset) const {
    while (!out.empty()) {
      const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read");
      if (n == 0) throw Error(ErrorCode::kDataLoss, path_.string() + " is truncated");
      out = out.subspan(static_cast<std::size_t>(n));
      offset += static_cast<std::uint64_t>(n);
    }
  }
  /// The file's size in bytes.
  [[nodiscard]] std::uint64_t size() const {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) fail("cannot stat");
    return static_cast<std::uint64_t>(info.st_size);
  }
  /// Flushes what was written to the disk.
  void sync() {
    if (::fsync(fd_) != 0) fail("cannot flush");
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw Error(ErrorCode::kUnavailable, std::string(what) + " " + path_.string() + ": " +
                                             std::strerror(errno));
  }

  int fd_;
  std::filesystem::path path_;
};

/// Flushes a directory's entries (a file created or renamed in it) to the disk.
inline void sync_directory(const std::filesystem::path& dir) {
  File d(dir, O_RDONLY | O_DIRECTORY);
  d.sync();
}

/// Appends little-endian fields to a byte string.
class IndexWriter {
 public:
  template <class T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void put(std::string_view text) {
    put(static_cast<std::uint32_t>(text.size()));
    bytes_.append(text);
  }
  [[nodiscard]] const std::string& bytes() const noexcept { return bytes_; }
  std::string& bytes() noexcept { return bytes_; }

 private:
  std::string bytes_;
};

/// Reads fields back, each checked against the bytes left; a count is checked to fit.
class IndexReader {
 public:
  IndexReader(std::span<const char> bytes, std::string where)
      : bytes_(bytes), where_(std::move(where)) {}

  template <class T>
  T get() {
    static_assert(std::is_arithmetic_v<T>);
    T value{};
    take(&value, sizeof value);
    return value;
  }
  std::string get_string() {
    const auto n = get<std::uint32_t>();
    if (n > bytes_.size()) bad("a string longer than the index");
    std::string out(bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
    return out;
  }
  /// A count of items of at least `bytes_each` bytes each: no more than can follow.
  std::uint32_t get_count(std::size_t bytes_each) {
    const auto n = get<std::uint32_t>();
    if (static_cast<std::uint64_t>(n) * bytes_each > bytes_.size()) bad("a count larger than the index");
    return n;
  }
  [[nodiscard]] std::size_t left() const noexcept { return bytes_.size(); }
  [[noreturn]] void bad(const std::string& what) const {
    throw Error(ErrorCode::kDataLoss, where_ + ": " + what);
  }

 private:
  void take(void* out, std::size_t n) {
    if (n > bytes_.size()) bad("the index ends in the middle of a field");
    std::memcpy(out, bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
  }

  std::span<const char> bytes_;
  std::string where_;
};

/// Where a tensor lies in the data file.
struct TensorRef {
  std::uint64_t offset = 0;
  std::uint64_t floats = 0;
  std::uint32_t crc = 0;
};

inline void put_ref(IndexWriter& w, const TensorRef& r) {
  w.put(r.offset);
  w.put(r.floats);
  w.put(r.crc);
}
inline TensorRef get_ref(IndexReader& r) {
  TensorRef ref;
  ref.offset = r.get<std::uint64_t>();
  ref.floats = r.get<std::uint64_t>();
  ref.crc = r.get<std::uint32_t>();
  return ref;
}

}  // namespace detail

/// Writes `state` as a checkpoint in the directory `dir`, which must not exist yet (it is
/// created): the data file, then the index, each flushed to the disk, then the directory.
/// Throws kInvalidArgument for a state whose tensors do not fit its specs, kUnavailable when
/// the disk refuses.
inline void write_checkpoint(const std::filesystem::path& dir, const ModelState& state) {
  for (const VariableState& v : state.variables) {
    const std::size_t n = v.spec.size();
    bool fits = v.values.size() == n;
    for (const SlotState& s : v.slots) fits = fits && s.values.size() == n;
    for (const PartCounters& c : v.counters) fits = fits && c.values.size() == v.counter_names.size();
    if (!fits) {
      throw Error(ErrorCode::kInvalidArgument,
                  "checkpoint: the tensors of '" + v.spec.name + "' do not fit its shape");
    }
  }
  for (const TableState& t : state.tables) {
    const std::size_t n = t.ids.size(), c = t.candidate_ids.size();
    if (t.spec.dim == 0 || t.rows.size() != n * t.stride() || t.touched.size() != n ||
        t.candidate_counts.size() != c || t.candidate_steps.size() != c) {
      throw Error(ErrorCode::kInvalidArgument, "checkpoint: the rows of table '" + t.spec.name + "' do not fit it");
    }
  }
  std::error_code ec;
  if (!std::filesystem::create_directory(dir, ec)) {
    throw Error(ErrorCode::kUnavailable, "cannot create " + dir.string() + ": " +
                                             (ec ? ec.message() : std::string("it exists")));
  }
  detail::IndexWriter index;
  index.bytes().append(kMagic, sizeof kMagic);
  index.put(kFormatVersion);
  index.put(state.global_step);
  index.put(static_cast<std::uint32_t>(state.pacer.size()));
  for (const std::int64_t x : state.pacer) index.put(x);
  index.put(static_cast<std::uint32_t>(state.variables.size()));
  {
    detail::File data(dir / "data", O_WRONLY | O_CREAT | O_EXCL);
    std::uint64_t offset = 0;
    static constexpr std::byte kZeros[kAlignment] = {};
    // Writes `bytes` at the next multiple of kAlignment; returns where they start.
    auto write_aligned = [&](std::span<const std::byte> bytes) {
      const std::uint64_t at = offset;
      data.write(bytes);
      offset += bytes.size();
      const std::size_t pad = (kAlignment - offset % kAlignment) % kAlignment;
      data.write(std::span(kZeros, pad));
      offset += pad;
      return at;
    };
    auto put_tensor = [&](const std::vector<float>& values) {
      const auto bytes = std::as_bytes(std::span(values));
      detail::put_ref(index, {write_aligned(bytes), values.size(), crc32c(bytes)});
    };
    for (const VariableState& v : state.variables) {
      index.put(std::string_view(v.spec.name));
      index.put(static_cast<std::uint32_t>(v.spec.shape.size()));
      for (const std::size_t d : v.spec.shape) index.put(static_cast<std::uint64_t>(d));
      index.put(static_cast<std::uint8_t>(v.spec.initializer.kind));
      index.put(v.spec.initializer.value);
      put_tensor(v.values);
      index.put(static_cast<std::uint32_t>(v.slots.size()));
      for (const SlotState& s : v.slots) {
        index.put(std::string_view(s.name));
        put_tensor(s.values);
      }
      index.put(static_cast<std::uint32_t>(v.counter_names.size()));
      for (const std::string& name : v.counter_names) index.put(std::string_view(name));
      index.put(static_cast<std::uint32_t>(v.counters.size()));
      for (const PartCounters& c : v.counters) {
        index.put(static_cast<std::uint64_t>(c.rows.begin));
        index.put(static_cast<std::uint64_t>(c.rows.end));
        for (const std::int64_t x : c.values) index.put(x);
      }
    }
    // Each table's arrays, chunk by chunk: where each chunk lies and its CRC-32C (a chunk's
    // TensorRef counts bytes, not floats).
    auto put_array = [&](std::span<const std::byte> bytes) {
      const std::size_t chunks = (bytes.size() + kChunkBytes - 1) / kChunkBytes;
      index.put(static_cast<std::uint32_t>(chunks));
      for (std::size_t c = 0; c < chunks; ++c) {
        const std::span<const std::byte> chunk =
            bytes.subspan(c * kChunkBytes, std::min(kChunkBytes, bytes.size() - c * kChunkBytes));
        detail::put_ref(index, {write_aligned(chunk), chunk.size(), crc32c(chunk)});
      }
    };
    index.put(static_cast<std::uint32_t>(state.tables.size()));
    index.put(state.table_seed);
    index.put(state.base_step);
    for (const TableState& t : state.tables) {
      index.put(std::string_view(t.spec.name));
      index.put(static_cast<std::uint64_t>(t.spec.dim));
      index.put(static_cast<std::uint8_t>(t.spec.initializer.kind));
      index.put(t.spec.initializer.value);
      index.put(t.spec.admit_after);
      index.put(t.spec.evict_after_steps);
      index.put(t.spec.max_rows);
      index.put(static_cast<std::uint32_t>(t.slot_names.size()));
      for (const std::string& name : t.slot_names) index.put(std::string_view(name));
      index.put(static_cast<std::uint32_t>(t.updates.size()));
      for (const std::int64_t u : t.updates) index.put(u);
      index.put(static_cast<std::uint64_t>(t.ids.size()));
      index.put(static_cast<std::uint64_t>(t.candidate_ids.size()));
      index.put(static_cast<std::uint64_t>(t.evicted.size()));
      put_array(std::as_bytes(std::span(t.ids)));
      put_array(std::as_bytes(std::span(t.rows)));
      put_array(std::as_bytes(std::span(t.touched)));
      put_array(std::as_bytes(std::span(t.candidate_ids)));
      put_array(std::as_bytes(std::span(t.candidate_counts)));
      put_array(std::as_bytes(std::span(t.candidate_steps)));
      put_array(std::as_bytes(std::span(t.evicted)));
    }
    data.sync();
  }
  index.put(crc32c(std::as_bytes(std::span(index.bytes().data(), index.bytes().size()))));
  {
    detail::File file(dir / "index", O_WRONLY | O_CREAT | O_EXCL);
    file.write(std::as_bytes(std::span(index.bytes().data(), index.bytes().size())));
    file.sync();
  }
  detail::sync_directory(dir);
}

namespace detail {

/// Reads `count` bytes at `offset` into `out` and returns their CRC-32C, a chunk at a time so
/// that each is summed while it is still in the processor's cache.
inline std::uint32_t read_summed(const File& file, std::span<std::byte> out, std::uint64_t offset) {
  constexpr std::size_t kChunk = std::size_t{256} << 10U;
  std::uint32_t crc = 0;
  while (!out.empty()) {
    const std::span<std::byte> chunk = out.first(std::min(kChunk, out.size()));
    file.read_at(chunk, offset);
    crc = crc32c(std::span<const std::byte>(chunk), crc);
    offset += chunk.size();
    out = out.subspan(chunk.size());
  }
  return crc;
}

/// Makes `tensor` hold `n` floats. New memory of 4 MiB or more is first asked to be backed by
/// huge pages (madvise; where transparent huge pages are on "madvise", as Debian's default):
/// a read into memory not touched yet is bound by its page faults, 512 times fewer so.
inline void size_for_read(std::vector<float>& tensor, std::size_t n) {
#if defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20U;
  if (tensor.capacity() < n && n * sizeof(float) >= 2 * kHuge) {
    std::vector<float> fresh;
    fresh.reserve(n);
    const auto begin = reinterpret_cast<std::uintptr_t>(fresh.data());
    const std::uintptr_t from = (begin + kHuge - 1) & ~(kHuge - 1);
    const std::uintptr_t to = (begin + n * sizeof(float)) & ~(kHuge - 1);
    if (to > from) ::madvise(reinterpret_cast<void*>(from), to - from, MADV_HUGEPAGE);  // a hint
    tensor = std::move(fresh);
  }
#endif
  tensor.resize(n);
}

/// Takes the tensors of `old`, by variable name and slot name, to read into again.
class TensorPool {
 public:
  explicit TensorPool(ModelState& old) {
    for (VariableState& v : old.variables) {
      tensors_.push_back({v.spec.name, {}, &v.values});
      for (SlotState& s : v.slots) tensors_.push_back({v.spec.name, s.name, &s.values});
    }
  }
  /// Moves the pooled tensor of `variable` (its slot `slot`, or its values when empty) into
  /// `into`, if there is one.
  void take(const std::string& variable, const std::string& slot, std::vector<float>& into) {
    for (Entry& e : tensors_) {
      if (e.from != nullptr && e.variable == variable && e.slot == slot) {
        into = std::move(*e.from);
        e.from = nullptr;
        return;
      }
    }
  }

 private:
  struct Entry {
    std::string variable, slot;
    std::vector<float>* from;
  };
  std::vector<Entry> tensors_;
};

/// `table_rows`, if given, gets each table's row count and then its count of evicted ids
/// from the index (read with or without the values): two numbers per table.
inline ModelState read_checkpoint(const std::filesystem::path& dir, bool values, ModelState* reuse,
                                  std::vector<std::uint64_t>* table_rows = nullptr);

}  // namespace detail

/// Reads the checkpoint in `dir`. With `values` false only the index is read (every field
/// checked, the tensors left empty): what the checkpoint holds, without its weight. Throws
/// kDataLoss naming the problem for anything incomplete or damaged (a missing index, a
/// wrong magic or version, a bad CRC, a data file shorter than the index says).
inline ModelState read_checkpoint(const std::filesystem::path& dir, bool values = true) {
  return detail::read_checkpoint(dir, values, nullptr);
}

/// Reads the checkpoint in `dir` into `into`, reading each tensor into the memory of the
/// tensor of the same variable and slot that `into` holds, if any: an evaluator that scores
/// checkpoint after checkpoint, or a ps restored again, touches no new memory (on a machine
/// where first touching memory costs more than reading it, several times as fast). `into`
/// is replaced whole, and on an error (as read_checkpoint) left valid but unspecified.
inline void read_checkpoint_into(const std::filesystem::path& dir, ModelState& into) {
  into = detail::read_checkpoint(dir, true, &into);
}

inline ModelState detail::read_checkpoint(const std::filesystem::path& dir, bool values,
                                          ModelState* reuse, std::vector<std::uint64_t>* table_rows) {
  const std::string where = "checkpoint " + dir.string();
  std::string bytes;
  {
    std::error_code ec;
    if (!std::filesystem::exists(dir / "index", ec)) {
      throw Error(ErrorCode::kDataLoss, where + " has no index (it was never finished)");
    }
    detail::File file(dir / "index", O_RDONLY);
    const std::uint64_t size = file.size();
    if (size > (std::uint64_t{1} << 32U)) throw Error(ErrorCode::kDataLoss, where + ": an index of 4 GiB or more");
    bytes.resize(static_cast<std::size_t>(size));
    file.read_at(std::as_writable_bytes(std::span(bytes.data(), bytes.size())), 0);
  }
  if (bytes.size() < sizeof kMagic + 8 || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    throw Error(ErrorCode::kDataLoss, where + ": not a pulley checkpoint index");
  }
  std::uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, bytes.data() + bytes.size() - 4, 4);
  const auto body = std::span(bytes.data(), bytes.size() - 4);
  if (crc32c(std::as_bytes(body)) != stored_crc) {
    throw Error(ErrorCode::kDataLoss, where + ": the index is damaged (its CRC-32C does not match)");
  }
  detail::IndexReader in(body.subspan(sizeof kMagic), where);
  const auto version = in.get<std::uint32_t>();
  if (version < kOldestVersion || version > kFormatVersion) {
    in.bad("format version " + std::to_string(version) + ", this pulley reads versions " +
           std::to_string(kOldestVersion) + " to " + std::to_string(kFormatVersion));
  }
  ModelState state;
  state.global_step = in.get<std::int64_t>();
  for (std::uint32_t i = 0, n = in.get_count(8); i < n; ++i) state.pacer.push_back(in.get<std::int64_t>());
  struct Pending {
    std::vector<float>* into;
    detail::TensorRef ref;
    std::string what;
  };
  std::vector<Pending> tensors;
  const std::uint32_t num_variables = in.get_count(20);
  state.variables.resize(num_variables);
  for (VariableState& v : state.variables) {
    v.spec.name = in.get_string();
    for (std::uint32_t d = 0, rank = in.get_count(8); d < rank; ++d) {
      v.spec.shape.push_back(static_cast<std::size_t>(in.get<std::uint64_t>()));
    }
    v.spec.initializer.kind = static_cast<Initializer::Kind>(in.get<std::uint8_t>());
    v.spec.initializer.value = in.get<float>();
    tensors.push_back({&v.values, detail::get_ref(in), "'" + v.spec.name + "'"});
    for (std::uint32_t s = 0, n = in.get_count(24); s < n; ++s) {
      v.slots.push_back({in.get_string(), {}});
      tensors.push_back({nullptr, detail::get_ref(in), "slot '" + v.slots.back().name + "' of '" + v.spec.name + "'"});
    }
    for (std::uint32_t c = 0, n = in.get_count(4); c < n; ++c) v.counter_names.push_back(in.get_string());
    for (std::uint32_t p = 0, n = in.get_count(16); p < n; ++p) {
      PartCounters part;
      part.rows.begin = static_cast<std::size_t>(in.get<std::uint64_t>());
      part.rows.end = static_cast<std::size_t>(in.get<std::uint64_t>());
      for (std::size_t c = 0; c < v.counter_names.size(); ++c) part.values.push_back(in.get<std::int64_t>());
      v.counters.push_back(std::move(part));
    }
  }
  // Tables (version 2): their specs and where their arrays' chunks lie.
  struct PendingArray {
    std::vector<detail::TensorRef> chunks;
    std::string what;
  };
  std::vector<PendingArray> arrays;
  struct Counts {
    std::uint64_t rows, candidates, evicted;
  };
  std::vector<Counts> counts;  // per table
  std::uint64_t array_bytes = 0;                                 // of every table, in all
  if (version >= 2) {
    const std::uint32_t num_tables = in.get_count(40);
    state.table_seed = in.get<std::uint64_t>();
    if (version >= 3) state.base_step = in.get<std::int64_t>();
    if (state.base_step < -1 || (state.base_step >= 0 && state.base_step >= state.global_step)) {
      in.bad("an incremental checkpoint over global step " + std::to_string(state.base_step) +
             ", not before its own " + std::to_string(state.global_step));
    }
    state.tables.resize(num_tables);
    for (TableState& t : state.tables) {
      t.spec.name = in.get_string();
      t.spec.dim = static_cast<std::size_t>(in.get<std::uint64_t>());
      t.spec.initializer.kind = static_cast<Initializer::Kind>(in.get<std::uint8_t>());
      t.spec.initializer.value = in.get<float>();
      t.spec.admit_after = in.get<std::uint32_t>();
      t.spec.evict_after_steps = in.get<std::int64_t>();
      t.spec.max_rows = in.get<std::uint64_t>();
      for (std::uint32_t k = 0, n = in.get_count(4); k < n; ++k) t.slot_names.push_back(in.get_string());
      for (std::uint32_t k = 0, n = in.get_count(8); k < n; ++k) t.updates.push_back(in.get<std::int64_t>());
      const auto rows = in.get<std::uint64_t>();
      const auto candidates = in.get<std::uint64_t>();
      const std::uint64_t evicted = version >= 3 ? in.get<std::uint64_t>() : 0;
      if (table_rows != nullptr) table_rows->insert(table_rows->end(), {rows, evicted});
      counts.push_back({rows, candidates, evicted});
      if (t.spec.dim == 0 || t.spec.dim > (std::size_t{1} << 16U) || t.slot_names.size() > 64) {
        in.bad("table '" + t.spec.name + "' has dim " + std::to_string(t.spec.dim) + " and " +
               std::to_string(t.slot_names.size()) + " slots");
      }
      // Sizes are checked against the data file before anything is allocated.
      const std::uint64_t stride_bytes = t.stride() * sizeof(float);
      const std::string what = "table '" + t.spec.name + "'";
      auto array = [&](std::uint64_t count, std::uint64_t each, std::string part) {
        PendingArray a;
        a.what = what + " (" + std::move(part) + ")";
        if (count > (std::uint64_t{1} << 48U) / each) in.bad(a.what + " has too many elements");
        // Laid out as the writer does: whole chunks of kChunkBytes, the last one shorter.
        const std::uint64_t bytes_n = count * each;
        const std::uint64_t chunks = (bytes_n + kChunkBytes - 1) / kChunkBytes;
        if (in.get_count(20) != chunks) in.bad(a.what + " is not cut into chunks of 64 MiB");
        for (std::uint64_t c = 0; c < chunks; ++c) {
          a.chunks.push_back(detail::get_ref(in));
          if (a.chunks.back().floats != std::min<std::uint64_t>(kChunkBytes, bytes_n - c * kChunkBytes)) {
            in.bad(a.what + " is not cut into chunks of 64 MiB");
          }
        }
        array_bytes += bytes_n;
        if (array_bytes > (std::uint64_t{1} << 62U)) in.bad("tables larger than any data file");
        arrays.push_back(std::move(a));
      };
      array(rows, 8, "ids");
      array(rows, stride_bytes, "rows");
      array(rows, 4, "steps");
      array(candidates, 8, "candidate ids");
      array(candidates, 4, "candidate counts");
      array(candidates, 4, "candidate steps");
      if (version >= 3) array(evicted, 8, "evicted ids");
    }
  }
  if (in.left() != 0) in.bad("bytes after the last table");
  // Slot tensors point into the slots now that the vectors will not move.
  {
    std::size_t t = 0;
    for (VariableState& v : state.variables) {
      ++t;
      for (SlotState& s : v.slots) tensors[t++].into = &s.values;
    }
  }
  for (const VariableState& v : state.variables) {
    for (const PartCounters& c : v.counters) {
      if (c.rows.empty() || c.rows.end > v.spec.rows()) in.bad("counters of '" + v.spec.name + "' for rows it does not have");
    }
  }
  std::optional<detail::TensorPool> pool;
  if (reuse != nullptr && values) pool.emplace(*reuse);
  detail::File data(dir / "data", O_RDONLY);
  const std::uint64_t data_size = data.size();
  for (std::size_t t = 0, vi = 0; t < tensors.size(); ++vi) {
    const VariableState& v = state.variables[vi];
    for (std::size_t k = 0; k <= v.slots.size(); ++k, ++t) {
      const Pending& p = tensors[t];
      if (p.ref.floats != v.spec.size()) in.bad(p.what + " has the wrong number of elements");
      const std::uint64_t bytes_n = p.ref.floats * sizeof(float);
      if (p.ref.offset > data_size || bytes_n > data_size - p.ref.offset) {
        throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (" + p.what + ")");
      }
      if (!values) continue;
      if (pool) pool->take(v.spec.name, k == 0 ? std::string() : v.slots[k - 1].name, *p.into);
      detail::size_for_read(*p.into, static_cast<std::size_t>(p.ref.floats));
      if (detail::read_summed(data, std::as_writable_bytes(std::span(*p.into)), p.ref.offset) != p.ref.crc) {
        throw Error(ErrorCode::kDataLoss, where + ": " + p.what + " is damaged (CRC-32C mismatch)");
      }
    }
  }
  // The tables' arrays: each chunk checked to lie in the data file, and all of them to fit
  // it, before anything is allocated; then read and summed.
  if (array_bytes > data_size) throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (tables)");
  for (const PendingArray& a : arrays) {
    for (const detail::TensorRef& c : a.chunks) {
      if (c.offset > data_size || c.floats > data_size - c.offset) {
        throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (" + a.what + ")");
      }
    }
  }
  if (values) {
    std::size_t k = 0;
    for (TableState& t : state.tables) {
      auto bytes_of = [](auto& vector, std::size_t n) {
        vector.resize(n);
        return std::as_writable_bytes(std::span(vector));
      };
      const Counts& n = counts[static_cast<std::size_t>(&t - state.tables.data())];
      const std::span<std::byte> into[7] = {
          bytes_of(t.ids, n.rows),           bytes_of(t.rows, n.rows * t.stride()),
          bytes_of(t.touched, n.rows),       bytes_of(t.candidate_ids, n.candidates),
          bytes_of(t.candidate_counts, n.candidates), bytes_of(t.candidate_steps, n.candidates),
          bytes_of(t.evicted, n.evicted)};
      for (const std::span<std::byte> target : std::span(into).first(version >= 3 ? 7 : 6)) {
        const PendingArray& a = arrays[k++];
        std::size_t at = 0;
        for (const detail::TensorRef& c : a.chunks) {
          if (c.floats > target.size() - at) throw Error(ErrorCode::kInternal, where + ": " + a.what + " overflows");
          const std::span<std::byte> chunk = target.subspan(at, c.floats);
          if (detail::read_summed(data, chunk, c.offset) != c.crc) {
            throw Error(ErrorCode::kDataLoss, where + ": " + a.what + " is damaged (CRC-32C mismatch)");
          }
          at += chunk.size();
        }
      }
    }
  }
  return state;
}

}  // namespace pulley::checkpoint
