// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pulley::detail {

/// True if no element is NaN or Inf: both have an all-ones exponent, so adding one to the
/// exponent field carries into the sign bit exactly for them. Integer ops in 16 independent
/// lanes keep the loop vectorizable (without -ffast-math) and free of a serial dependency:
/// it checks a gradient faster than memcpy copies it, which matters since every push is
/// checked on both sides.
inline bool all_finite(std::span<const float> values) noexcept {
  constexpr std::size_t kLanes = 16;
  constexpr std::uint32_t kExponent = 0x7F800000U;
  constexpr std::uint32_t kExponentOne = 0x00800000U;
  const float* p = values.data();
  const std::size_t n = values.size();
  std::uint32_t lanes[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) {
      std::uint32_t bits;
      std::memcpy(&bits, p + i + l, sizeof bits);
      lanes[l] |= (bits & kExponent) + kExponentOne;
    }
  }
  std::uint32_t carried = 0;
  for (; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    carried |= (bits & kExponent) + kExponentOne;
  }
  for (std::uint32_t lane : lanes) carried |= lane;
  return (carried & 0x80000000U) == 0;
}

}  // namespace pulley::detail
