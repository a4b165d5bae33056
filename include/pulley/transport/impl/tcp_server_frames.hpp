// SPDX-License-Identifier: MIT
#pragma once

/// TcpServer's frames (declared in transport/tcp_server.hpp, which includes this header
/// after the class): requests read and handed to the service one at a time, and replies
/// written straight from the parameters they view.

#include "pulley/transport/tcp_server.hpp"

namespace pulley {

template <Service S>
void TcpServer<S>::receive(const ConnectionPtr& c) {
  if (c->receiving || c->closed || c->closing) return;
  if (c->paused()) {
    if (!c->paused_at) c->paused_at = Clock::now();
    return;
  }
  if (c->paused_at) {  // a frame's deadline does not run while the ps does not read
    if (c->frame_deadline) *c->frame_deadline += Clock::now() - *c->paused_at;
    c->paused_at.reset();
  }
  if (c->rings_awaited) return await_rings(c);
  c->receiving = true;
  if (!c->local) c->receive_buffers.watermark(c->socket, c->reader.payload_left());
  c->rings.async_read_some(c->socket, c->receive_buffers.of(c->reader.buffers()),
                           [this, c](std::error_code ec, std::size_t n) {
                             c->receiving = false;
                             if (c->closed) return;
                             if (ec) return forget(*c);  // the peer left, or the link broke
                             c->last_heard = Clock::now();
                             try {
                               c->reader.commit(n);  // may fail to grow a payload buffer
                             } catch (const wire::Malformed& e) {
                               return drop(*c, e.what());
                             }
                             process(c);
                           });
}

template <Service S>
void TcpServer<S>::process(const ConnectionPtr& c) {
  c->processing = true;
  try {
    // Writing the replies may end a pause (the kernel took them): then handle the
    // requests still buffered before receiving more.
    for (bool again = true; again && !c->closed && !c->closing;) {
      bool paused = false;
      while (!c->closed && !c->closing && !(paused = c->paused())) {
        auto frame = c->reader.next([&](const wire::Header& h, std::span<const char>) {
          // A request carries at most one value per element the service holds.
          if (const std::uint64_t most = max_request_payload(service_); h.payload_bytes > most) {
            throw wire::Malformed("a payload of " + std::to_string(h.payload_bytes) +
                                  " bytes, more than the " + std::to_string(most) +
                                  " bytes a request to this ps can carry");
          }
          return std::span<const std::span<float>>();  // requests' payloads stay here
        });
        if (!frame) break;
        c->frame_deadline.reset();  // that frame is whole: the next one gets its own time
        dispatch(c, *frame);
      }
      flush_all();
      again = paused && !c->paused();
    }
  } catch (const std::exception& e) {  // a bad frame, or no memory for what it asks:
    drop(*c, e.what());                // that connection goes, the ps serves on
    flush_all();
  }
  c->processing = false;
  time_frame(*c);
  receive(c);
  maybe_stop();
}

template <Service S>
void TcpServer<S>::time_frame(Connection& c) {
  if (c.closed || !c.reader.mid_frame()) {  // (a dropped connection's reader may hold a bad header)
    c.frame_deadline.reset();
    return;
  }
  // In double, capped at 10^12 ms: a header's claim (checked, but not yet when this runs
  // for a frame still arriving) cannot overflow the clock's nanoseconds.
  const double payload_ms =
      std::min(static_cast<double>(c.reader.frame_payload()) * 1000.0 /
                   static_cast<double>(std::max<std::uint64_t>(options_.min_receive_rate, 1)),
               1e12);
  const auto allowance =
      options_.frame_timeout + std::chrono::milliseconds(static_cast<std::int64_t>(payload_ms));
  if (!c.frame_deadline) {
    c.frame_deadline = c.last_heard + allowance;
    c.frame_allowance = allowance;
  } else if (allowance > c.frame_allowance) {  // the header came in: its payload counts
    *c.frame_deadline += allowance - c.frame_allowance;
    c.frame_allowance = allowance;
  }
}

template <Service S>
void TcpServer<S>::dispatch(const ConnectionPtr& c, const wire::FrameReader::Frame& frame) {
  if (!c->peer) return on_hello(c, frame);
  // (A fenced task's connections go without a line each: the service said why, once.)
  if (!fence_reason(service_, *c->peer).empty()) return forget(*c);
  Request request = wire::decode_request(frame.header, frame.meta, frame.payload);
  served_ = true;
  // No reply may see the parameters change under it.
  if (changes_parameters(request)) {
    for (const ConnectionPtr& viewing : std::exchange(viewing_, {})) detach(*viewing);
    if (c->closed) return;  // its own unread replies could not be kept: it is gone
  }
  ++c->unanswered;
  // The frame reader checked large payloads finite as they arrived; the service checks
  // the rest.
  service_.handle(
      std::move(request),
      RequestContext{frame.finite, c->peer, c->session, c->shard, frame.largest},
      [this, weak = std::weak_ptr<Connection>(c), call = frame.header.call](Response&& response) {
        auto connection = weak.lock();
        if (!connection) return;
        --connection->unanswered;
        try {  // a Responder never throws: a reply that cannot be queued costs
          // A reply that waited (a pull for its step) goes to no task the
          // service stopped serving meanwhile (`fenced`): its connection goes,
          // once the service is out of the call that answered (closing tells
          // the service, which must not be entered twice).
          if (!fence_reason(service_, *connection->peer).empty()) {
            connection->closing = true;
            asio::post(io_, [this, weak] {
              if (auto gone = weak.lock(); gone && !gone->closed) forget(*gone);
            });
            return;
          }
          queue_frame(connection, wire::encode(response, call));  // its connection only
          maybe_resume(connection);
        } catch (const std::exception& e) {
          try {
            drop(*connection, std::string("cannot queue a reply: ") + e.what());
          } catch (const std::exception&) {
            forget(*connection);
          }
        }
      });
  if (service_.stopped()) begin_stopping();
}

template <Service S>
void TcpServer<S>::queue_frame(const ConnectionPtr& c, wire::Frame&& frame) {
  if (c->closed) return;
  if (c->unsent.empty()) c->last_written = Clock::now();  // the reader's clock starts
  c->replies.push_back(std::move(frame));
  c->unsent.append(c->replies.back());
  if (!c->replies.back().payload.empty()) {
    if (!std::exchange(c->views, true)) viewing_.push_back(c);
  }
  if (!std::exchange(c->dirty, true)) dirty_.push_back(c);
}

template <Service S>
void TcpServer<S>::maybe_resume(const ConnectionPtr& c) {
  if (c->receiving || c->processing || c->closed || c->paused() || c->resume_posted) return;
  c->resume_posted = true;
  asio::post(io_, [this, c] {
    c->resume_posted = false;
    if (!c->closed && !c->processing) process(c);
  });
}

template <Service S>
void TcpServer<S>::flush_all() {
  for (const ConnectionPtr& c : std::exchange(dirty_, {})) {
    c->dirty = false;
    write(c);
  }
}

template <Service S>
void TcpServer<S>::write(const ConnectionPtr& c) {
  if (c->closed || c->write_waiting) return;
  std::error_code ec;
  const std::uint64_t before = c->unsent.bytes();
  if (!c->rings.write_now(c->unsent, c->socket, ec)) return forget(*c);  // the peer is gone
  if (c->unsent.bytes() != before) c->last_written = Clock::now();
  if (c->unsent.empty()) {
    c->unsent.clear();
    c->replies.clear();
    stop_viewing(*c);
    if (c->copy) {  // written: the copy is spare now, which the budget may reclaim
      c->release_spare(budget_);
      c->spare = std::move(c->copy);
      c->spare_size = std::exchange(c->copy_size, 0);
    }
    if (c->closing) return forget(*c);  // a refusal, written whole
    return maybe_resume(c);             // a pause for unsent bytes may have ended just now
  }
  c->write_waiting = true;
  c->rings.async_wait_write(c->socket, [this, c](std::error_code wait) {
    c->write_waiting = false;
    if (c->closed) return;
    if (wait) return forget(*c);
    write(c);
    maybe_resume(c);
    maybe_stop();
  });
}

}  // namespace pulley
