// SPDX-License-Identifier: MIT
#pragma once

/// TcpClient's pairs of calls (declared in detail/tcp_client.hpp, which includes this header
/// after the class): how the answers of both copies of a shard settle into one, WaitReady's
/// answers and the grace a copy not ready is given, and which half answers the caller.

#include "pulley/transport/detail/tcp_client.hpp"

namespace pulley::transport_detail {

inline bool TcpClient::is_error(const Response& response) {
  return std::holds_alternative<ErrorReply>(response);
}

inline bool TcpClient::is_ended(const Response& response) {
  const auto* error = std::get_if<ErrorReply>(&response);
  return error != nullptr &&
         (error->code == ErrorCode::kOutOfRange || error->code == ErrorCode::kAborted);
}

inline bool TcpClient::is_unavailable(const Response& response) {
  const auto* error = std::get_if<ErrorReply>(&response);
  return error != nullptr && error->code == ErrorCode::kUnavailable;
}

inline void TcpClient::settle(const std::shared_ptr<Pair>& held) {
  Pair& pair = *held;
  if (closing_) {
    pair.answer(ErrorReply{ErrorCode::kUnavailable, "transport closed"});
    return;
  }
  if (pair.has_answer() && !pair.both_ready) return;
  auto& a = pair.answers[0];
  auto& b = pair.answers[1];
  const bool a_gone = links_[pair.links[0]]->dropped;
  const bool b_gone = links_[pair.links[1]]->dropped;
  if (a_gone && b_gone) {
    pair.answer(
        ErrorReply{ErrorCode::kUnavailable,
                   "both copies of ps " + std::to_string(pair.shard) + "'s shard are lost"});
    return;
  }
  if (pair.both_ready) return settle_ready(held, a_gone, b_gone);
  if (a_gone) {
    if (b) answer_pair(pair, 1);
    return;
  }
  if (b_gone) {
    if (a) answer_pair(pair, 0);
    return;
  }
  if (!a || !b) return;
  const bool a_ok = !is_error(*a);
  const bool b_ok = !is_error(*b);
  if (a_ok && b_ok) merge_copy_answers(*a, *b);
  // A Shutdown that one copy took (it answers that training ended) and the other may not
  // have: sent again until both have it.
  if (!a_ok && !b_ok && pair.unreached_stands &&
      (is_unavailable(*a) ? is_ended(*b) : is_ended(*a) && is_unavailable(*b))) {
    return answer_pair(pair, is_unavailable(*a) ? 0 : 1);
  }
  if (a_ok == b_ok) return answer_pair(pair, a_ok || !is_unavailable(*a) ? 0 : 1);
  const std::size_t ok = a_ok ? 0 : 1;
  const Response& refused = a_ok ? *b : *a;
  // A connection that broke: whether the copy is lost for good shows when it is tried
  // again. Dropped, the other copy's answer stands; reached, the call fails as without
  // copies (the caller sends again: each copy counts a push once).
  if (is_unavailable(refused)) {
    Link& link = *links_[pair.links[1 - ok]];
    if (!pair.waited[1 - ok] && link.state != State::kConnected) {
      pair.waited[1 - ok] = true;
      link.awaiting.push_back(held);
      if (link.state == State::kBroken) connect(link, [](std::error_code) {});
      return;
    }
    return answer_pair(pair, 1 - ok);
  }
  // A refusal by one copy only (a restore that reached one first, a replaced process
  // not yet known as one): the answer of the copy read from stands. Copies are dropped
  // only when lost for sure: each task decides alone, and a copy dropped by some tasks
  // and not others would miss their updates. A change of the workers is the exception:
  // a copy that refused it would count other workers than its twin from that step on,
  // and wait forever for a push that never comes, so the chief must hear the refusal
  // (and takes the change back from both).
  answer_pair(pair, pair.refusal_stands ? 1 - ok : 0);
}

inline void TcpClient::settle_ready(const std::shared_ptr<Pair>& held, bool a_gone, bool b_gone) {
  Pair& pair = *held;
  const auto& a = pair.answers[0];
  const auto& b = pair.answers[1];
  bool a_ready = a && !is_error(*a) && !a_gone;
  bool b_ready = b && !is_error(*b) && !b_gone;
  const auto* a_placed = a_ready ? std::get_if<PlacementReply>(&*a) : nullptr;
  const auto* b_placed = b_ready ? std::get_if<PlacementReply>(&*b) : nullptr;
  if (pair.followed || (!pair.has_answer() && a_placed != nullptr && b_placed != nullptr &&
                        a_placed->members != b_placed->members)) {
    // The job's ps tasks changed between the two answers (a ps left or joined): the newer
    // one is the answer, and the caller follows it (placing the copies anew) and asks
    // again; neither copy is given up for it, however late the grace's timer fires.
    if (!std::exchange(pair.followed, true))
      answer_pair(pair, a_placed->membership < b_placed->membership ? 1 : 0);
    if (pair.grace) pair.grace->cancel();
    return;
  }
  if (a_placed != nullptr && b_placed != nullptr &&
      (a_placed->membership != b_placed->membership || a_placed->epoch != b_placed->epoch)) {
    // Both ready, one at an older restore (a process the chief began to take back and
    // then gave up): it is no copy of this shard now, and waits out the grace as a copy
    // not ready does.
    (std::pair(a_placed->membership, a_placed->epoch) <
             std::pair(b_placed->membership, b_placed->epoch)
         ? a_ready
         : b_ready) = false;
  }
  if (!pair.has_answer()) {
    // Ready by one copy while the other, not given up, is out of reach: copies_whole.
    if (a_ready && (b_ready || b_gone || (b && is_error(*b)))) {
      ready_alone_.at(pair.shard) = !b_ready && !b_gone && is_unavailable(*b);
      answer_pair(pair, 0);
    } else if (b_ready && (a_gone || (a && is_error(*a)))) {
      ready_alone_.at(pair.shard) = !a_gone && is_unavailable(*a);
      answer_pair(pair, 1);
    } else if (!a_ready && !b_ready && (a || a_gone) &&
               (b || b_gone)) {  // neither is ready: an error
      answer_pair(pair, a && !a_gone && (!is_unavailable(*a) || b_gone) ? 0 : 1);
    }
  }
  if (a_ready == b_ready ||
      (a_ready ? b_gone || (b && is_error(*b)) : a_gone || (a && is_error(*a))))
    return;
  if (!pair.grace) return start_grace(held);
  if (!grace_over(pair)) return;
  Link& late = *links_[pair.links[a_ready ? 1 : 0]];
  drop(late,
       "not ready " + std::to_string(options_.copy_grace.count()) +
           " ms after its other copy was: a process started in place of a lost ps holds nothing",
       false);
  // One that answered (ready at an older restore) left no call behind for drop to settle.
  if (late.dropped && !pair.has_answer()) answer_pair(pair, a_ready ? 0 : 1);
}

inline void TcpClient::start_grace(const std::shared_ptr<Pair>& pair) {
  std::erase_if(graced_, [](const std::weak_ptr<Pair>& p) { return p.expired(); });
  graced_.push_back(pair);  // its timer goes before io_ does (~TcpClient)
  pair->grace = std::make_unique<asio::steady_timer>(io_, options_.copy_grace);
  pair->grace->async_wait([this, weak = std::weak_ptr<Pair>(pair)](std::error_code ec) {
    if (ec) return;
    if (const std::shared_ptr<Pair> held = weak.lock()) settle(held);
  });
}

inline void TcpClient::answer_pair(Pair& pair, std::size_t half) {
  Response response = std::move(*pair.answers[half]);
  if (half == 1 && pair.other_partial) {
    // The other copy was asked for less, or its tensors were not received into the
    // caller's targets: the caller sends again, to the copy left.
    response = ErrorReply{ErrorCode::kUnavailable, "the copy read from was lost during the call"};
  }
  pair.answer(std::move(response));
}

}  // namespace pulley::transport_detail
