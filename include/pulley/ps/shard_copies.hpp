// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "pulley/concepts/service.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// One ps task of a job that keeps a copy of every shard (`--ps-replicas 1`, beyond
/// TensorFlow): it serves its own shard, ps k's, and a copy of ps k − 1's (mod P), each a
/// whole ParameterServer: parts, optimizer slots, table rows and the sync policy's state.
///
/// It holds no replication logic of its own. The clients keep the copies alike: what
/// changes a shard they send to both of its copies, and they count it done once both have
/// answered (Tcp with `TcpOptions::replicas`); both copies take the same requests, so
/// under SyncReplicas with R = N their state is the same at every step boundary (bit for
/// bit with 2 workers, or one; with more, each copy may sum a step's gradients in another
/// order). With backup workers each copy takes the first R fresh pushes it sees, and
/// under Async and BoundedStaleness each applies pushes in the order they reach it: the
/// copies may then differ by what arrived first. When a ps is lost, the clients read its
/// shard from the copy, and training goes on without a rollback.
///
/// A connection names the shard it wants at its handshake (wire::Hello::shard,
/// RequestContext::shard). Heartbeats reach both copies whichever connection brings them,
/// as does a lost connection: each copy judges the workers and the chief on its own. A
/// push a worker sent just before it was lost may have reached one copy of a shard only,
/// which then counts it where the other completes the step without it: the role runner's
/// chief makes both copies alike again once the lost workers stop changing
/// (Chief::align_copies).
///
/// The chief's lease (`set_chief_lease`): only the chief gives a ps process up for the
/// job (CopyRulings), and it does so once it could not reach the process for the copy
/// timeout. A process cut off from the chief but reached by some tasks would go on serving
/// them after that ruling, while the tasks that heard it write the other copies alone: the
/// copies of its shards would part. So a process serves the tasks only while it heard the
/// chief (any request of the chief's) within its lease: with the role runner, three
/// quarters of the shorter of the copy timeout (so it ends before the chief can rule after
/// a silence) and the worker timeout (before it may complete a step without a worker cut
/// off with the chief); the chief beats every sixth of that (TrainingOptions::chief_lease). Then it
/// refuses every task but the chief (`fenced`, which the transport asks: a connection is closed at
/// its next request or reply, and new ones are refused for now) until it hears the chief again; a
/// task refused so finds the process out of reach and asks the chief about it, as for a
/// process gone. A chief lost or stopped therefore pauses a job with copies until a chief
/// comes back: nobody else may rule which copies stand.
///
/// Which copy it holds follows the job's ps tasks (copy_holder): when a ps leaves the job
/// (Chief::retire), the member after it holds the copy the leaving one held, in place of
/// the leaving one's; when a ps joins (Chief::join) as the last task, the first member
/// holds the new ps's copy in place of the last one's, which the new ps holds. The chief's
/// registration of the model at the new membership, sent on a connection that asks for that shard,
/// makes the new copy (`make_copy`), empty until the chief restores it; what waited on the copy
/// held before is answered kUnavailable, and so is what comes later on a connection to it (its
/// sender learns the membership again).
///
/// @tparam PS the ParameterServer type of both copies
template <class PS>
class ShardCopies {
 public:
  /// @param own       ps k, serving its own shard
  /// @param copy      the copy of ps (k − 1) mod P's shard, of the same type
  /// @param make_copy makes an empty copy of ps j's shard (as `copy` was made for j =
  ///                  k − 1), when the job's ps tasks change; none: the copy never moves
  ShardCopies(PS own, PS copy,
              std::type_identity_t<std::function<PS(std::uint32_t)>> make_copy = {})
      : own_(std::move(own)), copy_(std::move(copy)), make_copy_(std::move(make_copy)) {
    copy_.set_name(copy_name(copy_.task()));
  }

  /// Serves the tasks only while the chief was heard within `lease` (zero, the default:
  /// always). The lease runs from the chief's first request on, and ends with the chief's
  /// leaving heartbeat (training over). Keep it below the copy timeout of the chief's
  /// rulings by more than a request's way from the chief, and above the chief's heartbeat
  /// interval by some (the role runner's: TrainingOptions::chief_lease).
  void set_chief_lease(std::chrono::milliseconds lease) noexcept {
    lease_ = lease;
    own_.set_serves_without_chief(lease.count() <= 0);
    copy_.set_serves_without_chief(lease.count() <= 0);
  }

  /// Why task `peer` may not be served now (its lease ran out: see the class comment), or
  /// "" when it may. The chief always may, and so may everyone once training ended here
  /// (the answer says how). Logs when the process stops serving the tasks.
  [[nodiscard]] std::string fenced(const Node& peer) {
    if (lease_.count() <= 0 || !chief_heard_ || peer.role == Node::Role::kChief || stopped()) return {};
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *chief_heard_);
    if (silent < lease_) return {};
    std::string why = "ps " + std::to_string(own_.task()) + " has not heard the chief for " +
                      std::to_string(silent.count()) + " ms (its lease: " + std::to_string(lease_.count()) +
                      " ms): it serves no task until it does, since the chief may give its copies up";
    if (!std::exchange(fenced_, true)) log(LogLevel::kWarning, why);
    return why;
  }

  /// Hands `request` to the copy its connection asked for; a heartbeat, and a Shutdown that
  /// restarts the process, to both. A
  /// connection to a copy it holds no more is answered kUnavailable (but for heartbeats),
  /// unless the chief registers the model there at a membership that places that copy
  /// here: the copy then moves (see the class comment).
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    const bool chief = context.peer && context.peer->role == Node::Role::kChief;
    if (chief) heard_chief(request);
    if (context.shard && *context.shard != copy_.task() &&
        !take_copy_of(*context.shard, request, chief) &&
        !std::holds_alternative<Heartbeat>(request)) {
      std::string why;
      try {
        why = "ps " + std::to_string(own_.task()) + " holds no copy of ps " +
              std::to_string(*context.shard) + "'s shard now (it holds ps " +
              std::to_string(copy_.task()) + "'s): the job's ps tasks changed, ask them again";
      } catch (...) {  // (no memory for the words: the code says enough)
      }
      respond(reply, ErrorReply{ErrorCode::kUnavailable, std::move(why)});
      return;
    }
    const bool to_copy = context.shard && *context.shard == copy_.task();
    if (const auto* beat = std::get_if<Heartbeat>(&request)) {
      Heartbeat twin = *beat;
      (to_copy ? own_ : copy_).handle(Request{std::move(twin)}, context, [](Response&&) {});
    }
    if (const auto* end = std::get_if<Shutdown>(&request); end != nullptr && end->restart) {
      (to_copy ? own_ : copy_).handle(Request{Shutdown{*end}}, context, [](Response&&) {});
    }
    (to_copy ? copy_ : own_).handle(std::move(request), context, std::move(reply));
  }

  /// ps k's index.
  [[nodiscard]] std::uint32_t task() const noexcept { return own_.task(); }
  /// True if a task may connect to a copy of ps `shard`'s shard here: the one it holds, or,
  /// when its copy may move (`make_copy`), any other than its own (the chief's registration
  /// moves it; anyone else's request there is refused until then).
  [[nodiscard]] bool holds_copy(std::uint32_t shard) const noexcept {
    return shard == copy_.task() || (make_copy_ && shard != own_.task());
  }
  /// True once both copies serve no more (the chief shuts both down).
  [[nodiscard]] bool stopped() const noexcept { return own_.stopped() && copy_.stopped(); }
  /// Once both serve no more: a worker may still come to hear it (ParameterServer::awaits_workers).
  [[nodiscard]] bool awaits_workers() const {
    return stopped() && (own_.awaits_workers() || copy_.awaits_workers());
  }
  /// True once the chief told the process to start again empty (Shutdown::restart).
  [[nodiscard]] bool restarts() const noexcept { return own_.restarts(); }
  /// How it ended: its own shard's end, else the copy's.
  [[nodiscard]] const std::optional<ErrorReply>& ended() const noexcept {
    return own_.ended() ? own_.ended() : copy_.ended();
  }
  /// Time passed with no request: each copy holds the chief lost, and gives up on it, by
  /// its own clock (a process fenced off hears nobody but the chief).
  void tick() noexcept {
    own_.tick();
    copy_.tick();
  }
  void disconnected(const Node& node, std::uint64_t session) noexcept {
    own_.disconnected(node, session);
    copy_.disconnected(node, session);
  }
  /// The job's workers, as ps k's own copy has them (both take every ChangeWorkers).
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return own_.workers(); }
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return std::max(own_.max_request_payload(), copy_.max_request_payload());
  }

  /// ps k's own shard.
  [[nodiscard]] PS& own() noexcept { return own_; }
  /// The copy it holds: of ps k − 1's shard (mod P), or of the member before it once the
  /// job's ps tasks changed (copy_holder).
  [[nodiscard]] PS& copy() noexcept { return copy_; }

 private:
  using Clock = std::chrono::steady_clock;

  /// The chief sent `request`: its lease runs again (it ends when the chief leaves), and
  /// after a fence both copies forgive the workers the silence that was the process's own
  /// (Liveness::forgive). A look
  /// (GetStats) renews a lease but starts none: a chief started again looks at the ps
  /// tasks before it begins (runner/run.hpp), and at a job's start it must not fence the
  /// ones up while it waits for the others.
  void heard_chief(const Request& request) noexcept {
    // The fence began when the lease ran out (fenced_ is set only after it did).
    const bool fence_ends = fenced_ && chief_heard_.has_value();
    const Clock::time_point fence_began = fence_ends ? *chief_heard_ + lease_ : Clock::time_point{};
    const auto* beat = std::get_if<Heartbeat>(&request);
    if (beat != nullptr && beat->leaving) {
      chief_heard_.reset();
    } else if (chief_heard_ || !std::holds_alternative<GetStats>(request)) {
      chief_heard_ = Clock::now();
    }
    if (std::exchange(fenced_, false)) {
      if (fence_ends) {
        own_.fence_lifted(fence_began);
        copy_.fence_lifted(fence_began);
      }
      try {
        log(LogLevel::kInfo, "ps " + std::to_string(own_.task()) + " heard the chief again: it serves the tasks again");
      } catch (...) {  // (no memory for a log line: the lease runs again all the same)
      }
    }
  }

  /// The chief registers the model over members that place ps `shard`'s copy here (the
  /// copy held until now went with a ps that left): the copy held is let go, and an empty
  /// one of `shard` takes its place, for the chief to restore. True if it moved.
  bool take_copy_of(std::uint32_t shard, const Request& request, bool chief) noexcept {
    const auto* registration = std::get_if<Register>(&request);
    if (!chief || registration == nullptr || !make_copy_ || shard == own_.task() ||
        copy_holder(registration->members, shard) != own_.task()) {
      return false;
    }
    std::string line;
    try {  // everything that may throw, before the copy held is let go
      PS fresh = make_copy_(shard);
      const std::string now = "ps " + std::to_string(own_.task()) + " holds a copy of ps " +
                              std::to_string(shard) + "'s shard";
      const std::string instead = "in place of ps " + std::to_string(copy_.task()) + "'s";
      line =
          now + " from membership " + std::to_string(registration->membership) + " on, " + instead;
      fresh.set_name(copy_name(shard));
      fresh.set_serves_without_chief(lease_.count() <= 0);
      copy_.let_go(now + " now, " + instead);
      copy_ = std::move(fresh);
    } catch (...) {  // (the request is refused: the chief's move fails, and it moves nothing)
      try {
        log(LogLevel::kError, "ps " + std::to_string(own_.task()) +
                                  " could not make a copy of ps " + std::to_string(shard) +
                                  "'s shard");
      } catch (...) {
      }
      return false;
    }
    try {
      log(LogLevel::kInfo, line);
    } catch (...) {  // (no memory for the line: the copy moved all the same)
    }
    return true;
  }

  /// How its copy of ps `shard`'s shard is named in log lines and errors.
  [[nodiscard]] std::string copy_name(std::uint32_t shard) const {
    return "ps " + std::to_string(own_.task()) + "'s copy of ps " + std::to_string(shard);
  }

  PS own_;
  PS copy_;
  std::function<PS(std::uint32_t)> make_copy_;  ///< an empty copy of ps j's shard (may be empty)
  std::chrono::milliseconds lease_{0};
  std::optional<Clock::time_point> chief_heard_;  ///< the chief's last request, once it sent one
  bool fenced_ = false;                           ///< the lease ran out: logged once
};

}  // namespace pulley
