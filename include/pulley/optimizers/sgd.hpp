// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "pulley/concepts/optimizer.hpp"

namespace pulley {

/// Plain stochastic gradient descent: `w -= learning_rate * g` (TF's GradientDescentOptimizer).
struct Sgd {
  float learning_rate = 0.01F;  ///< step size

  /// SGD keeps no slots.
  struct State {};

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    for (std::size_t i = 0, n = w.size(); i < n; ++i) wp[i] -= lr * gp[i];
  }

  /// True if `apply` keeps every weight within kFiniteBound.
  [[nodiscard]] bool stays_finite(const State& /*state*/, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float* wp = w.data();
    const float* gp = g.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      detail::fold_bound(lane, wp[i] - lr * gp[i]);
    });
  }
};
static_assert(Optimizer<Sgd>);

}  // namespace pulley
