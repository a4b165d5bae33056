// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// A set of calls awaited together, with one deadline: the answer of every call, or the
/// first error among them, whichever comes first. The calls are those of one transport
/// (one driver, or none).
///
/// It never returns or throws while a call may still touch its caller's buffers: at the
/// deadline, at the first error (a refused push, a dead ps: the other answers need not be
/// awaited), and when the group is destroyed, the unfinished calls are cancelled first.
///
///     CallGroup group;
///     for (std::size_t ps = 0; ps < transport.num_ps(); ++ps)
///       group.add(transport.call(ps, GetStats{}));
///     group.wait(std::chrono::seconds(10), "stats");   // throws pulley::Error
///     StatsReply first = group.take_as<StatsReply>(0);
class CallGroup {
 public:
  using Clock = std::chrono::steady_clock;

  CallGroup() = default;
  CallGroup(const CallGroup&) = delete;
  CallGroup& operator=(const CallGroup&) = delete;
  ~CallGroup() { cancel(); }

  /// Adds a call; returns its index. Throws kInvalidArgument for a call of another
  /// transport than the group's first.
  std::size_t add(PendingCall call) {
    calls_.reserve(calls_.size() + 1);  // nothing below throws once the call is watched
    answers_.reserve(answers_.size() + 1);
    CallDriver* driver = call.control().watch(&signal_);
    // A driver runs only its own transport's I/O: it would not see another transport's
    // answer, nor one from another thread.
    const bool threaded = driver == nullptr && !call.control().answered();
    if ((driver != nullptr && driver_ != nullptr && driver != driver_) ||
        (driver != nullptr && threaded_) || (threaded && driver_ != nullptr)) {
      call.control().watch(nullptr);
      call.cancel();
      throw Error(ErrorCode::kInvalidArgument, "a CallGroup waits for calls of one transport");
    }
    if (driver != nullptr) driver_ = driver;
    threaded_ = threaded_ || threaded;
    calls_.push_back(std::move(call));
    answers_.emplace_back();
    return calls_.size() - 1;
  }

  /// Number of calls in the group.
  [[nodiscard]] std::size_t size() const noexcept { return calls_.size(); }

  /// Waits until every call is answered. Throws the first ErrorReply as an Error, or
  /// kDeadlineExceeded ("<what>: no answer within <timeout> ms") once `timeout` passes; the
  /// calls still unanswered are cancelled before it throws.
  void wait(std::chrono::milliseconds timeout, std::string_view what) {
    if (wait_for(timeout)) return;
    cancel();
    throw Error(ErrorCode::kDeadlineExceeded, std::string(what) + ": no answer within " +
                                                  std::to_string(timeout.count()) + " ms");
  }

  /// Waits at most `timeout` for every call to be answered; true if they are. Throws the
  /// first ErrorReply as an Error (cancelling the rest first); at the timeout the calls
  /// stay in flight, to be waited for again or cancelled.
  bool wait_for(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    try {
      for (;;) {
        const std::uint64_t seen = signal_.count();
        if (collect()) return true;
        if (Clock::now() >= deadline) return false;
        if (driver_ != nullptr) {
          driver_->run_until([&] { return signal_.count() != seen; }, deadline);
        } else {
          signal_.wait_until(seen, deadline);
        }
      }
    } catch (...) {
      cancel();
      throw;
    }
  }

  /// True when every call is answered, without blocking (a driver handles what arrived);
  /// throws the first error as `wait` does.
  bool ready() {
    // A deadline in the past: the driver handles what arrived, and returns.
    if (driver_ != nullptr) driver_->run_until([] { return false; }, Clock::time_point::min());
    try {
      return collect();
    } catch (...) {
      cancel();
      throw;
    }
  }

  /// The answer of call `i`, after `wait` (moved out: once).
  Response take(std::size_t i) { return std::move(*answers_.at(i)); }
  /// The answer of call `i` as reply type R (`expect`).
  template <class R>
  R take_as(std::size_t i) {
    return expect<R>(take(i));
  }

  /// Gives every unanswered call up (`PendingCall::cancel`): when it returns, no transport
  /// touches their buffers any more. (An answered call's transport touches them no more
  /// already: the Transport contract.)
  void cancel() noexcept {
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      if (answers_[i]) continue;  // taken: answered, and its signal will not be used again
      calls_[i].control().watch(nullptr);
      calls_[i].cancel();
    }
  }

 private:
  /// Takes the answers that arrived; true once all have. Throws the first error.
  bool collect() {
    bool all = true;
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      if (!answers_[i]) {
        if (!calls_[i].control().answered()) {
          all = false;
          continue;
        }
        answers_[i] = calls_[i].take();
      }
      if (const auto* error = std::get_if<ErrorReply>(&*answers_[i])) {
        throw Error(error->code, error->message);
      }
    }
    return all;
  }

  CallSignal signal_;
  CallDriver* driver_ = nullptr;  ///< the calls' transport runs its I/O on the waiting thread
  bool threaded_ = false;         ///< a call is answered from another thread
  std::vector<PendingCall> calls_;
  std::vector<std::optional<Response>> answers_;
};

}  // namespace pulley
