// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <span>

#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

/// A sharding policy decides which ps task holds which rows of which variable.
///
/// Required:
///   - `s.place(variables, num_ps)` → `Placement`
///
/// Semantic contract:
///   - `place` is pure and deterministic: every ps task computes the placement itself and
///     the chief checks that they all agree, so the same input must give the same output
///     on every process;
///   - for every variable, its parts are listed in row order and cover its rows exactly
///     once with non-empty ranges, and every part's `ps` is below `num_ps` (the server
///     checks this and refuses the model otherwise).
template <class S>
concept Sharding = std::copy_constructible<S> &&
    requires(const S& sharding, std::span<const VariableSpec> variables, std::size_t num_ps) {
  { sharding.place(variables, num_ps) } -> std::same_as<Placement>;
};

/// An id sharding policy decides which ps task holds each row of an embedding table.
///
/// Required:
///   - `s.ps_of(table, id, num_ps)` → `std::uint32_t`: the ps task that holds row `id` of the
///     table named `table`
///
/// Semantic contract:
///   - pure and deterministic, as `Sharding::place`: every worker and every ps computes it
///     and they must agree;
///   - the result is below `num_ps` (a ps refuses rows that are not its own).
template <class S>
concept IdSharding = std::copy_constructible<S> &&
    requires(const S& sharding, std::string_view table, std::uint64_t id, std::uint32_t num_ps) {
  { sharding.ps_of(table, id, num_ps) } -> std::convertible_to<std::uint32_t>;
};

}  // namespace pulley
