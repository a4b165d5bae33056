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

  /// An accumulator for n-element gradients, at step 0.
  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }

  /// Takes one contribution tagged with the sender's local step.
  Verdict accumulate(Accumulator& acc, std::span<const float> gradient,
                     std::int64_t /*local_step*/) const {
    acc.pending = gradient;
    return Verdict::kReady;
  }

  /// The gradient to apply for the completed step; advances the step.
  std::span<const float> take(Accumulator& acc) const {
    ++acc.step;
    return acc.pending;
  }

  /// Steps this accumulator has completed.
  [[nodiscard]] std::int64_t step(const Accumulator& acc) const { return acc.step; }
  /// No tokens: nobody waits.
  [[nodiscard]] TokenRule token_rule() const { return {}; }
};
static_assert(SyncPolicy<Async>);

}  // namespace pulley
