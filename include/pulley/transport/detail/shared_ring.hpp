// SPDX-License-Identifier: MIT
#pragma once

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <utility>

namespace pulley::transport_detail {

/// True where two processes of one host can share a SharedRing (Linux: memfd_create and
/// SCM_RIGHTS).
#if defined(__linux__)
inline constexpr bool kSharedRings = true;
#else
inline constexpr bool kSharedRings = false;
#endif

/// A one-way byte stream between two processes of one host in memory they share: a ring
/// buffer (`kCapacity` bytes unless its maker chose another power of 2) behind a memory file
/// (memfd) that the writing end makes and hands to the reading end over the local socket they
/// already share (SCM_RIGHTS). A byte crosses it in one copy at each end, with no system call while
/// neither end waits; the socket stays the doorbell (an end about to sleep says so in the shared
/// header, and the other end then writes one byte to wake it) and the sign of a lost peer (its end
/// of the socket closes when the process dies).
///
/// One writer and one reader, each one thread: `write` and `read` move what fits now and
/// never block; the owner of the socket polls it when neither can move. Each end keeps its
/// own position to itself and reads only the other's from the shared header, clamped to
/// the ring, so a peer that scribbles on the header can stall the stream or garble its
/// bytes (as it could through a socket) but never make this end touch memory outside the
/// ring; and the memory file is sealed at its size, so neither end can shrink it under
/// the other (a bus error on the next touch).
class SharedRing {
 public:
  static constexpr std::size_t kCapacity = std::size_t{4} << 20U;  ///< bytes, by default
  /// The capacities a reading end accepts (powers of 2 between them).
  static constexpr std::size_t kMinCapacity = std::size_t{64} << 10U;
  static constexpr std::size_t kMaxCapacity = std::size_t{64} << 20U;

  SharedRing() = default;
  SharedRing(const SharedRing&) = delete;
  SharedRing& operator=(const SharedRing&) = delete;
  SharedRing(SharedRing&& other) noexcept
      : mapping_(std::exchange(other.mapping_, nullptr)),
        fd_(std::exchange(other.fd_, -1)),
        capacity_(std::exchange(other.capacity_, 0)),
        mine_(std::exchange(other.mine_, 0)) {}
  SharedRing& operator=(SharedRing&& other) noexcept {
    std::swap(mapping_, other.mapping_);
    std::swap(fd_, other.fd_);
    std::swap(capacity_, other.capacity_);
    std::swap(mine_, other.mine_);
    return *this;
  }
  ~SharedRing() { release(); }

  /// Makes a ring of `capacity` bytes (a power of 2 from kMinCapacity to kMaxCapacity), the
  /// writing end; empty where the memory cannot be had.
  static SharedRing make(std::size_t capacity = kCapacity) {
    SharedRing ring;
    if (!accepted(capacity)) return ring;
#if defined(__linux__)
    const int fd = ::memfd_create("pulley-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return ring;
    // Its pages are had now (or the link stays on its socket), not at a later touch.
    const auto size = static_cast<off_t>(kHeader + capacity);
    if (::ftruncate(fd, size) != 0 || ::fallocate(fd, 0, 0, size) != 0 ||
        ::fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
      ::close(fd);
      return ring;
    }
    ring.fd_ = fd;
    ring.capacity_ = capacity;
    ring.map();
    if (ring.mapping_ != nullptr) new (ring.mapping_) Header{};
#endif
    return ring;
  }

  /// The reading end of the ring whose memory file is `fd` (taken over); empty if it cannot
  /// be mapped, is not a ring's size (a header and an accepted capacity), or is not sealed
  /// at it.
  static SharedRing open(int fd) {
    SharedRing ring;
#if defined(__linux__)
    ring.fd_ = fd;
    // The seals first: once sealed, the size read next cannot change.
    const int seals = ::fcntl(fd, F_GET_SEALS);
    struct stat status {};
    if (seals < 0 || (seals & kSeals) != kSeals || ::fstat(fd, &status) != 0 ||
        status.st_size <= static_cast<off_t>(kHeader) ||
        !accepted(static_cast<std::size_t>(status.st_size) - kHeader)) {
      ring.release();
      return ring;
    }
    ring.capacity_ = static_cast<std::size_t>(status.st_size) - kHeader;
    ring.map();
#else
    (void)fd;
#endif
    return ring;
  }

  [[nodiscard]] explicit operator bool() const noexcept { return mapping_ != nullptr; }
  /// The memory file, for handing to the reading end.
  [[nodiscard]] int fd() const noexcept { return fd_; }
  /// Its data bytes (0 when empty).
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// Copies as much of `bytes` as fits now; returns how much. Wakes a reader that sleeps.
  std::size_t write(std::span<const std::byte> bytes, int doorbell) noexcept {
    Header& h = header();
    const std::uint64_t head = mine_;
    const std::uint64_t used =
        std::min<std::uint64_t>(head - h.tail.load(std::memory_order_acquire), capacity_);
    const std::size_t n = std::min<std::size_t>(bytes.size(), capacity_ - used);
    if (n == 0) return 0;
    const std::size_t at = head & (capacity_ - 1);
    const std::size_t first = std::min(n, capacity_ - at);
    std::memcpy(data() + at, bytes.data(), first);
    std::memcpy(data(), bytes.data() + first, n - first);
    mine_ = head + n;
    h.head.store(mine_, std::memory_order_seq_cst);
    if (h.reader_sleeps.load(std::memory_order_seq_cst) != 0 && h.reader_sleeps.exchange(0) != 0) ring(doorbell);
    return n;
  }

  /// Copies as much into `bytes` as has arrived; returns how much. Wakes a writer that sleeps.
  std::size_t read(std::span<std::byte> bytes, int doorbell) noexcept {
    Header& h = header();
    const std::uint64_t tail = mine_;
    const std::uint64_t ready =
        std::min<std::uint64_t>(h.head.load(std::memory_order_acquire) - tail, capacity_);
    const std::size_t n = std::min<std::size_t>(bytes.size(), ready);
    if (n == 0) return 0;
    const std::size_t at = tail & (capacity_ - 1);
    const std::size_t first = std::min(n, capacity_ - at);
    std::memcpy(bytes.data(), data() + at, first);
    std::memcpy(bytes.data() + first, data(), n - first);
    mine_ = tail + n;
    h.tail.store(mine_, std::memory_order_seq_cst);
    if (h.writer_sleeps.load(std::memory_order_seq_cst) != 0 && h.writer_sleeps.exchange(0) != 0) ring(doorbell);
    return n;
  }

  /// True if a read now would move a byte. (Sequentially consistent, as `reader_sleeps`
  /// needs: its flag's store must not pass this look. On x86 it costs what acquire does.)
  [[nodiscard]] bool has_data() noexcept {
    return header().head.load(std::memory_order_seq_cst) != mine_;
  }
  /// True if a write now would move a byte (sequentially consistent, as `writer_sleeps`
  /// needs).
  [[nodiscard]] bool has_room() noexcept {
    return mine_ - header().tail.load(std::memory_order_seq_cst) < capacity_;
  }

  /// The reader is about to sleep until bytes arrive: true if it may (none came meanwhile;
  /// the writer will ring), false if it should read again.
  bool reader_sleeps() noexcept {
    Header& h = header();
    h.reader_sleeps.store(1, std::memory_order_seq_cst);
    if (!has_data()) return true;
    h.reader_sleeps.store(0, std::memory_order_relaxed);
    return false;
  }
  /// The writer is about to sleep until there is room: true if it may, false if room came.
  bool writer_sleeps() noexcept {
    Header& h = header();
    h.writer_sleeps.store(1, std::memory_order_seq_cst);
    if (!has_room()) return true;
    h.writer_sleeps.store(0, std::memory_order_relaxed);
    return false;
  }

 private:
  struct Header {
    alignas(64) std::atomic<std::uint64_t> head{0};  ///< bytes written, ever
    alignas(64) std::atomic<std::uint64_t> tail{0};  ///< bytes read, ever
    alignas(64) std::atomic<std::uint32_t> reader_sleeps{0};
    alignas(64) std::atomic<std::uint32_t> writer_sleeps{0};
  };
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "a shared ring needs lock-free atomics");
  static constexpr std::size_t kHeader = 4096;
  static_assert(sizeof(Header) <= kHeader);
  static constexpr bool accepted(std::size_t capacity) noexcept {
    return std::has_single_bit(capacity) && capacity >= kMinCapacity && capacity <= kMaxCapacity;
  }
#if defined(__linux__)
  static constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
#endif

  Header& header() noexcept { return *std::launder(reinterpret_cast<Header*>(mapping_)); }
  std::byte* data() noexcept { return static_cast<std::byte*>(mapping_) + kHeader; }

  /// One byte on the socket: the other end looks again. A full socket already holds one.
  static void ring(int doorbell) noexcept {
#if defined(__linux__)
    const char bell = 0;
    [[maybe_unused]] const auto sent = ::send(doorbell, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
#else
    (void)doorbell;
#endif
  }

  void map() noexcept {
#if defined(__linux__)
    void* p = ::mmap(nullptr, kHeader + capacity_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      release();
      return;
    }
    mapping_ = p;
#endif
  }

  void release() noexcept {
#if defined(__linux__)
    if (mapping_ != nullptr) ::munmap(mapping_, kHeader + capacity_);
    if (fd_ >= 0) ::close(fd_);
#endif
    mapping_ = nullptr;
    fd_ = -1;
    capacity_ = 0;
  }

  void* mapping_ = nullptr;
  int fd_ = -1;
  std::size_t capacity_ = 0;  ///< data bytes: a power of 2
  std::uint64_t mine_ = 0;  ///< the writer's head or the reader's tail: this end's own
};

#if defined(__linux__)
/// Sends one byte on local socket `socket` with `fd` attached (none when `fd` < 0), blocking
/// for at most a poll of the socket; false if it could not be sent.
inline bool send_fd(int socket, int fd) noexcept {
  char byte = fd >= 0 ? 'S' : 'N';
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  if (fd >= 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  return ::sendmsg(socket, &message, MSG_NOSIGNAL | MSG_DONTWAIT) == 1;
}

/// Receives the byte send_fd sent: 1 with the descriptor in `fd` ('S'), 1 with `fd` = −1
/// ('N'), 0 when nothing has come yet, −2 when the peer closed its end first, −1 on a broken
/// socket or anything else (another byte, more descriptors than one: every descriptor that
/// came is closed).
inline int receive_fd(int socket, int& fd) noexcept {
  fd = -1;
  char byte = 0;
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const auto n = ::recvmsg(socket, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
  if (n == 0) return -2;
  int count = 0;  // descriptors that came
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < fds; ++i) {
      int received = -1;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (++count == 1) {
        fd = received;
      } else {
        ::close(received);
      }
    }
  }
  const bool whole = n == 1 && (message.msg_flags & MSG_CTRUNC) == 0;
  if (whole && byte == 'S' && count == 1) return 1;
  if (fd >= 0) ::close(fd);
  fd = -1;
  return whole && byte == 'N' && count == 0 ? 1 : -1;
}
#endif

}  // namespace pulley::transport_detail
