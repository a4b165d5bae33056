// SPDX-License-Identifier: MIT
#pragma once

// A small TableModel for tests: logistic regression on the sum of the embeddings of an
// example's ids, z = bias + w · Σ emb[id], with every gradient written out by hand, and a
// reference that trains the same model in one process, row by row (SyncReference).

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <vector>

#include "pulley/concepts/model.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/variable.hpp"

namespace pulley::testing {

struct TableExample {
  std::vector<std::uint64_t> ids;  ///< may repeat
  float label = 0.0F;
};
using TableBatchOf = std::vector<TableExample>;

class TinyTableModel {
 public:
  using Batch = TableBatchOf;
  static constexpr std::size_t kDim = 3;

  explicit TinyTableModel(TableSpec table = {"emb", kDim, Initializer::uniform(0.5F)})
      : variables_{{"bias", {1}, Initializer::zeros()}, {"w", {kDim}, Initializer::constant(0.3F)}},
        tables_{std::move(table)},
        values_{std::vector<float>(1), std::vector<float>(kDim)},
        gradients_{std::vector<float>(1), std::vector<float>(kDim)} {}

  [[nodiscard]] std::span<const VariableSpec> variables() const { return variables_; }
  [[nodiscard]] std::span<const TableSpec> tables() const { return tables_; }
  std::span<float> parameter(std::size_t i) { return values_[i]; }
  [[nodiscard]] std::span<const float> gradient(std::size_t i) const { return gradients_[i]; }

  void lookup(const Batch& batch, std::size_t /*table*/, std::vector<std::uint64_t>& ids) const {
    for (const TableExample& e : batch) ids.insert(ids.end(), e.ids.begin(), e.ids.end());
  }

  /// Mean log loss of the batch; dense gradients into gradient(i), row gradients added
  /// into the table's.
  float compute_gradients(const Batch& batch, std::span<const TableBatch> tables) {
    const TableBatch& emb = tables[0];
    return compute(batch, [&](std::uint64_t id) { return emb.row(id); },
                   [&](std::uint64_t id) { return emb.gradient(id); });
  }

  /// The same computation over rows found by `row(id)`, gradients added at `grad(id)`.
  template <class Row, class Grad>
  float compute(const Batch& batch, Row row, Grad grad) {
    std::fill(gradients_[0].begin(), gradients_[0].end(), 0.0F);
    std::fill(gradients_[1].begin(), gradients_[1].end(), 0.0F);
    const float n = static_cast<float>(batch.size());
    double loss = 0.0;
    for (const TableExample& e : batch) {
      float x[kDim] = {};
      for (const std::uint64_t id : e.ids) {
        const auto r = row(id);
        for (std::size_t k = 0; k < kDim; ++k) x[k] += r[k];
      }
      float z = values_[0][0];
      for (std::size_t k = 0; k < kDim; ++k) z += values_[1][k] * x[k];
      const float p = 1.0F / (1.0F + std::exp(-z));
      loss -= e.label > 0.5F ? std::log(p) : std::log(1.0F - p);
      const float dz = (p - e.label) / n;
      gradients_[0][0] += dz;
      for (std::size_t k = 0; k < kDim; ++k) gradients_[1][k] += dz * x[k];
      for (const std::uint64_t id : e.ids) {
        const auto g = grad(id);
        for (std::size_t k = 0; k < kDim; ++k) g[k] += dz * values_[1][k];
      }
    }
    return static_cast<float>(loss / n);
  }

 private:
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> tables_;
  std::vector<std::vector<float>> values_;
  std::vector<std::vector<float>> gradients_;
};
static_assert(TableModel<TinyTableModel>);

/// Batches of `size` examples, each of 1 to 4 ids drawn with a power law from `vocabulary`
/// ids spread over the 64-bit range (a few ids are in most batches, most in few), labels
/// from a planted rule.
inline std::vector<TableBatchOf> table_batches(std::size_t count, std::size_t size,
                                               std::uint64_t vocabulary, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<TableBatchOf> out(count);
  for (TableBatchOf& batch : out) {
    for (std::size_t i = 0; i < size; ++i) {
      TableExample e;
      const std::size_t k = 1 + rng() % 4;
      for (std::size_t j = 0; j < k; ++j) {
        const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
        const auto rank = static_cast<std::uint64_t>(std::pow(static_cast<double>(vocabulary), u)) - 1;
        e.ids.push_back(mix_id(rank));
      }
      e.label = (e.ids[0] % 3 == 0) ? 1.0F : 0.0F;
      batch.push_back(std::move(e));
    }
  }
  return out;
}

/// The sync job the table tests train and hold to SyncReference: 2 workers, 30 steps of
/// SGD at 0.5, every value initialized from seed 11.
namespace table_job {
inline constexpr std::uint64_t kSeed = 11;
inline constexpr float kLearningRate = 0.5F;
inline constexpr std::int64_t kSteps = 30;
inline constexpr std::uint32_t kWorkers = 2;
}  // namespace table_job

/// What one process computes for sync R = N with TensorFlow's rules: the dense gradients
/// averaged over the workers, each row's gradient averaged over the workers whose batch
/// used it, then SGD at `learning_rate`, every value initialized from `seed`.
class SyncReference {
 public:
  TinyTableModel model;
  std::map<std::uint64_t, std::vector<float>> rows;

  SyncReference(std::uint64_t seed, float learning_rate) : seed_(seed), learning_rate_(learning_rate) {
    for (std::size_t v = 0; v < 2; ++v) initialize(model.variables()[v], seed_, model.parameter(v));
  }

  std::vector<float>& row(std::uint64_t id) {
    auto it = rows.find(id);
    if (it == rows.end()) {
      std::vector<float> r(TinyTableModel::kDim);
      initialize_row(model.tables()[0], seed_, id, r);
      it = rows.emplace(id, std::move(r)).first;
    }
    return it->second;
  }

  /// One global step: each worker's batch of it.
  void step(const std::vector<const TableBatchOf*>& batches) {
    std::vector<std::vector<float>> dense(2);
    std::map<std::uint64_t, std::pair<std::vector<float>, int>> sums;  // row: sum, count
    for (const TableBatchOf* batch : batches) {
      std::map<std::uint64_t, std::vector<float>> mine;
      model.compute(
          *batch, [&](std::uint64_t id) { return std::span<const float>(row(id)); },
          [&](std::uint64_t id) {
            auto& g = mine[id];
            g.resize(TinyTableModel::kDim, 0.0F);
            return std::span<float>(g);
          });
      for (std::size_t v = 0; v < 2; ++v) {
        const auto g = model.gradient(v);
        dense[v].resize(g.size(), 0.0F);
        for (std::size_t i = 0; i < g.size(); ++i) dense[v][i] += g[i];
      }
      for (auto& [id, g] : mine) {
        auto& [sum, count] = sums[id];
        sum.resize(g.size(), 0.0F);
        for (std::size_t k = 0; k < g.size(); ++k) sum[k] += g[k];
        ++count;
      }
    }
    const auto n = static_cast<float>(batches.size());
    for (std::size_t v = 0; v < 2; ++v) {
      auto w = model.parameter(v);
      for (std::size_t i = 0; i < w.size(); ++i) w[i] -= learning_rate_ * (dense[v][i] / n);
    }
    for (auto& [id, entry] : sums) {
      auto& r = row(id);
      const auto count = static_cast<float>(entry.second);
      for (std::size_t k = 0; k < r.size(); ++k) {
        r[k] -= learning_rate_ * (count == 1.0F ? entry.first[k] : entry.first[k] / count);
      }
    }
  }

 private:
  std::uint64_t seed_;
  float learning_rate_;
};

}  // namespace pulley::testing
