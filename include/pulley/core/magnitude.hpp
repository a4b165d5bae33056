// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

/// Ordinary magnitudes: what lets a ps prove an update finite without reading the part
/// (BoundsMagnitudes, concepts/optimizer.hpp). The checks fold exponent fields in integer
/// operations, as detail/finite.hpp does, so that their loops vectorize without
/// -ffast-math and cost about what `all_finite` costs.

namespace pulley {

/// The magnitude below which a value is "ordinary" (2^60): far beyond any parameter,
/// optimizer slot or gradient of real training, and far enough below float's range that
/// optimizers prove updates of ordinary values finite from it alone (BoundsMagnitudes):
/// the square of an ordinary gradient, 2^120, still leaves room under kFiniteBound.
inline constexpr float kOrdinaryMagnitude = 0x1p60F;

namespace detail {

/// A float's exponent field, in its bits.
inline constexpr std::uint32_t kExponentBits = 0x7F800000U;
/// A float's sign bit, where the folds below gather what they found.
inline constexpr std::uint32_t kSignBit = 0x80000000U;
/// 69 in the exponent field's bits: added to the field, it carries into the sign bit
/// exactly for exponents of 187 (127 + 60, so 2^60) and up, as 187 + 69 = 256.
inline constexpr std::uint32_t kOrdinaryCarry = 0x22800000U;
static_assert(kOrdinaryMagnitude == 0x1p60F, "kOrdinaryCarry is for 2^60");

/// Folds `x` into `lane`: its top bit becomes set unless |x| < kOrdinaryMagnitude (NaN and
/// Inf included). As `all_finite`, with the carry moved (kOrdinaryCarry).
inline void fold_ordinary(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= (bits & kExponentBits) + kOrdinaryCarry;
}

/// `fold_ordinary` of a value that must not be negative either (-0 counts as negative).
inline void fold_ordinary_non_negative(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= ((bits & kExponentBits) + kOrdinaryCarry) | (bits & kSignBit);
}

/// True if every element is below kOrdinaryMagnitude in magnitude (so finite): one
/// vectorized pass, as `all_finite`.
inline bool all_ordinary(std::span<const float> values) noexcept {
  const float* p = values.data();
  std::uint32_t lane = 0;
  for (std::size_t i = 0; i < values.size(); ++i) fold_ordinary(lane, p[i]);
  return (lane & kSignBit) == 0;
}

/// True if every element is below kOrdinaryMagnitude in magnitude and none is negative.
inline bool all_ordinary_non_negative(std::span<const float> values) noexcept {
  const float* p = values.data();
  std::uint32_t lane = 0;
  for (std::size_t i = 0; i < values.size(); ++i) fold_ordinary_non_negative(lane, p[i]);
  return (lane & kSignBit) == 0;
}

}  // namespace detail

/// A bound of the magnitudes `all_ordinary` (or the like) found `ordinary` or not:
/// kOrdinaryMagnitude, or +infinity (nothing known).
inline float magnitude_bound(bool ordinary) noexcept {
  return ordinary ? kOrdinaryMagnitude : std::numeric_limits<float>::infinity();
}

}  // namespace pulley
