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
#include <exception>
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
  TcpRing(std::size_t rank, const std::vector<std::string>& addresses,
          const Credentials& credentials, TcpRingOptions options,
          asio::ip::tcp::acceptor* listening,
          asio::local::stream_protocol::acceptor* listening_locally,
          std::vector<std::uint64_t> incarnations);

  // Bytes sent and received, the waits on the neighbours, and failures
  // (impl/tcp_ring_transfer.hpp).

  /// Runs `body`; if it throws, the link is broken for good first: its queue (views of the
  /// caller's memory, which unwinding may free) is dropped and its sockets closed, so that
  /// no later call writes stale bytes into a stream the neighbours can no longer follow.
  template <class Body>
  void guarded(Body body);

  void usable() const;

  void receive_now(std::span<std::byte> bytes);

  void flush_now();

  /// Waits until the previous rank may have sent more (`reading`) or the next may have room
  /// for what is queued, for up to a second; false once nothing has moved since `last` for
  /// the timeout. A shared link's doorbells are read here, and its closed socket is a lost
  /// neighbour once its ring holds nothing more to read (or, towards the next rank, at once).
  bool wait(bool reading, Clock::time_point last);

  /// While every wait is on a shared link: looks again for up to spin_before_sleep()
  /// (spin_until), and is true as soon as one can move (before `wait` says it sleeps).
  bool looked_again(bool reading, bool writing);

  /// Reads the doorbells waiting on a shared link's socket; false once it is closed.
  static bool ring_off(transport_detail::StreamSocket& socket);

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
  bool write_now();

  [[nodiscard]] int wait_ms(Clock::time_point last) const;

  [[nodiscard]] Error lost(const std::string& who, const std::string& why) const;
  [[nodiscard]] Error silent(const std::string& who, const char* what) const;

  // Forming the ring: the previous rank's hello checked, memory shared, and forming's reads
  // and writes by a deadline (impl/tcp_ring_form.hpp, with the private constructor above).

  /// Listens, connects to the next rank, accepts the previous one, and proves both links.
  /// The order is free of waits in a cycle: every rank sends its challenge before it
  /// reads anything, answers the next rank's challenge before it checks the previous rank's
  /// hello, and checks that before it reads the next rank's welcome.
  void form(const std::vector<Address>& addresses, const Credentials& credentials,
            asio::ip::tcp::acceptor* listening,
            asio::local::stream_protocol::acceptor* listening_locally);

  /// Moves the local links' bytes into shared memory (TcpRingOptions::shared_memory): each
  /// rank offers the next a ring it made (or says it has none: the option is off, or no
  /// memory), takes the previous rank's offer and says whether it mapped it, then hears the
  /// next rank's answer. Every local link makes this exchange, whatever the option, so ranks
  /// set apart share nothing and still agree. Every rank offers before it waits, so no wait
  /// is in a cycle. A link that does not share goes on through its socket.
  void share_memory(Clock::time_point deadline);

  /// Waits until `socket` has something to read, or throws once `deadline` has passed.
  void await(transport_detail::StreamSocket& socket, Clock::time_point deadline,
             const std::string& who) const;

  /// Reads exactly `bytes` from `socket` (non-blocking) by `deadline`.
  void read_bytes(transport_detail::StreamSocket& socket, std::span<std::byte> bytes,
                  Clock::time_point deadline, const std::string& who) const;

  /// Writes `bytes` whole to `socket` (a few bytes into an empty socket buffer: at once).
  void write_frame_bytes(transport_detail::StreamSocket& socket, std::span<const std::byte> bytes,
                         Clock::time_point deadline) const;

  // The connections to the neighbours, and the next rank's handshake
  // (impl/tcp_ring_connect.hpp).

  /// Connects to the next rank, trying again every 100 ms until it listens: at its local
  /// socket first when its address is this host's, else (or when none listens) over TCP.
  void connect_next(const Address& where, Clock::time_point deadline);

  /// Accepts a connection for the previous rank, on the TCP port or the local socket.
  /// Meanwhile the next rank's challenge is answered and its answer read if they come: a
  /// refusal fails at once, naming the reason, instead of waiting for a previous rank that
  /// may never connect (or was refused itself).
  void accept_previous(asio::ip::tcp::acceptor& acceptor,
                       asio::local::stream_protocol::acceptor* locally,
                       const Credentials& credentials, Clock::time_point deadline);

  /// Reads the next rank's challenge and sends this rank's hello.
  void answer_next(const Credentials& credentials, const Node& self, Clock::time_point deadline);

  /// Reads the next rank's welcome (or refusal) and checks its proof.
  void check_welcome(const Credentials& credentials, Clock::time_point deadline);

  /// What `read` reads from the next rank; a frame that is no handshake of this protocol
  /// fails with kUnavailable naming it (something else listens at its address).
  template <class Read>
  std::invoke_result_t<Read&> from_next(Read read);

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

// The member functions' definitions, by concern.
#include "pulley/transport/impl/tcp_ring_connect.hpp"
#include "pulley/transport/impl/tcp_ring_form.hpp"
#include "pulley/transport/impl/tcp_ring_transfer.hpp"
