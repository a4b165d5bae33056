// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <span>

#include "pulley/variable.hpp"

namespace pulley {

/// A model a worker trains: it declares its variables, owns their local copies and computes
/// gradients on a batch.
///
/// Required:
///   - `typename M::Batch`
///   - `m.variables()` → the variable specs, in a fixed order (a range of VariableSpec)
///   - `m.parameter(i)` → `std::span<float>` over variable i's local copy (row-major); the
///     worker pulls into it
///   - `m.gradient(i)` → `std::span<const float>` over the gradient of variable i from the
///     last `compute_gradients`; the worker pushes from it
///   - `m.compute_gradients(batch)` → the batch's mean loss (convertible to float)
///
/// Semantic contract:
///   - `variables()` is the same on every worker and the chief for the same configuration;
///   - `parameter(i)` and `gradient(i)` have `variables()[i].size()` elements and stay at the
///     same address for the model's lifetime (pull and push use them in place);
///   - the gradient is of the batch's mean loss, so averaging R gradients is averaging losses.
template <class M>
concept Model = requires(M& model, const M& cmodel, std::size_t i, const typename M::Batch& batch) {
  typename M::Batch;
  { cmodel.variables() } -> std::convertible_to<std::span<const VariableSpec>>;
  { model.parameter(i) } -> std::same_as<std::span<float>>;
  { cmodel.gradient(i) } -> std::same_as<std::span<const float>>;
  { model.compute_gradients(batch) } -> std::convertible_to<float>;
};

}  // namespace pulley
