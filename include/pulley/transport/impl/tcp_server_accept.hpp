// SPDX-License-Identifier: MIT
#pragma once

/// TcpServer's connections accepted, and their handshake (declared in
/// transport/tcp_server.hpp, which includes this header after the class): the port and the
/// local socket, the limits on connections in the handshake, the hello checked, the task's
/// process taken over, and shared memory offered.

#include "pulley/transport/tcp_server.hpp"

namespace pulley {

template <Service S>
void TcpServer<S>::listen_locally() {
#if defined(__linux__)
  const asio::ip::tcp::endpoint tcp = acceptor_.local_endpoint();
  const asio::local::stream_protocol::endpoint endpoint(
      transport_detail::local_socket_name(tcp.address(), tcp.port()));
  std::error_code ec;
  local_acceptor_.open(endpoint.protocol(), ec);
  if (!ec) local_acceptor_.bind(endpoint, ec);
  if (!ec) local_acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    std::error_code ignored;
    local_acceptor_.close(ignored);
    log(LogLevel::kWarning, "ps " + std::to_string(service_.task()) +
                                ": no local socket for port " + std::to_string(tcp.port()) + " (" +
                                ec.message() + "): tasks on this host reach it over TCP");
  }
#endif
}

template <Service S>
void TcpServer<S>::accept() {
#if defined(__linux__)
  if (local_acceptor_.is_open()) accept_local();
#endif
  accept_tcp();
}

#if defined(__linux__)
template <Service S>
void TcpServer<S>::accept_local() {
  local_acceptor_.async_accept(
      [this](std::error_code ec, asio::local::stream_protocol::socket socket) {
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

template <Service S>
void TcpServer<S>::accept_tcp() {
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

template <Service S>
void TcpServer<S>::admit(transport_detail::StreamSocket socket, std::string address, bool local) {
  std::error_code ignored;
  if (connections_.size() - clients_ >= options_.max_handshaking) {
    Connection* oldest = nullptr;
    for (const auto& [raw, c] : connections_) {
      if (!c->peer && !c->closed && (oldest == nullptr || c->accepted < oldest->accepted))
        oldest = raw;
    }
    if (oldest == nullptr) {
      socket.close(ignored);
      return;
    }
    drop(*oldest, std::to_string(options_.max_handshaking) +
                      " connections are in the handshake (TcpServerOptions::max_handshaking): the "
                      "oldest makes room");
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

template <Service S>
void TcpServer<S>::on_hello(const ConnectionPtr& c, const wire::FrameReader::Frame& frame) {
  const wire::Hello hello = wire::decode_handshake_as<wire::Hello>(frame.header, frame.meta);
  wire::Refusal refusal{ErrorCode::kUnauthenticated,
                        wire::refusal_reason(options_.credentials, *c->challenge, hello,
                                             options_.tasks.contains(Node::Role::kPs))};
  if (refusal.reason.empty()) refusal = outside_job(hello.peer);
  if (refusal.reason.empty() &&
      (hello.shard == wire::Hello::kRingLink || hello.shard == wire::Hello::kRingRendezvous)) {
    refusal.reason = hello.peer.name() + " connected as a ring's worker (TcpRing) to ps " +
                     std::to_string(service_.task()) + ": a ring's addresses are the workers'";
  } else if (refusal.reason.empty() && hello.shard != wire::Hello::kOwnShard &&
             hello.shard != service_.task() && !holds_copy(service_, hello.shard)) {
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
    queue_frame(c,
                wire::encode(wire::Handshake{wire::Refusal{ErrorCode::kUnavailable, for_now}}, 0));
    return;
  }
  if (clients_ >= options_.max_connections) {  // closed, as by a busy server: it may try again
    return drop(*c, std::to_string(options_.max_connections) +
                        " connections of the job are open (TcpServerOptions::max_connections)");
  }
  c->peer = hello.peer;
  c->incarnation = hello.incarnation;
  if (hello.shard != wire::Hello::kOwnShard && hello.shard != service_.task())
    c->shard = hello.shard;
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

template <Service S>
void TcpServer<S>::await_rings(const ConnectionPtr& c) {
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

template <Service S>
std::string TcpServer<S>::held_elsewhere(const wire::Hello& hello) const {
  if (options_.takeover_after.count() <= 0) return {};
  if (hello.incarnation == 0)
    return "its hello names no process (incarnation 0): one process per task";
  const auto now = Clock::now();
  for (const auto& [raw, c] : connections_) {
    if (!c->peer || c->closed || c->incarnation == 0 || c->incarnation == hello.incarnation ||
        c->peer->role != hello.peer.role || c->peer->index != hello.peer.index ||
        now - c->last_heard >= options_.takeover_after) {
      continue;
    }
    const auto ago =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - c->last_heard).count();
    return hello.peer.name() + " is another live process's (at " + c->address + ", heard " +
           std::to_string(ago) +
           " ms ago): one process per task (TcpServerOptions::takeover_after)";
  }
  return {};
}

template <Service S>
void TcpServer<S>::take_over(const Connection& c) {
  std::vector<Connection*> older;
  for (const auto& [raw, other] : connections_) {
    if (other.get() != &c && other->peer && !other->closed && other->incarnation != c.incarnation &&
        other->peer->role == c.peer->role && other->peer->index == c.peer->index) {
      older.push_back(raw);
    }
  }
  for (Connection* other : older) {
    drop(*other,
         c.peer->name() + " is now the process at " + c.address + " (it took the task over)");
  }
}

template <Service S>
wire::Refusal TcpServer<S>::outside_job(const Node& peer) const {
  if (options_.tasks.empty()) return {};
  const auto workers = job_workers(service_);
  if (peer.role == Node::Role::kWorker && !workers.empty()) {
    if (std::binary_search(workers.begin(), workers.end(), peer.index)) return {};
    return {ErrorCode::kUnauthenticated,
            peer.name() + " is not a worker of this job now (its workers are " +
                describe_members(workers) + "; a new worker asks the chief to join: --join)"};
  }
  const auto it = options_.tasks.find(peer.role);
  const std::uint32_t count = it == options_.tasks.end() ? 0 : it->second;
  if (peer.index < count) return {};
  // A worker beyond the spec's, where this ps knows no other workers (it has not been
  // told the job's): it may have joined while this process was not in the job (a ps
  // started again learns the workers from the chief's restore). A client this address
  // let in before takes kFailedPrecondition for a refusal for now.
  return {peer.role == Node::Role::kWorker ? ErrorCode::kFailedPrecondition
                                           : ErrorCode::kUnauthenticated,
          peer.name() + " is not a task of this job (it has " + std::to_string(count) + " " +
              Node::role_name(peer.role) + " task" + (count == 1 ? "" : "s") + ")"};
}

}  // namespace pulley
