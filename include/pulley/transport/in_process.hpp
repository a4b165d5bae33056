// SPDX-License-Identifier: MIT
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/concepts/transport.hpp"
#include "pulley/detail/pull_reply.hpp"
#include "pulley/messages.hpp"
#include "pulley/node.hpp"
#include "pulley/parameter_server.hpp"

namespace pulley {

/// The fabric of an in-process cluster: the ps tasks, their request queues, and the fault
/// injector. Workers, the chief and the evaluator reach it through `InProcess` endpoints
/// from threads of their own. Requests travel as the same structs the TCP transport
/// serializes, and each ps handles them one at a time, in arrival order, as it handles a
/// socket.
///
/// A request to an idle ps task is handled on the thread that sends it, under the task's
/// lock: no thread hand-off, so a push+pull costs about what its copies cost. A request to
/// a task that is busy (handling another sender's request), slowed down by `delay`, or has
/// requests queued goes to the task's own thread instead, so `call` never blocks on a busy
/// ps and requests from one sender keep their order. A request that must wait (a token, a
/// step-gated pull) is answered later by whichever thread completes what it waits for.
///
/// Faults, for tests: `drop_next` loses requests (the caller's deadline fires), `delay`
/// slows a node down, `kill` makes a node fail as a crashed process would: its queued and
/// waiting requests are answered `kUnavailable`, and so is everything sent to or by it
/// afterwards.
///
/// The network must outlive every endpoint and every served ParameterServer; its destructor
/// kills the ps tasks still running and joins their threads.
class InProcessNetwork {
 public:
  /// @param num_ps the number of ps tasks (served with `serve`)
  explicit InProcessNetwork(std::uint32_t num_ps) {
    for (std::uint32_t i = 0; i < num_ps; ++i) mailboxes_.push_back(std::make_unique<Mailbox>());
  }
  InProcessNetwork(const InProcessNetwork&) = delete;
  InProcessNetwork& operator=(const InProcessNetwork&) = delete;

  ~InProcessNetwork() {
    for (std::uint32_t i = 0; i < num_ps(); ++i) kill(Node::ps(i));
    join();
  }

  /// Number of ps tasks.
  [[nodiscard]] std::uint32_t num_ps() const noexcept {
    return static_cast<std::uint32_t>(mailboxes_.size());
  }

  /// Serves ps task `server.task()`. `Server` is any type with `handle(Request&&, Responder)`,
  /// `stopped()` and `task()`, i.e. a ParameterServer. Requests sent before are handled now.
  template <class Server>
  void serve(Server& server) {
    const std::uint32_t task = server.task();
    if (task >= num_ps()) {
      throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(task) + " here");
    }
    Mailbox& box = *mailboxes_[task];
    if (box.host) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ps task " + std::to_string(task) + " is served already");
    }
    {
      std::scoped_lock lock(box.serving, box.mutex);
      box.host = std::make_unique<HostOf<Server>>(server);
    }
    threads_.emplace_back([this, &box, task] { run(box, task); });
  }

  /// Waits until every served ps task has ended (after Shutdown, or killed).
  void join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  /// Loses the next `count` requests sent to ps `ps` (from `from` only, if given).
  void drop_next(std::uint32_t ps, std::size_t count, std::optional<Node> from = {}) {
    std::scoped_lock lock(faults_mutex_);
    drops_.push_back({ps, count, from});
  }

  /// Makes `node` slow: a client waits `delay` before each request it sends, a ps before
  /// each request it handles. A zero delay ends the slowdown.
  void delay(Node node, std::chrono::microseconds delay) {
    std::scoped_lock lock(faults_mutex_);
    delays_[node] = delay;
  }

  /// Kills `node` as a crash would.
  void kill(Node node) {
    {
      std::scoped_lock lock(faults_mutex_);
      dead_[node] = true;
    }
    if (node.job == Node::Job::kPs && node.index < num_ps()) {
      Mailbox& box = *mailboxes_[node.index];
      {
        std::scoped_lock lock(box.mutex);
        box.killed = true;
      }
      box.wake.notify_all();
    }
  }

  /// True once `node` was killed.
  [[nodiscard]] bool is_dead(Node node) const {
    std::scoped_lock lock(faults_mutex_);
    auto it = dead_.find(node);
    return it != dead_.end() && it->second;
  }

 private:
  friend class InProcess;

  /// One call in flight: where its answer goes. Answered at most once, and not at all
  /// once the caller cancelled (then the targets may be gone).
  struct Call : CallControl {
    PullTargets targets;

    void complete(Response&& response) {
      unless_cancelled([&] {
        if (answered()) return;
        auto* pull = std::get_if<PullReply>(&response);
        if (pull && !detail::copy_into(*pull, targets)) {
          response = ErrorReply{ErrorCode::kInvalidArgument, "pull reply does not fit its targets"};
        }
        answer(std::move(response));
      });
    }
  };

  struct Envelope {
    Request request;
    std::shared_ptr<Call> call;
  };

  /// A served ps task, whatever its ParameterServer type.
  struct Host {
    virtual ~Host() = default;
    virtual void handle(Request&& request, Responder reply) = 0;
    [[nodiscard]] virtual bool stopped() const = 0;
  };
  template <class Server>
  struct HostOf final : Host {
    explicit HostOf(Server& s) : server(s) {}
    void handle(Request&& request, Responder reply) override {
      server.handle(std::move(request), std::move(reply));
    }
    [[nodiscard]] bool stopped() const override { return server.stopped(); }
    Server& server;
  };

  struct Mailbox {
    std::mutex serving;  ///< held while the ps handles a request, on whichever thread
    std::mutex mutex;    ///< guards the rest; taken after `serving`
    std::condition_variable wake;
    std::deque<Envelope> queue;  ///< for the ps's own thread; no sender skips it
    std::unique_ptr<Host> host;  ///< set by serve()
    bool killed = false;
    bool closed = false;            ///< shut down or killed: nothing more is handled
    std::atomic<bool> dead{false};  ///< killed and flushed: every answer is kUnavailable
  };

  struct DropRule {
    std::uint32_t ps;
    std::size_t remaining;
    std::optional<Node> from;
  };

  static Response unavailable(const std::string& who) {
    return ErrorReply{ErrorCode::kUnavailable, who + " is unavailable (killed)"};
  }

  PendingCall send(Node from, std::uint32_t ps, Request&& request, PullTargets&& targets) {
    auto call = std::make_shared<Call>();
    call->targets = std::move(targets);
    PendingCall pending(call);
    if (ps >= num_ps()) {
      call->complete(ErrorReply{ErrorCode::kInvalidArgument,
                                "no ps task " + std::to_string(ps) + " in this cluster"});
      return pending;
    }
    if (is_dead(from)) {
      call->complete(unavailable(from.name()));
      return pending;
    }
    if (auto d = delay_of(from); d.count() > 0) std::this_thread::sleep_for(d);
    if (take_drop(ps, from)) {
      std::scoped_lock lock(faults_mutex_);
      lost_.push_back(std::move(call));  // never answered; the caller's deadline fires
      return pending;
    }
    Mailbox& box = *mailboxes_[ps];
    std::unique_lock serving(box.serving, std::try_to_lock);
    {
      std::scoped_lock lock(box.mutex);
      if (box.killed || box.closed) {
        call->complete(box.killed
                           ? unavailable(Node::ps(ps).name())
                           : Response{ErrorReply{ErrorCode::kCancelled,
                                                 "ps " + std::to_string(ps) + " shut down"}});
        return pending;
      }
      const bool idle = serving.owns_lock() && box.host && box.queue.empty();
      if (!idle || delay_of(Node::ps(ps)).count() > 0) {
        box.queue.push_back({std::move(request), std::move(call)});
        box.wake.notify_one();
        return pending;
      }
    }
    handle(box, ps, std::move(request), call);  // here and now, holding `serving`
    return pending;
  }

  /// Hands one request to the ps; the caller holds `box.serving`.
  static void handle(Mailbox& box, std::uint32_t task, Request&& request,
                     const std::shared_ptr<Call>& call) {
    // One use while the ps reads the request's views: a caller that gives up waits for it.
    call->unless_cancelled([&] {
      try {
        box.host->handle(std::move(request), [&box, call, task](Response&& r) {
          call->complete(box.dead ? unavailable(Node::ps(task).name()) : std::move(r));
        });
      } catch (const std::exception& e) {  // a throwing policy must not take the ps down
        call->complete(ErrorReply{ErrorCode::kInvalidArgument,
                                  "ps " + std::to_string(task) + " failed: " + e.what()});
      }
    });
    if (box.host->stopped()) {
      {
        std::scoped_lock lock(box.mutex);
        box.closed = true;
      }
      box.wake.notify_all();
    }
  }

  /// The ps task's own thread: serves the queue, and ends the task when it is shut down or
  /// killed.
  void run(Mailbox& box, std::uint32_t task) {
    for (;;) {
      {
        std::unique_lock lock(box.mutex);
        box.wake.wait(lock, [&] { return box.killed || box.closed || !box.queue.empty(); });
        if (box.killed || box.closed) break;
      }
      if (auto d = delay_of(Node::ps(task)); d.count() > 0) std::this_thread::sleep_for(d);
      std::scoped_lock serving(box.serving);
      Envelope envelope;
      {
        std::scoped_lock lock(box.mutex);
        if (box.killed || box.closed || box.queue.empty()) continue;
        envelope = std::move(box.queue.front());
        box.queue.pop_front();
      }
      handle(box, task, std::move(envelope.request), envelope.call);
    }
    std::scoped_lock serving(box.serving);
    std::deque<Envelope> orphans;
    {
      std::scoped_lock lock(box.mutex);
      box.closed = true;
      orphans = std::move(box.queue);
      if (box.killed) box.dead = true;
    }
    if (box.dead) {
      // A crashed ps answers nothing; the clients' connections break. Flush the requests it
      // held (token and pull waiters) so that they fail now instead of at their deadline.
      box.host->handle(Shutdown{}, [](Response&&) {});
    }
    for (Envelope& e : orphans) {
      e.call->complete(box.dead ? unavailable(Node::ps(task).name())
                                : Response{ErrorReply{ErrorCode::kCancelled, "ps shut down"}});
    }
  }

  std::chrono::microseconds delay_of(Node node) const {
    std::scoped_lock lock(faults_mutex_);
    auto it = delays_.find(node);
    return it == delays_.end() ? std::chrono::microseconds{0} : it->second;
  }

  bool take_drop(std::uint32_t ps, Node from) {
    std::scoped_lock lock(faults_mutex_);
    for (DropRule& rule : drops_) {
      if (rule.ps == ps && rule.remaining > 0 && (!rule.from || *rule.from == from)) {
        --rule.remaining;
        std::erase_if(drops_, [](const DropRule& r) { return r.remaining == 0; });
        return true;
      }
    }
    return false;
  }

  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::vector<std::thread> threads_;
  mutable std::mutex faults_mutex_;
  std::vector<DropRule> drops_;
  std::map<Node, std::chrono::microseconds> delays_;
  std::map<Node, bool> dead_;
  std::vector<std::shared_ptr<Call>> lost_;
};

/// A client endpoint on an InProcessNetwork: the in-process `Transport`.
class InProcess {
 public:
  /// @param network the cluster's fabric (must outlive this endpoint)
  /// @param self    who is calling, for the fault injector
  InProcess(InProcessNetwork& network, Node self) : network_(&network), self_(self) {}

  /// Number of ps tasks in the network.
  [[nodiscard]] std::size_t num_ps() const noexcept { return network_->num_ps(); }
  /// Who this endpoint speaks for.
  [[nodiscard]] Node self() const noexcept { return self_; }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    return network_->send(self_, static_cast<std::uint32_t>(ps), std::move(request),
                          std::move(targets));
  }

 private:
  InProcessNetwork* network_;
  Node self_;
};
static_assert(Transport<InProcess>);

}  // namespace pulley
