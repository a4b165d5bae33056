// SPDX-License-Identifier: MIT
#pragma once

// A table model for benchmarks that only moves rows.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/concepts/model.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/variable.hpp"

namespace pulley::bench {

/// A table model that only moves rows: its batch is a list of ids, its gradient a constant.
class RowsOnly {
 public:
  using Batch = std::vector<std::uint64_t>;
  explicit RowsOnly(std::size_t dim)
      : variables_{{"bias", {1}, Initializer::zeros()}},
        tables_{{"emb", dim, Initializer::uniform(0.01F)}} {}
  [[nodiscard]] std::span<const VariableSpec> variables() const { return variables_; }
  [[nodiscard]] std::span<const TableSpec> tables() const { return tables_; }
  std::span<float> parameter(std::size_t) { return value_; }
  [[nodiscard]] std::span<const float> gradient(std::size_t) const { return gradient_; }
  void lookup(const Batch& batch, std::size_t, std::vector<std::uint64_t>& ids) const {
    ids.insert(ids.end(), batch.begin(), batch.end());
  }
  float compute_gradients(const Batch&, std::span<const TableBatch> tables) {
    std::fill(tables[0].gradients.begin(), tables[0].gradients.end(), 1e-4F);
    return 0.0F;
  }

 private:
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> tables_;
  std::vector<float> value_{0.0F}, gradient_{0.0F};
};

}  // namespace pulley::bench
