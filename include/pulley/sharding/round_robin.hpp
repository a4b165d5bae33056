// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <span>

#include "pulley/concepts/sharding.hpp"
#include "pulley/sharding/partition.hpp"

namespace pulley {

/// Whole variables dealt to the ps tasks in turn: variable i on ps `i % num_ps`.
/// TensorFlow's default (`replica_device_setter` with its round-robin strategy).
struct RoundRobin {
  /// The placement of `variables` over `num_ps` ps tasks.
  [[nodiscard]] Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
    return place_round_robin(variables, num_ps, [](const VariableSpec&) { return std::size_t{1}; });
  }
};
static_assert(Sharding<RoundRobin>);

}  // namespace pulley
