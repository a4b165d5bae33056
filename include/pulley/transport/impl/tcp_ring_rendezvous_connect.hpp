// SPDX-License-Identifier: MIT
#pragma once

/// TcpRingRendezvous's connecting side (declared in transport/tcp_ring_rendezvous.hpp, which
/// includes this header after the class): the next ring's view found after a break (regroup) or
/// by a newcomer (join), a connection by a deadline, a worker asked (the handshake's connecting
/// side and the check-in), a running ring's rank 0 checked in with, and held check-ins released.

#include "pulley/transport/tcp_ring_rendezvous.hpp"

namespace pulley {

inline RingView TcpRingRendezvous::regroup(const RingView& view, RingProgress mine) {
  const auto deadline = HandshakeClock::now() + options_.form_timeout;
  while (HandshakeClock::now() < deadline) {
    bool below_alive = false;
    std::vector<bool> gone(view.addresses.size(), false);
    for (std::uint32_t i = 0; i < view.rank; ++i) {
      const Asked asked = ask(view.addresses[i], check_in(view.generation, mine),
                              HandshakeClock::now() + options_.timeout, deadline);
      if (asked.view) return released(*asked.view);
      if (asked.redirect &&
          asked.redirect->generation > view.generation) {  // a newer ring left this one out
        return released(join_at(asked.redirect->address, mine, deadline));
      }
      gone[i] = asked.gone;
      // Busy forming a ring, or still in the old one (it has not seen it broken): ask
      // again from the top.
      if (asked.busy || asked.redirect) {
        below_alive = true;
        break;
      }
    }
    if (!below_alive) {
      if (std::optional<RingView> formed = coordinate(view, mine, std::move(gone), deadline))
        return *formed;
    }
    pause();
  }
  throw Error(ErrorCode::kDeadlineExceeded, "ring: " + address_ + " found no ring to form within " +
                                                std::to_string(options_.form_timeout.count()) +
                                                " ms");
}

inline RingView TcpRingRendezvous::join(const std::vector<std::string>& members) {
  const auto deadline = HandshakeClock::now() + options_.form_timeout;
  while (HandshakeClock::now() < deadline) {
    for (const std::string& member : members) {
      if (member == address_) continue;
      const Asked asked =
          ask(member, check_in(0, {}), HandshakeClock::now() + options_.timeout, deadline);
      if (asked.view) return *asked.view;
      if (asked.redirect) {
        try {
          return join_at(asked.redirect->address, {}, deadline);
        } catch (const Error& e) {  // that rank 0 is gone since: ask the members again
          if (e.code() != ErrorCode::kUnavailable) throw;
          break;
        }
      }
      if (asked.busy) break;
    }
    pause();
  }
  throw Error(ErrorCode::kDeadlineExceeded,
              "ring: " + address_ + " was not taken into a ring within " +
                  std::to_string(options_.form_timeout.count()) + " ms");
}

inline void TcpRingRendezvous::connect(Socket& socket, const std::string& address,
                                       HandshakeClock::time_point deadline) {
  const Address at = parse_address(address);
  std::error_code ec;
  const auto endpoints = transport_detail::resolve_by(at.host, at.port, deadline, ec);
  if (ec == std::errc::timed_out)
    throw Error(ErrorCode::kDeadlineExceeded, "ring: " + address + " did not resolve in time");
  if (ec || endpoints.empty())
    throw Error(ErrorCode::kInvalidArgument, "ring: cannot resolve " + address);
  ec = transport_detail::connect_within(socket, endpoints.begin()->endpoint(), deadline);
  if (ec == std::errc::timed_out) {
    throw Error(ErrorCode::kDeadlineExceeded,
                "ring: " + address + " did not answer a connection in time");
  }
  if (ec) throw Error(ErrorCode::kUnavailable, "ring: " + address + ": " + ec.message());
}

inline TcpRingRendezvous::Asked TcpRingRendezvous::ask(const std::string& address,
                                                       const wire::RingCheckIn& said,
                                                       HandshakeClock::time_point handshake_by,
                                                       HandshakeClock::time_point answer_by) {
  Asked asked;
  Socket socket(io_);
  try {
    try {
      connect(socket, address, handshake_by);
    } catch (const Error& e) {
      asked.gone = e.code() == ErrorCode::kUnavailable;
      return asked;
    }
    const auto challenge =
        transport_detail::read_handshake_by<wire::Challenge>(socket, handshake_by, who());
    const wire::Hello hello =
        wire::hello_for(credentials_, challenge, Node::worker(0), wire::Hello::kRingRendezvous);
    transport_detail::write_frame_by(socket, wire::encode(wire::Handshake{hello}, 0), handshake_by,
                                     who());
    const auto bytes = transport_detail::read_frame_by(socket, handshake_by, who());
    const wire::Handshake answer = wire::decode_handshake(bytes.first, bytes.second);
    if (const auto* refusal = std::get_if<wire::Refusal>(&answer)) {
      if (refusal->code == ErrorCode::kUnavailable) {
        asked.busy = true;
        return asked;
      }
      throw Error(ErrorCode::kUnauthenticated,
                  "ring: " + address + " refused " + address_ + ": " + refusal->reason);
    }
    const auto* welcome = std::get_if<wire::Welcome>(&answer);
    if (welcome == nullptr || !wire::welcome_proves(credentials_, challenge, hello, *welcome)) {
      throw Error(
          ErrorCode::kUnauthenticated,
          "ring: " + address + " did not prove the job's shared secret (a wrong PULLEY_SECRET?)");
    }
    send(socket, said, handshake_by);
    auto reply = receive(socket, answer_by);
    if (auto* view = std::get_if<RingView>(&reply)) asked.view = std::move(*view);
    if (auto* redirect = std::get_if<wire::RingRedirect>(&reply))
      asked.redirect = std::move(*redirect);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnauthenticated) throw;
  } catch (const wire::Malformed& e) {
    log(LogLevel::kWarning, who() + ": " + address + " is not a ring's worker: " + e.what());
  }
  return asked;
}

inline RingView TcpRingRendezvous::join_at(const std::string& address, RingProgress mine,
                                           HandshakeClock::time_point deadline) {
  while (HandshakeClock::now() < deadline) {
    const Asked asked =
        ask(address, check_in(0, mine), HandshakeClock::now() + options_.timeout, deadline);
    if (asked.view) return *asked.view;
    if (!asked.busy && !asked.redirect) break;
    pause();
  }
  throw Error(ErrorCode::kUnavailable,
              "ring: " + address_ + " was sent to " + address + ", which did not take it in");
}

inline RingView TcpRingRendezvous::released(RingView view) {
  for (CheckedIn& in : held_)
    send_quietly(in.socket, wire::RingRedirect{view.generation, view.addresses.at(0)});
  held_.clear();
  return view;
}

}  // namespace pulley
