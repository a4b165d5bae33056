// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// What a ps task has taken from each worker since the last restore: how many pushes (a
/// checkpoint's cut brings every ps to the same counts, see CheckpointCut), the furthest
/// step one was made for, and the sequence number and answer of the last one, so that a push sent
/// again after a lost connection is answered as the first was and counted once (a worker has one
/// push in flight at a time, and sends again only its last). A push lost with its worker's process
/// and counted all the same (`count_lost`) is counted once too: a copy of it that still
/// comes, written before the process was lost and read after, is `counted_lost`.
class PushLedger {
 public:
  /// What a push taken was answered.
  struct Answer {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::string refused;            ///< why the update was refused ("" if it was not)
  };

  /// The answer to a push of `worker` numbered `sequence` of `series` if it is the last one
  /// taken again, else nullptr. Sequence 0 numbers nothing.
  [[nodiscard]] const Answer* repeated(std::uint32_t worker, std::uint64_t sequence, std::uint64_t series = 0) const {
    if (sequence == 0 || worker >= last_.size() || last_[worker].sequence != sequence ||
        last_[worker].series != series) {
      return nullptr;
    }
    return &last_[worker].answer;
  }

  /// True if a push of `worker` numbered `sequence` of `series` (not 0) is older than the
  /// last one taken of that series: a late copy its worker gave up on.
  [[nodiscard]] bool older(std::uint32_t worker, std::uint64_t sequence, std::uint64_t series) const {
    return series != 0 && sequence != 0 && worker < last_.size() && last_[worker].series == series &&
           sequence < last_[worker].sequence;
  }

  /// Counts one push of `worker` for step `local_step` taken (its verdict not known yet).
  void count(std::uint32_t worker, std::int64_t local_step) {
    if (taken_.size() <= worker) taken_.resize(worker + 1, 0);
    ++taken_[worker];
    furthest_ = std::max(furthest_, local_step);
  }

  /// Counts the push of `worker` for step `step` or before that its process was lost while
  /// writing: the pacing ps took it, this ps never did (ParameterServer::pulls_ahead).
  void count_lost(std::uint32_t worker, std::int64_t step) {
    count(worker, step);
    if (lost_.size() <= worker) lost_.resize(worker + 1, -1);
    lost_[worker] = std::max(lost_[worker], step);
  }

  /// True if a push of `worker` for `local_step` would be one counted by `count_lost`
  /// already: the process that wrote it was lost, and the one in its place pulled past it.
  [[nodiscard]] bool counted_lost(std::uint32_t worker, std::int64_t local_step) const noexcept {
    return worker < lost_.size() && local_step <= lost_[worker];
  }

  /// Remembers the answer to push `sequence` of `series` of `worker` (0: unnumbered,
  /// nothing kept).
  void answered(std::uint32_t worker, std::uint64_t sequence, Answer answer, std::uint64_t series = 0) {
    if (sequence == 0) return;
    if (last_.size() <= worker) last_.resize(worker + 1);
    last_[worker] = {sequence, series, std::move(answer)};
  }

  /// Pushes of `worker` taken so far.
  [[nodiscard]] std::uint64_t taken(std::uint32_t worker) const noexcept {
    return worker < taken_.size() ? taken_[worker] : 0;
  }
  /// Pushes taken so far, by worker.
  [[nodiscard]] const std::vector<std::uint64_t>& taken() const noexcept { return taken_; }
  /// The number and series of the last numbered push taken of `worker` (0 and 0: none).
  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> last(std::uint32_t worker) const noexcept {
    if (worker >= last_.size()) return {0, 0};
    return {last_[worker].sequence, last_[worker].series};
  }
  /// last() of every worker, into `sequences` and `series` (what PauseReply says beside
  /// `taken`).
  void last_pushes(std::vector<std::uint64_t>& sequences,
                   std::vector<std::uint64_t>& series) const {
    sequences.clear();
    series.clear();
    for (const Last& l : last_) {
      sequences.push_back(l.sequence);
      series.push_back(l.series);
    }
  }
  /// The furthest step a push taken so far was made for (Push::local_step), -1 if none.
  [[nodiscard]] std::int64_t furthest() const noexcept { return furthest_; }

  /// Forgets everything (a restore starts a new epoch).
  void clear() noexcept {
    taken_.clear();
    last_.clear();
    lost_.clear();
    furthest_ = -1;
  }

 private:
  struct Last {
    std::uint64_t sequence = 0;
    std::uint64_t series = 0;
    Answer answer;
  };
  std::vector<std::uint64_t> taken_;
  std::vector<Last> last_;
  std::vector<std::int64_t> lost_;  ///< by worker: the furthest step a lost push was counted for
  std::int64_t furthest_ = -1;
};

}  // namespace pulley
