// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "pulley/core/magnitude.hpp"

#if __has_include(<experimental/simd>)
#include <experimental/simd>
#endif

// GCC 12's AVX-512 square root (_mm512_sqrt_ps, reached through std::experimental::simd's
// sqrt where the target has AVX-512, e.g. -march=native) starts from _mm512_undefined_ps,
// which it defines as a variable initialized from itself: -Wuninitialized and
// -Wmaybe-uninitialized then warn in every function it is inlined into (GCC bug 105593,
// fixed in GCC 13), and a -Werror build of the user's own code fails. Off for this file's
// code, where every rule's square root is taken (`lane_sqrt`), and for what it inlines
// (tests/warnings/ builds the optimizers so).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pulley::detail {

/// True where `lanewise` runs a vector of lanes at a time (the standard library has
/// std::experimental::simd: libstdc++ 11 and later), false where it runs one value at a
/// time.
#if defined(__cpp_lib_experimental_parallel_simd) && __cpp_lib_experimental_parallel_simd >= 201803L
#define PULLEY_DETAIL_VECTOR_LANES 1
inline constexpr bool kVectorLanes = true;
#else
inline constexpr bool kVectorLanes = false;
#endif

/// `lanewise` and `lanewise_ordinary` (below): with `kCheck`, also whether each value
/// written is ordinary, and so is each value the rule returns, if it returns one (a
/// condition it asserts, such as a slot at or above a floor: not negative either). On the
/// values' bits, as `fold_ordinary` does (integer operations, which no floating-point
/// option such as -ffinite-math-only lets the compiler rewrite): the exponent field plus 69
/// carries into the top bit exactly for magnitudes of 2^60 and up, Inf and NaN among them;
/// for the arrays that must not be negative, the sign bit too.
template <bool kCheck, std::size_t kSigned, class Rule, std::same_as<float>... Out>
bool lanes(std::size_t begin, std::size_t end, Rule rule, const float* in, Out*... out) {
  // `rule` is a copy of the caller's, local here: no store through `out` can reach what it
  // captured by value, so its constants stay in registers for the whole loop.
  static_assert(sizeof...(Out) > 0, "lanewise writes at least one array");
  constexpr std::size_t kOut = sizeof...(Out);
  // Folds `bits`, a value written to array k (or a vector of them), into `lane`.
  const auto fold = []<std::size_t k>(std::integral_constant<std::size_t, k>, auto& lane, const auto& bits) {
    if constexpr (k < kSigned) {
      lane |= (bits & kExponentBits) + kOrdinaryCarry;
    } else {
      lane |= ((bits & kExponentBits) + kOrdinaryCarry) | (bits & kSignBit);
    }
  };
  constexpr std::size_t kAsserted = kOut;  // fold's index of what the rule returns: not negative
  std::uint32_t lane = 0;  // the scalar values' fold
  const auto fold_scalars = [&](std::size_t i, const auto&... arrays) {
    [&]<std::size_t... k>(std::index_sequence<k...>) {
      const std::array<float, kOut> written{arrays[i]...};
      (fold(std::integral_constant<std::size_t, k>{}, lane, std::bit_cast<std::uint32_t>(written[k])), ...);
    }(std::make_index_sequence<kOut>{});
  };
#if defined(PULLEY_DETAIL_VECTOR_LANES)
  namespace stdx = std::experimental;
  // AVX without AVX2 (-mavx, -march=sandybridge) has vectors of 8 floats but none of 8
  // integers, so the folds of the values' bits run at SSE2's width of 4 there.
#if defined(__AVX__) && !defined(__AVX2__)
  using V = stdx::simd<float, stdx::simd_abi::deduce_t<float, 4>>;
#else
  using V = stdx::native_simd<float>;
#endif
  using U = stdx::rebind_simd_t<std::uint32_t, V>;
  static_assert(sizeof(U) == sizeof(V) && std::is_trivially_copyable_v<U> && std::is_trivially_copyable_v<V>,
                "a vector of floats and one of their bits are bit casts of each other");
  constexpr std::size_t kWidth = V::size();
  // Two accumulators of folded lanes, a vector each: consecutive vectors fold into
  // different ones, so that no vector waits on the fold of the one before. Sgd's light
  // rule runs a fifth faster than with one (Momentum's about a twentieth); four gained no
  // more, and Ftrl's heavy rule measured slower with them (BENCHMARKS.md).
  constexpr std::size_t kAccumulators = 2;
  U folded[kAccumulators] = {};
  // What the rule returns for the padded tail (below), checked for its elements only.
  [[maybe_unused]] float asserted_tail[kWidth] = {};
  // One vector: the rule over kWidth values of `x` and of each `ys[k]`, written back there
  // (with kCheck, the values written folded into `lanes_folded`, one of `folded`).
  const auto run = [&](const float* x, const std::array<float*, kOut>& ys, bool check,
                       U& lanes_folded) {
    [&]<std::size_t... k>(std::index_sequence<k...>) {
      V values[kOut] = {V(ys[k], stdx::element_aligned)...};
      if constexpr (std::is_void_v<decltype(rule(V(x, stdx::element_aligned), values[k]...))>) {
        rule(V(x, stdx::element_aligned), values[k]...);
      } else {
        const V asserted = rule(V(x, stdx::element_aligned), values[k]...);
        if (kCheck && check)
          fold(std::integral_constant<std::size_t, kAsserted>{}, lanes_folded,
               std::bit_cast<U>(asserted));
        if (kCheck && !check) asserted.copy_to(asserted_tail, stdx::element_aligned);
      }
      if (kCheck && check)
        (fold(std::integral_constant<std::size_t, k>{}, lanes_folded, std::bit_cast<U>(values[k])),
         ...);
      (values[k].copy_to(ys[k], stdx::element_aligned), ...);
    }
    (std::make_index_sequence<kOut>{});
  };
  std::size_t i = begin;
  for (; i + kAccumulators * kWidth <= end; i += kAccumulators * kWidth) {
    for (std::size_t a = 0; a < kAccumulators; ++a) {
      run(in + i + a * kWidth, {(out + i + a * kWidth)...}, true, folded[a]);
    }
  }
  for (; i + kWidth <= end; i += kWidth) run(in + i, {(out + i)...}, true, folded[0]);
  if (i < end) {
    // The last end - i < kWidth elements, in one vector padded with zeros; what the rule
    // makes of the padding is dropped, and only the elements written are checked.
    const std::size_t n = end - i;
    const std::array<float*, kOut> arrays{(out + i)...};
    float padded_in[kWidth] = {};
    float padded[kOut][kWidth] = {};
    std::array<float*, kOut> to_padded{};
    std::copy_n(in + i, n, padded_in);
    for (std::size_t k = 0; k < kOut; ++k) {
      std::copy_n(arrays[k], n, padded[k]);
      to_padded[k] = padded[k];
    }
    run(padded_in, to_padded, false, folded[0]);
    for (std::size_t k = 0; k < kOut; ++k) std::copy_n(padded[k], n, arrays[k]);
    if constexpr (kCheck) {
      for (std::size_t j = 0; j < n; ++j) {
        fold_scalars(j, (out + i)...);
        fold(std::integral_constant<std::size_t, kAsserted>{}, lane,
             std::bit_cast<std::uint32_t>(asserted_tail[j]));
      }
    }
  }
  if constexpr (!kCheck) return true;
  for (std::size_t a = 1; a < kAccumulators; ++a) folded[0] |= folded[a];
  return (lane & kSignBit) == 0 && stdx::none_of((folded[0] & kSignBit) != 0U);
#else
  for (std::size_t i = begin; i < end; ++i) {
    if constexpr (std::is_void_v<decltype(rule(in[i], out[i]...))>) {
      rule(in[i], out[i]...);
    } else {
      const float asserted = rule(in[i], out[i]...);
      if constexpr (kCheck)
        fold(std::integral_constant<std::size_t, kAsserted>{}, lane,
             std::bit_cast<std::uint32_t>(asserted));
    }
    if constexpr (kCheck) fold_scalars(i, out...);
  }
  return (lane & kSignBit) == 0;
#endif
}

/// Runs `rule(in[i], out[i]...)` for every i in [begin, end): `in` is read, each `out` is
/// read and written through the references the rule gets. The rule is a generic lambda
/// written once for a value and for a vector of them: it takes square roots with
/// `lane_sqrt` (below), and mixes its arguments with plain floats. The rule is copied (so it
/// must be copyable, and a state of its own does not outlive the call): one that captures
/// its constants by value has them kept in registers (captured by reference, they are read
/// again for every vector, as a store through `out` might have changed them).
///
/// Why not a plain loop: `std::sqrt` may set errno, so a loop over it does not vectorize
/// unless the user builds with -fno-math-errno, which a header-only library cannot ask
/// for; Adam's, Adagrad's and RMSProp's updates were a scalar square root and division per
/// element. With std::experimental::simd every element goes through native_simd<float> (4
/// lanes with SSE2, 8 with AVX, 16 with AVX-512): the range in whole vectors, and the last
/// few elements in one vector padded with zeros, so that each element of an update is
/// computed by the same code whatever its position. Each lane does the scalar rule's IEEE
/// operations in the same order (square root and division are correctly rounded in both),
/// so the results are the plain loop's bit for bit where the compiler does not fuse a
/// multiply and an add into one rounding (x86-64's baseline, which has no FMA); where it
/// does (`-march=native`, aarch64) an element may differ from the plain loop's in its last
/// bit, alike on every task built the same way.
template <class Rule, std::same_as<float>... Out>
void lanewise(std::size_t begin, std::size_t end, Rule&& rule, const float* in, Out*... out) {
  (void)lanes<false, 0>(begin, end, rule, in, out...);
}

/// The square root of one value, or of each lane of a vector of them: what a `lanewise`
/// rule calls (std::sqrt, or std::experimental::sqrt, whose AVX-512 form GCC 12 warns about
/// wherever it is inlined: see the top of this file).
template <class V>
V lane_sqrt(V x) {
  using std::sqrt;
  return sqrt(x);
}

/// `mask ? a : b` for one value: the conditional a `lanewise` rule writes, which for a
/// vector of lanes (below) picks lane by lane.
inline float choose(bool mask, float a, float b) noexcept { return mask ? a : b; }
#if defined(PULLEY_DETAIL_VECTOR_LANES)
/// `choose` for a vector of lanes: a's lanes where `mask` is set, b's elsewhere.
template <class T, class Abi>
std::experimental::simd<T, Abi> choose(const std::experimental::simd_mask<T, Abi>& mask,
                                       const std::experimental::simd<T, Abi>& a, std::experimental::simd<T, Abi> b) {
  std::experimental::where(mask, b) = a;
  return b;
}
#endif

/// `lanewise`, and true if every value it wrote is ordinary (its magnitude below
/// kOrdinaryMagnitude, so neither NaN nor Inf), the values of the first `kSigned` arrays of
/// `out` of any sign and those of the others not negative either, -0 included (sums of
/// squares, whose square root an optimizer takes): what an optimizer's `apply_bounded` says
/// of the values it leaves (BoundsMagnitudes), judged in the lanes that computed them,
/// while they are in registers, not by reading them again. A rule may also return a value
/// (a float, or a vector as its arguments are) that must be ordinary and not negative: a
/// condition of the values it wrote that the proof of the next update needs (Ftrl returns
/// its accumulator less the floor the proof assumes).
template <std::size_t kSigned, class Rule, std::same_as<float>... Out>
bool lanewise_ordinary(std::size_t begin, std::size_t end, Rule&& rule, const float* in, Out*... out) {
  static_assert(kSigned <= sizeof...(Out), "kSigned counts arrays of out");
  return lanes<true, kSigned>(begin, end, rule, in, out...);
}

/// `lanewise_ordinary` for a rule of additions, subtractions and multiplications only (no
/// division, no `lane_sqrt`, no `choose`), such as Sgd's: where the build targets less than
/// AVX2 and the CPU has it, the rule runs a value at a time in a loop the compiler
/// vectorizes for AVX2 (`run_avx2`, core/magnitude.hpp), each value folded as `lanes` folds
/// it; elsewhere it is `lanewise_ordinary`. The values written are
/// the same in both, bit for bit (no FMA in either). Not for a rule with a square root,
/// which would not vectorize so (std::sqrt may set errno), nor one with a division, which
/// -ffast-math lets the compiler turn into an approximate reciprocal in the vectors and not
/// in the loop's scalar tail; nor with a condition that changes from one element to the
/// next (GCC does not vectorize the branch): make such a choice outside the loop.
template <std::size_t kSigned, class Rule, std::same_as<float>... Out>
bool arithmetic_lanewise_ordinary(std::size_t begin, std::size_t end, Rule&& rule, const float* in,
                                  Out*... out) {
  static_assert(kSigned <= sizeof...(Out), "kSigned counts arrays of out");
#if defined(PULLEY_DETAIL_AVX2_COPY)
  if (kCpuHasAvx2) {
    const auto one_at_a_time = [&, r = rule] {
      std::uint32_t lane = 0;
      for (std::size_t i = begin; i < end; ++i) {
        if constexpr (std::is_void_v<decltype(r(in[i], out[i]...))>) {
          r(in[i], out[i]...);
        } else {
          fold_ordinary_non_negative(lane, r(in[i], out[i]...));
        }
        std::size_t k = 0;
        ((k++ < kSigned ? fold_ordinary(lane, out[i]) : fold_ordinary_non_negative(lane, out[i])),
         ...);
      }
      return (lane & kSignBit) == 0;
    };
    return run_avx2(one_at_a_time);
  }
#endif
  return lanes<true, kSigned>(begin, end, rule, in, out...);
}

}  // namespace pulley::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
