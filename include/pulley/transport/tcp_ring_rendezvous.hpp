// SPDX-License-Identifier: MIT
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"
#include "pulley/transport/detail/handshake_io.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/tcp_ring.hpp"
#include "pulley/transport/wire/archive.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// Who is in a ring of workers, in rank order, and where their replicas start from: what
/// a TcpRingRendezvous hands each member before they form the ring.
struct RingView {
  /// 0: the ring a job starts with; each ring formed after counts one more.
  std::uint64_t generation = 0;
  std::vector<std::string> addresses;  ///< each rank's "host:port", in rank order
  /// Each rank's process (wire::incarnation()); empty in generation 0.
  std::vector<std::uint64_t> incarnations;
  std::uint32_t rank = 0;  ///< the receiver's
  /// The rank whose replica every rank copies: the one furthest on. A step some members
  /// finished before the old ring broke is kept, and none is half taken.
  std::uint32_t source = 0;
  /// The source's global step; -1 when no member holds a replica (a job that starts: rank
  /// 0 initializes or restores, then every rank copies it).
  std::int64_t step = -1;
  std::int64_t batches = 0;  ///< the batches the job read before `step`, by the source's count

  template <class Archive>
  void serialize(Archive& archive) {
    archive(generation, addresses, incarnations, rank, source, step, batches);
  }
};

/// Where a member stands when it checks in.
struct RingProgress {
  /// Its replica's global step; -1 when it holds none (a newcomer, or one whose copy from
  /// the source broke off half way).
  std::int64_t step = -1;
  std::int64_t batches = 0;  ///< the batches the job read before that step, by its count
};

namespace wire {

/// worker → the worker it takes for the rendezvous' coordinator, after the handshake.
struct RingCheckIn {
  std::uint64_t generation = 0;  ///< the ring it leaves; 0 for a newcomer
  std::string address;           ///< where it listens
  std::int64_t step = -1;
  std::int64_t batches = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(generation, address, step, batches);
  }
};

/// A member that is not its ring's rank 0 → a worker that checked in with it: check in with
/// rank 0 of ring `generation` at `address` instead.
struct RingRedirect {
  std::uint64_t generation = 0;
  std::string address;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(generation, address);
  }
};

using RingRendezvousMessage = std::variant<RingCheckIn, RingView, RingRedirect>;

}  // namespace wire

/// Forms a ring of worker processes, and forms it again when it breaks or a worker joins:
/// the failure rules of the all-reduce architecture (seed 004, section 1.4 and 2). A lost
/// worker's neighbours see its link fail, the others see theirs closed in turn, and every
/// survivor checks in; ranks are given again, the ring is rebuilt among those that checked
/// in, and they copy the replica of the one furthest on (RingView::source) before going on.
/// A newcomer checks in the same way and is taken in at the next step boundary.
///
/// Each worker keeps listening on its own address for the life of the job, so a live one
/// always takes a connection (the kernel queues it) and a dead one refuses it. Who
/// coordinates needs no election: every survivor checks in with the member of the old
/// ring lowest in rank that lets it in, and the lowest survivor finds nobody below it and
/// coordinates. It waits for every other member of the old ring to check in, to refuse a
/// connection (it is gone), or to stay silent for `TcpRingOptions::timeout`; it then asks a
/// silent one that still listens where it stands, and a member of a newer ring (this one
/// was left out of it, stopped for a while) redirects it there as a newcomer. It forms a
/// ring only with a quorum: more than half of the old ring's workers not known gone (a dead
/// process's address refuses connections; a stopped one's or a cut-off one's does not), or
/// exactly half that includes the lowest of them; so the two sides of a partition never
/// train apart, and the side without a quorum checks in until it reaches the other. Every
/// connection proves the job's secret (the handshake of wire/handshake.hpp, a Hello for
/// `kRingRendezvous`), and each ring's links are those of the processes its view names.
///
/// One thread uses it: the worker's, between its steps (`serve`), and when its ring broke
/// or voted to take a newcomer in (`regroup`).
class TcpRingRendezvous {
 public:
  /// Listens on `address` ("host:port", this worker's) for the life of the object.
  /// Throws kInvalidArgument (a bad address, no secret without allow_no_secret) or
  /// kUnavailable (cannot listen).
  TcpRingRendezvous(std::string address, Credentials credentials, TcpRingOptions options = {})
      : address_(std::move(address)), credentials_(std::move(credentials)), options_(options) {
    transport_detail::check_ring_credentials(credentials_, options_);
    const Address at = parse_address(address_);
    // The rings' links between workers on one host (TcpRingOptions::local_sockets); the
    // rendezvous itself speaks TCP. Bound first: a neighbour that finds the port finds it too.
    if (options_.local_sockets)
      local_acceptor_ =
          transport_detail::listen_locally(io_, transport_detail::ring_socket_name(address_));
    acceptor_.emplace(transport_detail::listen(
        io_, transport_detail::resolve_listen_endpoint(io_, at.host, at.port)));
    acceptor_->non_blocking(true);
  }

  TcpRingRendezvous(const TcpRingRendezvous&) = delete;
  TcpRingRendezvous& operator=(const TcpRingRendezvous&) = delete;

  [[nodiscard]] const std::string& address() const noexcept { return address_; }

  /// The view of the ring a job starts with: the cluster's workers, this one `rank`.
  [[nodiscard]] static RingView first(std::uint32_t rank, std::vector<std::string> addresses) {
    RingView view;
    view.addresses = std::move(addresses);
    view.rank = rank;
    return view;
  }

  /// Forms the ring `view` names, on this worker's address (TcpRing's errors).
  [[nodiscard]] TcpRing form(const RingView& view) {
    return TcpRing(view.rank, view.addresses, credentials_, options_, &*acceptor_,
                   local_acceptor_ ? &*local_acceptor_ : nullptr, view.incarnations);
  }

  // The rendezvous' rounds: serve (impl/tcp_ring_rendezvous_listen.hpp), regroup and join
  // (impl/tcp_ring_rendezvous_connect.hpp).

  /// At a step boundary of ring `view`: takes the check-ins waiting at this worker's
  /// address. Rank 0 holds them for the next `regroup` and returns true (vote to form the
  /// ring again after the next step, so that the newcomers come in); another rank redirects
  /// them to rank 0 and returns false. A connection that does not prove the job's secret
  /// within a second is dropped with one logged line.
  bool serve(const RingView& view);

  /// Forms the next ring's view after ring `view` broke or voted for it (`serve`), this
  /// member at `mine`: checks in with the lowest member that lets it in, or coordinates.
  /// Throws kDeadlineExceeded if no view is agreed within `form_timeout`, and
  /// kUnauthenticated if a member refuses this one's proof.
  RingView regroup(const RingView& view, RingProgress mine);

  /// A newcomer's view: checks in with the first of `members` (a running ring's workers,
  /// any of them) that answers, and is taken in at that ring's next step boundary. Throws
  /// kDeadlineExceeded if no ring takes it in within `form_timeout`.
  RingView join(const std::vector<std::string>& members);

 private:
  using HandshakeClock = transport_detail::HandshakeClock;
  using Socket = asio::ip::tcp::socket;

  struct CheckedIn {
    Socket socket;
    wire::RingCheckIn said;
    std::uint64_t incarnation = 0;
  };
  /// What asking a worker came to: a view (this one is in), a redirect, busy (it forms a
  /// ring: ask again), or none of these (it is gone or silent).
  struct Asked {
    std::optional<RingView> view;
    std::optional<wire::RingRedirect> redirect;
    bool busy = false;
    bool gone = false;  ///< nobody listens at its address: the worker is gone
  };

  [[nodiscard]] wire::RingCheckIn check_in(std::uint64_t generation, RingProgress mine) const {
    return {generation, address_, mine.step, mine.batches};
  }
  [[nodiscard]] static HandshakeClock::time_point soon() {
    return HandshakeClock::now() + std::chrono::seconds(1);
  }
  static void pause() {
    pollfd none{-1, 0, 0};
    ::poll(&none, 0, 200);
  }
  [[nodiscard]] std::string who() const { return "ring rendezvous at " + address_; }

  /// A connection waits at this worker's address (within `ms`).
  bool waiting(int ms) {
    pollfd fd{acceptor_->native_handle(), POLLIN, 0};
    return ::poll(&fd, 1, ms) > 0 && (fd.revents & POLLIN) != 0;
  }

  // ---- frames --------------------------------------------------------------------------

  template <class Message>
  void send(Socket& socket, const Message& message, HandshakeClock::time_point deadline) {
    wire::Frame frame;
    wire::MetaWriter archive(frame.meta, frame.payload);
    archive(const_cast<Message&>(message));
    frame.header.kind = static_cast<std::uint16_t>(wire::kRendezvousKind +
                                                   wire::RingRendezvousMessage(message).index());
    frame.header.meta_bytes = static_cast<std::uint32_t>(frame.meta.size());
    transport_detail::write_frame_by(socket, frame, deadline, who());
  }

  wire::RingRendezvousMessage receive(Socket& socket, HandshakeClock::time_point deadline) {
    // A view names every member: room for rings of thousands of workers.
    const auto [header, meta] =
        transport_detail::read_frame_by(socket, deadline, who(), wire::FrameLimits{1U << 20U, 0});
    if (header.kind < wire::kRendezvousKind)
      throw wire::Malformed("a frame of another kind where the rendezvous' was expected");
    return wire::detail::decode<wire::RingRendezvousMessage>(header.kind - wire::kRendezvousKind,
                                                             meta, std::nullopt, 0);
  }

  // ---- the listening side (impl/tcp_ring_rendezvous_listen.hpp) ----------------------

  /// Accepts a connection and runs the listening side of the handshake and the check-in by
  /// `deadline`; nothing if it fails (logged).
  std::optional<CheckedIn> take_check_in(HandshakeClock::time_point deadline);

  /// Coordinates the next ring after `view` (this member is the lowest alive): gathers the
  /// check-ins, sends each its view, returns this one's. Nothing if a member of a newer
  /// ring answered: this one was left out, and its check-ins were sent there.
  std::optional<RingView> coordinate(const RingView& view, RingProgress mine,
                                     std::vector<bool> gone, HandshakeClock::time_point deadline);

  /// Whether a connection to `address` is refused now (nobody listens: the worker is gone).
  bool refuses(const std::string& address);

  template <class Message>
  void send_quietly(Socket& socket, const Message& message);

  // ---- the connecting side (impl/tcp_ring_rendezvous_connect.hpp) --------------------

  /// Connects by `deadline`; kUnavailable if refused, kDeadlineExceeded if no answer.
  void connect(Socket& socket, const std::string& address, HandshakeClock::time_point deadline);

  /// Checks in with the worker at `address`: the handshake by `handshake_by` (a live
  /// member answers once it sees its ring broken, within the timeout), the answer by
  /// `answer_by` (a coordinator gathers first). Throws kUnauthenticated if it refuses this
  /// worker's proof or cannot prove its own; anything else is "none of these".
  Asked ask(const std::string& address, const wire::RingCheckIn& said,
            HandshakeClock::time_point handshake_by, HandshakeClock::time_point answer_by);

  /// Checks in with rank 0 of a running ring, at `address`, until it takes this one in.
  RingView join_at(const std::string& address, RingProgress mine,
                   HandshakeClock::time_point deadline);

  /// `view`, once the check-ins this worker held are sent where it checked in itself.
  RingView released(RingView view);

  std::string address_;
  Credentials credentials_;
  TcpRingOptions options_;
  asio::io_context io_;
  std::optional<asio::ip::tcp::acceptor> acceptor_;
  /// The rings' local links.
  std::optional<asio::local::stream_protocol::acceptor> local_acceptor_;
  std::vector<CheckedIn> held_;  ///< check-ins rank 0 took at step boundaries, for the next regroup
};

}  // namespace pulley

// The member functions' definitions, by concern.
#include "pulley/transport/impl/tcp_ring_rendezvous_connect.hpp"
#include "pulley/transport/impl/tcp_ring_rendezvous_listen.hpp"
