// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/concepts/transport.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// What the heartbeats of a HeartbeatSender brought back.
struct HeartbeatReplies {
  /// The counters each ps task answered with, by task index (nullopt: not heard yet, or no
  /// member of the job any more); a ps that did not answer the last beat keeps its earlier
  /// ones.
  std::vector<std::optional<Stats>> stats;
  /// When the last beat that a ps task answered was sent (the clock's epoch before any was).
  std::chrono::steady_clock::time_point at;
};

/// A worker's heartbeats (or the chief's: the ps tasks then wait for a lost chief to come
/// back, and end training as aborted when none does): while it lives, a thread of its own sends `Heartbeat` to every ps
/// task every `interval`, over a transport of its own (so a worker blocked on a token or
/// computing a long step still beats). A ps that heard it once and then hears nothing for
/// its worker timeout (`ParameterServer::set_worker_timeout`, default 5 s: keep `interval`
/// well below it) holds the worker lost, and the sync policy stops waiting for it; the
/// next heartbeat that arrives makes it count again. Destroying it says goodbye: the ps
/// tasks forget the worker instead of holding it lost once it is quiet; a worker that
/// failed calls `abandon` first, and is held lost.
///
/// It also tells the worker which others are lost (`lost`), so that a data source can
/// hand their share of the data to the workers that remain (runner/run.hpp's DataShard).
/// It beats the job's ps tasks: every ps task of the cluster until the replies name a
/// newer membership without some (a ps that left the job for good, Chief::leave).
///
///     HeartbeatSender beat(index, InProcess(network, Node::worker(index)));
///     Worker worker(index, model, InProcess(network, Node::worker(index)));
template <Transport T>
class HeartbeatSender {
 public:
  /// Starts beating at once, on its own thread, as worker `worker` (or as the task its
  /// transport names: the chief's is index 0); `who` names it in log lines ("worker 3").
  HeartbeatSender(std::uint32_t worker, T transport,
            std::chrono::milliseconds interval = std::chrono::seconds(1), std::string who = {})
      : worker_(worker), interval_(interval), transport_(std::move(transport)),
        who_(who.empty() ? "worker " + std::to_string(worker) : std::move(who)) {
    thread_ = std::thread([this] { beat(); });
  }

  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;

  /// Stops beating, after telling the ps tasks the worker leaves (best effort, one
  /// interval at most).
  ~HeartbeatSender() {
    {
      std::scoped_lock lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// Stops beating without the goodbye: the worker failed, and the ps tasks must hold it
  /// lost once its silence lasts (as a killed worker's), not forget it as one that ended
  /// normally (their sync policy would go on waiting for its pushes). Call it before the
  /// sender is destroyed on a failure path.
  void abandon() noexcept {
    {
      std::scoped_lock lock(mutex_);
      abandoned_ = stopping_ = true;
    }
    wake_.notify_all();
  }

  /// True if some ps task holds the chief lost, as of the last beat answered.
  [[nodiscard]] bool chief_lost() const {
    std::scoped_lock lock(mutex_);
    return chief_lost_;
  }

  /// The workers some ps task holds lost, as of the last beat answered, ascending.
  [[nodiscard]] std::vector<std::uint32_t> lost() const {
    std::scoped_lock lock(mutex_);
    return lost_;
  }

  /// The job's workers as the ps tasks last said, once workers joined or left, ascending;
  /// empty while they are the cluster spec's.
  [[nodiscard]] std::vector<std::uint32_t> workers() const {
    std::scoped_lock lock(mutex_);
    return workers_;
  }

  /// What the ps tasks answered the last beats with, and when the last answered beat was
  /// sent (one moment: both are read together).
  [[nodiscard]] HeartbeatReplies heard() const {
    std::scoped_lock lock(mutex_);
    return {stats_, heard_at_};
  }

  /// Beats that at least one ps task answered.
  [[nodiscard]] std::uint64_t beats() const {
    std::scoped_lock lock(mutex_);
    return beats_;
  }

 private:
  void beat() {
    std::unique_lock lock(mutex_);
    // The first beat goes out even when the worker failed before this thread ran (`abandon`
    // under load): a ps tracks a worker once it hears a beat, and one it never heard is never
    // held lost, so a sync policy would wait for its pushes for ever.
    for (bool first = true;; first = false) {
      if (abandoned_ && !first) return;
      const bool leaving = stopping_ && !abandoned_;
      lock.unlock();
      std::set<std::uint32_t> lost;
      bool chief_lost = false;
      std::vector<std::optional<Stats>> stats;
      std::vector<std::uint32_t> workers;
      const auto sent = std::chrono::steady_clock::now();
      const bool heard = send_all(leaving, lost, chief_lost, stats, workers);
      lock.lock();
      if (heard) heard_at_ = sent;
      stats_.resize(std::max(stats_.size(), stats.size()));
      for (std::size_t ps = 0; ps < stats.size(); ++ps) {
        if (stats[ps]) stats_[ps] = stats[ps];
        if (!member(static_cast<std::uint32_t>(ps))) stats_[ps].reset();  // left the job
      }
      if (heard) {
        lost_.assign(lost.begin(), lost.end());
        if (!workers.empty()) workers_ = std::move(workers);
        ++beats_;
        if (chief_lost != chief_lost_ && !leaving) {
          log(chief_lost ? LogLevel::kWarning : LogLevel::kInfo,
              who_ + (chief_lost ? ": the ps tasks hold the chief lost: they keep the model and wait for a chief "
                                "to come back"
                              : ": the chief is back"));
        }
        chief_lost_ = chief_lost;
      }
      if (leaving) return;
      wake_.wait_for(lock, interval_, [this] { return stopping_; });
    }
  }

  /// One Heartbeat to every ps, answered within an interval or given up; true if any
  /// answered. A ps that is down, or refuses, is simply not heard this time.
  bool send_all(bool leaving, std::set<std::uint32_t>& lost, bool& chief_lost,
                std::vector<std::optional<Stats>>& counters, std::vector<std::uint32_t>& workers) noexcept {
    try {
      std::vector<std::optional<PendingCall>> calls(transport_.num_ps());
      for (std::size_t ps = 0; ps < transport_.num_ps(); ++ps) {
        if (member(static_cast<std::uint32_t>(ps))) calls[ps].emplace(transport_.call(ps, Heartbeat{worker_, leaving}, {}));
      }
      const auto deadline = std::chrono::steady_clock::now() + interval_;
      bool heard = false;
      counters.resize(calls.size());
      for (std::size_t ps = 0; ps < calls.size(); ++ps) {
        if (!calls[ps]) continue;
        PendingCall& call = *calls[ps];
        if (!call.wait_until(deadline)) {
          call.cancel();
          continue;
        }
        const Response answer = call.take();
        if (const auto* stats = std::get_if<StatsReply>(&answer)) {
          heard = true;
          counters[ps] = stats->stats;
          lost.insert(stats->lost.begin(), stats->lost.end());
          chief_lost = chief_lost || stats->chief_lost;
          if (workers.empty()) workers = stats->workers;  // the first member's word
          if (!stats->members.empty() && stats->membership > membership_) {
            std::vector<std::uint32_t> before = members_;  // (none heard yet: every ps task)
            for (std::uint32_t k = 0; membership_ == 0 && k < transport_.num_ps(); ++k)
              before.push_back(k);
            reach_all(transport_, stats->ps_addresses);  // a ps that joined (throws: next beat)
            first_look_ = !membership_heard_;
            // (A take-back keeps the members: a ps that left or joined renews nothing.)
            if (stats->members == before || first_look_) renewals_left_ = kRenewals;
            members_ = stats->members;  // beaten from the next beat on
            membership_ = stats->membership;
            copies_placed_ = false;
          }
          membership_heard_ = true;
        }
      }
      // Copies that moved with the membership, after every answer is read (a link may move).
      if (!copies_placed_) {
        place_copies(transport_, members_);
        copies_placed_ = true;
      }
      // A ps the chief took back hears this task again: after every answer is read (it may
      // connect anew), and tried again at the next beats while it finds none to serve again.
      if (renewals_left_ > 0)
        renewals_left_ = renew_copies(transport_, first_look_) ? 0 : renewals_left_ - 1;
      return heard;
    } catch (...) {  // no memory, a transport that throws: try again next beat
      return false;
    }
  }

  /// True if ps task `ps` is a member of the job, as the replies last said.
  [[nodiscard]] bool member(std::uint32_t ps) const {
    return membership_ == 0 || std::binary_search(members_.begin(), members_.end(), ps);
  }

  std::uint32_t worker_;
  std::chrono::milliseconds interval_;
  std::vector<std::uint32_t> members_;  ///< the job's ps tasks (the beating thread's own)
  std::uint64_t membership_ = 0;        ///< their version: 0, every ps task of the cluster
  /// Beats left that renew copies given up (`renew_copies`) since the membership changed.
  static constexpr int kRenewals = 5;
  int renewals_left_ = 0;
  bool membership_heard_ = false;  ///< a ps told this sender the membership (Client's likewise)
  bool first_look_ = false;  ///< the renewals are of the first membership heard (renew_copies)
  bool copies_placed_ = true;  ///< place_copies took the membership heard last
  T transport_;
  std::string who_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool abandoned_ = false;  ///< stopping without the goodbye (`abandon`)
  std::vector<std::uint32_t> lost_;
  std::vector<std::uint32_t> workers_;  ///< the job's workers, once they changed
  bool chief_lost_ = false;
  std::uint64_t beats_ = 0;
  std::vector<std::optional<Stats>> stats_;
  std::chrono::steady_clock::time_point heard_at_{};
  std::thread thread_;
};

}  // namespace pulley
