// expect: policy\.take\(acc\)
// SPDX-License-Identifier: MIT
// A sync policy without `take` is rejected, and the diagnostic names it.
#include "pulley/optimizers/sgd.hpp"
#include "pulley/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"

struct ForgotTake {
  struct Accumulator {};
  Accumulator make_accumulator(std::size_t) const { return {}; }
  pulley::Verdict accumulate(Accumulator&, std::span<const float>, std::int64_t) const {
    return pulley::Verdict::kReady;
  }
  std::int64_t step(const Accumulator&) const { return 0; }
  pulley::TokenRule token_rule() const { return {}; }
};

int main() {
  pulley::ParameterServer<pulley::RoundRobin, pulley::Sgd, ForgotTake> ps(0, 1, {}, {});
}
