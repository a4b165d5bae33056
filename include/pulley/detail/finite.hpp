// SPDX-License-Identifier: MIT
#pragma once

#include <bit>
#include <cstdint>
#include <span>

namespace pulley::detail {

/// True if no element is NaN or Inf. An all-ones exponent marks both; integer ops keep the
/// loop vectorizable without -ffast-math.
inline bool all_finite(std::span<const float> values) noexcept {
  std::uint32_t bad = 0;
  for (float v : values) {
    bad |=
        static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(v) & 0x7F800000U) == 0x7F800000U);
  }
  return bad == 0;
}

}  // namespace pulley::detail
