// SPDX-License-Identifier: MIT
#pragma once

/// TcpRing's forming (declared in transport/tcp_ring.hpp, which includes this header after the
/// class): the constructor that forms the ring, the forming itself (listening, the previous
/// rank's hello checked, welcomed or refused), the shared memory the local links agree on, and
/// forming's reads and writes by a deadline.

#include "pulley/transport/tcp_ring.hpp"

namespace pulley {

inline TcpRing::TcpRing(std::size_t rank, const std::vector<std::string>& addresses,
                        const Credentials& credentials, TcpRingOptions options,
                        asio::ip::tcp::acceptor* listening,
                        asio::local::stream_protocol::acceptor* listening_locally,
                        std::vector<std::uint64_t> incarnations)
    : links_(std::make_unique<Links>()),
      rank_(rank),
      size_(addresses.size()),
      options_(options),
      incarnations_(std::move(incarnations)) {
  if (addresses.empty() || rank >= addresses.size() ||
      (!incarnations_.empty() && incarnations_.size() != size_)) {
    throw Error(ErrorCode::kInvalidArgument, "ring: rank " + std::to_string(rank) +
                                                 " of a ring of " +
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
    own_local = transport_detail::listen_locally(
        links_->io, transport_detail::ring_socket_name(addresses[rank_]));
    if (own_local) listening_locally = &*own_local;
  }
  form(parsed, credentials, listening, options_.local_sockets ? listening_locally : nullptr);
}

inline void TcpRing::form(const std::vector<Address>& addresses, const Credentials& credentials,
                          asio::ip::tcp::acceptor* listening,
                          asio::local::stream_protocol::acceptor* listening_locally) {
  const auto deadline = Clock::now() + options_.form_timeout;
  auto& io = links_->io;
  std::optional<asio::ip::tcp::acceptor> own;
  if (listening == nullptr) {
    own.emplace(
        transport_detail::listen(io, transport_detail::resolve_listen_endpoint(
                                         io, addresses[rank_].host, addresses[rank_].port)));
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
    const wire::Challenge challenge{credentials.job, static_cast<std::uint32_t>(rank_),
                                    wire::make_nonce()};
    // Whatever goes wrong on an accepted connection (a stranger that hangs up, stalls or
    // speaks another protocol) drops it, and the next one is accepted; the next rank's
    // link is another matter: its failures end the forming.
    const auto drop = [&](const char* what) {
      log(LogLevel::kWarning,
          "ring: rank " + std::to_string(rank_) + " dropped a connection: " + what);
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
      } else if (refusal.empty() &&
                 (hello.shard != wire::Hello::kRingLink || !(hello.peer == expected))) {
        refusal = hello.peer.name() + " is not " + expected.name() + " of the ring";
      } else if (refusal.empty() && !incarnations_.empty() &&
                 hello.incarnation != incarnations_[previous()]) {
        // A worker of the job that forms another ring (an older view): it regroups.
        refusal = "the process that claims " + expected.name() +
                  " is not the ring's (one of an older ring?)";
        code = ErrorCode::kUnavailable;
      }
      if (!refusal.empty()) {
        if (code == ErrorCode::kUnauthenticated) {
          log(LogLevel::kWarning,
              "ring: rank " + std::to_string(rank_) + " refused a connection: " + refusal);
        }
        try {
          write_frame(links_->previous,
                      wire::encode(wire::Handshake{wire::Refusal{code, refusal}}, 0), until);
        } catch (const Error&) {  // it hung up first
        }
        std::error_code ignored;
        links_->previous.close(ignored);
        continue;
      }
      write_frame(links_->previous,
                  wire::encode(wire::Handshake{wire::Welcome{
                                   wire::server_proof(credentials.secret, challenge, hello),
                                   wire::incarnation()}},
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

inline void TcpRing::share_memory(Clock::time_point deadline) {
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

inline void TcpRing::await(transport_detail::StreamSocket& socket, Clock::time_point deadline,
                           const std::string& who) const {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) {
    throw Error(ErrorCode::kDeadlineExceeded, "ring: rank " + std::to_string(rank_) + ": " + who +
                                                  " did not finish forming the ring in time");
  }
  pollfd fd{socket.native_handle(), POLLIN, 0};
  ::poll(&fd, 1, static_cast<int>(std::min<std::int64_t>(left, 1000)));
}

inline void TcpRing::read_bytes(transport_detail::StreamSocket& socket, std::span<std::byte> bytes,
                                Clock::time_point deadline, const std::string& who) const {
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

inline void TcpRing::write_frame_bytes(transport_detail::StreamSocket& socket,
                                       std::span<const std::byte> bytes,
                                       Clock::time_point deadline) const {
  while (!bytes.empty()) {
    std::error_code ec;
    const std::size_t n = socket.write_some(asio::buffer(bytes.data(), bytes.size()), ec);
    if (!ec) {
      bytes = bytes.subspan(n);
      continue;
    }
    if ((ec != asio::error::would_block && ec != asio::error::try_again) ||
        Clock::now() >= deadline) {
      throw lost(links_->previous_name, ec.message());
    }
    pollfd fd{socket.native_handle(), POLLOUT, 0};
    ::poll(&fd, 1, 100);
  }
}

}  // namespace pulley
