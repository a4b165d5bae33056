// SPDX-License-Identifier: MIT
// Each optimizer against values worked out by hand from its update formula.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <random>
#include <vector>

#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/sgd.hpp"

namespace {

// Applies `optimizer` twice to w = {1, -2} with gradients {0.5, -0.25}, then {0.5, 1.0}.
template <class O>
std::vector<std::vector<float>> two_steps(const O& optimizer) {
  std::vector<float> w{1.0F, -2.0F};
  auto state = optimizer.make_state(w.size());
  std::vector<std::vector<float>> out;
  const std::vector<float> g1{0.5F, -0.25F};
  const std::vector<float> g2{0.5F, 1.0F};
  optimizer.apply(state, w, g1);
  out.push_back(w);
  optimizer.apply(state, w, g2);
  out.push_back(w);
  return out;
}

}  // namespace

TEST_CASE("Sgd: w -= lr * g") {
  const auto w = two_steps(pulley::Sgd{0.1F});
  CHECK(w[0][0] == doctest::Approx(0.95));    // 1 - 0.1*0.5
  CHECK(w[0][1] == doctest::Approx(-1.975));  // -2 + 0.1*0.25
  CHECK(w[1][0] == doctest::Approx(0.90));
  CHECK(w[1][1] == doctest::Approx(-2.075));
}

TEST_CASE("Momentum: accumulation = mu*accumulation + g, then w -= lr*accumulation") {
  const auto w = two_steps(pulley::Momentum{0.1F, 0.9F, false});
  CHECK(w[0][0] == doctest::Approx(0.95));     // acc 0.5
  CHECK(w[1][0] == doctest::Approx(0.855));    // acc 0.95 -> 0.95 - 0.095
  CHECK(w[0][1] == doctest::Approx(-1.975));   // acc -0.25
  CHECK(w[1][1] == doctest::Approx(-2.0525));  // acc 0.775 -> -1.975 - 0.0775
}

TEST_CASE("Momentum with Nesterov: w -= lr*(g + mu*accumulation)") {
  const auto w = two_steps(pulley::Momentum{0.1F, 0.9F, true});
  CHECK(w[0][0] == doctest::Approx(0.905));     // 1 - 0.1*(0.5 + 0.45)
  CHECK(w[1][0] == doctest::Approx(0.7695));    // acc 0.95: 0.905 - 0.1*(0.5 + 0.855)
  CHECK(w[0][1] == doctest::Approx(-1.9525));   // -2 - 0.1*(-0.25 - 0.225)
  CHECK(w[1][1] == doctest::Approx(-2.12225));  // acc 0.775: -1.9525 - 0.1*(1 + 0.6975)
}

TEST_CASE("Adagrad: accumulator += g^2, then w -= lr*g/(sqrt(accumulator)+eps)") {
  const auto w = two_steps(pulley::Adagrad{0.1F, 0.1F, 1e-7F});
  // step 1: acc = 0.1 + 0.25 = 0.35, sqrt = 0.5916080; w0 = 1 - 0.05/0.5916080
  CHECK(w[0][0] == doctest::Approx(0.9154846).epsilon(1e-6));
  // acc1 = 0.1 + 0.0625 = 0.1625, sqrt = 0.4031129; w1 = -2 + 0.025/0.4031129
  CHECK(w[0][1] == doctest::Approx(-1.9379826).epsilon(1e-6));
  // step 2: acc = 0.6, sqrt = 0.7745967; w0 = 0.9154846 - 0.05/0.7745967
  CHECK(w[1][0] == doctest::Approx(0.8509348).epsilon(1e-6));
  // acc1 = 1.1625, sqrt = 1.0781929; w1 = -1.9379826 - 0.1/1.0781929
  CHECK(w[1][1] == doctest::Approx(-2.0307294).epsilon(1e-6));
}

TEST_CASE("Adam: bias correction folded into the step size, as TensorFlow does") {
  const auto w = two_steps(pulley::Adam{0.1F, 0.9F, 0.999F, 1e-7F});
  // t=1: lr_t = 0.1*sqrt(0.001)/0.1 = 0.0316228; m = 0.05, v = 0.00025, sqrt(v) = 0.0158114
  //      w0 = 1 - 0.0316228*0.05/0.0158115 = 0.9000002 (eps shifts the 7th digit)
  CHECK(w[0][0] == doctest::Approx(0.9).epsilon(1e-5));
  CHECK(w[0][1] == doctest::Approx(-1.9).epsilon(1e-5));  // sign flips, same magnitude
  // t=2: lr_t = 0.1*sqrt(1-0.998001)/(1-0.81) = 0.1*0.0447102/0.19 = 0.0235317
  //      m0 = 0.9*0.05 + 0.05 = 0.095; v0 = 0.999*0.00025 + 0.00025 = 0.00049975
  //      w0 = 0.9 - 0.0235317*0.095/0.0223551 = 0.9 - 0.1000000 = 0.8
  CHECK(w[1][0] == doctest::Approx(0.8).epsilon(1e-5));
  //      m1 = 0.9*(-0.025) + 0.1 = 0.0775; v1 = 0.999*0.0000625 + 0.001 = 0.0010624
  //      w1 = -1.9 - 0.0235317*0.0775/0.0325947 = -1.9 - 0.0559512 = -1.9559512
  CHECK(w[1][1] == doctest::Approx(-1.9559512).epsilon(1e-5));
}

TEST_CASE("optimizer state is per part: two parts updated independently stay independent") {
  const pulley::Adam adam{};
  std::vector<float> a{1.0F}, b{1.0F};
  auto sa = adam.make_state(1);
  auto sb = adam.make_state(1);
  const std::vector<float> g{1.0F};
  adam.apply(sa, a, g);
  adam.apply(sa, a, g);
  adam.apply(sb, b, g);
  CHECK(sa.t == 2);
  CHECK(sb.t == 1);
  CHECK(a[0] < b[0]);
}

namespace {

/// Applies `optimizer` to copies and says whether every weight and slot stayed finite.
template <class O>
bool apply_stays_finite(const O& optimizer, const typename O::State& state, std::vector<float> w,
                        const std::vector<float>& g) {
  auto s = state;
  optimizer.apply(s, w, g);
  bool finite = std::all_of(w.begin(), w.end(), [](float x) { return std::isfinite(x); });
  if constexpr (requires { s.m; }) {
    for (const auto* slot : {&s.m, &s.v}) {
      finite = finite && std::all_of(slot->begin(), slot->end(), [](float x) { return std::isfinite(x); });
    }
  } else if constexpr (requires { s.accumulation; }) {
    finite = finite && std::all_of(s.accumulation.begin(), s.accumulation.end(),
                                   [](float x) { return std::isfinite(x); });
  } else if constexpr (requires { s.accumulator; }) {
    finite = finite && std::all_of(s.accumulator.begin(), s.accumulator.end(),
                                   [](float x) { return std::isfinite(x); });
  }
  return finite;
}

/// stays_finite is never optimistic (true only when apply stays finite), and says true for
/// every gradient of an everyday size.
template <class O>
void check_prediction(const O& optimizer) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(-1.0F, 1.0F);
  const float scales[] = {0.0F, 1e-3F, 1.0F, 1e3F, 1e18F, 1e19F, 1e20F, 1e30F, 1e36F, 1e37F, 1e38F,
                          3e38F};
  int refused = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const float wscale = scales[static_cast<std::size_t>(trial) % std::size(scales)];
    const float gscale = scales[static_cast<std::size_t>(trial / 12) % std::size(scales)];
    std::vector<float> w(8), g(8);
    for (float& x : w) x = unit(rng) * wscale;
    for (float& x : g) x = unit(rng) * gscale;
    auto state = optimizer.make_state(w.size());
    if (trial % 3 == 1) optimizer.apply(state, w, g);  // a state that saw a gradient already
    const bool predicted = optimizer.stays_finite(state, w, g);
    CAPTURE(trial);
    if (predicted) CHECK(apply_stays_finite(optimizer, state, w, g));
    if (wscale <= 1e3F && gscale <= 1e3F) CHECK(predicted);  // no refusal of real gradients
    refused += predicted ? 0 : 1;
  }
  CHECK(refused > 0);  // the extremes were tried
}

}  // namespace

TEST_CASE("each stock optimizer predicts finiteness: never optimistic, never in the way") {
  check_prediction(pulley::Sgd{0.1F});
  check_prediction(pulley::Momentum{0.1F, 0.9F, false});
  check_prediction(pulley::Momentum{0.1F, 0.9F, true});
  check_prediction(pulley::Adagrad{0.1F});
  check_prediction(pulley::Adam{0.01F});
  // Adam refuses a gradient whose square overflows its second moment, as a finite weight
  // update would hide it (every parameter would freeze).
  const pulley::Adam adam{0.001F};
  const std::vector<float> w{1.0F}, g{3e38F};
  CHECK_FALSE(adam.stays_finite(adam.make_state(1), w, g));
}
