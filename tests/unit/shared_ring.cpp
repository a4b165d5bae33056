// SPDX-License-Identifier: MIT
// The shared-memory stream under TcpRing's local links (transport/detail/shared_ring.hpp):
// bytes come out as they went in, across the ring's end, with a doorbell only for an end
// that said it sleeps; the memory file crosses a local socket and is refused unless sealed
// at the ring's size; a peer that scribbles on the shared header cannot make an end touch
// memory outside the ring.
#include <doctest/doctest.h>

#if defined(__linux__)
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <vector>

#include "pulley/transport/detail/shared_ring.hpp"

using pulley::transport_detail::SharedRing;

#if defined(__linux__)
namespace {

/// A connected pair of local sockets, closed at the end.
struct Sockets {
  int fd[2] = {-1, -1};
  Sockets() { REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fd) == 0); }
  ~Sockets() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  Sockets(const Sockets&) = delete;
  Sockets& operator=(const Sockets&) = delete;
};

/// Bytes waiting on `fd` (doorbells rung), read off.
int bells(int fd) {
  int rung = 0;
  char buffer[64];
  while (true) {
    const auto n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n <= 0) return rung;
    rung += static_cast<int>(n);
  }
}

/// The reading end of `writer`'s ring, handed over the sockets as TcpRing hands it.
SharedRing hand_over(const SharedRing& writer, Sockets& sockets) {
  REQUIRE(pulley::transport_detail::send_fd(sockets.fd[0], writer.fd()));
  int fd = -1;
  REQUIRE(pulley::transport_detail::receive_fd(sockets.fd[1], fd) == 1);
  REQUIRE(fd >= 0);
  return SharedRing::open(fd);
}

/// Descriptors this process holds open.
std::ptrdiff_t open_descriptors() {
  return std::distance(std::filesystem::directory_iterator("/proc/self/fd"), std::filesystem::directory_iterator{});
}

std::byte pattern(std::size_t i) { return static_cast<std::byte>((i * 131U + i / 977U) & 0xFFU); }

}  // namespace

TEST_CASE("bytes come out of a shared ring as they went in, across its end, and only a sleeping end is woken") {
  Sockets sockets;
  SharedRing writer = SharedRing::make();
  REQUIRE(writer);
  SharedRing reader = hand_over(writer, sockets);
  REQUIRE(reader);
  const int to_reader = sockets.fd[0];
  const int to_writer = sockets.fd[1];

  // 2.5 rings' worth in pieces of odd sizes, read in pieces of other odd sizes.
  const std::size_t total = SharedRing::kCapacity * 5 / 2 + 3;
  std::vector<std::byte> in(total);
  for (std::size_t i = 0; i < total; ++i) in[i] = pattern(i);
  std::vector<std::byte> out(total);
  std::size_t written = 0;
  std::size_t read = 0;
  bool filled = false;
  while (read < total) {
    const std::size_t w = std::min<std::size_t>(total - written, 1'000'003);
    const std::size_t n = writer.write(std::span(in).subspan(written, w), to_reader);
    written += n;
    if (n < w) filled = true;  // the ring was full: the writer waits for room
    const std::size_t r = std::min<std::size_t>(total - read, 333'333);
    read += reader.read(std::span(out).subspan(read, r), to_writer);
  }
  CHECK(filled);
  CHECK(written == total);
  CHECK(std::memcmp(in.data(), out.data(), total) == 0);
  CHECK(bells(sockets.fd[1]) == 0);  // neither end ever said it sleeps
  CHECK(bells(sockets.fd[0]) == 0);

  // An empty ring: the reader may sleep, and the next write rings once.
  std::vector<std::byte> one(1, std::byte{42});
  CHECK(reader.reader_sleeps());
  CHECK(writer.write(one, to_reader) == 1);
  CHECK(bells(sockets.fd[1]) == 1);
  CHECK(writer.write(one, to_reader) == 1);  // said once, rung once
  CHECK(bells(sockets.fd[1]) == 0);
  CHECK_FALSE(reader.reader_sleeps());  // bytes wait: no sleep
  std::vector<std::byte> two(2);
  CHECK(reader.read(two, to_writer) == 2);

  // A full ring: the writer may sleep, and the next read rings once.
  std::vector<std::byte> full(SharedRing::kCapacity);
  CHECK(writer.write(full, to_reader) == SharedRing::kCapacity);
  CHECK(writer.write(one, to_reader) == 0);
  CHECK(writer.writer_sleeps());
  CHECK(reader.read(two, to_writer) == 2);
  CHECK(bells(sockets.fd[0]) == 1);
  CHECK_FALSE(writer.writer_sleeps());  // room came
}

TEST_CASE("a shared ring's memory is refused unless it is a sealed file of the ring's size") {
  Sockets sockets;
  int fd = -1;
  // Without a ring: a byte that says so, no file.
  REQUIRE(pulley::transport_detail::send_fd(sockets.fd[0], -1));
  CHECK(pulley::transport_detail::receive_fd(sockets.fd[1], fd) == 1);
  CHECK(fd == -1);
  CHECK(pulley::transport_detail::receive_fd(sockets.fd[1], fd) == 0);  // nothing more yet

  // A memory file of the right size that can still shrink: a bus error waiting to happen.
  const int unsealed = ::memfd_create("not-a-ring", MFD_CLOEXEC);
  REQUIRE(unsealed >= 0);
  REQUIRE(::ftruncate(unsealed, 4096 + static_cast<off_t>(SharedRing::kCapacity)) == 0);
  CHECK_FALSE(SharedRing::open(unsealed));  // (closed by open)

  // A sealed file of another size.
  const int small = ::memfd_create("small", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(small >= 0);
  REQUIRE(::ftruncate(small, 4096) == 0);
  REQUIRE(::fcntl(small, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
  CHECK_FALSE(SharedRing::open(small));

  // Something that is no file at all.
  int pipe_ends[2];
  REQUIRE(::pipe(pipe_ends) == 0);
  ::close(pipe_ends[1]);
  CHECK_FALSE(SharedRing::open(pipe_ends[0]));

  // Two descriptors where one was due: refused, and neither stays open here.
  {
    const int a = ::memfd_create("a", MFD_CLOEXEC);
    const int b = ::memfd_create("b", MFD_CLOEXEC);
    REQUIRE((a >= 0 && b >= 0));
    char byte = 'S';
    iovec io{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    const int both[2] = {a, b};
    std::memcpy(CMSG_DATA(c), both, sizeof both);
    REQUIRE(::sendmsg(sockets.fd[0], &message, 0) == 1);
    ::close(a);
    ::close(b);
    const auto before = open_descriptors();
    CHECK(pulley::transport_detail::receive_fd(sockets.fd[1], fd) == -1);
    CHECK(fd == -1);
    CHECK(open_descriptors() == before);
  }

  // A closed socket: the other end is gone.
  ::shutdown(sockets.fd[0], SHUT_WR);
  CHECK(pulley::transport_detail::receive_fd(sockets.fd[1], fd) == -2);
}

TEST_CASE("a peer that scribbles on the shared header cannot make an end touch memory outside the ring") {
  Sockets sockets;
  SharedRing writer = SharedRing::make();
  REQUIRE(writer);
  SharedRing reader = hand_over(writer, sockets);
  REQUIRE(reader);
  // A third mapping of the same memory, as a hostile peer holds it.
  void* mapped = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, writer.fd(), 0);
  REQUIRE(mapped != MAP_FAILED);
  auto* header = static_cast<std::byte*>(mapped);
  const auto scribble = [&](std::size_t offset, std::uint64_t value) { std::memcpy(header + offset, &value, 8); };
  // The header's head at 0 and tail at 64 (each on a cache line of its own).
  scribble(0, ~std::uint64_t{0} / 2);  // "half of all numbers written"
  std::vector<std::byte> big(3 * SharedRing::kCapacity);
  CHECK(reader.read(big, sockets.fd[1]) <= SharedRing::kCapacity);  // never past the ring
  scribble(64, ~std::uint64_t{0});  // "read more than ever written"
  CHECK(writer.write(big, sockets.fd[0]) <= SharedRing::kCapacity);
  scribble(64, 12345);
  CHECK(writer.write(big, sockets.fd[0]) <= SharedRing::kCapacity);
  ::munmap(mapped, 4096);
}
#endif
