// SPDX-License-Identifier: MIT
#pragma once

/// TcpRing's bytes moved (declared in transport/tcp_ring.hpp, which includes this header after
/// the class): a call's failure that breaks the link for good, bytes received from the previous
/// rank and written to the next (through the socket or the shared ring), the waits on both
/// neighbours, and the errors of a neighbour lost or silent.

#include "pulley/transport/tcp_ring.hpp"

namespace pulley {

template <class Body>
void TcpRing::guarded(Body body) {
  try {
    body();
  } catch (...) {
    links_->out.clear();
    std::error_code ignored;
    links_->next.close(ignored);
    links_->previous.close(ignored);
    links_->broken = true;
    throw;
  }
}

inline void TcpRing::usable() const {
  if (links_->broken) {
    throw Error(ErrorCode::kFailedPrecondition, "ring: rank " + std::to_string(rank_) +
                                                    "'s link failed before: form the ring again");
  }
}

inline void TcpRing::receive_now(std::span<std::byte> bytes) {
  auto last = Clock::now();
  while (!bytes.empty()) {
    if (links_->from_previous) {
      if (const std::size_t n =
              links_->from_previous.read(bytes, links_->previous.native_handle())) {
        bytes = bytes.subspan(n);
        last = Clock::now();
        continue;
      }
    } else {
      std::error_code ec;
      const std::size_t n =
          links_->previous.read_some(asio::buffer(bytes.data(), bytes.size()), ec);
      if (!ec) {
        bytes = bytes.subspan(n);
        last = Clock::now();
        continue;
      }
      if (ec != asio::error::would_block && ec != asio::error::try_again) {
        throw lost(links_->previous_name,
                   ec == asio::error::eof ? "closed the connection" : ec.message());
      }
    }
    if (!links_->out.empty() && write_now()) continue;
    if (!wait(true, last)) throw silent(links_->previous_name, "send");
  }
}

inline void TcpRing::flush_now() {
  auto last = Clock::now();
  while (!links_->out.empty()) {
    if (write_now()) {
      last = Clock::now();
      continue;
    }
    if (!wait(false, last)) throw silent(links_->next_name, "receive");
  }
}

inline bool TcpRing::wait(bool reading, Clock::time_point last) {
  const bool writing = !links_->out.empty();
  if (looked_again(reading, writing)) return true;
  if (reading && links_->from_previous && !links_->from_previous.reader_sleeps()) return true;
  if (writing && links_->to_next && !links_->to_next.writer_sleeps()) return true;
  if (reading && links_->from_previous && links_->previous_closed) {
    throw lost(links_->previous_name, "closed the connection");
  }
  std::array<pollfd, 2> fds{
      pollfd{links_->previous.native_handle(), POLLIN, 0},
      pollfd{links_->next.native_handle(), links_->to_next ? short{POLLIN} : short{POLLOUT}, 0}};
  if (!reading) fds[0].fd = -1;
  if (!writing) fds[1].fd = -1;
  if (::poll(fds.data(), fds.size(), wait_ms(last)) == 0)
    return Clock::now() - last < options_.timeout;
  if (links_->from_previous && fds[0].revents != 0 && !ring_off(links_->previous))
    links_->previous_closed = true;
  if (links_->to_next && fds[1].revents != 0 && !ring_off(links_->next)) {
    throw lost(links_->next_name, "closed the connection");
  }
  return Clock::now() - last <
         options_.timeout;  // (a neighbour that rings and moves nothing is silent)
}

inline bool TcpRing::looked_again(bool reading, bool writing) {
  if ((reading && !links_->from_previous) || (writing && !links_->to_next)) return false;
  return spin_until(
      [&] {
        return (reading && links_->from_previous.has_data()) ||
               (writing && links_->to_next.has_room());
      },
      Clock::now() + spin_before_sleep());
}

inline bool TcpRing::ring_off(transport_detail::StreamSocket& socket) {
  std::array<std::byte, 64> bells;
  while (true) {
    std::error_code ec;
    const std::size_t n = socket.read_some(asio::buffer(bells), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) return true;
    if (ec || n == 0) return false;
  }
}

inline bool TcpRing::write_now() {
  auto& out = links_->out;
  bool wrote = false;
  if (links_->to_next) {
    while (!out.empty()) {
      const std::size_t n = links_->to_next.write(out.front(), links_->next.native_handle());
      if (n == 0) break;
      wrote = true;
      links_->written += n;
      if (n < out.front().size()) {
        out.front() = out.front().subspan(n);
      } else {
        out.pop_front();
      }
    }
    return wrote;
  }
  while (!out.empty()) {
    std::array<asio::const_buffer, 16> buffers;
    std::size_t count = 0;
    for (auto it = out.begin(); it != out.end() && count < buffers.size(); ++it) {
      buffers[count++] = asio::const_buffer(it->data(), it->size());
    }
    std::error_code ec;
    std::size_t n = links_->next.write_some(std::span(buffers.data(), count), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) return wrote;
    if (ec) throw lost(links_->next_name, ec.message());
    wrote = true;
    links_->written += n;
    while (n > 0) {
      if (n < out.front().size()) {
        out.front() = out.front().subspan(n);
        break;
      }
      n -= out.front().size();
      out.pop_front();
    }
  }
  return wrote;
}

inline int TcpRing::wait_ms(Clock::time_point last) const {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(last + options_.timeout - Clock::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1000));
}

inline Error TcpRing::lost(const std::string& who, const std::string& why) const {
  return Error(ErrorCode::kUnavailable,
               "ring: rank " + std::to_string(rank_) + " lost " + who + ": " + why);
}

inline Error TcpRing::silent(const std::string& who, const char* what) const {
  return Error(ErrorCode::kDeadlineExceeded, "ring: rank " + std::to_string(rank_) + " waited " +
                                                 std::to_string(options_.timeout.count()) +
                                                 " ms for " + who + " to " + what +
                                                 " (stopped, or cut off?)");
}

}  // namespace pulley
