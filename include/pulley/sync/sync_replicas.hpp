// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/sync_policy.hpp"
#include "pulley/error.hpp"

namespace pulley {

/// Synchronous training with TensorFlow's `SyncReplicasOptimizer` semantics.
///
/// Each part has an accumulator at some step s. A gradient tagged with local step < s is
/// stale and dropped. When `replicas_to_aggregate` (R) fresh gradients are in, their mean
/// is applied once and the step advances. The global step advances the same way on push
/// messages; each time it does, `max(R, N)` tokens carrying the new step are released. A
/// worker takes a token before each step.
///
/// Three refinements over TF's plain token queue, each to keep its documented regimes
/// true: step 0 starts with max(R, N) tokens (TF lets every worker start its first step
/// without one and queues R more; with R < N a dead holder of one of only R tokens would
/// stall step 0 here); when R <= N a worker takes at most one token per step (TF lets a
/// fast worker take two and crowd a slow one out of the step even when R == N); and tokens
/// of a finished step that nobody took are withdrawn (TF lets them pile up behind a dead
/// backup worker and hands them out later, which only buys stale gradients).
///   - R == N: every worker contributes one batch to every step.
///   - R >  N: fast workers take several tokens and contribute several batches to a step.
///   - R <  N: N - R workers are backups; the slowest gradients of a step arrive stale and
///     are dropped, so one slow or dead worker does not stall training.
class SyncReplicas {
 public:
  /// @param replicas_to_aggregate R, gradients averaged into one update (≥ 1)
  /// @param total_num_replicas    N, the number of workers (≥ 1)
  SyncReplicas(int replicas_to_aggregate, int total_num_replicas)
      : replicas_to_aggregate_(replicas_to_aggregate), total_num_replicas_(total_num_replicas) {
    if (replicas_to_aggregate < 1 || total_num_replicas < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "SyncReplicas needs replicas_to_aggregate >= 1 and total_num_replicas >= 1, "
                  "got " +
                      std::to_string(replicas_to_aggregate) + " and " +
                      std::to_string(total_num_replicas));
    }
  }

  /// R: gradients averaged into one update.
  [[nodiscard]] int replicas_to_aggregate() const noexcept { return replicas_to_aggregate_; }
  /// N: the number of workers.
  [[nodiscard]] int total_num_replicas() const noexcept { return total_num_replicas_; }

  /// Running sum of the current step's fresh gradients (TF's ConditionalAccumulator).
  struct Accumulator {
    std::vector<float> sum;
    int count = 0;
    std::int64_t step = 0;
  };

  /// An accumulator for n-element gradients, at step 0.
  [[nodiscard]] Accumulator make_accumulator(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), 0, 0};
  }

  /// Takes one contribution tagged with the sender's local step.
  Verdict accumulate(Accumulator& acc, std::span<const float> gradient,
                     std::int64_t local_step) const {
    if (local_step < acc.step) return Verdict::kStale;
    if (acc.count == 0) {
      std::copy(gradient.begin(), gradient.end(), acc.sum.begin());
    } else {
      float* __restrict s = acc.sum.data();
      const float* __restrict g = gradient.data();
      for (std::size_t i = 0, n = acc.sum.size(); i < n; ++i) s[i] += g[i];
    }
    return ++acc.count == replicas_to_aggregate_ ? Verdict::kReady : Verdict::kPending;
  }

  /// The gradient to apply for the completed step; advances the step.
  std::span<const float> take(Accumulator& acc) const {
    const float scale = 1.0F / static_cast<float>(replicas_to_aggregate_);
    for (float& v : acc.sum) v *= scale;
    acc.count = 0;
    ++acc.step;
    return acc.sum;
  }

  /// Steps this accumulator has completed.
  [[nodiscard]] std::int64_t step(const Accumulator& acc) const { return acc.step; }
  /// max(R, N) tokens per step; one per worker when R <= N.
  [[nodiscard]] TokenRule token_rule() const {
    return {std::max(replicas_to_aggregate_, total_num_replicas_),
            replicas_to_aggregate_ <= total_num_replicas_ ? 1 : 0};
  }

 private:
  int replicas_to_aggregate_;
  int total_num_replicas_;
};
static_assert(SyncPolicy<SyncReplicas>);

}  // namespace pulley
