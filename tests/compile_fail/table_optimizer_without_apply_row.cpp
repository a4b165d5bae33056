// expect: O::kRowSlots
// SPDX-License-Identifier: MIT
// A dense-only optimizer (Momentum has no row form) is rejected where an embedding table
// needs a RowWiseOptimizer, and the diagnostic names the first row member it lacks.
#include "pulley/optimizers/momentum.hpp"

template <pulley::RowWiseOptimizer O>
void serve_table(const O& /*optimizer*/) {}

int main() { serve_table(pulley::Momentum{}); }
