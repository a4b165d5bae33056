// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "pulley/client/options.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"

namespace pulley::detail {

/// A client's wait for lost ps tasks to come back: retries with a growing pause (0.1 s to
/// 2 s), logs the first failure, and gives up once `ClientOptions::recovery_timeout` has
/// passed since it, naming the last failure. A failure after the ps tasks answered again
/// (`answered`) is a fault of its own, whose deadline runs from it; after `kMaxAnswered`
/// of those the deadline runs on (a call that breaks whenever it is made ends in time).
class Recovery {
 public:
  using Clock = std::chrono::steady_clock;

  /// @param who "worker 2", "chief": who waits, for the log and the error
  Recovery(std::string who, const ClientOptions& options)
      : who_(std::move(who)), timeout_(options.recovery_timeout), deadline_(Clock::now() + timeout_) {}

  /// True for what a lost ps gives: `kUnavailable` (it is gone, or not reachable). (A
  /// ps restarted and not restored yet, or restored since the request's epoch, answers
  /// `kFailedPrecondition`: a client tells that from a request it got wrong by waiting
  /// until ready and seeing whether the epoch moved.)
  static bool may_recover(ErrorCode code) noexcept { return code == ErrorCode::kUnavailable; }

  /// Pauses before the next try after `failure`; throws kUnavailable once the deadline
  /// has passed.
  void wait(const Error& failure) {
    const std::string seconds = std::to_string(timeout_.count() / 1000);
    if (tries_++ == 0) {
      log(LogLevel::kWarning, who_ + ": " + failure.what() + "; waiting for the ps tasks to be back " +
                                  "(at most " + seconds + " s)");
    }
    const auto now = Clock::now();
    if (std::exchange(answered_, false) && answers_ < kMaxAnswered) {
      ++answers_;
      deadline_ = now + timeout_;
      pause_ = std::chrono::milliseconds(100);
    }
    if (now >= deadline_) {
      throw Error(ErrorCode::kUnavailable,
                  who_ +
                      (answers_ < kMaxAnswered
                           ? ": the ps tasks were not back within " + seconds + " s ("
                           : ": the ps tasks answered again " + std::to_string(answers_) +
                                 " times, and the call broke each time (") +
                      std::to_string(tries_) + " tries); last: " + failure.what());
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause_, deadline_ - now));
    pause_ = std::min<std::chrono::milliseconds>(pause_ * 2, std::chrono::seconds(2));
  }

  /// The ps tasks answered since the last failure: the next one is a fault of its own, with
  /// its own deadline and pauses.
  void answered() noexcept { answered_ = true; }

  /// How many times `answered` gives a failure a deadline of its own.
  static constexpr int kMaxAnswered = 20;

  /// Time since the wait began (or since the ps tasks last answered).
  [[nodiscard]] Clock::duration waited() const noexcept { return Clock::now() - (deadline_ - timeout_); }

  /// Tries so far.
  [[nodiscard]] int tries() const noexcept { return tries_; }

 private:
  std::string who_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  std::chrono::milliseconds pause_{100};
  int tries_ = 0;
  int answers_ = 0;  ///< failures given a deadline of their own
  bool answered_ = false;
};

}  // namespace pulley::detail
