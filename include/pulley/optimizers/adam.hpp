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

/// Adam (Kingma & Ba) in TensorFlow's form, which folds bias correction into the step size:
///   t += 1
///   lr_t = learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t)
///   m = beta_1 * m + (1 - beta_1) * g
///   v = beta_2 * v + (1 - beta_2) * g^2
///   w -= lr_t * m / (sqrt(v) + epsilon)
/// Defaults are Keras'. `t` counts this part's updates, i.e. the global step in sync mode.
struct Adam {
  float learning_rate = 0.001F;  ///< step size
  float beta_1 = 0.9F;           ///< decay of the first moment
  float beta_2 = 0.999F;         ///< decay of the second moment
  float epsilon = 1e-7F;         ///< keeps the division finite

  /// First and second moment slots plus the update count.
  struct State {
    std::vector<float> m;
    std::vector<float> v;
    std::int64_t t = 0;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), std::vector<float>(n, 0.0F), 0};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    ++state.t;
    const float lr_t = step_size(state.t);
    const float b1 = beta_1;
    const float b2 = beta_2;
    const float eps = epsilon;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict mp = state.m.data();
    float* __restrict vp = state.v.data();
    for (std::size_t i = 0, n = w.size(); i < n; ++i) {
      mp[i] = b1 * mp[i] + (1.0F - b1) * gp[i];
      vp[i] = b2 * vp[i] + (1.0F - b2) * gp[i] * gp[i];
      wp[i] -= lr_t * mp[i] / (std::sqrt(vp[i]) + eps);
    }
  }

  /// The moments, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"m", state.m}, OptimizerSlot{"v", state.v}};
  }
  /// The update count, for checkpoints.
  [[nodiscard]] std::array<OptimizerCounter, 1> counters(State& state) const {
    return {OptimizerCounter{"t", &state.t}};
  }

  /// True if `apply` keeps every weight and both moments within kFiniteBound. A step is at
  /// most lr_t * |m| / epsilon, which bounds it without a square root or a division.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float reach = std::abs(step_size(state.t + 1)) / epsilon;
    const float b1 = beta_1;
    const float b2 = beta_2;
    const float* wp = w.data();
    const float* gp = g.data();
    const float* mp = state.m.data();
    const float* vp = state.v.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      const float m1 = b1 * mp[i] + (1.0F - b1) * gp[i];
      const float v1 = b2 * vp[i] + (1.0F - b2) * gp[i] * gp[i];
      detail::fold_bound(lane, m1);
      detail::fold_bound(lane, v1);
      detail::fold_bound(lane, std::abs(wp[i]) + reach * std::abs(m1));
    });
  }

 private:
  /// lr_t of update number t.
  [[nodiscard]] float step_size(std::int64_t t) const {
    const auto td = static_cast<double>(t);
    return static_cast<float>(learning_rate * std::sqrt(1.0 - std::pow(double{beta_2}, td)) /
                              (1.0 - std::pow(double{beta_1}, td)));
  }
};
static_assert(Optimizer<Adam>);

}  // namespace pulley
