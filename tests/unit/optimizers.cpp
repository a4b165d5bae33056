// SPDX-License-Identifier: MIT
// Each optimizer against values worked out by hand from its update formula.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "pulley/core/detail/lanes.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/rmsprop.hpp"
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

TEST_CASE("every stock optimizer computes every element as the scalar rule does, bit for bit") {
  // Their updates run a vector of lanes at a time where the standard library has
  // std::experimental::simd (detail::lanewise_ordinary). 2 051 elements: whole vectors and
  // a short tail of 3, less than a vector of any width (the padded tail). The references
  // below are the rules as plain loops. Where the target fuses a multiply and an add
  // (__FP_FAST_FMAF: -march=native, aarch64) the compiler may fuse either side's, so there
  // an element may differ in its last bits.
  MESSAGE("vector lanes: " << (pulley::detail::kVectorLanes ? "yes" : "no (the plain loop)"));
  constexpr std::size_t n = 2051;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_real_distribution<float> positive(0.0F, 2.0F);
  const auto draw = [&](auto& distribution) {
    std::vector<float> v(n);
    for (float& x : v) x = distribution(rng);
    return v;
  };
  const std::vector<float> w0 = draw(normal), g = draw(normal), s0 = draw(positive), s1 = draw(normal);
  const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
#if defined(__FP_FAST_FMAF)
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (std::abs(a[i] - b[i]) > 4e-7F * std::max(std::abs(a[i]), std::abs(b[i]))) return false;
    }
    return true;
#else
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
#endif
  };

  SUBCASE("Sgd") {
    const pulley::Sgd sgd{0.1F};
    auto state = sgd.make_state(n);
    std::vector<float> applied = w0, w = w0;
    sgd.apply(state, applied, g);
    for (std::size_t i = 0; i < n; ++i) w[i] -= 0.1F * g[i];
    CHECK(same_bits(applied, w));
  }
  SUBCASE("Momentum, plain and Nesterov") {
    for (const bool nesterov : {false, true}) {
      const pulley::Momentum momentum{0.1F, 0.9F, nesterov};
      auto state = momentum.make_state(n);
      state.accumulation = s1;
      std::vector<float> applied = w0, w = w0, a = s1;
      momentum.apply(state, applied, g);
      for (std::size_t i = 0; i < n; ++i) {
        a[i] = 0.9F * a[i] + g[i];
        w[i] -= nesterov ? 0.1F * (g[i] + 0.9F * a[i]) : 0.1F * a[i];
      }
      CAPTURE(nesterov);
      CHECK(same_bits(state.accumulation, a));
      CHECK(same_bits(applied, w));
    }
  }
  SUBCASE("Adam") {
    const pulley::Adam adam{0.01F, 0.9F, 0.999F, 1e-7F};
    auto state = adam.make_state(n);
    state.m = s1;
    state.v = s0;
    state.t = 4;
    std::vector<float> applied = w0, w = w0, m = s1, v = s0;
    adam.apply(state, applied, g);
    const auto t = 5.0;
    const auto lr_t = static_cast<float>(0.01F * std::sqrt(1.0 - std::pow(double{0.999F}, t)) /
                                         (1.0 - std::pow(double{0.9F}, t)));
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = 0.9F * m[i] + (1.0F - 0.9F) * g[i];
      v[i] = 0.999F * v[i] + (1.0F - 0.999F) * g[i] * g[i];
      w[i] -= lr_t * m[i] / (std::sqrt(v[i]) + 1e-7F);
    }
    CHECK(same_bits(state.m, m));
    CHECK(same_bits(state.v, v));
    CHECK(same_bits(applied, w));
  }
  SUBCASE("Adagrad") {
    const pulley::Adagrad adagrad{0.1F, 0.1F, 1e-7F};
    auto state = adagrad.make_state(n);
    state.accumulator = s0;
    std::vector<float> applied = w0, w = w0, a = s0;
    adagrad.apply(state, applied, g);
    for (std::size_t i = 0; i < n; ++i) {
      a[i] += g[i] * g[i];
      w[i] -= 0.1F * g[i] / (std::sqrt(a[i]) + 1e-7F);
    }
    CHECK(same_bits(state.accumulator, a));
    CHECK(same_bits(applied, w));
  }
  SUBCASE("RMSProp with momentum") {
    const pulley::RmsProp rmsprop{.learning_rate = 0.01F, .rho = 0.9F, .momentum = 0.5F, .epsilon = 1e-7F};
    auto state = rmsprop.make_state(n);
    state.rms = s0;
    state.momentum = s1;
    std::vector<float> applied = w0, w = w0, ms = s0, mom = s1;
    rmsprop.apply(state, applied, g);
    for (std::size_t i = 0; i < n; ++i) {
      ms[i] = 0.9F * ms[i] + (1.0F - 0.9F) * g[i] * g[i];
      mom[i] = 0.5F * mom[i] + 0.01F * g[i] / std::sqrt(ms[i] + 1e-7F);
      w[i] -= mom[i];
    }
    CHECK(same_bits(state.rms, ms));
    CHECK(same_bits(state.momentum, mom));
    CHECK(same_bits(applied, w));
  }
  SUBCASE("FTRL with l1, l2, l2 shrinkage and beta (learning_rate_power -0.5: the vector lanes)") {
    const pulley::Ftrl ftrl{.learning_rate = 0.1F,
                            .l1_regularization_strength = 0.5F,
                            .l2_regularization_strength = 0.2F,
                            .l2_shrinkage_regularization_strength = 0.1F,
                            .beta = 0.3F};
    auto state = ftrl.make_state(n);
    state.accumulator = s0;
    state.linear = s1;
    state.linear[0] = 0.0F;   // sign 0
    state.linear[1] = 0.5F;   // |linear| at l1 (before this update's step)
    std::vector<float> applied = w0, w = w0, a = s0, lin = state.linear;
    ftrl.apply(state, applied, g);
    const float lr = 0.1F;
    const float two_l2_adj = 2.0F * (0.2F + 0.3F / (2.0F * lr));
    const float two_shrink = 2.0F * 0.1F;
    std::size_t zeroed = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const float g_shrink = g[i] + two_shrink * w[i];
      const float accum_new = a[i] + g[i] * g[i];
      const float root_new = std::sqrt(accum_new);
      lin[i] += g_shrink - (root_new - std::sqrt(a[i])) / lr * w[i];
      const float quadratic = root_new / lr + two_l2_adj;
      const float sign = lin[i] > 0.0F ? 1.0F : (lin[i] < 0.0F ? -1.0F : 0.0F);
      w[i] = std::abs(lin[i]) > 0.5F ? (sign * 0.5F - lin[i]) / quadratic : 0.0F;
      a[i] = accum_new;
      zeroed += w[i] == 0.0F ? 1 : 0;
    }
    CHECK(zeroed > 100);  // l1 zeroes many: both branches are taken
    CHECK(zeroed < n - 100);
    CHECK(same_bits(state.accumulator, a));
    CHECK(same_bits(state.linear, lin));
    CHECK(same_bits(applied, w));
  }
}

namespace {
/// `lanewise_ordinary`, or with `arithmetic` `arithmetic_lanewise_ordinary` (AVX2's copy of
/// the loop where this CPU has AVX2 and the build targets less), over two arrays.
template <std::size_t kSigned, class Rule>
bool judged(bool arithmetic, std::size_t begin, std::size_t end, const Rule& rule, const float* in,
            float* a, float* b) {
  return arithmetic
             ? pulley::detail::arithmetic_lanewise_ordinary<kSigned>(begin, end, rule, in, a, b)
             : pulley::detail::lanewise_ordinary<kSigned>(begin, end, rule, in, a, b);
}
}  // namespace

TEST_CASE(
    "lanewise_ordinary and its arithmetic form judge every value they wrote, in whole vectors and "
    "in the tail") {
  // Two rules: `copy` writes its input to both arrays, `flip` writes it to the first and its
  // negation to the second. The first array may hold any sign; the second must not be
  // negative (kSigned = 1), or may (kSigned = 2). One value of every kind at every place of
  // ranges of 1 to 40 elements (whole vectors of any width, every tail length) and of a few
  // longer ones (the loop of four vectors at a time, up to AVX-512's 64 floats, and what
  // follows it); the rest 0.25. The verdict is worked out here from the values' magnitudes
  // and sign bits. Both forms: `arithmetic_lanewise_ordinary` runs the loop a value at a
  // time, in AVX2's copy where this CPU has it (core/magnitude.hpp).
#if defined(PULLEY_DETAIL_AVX2_COPY)
  MESSAGE("AVX2's copy of the loops runs here: " << pulley::detail::kCpuHasAvx2);
#endif
  const float limit = pulley::kOrdinaryMagnitude;
  const float inf = std::numeric_limits<float>::infinity();
  const float kinds[] = {0.5F,   std::nextafter(limit, 0.0F), limit, -std::nextafter(limit, 0.0F), -limit, -1.0F,
                         std::numeric_limits<float>::quiet_NaN(), inf, -inf, -0.0F, 0.0F};
  const auto ordinary = [&](float x) { return std::abs(x) < limit; };  // false for NaN
  const auto not_negative = [&](float x) { return ordinary(x) && !std::signbit(x); };  // -0 is negative
  const auto copy = [](auto x, auto& a, auto& b) {
    a = x;
    b = x;
  };
  const auto flip = [](auto x, auto& a, auto& b) {
    a = x;
    b = -x;
  };
  std::vector<std::size_t> sizes(40);
  std::iota(sizes.begin(), sizes.end(), std::size_t{1});
  sizes.insert(sizes.end(), {63, 64, 65, 80, 81, 131});
  for (const bool arithmetic : {false, true}) {
    CAPTURE(arithmetic);
    for (const std::size_t n : sizes) {
      for (std::size_t at = 0; at < n; ++at) {
        for (const float kind : kinds) {
          std::vector<float> in(n, 0.25F), a(n), b(n);
          in[at] = kind;
          CAPTURE(n);
          CAPTURE(at);
          CAPTURE(kind);
          CHECK(judged<1>(arithmetic, 0, n, copy, in.data(), a.data(), b.data()) ==
                (ordinary(kind) && not_negative(kind)));
          CHECK(judged<2>(arithmetic, 0, n, copy, in.data(), a.data(), b.data()) == ordinary(kind));
          CHECK(std::memcmp(a.data(), in.data(), n * sizeof(float)) ==
                0);  // written as lanewise writes
          // The other 0.25s flip to -0.25: the second array is negative wherever n > 1.
          CHECK(judged<1>(arithmetic, 0, n, flip, in.data(), a.data(), b.data()) ==
                (n == 1 && ordinary(kind) && not_negative(-kind)));
          CHECK(judged<2>(arithmetic, 0, n, flip, in.data(), a.data(), b.data()) == ordinary(kind));
        }
      }
    }
    // A range that starts past 0 (begin) checks only its own elements.
    std::vector<float> in(20, 0.25F), a(20), b(20);
    in[2] = std::numeric_limits<float>::quiet_NaN();
    CHECK(judged<1>(arithmetic, 3, 20, copy, in.data(), a.data(), b.data()));
    CHECK_FALSE(judged<1>(arithmetic, 2, 20, copy, in.data(), a.data(), b.data()));
    // Only the second array negative, everywhere: flip of positives.
    std::vector<float> positive(33, 0.5F), a33(33), b33(33);
    CHECK_FALSE(judged<1>(arithmetic, 0, 33, flip, positive.data(), a33.data(), b33.data()));
    CHECK(judged<2>(arithmetic, 0, 33, flip, positive.data(), a33.data(), b33.data()));
  }
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

/// Applies `optimizer` to copies and says whether every weight and slot stayed finite, and
/// within kFiniteBound (what the stock optimizers' checks and proofs promise).
template <class O>
bool apply_stays_finite(const O& optimizer, const typename O::State& state, std::vector<float> w,
                        const std::vector<float>& g) {
  auto s = state;
  optimizer.apply(s, w, g);
  const auto within = [](float x) { return std::abs(x) <= pulley::kFiniteBound; };  // false for NaN
  bool all = std::all_of(w.begin(), w.end(), within);
  for (const pulley::OptimizerSlot& slot : pulley::slots_of(optimizer, s)) {
    all = all && std::all_of(slot.values.begin(), slot.values.end(), within);
  }
  return all;
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
  check_prediction(pulley::Ftrl{0.1F});
  check_prediction(pulley::Ftrl{.learning_rate = 0.1F,
                                .learning_rate_power = -0.25F,
                                .l1_regularization_strength = 0.01F,
                                .l2_regularization_strength = 0.1F,
                                .l2_shrinkage_regularization_strength = 0.1F,
                                .beta = 0.5F});
  check_prediction(pulley::RmsProp{0.1F});
  check_prediction(pulley::RmsProp{.learning_rate = 0.1F, .momentum = 0.9F});
  // Adam refuses a gradient whose square overflows its second moment, as a finite weight
  // update would hide it (every parameter would freeze).
  const pulley::Adam adam{0.001F};
  const std::vector<float> w{1.0F}, g{3e38F};
  CHECK_FALSE(adam.stays_finite(adam.make_state(1), w, g));
}

namespace {

/// The largest magnitude among `w` and the slots of `state` (+infinity if one is NaN).
template <class O>
float largest_held(const O& optimizer, typename O::State& state, const std::vector<float>& w) {
  float most = 0.0F;
  const auto fold = [&most](float x) { most = std::isnan(x) ? std::numeric_limits<float>::infinity() : std::max(most, std::abs(x)); };
  for (const float x : w) fold(x);
  for (const pulley::OptimizerSlot& slot : pulley::slots_of(optimizer, state)) {
    for (const float x : slot.values) fold(x);
  }
  return most;
}

/// apply_bounded does what apply does, bit for bit, and returns kOrdinaryMagnitude exactly
/// when every weight and slot it left is below it; stays_finite_given, from magnitudes
/// alone, is never optimistic and proves every update of an everyday size, and every update
/// from the only bounds a ps hands it, kOrdinaryMagnitude for the part and the gradient.
template <class O>
void check_magnitudes(const O& optimizer) {
  static_assert(pulley::BoundsMagnitudes<O>);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.0F, 1.0F);
  const float scales[] = {0.0F, 1e-3F, 1.0F, 1e3F, 1e18F, 1e19F, 1e30F, 1e36F, 1e37F, 1e38F, 3e38F};
  int unproven = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const float wscale = scales[static_cast<std::size_t>(trial) % std::size(scales)];
    const float gscale = scales[static_cast<std::size_t>(trial / 11) % std::size(scales)];
    std::vector<float> w(37), g(37);  // not a multiple of the 16 lanes
    for (float& x : w) x = unit(rng) * wscale;
    for (float& x : g) x = unit(rng) * gscale;
    auto state = optimizer.make_state(w.size());
    if (trial % 3 == 1) optimizer.apply(state, w, g);  // a state that saw a gradient already
    CAPTURE(trial);
    float gmax = 0.0F;
    for (const float x : g) gmax = std::max(gmax, std::abs(x));
    const bool proven = optimizer.stays_finite_given(state, largest_held(optimizer, state, w), gmax);
    if (proven) CHECK(apply_stays_finite(optimizer, state, w, g));
    if (wscale <= 1e3F && gscale <= 1e3F) CHECK(proven);
    unproven += proven ? 0 : 1;
    auto bounded_state = state;
    auto bounded_w = w;
    const float measured = optimizer.apply_bounded(bounded_state, bounded_w, g);
    optimizer.apply(state, w, g);
    CHECK(std::memcmp(bounded_w.data(), w.data(), w.size() * sizeof(float)) == 0);
    // Ordinary (below 2^60) or not known: +infinity for Inf and NaN alike.
    const float held = largest_held(optimizer, state, w);
    CHECK(measured == (held < pulley::kOrdinaryMagnitude ? pulley::kOrdinaryMagnitude : std::numeric_limits<float>::infinity()));
  }
  CHECK(unproven > 0);  // the extremes were tried
  auto fresh = optimizer.make_state(37);
  CHECK(optimizer.stays_finite_given(fresh, pulley::kOrdinaryMagnitude, pulley::kOrdinaryMagnitude));
  std::vector<float> w(37, 0.5F);
  const std::vector<float> g(37, -0.25F);
  optimizer.apply(fresh, w, g);
  CHECK(optimizer.stays_finite_given(fresh, pulley::kOrdinaryMagnitude, pulley::kOrdinaryMagnitude));
}

}  // namespace

namespace {

/// A rule of its own on Sgd's base: Sgd's apply_bounded does not measure what it writes.
struct SgdWithOwnRule : pulley::Sgd {
  void apply(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= 1e30F * g[i];
  }
};
static_assert(!pulley::PredictsFiniteness<SgdWithOwnRule>);  // Sgd's check is not this rule's
static_assert(!pulley::BoundsMagnitudes<SgdWithOwnRule>);
/// Sgd with a check of its own: still Sgd's rule, so Sgd's bounds stand.
struct SgdWithOwnCheck : pulley::Sgd {
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w, std::span<const float> g) const {
    return w.size() < 1000 && pulley::Sgd::stays_finite(state, w, g);
  }
};
static_assert(pulley::PredictsFiniteness<SgdWithOwnCheck>);
static_assert(pulley::BoundsMagnitudes<SgdWithOwnCheck>);
/// A static apply, or one overloaded with the UpdateContext form: the check is taken at
/// its word (which class wrote it cannot be told), and the concepts still compile.
struct StaticApply {
  struct State {};
  [[nodiscard]] State make_state(std::size_t /*n*/) const { return {}; }
  static void apply(State& /*state*/, std::span<float> w, std::span<const float> g) {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= g[i];
  }
  [[nodiscard]] bool stays_finite(const State& /*state*/, std::span<const float> /*w*/, std::span<const float> /*g*/) const {
    return true;
  }
};
static_assert(pulley::PredictsFiniteness<StaticApply>);
static_assert(!pulley::BoundsMagnitudes<StaticApply>);
struct OverloadedApply : pulley::Sgd {
  using pulley::Sgd::apply;
  void apply(State& state, std::span<float> w, std::span<const float> g, const pulley::UpdateContext& /*context*/) const {
    pulley::Sgd::apply(state, w, g);
  }
};
static_assert(pulley::PredictsFiniteness<OverloadedApply>);
static_assert(!pulley::BoundsMagnitudes<OverloadedApply>);  // one apply, not an overload set
/// Sgd as it is, under another name: its apply and apply_bounded come together.
struct RenamedSgd : pulley::Sgd {};
static_assert(pulley::BoundsMagnitudes<RenamedSgd>);
/// A rule of its own with a bound of its own, but Sgd's proof: not taken as proven.
struct SgdWithOwnBound : pulley::Sgd {
  void apply(State& state, std::span<float> w, std::span<const float> g) const { (void)apply_bounded(state, w, g); }
  float apply_bounded(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= 1e30F * g[i];
    return std::numeric_limits<float>::infinity();
  }
};
static_assert(!pulley::BoundsMagnitudes<SgdWithOwnBound>);

}  // namespace

TEST_CASE("stock optimizers bound magnitudes: apply_bounded bounds what apply writes, the proof is never optimistic") {
  check_magnitudes(pulley::Sgd{0.1F});
  check_magnitudes(pulley::Momentum{0.1F, 0.9F, false});
  check_magnitudes(pulley::Momentum{0.1F, 0.9F, true});
  check_magnitudes(pulley::Adagrad{0.1F});
  check_magnitudes(pulley::Adam{0.01F});
  check_magnitudes(pulley::RmsProp{0.1F});
  check_magnitudes(pulley::RmsProp{.learning_rate = 0.1F, .momentum = 0.9F});
  check_magnitudes(pulley::Sgd{});  // the defaults, as Keras has them
  check_magnitudes(pulley::Momentum{});
  check_magnitudes(pulley::Adagrad{});
  check_magnitudes(pulley::Adam{});
  check_magnitudes(pulley::Adam{.beta_2 = 0.5F});
  check_magnitudes(pulley::RmsProp{});
  // A negative second moment or accumulator (a restore can set one) takes the square root
  // of a negative number: nothing is proven of it, and stays_finite refuses it.
  const pulley::Adam adam{0.001F};
  auto negative = adam.make_state(1);
  negative.v[0] = -1.0F;
  std::vector<float> w{1.0F};
  const std::vector<float> g{0.0F};
  CHECK_FALSE(adam.stays_finite(negative, w, g));
  auto measured = negative;
  CHECK(adam.apply_bounded(measured, w, g) == std::numeric_limits<float>::infinity());
  // RMSProp's mean square slightly below 0 with a zero gradient: its square root (of ms +
  // epsilon) and the weight stay finite, but the slot is negative: nothing is known.
  const pulley::RmsProp rms{0.1F};
  auto slightly = rms.make_state(3);
  for (float& ms : slightly.rms) ms = -rms.epsilon / 4;
  std::vector<float> w3(3, 1.0F);
  CHECK(rms.apply_bounded(slightly, w3, std::vector<float>(3, 0.0F)) == std::numeric_limits<float>::infinity());
  CHECK(std::isfinite(w3[0]));
  const pulley::Adagrad adagrad{0.1F};
  auto below = adagrad.make_state(1);
  below.accumulator[0] = -4.0F;
  CHECK_FALSE(adagrad.stays_finite(below, std::vector<float>{1.0F}, std::vector<float>{1.0F}));
  // Without epsilon, a zero accumulator (restored, say) and a zero gradient make 0/0: the
  // check works the update out, so it refuses that; the magnitudes prove nothing then.
  const pulley::Adagrad no_epsilon{0.1F, 0.1F, 0.0F};
  auto zero = no_epsilon.make_state(2);
  zero.accumulator[1] = 0.0F;
  const std::vector<float> w2{1.0F, 1.0F}, g2{1.0F, 0.0F};
  CHECK_FALSE(apply_stays_finite(no_epsilon, zero, w2, g2));
  CHECK_FALSE(no_epsilon.stays_finite(zero, w2, g2));
  CHECK_FALSE(no_epsilon.stays_finite_given(zero, 1.0F, 1.0F));
  CHECK(no_epsilon.stays_finite(zero, w2, std::vector<float>{1.0F, 1.0F}));
}

namespace {

/// Ftrl's proof from magnitudes holds of a part as its last apply_bounded left it (the
/// only parts a ps asks about): weights solved from slots that are ordinary, accumulators
/// not below initial_accumulator_value. States of every scale are made so (apply_bounded
/// with a zero gradient, the extremes of the bound among them: linear just under 2^60,
/// accumulators at the floor), then every gradient scale is tried: never optimistic, and
/// every update of an everyday size proven. (With an accumulator floor of 1e-6 and a
/// learning rate of 0.001, a weight of 2^59 is solved from ordinary slots, and a gradient
/// of 2^60 moves its linear past float's range: the proof must see the weight.)
void check_ftrl_magnitudes(const pulley::Ftrl& ftrl, bool proves_ordinary = true) {
  static_assert(pulley::BoundsMagnitudes<pulley::Ftrl>);
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> unit(-1.0F, 1.0F);
  const float below_ordinary = std::nextafter(pulley::kOrdinaryMagnitude, 0.0F);
  const float scales[] = {0.0F, 1e-3F, 1.0F, 1e3F, 0x1p59F, below_ordinary, 1e19F, 1e30F, 3e38F};
  int proven_count = 0;
  int unproven = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const float lscale = scales[static_cast<std::size_t>(trial) % std::size(scales)];
    const float gscale = scales[static_cast<std::size_t>(trial / 9) % std::size(scales)];
    const std::size_t n = 37;  // not a multiple of the lanes
    std::vector<float> w(n), g(n);
    auto state = ftrl.make_state(n);
    for (std::size_t i = 0; i < n; ++i) {
      w[i] = unit(rng);  // replaced by the solution from the slots (l2 shrinkage reads it first)
      state.linear[i] = i == 0 ? -lscale : unit(rng) * lscale;
      state.accumulator[i] =
          i <= 1 ? ftrl.initial_accumulator_value  // the largest weight linear allows
                 : ftrl.initial_accumulator_value + std::abs(unit(rng)) * std::min(lscale, 1e30F);
      g[i] = i == 2 ? gscale : unit(rng) * gscale;
    }
    CAPTURE(trial);
    if (ftrl.apply_bounded(state, w, std::vector<float>(n, 0.0F)) != pulley::kOrdinaryMagnitude) {
      CHECK(lscale > 1e18F);  // only slots beyond ordinary leave nothing known
      continue;
    }
    float gmax = 0.0F;
    for (const float x : g) gmax = std::max(gmax, std::abs(x));
    const bool proven = ftrl.stays_finite_given(state, pulley::kOrdinaryMagnitude, gmax);
    if (proven) CHECK(apply_stays_finite(ftrl, state, w, g));
    if (proven) CHECK(ftrl.stays_finite(state, w, g));
    if (gscale <= 1e3F) CHECK(proven);
    proven_count += proven ? 1 : 0;
    unproven += proven ? 0 : 1;
  }
  CHECK(proven_count > 100);
  CHECK(unproven > 0);  // the extremes were tried
  // What a ps hands it, the gradient ordinary too: proven unless the floor is tiny.
  CHECK(ftrl.stays_finite_given(ftrl.make_state(1), pulley::kOrdinaryMagnitude,
                                pulley::kOrdinaryMagnitude) == proves_ordinary);
}

}  // namespace

TEST_CASE(
    "Ftrl bounds magnitudes: each weight solved from its slots, accumulators at or above their "
    "start") {
  check_ftrl_magnitudes(pulley::Ftrl{});  // Keras' defaults
  check_ftrl_magnitudes(pulley::Ftrl{0.1F});
  check_ftrl_magnitudes(pulley::Ftrl{.learning_rate = 0.001F, .initial_accumulator_value = 1e-6F},
                        false);
  // A learning rate so small that g / lr overflows float before the weight scales it down.
  check_ftrl_magnitudes(pulley::Ftrl{.learning_rate = 1e-30F, .initial_accumulator_value = 1.0F},
                        false);
  check_ftrl_magnitudes(pulley::Ftrl{.learning_rate = 0.05F,
                                     .initial_accumulator_value = 0.01F,
                                     .l1_regularization_strength = 0.01F,
                                     .l2_regularization_strength = 0.1F,
                                     .l2_shrinkage_regularization_strength = 0.1F,
                                     .beta = 0.5F});
  const pulley::Ftrl ftrl{0.1F};
  const float inf = std::numeric_limits<float>::infinity();
  // An accumulator below its start (restored so): the weight's quotient is not bounded
  // away from 0, so nothing is known, though every value is ordinary.
  auto below = ftrl.make_state(3);
  below.accumulator[1] = ftrl.initial_accumulator_value / 2;
  std::vector<float> w(3, 0.5F);
  CHECK(ftrl.apply_bounded(below, w, std::vector<float>(3, 0.0F)) == inf);
  CHECK(std::isfinite(w[1]));
  // The bound is judged in the tail of the lanes too: one accumulator below, at each place.
  for (std::size_t at = 0; at < 37; ++at) {
    auto state = ftrl.make_state(37);
    std::vector<float> w37(37, 0.5F);
    state.accumulator[at] = -1.0F;
    CAPTURE(at);
    CHECK(ftrl.apply_bounded(state, w37, std::vector<float>(37, 1.0F)) ==
          inf);  // -1 + 1 = 0, below 0.1
  }
  auto ordinary = ftrl.make_state(37);
  std::vector<float> w37(37, 0.5F);
  CHECK(ftrl.apply_bounded(ordinary, w37, std::vector<float>(37, 1.0F)) ==
        pulley::kOrdinaryMagnitude);
  // No accumulator to start from and no L2: the quotient may be 0, nothing proven.
  const pulley::Ftrl from_zero{.learning_rate = 0.1F, .initial_accumulator_value = 0.0F};
  CHECK_FALSE(from_zero.stays_finite_given(from_zero.make_state(1), 1.0F, 1.0F));
  const pulley::Ftrl from_zero_l2{
      .learning_rate = 0.1F, .initial_accumulator_value = 0.0F, .l2_regularization_strength = 0.5F};
  CHECK(from_zero_l2.stays_finite_given(from_zero_l2.make_state(1), 1.0F, 1.0F));
  // Another power (std::pow, one element at a time): nothing proven, nothing measured.
  const pulley::Ftrl power{.learning_rate = 0.1F, .learning_rate_power = -0.25F};
  auto pstate = power.make_state(3);
  std::vector<float> pw(3, 0.5F);
  CHECK(power.apply_bounded(pstate, pw, std::vector<float>(3, 1.0F)) == inf);
  CHECK_FALSE(power.stays_finite_given(pstate, 1.0F, 1.0F));
}

TEST_CASE("Ftrl: linear and accumulator slots, the weight solved from them") {
  const auto w = two_steps(pulley::Ftrl{.learning_rate = 0.1F});
  // step 1, w0 = 1, g = 0.5: accum 0.1 -> 0.35, sqrt 0.3162278 -> 0.5916080
  //   linear = 0 + 0.5 - (0.5916080 - 0.3162278)/0.1*1 = 0.5 - 2.7538021 = -2.2538021
  //   quadratic = 0.5916080/0.1 = 5.9160798; w0 = 2.2538021/5.9160798
  CHECK(w[0][0] == doctest::Approx(0.3809621));
  // w1 = -2, g = -0.25: accum 0.1 -> 0.1625, sqrt 0.3162278 -> 0.4031129
  //   linear = -0.25 - (0.0868851/0.1)*(-2) = -0.25 + 1.7377024 = 1.4877024
  //   quadratic = 4.0311289; w1 = -1.4877024/4.0311289
  CHECK(w[0][1] == doctest::Approx(-0.3690536));
  // step 2, g = 0.5: accum 0.35 -> 0.6, sqrt -> 0.7745967
  //   linear = -2.2538021 + 0.5 - (0.1829887/0.1)*0.3809621 = -1.7538021 - 0.6971175
  //          = -2.4509197; quadratic = 7.7459667; w0 = 2.4509197/7.7459667
  CHECK(w[1][0] == doctest::Approx(0.3164124));
  // g = 1: accum 0.1625 -> 1.1625, sqrt -> 1.0781929
  //   linear = 1.4877024 + 1 - (0.6750800/0.1)*(-0.3690536) = 2.4877024 + 2.4914069
  //          = 4.9791093; quadratic = 10.7819293; w1 = -4.9791093/10.7819293
  CHECK(w[1][1] == doctest::Approx(-0.4618013));
}

TEST_CASE("Ftrl with l1: a weight whose |linear| is within l1 is exactly 0") {
  const auto w = two_steps(pulley::Ftrl{.learning_rate = 0.1F, .l1_regularization_strength = 2.0F});
  // step 1: linear and quadratic as without l1 (the old weight enters linear, not l1).
  //   w0: linear -2.2538021, |linear| > 2: w0 = (-2 + 2.2538021)/5.9160798
  CHECK(w[0][0] == doctest::Approx(0.0429004));
  //   w1: linear 1.4877024 <= 2: w1 = 0
  CHECK(w[0][1] == 0.0F);
  // step 2: linear0 = -2.2538021 + 0.5 - (0.1829887/0.1)*0.0429004 = -1.8323050, <= 2: 0
  CHECK(w[1][0] == 0.0F);
  //   linear1 = 1.4877024 + 1 - (...)*0 = 2.4877024 > 2: w1 = (2 - 2.4877024)/10.7819293
  CHECK(w[1][1] == doctest::Approx(-0.0452333));
}

TEST_CASE("Ftrl with l2 and beta: quadratic gains 2*(l2 + beta/(2*lr))") {
  // l2_adj = 0.5 + 0.1/(2*0.1) = 1, so quadratic = sqrt(accum_new)/0.1 + 2.
  const auto w = two_steps(
      pulley::Ftrl{.learning_rate = 0.1F, .l2_regularization_strength = 0.5F, .beta = 0.1F});
  // step 1: linear as without l2 (-2.2538021, 1.4877024); quadratic 7.9160798, 6.0311289
  CHECK(w[0][0] == doctest::Approx(0.2847119));   // 2.2538021/7.9160798
  CHECK(w[0][1] == doctest::Approx(-0.2466706));  // -1.4877024/6.0311289
  // step 2: linear0 = -2.2538021 + 0.5 - 1.8298871*0.2847119 = -1.7538021 - 0.5209906
  //   = -2.2747927; quadratic 7.7459667 + 2 = 9.7459667
  CHECK(w[1][0] == doctest::Approx(0.2334086));  // 2.2747927/9.7459667
  //   linear1 = 1.4877024 + 1 - 6.7508003*(-0.2466706) = 2.4877024 + 1.6652243 = 4.1529267
  //   quadratic 10.7819293 + 2 = 12.7819293
  CHECK(w[1][1] == doctest::Approx(-0.3249061));  // -4.1529267/12.7819293
}

TEST_CASE("Ftrl with learning_rate_power = -1 (std::pow) and l2 shrinkage") {
  // accum^(-p) = accum itself; g_shrink = g + 2*0.1*w.
  const auto w = two_steps(pulley::Ftrl{.learning_rate = 0.1F,
                                        .learning_rate_power = -1.0F,
                                        .l2_shrinkage_regularization_strength = 0.1F});
  // step 1, w0 = 1, g = 0.5: g_shrink = 0.5 + 0.2 = 0.7; accum 0.1 -> 0.35
  //   linear = 0.7 - (0.35 - 0.1)/0.1*1 = 0.7 - 2.5 = -1.8; quadratic = 0.35/0.1 = 3.5
  CHECK(w[0][0] == doctest::Approx(0.5142857));  // 1.8/3.5
  // w1 = -2, g = -0.25: g_shrink = -0.25 - 0.4 = -0.65; accum 0.1 -> 0.1625
  //   linear = -0.65 - (0.0625/0.1)*(-2) = -0.65 + 1.25 = 0.6; quadratic = 1.625
  CHECK(w[0][1] == doctest::Approx(-0.3692308));  // -0.6/1.625
  // step 2, g = 0.5: g_shrink = 0.5 + 0.2*0.5142857 = 0.6028571; accum 0.35 -> 0.6
  //   linear = -1.8 + 0.6028571 - 2.5*0.5142857 = -1.1971429 - 1.2857143 = -2.4828571
  //   quadratic = 6
  CHECK(w[1][0] == doctest::Approx(0.4138095));  // 2.4828571/6
  // g = 1: g_shrink = 1 - 0.2*0.3692308 = 0.9261538; accum 0.1625 -> 1.1625
  //   linear = 0.6 + 0.9261538 - 10*(-0.3692308) = 1.5261538 + 3.6923077 = 5.2184615
  //   quadratic = 11.625
  CHECK(w[1][1] == doctest::Approx(-0.4488999));  // -5.2184615/11.625
}

TEST_CASE("RmsProp: ms = rho*ms + (1-rho)*g^2, then w -= lr*g/sqrt(ms+eps)") {
  const auto w = two_steps(pulley::RmsProp{0.1F, 0.9F, 0.0F, 1e-7F});
  // step 1: ms0 = 0.1*0.25 = 0.025, sqrt(0.025 + 1e-7) = 0.1581142
  //   w0 = 1 - 0.1*0.5/0.1581142 = 1 - 0.3162271
  CHECK(w[0][0] == doctest::Approx(0.6837729));
  //   ms1 = 0.1*0.0625 = 0.00625, sqrt(ms1 + eps) = 0.0790576; w1 = -2 + 0.025/0.0790576
  CHECK(w[0][1] == doctest::Approx(-1.6837748));
  // step 2: ms0 = 0.9*0.025 + 0.025 = 0.0475, sqrt = 0.2179452
  //   w0 = 0.6837729 - 0.05/0.2179452 = 0.6837729 - 0.2294155
  CHECK(w[1][0] == doctest::Approx(0.4543574));
  //   ms1 = 0.9*0.00625 + 0.1 = 0.105625, sqrt = 0.3250002; w1 = -1.6837748 - 0.1/0.3250002
  CHECK(w[1][1] == doctest::Approx(-1.9914669));
}

TEST_CASE("RmsProp with momentum: mom = momentum*mom + lr*g/sqrt(ms+eps), w -= mom") {
  const auto w = two_steps(pulley::RmsProp{0.1F, 0.9F, 0.5F, 1e-7F});
  // step 1: mom starts at 0, so as without momentum (mom0 = 0.3162271, mom1 = -0.3162252)
  CHECK(w[0][0] == doctest::Approx(0.6837729));
  CHECK(w[0][1] == doctest::Approx(-1.6837748));
  // step 2: mom0 = 0.5*0.3162271 + 0.2294155 = 0.3875291; w0 = 0.6837729 - 0.3875291
  CHECK(w[1][0] == doctest::Approx(0.2962438));
  //   mom1 = 0.5*(-0.3162252) + 0.3076922 = 0.1495796; w1 = -1.6837748 - 0.1495796
  CHECK(w[1][1] == doctest::Approx(-1.8333543));
}

namespace {

/// Updates a row of dim 3 (slots from init_row, at updates 1 then 2) and a part of 3
/// elements (from make_state) with the same gradients, and checks that they hold the same
/// weights and slots, bit for bit, and that the row slots carry the dense slots' names.
template <pulley::RowWiseOptimizer O>
void check_row_matches_dense(const O& optimizer) {
  const std::vector<float> start{1.0F, -2.0F, 0.5F};
  const std::vector<std::vector<float>> gradients{{0.5F, -0.25F, 2.0F}, {0.5F, 1.0F, -0.75F}};
  const std::size_t dim = start.size();
  std::vector<float> dense = start;
  auto state = optimizer.make_state(dim);
  std::vector<float> row = start;
  // NaN where init_row must write: a slot it forgets shows up as a mismatch.
  std::vector<float> slots(O::kRowSlots * dim, std::numeric_limits<float>::quiet_NaN());
  optimizer.init_row(slots);
  const auto names = optimizer.row_slot_names();
  for (std::size_t u = 0; u < gradients.size(); ++u) {
    CAPTURE(u);
    optimizer.apply(state, dense, gradients[u]);
    pulley::RowContext context;
    context.global_step = static_cast<std::int64_t>(u);
    context.updates = static_cast<std::int64_t>(u + 1);  // Adam: the dense part's t
    context.table = "t";
    context.id = 42;
    optimizer.apply_row(row, slots, gradients[u], context);
    for (std::size_t i = 0; i < dim; ++i) CHECK(row[i] == dense[i]);
    const std::vector<pulley::OptimizerSlot> dense_slots = pulley::slots_of(optimizer, state);
    REQUIRE(dense_slots.size() == O::kRowSlots);
    for (std::size_t k = 0; k < O::kRowSlots; ++k) {
      CHECK(names[k] == dense_slots[k].name);
      for (std::size_t i = 0; i < dim; ++i) CHECK(slots[k * dim + i] == dense_slots[k].values[i]);
    }
  }
}

}  // namespace

TEST_CASE("apply_row on a row equals apply on a part, for every table optimizer") {
  check_row_matches_dense(pulley::Sgd{0.1F});
  check_row_matches_dense(pulley::Adagrad{0.1F});
  check_row_matches_dense(pulley::Adam{0.1F});
  check_row_matches_dense(pulley::Ftrl{.learning_rate = 0.1F,
                                       .l1_regularization_strength = 0.5F,
                                       .l2_regularization_strength = 0.1F,
                                       .l2_shrinkage_regularization_strength = 0.05F,
                                       .beta = 0.2F});
  check_row_matches_dense(pulley::Ftrl{.learning_rate = 0.1F, .learning_rate_power = -0.75F});
  check_row_matches_dense(pulley::RmsProp{0.1F});
  check_row_matches_dense(pulley::RmsProp{0.1F, 0.9F, 0.5F});
  // Momentum has no row form: it is the dense-only example (a table with it fails to
  // compile, see tests/compile_fail/table_optimizer_without_apply_row.cpp).
  static_assert(!pulley::RowWiseOptimizer<pulley::Momentum>);
}

TEST_CASE("Adam's apply_row is lazy: a row skipped at an update keeps its moments") {
  const pulley::Adam adam{0.1F, 0.9F, 0.999F, 1e-7F};
  std::vector<float> w{1.0F};
  std::vector<float> slots(2, 1.0F);
  adam.init_row(slots);
  CHECK(slots[0] == 0.0F);
  CHECK(slots[1] == 0.0F);
  const std::vector<float> g{0.5F};
  pulley::RowContext context;
  context.updates = 1;
  adam.apply_row(w, slots, g, context);
  // t=1: lr_t = 0.1*sqrt(1-0.999)/(1-0.9) = 0.0316228; m = 0.05, v = 0.00025
  //      w = 1 - 0.0316228*0.05/(0.0158114 + 1e-7) = 1 - 0.0999994 = 0.9000006
  CHECK(w[0] == doctest::Approx(0.9000006).epsilon(1e-6));
  context.updates = 3;  // the table's update 2 did not push this row
  adam.apply_row(w, slots, g, context);
  // t=3: lr_t = 0.1*sqrt(1-0.999^3)/(1-0.9^3) = 0.1*sqrt(0.002997001)/0.271
  //           = 0.1*0.0547449/0.271 = 0.0202011
  //      m = 0.9*0.05 + 0.1*0.5 = 0.095 and v = 0.999*0.00025 + 0.001*0.25 = 0.00049975:
  //      one decay each, none for update 2
  CHECK(slots[0] == doctest::Approx(0.095).epsilon(1e-6));
  CHECK(slots[1] == doctest::Approx(0.00049975).epsilon(1e-6));
  //      w = 0.9000006 - 0.0202011*0.095/(0.0223551 + 1e-7) = 0.9000006 - 0.0858459
  CHECK(w[0] == doctest::Approx(0.8141548).epsilon(1e-6));
  // A dense part given a zero gradient at update 2 decays its moments there (m 0.045,
  // v 0.00024975, w 0.8329952) and ends elsewhere: 0.8329952 - 0.0202011*0.0905/0.0223495.
  auto state = adam.make_state(1);
  std::vector<float> dense{1.0F};
  adam.apply(state, dense, g);
  adam.apply(state, dense, std::vector<float>{0.0F});
  adam.apply(state, dense, g);
  CHECK(dense[0] == doctest::Approx(0.7511953).epsilon(1e-6));
}

TEST_CASE("each stock optimizer's settings_error refuses what Keras refuses, naming the field and the value") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // The defaults are fine.
  CHECK_FALSE(pulley::Sgd{}.settings_error());
  CHECK_FALSE(pulley::Momentum{}.settings_error());
  CHECK_FALSE(pulley::Adagrad{}.settings_error());
  CHECK_FALSE(pulley::Adam{}.settings_error());
  CHECK_FALSE(pulley::Ftrl{}.settings_error());
  CHECK_FALSE(pulley::RmsProp{}.settings_error());
  const auto said = [](const auto& optimizer) { return optimizer.settings_error().value_or("(accepted)"); };
  CHECK(said(pulley::Sgd{nan}) == "learning_rate is nan: it must be a finite number of 0 or more");
  CHECK(said(pulley::Sgd{inf}) == "learning_rate is inf: it must be a finite number of 0 or more");
  CHECK(said(pulley::Sgd{-0.5F}) == "learning_rate is -0.5: it must be a finite number of 0 or more");
  CHECK_FALSE(pulley::Sgd{0.0F}.settings_error());  // 0 freezes the weights: allowed
  pulley::Ftrl ftrl0;
  ftrl0.learning_rate = 0.0F;  // FTRL divides by it
  CHECK(said(ftrl0) == "learning_rate is 0: it must be a finite number above 0");
  CHECK(said(pulley::Momentum{0.1F, 1.5F}) == "momentum is 1.5: it must be in [0, 1]");
  CHECK(said(pulley::Adagrad{0.1F, -0.1F}) == "initial_accumulator_value is -0.1: it must be a finite number of 0 or more");
  CHECK(said(pulley::Adagrad{0.1F, 0.0F, 0.0F}) ==
        "epsilon and initial_accumulator_value are both 0: a zero gradient would divide 0 by 0");
  CHECK_FALSE(pulley::Adagrad{0.1F, 0.0F, 1e-7F}.settings_error());
  pulley::Adam adam;
  adam.beta_1 = 1.0F;
  CHECK(said(adam) == "beta_1 is 1: it must be in [0, 1)");
  adam = pulley::Adam{};
  adam.epsilon = nan;
  CHECK(said(adam) == "epsilon is nan: it must be a finite number of 0 or more");
  pulley::Ftrl ftrl;
  ftrl.learning_rate_power = 0.5F;
  CHECK(said(ftrl) == "learning_rate_power is 0.5: it must be a finite number of 0 or less");
  ftrl = pulley::Ftrl{};
  ftrl.l1_regularization_strength = -1.0F;
  CHECK(said(ftrl) == "l1_regularization_strength is -1: it must be a finite number of 0 or more");
  pulley::RmsProp rms;
  rms.rho = -0.5F;
  CHECK(said(rms) == "rho is -0.5: it must be in [0, 1)");
  // The first field that fails is named.
  CHECK(said(pulley::Momentum{nan, 7.0F}) == "learning_rate is nan: it must be a finite number of 0 or more");
  // check_optimizer_settings throws it; an optimizer without settings_error is taken as it is.
  CHECK_THROWS_WITH_AS(pulley::check_optimizer_settings(pulley::Sgd{nan}, "dense"),
                       doctest::Contains("dense: learning_rate is nan: it must be a finite number of 0 or more"), pulley::Error);
  struct Plain {
    float learning_rate = std::numeric_limits<float>::quiet_NaN();
    struct State {};
    [[nodiscard]] State make_state(std::size_t) const { return {}; }
    void apply(State&, std::span<float>, std::span<const float>) const {}
  };
  static_assert(pulley::Optimizer<Plain>);
  CHECK_NOTHROW(pulley::check_optimizer_settings(Plain{}));
}
