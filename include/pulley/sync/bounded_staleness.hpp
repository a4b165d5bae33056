// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"

namespace pulley {

/// Stale-synchronous parallel training (SSP, as in Petuum's Bösen; the OSDI'14 parameter
/// server calls it bounded delay): each worker has a clock, the number of steps it has
/// pushed, and a worker at clock c may start its next step only while the slowest worker is
/// at clock c - s or later. Its step then reads parameters that include every update of
/// clocks before c - s from every worker, and possibly newer ones.
///
/// Every push is applied as it arrives (as in Async): nothing is averaged, and nothing is
/// stale but a repeated push of a clock already counted. A ps's global step is the slowest worker's clock as that ps has seen it, so a
/// pull of step c - s waits until every worker's updates of earlier clocks are applied
/// there. s = 0 is lockstep; `kUnbounded` never waits, which is Async with tokens.
///
/// A worker that dies holds the others back once they are s clocks ahead: its clock no
/// longer moves. Their token requests then wait, and their client reports what the ps
/// waits for ("worker 2 at clock 5"), until the ps holds the worker lost (its heartbeats
/// stopped, parameter_server.hpp): the slowest clock is then taken over the others. A
/// lost worker that comes back starts at the slowest clock (its clocks in between are
/// skipped; what it pushes for them is stale), so the global step never goes back.
///
/// Workers that join or leave the job (`reshape`): a worker that joins starts at the
/// slowest clock and holds nobody back until a ps hears from it. Its first push there sets
/// its clock to the one its token named, on every ps alike (the ps tasks count the change
/// when their own slowest clocks reach the step the chief chose, which one may do a clock
/// or two before another, so each counts it in at a clock of its own). Its tokens read the
/// step it starts at until then, so that its first push reaches every ps after that ps
/// counted it in. If the others ran ahead meanwhile, it catches up from there, holding the
/// slowest clock until it does. One that left no longer holds anyone back (what it still
/// pushes is stale). Batches are numbered clock × N + rank among the workers, N their
/// count: while the fastest run ahead of the change, up to s clocks' batches may be read
/// twice or not at all.
class BoundedStaleness {
 public:
  /// A staleness bound that never binds.
  static constexpr std::int64_t kUnbounded = std::numeric_limits<std::int64_t>::max();

  /// @param staleness          s, how many clocks a worker may run ahead of the slowest (≥ 0)
  /// @param total_num_replicas N, the workers, with task indices 0 .. N-1 (≥ 1)
  BoundedStaleness(std::int64_t staleness, int total_num_replicas)
      : staleness_(staleness), total_num_replicas_(total_num_replicas) {
    if (staleness < 0 || total_num_replicas < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "BoundedStaleness needs staleness >= 0 and total_num_replicas >= 1, got " +
                      std::to_string(staleness) + " and " + std::to_string(total_num_replicas));
    }
  }

  /// s: how many clocks a worker may run ahead of the slowest.
  [[nodiscard]] std::int64_t staleness() const noexcept { return staleness_; }
  /// N: the number of workers.
  [[nodiscard]] int total_num_replicas() const noexcept { return total_num_replicas_; }

  /// Only remembers the gradient it was handed: each push is applied as it arrives.
  struct Accumulator {
    std::span<const float> pending;
  };

  /// Every worker's clock as this ps has seen it.
  struct Pacer {
    std::vector<std::int64_t> clocks;  ///< by worker: steps pushed
    std::int64_t slowest = 0;          ///< the lowest clock of a worker not lost: the global step
    std::vector<char> lost;            ///< by worker: held lost by the ps
    /// The job's workers, ascending, once they changed (`reshape`); empty: 0 .. N-1.
    std::vector<std::uint32_t> workers;
    /// By worker: counted in by `reshape` and not heard since: it holds nobody back, and
    /// its first push sets its clock (another ps may have counted it in at another clock).
    std::vector<char> joined;
  };

  /// An accumulator for n-element gradients.
  [[nodiscard]] Accumulator make_accumulator(std::size_t /*n*/) const { return {}; }
  /// Keeps a view of `gradient` until `take`.
  void accumulate(Accumulator& acc, std::span<const float> gradient) const {
    acc.pending = gradient;
  }
  /// The gradient handed last.
  std::span<const float> take(Accumulator& acc) const { return acc.pending; }

  /// Every worker at clock 0.
  [[nodiscard]] Pacer make_pacer() const {
    const auto n = static_cast<std::size_t>(total_num_replicas_);
    return {std::vector<std::int64_t>(n, 0), 0, std::vector<char>(n, 0), {}, std::vector<char>(n, 0)};
  }

  /// A push for the worker's clock moves it on and is applied at once. A push for a clock
  /// it has passed is a repeat (a retried step): stale, dropped, so that no update counts
  /// twice; so is one of a worker outside the job's. Refused (Error) for a clock the worker
  /// cannot have had a token of. The first push of a worker counted in says its clock (its
  /// token's, from the pacing ps), even one behind this ps's slowest clock.
  Verdict on_push(Pacer& pacer, std::uint32_t worker, std::int64_t local_step) const {
    if (!member(pacer, worker)) return Verdict::kStale;  // it left, or is not counted here yet
    std::int64_t& clock = clock_of(pacer, worker);
    if (unheard(pacer, worker) && local_step >= 0) {
      clock = local_step;
      pacer.joined[worker] = 0;
    }
    if (local_step < 0 || local_step > clock) {
      throw Error(ErrorCode::kInvalidArgument,
                  "worker " + std::to_string(worker) + " pushed for clock " +
                      std::to_string(local_step) + " but is at clock " + std::to_string(clock));
    }
    if (local_step < clock) return Verdict::kStale;
    ++clock;
    update_slowest(pacer);
    return Verdict::kReady;
  }

  /// Takes the slowest clock over the other workers from now on.
  Verdict on_worker_lost(Pacer& pacer, std::uint32_t worker) const {
    if (worker < pacer.lost.size()) pacer.lost[worker] = 1;
    update_slowest(pacer);
    return Verdict::kPending;  // every push was applied as it came: nothing is pending
  }

  /// Counts `worker` again, from the slowest clock if it fell behind.
  void on_worker_back(Pacer& pacer, std::uint32_t worker) const {
    if (worker >= pacer.lost.size()) return;
    pacer.lost[worker] = 0;
    pacer.clocks[worker] = std::max(pacer.clocks[worker], pacer.slowest);
  }

  /// The workers at the slowest clock, or catching up to it (the others wait for them once
  /// s clocks ahead).
  [[nodiscard]] std::vector<std::uint32_t> awaited(const Pacer& pacer) const {
    std::vector<std::uint32_t> workers;
    for (std::uint32_t w = 0; w < pacer.clocks.size(); ++w) {
      if (counts(pacer, w) && pacer.clocks[w] <= pacer.slowest) workers.push_back(w);
    }
    return workers;
  }

  /// The slowest worker's clock.
  [[nodiscard]] std::int64_t global_step(const Pacer& pacer) const { return pacer.slowest; }

  /// The token of the worker's next clock c, once c is at most s ahead of the slowest; it
  /// reads step c - s (step c for a worker counted in and not heard yet), and batch
  /// c × N + its rank among the workers (each worker its own share of every clock). Asking
  /// again before pushing gives the same token. A worker outside the job's waits (it is
  /// let in at the next step, or it left).
  std::optional<Token> take_token(Pacer& pacer, std::uint32_t worker) const {
    if (!member(pacer, worker)) return std::nullopt;
    const std::int64_t clock = clock_of(pacer, worker);
    if (clock - pacer.slowest > staleness_) return std::nullopt;
    std::int64_t workers = total_num_replicas_;
    std::int64_t rank = worker;
    if (!pacer.workers.empty()) {
      workers = static_cast<std::int64_t>(pacer.workers.size());
      rank = std::lower_bound(pacer.workers.begin(), pacer.workers.end(), worker) - pacer.workers.begin();
    }
    const std::int64_t pull_step = unheard(pacer, worker) ? clock : read_step(clock);
    return Token{clock, pull_step, read_step(clock + 1), true, clock * workers + rank};
  }

  /// The job's workers are `workers` (task indices, ascending, not empty): one that joins
  /// starts at the slowest clock, one that left no longer counts. Throws kInvalidArgument
  /// for an empty or unordered set (the pacer is then as it was).
  void reshape(Pacer& pacer, std::span<const std::uint32_t> workers) const {
    require_task_set(workers, "worker", "BoundedStaleness: ");
    std::vector<std::uint32_t> set(workers.begin(), workers.end());
    const std::size_t size = std::max<std::size_t>(pacer.clocks.size(), set.back() + std::size_t{1});
    pacer.clocks.reserve(size);
    pacer.lost.reserve(size);
    pacer.joined.reserve(size);
    pacer.joined.resize(pacer.clocks.size(), 0);
    for (const std::uint32_t w : set) {  // nothing throws from here on
      if (w >= pacer.clocks.size()) {
        pacer.clocks.resize(w + std::size_t{1}, pacer.slowest);
        pacer.lost.resize(w + std::size_t{1}, 0);
        pacer.joined.resize(w + std::size_t{1}, 0);
        pacer.joined[w] = 1;
      } else if (!member(pacer, w)) {
        pacer.clocks[w] = std::max(pacer.clocks[w], pacer.slowest);
        pacer.joined[w] = 1;
      }
    }
    pacer.workers = std::move(set);
    update_slowest(pacer);
  }

  /// Every worker's clock; one that left the job, or joined and was not heard yet, at the
  /// slowest (a resumed job does not go back for it).
  [[nodiscard]] std::vector<std::int64_t> save(const Pacer& pacer) const {
    std::vector<std::int64_t> clocks = pacer.clocks;
    for (std::uint32_t w = 0; w < clocks.size(); ++w) {
      if (!member(pacer, w) || unheard(pacer, w)) clocks[w] = std::max(clocks[w], pacer.slowest);
    }
    return clocks;
  }

  /// Goes on from the saved clocks. A job resumed with more workers starts the new ones at
  /// the slowest clock saved; with fewer, the clocks of the workers gone are dropped.
  void load(Pacer& pacer, std::span<const std::int64_t> state) const {
    if (state.empty() || *std::min_element(state.begin(), state.end()) < 0) {
      throw Error(ErrorCode::kInvalidArgument, "BoundedStaleness cannot load a pacer of another policy");
    }
    const std::int64_t slowest = *std::min_element(state.begin(), state.end());
    std::vector<std::int64_t> clocks(static_cast<std::size_t>(total_num_replicas_), slowest);
    std::copy_n(state.begin(), std::min(state.size(), clocks.size()), clocks.begin());
    pacer.lost.assign(clocks.size(), 0);  // who is lost is the ps's to say, not the checkpoint's
    pacer.joined.assign(clocks.size(), 0);
    pacer.clocks = std::move(clocks);
    pacer.slowest = 0;
    update_slowest(pacer);
  }

  /// "the slowest: worker 2 at clock 5 (fastest: 8, staleness 3)"; a worker that joined
  /// behind it: "worker 3 catching up at clock 4".
  [[nodiscard]] std::string waiting_for(const Pacer& pacer) const {
    std::string slowest;
    for (std::uint32_t w = 0; w < pacer.clocks.size(); ++w) {
      if (pacer.clocks[w] > pacer.slowest || !counts(pacer, w)) continue;
      slowest += (slowest.empty() ? "worker " : ", worker ") + std::to_string(w);
      if (pacer.clocks[w] < pacer.slowest) slowest += " catching up at clock " + std::to_string(pacer.clocks[w]);
    }
    return "the slowest: " + slowest + " at clock " + std::to_string(pacer.slowest) +
           " (fastest: " +
           std::to_string(*std::max_element(pacer.clocks.begin(), pacer.clocks.end())) +
           ", staleness " + std::to_string(staleness_) + ")";
  }

 private:
  /// The lowest clock of the workers not lost; it never goes back (nor moves while every
  /// worker is lost).
  void update_slowest(Pacer& pacer) const {
    std::int64_t slowest = std::numeric_limits<std::int64_t>::max();
    for (std::uint32_t w = 0; w < pacer.clocks.size(); ++w) {
      if (counts(pacer, w)) slowest = std::min(slowest, pacer.clocks[w]);
    }
    if (slowest != std::numeric_limits<std::int64_t>::max()) {
      pacer.slowest = std::max(pacer.slowest, slowest);
    }
  }

  /// True if `worker` is one of the job's workers.
  [[nodiscard]] bool member(const Pacer& pacer, std::uint32_t worker) const noexcept {
    if (pacer.workers.empty()) return worker < static_cast<std::uint32_t>(total_num_replicas_);
    return std::binary_search(pacer.workers.begin(), pacer.workers.end(), worker);
  }
  /// True if `worker` holds the others back: one of the job's, heard, and not lost.
  [[nodiscard]] bool counts(const Pacer& pacer, std::uint32_t worker) const noexcept {
    return worker < pacer.lost.size() && pacer.lost[worker] == 0 && member(pacer, worker) && !unheard(pacer, worker);
  }
  /// True if `worker` was counted in by `reshape` and has not pushed here since.
  [[nodiscard]] static bool unheard(const Pacer& pacer, std::uint32_t worker) noexcept {
    return worker < pacer.joined.size() && pacer.joined[worker] != 0;
  }

  [[nodiscard]] std::int64_t read_step(std::int64_t clock) const {
    return clock > staleness_ ? clock - staleness_ : 0;
  }

  std::int64_t& clock_of(Pacer& pacer, std::uint32_t worker) const {
    if (worker >= pacer.clocks.size()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "worker " + std::to_string(worker) + " is outside total_num_replicas " +
                      std::to_string(total_num_replicas_));
    }
    return pacer.clocks[worker];
  }

  std::int64_t staleness_;
  int total_num_replicas_;
};
static_assert(SyncPolicy<BoundedStaleness>);

}  // namespace pulley
