// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"

namespace pulley {

/// Synchronous training with TensorFlow's `SyncReplicasOptimizer` semantics.
///
/// The ps's global step is at some step s. A push tagged with local step < s is stale: its
/// gradients are dropped. When `replicas_to_aggregate` (R) fresh pushes are in, the mean of
/// their gradients is applied once, part by part, and the step advances; each time it
/// does, `max(R, N)` tokens carrying the new step are released. A worker takes a token
/// before each step, and pulls the parameters of the token's step.
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
///
/// The max(R, N) tokens of a step are numbered 0, 1, ... and the token numbered k of step
/// s reads batch s × max(R, N) + k of the job's data (Token::batch): a step's examples are
/// the same whoever takes its tokens. With R <= N, worker w's first token of a step is token
/// w whatever the order the workers ask in, so a copy of the pacing ps that did not hand a
/// token out (ps/shard_copies.hpp) hands out the same; a refill step's further tokens, and
/// every token with R > N, are the lowest-numbered left. A token given back (`release`,
/// a lost worker) is handed out again with its number.
///
/// Lost workers (a deviation from TensorFlow, which waits for them forever): when the ps
/// holds a worker lost (its heartbeats stopped, parameter_server.hpp), training goes on
/// without it, losing at most the batches of the step in progress:
///   - a step that begins with L workers lost and N - L < R is a refill step (a step no
///     token or push touched yet begins again when a worker is lost, so the step a restore
///     makes is judged as the unbroken job judged it): it still needs R fresh gradients,
///     and the live workers take the lost ones' tokens (each its
///     own first, then one more at a time while more tokens are left than live workers
///     still to take theirs), so every step keeps its R batches, the lost worker's among
///     them. Its tokens pull at once after their push (`next_pull_step` is the step), since
///     the worker may bring another gradient of the same step. The pacing ps (the lowest member)
///     decides it when the step begins, and its tokens say so (Token::refill); every other
///     ps takes that word from the step's pushes (`follow`), whatever its own lost workers;
///   - a worker lost during a step that is not a refill step (its tokens were handed out
///     to wait for the next step) leaves that step needing min(R, N - L') fresh gradients
///     (at least 1), L' counting the lost workers that have not pushed for it; a step that
///     already has them all completes the moment the worker is lost. The update is the
///     mean of the fresh gradients the step got.
/// With R > N nothing changes: a step always needs R, and any worker takes any token. A
/// lost worker whose heartbeats come back counts again from the step in progress (and
/// takes its own token from the next); what it pushes for a step that completed without
/// it is stale and dropped.
///
/// A worker that pulls the next step without a push of this one here (`on_pull_ahead`:
/// its push was lost with its process, killed while it wrote the push to several ps tasks
/// and started again; or, with backup workers, it skipped the step): where each worker
/// brings at most one gradient (R <= N, not a refill step), the step goes on without it,
/// once, as if it had been lost for that step alone, whatever other workers the ps holds
/// lost. With backups the step still needs R from the others while they can bring R (and
/// this ps holds none of them lost).
///
/// Workers that join or leave the job (`reshape`, at a step boundary every ps reaches
/// alike): the workers are then a set of task indices, N its size, and "its own token" is
/// a worker's rank in it. From that step on a step has max(R, N) tokens (R = N when made
/// with `kEveryWorker`), numbered after the batches of the steps before, so the data goes
/// on where it was and the epoch's remaining batches are shared among the new workers. A
/// worker outside the set waits for a token (it is let in at the next step, or it left)
/// and what it pushes is stale.
class SyncReplicas {
 public:
  /// Pass as replicas_to_aggregate: R = N, and R follows N when workers join or leave.
  static constexpr int kEveryWorker = 0;

  /// @param replicas_to_aggregate R, gradients averaged into one update (≥ 1), or
  ///                              kEveryWorker: one of every worker's, however many
  /// @param total_num_replicas    N, the number of workers (≥ 1), task indices 0 .. N-1
  SyncReplicas(int replicas_to_aggregate, int total_num_replicas)
      : every_worker_(replicas_to_aggregate == kEveryWorker),
        replicas_to_aggregate_(every_worker_ ? total_num_replicas : replicas_to_aggregate),
        total_num_replicas_(total_num_replicas) {
    if (replicas_to_aggregate_ < 1 || total_num_replicas < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "SyncReplicas needs replicas_to_aggregate >= 1 (or kEveryWorker) and total_num_replicas >= 1, "
                  "got " +
                      std::to_string(replicas_to_aggregate) + " and " +
                      std::to_string(total_num_replicas));
    }
  }

  /// R: gradients averaged into one update (N at the start, with kEveryWorker).
  [[nodiscard]] int replicas_to_aggregate() const noexcept { return replicas_to_aggregate_; }
  /// N: the number of workers at the start.
  [[nodiscard]] int total_num_replicas() const noexcept { return total_num_replicas_; }
  /// True if R follows N (kEveryWorker).
  [[nodiscard]] bool every_worker() const noexcept { return every_worker_; }

  /// Running sum of the current step's fresh gradients of one part.
  struct Accumulator {
    std::vector<float> sum;
    int count = 0;
  };

  /// The global step, its fresh pushes so far, and its tokens.
  struct Pacer {
    std::int64_t step = 0;
    int fresh = 0;                                ///< fresh pushes of `step`
    std::vector<std::uint32_t> free;              ///< numbers of `step`'s tokens not taken, ascending
    std::map<std::uint32_t, std::int64_t> taken;  ///< tokens of `step` taken, by worker
    /// By worker: the numbers of the tokens of `step` it took and did not push for yet,
    /// oldest first.
    std::map<std::uint32_t, std::vector<std::uint32_t>> held;
    std::set<std::uint32_t> pushed;               ///< workers with a fresh push of `step`
    std::set<std::uint32_t> lost;                 ///< workers the ps holds lost
    /// Workers whose push of `step` was lost with their process (`on_pull_ahead`): not
    /// waited for in this step, their push of it stale.
    std::set<std::uint32_t> forfeited;
    bool refill = false;  ///< `step` began short of workers: the live ones take the lost ones' tokens
    /// The job's workers, ascending, once they changed (`reshape`); empty: 0 .. N-1.
    std::vector<std::uint32_t> workers;
    std::int64_t base_step = 0;   ///< the step the workers last changed at
    std::int64_t base_batch = 0;  ///< the batch of token 0 of `base_step`
  };

  /// An empty accumulator for n-element gradients.
  [[nodiscard]] Accumulator make_accumulator(std::size_t n) const {
    return {std::vector<float>(n, 0.0F), 0};
  }

  /// Adds one fresh gradient.
  void accumulate(Accumulator& acc, std::span<const float> gradient) const {
    if (acc.count++ == 0) {
      std::copy(gradient.begin(), gradient.end(), acc.sum.begin());
      return;
    }
    float* __restrict s = acc.sum.data();
    const float* __restrict g = gradient.data();
    for (std::size_t i = 0, n = acc.sum.size(); i < n; ++i) s[i] += g[i];
  }

  /// The mean of the gradients accumulated.
  std::span<const float> take(Accumulator& acc) const {
    const float scale = 1.0F / static_cast<float>(acc.count);
    for (float& v : acc.sum) v *= scale;
    acc.count = 0;
    return acc.sum;
  }

  /// Step 0, with max(R, N) tokens.
  [[nodiscard]] Pacer make_pacer() const {
    Pacer pacer;
    pacer.step = -1;
    next_step(pacer);
    return pacer;
  }

  /// Stale if tagged before the current step, or pushed by a worker outside the job's; the
  /// R-th fresh push completes the step.
  Verdict on_push(Pacer& pacer, std::uint32_t worker, std::int64_t local_step) const {
    if (local_step < pacer.step || !member(pacer, worker) ||
        (local_step == pacer.step && pacer.forfeited.contains(worker))) {
      return Verdict::kStale;
    }
    pacer.pushed.insert(worker);  // first: an insertion that throws leaves the pacer as it was
    if (const auto held = pacer.held.find(worker); held != pacer.held.end()) {
      if (held->second.size() <= 1) {
        pacer.held.erase(held);  // erasing cannot throw
      } else {
        held->second.erase(held->second.begin());
      }
    }
    if (++pacer.fresh < required(pacer)) return Verdict::kPending;
    next_step(pacer);
    return Verdict::kReady;
  }

  /// Stops waiting for `worker` (and gives back its tokens): the step completes now if the
  /// others' fresh gradients are all it needs. A step no token or push has touched yet
  /// begins with the worker lost, and is judged as such (a refill step or not): a step
  /// made by a restore (`load`, then every worker the ps still holds lost) is the step the
  /// unbroken job had, not one that lost a worker on the way.
  Verdict on_worker_lost(Pacer& pacer, std::uint32_t worker) const {
    const bool untouched =
        pacer.fresh == 0 && pacer.taken.empty() && pacer.pushed.empty() && pacer.forfeited.empty();
    pacer.lost.insert(worker);
    release(pacer, worker);
    if (untouched) {
      judge_refill(pacer);
      return Verdict::kPending;
    }
    return complete_without(pacer);
  }

  /// A push for `local_step` says what the pacing ps decided about that step (Token::refill):
  /// before the step's first fresh push, the step in progress takes its word, so that every
  /// ps needs what the tokens bring (this ps's own lost workers may differ for a heartbeat).
  void follow(Pacer& pacer, std::int64_t local_step, bool refill) const noexcept {
    if (local_step == pacer.step && pacer.fresh == 0) pacer.refill = refill && one_each(pacer);
  }

  /// `worker` pulls step `min_step` without a push for the step in progress here: when the
  /// step is the one before `min_step` and each worker brings at most one gradient to it
  /// (R <= N, not a refill step), the step stops waiting for that worker, as
  /// `on_worker_lost` would for this step alone (its tokens go back; a push of it for this
  /// step is stale from now on): kReady when that completes the step, whatever workers this
  /// ps holds lost. With backup workers (R < N) the worker may have skipped the step (the
  /// others went on, and it took the next step's token) or lost its push on the way: either
  /// way it brings none here, and the step needs min(R, N less those that owe one) of the
  /// others'. At most N - R skip a step (R workers pushed it to the pacing ps, and to every
  /// ps unless lost), so a step goes on short of R only when pushes were lost or this ps
  /// holds workers lost (whose pushes it then stops waiting for, as ever). nullopt
  /// otherwise: R > N or a refill step (the step needs R gradients from whoever brings them,
  /// and the pull waits), or a worker held lost here (the step does not wait for it).
  std::optional<Verdict> on_pull_ahead(Pacer& pacer, std::uint32_t worker,
                                       std::int64_t min_step) const {
    if (min_step != pacer.step + 1 || !member(pacer, worker) || pacer.pushed.contains(worker) ||
        pacer.forfeited.contains(worker) || pacer.lost.contains(worker) || !one_each(pacer) ||
        pacer.refill) {
      return std::nullopt;
    }
    pacer.forfeited.insert(worker);  // first: an insertion that throws leaves the pacer as it was
    release(pacer, worker);
    return complete_without(pacer);
  }

  /// Waits for `worker` again, from the step in progress.
  void on_worker_back(Pacer& pacer, std::uint32_t worker) const { pacer.lost.erase(worker); }

  /// The workers that have not pushed for the step in progress and are not lost (R <= N:
  /// each owes one gradient; with R > N any of them may bring the rest).
  [[nodiscard]] std::vector<std::uint32_t> awaited(const Pacer& pacer) const {
    std::vector<std::uint32_t> workers;
    for_each_worker(pacer, [&](std::uint32_t w) {
      if (!pacer.pushed.contains(w) && !pacer.lost.contains(w) && !pacer.forfeited.contains(w))
        workers.push_back(w);
    });
    return workers;
  }

  /// The global step, and the number of its first batch where the workers' changes moved
  /// it from step × max(R, N): a checkpoint's cut has no step half aggregated (what was is
  /// redone). The workers are the job's to say, not the checkpoint's (`reshape` after
  /// `load`).
  [[nodiscard]] std::vector<std::int64_t> save(const Pacer& pacer) const {
    const std::int64_t batch = first_batch(pacer);
    if (batch == pacer.step * std::max(replicas_to_aggregate_, total_num_replicas_)) return {pacer.step};
    return {pacer.step, batch};
  }

  /// Starts at the saved global step with all its tokens, numbered from the saved batch
  /// (a state of the global step alone: from step × max(R, N)).
  void load(Pacer& pacer, std::span<const std::int64_t> state) const {
    if (state.empty() || state.size() > 2 || state[0] < 0 || (state.size() == 2 && state[1] < 0)) {
      throw Error(ErrorCode::kInvalidArgument, "SyncReplicas cannot load a pacer of another policy");
    }
    Pacer fresh = make_pacer();
    fresh.step = state[0];
    fresh.base_step = state[0];
    fresh.base_batch = state.size() == 2 ? state[1] : state[0] * tokens_per_step(fresh);
    pacer = std::move(fresh);
  }

  /// The job's workers are `workers` (task indices, ascending, not empty) from the step in
  /// progress on, which must have had no push and no token taken. Its tokens are made
  /// again, max(R, N) of them, numbered on from the batch its first token had; R follows
  /// when made with kEveryWorker. Throws kInvalidArgument for an empty or unordered set,
  /// kFailedPrecondition in the middle of a step; the pacer is then as it was.
  void reshape(Pacer& pacer, std::span<const std::uint32_t> workers) const {
    require_task_set(workers, "worker", "SyncReplicas: ");
    if (pacer.fresh != 0 || !pacer.taken.empty() || !pacer.pushed.empty()) {
      throw Error(ErrorCode::kFailedPrecondition, "SyncReplicas: the workers change between steps only");
    }
    const std::int64_t batch = first_batch(pacer);
    std::vector<std::uint32_t> set(workers.begin(), workers.end());
    pacer.free.reserve(std::max<std::size_t>(set.size(), static_cast<std::size_t>(replicas_to_aggregate_)));
    pacer.workers = std::move(set);
    pacer.base_step = pacer.step;
    pacer.base_batch = batch;
    --pacer.step;  // the step begins again, with the new workers' tokens
    next_step(pacer);
  }

  /// Gives back the tokens of the current step `worker` took and did not push for, with
  /// their numbers; it may take them again (one per step still holds when R <= N).
  void release(Pacer& pacer, std::uint32_t worker) const noexcept {
    const auto held = pacer.held.find(worker);
    if (held == pacer.held.end()) return;
    // `free` has room for every token of the step (reserved in next_step): no allocation.
    for (const std::uint32_t number : held->second) {
      pacer.free.insert(std::lower_bound(pacer.free.begin(), pacer.free.end(), number), number);
    }
    const auto count = static_cast<std::int64_t>(held->second.size());
    const auto taken = pacer.taken.find(worker);
    if (taken != pacer.taken.end() && (taken->second -= count) <= 0) pacer.taken.erase(taken);
    pacer.held.erase(held);
  }

  /// A token of the current step `worker` took and has not pushed for, if it holds one (a
  /// worker pushes for each token before it asks for the next, so asking while holding
  /// one is asking again).
  [[nodiscard]] std::optional<Token> held_token(const Pacer& pacer, std::uint32_t worker) const {
    const auto held = pacer.held.find(worker);
    if (held == pacer.held.end() || held->second.empty() || !pacer.taken.contains(worker)) return std::nullopt;
    return token(pacer, held->second.front());
  }

  /// Steps completed.
  [[nodiscard]] std::int64_t global_step(const Pacer& pacer) const { return pacer.step; }

  /// A token of the current step, if `worker` may take one more (its own number, or the
  /// lowest-numbered left: see above):
  /// when R <= N, one per step, and in a refill step one more at a time while more tokens
  /// are left than live workers still to take their first.
  std::optional<Token> take_token(Pacer& pacer, std::uint32_t worker) const {
    if (pacer.free.empty() || !member(pacer, worker)) return std::nullopt;
    const bool each = one_each(pacer);
    if (each && pacer.forfeited.contains(worker))
      return std::nullopt;  // its next token is the next step's
    if (each && (pacer.taken.contains(worker) || pacer.pushed.contains(worker))) {
      const auto held = pacer.held.find(worker);
      if (!pacer.refill || (held != pacer.held.end() && !held->second.empty())) return std::nullopt;
      std::size_t owed = 0;  // live workers that have not taken their token of the step
      for_each_worker(pacer, [&](std::uint32_t w) {
        if (!pacer.lost.contains(w) && !pacer.taken.contains(w) && !pacer.pushed.contains(w)) ++owed;
      });
      if (pacer.free.size() <= owed) return std::nullopt;
    }
    // Allocations first (an entry in `held` left empty by a throw is as good as none).
    std::vector<std::uint32_t>& held = pacer.held[worker];
    held.reserve(held.size() + 1);
    ++pacer.taken[worker];
    auto number = pacer.free.begin();
    if (each) {  // its own first, so that the numbers do not hang on the order
      const std::uint32_t rank = rank_of(pacer, worker);
      const auto own = std::lower_bound(pacer.free.begin(), pacer.free.end(), rank);
      if (own != pacer.free.end() && *own == rank) number = own;
    }
    held.push_back(*number);
    pacer.free.erase(number);
    return token(pacer, held.back());
  }

  /// "step 12: 1 of 2 gradients in, 0 of 2 tokens left" (of those the step needs: fewer
  /// than R while workers are lost)
  [[nodiscard]] std::string waiting_for(const Pacer& pacer) const {
    return "step " + std::to_string(pacer.step) + ": " + std::to_string(pacer.fresh) + " of " +
           std::to_string(required(pacer)) + " gradients in, " +
           std::to_string(pacer.free.size()) + " of " + std::to_string(tokens_per_step(pacer)) +
           " tokens left" + (pacer.refill ? " (live workers take the lost ones' tokens)" : "");
  }

 private:
  /// A step that stopped waiting for a worker (lost, or its push lost with its process)
  /// completes with the others' fresh gradients once it has the R it needs, or with none
  /// (an empty update) once its pushes were all lost with their workers' processes and no
  /// live worker owes one, as it would in the other order.
  Verdict complete_without(Pacer& pacer) const {
    const bool complete = pacer.fresh == 0 ? !pacer.forfeited.empty() && awaited(pacer).empty()
                                           : pacer.fresh >= required(pacer);
    if (!complete) return Verdict::kPending;
    next_step(pacer);
    return Verdict::kReady;
  }

  /// N: the job's workers now.
  [[nodiscard]] int workers(const Pacer& pacer) const noexcept {
    return pacer.workers.empty() ? total_num_replicas_ : static_cast<int>(pacer.workers.size());
  }
  /// R now: N with kEveryWorker.
  [[nodiscard]] int replicas(const Pacer& pacer) const noexcept {
    return every_worker_ ? workers(pacer) : replicas_to_aggregate_;
  }
  /// True if `worker` is one of the job's workers.
  [[nodiscard]] bool member(const Pacer& pacer, std::uint32_t worker) const noexcept {
    if (pacer.workers.empty()) return worker < static_cast<std::uint32_t>(total_num_replicas_);
    return std::binary_search(pacer.workers.begin(), pacer.workers.end(), worker);
  }
  /// A member's rank among the job's workers (its own token's number).
  [[nodiscard]] static std::uint32_t rank_of(const Pacer& pacer, std::uint32_t worker) noexcept {
    if (pacer.workers.empty()) return worker;
    return static_cast<std::uint32_t>(std::lower_bound(pacer.workers.begin(), pacer.workers.end(), worker) -
                                      pacer.workers.begin());
  }
  /// Calls `f(w)` for each of the job's workers, ascending.
  template <class F>
  void for_each_worker(const Pacer& pacer, F&& f) const {
    if (!pacer.workers.empty()) {
      for (const std::uint32_t w : pacer.workers) f(w);
      return;
    }
    for (std::uint32_t w = 0; w < static_cast<std::uint32_t>(total_num_replicas_); ++w) f(w);
  }

  /// One token per worker per step (R <= N), refill steps aside.
  [[nodiscard]] bool one_each(const Pacer& pacer) const noexcept { return replicas(pacer) <= workers(pacer); }

  /// The batch of token 0 of the step in progress.
  [[nodiscard]] std::int64_t first_batch(const Pacer& pacer) const {
    return pacer.base_batch + (pacer.step - pacer.base_step) * tokens_per_step(pacer);
  }

  /// Token number `number` of the step in progress. With one token per step (and not a
  /// refill step) the worker's next token is of the next global step, so its push can
  /// bring that step's parameters back; otherwise its next token may be of this step.
  [[nodiscard]] Token token(const Pacer& pacer, std::uint32_t number) const {
    const bool next = one_each(pacer) && !pacer.refill;
    return Token{pacer.step, pacer.step, next ? pacer.step + 1 : pacer.step, true,
                 first_batch(pacer) + number, pacer.refill};
  }

  /// Fresh gradients the step in progress needs: R in a refill step (or with R > N), else
  /// R less the lost workers that owe one.
  [[nodiscard]] int required(const Pacer& pacer) const {
    if (!one_each(pacer) || pacer.refill) return replicas(pacer);
    int owing = 0;
    for (const std::uint32_t w : pacer.lost) {
      if (member(pacer, w) && !pacer.pushed.contains(w)) ++owing;
    }
    for (const std::uint32_t w : pacer.forfeited) {
      if (!pacer.lost.contains(w)) ++owing;
    }
    return std::max(1, std::min(replicas(pacer), workers(pacer) - owing));
  }

  /// Moves on to the next step, withdrawing the old step's untaken tokens; it is a refill
  /// step when the live workers are fewer than R.
  void next_step(Pacer& pacer) const {
    ++pacer.step;
    pacer.fresh = 0;
    pacer.free.resize(static_cast<std::size_t>(tokens_per_step(pacer)));  // capacity stays: no throw after the first
    for (std::size_t k = 0; k < pacer.free.size(); ++k) pacer.free[k] = static_cast<std::uint32_t>(k);
    pacer.taken.clear();
    pacer.held.clear();
    pacer.pushed.clear();
    pacer.forfeited.clear();
    judge_refill(pacer);
  }

  /// Whether the step in progress, beginning with the workers lost now, is a refill step.
  void judge_refill(Pacer& pacer) const {
    const auto lost = static_cast<int>(std::count_if(pacer.lost.begin(), pacer.lost.end(), [&](std::uint32_t w) {
      return member(pacer, w);
    }));
    pacer.refill = one_each(pacer) && lost > 0 && workers(pacer) - lost < replicas(pacer);
  }

  [[nodiscard]] std::int64_t tokens_per_step(const Pacer& pacer) const {
    return std::max(replicas(pacer), workers(pacer));
  }

  bool every_worker_;
  int replicas_to_aggregate_;
  int total_num_replicas_;
};
static_assert(SyncPolicy<SyncReplicas>);

}  // namespace pulley
