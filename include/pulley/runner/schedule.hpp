// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace pulley {

/// The global steps at which the chief and the evaluator evaluate: every `every` (0: none
/// before the last), and the last step.
inline std::vector<std::int64_t> evaluation_steps(std::int64_t every, std::int64_t last) {
  std::vector<std::int64_t> steps;
  if (every > 0) {
    for (std::int64_t s = every; s < last; s += every) steps.push_back(s);
  }
  steps.push_back(last);
  return steps;
}

/// The chief's calendar: which global step it waits for next, and what is due there. An
/// evaluation every `evaluate_every` steps and at the last step; with a checkpoint
/// directory, a checkpoint every `save_steps` steps (0: not by steps), at the last step,
/// and every `save_secs` (0: not by time) wherever training is. A checkpoint due at an
/// evaluation's step is cut exactly there, and the evaluation reads its values. It only
/// counts: the chief's loop (runner/chief_loop.hpp) waits and acts.
class ChiefSchedule {
 public:
  using Clock = std::chrono::steady_clock;

  /// What to plan for.
  struct Plan {
    std::int64_t last_step = 0;       ///< training ends there
    std::int64_t evaluate_every = 0;  ///< 0: at the last step only
    bool checkpoints = false;         ///< a checkpoint directory is set
    std::int64_t save_steps = 0;      ///< 0: not by steps
    std::chrono::seconds save_secs{0};  ///< 0: not by time
  };

  /// What is due next.
  struct Due {
    std::int64_t step = 0;         ///< the global step to wait for
    bool checkpoint = false;       ///< a checkpoint is cut at `step`
    bool evaluation = false;       ///< the evaluation of `step` is due there
    bool last = false;             ///< it is the last step's evaluation
    Clock::time_point deadline;    ///< when a checkpoint by time is due first (max: never)
  };

  /// A schedule from global step `step` (a new job: 0; a resumed one: its checkpoint's),
  /// the last checkpoint written at `now`.
  ChiefSchedule(Plan plan, std::int64_t step, Clock::time_point now)
      : plan_(plan), evaluations_(evaluation_steps(plan.evaluate_every, plan.last_step)) {
    restart(step, now);
  }

  /// The steps evaluated at, the last step included.
  [[nodiscard]] const std::vector<std::int64_t>& evaluations() const noexcept { return evaluations_; }
  /// True once the last step's evaluation is done: training is over.
  [[nodiscard]] bool done() const noexcept { return next_ == evaluations_.size(); }

  /// What is due next (not done()).
  [[nodiscard]] Due next() const {
    const std::int64_t evaluation = evaluations_[next_];
    const bool last = next_ + 1 == evaluations_.size();
    std::int64_t checkpoint = std::numeric_limits<std::int64_t>::max();
    if (plan_.checkpoints && plan_.save_steps > 0) {
      checkpoint = (saved_step_ / plan_.save_steps + 1) * plan_.save_steps;
    }
    // The last step's checkpoint, unless a cut that came late is there already.
    if (plan_.checkpoints && last && saved_step_ < evaluation) checkpoint = std::min(checkpoint, evaluation);
    Due due;
    due.step = std::min(evaluation, checkpoint);
    due.checkpoint = due.step == checkpoint;
    due.evaluation = due.step == evaluation;
    due.last = last && due.evaluation;
    due.deadline = plan_.checkpoints && plan_.save_secs.count() > 0 ? last_save_ + plan_.save_secs
                                                                   : Clock::time_point::max();
    return due;
  }

  /// A checkpoint was written at global step `step`, at `now`.
  void saved(std::int64_t step, Clock::time_point now) noexcept {
    saved_step_ = std::max(saved_step_, step);
    last_save_ = now;
  }

  /// The newest checkpoint written is of global step `step`, older than where training is
  /// (a chief that took over the live state of a lost one's job): the checkpoints due since
  /// are due now, the last step's included.
  void last_checkpoint(std::int64_t step) noexcept { saved_step_ = step; }

  /// The evaluation due was done.
  void evaluated() noexcept { ++next_; }

  /// The job went back (or forward) to global step `step`: a resumed job, a rollback after
  /// a lost ps, whose checkpoint is `now`'s last. The evaluations after it are due again;
  /// a job already at its last step is evaluated there once more.
  void restart(std::int64_t step, Clock::time_point now) noexcept {
    const auto after = std::upper_bound(evaluations_.begin(), evaluations_.end(), step);
    next_ = step >= plan_.last_step ? evaluations_.size() - 1
                                    : static_cast<std::size_t>(after - evaluations_.begin());
    saved_step_ = step;
    last_save_ = now;
  }

 private:
  Plan plan_;
  std::vector<std::int64_t> evaluations_;
  std::size_t next_ = 0;
  std::int64_t saved_step_ = 0;
  Clock::time_point last_save_;
};

}  // namespace pulley
