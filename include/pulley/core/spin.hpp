// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace pulley {

namespace spin_detail {
inline std::atomic<std::int64_t>& microseconds() noexcept {
  static std::atomic<std::int64_t> spin{200};
  return spin;
}
}  // namespace spin_detail

/// How long a wait whose answer may come at any moment looks again before it sleeps, giving
/// its core away between looks (default 200 µs): a worker's wait for its push's answers,
/// either end of a shared-memory link, an all-reduce rank's wait for its neighbours. The
/// answer often comes within it (the other worker's push that completes a sync step, the
/// other process's bytes) and is then taken at once, where a sleep and its wake-up cost tens
/// of microseconds, more on a virtual machine whose idle core the host halted. The price is
/// up to this much of a core's time per wait, which any other thread that wants the core
/// gets first.
[[nodiscard]] inline std::chrono::microseconds spin_before_sleep() noexcept {
  return std::chrono::microseconds(spin_detail::microseconds().load(std::memory_order_relaxed));
}

/// Sets `spin_before_sleep` for every wait this process starts from now on; 0 (or less)
/// makes a wait sleep at once. Less suits a host with many more busy threads than cores,
/// whose waits then yield to each other; the runner's flag `--spin-us` sets it.
inline void set_spin_before_sleep(std::chrono::microseconds spin) noexcept {
  spin_detail::microseconds().store(std::max<std::int64_t>(spin.count(), 0),
                                    std::memory_order_relaxed);
}

/// Looks at `ready()` until it is true (true) or `end` has passed (false), yielding the core
/// between looks.
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::steady_clock::time_point end) {
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= end) return ready();
    std::this_thread::yield();
  }
  return true;
}

}  // namespace pulley
