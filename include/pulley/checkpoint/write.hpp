// SPDX-License-Identifier: MIT
#pragma once

/// write_checkpoint: a ModelState written as a checkpoint (checkpoint/format.hpp describes
/// the format), both files flushed to the disk before it returns.

#include <fcntl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "pulley/checkpoint/crc32c.hpp"
#include "pulley/checkpoint/detail/file.hpp"
#include "pulley/checkpoint/detail/index_fields.hpp"
#include "pulley/checkpoint/format_constants.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"

namespace pulley::checkpoint {

/// Writes `state` as a checkpoint in the directory `dir`, which must not exist yet (it is
/// created): the data file, then the index, each flushed to the disk, then the directory.
/// Throws kInvalidArgument for a state whose tensors do not fit its specs, kUnavailable when
/// the disk refuses.
inline void write_checkpoint(const std::filesystem::path& dir, const ModelState& state) {
  for (const VariableState& v : state.variables) {
    const std::size_t n = v.spec.size();
    bool fits = v.values.size() == n;
    for (const SlotState& s : v.slots) fits = fits && s.values.size() == n;
    for (const PartCounters& c : v.counters)
      fits = fits && c.values.size() == v.counter_names.size();
    if (!fits) {
      throw Error(ErrorCode::kInvalidArgument,
                  "checkpoint: the tensors of '" + v.spec.name + "' do not fit its shape");
    }
  }
  for (const TableState& t : state.tables) {
    const std::size_t n = t.ids.size(), c = t.candidate_ids.size();
    if (t.spec.dim == 0 || t.rows.size() != n * t.stride() || t.touched.size() != n ||
        t.candidate_counts.size() != c || t.candidate_steps.size() != c) {
      throw Error(ErrorCode::kInvalidArgument,
                  "checkpoint: the rows of table '" + t.spec.name + "' do not fit it");
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

}  // namespace pulley::checkpoint
