// expect: policy\.take\(acc\)
// SPDX-License-Identifier: MIT
// A sync policy without `take` is rejected, and the diagnostic names it.
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"

struct ForgotTake {
  struct Accumulator {};
  struct Pacer {};
  Accumulator make_accumulator(std::size_t) const { return {}; }
  void accumulate(Accumulator&, std::span<const float>) const {}
  Pacer make_pacer() const { return {}; }
  pulley::Verdict on_push(Pacer&, std::uint32_t, std::int64_t) const {
    return pulley::Verdict::kReady;
  }
  std::int64_t global_step(const Pacer&) const { return 0; }
  std::optional<pulley::Token> take_token(Pacer&, std::uint32_t) const { return {}; }
};

int main() {
  pulley::ParameterServer<pulley::RoundRobin, pulley::Sgd, ForgotTake> ps(0, 1, {}, {});
}
