// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <xtensor-blas/xblas.hpp>
#include <xtensor/xadapt.hpp>

#include "pulley/concepts/model.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/variable.hpp"

namespace pulley::models {

/// One batch for `Mlp`: a row-major feature matrix and one class index per row. Both are
/// views; the caller keeps the data alive for the duration of the call.
struct MlpBatch {
  std::span<const float> features;       ///< `labels.size()` rows × input size, row-major
  std::span<const std::int32_t> labels;  ///< class of each row, in `[0, number of classes)`
};

/// A multi-layer perceptron for classification: dense layers with ReLU between them and a
/// softmax cross-entropy loss on the last layer's logits (Keras' `Dense` stack with
/// `SparseCategoricalCrossentropy(from_logits=True)`).
///
/// Variables, in order, for layer k = 0, 1, ...: `dense_k/kernel` of shape [in, out]
/// (Glorot uniform) and `dense_k/bias` of shape [out] (zeros). Each variable's parameters
/// and gradient are one contiguous buffer that never moves, so a worker pulls into and
/// pushes from them in place.
///
/// Every matrix product is one BLAS `gemm` into a preallocated buffer. The activation
/// buffers only grow (to the largest batch seen), so training with a fixed batch size
/// allocates nothing after the first step. Not thread-safe: `compute_gradients` and
/// `evaluate` reuse those buffers.
class Mlp {
 public:
  /// What `compute_gradients` and `evaluate` take (the `pulley::Model` requirement).
  using Batch = MlpBatch;

  /// What `evaluate` measures on a batch.
  struct Evaluation {
    double loss = 0.0;         ///< mean cross-entropy
    double accuracy = 0.0;     ///< fraction of rows whose arg-max logit is the label
    std::size_t examples = 0;  ///< rows evaluated
  };

  /// Builds the network `layer_sizes[0] → layer_sizes[1] → ... → layer_sizes.back()`, e.g.
  /// {784, 128, 10}: 784 inputs, one hidden layer of 128, 10 classes. Parameters start at
  /// zero; call `initialize` or pull them from the parameter servers.
  /// @throws std::invalid_argument for fewer than 2 sizes or a zero size.
  explicit Mlp(std::vector<std::size_t> layer_sizes);

  /// The variables, in the fixed order described above.
  [[nodiscard]] std::span<const VariableSpec> variables() const noexcept { return variables_; }

  /// Variable i's parameters, row-major; a stable address for the model's lifetime.
  /// @throws std::out_of_range for i >= variables().size().
  [[nodiscard]] std::span<float> parameter(std::size_t i) { return parameters_.at(i); }
  /// Read-only view of variable i's parameters.
  [[nodiscard]] std::span<const float> parameter(std::size_t i) const { return parameters_.at(i); }

  /// Gradient of the last `compute_gradients` batch's mean loss with respect to variable i;
  /// a stable address for the model's lifetime.
  /// @throws std::out_of_range for i >= variables().size().
  [[nodiscard]] std::span<const float> gradient(std::size_t i) const { return gradients_.at(i); }

  /// Fills every parameter from its initializer with `pulley::initialize` — what the chief
  /// does, for tests and single-process training.
  void initialize(std::uint64_t seed);

  /// Forward and backward pass: stores the gradient of the batch's mean loss in
  /// `gradient(i)` and returns that mean loss.
  /// @throws std::invalid_argument for an empty batch, a feature count that is not
  ///   rows × input size, or a label out of range.
  float compute_gradients(const Batch& batch);

  /// Forward pass only: mean loss and accuracy. Any number of rows; large batches are
  /// processed in chunks, so evaluating a whole test set does not grow the buffers to it.
  /// @throws std::invalid_argument as `compute_gradients` does.
  Evaluation evaluate(const Batch& batch);

  /// The sizes given to the constructor.
  [[nodiscard]] std::span<const std::size_t> layer_sizes() const noexcept { return layer_sizes_; }
  /// Features per row.
  [[nodiscard]] std::size_t input_size() const noexcept { return layer_sizes_.front(); }
  /// Number of classes (width of the last layer).
  [[nodiscard]] std::size_t num_classes() const noexcept { return layer_sizes_.back(); }

 private:
  /// Rows `evaluate` processes at once (more if the buffers already hold more).
  static constexpr std::size_t kEvalChunkRows = 256;

  [[nodiscard]] std::size_t num_layers() const noexcept { return layer_sizes_.size() - 1; }
  void validate(const Batch& batch) const;
  void reserve_rows(std::size_t rows);
  /// Logits of `rows` rows of `x` into `activations_.back()`; hidden activations kept.
  void forward(const float* x, std::size_t rows);
  /// Softmax cross-entropy of the logits in place (they become probabilities); returns
  /// the summed loss and, if `correct` is non-null, adds the number of arg-max hits.
  double softmax_cross_entropy(const std::int32_t* labels, std::size_t rows, std::size_t* correct);
  void backward(const float* x, const std::int32_t* labels, std::size_t rows);

  std::vector<std::size_t> layer_sizes_;
  std::vector<VariableSpec> variables_;
  std::vector<std::vector<float>> parameters_;  // one per variable; sized once, never resized
  std::vector<std::vector<float>> gradients_;   // likewise
  // activations_[k]: rows × layer_sizes_[k + 1], layer k's output after ReLU (logits, then
  // probabilities, then the loss gradient for the last layer).
  std::vector<std::vector<float>> activations_;
  // deltas_[k], hidden layers only: gradient of the loss with respect to layer k's pre-ReLU
  // output.
  std::vector<std::vector<float>> deltas_;
  std::size_t capacity_rows_ = 0;
};

static_assert(pulley::Model<Mlp>);

// ---------------------------------------------------------------------------------------
// Implementation
// ---------------------------------------------------------------------------------------

namespace detail {

/// A row-major rows × cols xtensor view over `data`, for `xt::blas::gemm`. No allocation:
/// the shape lives in a std::array. `data` must be an rvalue so the adaptor holds the
/// pointer by value, not a reference to the caller's variable.
template <class T>
[[nodiscard]] inline auto matrix(T* data, std::size_t rows, std::size_t cols) {
  return xt::adapt(std::move(data), rows * cols, xt::no_ownership(),
                   std::array<std::size_t, 2>{rows, cols});
}

}  // namespace detail

inline Mlp::Mlp(std::vector<std::size_t> layer_sizes) : layer_sizes_(std::move(layer_sizes)) {
  if (layer_sizes_.size() < 2) {
    throw std::invalid_argument(
        "pulley::models::Mlp: needs at least 2 layer sizes (inputs and classes), got " +
        std::to_string(layer_sizes_.size()));
  }
  for (std::size_t k = 0; k < layer_sizes_.size(); ++k) {
    if (layer_sizes_[k] == 0) {
      throw std::invalid_argument("pulley::models::Mlp: layer size " + std::to_string(k) +
                                  " is zero");
    }
  }
  const std::size_t layers = num_layers();
  variables_.reserve(2 * layers);
  for (std::size_t k = 0; k < layers; ++k) {
    const std::string prefix = "dense_" + std::to_string(k);
    const std::size_t in = layer_sizes_[k];
    const std::size_t out = layer_sizes_[k + 1];
    variables_.push_back({prefix + "/kernel", {in, out}, Initializer::glorot_uniform()});
    variables_.push_back({prefix + "/bias", {out}, Initializer::zeros()});
  }
  parameters_.reserve(variables_.size());
  gradients_.reserve(variables_.size());
  for (const VariableSpec& spec : variables_) {
    parameters_.emplace_back(spec.size(), 0.0F);
    gradients_.emplace_back(spec.size(), 0.0F);
  }
  activations_.resize(layers);
  deltas_.resize(layers - 1);
}

inline void Mlp::initialize(std::uint64_t seed) {
  for (std::size_t i = 0; i < variables_.size(); ++i) {
    pulley::initialize(variables_[i], seed, parameters_[i]);
  }
}

inline void Mlp::validate(const Batch& batch) const {
  const std::size_t rows = batch.labels.size();
  const std::size_t in = input_size();
  if (rows == 0) {
    throw std::invalid_argument("pulley::models::Mlp: empty batch (no labels)");
  }
  if (batch.features.size() % in != 0 || batch.features.size() / in != rows) {
    throw std::invalid_argument("pulley::models::Mlp: batch has " +
                                std::to_string(batch.features.size()) +
                                " feature values, expected " + std::to_string(rows) +
                                " rows (one per label) x " + std::to_string(in) + " inputs");
  }
  const auto classes = static_cast<std::int64_t>(num_classes());
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t label = batch.labels[r];
    if (label < 0 || label >= classes) {
      throw std::invalid_argument("pulley::models::Mlp: label " + std::to_string(label) +
                                  " of row " + std::to_string(r) + " is outside [0, " +
                                  std::to_string(classes) + ")");
    }
  }
}

inline void Mlp::reserve_rows(std::size_t rows) {
  if (rows <= capacity_rows_) return;
  for (std::size_t k = 0; k < num_layers(); ++k) {
    activations_[k].resize(rows * layer_sizes_[k + 1]);
    if (k < deltas_.size()) deltas_[k].resize(rows * layer_sizes_[k + 1]);
  }
  capacity_rows_ = rows;
}

inline void Mlp::forward(const float* x, std::size_t rows) {
  const float* in = x;
  for (std::size_t k = 0; k < num_layers(); ++k) {
    const std::size_t in_dim = layer_sizes_[k];
    const std::size_t out_dim = layer_sizes_[k + 1];
    float* z = activations_[k].data();
    const float* bias = parameters_[2 * k + 1].data();
    // z = bias broadcast over rows, then z += in · W in the same gemm (beta = 1).
    for (std::size_t r = 0; r < rows; ++r) std::copy_n(bias, out_dim, z + r * out_dim);
    auto zm = detail::matrix(z, rows, out_dim);
    xt::blas::gemm(detail::matrix(in, rows, in_dim),
                   detail::matrix(parameters_[2 * k].data(), in_dim, out_dim), zm,
                   /*transpose_A=*/false, /*transpose_B=*/false, 1.0F, 1.0F);
    if (k + 1 < num_layers()) {
      for (std::size_t i = 0, n = rows * out_dim; i < n; ++i) z[i] = std::max(z[i], 0.0F);
    }
    in = z;
  }
}

inline double Mlp::softmax_cross_entropy(const std::int32_t* labels, std::size_t rows,
                                         std::size_t* correct) {
  const std::size_t classes = num_classes();
  float* logits = activations_.back().data();
  double loss = 0.0;
  for (std::size_t r = 0; r < rows; ++r) {
    float* z = logits + r * classes;
    const auto label = static_cast<std::size_t>(labels[r]);
    const std::size_t arg_max = static_cast<std::size_t>(std::max_element(z, z + classes) - z);
    if (correct != nullptr && arg_max == label) ++*correct;
    const float max = z[arg_max];  // subtracting it keeps exp() from overflowing
    const float shifted_label = z[label] - max;
    float sum = 0.0F;
    for (std::size_t j = 0; j < classes; ++j) {
      z[j] = std::exp(z[j] - max);
      sum += z[j];
    }
    // -log softmax(z)[label] = log Σ exp(z - max) - (z[label] - max)
    loss += static_cast<double>(std::log(sum) - shifted_label);
    const float inv_sum = 1.0F / sum;
    for (std::size_t j = 0; j < classes; ++j) z[j] *= inv_sum;
  }
  return loss;
}

inline void Mlp::backward(const float* x, const std::int32_t* labels, std::size_t rows) {
  const std::size_t layers = num_layers();
  // d(mean loss)/d(logits) = (softmax - one_hot) / rows, in place of the probabilities.
  {
    const std::size_t classes = num_classes();
    const float inv_rows = 1.0F / static_cast<float>(rows);
    float* p = activations_.back().data();
    for (std::size_t r = 0; r < rows; ++r) {
      p[r * classes + static_cast<std::size_t>(labels[r])] -= 1.0F;
    }
    for (std::size_t i = 0, n = rows * classes; i < n; ++i) p[i] *= inv_rows;
  }
  for (std::size_t k = layers; k-- > 0;) {
    const std::size_t in_dim = layer_sizes_[k];
    const std::size_t out_dim = layer_sizes_[k + 1];
    const float* delta = (k + 1 == layers) ? activations_.back().data() : deltas_[k].data();
    const float* input = (k == 0) ? x : activations_[k - 1].data();

    // dW = inputᵀ · delta
    auto kernel_grad = detail::matrix(gradients_[2 * k].data(), in_dim, out_dim);
    xt::blas::gemm(detail::matrix(input, rows, in_dim), detail::matrix(delta, rows, out_dim),
                   kernel_grad, /*transpose_A=*/true, /*transpose_B=*/false);

    // db = column sums of delta
    float* bias_grad = gradients_[2 * k + 1].data();
    std::fill_n(bias_grad, out_dim, 0.0F);
    for (std::size_t r = 0; r < rows; ++r) {
      const float* row = delta + r * out_dim;
      for (std::size_t j = 0; j < out_dim; ++j) bias_grad[j] += row[j];
    }

    if (k == 0) break;  // no gradient with respect to the input features
    // delta of layer k-1 = (delta · Wᵀ) ⊙ [its ReLU output > 0]
    float* prev_delta = deltas_[k - 1].data();
    auto prev_delta_m = detail::matrix(prev_delta, rows, in_dim);
    xt::blas::gemm(detail::matrix(delta, rows, out_dim),
                   detail::matrix(parameters_[2 * k].data(), in_dim, out_dim), prev_delta_m,
                   /*transpose_A=*/false, /*transpose_B=*/true);
    const float* activation = activations_[k - 1].data();
    for (std::size_t i = 0, n = rows * in_dim; i < n; ++i) {
      if (!(activation[i] > 0.0F)) prev_delta[i] = 0.0F;
    }
  }
}

inline float Mlp::compute_gradients(const Batch& batch) {
  validate(batch);
  const std::size_t rows = batch.labels.size();
  reserve_rows(rows);
  forward(batch.features.data(), rows);
  const double loss = softmax_cross_entropy(batch.labels.data(), rows, nullptr);
  backward(batch.features.data(), batch.labels.data(), rows);
  return static_cast<float>(loss / static_cast<double>(rows));
}

inline Mlp::Evaluation Mlp::evaluate(const Batch& batch) {
  validate(batch);
  const std::size_t rows = batch.labels.size();
  const std::size_t chunk = std::max(kEvalChunkRows, capacity_rows_);
  reserve_rows(std::min(rows, chunk));
  double loss = 0.0;
  std::size_t correct = 0;
  for (std::size_t begin = 0; begin < rows; begin += chunk) {
    const std::size_t n = std::min(chunk, rows - begin);
    forward(batch.features.data() + begin * input_size(), n);
    loss += softmax_cross_entropy(batch.labels.data() + begin, n, &correct);
  }
  const auto total = static_cast<double>(rows);
  return {loss / total, static_cast<double>(correct) / total, rows};
}

}  // namespace pulley::models
