// SPDX-License-Identifier: MIT
#pragma once

/// InProcessNetwork's requests (declared in transport/in_process.hpp, which includes this
/// header after the class): a request sent, on the sender's thread when the ps task is
/// idle or queued for it when not, handed to the service, and its answer copied into the
/// caller's targets (or lost, when its connection breaks).

#include "pulley/transport/in_process.hpp"

namespace pulley {

inline void InProcessNetwork::Call::complete(Response&& response) {
  unless_cancelled([&] {
    if (has_answer()) return;
    if (lost_reply) response = ErrorReply{ErrorCode::kUnavailable, *lost_reply};
    if (!std::holds_alternative<ErrorReply>(response) && !detail::copy_into(response, targets)) {
      response = ErrorReply{ErrorCode::kInvalidArgument, "reply does not fit its targets"};
    }
    answer(std::move(response));
  });
}

inline PendingCall InProcessNetwork::Fabric::send(Node from, std::uint64_t session,
                                                  std::uint32_t ps, Request&& request,
                                                  PullTargets&& targets) {
  auto call = std::make_shared<Call>();
  call->targets = std::move(targets);
  PendingCall pending(call);
  if (ps >= num_ps()) {
    call->complete(ErrorReply{ErrorCode::kInvalidArgument,
                              "no ps task " + std::to_string(ps) + " in this cluster"});
    return pending;
  }
  if (is_dead(from)) {
    call->complete(unavailable(from.name() + " is unavailable (killed)"));
    return pending;
  }
  if (auto d = delay_of(from); d.count() > 0) std::this_thread::sleep_for(d);
  if (take_drop(ps, from)) {
    std::scoped_lock lock(faults_mutex_);
    lost_.push_back(std::move(call));  // never answered; the caller's deadline fires
    return pending;
  }
  if (take_reply_loss(ps, from)) {
    call->lost_reply =
        "the connection to " + Node::ps(ps).name() + " was lost before its answer came";
  }
  Mailbox& box = *mailboxes_[ps];
  std::unique_lock serving(box.serving, std::try_to_lock);
  bool idle = false;
  {
    std::scoped_lock lock(box.mutex);
    if (const auto gone = gone_reason(box, ps)) {
      call->complete(unavailable(*gone));
      return pending;
    }
    idle =
        serving.owns_lock() && box.host && box.queue.empty() && delay_of(Node::ps(ps)).count() == 0;
    if (!idle && (box.thread_running || !box.host)) {
      box.queue.push_back({std::move(request), std::move(call), from, session});
      if (!box.combining) box.wake.notify_one();  // (else the sender serving takes it)
      return pending;
    }
    if (idle) box.combining = true;
  }
  // Idle, or stopped with no thread left: handled here (a stopped service answers at
  // once, so waiting for another sender's turn is short).
  if (!serving.owns_lock()) serving.lock();
  try {
    handle(*this, box, ps, std::move(request), from, session, call);
    if (idle) handle_queued(box, ps);
  } catch (...) {  // (an allocation failed): what is queued goes to the task's thread
    if (idle) stop_combining(box);
    throw;
  }
  return pending;
}

inline void InProcessNetwork::Fabric::handle(Fabric& fabric, Mailbox& box, std::uint32_t task,
                                             Request&& request, Node from, std::uint64_t session,
                                             const CallPtr& call) {
  {
    std::scoped_lock lock(box.mutex);
    if (const auto gone = gone_reason(box, task)) {
      call->complete(unavailable(*gone));
      return;
    }
    if (fabric.is_dead(from)) {  // killed after it sent this: a dead process sends nothing
      call->complete(unavailable(from.name() + " is unavailable (killed)"));
      return;
    }
    if (fabric.is_broken(session)) {  // sent on a connection that broke before its turn
      call->complete(unavailable("the connection to " + Node::ps(task).name() + " was lost"));
      return;
    }
    std::erase_if(box.in_service, [](const CallPtr& c) { return c->has_answer(); });
    box.in_service.push_back(call);
  }
  // One use while the service reads the request's views: a caller that gives up waits
  // for it.
  call->unless_cancelled([&] {
    box.host->handle(std::move(request), from, session,
                     [call](Response&& r) { call->complete(std::move(r)); });
  });
  if (call->lost_reply) {  // its connection breaks now: the caller and the ps hear it
    fabric.break_session(session);
    call->complete(ErrorReply{ErrorCode::kUnavailable, *call->lost_reply});
    box.host->disconnected(from, session);
  }
  if (box.host->stopped()) {
    std::scoped_lock lock(box.mutex);
    box.stopped = true;
    box.wake.notify_all();
  }
}

}  // namespace pulley
