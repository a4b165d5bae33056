// SPDX-License-Identifier: MIT
// A connection's path through shared memory (transport/detail/shared_rings.hpp), driven as
// the TCP client and server drive it: a read that finds nothing looks again for a while
// before it sleeps, so that an answer coming meanwhile needs no doorbell; one that waited
// longer sleeps and is woken by the doorbell; a peer that closes, or a stop, ends a read
// in either state.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <system_error>
#include <vector>

#if defined(__linux__)
#include <sys/socket.h>
#include <unistd.h>
#endif

#include "pulley/core/spin.hpp"
#include "pulley/transport/detail/shared_rings.hpp"

#if defined(__linux__)
namespace {

using pulley::transport_detail::SharedRing;
using pulley::transport_detail::SharedRings;
using pulley::transport_detail::StreamSocket;

/// One end under test (`rings`, on `near`) and its peer played by hand: the peer writes into
/// `to_near` (rings `far`'s doorbell when the near end said it sleeps).
struct Link {
  asio::io_context io;
  StreamSocket near{io};
  StreamSocket far{io};
  SharedRing to_near = SharedRing::make(pulley::transport_detail::kLinkRingBytes);
  SharedRing from_near = SharedRing::make(pulley::transport_detail::kLinkRingBytes);
  SharedRings rings;

  Link() {
    asio::local::stream_protocol::socket a(io);
    asio::local::stream_protocol::socket b(io);
    asio::local::connect_pair(a, b);
    near = StreamSocket(io, asio::generic::stream_protocol(AF_UNIX, 0), a.release());
    far = StreamSocket(io, asio::generic::stream_protocol(AF_UNIX, 0), b.release());
    near.non_blocking(true);
    REQUIRE(to_near);
    REQUIRE(from_near);
    rings.start(open_end(from_near), open_end(to_near), near);
  }

  /// The other end of `ring`, opened on a copy of its memory file, as a peer opens it.
  static SharedRing open_end(const SharedRing& ring) {
    SharedRing end = SharedRing::open(::dup(ring.fd()));
    REQUIRE(end);
    return end;
  }

  /// Doorbells waiting on the near end's socket (left there for its watch).
  int bells() {
    char buffer[64];
    const auto n = ::recv(near.native_handle(), buffer, sizeof buffer, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 ? static_cast<int>(n) : 0;
  }

  /// What a read completed with.
  struct Read {
    std::error_code ec;
    std::size_t n = 0;
  };

  /// Starts a read of up to `into`'s size.
  void read(std::vector<std::byte>& into, std::optional<Read>& done) {
    const std::array<asio::mutable_buffer, 1> buffers{asio::buffer(into)};
    rings.async_read_some(near, buffers, [&done](std::error_code ec, std::size_t n) {
      done = Read{ec, n};
    });
  }

  /// Runs the io_context until `done` or 10 s.
  template <class Done>
  void run_until(const std::optional<Done>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done && std::chrono::steady_clock::now() < deadline) {
      io.restart();
      io.run_one_for(std::chrono::milliseconds(10));
    }
  }

  /// Fills the near end's ring from `floats` (a frame larger than the ring): true if it is
  /// full and bytes wait in `list`.
  bool fill(pulley::transport_detail::GatherList& list, pulley::wire::Frame& frame,
            const std::vector<float>& floats) {
    frame.header.payload_bytes = floats.size() * sizeof(float);
    frame.payload = {std::span<const float>(floats)};
    list.append(frame);
    std::error_code ec;
    return rings.write_now(list, near, ec) && !ec && !list.empty();
  }

  /// Starts a wait for room in the near end's ring.
  void wait_for_room(std::optional<std::error_code>& done) {
    rings.async_wait_write(near, [&done](std::error_code ec) { done = ec; });
  }

  /// The peer reads `n` bytes from the near end's ring.
  void peer_reads(std::size_t n) {
    std::vector<std::byte> bytes(n);
    REQUIRE(from_near.read(bytes, far.native_handle()) == n);
  }

  /// Runs the io_context (without blocking) until a read or wait started before has looked
  /// for longer than spin_before_sleep(), and so sleeps.
  void wait_past_spin() {
    const auto until = std::chrono::steady_clock::now() + 20 * pulley::spin_before_sleep();
    while (std::chrono::steady_clock::now() < until) {
      io.restart();
      io.poll();
    }
  }

  /// The peer writes `bytes` into the near end's ring.
  void peer_writes(const std::vector<std::byte>& bytes) {
    REQUIRE(to_near.write(bytes, far.native_handle()) == bytes.size());
  }
};

}  // namespace

TEST_CASE(
    "a read through shared memory looks again before it sleeps: an answer meanwhile rings no "
    "doorbell") {
  Link link;
  const std::vector<std::byte> answer{std::byte{1}, std::byte{2}, std::byte{3}};
  std::vector<std::byte> into(16);

  // Asked while the ring is empty, the read does not say it sleeps: the peer's answer, written
  // before the read's next look, is taken without a doorbell. (Its next look comes when the
  // io_context runs: a look that came after spin_before_sleep(), on a busy host, would sleep.)
  std::optional<Link::Read> first;
  link.read(into, first);
  CHECK_FALSE(first);
  link.peer_writes(answer);
  CHECK(link.bells() == 0);
  link.run_until(first);
  REQUIRE(first);
  CHECK_FALSE(first->ec);
  CHECK(first->n == answer.size());
  CHECK(std::equal(answer.begin(), answer.end(), into.begin()));

  // A read left waiting longer than spin_before_sleep() sleeps; the peer's next write rings it
  // awake.
  std::optional<Link::Read> second;
  link.read(into, second);
  link.wait_past_spin();
  CHECK_FALSE(second);
  link.peer_writes(answer);
  CHECK(link.bells() == 1);
  link.run_until(second);
  REQUIRE(second);
  CHECK_FALSE(second->ec);
  CHECK(second->n == answer.size());
}

TEST_CASE(
    "a wait for room in shared memory looks again before it sleeps: room made meanwhile rings no "
    "doorbell") {
  Link link;
  const std::vector<float> floats(2 * pulley::transport_detail::kLinkRingBytes / sizeof(float),
                                  1.0F);
  pulley::wire::Frame frame;
  pulley::transport_detail::GatherList list;
  REQUIRE(link.fill(list, frame, floats));

  std::optional<std::error_code> first;
  link.wait_for_room(first);
  link.peer_reads(4096);
  CHECK(link.bells() == 0);  // the writer never said it sleeps
  link.run_until(first);
  REQUIRE(first);
  CHECK_FALSE(*first);

  // Full again; a wait left longer than spin_before_sleep() sleeps, and the peer's next read rings
  // it.
  std::error_code ec;
  REQUIRE(link.rings.write_now(list, link.near, ec));
  REQUIRE_FALSE(list.empty());
  std::optional<std::error_code> second;
  link.wait_for_room(second);
  link.wait_past_spin();
  CHECK_FALSE(second);
  link.peer_reads(4096);
  CHECK(link.bells() == 1);
  link.run_until(second);
  REQUIRE(second);
  CHECK_FALSE(*second);
}

TEST_CASE("with set_spin_before_sleep(0) a read through shared memory sleeps at once") {
  struct Restore {
    std::chrono::microseconds spin = pulley::spin_before_sleep();
    ~Restore() { pulley::set_spin_before_sleep(spin); }
  } restore;
  pulley::set_spin_before_sleep(std::chrono::microseconds(-5));  // less than 0 is 0
  CHECK(pulley::spin_before_sleep().count() == 0);
  Link link;
  std::vector<std::byte> into(16);
  std::optional<Link::Read> read;
  link.read(into, read);  // asked on an empty ring: says at once that it sleeps
  CHECK_FALSE(read);
  link.peer_writes({std::byte{7}, std::byte{8}});
  CHECK(link.bells() == 1);  // so the peer's write rang, with no wait past a spin
  link.run_until(read);
  REQUIRE(read);
  CHECK_FALSE(read->ec);
  CHECK(read->n == 2);
}

TEST_CASE(
    "a read through shared memory ends when the peer closes, or with operation_aborted when "
    "stopped") {
  for (const bool asleep : {false, true}) {  // while the read still looks, and once it sleeps
    CAPTURE(asleep);
    {
      INFO("the peer closes: what it wrote first is read, then eof");
      Link link;
      std::vector<std::byte> into(16);
      std::optional<Link::Read> read;
      link.read(into, read);
      if (asleep) link.wait_past_spin();
      link.peer_writes({std::byte{7}});
      link.far.close();
      link.run_until(read);
      REQUIRE(read);
      CHECK_FALSE(read->ec);
      CHECK(read->n == 1);
      std::optional<Link::Read> after;
      link.read(into, after);
      link.run_until(after);
      REQUIRE(after);
      CHECK(after->ec == asio::error::eof);
    }
    {
      INFO("stopped, its socket closed next: operation_aborted, nothing read");
      Link link;
      std::vector<std::byte> into(16);
      std::optional<Link::Read> read;
      link.read(into, read);
      if (asleep) link.wait_past_spin();
      link.rings.stop();
      link.near.close();
      link.run_until(read);
      REQUIRE(read);
      CHECK(read->ec == asio::error::operation_aborted);
      CHECK(read->n == 0);
    }
  }
}
#endif
