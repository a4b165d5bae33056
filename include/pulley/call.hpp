// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "pulley/messages.hpp"

namespace pulley {

// A call is one request in flight and its answer to come. The caller holds a PendingCall
// (one call) or a CallGroup (several, call_group.hpp); a transport holds the shared
// CallControl, which it derives its per-call state from.

class CallControl;

/// Wakes a thread that waits for any of several calls: each answer bumps a count.
class CallSignal {
 public:
  /// One more answer arrived.
  void notify() {
    {
      std::scoped_lock lock(mutex_);
      ++count_;
    }
    changed_.notify_all();
  }
  /// Answers so far.
  [[nodiscard]] std::uint64_t count() const {
    std::scoped_lock lock(mutex_);
    return count_;
  }
  /// Waits until `count()` differs from `seen` or `deadline` passes.
  void wait_until(std::uint64_t seen, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    changed_.wait_until(lock, deadline, [&] { return count_ != seen; });
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t count_ = 0;
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
/// caller gave up. Caller side: through PendingCall or CallGroup.
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
    if (--users_ == 0) changed_.notify_all();
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
  /// Wakes the caller.
  bool answer(Response&& response) {
    std::scoped_lock lock(mutex_);
    if (cancelled_ || answered_) return false;
    response_ = std::move(response);
    answered_ = true;
    changed_.notify_all();
    if (signal_ != nullptr) signal_->notify();
    return true;
  }
  /// True once the call has its answer (and stays true after `take`).
  [[nodiscard]] bool answered() const {
    std::scoped_lock lock(mutex_);
    return answered_;
  }
  /// The transport is going away: it answered every call it held or ended their uses, and
  /// neither waiting nor cancelling may reach it any more.
  void detach_driver() {
    std::scoped_lock lock(mutex_);
    driver_ = nullptr;
  }

  // ---- caller side ------------------------------------------------------------------------

  /// The transport's driver, or null (then answers come from other threads).
  [[nodiscard]] CallDriver* driver() const {
    std::scoped_lock lock(mutex_);
    return driver_;
  }
  /// `signal` is notified when the answer arrives (null: nothing is). Notifies it at once if
  /// the answer is there already.
  void watch(CallSignal* signal) {
    std::scoped_lock lock(mutex_);
    signal_ = signal;
    if (signal_ != nullptr && answered_) signal_->notify();
  }
  /// Waits until the call is answered or `deadline` passes; true if it is answered. With a
  /// driver, the waiting thread runs the transport's I/O meanwhile.
  bool wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    if (answered_) return true;
    if (CallDriver* driver = driver_) {
      lock.unlock();
      driver->run_until([this] { return answered(); }, deadline);
      lock.lock();
      return answered_;
    }
    return changed_.wait_until(lock, deadline, [&] { return answered_; });
  }
  /// The answer, once the call is answered; only once.
  Response take() {
    std::scoped_lock lock(mutex_);
    return std::move(*response_);
  }
  /// Gives the call up: ends a use under way (the driver's `abort`) and waits until no use is
  /// left; afterwards the transport begins none, so the caller may free the request's
  /// buffers and the reply targets. An answer that arrives later is dropped.
  void cancel() {
    CallDriver* driver = nullptr;
    {
      std::scoped_lock lock(mutex_);
      if (cancelled_) return;
      cancelled_ = true;
      signal_ = nullptr;
      if (users_ > 0) driver = driver_;
    }
    if (driver != nullptr) driver->abort(*this);
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return users_ == 0; });
  }

 protected:
  ~CallControl() = default;  // owned through the transport's derived per-call state

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;  ///< an answer arrived, or the last use ended
  std::optional<Response> response_;
  CallDriver* driver_;  ///< for the call's whole life: a use may outlast the answer
  CallSignal* signal_ = nullptr;
  int users_ = 0;
  bool answered_ = false;
  bool cancelled_ = false;
};

/// One call in flight, as its caller holds it: the answer to come, and the way to give it
/// up. A call whose transport has a driver (Tcp) is waited on by the thread that uses the
/// transport, while the transport lives. To wait for several calls, use a CallGroup.
class PendingCall {
 public:
  using Clock = std::chrono::steady_clock;

  explicit PendingCall(std::shared_ptr<CallControl> control) : control_(std::move(control)) {}

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
