// SPDX-License-Identifier: MIT
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/transport/detail/reply_targets.hpp"

namespace pulley {

/// The fabric of an in-process cluster: it owns the ps tasks (any `Service`, typically a
/// ParameterServer) and their request queues, and injects faults. Workers, the chief and
/// the evaluator reach it through `InProcess` endpoints from threads of their own. Requests
/// travel as the same structs the TCP transport encodes, and each ps handles them one at a
/// time, in arrival order, as it handles a socket.
///
/// A request to an idle ps task is handled on the thread that sends it, under the task's
/// lock: no thread hand-off, so a push+pull costs about what its copies cost. A request to
/// a task that is busy (handling another sender's request), slowed down by `delay`, or has
/// requests queued is queued instead, so `call` never blocks on a busy ps and requests from
/// one sender keep their order: the sender handling one takes the queue on after it, else
/// (a slowed task, one whose own thread is at work) the task's own thread serves it. A request that
/// must wait (a token, a step-gated pull) is answered later by whichever thread completes what it
/// waits for.
///
/// Each endpoint holds one "connection" (session) per ps task, as a TCP client does.
///
/// Faults, for tests: `drop_next` loses requests (the caller's deadline fires),
/// `lose_replies` breaks a connection between a request taking effect and its answer,
/// `delay` slows a node down, `restart` serves a fresh ps in place of a killed one, `kill` makes a
/// node fail as a crashed process would: the requests it
/// held and everything sent to or by it afterwards are answered `kUnavailable`, and every
/// ps hears that a killed client left (`Service::disconnected`).
///
/// Lifetimes take care of themselves: the network owns the services it serves and joins
/// their threads before destroying them; an endpoint that outlives the network gets
/// `kUnavailable` answers.
class InProcessNetwork {
 public:
  /// @param num_ps   the number of ps tasks (served with `serve`)
  /// @param joinable ps tasks beyond them that may be served later and join the job
  ///                 (Chief::join): tasks num_ps .. num_ps + joinable - 1, which endpoints
  ///                 reach once they learn of them (`InProcess::add_ps`)
  explicit InProcessNetwork(std::uint32_t num_ps, std::uint32_t joinable = 0)
      : fabric_(std::make_shared<Fabric>(num_ps + joinable)), spec_ps_(num_ps) {}
  InProcessNetwork(const InProcessNetwork&) = delete;
  InProcessNetwork& operator=(const InProcessNetwork&) = delete;

  /// Ends every ps task still serving (their waiting requests fail), joins their threads
  /// and destroys the services.
  ~InProcessNetwork() { fabric_->close(); }

  /// Number of ps tasks, joinable ones included.
  [[nodiscard]] std::uint32_t num_ps() const noexcept { return fabric_->num_ps(); }

  /// Serves ps task `service.task()`, which the network now owns (ask it through its
  /// protocol: GetStats). Requests sent before are handled now.
  template <Service S>
  void serve(S service) {
    fabric_->serve(std::make_unique<HostOf<S>>(std::move(service)));
  }

  /// Waits until every served ps task has stopped (after Shutdown, a failure, or killed).
  void join() { fabric_->join(); }

  /// Loses the next `count` requests sent to ps `ps` (from `from` only, if given).
  void drop_next(std::uint32_t ps, std::size_t count, std::optional<Node> from = {}) {
    fabric_->drop_next(ps, count, from);
  }

  /// Breaks the connection that carries each of the next `count` requests sent to ps `ps`
  /// (from `from` only, if given) once the ps has handled it: the request takes effect and
  /// its answer is lost (the caller gets kUnavailable), the ps hears that connection close
  /// (`Service::disconnected`), and the sender's next request to that ps opens a new one.
  void lose_replies(std::uint32_t ps, std::size_t count, std::optional<Node> from = {}) {
    fabric_->lose_replies(ps, count, from);
  }

  /// Like `lose_replies`, at random: each request sent to ps `ps` (from `from` only, if
  /// given) loses its answer with probability `probability` (0 ends it); `seed` makes the
  /// draws repeatable for a given order of requests.
  void lose_replies_at_random(std::uint32_t ps, double probability, std::uint64_t seed,
                              std::optional<Node> from = {}) {
    fabric_->lose_replies_at_random(ps, probability, seed, from);
  }

  /// Makes `node` slow: a client waits `delay` before each request it sends, a ps before
  /// each request it handles. A zero delay ends the slowdown.
  void delay(Node node, std::chrono::microseconds delay) { fabric_->set_delay(node, delay); }

  /// Kills `node` as a crash would.
  void kill(Node node) { fabric_->kill(node); }

  /// True once `node` was killed.
  [[nodiscard]] bool is_dead(Node node) const { return fabric_->is_dead(node); }

  /// Serves `service` in place of killed ps task `service.task()`, as a process started
  /// again on its address: the old service is destroyed, and the new one (fresh, until the
  /// chief restores it) answers from now on. Throws kFailedPrecondition if that task was
  /// not killed.
  template <Service S>
  void restart(S service) {
    fabric_->restart(std::make_unique<HostOf<S>>(std::move(service)));
  }

 private:
  friend class InProcess;

  /// A served ps task, whatever its Service type.
  struct Host {
    virtual ~Host() = default;
    virtual void handle(Request&& request, Node from, std::uint64_t session,
                        Responder reply) noexcept = 0;
    /// Connection `session` of `node` closed (0: every connection of it).
    virtual void disconnected(Node node, std::uint64_t session) noexcept = 0;
    [[nodiscard]] virtual std::uint32_t task() const = 0;
    [[nodiscard]] virtual bool stopped() const = 0;
  };
  template <Service S>
  struct HostOf final : Host {
    explicit HostOf(S s) : service(std::move(s)) {}
    void handle(Request&& request, Node from, std::uint64_t session,
                Responder reply) noexcept override {
      // Requests come from this process's own clients, which check every tensor before
      // they send anything.
      service.handle(std::move(request), RequestContext{true, from, session}, std::move(reply));
    }
    void disconnected(Node node, std::uint64_t session) noexcept override {
      notify_disconnected(service, node, session);
    }
    [[nodiscard]] std::uint32_t task() const override { return service.task(); }
    [[nodiscard]] bool stopped() const override { return service.stopped(); }
    S service;
  };

  /// One call in flight: where its answer goes. Answered at most once, and not at all
  /// once the caller cancelled (then the targets may be gone).
  struct Call : CallControl {
    PullTargets targets;
    /// Its connection breaks once the ps has handled it (`lose_replies`): the answer
    /// becomes this kUnavailable.
    std::optional<std::string> lost_reply;

    // Defined in impl/in_process_requests.hpp.
    void complete(Response&& response);
  };
  using CallPtr = std::shared_ptr<Call>;

  struct Envelope {
    Request request;
    CallPtr call;
    Node from;
    std::uint64_t session = 0;
  };

  struct Mailbox {
    std::mutex serving;  ///< held while the service handles a request, on whichever thread
    std::mutex mutex;    ///< guards the rest; taken after `serving`
    std::condition_variable wake;
    std::deque<Envelope> queue;       ///< for the task's own thread; no sender skips it
    std::unique_ptr<Host> host;       ///< set by serve()
    std::vector<CallPtr> in_service;  ///< handed to the service; pruned as they are answered
    bool thread_running = false;      ///< the task's own thread serves the queue
    bool combining = false;           ///< a sender serves here (send), and takes the queue on after
    bool stopped = false;             ///< the service stopped: its thread ends once idle
    bool killed = false;
    bool closed = false;  ///< the network is gone
  };

  struct DropRule {
    std::uint32_t ps;
    std::size_t remaining;
    std::optional<Node> from;
  };

  struct RandomLoss {
    std::uint32_t ps;
    double probability;
    std::optional<Node> from;
    std::mt19937_64 rng;
  };

  /// Everything the network and its endpoints share; it outlives both.
  class Fabric {
   public:
    explicit Fabric(std::uint32_t num_ps) {
      for (std::uint32_t i = 0; i < num_ps; ++i) mailboxes_.push_back(std::make_unique<Mailbox>());
    }

    [[nodiscard]] std::uint32_t num_ps() const noexcept {
      return static_cast<std::uint32_t>(mailboxes_.size());
    }

    // A ps task served: its thread and its queue, and the network's close
    // (impl/in_process_serving.hpp).

    void serve(std::unique_ptr<Host> host);

    void join();

    /// The network is going away: everything waiting fails, the threads end, the services
    /// are destroyed; later calls fail.
    void close();

    // Faults injected, and a killed ps task served again (impl/in_process_faults.hpp).

    void drop_next(std::uint32_t ps, std::size_t count, std::optional<Node> from);

    void lose_replies(std::uint32_t ps, std::size_t count, std::optional<Node> from);

    void lose_replies_at_random(std::uint32_t ps, double probability, std::uint64_t seed,
                                std::optional<Node> from);

    /// True if connection `session` was broken by `lose_replies` (its endpoint opens a new
    /// one; what was sent on it and not handled yet is lost).
    bool is_broken(std::uint64_t session) const;

    void set_delay(Node node, std::chrono::microseconds delay);

    void kill(Node node);

    void restart(std::unique_ptr<Host> host);

    [[nodiscard]] bool is_dead(Node node) const;

    /// A session id for a new connection.
    std::uint64_t new_session() noexcept { return next_session_.fetch_add(1) + 1; }

    // A request sent, handed to the service and answered (impl/in_process_requests.hpp).

    PendingCall send(Node from, std::uint64_t session, std::uint32_t ps, Request&& request,
                     PullTargets&& targets);

   private:
    static Response unavailable(const std::string& why) {
      return ErrorReply{ErrorCode::kUnavailable, why};
    }

    // Defined in impl/: gone_reason, fail_held, delay_of, take_reply_loss, take_rule and
    // break_session in in_process_faults.hpp; handle_queued, stop_combining and run in
    // in_process_serving.hpp; handle in in_process_requests.hpp.

    static std::optional<std::string> gone_reason(const Mailbox& box, std::uint32_t ps);

    /// Fails every request the task holds, queued or handed to its service (as a crashed
    /// process's connections would break). The caller holds `box.mutex`.
    static void fail_held(Mailbox& box, const std::string& why);

    /// After a sender handled its request here (`send`, holding `box.serving`): what other
    /// senders queued meanwhile, in order, on this thread rather than the task's own. With
    /// two workers on two cores a hand-off woke a third thread for each request that found
    /// the ps busy (a quarter of an async job's requests) and waited for a core for it.
    /// At most kMaxCombined, so that the sender's own caller is not held up by a busy job's
    /// stream of requests: the task's thread takes the rest (as it does for a slowed task).
    void handle_queued(Mailbox& box, std::uint32_t task);

    /// Ends a sender's turn at the queue (handle_queued) early: the task's thread takes it.
    static void stop_combining(Mailbox& box) noexcept;

    /// Hands one request to the service; the caller holds `box.serving`.
    static void handle(Fabric& fabric, Mailbox& box, std::uint32_t task, Request&& request,
                       Node from, std::uint64_t session, const CallPtr& call);

    /// The task's own thread: serves the queue until the service stops (and the queue is
    /// drained) or the task is killed.
    void run(Mailbox& box, std::uint32_t task);

    std::chrono::microseconds delay_of(Node node) const;

    bool take_drop(std::uint32_t ps, Node from) { return take_rule(drops_, ps, from); }
    bool take_reply_loss(std::uint32_t ps, Node from);

    bool take_rule(std::vector<DropRule>& rules, std::uint32_t ps, Node from);

    void break_session(std::uint64_t session);

    std::vector<std::unique_ptr<Mailbox>> mailboxes_;
    std::mutex threads_mutex_;
    std::vector<std::thread> threads_;
    mutable std::mutex faults_mutex_;
    std::vector<DropRule> drops_;
    std::vector<DropRule> reply_losses_;
    std::vector<RandomLoss> random_losses_;
    std::set<std::uint64_t> broken_;  ///< connections broken by lose_replies
    std::atomic<bool> any_broken_{false};
    std::map<Node, std::chrono::microseconds> delays_;
    std::map<Node, bool> dead_;
    std::vector<CallPtr> lost_;
    std::atomic<std::uint64_t> next_session_{0};
  };

  std::shared_ptr<Fabric> fabric_;
  std::uint32_t spec_ps_;  ///< ps tasks endpoints reach from the start
};

/// A client endpoint on an InProcessNetwork: the in-process `Transport`.
class InProcess {
 public:
  /// @param network the cluster's fabric
  /// @param self    who is calling: the ps tasks check what its job may send, and the fault
  ///                injector acts on it
  InProcess(InProcessNetwork& network, Node self) : fabric_(network.fabric_), self_(self) {
    for (std::uint32_t ps = 0; ps < network.spec_ps_; ++ps) sessions_.push_back(fabric_->new_session());
  }

  /// Number of ps tasks this endpoint reaches: the network's, without the joinable ones
  /// it has not learned of (`add_ps`).
  [[nodiscard]] std::size_t num_ps() const noexcept { return sessions_.size(); }

  /// Reaches the next joinable ps task (task num_ps()); `address` names it in messages
  /// only, and `connect` changes nothing in-process. Throws kFailedPrecondition when the
  /// network has no more.
  void add_ps(const std::string& address, bool /*connect*/ = true) {
    if (sessions_.size() >= fabric_->num_ps()) {
      throw Error(ErrorCode::kFailedPrecondition, "ps at " + address + ": the in-process network has no joinable ps task left");
    }
    sessions_.push_back(fabric_->new_session());
  }

  /// Ps task `ps`'s address in-process: "in-process:" and its index.
  [[nodiscard]] std::string address(std::size_t ps) const { return "in-process:" + std::to_string(ps); }
  /// Who this endpoint speaks for.
  [[nodiscard]] Node self() const noexcept { return self_; }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    std::uint64_t session = 0;
    if (ps < sessions_.size()) {
      if (fabric_->is_broken(sessions_[ps])) sessions_[ps] = fabric_->new_session();  // reconnects
      session = sessions_[ps];
    }
    return fabric_->send(self_, session, static_cast<std::uint32_t>(ps), std::move(request), std::move(targets));
  }

 private:
  std::shared_ptr<InProcessNetwork::Fabric> fabric_;
  Node self_;
  std::vector<std::uint64_t> sessions_;  ///< by ps: this endpoint's connection to it
};
static_assert(GrowingTransport<InProcess>);

}  // namespace pulley

// InProcessNetwork's member functions' definitions, by concern.
#include "pulley/transport/impl/in_process_faults.hpp"
#include "pulley/transport/impl/in_process_requests.hpp"
#include "pulley/transport/impl/in_process_serving.hpp"
