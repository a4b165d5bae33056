// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "pulley/concepts/optimizer.hpp"

namespace pulley {

/// Momentum SGD with TensorFlow's update rule (MomentumOptimizer):
///   accumulation = momentum * accumulation + g
///   w -= learning_rate * accumulation                         (classic)
///   w -= learning_rate * (g + momentum * accumulation)        (use_nesterov)
struct Momentum {
  float learning_rate = 0.01F;  ///< step size
  float momentum = 0.9F;        ///< decay of the accumulation
  bool use_nesterov = false;    ///< look-ahead update

  /// The accumulation slot, one value per element.
  struct State {
    std::vector<float> accumulation;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const { return {std::vector<float>(n, 0.0F)}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict ap = state.accumulation.data();
    const std::size_t n = w.size();
    if (use_nesterov) {
      for (std::size_t i = 0; i < n; ++i) {
        ap[i] = mu * ap[i] + gp[i];
        wp[i] -= lr * (gp[i] + mu * ap[i]);
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        ap[i] = mu * ap[i] + gp[i];
        wp[i] -= lr * ap[i];
      }
    }
  }

  /// True if `apply` keeps every weight and the accumulation within kFiniteBound.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    const float* a = state.accumulation.data();
    unsigned bad = 0;
    for (std::size_t i = 0, n = w.size(); i < n; ++i) {
      const float acc = mu * a[i] + g[i];
      const float step = use_nesterov ? g[i] + mu * acc : acc;
      bad |= static_cast<unsigned>(!(std::abs(acc) <= kFiniteBound) ||
                                   !(std::abs(w[i] - lr * step) <= kFiniteBound));
    }
    return bad == 0;
  }
};
static_assert(Optimizer<Momentum>);

}  // namespace pulley
