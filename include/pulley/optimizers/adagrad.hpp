// SPDX-License-Identifier: MIT
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/concepts/optimizer.hpp"

namespace pulley {

/// Adagrad with Keras' defaults and rule:
///   accumulator += g^2
///   w -= learning_rate * g / (sqrt(accumulator) + epsilon)
struct Adagrad {
  float learning_rate = 0.001F;            ///< step size
  float initial_accumulator_value = 0.1F;  ///< starting sum of squares
  float epsilon = 1e-7F;                   ///< keeps the division finite

  /// The sum of squared gradients, one value per element.
  struct State {
    std::vector<float> accumulator;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, initial_accumulator_value)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    const float eps = epsilon;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict ap = state.accumulator.data();
    for (std::size_t i = 0, n = w.size(); i < n; ++i) {
      ap[i] += gp[i] * gp[i];
      wp[i] -= lr * gp[i] / (std::sqrt(ap[i]) + eps);
    }
  }

  /// The accumulator, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 1> slots(State& state) const {
    return {OptimizerSlot{"accumulator", state.accumulator}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and the accumulator within kFiniteBound. A step is
  /// at most learning_rate * |g| / sqrt(g^2) = learning_rate, so no division is needed.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = std::abs(learning_rate);
    const float* wp = w.data();
    const float* gp = g.data();
    const float* ap = state.accumulator.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      detail::fold_bound(lane, ap[i] + gp[i] * gp[i]);
      detail::fold_bound(lane, std::abs(wp[i]) + lr);
    });
  }
};
static_assert(Optimizer<Adagrad>);

}  // namespace pulley
