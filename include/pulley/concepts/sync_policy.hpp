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
///   - `p.initial_tokens()`, `p.tokens_per_step()`, `p.tokens_per_worker()` → sync tokens:
///     how many exist at the start, how many each completed global step releases, and how
///     many of one step a single worker may take (negative: no limit). A negative
///     `initial_tokens()` means tokens are not used: TakeToken never waits and hands out
///     local step 0. Tokens of a step that nobody took by the time the next step completes
///     are withdrawn: they could only produce stale gradients.
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
  { policy.initial_tokens() } -> std::same_as<std::int64_t>;
  { policy.tokens_per_step() } -> std::same_as<std::int64_t>;
  { policy.tokens_per_worker() } -> std::same_as<std::int64_t>;
};

}  // namespace pulley
