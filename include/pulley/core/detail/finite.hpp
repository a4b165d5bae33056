// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "pulley/core/magnitude.hpp"

namespace pulley::detail {

/// True if no element is NaN or Inf: both have an all-ones exponent, so adding one to the
/// exponent field carries into the sign bit exactly for them. Every push is checked on
/// both sides, so this runs at about a read's speed (`fold_lanes`), and on the values'
/// bits, so no -ffast-math build can compile it away.
inline bool all_finite(std::span<const float> values) noexcept {
  constexpr std::uint32_t kExponentOne = 0x00800000U;
  const float* p = values.data();
  const std::uint32_t carried = fold_lanes(values.size(), [p](std::size_t i, std::uint32_t& lane) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    lane |= (bits & kExponentBits) + kExponentOne;
  });
  return (carried & kSignBit) == 0;
}

}  // namespace pulley::detail
