// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/core/log.hpp"
#include "pulley/transport/tcp_options.hpp"

namespace pulley {

/// The chief's rulings on lost ps processes, in a job whose ps tasks keep copies of each
/// other's shards (`--ps-replicas 1`): the one place that decides which copies the job
/// gives up, so that no task gives up a copy the others still write to (TcpOptions::
/// copy_referee). A task that cannot reach a ps process asks: the chief's own transports
/// through `referee()`, every other task at the chief's JoinDesk (LostPs). The chief then
/// looks at the ps's address itself (`LookAt`; the role runner's is probe_ps: TCP, the
/// handshake only), and rules by what it sees, not by what it was told:
///   - that very process serves there: not lost; the asker is the one cut off (a network
///     partition), and waits for it as for a ps without copies (its workers are held lost
///     by that ps if the cut outlasts the worker timeout, as without copies);
///   - another process serves there: the one asked about is gone (a task gives a process
///     replaced so up by itself; nothing is ruled);
///   - the address refuses connections, or something else answers there: lost;
///   - nothing can be told (no connection, no handshake, a connection cut short): lost once
///     the chief's looks have seen nothing for `silence` (the copy timeout), not lost until
///     then, so that a ps busy or paused for a moment is not given up.
/// A ruling "lost" is for good: every task that asks about that process later hears the
/// same. A task that lies (it holds the job's secret) cannot have a live process ruled
/// lost: the chief looks for itself.
///
/// A process ruled lost may come back (stopped or hung past the copy timeout, then
/// continued; a cut that healed). No task reaches it any more, and its copies are old.
/// While the chief's loop finds every copy it holds given up and nothing to take back
/// there, it asks for it (`revive`, every 2 s), and a process ruled lost that serves there
/// is told to start again empty (`Tell`; Shutdown::restart): the chief then takes it back
/// as a process started in its place (Chief::take_back). At the end of training
/// (`finish`) whichever process serves such an address hears that training finished.
///
/// Thread-safe: the desk asks on its server's thread, the chief's transports on theirs;
/// looks run on a thread of its own, one at a time. A question whose look has not come back
/// is answered later (`referee()`), or "ask again" (`rule`).
class CopyRulings : public std::enable_shared_from_this<CopyRulings> {
 public:
  /// What a look at ps task `ps`'s address found.
  struct Sight {
    enum class Kind : std::uint8_t { kServes, kGone, kSilent };
    Kind kind = Kind::kSilent;
    std::uint64_t process = 0;  ///< kServes: the process that proved itself that ps
    std::string detail;         ///< what was seen, for the log
    /// kSilent: a connection was made (a process is there, stopped or hung) though nothing
    /// could be told.
    bool reached = false;
  };
  /// Looks at ps task `ps`'s address once (the role runner's: probe_ps, within the attempt
  /// timeout).
  using LookAt = std::function<Sight(std::uint32_t ps)>;
  /// Tells the process that serves ps task `ps`'s address, if it is one of `only` (any,
  /// when empty), to start again empty (`restart`) or that training finished, and returns
  /// what it saw there as a look does (kServes: that process, told if one of `only`). The
  /// role runner's: tell_ps, within the attempt timeout.
  using Tell =
      std::function<Sight(std::uint32_t ps, const std::set<std::uint64_t>& only, bool restart)>;
  /// A ruling, and why, in words for the asker's log.
  struct Ruling {
    bool lost = false;
    std::string why;
  };

  /// @param num_ps  the job's ps tasks: a question about another is answered "not lost"
  /// @param look_at how the chief looks at a ps's address
  /// @param silence how long the chief's looks may see nothing before a process is lost
  /// @param tell    how the chief speaks to a process ruled lost that comes back (none:
  ///                it is never told anything)
  CopyRulings(std::uint32_t num_ps, LookAt look_at, std::chrono::milliseconds silence,
              Tell tell = {})
      : num_ps_(num_ps), look_at_(std::move(look_at)), silence_(silence), tell_(std::move(tell)) {}
  CopyRulings(const CopyRulings&) = delete;
  CopyRulings& operator=(const CopyRulings&) = delete;
  ~CopyRulings() {
    {
      const std::scoped_lock lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    revive_wake_.notify_all();
    if (looking_.joinable()) looking_.join();
    if (reviving_.joinable()) reviving_.join();
    for (auto& [ps, waiting] : waiting_) {  // (no transport of the chief asks any more)
      for (auto& [lost, answer] : waiting) answer(false);
    }
  }

  /// The referee of the chief's own transports: the same rulings, answered once the chief
  /// has looked. (Made by std::make_shared: the referee holds it.)
  [[nodiscard]] CopyReferee referee() {
    return [self = shared_from_this()](const LostProcess& lost, std::function<void(bool)> answer) {
      if (const std::optional<Ruling> ruling = self->rule(lost, &answer)) answer(ruling->lost);
    };
  }

  /// The job has `num_ps` ps tasks now (one joined: Chief::join): questions about it are
  /// ruled from now on (`look_at` must then look at its address).
  void grow(std::uint32_t num_ps) noexcept {
    std::uint32_t known = num_ps_.load();
    while (known < num_ps && !num_ps_.compare_exchange_weak(known, num_ps)) {
    }
  }

  /// The ruling on a task's question, or nullopt while the chief looks at the ps's address
  /// (ask again).
  std::optional<Ruling> rule(const LostProcess& lost) { return rule(lost, nullptr); }

  /// The chief's loop gave up every copy ps `ps`'s process holds (no shard is read there as
  /// its last copy) and found no process to take back there: a process ruled lost that
  /// serves its address is told to start again empty, once, on a thread of its own (a look
  /// at a process still stopped lasts the attempt timeout: the loop must not wait on it).
  void revive(std::uint32_t ps) {
    const std::scoped_lock lock(mutex_);
    const auto lost = lost_.find(ps);
    if (!tell_ || stop_ || stop_reviving_ || lost == lost_.end() || lost->second.empty()) return;
    revive_.insert(ps);
    if (!reviving_.joinable()) reviving_ = std::thread([this] { revive_loop(); });
    revive_wake_.notify_one();
  }

  /// Training ended: whichever process serves the address of a ps a process of which was
  /// ruled lost hears it (one ruled lost that lives on, or one started again that the
  /// chief did not take back yet, would wait for a chief until its recovery timeout, then
  /// fail; a member hears it twice). Looks for processes coming back end first. Where a
  /// process is there but does not answer (a look's connection is taken, its handshake is
  /// not: a process stopped or hung when training ended), it is told again every second
  /// for up to `grace` (the role runner's: the recovery timeout, as long as such a process
  /// would wait for a chief once continued); an address that refuses or takes no
  /// connection is told once.
  void finish(std::chrono::milliseconds grace = std::chrono::milliseconds(0)) {
    {
      const std::scoped_lock lock(mutex_);
      stop_reviving_ = true;
    }
    revive_wake_.notify_all();
    if (reviving_.joinable()) reviving_.join();
    if (!tell_) return;
    const auto deadline = Clock::now() + grace;
    std::vector<std::uint32_t> left = ruled_lost();
    for (bool said = false; !left.empty();) {
      std::vector<std::uint32_t> there;  // a process there that did not answer
      for (const std::uint32_t ps : left) {
        const std::set<std::uint64_t> lost = processes(ps);
        const Sight seen = told(ps, {}, false);
        const std::string who = "ps " + std::to_string(ps) + "'s process";
        if (seen.kind == Sight::Kind::kServes && lost.contains(seen.process)) {
          log(LogLevel::kInfo,
              "chief: told " + who + " (" + seen.detail +
                  "), given up for the job and still alive, that training finished");
        } else if (seen.kind == Sight::Kind::kSilent && seen.reached) {
          there.push_back(ps);
          if (!said && grace.count() > 0) {
            log(LogLevel::kInfo,
                "chief: " + who +
                    ", given up for the job, takes connections but does not answer (" +
                    seen.detail +
                    "; stopped or hung?): it is told that training finished if it answers within " +
                    std::to_string(grace.count()) + " ms");
          }
        }
      }
      said = true;
      const auto now = Clock::now();
      if (there.empty() || now >= deadline) {
        for (const std::uint32_t ps : there) {
          log(LogLevel::kWarning, "chief: ps " + std::to_string(ps) +
                                      "'s process, given up for the job, never answered: it was "
                                      "not told that training finished");
        }
        return;
      }
      std::this_thread::sleep_for(
          std::min<Clock::duration>(deadline - now, std::chrono::seconds(1)));
      left = std::move(there);
    }
  }

  /// The ps tasks a process of which was ruled lost, ascending.
  [[nodiscard]] std::vector<std::uint32_t> ruled_lost() const {
    const std::scoped_lock lock(mutex_);
    std::vector<std::uint32_t> tasks;
    for (const auto& [ps, processes] : lost_) {
      if (!processes.empty()) tasks.push_back(ps);
    }
    return tasks;
  }

 private:
  using Clock = std::chrono::steady_clock;
  /// A look answers the questions of this long after it (one look serves every task that
  /// lost the same process at once).
  static constexpr std::chrono::seconds kFresh{1};

  struct Look {
    Clock::time_point at;
    Sight sight;
    Clock::time_point silent_since;  ///< kSilent: since the first of the silent looks in a row
  };

  /// rule(lost); when the chief must look first and `park` is given, *park is moved to wait
  /// for that look, under the same lock that queues it (so no look can finish in between
  /// and leave it unanswered).
  std::optional<Ruling> rule(const LostProcess& lost, std::function<void(bool)>* park) {
    if (lost.ps >= num_ps_) return Ruling{false, "the job has no ps " + std::to_string(lost.ps)};
    const auto now = Clock::now();
    std::unique_lock lock(mutex_);
    if (lost.process != 0 && lost_[lost.ps].contains(lost.process)) {
      return Ruling{true, "the chief ruled it lost for the job"};
    }
    const auto seen = looks_.find(lost.ps);
    if (seen == looks_.end() || now - seen->second.at > kFresh) {
      if (park != nullptr) waiting_[lost.ps].emplace_back(lost, std::move(*park));
      if (std::find(queue_.begin(), queue_.end(), lost.ps) == queue_.end()) queue_.push_back(lost.ps);
      if (!looking_.joinable()) looking_ = std::thread([this] { look_loop(); });
      lock.unlock();
      wake_.notify_one();
      return std::nullopt;
    }
    const Look look = seen->second;
    lock.unlock();
    switch (look.sight.kind) {
      case Sight::Kind::kServes:
        if (lost.process == 0 || look.sight.process == lost.process) return Ruling{false, "the chief reaches it"};
        return Ruling{true, "another process serves its address: the one this task reached is gone"};
      case Sight::Kind::kGone:
        if (lost.process != 0) rule_lost(lost.ps, lost.process, look.sight.detail);
        return Ruling{true, "the chief ruled it lost for the job (" + look.sight.detail + ")"};
      case Sight::Kind::kSilent:
        break;
    }
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - look.silent_since);
    if (silent < silence_) {
      return Ruling{false, "the chief cannot reach it either (" + look.sight.detail + ", for " +
                               std::to_string(silent.count()) + " ms): it gives it up once that lasts " +
                               std::to_string(silence_.count()) + " ms"};
    }
    if (lost.process != 0) {
      rule_lost(lost.ps, lost.process, look.sight.detail + " for " + std::to_string(silent.count()) + " ms");
    }
    return Ruling{true, "the chief ruled it lost for the job (silent for " + std::to_string(silent.count()) + " ms)"};
  }

  /// Process `process` of ps `ps` is lost for the job, for `why`: logged once.
  void rule_lost(std::uint32_t ps, std::uint64_t process, const std::string& why) {
    {
      const std::scoped_lock lock(mutex_);
      if (!lost_[ps].insert(process).second) return;
    }
    log(LogLevel::kWarning, "chief: ps " + std::to_string(ps) + "'s process is lost for the job (the chief's look: " +
                                why + "): every task gives up the copies it held, and the other copies serve alone");
  }

  void look_loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      const std::uint32_t ps = queue_.front();
      queue_.pop_front();
      lock.unlock();
      const auto began = Clock::now();
      Sight sight;
      try {
        sight = look_at_(ps);
      } catch (const std::exception& e) {
        sight = Sight{Sight::Kind::kSilent, 0, e.what()};
      }
      lock.lock();
      const auto now = Clock::now();
      Look& look = looks_[ps];
      // Silence counts from the first of silent looks in a row (the askers look again every
      // second or so: a gap between two looks longer than the limit starts it again; a look
      // itself may last longer, an attempt timeout at a process that never answers).
      const bool silent_before = look.sight.kind == Sight::Kind::kSilent &&
                                 look.at != Clock::time_point{} && began - look.at < silence_;
      if (sight.kind != Sight::Kind::kSilent || !silent_before) look.silent_since = began;
      look.at = now;
      look.sight = std::move(sight);
      // The chief's own transports that asked about this ps hear the ruling now.
      std::vector<std::pair<LostProcess, std::function<void(bool)>>> waiting = std::move(waiting_[ps]);
      waiting_.erase(ps);
      lock.unlock();
      for (auto& [lost, answer] : waiting) {
        const std::optional<Ruling> ruling = rule(lost);
        answer(ruling && ruling->lost);
      }
      lock.lock();
    }
  }

  /// The processes of ps `ps` ruled lost.
  [[nodiscard]] std::set<std::uint64_t> processes(std::uint32_t ps) const {
    const std::scoped_lock lock(mutex_);
    const auto found = lost_.find(ps);
    return found == lost_.end() ? std::set<std::uint64_t>{} : found->second;
  }

  /// tell_, with what it throws as a silent look.
  Sight told(std::uint32_t ps, const std::set<std::uint64_t>& only, bool restart) {
    try {
      return tell_(ps, only, restart);
    } catch (const std::exception& e) {
      return Sight{Sight::Kind::kSilent, 0, e.what()};
    }
  }

  /// Looks at the address of each ps `revive` asked for, and tells a process ruled lost
  /// there to start again (each such process once).
  void revive_loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      revive_wake_.wait(lock, [&] { return stop_ || stop_reviving_ || !revive_.empty(); });
      if (stop_ || stop_reviving_) return;
      const std::uint32_t ps = *revive_.begin();
      revive_.erase(revive_.begin());
      std::set<std::uint64_t> lost;
      std::set_difference(lost_[ps].begin(), lost_[ps].end(), restarted_.begin(), restarted_.end(),
                          std::inserter(lost, lost.end()));
      if (lost.empty()) continue;
      lock.unlock();
      const Sight seen = told(ps, lost, true);
      const bool restarted = seen.kind == Sight::Kind::kServes && lost.contains(seen.process);
      if (restarted) {  // (logged before the lock: a ruling asked meanwhile waits on no write)
        log(LogLevel::kWarning, "chief: ps " + std::to_string(ps) +
                                    "'s process, ruled lost for the job, answers again (" +
                                    seen.detail +
                                    "): told it to start again empty, to be taken back");
      }
      lock.lock();
      if (restarted) restarted_.insert(seen.process);
    }
  }

  std::atomic<std::uint32_t> num_ps_;
  const LookAt look_at_;
  const std::chrono::milliseconds silence_;
  const Tell tell_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;                           ///< the looks' (look_loop)
  std::condition_variable revive_wake_;                    ///< revive_loop's
  std::map<std::uint32_t, std::set<std::uint64_t>> lost_;  ///< by ps: processes ruled lost
  std::map<std::uint32_t, Look> looks_;                    ///< by ps: the last look
  std::deque<std::uint32_t> queue_;                        ///< ps tasks to look at
  /// By ps: the chief's own transports' questions waiting for its look.
  std::map<std::uint32_t, std::vector<std::pair<LostProcess, std::function<void(bool)>>>> waiting_;
  std::set<std::uint32_t> revive_;     ///< ps tasks `revive` asked for, not looked at yet
  std::set<std::uint64_t> restarted_;  ///< processes ruled lost told to start again
  bool stop_ = false;
  bool stop_reviving_ = false;  ///< training ended (finish)
  std::thread looking_;         ///< started at the first question that needs a look
  std::thread reviving_;        ///< started at the first `revive` (revive_loop)
};

}  // namespace pulley
