// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/core/detail/lanes.hpp"

namespace pulley {

/// Adagrad with Keras' defaults and rule:
///   accumulator += g^2
///   w -= learning_rate * g / (sqrt(accumulator) + epsilon)
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's SparseApplyAdagrad), whose accumulator is its one row slot.
struct Adagrad {
  float learning_rate = 0.001F;            ///< step size
  float initial_accumulator_value = 0.1F;  ///< starting sum of squares
  float epsilon = 1e-7F;                   ///< keeps the division finite

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    std::optional<std::string> error = SettingsCheck()
                                           .non_negative("learning_rate", learning_rate)
                                           .non_negative("initial_accumulator_value", initial_accumulator_value)
                                           .non_negative("epsilon", epsilon)
                                           .error();
    if (!error && epsilon == 0 && initial_accumulator_value == 0) {
      error = "epsilon and initial_accumulator_value are both 0: a zero gradient would divide 0 by 0";
    }
    return error;
  }

  /// The sum of squared gradients, one value per element.
  struct State {
    std::vector<float> accumulator;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, initial_accumulator_value)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and accumulators
  /// afterwards (+infinity if an accumulator is negative: BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    return update(w.data(), state.accumulator.data(), g.data(), w.size());
  }

  /// True if no weight or accumulator can leave kFiniteBound when each is at most `largest`
  /// (the accumulators not negative) and each gradient element at most `largest_gradient`
  /// in magnitude (BoundsMagnitudes). A step is then at most learning_rate × (1 + 2^-20):
  /// where g² rounds to nothing (|g| < 2^-63), |g| / epsilon is below 2^-23 for an epsilon
  /// of 2^-40 or more. With a smaller epsilon a zero accumulator lets a tiny gradient make
  /// a huge step (or 0/0), so nothing is proven then.
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    return epsilon >= 0x1p-40F && proven_finite(s + g * g) && proven_finite(s + std::abs(double{learning_rate}));
  }

  /// The accumulator, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 1> slots(State& state) const {
    return {OptimizerSlot{"accumulator", state.accumulator}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and the accumulator within kFiniteBound. It works
  /// out the update itself (as `apply` does, without storing it), so it holds for any
  /// accumulators and settings (epsilon = 0 with a zero accumulator and gradient is 0/0);
  /// it costs about as much as `apply`, and is asked only what `stays_finite_given` left.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const float lr = learning_rate;
    const float eps = epsilon;
    const float* wp = w.data();
    const float* gp = g.data();
    const float* ap = state.accumulator.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      const float a = ap[i] + gp[i] * gp[i];
      detail::fold_bound_non_negative(lane, a);  // else its square root is NaN
      detail::fold_bound(lane, wp[i] - lr * gp[i] / (std::sqrt(a) + eps));
    });
  }

  /// A table row keeps one slot: its accumulator.
  static constexpr std::size_t kRowSlots = 1;

  /// The row slot's name, the same as the dense slot's.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"accumulator"};
  }

  /// Starts a new row's accumulator at initial_accumulator_value.
  void init_row(std::span<float> slots) const {
    std::ranges::fill(slots, initial_accumulator_value);
  }

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does; `slots`
  /// holds the row's accumulator (w.size() floats).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (+infinity if its
  /// accumulator is negative: BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> slots, std::span<const float> g,
                          const RowContext& /*context*/) const {
    return update(w.data(), slots.data(), g.data(), w.size());
  }

  /// `stays_finite_given` for a row (BoundsRowMagnitudes): the same rule.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& /*context*/) const {
    return stays_finite_given(State{}, largest, largest_gradient);
  }

 private:
  /// The rule over n elements, behind `apply` and `apply_row`: a bound of the magnitudes
  /// it leaves (BoundsMagnitudes).
  float update(float* __restrict w, float* __restrict accumulator, const float* __restrict g,
               std::size_t n) const {
    const float lr = learning_rate;
    const float eps = epsilon;
    const bool ordinary =
        detail::lanewise_ordinary<1>(  // w of any sign, the accumulator not negative
            0, n,
            [=](auto gi, auto& wi, auto& ai) {  // (by value: the constants stay in registers)
              ai += gi * gi;
              wi -= lr * gi / (detail::lane_sqrt(ai) + eps);
            },
            g, w, accumulator);
    return magnitude_bound(ordinary);
  }
};
static_assert(Optimizer<Adagrad>);
static_assert(BoundsMagnitudes<Adagrad>);
static_assert(RowWiseOptimizer<Adagrad>);
static_assert(BoundsRowMagnitudes<Adagrad>);

}  // namespace pulley
