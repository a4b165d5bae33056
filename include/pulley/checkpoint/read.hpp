// SPDX-License-Identifier: MIT
#pragma once

/// The reading side of a checkpoint (checkpoint/format.hpp describes the format):
/// read_checkpoint, the whole state or only its index, and read_checkpoint_into, which reads
/// into the memory of the tensors a state already holds; every length and CRC is checked.

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "pulley/checkpoint/crc32c.hpp"
#include "pulley/checkpoint/detail/file.hpp"
#include "pulley/checkpoint/detail/index_fields.hpp"
#include "pulley/checkpoint/format_constants.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"

namespace pulley::checkpoint {

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
                                          ModelState* reuse,
                                          std::vector<std::uint64_t>* table_rows) {
  const std::string where = "checkpoint " + dir.string();
  std::string bytes;
  {
    std::error_code ec;
    if (!std::filesystem::exists(dir / "index", ec)) {
      throw Error(ErrorCode::kDataLoss, where + " has no index (it was never finished)");
    }
    detail::File file(dir / "index", O_RDONLY);
    const std::uint64_t size = file.size();
    if (size > (std::uint64_t{1} << 32U))
      throw Error(ErrorCode::kDataLoss, where + ": an index of 4 GiB or more");
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
    throw Error(ErrorCode::kDataLoss,
                where + ": the index is damaged (its CRC-32C does not match)");
  }
  detail::IndexReader in(body.subspan(sizeof kMagic), where);
  const auto version = in.get<std::uint32_t>();
  if (version < kOldestVersion || version > kFormatVersion) {
    in.bad("format version " + std::to_string(version) + ", this pulley reads versions " +
           std::to_string(kOldestVersion) + " to " + std::to_string(kFormatVersion));
  }
  ModelState state;
  state.global_step = in.get<std::int64_t>();
  for (std::uint32_t i = 0, n = in.get_count(8); i < n; ++i)
    state.pacer.push_back(in.get<std::int64_t>());
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
      tensors.push_back({nullptr, detail::get_ref(in),
                         "slot '" + v.slots.back().name + "' of '" + v.spec.name + "'"});
    }
    for (std::uint32_t c = 0, n = in.get_count(4); c < n; ++c)
      v.counter_names.push_back(in.get_string());
    for (std::uint32_t p = 0, n = in.get_count(16); p < n; ++p) {
      PartCounters part;
      part.rows.begin = static_cast<std::size_t>(in.get<std::uint64_t>());
      part.rows.end = static_cast<std::size_t>(in.get<std::uint64_t>());
      for (std::size_t c = 0; c < v.counter_names.size(); ++c)
        part.values.push_back(in.get<std::int64_t>());
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
  std::vector<Counts> counts;     // per table
  std::uint64_t array_bytes = 0;  // of every table, in all
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
      for (std::uint32_t k = 0, n = in.get_count(4); k < n; ++k)
        t.slot_names.push_back(in.get_string());
      for (std::uint32_t k = 0, n = in.get_count(8); k < n; ++k)
        t.updates.push_back(in.get<std::int64_t>());
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
          if (a.chunks.back().floats !=
              std::min<std::uint64_t>(kChunkBytes, bytes_n - c * kChunkBytes)) {
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
      if (c.rows.empty() || c.rows.end > v.spec.rows())
        in.bad("counters of '" + v.spec.name + "' for rows it does not have");
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
      if (detail::read_summed(data, std::as_writable_bytes(std::span(*p.into)), p.ref.offset) !=
          p.ref.crc) {
        throw Error(ErrorCode::kDataLoss, where + ": " + p.what + " is damaged (CRC-32C mismatch)");
      }
    }
  }
  // The tables' arrays: each chunk checked to lie in the data file, and all of them to fit
  // it, before anything is allocated; then read and summed.
  if (array_bytes > data_size)
    throw Error(ErrorCode::kDataLoss, where + ": the data file is truncated (tables)");
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
      const std::span<std::byte> into[7] = {bytes_of(t.ids, n.rows),
                                            bytes_of(t.rows, n.rows * t.stride()),
                                            bytes_of(t.touched, n.rows),
                                            bytes_of(t.candidate_ids, n.candidates),
                                            bytes_of(t.candidate_counts, n.candidates),
                                            bytes_of(t.candidate_steps, n.candidates),
                                            bytes_of(t.evicted, n.evicted)};
      for (const std::span<std::byte> target : std::span(into).first(version >= 3 ? 7 : 6)) {
        const PendingArray& a = arrays[k++];
        std::size_t at = 0;
        for (const detail::TensorRef& c : a.chunks) {
          if (c.floats > target.size() - at)
            throw Error(ErrorCode::kInternal, where + ": " + a.what + " overflows");
          const std::span<std::byte> chunk = target.subspan(at, c.floats);
          if (detail::read_summed(data, chunk, c.offset) != c.crc) {
            throw Error(ErrorCode::kDataLoss,
                        where + ": " + a.what + " is damaged (CRC-32C mismatch)");
          }
          at += chunk.size();
        }
      }
    }
  }
  return state;
}

}  // namespace pulley::checkpoint
