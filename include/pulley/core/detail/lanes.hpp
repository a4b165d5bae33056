// SPDX-License-Identifier: MIT
#pragma once

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
/// element. With std::experimental::simd the body runs over native_simd<float> (4 lanes
/// with SSE2, 8 with AVX, 16 with AVX-512), the rest of the range one value at a time.
/// Every lane computes what the scalar rule computes, with the same IEEE operations in the
/// same order (square root and division are correctly rounded in both), so the results
/// are the plain loop's bit for bit.
template <class Rule, std::same_as<float>... Out>
void lanewise(std::size_t begin, std::size_t end, Rule&& rule, const float* in, Out*... out) {
  std::size_t i = begin;
#if defined(__cpp_lib_experimental_parallel_simd) && __cpp_lib_experimental_parallel_simd >= 201803L
  namespace stdx = std::experimental;
  using V = stdx::native_simd<float>;
  constexpr std::size_t kWidth = V::size();
  const std::array<float*, sizeof...(Out)> arrays{out...};
  for (; i + kWidth <= end; i += kWidth) {
    [&]<std::size_t... k>(std::index_sequence<k...>) {
      V values[sizeof...(Out)] = {V(arrays[k] + i, stdx::element_aligned)...};
      rule(V(in + i, stdx::element_aligned), values[k]...);
      (values[k].copy_to(arrays[k] + i, stdx::element_aligned), ...);
    }(std::index_sequence_for<Out...>{});
  }
#endif
  for (; i < end; ++i) rule(in[i], out[i]...);
}

}  // namespace pulley::detail
