// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "pulley/error.hpp"
#include "pulley/placement.hpp"
#include "pulley/variable.hpp"

namespace pulley::detail {

/// Splits every variable into `parts_for(spec)` row ranges as TensorFlow's partitioned
/// variables do (the first `rows % k` parts get one row more) and deals the parts to the ps
/// tasks round-robin in creation order, as `replica_device_setter` does with each part.
template <class PartsFor>
Placement place_round_robin(std::span<const VariableSpec> variables, std::size_t num_ps,
                            PartsFor parts_for) {
  if (num_ps == 0) throw Error(ErrorCode::kInvalidArgument, "sharding needs at least one ps task");
  PlacementBuilder builder;
  std::size_t next_ps = 0;
  for (const VariableSpec& spec : variables) {
    builder.begin_variable();
    const std::size_t rows = spec.rows();
    std::size_t k = parts_for(spec);
    k = k < 1 ? 1 : (k > rows && rows > 0 ? rows : k);
    const std::size_t base = rows / k;
    const std::size_t extra = rows % k;
    std::size_t begin = 0;
    for (std::size_t i = 0; i < k; ++i) {
      const std::size_t end = begin + base + (i < extra ? 1 : 0);
      builder.add(static_cast<std::uint32_t>(next_ps), {begin, end});
      next_ps = (next_ps + 1) % num_ps;
      begin = end;
    }
  }
  return std::move(builder).finish();
}

}  // namespace pulley::detail
