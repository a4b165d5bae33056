// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>

namespace pulley {

/// Deadlines of a client's (worker's, chief's) requests. A request past its deadline fails
/// with `kDeadlineExceeded` and is cancelled: the transport no longer touches its buffers.
struct ClientOptions {
  /// For requests a ps answers at once (push, ungated pull, stats, initialize).
  std::chrono::milliseconds request_timeout{std::chrono::seconds(60)};
  /// For requests that wait on other tasks: readiness, sync tokens, step-gated pulls.
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(30)};
};

}  // namespace pulley
