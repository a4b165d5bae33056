// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "pulley/core/spin.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

// A call is one request in flight and its answer to come. The caller holds a PendingCall
// (one call) or a CallGroup (several, call_group.hpp); a transport holds the shared
// CallControl, which it derives its per-call state from.

class CallControl;

/// Wakes a thread that waits for any of several calls: each answer bumps a count. An answer
/// nobody waits for yet costs no lock.
class CallSignal {
 public:
  /// One more answer arrived.
  void notify() {
    count_.fetch_add(1);
    if (waiters_.load() > 0) {
      std::scoped_lock lock(mutex_);  // a waiter between its check and its sleep holds it
      changed_.notify_all();
    }
  }
  /// Answers so far.
  [[nodiscard]] std::uint64_t count() const { return count_.load(); }
  /// Waits until `count()` differs from `seen` or `deadline` passes: first for up to
  /// spin_before_sleep() without sleeping (spin_until), then asleep.
  void wait_until(std::uint64_t seen, std::chrono::steady_clock::time_point deadline) {
    const auto changed = [&] { return count_.load() != seen; };
    if (spin_until(changed,
                   std::min(deadline, std::chrono::steady_clock::now() + spin_before_sleep())))
      return;
    std::unique_lock lock(mutex_);
    waiters_.fetch_add(1);
    changed_.wait_until(lock, deadline, changed);
    waiters_.fetch_sub(1);
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::atomic<std::uint64_t> count_{0};
  std::atomic<int> waiters_{0};
};

/// The part of a transport that needs the caller's thread. A transport with no thread of its
/// own (Tcp) moves its I/O forward while its caller waits, and cuts a transfer under way
/// when its caller gives up on it. A transport that answers on threads of its own
/// (InProcess) has no driver.
class CallDriver {
 public:
  /// Runs the transport's I/O on this thread until `done()` (checked after each I/O event)
  /// or until `deadline` passes.
  virtual void run_until(const std::function<bool()>& done,
                         std::chrono::steady_clock::time_point deadline) = 0;
  /// `call`'s caller gives up while the transport uses its buffers (see `CallControl::cancel`):
  /// end that use now, e.g. by closing a connection that stalled mid-frame.
  virtual void abort(CallControl& call) = 0;

 protected:
  ~CallDriver() = default;
};

/// What a caller and a transport share about one call: its answer, and whether the caller
/// gave up.
///
/// Transport side: `answer` once; bracket every use of the request's views or the reply
/// targets with `begin_use`/`end_use` (or `unless_cancelled`), and begin none after the
/// caller gave up. Caller side: through PendingCall or CallGroup. The caller sees the call
/// `answered` only once it has its answer and no use is under way, so acting on an answer
/// (freeing buffers) never races a transport thread that still touches them.
class CallControl {
 public:
  explicit CallControl(CallDriver* driver = nullptr) noexcept : driver_(driver) {}
  CallControl(const CallControl&) = delete;
  CallControl& operator=(const CallControl&) = delete;

  // ---- transport side ---------------------------------------------------------------------

  /// Starts using the call's buffers unless the caller gave up; pair with `end_use`. A use
  /// may span several asynchronous steps (a gather-write, a scatter-read).
  bool begin_use() {
    std::scoped_lock lock(mutex_);
    if (cancelled_) return false;
    ++users_;
    return true;
  }
  /// Ends a use begun with `begin_use`.
  void end_use() {
    std::scoped_lock lock(mutex_);
    if (--users_ == 0) {
      changed_.notify_all();
      settle();
    }
  }
  /// Runs `f` inside one use unless the caller gave up; true if it ran. Re-entrant.
  template <class F>
  bool unless_cancelled(F&& f) {
    if (!begin_use()) return false;
    struct End {
      CallControl* c;
      ~End() { c->end_use(); }
    } end{this};
    std::forward<F>(f)();
    return true;
  }
  /// Sets the answer, unless the call has one or its caller gave up; true if this one is it.
  /// Wakes the caller once no use is under way.
  bool answer(Response&& response) {
    std::scoped_lock lock(mutex_);
    if (cancelled_ || has_answer_) return false;
    response_ = std::move(response);
    has_answer_.store(true, std::memory_order_release);
    settle();
    return true;
  }
  /// True once the call has an answer, whether or not a use is still under way. Takes no
  /// lock.
  [[nodiscard]] bool has_answer() const { return has_answer_.load(std::memory_order_acquire); }
  /// The transport is going away: it answered every call it held or ended their uses, and
  /// neither waiting nor cancelling may reach it any more.
  void detach_driver() {
    std::scoped_lock lock(mutex_);
    driver_ = nullptr;
  }

  // ---- caller side ------------------------------------------------------------------------

  /// True once the call has its answer and no use of its buffers is under way (and stays
  /// true after `take`). Takes no lock.
  [[nodiscard]] bool answered() const { return answered_.load(std::memory_order_acquire); }
  /// The transport's driver, or null (then answers come from other threads).
  [[nodiscard]] CallDriver* driver() const {
    std::scoped_lock lock(mutex_);
    return driver_;
  }
  /// `signal` is notified when the call turns `answered` (null: nothing is); it is notified
  /// at once if it is already. Returns the transport's driver, or null.
  CallDriver* watch(CallSignal* signal) {
    std::scoped_lock lock(mutex_);
    signal_ = signal;
    if (signal_ != nullptr && answered_) signal_->notify();
    return driver_;
  }
  /// Waits until the call is answered or `deadline` passes; true if it is answered. With a
  /// driver, the waiting thread runs the transport's I/O meanwhile.
  bool wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    if (answered_) return true;
    if (CallDriver* driver = driver_) {
      lock.unlock();
      driver->run_until([this] { return answered(); }, deadline);
      return answered();
    }
    return changed_.wait_until(lock, deadline, [&] { return answered_.load(); });
  }
  /// The answer, once the call is answered; only once.
  Response take() {
    std::scoped_lock lock(mutex_);
    return std::move(*response_);
  }
  /// Gives the call up: ends a use under way (the driver's `abort`) and waits until no use is
  /// left; afterwards the transport begins none, so the caller may free the request's
  /// buffers and the reply targets. An answer that arrives later is dropped. Every caller
  /// of `cancel` waits, the second one too.
  void cancel() {
    CallDriver* driver = nullptr;
    {
      std::scoped_lock lock(mutex_);
      signal_ = nullptr;
      if (!cancelled_ && users_ > 0) driver = driver_;
      cancelled_ = true;
    }
    if (driver != nullptr) driver->abort(*this);
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return users_ == 0; });
  }

 protected:
  ~CallControl() = default;  // owned through the transport's derived per-call state

 private:
  /// The caller may act on the answer once there is one and no use is under way. The caller
  /// holds `mutex_`.
  void settle() {
    if (!has_answer_ || users_ > 0 || answered_) return;
    answered_.store(true, std::memory_order_release);
    changed_.notify_all();
    if (signal_ != nullptr) signal_->notify();
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;  ///< an answer settled, or the last use ended
  std::optional<Response> response_;
  CallDriver* driver_;  ///< for the call's whole life: a use may outlast the answer
  CallSignal* signal_ = nullptr;
  int users_ = 0;
  std::atomic<bool> has_answer_{false};  ///< set under `mutex_`, read without it
  std::atomic<bool> answered_{false};    ///< has an answer and no use: set under `mutex_`
  bool cancelled_ = false;
};

/// One call in flight, as its caller holds it: the answer to come, and the way to give it
/// up. A call whose transport has a driver (Tcp) is waited on by the thread that uses the
/// transport, while the transport lives. To wait for several calls, use a CallGroup.
class PendingCall {
 public:
  using Clock = std::chrono::steady_clock;

  explicit PendingCall(std::shared_ptr<CallControl> control) : control_(std::move(control)) {}
  PendingCall(PendingCall&&) noexcept = default;
  PendingCall& operator=(PendingCall&&) noexcept = default;
  /// One caller per call: a copy could give it up behind its other holder's back.
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;

  /// Waits until the answer is there or `deadline` passes; true if it is there.
  bool wait_until(Clock::time_point deadline) { return control_->wait_until(deadline); }
  /// Waits at most `timeout`; true if the answer is there.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) {
    return wait_until(Clock::now() + timeout);
  }
  /// True if the answer is there, without blocking (a driver handles what already arrived).
  bool ready() { return wait_until(Clock::time_point::min()); }
  /// Waits as long as it takes and returns the answer (only once).
  Response get() {
    while (!wait_until(Clock::now() + std::chrono::hours(1))) {
    }
    return control_->take();
  }
  /// The answer, once `wait_until` or `ready` returned true (only once).
  Response take() { return control_->take(); }
  /// Gives the call up (`CallControl::cancel`): when it returns, the transport no longer
  /// touches the request's buffers or the reply targets.
  void cancel() { control_->cancel(); }
  /// The shared state, for a CallGroup.
  [[nodiscard]] CallControl& control() const noexcept { return *control_; }

 private:
  std::shared_ptr<CallControl> control_;
};

}  // namespace pulley
