// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/core/detail/finite.hpp"
#include "pulley/core/magnitude.hpp"
#include "pulley/transport/wire/frame.hpp"

namespace pulley::wire {

/// Bytes that the readers of one process side (a ps's connections) may hold together: their
/// receive buffers, large payloads, and what their owner charges to it (copies of unsent
/// replies). Single-threaded, like the I/O that uses it.
class MemoryBudget {
 public:
  /// @param limit bytes that may be held at once
  explicit MemoryBudget(std::uint64_t limit) noexcept : limit_(limit) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  /// Takes `n` bytes if they fit; otherwise asks `reclaim` (when set) to give back what is
  /// held but idle, and tries once more. False if they still do not fit.
  bool take(std::uint64_t n) {
    if (fits(n)) return used_ += n, true;
    if (reclaim) reclaim();
    if (fits(n)) return used_ += n, true;
    return false;
  }
  /// Gives back `n` bytes taken earlier.
  void give(std::uint64_t n) noexcept {
    assert(n <= used_ && "a MemoryBudget was given back more than was taken");
    used_ -= std::min(n, used_);
  }

  [[nodiscard]] std::uint64_t used() const noexcept { return used_; }
  [[nodiscard]] std::uint64_t limit() const noexcept { return limit_; }

  /// Called when a take does not fit: frees what is held but not in use (e.g.
  /// `FrameReader::release_idle` on every reader).
  std::function<void()> reclaim;

 private:
  [[nodiscard]] bool fits(std::uint64_t n) const noexcept { return n <= limit_ - std::min(used_, limit_); }

  std::uint64_t limit_;
  std::uint64_t used_ = 0;
};

/// Cuts a received byte stream into frames (frame.hpp) with as few receive calls as it can.
/// Small frames arrive many at a time in one buffer and are handed out in place; a payload
/// too large for that buffer is received straight into its destination: the pull targets
/// the owner routes it to, or a payload buffer that grows only as bytes arrive (so a header
/// claiming gigabytes costs nothing until they come).
///
/// It does no I/O: the owner receives into `buffers()`, reports with `commit(n)`, and takes
/// the frames that completed with `next()`. Every header is checked (`check`) before
/// anything is allocated for its frame; a bad one throws Malformed. With a MemoryBudget,
/// every byte it allocates is charged to it first, and a frame that would overdraw it
/// throws Malformed instead.
class FrameReader {
 public:
  /// A complete frame. Its views stay valid until the next `next()` or `buffers()`.
  struct Frame {
    Header header;
    std::span<const char> meta;
    std::span<const float> payload;  ///< empty when routed: the floats are in the targets
    bool routed = false;             ///< the payload went to the targets `route` gave
    /// Every payload float was checked finite as it arrived (payloads received into the
    /// growing buffer only: they are the ones too large to check again cheaply).
    bool finite = false;
    /// With `finite`: no payload float is larger in magnitude (kOrdinaryMagnitude when
    /// all were below it, else +infinity: not known).
    float largest = std::numeric_limits<float>::infinity();
  };

  /// @param buffer_bytes the receive buffer: frames up to this size come in place, many per
  ///                     receive; larger payloads go straight to their destination
  /// @param budget       charged for what it allocates (null: unbounded); must outlive it
  explicit FrameReader(FrameLimits limits, std::size_t buffer_bytes = std::size_t{64} << 10U,
                       MemoryBudget* budget = nullptr)
      : limits_(limits), budget_(budget) {
    charge(buffer_bytes);
    try {
      buffer_.resize(buffer_bytes / sizeof(float));
    } catch (...) {
      if (budget_ != nullptr) budget_->give(buffer_bytes);
      throw;
    }
  }
  FrameReader(const FrameReader&) = delete;
  FrameReader& operator=(const FrameReader&) = delete;
  ~FrameReader() {
    if (budget_ != nullptr) budget_->give(buffer_.size() * sizeof(float) + own_capacity_ * sizeof(float));
  }

  /// What frames may claim from now on (a ps lets a client past its handshake).
  void set_limits(const FrameLimits& limits) noexcept { limits_ = limits; }

  /// True while a frame has begun and is not complete: bytes of it arrived, or its payload
  /// is being received outside the buffer.
  [[nodiscard]] bool mid_frame() const noexcept { return direct_ || end_ > begin_; }
  /// The payload bytes of the frame in progress, once its header is in (else 0).
  [[nodiscard]] std::uint64_t frame_payload() const noexcept {
    if (direct_) return header_.payload_bytes;
    if (end_ - begin_ < sizeof(Header)) return 0;
    Header h;
    std::memcpy(&h, reinterpret_cast<const std::byte*>(buffer_.data()) + begin_, sizeof h);
    return h.payload_bytes;
  }
  /// Frees the large-payload buffer kept from earlier frames, unless a payload is being
  /// received into it, or the last frame handed out views it (until the next `next()` or
  /// `buffers()`).
  void release_idle() noexcept {
    if ((direct_ && !routed_) || !own_ || own_viewed_ || growing_) return;
    release_own();
  }

  /// Where the next received bytes go: the buffer, or while a payload is received outside
  /// it, the rest of its destination and then the buffer (so the frames after a large
  /// payload come with its last bytes). Never empty.
  std::span<const std::span<std::byte>> buffers() {
    own_viewed_ = false;
    scatter_size_ = 0;
    if (direct_) {
      std::uint64_t skip = direct_done_;
      std::uint64_t listed = direct_done_;  // payload bytes received or listed
      for (std::span<float> t : direct_targets()) {
        const std::span<std::byte> bytes = std::as_writable_bytes(t);
        if (skip >= bytes.size()) {
          skip -= bytes.size();
          continue;
        }
        if (scatter_size_ + 1 == scatter_.size()) break;  // keep one for the buffer
        scatter_[scatter_size_++] = bytes.subspan(static_cast<std::size_t>(skip));
        listed += bytes.size() - skip;
        skip = 0;
      }
      // The buffer's free end, after the head kept for the frame in progress; only once the
      // destination's last span is in the list, or bytes would land out of order.
      if (listed == header_.payload_bytes && end_ < capacity()) {
        scatter_[scatter_size_++] = std::span<std::byte>(bytes() + end_, capacity() - end_);
      }
      return {scatter_.data(), scatter_size_};
    }
    if (begin_ > 0) {  // a frame begun (typically a few bytes, or none) moves to the front
      std::memmove(bytes(), bytes() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    scatter_[scatter_size_++] = std::span<std::byte>(bytes() + end_, capacity() - end_);
    return {scatter_.data(), scatter_size_};
  }

  /// `n` bytes arrived in `buffers()`.
  void commit(std::size_t n) {
    if (!direct_) {
      end_ += n;
      return;
    }
    const std::uint64_t left = header_.payload_bytes - direct_done_;
    const auto to_payload = static_cast<std::size_t>(std::min<std::uint64_t>(n, left));
    direct_done_ += to_payload;
    end_ += n - to_payload;  // the next frames, in the buffer
    if (!routed_) arrived_in_own();
  }

  /// The next complete frame, or nullopt when more bytes are needed. `route(header, meta)`
  /// is asked once per frame with a payload, when its head is in: it returns the spans the
  /// payload goes to (a `std::span<const std::span<float>>` that stays valid until the frame
  /// is complete), or an empty one to keep it here. Throws Malformed for a frame that
  /// breaks the protocol or the limits, or whose payload is not the size of its targets.
  template <class Route>
  std::optional<Frame> next(Route&& route) {
    own_viewed_ = false;
    if (direct_) {
      if (direct_done_ < header_.payload_bytes) return std::nullopt;
      return finish_direct();
    }
    const std::size_t available = end_ - begin_;
    if (available < sizeof(Header)) return std::nullopt;
    std::memcpy(&header_, bytes() + begin_, sizeof header_);
    check(header_, limits_);
    const std::size_t head = static_cast<std::size_t>(head_bytes(header_));
    if (head > capacity()) grow_buffer(head);  // a large metadata: bounded by the limits
    if (available < head) return std::nullopt;
    const std::span<const char> meta(
        reinterpret_cast<const char*>(bytes()) + begin_ + sizeof(Header), header_.meta_bytes);
    const std::uint64_t payload = header_.payload_bytes;
    const std::size_t buffered =
        static_cast<std::size_t>(std::min<std::uint64_t>(available - head, payload));
    if (payload > 0 && !asked_) {
      asked_ = true;
      targets_ = route(header_, meta);
    }
    if (!targets_.empty()) {  // straight into the targets, starting with what is here
      std::uint64_t total = 0;
      for (std::span<float> t : targets_) total += t.size_bytes();
      if (total != payload) throw Malformed("a payload of another size than its targets");
      scatter_copy(bytes() + begin_ + head, buffered);
      return start_direct(head, buffered, true);
    }
    if (head + payload <= capacity()) {  // in place, once it is all here
      if (available < head + payload) return std::nullopt;
      const std::span<const float> values(reinterpret_cast<const float*>(bytes() + begin_ + head),
                                          static_cast<std::size_t>(payload / sizeof(float)));
      begin_ += head + static_cast<std::size_t>(payload);
      asked_ = false;
      return Frame{header_, meta, values, false, false};
    }
    // Too large for the buffer: into the growing payload buffer.
    direct_done_ = buffered;
    checked_ = 0;
    ordinary_ = finite_ = true;
    grow_own(false);  // a new frame: nothing in the buffer is worth keeping
    std::memcpy(own_.get(), bytes() + begin_ + head, buffered);
    arrived_in_own();
    return start_direct(head, buffered, false);
  }

  /// Bytes of the payload being received outside the buffer still to come; 0 when none is.
  [[nodiscard]] std::uint64_t payload_left() const noexcept {
    return direct_ ? header_.payload_bytes - direct_done_ : 0;
  }

  /// Frame views handed out so far stay valid; what is buffered is dropped (a reconnect).
  void reset() {
    begin_ = end_ = 0;
    direct_ = routed_ = asked_ = false;
    targets_ = {};
  }

 private:
  static constexpr std::size_t kChunkFloats = (std::size_t{1} << 20U) / sizeof(float);

  std::byte* bytes() noexcept { return reinterpret_cast<std::byte*>(buffer_.data()); }
  std::size_t capacity() const noexcept { return buffer_.size() * sizeof(float); }

  std::span<const std::span<float>> direct_targets() {
    if (routed_) return targets_;
    const auto floats = static_cast<std::size_t>(header_.payload_bytes / sizeof(float));
    own_target_[0] = std::span<float>(own_.get(), std::min(own_capacity_, floats));
    return {own_target_.data(), 1};
  }

  /// Checks the floats that arrived in own_ while they are in cache, and grows it for what
  /// is to come.
  void arrived_in_own() {
    const auto arrived = static_cast<std::size_t>(direct_done_ / sizeof(float));
    // One pass finds them all ordinary (so finite), as a gradient nearly always is; from
    // the first chunk that is not, each is checked for finiteness alone.
    const std::span<const float> fresh(own_.get() + checked_, arrived - checked_);
    if (ordinary_) ordinary_ = pulley::detail::all_ordinary(fresh);
    if (!ordinary_) finite_ = finite_ && pulley::detail::all_finite(fresh);
    checked_ = arrived;
    grow_own();
  }

  void grow_buffer(std::size_t head) {
    const std::size_t floats = (head + sizeof(float) - 1) / sizeof(float);
    const std::size_t more = (floats - buffer_.size()) * sizeof(float);
    charge(more);
    std::vector<float> bigger;
    try {
      bigger.resize(floats);
    } catch (...) {
      if (budget_ != nullptr) budget_->give(more);
      throw;
    }
    std::memcpy(bigger.data(), bytes() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
    buffer_ = std::move(bigger);
  }

  /// Grows the payload buffer to hold at most max(1 MiB, twice what arrived), keeping what
  /// arrived in it (`keep`) or not (a new frame, whose first bytes are still in the receive
  /// buffer: the old buffer is freed first): memory follows
  /// the bytes that came, not what a header claims. It is not zero-filled (every byte is
  /// received before it is read), and a buffer kept from an earlier frame is not shrunk, so
  /// steady traffic is received in one go.
  void grow_own(bool keep = true) {
    const auto floats = static_cast<std::size_t>(header_.payload_bytes / sizeof(float));
    const auto arrived = static_cast<std::size_t>(direct_done_ / sizeof(float));
    const std::size_t until =
        own_capacity_ >= floats ? floats : std::min(floats, std::max(2 * arrived, kChunkFloats));
    if (own_capacity_ >= until) return;
    if (!keep) release_own();  // a new frame: give the old buffer back before the new one
    const std::size_t more = (until - own_capacity_) * sizeof(float);
    growing_ = true;  // the budget's reclaim must not free own_ under this
    try {
      charge(more);
    } catch (...) {
      growing_ = false;
      throw;
    }
    growing_ = false;
    // realloc keeps what arrived (a float's first bytes included) and, for a large block,
    // moves its pages instead of copying them, so the old and the new buffer are never both
    // in memory.
    void* bigger = std::realloc(own_.get(), until * sizeof(float));
    if (bigger == nullptr) {
      if (budget_ != nullptr) budget_->give(more);
      throw Malformed("no memory for a payload of " + std::to_string(header_.payload_bytes) +
                      " bytes");
    }
    (void)own_.release();
    own_.reset(static_cast<float*>(bigger));
    own_capacity_ = until;
  }

  /// Frees the payload buffer and gives its bytes back.
  void release_own() noexcept {
    own_.reset();
    if (budget_ != nullptr) budget_->give(own_capacity_ * sizeof(float));
    own_capacity_ = 0;
  }

  /// Charges `n` bytes to the budget, or throws Malformed when they do not fit.
  void charge(std::uint64_t n) {
    if (budget_ == nullptr || n == 0 || budget_->take(n)) return;
    throw Malformed("the memory budget (" + std::to_string(budget_->limit() >> 20U) +
                    " MiB across all connections) cannot hold " + std::to_string(n) +
                    " more bytes for this frame");
  }

  /// Copies `n` received bytes into the targets, from their start.
  void scatter_copy(const std::byte* from, std::size_t n) {
    for (std::span<float> t : targets_) {
      const std::size_t take = std::min(n, t.size_bytes());
      std::memcpy(t.data(), from, take);
      from += take;
      n -= take;
      if (n == 0) break;
    }
  }

  /// The payload's `buffered` bytes after the head were copied out; the head stays where it
  /// is (its metadata is handed out with the frame).
  std::optional<Frame> start_direct(std::size_t head, std::size_t buffered, bool routed) {
    head_at_ = begin_;
    direct_ = true;
    routed_ = routed;
    direct_done_ = buffered;
    if (direct_done_ == header_.payload_bytes) {  // all here: the next frames stay buffered
      begin_ += head + buffered;
      return finish_direct();
    }
    // All that was buffered after the head is payload: the frames after it land right
    // behind the head (aligned, so their payloads can be used in place), and the payload's
    // last receive brings them whatever this one filled.
    begin_ = end_ = head_at_ + head;
    return std::nullopt;
  }

  std::optional<Frame> finish_direct() {
    const std::span<const char> meta(
        reinterpret_cast<const char*>(bytes()) + head_at_ + sizeof(Header),
        header_.meta_bytes);
    Frame frame{header_, meta, {}, routed_, false};
    if (!routed_) {
      frame.payload = std::span<const float>(
          own_.get(), static_cast<std::size_t>(header_.payload_bytes / sizeof(float)));
      frame.finite = finite_;
      frame.largest = pulley::magnitude_bound(ordinary_);
      own_viewed_ = true;
    }
    direct_ = routed_ = asked_ = false;
    targets_ = {};
    return frame;
  }

  FrameLimits limits_;
  MemoryBudget* budget_;       ///< charged for buffer_ and own_, if set
  std::vector<float> buffer_;  ///< the receive buffer (floats: aligned for in-place payloads)
  std::size_t begin_ = 0;      ///< first byte not handed out
  std::size_t end_ = 0;        ///< end of what was received
  Header header_;        ///< of the frame being cut
  bool asked_ = false;         ///< route() was asked about the current frame
  std::span<const std::span<float>> targets_;  ///< where route() sent the current payload
  bool direct_ = false;                        ///< a payload is being received outside the buffer
  bool routed_ = false;                        ///< ... into targets_ (else into own_)
  std::uint64_t direct_done_ = 0;              ///< payload bytes received so far
  std::size_t head_at_ = 0;                    ///< where the current frame's head is in the buffer
  /// Frees what malloc gave.
  struct Free {
    void operator()(float* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<float, Free> own_;           ///< payloads too large for the buffer, not routed
  std::size_t own_capacity_ = 0;               ///< floats allocated in own_
  bool own_viewed_ = false;                    ///< the last frame handed out views own_
  bool growing_ = false;                       ///< own_ is being replaced (charge under way)
  std::size_t checked_ = 0;                    ///< floats of own_ checked finite so far
  bool finite_ = true;
  bool ordinary_ = true;                       ///< ... all below kOrdinaryMagnitude
  std::array<std::span<float>, 1> own_target_{};
  std::array<std::span<std::byte>, 16> scatter_{};
  std::size_t scatter_size_ = 0;
};

}  // namespace pulley::wire
