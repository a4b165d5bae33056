// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/ring.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

/// A Ring among threads of one process: `InProcessRing::make(n)` gives the n links, one for
/// each thread. A send copies the caller's bytes into a buffer the link recycles, so a rank
/// that fails and drops its tensors leaves nothing its neighbour could read after them; the
/// next rank's receive copies out, and `flush` waits until it has taken everything. A link
/// destroyed (or `leave`d) counts as a lost worker, as a process that dies closes its
/// sockets: its neighbours' waits fail with kUnavailable naming it.
class InProcessRing {
 public:
  /// The links of a ring of `n` ranks (n ≥ 1); a wait for a neighbour gives up after
  /// `timeout` with kDeadlineExceeded.
  static std::vector<InProcessRing> make(std::size_t n,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    if (n == 0) throw Error(ErrorCode::kInvalidArgument, "a ring needs at least one rank");
    auto hub = std::make_shared<Hub>(n, timeout);
    std::vector<InProcessRing> ring;
    ring.reserve(n);
    for (std::size_t r = 0; r < n; ++r) ring.push_back(InProcessRing(hub, r));
    return ring;
  }

  InProcessRing(InProcessRing&&) noexcept = default;
  InProcessRing& operator=(InProcessRing&& other) noexcept {
    if (this != &other) {
      leave();
      hub_ = std::move(other.hub_);
      rank_ = other.rank_;
    }
    return *this;
  }
  InProcessRing(const InProcessRing&) = delete;
  InProcessRing& operator=(const InProcessRing&) = delete;
  ~InProcessRing() { leave(); }

  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t size() const noexcept { return hub_ ? hub_->links.size() : 0; }

  void send(std::span<const std::byte> bytes) {
    Link& out = hub_->links[rank_];
    std::lock_guard lock(out.mutex);
    if (out.closed) throw lost(next());
    if (bytes.empty()) return;
    std::vector<std::byte> copy;
    if (!out.spare.empty()) {
      copy = std::move(out.spare.back());
      out.spare.pop_back();
    }
    copy.assign(bytes.begin(), bytes.end());
    out.queued.push_back(std::move(copy));
    out.changed.notify_all();
  }

  void receive(std::span<std::byte> bytes) {
    Link& in = hub_->links[previous()];
    while (!bytes.empty()) {
      std::span<const std::byte> front;
      {
        std::unique_lock lock(in.mutex);
        wait(in, lock, [&] { return in.closed || !in.queued.empty(); }, previous(), "send");
        if (in.queued.empty()) throw lost(previous());
        front = std::span<const std::byte>(in.queued.front()).subspan(in.offset);
      }
      // Copied outside the lock: only this rank takes from the front of its incoming link.
      const std::size_t n = std::min(front.size(), bytes.size());
      std::memcpy(bytes.data(), front.data(), n);
      bytes = bytes.subspan(n);
      std::lock_guard lock(in.mutex);
      in.offset += n;
      if (in.offset == in.queued.front().size()) {
        in.spare.push_back(std::move(in.queued.front()));
        in.queued.pop_front();
        in.offset = 0;
        in.changed.notify_all();
      }
    }
  }

  void flush() {
    Link& out = hub_->links[rank_];
    std::unique_lock lock(out.mutex);
    wait(out, lock, [&] { return out.closed || out.queued.empty(); }, next(), "receive");
    if (!out.queued.empty()) throw lost(next());
  }

  /// Leaves the ring as a lost worker does: both neighbours' waits on it fail. The link is
  /// unusable afterwards (the destructor does this too).
  void leave() noexcept {
    if (!hub_) return;
    for (Link* link : {&hub_->links[rank_], &hub_->links[previous()]}) {
      std::lock_guard lock(link->mutex);
      link->closed = true;  // what it sent stays readable, as bytes in a socket's buffer do
      link->changed.notify_all();
    }
    hub_.reset();
  }

 private:
  /// The bytes one rank sent the next and the next has not taken yet.
  struct Link {
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<std::vector<std::byte>> queued;
    std::vector<std::vector<std::byte>> spare;  ///< taken buffers, for the next sends
    std::size_t offset = 0;  ///< bytes of queued.front() taken
    bool closed = false;     ///< one of its ends left
  };
  struct Hub {
    Hub(std::size_t n, std::chrono::milliseconds t) : links(n), timeout(t) {}
    std::vector<Link> links;  ///< links[r]: from rank r to rank r + 1
    std::chrono::milliseconds timeout;
  };

  InProcessRing(std::shared_ptr<Hub> hub, std::size_t rank) : hub_(std::move(hub)), rank_(rank) {}

  [[nodiscard]] std::size_t next() const noexcept { return (rank_ + 1) % size(); }
  [[nodiscard]] std::size_t previous() const noexcept { return (rank_ + size() - 1) % size(); }

  template <class Ready>
  void wait(Link& link, std::unique_lock<std::mutex>& lock, Ready ready, std::size_t peer, const char* what) const {
    if (!link.changed.wait_for(lock, hub_->timeout, ready)) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "ring: rank " + std::to_string(rank_) + " waited " + std::to_string(hub_->timeout.count()) +
                      " ms for rank " + std::to_string(peer) + " to " + what);
    }
  }

  [[nodiscard]] Error lost(std::size_t peer) const {
    return Error(ErrorCode::kUnavailable,
                 "ring: rank " + std::to_string(rank_) + " lost its neighbour, rank " + std::to_string(peer));
  }

  std::shared_ptr<Hub> hub_;
  std::size_t rank_ = 0;
};

static_assert(Ring<InProcessRing>);

}  // namespace pulley
