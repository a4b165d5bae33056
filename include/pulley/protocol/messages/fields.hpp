// SPDX-License-Identifier: MIT
#pragma once

/// The fields that messages share (protocol/messages.hpp lists the messages): a part's
/// values and its optimizer state, an embedding table's rows, a slice of a part, and the
/// most that one message may carry.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/core/variable.hpp"

namespace pulley {

/// Values for one part, addressed by its global index in `Placement::parts`.
struct PartValues {
  std::uint32_t part = 0;
  std::span<const float> values;  ///< a tensor

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, values);
  }
};

/// One part with its optimizer state, as a checkpoint reads and restores it: its values, its
/// optimizer slots (one value per element each, in the order the ps names them) and its
/// counters.
struct PartState {
  std::uint32_t part = 0;
  std::span<const float> values;              ///< a tensor
  std::vector<std::span<const float>> slots;  ///< tensors
  std::vector<std::int64_t> counters;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, values, slots, counters);
  }
};

/// The most ids one PullRows or Push carries to one ps, over all its tables (2 MiB of ids,
/// half the metadata a TCP frame may hold): a client splits a larger row pull into several
/// and refuses a larger push (its batch is too large), a ps refuses more.
inline constexpr std::size_t kMaxIdsPerMessage = std::size_t{1} << 18U;
/// The most bytes of rows of one table that one PullRows answer or Push carries: a client
/// splits larger row pulls, a ps refuses more.
inline constexpr std::size_t kMaxRowBytesPerMessage = std::size_t{256} << 20U;

/// Rows of one embedding table: which ids, and in a push one row of the table's dim floats
/// per id. The ids ride in the metadata (8 bytes each); the rows are a tensor.
struct TableRows {
  std::uint32_t table = 0;         ///< index into the model's tables
  std::vector<std::uint64_t> ids;  ///< distinct
  std::span<const float> values;   ///< a tensor: ids.size() × dim (empty in a pull)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(table, ids, values);
  }
};

/// Rows `rows` (relative to the variable, inside the part) of part `part`.
struct Slice {
  std::uint32_t part = 0;
  RowRange rows;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, rows);
  }
};

}  // namespace pulley
