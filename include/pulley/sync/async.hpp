// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "pulley/concepts/sync_policy.hpp"

namespace pulley {

/// Asynchronous training: every push is applied as soon as it arrives and no worker ever
/// waits for another. Nothing is stale, no tokens are used, and the global step counts
/// push messages.
struct Async {
  /// Only remembers the gradient it was handed, so `take` returns it without a copy.
  struct Accumulator {
    std::span<const float> pending;
    std::int64_t step = 0;
  };

  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }

  Verdict accumulate(Accumulator& acc, std::span<const float> gradient,
                     std::int64_t /*local_step*/) const {
    acc.pending = gradient;
    return Verdict::kReady;
  }

  std::span<const float> take(Accumulator& acc) const {
    ++acc.step;
    return acc.pending;
  }

  [[nodiscard]] std::int64_t step(const Accumulator& acc) const { return acc.step; }
  [[nodiscard]] std::int64_t initial_tokens() const { return -1; }
  [[nodiscard]] std::int64_t tokens_per_step() const { return -1; }
  [[nodiscard]] std::int64_t tokens_per_worker() const { return -1; }
};
static_assert(SyncPolicy<Async>);

}  // namespace pulley
