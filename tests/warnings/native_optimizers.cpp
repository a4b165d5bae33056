// SPDX-License-Identifier: MIT
// Compiled, never run (warnings.native_optimizers, warnings.avx_optimizers): every stock
// optimizer's update with the host's widest vectors (-march=native), or AVX's without AVX2
// (-mavx), and the optimizer on (-O2), where the compiler's middle-end warnings run, under
// -Werror. A user who builds for the host and treats warnings as errors must not have
// pulley's headers fail the build (GCC 12's AVX-512 square root warned in every caller of
// the vector lanes: core/detail/lanes.hpp; with -mavx the lanes' folds did not compile).
#include <cstddef>
#include <span>
#include <vector>

#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/rmsprop.hpp"
#include "pulley/optimizers/sgd.hpp"

namespace {

template <class O>
float dense_and_row(const O& optimizer, std::span<float> w, std::span<const float> g) {
  auto state = optimizer.make_state(w.size());
  float bound = optimizer.apply_bounded(state, w, g);
  if constexpr (pulley::RowWiseOptimizer<O>) {
    std::vector<float> slots(O::kRowSlots * w.size());
    pulley::RowContext context;
    context.updates = 1;
    optimizer.apply_row(w, slots, g, context);
  }
  return bound;
}

}  // namespace

float native_optimizers(std::span<float> w, std::span<const float> g) {
  return dense_and_row(pulley::Sgd{}, w, g) + dense_and_row(pulley::Momentum{}, w, g) +
         dense_and_row(pulley::Adagrad{}, w, g) + dense_and_row(pulley::Adam{}, w, g) +
         dense_and_row(pulley::RmsProp{}, w, g) + dense_and_row(pulley::Ftrl{}, w, g);
}
