// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

// Building blocks of the stock sharding policies, for writing your own.

/// Splits `rows` rows into `k` contiguous ranges as TensorFlow's partitioned variables do:
/// the first `rows % k` ranges get one row more. `k` is clamped to [1, rows] (a variable of
/// 0 rows gets one empty range).
inline std::vector<RowRange> partition_rows(std::size_t rows, std::size_t k) {
  if (k < 1) k = 1;
  if (k > rows && rows > 0) k = rows;
  const std::size_t base = rows / k;
  const std::size_t extra = rows % k;
  std::vector<RowRange> ranges;
  ranges.reserve(k);
  std::size_t begin = 0;
  for (std::size_t i = 0; i < k; ++i) {
    const std::size_t end = begin + base + (i < extra ? 1 : 0);
    ranges.push_back({begin, end});
    begin = end;
  }
  return ranges;
}

/// Splits every variable into `parts_for(spec)` parts (`partition_rows`) and deals all the
/// parts to the ps tasks round-robin in creation order, as `replica_device_setter` does
/// with each part. Throws kInvalidArgument when `num_ps` is 0.
template <class PartsFor>
Placement place_round_robin(std::span<const VariableSpec> variables, std::size_t num_ps,
                            PartsFor parts_for) {
  if (num_ps == 0) throw Error(ErrorCode::kInvalidArgument, "sharding needs at least one ps task");
  PlacementBuilder builder;
  std::size_t next_ps = 0;
  for (const VariableSpec& spec : variables) {
    builder.begin_variable();
    for (const RowRange& rows : partition_rows(spec.rows(), parts_for(spec))) {
      builder.add(static_cast<std::uint32_t>(next_ps), rows);
      next_ps = (next_ps + 1) % num_ps;
    }
  }
  return std::move(builder).finish();
}

}  // namespace pulley
