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

/// Adam (Kingma & Ba) in TensorFlow's form, which folds bias correction into the step size:
///   t += 1
///   lr_t = learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t)
///   m = beta_1 * m + (1 - beta_1) * g
///   v = beta_2 * v + (1 - beta_2) * g^2
///   w -= lr_t * m / (sqrt(v) + epsilon)
/// Defaults are Keras'. `t` counts this part's updates, i.e. the global step in sync mode.
///
/// A row of an embedding table (`apply_row`) follows TensorFlow's LazyAdam: its moments are
/// its two row slots and advance only when the row is pushed (an untouched row's do not
/// decay), while `t` is the table's update count `RowContext::updates`, the same for every
/// row of one update. A row pushed at every update therefore moves exactly as `apply` moves
/// a dense element.
struct Adam {
  float learning_rate = 0.001F;  ///< step size
  float beta_1 = 0.9F;           ///< decay of the first moment
  float beta_2 = 0.999F;         ///< decay of the second moment
  float epsilon = 1e-7F;         ///< keeps the division finite

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck()
        .non_negative("learning_rate", learning_rate)
        .decay("beta_1", beta_1)
        .decay("beta_2", beta_2)
        .non_negative("epsilon", epsilon)
        .error();
  }

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
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and moments afterwards
  /// (+infinity if a second moment is negative: BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    ++state.t;
    return update(step_size(state.t), w.data(), state.m.data(), state.v.data(), g.data(), w.size());
  }

  /// True if no weight or moment can leave kFiniteBound when each is at most `largest` (the
  /// second moments not negative) and each gradient element at most `largest_gradient` in
  /// magnitude: `stays_finite`'s bounds over magnitudes (BoundsMagnitudes).
  [[nodiscard]] bool stays_finite_given(const State& state, float largest, float largest_gradient) const {
    return proven_at(step_size(state.t + 1), largest, largest_gradient);
  }

  /// The moments, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"m", state.m}, OptimizerSlot{"v", state.v}};
  }
  /// The update count, for checkpoints.
  [[nodiscard]] std::array<OptimizerCounter, 1> counters(State& state) const {
    return {OptimizerCounter{"t", &state.t}};
  }

  /// True if `apply` keeps every weight and both moments within kFiniteBound (and the second
  /// moments not negative, as a restore could have set them). A step is at most
  /// lr_t * |m| / epsilon, which bounds it without a square root or a division.
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
      detail::fold_bound_non_negative(lane, v1);  // else its square root is NaN
      detail::fold_bound(lane, std::abs(wp[i]) + reach * std::abs(m1));
    });
  }

  /// A table row keeps two slots: its first and second moments.
  static constexpr std::size_t kRowSlots = 2;

  /// The row slots' names, the same as the dense slots'.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"m", "v"};
  }

  /// Starts a new row's moments at zero.
  void init_row(std::span<float> slots) const { std::ranges::fill(slots, 0.0F); }

  /// Updates one table row `w` in place from its gradient `g` (LazyAdam): `slots` holds the
  /// row's m then v (w.size() floats each), and `t` is `context.updates`, which must be at
  /// least 1 (the step size of t = 0 is 0/0).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (+infinity if a
  /// second moment is negative: BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> slots, std::span<const float> g,
                          const RowContext& context) const {
    const std::size_t n = w.size();
    return update(step_size(context.updates), w.data(), slots.data(), slots.data() + n, g.data(), n);
  }

  /// `stays_finite_given` for a row at the table's update `context.updates`
  /// (BoundsRowMagnitudes): the same bounds at that update's step size.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& context) const {
    return proven_at(step_size(context.updates), largest, largest_gradient);
  }

 private:
  /// `stays_finite_given`'s bounds at step size lr_t.
  [[nodiscard]] bool proven_at(float lr_t, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    const double m1 = beta_1 * s + (1.0 - beta_1) * g;
    const double v1 = beta_2 * s + (1.0 - beta_2) * g * g;
    const double reach = std::abs(double{lr_t}) / epsilon;
    return proven_finite(m1) && proven_finite(v1) && proven_finite(s + reach * m1);
  }

  /// The rule over n elements at step size lr_t, behind `apply` and `apply_row`: a bound
  /// of the magnitudes it leaves (BoundsMagnitudes).
  float update(float lr_t, float* __restrict w, float* __restrict m, float* __restrict v,
               const float* __restrict g, std::size_t n) const {
    const float b1 = beta_1;
    const float b2 = beta_2;
    const float eps = epsilon;
    const bool ordinary = detail::lanewise_ordinary<2>(  // w and m of any sign, v not negative
        0, n,
        [=](auto gi, auto& wi, auto& mi, auto& vi) {  // (by value: the constants stay in registers)
          mi = b1 * mi + (1.0F - b1) * gi;
          vi = b2 * vi + (1.0F - b2) * gi * gi;
          wi -= lr_t * mi / (detail::lane_sqrt(vi) + eps);
        },
        g, w, m, v);
    return magnitude_bound(ordinary);
  }

  /// lr_t of update number t.
  [[nodiscard]] float step_size(std::int64_t t) const {
    const auto td = static_cast<double>(t);
    return static_cast<float>(learning_rate * std::sqrt(1.0 - std::pow(double{beta_2}, td)) /
                              (1.0 - std::pow(double{beta_1}, td)));
  }
};
static_assert(Optimizer<Adam>);
static_assert(BoundsMagnitudes<Adam>);
static_assert(RowWiseOptimizer<Adam>);
static_assert(BoundsRowMagnitudes<Adam>);

}  // namespace pulley
