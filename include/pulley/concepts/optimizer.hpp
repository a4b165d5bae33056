// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "pulley/variable.hpp"

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

/// An optimizer: a small value type holding hyper-parameters, plus a per-part `State`
/// (slots such as momentum or Adam's moments) that the ps keeps beside the part it updates.
///
/// Required:
///   - `typename O::State`, movable
///   - `o.make_state(n)` → `O::State` for a part of `n` elements
///   - `o.apply(state, weights, gradient)` or `o.apply(state, weights, gradient, context)`:
///     updates `weights` in place (the second form also sees an UpdateContext)
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
