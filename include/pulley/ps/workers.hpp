// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pulley/core/node.hpp"

namespace pulley {

/// The job's workers as a ps counts them: the set the chief last made the job's
/// (ChangeWorkers, Restore::workers), and a change it set for a step to come. Only the
/// set and its rules live here; the ps applies a change that comes due to its sync
/// policy's pacer and its liveness (ParameterServer::count_next_workers).
///
/// The set is kept here as well as in the pacer (SyncReplicas and BoundedStaleness count
/// their workers): a policy that counts none (Async) still needs it, for the handshake
/// and to refuse a worker that left.
class JobWorkers {
 public:
  /// Worker indices a ps keeps counts for.
  static constexpr std::uint32_t kMaxIndex = std::uint32_t{1} << 20U;
  /// Workers a job has at most at once.
  static constexpr std::size_t kMaxSet = std::size_t{1} << 16U;

  /// A change that came due: the job's workers before it and after.
  struct Change {
    std::vector<std::uint32_t> before;  ///< empty when nobody said (the cluster spec's)
    std::vector<std::uint32_t> after;
  };

  /// Why `workers` cannot be the job's workers, or "".
  [[nodiscard]] static std::string check(std::span<const std::uint32_t> workers) {
    if (workers.size() > kMaxSet) return "more than " + std::to_string(kMaxSet) + " workers";
    if (std::string why = check_task_set(workers, "worker"); !why.empty()) return why;
    if (workers.back() >= kMaxIndex) return "worker index " + std::to_string(workers.back()) + " is too large";
    return {};
  }

  /// The job's workers now, ascending; empty while they are the cluster spec's.
  [[nodiscard]] const std::vector<std::uint32_t>& now() const noexcept { return now_; }

  /// Who may connect: the workers of the change to come once the chief set one (a worker
  /// joining connects before its step), else those of now.
  [[nodiscard]] std::span<const std::uint32_t> admitted() const noexcept {
    return next_ ? std::span<const std::uint32_t>(next_->change.after) : std::span<const std::uint32_t>(now_);
  }

  /// True unless `worker` left the job: one of the workers now, or of the change to come,
  /// or any while they are the cluster spec's (the transport checked who connects).
  [[nodiscard]] bool counted(std::uint32_t worker) const {
    if (now_.empty() || std::binary_search(now_.begin(), now_.end(), worker)) return true;
    return next_ && std::binary_search(next_->change.after.begin(), next_->change.after.end(), worker);
  }

  /// True if the change to come takes `worker` out of the job at `step` or before. Its
  /// push for that step is refused here already, as at a ps that counted the change (under
  /// BoundedStaleness a worker may hold a token of a step past the change, taken before the
  /// ps that gave it counted the change): no ps takes, or counts, a push another refuses.
  [[nodiscard]] bool leaves_by(std::uint32_t worker, std::int64_t step) const {
    return next_ && step >= next_->from_step &&
           !std::binary_search(next_->change.after.begin(), next_->change.after.end(), worker);
  }

  /// The workers are `after` from global step `from_step` on (the chief's ChangeWorkers;
  /// `before`: the set until then as the chief has it, for a ps that knows none). Checked
  /// by the caller (`check`, a step to come).
  void change_at(std::vector<std::uint32_t> after, std::int64_t from_step, std::vector<std::uint32_t> before) {
    next_ = Next{{std::move(before), std::move(after)}, from_step};
  }

  /// Takes back the change set for `from_step` (another ps refused it); none else.
  void take_back(std::int64_t from_step) noexcept {
    if (next_ && next_->from_step == from_step) next_.reset();
  }

  /// The change set for a step at or before `global_step`, taken out (it is now's); none
  /// while its step has not come.
  [[nodiscard]] std::optional<Change> due(std::int64_t global_step) {
    if (!next_ || global_step < next_->from_step) return std::nullopt;
    Change change = std::move(next_->change);
    next_.reset();
    if (!now_.empty()) change.before = now_;
    now_ = change.after;
    return change;
  }

  /// The workers are `workers` now (a restore says them as they are); a change to come is
  /// dropped. An empty list keeps those of now.
  void restore(std::vector<std::uint32_t> workers) {
    if (!workers.empty()) now_ = std::move(workers);
    next_.reset();
  }

  /// What a worker the job no longer counts, or will not from the change to come, is told.
  [[nodiscard]] std::string left_message(std::uint32_t worker) const {
    const bool leaving = next_ && !std::binary_search(next_->change.after.begin(), next_->change.after.end(), worker);
    const std::string workers = leaving ? describe_members(next_->change.after) + " from global step " +
                                              std::to_string(next_->from_step)
                                        : describe_members(now_) + " now";
    return Node::worker(worker).name() + " is not one of the job's workers " + workers +
           ": the chief took it out of the job (to train in it again, a worker asks to join: --join)";
  }

 private:
  struct Next {
    Change change;
    std::int64_t from_step = 0;
  };

  std::vector<std::uint32_t> now_;
  std::optional<Next> next_;
};

}  // namespace pulley
