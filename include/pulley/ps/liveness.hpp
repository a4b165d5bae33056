// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pulley {

/// Where a ps task detects a lost worker: the workers it heard from (a heartbeat, a token
/// request) and when, and which of them it holds lost. A worker is held lost once it was
/// heard and then stays silent for the worker timeout; one never heard is never lost (a
/// Worker made by hand without a HeartbeatSender, as in TensorFlow). The ps tells its sync
/// policy of every change; this part keeps only the clock and the verdicts.
///
/// A ps that heard no task at all (no worker, nor the chief) for a whole timeout was most
/// likely the one cut off (a partition, a stopped process, a long pause of its own): every
/// task then gets a fresh timeout to be heard from again, once, instead of being held lost
/// for the ps's own silence. (If every task really is gone, they are held lost after two
/// timeouts.)
///
/// The chief beats too, and is judged by the same timeout and grace: a ps that holds it
/// lost keeps the model and waits for a chief to come back.
class Liveness {
 public:
  using Clock = std::chrono::steady_clock;

  /// How long a worker heard before may be silent (default 5 s).
  void set_timeout(std::chrono::milliseconds timeout) noexcept { timeout_ = timeout; }
  /// The timeout.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// `worker` was heard at `now` (its lost verdict stands until `back`).
  void heard(std::uint32_t worker, Clock::time_point now) {
    heard_any(now);
    workers_[worker].last = now;
  }

  /// `worker`, heard before, was heard again at `now`: its clock alone (no fresh timeout for
  /// the others after a silence: for a ps that ended, which holds nobody lost any more).
  void touch(std::uint32_t worker, Clock::time_point now) {
    if (const auto it = workers_.find(worker); it != workers_.end()) it->second.last = now;
  }

  /// The chief was heard at `now`; true if it was held lost until then (it is back).
  bool heard_chief(Clock::time_point now) {
    heard_any(now);
    const bool was_lost = chief_ && chief_->lost;
    chief_ = Heard{now, false};
    return was_lost;
  }

  /// The ps refused every task but the chief from `since` to `now` (ShardCopies' fence):
  /// that silence was its own doing, and so was any time before it in which it heard
  /// nobody at all (it was stopped or cut off: its lease ran out in that time). Neither
  /// counts against a worker not held lost; a worker's silence while others were heard
  /// still does.
  void forgive(Clock::time_point since, Clock::time_point now) noexcept {
    since = std::min(since, last_heard_any_);
    if (now <= since) return;
    for (auto& [w, heard] : workers_) {
      if (!heard.lost) heard.last = heard.last < since ? heard.last + (now - since) : now;
    }
    last_heard_any_ = now;
    grace_ = false;
  }

  /// The chief ended normally (or never beat): nothing to hold lost.
  void chief_left() noexcept { chief_.reset(); }

  /// Since when the chief is held lost (its last heartbeat), if it is.
  [[nodiscard]] std::optional<Clock::time_point> chief_lost_since() const {
    if (chief_ && chief_->lost) return chief_->last;
    return std::nullopt;
  }

  /// True if `worker` is held lost now.
  [[nodiscard]] bool is_lost(std::uint32_t worker) const {
    const auto it = workers_.find(worker);
    return it != workers_.end() && it->second.lost;
  }

  /// True if `worker`, heard before and not held lost, has been silent for the timeout at
  /// `now` while others were heard: `expire` would hold it lost at `now`. For a ps that
  /// may not hold anyone lost now (paused for a cut) but must not wait for the dead.
  [[nodiscard]] bool silent(std::uint32_t worker, Clock::time_point now) const {
    const auto it = workers_.find(worker);
    if (it == workers_.end() || it->second.lost || now - it->second.last < timeout_) return false;
    return grace_ || now - last_heard_any_ < timeout_;  // else the silence may be the ps's own
  }

  /// True if some worker heard before, not held lost and not left, was heard within the
  /// timeout at `now`: it may still come with a request.
  [[nodiscard]] bool awaits_any(Clock::time_point now) const {
    return std::any_of(workers_.begin(), workers_.end(), [&](const auto& entry) {
      return !entry.second.lost && now - entry.second.last < timeout_;
    });
  }

  /// A lost `worker` counts again, heard at `now`.
  void back(std::uint32_t worker, Clock::time_point now) {
    Heard& heard = workers_[worker];
    heard.lost = false;
    heard.last = now;
  }

  /// `worker` ended normally: forgotten, so it is not held lost once quiet (one already
  /// lost stays lost).
  void leave(std::uint32_t worker) {
    if (const auto it = workers_.find(worker); it != workers_.end() && !it->second.lost) {
      workers_.erase(it);
    }
  }

  /// True if `worker` was heard (lost or not); `any`: if any worker was.
  [[nodiscard]] bool known(std::uint32_t worker) const { return workers_.contains(worker); }
  [[nodiscard]] bool any() const noexcept { return !workers_.empty(); }

  /// `worker` left the job for good: forgotten, lost or not.
  void forget(std::uint32_t worker) { workers_.erase(worker); }

  /// Holds the chief lost if it was silent for the timeout at `now`, calling
  /// `on_chief_lost(last_heard)` right after marking it.
  template <class OnChiefLost>
  void expire_chief(Clock::time_point now, OnChiefLost&& on_chief_lost) {
    if (start_grace(now)) return;
    if (chief_ && !chief_->lost && now - chief_->last >= timeout_) {
      chief_->lost = true;
      on_chief_lost(chief_->last);
    }
  }

  /// Holds lost every worker silent for the timeout at `now`, calling
  /// `on_lost(worker, last_heard)` for each, in worker order, right after marking it.
  template <class OnLost>
  void expire(Clock::time_point now, OnLost&& on_lost) {
    if (start_grace(now)) return;
    std::vector<std::pair<std::uint32_t, Clock::time_point>> lost;  // `on_lost` may forget workers
    for (auto& [worker, heard] : workers_) {
      if (heard.lost || now - heard.last < timeout_) continue;
      heard.lost = true;
      lost.emplace_back(worker, heard.last);
    }
    for (const auto& [worker, last] : lost) on_lost(worker, last);
  }

  /// The workers held lost, ascending.
  [[nodiscard]] std::vector<std::uint32_t> lost() const {
    std::vector<std::uint32_t> out;
    for (const auto& [worker, heard] : workers_) {
      if (heard.lost) out.push_back(worker);
    }
    return out;
  }

  /// " (last heard 14.2 s ago)" for a worker heard before `now`, else "".
  [[nodiscard]] std::string last_heard(std::uint32_t worker, Clock::time_point now) const {
    const auto it = workers_.find(worker);
    if (it == workers_.end()) return {};
    return " (last heard " + seconds_between(it->second.last, now) + " s ago)";
  }

  /// "worker:1 (last heard 14.2 s ago), worker:2": `workers` with how long ago each was
  /// heard (the first 8, then how many more).
  [[nodiscard]] std::string describe(const std::vector<std::uint32_t>& workers, Clock::time_point now) const {
    std::string text;
    for (std::size_t i = 0; i < workers.size(); ++i) {
      if (i == 8) return text + ", and " + std::to_string(workers.size() - i) + " more";
      if (i > 0) text += ", ";
      text += "worker:" + std::to_string(workers[i]) + last_heard(workers[i], now);
    }
    return text;
  }

  /// "14.2": seconds from `then` to `now`, one decimal.
  static std::string seconds_between(Clock::time_point then, Clock::time_point now) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f", std::chrono::duration<double>(now - then).count());
    return text;
  }

 private:
  struct Heard {
    Clock::time_point last;
    bool lost = false;
  };
  /// Nobody heard for a whole timeout at `now`: a fresh one each, from now, once (true).
  bool start_grace(Clock::time_point now) {
    if (grace_ || (workers_.empty() && !chief_) || now - last_heard_any_ < timeout_) return false;
    grace_ = true;
    for (auto& [w, heard] : workers_) heard.last = now;
    if (chief_ && !chief_->lost) chief_->last = now;
    last_heard_any_ = now;
    return true;
  }

  /// Heard at `now`: after a silence of a whole timeout, everyone gets a fresh one (also
  /// when the grace for that silence began before: the first word after it counts).
  void heard_any(Clock::time_point now) {
    if (grace_ || now - last_heard_any_ >= timeout_) {
      for (auto& [w, heard] : workers_) heard.last = now;
      if (chief_ && !chief_->lost) chief_->last = now;
    }
    last_heard_any_ = now;
    grace_ = false;
  }

  std::map<std::uint32_t, Heard> workers_;
  std::optional<Heard> chief_;  ///< once the chief beat
  std::chrono::milliseconds timeout_{std::chrono::seconds(5)};
  Clock::time_point last_heard_any_;
  bool grace_ = false;  ///< the fresh timeout after hearing nobody is running
};

}  // namespace pulley
