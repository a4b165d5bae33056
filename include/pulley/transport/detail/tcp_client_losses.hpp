// SPDX-License-Identifier: MIT
#pragma once

/// TcpClient's copies lost and taken back (declared in detail/tcp_client.hpp, which includes
/// this header after the class): a copy dropped when lost for good or asked of the referee
/// first, the referee's rulings, a copy given up, and the copies of a ps reached and served
/// again.

#include "pulley/transport/detail/tcp_client.hpp"

namespace pulley::transport_detail {

inline bool TcpClient::reach_again(std::uint32_t ps, bool serve, bool unreached_too) {
  if (options_.replicas == 0) return false;
  std::vector<Link*> copies;
  for (const auto& link : links_) {
    if (link->task == ps) copies.push_back(link.get());
  }
  std::stable_partition(copies.begin(), copies.end(),
                        [](const Link* link) { return link->dropped; });
  if (copies.empty() || !copies.front()->dropped) return false;
  const auto deadline = std::chrono::steady_clock::now() +
                        (serve ? options_.copy_grace : std::chrono::milliseconds(0));
  std::uint64_t fresh = 0;  // the process started in the lost one's place
  for (Link* link : copies) {
    if (!link->dropped) {
      drop(*link,
           "another copy ps " + std::to_string(ps) + " held was given up: its process is gone");
      if (!link->dropped) continue;  // the last copy of its shard: left as it is
    }
    if (link->state == State::kConnected && link->renewed &&
        (fresh == 0 || link->server == fresh)) {
      fresh = link->server;  // reached it already
      continue;
    }
    link->renewed = false;
    fail(*link, "reached again");
    for (auto backoff = options_.initial_backoff;;
         backoff = std::min(backoff * 2, std::chrono::milliseconds(1000))) {
      link->renewing = true;
      bool done = false;
      std::error_code attempt;
      connect(*link, [&](std::error_code ec) {
        done = true;
        attempt = ec;
      });
      while (!done) io_.run_one();
      link->renewing = false;
      if (link->state == State::kConnected) break;
      if (link->refused || attempt == asio::error::connection_refused ||
          std::chrono::steady_clock::now() + backoff > deadline) {
        if (serve && unreached_too) break;  // served unreached (above)
        not_back(*link, link->broken_reason);
        return false;  // not there, or gone again: the next look tries again
      }
      std::this_thread::sleep_for(backoff);
    }
    if (link->state != State::kConnected) {
      link->server = 0;  // the next process it reaches is taken, but the one given up
      continue;
    }
    // A copy given up unreached knows no process given up: the referee does.
    if (link->lost == 0 && fresh == 0 && reached_ruled_lost(*link)) link->lost = link->server;
    if ((link->lost != 0 && link->server == link->lost) || (fresh != 0 && link->server != fresh)) {
      // The very process given up (alive but cut off: its copies are old), or yet
      // another since: nothing served.
      fail(*link, "not the process taken back");
      if (!serve || !unreached_too) {
        not_back(*link, fresh != 0 && link->server != fresh
                            ? "another process than its other link's answers there"
                            : "the process given up answers there (its copies are old)");
        return false;
      }
      link->server = 0;
      continue;
    }
    fresh = link->server;
    link->renewed = true;
    link->not_back.clear();
  }
  if (serve) serve_again(ps);
  return true;
}

inline void TcpClient::not_back(Link& link, const std::string& why) {
  if (link.not_back == why) return;  // said already: the next look is every 2 s or so
  link.not_back = why;
  log_copies(LogLevel::kInfo, self_.name() + ": ps " + std::to_string(link.task) + " at " +
                                  link.address + " is not reached again yet: " + why);
}

inline void TcpClient::serve_again(std::uint32_t ps) {
  for (const auto& link : links_) {
    if (!link->dropped || link->task != ps) continue;
    link->dropped = false;
    if (link->server != 0)
      link->lost = 0;  // (one served unreached still refuses the process given up)
    link->renewed = false;
    link->failing_since.reset();
    const std::size_t shard = index_of(*link) % shards_;
    log_copies(LogLevel::kInfo,
               self_.name() + ": ps " + std::to_string(shard) +
                   "'s shard is served by two copies again (ps " + std::to_string(link->task) +
                   " at " + link->address + " holds one again" +
                   (link->server == 0 ? "; not reached yet: this task waits for it" : "") + ")");
    if (link->server == 0) link->failing_since = std::chrono::steady_clock::now();
  }
}

inline void TcpClient::give_up(std::uint32_t ps, const std::string& why) {
  for (const auto& link : links_) {
    if (link->task != ps) continue;
    link->renewed = false;
    drop(*link, why);
  }
}

inline void TcpClient::drop(Link& link, const std::string& why, bool lost) {
  if (link.dropped || options_.replicas == 0) return;
  const std::size_t index = index_of(link);
  const std::size_t shard = index % shards_;
  const std::size_t other = partner_of(link);
  if (links_[other]->dropped) return;  // the last copy: waited for as a ps without copies
  link.dropped = true;
  link.lost = lost ? link.server : 0;
  log_copies(LogLevel::kWarning, self_.name() + ": dropping the copy of ps " +
                                     std::to_string(shard) + "'s shard held by ps " +
                                     std::to_string(link.task) + " at " + link.address + " (" +
                                     why + "): it is served by the copy at " +
                                     links_[other]->address + " alone from now on");
  // Closed with a reset, not a FIN: what the kernel still holds to send (held back by
  // a silent cut, delivered when it heals) is discarded, so nothing this task sent
  // before reaches a process it gave up (a chief's request would renew its lease). Over
  // TCP only: on one host (a local socket, shared memory) what was sent is still read by
  // a process that was only stopped, as there is no cut to heal.
  std::error_code ignored;
  link.socket.set_option(asio::socket_base::linger(true, 0), ignored);
  fail(link, "dropped: " + why);  // what it sent waits in parked_next
  Link& to = *links_[other];
  std::vector<PendingPtr> moved;
  for (auto& [id, out] : std::exchange(link.pending, {})) moved.push_back(out);
  link.outbox.clear();
  for (auto* list : {&link.parked, &link.parked_next}) {
    for (PendingPtr& out : std::exchange(*list, {})) moved.push_back(std::move(out));
  }
  std::vector<std::shared_ptr<Pair>> halves;  // no longer waited for
  for (PendingPtr& out : moved) {
    if (out->pair) {
      halves.push_back(out->pair);
      continue;
    }
    out->ps = other;
    out->sent = false;
    to.pending.emplace(out->frame.header.call, out);
    to.outbox.push_back(std::move(out));
  }
  if (to.state == State::kBroken) {
    connect(to, [](std::error_code) {});
  } else {
    flush(to);  // the caller may be waiting already
    receive(to);
  }
  for (const auto& pair : halves) settle(pair);
}

inline void TcpClient::drop_if_lost(Link& link, std::error_code ec) {
  if (!ec || options_.replicas == 0 || !link.ever_connected || link.dropped || closing_) return;
  const bool refused = ec == asio::error::connection_refused;
  if (refused || (link.failing_since && std::chrono::steady_clock::now() - *link.failing_since >=
                                            options_.copy_timeout)) {
    std::string why =
        refused ? "its address refuses connections"
                : "out of reach for " + std::to_string(options_.copy_timeout.count()) + " ms";
    if (options_.copy_referee) return ask_referee(link, std::move(why));
    drop(link, why);
  }
}

inline void TcpClient::watch_silence() {
  if (options_.replicas == 0 || watching_ || closing_) return;
  watching_ = true;
  watch_.expires_after(std::max<std::chrono::milliseconds>(options_.copy_timeout / 4,
                                                           std::chrono::milliseconds(10)));
  watch_.async_wait([this](std::error_code ec) {
    watching_ = false;
    if (ec || closing_) return;
    look_at_silence();
    for (const auto& link : links_) {
      if (!link->pending.empty()) return watch_silence();
    }
  });
}

inline void TcpClient::look_at_silence() {
  const auto now = std::chrono::steady_clock::now();
  const auto half = options_.copy_timeout / 2;
  std::vector<std::uint32_t> said;  // processes logged in this look (one line each)
  for (std::size_t index = 0; index < links_.size(); ++index) {
    Link& link = *links_[index];
    if (link.state != State::kConnected || link.dropped || link.pending.empty() ||
        links_[partner_of(link)]->dropped || now - link.heard < half) {
      link.asked_since.reset();  // answering, idle, or the last copy (waited for as one)
      continue;
    }
    // Bytes that came while no caller waited (nothing read them yet) are heard: this side
    // was away, not the ps silent.
    std::error_code ec;
    if (link.rings.active() ? link.rings.has_data() : link.socket.available(ec) > 0) {
      link.heard = now;
      link.asked_since.reset();
      continue;
    }
    if (!link.asked_since) {
      link.asked_since = now;
      queue(link, std::make_shared<Pending>(this, index), Request{GetStats{}});
      flush(link);
      receive(link);
      continue;
    }
    if (now - link.heard < options_.copy_timeout || now - *link.asked_since < half) continue;
    const auto silent =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - link.heard).count();
    const auto since = link.heard;
    if (std::find(said.begin(), said.end(), link.task) == said.end()) {
      said.push_back(link.task);
      log_copies(LogLevel::kWarning,
                 self_.name() + ": ps " + std::to_string(link.task) + " at " + link.address +
                     " has sent nothing for " + std::to_string(silent) +
                     " ms, though asked a question it answers at once: its process may be "
                     "stopped or hung, and its connections end as lost ones do");
    }
    fail(link, "silent for " + std::to_string(silent) + " ms (a process stopped or hung?)");
    link.failing_since = since;  // out of reach since its last byte
  }
}

inline void TcpClient::ask_referee(Link& link, std::string why) {
  if (links_[partner_of(link)]->dropped) return;  // the last copy of a shard: waited for
  Asked& asked = asked_[link.task];
  const auto now = std::chrono::steady_clock::now();
  if (asked.in_flight || now - asked.answered < kAskAgainAfter) return;
  asked.in_flight = true;
  if (!std::exchange(asked.told, true)) {
    log_copies(LogLevel::kWarning,
               self_.name() + ": ps " + std::to_string(link.task) + " at " + link.address + ": " +
                   why +
                   "; asks the chief whether it is lost for the job (until then, waits for it)");
  }
  std::shared_ptr<Rulings> box = rulings_;
  options_.copy_referee(LostProcess{link.task, link.server, why},
                        [box, task = link.task, process = link.server, why](bool lost) {
                          const std::scoped_lock lock(box->mutex);
                          if (box->client == nullptr) return;
                          TcpClient* client = box->client;
                          asio::post(client->io_, [client, task, process, why, lost] {
                            client->ruled(task, process, why, lost);
                          });
                        });
}

inline void TcpClient::ruled(std::uint32_t task, std::uint64_t process, const std::string& why,
                             bool lost) {
  Asked& asked = asked_[task];
  asked.in_flight = false;
  asked.answered = std::chrono::steady_clock::now();
  if (!lost) return;
  for (const auto& link : links_) {
    // (A link that reached another process since, one the chief took back, stays.)
    if (link->task == task && !link->dropped && (process == 0 || link->server == process)) {
      drop(*link, why + "; the chief ruled it lost for the job");
    }
  }
}

inline std::optional<bool> TcpClient::ask_referee_now(
    std::uint32_t task, std::uint64_t process, const std::string& why,
    std::chrono::steady_clock::time_point deadline, bool reached) {
  auto promise = std::make_shared<std::promise<bool>>();  // (an answer after the deadline
  std::future<bool> ruling = promise->get_future();       // is dropped with it)
  options_.copy_referee(LostProcess{task, process, why, reached},
                        [promise](bool lost) { promise->set_value(lost); });
  if (ruling.wait_until(deadline) != std::future_status::ready) return std::nullopt;
  return ruling.get();
}

inline bool TcpClient::ruled_lost_now(const Link& link, const std::string& why) {
  const auto deadline =
      std::chrono::steady_clock::now() + options_.copy_timeout + 4 * options_.attempt_timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    const std::optional<bool> lost = ask_referee_now(link.task, 0, why, deadline);
    if (!lost) return false;
    if (*lost) return true;
    std::this_thread::sleep_for(kAskAgainAfter);
  }
  return false;
}

inline bool TcpClient::reached_ruled_lost(const Link& link) {
  if (!options_.copy_referee || link.server == 0) return false;
  const auto deadline =
      std::chrono::steady_clock::now() + 2 * options_.attempt_timeout + std::chrono::seconds(1);
  return ask_referee_now(link.task, link.server,
                         "reached after it was out of reach: is it the process given up?", deadline,
                         true)
      .value_or(false);
}

}  // namespace pulley::transport_detail
