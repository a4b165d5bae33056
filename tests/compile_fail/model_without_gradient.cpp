// expect: cmodel\.gradient\(i\)
// SPDX-License-Identifier: MIT
// A model without `gradient` is rejected by Worker, and the diagnostic names it.
#include "pulley/client/worker.hpp"
#include "pulley/transport/in_process.hpp"

struct ForgotGradient {
  struct Batch {};
  std::span<const pulley::VariableSpec> variables() const { return {}; }
  std::span<float> parameter(std::size_t) { return {}; }
  float compute_gradients(const Batch&) { return 0.0F; }
};

int main() {
  pulley::InProcessNetwork network(1);
  pulley::Worker<ForgotGradient, pulley::InProcess> w(
      0, {}, pulley::InProcess(network, pulley::Node::worker(0)));
}
