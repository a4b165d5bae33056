// expect: transport\.call\(
// SPDX-License-Identifier: MIT
// A transport without `call` is rejected by Worker, and the diagnostic names it.
#include "pulley/client/worker.hpp"
#include "support/linear_model.hpp"

struct ForgotCall {
  std::size_t num_ps() const { return 1; }
};

int main() { pulley::Worker<pulley::testing::LinearModel, ForgotCall> w(0, {2, 2}, {}); }
