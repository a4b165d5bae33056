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
  std::uint64_t generation = 0;             ///< 0: the ring a job starts with; each ring formed after counts one more
  std::vector<std::string> addresses;       ///< each rank's "host:port", in rank order
  std::vector<std::uint64_t> incarnations;  ///< each rank's process (wire::incarnation()); empty in generation 0
  std::uint32_t rank = 0;                   ///< the receiver's
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
    if (options_.local_sockets) local_acceptor_ = transport_detail::listen_locally(io_, transport_detail::ring_socket_name(address_));
    acceptor_.emplace(transport_detail::listen(io_, transport_detail::resolve_listen_endpoint(io_, at.host, at.port)));
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

  /// At a step boundary of ring `view`: takes the check-ins waiting at this worker's
  /// address. Rank 0 holds them for the next `regroup` and returns true (vote to form the
  /// ring again after the next step, so that the newcomers come in); another rank redirects
  /// them to rank 0 and returns false. A connection that does not prove the job's secret
  /// within a second is dropped with one logged line.
  bool serve(const RingView& view) {
    for (int taken = 0; taken < 16 && waiting(0); ++taken) {
      std::optional<CheckedIn> in = take_check_in(HandshakeClock::now() + std::chrono::seconds(1));
      if (!in) continue;
      if (view.rank == 0) {
        held_.push_back(std::move(*in));
      } else {
        send_quietly(in->socket, wire::RingRedirect{view.generation, view.addresses.at(0)});
      }
    }
    return !held_.empty();
  }

  /// Forms the next ring's view after ring `view` broke or voted for it (`serve`), this
  /// member at `mine`: checks in with the lowest member that lets it in, or coordinates.
  /// Throws kDeadlineExceeded if no view is agreed within `form_timeout`, and
  /// kUnauthenticated if a member refuses this one's proof.
  RingView regroup(const RingView& view, RingProgress mine) {
    const auto deadline = HandshakeClock::now() + options_.form_timeout;
    while (HandshakeClock::now() < deadline) {
      bool below_alive = false;
      std::vector<bool> gone(view.addresses.size(), false);
      for (std::uint32_t i = 0; i < view.rank; ++i) {
        const Asked asked = ask(view.addresses[i], check_in(view.generation, mine),
                                HandshakeClock::now() + options_.timeout, deadline);
        if (asked.view) return released(*asked.view);
        if (asked.redirect && asked.redirect->generation > view.generation) {  // a newer ring left this one out
          return released(join_at(asked.redirect->address, mine, deadline));
        }
        gone[i] = asked.gone;
        // Busy forming a ring, or still in the old one (it has not seen it broken): ask
        // again from the top.
        if (asked.busy || asked.redirect) {
          below_alive = true;
          break;
        }
      }
      if (!below_alive) {
        if (std::optional<RingView> formed = coordinate(view, mine, std::move(gone), deadline)) return *formed;
      }
      pause();
    }
    throw Error(ErrorCode::kDeadlineExceeded, "ring: " + address_ + " found no ring to form within " +
                                                  std::to_string(options_.form_timeout.count()) + " ms");
  }

  /// A newcomer's view: checks in with the first of `members` (a running ring's workers,
  /// any of them) that answers, and is taken in at that ring's next step boundary. Throws
  /// kDeadlineExceeded if no ring takes it in within `form_timeout`.
  RingView join(const std::vector<std::string>& members) {
    const auto deadline = HandshakeClock::now() + options_.form_timeout;
    while (HandshakeClock::now() < deadline) {
      for (const std::string& member : members) {
        if (member == address_) continue;
        const Asked asked = ask(member, check_in(0, {}), HandshakeClock::now() + options_.timeout, deadline);
        if (asked.view) return *asked.view;
        if (asked.redirect) {
          try {
            return join_at(asked.redirect->address, {}, deadline);
          } catch (const Error& e) {  // that rank 0 is gone since: ask the members again
            if (e.code() != ErrorCode::kUnavailable) throw;
            break;
          }
        }
        if (asked.busy) break;
      }
      pause();
    }
    throw Error(ErrorCode::kDeadlineExceeded, "ring: " + address_ + " was not taken into a ring within " +
                                                  std::to_string(options_.form_timeout.count()) + " ms");
  }

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
  [[nodiscard]] static HandshakeClock::time_point soon() { return HandshakeClock::now() + std::chrono::seconds(1); }
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
    frame.header.kind = static_cast<std::uint16_t>(
        wire::kRendezvousKind + wire::RingRendezvousMessage(message).index());
    frame.header.meta_bytes = static_cast<std::uint32_t>(frame.meta.size());
    transport_detail::write_frame_by(socket, frame, deadline, who());
  }

  wire::RingRendezvousMessage receive(Socket& socket, HandshakeClock::time_point deadline) {
    // A view names every member: room for rings of thousands of workers.
    const auto [header, meta] = transport_detail::read_frame_by(socket, deadline, who(), wire::FrameLimits{1U << 20U, 0});
    if (header.kind < wire::kRendezvousKind) throw wire::Malformed("a frame of another kind where the rendezvous' was expected");
    return wire::detail::decode<wire::RingRendezvousMessage>(header.kind - wire::kRendezvousKind, meta, std::nullopt, 0);
  }

  // ---- the listening side ---------------------------------------------------------------

  /// Accepts a connection and runs the listening side of the handshake and the check-in by
  /// `deadline`; nothing if it fails (logged).
  std::optional<CheckedIn> take_check_in(HandshakeClock::time_point deadline) {
    Socket socket(io_);
    std::error_code ec;
    acceptor_->accept(socket, ec);
    if (ec) return std::nullopt;
    socket.non_blocking(true);
    try {
      const wire::Challenge challenge{credentials_.job, 0, wire::make_nonce()};
      transport_detail::write_frame_by(socket, wire::encode(wire::Handshake{challenge}, 0), deadline, who());
      const auto hello = transport_detail::read_handshake_by<wire::Hello>(socket, deadline, who());
      std::string refusal = wire::refusal_reason(credentials_, challenge, hello);
      ErrorCode code = ErrorCode::kUnauthenticated;
      if (refusal.empty() && hello.shard == wire::Hello::kRingLink) {
        refusal = "a ring link to " + address_ + ", which forms no ring now: check in again";
        code = ErrorCode::kUnavailable;
      } else if (refusal.empty() && hello.shard != wire::Hello::kRingRendezvous) {
        refusal = hello.peer.name() + " is not a ring's worker";
      }
      if (!refusal.empty()) {
        if (code == ErrorCode::kUnauthenticated) log(LogLevel::kWarning, who() + " refused a connection: " + refusal);
        transport_detail::write_frame_by(socket, wire::encode(wire::Handshake{wire::Refusal{code, refusal}}, 0),
                                         deadline, who());
        return std::nullopt;
      }
      transport_detail::write_frame_by(
          socket,
          wire::encode(wire::Handshake{wire::Welcome{wire::server_proof(credentials_.secret, challenge, hello),
                                                     wire::incarnation()}},
                       0),
          deadline, who());
      auto said = receive(socket, deadline);
      auto* in = std::get_if<wire::RingCheckIn>(&said);
      if (in == nullptr) throw wire::Malformed("a rendezvous message other than a check-in came first");
      return CheckedIn{std::move(socket), std::move(*in), hello.incarnation};
    } catch (const std::exception& e) {
      log(LogLevel::kWarning, who() + " dropped a connection: " + e.what());
      return std::nullopt;
    }
  }

  /// Coordinates the next ring after `view` (this member is the lowest alive): gathers the
  /// check-ins, sends each its view, returns this one's. Nothing if a member of a newer
  /// ring answered: this one was left out, and its check-ins were sent there.
  std::optional<RingView> coordinate(const RingView& view, RingProgress mine, std::vector<bool> gone,
                                     HandshakeClock::time_point deadline) {
    const std::size_t n = view.addresses.size();
    std::vector<std::optional<CheckedIn>> members(n);
    std::vector<CheckedIn> newcomers;
    auto take = [&](CheckedIn in) {
      for (std::size_t j = view.rank + 1; j < n; ++j) {
        if (in.said.address != view.addresses[j]) continue;
        const bool same = view.incarnations.empty() || view.incarnations[j] == in.incarnation;
        if (in.said.generation == view.generation && same) {
          members[j] = std::move(in);
          return;
        }
        gone[j] = true;  // another process at its address: the member is gone, this is a newcomer
      }
      std::erase_if(newcomers, [&](const CheckedIn& c) { return c.said.address == in.said.address; });
      newcomers.push_back(std::move(in));
    };
    for (CheckedIn& in : held_) take(std::move(in));
    held_.clear();
    log(LogLevel::kInfo, "ring: " + address_ + " gathers the next ring after generation " +
                             std::to_string(view.generation));
    const auto started = HandshakeClock::now();
    auto last_probe = started - std::chrono::seconds(1);
    while (HandshakeClock::now() < deadline) {
      bool all = true;
      for (std::size_t j = view.rank + 1; j < n; ++j) all = all && (members[j] || gone[j]);
      if (all || HandshakeClock::now() - started >= options_.timeout) break;
      if (waiting(100)) {
        if (std::optional<CheckedIn> in = take_check_in(soon())) take(std::move(*in));
      }
      if (HandshakeClock::now() - last_probe >= std::chrono::milliseconds(500)) {
        last_probe = HandshakeClock::now();
        for (std::size_t j = view.rank + 1; j < n; ++j) {
          if (!members[j] && !gone[j] && refuses(view.addresses[j])) gone[j] = true;
        }
      }
    }
    // A silent member that still listens may be in a newer ring that left this one out
    // (it was stopped for longer than the timeout): then this one is the newcomer.
    for (std::size_t j = view.rank + 1; j < n; ++j) {
      if (members[j] || gone[j]) continue;
      const Asked asked = ask(view.addresses[j], check_in(view.generation, mine), HandshakeClock::now() + options_.timeout,
                              HandshakeClock::now() + 2 * options_.timeout);
      if (asked.busy || (asked.redirect && asked.redirect->generation <= view.generation)) {
        // It forms a ring, or is still in this one: nothing to decide on yet, ask again.
        for (auto& m : members) {
          if (m) send_quietly(m->socket, wire::RingRedirect{view.generation, address_});
        }
        return std::nullopt;
      }
      if (asked.view || asked.redirect) {
        log(LogLevel::kWarning, "ring: " + address_ + " was left out of a newer ring: it joins it");
        const std::string there = asked.redirect ? asked.redirect->address : asked.view->addresses.at(0);
        for (auto& m : members) {
          if (m) send_quietly(m->socket, wire::RingRedirect{0, there});
        }
        for (auto& c : newcomers) send_quietly(c.socket, wire::RingRedirect{0, there});
        if (asked.view) return *asked.view;
        return join_at(there, mine, deadline);
      }
      log(LogLevel::kWarning, "ring: " + address_ + " leaves out " + view.addresses[j] + ": it did not check in within " +
                                  std::to_string(options_.timeout.count()) + " ms");
    }
    // A quorum: more than half of the old ring's workers not known gone (a dead process's
    // address refuses connections; a cut link's or a stopped one's does not), or half with
    // the lowest of them. The workers cut off from the others by a partition then form no
    // ring of their own: they keep checking in, and join the others' once they reach them.
    std::size_t voters = 0;
    std::size_t here = 1;
    bool lowest = true;
    for (std::size_t j = 0; j < n; ++j) {
      if (gone[j]) continue;
      ++voters;
      if (j < view.rank) lowest = false;
      if (members[j]) ++here;
    }
    if (2 * here < voters || (2 * here == voters && !lowest)) {
      log(LogLevel::kWarning, "ring: " + address_ + " reaches " + std::to_string(here) + " of the " +
                                  std::to_string(voters) + " workers of generation " + std::to_string(view.generation) +
                                  " not known gone, no quorum: it forms no ring and checks in again");
      for (auto& m : members) {  // (ask again: this one gathers again after a pause)
        if (m) send_quietly(m->socket, wire::RingRedirect{view.generation, address_});
      }
      return std::nullopt;
    }
    // The next view: the members in their old order, this one among them, then the newcomers.
    RingView next;
    std::uint64_t generation = view.generation;
    std::vector<std::pair<std::int64_t, std::int64_t>> progress;  // step, batches
    std::vector<CheckedIn*> order;
    for (std::size_t j = 0; j < n; ++j) {
      if (j == view.rank) {
        next.addresses.push_back(address_);
        next.incarnations.push_back(wire::incarnation());
        progress.emplace_back(mine.step, mine.batches);
        order.push_back(nullptr);
      } else if (members[j]) {
        next.addresses.push_back(members[j]->said.address);
        next.incarnations.push_back(members[j]->incarnation);
        progress.emplace_back(members[j]->said.step, members[j]->said.batches);
        order.push_back(&*members[j]);
      }
    }
    for (CheckedIn& c : newcomers) {
      generation = std::max(generation, c.said.generation);
      next.addresses.push_back(c.said.address);
      next.incarnations.push_back(c.incarnation);
      progress.emplace_back(c.said.step, c.said.batches);
      order.push_back(&c);
    }
    next.generation = generation + 1;
    for (std::uint32_t r = 0; r < progress.size(); ++r) {
      if (progress[r].first > next.step) {
        next.step = progress[r].first;
        next.batches = progress[r].second;
        next.source = r;
      }
    }
    std::string names;
    for (const std::string& a : next.addresses) names += (names.empty() ? "" : ", ") + a;
    log(LogLevel::kInfo, "ring: generation " + std::to_string(next.generation) + " of " +
                             std::to_string(next.addresses.size()) + " workers (" + names + "), from step " +
                             std::to_string(next.step) + " of rank " + std::to_string(next.source));
    RingView own;
    for (std::uint32_t r = 0; r < order.size(); ++r) {
      next.rank = r;
      if (order[r] == nullptr) {
        own = next;
      } else {
        send_quietly(order[r]->socket, next);
      }
    }
    return own;
  }

  /// Whether a connection to `address` is refused now (nobody listens: the worker is gone).
  bool refuses(const std::string& address) {
    try {
      Socket socket(io_);
      connect(socket, address, soon());
      return false;
    } catch (const Error& e) {
      return e.code() == ErrorCode::kUnavailable;
    }
  }

  template <class Message>
  void send_quietly(Socket& socket, const Message& message) {
    try {
      send(socket, message, soon());
    } catch (const std::exception&) {  // it is gone: the ring it was told of will not form, and it regroups
    }
  }

  // ---- the connecting side --------------------------------------------------------------

  /// Connects by `deadline`; kUnavailable if refused, kDeadlineExceeded if no answer.
  void connect(Socket& socket, const std::string& address, HandshakeClock::time_point deadline) {
    const Address at = parse_address(address);
    std::error_code ec;
    const auto endpoints = transport_detail::resolve_by(at.host, at.port, deadline, ec);
    if (ec == std::errc::timed_out)
      throw Error(ErrorCode::kDeadlineExceeded, "ring: " + address + " did not resolve in time");
    if (ec || endpoints.empty()) throw Error(ErrorCode::kInvalidArgument, "ring: cannot resolve " + address);
    ec = transport_detail::connect_within(socket, endpoints.begin()->endpoint(), deadline);
    if (ec == std::errc::timed_out) {
      throw Error(ErrorCode::kDeadlineExceeded, "ring: " + address + " did not answer a connection in time");
    }
    if (ec) throw Error(ErrorCode::kUnavailable, "ring: " + address + ": " + ec.message());
  }

  /// Checks in with the worker at `address`: the handshake by `handshake_by` (a live
  /// member answers once it sees its ring broken, within the timeout), the answer by
  /// `answer_by` (a coordinator gathers first). Throws kUnauthenticated if it refuses this
  /// worker's proof or cannot prove its own; anything else is "none of these".
  Asked ask(const std::string& address, const wire::RingCheckIn& said, HandshakeClock::time_point handshake_by,
            HandshakeClock::time_point answer_by) {
    Asked asked;
    Socket socket(io_);
    try {
      try {
        connect(socket, address, handshake_by);
      } catch (const Error& e) {
        asked.gone = e.code() == ErrorCode::kUnavailable;
        return asked;
      }
      const auto challenge = transport_detail::read_handshake_by<wire::Challenge>(socket, handshake_by, who());
      const wire::Hello hello = wire::hello_for(credentials_, challenge, Node::worker(0), wire::Hello::kRingRendezvous);
      transport_detail::write_frame_by(socket, wire::encode(wire::Handshake{hello}, 0), handshake_by, who());
      const auto bytes = transport_detail::read_frame_by(socket, handshake_by, who());
      const wire::Handshake answer = wire::decode_handshake(bytes.first, bytes.second);
      if (const auto* refusal = std::get_if<wire::Refusal>(&answer)) {
        if (refusal->code == ErrorCode::kUnavailable) {
          asked.busy = true;
          return asked;
        }
        throw Error(ErrorCode::kUnauthenticated, "ring: " + address + " refused " + address_ + ": " + refusal->reason);
      }
      const auto* welcome = std::get_if<wire::Welcome>(&answer);
      if (welcome == nullptr || !wire::welcome_proves(credentials_, challenge, hello, *welcome)) {
        throw Error(ErrorCode::kUnauthenticated,
                    "ring: " + address + " did not prove the job's shared secret (a wrong PULLEY_SECRET?)");
      }
      send(socket, said, handshake_by);
      auto reply = receive(socket, answer_by);
      if (auto* view = std::get_if<RingView>(&reply)) asked.view = std::move(*view);
      if (auto* redirect = std::get_if<wire::RingRedirect>(&reply)) asked.redirect = std::move(*redirect);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnauthenticated) throw;
    } catch (const wire::Malformed& e) {
      log(LogLevel::kWarning, who() + ": " + address + " is not a ring's worker: " + e.what());
    }
    return asked;
  }

  /// Checks in with rank 0 of a running ring, at `address`, until it takes this one in.
  RingView join_at(const std::string& address, RingProgress mine, HandshakeClock::time_point deadline) {
    while (HandshakeClock::now() < deadline) {
      const Asked asked = ask(address, check_in(0, mine), HandshakeClock::now() + options_.timeout, deadline);
      if (asked.view) return *asked.view;
      if (!asked.busy && !asked.redirect) break;
      pause();
    }
    throw Error(ErrorCode::kUnavailable, "ring: " + address_ + " was sent to " + address + ", which did not take it in");
  }

  /// `view`, once the check-ins this worker held are sent where it checked in itself.
  RingView released(RingView view) {
    for (CheckedIn& in : held_) send_quietly(in.socket, wire::RingRedirect{view.generation, view.addresses.at(0)});
    held_.clear();
    return view;
  }

  std::string address_;
  Credentials credentials_;
  TcpRingOptions options_;
  asio::io_context io_;
  std::optional<asio::ip::tcp::acceptor> acceptor_;
  std::optional<asio::local::stream_protocol::acceptor> local_acceptor_;  ///< the rings' local links
  std::vector<CheckedIn> held_;  ///< check-ins rank 0 took at step boundaries, for the next regroup
};

}  // namespace pulley
