// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "pulley/concepts/sharding.hpp"
#include "pulley/core/hash.hpp"

namespace pulley {

/// Rows of embedding tables spread by a hash of the id (and the table's name, so that the
/// same id in many tables does not always land on the same ps): the default, which keeps
/// the load even whatever the ids look like (TensorFlow's `mod` partition strategy does the
/// same with the id itself, which skewed ids defeat).
///
/// Rendezvous (highest random weight) hashing: each ps task scores each row by a hash of
/// the row and the task's index, and the highest score holds it. When the ps tasks change,
/// only the rows that must move do: a ps task added takes about 1/(P + 1) of the rows, from
/// every other one alike, and the rows of a ps task that leaves spread over the rest; no
/// other row changes hands. A lookup costs P + 1 hashes.
struct HashIds {
  /// The ps task that holds row `id` of `table` among ps tasks 0 .. num_ps − 1.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::uint32_t num_ps) const noexcept {
    Best best(row_key(table, id), 0);
    for (std::uint32_t ps = 1; ps < num_ps; ++ps) best.offer(ps);
    return best.ps;
  }

  /// The ps task that holds row `id` of `table` among the ps tasks `members` (task indices,
  /// ascending, not empty): the same as above when they are 0 .. num_ps − 1.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::span<const std::uint32_t> members) const noexcept {
    Best best(row_key(table, id), members.front());
    for (const std::uint32_t ps : members.subspan(1)) best.offer(ps);
    return best.ps;
  }

 private:
  static constexpr std::uint64_t row_key(std::string_view table, std::uint64_t id) noexcept {
    return mix_id(id ^ name_hash(table));
  }
  static constexpr std::uint64_t score(std::uint64_t row, std::uint32_t ps) noexcept {
    return mix_id(row + (std::uint64_t{ps} + 1) * 0x9E3779B97F4A7C15ULL);
  }
  /// The task scoring a row highest among those offered, in ascending order: the first on
  /// a tie.
  struct Best {
    std::uint64_t row;
    std::uint32_t ps;
    std::uint64_t score_of_ps;
    Best(std::uint64_t r, std::uint32_t first) noexcept : row(r), ps(first), score_of_ps(score(r, first)) {}
    void offer(std::uint32_t task) noexcept {
      const std::uint64_t s = score(row, task);
      if (s > score_of_ps) {
        ps = task;
        score_of_ps = s;
      }
    }
  };
};
static_assert(IdSharding<HashIds>);
static_assert(ElasticIdSharding<HashIds>);
/// Rows of embedding tables spread by range: the id space [0, 2^64) cut into `num_ps` equal
/// contiguous ranges, ps i holding [i·2^64/num_ps, (i+1)·2^64/num_ps) (TensorFlow's `div`
/// strategy over the whole id space). Ids that are already hashes spread evenly; small
/// sequential ids all land on ps 0, so use it for ids drawn over the whole 64-bit range.
///
/// When the ps tasks change, the ranges are cut again among them, in task order: adding a
/// ps task to P moves about half the rows (HashIds moves 1/(P + 1)).
struct RangeIds {
  /// The ps task that holds row `id` (the table does not matter).
  [[nodiscard]] std::uint32_t ps_of(std::string_view /*table*/, std::uint64_t id,
                                    std::uint32_t num_ps) const noexcept {
    // floor(id · num_ps / 2^64), in two 32-bit halves so that nothing overflows.
    const std::uint64_t high = (id >> 32U) * num_ps;
    const std::uint64_t low = ((id & 0xFFFFFFFFU) * num_ps) >> 32U;
    return static_cast<std::uint32_t>((high + low) >> 32U);
  }
  /// The ps task that holds row `id` among the ps tasks `members` (not empty): the i-th
  /// range is the i-th member's.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::span<const std::uint32_t> members) const noexcept {
    return members[ps_of(table, id, static_cast<std::uint32_t>(members.size()))];
  }
};
static_assert(ElasticIdSharding<RangeIds>);

}  // namespace pulley
