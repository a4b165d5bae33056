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

/// Serves one Service (a ParameterServer) on a TCP port, and owns it. All connections are
/// handled by one thread (the one that calls `run`), so the service sees its requests one
/// at a time, as in-process.
///
/// Every connection begins with the handshake (wire/handshake.hpp): until a client has
/// proved its job and the job's secret, nothing it sends reaches the service, and a frame
/// may carry only a few hundred bytes. The task it proved is the request's `peer`, so the
/// service refuses what that task's job may not send. When a task's connection closes, the
/// service hears of it (`Service::disconnected`: a token taken on it comes back).
///
/// Requests are received many at a time when they are small (a push and its pull arrive in
/// one receive), and every reply they produce leaves in one gather-write at the end of the
/// batch, straight from the ps's parameters. What the kernel does not take at once goes
/// out as the socket drains, still from the parameters, unless a request that changes them
/// (`changes_parameters`: a push, an initialization) comes first: then the rest is copied,
/// so a reply never sees the parameters change under it.
///
/// A client cannot make the ps use memory or time without bound: a frame that fails
/// wire::check, does not decode, claims more tensor bytes than the service holds, or would
/// overdraw `max_buffered_bytes` closes that connection with a logged reason, as do a
/// handshake, a frame or an idleness that outlasts its deadline; a connection whose peer
/// does not read its replies stops being read once `max_unsent_bytes` of them wait, and so
/// does one with `max_unanswered_requests` requests waiting in the service. Nothing a
/// client does ends the server: every other connection is served on. Once the service
/// stopped (shut down by the chief, or failed), `run` returns when every client has left,
/// or after `linger`.
///
/// @tparam S the Service it serves
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

  // Accepting connections, and the handshake (impl/tcp_server_accept.hpp).

  /// Listens on the local socket of this TCP address and port too, unless its name is taken
  /// (logged: TCP then serves alone).
  void listen_locally();

  void accept();

#if defined(__linux__)
  /// Accepts on the local socket, as accept_tcp on the port; the peer is named by its pid.
  void accept_local();
#endif

  void accept_tcp();

  /// A new connection: challenged, and read. At the limit of connections in the handshake
  /// the oldest of them is closed to make room (a task of the job answers the challenge in
  /// a round trip; a connection that has not yet is the likelier stranger); a connection
  /// the memory budget cannot hold is refused.
  void admit(transport_detail::StreamSocket socket, std::string address, bool local);

  /// The client's answer to the challenge: let it in, or refuse it with one log line.
  void on_hello(const ConnectionPtr& c, const wire::FrameReader::Frame& frame);

  /// The welcome took the client's offer of shared memory: its ring comes with the next byte
  /// (send_fd), and this side answers with its own, or without one (no memory, or the budget
  /// cannot hold it: the connection stays on its socket, as it does when the client's ring is
  /// none). Until the answer, nothing else is read.
  void await_rings(const ConnectionPtr& c);

  /// Why `hello`'s process may not be its task now: another process is, with a connection
  /// heard within `takeover_after` (TcpServerOptions); or "".
  [[nodiscard]] std::string held_elsewhere(const wire::Hello& hello) const;

  /// `c` is its task's process now: the silent connections of a process before it in that
  /// task (a lost host's, half open) are closed, so that one process at a time is the task.
  void take_over(const Connection& c);

  /// The refusal of a client that proved the secret as `peer` but is not one of the job's
  /// tasks (`TcpServerOptions::tasks`); an empty reason lets it in.
  [[nodiscard]] wire::Refusal outside_job(const Node& peer) const;

  // Requests read and handed to the service, replies written (impl/tcp_server_frames.hpp).

  /// Arms one receive into the connection's reader, unless one is armed or it is paused.
  void receive(const ConnectionPtr& c);

  /// Handles every complete request received (while not paused), writes the replies they
  /// produced, and reads on.
  void process(const ConnectionPtr& c);

  /// Starts or ends the deadline of a frame half received.
  void time_frame(Connection& c);

  void dispatch(const ConnectionPtr& c, const wire::FrameReader::Frame& frame);

  /// Queues a frame for the write at the end of the batch; a reply's views of the parameters
  /// stay valid until the next push or initialization (see `detach`).
  void queue_frame(const ConnectionPtr& c, wire::Frame&& frame);

  /// Reading was paused and need not be any longer: resume, after the current handler (the
  /// ps may be in the middle of a request).
  void maybe_resume(const ConnectionPtr& c);

  void flush_all();

  /// Writes what the socket takes now, straight from the replies (their headers, metadata
  /// and the parameters they view), and waits for it to take the rest.
  void write(const ConnectionPtr& c);

  // Deadlines, closing connections, and stopping (impl/tcp_server_lifetime.hpp).

  /// The parameters are about to change: what is unsent of `c`'s replies stops viewing
  /// them. The kernel takes what it can first; the rest is copied, charged to the budget.
  void detach(Connection& c);

  /// `c`'s replies no longer view the parameters (all written, or the connection is done).
  void stop_viewing(Connection& c);

  void drop(Connection& c, const std::string& reason);

  /// A connection is done: closed, its unsent replies dropped, no longer kept alive here.
  /// The service hears that this connection of its task is gone (what was taken on it, a
  /// token, comes back).
  void forget(Connection& c);

  /// Closes the connections whose handshake, frame, unread replies or idleness outlasted
  /// its deadline, after the service's `tick`; runs a few times per the shortest deadline
  /// (at least once a second).
  void sweep();

  /// Closes `c` if its task is fenced, or its handshake, its frame, its unread replies or
  /// its idleness outlasted their deadline.
  void expire(Connection& c, Clock::time_point now);

  /// Logs a warning about a client, at most 20 a second (a flood of bad connections must
  /// not flood the log).
  void warn_limited(const std::string& line);

  /// The service stopped: go on answering until every client has left, or `linger` passed.
  void begin_stopping();

  /// Stops once the service stopped, every client that proved itself has left (a
  /// connection still in its handshake keeps no ps alive) and the service awaits no worker
  /// (looked at every kAwaitedLook), then `end_grace` passed; or, while the service runs,
  /// starts waiting for one (`watch_orphan`).
  void maybe_stop();

  /// Every client is gone while the service still serves: wait `orphaned_after` for one.
  void watch_orphan();

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
  /// How long a server whose service stopped to start again (Service's `restarts`) still
  /// serves clients left connected.
  static constexpr std::chrono::milliseconds kRestartLinger{1000};
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

// The member functions' definitions, by concern.
#include "pulley/transport/impl/tcp_server_accept.hpp"
#include "pulley/transport/impl/tcp_server_frames.hpp"
#include "pulley/transport/impl/tcp_server_lifetime.hpp"
