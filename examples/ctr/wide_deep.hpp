// SPDX-License-Identifier: MIT
#pragma once

// A wide-and-deep click model as a pulley TableModel: a "wide" table of one weight per id,
// summed, plus a "deep" part, an MLP over the 13 dense features, the 26 fields'
// embeddings (table "emb", dim 16) and the dot products of every pair of them (DLRM's
// interaction: a ReLU layer learns products of its inputs poorly, and field interactions
// are products): logit = bias + Σ wide[id] + MLP([dense, emb..., <emb_f, emb_g>...]).
// The matrix products are plain loops ordered so that the compiler vectorizes them (the
// hidden layer is 754 × 64; BLAS would not pay for its call at this size).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "ctr/data.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/core/variable.hpp"

namespace ctr {

class WideDeep {
 public:
  struct Batch {
    std::span<const Example> examples;
  };
  static constexpr std::size_t kDim = 16;                   ///< embedding dimension
  static constexpr std::size_t kPairs = kFields * (kFields - 1) / 2;  ///< field pairs
  static constexpr std::size_t kDots = kDense + kFields * kDim;       ///< where the dots start
  static constexpr std::size_t kIn = kDots + kPairs;                 ///< the MLP's input
  static constexpr std::size_t kHidden = 64;

  /// @param admit_after a value gets rows once it was seen this many times (TableSpec):
  ///        rarer ones read as their initial values and teach nothing, which keeps the
  ///        long tail from fitting noise, and memory down
  /// @param max_rows the most rows of each table one ps holds (0: no cap; TableSpec)
  explicit WideDeep(std::uint32_t admit_after = 1, std::uint64_t max_rows = 0)
      : variables_{{"hidden/kernel", {kIn, kHidden}, pulley::Initializer::glorot_uniform()},
                   {"hidden/bias", {kHidden}, pulley::Initializer::zeros()},
                   {"out/kernel", {kHidden, 1}, pulley::Initializer::glorot_uniform()},
                   {"out/bias", {1}, pulley::Initializer::zeros()}},
        tables_{{"wide", 1, pulley::Initializer::zeros(), admit_after, 0, max_rows},
                {"emb", kDim, pulley::Initializer::uniform(0.05F), admit_after, 0, max_rows}} {
    for (const auto& v : variables_) {
      values_.emplace_back(v.size());
      gradients_.emplace_back(v.size());
    }
  }

  [[nodiscard]] std::span<const pulley::VariableSpec> variables() const { return variables_; }
  [[nodiscard]] std::span<const pulley::TableSpec> tables() const { return tables_; }
  std::span<float> parameter(std::size_t i) { return values_[i]; }
  [[nodiscard]] std::span<const float> gradient(std::size_t i) const { return gradients_[i]; }

  /// Both tables are keyed by the same ids: every field's value of every example.
  void lookup(const Batch& batch, std::size_t /*table*/, std::vector<std::uint64_t>& ids) const {
    for (const Example& e : batch.examples) {
      for (std::size_t f = 0; f < kFields; ++f) ids.push_back(id_of(f, e.value[f]));
    }
  }

  float compute_gradients(const Batch& batch, std::span<const pulley::TableBatch> tables) {
    const pulley::TableBatch& wide = tables[0];
    const pulley::TableBatch& emb = tables[1];
    forward(batch.examples, [&](std::uint64_t id) { return wide.row(id)[0]; },
            [&](std::uint64_t id) { return emb.row(id); });
    return backward(batch.examples, wide, emb);
  }

  /// The predicted logits of `examples`, rows from `wide(id)` → float and `emb(id)` → span.
  template <class Wide, class Emb>
  std::vector<double> predict(std::span<const Example> examples, Wide wide, Emb emb) {
    forward(examples, wide, emb);
    return {logits_.begin(), logits_.end()};
  }

 private:
  template <class Wide, class Emb>
  void forward(std::span<const Example> examples, Wide wide, Emb emb) {
    const std::size_t n = examples.size();
    x_.assign(n * kIn, 0.0F);
    h_.assign(n * kHidden, 0.0F);
    logits_.assign(n, 0.0F);
    const float* w1 = values_[0].data();
    const float* b1 = values_[1].data();
    const float* w2 = values_[2].data();
    for (std::size_t b = 0; b < n; ++b) {
      const Example& e = examples[b];
      float* x = x_.data() + b * kIn;
      std::copy(e.dense, e.dense + kDense, x);
      float wide_sum = 0.0F;
      for (std::size_t f = 0; f < kFields; ++f) {
        const std::uint64_t id = id_of(f, e.value[f]);
        wide_sum += wide(id);
        const auto row = emb(id);
        std::copy(row.begin(), row.end(), x + kDense + f * kDim);
      }
      const float* e_in = x + kDense;
      float* dot = x + kDots;
      for (std::size_t f = 0; f < kFields; ++f) {
        for (std::size_t g = f + 1; g < kFields; ++g) *dot++ = inner(e_in + f * kDim, e_in + g * kDim);
      }
      float* h = h_.data() + b * kHidden;
      std::copy(b1, b1 + kHidden, h);
      for (std::size_t k = 0; k < kIn; ++k) {
        const float xk = x[k];
        const float* w = w1 + k * kHidden;
        for (std::size_t j = 0; j < kHidden; ++j) h[j] += xk * w[j];
      }
      float out = values_[3][0] + wide_sum;
      for (std::size_t j = 0; j < kHidden; ++j) {
        h[j] = std::max(h[j], 0.0F);
        out += h[j] * w2[j];
      }
      logits_[b] = out;
    }
  }

  float backward(std::span<const Example> examples, const pulley::TableBatch& wide,
                 const pulley::TableBatch& emb) {
    const std::size_t n = examples.size();
    for (auto& g : gradients_) std::fill(g.begin(), g.end(), 0.0F);
    float* g_w1 = gradients_[0].data();
    float* g_b1 = gradients_[1].data();
    float* g_w2 = gradients_[2].data();
    const float* w1 = values_[0].data();
    const float* w2 = values_[2].data();
    double loss = 0.0;
    std::vector<float> dh(kHidden), dx(kIn);
    for (std::size_t b = 0; b < n; ++b) {
      const Example& e = examples[b];
      const float z = logits_[b];
      // log(1 + exp(-z)) or log(1 + exp(z)), computed without overflow
      const float softplus = z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
      loss += e.label > 0.5F ? softplus - z : softplus;
      const float p = 1.0F / (1.0F + std::exp(-z));
      const float dz = (p - e.label) / static_cast<float>(n);
      gradients_[3][0] += dz;
      const float* h = h_.data() + b * kHidden;
      for (std::size_t j = 0; j < kHidden; ++j) {
        g_w2[j] += h[j] * dz;
        dh[j] = h[j] > 0.0F ? dz * w2[j] : 0.0F;
        g_b1[j] += dh[j];
      }
      const float* x = x_.data() + b * kIn;
      for (std::size_t k = 0; k < kIn; ++k) {
        const float xk = x[k];
        float* g = g_w1 + k * kHidden;
        const float* w = w1 + k * kHidden;
        float s = 0.0F;
        for (std::size_t j = 0; j < kHidden; ++j) {
          g[j] += xk * dh[j];
          s += dh[j] * w[j];
        }
        dx[k] = s;
      }
      // d<e_f, e_g> / de_f = e_g: the dots' share of each embedding's gradient
      const float* e_in = x + kDense;
      float* de = dx.data() + kDense;
      const float* d_dot = dx.data() + kDots;
      for (std::size_t f = 0; f < kFields; ++f) {
        for (std::size_t g = f + 1; g < kFields; ++g, ++d_dot) {
          for (std::size_t k = 0; k < kDim; ++k) {
            de[f * kDim + k] += *d_dot * e_in[g * kDim + k];
            de[g * kDim + k] += *d_dot * e_in[f * kDim + k];
          }
        }
      }
      for (std::size_t f = 0; f < kFields; ++f) {
        const std::uint64_t id = id_of(f, e.value[f]);
        wide.gradient(id)[0] += dz;
        const auto g = emb.gradient(id);
        for (std::size_t k = 0; k < kDim; ++k) g[k] += de[f * kDim + k];
      }
    }
    return static_cast<float>(loss / static_cast<double>(n));
  }

  static float inner(const float* a, const float* b) {
    float s = 0.0F;
    for (std::size_t k = 0; k < kDim; ++k) s += a[k] * b[k];
    return s;
  }

  std::vector<pulley::VariableSpec> variables_;
  std::vector<pulley::TableSpec> tables_;
  std::vector<std::vector<float>> values_;
  std::vector<std::vector<float>> gradients_;
  std::vector<float> x_, h_, logits_;  ///< the last batch's input, hidden layer and logits
};
static_assert(pulley::TableModel<WideDeep>);

}  // namespace ctr
