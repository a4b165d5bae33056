// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <span>

#include "pulley/concepts/sharding.hpp"
#include "pulley/sharding/partition.hpp"

namespace pulley {

/// Splits every variable along its first dimension into `num_shards` parts (fewer when it
/// has fewer rows), like TF's `fixed_size_partitioner`; parts are dealt round-robin.
struct FixedShards {
  std::size_t num_shards = 1;  ///< parts per variable (fewer if it has fewer rows)

  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return place_round_robin(variables, num_ps,
                                     [this](const VariableSpec&) { return num_shards; });
  }
};
static_assert(Sharding<FixedShards>);

/// Splits a variable only as much as needed to keep each part at least `min_slice_bytes`,
/// with at most `max_shards` parts, like TF's `min_max_variable_partitioner`: rows per part
/// = max(1, floor(min_slice_bytes / row_bytes)), parts = min(max_shards, ceil(rows / that)).
/// Small variables stay whole; parts are dealt round-robin.
struct MinSize {
  std::size_t min_slice_bytes = std::size_t{256} << 10U;  ///< smallest part worth a split
  std::size_t max_shards = 1;                             ///< most parts per variable

  /// Number of parts for `spec` under this rule.
  [[nodiscard]] std::size_t parts_for(const VariableSpec& spec) const {
    const std::size_t row_bytes = spec.row_size() * sizeof(float);
    std::size_t rows_per_part = row_bytes == 0 ? 1 : min_slice_bytes / row_bytes;
    if (rows_per_part == 0) rows_per_part = 1;
    const std::size_t wanted = (spec.rows() + rows_per_part - 1) / rows_per_part;
    return wanted < max_shards ? wanted : max_shards;
  }

  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return place_round_robin(variables, num_ps,
                                     [this](const VariableSpec& s) { return parts_for(s); });
  }
};
static_assert(Sharding<MinSize>);

}  // namespace pulley
