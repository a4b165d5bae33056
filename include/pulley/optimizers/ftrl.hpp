// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/core/detail/lanes.hpp"

namespace pulley {

/// FTRL-Proximal (McMahan et al., "Ad Click Prediction", 2013) with TensorFlow's rule
/// (ApplyFtrlV2) and Keras' defaults, Keras' `beta` folded into the L2 strength as Keras
/// does. Per element, with p = learning_rate_power and l2_adj = l2 + beta / (2 * lr):
///   g_shrink   = g + 2 * l2_shrinkage * w
///   accum_new  = accumulator + g^2
///   linear    += g_shrink - (accum_new^(-p) - accumulator^(-p)) / lr * w
///   quadratic  = accum_new^(-p) / lr + 2 * l2_adj
///   w          = |linear| > l1 ? (sign(linear) * l1 - linear) / quadratic : 0
///   accumulator = accum_new
/// The weight is worked out from the slots, not stepped from its old value: L1 sets it to
/// exactly 0 while |linear| stays within l1, which is what makes FTRL's models sparse. The
/// hyper-parameters must be those Keras accepts: learning_rate > 0, learning_rate_power
/// <= 0, initial_accumulator_value >= 0, and the regularization strengths and beta >= 0.
///
/// The same rule updates a dense part (`apply`) or one row of an embedding table
/// (`apply_row`, TF's SparseApplyFtrlV2), whose accumulator and linear are its two row
/// slots. A row's weights can move on a zero gradient: its first update replaces its
/// initial value with the solution from its slots, and l2_shrinkage keeps pulling it to 0.
///
/// Finiteness is proven from magnitudes (BoundsMagnitudes) for Keras' learning_rate_power
/// of -0.5 and an initial_accumulator_value of about 2^-10 or more (or an L2 strength):
/// `apply_bounded` judges in its pass that the weights and slots it wrote are ordinary and
/// that no accumulator is below initial_accumulator_value (which the rule only adds to).
/// The weight it wrote is then |linear| / quadratic at most, and quadratic at least
/// sqrt(initial_accumulator_value) / lr + 2 * l2_adj, which bounds the next update's
/// change of linear (at most |g| * |w| / lr) without reading the part. Other powers, and
/// parts restored or initialized since, are checked by `stays_finite`.
struct Ftrl {
  float learning_rate = 0.001F;                       ///< lr: step size
  float learning_rate_power = -0.5F;                  ///< p: how lr decays with the accumulator
  float initial_accumulator_value = 0.1F;             ///< starting sum of squares
  float l1_regularization_strength = 0.0F;            ///< l1: zeroes weights with small |linear|
  float l2_regularization_strength = 0.0F;            ///< l2: shrinks weights towards 0
  float l2_shrinkage_regularization_strength = 0.0F;  ///< l2_shrinkage: a magnitude penalty
  float beta = 0.0F;                                  ///< Keras' beta: adds beta / (2 * lr) to l2

  /// What is wrong with the settings, or nullopt (Optimizer: settings_error).
  [[nodiscard]] std::optional<std::string> settings_error() const {
    return SettingsCheck()
        .positive("learning_rate", learning_rate)
        .non_positive("learning_rate_power", learning_rate_power)
        .non_negative("initial_accumulator_value", initial_accumulator_value)
        .non_negative("l1_regularization_strength", l1_regularization_strength)
        .non_negative("l2_regularization_strength", l2_regularization_strength)
        .non_negative("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength)
        .non_negative("beta", beta)
        .error();
  }

  /// The accumulator (sum of squared gradients) and linear slots, one value per element.
  struct State {
    std::vector<float> accumulator;
    std::vector<float> linear;
  };

  /// Fresh slots for a part of n elements.
  [[nodiscard]] State make_state(std::size_t n) const {
    return {std::vector<float>(n, initial_accumulator_value), std::vector<float>(n, 0.0F)};
  }

  /// Updates `w` in place from gradient `g` (same size as the state).
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    (void)apply_bounded(state, w, g);
  }

  /// `apply`, returning a bound of the magnitudes of the weights and slots afterwards:
  /// kOrdinaryMagnitude when every one is below it and no accumulator is below
  /// initial_accumulator_value (for learning_rate_power -0.5), else +infinity: nothing
  /// known (BoundsMagnitudes).
  float apply_bounded(State& state, std::span<float> w, std::span<const float> g) const {
    return update<true>(w.data(), state.accumulator.data(), state.linear.data(), g.data(),
                        w.size());
  }

  /// True if no weight or slot can leave kFiniteBound when each is at most `largest`, no
  /// accumulator below initial_accumulator_value and each weight what the rule made of its
  /// slots (as `apply_bounded` leaves them when it returns a finite bound), and each
  /// gradient element at most `largest_gradient` in magnitude (BoundsMagnitudes). Bounds,
  /// in double, with room for float's rounding:
  ///   accumulator <= largest + g^2
  ///   |linear|    <= largest + g + 2 * l2_shrinkage * |w| + root_step / lr * |w|, where
  ///                  root_step = sqrt(accum_new) - sqrt(accum) is at most g, and |w| is at
  ///                  most largest / q_least; root_step / lr is worked out first (as the
  ///                  rule does), so it too must stay finite (a learning rate below 1e-20)
  ///   |w|         <= (l1 + |linear|) / q_least, where
  ///                  q_least = sqrt(initial_accumulator_value) / lr + 2 * l2_adj
  /// For another learning_rate_power nothing is proven.
  [[nodiscard]] bool stays_finite_given(const State& /*state*/, float largest,
                                        float largest_gradient) const {
    if (learning_rate_power != -0.5F) return false;
    const double lr = learning_rate;
    const double held = largest;
    const double g = largest_gradient;
    const double q_least = std::sqrt(double{initial_accumulator_value}) / lr +
                           2.0 * (double{l2_regularization_strength} + double{beta} / (2.0 * lr));
    if (!(q_least > 0.0)) return false;  // a zero accumulator and no L2: a quotient by 0
    constexpr double kRounding = 1.01;   // the float rule's roundings, each a part in 2^23
    const double accumulator = held + g * g;
    // sqrt(accum_new) - sqrt(accum) in float: at most g, and each root's rounding.
    const double root_step = g + 0x1p-22 * std::sqrt(accumulator);
    const double w = std::min(held, held / q_least * kRounding);
    const double linear =
        kRounding *
        (held + g + 2.0 * double{l2_shrinkage_regularization_strength} * w + root_step * w / lr);
    const double w_new = kRounding * (double{l1_regularization_strength} + linear) / q_least;
    return proven_finite(accumulator) && proven_finite(kRounding * root_step / lr) &&
           proven_finite(linear) && proven_finite(w_new);
  }

  /// The accumulator and linear slots, for checkpoints.
  [[nodiscard]] std::array<OptimizerSlot, 2> slots(State& state) const {
    return {OptimizerSlot{"accumulator", state.accumulator}, OptimizerSlot{"linear", state.linear}};
  }
  /// No counters.
  [[nodiscard]] std::array<OptimizerCounter, 0> counters(State& /*state*/) const { return {}; }

  /// True if `apply` keeps every weight and both slots within kFiniteBound. The new weight
  /// is a quotient of two terms that depend on the slots, so no cheap bound holds for every
  /// state: this runs the update itself (`apply`'s own code) on copies of blocks of
  /// kCheckBlock elements, which stay in L1, and checks its results; it costs about as much
  /// as `apply`.
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    const std::size_t n = w.size();
    float wb[kCheckBlock];
    float ab[kCheckBlock];
    float lb[kCheckBlock];
    for (std::size_t begin = 0; begin < n; begin += kCheckBlock) {
      const std::size_t m = std::min(kCheckBlock, n - begin);
      std::copy_n(w.data() + begin, m, wb);
      std::copy_n(state.accumulator.data() + begin, m, ab);
      std::copy_n(state.linear.data() + begin, m, lb);
      (void)update<false>(wb, ab, lb, g.data() + begin, m);
      const bool within = bounded(m, [&](std::size_t i, std::uint32_t& lane) {
        detail::fold_bound(lane, wb[i]);
        detail::fold_bound(lane, ab[i]);
        detail::fold_bound(lane, lb[i]);
      });
      if (!within) return false;
    }
    return true;
  }

  /// A table row keeps two slots: its accumulator and its linear term.
  static constexpr std::size_t kRowSlots = 2;

  /// The row slots' names, the same as the dense slots'.
  [[nodiscard]] std::array<std::string_view, kRowSlots> row_slot_names() const {
    return {"accumulator", "linear"};
  }

  /// Starts a new row's accumulator at initial_accumulator_value and its linear at 0.
  void init_row(std::span<float> slots) const {
    const std::size_t n = slots.size() / kRowSlots;
    std::ranges::fill(slots.first(n), initial_accumulator_value);
    std::ranges::fill(slots.subspan(n), 0.0F);
  }

  /// Updates one table row `w` in place from its gradient `g`, as `apply` does; `slots`
  /// holds the row's accumulator then its linear (w.size() floats each).
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& /*context*/) const {
    const std::size_t n = w.size();
    (void)update<false>(w.data(), slots.data(), slots.data() + n, g.data(), n);
  }

 private:
  /// The hyper-parameters as one update uses them, copied out of the object once.
  struct Terms {
    float lr;
    float l1;
    float two_l2_adj;        ///< 2 * (l2 + beta / (2 * lr))
    float two_l2_shrinkage;  ///< 2 * l2_shrinkage
    float floor;             ///< initial_accumulator_value: no accumulator falls below it
  };

  /// This object's Terms.
  [[nodiscard]] Terms terms() const {
    const float lr = learning_rate;
    return {lr, l1_regularization_strength,
            2.0F * (l2_regularization_strength + beta / (2.0F * lr)),
            2.0F * l2_shrinkage_regularization_strength, initial_accumulator_value};
  }

  /// Elements `stays_finite` updates in copies at a time.
  static constexpr std::size_t kCheckBlock = 256;

  /// x^(-p) for p = -0.5, Keras' default: a square root, far cheaper than std::pow, of a
  /// value or of a vector of lanes (detail::lanewise).
  struct SqrtPower {
    template <class V>
    V operator()(V x) const {
      return detail::lane_sqrt(x);
    }
  };
  /// x^(-p) for any other p.
  struct AnyPower {
    float minus_p;
    float operator()(float x) const { return std::pow(x, minus_p); }
  };

  /// The rule for one element, or for a vector of them (detail::lanewise), behind `update`.
  /// Returns the new accumulator less `floor`: not negative where the proof holds.
  template <class V, class Power>
  static V step(const Terms& k, Power power, V& w, V& accumulator, V& linear, V g) {
    using std::abs;
    using detail::choose;
    const V zero(0.0F);
    const V g_shrink = g + k.two_l2_shrinkage * w;
    const V accum_new = accumulator + g * g;
    const V power_new = power(accum_new);
    linear += g_shrink - (power_new - power(accumulator)) / k.lr * w;
    const V quadratic = power_new / k.lr + k.two_l2_adj;
    const V sign = choose(linear > zero, V(1.0F), choose(linear < zero, V(-1.0F), zero));
    w = choose(abs(linear) > V(k.l1), (sign * k.l1 - linear) / quadratic, zero);
    accumulator = accum_new;
    return accum_new - k.floor;
  }

  /// The rule over n elements, behind `apply_bounded`, `apply_row` and `stays_finite`: in
  /// vector lanes for Keras' learning_rate_power of -0.5 (a square root, bit for bit the
  /// scalar rule where no multiply and add are fused: detail::lanewise), else one element
  /// at a time (std::pow has no vector form here). With `kBound`, returns `apply_bounded`'s
  /// bound, judged in the lanes (detail::lanewise_ordinary: every value written ordinary,
  /// and the accumulators not below the floor, which also keeps them from being negative);
  /// without, +infinity.
  template <bool kBound>
  float update(float* __restrict w, float* __restrict accumulator, float* __restrict linear,
               const float* __restrict g, std::size_t n) const {
    const Terms k = terms();
    if (learning_rate_power == -0.5F) {
      const auto rule = [k](auto gi, auto& wi, auto& li, auto& ai) {
        return step(k, SqrtPower{}, wi, ai, li, gi);
      };
      if constexpr (kBound) {
        return magnitude_bound(detail::lanewise_ordinary<3>(0, n, rule, g, w, linear, accumulator));
      } else {
        detail::lanewise(0, n, rule, g, w, linear, accumulator);
        return std::numeric_limits<float>::infinity();
      }
    }
    const AnyPower power{-learning_rate_power};
    for (std::size_t i = 0; i < n; ++i) (void)step(k, power, w[i], accumulator[i], linear[i], g[i]);
    return std::numeric_limits<float>::infinity();
  }
};
static_assert(Optimizer<Ftrl>);
static_assert(PredictsFiniteness<Ftrl>);
static_assert(BoundsMagnitudes<Ftrl>);
static_assert(RowWiseOptimizer<Ftrl>);

}  // namespace pulley
