// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/magnitude.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/ps/shard.hpp"

namespace pulley {

/// Where a push is applied: the update in progress on one ps task. Each push comes with
/// the sync policy's verdict: a stale one is dropped and counted; a fresh one's gradients
/// go into the parts' accumulators (and its rows into the tables' ones); the push that
/// completes an update (kReady) makes every part apply its accumulator's mean with the
/// optimizer, and every table its rows.
///
/// Nothing non-finite is ever applied, and an update is applied whole or not at all:
///   - a push that is an update by itself (Async, BoundedStaleness; SyncReplicas with
///     R = 1) is checked against the state it would be applied to, and refused, naming its
///     sender, if anything would go non-finite; it still counts towards the step (the other
///     ps tasks may have taken their share of it, and steps must not drift apart);
///   - an update averaged from several pushes is checked once, when it is applied, and
///     rolled back on this ps (logged, with the workers whose pushes made it) if anything
///     would go non-finite.
/// Optimizers with `stays_finite` are asked before applying; others apply into a copy of
/// the part and its State that replaces them only if it stayed finite (or, if the State
/// cannot be copied, fail the ps when the part goes non-finite). An optimizer that bounds
/// magnitudes (BoundsMagnitudes, every stock one) is asked first with what its
/// last update measured and a bound of the gradient's magnitudes: what it proves finite is
/// applied without reading the part twice, and `stays_finite` decides the rest.
///
/// @tparam O, P, T as the Shard it updates
template <Optimizer O, SyncPolicy P, class T>
class Update {
 public:
  /// What taking one push did.
  struct Outcome {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::string refused;            ///< why the push was refused (it counts towards the step), or ""
  };

  /// Takes push `r` (checked) with the sync policy's `verdict`, made at global step
  /// `step_before`, and applies the update it completes. `largest`: no value of the push
  /// is larger in magnitude (the transport measured it as it checked the push arrived
  /// finite: RequestContext::tensors_largest), or +infinity; `r.largest` bounds its
  /// gradients too, where the client in this process measured it. A throw from the optimizer or
  /// the policy leaves the update half applied: the ps then fails.
  Outcome take(Shard<O, P, T>& shard, const P& sync, const Push& r, Verdict verdict,
               std::int64_t step_before, Stats& stats,
               float largest = std::numeric_limits<float>::infinity()) {
    largest = std::min(largest, r.largest);  // the client in this process measured it, maybe
    const bool stale = verdict == Verdict::kStale;
    const bool alone = verdict == Verdict::kReady && contributors_.empty();
    Outcome out;
    std::string refused = alone ? would_overflow(shard, r, largest) : std::string();
    for (const PartValues& pv : r.gradients) {
      stats.bytes_pushed += static_cast<std::int64_t>(pv.values.size_bytes());
      if (stale) {
        ++stats.stale_gradients_dropped;
        ++out.stale_parts;
        continue;
      }
      if (!refused.empty()) continue;
      ++stats.gradients_accepted;
      sync.accumulate(shard.find(pv.part)->accumulator, pv.values);
    }
    for (const TableRows& tr : r.rows) {
      stats.bytes_pushed += static_cast<std::int64_t>(tr.values.size_bytes());
      if (stale) {
        stats.table_rows_dropped += static_cast<std::int64_t>(tr.ids.size());
        continue;
      }
      if (refused.empty()) shard.tables().add(tr);
    }
    if (!stale && refused.empty()) {
      contributors_.push_back(r.worker);
      pushed_largest_ = std::max(pushed_largest_, largest);
    }
    std::string rolled_back;
    if (verdict == Verdict::kReady) {
      // An update of nothing (its one push refused here) applies nothing.
      if (!contributors_.empty()) rolled_back = timed_apply(shard, sync, step_before, alone, stats);
      clear();
    }
    if (alone && refused.empty() && !rolled_back.empty()) {
      refused = "push from worker " + std::to_string(r.worker) + " refused: it would make " + rolled_back +
                " non-finite; none of it was applied (it counts towards the step, as on the other ps tasks)";
    } else if (!refused.empty()) {
      ++stats.updates_refused;  // (a rollback counted itself)
    }
    out.refused = std::move(refused);
    return out;
  }

  /// The update in progress needs no more pushes (a worker it waited for was held lost):
  /// applies what it has, at global step `step_before`.
  void complete(Shard<O, P, T>& shard, const P& sync, std::int64_t step_before, Stats& stats) {
    if (!contributors_.empty()) (void)timed_apply(shard, sync, step_before, /*checked=*/false, stats);
    clear();
  }

  /// Forgets the update in progress (a restore empties the shard's accumulators).
  void clear() noexcept {
    contributors_.clear();
    pushed_largest_ = 0.0F;
  }

 private:
  /// `apply`, its time added to `Stats::apply_microseconds`.
  std::string timed_apply(Shard<O, P, T>& shard, const P& sync, std::int64_t step_before, bool checked,
                          Stats& stats) {
    const auto began = std::chrono::steady_clock::now();
    std::string rolled_back = apply(shard, sync, step_before, checked, stats);
    stats.apply_microseconds += std::chrono::duration_cast<std::chrono::microseconds>(
                                    std::chrono::steady_clock::now() - began).count();
    return rolled_back;
  }

  /// Why applying push `r` alone would make a parameter or a slot non-finite (the
  /// optimizer's `stays_finite`, asked of every part against the state it would be applied
  /// to), or "" when it would not, or when the optimizer cannot tell (`apply` guards those).
  std::string would_overflow(Shard<O, P, T>& shard, const Push& r, float largest) const {
    if constexpr (PredictsFiniteness<O>) {
      for (const PartValues& pv : r.gradients) {
        const auto& held = *shard.find(pv.part);
        if (proven_by_magnitudes(shard.optimizer(), held, pv.values, largest)) continue;
        if (!shard.optimizer().stays_finite(held.optimizer_state, held.values, pv.values)) {
          return "push from worker " + std::to_string(r.worker) + " refused: its gradient for " +
                 shard.describe(held.part) +
                 " would make a parameter or an optimizer slot non-finite (or larger than float's "
                 "range allows); none of it was applied (it counts towards the step, as on the other "
                 "ps tasks)";
        }
      }
    }
    return {};
  }

  /// Takes every part's update from its accumulator and applies it, unless that would make
  /// a parameter (or, for an optimizer that predicts it, a slot) non-finite: the update is
  /// then skipped on this ps. With `stays_finite`, the update is asked about once, unless
  /// its one push already was (`checked`). Returns what would have gone non-finite when the
  /// update was skipped, "" when applied.
  std::string apply(Shard<O, P, T>& shard, const P& sync, std::int64_t step_before, bool checked, Stats& stats) {
    const auto parts = shard.parts();
    const O& optimizer = shard.optimizer();
    updates_.clear();
    for (auto& held : parts) updates_.push_back(sync.take(held.accumulator));
    // The tables' rows first, into scratch memory: committed with the dense parts below, or
    // not at all.
    if (const auto table = shard.tables().prepare(step_before)) {
      return skip(shard, step_before, "table '" + *table + "'", stats);
    }
    if constexpr (PredictsFiniteness<O>) {
      // A mean of pushes is no larger than the largest of them; a policy that sums them
      // (against the contract) gets at most as many times that as there were pushes.
      const float pushed = pushed_largest_ * static_cast<float>(contributors_.size());
      for (std::size_t i = 0; !checked && i < parts.size(); ++i) {
        if (proven_by_magnitudes(optimizer, parts[i], updates_[i], pushed)) continue;
        if (!optimizer.stays_finite(parts[i].optimizer_state, parts[i].values, updates_[i])) {
          return skip(shard, step_before, shard.describe(parts[i].part), stats);
        }
      }
      for (std::size_t i = 0; i < parts.size(); ++i) {
        if constexpr (BoundsMagnitudes<O>) {
          parts[i].largest = optimizer.apply_bounded(parts[i].optimizer_state, parts[i].values, updates_[i]);
        } else {
          apply_to(shard, parts[i], parts[i].values, parts[i].optimizer_state, updates_[i], step_before);
        }
      }
    } else if constexpr (std::is_copy_assignable_v<typename O::State>) {
      shadows_.resize(parts.size());
      for (std::size_t i = 0; i < parts.size(); ++i) {
        Shadow& shadow = shadows_[i];
        shadow.values = parts[i].values;  // copy-assignments reuse the shadows' memory
        if (!shadow.state) {
          shadow.state.emplace(parts[i].optimizer_state);
        } else {
          *shadow.state = parts[i].optimizer_state;
        }
        apply_to(shard, parts[i], shadow.values, *shadow.state, updates_[i], step_before);
        if (!detail::all_finite(shadow.values)) return skip(shard, step_before, shard.describe(parts[i].part), stats);
      }
      for (std::size_t i = 0; i < parts.size(); ++i) {
        std::swap(parts[i].values, shadows_[i].values);
        std::swap(parts[i].optimizer_state, *shadows_[i].state);
      }
    } else {
      for (std::size_t i = 0; i < parts.size(); ++i) {
        apply_to(shard, parts[i], parts[i].values, parts[i].optimizer_state, updates_[i], step_before);
        if (!detail::all_finite(parts[i].values)) {
          throw std::runtime_error("the parameters of " + shard.describe(parts[i].part) +
                                   " went non-finite, and the optimizer's State cannot be copied to "
                                   "undo it (give the optimizer stays_finite)");
        }
      }
    }
    stats.updates_applied += static_cast<std::int64_t>(parts.size());
    stats.updates_applied += shard.tables().commit(step_before);
    return {};
  }

  /// True if the optimizer proves from magnitudes alone (BoundsMagnitudes) that applying
  /// `update` to `held` stays finite: from what its last update measured of the part, and
  /// `largest` (no element of `update` is larger; +infinity: not known, so the update is
  /// read here, once, for whether all of it is ordinary: detail::all_ordinary).
  static bool proven_by_magnitudes(const O& optimizer, const HeldPart<O, P>& held,
                                   std::span<const float> update, float largest) {
    if constexpr (BoundsMagnitudes<O>) {
      if (!(held.largest < std::numeric_limits<float>::infinity())) return false;
      if (!(largest < std::numeric_limits<float>::infinity())) {
        largest = magnitude_bound(detail::all_ordinary(update));
      }
      return optimizer.stays_finite_given(held.optimizer_state, held.largest, largest);
    } else {
      return false;
    }
  }

  static void apply_to(const Shard<O, P, T>& shard, const HeldPart<O, P>& held, std::span<float> values,
                       typename O::State& state, std::span<const float> update, std::int64_t step_before) {
    const UpdateContext context{step_before, shard.variables()[held.part.variable].name, held.part.rows,
                                held.row_size};
    apply_update(shard.optimizer(), state, values, update, context);
  }

  /// Drops the update (counted, and logged with the workers whose pushes made it).
  std::string skip(Shard<O, P, T>& shard, std::int64_t step_before, const std::string& what, Stats& stats) {
    ++stats.updates_refused;
    shard.tables().clear();
    std::string from;
    for (const std::uint32_t w : contributors_) from += (from.empty() ? "worker " : ", worker ") + std::to_string(w);
    log(LogLevel::kWarning, "ps " + std::to_string(shard.task()) + ": rolled back the update of global step " +
                                std::to_string(step_before + 1) + " (gradients from " + from +
                                "): it would have made " + what + " non-finite");
    return what;
  }

  /// A part's values and State as an update leaves them, kept only if they stay finite
  /// (optimizers without `stays_finite`).
  struct Shadow {
    std::vector<float> values;
    std::optional<typename O::State> state;
  };

  /// Whose gradients are in the accumulators, a worker once per push (for a rollback's log).
  std::vector<std::uint32_t> contributors_;
  float pushed_largest_ = 0.0F;  ///< a bound of the magnitudes of those gradients
  std::vector<Shadow> shadows_;
  std::vector<std::span<const float>> updates_;  ///< scratch: each part's update
};

}  // namespace pulley
