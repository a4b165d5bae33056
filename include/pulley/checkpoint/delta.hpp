// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

/// Applies the incremental checkpoint `delta` over `base`, the whole state at `delta`'s base
/// step (a full checkpoint, or deltas already applied over one): `base` becomes the whole
/// state at `delta`'s step. Per table, the rows `delta` says were evicted go, then its rows
/// replace those of the same id or join them; admission counts and update counts are
/// `delta`'s (they are whole in every checkpoint), as are the dense parts and the sync
/// state. A full `delta` simply replaces `base`. Throws kInvalidArgument, leaving `base` as
/// it was, when `delta` is not over `base` (another step, other tables or slots).
///
/// Costs O(rows of `base` × log rows of `delta`) time and memory for `delta`'s ids only.
inline void apply_delta(ModelState& base, ModelState delta) {
  if (!delta.incremental()) {
    base = std::move(delta);
    return;
  }
  if (base.incremental() || base.global_step != delta.base_step) {
    throw Error(ErrorCode::kInvalidArgument,
                "an incremental checkpoint over global step " + std::to_string(delta.base_step) +
                    " applied over " + (base.incremental() ? "another incremental one" : "the state of step " +
                                                                     std::to_string(base.global_step)));
  }
  if (base.tables.size() != delta.tables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "an incremental checkpoint of " + std::to_string(delta.tables.size()) +
                                                 " tables over one of " + std::to_string(base.tables.size()));
  }
  for (std::size_t t = 0; t < base.tables.size(); ++t) {
    const TableState& a = base.tables[t];
    const TableState& b = delta.tables[t];
    if (a.spec.name != b.spec.name || a.spec.dim != b.spec.dim || a.slot_names != b.slot_names) {
      throw Error(ErrorCode::kInvalidArgument, "an incremental checkpoint's table '" + b.spec.name +
                                                   "' is not its base's '" + a.spec.name + "' (name, dim, slots)");
    }
  }
  for (std::size_t t = 0; t < base.tables.size(); ++t) {
    TableState& into = base.tables[t];
    TableState& d = delta.tables[t];
    const std::size_t stride = into.stride();
    std::vector<std::uint64_t> gone = std::move(d.evicted);
    std::sort(gone.begin(), gone.end());
    // The delta's rows by id.
    std::vector<std::pair<std::uint64_t, std::size_t>> changed(d.ids.size());
    for (std::size_t i = 0; i < d.ids.size(); ++i) changed[i] = {d.ids[i], i};
    std::sort(changed.begin(), changed.end());
    std::vector<bool> placed(d.ids.size(), false);
    // One pass over the base's rows: evicted ones go (the rest close up), changed ones take
    // the delta's values.
    std::size_t kept = 0;
    for (std::size_t r = 0; r < into.ids.size(); ++r) {
      const std::uint64_t id = into.ids[r];
      const auto c = std::lower_bound(changed.begin(), changed.end(), std::pair{id, std::size_t{0}});
      const bool is_changed = c != changed.end() && c->first == id;
      if (!is_changed && std::binary_search(gone.begin(), gone.end(), id)) continue;
      const float* from = into.rows.data() + r * stride;
      std::uint32_t touched = into.touched[r];
      if (is_changed) {
        from = d.rows.data() + c->second * stride;
        touched = d.touched[c->second];
        placed[c->second] = true;
      }
      into.ids[kept] = id;
      into.touched[kept] = touched;
      std::copy(from, from + stride, into.rows.begin() + static_cast<std::ptrdiff_t>(kept * stride));
      ++kept;
    }
    into.ids.resize(kept);
    into.touched.resize(kept);
    into.rows.resize(kept * stride);
    // Rows the base did not hold join it.
    for (std::size_t i = 0; i < d.ids.size(); ++i) {
      if (placed[i]) continue;
      into.ids.push_back(d.ids[i]);
      into.touched.push_back(d.touched[i]);
      into.rows.insert(into.rows.end(), d.rows.begin() + static_cast<std::ptrdiff_t>(i * stride),
                       d.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * stride));
    }
    into.spec = std::move(d.spec);
    into.candidate_ids = std::move(d.candidate_ids);
    into.candidate_counts = std::move(d.candidate_counts);
    into.candidate_steps = std::move(d.candidate_steps);
    into.updates = std::move(d.updates);
  }
  base.global_step = delta.global_step;
  base.pacer = std::move(delta.pacer);
  base.variables = std::move(delta.variables);
  base.table_seed = delta.table_seed;
  base.base_step = -1;
}

}  // namespace pulley
