// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <utility>

#if __has_include(<experimental/simd>)
#include <experimental/simd>
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

/// Runs `rule(in[i], out[i]...)` for every i in [begin, end): `in` is read, each `out` is
/// read and written through the references the rule gets. The rule is a generic lambda
/// written once for a value and for a vector of them: it calls `sqrt` unqualified after
/// `using std::sqrt;`, and mixes its arguments with plain floats.
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
  static_assert(sizeof...(Out) > 0, "lanewise writes at least one array");
#if defined(PULLEY_DETAIL_VECTOR_LANES)
  namespace stdx = std::experimental;
  using V = stdx::native_simd<float>;
  constexpr std::size_t kWidth = V::size();
  constexpr std::size_t kOut = sizeof...(Out);
  // One vector: the rule over kWidth values of `x` and of each `ys[k]`, written back there.
  const auto run = [&rule](const float* x, const std::array<float*, kOut>& ys) {
    [&]<std::size_t... k>(std::index_sequence<k...>) {
      V values[kOut] = {V(ys[k], stdx::element_aligned)...};
      rule(V(x, stdx::element_aligned), values[k]...);
      (values[k].copy_to(ys[k], stdx::element_aligned), ...);
    }(std::make_index_sequence<kOut>{});
  };
  std::size_t i = begin;
  for (; i + kWidth <= end; i += kWidth) run(in + i, {(out + i)...});
  if (i == end) return;
  // The last end - i < kWidth elements, in one vector padded with zeros (whatever the rule
  // makes of the padding is dropped).
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
  run(padded_in, to_padded);
  for (std::size_t k = 0; k < kOut; ++k) std::copy_n(padded[k], n, arrays[k]);
#else
  for (std::size_t i = begin; i < end; ++i) rule(in[i], out[i]...);
#endif
}

}  // namespace pulley::detail
