// SPDX-License-Identifier: MIT
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/core/detail/lanes.hpp"

namespace pulley {

/// Momentum SGD with TensorFlow's update rule (MomentumOptimizer):
///   accumulation = momentum * accumulation + g
///   w -= learning_rate * accumulation                         (classic)
///   w -= learning_rate * (g + momentum * accumulation)        (use_nesterov)
struct Momentum {
  float learning_rate = 0.01F;  ///< step size
  float momentum = 0.9F;        ///< decay of the accumulation
  bool use_nesterov = false;    ///< look-ahead update

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck().non_negative("learning_rate", learning_rate).fraction("momentum", momentum).error();
  }

  /// The accumulation slot, one value per element.
  struct State {
    std::vector<float> accumulation;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const { return {std::vector<float>(n, 0.0F)}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and the accumulation
  /// afterwards, judged in the lanes that wrote them (BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    const std::size_t n = w.size();
    const bool nesterov = use_nesterov;
    const auto rule = [lr, mu, nesterov](auto gi, auto& ai, auto& wi) {
      ai = mu * ai + gi;
      wi -= lr * (nesterov ? gi + mu * ai : ai);
    };
    // Both arrays of any sign.
    const bool ordinary =
        detail::lanewise_ordinary<2>(0, n, rule, g.data(), state.accumulation.data(), w.data());
    return magnitude_bound(ordinary);
  }

  /// True if no weight or accumulation can leave kFiniteBound when each is at most
  /// `largest` and each gradient element at most `largest_gradient` in magnitude
  /// (BoundsMagnitudes).
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    const double mu = std::abs(double{momentum});
    const double acc = mu * s + g;
    const double step = use_nesterov ? g + mu * acc : acc;
    return proven_finite(acc) && proven_finite(s + std::abs(double{learning_rate}) * step);
  }

  /// The accumulation, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 1> slots(State& state) const {
    return {OptimizerSlot{"accumulation", state.accumulation}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and the accumulation within kFiniteBound.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float mu = momentum;
    const float* wp = w.data();
    const float* gp = g.data();
    const float* ap = state.accumulation.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      const float acc = mu * ap[i] + gp[i];
      // Nesterov's step g + mu * acc; plain momentum's acc (the same float ops as apply's).
      const float step = use_nesterov ? gp[i] + mu * acc : acc;
      detail::fold_bound(lane, acc);
      detail::fold_bound(lane, wp[i] - lr * step);
    });
  }
};
static_assert(Optimizer<Momentum>);
static_assert(BoundsMagnitudes<Momentum>);

}  // namespace pulley
