// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <span>
#include <string_view>

#include "pulley/core/hash.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

/// A small, fast, portable generator (SplitMix64). Unlike the standard distributions,
/// whose output differs between standard libraries, the values below depend only on the
/// seed, so a seeded run initializes identically everywhere.
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

  constexpr std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30U)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27U)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31U);
  }
  /// Uniform in [0, 1), 53 random bits.
  constexpr double uniform() noexcept { return static_cast<double>(next() >> 11U) * 0x1.0p-53; }

 private:
  std::uint64_t state_;
};

/// Fills `values` (which has `spec.size()` elements) as `spec.initializer` says, from
/// `seed` and the variable's name.
inline void initialize(const VariableSpec& spec, std::uint64_t seed, std::span<float> values) {
  SplitMix64 rng(seed ^ name_hash(spec.name));
  const Initializer& init = spec.initializer;
  auto uniform = [&](double limit) {
    for (float& v : values) v = static_cast<float>((2.0 * rng.uniform() - 1.0) * limit);
  };
  switch (init.kind) {
    case Initializer::Kind::kZeros:
      for (float& v : values) v = 0.0F;
      break;
    case Initializer::Kind::kConstant:
      for (float& v : values) v = init.value;
      break;
    case Initializer::Kind::kUniform:
      uniform(init.value);
      break;
    case Initializer::Kind::kNormal:
      for (float& v : values) {  // Box–Muller; 1 - u keeps the log finite
        const double r = std::sqrt(-2.0 * std::log(1.0 - rng.uniform()));
        v = static_cast<float>(init.value * r * std::cos(2.0 * std::numbers::pi * rng.uniform()));
      }
      break;
    case Initializer::Kind::kGlorotUniform: {
      // fan_in is the first dimension, fan_out the product of the rest (Keras' rule for a
      // Dense kernel [in, out]); a vector counts as fan_in = fan_out = its length.
      const double fan_in = static_cast<double>(spec.rows());
      const double fan_out = spec.shape.size() > 1 ? static_cast<double>(spec.row_size()) : fan_in;
      uniform(std::sqrt(6.0 / (fan_in + fan_out)));
      break;
    }
  }
}

/// Fills `row` (`spec.dim` floats) with the initial value of row `id` of table `spec`: a
/// function of the initializer, the table's name, the id and `seed` alone. Glorot's rule has
/// no fans in a table; it is refused where a table is registered.
inline void initialize_row(const TableSpec& spec, std::uint64_t seed, std::uint64_t id,
                           std::span<float> row) {
  const VariableSpec as_vector{spec.name, {row.size()}, spec.initializer};
  initialize(as_vector, seed ^ mix_id(id ^ 0x9E3779B97F4A7C15ULL), row);
}

}  // namespace pulley
