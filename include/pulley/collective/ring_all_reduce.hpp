// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/ring.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

/// The ring all-reduce of seed 004 (section 2) over any Ring: the tensor is cut into as many
/// chunks as ranks; N − 1 reduce-scatter steps leave each rank with the sum of one chunk,
/// and N − 1 all-gather steps pass the sums on, so that every rank ends with the whole sum.
/// Each rank sends 2 (N − 1) / N of the tensor, whatever N.
///
/// Pipelined: a chunk travels in segments, and a segment received is reduced and queued for
/// the next rank at once, while the rest of its chunk is still arriving; the link sends it
/// while the rank waits for the next segment (Ring's contract).
///
/// Replicas stay bit-identical: each chunk's sum is added up by the ranks in one fixed order
/// (starting at the rank whose index is the chunk's) and then copied to every other rank, so
/// every rank ends with the same bits, not merely the same value.
///
/// Each call starts with a 32-byte header naming the call's kind, its number, its size and
/// (a broadcast) its root: ranks that disagree (a rank that missed a call, another tensor
/// size) fail the call with kFailedPrecondition instead of adding unrelated bytes. One
/// RingAllReduce per link: it numbers that link's calls. A call that failed (a lost
/// neighbour, ranks out of step) leaves the ring's streams where nobody can follow them:
/// every later call fails with kFailedPrecondition, and the ring must be formed again.
class RingAllReduce {
 public:
  /// Floats per segment by default: 32 Ki floats, 128 KiB, well inside a socket's buffer,
  /// small enough that the next rank starts forwarding early.
  static constexpr std::size_t kDefaultSegment = std::size_t{32} << 10U;

  /// @param segment floats per segment (at least 1)
  explicit RingAllReduce(std::size_t segment = kDefaultSegment) : segment_(std::max<std::size_t>(segment, 1)) {}

  /// Replaces `data` on every rank by the element-wise sum of every rank's `data`. Every rank
  /// calls it with a tensor of the same size. Throws what the link throws (a lost
  /// neighbour), and `data` is then partly summed: use it for nothing.
  template <Ring R>
  void sum(R& ring, std::span<float> data) {
    guarded([&] { sum_now(ring, data); });
  }

  /// Copies rank `root`'s `data` to every other rank's (the same size on every rank): how a
  /// ring starts its replicas from one set of parameters.
  template <Ring R>
  void broadcast(R& ring, std::span<float> data, std::size_t root) {
    if (root >= ring.size()) {
      throw Error(ErrorCode::kInvalidArgument, "broadcast from rank " + std::to_string(root) +
                                                   " in a ring of " + std::to_string(ring.size()));
    }
    guarded([&] { broadcast_now(ring, data, root); });
  }

  /// Floats per segment.
  [[nodiscard]] std::size_t segment() const noexcept { return segment_; }
  /// Calls made on this link so far (each rank's count is the same in a healthy ring).
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }
  /// Bytes this rank has queued for the next one, headers included.
  [[nodiscard]] std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

 private:
  static constexpr std::uint64_t kMagic = 0x474E4952594C4C50ULL;  // "PLLYRING"
  static constexpr std::uint64_t kSum = 1;
  static constexpr std::uint64_t kBroadcast = 2;

  struct Header {
    std::uint64_t magic = 0;
    std::uint64_t call = 0;  ///< kind in the top byte, the call's number below
    std::uint64_t floats = 0;
    std::uint64_t root = 0;  ///< a broadcast's
  };

  template <class Body>
  void guarded(Body body) {
    if (broken_) {
      throw Error(ErrorCode::kFailedPrecondition, "ring: an earlier call on this link failed: form the ring again");
    }
    try {
      body();
    } catch (...) {
      broken_ = true;
      throw;
    }
  }

  template <Ring R>
  void sum_now(R& ring, std::span<float> data) {
    const std::size_t n = ring.size();
    const std::size_t rank = ring.rank();
    start(ring, kSum, data.size());
    if (n == 1) return;
    scratch_.resize(std::min(segment_, data.size() / n + 1));
    auto chunk = [&](std::size_t c) {
      const std::size_t begin = data.size() * c / n;
      return data.subspan(begin, data.size() * (c + 1) / n - begin);
    };
    send_floats(ring, chunk(rank));
    // Rounds 0 .. n − 2 reduce (chunk rank − 1 − round arrives, partly summed); rounds
    // n − 1 .. 2n − 3 gather (chunk rank − round + n − 1 arrives, whole). Each chunk that
    // arrives goes on to the next rank, but for the last round's.
    for (std::size_t round = 0; round + 2 < 2 * n; ++round) {
      const std::size_t c = (rank + 2 * n - 1 - round) % n;
      const std::span<float> into = chunk(c);
      const bool forward = round + 3 < 2 * n;
      for (std::size_t at = 0; at < into.size(); at += segment_) {
        const std::span<float> part = into.subspan(at, std::min(segment_, into.size() - at));
        if (round + 1 < n) {
          const std::span<float> got(scratch_.data(), part.size());
          receive_floats(ring, got);
          for (std::size_t i = 0; i < part.size(); ++i) part[i] += got[i];
        } else {
          receive_floats(ring, part);
        }
        if (forward) send_floats(ring, part);
      }
    }
    ring.flush();
  }

  template <Ring R>
  void broadcast_now(R& ring, std::span<float> data, std::size_t root) {
    const std::size_t n = ring.size();
    start(ring, kBroadcast, data.size(), root);
    if (n == 1) return;
    const std::size_t rank = ring.rank();
    const bool last = (rank + 1) % n == root;
    for (std::size_t at = 0; at < data.size(); at += segment_) {
      const std::span<float> part = data.subspan(at, std::min(segment_, data.size() - at));
      if (rank != root) receive_floats(ring, part);
      if (!last) send_floats(ring, part);
    }
    ring.flush();
  }

  /// Sends this call's header and checks the previous rank's against it.
  template <Ring R>
  void start(R& ring, std::uint64_t kind, std::size_t floats, std::size_t root = 0) {
    const std::uint64_t call = calls_++;
    if (ring.size() == 1) return;
    header_ = {kMagic, (kind << 56U) | call, floats, root};
    ring.send(std::as_bytes(std::span(&header_, 1)));
    bytes_sent_ += sizeof(Header);
    Header got;
    ring.receive(std::as_writable_bytes(std::span(&got, 1)));
    if (got.magic != kMagic || got.call != header_.call || got.floats != floats || got.root != header_.root) {
      auto say = [](const Header& h) {
        return "call " + std::to_string(h.call & ((std::uint64_t{1} << 56U) - 1)) +
               ((h.call >> 56U) == kSum ? " (sum" : " (broadcast from rank " + std::to_string(h.root)) + " of " +
               std::to_string(h.floats) + " floats)";
      };
      throw Error(ErrorCode::kFailedPrecondition,
                  got.magic != kMagic
                      ? "ring: the previous rank sent no all-reduce header (is it another program?)"
                      : "ring: out of step: rank " + std::to_string(ring.rank()) + " is at " + say(header_) +
                            ", the previous rank at " + say(got));
    }
  }

  template <Ring R>
  void send_floats(R& ring, std::span<const float> values) {
    if (values.empty()) return;
    ring.send(std::as_bytes(values));
    bytes_sent_ += values.size_bytes();
  }

  template <Ring R>
  static void receive_floats(R& ring, std::span<float> values) {
    if (!values.empty()) ring.receive(std::as_writable_bytes(values));
  }

  std::size_t segment_;
  std::vector<float> scratch_;  ///< one segment as it arrives, before it is added
  Header header_;               ///< this call's, alive until the call's flush
  std::uint64_t calls_ = 0;
  std::uint64_t bytes_sent_ = 0;
  bool broken_ = false;  ///< a call failed
};

}  // namespace pulley
