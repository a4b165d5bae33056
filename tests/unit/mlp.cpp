// SPDX-License-Identifier: MIT
#include "pulley/models/mlp.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pulley/core/initializers.hpp"

namespace {

using pulley::models::Mlp;
using pulley::models::MlpBatch;

/// Features and labels a test owns; `batch()` views them.
struct Data {
  std::vector<float> features;
  std::vector<std::int32_t> labels;

  [[nodiscard]] MlpBatch batch() const { return {features, labels}; }
};

/// Features uniform in [-1, 1) and uniform labels, from pulley's portable generator.
Data make_data(std::size_t rows, std::size_t inputs, std::size_t classes, std::uint64_t seed) {
  pulley::SplitMix64 rng(seed);
  Data d;
  d.features.resize(rows * inputs);
  for (float& f : d.features) f = static_cast<float>(2.0 * rng.uniform() - 1.0);
  for (std::size_t r = 0; r < rows; ++r) {
    d.labels.push_back(static_cast<std::int32_t>(rng.next() % classes));
  }
  return d;
}

/// Glorot kernels, and biases made non-zero so the bias path is exercised too.
Mlp random_model(std::vector<std::size_t> sizes, std::uint64_t seed) {
  Mlp model(std::move(sizes));
  model.initialize(seed);
  pulley::SplitMix64 rng(seed + 1);
  for (std::size_t i = 1; i < model.variables().size(); i += 2) {
    for (float& b : model.parameter(i)) b = static_cast<float>(0.2 * rng.uniform() - 0.1);
  }
  return model;
}

/// A naive double-precision forward pass of one row, straight from the parameters: an
/// independent reference for the model's. Returns the logits; `margin` gets the smallest
/// |pre-activation| of any hidden unit (how far the row is from a ReLU kink).
std::vector<double> reference_logits(const Mlp& model, std::span<const float> row,
                                     double* margin = nullptr) {
  const auto sizes = model.layer_sizes();
  std::vector<double> a(row.begin(), row.end());
  double smallest = std::numeric_limits<double>::infinity();
  for (std::size_t k = 0; k + 1 < sizes.size(); ++k) {
    const auto kernel = model.parameter(2 * k);
    const auto bias = model.parameter(2 * k + 1);
    const bool hidden = k + 2 < sizes.size();
    std::vector<double> z(sizes[k + 1]);
    for (std::size_t o = 0; o < sizes[k + 1]; ++o) {
      double s = bias[o];
      for (std::size_t i = 0; i < sizes[k]; ++i) s += a[i] * kernel[i * sizes[k + 1] + o];
      if (hidden) smallest = std::min(smallest, std::abs(s));
      z[o] = hidden ? std::max(s, 0.0) : s;
    }
    a = std::move(z);
  }
  if (margin != nullptr) *margin = smallest;
  return a;
}

/// Mean softmax cross-entropy from `reference_logits`.
double reference_loss(const Mlp& model, const Data& data) {
  const std::size_t inputs = model.input_size();
  double total = 0.0;
  for (std::size_t r = 0; r < data.labels.size(); ++r) {
    const auto z = reference_logits(model, std::span(data.features).subspan(r * inputs, inputs));
    double sum = 0.0;
    for (double v : z) sum += std::exp(v);
    total += std::log(sum) - z[static_cast<std::size_t>(data.labels[r])];
  }
  return total / static_cast<double>(data.labels.size());
}

/// `rows` random rows for `model` whose hidden pre-activations all stay at least `margin`
/// from zero, so a finite difference never straddles a ReLU kink.
Data data_away_from_kinks(const Mlp& model, std::size_t rows, double margin, std::uint64_t seed) {
  Data kept;
  const std::size_t inputs = model.input_size();
  while (kept.labels.size() < rows) {
    const Data candidate = make_data(1, inputs, model.num_classes(), seed++);
    double row_margin = 0.0;
    (void)reference_logits(model, candidate.features, &row_margin);
    if (row_margin < margin) continue;
    kept.features.insert(kept.features.end(), candidate.features.begin(), candidate.features.end());
    kept.labels.push_back(candidate.labels.front());
  }
  return kept;
}

/// Checks every gradient element of every variable against a central difference of the
/// model's own loss.
void check_gradients(std::vector<std::size_t> sizes, std::size_t rows, std::uint64_t seed) {
  Mlp model = random_model(sizes, seed);
  // Central differences on float: eps = 1e-2 keeps rounding noise (~1e-7 / eps) small, and
  // rows at least 0.1 from every ReLU kink keep a perturbation from crossing one.
  constexpr float kEps = 1e-2F;
  const Data data = data_away_from_kinks(model, rows, 0.1, seed + 2);
  model.compute_gradients(data.batch());
  // Snapshot first: every finite-difference call below overwrites the gradients.
  std::vector<std::vector<float>> analytic;
  for (std::size_t v = 0; v < model.variables().size(); ++v) {
    analytic.emplace_back(model.gradient(v).begin(), model.gradient(v).end());
  }

  constexpr double kAbsTol = 5e-5;
  constexpr double kRelTol = 2e-3;
  double largest = 0.0;
  std::size_t checked = 0;
  for (std::size_t v = 0; v < model.variables().size(); ++v) {
    const std::span<float> params = model.parameter(v);
    for (std::size_t j = 0; j < params.size(); ++j) {
      const float saved = params[j];
      params[j] = saved + kEps;
      const double plus = model.compute_gradients(data.batch());
      params[j] = saved - kEps;
      const double minus = model.compute_gradients(data.batch());
      params[j] = saved;
      const double numeric = (plus - minus) / (2.0 * static_cast<double>(kEps));
      const double a = analytic[v][j];
      INFO(model.variables()[v].name, "[", j, "]: analytic ", a, ", numeric ", numeric);
      CHECK(std::abs(a - numeric) <= kAbsTol + kRelTol * std::max(std::abs(a), std::abs(numeric)));
      largest = std::max(largest, std::abs(a));
      ++checked;
    }
  }
  std::size_t expected = 0;
  for (const auto& spec : model.variables()) expected += spec.size();
  CHECK(checked == expected);
  // The tolerance is meaningful only if gradients are far above it.
  CHECK(largest > 50 * kAbsTol);
}

}  // namespace

TEST_CASE("Mlp declares dense_k/kernel and dense_k/bias in order") {
  Mlp model({784, 128, 10});
  const auto vars = model.variables();
  REQUIRE(vars.size() == 4);
  CHECK(vars[0].name == "dense_0/kernel");
  CHECK(vars[0].shape == std::vector<std::size_t>{784, 128});
  CHECK(vars[0].initializer == pulley::Initializer::glorot_uniform());
  CHECK(vars[1].name == "dense_0/bias");
  CHECK(vars[1].shape == std::vector<std::size_t>{128});
  CHECK(vars[1].initializer == pulley::Initializer::zeros());
  CHECK(vars[2].name == "dense_1/kernel");
  CHECK(vars[2].shape == std::vector<std::size_t>{128, 10});
  CHECK(vars[3].name == "dense_1/bias");
  CHECK(vars[3].shape == std::vector<std::size_t>{10});
  for (std::size_t i = 0; i < vars.size(); ++i) {
    CHECK(model.parameter(i).size() == vars[i].size());
    CHECK(model.gradient(i).size() == vars[i].size());
  }
  CHECK(model.input_size() == 784);
  CHECK(model.num_classes() == 10);
  CHECK_THROWS_AS((void)model.parameter(4), std::out_of_range);
  CHECK_THROWS_AS((void)model.gradient(4), std::out_of_range);
}

TEST_CASE("Mlp::initialize follows each variable's initializer, deterministically") {
  Mlp a({6, 5, 3});
  Mlp b({6, 5, 3});
  a.initialize(42);
  b.initialize(42);
  const double limit = std::sqrt(6.0 / (6 + 5));
  bool any_nonzero = false;
  for (float w : a.parameter(0)) {
    CHECK(std::abs(w) <= limit);
    any_nonzero = any_nonzero || w != 0.0F;
  }
  CHECK(any_nonzero);
  for (float w : a.parameter(1)) CHECK(w == 0.0F);
  for (std::size_t i = 0; i < a.variables().size(); ++i) {
    CHECK(std::ranges::equal(a.parameter(i), b.parameter(i)));
  }
  b.initialize(43);
  CHECK_FALSE(std::ranges::equal(a.parameter(0), b.parameter(0)));
}

TEST_CASE("Mlp parameter and gradient buffers never move") {
  Mlp model = random_model({5, 4, 3}, 1);
  std::vector<const float*> params;
  std::vector<const float*> grads;
  for (std::size_t i = 0; i < model.variables().size(); ++i) {
    params.push_back(model.parameter(i).data());
    grads.push_back(model.gradient(i).data());
  }
  for (std::size_t rows : {3, 50, 1, 700}) {
    const Data data = make_data(rows, 5, 3, rows);
    model.compute_gradients(data.batch());
    (void)model.evaluate(data.batch());
  }
  const Mlp moved = std::move(model);
  for (std::size_t i = 0; i < moved.variables().size(); ++i) {
    CHECK(moved.parameter(i).data() == params[i]);
    CHECK(moved.gradient(i).data() == grads[i]);
  }
}

TEST_CASE("Mlp loss matches a naive double-precision forward pass") {
  for (const auto& sizes : std::vector<std::vector<std::size_t>>{{5, 4, 3}, {3, 2}, {4, 6, 5, 2}}) {
    CAPTURE(sizes.size());
    Mlp model = random_model(sizes, 11);
    const Data data = make_data(9, sizes.front(), sizes.back(), 12);
    const double expected = reference_loss(model, data);
    CHECK(model.compute_gradients(data.batch()) == doctest::Approx(expected).epsilon(1e-5));
    CHECK(model.evaluate(data.batch()).loss == doctest::Approx(expected).epsilon(1e-5));
  }
}

TEST_CASE("Mlp gradients match central finite differences") {
  SUBCASE("{5, 4, 3}, batch of 7") { check_gradients({5, 4, 3}, 7, 3); }
  SUBCASE("no hidden layer, batch of 1") { check_gradients({3, 4}, 1, 5); }
  SUBCASE("two hidden layers, batch of 4") { check_gradients({4, 6, 5, 3}, 4, 7); }
}

TEST_CASE("Mlp gradients are of the mean loss, independent of the batch size") {
  // Repeating a batch leaves the mean loss, and so its gradient, unchanged.
  Mlp model = random_model({5, 4, 3}, 21);
  const Data once = make_data(6, 5, 3, 22);
  Data twice = once;
  twice.features.insert(twice.features.end(), once.features.begin(), once.features.end());
  twice.labels.insert(twice.labels.end(), once.labels.begin(), once.labels.end());

  const float loss_once = model.compute_gradients(once.batch());
  std::vector<std::vector<float>> grads_once;
  for (std::size_t i = 0; i < model.variables().size(); ++i) {
    grads_once.emplace_back(model.gradient(i).begin(), model.gradient(i).end());
  }
  const float loss_twice = model.compute_gradients(twice.batch());
  CHECK(loss_twice == doctest::Approx(loss_once).epsilon(1e-6));
  for (std::size_t i = 0; i < model.variables().size(); ++i) {
    const auto g = model.gradient(i);
    for (std::size_t j = 0; j < g.size(); ++j) {
      CHECK(g[j] == doctest::Approx(grads_once[i][j]).epsilon(1e-5).scale(1e-6));
    }
  }
}

TEST_CASE("Mlp plain SGD drives the loss down on a separable problem") {
  // Three clusters around 2·e_c in 4-D with ±0.5 noise: linearly separable with a margin.
  constexpr std::size_t kRows = 60;
  constexpr std::size_t kInputs = 4;
  pulley::SplitMix64 rng(99);
  Data data;
  for (std::size_t r = 0; r < kRows; ++r) {
    const std::size_t c = r % 3;
    for (std::size_t i = 0; i < kInputs; ++i) {
      const double center = (i == c) ? 2.0 : 0.0;
      data.features.push_back(static_cast<float>(center + rng.uniform() - 0.5));
    }
    data.labels.push_back(static_cast<std::int32_t>(c));
  }
  Mlp model({kInputs, 8, 3});
  model.initialize(5);

  const Mlp::Evaluation before = model.evaluate(data.batch());
  constexpr float kLearningRate = 0.5F;
  float first = 0.0F;
  float last = 0.0F;
  for (int step = 0; step < 100; ++step) {
    last = model.compute_gradients(data.batch());
    if (step == 0) first = last;
    for (std::size_t i = 0; i < model.variables().size(); ++i) {
      const auto w = model.parameter(i);
      const auto g = model.gradient(i);
      for (std::size_t j = 0; j < w.size(); ++j) w[j] -= kLearningRate * g[j];
    }
  }
  const Mlp::Evaluation after = model.evaluate(data.batch());
  CHECK(first == doctest::Approx(before.loss).epsilon(1e-6));
  CHECK(last < 0.2F * first);
  CHECK(after.loss < 0.2 * before.loss);
  CHECK(after.accuracy == 1.0);
  CHECK(after.examples == kRows);
}

TEST_CASE("Mlp::evaluate counts arg-max hits and averages the loss") {
  // One dense layer, 2 inputs → 3 classes, with hand-set weights:
  //   logits = [x0 + 0, x1 + 0, -x0 + 0.5]
  Mlp model({2, 3});
  const std::vector<float> kernel = {1.0F, 0.0F, -1.0F,  //
                                     0.0F, 1.0F, 0.0F};
  const std::vector<float> bias = {0.0F, 0.0F, 0.5F};
  std::ranges::copy(kernel, model.parameter(0).begin());
  std::ranges::copy(bias, model.parameter(1).begin());

  // Row logits and arg-max:  (2,0)→[2,0,-1.5]:0  (0,2)→[0,2,0.5]:1
  //                          (-1,0)→[-1,0,1.5]:2  (0,-3)→[0,-3,0.5]:2
  const std::vector<float> features = {2, 0, 0, 2, -1, 0, 0, -3};
  const std::vector<std::int32_t> labels = {0, 1, 0, 2};  // row 2 is wrong
  const std::vector<std::vector<double>> logits = {
      {2, 0, -1.5}, {0, 2, 0.5}, {-1, 0, 1.5}, {0, -3, 0.5}};
  double expected_loss = 0.0;
  for (std::size_t r = 0; r < logits.size(); ++r) {
    double sum = 0.0;
    for (double z : logits[r]) sum += std::exp(z);
    expected_loss += std::log(sum) - logits[r][static_cast<std::size_t>(labels[r])];
  }
  expected_loss /= 4.0;

  const Mlp::Evaluation e = model.evaluate({features, labels});
  CHECK(e.examples == 4);
  CHECK(e.accuracy == 0.75);
  CHECK(e.loss == doctest::Approx(expected_loss).epsilon(1e-6));

  SUBCASE("logits far beyond exp's float range stay finite") {
    // ×100: logits in the hundreds, where exp overflows a float unless the max is subtracted.
    std::vector<float> scaled = features;
    for (float& f : scaled) f *= 100.0F;
    double expected = 0.0;
    for (std::size_t r = 0; r < logits.size(); ++r) {
      std::vector<double> z(3);
      for (std::size_t o = 0; o < 3; ++o) {
        z[o] = bias[o] + scaled[2 * r] * kernel[o] + scaled[2 * r + 1] * kernel[3 + o];
      }
      const double max = *std::ranges::max_element(z);
      double sum = 0.0;
      for (double v : z) sum += std::exp(v - max);
      expected += max + std::log(sum) - z[static_cast<std::size_t>(labels[r])];
    }
    expected /= 4.0;
    const Mlp::Evaluation big = model.evaluate({scaled, labels});
    CHECK(big.loss == doctest::Approx(expected).epsilon(1e-5));
    CHECK(std::isfinite(model.compute_gradients({scaled, labels})));
    for (std::size_t i = 0; i < model.variables().size(); ++i) {
      for (float g : model.gradient(i)) CHECK(std::isfinite(g));
    }
  }

  SUBCASE("a batch larger than one evaluation chunk gives the same answer") {
    std::vector<float> many_features;
    std::vector<std::int32_t> many_labels;
    for (int copy = 0; copy < 1001; ++copy) {  // 4004 rows: several chunks and a remainder
      many_features.insert(many_features.end(), features.begin(), features.end());
      many_labels.insert(many_labels.end(), labels.begin(), labels.end());
    }
    many_labels[1] = 2;  // one more miss: (0,2) predicts 1
    const Mlp::Evaluation big = model.evaluate({many_features, many_labels});
    CHECK(big.examples == 4004);
    CHECK(big.accuracy == doctest::Approx((3.0 * 1001 - 1) / 4004.0).epsilon(1e-12));
  }
}

TEST_CASE("Mlp rejects bad layer sizes and malformed batches") {
  CHECK_THROWS_AS(Mlp({}), std::invalid_argument);
  CHECK_THROWS_AS(Mlp({784}), std::invalid_argument);
  CHECK_THROWS_AS(Mlp({784, 0, 10}), std::invalid_argument);
  CHECK_THROWS_AS(Mlp({0, 10}), std::invalid_argument);
  CHECK_THROWS_AS(Mlp({784, 128, 0}), std::invalid_argument);

  Mlp model({3, 4, 2});
  model.initialize(1);
  const std::vector<float> six = {1, 2, 3, 4, 5, 6};
  const std::vector<float> five = {1, 2, 3, 4, 5};
  const std::vector<std::int32_t> two_labels = {0, 1};
  const std::vector<std::int32_t> three_labels = {0, 1, 1};

  CHECK_NOTHROW(model.compute_gradients({six, two_labels}));
  CHECK_THROWS_WITH_AS(model.compute_gradients({five, two_labels}),
                       doctest::Contains("feature values"), std::invalid_argument);
  CHECK_THROWS_AS(model.compute_gradients({six, three_labels}), std::invalid_argument);
  CHECK_THROWS_AS(model.evaluate({five, two_labels}), std::invalid_argument);
  CHECK_THROWS_AS(model.compute_gradients({{}, {}}), std::invalid_argument);

  for (std::int32_t bad : {-1, 2, 1000}) {
    const std::vector<std::int32_t> labels = {0, bad};
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(model.compute_gradients({six, labels}), doctest::Contains("label"),
                         std::invalid_argument);
    CHECK_THROWS_AS(model.evaluate({six, labels}), std::invalid_argument);
  }
}
