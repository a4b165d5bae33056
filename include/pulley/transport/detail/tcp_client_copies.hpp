// SPDX-License-Identifier: MIT
#pragma once

/// TcpClient's copies of each shard (declared in detail/tcp_client.hpp, which includes this
/// header after the class): where each copy is (placed by the job's membership, moved, its
/// link renumbered), where a call goes, and which copies are whole or given up. How the
/// answers of both copies settle is in tcp_client_pairs.hpp; a copy lost, given up and
/// served again, in tcp_client_losses.hpp.

#include "pulley/transport/detail/tcp_client.hpp"

namespace pulley::transport_detail {

inline void TcpClient::renumber_copies(std::ptrdiff_t by) {
  const std::size_t first = shards_;  // (their place now)
  std::set<Pending*> calls;
  std::set<Pair*> pairs;
  const auto note = [&](const PendingPtr& p) {
    if (!p) return;
    calls.insert(p.get());
    if (p->pair) pairs.insert(p->pair.get());
  };
  for (const auto& link : links_) {
    for (const auto& [id, p] : link->pending) note(p);
    for (const auto* list : {&link->outbox, &link->writing}) {
      for (const PendingPtr& p : *list) note(p);
    }
    for (const auto* list : {&link->parked, &link->parked_next}) {
      for (const PendingPtr& p : *list) note(p);
    }
    note(link->reading);
    for (const auto& weak : link->awaiting) {
      if (const std::shared_ptr<Pair> pair = weak.lock()) pairs.insert(pair.get());
    }
  }
  for (const auto& weak : graced_) {
    if (const std::shared_ptr<Pair> pair = weak.lock()) pairs.insert(pair.get());
  }
  const auto moved = [&](std::size_t& index) {
    if (index >= first) index = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(index) + by);
  };
  for (Pending* p : calls) moved(p->ps);
  for (Pair* pair : pairs) {
    for (std::size_t& index : pair->links) moved(index);
  }
}

inline void TcpClient::place_copies(std::span<const std::uint32_t> members) {
  if (options_.replicas == 0) return;
  if (members.size() < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                "a job whose ps tasks keep copies of each other's shards (--ps-replicas 1) "
                "keeps 2 ps tasks "
                "or more: each copy is on another ps than its shard's own");
  }
  if (!std::is_sorted(members.begin(), members.end()) || members.back() >= shards_) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "the job's ps tasks must be ascending task indices below " + std::to_string(shards_));
  }
  members_.assign(members.begin(), members.end());
  for (std::uint32_t shard = 0; shard < shards_; ++shard) {
    const std::uint32_t holder = copy_holder(members, shard);
    Link& link = *links_[link_of(shard, 1)];
    if (link.task != holder) move_copy(link, shard, holder);
    // No member: its own ps alone (a courtesy Shutdown reaches it), never a Pair.
    if (holder == shard) link.dropped = true;
  }
}

inline bool TcpClient::copies_whole() const {
  // A shard with a copy given up since is served by the other alone: whole for writes.
  for (std::size_t k = 0; k < ready_alone_.size(); ++k) {
    if (ready_alone_[k] && !links_[link_of(k, 0)]->dropped && !links_[link_of(k, 1)]->dropped)
      return false;
  }
  return true;
}

inline std::vector<std::uint32_t> TcpClient::given_up() const {
  std::vector<std::uint32_t> tasks;
  for (const auto& link : links_) {
    if (link->dropped && member(link->task)) tasks.push_back(link->task);
  }
  std::sort(tasks.begin(), tasks.end());
  tasks.erase(std::unique(tasks.begin(), tasks.end()), tasks.end());
  return tasks;
}

inline bool TcpClient::given_up_whole(std::uint32_t ps) const {
  if (!member(ps)) return false;
  bool any = false;
  for (const auto& link : links_) {
    if (link->task != ps) continue;
    if (!link->dropped) return false;  // (the last copy of its shard, say)
    any = true;
  }
  return any;
}

inline void TcpClient::log_copies(LogLevel level, const std::string& line) const {
  if (options_.logs_copies) log(level, line);
}

inline TcpClient::Spread TcpClient::spread_of(const Request& request) const noexcept {
  if (std::holds_alternative<WaitReady>(request)) return Spread::kBothReady;
  if (std::holds_alternative<PullRows>(request)) {  // a worker's creates rows: both copies must
    return self_.role == Node::Role::kWorker ? Spread::kBoth : Spread::kOne;
  }
  // A pull for a step waits for both copies to complete it: no worker then pushes for the
  // next step before both took every push of this one (each completes steps on its own).
  if (const auto* pull = std::get_if<Pull>(&request))
    return pull->min_step > 0 ? Spread::kGate : Spread::kOne;
  // A heartbeat reaches both copies a ps process holds (ShardCopies hands it to each).
  if (std::holds_alternative<TakeToken>(request) || std::holds_alternative<Heartbeat>(request) ||
      std::holds_alternative<GetStats>(request) || std::holds_alternative<ReadState>(request) ||
      std::holds_alternative<ReadRows>(request)) {
    return Spread::kOne;
  }
  return Spread::kBoth;
}

inline std::size_t TcpClient::link_of(std::size_t shard, std::size_t copy) const noexcept {
  return copy == 0 ? shard : shards_ + shard;
}

inline void TcpClient::move_copy(Link& link, std::uint32_t shard, std::uint32_t holder) {
  std::error_code ignored;
  link.socket.set_option(asio::socket_base::linger(true, 0), ignored);
  link.dropped = true;  // (no attempt at the old ps follows; Pairs settle without it)
  fail(link, "ps " + std::to_string(shard) + "'s copy moved to ps " + std::to_string(holder));
  fail_all(link, false);  // calls queued on a link that was broken already
  for (auto* list : {&link.parked, &link.parked_next}) {
    for (PendingPtr& p : std::exchange(*list, {})) {
      deliver(*p, unavailable(link));
      p->detach_driver();
    }
  }
  for (const auto& weak : std::exchange(link.awaiting, {})) {
    if (const std::shared_ptr<Pair> pair = weak.lock()) settle(pair);
  }
  const Link& at = *links_[holder];
  if (holder != shard) {  // (a ps that is no member has no copy: nothing to say)
    log_copies(LogLevel::kInfo, self_.name() + ": ps " + std::to_string(shard) +
                                    "'s copy is held by ps " + std::to_string(holder) + " at " +
                                    at.address + " now (was ps " + std::to_string(link.task) + ")");
  }
  link.task = holder;
  link.address = at.address;
  link.host = at.host;
  link.port = at.port;
  link.local = false;
  link.server = 0;
  link.lost = 0;
  link.renewed = false;
  link.refused.reset();
  link.failing_since = std::chrono::steady_clock::now();
  link.ever_connected = at.ever_connected;
  link.dropped = false;
  ready_alone_.at(shard) = false;
}

inline bool TcpClient::member(std::uint32_t ps) const {
  return members_.empty() || std::binary_search(members_.begin(), members_.end(), ps);
}

inline std::size_t TcpClient::index_of(const Link& link) const {
  for (std::size_t i = 0; i < links_.size(); ++i) {
    if (links_[i].get() == &link) return i;
  }
  return 0;
}

inline std::size_t TcpClient::partner_of(const Link& link) const {
  const std::size_t index = index_of(link);
  return index < shards_ ? shards_ + index : index - shards_;
}

}  // namespace pulley::transport_detail
