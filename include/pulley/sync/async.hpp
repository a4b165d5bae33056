// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

/// Asynchronous training: every push is applied as soon as it arrives and no worker ever
/// waits for another. Nothing is stale, tokens never wait, and the global step counts push
/// messages.
struct Async {
  /// Only remembers the gradient it was handed, so `take` returns it without a copy.
  struct Accumulator {
    std::span<const float> pending;
  };

  /// Counts push messages.
  struct Pacer {
    std::int64_t pushes = 0;
  };

  /// An accumulator for n-element gradients.
  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }
  /// Keeps a view of `gradient` until `take`.
  void accumulate(Accumulator& acc, std::span<const float> gradient) const {
    acc.pending = gradient;
  }
  /// The gradient handed last.
  std::span<const float> take(Accumulator& acc) const { return acc.pending; }

  /// At step 0.
  [[nodiscard]] Pacer make_pacer() const { return {}; }
  /// Every push is applied at once and is one step.
  Verdict on_push(Pacer& pacer, std::uint32_t /*worker*/, std::int64_t /*local_step*/) const {
    ++pacer.pushes;
    return Verdict::kReady;
  }
  /// Push messages handled.
  [[nodiscard]] std::int64_t global_step(const Pacer& pacer) const { return pacer.pushes; }
  /// Always a token, which need not be asked for again.
  std::optional<Token> take_token(Pacer& /*pacer*/, std::uint32_t /*worker*/) const {
    return Token{0, 0, 0, false};
  }
  /// The pushes counted.
  [[nodiscard]] std::vector<std::int64_t> save(const Pacer& pacer) const { return {pacer.pushes}; }
  /// Goes on from the saved count.
  void load(Pacer& pacer, std::span<const std::int64_t> state) const {
    if (state.size() != 1 || state[0] < 0) {
      throw Error(ErrorCode::kInvalidArgument, "Async cannot load a pacer of another policy");
    }
    pacer.pushes = state[0];
  }
  /// Async counts no workers: any number may join or leave.
  void reshape(Pacer& /*pacer*/, std::span<const std::uint32_t> /*workers*/) const noexcept {}
  /// Async never waits.
  [[nodiscard]] std::string waiting_for(const Pacer& /*pacer*/) const { return "nothing (async)"; }
};
static_assert(SyncPolicy<Async>);

}  // namespace pulley
