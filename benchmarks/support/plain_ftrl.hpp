// SPDX-License-Identifier: MIT
#pragma once

/// The plain-loop FTRL step the benchmarks compare pulley::Ftrl against: Keras' defaults
/// (learning_rate_power -0.5, no l1 or l2), one scalar pass, as a user would write it.

#include <cmath>
#include <cstddef>

namespace pulley::bench {

/// Updates `n` weights `w` with gradient `g`, and their accumulators `acc` and linear terms
/// `lin`, at learning rate `lr`.
inline void plain_ftrl(float* w, float* acc, float* lin, const float* g, std::size_t n, float lr) {
  for (std::size_t k = 0; k < n; ++k) {
    const float acc_new = acc[k] + g[k] * g[k];
    const float root_new = std::sqrt(acc_new);
    lin[k] += g[k] - (root_new - std::sqrt(acc[k])) / lr * w[k];
    const float quadratic = root_new / lr;
    w[k] = std::abs(lin[k]) > 0.0F ? -lin[k] / quadratic : 0.0F;
    acc[k] = acc_new;
  }
}

}  // namespace pulley::bench
