// SPDX-License-Identifier: MIT
#pragma once

/// TcpRing's connections to its neighbours (declared in transport/tcp_ring.hpp, which includes
/// this header after the class): the next rank connected (local socket or TCP), the previous
/// rank's connection accepted, and the next rank's challenge answered and its welcome checked.

#include "pulley/transport/tcp_ring.hpp"

namespace pulley {

inline void TcpRing::connect_next(const Address& where, Clock::time_point deadline) {
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
      const asio::generic::stream_protocol::endpoint named{
          asio::local::stream_protocol::endpoint(links_->next_local_name)};
      if (!transport_detail::connect_within(
              socket, named, std::min(deadline, Clock::now() + std::chrono::seconds(1)))) {
        links_->next_local = true;
        return;
      }
      socket.close(ec);
      why = "its local socket refused";
    }
#endif
    if (!local || Clock::now() >= tcp_after) {
      links_->next_local = false;
      ec = transport_detail::connect_within(
          socket, endpoint, std::min(deadline, Clock::now() + std::chrono::seconds(1)));
      if (!ec) return;
      why = ec.message();
    }
    pollfd none{-1, 0, 0};
    ::poll(&none, 0, 100);
  }
  throw Error(ErrorCode::kDeadlineExceeded,
              "ring: rank " + std::to_string(rank_) + " could not connect to " + links_->next_name +
                  " within " + std::to_string(options_.form_timeout.count()) + " ms: " + why);
}

inline void TcpRing::accept_previous(asio::ip::tcp::acceptor& acceptor,
                                     asio::local::stream_protocol::acceptor* locally,
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
      throw Error(ErrorCode::kUnavailable,
                  "ring: rank " + std::to_string(rank_) + " cannot accept: " + ec.message());
    }
    if (Clock::now() >= deadline) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "ring: rank " + std::to_string(rank_) + ": " + links_->previous_name +
                      " did not connect within " + std::to_string(options_.form_timeout.count()) +
                      " ms");
    }
    std::array<pollfd, 3> fds{
        pollfd{acceptor.native_handle(), POLLIN, 0},
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

inline void TcpRing::answer_next(const Credentials& credentials, const Node& self,
                                 Clock::time_point deadline) {
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

inline void TcpRing::check_welcome(const Credentials& credentials, Clock::time_point deadline) {
  wire::Handshake message = from_next([&] {
    const auto bytes = read_frame(links_->next, deadline);
    return wire::decode_handshake(bytes.first, bytes.second);
  });
  if (auto* refusal = std::get_if<wire::Refusal>(&message)) {
    // kUnavailable: the next rank forms another ring now (this one's view is stale).
    throw Error(refusal->code == ErrorCode::kUnavailable ? ErrorCode::kUnavailable
                                                         : ErrorCode::kUnauthenticated,
                "ring: " + links_->next_name + " refused rank " + std::to_string(rank_) + ": " +
                    refusal->reason);
  }
  const auto* welcome = std::get_if<wire::Welcome>(&message);
  if (welcome == nullptr || !wire::welcome_proves(credentials, challenge_, said_, *welcome)) {
    throw Error(ErrorCode::kUnauthenticated,
                "ring: " + links_->next_name +
                    " did not prove the job's shared secret (a wrong PULLEY_SECRET?)");
  }
  if (!incarnations_.empty() && welcome->server != incarnations_[next()]) {
    throw Error(ErrorCode::kUnavailable,
                "ring: " + links_->next_name + " is another process than the ring's");
  }
  welcomed_ = true;
}

template <class Read>
std::invoke_result_t<Read&> TcpRing::from_next(Read read) {
  try {
    return read();
  } catch (const wire::Malformed& e) {
    throw Error(ErrorCode::kUnavailable,
                "ring: " + links_->next_name + " is not a pulley ring rank: " + e.what());
  }
}

}  // namespace pulley
