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

/// RMSProp with TensorFlow's rule (ApplyRMSProp) and Keras' defaults, where `ms` is the
/// slot "rms" and `mom` the slot "momentum":
///   ms  = rho * ms + (1 - rho) * g^2
///   mom = momentum * mom + learning_rate * g / sqrt(ms + epsilon)
///   w  -= mom
/// At the default momentum = 0, `mom` is just the last step. Not centered: the mean
/// gradient is not subtracted from `ms` (TF's ApplyCenteredRMSProp, Keras'
/// `centered=True`, is another rule with a third slot).
///
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's SparseApplyRMSProp), whose rms and momentum are its two row slots.
struct RmsProp {
  float learning_rate = 0.001F;  ///< step size
  float rho = 0.9F;              ///< decay of the mean square
  float momentum = 0.0F;         ///< decay of the momentum slot (0: plain RMSProp)
  float epsilon = 1e-7F;         ///< keeps the division finite

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck()
        .non_negative("learning_rate", learning_rate)
        .decay("rho", rho)
        .fraction("momentum", momentum)
        .non_negative("epsilon", epsilon)
        .error();
  }

  /// The mean-square and momentum slots, one value per element.
  struct State {
    std::vector<float> rms;
    std::vector<float> momentum;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), std::vector<float>(n, 0.0F)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }

  /// `apply`, returning a bound of the magnitudes of the weights and slots afterwards
  /// (+infinity if a mean square is negative: BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    return update(w.data(), state.rms.data(), state.momentum.data(), g.data(), w.size());
  }

  /// True if no weight or slot can leave kFiniteBound when each is at most `largest` (the
  /// mean squares not negative) and each gradient element at most `largest_gradient` in
  /// magnitude: a step's new part is at most learning_rate * |g| / sqrt(epsilon)
  /// (BoundsMagnitudes; nothing is proven with epsilon = 0).
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest, float largest_gradient) const {
    const double s = largest;
    const double g = largest_gradient;
    const double mom = std::abs(double{momentum}) * s + std::abs(double{learning_rate}) * g / std::sqrt(double{epsilon});
    return epsilon > 0 && proven_finite(s + g * g) && proven_finite(mom) && proven_finite(s + mom);
  }

  /// The rms and momentum slots, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"rms", state.rms}, OptimizerSlot{"momentum", state.momentum}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and both slots within kFiniteBound. It works out
  /// the update itself (as `apply` does, without storing it) and checks its results, so it
  /// holds for any slots and hyper-parameters (a bound through sqrt(epsilon) would assume
  /// rms >= 0); it costs about as much as `apply`.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const Terms k = terms();
    const float* wp = w.data();
    const float* gp = g.data();
    const float* rp = state.rms.data();
    const float* mp = state.momentum.data();
    return bounded(w.size(), [&](std::size_t i, std::uint32_t& lane) {
      float wi = wp[i];
      float ri = rp[i];
      float mi = mp[i];
      step(k, wi, ri, mi, gp[i]);
      detail::fold_bound(lane, wi);
      detail::fold_bound(lane, ri);
      detail::fold_bound(lane, mi);
    });
  }

  /// A table row keeps two slots: its mean square and its momentum.
  static constexpr std::size_t kRowSlots = 2;

  /// The row slots' names, the same as the dense slots'.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"rms", "momentum"};
  }

  /// Starts a new row's slots at zero.
  void init_row(std::span<float> slots) const { std::ranges::fill(slots, 0.0F); }

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does; `slots`
  /// holds the row's rms then its momentum (w.size() floats each).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    (void)apply_row_bounded(w, slots, g, context);
  }

  /// `apply_row`, returning a bound of the row's magnitudes afterwards (+infinity if a mean
  /// square is negative: BoundsRowMagnitudes).
  float apply_row_bounded(std::span<float> w, std::span<float> slots, std::span<const float> g,
                          const RowContext& /*context*/) const {
    const std::size_t n = w.size();
    return update(w.data(), slots.data(), slots.data() + n, g.data(), n);
  }

  /// `stays_finite_given` for a row (BoundsRowMagnitudes): the same rule.
  [[nodiscard]] bool row_stays_finite_given(float largest, float largest_gradient, const RowContext& /*context*/) const {
    return stays_finite_given(State{}, largest, largest_gradient);
  }

 private:
  /// The hyper-parameters, copied out of the object once per update.
  struct Terms {
    float lr;
    float rho;
    float momentum;
    float epsilon;
  };

  /// This object's Terms.
  [[nodiscard]] Terms terms() const { return {learning_rate, rho, momentum, epsilon}; }

  /// The rule for one element, or a vector of them (detail::lanewise), behind `update`
  /// and `stays_finite`.
  template <class V>
  static void step(const Terms& k, V& w, V& ms, V& mom, V g) {
    ms = k.rho * ms + (1.0F - k.rho) * g * g;
    mom = k.momentum * mom + k.lr * g / detail::lane_sqrt(ms + k.epsilon);
    w -= mom;
  }

  /// The rule over n elements, behind `apply` and `apply_row`: a bound of the magnitudes
  /// it leaves (BoundsMagnitudes).
  float update(float* __restrict w, float* __restrict ms, float* __restrict mom,
               const float* __restrict g, std::size_t n) const {
    const Terms k = terms();
    const bool ordinary = detail::lanewise_ordinary<2>(  // w and the momentum of any sign, ms not negative
        0, n, [k](auto gi, auto& wi, auto& momi, auto& msi) { step(k, wi, msi, momi, gi); }, g, w, mom, ms);
    return magnitude_bound(ordinary);
  }
};
static_assert(Optimizer<RmsProp>);
static_assert(BoundsMagnitudes<RmsProp>);
static_assert(RowWiseOptimizer<RmsProp>);
static_assert(BoundsRowMagnitudes<RmsProp>);

}  // namespace pulley
