// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace pulley {

/// What an accumulator did with one contribution.
enum class Verdict : std::uint8_t {
  kStale,    ///< older than the accumulator's step: dropped, never applied
  kPending,  ///< kept; the step needs more contributions
  kReady,    ///< kept, and the step is complete: call `take`
};

/// How a sync policy paces workers with tokens (TF's `sync_token_queue`). A worker takes a
/// token before each step and tags its push with the token's step. When step 0 starts and
/// each time a global step completes, `per_step` tokens of the new step are released,
/// replacing any of the old step that nobody took (those could only buy stale gradients).
struct TokenRule {
  std::int64_t per_step = 0;    ///< tokens per step; 0: no tokens, TakeToken never waits
  std::int64_t per_worker = 0;  ///< most tokens of one step a worker may take; 0: no limit
};

/// An aggregation (sync) policy decides when gradients are applied and how workers are
/// paced. The ps keeps one `Accumulator` per part it holds plus one, of size 0, for the
/// global step: every push message is a vote on that one.
///
/// Required:
///   - `typename P::Accumulator`
///   - `p.make_accumulator(n)` → an accumulator for `n`-element gradients, at step 0
///   - `p.accumulate(acc, gradient, local_step)` → `Verdict`
///   - `p.take(acc)` → the aggregated gradient to apply; advances `acc` by one step
///   - `p.step(acc)` → the steps `acc` has completed
///   - `p.token_rule()` → `TokenRule`: how workers are paced with sync tokens
///
/// Semantic contract:
///   - a contribution with `local_step < step(acc)` is stale: `accumulate` returns kStale and
///     leaves `acc` unchanged;
///   - `take` is called exactly once after each kReady, before the next `accumulate`; the
///     span it returns stays valid until then and may alias the last gradient passed in;
///   - `accumulate` may keep a view of `gradient` only until the next `take`;
///   - the policy object is never modified after construction.
template <class P>
concept SyncPolicy = std::copy_constructible<P> &&
    requires(const P& policy, typename P::Accumulator& acc, const typename P::Accumulator& cacc,
             std::span<const float> gradient, std::int64_t local_step, std::size_t n) {
  typename P::Accumulator;
  { policy.make_accumulator(n) } -> std::same_as<typename P::Accumulator>;
  { policy.accumulate(acc, gradient, local_step) } -> std::same_as<Verdict>;
  { policy.take(acc) } -> std::same_as<std::span<const float>>;
  { policy.step(cacc) } -> std::same_as<std::int64_t>;
  { policy.token_rule() } -> std::same_as<TokenRule>;
};

}  // namespace pulley
