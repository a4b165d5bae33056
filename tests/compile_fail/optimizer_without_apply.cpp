// expect: optimizer\.apply\(state, weights, gradient\)
// SPDX-License-Identifier: MIT
// An optimizer without `apply` is rejected, and the diagnostic names the missing member.
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"

struct ForgotApply {
  struct State {};
  State make_state(std::size_t) const { return {}; }
};

int main() {
  pulley::ParameterServer<pulley::RoundRobin, ForgotApply, pulley::Async> ps(0, 1, {}, {});
}
