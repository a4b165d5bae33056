// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/core/magnitude.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

/// What an optimizer may know about one update besides the weights and the gradient.
struct UpdateContext {
  /// Global steps completed before this update (sync: this update completes step
  /// `global_step + 1`; async: pushes applied before this one). For schedules.
  std::int64_t global_step = 0;
  std::string_view variable;  ///< the variable's name
  RowRange rows;              ///< the rows of the variable this part holds
  std::size_t row_size = 0;   ///< elements per row: element i is row `rows.begin + i / row_size`
};

/// The largest magnitude the stock optimizers' `stays_finite` lets a parameter or a slot
/// reach: just under 2^127, half of float's range, so that rounding (of a mean of
/// gradients, of the update itself) cannot carry a value it passed into infinity. A value
/// passes exactly when its exponent field is at most 253 (see `bounded`).
inline constexpr float kFiniteBound = 0x1.fffffep126F;

namespace detail {

/// Folds `x` into `lane`: its top bit becomes set if |x| > kFiniteBound or x is NaN. Integer
/// operations, so that loops of it vectorize without -ffast-math: the exponent field plus 2
/// carries into the sign bit exactly for exponents of 254 (2^127 and up) and 255 (Inf, NaN).
inline void fold_bound(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= (bits & 0x7F800000U) + 0x01000000U;
}

/// `fold_bound` of a value that must not be negative (a sum of squares, whose square root
/// is taken): a negative one also sets the top bit.
inline void fold_bound_non_negative(std::uint32_t& lane, float x) noexcept {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  lane |= ((bits & 0x7F800000U) + 0x01000000U) | (bits & 0x80000000U);
}

/// The class that declares a const member function.
template <class F>
struct MemberOf;
template <class R, class C, class... A>
struct MemberOf<R (C::*)(A...) const> {
  using type = C;
};
template <class R, class C, class... A>
struct MemberOf<R (C::*)(A...) const noexcept> {
  using type = C;
};

}  // namespace detail

/// True if `x`, an upper bound computed in double of what an update writes, leaves room
/// for float rounding under kFiniteBound (a proof of `stays_finite_given`).
[[nodiscard]] inline bool proven_finite(double x) noexcept { return x <= 0x1p126; }

/// True if every value `fold(i, lane)` folds (with `detail::fold_bound`) for i in [0, n) is
/// within kFiniteBound. Consecutive i go to independent lanes (detail::fold_lanes), so the
/// loop vectorizes: a stock optimizer's `stays_finite` costs about one read of its operands.
template <class Fold>
bool bounded(std::size_t n, Fold&& fold) noexcept {
  return (detail::fold_lanes(n, fold) & detail::kSignBit) == 0;
}

/// An optimizer: a small value type holding hyper-parameters, plus a per-part `State`
/// (slots such as momentum or Adam's moments) that the ps keeps beside the part it updates.
///
/// Required:
///   - `typename O::State`, movable
///   - `o.make_state(n)` → `O::State` for a part of `n` elements
///   - `o.apply(state, weights, gradient)` or `o.apply(state, weights, gradient, context)`:
///     updates `weights` in place (the second form also sees an UpdateContext)
/// Optional:
///   - `o.stays_finite(state, weights, gradient)` → bool, with `state` const: true only if
///     `apply` with these arguments would leave every weight and every slot finite. It may
///     be conservative (false for a few updates that would have stayed finite, far beyond
///     any real gradient) but never optimistic. The ps asks it about every update before
///     applying it: a push that is an update by itself (Async, BoundedStaleness) is refused
///     when it answers false, naming the variable and the sender; an update averaged from
///     several pushes (SyncReplicas) is rolled back on that ps, and logged. Without it, the
///     ps applies each update to a copy of the part and its State (which must then be
///     copyable), keeps the copy only if the weights stayed finite (a push that was an
///     update by itself is then refused as above), and fails if the State cannot be copied
///     and the weights went non-finite; `stays_finite` saves that copy and guards the
///     slots too.
///   - `o.apply_bounded(state, weights, gradient)` and `o.stays_finite_given(state,
///     largest, largest_gradient)` (BoundsMagnitudes, with `stays_finite`): the ps then
///     proves most updates finite in O(1), from magnitudes, and reads the part once.
///   - `o.settings_error()` → `std::optional<std::string>`: what is wrong with its
///     hyper-parameters (a learning rate that is NaN, infinite or negative; a decay
///     outside [0, 1)), or nullopt. A ps, and the role runner in every task, ask it before
///     anything else and refuse to start with kInvalidArgument naming the field
///     (`check_optimizer_settings`); `SettingsCheck` writes one in a line per field.
///   - `o.slots(state)` → a range of `OptimizerSlot` (name, `std::span<float>` of n values,
///     one per element of the part) and `o.counters(state)` → a range of `OptimizerCounter`
///     (name, `std::int64_t*`): the State as checkpoints save and restore it. A State that
///     holds anything else is not checkpointed (a restore starts it from `make_state`, and
///     the chief says so in its log); an empty State needs neither.
///
/// Semantic contract (the compiler cannot check it):
///   - `gradient` is the mean of the gradients the sync policy aggregated for this update
///     (SyncReplicas: of R workers' batches; Async: one worker's), each the gradient of its
///     batch's mean loss;
///   - `apply` is called once per global step (sync) or once per accepted push (async) for
///     each part, with `weights.size() == gradient.size() == n` of the `make_state(n)` call;
///   - calls are never concurrent: one ps applies one update at a time;
///   - `gradient` may alias the sync policy's accumulator or the sender's message: it is
///     valid only during the call, and must not be kept;
///   - it is deterministic: the same state, weights and gradient give the same result;
///   - it is element-wise or at least part-local: a variable split over several ps tasks is
///     updated part by part, so a rule that needs the whole variable (a global norm) does
///     not belong here (the UpdateContext tells which rows a part holds, for row-wise rules);
///   - a throw while applying fails the ps (half an update cannot be undone), so `apply`
///     should not throw; `make_state` may throw (the model is then refused);
///   - the optimizer object is shared by all parts and is never modified after construction
///     (`apply` is const); everything that changes lives in `State`.
template <class O>
concept Optimizer = std::copy_constructible<O> && std::movable<typename O::State> &&
    requires(const O& optimizer, typename O::State& state, std::span<float> weights,
             std::span<const float> gradient, std::size_t n, const UpdateContext& context) {
  { optimizer.make_state(n) } -> std::same_as<typename O::State>;
  requires requires { { optimizer.apply(state, weights, gradient) } -> std::same_as<void>; } ||
      requires { { optimizer.apply(state, weights, gradient, context) } -> std::same_as<void>; };
};

/// The checks an optimizer's `settings_error` makes of its hyper-parameters, each naming
/// the field and the value it refuses, the first failing one kept:
///   `return SettingsCheck().positive("learning_rate", learning_rate).error();`
class SettingsCheck {
 public:
  /// A finite number above 0 (FTRL's learning rate, which it divides by).
  SettingsCheck& positive(std::string_view name, float value) {
    return rule(name, value, value > 0, "a finite number above 0");
  }
  /// A finite number of 0 or more (a learning rate: 0 freezes the weights; a
  /// regularization strength, an initial accumulator).
  SettingsCheck& non_negative(std::string_view name, float value) {
    return rule(name, value, value >= 0, "a finite number of 0 or more");
  }
  /// A finite number of 0 or less (FTRL's learning_rate_power).
  SettingsCheck& non_positive(std::string_view name, float value) {
    return rule(name, value, value <= 0, "a finite number of 0 or less");
  }
  /// A decay in [0, 1) (Adam's betas, RMSProp's rho).
  SettingsCheck& decay(std::string_view name, float value) {
    return rule(name, value, value >= 0 && value < 1, "in [0, 1)");
  }
  /// A fraction in [0, 1] (a momentum).
  SettingsCheck& fraction(std::string_view name, float value) {
    return rule(name, value, value >= 0 && value <= 1, "in [0, 1]");
  }
  /// The first rule that failed, or nullopt.
  [[nodiscard]] std::optional<std::string> error() const { return error_; }

 private:
  SettingsCheck& rule(std::string_view name, float value, bool holds, const char* must) {
    if (!error_ && !(std::isfinite(value) && holds)) {
      char shown[32];
      std::snprintf(shown, sizeof shown, "%g", static_cast<double>(value));
      error_ = std::string(name) + " is " + shown + ": it must be " + must;
    }
    return *this;
  }
  std::optional<std::string> error_;
};

/// Throws kInvalidArgument ("<who>: learning_rate is nan: ...") when `optimizer` has a
/// `settings_error` that names a problem; an optimizer without one is taken as it is.
template <class O>
void check_optimizer_settings(const O& optimizer, std::string_view who = "the optimizer") {
  if constexpr (requires { { optimizer.settings_error() } -> std::convertible_to<std::optional<std::string>>; }) {
    if (const std::optional<std::string> error = optimizer.settings_error()) {
      throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": " + *error);
    }
  }
}

/// One element-wise slot of an optimizer's State (Adam's "m"): one value per element.
struct OptimizerSlot {
  std::string_view name;
  std::span<float> values;
};

/// One counter of an optimizer's State (Adam's "t").
struct OptimizerCounter {
  std::string_view name;
  std::int64_t* value;
};

/// True if the optimizer names its State's slots and counters, for checkpoints.
template <class O>
concept ExposesState = Optimizer<O> && requires(const O& optimizer, typename O::State& state) {
  { optimizer.slots(state) } -> std::ranges::range;
  { optimizer.counters(state) } -> std::ranges::range;
};

/// The slots of `state`, or none if the optimizer does not name them.
template <Optimizer O>
std::vector<OptimizerSlot> slots_of(const O& optimizer, typename O::State& state) {
  std::vector<OptimizerSlot> out;
  if constexpr (ExposesState<O>) {
    for (const OptimizerSlot& slot : optimizer.slots(state)) out.push_back(slot);
  }
  return out;
}

/// The counters of `state`, or none if the optimizer does not name them.
template <Optimizer O>
std::vector<OptimizerCounter> counters_of(const O& optimizer, typename O::State& state) {
  std::vector<OptimizerCounter> out;
  if constexpr (ExposesState<O>) {
    for (const OptimizerCounter& counter : optimizer.counters(state)) out.push_back(counter);
  }
  return out;
}

/// True if a checkpoint holds all of the optimizer's State: it names its slots and
/// counters, or its State is empty.
template <Optimizer O>
inline constexpr bool checkpoints_whole_state_v =
    ExposesState<O> || std::is_empty_v<typename O::State>;

namespace detail {

/// True if `Check` (a pointer to a member function: `&O::stays_finite`, say) is declared by
/// the class that declares `Apply` (`&O::apply`) or by one derived from it: the check was
/// written for the rule it checks. A class derived from a stock optimizer that brings an
/// `apply` of its own does not take the stock checks with it; one that brings a check of
/// its own (stricter, or counted) keeps the stock rule.
template <class Apply, class Check>
concept DeclaredWith = std::is_base_of_v<typename MemberOf<Apply>::type, typename MemberOf<Check>::type>;

/// True if `&O::apply` and `&O::stays_finite` each name one non-static member function (not
/// an overload set, a template or a static function), so that DeclaredWith can tell.
template <class O>
concept NamesApplyAndCheck = requires {
  typename MemberOf<decltype(&O::apply)>::type;
  typename MemberOf<decltype(&O::stays_finite)>::type;
};

}  // namespace detail

/// True if the optimizer can tell in advance whether an update stays finite:
/// `o.stays_finite(state, weights, gradient)` → bool, true only if `apply` keeps every
/// weight and slot within kFiniteBound (never optimistic). Where `apply` and
/// `stays_finite` each name one member function, `stays_finite` must come with the `apply`
/// it checks (detail::DeclaredWith): a derived class with a rule of its own is checked by
/// applying to copies, as an optimizer without `stays_finite`. (An overloaded or template
/// `apply` is taken at its word, as a check cannot be told from its rule then.)
template <class O>
concept PredictsFiniteness = Optimizer<O> &&
    requires(const O& optimizer, const typename O::State& state, std::span<const float> weights,
             std::span<const float> gradient) {
  { optimizer.stays_finite(state, weights, gradient) } -> std::convertible_to<bool>;
} && (!detail::NamesApplyAndCheck<O> || detail::DeclaredWith<decltype(&O::apply), decltype(&O::stays_finite)>);

/// True if the optimizer proves an update finite from magnitudes alone, so that the ps
/// checks an update without reading the part (the check costs nothing per element):
///   - `o.apply_bounded(state, weights, gradient)` → float: does what `apply` does, and
///     returns a bound that no weight or slot of the part exceeds in magnitude afterwards
///     (the stock ones: kOrdinaryMagnitude when all are below it and the slots that must
///     not be negative are not, else +infinity: nothing known); the ps hands
///     `stays_finite_given` nothing finer than kOrdinaryMagnitude, so it must prove the
///     updates of real training from that bound;
///   - `o.stays_finite_given(state, largest, largest_gradient)` → bool, O(1): true only if
///     `apply` keeps every weight and slot within kFiniteBound whenever none of them is
///     larger than `largest` in magnitude (and the slots that must not be negative are
///     not) and no gradient element larger than `largest_gradient`. Conservative, never
///     optimistic, as `stays_finite`. It is asked only of a part as this optimizer's
///     `apply_bounded` last left it, having returned `largest`, so it may also count on
///     what that pass made sure of (Ftrl: each weight solved from its slots, no
///     accumulator below its start).
/// The ps keeps each part's `largest` from its last `apply_bounded`, and asks
/// `stays_finite` where `stays_finite_given` cannot tell (or the part was written
/// otherwise since: initialized, restored): a refused update is refused as before.
/// `apply_bounded` must be declared by the class that declares its one `apply` (it is the
/// same rule), and `stays_finite_given` must come with that `apply` as `stays_finite` does.
template <class O>
concept BoundsMagnitudes = PredictsFiniteness<O> &&
    requires(const O& optimizer, typename O::State& state, const typename O::State& held,
             std::span<float> weights, std::span<const float> gradient, float magnitude) {
  { optimizer.apply_bounded(state, weights, gradient) } -> std::same_as<float>;
  { optimizer.stays_finite_given(held, magnitude, magnitude) } -> std::convertible_to<bool>;
  &O::apply;  // one apply, not an overload set
  &O::apply_bounded;
  &O::stays_finite_given;
} && std::same_as<typename detail::MemberOf<decltype(&O::apply)>::type,
                  typename detail::MemberOf<decltype(&O::apply_bounded)>::type> &&
    detail::DeclaredWith<decltype(&O::apply), decltype(&O::stays_finite_given)>;

/// What a row-wise (sparse) update of one row of an embedding table may know.
struct RowContext {
  /// Global steps completed before this update (as UpdateContext::global_step).
  std::int64_t global_step = 0;
  /// Updates of this table on this ps so far, this one included: 1 for the first. Lazy
  /// Adam's `t`, the same for every row of one update.
  std::int64_t updates = 0;
  std::string_view table;  ///< the table's name
  std::uint64_t id = 0;    ///< the row's id
};

/// An optimizer that can also update embedding tables row by row (sparse apply), as
/// TensorFlow's `sparse_apply_*` kernels do: only the rows pushed in an update are touched,
/// with slots of their own kept beside each row. An optimizer says it supports tables by
/// having these members; a table used with one that lacks them fails to compile, naming
/// them.
///
/// Required (besides Optimizer):
///   - `O::kRowSlots`, a `static constexpr std::size_t`: slots per row (Adagrad 1, Adam 2)
///   - `o.row_slot_names()` → `std::array<std::string_view, O::kRowSlots>`, for checkpoints
///   - `o.init_row(slots)`: fills a new row's slots; `slots` holds kRowSlots × dim floats,
///     slot k at [k × dim, (k + 1) × dim)
///   - `o.apply_row(weights, slots, gradient, context)`: updates one row (`weights` and
///     `gradient` of dim floats, `slots` as above) in place
///
/// Semantic contract (the compiler cannot check it):
///   - `gradient` is the mean of the gradients pushed for this row in this update (sync: over
///     the replicas whose push held the row, as TensorFlow's sparse conditional accumulator
///     averages; async: one worker's, duplicates summed by the worker);
///   - `apply_row` is called once per update for each row pushed in it and never for the
///     others ("lazy": an untouched row's slots do not decay), one row at a time;
///   - it is deterministic, touches nothing but its arguments, and does not throw;
///   - what it does to a row with a zero gradient is its business (FTRL's weights move);
///   - the ps checks every updated row for finite values and drops the whole update of the
///     table if one is not, so `apply_row` need not guard against overflow (the check is a
///     copy of each row and a pass over it, unless the optimizer proves rows finite from
///     magnitudes: BoundsRowMagnitudes, below).
template <class O>
concept RowWiseOptimizer = Optimizer<O> &&
    requires(const O& optimizer, std::span<float> weights, std::span<float> slots,
             std::span<const float> gradient, const RowContext& context) {
  { O::kRowSlots } -> std::convertible_to<std::size_t>;
  { optimizer.row_slot_names() } -> std::ranges::range;
  { optimizer.init_row(slots) } -> std::same_as<void>;
  { optimizer.apply_row(weights, slots, gradient, context) } -> std::same_as<void>;
};

/// True if a row-wise optimizer proves a row's update finite from magnitudes alone, as
/// BoundsMagnitudes does for a dense part, so that an embedding table updates proven rows
/// in place, judging each value in the pass that computes it (EmbeddingTable::apply then
/// reads and writes each row once, with no copy aside and no second pass):
///   - `o.apply_row_bounded(weights, slots, gradient, context)` → float: does what
///     `apply_row` does, and returns a bound that no value or slot of the row exceeds in
///     magnitude afterwards (the stock ones: kOrdinaryMagnitude when all are below it and
///     the slots that must not be negative are not, else +infinity: nothing known);
///   - `o.row_stays_finite_given(largest, largest_gradient, context)` → bool, O(1): true
///     only if `apply_row` with this `context` (its global_step, updates and table; not its
///     id) keeps every value and slot of a row within kFiniteBound whenever none of them is
///     larger than `largest` in magnitude (and the slots that must not be negative are
///     not) and no gradient element is larger than `largest_gradient`. Conservative, never
///     optimistic, as `stays_finite`.
/// A table asks `row_stays_finite_given(kOrdinaryMagnitude, kOrdinaryMagnitude, ...)` once
/// per update. It holds a row proven while the row's last `apply_row_bounded` returned
/// kOrdinaryMagnitude or less, or, for a row created or restored since, while every value
/// and slot of it is ordinary and no slot is negative; any other row is updated in a copy
/// first and checked, as for an optimizer without these members. Both must be declared by
/// the class that declares `apply_row` (the same rule), so that a class derived from a stock
/// optimizer with an `apply_row` of its own is checked by copies.
template <class O>
concept BoundsRowMagnitudes = RowWiseOptimizer<O> &&
    requires(const O& optimizer, std::span<float> weights, std::span<float> slots,
             std::span<const float> gradient, const RowContext& context, float magnitude) {
  { optimizer.apply_row_bounded(weights, slots, gradient, context) } -> std::same_as<float>;
  { optimizer.row_stays_finite_given(magnitude, magnitude, context) } -> std::convertible_to<bool>;
  &O::apply_row;  // one apply_row, not an overload set
  &O::apply_row_bounded;
  &O::row_stays_finite_given;
} && std::same_as<typename detail::MemberOf<decltype(&O::apply_row)>::type,
                  typename detail::MemberOf<decltype(&O::apply_row_bounded)>::type> &&
    detail::DeclaredWith<decltype(&O::apply_row), decltype(&O::row_stays_finite_given)>;

/// Calls whichever form of `apply` the optimizer has.
template <Optimizer O>
void apply_update(const O& optimizer, typename O::State& state, std::span<float> weights,
                  std::span<const float> gradient, const UpdateContext& context) {
  if constexpr (requires { optimizer.apply(state, weights, gradient, context); }) {
    optimizer.apply(state, weights, gradient, context);
  } else {
    optimizer.apply(state, weights, gradient);
  }
}

}  // namespace pulley
