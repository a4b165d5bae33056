// SPDX-License-Identifier: MIT
// wire::FrameReader, without sockets: a stream of frames cut into arbitrary receives
// comes out whole and in order, in place, into routed targets, or into its own buffer.
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame_reader.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

using namespace pulley;
using wire::FrameReader;

namespace {

std::vector<float> ramp(std::size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

/// Appends a frame's bytes as a sender writes them.
void append(std::vector<std::byte>& stream, const wire::Frame& f) {
  auto put = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    stream.insert(stream.end(), b, b + n);
  };
  put(&f.header, sizeof f.header);
  put(f.meta.data(), f.meta.size());
  put(wire::kZeros.data(), wire::padding(f.meta.size()));
  for (auto v : f.payload) put(v.data(), v.size_bytes());
}

struct Received {
  std::uint64_t call;
  std::uint16_t kind;
  std::vector<float> payload;  ///< for frames not routed
  bool routed;
  bool finite;
  bool aligned;
};

/// Feeds `stream` to `reader` in receives of the sizes `chunk()` picks, as a socket would
/// fill the buffers it is given; routes pull replies of `routes` by call id.
template <class Chunk>
std::vector<Received> feed(FrameReader& reader, const std::vector<std::byte>& stream, Chunk chunk,
                           std::map<std::uint64_t, std::vector<std::span<float>>>& routes) {
  std::vector<Received> out;
  std::size_t at = 0;
  auto route = [&](const wire::Header& h, std::span<const char>) {
    auto it = routes.find(h.call);
    return it == routes.end() ? std::span<const std::span<float>>()
                              : std::span<const std::span<float>>(it->second);
  };
  while (at < stream.size()) {
    std::size_t want = std::min(chunk(), stream.size() - at);
    std::size_t got = 0;
    for (std::span<std::byte> b : reader.buffers()) {
      const std::size_t n = std::min(want - got, b.size());
      std::memcpy(b.data(), stream.data() + at + got, n);
      got += n;
      if (got == want) break;
    }
    REQUIRE(got > 0);
    reader.commit(got);
    at += got;
    while (auto f = reader.next(route)) {
      out.push_back({f->header.call, f->header.kind,
                     std::vector<float>(f->payload.begin(), f->payload.end()), f->routed, f->finite,
                     reinterpret_cast<std::uintptr_t>(f->payload.data()) % alignof(float) == 0});
    }
  }
  return out;
}

}  // namespace

TEST_CASE("frames cut into any receives come out whole, in order, each where it belongs") {
  // A 1 KiB buffer: the 40-float push fits in place; the 5000-float ones do not.
  const auto small = ramp(40, 1.0F), large = ramp(5000, -7.0F), pulled = ramp(3000, 0.5F);
  auto poisoned = large;
  poisoned[4321] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::byte> stream;
  append(stream, wire::encode(Request{Push{1, 2, {{0, small}}}}, 1));
  append(stream, wire::encode(Request{GetStats{}}, 2));
  append(stream, wire::encode(Request{Push{1, 3, {{0, large}}}}, 3));
  // Right behind a large one, where a receive ending at any byte of its payload must not
  // leave the next payload misaligned.
  append(stream, wire::encode(Request{Push{1, 5, {{0, small}}}}, 4));
  append(stream, wire::encode(Request{Pull{0, {{0, {0, 3}}}}}, 5));
  append(stream,
         wire::encode(Response{PullReply{
                          9, {std::span(pulled).first(1000), std::span(pulled).subspan(1000)}}},
                      6));
  append(stream, wire::encode(Response{PullReply{9, {std::span(small)}}}, 7));  // routed, small
  append(stream, wire::encode(Request{Push{1, 4, {{0, poisoned}}}}, 8));
  append(stream, wire::encode(Response{ErrorReply{ErrorCode::kNotFound, "x"}}, 9));

  // Where the third frame's head ends: a first receive ending 2 bytes later leaves the
  // large payload's start, and so the frames received after it, off a 4-byte boundary
  // unless the reader realigns; a second receive brings all the rest at once.
  const std::size_t large_head_end =
      wire::encode(Request{Push{1, 2, {{0, small}}}}, 1).size() +
      wire::encode(Request{GetStats{}}, 2).size() +
      wire::head_bytes(wire::encode(Request{Push{1, 3, {{0, large}}}}, 3).header);
  std::mt19937 rng(7);
  const std::vector<std::size_t> sizes{1, 3, 31, 32, 33, 1001, 1002, 1003, 4096, 70000};
  for (std::size_t pick = 0; pick <= sizes.size() + 1; ++pick) {
    CAPTURE(pick);
    bool first = true;
    auto chunk = [&] {  // each size alone, a random mix, then the odd split
      if (pick == sizes.size() + 1) return std::exchange(first, false) ? large_head_end + 2 : 70000;
      return pick < sizes.size() ? sizes[pick] : sizes[rng() % sizes.size()];
    };
    std::vector<float> a(1000), b(2000), c(40);
    std::map<std::uint64_t, std::vector<std::span<float>>> routes{{6, {a, b}}, {7, {c}}};
    FrameReader reader({}, 1024);
    const auto frames = feed(reader, stream, chunk, routes);
    REQUIRE(frames.size() == 9);
    for (std::size_t i = 0; i < frames.size(); ++i) CHECK(frames[i].call == i + 1);
    CHECK(frames[0].payload == small);
    CHECK_FALSE(frames[0].finite);  // small payloads are left to the ps to check, in cache
    CHECK(frames[1].payload.empty());
    CHECK(frames[2].payload == large);
    CHECK(frames[2].finite);  // checked as it arrived
    CHECK(frames[3].payload == small);
    CHECK(frames[4].kind == wire::variant_index<Request, Pull>());
    CHECK(frames[5].routed);
    CHECK(std::equal(a.begin(), a.end(), pulled.begin()));
    CHECK(std::equal(b.begin(), b.end(), pulled.begin() + 1000));
    CHECK(frames[6].routed);
    CHECK(c == small);
    CHECK(frames[7].payload.size() == poisoned.size());
    CHECK_FALSE(frames[7].finite);
    CHECK(frames[8].kind == wire::kResponseKind + wire::variant_index<Response, ErrorReply>());
    for (const Received& f : frames) CHECK(f.aligned);
  }
}

TEST_CASE("a bad header throws before anything is allocated for its frame") {
  FrameReader reader({}, 1024);
  wire::Header h;
  h.kind = static_cast<std::uint16_t>(wire::variant_index<Request, Push>());
  h.payload_bytes = std::uint64_t{1} << 40U;  // over the 4 GiB limit
  auto bytes = reader.buffers();
  std::memcpy(bytes[0].data(), &h, sizeof h);
  reader.commit(sizeof h);
  auto keep = [](const wire::Header&, std::span<const char>) {
    return std::span<const std::span<float>>();
  };
  CHECK_THROWS_AS(reader.next(keep), wire::Malformed);

  FrameReader other({}, 1024);
  h.payload_bytes = 12;
  h.magic = 0x12345678;
  bytes = other.buffers();
  std::memcpy(bytes[0].data(), &h, sizeof h);
  other.commit(sizeof h);
  CHECK_THROWS_WITH_AS(other.next(keep), "bad magic: not a pulley peer", wire::Malformed);
}

TEST_CASE("targets whose sizes miss the payload's are refused, not overrun") {
  const auto values = ramp(100, 0.0F);
  std::vector<std::byte> stream;
  append(stream, wire::encode(Response{PullReply{1, {std::span(values)}}}, 1));
  std::vector<float> too_small(50);
  std::map<std::uint64_t, std::vector<std::span<float>>> routes{{1, {too_small}}};
  FrameReader reader({}, 1024);
  CHECK_THROWS_AS(feed(
                      reader, stream, [] { return std::size_t{4096}; }, routes),
                  wire::Malformed);
}

TEST_CASE("a payload larger than the growth steps arrives whole however its receives split floats") {
  // 3 MiB and a float: the payload buffer grows (1 MiB, then twice what arrived) while
  // receives end in the middle of floats.
  const auto big = ramp((std::size_t{3} << 20U) / sizeof(float) + 1, 0.25F);
  std::vector<std::byte> stream;
  append(stream, wire::encode(Request{Push{0, 1, {{0, big}}}}, 1));
  append(stream, wire::encode(Request{GetStats{}}, 2));
  for (const std::size_t size : {std::size_t{65537}, std::size_t{100003}, std::size_t{1} << 20U}) {
    CAPTURE(size);
    wire::MemoryBudget budget(std::uint64_t{64} << 20U);
    std::map<std::uint64_t, std::vector<std::span<float>>> none;
    {
      FrameReader reader({}, 4096, &budget);
      const auto frames = feed(reader, stream, [&] { return size; }, none);
      REQUIRE(frames.size() == 2);
      CHECK(frames[0].payload == big);
      CHECK(frames[0].finite);
      // Charged: the receive buffer and the payload buffer, at most twice what arrived.
      CHECK(budget.used() > big.size() * sizeof(float));
      CHECK(budget.used() <= 4096 + 2 * big.size() * sizeof(float));
      reader.release_idle();  // between frames the payload buffer may go back
      CHECK(budget.used() == 4096);
    }
    CHECK(budget.used() == 0);  // and everything, when the reader goes
  }
}

TEST_CASE("a payload that would overdraw the memory budget is refused as it grows") {
  const auto big = ramp((std::size_t{8} << 20U) / sizeof(float), 1.0F);
  std::vector<std::byte> stream;
  append(stream, wire::encode(Request{Push{0, 1, {{0, big}}}}, 1));
  wire::MemoryBudget budget(std::uint64_t{3} << 20U);
  bool reclaimed = false;
  budget.reclaim = [&] { reclaimed = true; };
  std::map<std::uint64_t, std::vector<std::span<float>>> none;
  FrameReader reader({}, 4096, &budget);
  CHECK_THROWS_WITH_AS(feed(reader, stream, [] { return std::size_t{1} << 20U; }, none),
                       doctest::Contains("memory budget (3 MiB across all connections)"),
                       wire::Malformed);
  CHECK(reclaimed);  // the owner was asked to give back idle buffers first
  CHECK(budget.used() <= budget.limit());
}

TEST_CASE("a payload buffer a frame still views is not given back") {
  const auto big = ramp((std::size_t{2} << 20U) / sizeof(float), 3.0F);
  std::vector<std::byte> stream;
  append(stream, wire::encode(Request{Push{0, 1, {{0, big}}}}, 1));
  wire::MemoryBudget budget(std::uint64_t{64} << 20U);
  FrameReader reader({}, 4096, &budget);
  std::size_t at = 0;
  std::optional<FrameReader::Frame> frame;
  auto keep = [](const wire::Header&, std::span<const char>) {
    return std::span<const std::span<float>>();
  };
  while (!frame) {
    const auto spans = reader.buffers();
    const std::size_t n = std::min(spans[0].size(), stream.size() - at);
    std::memcpy(spans[0].data(), stream.data() + at, n);
    reader.commit(n);
    at += n;
    frame = reader.next(keep);
  }
  const std::uint64_t held = budget.used();
  reader.release_idle();  // e.g. the budget reclaiming for another connection meanwhile
  CHECK(budget.used() == held);
  CHECK(std::equal(frame->payload.begin(), frame->payload.end(), big.begin(), big.end()));
  CHECK_FALSE(reader.next(keep));  // the frame is done with: now it may go
  reader.release_idle();
  CHECK(budget.used() < held);
}
