// SPDX-License-Identifier: MIT
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/concepts/ring.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/spin.hpp"
#include "pulley/transport/detail/handshake_io.hpp"
#include "pulley/transport/detail/shared_ring.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// How a TcpRing forms and when it gives a neighbour up.
struct TcpRingOptions {
  /// How long the ring may take to form: every rank listening, connected to the next and
  /// proven to it. Ranks may start in any order within it.
  std::chrono::milliseconds form_timeout = std::chrono::seconds(120);
  /// A neighbour that makes no progress this long (sends nothing this rank waits for, or
  /// takes nothing it sends) is lost: kDeadlineExceeded. It covers whatever a rank does
  /// between two calls too (a chief's evaluation on rank 0): the others wait for it.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  /// Form a ring whose credentials hold no secret (the handshake then proves nothing): for
  /// addresses only trusted peers reach. Without it, an empty secret is refused.
  bool allow_no_secret = false;
  /// Link ranks on one host through local sockets (Linux: a Unix-domain socket with the
  /// abstract name of the rank's address, `transport_detail::ring_socket_name`) rather than
  /// TCP loopback: the same handshake and frames, at a fraction of TCP's cost per byte. A
  /// rank also listens there, and connects there to a next rank whose address is its
  /// host's, TCP when none listens there for a second. Off: TCP always
  /// (`--no-local-sockets`).
  bool local_sockets = true;
  /// Over a local socket, move the bytes through memory both ranks share (Linux: a
  /// memory file handed over the socket, transport_detail::SharedRing): one copy at each
  /// end and no system call while neither waits; the socket stays the doorbell and the
  /// sign of a lost neighbour. Off: the bytes go through the socket. (A rank whose next
  /// rank died finds out when its ring to it is full, 4 MiB on, or when the loss comes
  /// round the ring, rather than at its next write.)
  bool shared_memory = true;
};

namespace transport_detail {
/// The abstract local socket name of the ring rank at `address` ("\0pulley-ring/host:port",
/// as the ring's view spells the address): unlike a ps's, it is named by the address as
/// written, since both ends read it from the same view.
inline std::string ring_socket_name(const std::string& address) {
  return std::string(1, '\0') + "pulley-ring/" + address;
}

/// A local socket listening under `name`, non-blocking; none where local sockets are not
/// (not Linux) or the name is held (another ring of this process, say).
inline std::optional<asio::local::stream_protocol::acceptor> listen_locally(asio::io_context& io,
                                                                            const std::string& name) {
#if defined(__linux__)
  asio::local::stream_protocol::acceptor acceptor(io);
  const asio::local::stream_protocol::endpoint endpoint(name);
  std::error_code ec;
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) acceptor.non_blocking(true, ec);
  if (ec) return std::nullopt;
  return acceptor;
#else
  (void)io, (void)name;
  return std::nullopt;
#endif
}
}  // namespace transport_detail

namespace transport_detail {
/// Refuses credentials a ring must not form with: malformed ones, or no secret unless
/// `options.allow_no_secret` (kInvalidArgument).
inline void check_ring_credentials(const Credentials& credentials, const TcpRingOptions& options) {
  wire::check_credentials(credentials);
  if (credentials.secret.empty() && !options.allow_no_secret) {
    throw Error(ErrorCode::kInvalidArgument,
                "ring: no shared secret is set, so anyone who knows the job's name ('" + credentials.job +
                    "') could join the ring: set the job's secret (README, Security), or "
                    "TcpRingOptions::allow_no_secret for addresses only trusted peers reach");
  }
}
}  // namespace transport_detail

/// A Ring of worker processes over TCP: each rank listens on its own address, connects to
/// the next rank's, and accepts the previous rank's connection. Both connections open with
/// the handshake every pulley connection makes (wire/handshake.hpp): the connecting rank
/// proves the job's name and secret and its rank (a Hello for a ring link,
/// `wire::Hello::kRingLink`), the listening rank proves them back, and anything else that
/// connects is refused with one logged line and does not hold the ring up.
///
/// One thread per rank does everything: the sockets are non-blocking, and while the rank
/// waits to receive, what it queued for the next rank is written as the kernel takes it, so
/// a rank sends and receives at once (Ring's contract) without a thread of its own.
class TcpRing {
 public:
  /// Forms the ring: `addresses` are every rank's "host:port" in rank order (the same list
  /// on every rank), and this rank listens on `addresses[rank]`. Blocks until both
  /// neighbours are connected and proven, or throws: kInvalidArgument (a bad address),
  /// kUnavailable (cannot listen), kDeadlineExceeded (not formed within form_timeout),
  /// kUnauthenticated (the next rank refused this one's proof, or could not prove its own).
  TcpRing(std::size_t rank, const std::vector<std::string>& addresses, Credentials credentials,
          TcpRingOptions options = {})
      : TcpRing(rank, addresses, credentials, options, nullptr, nullptr, {}) {}

  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  void send(std::span<const std::byte> bytes) {
    usable();
    if (bytes.empty()) return;
    links_->out.push_back(bytes);
    guarded([&] { write_now(); });
  }

  void receive(std::span<std::byte> bytes) {
    usable();
    guarded([&] { receive_now(bytes); });
  }

  void flush() {
    usable();
    guarded([&] { flush_now(); });
  }

  /// Bytes written to the next rank (handshake excluded).
  [[nodiscard]] std::uint64_t bytes_written() const noexcept { return links_->written; }
  /// True if both of this rank's links are local sockets (TcpRingOptions::local_sockets).
  [[nodiscard]] bool local() const noexcept { return links_->next_local && links_->previous_local; }
  /// True if both of this rank's links move their bytes through shared memory
  /// (TcpRingOptions::shared_memory).
  [[nodiscard]] bool shared() const noexcept { return links_->to_next && links_->from_previous; }
  /// True if the link to the next rank moves its bytes through shared memory.
  [[nodiscard]] bool shares_with_next() const noexcept { return static_cast<bool>(links_->to_next); }

 private:
  using Clock = std::chrono::steady_clock;
  friend class TcpRingRendezvous;

  /// Forms the ring on `listening` and `listening_locally` when given (where this process
  /// keeps listening across rings: TcpRingRendezvous's; `listening_locally` may be null:
  /// no local socket), else on acceptors of its own. `incarnations`, when given, are the
  /// processes (wire::incarnation()) the ranks must be: a link from or to another process,
  /// one left over from an older ring say, is refused.
  TcpRing(std::size_t rank, const std::vector<std::string>& addresses, const Credentials& credentials,
          TcpRingOptions options, asio::ip::tcp::acceptor* listening,
          asio::local::stream_protocol::acceptor* listening_locally, std::vector<std::uint64_t> incarnations)
      : links_(std::make_unique<Links>()),
        rank_(rank),
        size_(addresses.size()),
        options_(options),
        incarnations_(std::move(incarnations)) {
    if (addresses.empty() || rank >= addresses.size() || (!incarnations_.empty() && incarnations_.size() != size_)) {
      throw Error(ErrorCode::kInvalidArgument, "ring: rank " + std::to_string(rank) + " of a ring of " +
                                                   std::to_string(addresses.size()) + " addresses");
    }
    transport_detail::check_ring_credentials(credentials, options);
    if (size_ == 1) return;
    std::vector<Address> parsed;
    for (const std::string& a : addresses) parsed.push_back(parse_address(a));
    links_->next_name = "rank " + std::to_string(next()) + " at " + addresses[next()];
    links_->previous_name = "rank " + std::to_string(previous());
    links_->next_local_name = transport_detail::ring_socket_name(addresses[next()]);
    std::optional<asio::local::stream_protocol::acceptor> own_local;
    if (listening == nullptr && options_.local_sockets) {
      own_local = transport_detail::listen_locally(links_->io, transport_detail::ring_socket_name(addresses[rank_]));
      if (own_local) listening_locally = &*own_local;
    }
    form(parsed, credentials, listening, options_.local_sockets ? listening_locally : nullptr);
  }

  /// Runs `body`; if it throws, the link is broken for good first: its queue (views of the
  /// caller's memory, which unwinding may free) is dropped and its sockets closed, so that
  /// no later call writes stale bytes into a stream the neighbours can no longer follow.
  template <class Body>
  void guarded(Body body) {
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

  void usable() const {
    if (links_->broken) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "ring: rank " + std::to_string(rank_) + "'s link failed before: form the ring again");
    }
  }

  void receive_now(std::span<std::byte> bytes) {
    auto last = Clock::now();
    while (!bytes.empty()) {
      if (links_->from_previous) {
        if (const std::size_t n = links_->from_previous.read(bytes, links_->previous.native_handle())) {
          bytes = bytes.subspan(n);
          last = Clock::now();
          continue;
        }
      } else {
        std::error_code ec;
        const std::size_t n = links_->previous.read_some(asio::buffer(bytes.data(), bytes.size()), ec);
        if (!ec) {
          bytes = bytes.subspan(n);
          last = Clock::now();
          continue;
        }
        if (ec != asio::error::would_block && ec != asio::error::try_again) {
          throw lost(links_->previous_name, ec == asio::error::eof ? "closed the connection" : ec.message());
        }
      }
      if (!links_->out.empty() && write_now()) continue;
      if (!wait(true, last)) throw silent(links_->previous_name, "send");
    }
  }

  void flush_now() {
    auto last = Clock::now();
    while (!links_->out.empty()) {
      if (write_now()) {
        last = Clock::now();
        continue;
      }
      if (!wait(false, last)) throw silent(links_->next_name, "receive");
    }
  }

  /// Waits until the previous rank may have sent more (`reading`) or the next may have room
  /// for what is queued, for up to a second; false once nothing has moved since `last` for
  /// the timeout. A shared link's doorbells are read here, and its closed socket is a lost
  /// neighbour once its ring holds nothing more to read (or, towards the next rank, at once).
  bool wait(bool reading, Clock::time_point last) {
    const bool writing = !links_->out.empty();
    if (looked_again(reading, writing)) return true;
    if (reading && links_->from_previous && !links_->from_previous.reader_sleeps()) return true;
    if (writing && links_->to_next && !links_->to_next.writer_sleeps()) return true;
    if (reading && links_->from_previous && links_->previous_closed) {
      throw lost(links_->previous_name, "closed the connection");
    }
    std::array<pollfd, 2> fds{pollfd{links_->previous.native_handle(), POLLIN, 0},
                              pollfd{links_->next.native_handle(), links_->to_next ? short{POLLIN} : short{POLLOUT}, 0}};
    if (!reading) fds[0].fd = -1;
    if (!writing) fds[1].fd = -1;
    if (::poll(fds.data(), fds.size(), wait_ms(last)) == 0) return Clock::now() - last < options_.timeout;
    if (links_->from_previous && fds[0].revents != 0 && !ring_off(links_->previous)) links_->previous_closed = true;
    if (links_->to_next && fds[1].revents != 0 && !ring_off(links_->next)) {
      throw lost(links_->next_name, "closed the connection");
    }
    return Clock::now() - last < options_.timeout;  // (a neighbour that rings and moves nothing is silent)
  }

  /// While every wait is on a shared link: looks again for up to spin_before_sleep()
  /// (spin_until), and is true as soon as one can move (before `wait` says it sleeps).
  bool looked_again(bool reading, bool writing) {
    if ((reading && !links_->from_previous) || (writing && !links_->to_next)) return false;
    return spin_until(
        [&] {
          return (reading && links_->from_previous.has_data()) ||
                 (writing && links_->to_next.has_room());
        },
        Clock::now() + spin_before_sleep());
  }

  /// Reads the doorbells waiting on a shared link's socket; false once it is closed.
  static bool ring_off(transport_detail::StreamSocket& socket) {
    std::array<std::byte, 64> bells;
    while (true) {
      std::error_code ec;
      const std::size_t n = socket.read_some(asio::buffer(bells), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) return true;
      if (ec || n == 0) return false;
    }
  }

  struct Links {
    asio::io_context io;
    transport_detail::StreamSocket next{io};
    transport_detail::StreamSocket previous{io};
    bool next_local = false;      ///< `next` is a local socket
    bool previous_local = false;  ///< `previous` is a local socket
    transport_detail::SharedRing to_next;        ///< the bytes for the next rank, when shared
    transport_detail::SharedRing from_previous;  ///< the previous rank's bytes, when shared
    bool previous_closed = false;  ///< a shared `previous` link's socket closed (its ring may hold more)
    std::deque<std::span<const std::byte>> out;  ///< queued for the next rank, in order
    std::string next_name, previous_name;
    std::string next_local_name;  ///< the next rank's local socket name
    std::uint64_t written = 0;
    bool broken = false;  ///< a call failed: the link is unusable
  };

  [[nodiscard]] std::size_t next() const noexcept { return (rank_ + 1) % size_; }
  [[nodiscard]] std::size_t previous() const noexcept { return (rank_ + size_ - 1) % size_; }

  /// Writes what the kernel (or the shared ring) takes now; true if it took anything.
  bool write_now() {
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

  [[nodiscard]] int wait_ms(Clock::time_point last) const {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(last + options_.timeout - Clock::now());
    return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1000));
  }

  [[nodiscard]] Error lost(const std::string& who, const std::string& why) const {
    return Error(ErrorCode::kUnavailable, "ring: rank " + std::to_string(rank_) + " lost " + who + ": " + why);
  }
  [[nodiscard]] Error silent(const std::string& who, const char* what) const {
    return Error(ErrorCode::kDeadlineExceeded, "ring: rank " + std::to_string(rank_) + " waited " +
                                                   std::to_string(options_.timeout.count()) + " ms for " + who +
                                                   " to " + what + " (stopped, or cut off?)");
  }

  // ---- forming the ring ----------------------------------------------------------------

  /// Listens, connects to the next rank, accepts the previous one, and proves both links.
  /// The order is free of waits in a cycle: every rank sends its challenge before it
  /// reads anything, answers the next rank's challenge before it checks the previous rank's
  /// hello, and checks that before it reads the next rank's welcome.
  void form(const std::vector<Address>& addresses, const Credentials& credentials, asio::ip::tcp::acceptor* listening,
            asio::local::stream_protocol::acceptor* listening_locally) {
    const auto deadline = Clock::now() + options_.form_timeout;
    auto& io = links_->io;
    std::optional<asio::ip::tcp::acceptor> own;
    if (listening == nullptr) {
      own.emplace(transport_detail::listen(
          io, transport_detail::resolve_listen_endpoint(io, addresses[rank_].host, addresses[rank_].port)));
      own->non_blocking(true);
      listening = &*own;
    }
    asio::ip::tcp::acceptor& acceptor = *listening;
    connect_next(addresses[next()], deadline);
    const Node self = Node::worker(static_cast<std::uint32_t>(rank_));
    const Node expected = Node::worker(static_cast<std::uint32_t>(previous()));
    while (true) {
      accept_previous(acceptor, listening_locally, credentials, deadline);
      const auto until = std::min(deadline, Clock::now() + std::chrono::seconds(10));
      const wire::Challenge challenge{credentials.job, static_cast<std::uint32_t>(rank_), wire::make_nonce()};
      // Whatever goes wrong on an accepted connection (a stranger that hangs up, stalls or
      // speaks another protocol) drops it, and the next one is accepted; the next rank's
      // link is another matter: its failures end the forming.
      const auto drop = [&](const char* what) {
        log(LogLevel::kWarning, "ring: rank " + std::to_string(rank_) + " dropped a connection: " + what);
        std::error_code ignored;
        links_->previous.close(ignored);
      };
      try {
        write_frame(links_->previous, wire::encode(wire::Handshake{challenge}, 0), until);
      } catch (const std::exception& e) {
        if (Clock::now() >= deadline) throw;
        drop(e.what());
        continue;
      }
      if (!answered_) answer_next(credentials, self, deadline);
      try {
        const auto hello = read_handshake<wire::Hello>(links_->previous, until);
        std::string refusal = wire::refusal_reason(credentials, challenge, hello);
        ErrorCode code = ErrorCode::kUnauthenticated;
        if (refusal.empty() && hello.shard == wire::Hello::kRingRendezvous) {
          // A worker checking in (TcpRingRendezvous) while this one forms: it asks again.
          refusal = "rank " + std::to_string(rank_) + " is forming a ring: check in again";
          code = ErrorCode::kUnavailable;
        } else if (refusal.empty() && (hello.shard != wire::Hello::kRingLink || !(hello.peer == expected))) {
          refusal = hello.peer.name() + " is not " + expected.name() + " of the ring";
        } else if (refusal.empty() && !incarnations_.empty() && hello.incarnation != incarnations_[previous()]) {
          // A worker of the job that forms another ring (an older view): it regroups.
          refusal = "the process that claims " + expected.name() + " is not the ring's (one of an older ring?)";
          code = ErrorCode::kUnavailable;
        }
        if (!refusal.empty()) {
          if (code == ErrorCode::kUnauthenticated) {
            log(LogLevel::kWarning, "ring: rank " + std::to_string(rank_) + " refused a connection: " + refusal);
          }
          try {
            write_frame(links_->previous, wire::encode(wire::Handshake{wire::Refusal{code, refusal}}, 0), until);
          } catch (const Error&) {  // it hung up first
          }
          std::error_code ignored;
          links_->previous.close(ignored);
          continue;
        }
        write_frame(links_->previous,
                    wire::encode(wire::Handshake{wire::Welcome{
                                     wire::server_proof(credentials.secret, challenge, hello), wire::incarnation()}},
                                 0),
                    until);
        break;
      } catch (const std::exception& e) {
        if (Clock::now() >= deadline) throw;
        drop(e.what());
      }
    }
    if (!welcomed_) check_welcome(credentials, deadline);
    std::error_code ignored;  // (TCP's option; a local socket has no delay to turn off)
    if (!links_->next_local) links_->next.set_option(asio::ip::tcp::no_delay(true), ignored);
    if (!links_->previous_local) links_->previous.set_option(asio::ip::tcp::no_delay(true), ignored);
    if (links_->next_local) transport_detail::widen_local_buffers(links_->next);
    if (links_->previous_local) transport_detail::widen_local_buffers(links_->previous);
    if (transport_detail::kSharedRings) share_memory(deadline);
  }

  /// Moves the local links' bytes into shared memory (TcpRingOptions::shared_memory): each
  /// rank offers the next a ring it made (or says it has none: the option is off, or no
  /// memory), takes the previous rank's offer and says whether it mapped it, then hears the
  /// next rank's answer. Every local link makes this exchange, whatever the option, so ranks
  /// set apart share nothing and still agree. Every rank offers before it waits, so no wait
  /// is in a cycle. A link that does not share goes on through its socket.
  void share_memory(Clock::time_point deadline) {
#if defined(__linux__)
    transport_detail::SharedRing offered;
    if (links_->next_local) {
      if (options_.shared_memory) offered = transport_detail::SharedRing::make();
      if (!transport_detail::send_fd(links_->next.native_handle(), offered ? offered.fd() : -1)) {
        throw lost(links_->next_name, "could not offer it shared memory");
      }
    }
    if (links_->previous_local) {
      int fd = -1;
      int got = 0;
      while ((got = transport_detail::receive_fd(links_->previous.native_handle(), fd)) == 0) {
        await(links_->previous, deadline, links_->previous_name);
      }
      if (got < 0) throw lost(links_->previous_name, "closed the connection before sharing memory");
      if (fd >= 0 && options_.shared_memory) {
        links_->from_previous = transport_detail::SharedRing::open(fd);
      } else if (fd >= 0) {
        ::close(fd);
      }
      const std::array<std::byte, 1> answer{links_->from_previous ? std::byte{'Y'} : std::byte{'N'}};
      write_frame_bytes(links_->previous, answer, deadline);
    }
    if (links_->next_local) {
      std::array<std::byte, 1> answer{};
      read_bytes(links_->next, answer, deadline, links_->next_name);
      if (answer[0] == std::byte{'Y'} && offered) links_->to_next = std::move(offered);
    }
#else
    (void)deadline;
#endif
  }

  /// Waits until `socket` has something to read, or throws once `deadline` has passed.
  void await(transport_detail::StreamSocket& socket, Clock::time_point deadline, const std::string& who) const {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      throw Error(ErrorCode::kDeadlineExceeded, "ring: rank " + std::to_string(rank_) + ": " + who +
                                                    " did not finish forming the ring in time");
    }
    pollfd fd{socket.native_handle(), POLLIN, 0};
    ::poll(&fd, 1, static_cast<int>(std::min<std::int64_t>(left, 1000)));
  }

  /// Reads exactly `bytes` from `socket` (non-blocking) by `deadline`.
  void read_bytes(transport_detail::StreamSocket& socket, std::span<std::byte> bytes, Clock::time_point deadline,
                  const std::string& who) const {
    while (!bytes.empty()) {
      std::error_code ec;
      const std::size_t n = socket.read_some(asio::buffer(bytes.data(), bytes.size()), ec);
      if (!ec) {
        bytes = bytes.subspan(n);
        continue;
      }
      if (ec != asio::error::would_block && ec != asio::error::try_again) {
        throw lost(who, ec == asio::error::eof ? "closed the connection" : ec.message());
      }
      await(socket, deadline, who);
    }
  }

  /// Writes `bytes` whole to `socket` (a few bytes into an empty socket buffer: at once).
  void write_frame_bytes(transport_detail::StreamSocket& socket, std::span<const std::byte> bytes,
                         Clock::time_point deadline) const {
    while (!bytes.empty()) {
      std::error_code ec;
      const std::size_t n = socket.write_some(asio::buffer(bytes.data(), bytes.size()), ec);
      if (!ec) {
        bytes = bytes.subspan(n);
        continue;
      }
      if ((ec != asio::error::would_block && ec != asio::error::try_again) || Clock::now() >= deadline) {
        throw lost(links_->previous_name, ec.message());
      }
      pollfd fd{socket.native_handle(), POLLOUT, 0};
      ::poll(&fd, 1, 100);
    }
  }

  /// Connects to the next rank, trying again every 100 ms until it listens: at its local
  /// socket first when its address is this host's, else (or when none listens) over TCP.
  void connect_next(const Address& where, Clock::time_point deadline) {
    std::error_code ec;
    const auto endpoints = transport_detail::resolve_by(where.host, where.port, deadline, ec);
    if (ec == std::errc::timed_out) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "ring: " + where.to_string() + " did not resolve in time");
    }
    if (ec || endpoints.empty()) {
      throw Error(ErrorCode::kInvalidArgument, "ring: cannot resolve " + where.to_string() + ": " +
                                                   (ec ? ec.message() : std::string("no address")));
    }
    const asio::generic::stream_protocol::endpoint endpoint(endpoints.begin()->endpoint());
    const bool local = options_.local_sockets && transport_detail::kLocalSockets &&
                       transport_detail::is_this_hosts(endpoints.begin()->endpoint().address());
    std::string why = "no attempt";
    // A rank binds its local socket before its TCP port, but may bind both between this
    // rank's local attempt and its TCP one: TCP is tried only once the local socket has
    // refused for a second (a next rank that does not listen there, with local_sockets off).
    const auto tcp_after = Clock::now() + std::chrono::seconds(1);
    while (Clock::now() < deadline) {
      auto& socket = links_->next;
      if (socket.is_open()) socket.close();
#if defined(__linux__)
      if (local) {  // a local connection is taken or refused at once
        const asio::generic::stream_protocol::endpoint named{asio::local::stream_protocol::endpoint(links_->next_local_name)};
        if (!transport_detail::connect_within(socket, named, std::min(deadline, Clock::now() + std::chrono::seconds(1)))) {
          links_->next_local = true;
          return;
        }
        socket.close(ec);
        why = "its local socket refused";
      }
#endif
      if (!local || Clock::now() >= tcp_after) {
        links_->next_local = false;
        ec = transport_detail::connect_within(socket, endpoint, std::min(deadline, Clock::now() + std::chrono::seconds(1)));
        if (!ec) return;
        why = ec.message();
      }
      pollfd none{-1, 0, 0};
      ::poll(&none, 0, 100);
    }
    throw Error(ErrorCode::kDeadlineExceeded, "ring: rank " + std::to_string(rank_) + " could not connect to " +
                                                  links_->next_name + " within " +
                                                  std::to_string(options_.form_timeout.count()) + " ms: " + why);
  }

  /// Accepts a connection for the previous rank, on the TCP port or the local socket.
  /// Meanwhile the next rank's challenge is answered and its answer read if they come: a
  /// refusal fails at once, naming the reason, instead of waiting for a previous rank that
  /// may never connect (or was refused itself).
  void accept_previous(asio::ip::tcp::acceptor& acceptor, asio::local::stream_protocol::acceptor* locally,
                       const Credentials& credentials, Clock::time_point deadline) {
    while (true) {
      std::error_code ec;
      if (locally != nullptr) {
        asio::local::stream_protocol::socket accepted(links_->io);
        locally->accept(accepted, ec);
        if (!ec) {
          links_->previous = transport_detail::StreamSocket(std::move(accepted));
          links_->previous.non_blocking(true);
          links_->previous_local = true;
          return;
        }
      }
      asio::ip::tcp::socket accepted(links_->io);
      acceptor.accept(accepted, ec);
      if (!ec) {
        links_->previous = transport_detail::StreamSocket(std::move(accepted));
        links_->previous.non_blocking(true);
        links_->previous_local = false;
        return;
      }
      if (ec != asio::error::would_block && ec != asio::error::try_again) {
        throw Error(ErrorCode::kUnavailable, "ring: rank " + std::to_string(rank_) + " cannot accept: " + ec.message());
      }
      if (Clock::now() >= deadline) {
        throw Error(ErrorCode::kDeadlineExceeded,
                    "ring: rank " + std::to_string(rank_) + ": " + links_->previous_name + " did not connect within " +
                        std::to_string(options_.form_timeout.count()) + " ms");
      }
      std::array<pollfd, 3> fds{pollfd{acceptor.native_handle(), POLLIN, 0},
                                pollfd{links_->next.native_handle(), welcomed_ ? short{0} : short{POLLIN}, 0},
                                pollfd{locally != nullptr ? locally->native_handle() : -1, POLLIN, 0}};
      ::poll(fds.data(), fds.size(), 100);
      if (!welcomed_ && fds[1].revents != 0) {
        if (answered_) {
          check_welcome(credentials, deadline);
        } else {
          answer_next(credentials, Node::worker(static_cast<std::uint32_t>(rank_)), deadline);
        }
      }
    }
  }

  /// Reads the next rank's challenge and sends this rank's hello.
  void answer_next(const Credentials& credentials, const Node& self, Clock::time_point deadline) {
    challenge_ = from_next([&] { return read_handshake<wire::Challenge>(links_->next, deadline); });
    if (challenge_.job != credentials.job || challenge_.ps != next()) {
      throw Error(ErrorCode::kUnauthenticated, "ring: " + links_->next_name + " answered as rank " +
                                                   std::to_string(challenge_.ps) + " of job '" +
                                                   challenge_.job.substr(0, wire::kMaxJobName) + "'");
    }
    said_ = wire::hello_for(credentials, challenge_, self, wire::Hello::kRingLink);
    write_frame(links_->next, wire::encode(wire::Handshake{said_}, 0), deadline);
    answered_ = true;
  }

  /// Reads the next rank's welcome (or refusal) and checks its proof.
  void check_welcome(const Credentials& credentials, Clock::time_point deadline) {
    wire::Handshake message = from_next([&] {
      const auto bytes = read_frame(links_->next, deadline);
      return wire::decode_handshake(bytes.first, bytes.second);
    });
    if (auto* refusal = std::get_if<wire::Refusal>(&message)) {
      // kUnavailable: the next rank forms another ring now (this one's view is stale).
      throw Error(refusal->code == ErrorCode::kUnavailable ? ErrorCode::kUnavailable : ErrorCode::kUnauthenticated,
                  "ring: " + links_->next_name + " refused rank " + std::to_string(rank_) + ": " + refusal->reason);
    }
    const auto* welcome = std::get_if<wire::Welcome>(&message);
    if (welcome == nullptr || !wire::welcome_proves(credentials, challenge_, said_, *welcome)) {
      throw Error(ErrorCode::kUnauthenticated,
                  "ring: " + links_->next_name + " did not prove the job's shared secret (a wrong PULLEY_SECRET?)");
    }
    if (!incarnations_.empty() && welcome->server != incarnations_[next()]) {
      throw Error(ErrorCode::kUnavailable, "ring: " + links_->next_name + " is another process than the ring's");
    }
    welcomed_ = true;
  }

  /// What `read` reads from the next rank; a frame that is no handshake of this protocol
  /// fails with kUnavailable naming it (something else listens at its address).
  template <class Read>
  std::invoke_result_t<Read&> from_next(Read read) {
    try {
      return read();
    } catch (const wire::Malformed& e) {
      throw Error(ErrorCode::kUnavailable, "ring: " + links_->next_name + " is not a pulley ring rank: " + e.what());
    }
  }

  [[nodiscard]] std::string who() const { return "ring: rank " + std::to_string(rank_); }

  void write_frame(transport_detail::StreamSocket& socket, const wire::Frame& frame, Clock::time_point deadline) {
    transport_detail::write_frame_by(socket, frame, deadline, who());
  }
  std::pair<wire::Header, std::string> read_frame(transport_detail::StreamSocket& socket, Clock::time_point deadline) {
    return transport_detail::read_frame_by(socket, deadline, who());
  }
  template <class Expected>
  Expected read_handshake(transport_detail::StreamSocket& socket, Clock::time_point deadline) {
    return transport_detail::read_handshake_by<Expected>(socket, deadline, who());
  }

  std::unique_ptr<Links> links_;  ///< behind a pointer: the ring moves, its sockets do not
  std::size_t rank_ = 0;
  std::size_t size_ = 1;
  TcpRingOptions options_;
  std::vector<std::uint64_t> incarnations_;  ///< each rank's process, when the ring knows them
  wire::Challenge challenge_;  ///< the next rank's
  wire::Hello said_;           ///< this rank's hello to the next
  bool answered_ = false;  ///< this rank's hello went to the next
  bool welcomed_ = false;  ///< and the next let it in
};

static_assert(Ring<TcpRing>);

}  // namespace pulley
