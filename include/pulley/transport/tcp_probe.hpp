// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <system_error>
#include <variant>

#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"
#include "pulley/transport/detail/handshake_io.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// What one look at a ps task's address found (probe_ps).
struct ProbeResult {
  enum class Kind : std::uint8_t {
    kServes,  ///< a process proved itself that ps of the job: `process`
    kGone,    ///< no such ps there: the address refuses connections, or something else answers
    kSilent,  ///< nothing could be told in time: no connection or no handshake, or one cut short
  };
  Kind kind = Kind::kSilent;
  std::uint64_t process = 0;  ///< kServes: the process (wire::Welcome::server)
  std::string detail;         ///< what was seen, for a log line
  /// kSilent: a connection was made, so something listens there (a process stopped or hung,
  /// whose kernel still takes connections), though nothing could be told.
  bool reached = false;
};

namespace transport_detail {

/// Looks once at who serves ps task `ps` at `address`, as probe_ps says, and calls
/// `serves(socket, deadline, who, seen)` on the connection of the first process that proved
/// itself that ps (`seen` names it), before it hangs up: probe_ps's and tell_ps's common part.
template <class Serves>
ProbeResult look_at_ps(const std::string& address, std::uint32_t ps, const Node& self,
                       const Credentials& credentials, std::chrono::milliseconds timeout,
                       Serves serves, std::uint32_t shard = wire::Hello::kOwnShard) {
  using Clock = HandshakeClock;
  const auto deadline = Clock::now() + timeout;
  const Address where = parse_address(address);
  asio::io_context io;
  std::error_code ec;
  const auto endpoints = resolve_by(where.host, where.port, deadline, ec);
  if (ec || endpoints.empty()) {
    return {ProbeResult::Kind::kSilent, 0,
            "cannot resolve " + address +
                (ec == std::errc::timed_out ? " within " + std::to_string(timeout.count()) + " ms"
                 : ec                       ? ": " + ec.message()
                                            : "")};
  }
  const std::string who = "a look at ps " + std::to_string(ps) + " at " + address;
  ProbeResult seen{ProbeResult::Kind::kGone, 0, "its address refuses connections"};
  for (const auto& entry : endpoints) {
    asio::ip::tcp::socket socket(io);
    ec = connect_within(socket, entry.endpoint(), deadline);
    if (ec == asio::error::connection_refused) continue;
    if (ec) {
      seen = {ProbeResult::Kind::kSilent, 0,
              ec == std::errc::timed_out ? "no connection within " + std::to_string(timeout.count()) + " ms" : ec.message()};
      continue;
    }
    try {
      const auto challenge = read_handshake_by<wire::Challenge>(socket, deadline, who);
      if (challenge.job != credentials.job || challenge.ps != ps) {
        if (seen.kind == ProbeResult::Kind::kGone) seen.detail = "another task answers there";
        continue;
      }
      const wire::Hello hello = wire::hello_for(credentials, challenge, self, shard);
      write_frame_by(socket, wire::encode(wire::Handshake{hello}, 0), deadline, who);
      const auto frame = read_frame_by(socket, deadline, who);
      const wire::Handshake answer = wire::decode_handshake(frame.first, frame.second);
      const auto* welcome = std::get_if<wire::Welcome>(&answer);
      if (welcome != nullptr && wire::welcome_proves(credentials, challenge, hello, *welcome)) {
        ProbeResult served{ProbeResult::Kind::kServes, welcome->server, "it serves"};
        serves(socket, deadline, who, served);
        return served;
      }
      // A refusal for now (its connections are full, say) or a proof that fails: nothing told.
      seen = {ProbeResult::Kind::kSilent, 0, "it did not let the look in", true};
    } catch (const wire::Malformed& e) {
      if (seen.kind == ProbeResult::Kind::kGone) seen.detail = std::string("something else answers there: ") + e.what();
    } catch (const Error& e) {  // no challenge in time, or the connection cut short
      seen = {ProbeResult::Kind::kSilent, 0, e.message(), true};
    }
  }
  return seen;
}

}  // namespace transport_detail

/// Looks once at who serves ps task `ps` at `address` ("host:port"), over TCP, as task
/// `self` of the job of `credentials`: the handshake only (both sides prove the job's
/// secret), then it hangs up, having sent no request. Every address the host name resolves
/// to is tried, within `timeout` together with the name's resolving: the first that serves decides;
/// kGone only when every one refuses or holds something else. The chief looks when a task says a ps
/// process is out of its reach (runner/copy_rulings.hpp).
inline ProbeResult probe_ps(const std::string& address, std::uint32_t ps, const Node& self,
                            const Credentials& credentials, std::chrono::milliseconds timeout) {
  return transport_detail::look_at_ps(address, ps, self, credentials, timeout,
                                      [](auto&, auto, const std::string&, const ProbeResult&) {});
}

/// Sends `request` to the process that serves ps task `ps` at `address`, if it is one of
/// `only` (wire::Welcome::server; empty: whichever serves there), within `timeout` per
/// connection: probe_ps's look, then the request and its answer, on a connection of its own
/// to its own shard, then, if that was answered, to each shard of `copies` (wire::Hello::
/// shard), since a process may hold a copy of one of them (and refuses the others at once).
/// How the chief speaks to a process it gave up, which no task reaches any more (one stopped
/// or cut off for longer than the copy timeout that came back): it tells it to start again
/// empty, or, at the end, that training finished, as its Shutdown reaches both copies of
/// every shard. Returns the look at its own shard: the process was told, and answered (with
/// anything, a refusal too: answers are not read further), when it is kServes with a
/// process of `only`.
inline ProbeResult tell_ps(const std::string& address, std::uint32_t ps, const Node& self,
                           const Credentials& credentials, const Request& request,
                           std::chrono::milliseconds timeout,
                           const std::set<std::uint64_t>& only = {},
                           std::span<const std::uint32_t> copies = {}) {
  const auto tell = [&](std::uint32_t shard) {
    return transport_detail::look_at_ps(
        address, ps, self, credentials, timeout,
        [&](asio::ip::tcp::socket& socket, transport_detail::HandshakeClock::time_point deadline,
            const std::string& who, const ProbeResult& served) {
          if (!only.empty() && !only.contains(served.process)) return;
          transport_detail::write_frame_by(socket, wire::encode(request, 1), deadline, who);
          (void)transport_detail::read_frame_by(socket, deadline, who);
        },
        shard);
  };
  const ProbeResult own = tell(wire::Hello::kOwnShard);
  if (own.kind != ProbeResult::Kind::kServes || (!only.empty() && !only.contains(own.process)))
    return own;
  for (const std::uint32_t shard : copies) {
    if (shard != ps) (void)tell(shard);
  }
  return own;
}

/// True when a process at `address` ("host:port") takes a TCP connection within `timeout`,
/// the name's resolving included (no handshake: whether anything listens there at all). A task that
/// gave its ps tasks up asks it of the chief's address, to say whether the chief is gone too.
inline bool listens_at(const std::string& address, std::chrono::milliseconds timeout) {
  const auto deadline = transport_detail::HandshakeClock::now() + timeout;
  try {
    const Address where = parse_address(address);
    asio::io_context io;
    std::error_code ec;
    const auto endpoints = transport_detail::resolve_by(where.host, where.port, deadline, ec);
    if (ec) return false;
    for (const auto& entry : endpoints) {
      asio::ip::tcp::socket socket(io);
      if (!transport_detail::connect_within(socket, entry.endpoint(), deadline)) return true;
    }
  } catch (const std::exception&) {  // a malformed address, no memory: nothing told
  }
  return false;
}

}  // namespace pulley
