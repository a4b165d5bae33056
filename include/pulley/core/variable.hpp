// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace pulley {

/// How the chief fills a variable before training. Values are drawn from pulley's own
/// generator (see initializers.hpp), so a seed gives the same numbers on every platform.
struct Initializer {
  enum class Kind : std::uint8_t {
    kZeros,          ///< all 0
    kConstant,       ///< all `value`
    kUniform,        ///< U(-value, value)
    kNormal,         ///< N(0, value^2)
    kGlorotUniform,  ///< U(-l, l), l = sqrt(6 / (fan_in + fan_out)) — Keras' default for Dense
  };
  Kind kind = Kind::kZeros;  ///< which rule
  float value = 0.0F;        ///< the rule's parameter (constant, limit or stddev)

  /// All 0.
  static constexpr Initializer zeros() noexcept { return {}; }
  /// All `v`.
  static constexpr Initializer constant(float v) noexcept { return {Kind::kConstant, v}; }
  /// U(-limit, limit).
  static constexpr Initializer uniform(float limit) noexcept { return {Kind::kUniform, limit}; }
  /// N(0, stddev^2).
  static constexpr Initializer normal(float stddev) noexcept { return {Kind::kNormal, stddev}; }
  /// Glorot (Xavier) uniform.
  static constexpr Initializer glorot_uniform() noexcept { return {Kind::kGlorotUniform, 0.0F}; }

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(kind, value);
  }

  friend bool operator==(const Initializer&, const Initializer&) = default;
};

/// A dense float32 variable as the model declares it: a name, a shape and an initializer.
/// Its first dimension is the row dimension that partitioners split along; a scalar
/// (empty shape) is one row of one element.
struct VariableSpec {
  std::string name;
  std::vector<std::size_t> shape;
  Initializer initializer;

  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept {
    return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
  }
  /// Rows along the first dimension (1 for a scalar).
  [[nodiscard]] std::size_t rows() const noexcept { return shape.empty() ? 1 : shape.front(); }
  /// Elements in one row.
  [[nodiscard]] std::size_t row_size() const noexcept { return rows() == 0 ? 0 : size() / rows(); }

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(name, shape, initializer);
  }

  friend bool operator==(const VariableSpec&, const VariableSpec&) = default;
};

/// An embedding table as the model declares it: rows of `dim` floats keyed by 64-bit ids,
/// with no fixed vocabulary. A row exists on the ps that holds its id from the first time it
/// is admitted (see below), with a value that depends only on the initializer, the table's
/// name, the id and the job's seed, so that it is the same whichever ps holds it and
/// whatever order ids arrive in. A worker pulls and pushes only the rows its batch touches.
struct TableSpec {
  std::string name;
  std::size_t dim = 0;      ///< floats per row
  Initializer initializer;  ///< of each new row: zeros, constant, uniform or normal
  /// Admission: a row is created only once its id was pulled this many times (1: at once).
  /// Until then it reads as its initial value, and pushes to it are dropped and counted.
  std::uint32_t admit_after = 1;
  /// Eviction: a row neither pulled nor pushed for this many global steps is removed (and
  /// starts again from its initial value if it comes back); 0 keeps rows for ever.
  std::int64_t evict_after_steps = 0;
  /// Cap: the most rows of this table one ps holds (0: no cap). A pull that would create a
  /// row past it first evicts the least recently touched eighth of the ps's rows (rows
  /// touched at the current step stay; if none can go, the row is not created: it reads as
  /// its initial value and pushes to it are dropped, both counted). The ids admission
  /// counts are held to as many.
  std::uint64_t max_rows = 0;

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(name, dim, initializer, admit_after, evict_after_steps, max_rows);
  }

  friend bool operator==(const TableSpec&, const TableSpec&) = default;
};

/// A half-open range of rows `[begin, end)` of one variable.
struct RowRange {
  std::size_t begin = 0;
  std::size_t end = 0;

  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  [[nodiscard]] constexpr bool empty() const noexcept { return end <= begin; }
  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(begin, end);
  }
  friend constexpr bool operator==(RowRange, RowRange) = default;
};

}  // namespace pulley
