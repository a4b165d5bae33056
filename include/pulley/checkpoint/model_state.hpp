// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pulley/core/variable.hpp"

namespace pulley {

/// An optimizer slot of one variable (Adam's "m", Momentum's "accumulation"): one value per
/// element of the variable, row-major as the variable.
struct SlotState {
  std::string name;
  std::vector<float> values;

  friend bool operator==(const SlotState&, const SlotState&) = default;
};

/// The optimizer's counters of one part of a variable (Adam's "t"), with the rows that part
/// held: counters belong to a part, since each part is updated on its own.
struct PartCounters {
  RowRange rows;
  std::vector<std::int64_t> values;  ///< one per counter name, in order

  friend bool operator==(const PartCounters&, const PartCounters&) = default;
};

/// One variable as a checkpoint holds it: its values, its optimizer slots and counters.
struct VariableState {
  VariableSpec spec;
  std::vector<float> values;                ///< spec.size() floats, row-major
  std::vector<SlotState> slots;             ///< each spec.size() floats
  std::vector<std::string> counter_names;   ///< e.g. {"t"}
  std::vector<PartCounters> counters;       ///< by part, in row order

  friend bool operator==(const VariableState&, const VariableState&) = default;
};

/// One embedding table as a checkpoint holds it: every row the ps tasks held at the cut
/// (an incremental checkpoint's: those touched since its base, and the ids evicted since),
/// with its optimizer slots and the step it was last touched, and the ids admission was
/// counting (pulled, not admitted yet). Rows are in no particular order.
struct TableState {
  TableSpec spec;
  std::vector<std::string> slot_names;  ///< the row-wise optimizer's, in row order
  std::vector<std::uint64_t> ids;       ///< one per row, distinct
  /// Per row, its `spec.dim` values then each slot's `spec.dim` floats: `stride()` floats.
  std::vector<float> rows;
  std::vector<std::uint32_t> touched;   ///< per row: the global step it was last pulled or pushed
  std::vector<std::uint64_t> candidate_ids;     ///< ids pulled, not admitted yet
  std::vector<std::uint32_t> candidate_counts;  ///< per candidate: pulls counted
  std::vector<std::uint32_t> candidate_steps;   ///< per candidate: the step last pulled
  /// The table's update count (lazy Adam's `t`) on each ps that wrote the checkpoint, by
  /// task (all the largest when a ps task had left the job): restored as it was onto as
  /// many ps tasks, else every ps takes the largest.
  std::vector<std::int64_t> updates;
  /// An incremental checkpoint's: the ids of rows evicted since its base (a row evicted and
  /// created again is among `ids` too: remove these first, then take the rows).
  std::vector<std::uint64_t> evicted;

  /// Floats per row: its values and slots.
  [[nodiscard]] std::size_t stride() const noexcept { return (1 + slot_names.size()) * spec.dim; }

  friend bool operator==(const TableState&, const TableState&) = default;
};

/// What a job needs to go on from a global step: every variable with its optimizer state,
/// its embedding tables' rows, and the sync policy's state, as one consistent cut across
/// all ps tasks (Chief::save_state).
struct ModelState {
  /// Global steps completed at the cut.
  std::int64_t global_step = 0;
  /// The sync policy's state at the cut (`SyncPolicy::save`), the same on every ps.
  std::vector<std::int64_t> pacer;
  std::vector<VariableState> variables;
  std::vector<TableState> tables;
  /// The seed the tables' rows start from (a row not held reads as its initial value).
  std::uint64_t table_seed = 0;
  /// -1 for a full checkpoint. An incremental one's tables hold only the rows changed since
  /// the checkpoint of this global step (its base), and the rows evicted since: it is whole
  /// applied over its base (`apply_delta`, checkpoint/delta.hpp). Its dense parts, counts
  /// and sync state are whole.
  std::int64_t base_step = -1;

  /// True for an incremental checkpoint (base_step ≥ 0).
  [[nodiscard]] bool incremental() const noexcept { return base_step >= 0; }

  /// The variables' specs, in order.
  [[nodiscard]] std::vector<VariableSpec> specs() const {
    std::vector<VariableSpec> out;
    for (const VariableState& v : variables) out.push_back(v.spec);
    return out;
  }
  /// The tables' specs, in order.
  [[nodiscard]] std::vector<TableSpec> table_specs() const {
    std::vector<TableSpec> out;
    for (const TableState& t : tables) out.push_back(t.spec);
    return out;
  }

  friend bool operator==(const ModelState&, const ModelState&) = default;
};

}  // namespace pulley
