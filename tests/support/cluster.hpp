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
  /// `joinable`: ps tasks beyond the `num_ps` that `start_ps` may serve later, to join.
  Cluster(std::uint32_t num_ps, O optimizer, P sync, S sharding = {},
          std::chrono::milliseconds worker_timeout = std::chrono::seconds(5), std::uint32_t joinable = 0)
      : network_(num_ps, joinable), num_ps_(num_ps), optimizer_(optimizer), sync_(sync), sharding_(sharding),
        worker_timeout_(worker_timeout) {
    for (std::uint32_t i = 0; i < num_ps; ++i) start_ps(i);
  }

  /// Serves a fresh ps task `task` (its cluster: tasks 0 .. task).
  void start_ps(std::uint32_t task) {
    ParameterServer<S, O, P> ps(task, task + 1 > num_ps_ ? task + 1 : num_ps_, optimizer_, sync_, sharding_);
    ps.set_worker_timeout(worker_timeout_);
    network_.serve(std::move(ps));
  }

  InProcessNetwork& network() { return network_; }
  InProcess endpoint(Node self) { return InProcess(network_, self); }

 private:
  InProcessNetwork network_;
  std::uint32_t num_ps_;  ///< the cluster spec's ps tasks
  O optimizer_;
  P sync_;
  S sharding_;
  std::chrono::milliseconds worker_timeout_;
};

}  // namespace pulley::testing
