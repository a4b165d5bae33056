// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/checkpoint/format.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/id_index.hpp"
#include "pulley/core/initializers.hpp"

namespace pulley {

/// Rows of one embedding table of a checkpoint, looked up by id without a cluster: for
/// serving, offline evaluation, or an evaluator task scoring checkpoints. A row the
/// checkpoint does not hold reads as its initial value (as a ps reads it to a reader that
/// creates nothing), from the checkpoint's table seed.
///
/// It views `table` (which must outlive it) and adds an index of 4 to 8 bytes per row.
class CheckpointRows {
 public:
  /// Rows of `table`, whose absent rows start from `seed` (ModelState::table_seed).
  CheckpointRows(const TableState& table, std::uint64_t seed) : table_(&table), seed_(seed) {
    if (table.ids.size() >= IdIndex::kNone) {
      throw Error(ErrorCode::kInvalidArgument, "table '" + table.spec.name + "' has too many rows to index");
    }
    index_.reserve(table.ids.size(), key_of());
    for (std::uint32_t row = 0; row < table.ids.size(); ++row) {
      if (!index_.emplace(table.ids[row], row, key_of()).second) {
        throw Error(ErrorCode::kDataLoss, "table '" + table.spec.name + "' holds row " +
                                              std::to_string(table.ids[row]) + " twice");
      }
    }
  }

  /// The table's spec.
  [[nodiscard]] const TableSpec& spec() const noexcept { return table_->spec; }
  /// True if the checkpoint holds the row of `id`.
  [[nodiscard]] bool contains(std::uint64_t id) const noexcept { return index_.find(id, key_of()) != IdIndex::kNone; }

  /// Writes the values of the rows of `ids` into `out` (`ids.size() × dim` floats, in order).
  void lookup(std::span<const std::uint64_t> ids, std::span<float> out) const {
    const std::size_t dim = table_->spec.dim, stride = table_->stride();
    if (out.size() != ids.size() * dim) {
      throw Error(ErrorCode::kInvalidArgument, "lookup of table '" + table_->spec.name + "': " +
                                                   std::to_string(out.size()) + " floats for " +
                                                   std::to_string(ids.size()) + " rows of dim " + std::to_string(dim));
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::span<float> into = out.subspan(i * dim, dim);
      const std::uint32_t row = index_.find(ids[i], key_of());
      if (row == IdIndex::kNone) {
        initialize_row(table_->spec, seed_, ids[i], into);
      } else {
        const float* values = table_->rows.data() + static_cast<std::size_t>(row) * stride;
        std::copy(values, values + dim, into.begin());
      }
    }
  }

 private:
  struct KeyOf {
    const std::vector<std::uint64_t>* ids;
    std::uint64_t operator()(std::uint32_t row) const noexcept { return (*ids)[row]; }
  };
  [[nodiscard]] KeyOf key_of() const noexcept { return KeyOf{&table_->ids}; }

  const TableState* table_;
  std::uint64_t seed_;
  IdIndex index_{0x243F6A8885A308D3ULL};  ///< keyed: the ids came from the checkpoint, not a client
};

/// Every table of `state`, by the model's order: what an evaluator reads rows from. `state`
/// must be whole (a full checkpoint, or CheckpointDirectory::load's): an incremental one
/// alone lacks the rows it did not change, and is refused with kInvalidArgument.
inline std::vector<CheckpointRows> checkpoint_rows(const ModelState& state) {
  if (state.incremental()) {
    throw Error(ErrorCode::kInvalidArgument, "the rows of an incremental checkpoint (over global step " +
                                                 std::to_string(state.base_step) +
                                                 ") are looked up once it is applied over its base (CheckpointDirectory::load)");
  }
  std::vector<CheckpointRows> out;
  out.reserve(state.tables.size());
  for (const TableState& t : state.tables) out.emplace_back(t, state.table_seed);
  return out;
}

}  // namespace pulley
