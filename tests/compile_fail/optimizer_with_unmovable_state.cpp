// expect: movable<typename O::State>
// SPDX-License-Identifier: MIT
// An optimizer whose State cannot be moved is rejected: the ps keeps one per part in a
// vector, and the diagnostic names the requirement.
#include <mutex>

#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"

struct Locked {
  struct State {
    std::mutex guard;
  };
  State make_state(std::size_t) const { return {}; }
  void apply(State&, std::span<float>, std::span<const float>) const {}
};

int main() { pulley::ParameterServer<pulley::RoundRobin, Locked, pulley::Async> ps(0, 1, {}, {}); }
