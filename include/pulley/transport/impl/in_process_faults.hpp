// SPDX-License-Identifier: MIT
#pragma once

/// InProcessNetwork's faults and failures (declared in transport/in_process.hpp, which
/// includes this header after the class): requests dropped, replies lost (counted or at
/// random) and the connections they break, delays, kills, a killed ps task served again,
/// and what a task gone answers.

#include "pulley/transport/in_process.hpp"

namespace pulley {

inline void InProcessNetwork::Fabric::drop_next(std::uint32_t ps, std::size_t count,
                                                std::optional<Node> from) {
  std::scoped_lock lock(faults_mutex_);
  drops_.push_back({ps, count, from});
}

inline void InProcessNetwork::Fabric::lose_replies(std::uint32_t ps, std::size_t count,
                                                   std::optional<Node> from) {
  std::scoped_lock lock(faults_mutex_);
  reply_losses_.push_back({ps, count, from});
}

inline void InProcessNetwork::Fabric::lose_replies_at_random(std::uint32_t ps, double probability,
                                                             std::uint64_t seed,
                                                             std::optional<Node> from) {
  std::scoped_lock lock(faults_mutex_);
  std::erase_if(random_losses_, [&](const RandomLoss& r) { return r.ps == ps && r.from == from; });
  if (probability > 0.0) random_losses_.push_back({ps, probability, from, std::mt19937_64(seed)});
}

inline bool InProcessNetwork::Fabric::is_broken(std::uint64_t session) const {
  if (!any_broken_.load(std::memory_order_acquire)) return false;
  std::scoped_lock lock(faults_mutex_);
  return broken_.contains(session);
}

inline void InProcessNetwork::Fabric::set_delay(Node node, std::chrono::microseconds delay) {
  std::scoped_lock lock(faults_mutex_);
  delays_[node] = delay;
}

inline void InProcessNetwork::Fabric::kill(Node node) {
  {
    std::scoped_lock lock(faults_mutex_);
    dead_[node] = true;
  }
  if (node.role != Node::Role::kPs) {
    // Its connections break: what it sent and no ps handled yet is lost, and every ps
    // hears that it left, as a TCP ps would. (handle() refuses what slips past.)
    for (auto& box : mailboxes_) {
      std::scoped_lock lock(box->serving, box->mutex);
      std::erase_if(box->queue, [&](Envelope& e) {
        if (e.from != node) return false;
        e.call->complete(unavailable(node.name() + " is unavailable (killed)"));
        return true;
      });
      if (box->host && !box->closed) box->host->disconnected(node, 0);
    }
    return;
  }
  if (node.index >= num_ps()) return;
  Mailbox& box = *mailboxes_[node.index];
  std::scoped_lock lock(box.mutex);
  box.killed = true;
  fail_held(box, node.name() + " is unavailable (killed)");
  box.wake.notify_all();
}

inline void InProcessNetwork::Fabric::restart(std::unique_ptr<Host> host) {
  const std::uint32_t task = host->task();
  if (task >= num_ps() || !is_dead(Node::ps(task))) {
    throw Error(ErrorCode::kFailedPrecondition,
                "ps task " + std::to_string(task) + " was not killed: nothing to restart");
  }
  Mailbox& box = *mailboxes_[task];
  for (;;) {  // the killed task's thread sees the kill and ends
    std::scoped_lock lock(box.mutex);
    if (!box.thread_running) break;
    box.wake.notify_all();
    std::this_thread::yield();
  }
  std::unique_ptr<Host> old;
  {
    std::scoped_lock lock(box.serving, box.mutex);
    if (box.closed) return;
    old = std::exchange(box.host, std::move(host));
    box.killed = false;
    box.stopped = false;
    box.thread_running = true;
  }
  {
    std::scoped_lock lock(faults_mutex_);
    dead_[Node::ps(task)] = false;
  }
  std::scoped_lock lock(threads_mutex_);
  threads_.emplace_back([this, &box, task] { run(box, task); });
}

inline bool InProcessNetwork::Fabric::is_dead(Node node) const {
  std::scoped_lock lock(faults_mutex_);
  auto it = dead_.find(node);
  return it != dead_.end() && it->second;
}

inline std::optional<std::string> InProcessNetwork::Fabric::gone_reason(const Mailbox& box,
                                                                        std::uint32_t ps) {
  if (box.closed) return "the in-process network was shut down";
  if (box.killed) return Node::ps(ps).name() + " is unavailable (killed)";
  return std::nullopt;
}

inline void InProcessNetwork::Fabric::fail_held(Mailbox& box, const std::string& why) {
  for (Envelope& e : std::exchange(box.queue, {})) e.call->complete(unavailable(why));
  for (const CallPtr& c : std::exchange(box.in_service, {})) c->complete(unavailable(why));
}

inline std::chrono::microseconds InProcessNetwork::Fabric::delay_of(Node node) const {
  std::scoped_lock lock(faults_mutex_);
  auto it = delays_.find(node);
  return it == delays_.end() ? std::chrono::microseconds{0} : it->second;
}

inline bool InProcessNetwork::Fabric::take_reply_loss(std::uint32_t ps, Node from) {
  if (take_rule(reply_losses_, ps, from)) return true;
  std::scoped_lock lock(faults_mutex_);
  for (RandomLoss& r : random_losses_) {
    if (r.ps == ps && (!r.from || *r.from == from) &&
        std::uniform_real_distribution<double>(0.0, 1.0)(r.rng) < r.probability) {
      return true;
    }
  }
  return false;
}

inline bool InProcessNetwork::Fabric::take_rule(std::vector<DropRule>& rules, std::uint32_t ps,
                                                Node from) {
  std::scoped_lock lock(faults_mutex_);
  for (DropRule& rule : rules) {
    if (rule.ps == ps && rule.remaining > 0 && (!rule.from || *rule.from == from)) {
      --rule.remaining;
      std::erase_if(rules, [](const DropRule& r) { return r.remaining == 0; });
      return true;
    }
  }
  return false;
}

inline void InProcessNetwork::Fabric::break_session(std::uint64_t session) {
  std::scoped_lock lock(faults_mutex_);
  broken_.insert(session);
  any_broken_.store(true, std::memory_order_release);
}

}  // namespace pulley
