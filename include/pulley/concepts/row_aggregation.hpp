// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace pulley {

/// A row aggregation policy decides how the rows of one embedding table pushed for one
/// update become the rows its optimizer applies: TensorFlow's SparseConditionalAccumulator
/// and its `reduction_type`. The ps keeps one `Accumulator` per table; the sync policy
/// decides which pushes belong to an update (their rows share the push's verdict), this
/// policy what their rows add up to.
///
/// Required:
///   - `typename A::Accumulator`, movable
///   - `a.make_accumulator(dim)` → an empty accumulator of rows of `dim` floats
///   - `a.add(acc, ids, rows)` → void: one push's rows, `ids` distinct, `rows` holding
///     `ids.size() × dim` floats in the order of `ids`
///   - `a.ids(acc)` → `std::span<const std::uint64_t>`: the distinct ids added since the last
///     `clear`, each once
///   - `a.take(acc)` → `std::span<const float>`: the update's rows, `ids(acc).size() × dim`
///     floats in the order of `ids(acc)`
///   - `a.clear(acc)`, noexcept: forgets everything added (memory may be kept)
///
/// Semantic contract:
///   - deterministic: the same pushes in the same order give the same rows;
///   - `take` is called once per update, after at least one `add`; its span stays valid
///     until the next `add` or `clear`, and the ps clears the accumulator after each update
///     (applied or rolled back);
///   - ids come from peers: an accumulator that hashes them should key its hash at random,
///     so that chosen ids cannot pile onto one slot;
///   - the policy object is never modified after construction; everything that changes
///     lives in the Accumulator.
template <class A>
concept RowAggregation = std::copy_constructible<A> && std::movable<typename A::Accumulator> &&
    requires(const A& policy, typename A::Accumulator& acc, const typename A::Accumulator& cacc,
             std::span<const std::uint64_t> ids, std::span<const float> rows, std::size_t dim) {
  { policy.make_accumulator(dim) } -> std::same_as<typename A::Accumulator>;
  { policy.add(acc, ids, rows) } -> std::same_as<void>;
  { policy.ids(cacc) } -> std::convertible_to<std::span<const std::uint64_t>>;
  { policy.take(acc) } -> std::convertible_to<std::span<const float>>;
  { policy.clear(acc) } noexcept;
};

}  // namespace pulley
