// SPDX-License-Identifier: MIT
#pragma once

/// TcpClient's connections (declared in detail/tcp_client.hpp, which includes this header
/// after the class): a ps added, an attempt and its deadline, local sockets, the handshake,
/// and the rings of shared memory.

#include "pulley/transport/detail/tcp_client.hpp"

namespace pulley::transport_detail {

inline void TcpClient::add_ps(Address where, bool connect_now) {
  const auto task = static_cast<std::uint32_t>(shards_);
  if (options_.replicas == 0) {
    links_.push_back(std::make_unique<Link>(io_, std::move(where), options_.limits, task,
                                            wire::Hello::kOwnShard));
  } else {
    // Its own link goes before the copies' links (link_of), which move up one; its copy
    // is reached at the new ps itself, as a shard of no member, until the chief's
    // membership places it (place_copies).
    auto copy = std::make_unique<Link>(io_, where, options_.limits, task, task);
    copy->dropped = true;
    if (members_.empty()) {  // (every ps known so far was a member: the new one is not yet)
      for (std::uint32_t k = 0; k < task; ++k) members_.push_back(k);
    }
    renumber_copies(1);
    links_.insert(links_.begin() + static_cast<std::ptrdiff_t>(shards_),
                  std::make_unique<Link>(io_, std::move(where), options_.limits, task,
                                         wire::Hello::kOwnShard));
    links_.push_back(std::move(copy));
    ready_alone_.push_back(false);
  }
  ++shards_;
  try {
    if (connect_now) connect_with_backoff(*links_[task], options_.connect_timeout);
  } catch (...) {  // (the links are kept alive: their handlers may still run)
    --shards_;
    retired_.push_back(std::move(links_[task]));  // broken: its attempt ended
    links_.erase(links_.begin() + static_cast<std::ptrdiff_t>(task));
    if (options_.replicas != 0) {
      retired_.push_back(std::move(links_.back()));  // never connected
      links_.pop_back();
      ready_alone_.pop_back();
      renumber_copies(-1);
    }
    throw;
  }
}

inline void TcpClient::connect_all(std::optional<std::span<const std::uint32_t>> reach_now) {
  const bool quick = options_.replicas != 0 && options_.copy_connect_timeout.count() > 0;
  std::vector<std::optional<Error>> missed(links_.size());
  // The first link missed at each task: the others at its address are not waited for.
  const auto missed_at = [&](std::size_t i) -> const std::optional<Error>* {
    for (std::size_t j = 0; j < i; ++j) {
      if (missed[j] && links_[j]->task == links_[i]->task) return &missed[j];
    }
    return nullptr;
  };
  for (std::size_t i = 0; i < links_.size(); ++i) {
    if (reach_now &&
        std::find(reach_now->begin(), reach_now->end(), links_[i]->task) == reach_now->end())
      continue;
    if (const std::optional<Error>* before = quick ? missed_at(i) : nullptr) {
      missed[i] = **before;
      continue;
    }
    try {
      connect_with_backoff(*links_[i],
                           quick ? options_.copy_connect_timeout : options_.connect_timeout);
    } catch (const Error& e) {
      if (options_.replicas == 0 || e.code() != ErrorCode::kUnavailable) throw;
      missed[i] = e;
    }
  }
  const auto twin_reached = [&](std::size_t i) {
    const Link& twin = *links_[partner_of(*links_[i])];
    return twin.state == State::kConnected && !twin.dropped;
  };
  for (std::size_t i = 0; i < links_.size(); ++i) {  // the last copies first
    if (!missed[i] || twin_reached(i)) continue;
    if (!quick) throw *missed[i];
    const std::size_t j = partner_of(*links_[i]);
    if (!missed[j]) {  // its twin was not tried (not among reach_now): this one alone
      connect_with_backoff(*links_[i], options_.connect_timeout);
      missed[i].reset();
      continue;
    }
    // Neither copy reached: whichever comes first (one may be gone for good, the
    // other stalled a while).
    if (!connect_first({links_[i].get(), links_[j].get()}, options_.connect_timeout)) {
      throw Error(ErrorCode::kUnavailable,
                  "neither copy of ps " + std::to_string(i % shards_) + "'s shard reached within " +
                      std::to_string(options_.connect_timeout.count()) +
                      " ms: " + missed[i]->message() + "; " + missed[j]->message());
    }
    missed[links_[i]->state == State::kConnected ? i : j].reset();
  }
  std::vector<std::uint32_t> ruled_lost;  // the processes the referee ruled lost here
  // Whether link i reached late a process the referee ruled lost (stopped past the copy
  // timeout, continued since); asked once per process, the other links hear the same.
  std::vector<std::uint64_t> cleared;  // processes reached late and not ruled lost
  const auto old_process = [&](std::size_t i) {
    const std::uint64_t server = links_[i]->server;
    if (std::find(cleared.begin(), cleared.end(), server) != cleared.end()) return false;
    if (reached_ruled_lost(*links_[i])) return true;
    cleared.push_back(server);
    return false;
  };
  // Link i is given up as that process, whose copies are old.
  const auto given_up_old = [&](std::size_t i) {
    Link& link = *links_[i];
    ruled_lost.push_back(link.task);
    if (links_[partner_of(link)]->dropped) return;  // the last copy of its shard
    link.dropped = true;
    link.lost = link.server;
    fail(link, "its process was ruled lost for the job");
    log_copies(LogLevel::kWarning,
               self_.name() + ": ps " + std::to_string(link.task) + " at " + link.address +
                   " answers again, but its process was ruled lost for the job (stopped or cut "
                   "off past the copy timeout: its copies are old): ps " +
                   std::to_string(i % shards_) + "'s shard is served by one copy only");
  };
  for (std::size_t i = 0; i < links_.size(); ++i) {
    if (!missed[i]) continue;
    const bool ruled =
        std::find(ruled_lost.begin(), ruled_lost.end(), links_[i]->task) != ruled_lost.end();
    if (quick && !ruled) {
      // One attempt, or the first wait's attempts when another link reached the process
      // meanwhile (it was stalled, not gone).
      const bool process_back = std::any_of(links_.begin(), links_.end(), [&](const auto& other) {
        return other->task == links_[i]->task && other->state == State::kConnected;
      });
      try {
        connect_with_backoff(*links_[i], process_back ? std::max(options_.copy_connect_timeout,
                                                                 options_.attempt_timeout)
                                                      : std::chrono::milliseconds(0));
        if (old_process(i)) given_up_old(i);
        continue;
      } catch (const Error& e) {  // (the first miss stays the one logged)
        if (e.code() != ErrorCode::kUnavailable) throw;
      }
    }
    if (options_.copy_referee && !ruled && !ruled_lost_now(*links_[i], missed[i]->message())) {
      try {
        connect_with_backoff(*links_[i], options_.connect_timeout);
        if (old_process(i)) given_up_old(i);
        continue;
      } catch (const Error& again) {
        if (again.code() != ErrorCode::kUnavailable) throw;
        throw Error(again.code(),
                    std::string(again.message()) +
                        "; its copy is not given up: the chief did not rule its process lost");
      }
    }
    ruled_lost.push_back(links_[i]->task);
    links_[i]->dropped = true;
    log_copies(LogLevel::kWarning, self_.name() + ": " + missed[i]->what() + ": ps " +
                                       std::to_string(i % shards_) +
                                       "'s shard is served by one copy only");
  }
}

inline bool TcpClient::connect_first(std::initializer_list<Link*> links,
                                     std::chrono::milliseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  auto backoff = options_.initial_backoff;
  for (;;) {
    for (Link* link : links) {
      bool done = false;
      connect(*link, [&](std::error_code) { done = true; });
      while (!done) io_.run_one();
      if (link->state == State::kConnected) return true;
      if (link->refused) throw Error(link->refused->code, link->refused->message);
    }
    if (std::chrono::steady_clock::now() + backoff > deadline) return false;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

inline void TcpClient::connect_with_backoff(Link& link, std::chrono::milliseconds patience) {
  if (connect_first({&link}, patience)) return;
  const std::string tried = patience < options_.attempt_timeout
                                ? " (one attempt)"
                                : " for " + std::to_string(patience.count()) + " ms";
  throw Error(ErrorCode::kUnavailable,
              "ps at " + link.address + " unreachable" + tried + ": " + link.broken_reason);
}

template <class Done>
inline void TcpClient::connect(Link& link, Done done) {
  const std::uint64_t gen = ++link.generation;
  link.state = State::kConnecting;
  link.rings.stop();  // (a link is connected again only once broken: stopped already)
  link.offered = {};
  link.socket = StreamSocket(io_);
  link.local = false;
  link.refused.reset();
  link.connected = std::move(done);
  auto timed_out = std::make_shared<bool>(false);
  link.timer.expires_after(options_.attempt_timeout);
  link.timer.async_wait([this, &link, gen, timed_out](std::error_code ec) {
    if (ec || gen != link.generation ||
        (link.state != State::kConnecting && link.state != State::kHandshaking)) {
      return;
    }
    *timed_out = true;
    link.resolver.cancel();
    if (link.state == State::kHandshaking) {
      return fail(
          link, "no handshake within " + std::to_string(options_.attempt_timeout.count()) + " ms");
    }
    std::error_code ignored;
    link.socket.close(ignored);
  });
  auto finish = [this, &link, gen, timed_out](std::error_code ec) {
    if (gen != link.generation) return;
    if (!ec && !link.local) link.socket.set_option(asio::ip::tcp::no_delay(true), ec);
    if (!ec && link.local) widen_local_buffers(link.socket);
    if (!ec) link.socket.non_blocking(true, ec);  // requests are first written directly
    if (ec) {
      link.timer.cancel();
      link.state = State::kBroken;
      link.broken_reason = *timed_out ? "no connection within " +
                                            std::to_string(options_.attempt_timeout.count()) + " ms"
                                      : ec.message();
      drop_if_lost(link, ec);  // then its calls go to the other copy
      fail_all(link, false);   // else what waited for this attempt learns its outcome now
      return connected(link, ec);
    }
    // Connected: the ps speaks first (its challenge), and the handshake follows.
    link.state = State::kHandshaking;
    link.reader.reset();
    link.reader.set_limits(wire::kHandshakeLimits);
    link.receive_buffers = {};  // a new socket: low watermark 1
    link.receiving = false;
    receive(link);
  };
  // A numeric address needs no resolver (whose first use starts a thread). A ps on this
  // host is reached through its local socket when it has one, else over TCP.
  const auto port = static_cast<std::uint16_t>(std::stoi(link.port));
  std::error_code not_numeric;
  const asio::ip::address numeric = asio::ip::make_address(link.host, not_numeric);
  if (!not_numeric) {
    const asio::ip::tcp::endpoint endpoint(numeric, port);
    reach_locally(
        link, gen, timed_out, local_names(numeric, port), 0, finish, [&link, endpoint, finish] {
          link.socket.async_connect(endpoint, [finish](std::error_code ec) mutable { finish(ec); });
        });
    return;
  }
  link.resolver.async_resolve(
      link.host, link.port,
      [this, &link, gen, timed_out, port, finish](
          std::error_code ec, asio::ip::tcp::resolver::results_type endpoints) mutable {
        if (ec) return finish(ec);
        std::vector<asio::generic::stream_protocol::endpoint> tcp;  // (as the socket takes them)
        for (const auto& entry : endpoints) tcp.emplace_back(entry.endpoint());
        reach_locally(
            link, gen, timed_out, local_names(endpoints.begin()->endpoint().address(), port), 0,
            finish, [&link, tcp = std::move(tcp), finish] {
              asio::async_connect(
                  link.socket, tcp,
                  [finish](std::error_code ec2, const auto& /*endpoint*/) mutable { finish(ec2); });
            });
      });
}

inline std::vector<std::string> TcpClient::local_names(const asio::ip::address& address,
                                                       std::uint16_t port) const {
  if (!options_.local_sockets) return {};
  return local_socket_names(address, port);
}

template <class Finish, class OverTcp>
inline void TcpClient::reach_locally(Link& link, std::uint64_t gen, std::shared_ptr<bool> timed_out,
                                     std::vector<std::string> names, std::size_t next,
                                     Finish finish, OverTcp over_tcp) {
#if defined(__linux__)
  if (next < names.size()) {
    link.local = true;
    link.socket = StreamSocket(io_);
    const asio::generic::stream_protocol::endpoint endpoint{
        asio::local::stream_protocol::endpoint(names[next])};
    link.socket.async_connect(endpoint, [this, &link, gen, timed_out, names = std::move(names),
                                         next, finish, over_tcp](std::error_code ec) mutable {
      if (gen != link.generation) return;
      if (!ec || *timed_out) return finish(ec);
      reach_locally(link, gen, timed_out, std::move(names), next + 1, std::move(finish),
                    std::move(over_tcp));
    });
    return;
  }
#else
  (void)gen, (void)timed_out, (void)names, (void)next, (void)finish;
#endif
  if (link.local) link.socket = StreamSocket(io_);
  link.local = false;
  over_tcp();
}

inline void TcpClient::connected(Link& link, std::error_code ec) {
  if (auto done = std::exchange(link.connected, nullptr)) done(ec);
  drop_if_lost(link, ec);
  if (!link.dropped) {  // (a dropped copy's calls went to the other: drop)
    for (PendingPtr& p : std::exchange(link.parked, {})) {
      deliver(*p, unavailable(link));
      p->detach_driver();
    }
  }
  for (const auto& weak : std::exchange(link.awaiting, {})) {
    if (const std::shared_ptr<Pair> pair = weak.lock()) settle(pair);
  }
}

inline void TcpClient::on_handshake(Link& link, const wire::FrameReader::Frame& frame) {
  wire::Handshake message = wire::decode_handshake(frame.header, frame.meta);
  if (!link.challenge) {
    auto* challenge = std::get_if<wire::Challenge>(&message);
    if (challenge == nullptr) throw wire::Malformed("the ps did not open with a challenge");
    if (challenge->job != options_.credentials.job) {
      return refuse(link, "it serves job '" + challenge->job.substr(0, wire::kMaxJobName) +
                              "', and this task belongs to job '" + options_.credentials.job + "'");
    }
    if (challenge->ps != link.task) {
      return refuse(link, "it is ps " + std::to_string(challenge->ps) + ", but is listed as ps " +
                              std::to_string(link.task) + " (are the ps addresses in task order?)");
    }
    if (challenge->nonce.size() != wire::kNonceBytes)
      throw wire::Malformed("a malformed challenge");
    link.challenge = std::move(*challenge);
    link.said = wire::hello_for(options_.credentials, *link.challenge, self_, link.shard);
    link.hello = wire::encode(wire::Handshake{link.said}, 0);
    if (offers_shared_memory(link)) link.hello.header.flags = wire::kSharedMemoryFlag;
    link.write_list.append(link.hello);
    return flush(link);
  }
  if (auto* refusal = std::get_if<wire::Refusal>(&message)) {
    // Its words are quoted, its code is not trusted: whoever answers on the port has
    // proved nothing yet, and must not make a worker believe training finished.
    const std::string said = refusal->reason.substr(0, 1024);
    // kUnavailable only asks for a retry (its task is held by a process still heard):
    // the worst an impostor gets from it is retries until the recovery timeout. So does
    // kFailedPrecondition where this task was let in before: a ps started again in a
    // lost one's place knows the cluster spec's workers only until the chief restores
    // it, so it refuses a worker that joined the job since (the caller waits as for a
    // lost ps). Anything else (another secret, a task taken out) is final.
    if (refusal->code == ErrorCode::kUnavailable ||
        (refusal->code == ErrorCode::kFailedPrecondition && link.ever_connected)) {
      return fail(link, "refused by the ps for now: " + said);
    }
    link.refused =
        ErrorReply{ErrorCode::kUnauthenticated,
                   "ps at " + link.address + " refused the connection: \"" + said + "\""};
    return fail(link, "refused by the ps: " + said);
  }
  auto* welcome = std::get_if<wire::Welcome>(&message);
  if (welcome == nullptr)
    throw wire::Malformed("the ps answered the hello with neither welcome nor refusal");
  if (!wire::welcome_proves(options_.credentials, *link.challenge, link.said, *welcome)) {
    return refuse(link,
                  "it did not prove the job's shared secret (a ps of another job, or a "
                  "wrong PULLEY_SECRET?)");
  }
  if ((frame.header.flags & wire::kSharedMemoryFlag) != 0) {
    if (!offers_shared_memory(link))
      throw wire::Malformed("the ps took an offer of shared memory never made");
    return share_memory(link, welcome->server);
  }
  welcomed(link, welcome->server);
}

inline bool TcpClient::offers_shared_memory(const Link& link) const {
  return link.local && !link.unshared && options_.shared_memory && kSharedRings;
}

inline void TcpClient::share_memory(Link& link, std::uint64_t server) {
#if defined(__linux__)
  link.offered = SharedRing::make(kLinkRingBytes);
  if (!send_fd(link.socket.native_handle(), link.offered ? link.offered.fd() : -1)) {
    return fail(link, "cannot hand the ps the memory it took");
  }
  await_rings(link, server);
#else
  (void)server;
  throw wire::Malformed("the ps took an offer of shared memory never made");
#endif
}

inline void TcpClient::await_rings(Link& link, std::uint64_t server) {
#if defined(__linux__)
  link.receiving = true;  // (no receive may read the ps's answer as frame bytes)
  link.socket.async_wait(asio::socket_base::wait_read, [this, &link, gen = link.generation,
                                                        server](std::error_code ec) {
    if (gen != link.generation) return;
    link.receiving = false;
    if (ec) return fail(link, ec.message());
    int fd = -1;
    const int got = receive_fd(link.socket.native_handle(), fd);
    if (got == 0) return await_rings(link, server);  // (woken for nothing)
    if (got == -2) return fail(link, "the ps closed the connection after its welcome");
    if (got < 0) return fail(link, "the ps answered the memory it took with something else");
    SharedRing in;
    if (fd >= 0) {
      in = SharedRing::open(fd);
      if (!in || in.capacity() > kLinkRingBytes || !link.offered) {
        // The ps uses its rings now: this connection cannot go on, and the next ones
        // to this ps keep their bytes on the socket.
        link.unshared = true;
        return fail(link, "the ps's shared memory is not a ring this side can use");
      }
      link.rings.start(std::move(link.offered), std::move(in), link.socket);
    }
    link.offered = {};
    welcomed(link, server);
    if (gen == link.generation) receive(link);
  });
#else
  (void)link, (void)server;
#endif
}

inline void TcpClient::welcomed(Link& link, std::uint64_t server) {
  link.challenge.reset();
  link.timer.cancel();
  link.state = State::kConnected;
  link.ever_connected = true;
  link.failing_since.reset();
  if (const auto asked = asked_.find(link.task); asked != asked_.end()) asked->second.told = false;
  link.last_active = std::chrono::steady_clock::now();
  link.heard = link.last_active;
  link.asked_since.reset();
  link.reader.set_limits(options_.limits);
  // Another process than the one reached before: it holds nothing of the job. With a
  // copy elsewhere it is dropped (drop ends this attempt); as the last copy it is used,
  // and the job rolls back as without copies.
  if (link.lost != 0 && server == link.lost && !link.dropped && !link.renewing) {
    // A copy served again unreached (reach_again): the process given up is no copy.
    return fail(link,
                "the process given up answers on its address, not the one the chief took back");
  }
  const std::uint64_t before = std::exchange(link.server, server);
  if (options_.replicas == 1 && before != 0 && before != server && !link.renewing &&
      !links_[partner_of(link)]->dropped) {
    link.server = before;  // the process given up (reach_again takes only another)
    if (link.dropped)
      return fail(link, "another process answers on the address of a copy given up");
    return drop(link,
                "another process answers on its address: a ps started in place of a lost one holds "
                "nothing");
  }
  flush(link);  // the receive handler that brought the welcome arms the next receive
  connected(link, {});
}

inline void TcpClient::refuse(Link& link, const std::string& why) {
  const std::string reason = "ps at " + link.address + " cannot be used: " + why;
  link.refused = ErrorReply{ErrorCode::kUnauthenticated, reason};
  fail(link, why);
}

}  // namespace pulley::transport_detail
