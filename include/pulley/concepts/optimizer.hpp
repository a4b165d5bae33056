// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <span>

namespace pulley {

/// An optimizer: a small value type holding hyper-parameters, plus a per-part `State`
/// (slots such as momentum or Adam's moments) that the ps keeps beside the part it updates.
///
/// Required:
///   - `typename O::State`
///   - `o.make_state(n)` → `O::State` for a part of `n` elements
///   - `o.apply(state, weights, gradient)` updates `weights` in place
///
/// Semantic contract (the compiler cannot check it):
///   - `apply` is called once per global step (sync) or once per accepted push (async) for
///     each part, with `weights.size() == gradient.size() == n` of the `make_state(n)` call;
///   - it is deterministic: the same state, weights and gradient give the same result;
///   - it is element-wise or at least part-local: a variable split over several ps tasks is
///     updated part by part, so a rule that needs the whole variable (a global norm) does
///     not belong here;
///   - the optimizer object is shared by all parts and is never modified after construction
///     (`apply` is const); everything that changes lives in `State`.
template <class O>
concept Optimizer = std::copy_constructible<O> &&
    requires(const O& optimizer, typename O::State& state, std::span<float> weights,
             std::span<const float> gradient, std::size_t n) {
  typename O::State;
  { optimizer.make_state(n) } -> std::same_as<typename O::State>;
  { optimizer.apply(state, weights, gradient) } -> std::same_as<void>;
};

}  // namespace pulley
