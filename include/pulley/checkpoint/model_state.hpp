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

/// What a job needs to go on from a global step: every variable with its optimizer state,
/// and the sync policy's state, as one consistent cut across all ps tasks (Chief::save).
struct ModelState {
  /// Global steps completed at the cut.
  std::int64_t global_step = 0;
  /// The sync policy's state at the cut (`SyncPolicy::save`), the same on every ps.
  std::vector<std::int64_t> pacer;
  std::vector<VariableState> variables;

  /// The variables' specs, in order.
  [[nodiscard]] std::vector<VariableSpec> specs() const {
    std::vector<VariableSpec> out;
    for (const VariableState& v : variables) out.push_back(v.spec);
    return out;
  }

  friend bool operator==(const ModelState&, const ModelState&) = default;
};

}  // namespace pulley
