// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "pulley/messages.hpp"

namespace pulley {

/// Where a pull's values go: one destination per requested slice, in request order.
using PullTargets = std::vector<std::span<float>>;

class CallControl;

/// The part of a transport that needs the caller's thread. A transport with no thread of its
/// own (Tcp) moves its I/O forward while its caller waits, and cuts a transfer under way
/// when its caller gives up on it. A transport that answers on threads of its own
/// (InProcess) has no driver.
class CallDriver {
 public:
  /// Runs the transport's I/O until `call` is answered or `deadline` passes.
  virtual void run_until(CallControl& call, std::chrono::steady_clock::time_point deadline) = 0;
  /// `call`'s caller gives up while the transport uses its buffers (see `CallControl::cancel`):
  /// end that use now, e.g. by closing a connection that stalled mid-frame.
  virtual void abort(CallControl& call) = 0;

 protected:
  ~CallDriver() = default;
};

/// What a caller and a transport share about one call: its answer, and whether the caller
/// gave up. A transport derives its per-call state from it (one allocation per call).
///
/// Transport side: `answer` once; bracket every use of the request's views or the pull
/// targets with `begin_use`/`end_use` (or `unless_cancelled`), and begin none after the
/// caller gave up. Caller side: through `PendingCall`.
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

  // ---- caller side (use PendingCall) ------------------------------------------------------

  /// Waits until the call is answered or `deadline` passes; true if it is answered. With a
  /// driver, the waiting thread runs the transport's I/O meanwhile.
  bool wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    if (answered_) return true;
    if (CallDriver* driver = driver_) {
      lock.unlock();
      driver->run_until(*this, deadline);
      lock.lock();
      return answered_;
    }
    return changed_.wait_until(lock, deadline, [&] { return answered_; });
  }
  /// The answer, once `wait_until` returned true; only once.
  Response take() {
    std::scoped_lock lock(mutex_);
    return std::move(*response_);
  }
  /// Gives the call up: ends a use under way (the driver's `abort`) and waits until no use is
  /// left; afterwards the transport begins none, so the caller may free the request's
  /// buffers and the pull targets. An answer that arrives later is dropped.
  void cancel() {
    CallDriver* driver = nullptr;
    {
      std::scoped_lock lock(mutex_);
      if (cancelled_) return;
      cancelled_ = true;
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
  int users_ = 0;
  bool answered_ = false;
  bool cancelled_ = false;
};

/// A call in flight, as its caller holds it: the answer to come, and the way to give it up.
/// A call whose transport has a driver (Tcp) is waited on by the thread that uses the
/// transport, while the transport lives.
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
  /// touches the request's buffers or the pull targets.
  void cancel() { control_->cancel(); }

 private:
  std::shared_ptr<CallControl> control_;
};

/// The client side of a transport: how a worker, the chief or an evaluator reaches the ps
/// tasks. The server side is the transport's own serving loop, which hands every request to
/// `ParameterServer::handle` and sends back what it answers.
///
/// Required:
///   - `t.num_ps()` → number of ps tasks
///   - `t.call(ps, request, targets)` → `PendingCall`
///
/// Semantic contract:
///   - `call` never waits for another task (a request that must wait for a token or a step
///     returns a PendingCall that is answered later), so calls to different ps tasks never
///     wait for each other;
///   - a transport may hold a request until its caller waits on any PendingCall, so that
///     requests made together leave together (a push and a pull in one write);
///   - requests from one client to one ps are handled in the order they were made;
///   - for a Pull, the transport copies the reply's values into `targets` (slice by slice)
///     before the call is answered, and the PullReply's views then point into `targets`;
///   - `targets` and every view inside `request` stay valid until the call is answered or
///     the caller has cancelled it; the transport touches neither afterwards;
///   - failures arrive as an ErrorReply answer: `kUnavailable` for a dead or unreachable
///     peer; a lost message leaves the call unanswered, and the caller's deadline turns that
///     into `kDeadlineExceeded` (and a cancel).
template <class T>
concept Transport = std::move_constructible<T> &&
    requires(T& transport, const T& ctransport, std::size_t ps, Request request,
             PullTargets targets) {
  { ctransport.num_ps() } -> std::convertible_to<std::size_t>;
  { transport.call(ps, std::move(request), std::move(targets)) } -> std::same_as<PendingCall>;
};

}  // namespace pulley
