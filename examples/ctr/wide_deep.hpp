// SPDX-License-Identifier: MIT
#pragma once

// A wide-and-deep click model as a pulley TableModel: a "wide" table of one weight per id,
// summed, plus a "deep" part, an MLP over the 13 dense features, the 26 fields'
// embeddings (table "emb", dim 16) and the dot products of every pair of them (DLRM's
// interaction: a ReLU layer learns products of its inputs poorly, and field interactions
// are products): logit = bias + Σ wide[id] + MLP([dense, emb..., <emb_f, emb_g>...]).
// The hidden layer's products (754 × 64, over a whole batch) are BLAS gemms into buffers
// kept from batch to batch.

#include <xtensor-blas/xblas.hpp>
#include <xtensor/xadapt.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "ctr/data.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/core/variable.hpp"

namespace ctr {

/// A row-major rows × cols view of `data` for xt::blas::gemm (no copy, no allocation).
/// `data` is moved in so that the adaptor holds the pointer by value, not a reference to
/// this function's parameter.
template <class T>
auto matrix(T* data, std::size_t rows, std::size_t cols) {
  return xt::adapt(std::move(data), rows * cols, xt::no_ownership(), std::array<std::size_t, 2>{rows, cols});
}

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
    x_.resize(n * kIn);
    h_.resize(n * kHidden);
    logits_.assign(n, values_[3][0]);
    for (std::size_t b = 0; b < n; ++b) {
      const Example& e = examples[b];
      float* x = x_.data() + b * kIn;
      std::copy(e.dense, e.dense + kDense, x);
      for (std::size_t f = 0; f < kFields; ++f) {
        const std::uint64_t id = id_of(f, e.value[f]);
        logits_[b] += wide(id);
        const auto row = emb(id);
        std::copy(row.begin(), row.end(), x + kDense + f * kDim);
      }
      const float* e_in = x + kDense;
      float* dot = x + kDots;
      for (std::size_t f = 0; f < kFields; ++f) {
        for (std::size_t g = f + 1; g < kFields; ++g) *dot++ = inner(e_in + f * kDim, e_in + g * kDim);
      }
    }
    // H = ReLU(X · W1 + b1): the bias in first, then one gemm adds the product (beta = 1).
    const float* b1 = values_[1].data();
    for (std::size_t b = 0; b < n; ++b) std::copy(b1, b1 + kHidden, h_.data() + b * kHidden);
    auto h = matrix(h_.data(), n, kHidden);
    xt::blas::gemm(matrix(x_.data(), n, kIn), matrix(values_[0].data(), kIn, kHidden), h, false, false, 1.0F, 1.0F);
    const float* w2 = values_[2].data();
    for (std::size_t b = 0; b < n; ++b) {
      float* hb = h_.data() + b * kHidden;
      float out = 0.0F;
      for (std::size_t j = 0; j < kHidden; ++j) {
        hb[j] = std::max(hb[j], 0.0F);
        out += hb[j] * w2[j];
      }
      logits_[b] += out;
    }
  }

  float backward(std::span<const Example> examples, const pulley::TableBatch& wide,
                 const pulley::TableBatch& emb) {
    const std::size_t n = examples.size();
    float* g_b1 = gradients_[1].data();
    float* g_w2 = gradients_[2].data();
    std::fill(gradients_[1].begin(), gradients_[1].end(), 0.0F);
    std::fill(gradients_[2].begin(), gradients_[2].end(), 0.0F);
    gradients_[3][0] = 0.0F;
    const float* w2 = values_[2].data();
    double loss = 0.0;
    dh_.resize(n * kHidden);
    dz_.resize(n);
    for (std::size_t b = 0; b < n; ++b) {
      const Example& e = examples[b];
      const float z = logits_[b];
      // log(1 + exp(-z)) or log(1 + exp(z)), computed without overflow
      const float softplus = z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
      loss += e.label > 0.5F ? softplus - z : softplus;
      const float p = 1.0F / (1.0F + std::exp(-z));
      const float dz = (p - e.label) / static_cast<float>(n);
      dz_[b] = dz;
      gradients_[3][0] += dz;
      const float* h = h_.data() + b * kHidden;
      float* dh = dh_.data() + b * kHidden;
      for (std::size_t j = 0; j < kHidden; ++j) {
        g_w2[j] += h[j] * dz;
        dh[j] = h[j] > 0.0F ? dz * w2[j] : 0.0F;
        g_b1[j] += dh[j];
      }
    }
    // dW1 = Xᵀ · dH, and the input's gradient dX = dH · W1ᵀ: one gemm each.
    auto g_w1 = matrix(gradients_[0].data(), kIn, kHidden);
    xt::blas::gemm(matrix(x_.data(), n, kIn), matrix(dh_.data(), n, kHidden), g_w1, true, false);
    dx_.resize(n * kIn);
    auto dx = matrix(dx_.data(), n, kIn);
    xt::blas::gemm(matrix(dh_.data(), n, kHidden), matrix(values_[0].data(), kIn, kHidden), dx, false, true);
    for (std::size_t b = 0; b < n; ++b) {
      const Example& e = examples[b];
      // d<e_f, e_g> / de_f = e_g: the dots' share of each embedding's gradient
      const float* e_in = x_.data() + b * kIn + kDense;
      float* de = dx_.data() + b * kIn + kDense;
      const float* d_dot = dx_.data() + b * kIn + kDots;
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
        wide.gradient(id)[0] += dz_[b];
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
  std::vector<float> dz_, dh_, dx_;    ///< the gradients of the logits, hidden layer and input
};
static_assert(pulley::TableModel<WideDeep>);

}  // namespace ctr
