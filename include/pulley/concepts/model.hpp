// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "pulley/core/id_index.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

/// The rows of one embedding table that a batch touches, as a worker pulled them for a step:
/// what a TableModel computes with and writes its row gradients into.
struct TableBatch {
  std::size_t dim = 0;                  ///< floats per row
  std::span<const std::uint64_t> ids;   ///< the batch's distinct ids, in the worker's order
  std::span<const float> rows;          ///< ids.size() × dim: the rows, in that order
  std::span<float> gradients;           ///< ids.size() × dim, zero before the step: add into it
  const IdPositions* positions = nullptr;  ///< id → index in ids

  /// The index of `id` in `ids`; throws std::out_of_range if it is not one of them.
  [[nodiscard]] std::size_t index(std::uint64_t id) const {
    const std::size_t at = positions->find(id);
    if (at == IdPositions::npos) {
      throw std::out_of_range("id " + std::to_string(id) + " is not one of the batch's ids");
    }
    return at;
  }
  /// The row of `id`.
  [[nodiscard]] std::span<const float> row(std::uint64_t id) const {
    return rows.subspan(index(id) * dim, dim);
  }
  /// Where the gradient of `id`'s row goes (add to it: an id used twice in a batch sums).
  [[nodiscard]] std::span<float> gradient(std::uint64_t id) const {
    return gradients.subspan(index(id) * dim, dim);
  }
};

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
///   - `m.compute_gradients(batch)` → the batch's mean loss (convertible to float); or, in
///     a model with embedding tables, the members of TableModel in its place
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
  requires requires { { model.compute_gradients(batch) } -> std::convertible_to<float>; } ||
      requires(std::vector<std::uint64_t>& ids, std::span<const TableBatch> tables) {
        { cmodel.tables() } -> std::convertible_to<std::span<const TableSpec>>;
        { cmodel.lookup(batch, i, ids) } -> std::same_as<void>;
        { model.compute_gradients(batch, tables) } -> std::convertible_to<float>;
      };
};


/// A model with embedding tables (a recommendation model): dense variables as a Model has,
/// plus tables of rows keyed by 64-bit ids, of which a batch touches a few. The worker
/// pulls only the rows of the batch's ids, and pushes only their gradients.
///
/// Required:
///   - `typename M::Batch`, `m.variables()`, `m.parameter(i)`, `m.gradient(i)` as for Model
///   - `m.tables()` → the table specs, in a fixed order (a range of TableSpec)
///   - `m.lookup(batch, t, ids)`: appends to `ids` (a std::vector<std::uint64_t>) the ids of
///     table t that `batch` uses, duplicates allowed (the worker removes them)
///   - `m.compute_gradients(batch, tables)` with `tables` a std::span<const TableBatch>, one
///     per table: the batch's mean loss; the dense gradients go to `gradient(i)` as for
///     Model, each row's gradient is added into `tables[t].gradient(id)`
///
/// Optional: `static constexpr bool kAppliesWhenComputed = true` in a model whose
/// `compute_gradients` applies part of the step itself (DenseOnRing applies the dense
/// variables' there): a Worker then never computes a step twice: where it would (the job
/// was rolled back, or its members changed, while the step's push was on its way), it fails
/// with kAborted instead (AppliesWhenComputed).
///
/// Semantic contract: as Model's; `lookup` lists every id that `compute_gradients` reads or
/// writes, and the row gradients are of the batch's mean loss.
template <class M>
concept TableModel = Model<M> &&
    requires(M& model, const M& cmodel, std::size_t i, const typename M::Batch& batch,
             std::vector<std::uint64_t>& ids, std::span<const TableBatch> tables) {
  { cmodel.tables() } -> std::convertible_to<std::span<const TableSpec>>;
  { cmodel.lookup(batch, i, ids) } -> std::same_as<void>;
  { model.compute_gradients(batch, tables) } -> std::convertible_to<float>;
};


/// A model whose `compute_gradients` applies part of the step (TableModel's optional
/// `kAppliesWhenComputed`).
template <class M>
concept AppliesWhenComputed = requires { requires M::kAppliesWhenComputed; };

}  // namespace pulley
