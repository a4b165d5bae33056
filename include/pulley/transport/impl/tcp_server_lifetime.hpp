// SPDX-License-Identifier: MIT
#pragma once

/// TcpServer's deadlines and endings (declared in transport/tcp_server.hpp, which
/// includes this header after the class): replies detached from parameters about to
/// change, connections expired and forgotten, and the server's stop once its clients left.

#include "pulley/transport/tcp_server.hpp"

namespace pulley {

template <Service S>
void TcpServer<S>::detach(Connection& c) {
  if (c.closed || !std::exchange(c.views, false)) return;
  std::error_code ec;
  if (!c.write_waiting && !c.rings.write_now(c.unsent, c.socket, ec)) return forget(c);
  const auto n = static_cast<std::size_t>(c.unsent.bytes());
  if (c.spare_size < n) {  // the spare may hold nothing still unsent: the copy does
    c.release_spare(budget_);
    if (!budget_.take(n)) {
      return drop(c, std::to_string(n) +
                         " bytes of its replies are unread and the ps's "
                         "buffer budget cannot keep them (TcpServerOptions::max_buffered_bytes: " +
                         std::to_string(budget_.limit() >> 20U) + " MiB)");
    }
    try {
      c.spare = std::make_unique_for_overwrite<char[]>(n);
    } catch (const std::bad_alloc&) {  // its replies cannot wait: that connection goes
      budget_.give(n);
      return drop(c, "no memory to keep " + std::to_string(n) + " unsent reply bytes");
    }
    c.spare_size = n;
  }
  c.unsent.copy_remaining(c.spare.get());
  std::swap(c.copy, c.spare);
  std::swap(c.copy_size, c.spare_size);
  c.unsent.clear();
  c.replies.clear();
  c.unsent.append(c.copy.get(), n);
}

template <Service S>
void TcpServer<S>::stop_viewing(Connection& c) {
  if (std::exchange(c.views, false)) {
    std::erase_if(viewing_, [&](const ConnectionPtr& v) { return v.get() == &c; });
  }
}

template <Service S>
void TcpServer<S>::drop(Connection& c, const std::string& reason) {
  warn_limited("closing connection from " + c.who() + ": " + reason);
  forget(c);
}

template <Service S>
void TcpServer<S>::forget(Connection& c) {
  if (std::exchange(c.closed, true)) return;
  stop_viewing(c);
  c.unsent.clear();
  c.replies.clear();
  c.rings.stop();
  std::error_code ignored;
  c.socket.close(ignored);
  ConnectionPtr keep;  // alive until this returns
  if (const auto it = connections_.find(&c); it != connections_.end()) {
    keep = it->second;
    connections_.erase(it);
  }
  if (c.peer) {
    --clients_;
    // The service may apply what the peer's leaving sets off (held pushes, when the
    // chief leaves a ps it paused): no reply may see the parameters change under it.
    for (const ConnectionPtr& viewing : std::exchange(viewing_, {})) detach(*viewing);
    notify_disconnected(service_, *c.peer, c.session);
    // What it held may have gone to others, whose replies wait to be written.
    asio::post(io_, [this] { flush_all(); });
  }
  maybe_stop();
}

template <Service S>
void TcpServer<S>::sweep() {
  const auto shortest =
      std::min({options_.handshake_timeout, options_.frame_timeout, options_.idle_timeout});
  const auto every = std::clamp<std::chrono::milliseconds>(
      shortest / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  sweep_.expires_after(every);
  sweep_.async_wait([this](std::error_code ec) {
    if (ec) return;
    sweep();  // first: a throw below must not end the deadlines
    if (!service_.stopped()) {
      tick(service_);  // deadlines of its own that pass while nobody sends
      if (service_.stopped()) begin_stopping();
    }
    const auto now = Clock::now();
    std::vector<ConnectionPtr> all;
    for (auto& [raw, c] : connections_) all.push_back(c);
    for (const ConnectionPtr& c : all) {
      try {
        expire(*c, now);
      } catch (const std::exception&) {  // no memory for a log line: close it quietly
        forget(*c);
      }
    }
    flush_all();
  });
}

template <Service S>
void TcpServer<S>::expire(Connection& c, Clock::time_point now) {
  if (c.closed) return;
  // A task the service serves no more (`fenced`) is closed even while it only waits:
  // a pull parked for a step, or a connection with nothing to say, must not hold it.
  if (c.peer && !fence_reason(service_, *c.peer).empty()) return forget(c);
  const auto ms = [](Clock::duration d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  if (!c.peer && now - c.accepted > options_.handshake_timeout) {
    drop(c, "no handshake within " + ms(options_.handshake_timeout) + " ms");
  } else if (c.frame_deadline && c.receiving && now > *c.frame_deadline) {
    drop(c, "a frame begun " + ms(now - *c.frame_deadline + c.frame_allowance) +
                " ms ago is still not complete (TcpServerOptions::frame_timeout)");
  } else if (!c.unsent.empty() && now - c.last_written > options_.frame_timeout) {
    drop(c, "it has not read its replies for " + ms(now - c.last_written) +
                " ms (TcpServerOptions::frame_timeout)");
  } else if (c.peer && !c.frame_deadline && c.unanswered == 0 && c.unsent.empty() &&
             now - c.last_heard > options_.idle_timeout) {
    log(LogLevel::kInfo,
        "ps " + std::to_string(service_.task()) + ": closing idle connection from " + c.who());
    forget(c);
  }
}

template <Service S>
void TcpServer<S>::warn_limited(const std::string& line) {
  warnings_(LogLevel::kWarning, "ps " + std::to_string(service_.task()) + ": " + line);
}

template <Service S>
void TcpServer<S>::begin_stopping() {
  if (stopping_) return;
  stopping_ = true;
  // A process told to start again: its clients hold a process given up (their answer,
  // the chief's Ack, goes out within the second).
  linger_.expires_after(restarts(service_) ? std::min(options_.linger, kRestartLinger)
                                           : options_.linger);
  linger_.async_wait([this](std::error_code ec) {
    if (!ec) io_.stop();
  });
  maybe_stop();
}

template <Service S>
void TcpServer<S>::maybe_stop() {
  if (clients_ > 0) return;
  if (!stopping_) return watch_orphan();
  if (awaits_workers(service_)) {  // a worker that did not hear the end yet may still come
    grace_over_ = false;           // the grace comes after it
    if (grace_armed_) return;
    grace_armed_ = true;
    grace_.expires_after(kAwaitedLook);
    grace_.async_wait([this](std::error_code ec) {
      grace_armed_ = false;
      if (!ec) maybe_stop();
    });
    return;
  }
  if (options_.end_grace.count() > 0 && !grace_over_) {
    if (grace_armed_) return;
    grace_armed_ = true;
    grace_.expires_after(options_.end_grace);
    grace_.async_wait([this](std::error_code ec) {
      grace_armed_ = false;
      if (ec) return;
      // A client still connected, or one still in its handshake (perhaps the one cut
      // off, coming back), starts it anew.
      grace_over_ = clients_ == 0 && connections_.empty();
      maybe_stop();
    });
    return;
  }
  std::error_code ignored;
  acceptor_.close(ignored);
  retry_accept_.cancel();
#if defined(__linux__)
  local_acceptor_.close(ignored);
  retry_local_.cancel();
#endif
  linger_.cancel();
  grace_.cancel();
  orphan_.cancel();
  sweep_.cancel();
  io_.stop();
}

template <Service S>
void TcpServer<S>::watch_orphan() {
  if (!served_ || orphan_armed_) return;  // a connection that came and went restarts nothing
  orphan_armed_ = true;
  orphan_.expires_after(options_.orphaned_after);
  orphan_.async_wait([this](std::error_code ec) {
    orphan_armed_ = false;
    if (ec || clients_ > 0 || stopping_) return;
    orphaned_ = true;
    io_.stop();
  });
}

}  // namespace pulley
