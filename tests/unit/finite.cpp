// SPDX-License-Identifier: MIT
// detail::all_finite, which guards every push on the worker and on the ps.
#include "pulley/core/detail/finite.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

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
  // 37 elements: two full 16-lane blocks and a tail of 5, so every lane and the tail are hit.
  for (float bad : {inf, -inf, nan, -nan, snan}) {
    for (std::size_t at = 0; at < 37; ++at) {
      std::vector<float> values(37, -std::numeric_limits<float>::max());
      values[at] = bad;
      CHECK_MESSAGE(!all_finite(values), "value " << bad << " at " << at);
    }
  }
}
