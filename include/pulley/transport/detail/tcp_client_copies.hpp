// SPDX-License-Identifier: MIT
#pragma once

/// TcpClient's copies of each shard (declared in detail/tcp_client.hpp, which includes this
/// header after the class): where a call goes, how the answers of both copies settle into
/// one, when a copy is given up, and what the referee rules.

#include "pulley/transport/detail/tcp_client.hpp"

namespace pulley::transport_detail {

inline void TcpClient::renumber_copies(std::ptrdiff_t by) {
  const std::size_t first = shards_;  // (their place now)
  std::set<Pending*> calls;
  std::set<Pair*> pairs;
  const auto note = [&](const PendingPtr& p) {
    if (!p) return;
    calls.insert(p.get());
    if (p->pair) pairs.insert(p->pair.get());
  };
  for (const auto& link : links_) {
    for (const auto& [id, p] : link->pending) note(p);
    for (const auto* list : {&link->outbox, &link->writing}) {
      for (const PendingPtr& p : *list) note(p);
    }
    for (const auto* list : {&link->parked, &link->parked_next}) {
      for (const PendingPtr& p : *list) note(p);
    }
    note(link->reading);
    for (const auto& weak : link->awaiting) {
      if (const std::shared_ptr<Pair> pair = weak.lock()) pairs.insert(pair.get());
    }
  }
  for (const auto& weak : graced_) {
    if (const std::shared_ptr<Pair> pair = weak.lock()) pairs.insert(pair.get());
  }
  const auto moved = [&](std::size_t& index) {
    if (index >= first) index = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(index) + by);
  };
  for (Pending* p : calls) moved(p->ps);
  for (Pair* pair : pairs) {
    for (std::size_t& index : pair->links) moved(index);
  }
}

inline void TcpClient::place_copies(std::span<const std::uint32_t> members) {
  if (options_.replicas == 0) return;
  if (members.size() < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                "a job whose ps tasks keep copies of each other's shards (--ps-replicas 1) "
                "keeps 2 ps tasks "
                "or more: each copy is on another ps than its shard's own");
  }
  if (!std::is_sorted(members.begin(), members.end()) || members.back() >= shards_) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "the job's ps tasks must be ascending task indices below " + std::to_string(shards_));
  }
  members_.assign(members.begin(), members.end());
  for (std::uint32_t shard = 0; shard < shards_; ++shard) {
    const std::uint32_t holder = copy_holder(members, shard);
    Link& link = *links_[link_of(shard, 1)];
    if (link.task != holder) move_copy(link, shard, holder);
    // No member: its own ps alone (a courtesy Shutdown reaches it), never a Pair.
    if (holder == shard) link.dropped = true;
  }
}

inline bool TcpClient::copies_whole() const {
  // A shard with a copy given up since is served by the other alone: whole for writes.
  for (std::size_t k = 0; k < ready_alone_.size(); ++k) {
    if (ready_alone_[k] && !links_[link_of(k, 0)]->dropped && !links_[link_of(k, 1)]->dropped)
      return false;
  }
  return true;
}

inline std::vector<std::uint32_t> TcpClient::given_up() const {
  std::vector<std::uint32_t> tasks;
  for (const auto& link : links_) {
    if (link->dropped && member(link->task)) tasks.push_back(link->task);
  }
  std::sort(tasks.begin(), tasks.end());
  tasks.erase(std::unique(tasks.begin(), tasks.end()), tasks.end());
  return tasks;
}

inline bool TcpClient::reach_again(std::uint32_t ps, bool serve, bool unreached_too) {
  if (options_.replicas == 0) return false;
  std::vector<Link*> copies;
  for (const auto& link : links_) {
    if (link->task == ps) copies.push_back(link.get());
  }
  std::stable_partition(copies.begin(), copies.end(),
                        [](const Link* link) { return link->dropped; });
  if (copies.empty() || !copies.front()->dropped) return false;
  const auto deadline = std::chrono::steady_clock::now() +
                        (serve ? options_.copy_grace : std::chrono::milliseconds(0));
  std::uint64_t fresh = 0;  // the process started in the lost one's place
  for (Link* link : copies) {
    if (!link->dropped) {
      drop(*link,
           "another copy ps " + std::to_string(ps) + " held was given up: its process is gone");
      if (!link->dropped) continue;  // the last copy of its shard: left as it is
    }
    if (link->state == State::kConnected && link->renewed &&
        (fresh == 0 || link->server == fresh)) {
      fresh = link->server;  // reached it already
      continue;
    }
    link->renewed = false;
    fail(*link, "reached again");
    for (auto backoff = options_.initial_backoff;;
         backoff = std::min(backoff * 2, std::chrono::milliseconds(1000))) {
      link->renewing = true;
      bool done = false;
      std::error_code attempt;
      connect(*link, [&](std::error_code ec) {
        done = true;
        attempt = ec;
      });
      while (!done) io_.run_one();
      link->renewing = false;
      if (link->state == State::kConnected) break;
      if (link->refused || attempt == asio::error::connection_refused ||
          std::chrono::steady_clock::now() + backoff > deadline) {
        if (serve && unreached_too) break;  // served unreached (above)
        return false;                       // not there, or gone again: the next look tries again
      }
      std::this_thread::sleep_for(backoff);
    }
    if (link->state != State::kConnected) {
      link->server = 0;  // the next process it reaches is taken, but the one given up
      continue;
    }
    if ((link->lost != 0 && link->server == link->lost) || (fresh != 0 && link->server != fresh)) {
      // The very process given up (alive but cut off: its copies are old), or yet
      // another since: nothing served.
      fail(*link, "not the process taken back");
      if (!serve || !unreached_too) return false;
      link->server = 0;
      continue;
    }
    fresh = link->server;
    link->renewed = true;
  }
  if (serve) serve_again(ps);
  return true;
}

inline void TcpClient::log_copies(LogLevel level, const std::string& line) const {
  if (options_.logs_copies) log(level, line);
}

inline void TcpClient::serve_again(std::uint32_t ps) {
  for (const auto& link : links_) {
    if (!link->dropped || link->task != ps) continue;
    link->dropped = false;
    if (link->server != 0)
      link->lost = 0;  // (one served unreached still refuses the process given up)
    link->renewed = false;
    link->failing_since.reset();
    const std::size_t shard = index_of(*link) % shards_;
    log_copies(LogLevel::kInfo,
               self_.name() + ": ps " + std::to_string(shard) +
                   "'s shard is served by two copies again (ps " + std::to_string(link->task) +
                   " at " + link->address + " holds one again" +
                   (link->server == 0 ? "; not reached yet: this task waits for it" : "") + ")");
    if (link->server == 0) link->failing_since = std::chrono::steady_clock::now();
  }
}

inline void TcpClient::give_up(std::uint32_t ps, const std::string& why) {
  for (const auto& link : links_) {
    if (link->task != ps) continue;
    link->renewed = false;
    drop(*link, why);
  }
}

inline TcpClient::Spread TcpClient::spread_of(const Request& request) const noexcept {
  if (std::holds_alternative<WaitReady>(request)) return Spread::kBothReady;
  if (std::holds_alternative<PullRows>(request)) {  // a worker's creates rows: both copies must
    return self_.role == Node::Role::kWorker ? Spread::kBoth : Spread::kOne;
  }
  // A pull for a step waits for both copies to complete it: no worker then pushes for the
  // next step before both took every push of this one (each completes steps on its own).
  if (const auto* pull = std::get_if<Pull>(&request))
    return pull->min_step > 0 ? Spread::kGate : Spread::kOne;
  // A heartbeat reaches both copies a ps process holds (ShardCopies hands it to each).
  if (std::holds_alternative<TakeToken>(request) || std::holds_alternative<Heartbeat>(request) ||
      std::holds_alternative<GetStats>(request) || std::holds_alternative<ReadState>(request) ||
      std::holds_alternative<ReadRows>(request)) {
    return Spread::kOne;
  }
  return Spread::kBoth;
}

inline std::size_t TcpClient::link_of(std::size_t shard, std::size_t copy) const noexcept {
  return copy == 0 ? shard : shards_ + shard;
}

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

inline void TcpClient::drop(Link& link, const std::string& why, bool lost) {
  if (link.dropped || options_.replicas == 0) return;
  const std::size_t index = index_of(link);
  const std::size_t shard = index % shards_;
  const std::size_t other = partner_of(link);
  if (links_[other]->dropped) return;  // the last copy: waited for as a ps without copies
  link.dropped = true;
  link.lost = lost ? link.server : 0;
  log_copies(LogLevel::kWarning, self_.name() + ": dropping the copy of ps " +
                                     std::to_string(shard) + "'s shard held by ps " +
                                     std::to_string(link.task) + " at " + link.address + " (" +
                                     why + "): it is served by the copy at " +
                                     links_[other]->address + " alone from now on");
  // Closed with a reset, not a FIN: what the kernel still holds to send (held back by
  // a silent cut, delivered when it heals) is discarded, so nothing this task sent
  // before reaches a process it gave up (a chief's request would renew its lease). Over
  // TCP only: on one host (a local socket, shared memory) what was sent is still read by
  // a process that was only stopped, as there is no cut to heal.
  std::error_code ignored;
  link.socket.set_option(asio::socket_base::linger(true, 0), ignored);
  fail(link, "dropped: " + why);  // what it sent waits in parked_next
  Link& to = *links_[other];
  std::vector<PendingPtr> moved;
  for (auto& [id, out] : std::exchange(link.pending, {})) moved.push_back(out);
  link.outbox.clear();
  for (auto* list : {&link.parked, &link.parked_next}) {
    for (PendingPtr& out : std::exchange(*list, {})) moved.push_back(std::move(out));
  }
  std::vector<std::shared_ptr<Pair>> halves;  // no longer waited for
  for (PendingPtr& out : moved) {
    if (out->pair) {
      halves.push_back(out->pair);
      continue;
    }
    out->ps = other;
    out->sent = false;
    to.pending.emplace(out->frame.header.call, out);
    to.outbox.push_back(std::move(out));
  }
  if (to.state == State::kBroken) {
    connect(to, [](std::error_code) {});
  } else {
    flush(to);  // the caller may be waiting already
    receive(to);
  }
  for (const auto& pair : halves) settle(pair);
}

inline void TcpClient::move_copy(Link& link, std::uint32_t shard, std::uint32_t holder) {
  std::error_code ignored;
  link.socket.set_option(asio::socket_base::linger(true, 0), ignored);
  link.dropped = true;  // (no attempt at the old ps follows; Pairs settle without it)
  fail(link, "ps " + std::to_string(shard) + "'s copy moved to ps " + std::to_string(holder));
  fail_all(link, false);  // calls queued on a link that was broken already
  for (auto* list : {&link.parked, &link.parked_next}) {
    for (PendingPtr& p : std::exchange(*list, {})) {
      deliver(*p, unavailable(link));
      p->detach_driver();
    }
  }
  for (const auto& weak : std::exchange(link.awaiting, {})) {
    if (const std::shared_ptr<Pair> pair = weak.lock()) settle(pair);
  }
  const Link& at = *links_[holder];
  if (holder != shard) {  // (a ps that is no member has no copy: nothing to say)
    log_copies(LogLevel::kInfo, self_.name() + ": ps " + std::to_string(shard) +
                                    "'s copy is held by ps " + std::to_string(holder) + " at " +
                                    at.address + " now (was ps " + std::to_string(link.task) + ")");
  }
  link.task = holder;
  link.address = at.address;
  link.host = at.host;
  link.port = at.port;
  link.local = false;
  link.server = 0;
  link.lost = 0;
  link.renewed = false;
  link.refused.reset();
  link.failing_since = std::chrono::steady_clock::now();
  link.ever_connected = at.ever_connected;
  link.dropped = false;
  ready_alone_.at(shard) = false;
}

inline bool TcpClient::member(std::uint32_t ps) const {
  return members_.empty() || std::binary_search(members_.begin(), members_.end(), ps);
}

inline std::size_t TcpClient::index_of(const Link& link) const {
  for (std::size_t i = 0; i < links_.size(); ++i) {
    if (links_[i].get() == &link) return i;
  }
  return 0;
}

inline void TcpClient::drop_if_lost(Link& link, std::error_code ec) {
  if (!ec || options_.replicas == 0 || !link.ever_connected || link.dropped || closing_) return;
  const bool refused = ec == asio::error::connection_refused;
  if (refused || (link.failing_since && std::chrono::steady_clock::now() - *link.failing_since >=
                                            options_.copy_timeout)) {
    std::string why =
        refused ? "its address refuses connections"
                : "out of reach for " + std::to_string(options_.copy_timeout.count()) + " ms";
    if (options_.copy_referee) return ask_referee(link, std::move(why));
    drop(link, why);
  }
}

inline void TcpClient::ask_referee(Link& link, std::string why) {
  if (links_[partner_of(link)]->dropped) return;  // the last copy of a shard: waited for
  Asked& asked = asked_[link.task];
  const auto now = std::chrono::steady_clock::now();
  if (asked.in_flight || now - asked.answered < kAskAgainAfter) return;
  asked.in_flight = true;
  if (!std::exchange(asked.told, true)) {
    log_copies(LogLevel::kWarning,
               self_.name() + ": ps " + std::to_string(link.task) + " at " + link.address + ": " +
                   why +
                   "; asks the chief whether it is lost for the job (until then, waits for it)");
  }
  std::shared_ptr<Rulings> box = rulings_;
  options_.copy_referee(LostProcess{link.task, link.server, why},
                        [box, task = link.task, process = link.server, why](bool lost) {
                          const std::scoped_lock lock(box->mutex);
                          if (box->client == nullptr) return;
                          TcpClient* client = box->client;
                          asio::post(client->io_, [client, task, process, why, lost] {
                            client->ruled(task, process, why, lost);
                          });
                        });
}

inline void TcpClient::ruled(std::uint32_t task, std::uint64_t process, const std::string& why,
                             bool lost) {
  Asked& asked = asked_[task];
  asked.in_flight = false;
  asked.answered = std::chrono::steady_clock::now();
  if (!lost) return;
  for (const auto& link : links_) {
    // (A link that reached another process since, one the chief took back, stays.)
    if (link->task == task && !link->dropped && (process == 0 || link->server == process)) {
      drop(*link, why + "; the chief ruled it lost for the job");
    }
  }
}

inline bool TcpClient::ruled_lost_now(const Link& link, const std::string& why) {
  const auto deadline =
      std::chrono::steady_clock::now() + options_.copy_timeout + 4 * options_.attempt_timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto promise = std::make_shared<std::promise<bool>>();
    std::future<bool> ruling = promise->get_future();
    options_.copy_referee(LostProcess{link.task, 0, why},
                          [promise](bool lost) { promise->set_value(lost); });
    if (ruling.wait_until(deadline) != std::future_status::ready) return false;
    if (ruling.get()) return true;
    std::this_thread::sleep_for(kAskAgainAfter);
  }
  return false;
}

inline std::size_t TcpClient::partner_of(const Link& link) const {
  const std::size_t index = index_of(link);
  return index < shards_ ? shards_ + index : index - shards_;
}

}  // namespace pulley::transport_detail
