// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <span>

#include "pulley/core/hash.hpp"
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

/// Where `sharding` puts rows of `tables` over `num_ps` ps tasks, as one number: the ps
/// of 64 small ids and 64 ids spread over the whole id space, for every table, hashed. The
/// ps tasks say theirs when a client gets ready (PlacementReply::id_sharding), so that a
/// worker (or a ps) whose id sharding puts rows elsewhere is refused then, by name, instead
/// of having each push refused. Every sharding agrees with every other on one ps task.
template <IdSharding I>
std::uint64_t id_sharding_fingerprint(const I& sharding, std::span<const TableSpec> tables, std::uint32_t num_ps) {
  std::uint64_t hash = name_hash("id sharding");
  for (const TableSpec& table : tables) {
    hash = name_hash(table.name, hash);
    for (std::uint64_t k = 0; k < 64; ++k) {
      hash = mix_id(hash ^ static_cast<std::uint32_t>(sharding.ps_of(table.name, k, num_ps)));
      hash = mix_id(hash ^ static_cast<std::uint32_t>(sharding.ps_of(table.name, mix_id(k + 1), num_ps)));
    }
  }
  return hash;
}

}  // namespace pulley
