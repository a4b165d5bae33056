// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "pulley/concepts/service.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// The ps tasks that asked the chief to join the job and wait for it (Join): filled by the
/// JoinDesk on its server's thread, emptied by the chief's loop on its own.
class JoinQueue {
 public:
  /// One ps that asked.
  struct Asked {
    std::uint32_t task = 0;  ///< its task index, as its handshake proved it
    std::string address;     ///< where it serves
    int tries = 0;           ///< joins cut short by a lost ps so far
  };

  /// Queues `asked`, or leaves a task the job has known already alone (a joined ps started
  /// again with --join: the chief takes it back as any ps started again, by a rollback);
  /// why not, if it is refused: beyond the next task index (once the chief said it:
  /// `expect`), or that task asked already.
  std::optional<std::string> ask(Asked asked) {
    std::scoped_lock lock(mutex_);
    if (next_ && asked.task < *next_) return std::nullopt;
    if (next_ && asked.task != *next_) {
      return "the next ps task of the job is ps " + std::to_string(*next_) + ", not ps " + std::to_string(asked.task) +
             ": list the new ps after the job's ps tasks in its cluster spec";
    }
    for (const Asked& a : waiting_) {
      if (a.task == asked.task) return "ps " + std::to_string(asked.task) + " asked to join already";
    }
    waiting_.push_back(std::move(asked));
    return std::nullopt;
  }

  /// The oldest ps that asked, taken out; nullopt when none waits.
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

  /// The task index the next ps to join must have (the ps tasks the job has known).
  void expect(std::uint32_t next) {
    std::scoped_lock lock(mutex_);
    next_ = next;
  }

 private:
  std::mutex mutex_;
  std::deque<Asked> waiting_;
  std::optional<std::uint32_t> next_;
};

/// The chief's door, a Service its TcpServer serves on the chief's address: a new ps task
/// asks there to join the running job (Join), proving the job's secret at the handshake
/// like every task. The desk queues it (JoinQueue) and answers at once; the chief takes it
/// in at its next evaluation or checkpoint. Every other request is refused: the chief
/// serves nothing else.
class JoinDesk {
 public:
  explicit JoinDesk(std::shared_ptr<JoinQueue> queue) : queue_(std::move(queue)) {}

  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    try {
      auto* join = std::get_if<Join>(&request);
      if (join == nullptr) {
        return respond(reply, ErrorReply{ErrorCode::kInvalidArgument,
                                         "this is the chief: it takes Join requests of new ps tasks only"});
      }
      if (!context.peer || context.peer->role != Node::Role::kPs) {
        return respond(reply, ErrorReply{ErrorCode::kPermissionDenied, "only a ps task may ask to join the job"});
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

  /// The chief's desk answers the handshake as task 0 of its one address.
  [[nodiscard]] std::uint32_t task() const noexcept { return 0; }
  /// It serves until its server is stopped (the chief ends).
  [[nodiscard]] bool stopped() const noexcept { return false; }

 private:
  std::shared_ptr<JoinQueue> queue_;
};
static_assert(Service<JoinDesk>);

}  // namespace pulley
