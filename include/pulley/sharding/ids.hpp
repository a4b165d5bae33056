// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <string_view>

#include "pulley/concepts/sharding.hpp"
#include "pulley/core/hash.hpp"

namespace pulley {

/// Rows of embedding tables spread by a hash of the id (and the table's name, so that the
/// same id in many tables does not always land on the same ps): the default, which keeps
/// the load even whatever the ids look like (TensorFlow's `mod` partition strategy does the
/// same with the id itself, which skewed ids defeat).
struct HashIds {
  /// The ps task that holds row `id` of `table`.
  [[nodiscard]] std::uint32_t ps_of(std::string_view table, std::uint64_t id,
                                    std::uint32_t num_ps) const noexcept {
    return static_cast<std::uint32_t>(mix_id(id ^ name_hash(table)) % num_ps);
  }
};
static_assert(IdSharding<HashIds>);

/// Rows of embedding tables spread by range: the id space [0, 2^64) cut into `num_ps` equal
/// contiguous ranges, ps i holding [i·2^64/num_ps, (i+1)·2^64/num_ps) (TensorFlow's `div`
/// strategy over the whole id space). Ids that are already hashes spread evenly; small
/// sequential ids all land on ps 0, so use it for ids drawn over the whole 64-bit range.
struct RangeIds {
  /// The ps task that holds row `id` (the table does not matter).
  [[nodiscard]] std::uint32_t ps_of(std::string_view /*table*/, std::uint64_t id,
                                    std::uint32_t num_ps) const noexcept {
    // floor(id · num_ps / 2^64), in two 32-bit halves so that nothing overflows.
    const std::uint64_t high = (id >> 32U) * num_ps;
    const std::uint64_t low = ((id & 0xFFFFFFFFU) * num_ps) >> 32U;
    return static_cast<std::uint32_t>((high + low) >> 32U);
  }
};
static_assert(IdSharding<RangeIds>);

}  // namespace pulley
