// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

/// Ordinary magnitudes: what lets a ps prove an update finite without reading the part
/// (BoundsMagnitudes, concepts/optimizer.hpp). The checks fold exponent fields in integer
/// operations in independent lanes (`detail::fold_lanes`), as detail/finite.hpp's
/// `all_finite` does, so that their loops vectorize without -ffast-math and cost a read.

namespace pulley {

/// The magnitude below which a value is "ordinary" (2^60): far beyond any parameter,
/// optimizer slot or gradient of real training, and far enough below float's range that
/// optimizers prove updates of ordinary values finite from it alone (BoundsMagnitudes):
/// the square of an ordinary gradient, 2^120, still leaves room under kFiniteBound.
inline constexpr float kOrdinaryMagnitude = 0x1p60F;

namespace detail {

// Where the build targets x86-64 below AVX2 (its default: SSE2, 4 floats per instruction),
// the loops that most pushes and pulls run (the checks, Sgd's update) are compiled a second
// time for AVX2 (8 floats), and that copy runs where the CPU has AVX2.
// Not AVX-512 nor FMA: with FMA the compiler fuses a multiply and an add into one rounding,
// and an update would differ in its last bit from the same update on a CPU without it,
// where AVX2's lanes do each element's IEEE operations as SSE2's do, bit for bit. A build
// for AVX2 or more (-mavx2, -march=native) takes what it asked for instead.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__) && \
    !defined(__FMA__)
#define PULLEY_DETAIL_AVX2_COPY 1
#endif

/// Runs `fold(i, lane)` for every i in [0, n), the values of 32 consecutive i folded into
/// 32 independent lanes, and returns the lanes OR-ed together: `fold_lanes`'s loop, in the
/// instruction set of the function it is inlined into.
template <class Fold>
[[gnu::always_inline]] inline std::uint32_t fold_in_lanes(std::size_t n, Fold& fold) noexcept {
  constexpr std::size_t kLanes = 32;
  std::uint32_t lanes[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) fold(i + l, lanes[l]);
  }
  std::uint32_t all = 0;
  for (; i < n; ++i) fold(i, all);
  for (const std::uint32_t lane : lanes) all |= lane;
  return all;
}

#if defined(PULLEY_DETAIL_AVX2_COPY)
/// True if this CPU, and its OS, run AVX2 instructions. Read at static initialization; a
/// loop run before that (another static initializer's) sees false and takes SSE2's copy,
/// which gives the same values.
inline const bool kCpuHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();

/// Runs `kernel()`, a loop written a value at a time, with what it calls inlined
/// (`flatten`; clang inlines only the calls in this body, so what the kernel calls in turn
/// is `always_inline`) into this function, compiled for AVX2: the loop vectorizes for 8
/// floats. GCC's -O2 vectorizes only loops that need no run-time check of overlap or trip
/// count, which these loops need, so this function asks GCC for the cost model of -O3
/// (the `optimize` attribute, which GCC's manual calls meant for debugging: it works here
/// as documented, adding one option to the command line's, and a test checks the values).
template <class Kernel>
#if defined(__clang__)
[[gnu::target("avx2"), gnu::flatten]]
#else
[[gnu::target("avx2"), gnu::flatten, gnu::optimize("vect-cost-model=dynamic")]]
#endif
auto run_avx2(Kernel& kernel) {
  return kernel();
}
#endif

/// Runs `fold(i, lane)` for every i in [0, n), the values of 32 consecutive i folded into
/// 32 independent lanes, and returns the lanes OR-ed together. The checks of pulley fold a
/// value's bits with integer operations into a lane (its top bit set for a value out of
/// bounds): written as one lane, the loop vectorizes but each vector waits on the OR of the
/// one before; with 32 lanes the compiler keeps several vector accumulators, and a check
/// alone reads at about twice the speed (a 1 MB gradient: 66-71 GB/s against 29-31 with
/// one lane, SSE2, the host of BENCHMARKS.md), faster than memcpy copies it. With AVX2's
/// 8 floats where the CPU has them (`run_avx2`).
template <class Fold>
std::uint32_t fold_lanes(std::size_t n, Fold&& fold) noexcept {
#if defined(PULLEY_DETAIL_AVX2_COPY)
  if (kCpuHasAvx2) {
    const auto kernel = [n, &fold] { return fold_in_lanes(n, fold); };
    return run_avx2(kernel);
  }
#endif
  return fold_in_lanes(n, fold);
}

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
  return (fold_lanes(values.size(),
                     [p](std::size_t i, std::uint32_t& lane) { fold_ordinary(lane, p[i]); }) &
          kSignBit) == 0;
}

/// True if every element is below kOrdinaryMagnitude in magnitude and none is negative.
inline bool all_ordinary_non_negative(std::span<const float> values) noexcept {
  const float* p = values.data();
  return (fold_lanes(
              values.size(),
              [p](std::size_t i, std::uint32_t& lane) { fold_ordinary_non_negative(lane, p[i]); }) &
          kSignBit) == 0;
}

}  // namespace detail

/// A bound of the magnitudes `all_ordinary` (or the like) found `ordinary` or not:
/// kOrdinaryMagnitude, or +infinity (nothing known).
inline float magnitude_bound(bool ordinary) noexcept {
  return ordinary ? kOrdinaryMagnitude : std::numeric_limits<float>::infinity();
}

}  // namespace pulley
