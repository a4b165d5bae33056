// SPDX-License-Identifier: MIT
#pragma once

// Waiting for an event in a test, never for a time.

#include <chrono>
#include <thread>

namespace pulley::testing {

/// Polls `done` every 10 ms until it returns true (then true) or `limit` passed (then
/// false): a test waits for what it checks next, bounded, and checks that it came.
template <class Predicate>
bool wait_until(Predicate done, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace pulley::testing
