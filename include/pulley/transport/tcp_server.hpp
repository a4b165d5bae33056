// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/log.hpp"
#include "pulley/messages.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame_reader.hpp"

namespace pulley {

/// How a TcpServer treats its clients.
struct TcpServerOptions {
  /// What a request frame may claim, checked before anything is allocated for it.
  wire::FrameLimits frames;
  /// A connection stops being read while more than this many bytes of its replies wait to
  /// be written (a client that does not read cannot grow the ps's memory).
  std::uint64_t max_unsent_bytes = std::uint64_t{64} << 20U;
  /// A connection stops being read while this many of its requests are handled but not
  /// answered (pulls waiting for a step, token requests), since their replies come all at
  /// once later. A pulley client has at most three in flight per ps.
  std::uint32_t max_unanswered_requests = 16;
  /// Once the service stopped, how long the server goes on answering (every request then
  /// gets the service's final answer, e.g. "training finished") before it ends while
  /// clients stay connected: clients in the middle of a step hear how training ended
  /// instead of finding the connection closed. It ends sooner when every client has left.
  std::chrono::milliseconds linger{std::chrono::seconds(60)};
  /// How long the server goes on once every client has left while the service still runs
  /// (the chief died before it ended training, say): then `run` returns and `orphaned()`
  /// says so, so the task can fail instead of waiting for ever. Counted only once a
  /// request was handled: a ps may wait as long as it takes for its job to start.
  std::chrono::milliseconds orphaned_after{std::chrono::minutes(5)};
};

/// Serves one Service (a ParameterServer) on a TCP port, and owns it. All connections are
/// handled by one thread (the one that calls `run`), so the service sees its requests one
/// at a time, as in-process.
///
/// Requests are received many at a time when they are small (a push and its pull arrive in
/// one receive), and every reply they produce leaves in one gather-write at the end of the
/// batch, straight from the ps's parameters. What the kernel does not take at once goes
/// out as the socket drains, still from the parameters, unless a request that changes them
/// (`changes_parameters`: a push, an initialization) comes first: then the rest is copied,
/// so a reply never sees the parameters change under it.
///
/// A frame that fails wire::check or does not decode closes that connection with a logged
/// reason; the server keeps serving everyone else. A connection whose peer does not read
/// its replies stops being read once `max_unsent_bytes` of them wait (its requests wait in
/// the kernel), and so does one with `max_unanswered_requests` requests waiting in the
/// service, so no client can make the ps buffer without bound. Once the service stopped
/// (shut down by the chief, or failed), `run` returns when every client has left, or after
/// `linger`.
///
/// @tparam S the Service it serves
template <Service S>
class TcpServer {
 public:
  /// Serves `service` on `host:port`: `host` is a name ("localhost"), a numeric address, or
  /// "0.0.0.0" / "::" for every interface (what TensorFlow's servers do: under Kubernetes a
  /// task's name may resolve to a service address that is no local interface). Port 0 picks
  /// a free one; see `port()`. Throws kInvalidArgument for a host that does not resolve,
  /// kUnavailable when the address cannot be bound (a port in use).
  TcpServer(S service, const std::string& host, std::uint16_t port, TcpServerOptions options = {})
      : service_(std::move(service)),
        options_(options),
        acceptor_(transport_detail::listen(
            io_, transport_detail::resolve_listen_endpoint(io_, host, port))),
        retry_accept_(io_) {}

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  /// The service it serves. While `run` runs, only that thread may touch it.
  [[nodiscard]] S& service() noexcept { return service_; }

  /// Serves until the service stopped and its clients heard (see the class comment), or
  /// `stop` is called.
  void run() {
    accept();
    io_.run();
  }

  /// Stops serving now, from any thread.
  void stop() { io_.stop(); }

  /// True if `run` returned because every client had left for `orphaned_after` while the
  /// service was still serving.
  [[nodiscard]] bool orphaned() const noexcept { return orphaned_; }

 private:
  struct Connection : std::enable_shared_from_this<Connection> {
    Connection(TcpServer& server, asio::ip::tcp::socket peer)
        : owner(server), socket(std::move(peer)), reader(server.options_.frames) {}

    /// Too much of this connection's work is unfinished to take more requests: replies
    /// unsent, or requests unanswered. Reading resumes when either shrinks.
    [[nodiscard]] bool paused() const {
      return unsent.bytes() > owner.options_.max_unsent_bytes ||
             unanswered >= owner.options_.max_unanswered_requests;
    }

    TcpServer& owner;
    asio::ip::tcp::socket socket;
    wire::FrameReader reader;
    transport_detail::ReceiveBuffers receive_buffers;
    std::deque<wire::Frame> replies;   ///< replies with bytes in `unsent` (stable addresses)
    transport_detail::GatherList unsent;  ///< what of them, in order, the kernel has not taken
    std::unique_ptr<char[]> copy;     ///< a copy of unsent bytes that viewed the parameters
    std::unique_ptr<char[]> spare;    ///< the copy before, for reuse
    std::size_t copy_size = 0, spare_size = 0;
    std::size_t unanswered = 0;  ///< requests handled, their replies not queued
    bool views = false;          ///< `unsent` views the ps's parameters (it is in owner.viewing_)
    bool write_waiting = false;  ///< waits for the socket to take more
    bool receiving = false;      ///< a receive is armed
    bool processing = false;     ///< inside process(): it reads on by itself
    bool resume_posted = false;
    bool dirty = false;  ///< in owner.dirty_: replies queued since the last write
    bool closed = false;
  };
  using ConnectionPtr = std::shared_ptr<Connection>;

  void accept() {
    acceptor_.async_accept([this](std::error_code ec, asio::ip::tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec) {  // e.g. out of file descriptors: keep serving, try again shortly
        if (!accept_failing_) {
          log(LogLevel::kWarning, "ps " + std::to_string(service_.task()) + ": accept failed (" +
                                      ec.message() + "); retrying every 100 ms");
        }
        accept_failing_ = true;
        retry_accept_.expires_after(std::chrono::milliseconds(100));
        retry_accept_.async_wait([this](std::error_code timer) {
          if (!timer) accept();
        });
        return;
      }
      accept_failing_ = false;
      orphan_.cancel();
      std::error_code ignored;
      socket.set_option(asio::ip::tcp::no_delay(true), ignored);
      socket.non_blocking(true, ignored);  // replies are first written without waiting
      auto connection = std::make_shared<Connection>(*this, std::move(socket));
      connections_.emplace(connection.get(), connection);
      receive(connection);
      accept();
    });
  }

  /// Arms one receive into the connection's reader, unless one is armed or it is paused.
  void receive(const ConnectionPtr& c) {
    if (c->receiving || c->closed || c->paused()) return;
    c->receiving = true;
    c->receive_buffers.watermark(c->socket, c->reader.payload_left());
    c->socket.async_read_some(c->receive_buffers.of(c->reader.buffers()),
                              [this, c](std::error_code ec, std::size_t n) {
                                c->receiving = false;
                                if (c->closed) return;
                                if (ec) return forget(*c);  // the peer left, or the link broke
                                try {
                                  c->reader.commit(n);  // may fail to grow a payload buffer
                                } catch (const wire::Malformed& e) {
                                  return drop(*c, e.what());
                                }
                                process(c);
                              });
  }

  /// Handles every complete request received (while not paused), writes the replies they
  /// produced, and reads on.
  void process(const ConnectionPtr& c) {
    c->processing = true;
    try {
      // Writing the replies may end a pause (the kernel took them): then handle the
      // requests still buffered before receiving more.
      for (bool again = true; again && !c->closed;) {
        bool paused = false;
        while (!c->closed && !(paused = c->paused())) {
          auto frame = c->reader.next([](const wire::Header&, std::span<const char>) {
            return std::span<const std::span<float>>();  // requests' payloads stay here
          });
          if (!frame) break;
          dispatch(c, *frame);
        }
        flush_all();
        again = paused && !c->paused();
      }
    } catch (const std::exception& e) {  // a bad frame, or no memory for what it asks:
      drop(*c, e.what());                 // that connection goes, the ps serves on
      flush_all();
    }
    c->processing = false;
    receive(c);
    maybe_stop();
  }

  void dispatch(const ConnectionPtr& c, const wire::FrameReader::Frame& frame) {
    Request request = wire::decode_request(frame.header, frame.meta, frame.payload);
    served_ = true;
    // No reply may see the parameters change under it.
    if (changes_parameters(request)) {
      for (const ConnectionPtr& viewing : std::exchange(viewing_, {})) detach(*viewing);
    }
    ++c->unanswered;
    // The frame reader checked large payloads finite as they arrived; the service checks
    // the rest.
    service_.handle(std::move(request), RequestContext{frame.finite},
                    [this, weak = std::weak_ptr<Connection>(c),
                     call = frame.header.call](Response&& response) {
                      auto connection = weak.lock();
                      if (!connection) return;
                      --connection->unanswered;
                      try {  // a Responder never throws: a reply that cannot be queued costs
                        queue_reply(connection, response, call);  // its connection only
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

  /// Queues a reply for the write at the end of the batch; its views of the parameters stay
  /// valid until the next push or initialization (see `detach`).
  void queue_reply(const ConnectionPtr& c, const Response& response, std::uint64_t call) {
    if (c->closed) return;
    c->replies.push_back(wire::encode(response, call));
    c->unsent.append(c->replies.back());
    if (!c->replies.back().payload.empty()) {
      if (!std::exchange(c->views, true)) viewing_.push_back(c);
    }
    if (!std::exchange(c->dirty, true)) dirty_.push_back(c);
  }

  /// Reading was paused and need not be any longer: resume, after the current handler (the
  /// ps may be in the middle of a request).
  void maybe_resume(const ConnectionPtr& c) {
    if (c->receiving || c->processing || c->closed || c->paused() || c->resume_posted) return;
    c->resume_posted = true;
    asio::post(io_, [this, c] {
      c->resume_posted = false;
      if (!c->closed && !c->processing) process(c);
    });
  }

  void flush_all() {
    for (const ConnectionPtr& c : std::exchange(dirty_, {})) {
      c->dirty = false;
      write(c);
    }
  }

  /// Writes what the socket takes now, straight from the replies (their headers, metadata
  /// and the parameters they view), and waits for it to take the rest.
  void write(const ConnectionPtr& c) {
    if (c->closed || c->write_waiting) return;
    std::error_code ec;
    if (!c->unsent.write_now(c->socket, ec)) return forget(*c);  // the peer is gone
    if (c->unsent.empty()) {
      c->unsent.clear();
      c->replies.clear();
      stop_viewing(*c);
      return maybe_resume(c);  // a pause for unsent bytes may have ended just now
    }
    c->write_waiting = true;
    c->socket.async_wait(asio::socket_base::wait_write, [this, c](std::error_code wait) {
      c->write_waiting = false;
      if (c->closed) return;
      if (wait) return forget(*c);
      write(c);
      maybe_resume(c);
      maybe_stop();
    });
  }

  /// The parameters are about to change: what is unsent of `c`'s replies stops viewing
  /// them. The kernel takes what it can first; the rest is copied.
  void detach(Connection& c) {
    if (c.closed || !std::exchange(c.views, false)) return;
    std::error_code ec;
    if (!c.write_waiting && !c.unsent.write_now(c.socket, ec)) return forget(c);
    const auto n = static_cast<std::size_t>(c.unsent.bytes());
    if (c.spare_size < n) {  // the spare may hold nothing still unsent: the copy does
      try {
        c.spare = std::make_unique_for_overwrite<char[]>(n);
      } catch (const std::bad_alloc&) {  // its replies cannot wait: that connection goes
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

  /// `c`'s replies no longer view the parameters (all written, or the connection is done).
  void stop_viewing(Connection& c) {
    if (std::exchange(c.views, false)) {
      std::erase_if(viewing_, [&](const ConnectionPtr& v) { return v.get() == &c; });
    }
  }

  void drop(Connection& c, const std::string& reason) {
    std::error_code ignored;
    const auto peer = c.socket.remote_endpoint(ignored);
    log(LogLevel::kWarning, "ps " + std::to_string(service_.task()) +
                                ": closing connection from " + peer.address().to_string() + ":" +
                                std::to_string(peer.port()) + ": " + reason);
    forget(c);
  }

  /// A connection is done: closed, its unsent replies dropped, no longer kept alive here.
  void forget(Connection& c) {
    if (std::exchange(c.closed, true)) return;
    stop_viewing(c);
    c.unsent.clear();
    c.replies.clear();
    std::error_code ignored;
    c.socket.close(ignored);
    connections_.erase(&c);
    maybe_stop();
  }

  /// The service stopped: go on answering until every client has left, or `linger` passed.
  void begin_stopping() {
    if (stopping_) return;
    stopping_ = true;
    linger_.expires_after(options_.linger);
    linger_.async_wait([this](std::error_code ec) {
      if (!ec) io_.stop();
    });
    maybe_stop();
  }

  void maybe_stop() {
    if (!connections_.empty()) return;
    if (!stopping_) return watch_orphan();
    std::error_code ignored;
    acceptor_.close(ignored);
    retry_accept_.cancel();
    linger_.cancel();
    orphan_.cancel();
    io_.stop();
  }

  /// Every client is gone while the service still serves: wait `orphaned_after` for one.
  void watch_orphan() {
    if (!served_) return;
    orphan_.expires_after(options_.orphaned_after);
    orphan_.async_wait([this](std::error_code ec) {
      if (ec || !connections_.empty() || stopping_) return;
      orphaned_ = true;
      io_.stop();
    });
  }

  S service_;  ///< first: destroyed last, after every connection that may answer for it
  TcpServerOptions options_;
  asio::io_context io_{1};
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer retry_accept_;
  asio::steady_timer linger_{io_};
  asio::steady_timer orphan_{io_};
  bool served_ = false;    ///< a request was handled: the job has started
  bool orphaned_ = false;  ///< run() returned because every client left
  bool accept_failing_ = false;
  bool stopping_ = false;
  std::vector<ConnectionPtr> dirty_;    ///< connections with replies queued in this batch
  std::vector<ConnectionPtr> viewing_;  ///< connections whose unsent replies view parameters
  /// Open connections, kept alive here: one whose reading is paused has no handler pending
  /// that would hold it, while requests it made wait in the ps. Destroyed before io_.
  std::map<Connection*, ConnectionPtr> connections_;
};

}  // namespace pulley
