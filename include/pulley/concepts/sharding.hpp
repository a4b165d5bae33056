// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <span>

#include "pulley/core/error.hpp"
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
///
/// Optional, for a job whose ps tasks change (sharding/rebalance.hpp):
///   - `s.rebalance(variables, before, members)` → `Placement`: `before`'s parts (the same
///     parts, the same rows) placed over the ps tasks `members` (task indices, ascending,
///     not empty); as pure and deterministic as `place`, every part on a member. Without
///     it, `rebalance_parts` moves as few whole parts as keeps the ps tasks balanced.
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

/// An id sharding that also places rows over any set of ps tasks, for a job whose ps tasks
/// change (one lost for good, one added); one that does not is written for a fixed count.
///
/// Required, beyond IdSharding:
///   - `s.ps_of(table, id, members)` → `std::uint32_t`: the ps task among `members` (task
///     indices, ascending, not empty) that holds row `id` of `table`
///
/// Semantic contract:
///   - pure and deterministic, the result one of `members`;
///   - with `members` = 0 .. num_ps − 1 it equals `ps_of(table, id, num_ps)`, so that a job
///     whose ps tasks never change places rows as before;
///   - it should move few rows when `members` changes: HashIds moves only the rows that
///     must (those of a task that left, or a new task's share).
template <class S>
concept ElasticIdSharding = IdSharding<S> &&
    requires(const S& sharding, std::string_view table, std::uint64_t id, std::span<const std::uint32_t> members) {
  { sharding.ps_of(table, id, members) } -> std::convertible_to<std::uint32_t>;
};

/// True when `members` (ascending task indices, not empty) are ps tasks 0 .. n − 1: the
/// shape of a job whose ps tasks never changed, where every IdSharding places rows.
[[nodiscard]] inline bool first_tasks(std::span<const std::uint32_t> members) noexcept {
  return !members.empty() && members.back() + 1 == members.size();
}

/// The ps task among `members` (ascending task indices, not empty) that holds row `id` of
/// `table`: `ps_of(table, id, n)` while the members are ps tasks 0 .. n − 1, else the
/// ElasticIdSharding's `ps_of(table, id, members)`. Throws kFailedPrecondition for an id
/// sharding written for a fixed count once a ps task has left (a ps refuses such a
/// membership when it is registered, so a job meets this only by misuse).
template <IdSharding I>
[[nodiscard]] std::uint32_t row_owner(const I& sharding, std::string_view table, std::uint64_t id,
                                      std::span<const std::uint32_t> members) {
  if (first_tasks(members)) return sharding.ps_of(table, id, static_cast<std::uint32_t>(members.size()));
  if constexpr (ElasticIdSharding<I>) {
    return sharding.ps_of(table, id, members);
  } else {
    throw Error(ErrorCode::kFailedPrecondition,
                "this IdSharding places rows over ps tasks 0 .. n-1 only: give it ps_of(table, id, members) "
                "(ElasticIdSharding) for a job whose ps tasks change");
  }
}

/// Where `sharding` puts rows of `tables` over the ps tasks `members`, as one number: the
/// ps of 64 small ids and 64 ids spread over the whole id space, for every table, hashed.
/// The ps tasks say theirs when a client gets ready (PlacementReply::id_sharding), so that
/// a worker (or a ps) whose id sharding puts rows elsewhere is refused then, by name,
/// instead of having each push refused. Every sharding agrees with every other on one ps
/// task.
template <IdSharding I>
std::uint64_t id_sharding_fingerprint(const I& sharding, std::span<const TableSpec> tables,
                                      std::span<const std::uint32_t> members) {
  std::uint64_t hash = name_hash("id sharding");
  for (const TableSpec& table : tables) {
    hash = name_hash(table.name, hash);
    for (std::uint64_t k = 0; k < 64; ++k) {
      hash = mix_id(hash ^ row_owner(sharding, table.name, k, members));
      hash = mix_id(hash ^ row_owner(sharding, table.name, mix_id(k + 1), members));
    }
  }
  return hash;
}

}  // namespace pulley
