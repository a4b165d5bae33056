// SPDX-License-Identifier: MIT
// detail::all_finite, which guards every push on the worker and on the ps, and
// detail::all_ordinary, which lets a ps prove an update finite without reading it again.
#include "pulley/core/detail/finite.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "pulley/core/magnitude.hpp"

using pulley::detail::all_finite;

TEST_CASE("all_finite accepts every finite value, extremes included") {
  const float lim_max = std::numeric_limits<float>::max();
  const float lim_min = std::numeric_limits<float>::min();
  const float denorm = std::numeric_limits<float>::denorm_min();
  const std::vector<float> values{0.0F,    -0.0F,  1.0F,    -1.0F, lim_max, -lim_max,
                                  lim_min, denorm, -denorm, 3e38F, -3e38F,  1e-40F};
  CHECK(all_finite(values));
  CHECK(all_finite({}));
}

TEST_CASE("all_finite finds one NaN or Inf at any position, in the vector body or its tail") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float snan = std::numeric_limits<float>::signaling_NaN();
  // 69 elements: two full blocks of fold_lanes' 32 lanes and a tail of 5, so every lane and
  // the tail are hit.
  for (float bad : {inf, -inf, nan, -nan, snan}) {
    for (std::size_t at = 0; at < 69; ++at) {
      std::vector<float> values(69, -std::numeric_limits<float>::max());
      values[at] = bad;
      CHECK_MESSAGE(!all_finite(values), "value " << bad << " at " << at);
    }
  }
}

TEST_CASE(
    "all_ordinary and all_ordinary_non_negative find one value out of bounds at any position") {
  const float limit = pulley::kOrdinaryMagnitude;
  const float below = std::nextafter(limit, 0.0F);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(pulley::detail::all_ordinary({}));
  CHECK(pulley::detail::all_ordinary_non_negative({}));
  // As above: every lane of two blocks and the tail. The rest are the largest ordinary
  // magnitude, of both signs for all_ordinary.
  for (std::size_t at = 0; at < 69; ++at) {
    std::vector<float> values(69, below), signed_values(69, -below);
    CHECK(pulley::detail::all_ordinary(signed_values));
    CHECK(pulley::detail::all_ordinary_non_negative(values));
    for (const float bad : {limit, -limit, inf, -inf, nan}) {
      signed_values[at] = bad;
      values[at] = bad;
      CHECK_MESSAGE(!pulley::detail::all_ordinary(signed_values), "value " << bad << " at " << at);
      CHECK_MESSAGE(!pulley::detail::all_ordinary_non_negative(values),
                    "value " << bad << " at " << at);
    }
    for (const float negative : {-0.0F, -1.0F, -below}) {
      values[at] = negative;
      signed_values[at] = negative;
      CHECK(pulley::detail::all_ordinary(signed_values));
      CHECK_MESSAGE(!pulley::detail::all_ordinary_non_negative(values),
                    "value " << negative << " at " << at);
    }
  }
}
