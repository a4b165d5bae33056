// SPDX-License-Identifier: MIT
#pragma once

// An in-process cluster for tests: N ps tasks of one ParameterServer type, each served on a
// thread of its own.

#include <chrono>
#include <cstdint>

#include "pulley/ps/parameter_server.hpp"
#include "pulley/transport/in_process.hpp"

namespace pulley::testing {

template <class S, class O, class P>
class Cluster {
 public:
  Cluster(std::uint32_t num_ps, O optimizer, P sync, S sharding = {},
          std::chrono::milliseconds worker_timeout = std::chrono::seconds(5))
      : network_(num_ps) {
    for (std::uint32_t i = 0; i < num_ps; ++i) {
      ParameterServer<S, O, P> ps(i, num_ps, optimizer, sync, sharding);
      ps.set_worker_timeout(worker_timeout);
      network_.serve(std::move(ps));
    }
  }

  InProcessNetwork& network() { return network_; }
  InProcess endpoint(Node self) { return InProcess(network_, self); }

 private:
  InProcessNetwork network_;
};

}  // namespace pulley::testing
