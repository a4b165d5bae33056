// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/runner/copy_rulings.hpp"

namespace pulley {

/// The tasks that asked the chief to join the job, or to leave it, and wait for it (Join,
/// Leave): filled by the JoinDesk on its server's thread, emptied by the chief's loop on
/// its own. It also keeps the job's workers and ps tasks as the chief last counted them,
/// so that the desk can tell a task whether it is in, or out.
class JoinQueue {
 public:
  /// One task that asked.
  struct Asked {
    std::uint32_t task = 0;  ///< its task index, as its handshake proved it
    std::string address;     ///< where it serves (a ps)
    int tries = 0;           ///< joins cut short by a lost ps so far
    Node::Role role = Node::Role::kPs;
    bool leaving = false;    ///< it asks to leave the job (Leave), not to join it
  };

  /// What the desk answers a task that asked.
  enum class Standing : std::uint8_t {
    kWaiting,   ///< queued: the chief counts it in (or out) as soon as it is free
    kIn,        ///< one of the job's workers: it may connect to the ps tasks
    kOut,       ///< it asked to leave, and is no task of the job any more
    kRefused,   ///< the chief could not count it in or out (the reason comes with it)
  };

  /// @param num_workers the cluster spec's workers (task indices 0 .. num_workers - 1)
  /// @param last_step   the global step training ends at, as the chief runs it (a worker
  ///                    that joins follows it)
  explicit JoinQueue(std::uint32_t num_workers = 0, std::int64_t last_step = 0)
      : known_(num_workers), last_step_(last_step) {
    for (std::uint32_t w = 0; w < num_workers; ++w) workers_.push_back(w);
  }

  /// The global step training ends at.
  [[nodiscard]] std::int64_t last_step() const noexcept { return last_step_; }

  /// Queues `asked` (a ps), or leaves a task the job has known already alone (a joined ps
  /// started again with --join: the chief takes it back as any ps started again, by a
  /// rollback); why not, if it is refused: beyond the next task index (once the chief
  /// said it: `expect`), or that task asked already.
  std::optional<std::string> ask(Asked asked) {
    std::scoped_lock lock(mutex_);
    if (next_ && asked.task < *next_) return std::nullopt;
    if (next_ && asked.task != *next_) {
      return "the next ps task of the job is ps " + std::to_string(*next_) + ", not ps " + std::to_string(asked.task) +
             ": list the new ps after the job's ps tasks in its cluster spec";
    }
    for (const Asked& a : waiting_) {
      if (a.role == Node::Role::kPs && a.task == asked.task) return "ps " + std::to_string(asked.task) + " asked to join already";
    }
    waiting_.push_back(std::move(asked));
    return std::nullopt;
  }

  /// Where worker `task` stands, queuing it the first time it asks; with kRefused, `why`
  /// says why (a worker index beyond the next one, or the chief's refusal, told once: a
  /// process that asks again later is queued again).
  Standing ask_worker(std::uint32_t task, std::string& why) {
    std::scoped_lock lock(mutex_);
    if (std::binary_search(workers_.begin(), workers_.end(), task)) return Standing::kIn;
    if (told_refusal(Node::worker(task), why)) return Standing::kRefused;
    const std::uint32_t next = next_worker();
    if (task > next) {
      why = "the next worker of the job is worker " + std::to_string(next) + ", not worker " + std::to_string(task) +
            ": list the new worker after the job's workers in its cluster spec";
      return Standing::kRefused;
    }
    const bool queued = std::any_of(waiting_.begin(), waiting_.end(), [&](const Asked& a) {
      return a.role == Node::Role::kWorker && a.task == task;
    });
    if (!queued) waiting_.push_back({task, {}, 0, Node::Role::kWorker});
    return Standing::kWaiting;
  }

  /// Where task `who` (a ps task or a worker) stands after asking to leave the job,
  /// queuing it the first time: kOut once the chief took it out (`took_out`), kRefused with
  /// `why` (the job's last worker or ps task, or the chief's refusal, told once), else
  /// kWaiting.
  Standing ask_leave(Node who, std::string& why) {
    std::scoped_lock lock(mutex_);
    if (out_.contains(who)) return Standing::kOut;
    if (told_refusal(who, why)) return Standing::kRefused;
    const bool worker = who.role == Node::Role::kWorker;
    const std::vector<std::uint32_t>& tasks = worker ? workers_ : ps_;
    if (tasks.size() == 1 && tasks.front() == who.index) {
      why = (worker ? "worker " : "ps ") + std::to_string(who.index) + " is the job's last " +
            (worker ? "worker" : "ps task") + ": it cannot leave";
      return Standing::kRefused;
    }
    const bool queued = std::any_of(waiting_.begin(), waiting_.end(), [&](const Asked& a) {
      return a.role == who.role && a.task == who.index && a.leaving;
    });
    if (!queued) waiting_.push_back({who.index, {}, 0, who.role, true});
    return Standing::kWaiting;
  }

  /// The oldest task that asked, taken out; nullopt when none waits.
  std::optional<Asked> take() {
    std::scoped_lock lock(mutex_);
    if (waiting_.empty()) return std::nullopt;
    Asked first = std::move(waiting_.front());
    waiting_.pop_front();
    return first;
  }

  /// Puts `asked` back first in line (its join is tried again).
  void put_back(Asked asked) {
    std::scoped_lock lock(mutex_);
    waiting_.push_front(std::move(asked));
  }

  /// The ps tasks the job has known, members or not, by task index (their addresses):
  /// the next ps to join must have index `ps_addresses.size()`.
  void expect(std::vector<std::string> ps_addresses) {
    std::scoped_lock lock(mutex_);
    next_ = static_cast<std::uint32_t>(ps_addresses.size());
    if (on_expect_) on_expect_(ps_addresses);
    ps_addresses_ = std::move(ps_addresses);
  }

  /// Calls `told(ps_addresses)` with what each `expect` says from now on (the chief's
  /// rulings learn the address of a ps that joined).
  void on_expect(std::function<void(const std::vector<std::string>&)> told) {
    std::scoped_lock lock(mutex_);
    on_expect_ = std::move(told);
  }

  /// The chief's loop gave up every copy ps `ps`'s process holds and found no process to
  /// take back there (Chief::given_up_whole): calls what `on_may_restart` set (the role
  /// runner's: CopyRulings::revive, which tells a process ruled lost there that lives on to
  /// start again empty).
  void may_restart(std::uint32_t ps) {
    std::function<void(std::uint32_t)> told;
    {
      std::scoped_lock lock(mutex_);
      told = on_may_restart_;
    }
    if (told) told(ps);
  }

  /// Calls `told(ps)` at each `may_restart` from now on.
  void on_may_restart(std::function<void(std::uint32_t)> told) {
    std::scoped_lock lock(mutex_);
    on_may_restart_ = std::move(told);
  }

  /// The job as the chief last said it, for a task that joins knowing only the chief's
  /// address (Shape).
  [[nodiscard]] ShapeReply shape() const {
    std::scoped_lock lock(mutex_);
    return ShapeReply{ps_addresses_, ps_, workers_, next_worker()};
  }

  /// The job's workers, ascending, as the chief counts them now.
  [[nodiscard]] std::vector<std::uint32_t> workers() const {
    std::scoped_lock lock(mutex_);
    return workers_;
  }
  /// The chief counts `workers` now (ascending): those among them are in.
  void set_workers(std::vector<std::uint32_t> workers) {
    std::scoped_lock lock(mutex_);
    for (const std::uint32_t w : workers) {  // in now: what it was told before no longer holds
      refused_.erase(Node::worker(w));
      out_.erase(Node::worker(w));
    }
    known_ = std::max(known_, workers.empty() ? 0U : workers.back() + 1);
    workers_ = std::move(workers);
  }
  /// The job's ps tasks, ascending, as the chief has them now (the last one cannot leave).
  void set_ps(std::vector<std::uint32_t> members) {
    std::scoped_lock lock(mutex_);
    ps_ = std::move(members);
  }

  /// The chief took `who`, which asked to leave, out of the job (or found it out already):
  /// the desk tells it so from now on.
  void took_out(Node who) {
    std::scoped_lock lock(mutex_);
    out_.insert(who);
    refused_.erase(who);
  }

  /// The chief could not count task `who` in or out, for `why`: the desk tells it so (and
  /// forgets that it asked).
  void refuse(Node who, std::string why) {
    std::scoped_lock lock(mutex_);
    std::erase_if(waiting_, [&](const Asked& a) { return a.role == who.role && a.task == who.index; });
    refused_[who] = std::move(why);
  }

 private:
  /// True, with the chief's refusal of `who` in `why`, if there is one (told once).
  bool told_refusal(Node who, std::string& why) {
    const auto refusal = refused_.find(who);
    if (refusal == refused_.end()) return false;
    why = std::move(refusal->second);
    refused_.erase(refusal);
    return true;
  }

  /// The index the next new worker has: one past every worker the job has known.
  [[nodiscard]] std::uint32_t next_worker() const {
    std::uint32_t next = std::max(known_, workers_.empty() ? 0U : workers_.back() + 1);
    for (const Asked& a : waiting_) {  // two new workers asking at once: the second is next but one
      if (a.role == Node::Role::kWorker && !a.leaving) next = std::max(next, a.task + 1);
    }
    return next;
  }

  mutable std::mutex mutex_;
  std::deque<Asked> waiting_;
  std::optional<std::uint32_t> next_;
  std::vector<std::string> ps_addresses_;  ///< every ps task the job has known, by index
  std::function<void(const std::vector<std::string>&)> on_expect_;  ///< on_expect
  std::function<void(std::uint32_t)> on_may_restart_;               ///< on_may_restart
  std::vector<std::uint32_t> workers_;
  std::uint32_t known_;  ///< one past the highest worker index the job has counted
  std::vector<std::uint32_t> ps_;  ///< the job's ps tasks, as the chief last said
  std::set<Node> out_;             ///< tasks the chief took out at their request
  std::map<Node, std::string> refused_;
  std::int64_t last_step_;
};

/// The chief's door, a Service its TcpServer serves on the chief's address: a new ps task
/// or worker asks there to join the running job (Join), and a task of the job to leave it
/// (Leave), or a task about to join asks for the job's shape (Shape), or, in a job with
/// copies, a task asks whether a ps process it cannot reach is lost (LostPs: the chief's
/// CopyRulings answer), proving the job's secret at the handshake like every task. The desk queues it (JoinQueue); the chief takes it in as
/// soon as it is free: while it waits for training to reach its next evaluation or
/// checkpoint (within half a second), or once it has evaluated or saved. A ps is answered
/// at once; a worker asks until it is in, and a task that leaves until it is out.
/// Every other request is refused: the chief serves nothing else.
class JoinDesk {
 public:
  /// @param rulings the chief's rulings on lost ps processes (a job with copies), else null
  explicit JoinDesk(std::shared_ptr<JoinQueue> queue, std::shared_ptr<CopyRulings> rulings = nullptr)
      : queue_(std::move(queue)), rulings_(std::move(rulings)) {}

  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    try {
      if (std::holds_alternative<Leave>(request)) return answer_leave(context, reply);
      if (std::holds_alternative<Shape>(request)) return answer_shape(context, reply);
      if (const auto* lost = std::get_if<LostPs>(&request)) return answer_lost(*lost, context, reply);
      auto* join = std::get_if<Join>(&request);
      if (join == nullptr) {
        return respond(reply, ErrorReply{ErrorCode::kInvalidArgument,
                                         "this is the chief: it takes Join, Leave, Shape and LostPs requests of "
                                         "tasks only"});
      }
      if (context.peer && context.peer->role == Node::Role::kWorker) return answer_worker(context.peer->index, reply);
      if (!context.peer || context.peer->role != Node::Role::kPs) {
        return respond(reply, ErrorReply{ErrorCode::kPermissionDenied, "only a ps task or a worker may ask to join the job"});
      }
      if (join->address.empty() || join->address.size() > 255) {
        return respond(reply, ErrorReply{ErrorCode::kInvalidArgument, "a Join names its address (host:port)"});
      }
      if (auto why = queue_->ask({context.peer->index, std::move(join->address)})) {
        return respond(reply, ErrorReply{ErrorCode::kFailedPrecondition, std::move(*why)});
      }
      respond(reply, Ack{});
    } catch (...) {  // no memory
      respond(reply, ErrorReply{ErrorCode::kInternal, "the chief could not queue the Join"});
    }
  }

  /// A worker: the job's schedule and workers once it is one of them (JoinReply),
  /// kUnavailable while it waits (it asks again), or the refusal.
  void answer_worker(std::uint32_t task, Responder& reply) {
    std::string why;
    switch (queue_->ask_worker(task, why)) {
      case JoinQueue::Standing::kIn:
        return respond(reply, JoinReply{queue_->last_step(), queue_->workers()});
      case JoinQueue::Standing::kWaiting:
      case JoinQueue::Standing::kOut:  // (not an answer to a Join)
        return respond(reply, ErrorReply{ErrorCode::kUnavailable, "worker " + std::to_string(task) +
                                                                      " waits for the chief to count it in"});
      case JoinQueue::Standing::kRefused:
        return respond(reply, ErrorReply{ErrorCode::kFailedPrecondition, why});
    }
  }

  /// A ps task or worker that asks to leave: whether it is out (LeaveReply), or the refusal.
  void answer_leave(const RequestContext& context, Responder& reply) {
    if (!context.peer || (context.peer->role != Node::Role::kPs && context.peer->role != Node::Role::kWorker)) {
      return respond(reply, ErrorReply{ErrorCode::kPermissionDenied, "only a ps task or a worker may ask to leave the job"});
    }
    std::string why;
    switch (queue_->ask_leave(*context.peer, why)) {
      case JoinQueue::Standing::kOut:
        return respond(reply, LeaveReply{true});
      case JoinQueue::Standing::kRefused:
        return respond(reply, ErrorReply{ErrorCode::kFailedPrecondition, why});
      case JoinQueue::Standing::kWaiting:
      case JoinQueue::Standing::kIn:
        return respond(reply, LeaveReply{false});
    }
  }

  /// A task about to join: the job's shape, once the chief has said it (kUnavailable
  /// before: ask again).
  void answer_shape(const RequestContext& context, Responder& reply) {
    if (!context.peer || context.peer->role == Node::Role::kChief) {
      return respond(reply, ErrorReply{ErrorCode::kPermissionDenied, "only a ps task, a worker or an evaluator may ask for the job's shape"});
    }
    ShapeReply shape = queue_->shape();
    if (shape.ps.empty()) {
      return respond(reply, ErrorReply{ErrorCode::kUnavailable, "the chief has not started the job yet"});
    }
    respond(reply, std::move(shape));
  }

  /// A worker or the evaluator that cannot reach a ps process: the chief's ruling
  /// (LostPsReply), or kUnavailable while the chief looks at it (ask again).
  void answer_lost(const LostPs& lost, const RequestContext& context, Responder& reply) {
    if (!context.peer || (context.peer->role != Node::Role::kWorker && context.peer->role != Node::Role::kEvaluator)) {
      return respond(reply, ErrorReply{ErrorCode::kPermissionDenied, "only a worker or an evaluator may ask whether a ps is lost"});
    }
    if (rulings_ == nullptr) {
      return respond(reply, ErrorReply{ErrorCode::kFailedPrecondition,
                                       "this job's ps tasks keep no copies of each other's shards: nothing to give up"});
    }
    std::optional<CopyRulings::Ruling> ruling = rulings_->rule(LostProcess{lost.ps, lost.process, lost.why.substr(0, 256)});
    if (!ruling) {
      return respond(reply, ErrorReply{ErrorCode::kUnavailable, "the chief looks at ps " + std::to_string(lost.ps) +
                                                                    ": ask again"});
    }
    respond(reply, LostPsReply{ruling->lost, std::move(ruling->why)});
  }

  /// The chief's desk answers the handshake as task 0 of its one address.
  [[nodiscard]] std::uint32_t task() const noexcept { return 0; }
  /// It serves until its server is stopped (the chief ends).
  [[nodiscard]] bool stopped() const noexcept { return false; }

 private:
  std::shared_ptr<JoinQueue> queue_;
  std::shared_ptr<CopyRulings> rulings_;
};
static_assert(Service<JoinDesk>);

}  // namespace pulley
