// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
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
/// copy_referee). A task that cannot reach a ps process asks (LostPs, at the chief's
/// JoinDesk); the chief rules it lost when it finds the same:
///   - its own transports found that process lost (they ask `own()`, whose every answer is
///     "lost": the chief's view is the job's);
///   - or a look at the ps's address (`LookAt`; the role runner's is probe_ps: TCP, the
///     handshake only) finds it refusing connections or silent (or held by another
///     process: the one asked about is gone, though nothing is ruled for it);
/// and not lost when the look reaches that very process: the asker is the one cut off (a
/// network partition), and waits for it as for a ps without copies (its workers are held
/// lost by the ps if the cut outlasts the worker timeout, as without copies). A ruling
/// "lost" is for good: every task that asks about that process later hears the same. A
/// task that lies (it holds the job's secret) cannot have a live process ruled lost: the
/// chief looks for itself.
///
/// Thread-safe: the desk asks on its server's thread, the chief's transports on theirs;
/// looks run on a thread of its own, one at a time, each answered "ask again" meanwhile.
class CopyRulings : public std::enable_shared_from_this<CopyRulings> {
 public:
  /// What a look at ps task `ps`'s address found.
  struct Sight {
    bool reached = false;       ///< a process answered there (else it refuses, or is silent)
    std::uint64_t process = 0;  ///< the one that proved itself that ps (0: it cannot be told)
    std::string detail;         ///< what was seen, for the log
  };
  /// Looks at ps task `ps`'s address once (the role runner's: probe_ps, bounded by the
  /// attempt timeout).
  using LookAt = std::function<Sight(std::uint32_t ps)>;

  /// @param num_ps  the job's ps tasks: a question about another is answered "not lost"
  /// @param look_at how the chief looks at a ps's address
  CopyRulings(std::uint32_t num_ps, LookAt look_at) : num_ps_(num_ps), look_at_(std::move(look_at)) {}
  CopyRulings(const CopyRulings&) = delete;
  CopyRulings& operator=(const CopyRulings&) = delete;
  ~CopyRulings() {
    {
      const std::scoped_lock lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (looking_.joinable()) looking_.join();
  }

  /// The referee of the chief's own transports: what they find lost is lost for the job.
  /// (Made by std::make_shared: the referee holds it.)
  [[nodiscard]] CopyReferee own() {
    return [self = shared_from_this()](const LostProcess& lost, const std::function<void(bool)>& answer) {
      self->rule_lost(lost.ps, lost.process, "the chief's own connections: " + lost.why);
      answer(true);
    };
  }

  /// The ruling on a task's question: true (lost for the job), false (the chief reaches
  /// that very process), or nullopt while the chief looks at its address (ask again).
  std::optional<bool> rule(const LostProcess& lost) {
    if (lost.ps >= num_ps_) return false;  // no such ps: nothing to give up
    std::unique_lock lock(mutex_);
    if (lost.process != 0 && lost_[lost.ps].contains(lost.process)) return true;
    const auto now = Clock::now();
    const auto seen = looks_.find(lost.ps);
    if (seen == looks_.end() || now - seen->second.at > kFresh) {
      if (std::find(queue_.begin(), queue_.end(), lost.ps) == queue_.end()) queue_.push_back(lost.ps);
      if (!looking_.joinable()) looking_ = std::thread([this] { look_loop(); });
      lock.unlock();
      wake_.notify_one();
      return std::nullopt;
    }
    const Sight sight = seen->second.sight;
    lock.unlock();
    if (!sight.reached) {
      if (lost.process != 0) rule_lost(lost.ps, lost.process, "the chief's look: " + sight.detail);
      return true;
    }
    // Another process holds the address: the one asked about is gone (a task gives up a
    // process replaced so by itself; nothing to rule, and nothing to log for a question
    // that may name any process).
    return lost.process != 0 && sight.process != 0 && sight.process != lost.process;
  }

 private:
  using Clock = std::chrono::steady_clock;
  /// A look answers the questions of this long after it (one look serves every task that
  /// lost the same process at once).
  static constexpr std::chrono::seconds kFresh{1};

  struct Look {
    Clock::time_point at;
    Sight sight;
  };

  /// Process `process` of ps `ps` is lost for the job, for `why`: logged once.
  void rule_lost(std::uint32_t ps, std::uint64_t process, const std::string& why) {
    {
      const std::scoped_lock lock(mutex_);
      if (!lost_[ps].insert(process).second) return;
    }
    log(LogLevel::kWarning, "chief: ps " + std::to_string(ps) + "'s process is lost for the job (" + why +
                                "): every task gives up the copies it held, and the other copies serve alone");
  }

  void look_loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      const std::uint32_t ps = queue_.front();
      queue_.pop_front();
      lock.unlock();
      Sight sight = look_at_(ps);
      lock.lock();
      looks_[ps] = Look{Clock::now(), std::move(sight)};
    }
  }

  const std::uint32_t num_ps_;
  const LookAt look_at_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<std::uint32_t, std::set<std::uint64_t>> lost_;  ///< by ps: processes ruled lost
  std::map<std::uint32_t, Look> looks_;                    ///< by ps: the last look
  std::deque<std::uint32_t> queue_;                        ///< ps tasks to look at
  bool stop_ = false;
  std::thread looking_;  ///< started at the first question that needs a look
};

}  // namespace pulley
