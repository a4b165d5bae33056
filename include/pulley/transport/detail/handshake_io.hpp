// SPDX-License-Identifier: MIT
#pragma once

#include <poll.h>

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
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
/// `deadline` has passed.
inline void await_ready(asio::ip::tcp::socket& socket, short events, HandshakeClock::time_point deadline,
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

inline void write_frame_by(asio::ip::tcp::socket& socket, const wire::Frame& frame, HandshakeClock::time_point deadline,
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

inline void read_exact_by(asio::ip::tcp::socket& socket, char* into, std::size_t n, HandshakeClock::time_point deadline,
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
inline std::pair<wire::Header, std::string> read_frame_by(asio::ip::tcp::socket& socket, HandshakeClock::time_point deadline,
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

template <class Expected>
Expected read_handshake_by(asio::ip::tcp::socket& socket, HandshakeClock::time_point deadline, std::string_view who) {
  const auto bytes = read_frame_by(socket, deadline, who);
  return wire::decode_handshake_as<Expected>(bytes.first, bytes.second);
}

}  // namespace pulley::transport_detail
