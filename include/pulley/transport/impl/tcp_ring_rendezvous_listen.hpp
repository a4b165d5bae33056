// SPDX-License-Identifier: MIT
#pragma once

/// TcpRingRendezvous's listening side (declared in transport/tcp_ring_rendezvous.hpp, which
/// includes this header after the class): the check-ins served at a step boundary, a check-in
/// taken (the handshake's listening side), the next ring coordinated from the check-ins with a
/// quorum, a member gone seen by its refusal, and a message sent to one that may be gone.

#include "pulley/transport/tcp_ring_rendezvous.hpp"

namespace pulley {

inline bool TcpRingRendezvous::serve(const RingView& view) {
  for (int taken = 0; taken < 16 && waiting(0); ++taken) {
    std::optional<CheckedIn> in = take_check_in(HandshakeClock::now() + std::chrono::seconds(1));
    if (!in) continue;
    if (view.rank == 0) {
      held_.push_back(std::move(*in));
    } else {
      send_quietly(in->socket, wire::RingRedirect{view.generation, view.addresses.at(0)});
    }
  }
  return !held_.empty();
}

inline std::optional<TcpRingRendezvous::CheckedIn> TcpRingRendezvous::take_check_in(
    HandshakeClock::time_point deadline) {
  Socket socket(io_);
  std::error_code ec;
  acceptor_->accept(socket, ec);
  if (ec) return std::nullopt;
  socket.non_blocking(true);
  try {
    const wire::Challenge challenge{credentials_.job, 0, wire::make_nonce()};
    transport_detail::write_frame_by(socket, wire::encode(wire::Handshake{challenge}, 0), deadline,
                                     who());
    const auto hello = transport_detail::read_handshake_by<wire::Hello>(socket, deadline, who());
    std::string refusal = wire::refusal_reason(credentials_, challenge, hello);
    ErrorCode code = ErrorCode::kUnauthenticated;
    if (refusal.empty() && hello.shard == wire::Hello::kRingLink) {
      refusal = "a ring link to " + address_ + ", which forms no ring now: check in again";
      code = ErrorCode::kUnavailable;
    } else if (refusal.empty() && hello.shard != wire::Hello::kRingRendezvous) {
      refusal = hello.peer.name() + " is not a ring's worker";
    }
    if (!refusal.empty()) {
      if (code == ErrorCode::kUnauthenticated)
        log(LogLevel::kWarning, who() + " refused a connection: " + refusal);
      transport_detail::write_frame_by(
          socket, wire::encode(wire::Handshake{wire::Refusal{code, refusal}}, 0), deadline, who());
      return std::nullopt;
    }
    transport_detail::write_frame_by(
        socket,
        wire::encode(
            wire::Handshake{wire::Welcome{wire::server_proof(credentials_.secret, challenge, hello),
                                          wire::incarnation()}},
            0),
        deadline, who());
    auto said = receive(socket, deadline);
    auto* in = std::get_if<wire::RingCheckIn>(&said);
    if (in == nullptr)
      throw wire::Malformed("a rendezvous message other than a check-in came first");
    return CheckedIn{std::move(socket), std::move(*in), hello.incarnation};
  } catch (const std::exception& e) {
    log(LogLevel::kWarning, who() + " dropped a connection: " + e.what());
    return std::nullopt;
  }
}

inline std::optional<RingView> TcpRingRendezvous::coordinate(const RingView& view,
                                                             RingProgress mine,
                                                             std::vector<bool> gone,
                                                             HandshakeClock::time_point deadline) {
  const std::size_t n = view.addresses.size();
  std::vector<std::optional<CheckedIn>> members(n);
  std::vector<CheckedIn> newcomers;
  auto take = [&](CheckedIn in) {
    for (std::size_t j = view.rank + 1; j < n; ++j) {
      if (in.said.address != view.addresses[j]) continue;
      const bool same = view.incarnations.empty() || view.incarnations[j] == in.incarnation;
      if (in.said.generation == view.generation && same) {
        members[j] = std::move(in);
        return;
      }
      gone[j] = true;  // another process at its address: the member is gone, this is a newcomer
    }
    std::erase_if(newcomers, [&](const CheckedIn& c) { return c.said.address == in.said.address; });
    newcomers.push_back(std::move(in));
  };
  for (CheckedIn& in : held_) take(std::move(in));
  held_.clear();
  log(LogLevel::kInfo, "ring: " + address_ + " gathers the next ring after generation " +
                           std::to_string(view.generation));
  const auto started = HandshakeClock::now();
  auto last_probe = started - std::chrono::seconds(1);
  while (HandshakeClock::now() < deadline) {
    bool all = true;
    for (std::size_t j = view.rank + 1; j < n; ++j) all = all && (members[j] || gone[j]);
    if (all || HandshakeClock::now() - started >= options_.timeout) break;
    if (waiting(100)) {
      if (std::optional<CheckedIn> in = take_check_in(soon())) take(std::move(*in));
    }
    if (HandshakeClock::now() - last_probe >= std::chrono::milliseconds(500)) {
      last_probe = HandshakeClock::now();
      for (std::size_t j = view.rank + 1; j < n; ++j) {
        if (!members[j] && !gone[j] && refuses(view.addresses[j])) gone[j] = true;
      }
    }
  }
  // A silent member that still listens may be in a newer ring that left this one out
  // (it was stopped for longer than the timeout): then this one is the newcomer.
  for (std::size_t j = view.rank + 1; j < n; ++j) {
    if (members[j] || gone[j]) continue;
    const Asked asked =
        ask(view.addresses[j], check_in(view.generation, mine),
            HandshakeClock::now() + options_.timeout, HandshakeClock::now() + 2 * options_.timeout);
    if (asked.busy || (asked.redirect && asked.redirect->generation <= view.generation)) {
      // It forms a ring, or is still in this one: nothing to decide on yet, ask again.
      for (auto& m : members) {
        if (m) send_quietly(m->socket, wire::RingRedirect{view.generation, address_});
      }
      return std::nullopt;
    }
    if (asked.view || asked.redirect) {
      log(LogLevel::kWarning, "ring: " + address_ + " was left out of a newer ring: it joins it");
      const std::string there =
          asked.redirect ? asked.redirect->address : asked.view->addresses.at(0);
      for (auto& m : members) {
        if (m) send_quietly(m->socket, wire::RingRedirect{0, there});
      }
      for (auto& c : newcomers) send_quietly(c.socket, wire::RingRedirect{0, there});
      if (asked.view) return *asked.view;
      return join_at(there, mine, deadline);
    }
    log(LogLevel::kWarning, "ring: " + address_ + " leaves out " + view.addresses[j] +
                                ": it did not check in within " +
                                std::to_string(options_.timeout.count()) + " ms");
  }
  // A quorum: more than half of the old ring's workers not known gone (a dead process's
  // address refuses connections; a cut link's or a stopped one's does not), or half with
  // the lowest of them. The workers cut off from the others by a partition then form no
  // ring of their own: they keep checking in, and join the others' once they reach them.
  std::size_t voters = 0;
  std::size_t here = 1;
  bool lowest = true;
  for (std::size_t j = 0; j < n; ++j) {
    if (gone[j]) continue;
    ++voters;
    if (j < view.rank) lowest = false;
    if (members[j]) ++here;
  }
  if (2 * here < voters || (2 * here == voters && !lowest)) {
    log(LogLevel::kWarning, "ring: " + address_ + " reaches " + std::to_string(here) + " of the " +
                                std::to_string(voters) + " workers of generation " +
                                std::to_string(view.generation) +
                                " not known gone, no quorum: it forms no ring and checks in again");
    for (auto& m : members) {  // (ask again: this one gathers again after a pause)
      if (m) send_quietly(m->socket, wire::RingRedirect{view.generation, address_});
    }
    return std::nullopt;
  }
  // The next view: the members in their old order, this one among them, then the newcomers.
  RingView next;
  std::uint64_t generation = view.generation;
  std::vector<std::pair<std::int64_t, std::int64_t>> progress;  // step, batches
  std::vector<CheckedIn*> order;
  for (std::size_t j = 0; j < n; ++j) {
    if (j == view.rank) {
      next.addresses.push_back(address_);
      next.incarnations.push_back(wire::incarnation());
      progress.emplace_back(mine.step, mine.batches);
      order.push_back(nullptr);
    } else if (members[j]) {
      next.addresses.push_back(members[j]->said.address);
      next.incarnations.push_back(members[j]->incarnation);
      progress.emplace_back(members[j]->said.step, members[j]->said.batches);
      order.push_back(&*members[j]);
    }
  }
  for (CheckedIn& c : newcomers) {
    generation = std::max(generation, c.said.generation);
    next.addresses.push_back(c.said.address);
    next.incarnations.push_back(c.incarnation);
    progress.emplace_back(c.said.step, c.said.batches);
    order.push_back(&c);
  }
  next.generation = generation + 1;
  for (std::uint32_t r = 0; r < progress.size(); ++r) {
    if (progress[r].first > next.step) {
      next.step = progress[r].first;
      next.batches = progress[r].second;
      next.source = r;
    }
  }
  std::string names;
  for (const std::string& a : next.addresses) names += (names.empty() ? "" : ", ") + a;
  log(LogLevel::kInfo, "ring: generation " + std::to_string(next.generation) + " of " +
                           std::to_string(next.addresses.size()) + " workers (" + names +
                           "), from step " + std::to_string(next.step) + " of rank " +
                           std::to_string(next.source));
  RingView own;
  for (std::uint32_t r = 0; r < order.size(); ++r) {
    next.rank = r;
    if (order[r] == nullptr) {
      own = next;
    } else {
      send_quietly(order[r]->socket, next);
    }
  }
  return own;
}

inline bool TcpRingRendezvous::refuses(const std::string& address) {
  try {
    Socket socket(io_);
    connect(socket, address, soon());
    return false;
  } catch (const Error& e) {
    return e.code() == ErrorCode::kUnavailable;
  }
}

template <class Message>
void TcpRingRendezvous::send_quietly(Socket& socket, const Message& message) {
  try {
    send(socket, message, soon());
  } catch (const std::exception&) {  // it is gone: the ring it was told of will not form, and it
                                     // regroups
  }
}

}  // namespace pulley
