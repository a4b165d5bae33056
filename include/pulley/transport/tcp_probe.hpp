// SPDX-License-Identifier: MIT
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <string>
#include <system_error>
#include <variant>

#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"
#include "pulley/transport/detail/handshake_io.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// What one look at a ps task's address found (probe_ps).
struct ProbeResult {
  enum class Kind : std::uint8_t {
    kReached,  ///< a process answered the handshake there
    kRefused,  ///< the address refuses connections: no process listens there
    kSilent,   ///< no connection, or no handshake, within the time given
  };
  Kind kind = Kind::kSilent;
  /// kReached: the process that proved itself ps `ps` of the job (wire::Welcome::server);
  /// 0 when something else answered (another task or job, a refusal): it cannot be told.
  std::uint64_t process = 0;
  std::string detail;  ///< what was seen, for a log line
};

/// Looks once, within `timeout`, at who serves ps task `ps` at `address` ("host:port"),
/// over TCP, as task `self` of the job of `credentials`: the handshake only (both sides
/// prove the job's secret), then it hangs up, having sent no request. The chief asks it
/// when a task says a ps process is out of its reach (runner/copy_rulings.hpp).
inline ProbeResult probe_ps(const std::string& address, std::uint32_t ps, const Node& self,
                            const Credentials& credentials, std::chrono::milliseconds timeout) {
  using Clock = transport_detail::HandshakeClock;
  const auto deadline = Clock::now() + timeout;
  const Address where = parse_address(address);
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  std::error_code ec;
  asio::ip::tcp::resolver resolver(io);
  const auto endpoints = resolver.resolve(where.host, std::to_string(where.port), ec);
  if (ec || endpoints.empty()) {
    return {ProbeResult::Kind::kSilent, 0, "cannot resolve " + address + (ec ? ": " + ec.message() : "")};
  }
  const auto endpoint = endpoints.begin()->endpoint();
  socket.open(endpoint.protocol(), ec);
  if (!ec) socket.non_blocking(true, ec);
  if (!ec) socket.connect(endpoint, ec);
  if (ec == asio::error::in_progress || ec == asio::error::would_block) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd fd{socket.native_handle(), POLLOUT, 0};
    if (::poll(&fd, 1, static_cast<int>(left > 0 ? left : 0)) <= 0) {
      return {ProbeResult::Kind::kSilent, 0, "no connection within " + std::to_string(timeout.count()) + " ms"};
    }
    int error = 0;
    socklen_t length = sizeof error;
    ::getsockopt(socket.native_handle(), SOL_SOCKET, SO_ERROR, &error, &length);
    ec = std::error_code(error, std::system_category());
  }
  if (ec == asio::error::connection_refused) return {ProbeResult::Kind::kRefused, 0, "its address refuses connections"};
  if (ec) return {ProbeResult::Kind::kSilent, 0, ec.message()};
  const std::string who = "a look at ps " + std::to_string(ps) + " at " + address;
  try {
    const auto challenge = transport_detail::read_handshake_by<wire::Challenge>(socket, deadline, who);
    if (challenge.job != credentials.job || challenge.ps != ps) {
      return {ProbeResult::Kind::kReached, 0, "another task answers there"};
    }
    const wire::Hello hello = wire::hello_for(credentials, challenge, self);
    transport_detail::write_frame_by(socket, wire::encode(wire::Handshake{hello}, 0), deadline, who);
    const auto frame = transport_detail::read_frame_by(socket, deadline, who);
    const wire::Handshake answer = wire::decode_handshake(frame.first, frame.second);
    const auto* welcome = std::get_if<wire::Welcome>(&answer);
    if (welcome == nullptr || !wire::welcome_proves(credentials, challenge, hello, *welcome)) {
      return {ProbeResult::Kind::kReached, 0, "it did not let this task in"};
    }
    return {ProbeResult::Kind::kReached, welcome->server, "reached"};
  } catch (const Error& e) {
    return {e.code() == ErrorCode::kDeadlineExceeded ? ProbeResult::Kind::kSilent : ProbeResult::Kind::kReached, 0,
            e.message()};
  } catch (const wire::Malformed& e) {
    return {ProbeResult::Kind::kReached, 0, std::string("not a pulley ps: ") + e.what()};
  }
}

}  // namespace pulley
