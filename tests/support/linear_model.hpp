// SPDX-License-Identifier: MIT
#pragma once

// A linear regression model y = x W + b with mean squared error, small enough to check
// distributed training against a single-process reference exactly. Standard headers only.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/core/initializers.hpp"
#include "pulley/core/variable.hpp"

namespace pulley::testing {

struct LinearBatch {
  std::span<const float> x;  // rows x in
  std::span<const float> y;  // rows x out
};

class LinearModel {
 public:
  using Batch = LinearBatch;

  LinearModel(std::size_t in, std::size_t out)
      : in_(in),
        out_(out),
        variables_{{"linear/kernel", {in, out}, Initializer::glorot_uniform()},
                   {"linear/bias", {out}, Initializer::uniform(0.1F)}},
        w_(in * out),
        b_(out),
        dw_(in * out),
        db_(out) {}

  std::span<const VariableSpec> variables() const { return variables_; }
  std::span<float> parameter(std::size_t i) { return i == 0 ? std::span(w_) : std::span(b_); }
  std::span<const float> gradient(std::size_t i) const {
    return i == 0 ? std::span(dw_) : std::span(db_);
  }

  /// 0.5 * mean over rows of |x W + b - y|^2, and its gradient.
  float compute_gradients(const Batch& batch) {
    const std::size_t rows = batch.y.size() / out_;
    std::fill(dw_.begin(), dw_.end(), 0.0F);
    std::fill(db_.begin(), db_.end(), 0.0F);
    double loss = 0.0;
    std::vector<float> err(out_);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t o = 0; o < out_; ++o) {
        float p = b_[o];
        for (std::size_t i = 0; i < in_; ++i) p += batch.x[r * in_ + i] * w_[i * out_ + o];
        err[o] = p - batch.y[r * out_ + o];
        loss += 0.5 * err[o] * err[o];
      }
      for (std::size_t o = 0; o < out_; ++o) {
        db_[o] += err[o] / static_cast<float>(rows);
        for (std::size_t i = 0; i < in_; ++i) {
          dw_[i * out_ + o] += batch.x[r * in_ + i] * err[o] / static_cast<float>(rows);
        }
      }
    }
    return static_cast<float>(loss / static_cast<double>(rows));
  }

  /// Fills every variable as the chief would with `seed`.
  void initialize(std::uint64_t seed) {
    for (std::size_t v = 0; v < variables_.size(); ++v) {
      pulley::initialize(variables_[v], seed, parameter(v));
    }
  }

 private:
  std::size_t in_;
  std::size_t out_;
  std::vector<VariableSpec> variables_;
  std::vector<float> w_, b_, dw_, db_;
};

/// Deterministic synthetic data: `rows` examples of a noisy linear map, from `seed`.
struct LinearData {
  std::vector<float> x, y;

  LinearData(std::size_t rows, std::size_t in, std::size_t out, std::uint64_t seed)
      : x(rows * in), y(rows * out) {
    SplitMix64 rng(seed);
    for (float& v : x) v = static_cast<float>(rng.uniform() * 2.0 - 1.0);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t o = 0; o < out; ++o) {
        float t = 0.3F * static_cast<float>(o);
        for (std::size_t i = 0; i < in; ++i) {
          t += x[r * in + i] * (static_cast<float>((i + 2 * o) % 5) - 2.0F) * 0.5F;
        }
        y[r * out + o] = t + static_cast<float>(rng.uniform() - 0.5) * 0.1F;
      }
    }
  }
};

}  // namespace pulley::testing
