// SPDX-License-Identifier: MIT
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/core/detail/lanes.hpp"

namespace pulley {

/// Plain stochastic gradient descent: `w -= learning_rate * g` (TF's GradientDescentOptimizer).
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's sparse_apply of GradientDescent), which keeps no slots either.
struct Sgd {
  float learning_rate = 0.01F;  ///< step size

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck().non_negative("learning_rate", learning_rate).error();
  }

  /// SGD keeps no slots.
  struct State {};

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the weights' magnitudes afterwards (BoundsMagnitudes).
  float apply_bounded(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    return update(learning_rate, w.data(), g.data(), w.size());
  }

  /// True if no weight can leave kFiniteBound when each is at most `largest` and each
  /// gradient element at most `largest_gradient` in magnitude (BoundsMagnitudes).
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    return proven_finite(double{largest} + std::abs(double{learning_rate}) * largest_gradient);
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

  /// A table row keeps no slots.
  static constexpr std::size_t kRowSlots = 0;

  /// No slot names.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const { return {}; }

  /// Nothing to fill: a row has no slots.
  void init_row(std::span<float> /*slots*/) const {}

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does.
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> /*slots*/, std::span<const float> g,
                          const RowContext& /*context*/) const {
    return update(learning_rate, w.data(), g.data(), w.size());
  }

  /// `stays_finite_given` for a row (BoundsRowMagnitudes): the same rule.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& /*context*/) const {
    return stays_finite_given(State{}, largest, largest_gradient);
  }

 private:
  /// The rule over n elements, behind `apply` and `apply_row`: a bound of the weights'
  /// magnitudes after (kOrdinaryMagnitude or +infinity), judged in the lanes that wrote them.
  static float update(float lr, float* w, const float* g, std::size_t n) {
    return magnitude_bound(detail::arithmetic_lanewise_ordinary<1>(
        0, n, [lr](auto gi, auto& wi) { wi -= lr * gi; }, g, w));
  }
};
static_assert(Optimizer<Sgd>);
static_assert(BoundsMagnitudes<Sgd>);
static_assert(RowWiseOptimizer<Sgd>);
static_assert(BoundsRowMagnitudes<Sgd>);

}  // namespace pulley
