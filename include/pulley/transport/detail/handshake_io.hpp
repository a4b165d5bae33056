// SPDX-License-Identifier: MIT
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "pulley/core/error.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame.hpp"
#include "pulley/transport/wire/handshake.hpp"

/// Whole frames written and read on a non-blocking socket by a thread that waits for them
/// (poll), each by a deadline: the handshakes of the ring's links and of its rendezvous,
/// which a single thread runs without an io_context's handlers. `who` opens every error.
namespace pulley::transport_detail {

using HandshakeClock = std::chrono::steady_clock;

/// Waits until `socket` is ready for `events` (a second at most); kDeadlineExceeded once
/// `deadline` has passed. (Every socket here is TCP's or a local one.)
template <class Socket>
void await_ready(Socket& socket, short events, HandshakeClock::time_point deadline,
                        std::string_view who, const char* what) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - HandshakeClock::now()).count();
  pollfd fd{socket.native_handle(), events, 0};
  if (left <= 0 || ::poll(&fd, 1, static_cast<int>(std::min<std::int64_t>(left, 1000))) < 0) {
    if (HandshakeClock::now() >= deadline) {
      throw Error(ErrorCode::kDeadlineExceeded, std::string(who) + ": the handshake's " + what +
                                                    " did not complete in time");
    }
  }
}

/// Connects `socket` (open or not) to `endpoint` by `deadline`: no error, or why not
/// (`connection_refused`, `timed_out`, ...). The connect is the kernel's non-blocking one,
/// polled up to the deadline: asio's own connect waits for the kernel to give up (about two
/// minutes for a host that drops packets, or whose accept queue is full), whatever the
/// socket's non-blocking mode.
template <class Socket, class Endpoint>
std::error_code connect_within(Socket& socket, const Endpoint& endpoint, HandshakeClock::time_point deadline) {
  std::error_code ec;
  if (!socket.is_open()) socket.open(endpoint.protocol(), ec);
  if (!ec) socket.non_blocking(true, ec);
  if (ec) return ec;
  if (::connect(socket.native_handle(), endpoint.data(), static_cast<socklen_t>(endpoint.size())) == 0) return {};
  // Errors in Asio's category, as its own calls give them (asio::error::connection_refused).
  const asio::error_category& system = asio::error::get_system_category();
  if (errno != EINPROGRESS && errno != EAGAIN) return {errno, system};
  pollfd fd{socket.native_handle(), POLLOUT, 0};
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - HandshakeClock::now()).count();
    if (left <= 0) return std::make_error_code(std::errc::timed_out);
    const int ready = ::poll(&fd, 1, static_cast<int>(std::min<std::int64_t>(left, 1000)));
    if (ready > 0) break;
    if (ready < 0 && errno != EINTR) return {errno, system};
  }
  int error = 0;
  socklen_t length = sizeof error;
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) return {errno, system};
  return {error, system};
}

template <class Socket>
void write_frame_by(Socket& socket, const wire::Frame& frame, HandshakeClock::time_point deadline,
                           std::string_view who) {
  std::string bytes(reinterpret_cast<const char*>(&frame.header), sizeof frame.header);
  bytes += frame.meta;
  bytes.append(wire::padding(frame.meta.size()), '\0');
  std::size_t at = 0;
  while (at < bytes.size()) {
    std::error_code ec;
    at += socket.write_some(asio::buffer(bytes.data() + at, bytes.size() - at), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      await_ready(socket, POLLOUT, deadline, who, "write");
    } else if (ec) {
      throw Error(ErrorCode::kUnavailable, std::string(who) + ": handshake: " + ec.message());
    }
  }
}

template <class Socket>
void read_exact_by(Socket& socket, char* into, std::size_t n, HandshakeClock::time_point deadline,
                          std::string_view who) {
  std::size_t at = 0;
  while (at < n) {
    std::error_code ec;
    at += socket.read_some(asio::buffer(into + at, n - at), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      await_ready(socket, POLLIN, deadline, who, "read");
    } else if (ec) {
      throw Error(ErrorCode::kUnavailable, std::string(who) + ": handshake: " +
                                               (ec == asio::error::eof ? "the peer closed the connection" : ec.message()));
    }
  }
}

/// Reads one frame of metadata only (no payload) within `limits`; throws wire::Malformed
/// for a header that breaks them.
template <class Socket>
std::pair<wire::Header, std::string> read_frame_by(Socket& socket, HandshakeClock::time_point deadline,
                                                          std::string_view who,
                                                          const wire::FrameLimits& limits = wire::kHandshakeLimits) {
  wire::Header header;
  read_exact_by(socket, reinterpret_cast<char*>(&header), sizeof header, deadline, who);
  wire::check(header, limits);
  if (header.payload_bytes != 0) throw wire::Malformed("a frame with a payload where metadata alone was expected");
  std::string meta(header.meta_bytes + wire::padding(header.meta_bytes), '\0');
  read_exact_by(socket, meta.data(), meta.size(), deadline, who);
  meta.resize(header.meta_bytes);
  return {header, std::move(meta)};
}

template <class Expected, class Socket>
Expected read_handshake_by(Socket& socket, HandshakeClock::time_point deadline, std::string_view who) {
  const auto bytes = read_frame_by(socket, deadline, who);
  return wire::decode_handshake_as<Expected>(bytes.first, bytes.second);
}

}  // namespace pulley::transport_detail
