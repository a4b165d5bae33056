// SPDX-License-Identifier: MIT
#pragma once

/// TcpClient's calls (declared in detail/tcp_client.hpp, which includes this header after
/// the class): the transport made and closed, a call made, its frame written and its reply
/// read, what waited on a lost connection failed, and what Tcp answers about a connection.

#include "pulley/transport/detail/tcp_client.hpp"

namespace pulley::transport_detail {

inline TcpClient::TcpClient(Node self, std::vector<Address> addresses, TcpOptions options,
                            std::optional<std::span<const std::uint32_t>> reach_now)
    : self_(self), options_(std::move(options)), shards_(addresses.size()) {
  rulings_->client = this;
  wire::check_credentials(options_.credentials);
  if (options_.replicas > 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "replicas must be 0 or 1, got " + std::to_string(options_.replicas));
  }
  if (options_.replicas == 1 && shards_ < 2) {
    throw Error(ErrorCode::kInvalidArgument, "a copy of each ps's shard needs at least 2 ps tasks");
  }
  const auto count = static_cast<std::uint32_t>(shards_);
  for (std::uint32_t k = 0; k < count; ++k) {
    links_.push_back(
        std::make_unique<Link>(io_, addresses[k], options_.limits, k, wire::Hello::kOwnShard));
  }
  if (options_.replicas == 1) {  // ps k's shard, as ps k + 1 holds its copy
    for (std::uint32_t k = 0; k < count; ++k) {
      links_.push_back(std::make_unique<Link>(io_, addresses[(k + 1) % count], options_.limits,
                                              (k + 1) % count, k));
    }
  }
  connect_all(reach_now);
}

inline TcpClient::~TcpClient() {
  {  // a ruling that comes later finds no transport
    const std::scoped_lock lock(rulings_->mutex);
    rulings_->client = nullptr;
  }
  // Every call still waiting is answered kUnavailable, so none waits on this driver.
  closing_ = true;
  watch_.cancel();
  for (auto& link : links_) fail(*link, "transport closed");
  for (const auto& weak : graced_) {
    if (const std::shared_ptr<Pair> pair = weak.lock()) pair->grace.reset();
  }
}

inline std::string TcpClient::address(std::size_t ps) const {
  if (ps >= shards_) throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps));
  return links_[ps]->address;
}

inline bool TcpClient::local(std::size_t ps) const {
  if (ps >= shards_) throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps));
  const Link& link = *links_[ps];
  return link.local && link.state == State::kConnected;
}

inline bool TcpClient::shared_memory(std::size_t ps) const {
  if (ps >= shards_) throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps));
  const Link& link = *links_[ps];
  return link.rings.active() && link.state == State::kConnected;
}

inline PendingCall TcpClient::call(std::size_t ps, Request&& request, PullTargets targets) {
  if (ps >= shards_) {
    auto refused = std::make_shared<Pending>(this, 0);
    PendingCall result(refused);
    refused->answer(ErrorReply{ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps)});
    return result;
  }
  begin_again_if_stale(*links_[ps]);
  if (options_.replicas == 0) return call_on(ps, std::move(request), std::move(targets));
  begin_again_if_stale(*links_[link_of(ps, 1)]);  // (before a copy it may drop is chosen)
  // ps k's own copy is read from while it lives (every task then takes tokens from the
  // same pacer), the one ps k + 1 holds once it was dropped.
  const std::size_t reading = links_[ps]->dropped ? link_of(ps, 1) : ps;
  const std::size_t other = reading == ps ? link_of(ps, 1) : ps;
  const Spread spread = spread_of(request);
  if (links_[other]->dropped || spread == Spread::kOne) {
    return call_on(reading, std::move(request), std::move(targets));
  }
  auto pair = std::make_shared<Pair>(this, ps, spread == Spread::kBothReady);
  PendingCall result(pair);
  pair->links = {reading, other};
  pair->refusal_stands = std::holds_alternative<ChangeWorkers>(request);
  pair->unreached_stands = std::holds_alternative<Shutdown>(request);
  for (std::size_t half = 0; half < 2; ++half) {
    auto pending = std::make_shared<Pending>(this, pair->links[half]);
    pending->pair = pair;
    pending->half = half;
    if (half == 0) pending->targets = targets;
    pair->halves[half] = pending;
    if (half == 1 && spread == Spread::kGate) {  // the other copy only says when it got there
      pair->other_partial = true;
      const Pull& pull = std::get<Pull>(request);
      queue(*links_[pair->links[half]], std::move(pending),
            Request{Pull{pull.min_step, {}, pull.epoch, pull.pushes_paced}});
    } else if (half == 1 &&
               std::holds_alternative<PullRows>(request)) {  // it creates the rows, sends none
      pair->other_partial = true;
      PullRows touch = std::get<PullRows>(request);
      touch.touch_only = true;
      queue(*links_[pair->links[half]], std::move(pending), Request{std::move(touch)});
    } else {
      queue(*links_[pair->links[half]], std::move(pending), request);
    }
  }
  return result;
}

inline void TcpClient::begin_again_if_stale(Link& link) {
  if ((link.state == State::kConnecting || link.state == State::kHandshaking) &&
      link.timer.expiry() <= std::chrono::steady_clock::now()) {
    fail(link, "an attempt left behind by an earlier call outlived attempt_timeout");
  }
}

inline PendingCall TcpClient::call_on(std::size_t index, Request&& request, PullTargets targets) {
  auto pending = std::make_shared<Pending>(this, index);
  pending->targets = std::move(targets);
  PendingCall result(pending);
  queue(*links_[index], std::move(pending), request);
  return result;
}

inline void TcpClient::queue(Link& link, PendingPtr pending, const Request& request) {
  if (link.state == State::kConnected && link.pending.empty() && closed_while_quiet(link)) {
    fail(link, "closed by the ps while idle");  // reconnect below, not fail this call
  }
  const std::uint64_t id = next_call_++;
  // The payload views alias the request's tensors (the caller's buffers), which stay
  // valid until the call is answered or cancelled; the rest is serialized here.
  pending->frame = wire::encode(request, id);
  link.pending.emplace(id, pending);
  link.outbox.push_back(std::move(pending));
  if (link.state == State::kBroken) connect(link, [](std::error_code) {});
}

inline void TcpClient::run_until(const std::function<bool()>& done,
                                 std::chrono::steady_clock::time_point deadline) {
  for (auto& link : links_) {
    flush(*link);
    receive(*link);
  }
  watch_silence();
  while (!done()) {
    if (deadline <= std::chrono::steady_clock::now()) {
      io_.poll();  // what already arrived
      return;
    }
    io_.run_one_until(deadline);
  }
}

inline bool TcpClient::closed_while_quiet(Link& link) {
  const auto now = std::chrono::steady_clock::now();
  if (now - link.last_active < std::chrono::seconds(1)) return false;
  link.last_active = now;
  if (link.rings.active()) return link.rings.peer_closed();
  char byte = 0;
  const ssize_t n = ::recv(link.socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

inline void TcpClient::abort(CallControl& call) {
  auto& pending = static_cast<Pending&>(call);
  if (pending.is_pair) {
    for (const auto& weak : static_cast<Pair&>(pending).halves) {
      if (const PendingPtr half = weak.lock()) abort_one(*half);
    }
    return;
  }
  abort_one(pending);
}

inline void TcpClient::abort_one(Pending& pending) {
  Link& link = *links_[pending.ps];
  if (pending.writing || link.reading.get() == &pending) {
    fail(link, "a call was given up mid-transfer");
  }
}

inline void TcpClient::deliver(Pending& pending, Response&& response) {
  if (!pending.pair) {
    pending.answer(std::move(response));
    return;
  }
  const std::shared_ptr<Pair> pair = pending.pair;
  pair->answers[pending.half] = std::move(response);
  settle(pair);
}

inline void TcpClient::flush(Link& link) {
  if (link.state != State::kConnected && link.state != State::kHandshaking) return;
  while (link.state == State::kConnected && !link.outbox.empty()) {
    PendingPtr out = std::move(link.outbox.front());
    link.outbox.pop_front();
    if (!out->use().begin_use()) {  // given up before it went out: forget it
      link.pending.erase(out->frame.header.call);
      out->detach_driver();
      continue;
    }
    link.write_list.append(out->frame);
    out->frame_end = link.write_list.appended();
    out->writing = true;
    link.writing.push_back(std::move(out));
  }
  if (link.write_waiting || link.write_list.empty()) return;
  std::error_code ec;
  if (!link.rings.write_now(link.write_list, link.socket, ec)) return fail(link, ec.message());
  while (!link.writing.empty() && link.writing.front()->frame_end <= link.write_list.written()) {
    end_writing(*link.writing.front());
    link.writing.pop_front();
  }
  if (link.write_list.empty()) return link.write_list.clear();
  link.write_waiting = true;
  link.rings.async_wait_write(link.socket,
                              [this, &link, gen = link.generation](std::error_code wait) {
                                if (gen != link.generation) return;  // fail() reset the link
                                link.write_waiting = false;
                                if (wait) return fail(link, wait.message());
                                // Room again: the ps took bytes, so it lives (a large
                                // frame may cross for longer than the copy timeout).
                                link.heard = std::chrono::steady_clock::now();
                                flush(link);
                              });
}

inline void TcpClient::end_writing(Pending& p) {
  if (!std::exchange(p.writing, false)) return;
  p.sent = true;
  p.use().end_use();
}

inline TcpClient::Pending* TcpClient::replied(Link& link, std::uint64_t call) {
  const auto it = link.pending.find(call);
  if (it == link.pending.end()) return nullptr;
  if (!it->second->sent) throw wire::Malformed("a reply to a request not yet sent whole");
  return it->second.get();
}

inline void TcpClient::receive(Link& link) {
  if (link.receiving || link.dispatching) return;  // (the handler arms the next receive)
  if (link.state != State::kHandshaking &&
      (link.state != State::kConnected || link.pending.empty())) {
    return;
  }
  link.receiving = true;
  if (!link.local) link.receive_buffers.watermark(link.socket, link.reader.payload_left());
  link.rings.async_read_some(
      link.socket, link.receive_buffers.of(link.reader.buffers()),
      [this, &link, gen = link.generation](std::error_code ec, std::size_t n) {
        if (gen != link.generation) return;
        link.receiving = false;
        if (ec) return fail(link, ec.message());
        link.heard = std::chrono::steady_clock::now();
        // While it hands frames on, an answer may lead elsewhere to this link again (a
        // Pair settled): no second receive may start into the reader's buffers.
        link.dispatching = true;
        try {
          link.reader.commit(n);  // may fail to grow a payload buffer
          while (auto frame =
                     link.reader.next([&](const wire::Header& h, std::span<const char> meta) {
                       return route(link, h, meta);
                     })) {
            if (link.state == State::kHandshaking) {
              on_handshake(link, *frame);
              if (link.state != State::kConnected && link.state != State::kHandshaking) break;
            } else {
              on_reply(link, *frame);
            }
            if (gen != link.generation) break;  // failed or dropped meanwhile: the reader was reset
          }
        } catch (const std::exception& e) {  // a bad frame, or no memory: this link only
          link.dispatching = false;
          return fail(link, e.what());
        }
        link.dispatching = false;
        if (gen == link.generation) receive(link);
      });
}

inline std::span<const std::span<float>> TcpClient::route(Link& link, const wire::Header& header,
                                                          std::span<const char> meta) {
  if (link.state != State::kConnected) return {};    // the handshake has no payload
  if (header.kind < wire::kResponseKind) return {};  // not a reply: on_reply refuses it
  if (replied(link, header.call) == nullptr) return {};
  const PendingPtr& pending = link.pending.at(header.call);
  if (pending->targets.empty()) return {};
  Response response = wire::decode_response_meta(header, meta, link.sizes);
  const auto& targets = pending->targets;
  bool fits = link.sizes.size() == targets.size();
  for (std::size_t i = 0; fits && i < targets.size(); ++i) {
    fits = link.sizes[i] == targets[i].size();
  }
  if (!fits || !pending->use().begin_use()) return {};  // a misfit, or a call given up
  link.reading = pending;
  link.reading_response = std::move(response);
  return targets;
}

inline void TcpClient::on_reply(Link& link, const wire::FrameReader::Frame& frame) {
  replied(link, frame.header.call);  // throws for a reply before its request
  link.last_active = std::chrono::steady_clock::now();
  const auto it = link.pending.find(frame.header.call);
  if (frame.routed) {
    const PendingPtr pending = std::exchange(link.reading, nullptr);
    Response response = std::move(link.reading_response);
    detail::point_at(response, pending->targets);
    link.pending.erase(it);
    deliver(*pending, std::move(response));
    pending->use().end_use();
    return;
  }
  Response response = wire::decode_response(frame.header, frame.meta, frame.payload);
  if (it == link.pending.end()) return;  // an answer nobody waits for any more
  const PendingPtr pending = it->second;
  link.pending.erase(it);
  if (pending->pair && pending->half == 1) {
    // The other copy's tensors are not read, only its outcome.
    if (!is_error(response) && !detail::copy_into(response, pending->targets)) {
      pending->pair->other_partial = true;
      response = Ack{};
    }
  } else if (!std::holds_alternative<ErrorReply>(response)) {
    bool fits = true;  // (a caller that gave up gets no copy, and no answer)
    pending->use().unless_cancelled([&] { fits = detail::copy_into(response, pending->targets); });
    if (!fits) {
      response = ErrorReply{ErrorCode::kInvalidArgument, "reply does not fit its targets"};
    }
  }
  deliver(*pending, std::move(response));
}

inline Response TcpClient::unavailable(const Link& link) {
  if (link.refused) return ErrorReply{*link.refused};
  return ErrorReply{ErrorCode::kUnavailable,
                    "connection to ps at " + link.address + " lost: " + link.broken_reason};
}

inline void TcpClient::fail_all(Link& link, bool park) {
  link.outbox.clear();
  const bool may_park = park && options_.replicas == 1 && !closing_ &&
                        (link.ever_connected || link.dropped) && !links_[partner_of(link)]->dropped;
  for (auto& [id, pending] : std::exchange(link.pending, {})) {
    if (may_park && !pending->pair && !pending->parked_once) {
      pending->parked_once = true;
      link.parked_next.push_back(pending);
      continue;
    }
    deliver(*pending, unavailable(link));
    pending->detach_driver();  // answered or given up: it needs the transport no more
  }
}

inline void TcpClient::fail(Link& link, const std::string& reason) {
  if (link.state == State::kBroken) return;
  if (link.state == State::kConnected) link.failing_since = std::chrono::steady_clock::now();
  link.state = State::kBroken;
  link.broken_reason = reason;
  ++link.generation;
  std::error_code ignored;
  link.timer.cancel();
  link.resolver.cancel();
  link.rings.stop();
  link.offered = {};
  link.socket.close(ignored);  // the operations under way end without touching buffers
  for (const PendingPtr& p : std::exchange(link.writing, {})) end_writing(*p);
  link.write_list.clear();
  link.write_waiting = false;  // its wait completes as stale
  if (link.reading) std::exchange(link.reading, nullptr)->use().end_use();
  link.reader.reset();
  link.challenge.reset();
  connected(link, asio::error::connection_aborted);  // an attempt under way ends
  fail_all(link);                                    // (a Pair may start the next attempt: settle)
  if (!link.parked_next.empty() && !link.dropped) {  // is the copy lost? try it again
    for (PendingPtr& p : std::exchange(link.parked_next, {})) link.parked.push_back(std::move(p));
    if (link.state == State::kBroken) connect(link, [](std::error_code) {});
  }
}

}  // namespace pulley::transport_detail
