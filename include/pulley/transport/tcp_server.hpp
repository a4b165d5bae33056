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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/transport/detail/shared_rings.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/tcp_options.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame_reader.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

template <Service S>
class TcpServer {
 public:
  /// Serves `service` on `host:port`: `host` is a name ("localhost"), a numeric address, or
  /// "0.0.0.0" / "::" for every interface (what TensorFlow's servers do: under Kubernetes a
  /// task's name may resolve to a service address that is no local interface). Port 0 picks
  /// a free one; see `port()`. Throws kInvalidArgument for a host that does not resolve or
  /// bad credentials, kUnavailable when the address cannot be bound (a port in use).
  TcpServer(S service, const std::string& host, std::uint16_t port, TcpServerOptions options = {})
      : service_(std::move(service)),
        options_(std::move(options)),
        budget_(options_.max_buffered_bytes),
        acceptor_(transport_detail::listen(
            io_, transport_detail::resolve_listen_endpoint(io_, host, port))),
        retry_accept_(io_) {
    wire::check_credentials(options_.credentials);
    if (options_.local_socket) listen_locally();
    budget_.reclaim = [this] {
      for (auto& [raw, connection] : connections_) {
        connection->reader.release_idle();
        connection->release_spare(budget_);
      }
    };
    if (options_.credentials.secret.empty() && !options_.allow_no_secret) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ps " + std::to_string(service_.task()) + ": no shared secret is set, so any peer that knows "
                  "the job's name ('" + options_.credentials.job + "') could join: set the job's secret "
                  "(TcpServerOptions::credentials; Job::credentials under pulley::run; README, Security), or "
                  "TcpServerOptions::allow_no_secret for a port only trusted peers reach");
    }
    if (options_.credentials.secret.empty()) {
      log(LogLevel::kWarning, "ps " + std::to_string(service_.task()) +
                                  ": no shared secret is set: any peer that reaches this port "
                                  "may join job '" + options_.credentials.job +
                                  "' (set TcpServerOptions::credentials; README, Security)");
    }
  }

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  /// The service it serves. While `run` runs, only that thread may touch it.
  [[nodiscard]] S& service() noexcept { return service_; }

  /// Serves until the service stopped and its clients heard (see the class comment), or
  /// `stop` is called. A handler that throws (it should not: each closes its own
  /// connection) is logged, and serving goes on.
  void run() {
    accept();
    sweep();
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        log(LogLevel::kError, "ps " + std::to_string(service_.task()) +
                                  ": an I/O handler failed (" + e.what() + "); serving on");
      }
    }
  }

  /// Stops serving now, from any thread.
  void stop() { io_.stop(); }

  /// True if `run` returned because every client had left for `orphaned_after` while the
  /// service was still serving.
  [[nodiscard]] bool orphaned() const noexcept { return orphaned_; }

  /// Bytes held for connections now (see `TcpServerOptions::max_buffered_bytes`). Only from
  /// the thread that runs the server, or once it has returned.
  [[nodiscard]] std::uint64_t buffered_bytes() const noexcept { return budget_.used(); }

 private:
  using Clock = std::chrono::steady_clock;

  struct Connection : std::enable_shared_from_this<Connection> {
    Connection(TcpServer& server, transport_detail::StreamSocket peer_socket, std::string peer_address, bool is_local)
        : owner(server),
          socket(std::move(peer_socket)),
          local(is_local),
          address(std::move(peer_address)),
          reader(wire::kHandshakeLimits, std::size_t{64} << 10U, &server.budget_),
          session(++server.sessions_),
          accepted(Clock::now()),
          last_heard(accepted) {}
    ~Connection() { owner.budget_.give(copy_size + spare_size + ring_charge); }

    /// Too much of this connection's work is unfinished to take more requests: replies
    /// unsent, or requests unanswered. Reading resumes when either shrinks.
    [[nodiscard]] bool paused() const {
      return unsent.bytes() > owner.options_.max_unsent_bytes ||
             unanswered >= owner.options_.max_unanswered_requests;
    }

    /// Frees the copy of unsent replies kept for reuse.
    void release_spare(wire::MemoryBudget& budget) noexcept {
      if (!spare) return;
      spare.reset();
      budget.give(spare_size);
      spare_size = 0;
    }

    /// "worker:1 at 10.0.0.2:4711" ("... at the local socket, pid 4711"), or the address
    /// alone before the handshake.
    [[nodiscard]] std::string who() const {
      return peer ? peer->name() + " at " + address : address;
    }

    TcpServer& owner;
    transport_detail::StreamSocket socket;
    bool local;           ///< on the local socket (no receive watermark: see ReceiveBuffers)
    transport_detail::SharedRings rings;  ///< its bytes' path once both ends took shared memory
    bool rings_awaited = false;   ///< the welcome took shared memory: the client's ring comes next
    std::size_t ring_charge = 0;  ///< this side's ring, charged to the budget
    std::string address;  ///< the peer's, for log lines
    wire::FrameReader reader;
    transport_detail::ReceiveBuffers receive_buffers;
    std::optional<wire::Challenge> challenge;  ///< sent; until the client answers it
    std::optional<Node> peer;                  ///< the task it proved, after the handshake
    std::uint64_t incarnation = 0;             ///< its process (wire::Hello::incarnation)
    std::optional<std::uint32_t> shard;        ///< a copy's shard it asked for (wire::Hello::shard)
    std::uint64_t session;                     ///< this connection's id, for the service
    std::deque<wire::Frame> replies;   ///< replies with bytes in `unsent` (stable addresses)
    transport_detail::GatherList unsent;  ///< what of them, in order, the kernel has not taken
    std::unique_ptr<char[]> copy;     ///< a copy of unsent bytes that viewed the parameters
    std::unique_ptr<char[]> spare;    ///< the copy before, for reuse
    std::size_t copy_size = 0, spare_size = 0;  ///< (both charged to the budget)
    std::size_t unanswered = 0;  ///< requests handled, their replies not queued
    Clock::time_point accepted;
    Clock::time_point last_heard;  ///< the last receive
    std::optional<Clock::time_point> frame_deadline;  ///< while a frame is half in
    std::optional<Clock::time_point> paused_at;       ///< reading paused since
    Clock::time_point last_written;  ///< the kernel last took reply bytes (or they began)
    Clock::duration frame_allowance{};                ///< the frame's time, as last computed
    bool views = false;          ///< `unsent` views the ps's parameters (it is in owner.viewing_)
    bool write_waiting = false;  ///< waits for the socket to take more
    bool receiving = false;      ///< a receive is armed
    bool processing = false;     ///< inside process(): it reads on by itself
    bool resume_posted = false;
    bool dirty = false;  ///< in owner.dirty_: replies queued since the last write
    bool closed = false;
    bool closing = false;  ///< refused (or fenced): closes once its last frame is written
  };
  using ConnectionPtr = std::shared_ptr<Connection>;

  /// Listens on the local socket of this TCP address and port too, unless its name is taken
  /// (logged: TCP then serves alone).
  void listen_locally() {
#if defined(__linux__)
    const asio::ip::tcp::endpoint tcp = acceptor_.local_endpoint();
    const asio::local::stream_protocol::endpoint endpoint(transport_detail::local_socket_name(tcp.address(), tcp.port()));
    std::error_code ec;
    local_acceptor_.open(endpoint.protocol(), ec);
    if (!ec) local_acceptor_.bind(endpoint, ec);
    if (!ec) local_acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      std::error_code ignored;
      local_acceptor_.close(ignored);
      log(LogLevel::kWarning, "ps " + std::to_string(service_.task()) + ": no local socket for port " +
                                  std::to_string(tcp.port()) + " (" + ec.message() +
                                  "): tasks on this host reach it over TCP");
    }
#endif
  }

  void accept() {
#if defined(__linux__)
    if (local_acceptor_.is_open()) accept_local();
#endif
    accept_tcp();
  }

#if defined(__linux__)
  /// Accepts on the local socket, as accept_tcp on the port; the peer is named by its pid.
  void accept_local() {
    local_acceptor_.async_accept([this](std::error_code ec, asio::local::stream_protocol::socket socket) {
      if (ec == asio::error::operation_aborted || !local_acceptor_.is_open()) return;
      if (ec) {  // (out of file descriptors, say: accept_tcp's retries say so; try again)
        retry_local_.expires_after(std::chrono::milliseconds(100));
        retry_local_.async_wait([this](std::error_code timer) {
          if (!timer) accept_local();
        });
        return;
      }
      std::string address = "the local socket";
      ucred peer{};
      socklen_t size = sizeof peer;
      if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &peer, &size) == 0) {
        address += ", pid " + std::to_string(peer.pid);
      }
      admit(transport_detail::StreamSocket(std::move(socket)), std::move(address), true);
      accept_local();
    });
  }
#endif

  void accept_tcp() {
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
          if (!timer) accept_tcp();
        });
        return;
      }
      accept_failing_ = false;
      std::error_code ignored;
      const asio::ip::tcp::endpoint peer = socket.remote_endpoint(ignored);
      admit(transport_detail::StreamSocket(std::move(socket)),
            peer.address().to_string() + ":" + std::to_string(peer.port()), false);
      accept_tcp();
    });
  }

  /// A new connection: challenged, and read. At the limit of connections in the handshake
  /// the oldest of them is closed to make room (a task of the job answers the challenge in
  /// a round trip; a connection that has not yet is the likelier stranger); a connection
  /// the memory budget cannot hold is refused.
  void admit(transport_detail::StreamSocket socket, std::string address, bool local) {
    std::error_code ignored;
    if (connections_.size() - clients_ >= options_.max_handshaking) {
      Connection* oldest = nullptr;
      for (const auto& [raw, c] : connections_) {
        if (!c->peer && !c->closed && (oldest == nullptr || c->accepted < oldest->accepted)) oldest = raw;
      }
      if (oldest == nullptr) {
        socket.close(ignored);
        return;
      }
      drop(*oldest, std::to_string(options_.max_handshaking) +
                        " connections are in the handshake (TcpServerOptions::max_handshaking): the oldest makes room");
    }
    if (local) {
      transport_detail::widen_local_buffers(socket);
    } else {
      socket.set_option(asio::ip::tcp::no_delay(true), ignored);
    }
    socket.non_blocking(true, ignored);  // replies are first written without waiting
    ConnectionPtr c;
    try {
      c = std::make_shared<Connection>(*this, std::move(socket), std::move(address), local);
      c->challenge = wire::Challenge{options_.credentials.job, service_.task(), wire::make_nonce()};
      connections_.emplace(c.get(), c);
      queue_frame(c, wire::encode(wire::Handshake{*c->challenge}, 0));
    } catch (const std::exception& e) {  // no memory, or the budget is spent
      warn_limited("refused a connection: " + std::string(e.what()));
      if (c) forget(*c);
      return;
    }
    write(c);
    receive(c);
  }

  /// Arms one receive into the connection's reader, unless one is armed or it is paused.
  void receive(const ConnectionPtr& c) {
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

  /// Handles every complete request received (while not paused), writes the replies they
  /// produced, and reads on.
  void process(const ConnectionPtr& c) {
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
      drop(*c, e.what());                 // that connection goes, the ps serves on
      flush_all();
    }
    c->processing = false;
    time_frame(*c);
    receive(c);
    maybe_stop();
  }

  /// Starts or ends the deadline of a frame half received.
  void time_frame(Connection& c) {
    if (c.closed || !c.reader.mid_frame()) {  // (a dropped connection's reader may hold a bad header)
      c.frame_deadline.reset();
      return;
    }
    // In double, capped at 10^12 ms: a header's claim (checked, but not yet when this runs
    // for a frame still arriving) cannot overflow the clock's nanoseconds.
    const double payload_ms = std::min(static_cast<double>(c.reader.frame_payload()) * 1000.0 /
                                           static_cast<double>(std::max<std::uint64_t>(options_.min_receive_rate, 1)),
                                       1e12);
    const auto allowance = options_.frame_timeout + std::chrono::milliseconds(static_cast<std::int64_t>(payload_ms));
    if (!c.frame_deadline) {
      c.frame_deadline = c.last_heard + allowance;
      c.frame_allowance = allowance;
    } else if (allowance > c.frame_allowance) {  // the header came in: its payload counts
      *c.frame_deadline += allowance - c.frame_allowance;
      c.frame_allowance = allowance;
    }
  }

  void dispatch(const ConnectionPtr& c, const wire::FrameReader::Frame& frame) {
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
    service_.handle(std::move(request), RequestContext{frame.finite, c->peer, c->session, c->shard, frame.largest},
                    [this, weak = std::weak_ptr<Connection>(c),
                     call = frame.header.call](Response&& response) {
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

  /// The client's answer to the challenge: let it in, or refuse it with one log line.
  void on_hello(const ConnectionPtr& c, const wire::FrameReader::Frame& frame) {
    const wire::Hello hello = wire::decode_handshake_as<wire::Hello>(frame.header, frame.meta);
    wire::Refusal refusal{ErrorCode::kUnauthenticated,
                          wire::refusal_reason(options_.credentials, *c->challenge, hello,
                                               options_.tasks.contains(Node::Role::kPs))};
    if (refusal.reason.empty()) refusal = outside_job(hello.peer);
    if (refusal.reason.empty() && (hello.shard == wire::Hello::kRingLink || hello.shard == wire::Hello::kRingRendezvous)) {
      refusal.reason = hello.peer.name() + " connected as a ring's worker (TcpRing) to ps " +
                       std::to_string(service_.task()) + ": a ring's addresses are the workers'";
    } else if (refusal.reason.empty() && hello.shard != wire::Hello::kOwnShard && hello.shard != service_.task() &&
               !holds_copy(service_, hello.shard)) {
      refusal.reason = hello.peer.name() + " asked for a copy of ps " + std::to_string(hello.shard) +
                       "'s shard, which ps " + std::to_string(service_.task()) +
                       " does not hold (is --ps-replicas the same for every task?)";
    }
    if (!refusal.reason.empty()) {
      warn_limited("refused a connection from " + c->address + ": " + refusal.reason);
      c->closing = true;
      queue_frame(c, wire::encode(wire::Handshake{std::move(refusal)}, 0));
      return;
    }
    std::string for_now = held_elsewhere(hello);  // it may try again later
    const bool held = !for_now.empty();
    if (!held) for_now = fence_reason(service_, hello.peer);
    if (!for_now.empty()) {
      if (held) warn_limited("refused a connection from " + c->address + ": " + for_now);
      c->closing = true;
      queue_frame(c, wire::encode(wire::Handshake{wire::Refusal{ErrorCode::kUnavailable, for_now}}, 0));
      return;
    }
    if (clients_ >= options_.max_connections) {  // closed, as by a busy server: it may try again
      return drop(*c, std::to_string(options_.max_connections) +
                          " connections of the job are open (TcpServerOptions::max_connections)");
    }
    c->peer = hello.peer;
    c->incarnation = hello.incarnation;
    if (hello.shard != wire::Hello::kOwnShard && hello.shard != service_.task()) c->shard = hello.shard;
    ++clients_;
    take_over(*c);
    orphan_.cancel();
    c->reader.set_limits(options_.frames);
    wire::Frame welcome = wire::encode(
        wire::Handshake{wire::Welcome{
            wire::server_proof(options_.credentials.secret, *c->challenge, hello), server_id_}},
        0);
    // Shared memory, where the client offered it: its ring is the next byte it sends (it
    // sends nothing else before the welcome), so nothing may be left unread behind the hello.
    if ((frame.header.flags & wire::kSharedMemoryFlag) != 0 && options_.shared_memory && c->local &&
        transport_detail::kSharedRings && !c->reader.mid_frame()) {
      welcome.header.flags = wire::kSharedMemoryFlag;
      c->rings_awaited = true;
    }
    queue_frame(c, std::move(welcome));
    c->challenge.reset();
  }

  /// The welcome took the client's offer of shared memory: its ring comes with the next byte
  /// (send_fd), and this side answers with its own, or without one (no memory, or the budget
  /// cannot hold it: the connection stays on its socket, as it does when the client's ring is
  /// none). Until the answer, nothing else is read.
  void await_rings(const ConnectionPtr& c) {
#if defined(__linux__)
    c->receiving = true;
    c->socket.async_wait(asio::socket_base::wait_read, [this, c](std::error_code ec) {
      c->receiving = false;
      if (c->closed) return;
      if (ec) return forget(*c);
      int fd = -1;
      const int got = transport_detail::receive_fd(c->socket.native_handle(), fd);
      if (got == 0) return receive(c);   // (woken for nothing)
      if (got == -2) return forget(*c);  // it left (its attempt's time ran out, say)
      if (got < 0) return drop(*c, "it sent something else than the memory it offered to share");
      c->rings_awaited = false;
      c->last_heard = Clock::now();
      transport_detail::SharedRing in =
          fd >= 0 ? transport_detail::SharedRing::open(fd) : transport_detail::SharedRing{};
      // Both rings count against the budget: this process has the client's pages as it reads
      // them (a client may hand over a file with holes), and that ring may be no larger than
      // this side's.
      if (in && in.capacity() > transport_detail::kLinkRingBytes) in = {};
      transport_detail::SharedRing out;
      const std::size_t charge = in.capacity() + transport_detail::kLinkRingBytes;
      if (in && budget_.take(charge)) {
        out = transport_detail::SharedRing::make(transport_detail::kLinkRingBytes);
        if (out) {
          c->ring_charge = charge;
        } else {
          budget_.give(charge);
        }
      }
      if (!transport_detail::send_fd(c->socket.native_handle(), out ? out.fd() : -1)) {
        return drop(*c, "cannot answer its offer of shared memory");
      }
      if (in && out) c->rings.start(std::move(out), std::move(in), c->socket);
      receive(c);
    });
#else
    c->rings_awaited = false;
    receive(c);
#endif
  }

  /// Why `hello`'s process may not be its task now: another process is, with a connection
  /// heard within `takeover_after` (TcpServerOptions); or "".
  [[nodiscard]] std::string held_elsewhere(const wire::Hello& hello) const {
    if (options_.takeover_after.count() <= 0) return {};
    if (hello.incarnation == 0) return "its hello names no process (incarnation 0): one process per task";
    const auto now = Clock::now();
    for (const auto& [raw, c] : connections_) {
      if (!c->peer || c->closed || c->incarnation == 0 || c->incarnation == hello.incarnation ||
          c->peer->role != hello.peer.role || c->peer->index != hello.peer.index ||
          now - c->last_heard >= options_.takeover_after) {
        continue;
      }
      const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(now - c->last_heard).count();
      return hello.peer.name() + " is another live process's (at " + c->address + ", heard " +
             std::to_string(ago) + " ms ago): one process per task (TcpServerOptions::takeover_after)";
    }
    return {};
  }

  /// `c` is its task's process now: the silent connections of a process before it in that
  /// task (a lost host's, half open) are closed, so that one process at a time is the task.
  void take_over(const Connection& c) {
    std::vector<Connection*> older;
    for (const auto& [raw, other] : connections_) {
      if (other.get() != &c && other->peer && !other->closed && other->incarnation != c.incarnation &&
          other->peer->role == c.peer->role && other->peer->index == c.peer->index) {
        older.push_back(raw);
      }
    }
    for (Connection* other : older) {
      drop(*other, c.peer->name() + " is now the process at " + c.address + " (it took the task over)");
    }
  }

  /// The refusal of a client that proved the secret as `peer` but is not one of the job's
  /// tasks (`TcpServerOptions::tasks`); an empty reason lets it in.
  [[nodiscard]] wire::Refusal outside_job(const Node& peer) const {
    if (options_.tasks.empty()) return {};
    const auto workers = job_workers(service_);
    if (peer.role == Node::Role::kWorker && !workers.empty()) {
      if (std::binary_search(workers.begin(), workers.end(), peer.index)) return {};
      return {ErrorCode::kUnauthenticated,
              peer.name() + " is not a worker of this job now (its workers are " + describe_members(workers) +
                  "; a new worker asks the chief to join: --join)"};
    }
    const auto it = options_.tasks.find(peer.role);
    const std::uint32_t count = it == options_.tasks.end() ? 0 : it->second;
    if (peer.index < count) return {};
    // A worker beyond the spec's, where this ps knows no other workers (it has not been
    // told the job's): it may have joined while this process was not in the job (a ps
    // started again learns the workers from the chief's restore). A client this address
    // let in before takes kFailedPrecondition for a refusal for now.
    return {peer.role == Node::Role::kWorker ? ErrorCode::kFailedPrecondition : ErrorCode::kUnauthenticated,
            peer.name() + " is not a task of this job (it has " + std::to_string(count) + " " +
                Node::role_name(peer.role) + " task" + (count == 1 ? "" : "s") + ")"};
  }

  /// Queues a frame for the write at the end of the batch; a reply's views of the parameters
  /// stay valid until the next push or initialization (see `detach`).
  void queue_frame(const ConnectionPtr& c, wire::Frame&& frame) {
    if (c->closed) return;
    if (c->unsent.empty()) c->last_written = Clock::now();  // the reader's clock starts
    c->replies.push_back(std::move(frame));
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
      return maybe_resume(c);  // a pause for unsent bytes may have ended just now
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

  /// The parameters are about to change: what is unsent of `c`'s replies stops viewing
  /// them. The kernel takes what it can first; the rest is copied, charged to the budget.
  void detach(Connection& c) {
    if (c.closed || !std::exchange(c.views, false)) return;
    std::error_code ec;
    if (!c.write_waiting && !c.rings.write_now(c.unsent, c.socket, ec)) return forget(c);
    const auto n = static_cast<std::size_t>(c.unsent.bytes());
    if (c.spare_size < n) {  // the spare may hold nothing still unsent: the copy does
      c.release_spare(budget_);
      if (!budget_.take(n)) {
        return drop(c, std::to_string(n) + " bytes of its replies are unread and the ps's "
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

  /// `c`'s replies no longer view the parameters (all written, or the connection is done).
  void stop_viewing(Connection& c) {
    if (std::exchange(c.views, false)) {
      std::erase_if(viewing_, [&](const ConnectionPtr& v) { return v.get() == &c; });
    }
  }

  void drop(Connection& c, const std::string& reason) {
    warn_limited("closing connection from " + c.who() + ": " + reason);
    forget(c);
  }

  /// A connection is done: closed, its unsent replies dropped, no longer kept alive here.
  /// The service hears that this connection of its task is gone (what was taken on it, a
  /// token, comes back).
  void forget(Connection& c) {
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

  /// Closes the connections whose handshake, frame, unread replies or idleness outlasted
  /// its deadline, after the service's `tick`; runs a few times per the shortest deadline
  /// (at least once a second).
  void sweep() {
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

  /// Closes `c` if its task is fenced, or its handshake, its frame, its unread replies or
  /// its idleness outlasted their deadline.
  void expire(Connection& c, Clock::time_point now) {
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
      log(LogLevel::kInfo, "ps " + std::to_string(service_.task()) +
                               ": closing idle connection from " + c.who());
      forget(c);
    }
  }

  /// Logs a warning about a client, at most 20 a second (a flood of bad connections must
  /// not flood the log).
  void warn_limited(const std::string& line) {
    warnings_(LogLevel::kWarning, "ps " + std::to_string(service_.task()) + ": " + line);
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

  /// Stops once the service stopped, every client that proved itself has left (a
  /// connection still in its handshake keeps no ps alive) and the service awaits no worker
  /// (looked at every kAwaitedLook), then `end_grace` passed; or, while the service runs,
  /// starts waiting for one (`watch_orphan`).
  void maybe_stop() {
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

  /// Every client is gone while the service still serves: wait `orphaned_after` for one.
  void watch_orphan() {
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

  S service_;  ///< first: destroyed last, after every connection that may answer for it
  TcpServerOptions options_;
  wire::MemoryBudget budget_;  ///< before the connections, which give back to it
  asio::io_context io_{1};
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer retry_accept_;
#if defined(__linux__)
  asio::local::stream_protocol::acceptor local_acceptor_{io_};  ///< closed: no local socket
  asio::steady_timer retry_local_{io_};
#endif
  asio::steady_timer linger_{io_};
  /// How often a server whose service stopped looks whether a worker is still awaited.
  static constexpr std::chrono::milliseconds kAwaitedLook{50};
  asio::steady_timer grace_{
      io_};  ///< end_grace (or kAwaitedLook), once the service stopped and no client is left
  asio::steady_timer orphan_{io_};
  asio::steady_timer sweep_{io_};
  bool served_ = false;    ///< a request was handled: the job has started
  bool orphaned_ = false;  ///< run() returned because every client left
  bool orphan_armed_ = false;  ///< orphan_ runs
  bool accept_failing_ = false;
  bool stopping_ = false;
  bool grace_armed_ = false;    ///< grace_ runs
  bool grace_over_ = false;     ///< end_grace passed with no client: it may end
  std::uint64_t sessions_ = 0;  ///< connections accepted so far
  /// This server, as its welcomes name it (wire::Welcome::server): random, never 0.
  std::uint64_t server_id_ = [] {
    std::uint64_t id = 0;
    while (id == 0) detail::random_bytes(&id, sizeof id);
    return id;
  }();
  std::size_t clients_ = 0;     ///< open connections that completed the handshake
  LimitedLog warnings_;
  std::vector<ConnectionPtr> dirty_;    ///< connections with replies queued in this batch
  std::vector<ConnectionPtr> viewing_;  ///< connections whose unsent replies view parameters
  /// Open connections, kept alive here: one whose reading is paused has no handler pending
  /// that would hold it, while requests it made wait in the ps. Destroyed before io_.
  std::map<Connection*, ConnectionPtr> connections_;
};

}  // namespace pulley
