// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <signal.h>  // sigaction (POSIX)

#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/transport/tcp.hpp"

namespace pulley::runner_detail {

/// A connection of task `self` to the chief's JoinDesk at `chief`: one process, whose
/// address holds no copy of any shard whatever `tcp.replicas` the job's ps tasks keep.
inline Tcp chief_desk(Node self, const std::string& chief, TcpOptions tcp) {
  tcp.replicas = 0;
  return Tcp(self, std::vector<std::string>{chief}, std::move(tcp));
}

/// Asks the chief's desk at `chief`, as task `self`, `request` (for `what`: "to join the
/// job") until it answers: again while the chief cannot answer yet (it has not started the
/// job or counted the task in, or cannot be reached), for `patience`, after calling
/// `waiting` with each such answer (false from it: give up, nullopt). Throws the desk's
/// refusal; once `patience` has passed, kDeadlineExceeded if the desk was reached (it kept
/// the task waiting), else kUnavailable.
template <class Reply>
std::optional<Reply> ask_desk(Node self, const std::string& chief, TcpOptions tcp, const Request& request,
                              const std::string& what, std::chrono::milliseconds patience,
                              const std::function<bool(const Error&)>& waiting = {}) {
  tcp.connect_timeout = std::min(tcp.connect_timeout, patience);
  const auto deadline = std::chrono::steady_clock::now() + patience;
  std::optional<Tcp> desk;
  bool reached = false;
  for (;;) {
    try {
      if (!desk) desk.emplace(chief_desk(self, chief, tcp));
      reached = true;
      CallGroup group;
      group.add(desk->call(0, Request(request), {}));
      group.wait(std::chrono::seconds(30), "ask the chief at " + chief + " " + what);
      return group.take_as<Reply>(0);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable) throw;
      if (std::chrono::steady_clock::now() > deadline) {
        throw Error(reached ? ErrorCode::kDeadlineExceeded : ErrorCode::kUnavailable,
                    "asked the chief at " + chief + " " + what + " for " + std::to_string(patience.count() / 1000) +
                        " s without an answer: " + e.message());
      }
      if (waiting && !waiting(e)) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
}

/// The job's shape as the chief's desk at `chief` tells it to task `self` (Shape): every ps
/// task's address, the members, the workers; `ask_desk` with `patience`.
inline ShapeReply ask_shape(Node self, const std::string& chief, TcpOptions tcp, std::chrono::milliseconds patience) {
  return *ask_desk<ShapeReply>(self, chief, std::move(tcp), Shape{}, "for the job's shape", patience);
}

/// The referee of a worker's or the evaluator's transports in a job with copies: it asks
/// the chief's desk at `chief` (LostPs) on a thread of its own, one question at a time
/// (those about one ps process share an answer), for `patience` at most; a chief that does
/// not answer by then rules nothing, and the task waits for the ps (logged).
class AskChief {
 public:
  AskChief(Node self, std::string chief, TcpOptions tcp, std::chrono::milliseconds patience)
      : self_(self), chief_(std::move(chief)), tcp_(std::move(tcp)), patience_(patience) {
    tcp_.copy_referee = nullptr;  // (the desk holds no copies; no question asks another)
  }
  AskChief(const AskChief&) = delete;
  AskChief& operator=(const AskChief&) = delete;
  ~AskChief() {
    {
      const std::scoped_lock lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (asking_.joinable()) asking_.join();
    for (Question& q : questions_) {  // nothing ruled (no transport waits any more)
      for (const auto& answer : q.answers) answer(false);
    }
  }

  /// Queues the question; `answer` is called on the asking thread.
  void ask(const LostProcess& lost, std::function<void(bool)> answer) {
    {
      const std::scoped_lock lock(mutex_);
      const auto same = std::find_if(questions_.begin(), questions_.end(), [&](const Question& q) {
        return q.lost.ps == lost.ps && q.lost.process == lost.process;
      });
      if (same != questions_.end()) {
        same->answers.push_back(std::move(answer));
        return;
      }
      questions_.push_back(Question{lost, {std::move(answer)}});
      if (!asking_.joinable()) asking_ = std::thread([this] { ask_loop(); });
    }
    wake_.notify_one();
  }

  /// A CopyReferee that asks through `asker`.
  static CopyReferee referee(std::shared_ptr<AskChief> asker) {
    return [asker = std::move(asker)](const LostProcess& lost, std::function<void(bool)> answer) {
      asker->ask(lost, std::move(answer));
    };
  }

 private:
  struct Question {
    LostProcess lost;
    std::vector<std::function<void(bool)>> answers;
  };

  void ask_loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stop_ || !questions_.empty(); });
      if (stop_) return;
      const LostProcess lost = questions_.front().lost;
      lock.unlock();
      bool ruled_lost = false;
      try {
        ruled_lost = ask_one(lost);
      } catch (const std::exception& e) {  // no memory, say: nothing ruled, the task waits
        log(LogLevel::kWarning, self_.name() + ": could not ask the chief about ps " + std::to_string(lost.ps) + ": " +
                                    e.what());
      }
      lock.lock();
      Question asked = std::move(questions_.front());
      questions_.pop_front();
      lock.unlock();
      for (const auto& answer : asked.answers) answer(ruled_lost);
      lock.lock();
    }
  }

  bool ask_one(const LostProcess& lost) {
    const std::string ps = "ps " + std::to_string(lost.ps);
    try {
      const std::optional<LostPsReply> ruling =
          ask_desk<LostPsReply>(self_, chief_, tcp_, LostPs{lost.ps, lost.process, lost.why},
                                "whether " + ps + " is lost", patience_, [this](const Error&) {
                                  const std::scoped_lock lock(mutex_);
                                  return !stop_;
                                });
      if (!ruling) return false;  // this task ends
      if (!ruling->lost && !lost.reached && now_and_then(lost.ps)) {
        log(LogLevel::kWarning, self_.name() + ": " + ps + " is not lost for the job (" + ruling->why.substr(0, 256) +
                                    "): this task waits for it");
      }
      return ruling->lost;
    } catch (const Error& e) {
      if (!lost.reached && now_and_then(lost.ps)) {
        log(LogLevel::kWarning, self_.name() + ": the chief could not rule whether " + ps + " is lost (" +
                                    e.message() + "): nothing is given up, and this task waits for it");
      }
      return false;
    }
  }

  /// True at most once every 10 s for ps `ps`: a task cut off asks again every second.
  bool now_and_then(std::uint32_t ps) {
    const auto now = std::chrono::steady_clock::now();
    const auto [told, first] = told_.try_emplace(ps, now);
    if (!first && now - told->second < std::chrono::seconds(10)) return false;
    told->second = now;
    return true;
  }

  const Node self_;
  const std::string chief_;
  TcpOptions tcp_;
  const std::chrono::milliseconds patience_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Question> questions_;
  std::map<std::uint32_t, std::chrono::steady_clock::time_point> told_;  ///< by ps: the last waiting line (asking thread)
  bool stop_ = false;
  std::thread asking_;  ///< started at the first question
};

/// Set by the first SIGTERM once `leave_on_sigterm` installed its handler.
inline std::atomic<bool>& sigterm_received() noexcept {
  static std::atomic<bool> received{false};
  return received;
}

/// From now on the first SIGTERM this process gets asks its task to leave the job through
/// the chief (LeaveWatch) instead of ending the process; a second one ends it as SIGTERM
/// does (the handler is reset once it ran).
inline void leave_on_sigterm() {
  (void)sigterm_received();  // made before the handler may run
  struct sigaction action {};
  action.sa_handler = [](int) { sigterm_received().store(true); };
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;
  if (sigaction(SIGTERM, &action, nullptr) != 0) {
    log(LogLevel::kWarning, "SIGTERM cannot ask this task to leave the job (sigaction failed): it ends the process");
  }
}

/// Ends the process as the SIGTERM it got would have without `leave_on_sigterm`.
[[noreturn]] inline void end_as_sigterm() {
  std::signal(SIGTERM, SIG_DFL);
  std::raise(SIGTERM);
  std::_Exit(128 + SIGTERM);  // not reached
}

/// While it lives, the first SIGTERM asks this task (a ps task or a worker of a job that
/// can go on without it) to leave the job, instead of ending the process
/// (`leave_on_sigterm`; before and after, SIGTERM ends it as it does by default). A thread
/// of its own then asks the chief at `chief` (Leave, at its JoinDesk) until the chief has
/// taken the task out, and calls `out` on that thread (a ps stops serving; a worker ends
/// when the ps tasks refuse it). When the chief refuses (the job's last worker or ps task,
/// or the others cannot take a ps's share), the task goes on as it was, saying why (a
/// second SIGTERM ends it). When the chief cannot be reached at the first try (the whole
/// job is being ended: every task got SIGTERM), or not again for `patience` since its last
/// answer, it ends the process as SIGTERM does.
class LeaveWatch {
 public:
  LeaveWatch(Node self, std::string chief, TcpOptions tcp, std::chrono::milliseconds patience, std::function<void()> out)
      : self_(self), chief_(std::move(chief)), tcp_(std::move(tcp)), patience_(patience), out_(std::move(out)) {
    leave_on_sigterm();
    thread_ = std::thread([this] { watch(); });
  }
  LeaveWatch(const LeaveWatch&) = delete;
  LeaveWatch& operator=(const LeaveWatch&) = delete;
  ~LeaveWatch() {
    std::signal(SIGTERM, SIG_DFL);
    done_ = true;
    thread_.join();
  }

  /// True once the chief has taken this task out of the job at its request.
  [[nodiscard]] bool out() const noexcept { return out_done_; }

 private:
  static constexpr std::chrono::milliseconds kLook{100};
  static constexpr std::chrono::milliseconds kAskEvery{200};

  void watch() {
    while (!done_ && !sigterm_received()) std::this_thread::sleep_for(kLook);
    if (done_) return;
    const std::string name = std::string(self_.role == Node::Role::kPs ? "ps " : "worker ") + std::to_string(self_.index);
    log(LogLevel::kInfo, name + ": SIGTERM: asks the chief at " + chief_ +
                             " to take it out of the job (a second SIGTERM ends it at once)");
    auto deadline = std::chrono::steady_clock::now() + patience_;
    std::optional<Tcp> desk;
    bool reached = false;  // the chief answered once
    while (!done_) {
      try {
        if (!desk) desk.emplace(chief_desk(self_, chief_, tcp_));
        CallGroup group;
        group.add(desk->call(0, Leave{}, {}));
        group.wait(std::chrono::seconds(5), "ask the chief at " + chief_ + " to leave the job");
        const LeaveReply reply = group.take_as<LeaveReply>(0);
        deadline = std::chrono::steady_clock::now() + patience_;
        if (!std::exchange(reached, true) && !reply.out) {
          log(LogLevel::kInfo, name + ": the chief takes it out of the job as soon as it is free");
        }
        if (reply.out) {
          log(LogLevel::kInfo, name + ": the chief took it out of the job");
          out_done_ = true;
          out_();
          return;
        }
      } catch (const Error& e) {
        if (done_) return;  // the task ended meanwhile
        if (e.code() == ErrorCode::kFailedPrecondition) {
          log(LogLevel::kWarning, name + " cannot leave the job: " + e.message() +
                                      "; it goes on (a second SIGTERM ends it)");
          return;
        }
        const bool unreachable = e.code() == ErrorCode::kUnavailable || e.code() == ErrorCode::kDeadlineExceeded;
        if (!unreachable || !reached || std::chrono::steady_clock::now() > deadline) {
          log(LogLevel::kWarning, name + " cannot leave the job (" + e.what() + "): it ends as SIGTERM ends it");
          end_as_sigterm();
        }
        desk.reset();
      }
      std::this_thread::sleep_for(kAskEvery);
    }
  }

  Node self_;
  std::string chief_;
  TcpOptions tcp_;
  std::chrono::milliseconds patience_;
  std::function<void()> out_;
  std::atomic<bool> done_{false};
  std::atomic<bool> out_done_{false};
  std::thread thread_;  // last: started once the rest is made
};

}  // namespace pulley::runner_detail
