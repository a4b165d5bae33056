// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>

namespace pulley {

/// A sync token: leave for one step, and what that step must read. TF's `sync_token_queue`
/// holds only the step number; pulley's tokens also say which parameters to pull, so that
/// one mechanism serves every pacing rule.
struct Token {
  /// Tags the step's push (TF's `local_step`): the policy judges staleness by it.
  std::int64_t local_step = 0;
  /// The step's parameters must include every update of the global steps before this one:
  /// the worker pulls with `Pull::min_step = pull_step` (0: whatever the ps holds).
  std::int64_t pull_step = 0;
  /// What the worker pulls together with this step's push, for its next step: the earliest
  /// `pull_step` its next token can have, so that the prefetch can serve it.
  std::int64_t next_pull_step = 0;
  /// False when tokens never wait (Async): the worker need not ask for another.
  bool paced = true;
  /// Which batch of the job's data the step reads, counted from the job's start, when the
  /// policy numbers them (-1: it does not, and each worker reads its own share). A step's
  /// batches are numbered by the step, not by who takes its tokens: under SyncReplicas,
  /// step s reads batches s × max(R, N) ... s × max(R, N) + max(R, N) - 1, so a token a
  /// lost worker gave back reads, in whichever worker takes it, the batch the lost worker
  /// would have read (DataShard::batch, runner/training.hpp).
  std::int64_t batch = -1;
  /// The step needs all R gradients although workers are lost (a SyncReplicas refill
  /// step): the live workers bring the lost ones'. The pacing ps (the lowest member: ps 0 while none left) decides it; the
  /// worker's push carries it (Push::refill), and every ps follows the pacing ps's word for the
  /// step (`SyncPolicy::follow`), so that no ps waits for gradients the tokens will not bring.
  bool refill = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(local_step, pull_step, next_pull_step, paced, batch, refill);
  }
  friend bool operator==(const Token&, const Token&) = default;
};

}  // namespace pulley
