// SPDX-License-Identifier: MIT
// The wire format: every message survives a round trip with its tensors; any header or
// metadata a peer could send wrong is refused as Malformed before it is trusted.
#include "pulley/transport/wire/codec.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <vector>

using namespace pulley;

// The largest single allocation this program has made, to see what a lying frame costs.
namespace {
std::atomic<std::size_t> g_largest_allocation{0};
}  // namespace

// Replacement operators may use malloc/free; GCC cannot tell that they pair up.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t size) {
  std::size_t seen = g_largest_allocation.load();
  while (size > seen && !g_largest_allocation.compare_exchange_weak(seen, size)) {
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {

// Writes a frame to bytes as a socket would carry it, then decodes it back.
template <class Variant>
Variant round_trip(const Variant& message, std::vector<float>& storage) {
  const wire::Frame frame = wire::encode(message, 77);
  CHECK(frame.header.call == 77);
  wire::check(frame.header);
  storage.clear();
  for (auto v : frame.payload) storage.insert(storage.end(), v.begin(), v.end());
  CHECK(storage.size() * sizeof(float) == frame.header.payload_bytes);
  if constexpr (std::is_same_v<Variant, Request>) {
    return wire::decode_request(frame.header, frame.meta, storage);
  } else {
    return wire::decode_response(frame.header, frame.meta, storage);
  }
}

const std::vector<VariableSpec> kModel{{"dense/kernel", {3, 2}, Initializer::glorot_uniform()},
                                       {"dense/bias", {2}, Initializer::constant(0.5F)}};

}  // namespace

TEST_CASE("every request survives a round trip, tensors included") {
  std::vector<float> storage;
  const std::vector<float> a{1, 2, 3}, b{-4.5F, 5};

  auto reg = std::get<Register>(round_trip(Request{Register{kModel}}, storage));
  CHECK(reg.variables == kModel);
  const std::vector<TableSpec> tables{{"emb", 16, Initializer::normal(0.01F), 3, 100}};
  auto with_tables = std::get<Register>(round_trip(Request{Register{kModel, tables, 77, {1, 2}, 4}}, storage));
  CHECK(with_tables.tables == tables);
  CHECK(with_tables.table_seed == 77);
  CHECK(with_tables.members == std::vector<std::uint32_t>{1, 2});
  CHECK(with_tables.membership == 4);
  const std::uint64_t top = ~std::uint64_t{0};
  auto rows = std::get<PullRows>(round_trip(Request{PullRows{6, 1, {{1, {0, top}, {}}}}}, storage));
  CHECK(rows.min_step == 6);
  CHECK(rows.epoch == 1);
  CHECK(rows.tables.at(0).table == 1);
  CHECK(rows.tables.at(0).ids == std::vector<std::uint64_t>{0, top});
  CHECK(rows.tables.at(0).values.empty());
  auto sparse = std::get<Push>(round_trip(Request{Push{1, 2, {{0, a}}, 0, 5, {{0, {top}, b}}}}, storage));
  CHECK(sparse.gradients.at(0).values[2] == 3.0F);
  CHECK(sparse.rows.at(0).ids == std::vector<std::uint64_t>{top});
  CHECK(std::vector<float>(sparse.rows.at(0).values.begin(), sparse.rows.at(0).values.end()) == b);

  auto init = std::get<Initialize>(round_trip(Request{Initialize{{{4, a}, {9, b}}}}, storage));
  REQUIRE(init.parts.size() == 2);
  CHECK(init.parts[0].part == 4);
  CHECK(std::vector<float>(init.parts[0].values.begin(), init.parts[0].values.end()) == a);
  CHECK(std::vector<float>(init.parts[1].values.begin(), init.parts[1].values.end()) == b);

  auto push = std::get<Push>(round_trip(Request{Push{3, 42, {{1, b}}, 2, 99}}, storage));
  CHECK(push.worker == 3);
  CHECK(push.local_step == 42);
  CHECK(push.gradients.at(0).values[0] == -4.5F);
  CHECK(push.epoch == 2);
  CHECK(push.sequence == 99);

  auto restore = std::get<Restore>(round_trip(Request{Restore{4, {10, 11}, {{1, a, {b}, {3}}}}}, storage));
  CHECK(restore.epoch == 4);
  CHECK(restore.pacer == std::vector<std::int64_t>{10, 11});
  CHECK(restore.parts.at(0).values[2] == 3.0F);
  CHECK(restore.parts.at(0).slots.at(0)[1] == 5.0F);
  const auto read =
      std::get<ReadState>(round_trip(Request{ReadState{{1, 2}, 3, 4, {5, 0}, {6, 0}}}, storage));
  CHECK(read.until == std::vector<std::uint64_t>{1, 2});
  CHECK(read.since == 3);
  CHECK(read.forget_evictions_before == 4);
  CHECK(read.last_sequences == std::vector<std::uint64_t>{5, 0});
  CHECK(read.last_series == std::vector<std::uint64_t>{6, 0});
  CHECK(std::holds_alternative<Pause>(round_trip(Request{Pause{}}, storage)));
  CHECK(std::holds_alternative<Resume>(round_trip(Request{Resume{}}, storage)));
  const auto beat = std::get<Heartbeat>(round_trip(Request{Heartbeat{5, true}}, storage));
  CHECK(beat.worker == 5);
  CHECK(beat.leaving);

  auto pull = std::get<Pull>(round_trip(Request{Pull{7, {{2, {1, 3}}}}}, storage));
  CHECK(pull.min_step == 7);
  CHECK(pull.slices.at(0).rows == RowRange{1, 3});

  CHECK(std::get<TakeToken>(round_trip(Request{TakeToken{5}}, storage)).worker == 5);
  CHECK(std::holds_alternative<WaitReady>(round_trip(Request{WaitReady{}}, storage)));
  CHECK(std::holds_alternative<GetStats>(round_trip(Request{GetStats{}}, storage)));
  const auto bye = std::get<Shutdown>(round_trip(Request{Shutdown{true, "out of data"}}, storage));
  CHECK(bye.aborted);
  CHECK(bye.reason == "out of data");
  CHECK(!bye.restart);
  CHECK(std::get<Shutdown>(round_trip(Request{Shutdown{false, {}, true}}, storage)).restart);
}

TEST_CASE("every response survives a round trip, tensors included") {
  std::vector<float> storage;
  const std::vector<float> a{1, 2, 3}, b{4};
  auto pull = std::get<PullReply>(round_trip(Response{PullReply{9, {a, b}}}, storage));
  CHECK(pull.global_step == 9);
  REQUIRE(pull.values.size() == 2);
  CHECK(pull.values[0].size() == 3);
  CHECK(pull.values[1][0] == 4.0F);

  PlacementBuilder builder;
  builder.begin_variable();
  builder.add(0, {0, 2});
  builder.add(1, {2, 3});
  builder.begin_variable();
  builder.add(0, {0, 2});
  const Placement placement = std::move(builder).finish();
  auto placed = std::get<PlacementReply>(
      round_trip(Response{PlacementReply{kModel, placement, 3, {"m", "v"}, {"t"}, {}, 0, {0, 2}, 1}}, storage));
  CHECK(placed.variables == kModel);
  CHECK(placed.members == std::vector<std::uint32_t>{0, 2});
  CHECK(placed.membership == 1);
  CHECK(placed.placement == placement);
  CHECK(placed.epoch == 3);
  CHECK(placed.slot_names == std::vector<std::string>{"m", "v"});
  CHECK(placed.counter_names == std::vector<std::string>{"t"});

  const auto paused = std::get<PauseReply>(round_trip(
      Response{PauseReply{12, 2, {4, 0, 7}, {"m"}, {"t"}, false, 3, 11, {9, 0, 2}, {5, 0, 6}}},
      storage));
  CHECK(paused.global_step == 12);
  CHECK(paused.pushes == std::vector<std::uint64_t>{4, 0, 7});
  CHECK_FALSE(paused.whole);
  CHECK(paused.evictions_since == 3);
  CHECK(paused.furthest_pushed == 11);
  CHECK(paused.last_sequences == std::vector<std::uint64_t>{9, 0, 2});
  CHECK(paused.last_series == std::vector<std::uint64_t>{5, 0, 6});
  const std::vector<float> m{7, 8, 9};
  auto state = std::get<StateReply>(
      round_trip(Response{StateReply{5, {5}, {{2, a, {m}, {5}}, {6, b, {}, {}}}}}, storage));
  CHECK(state.pacer == std::vector<std::int64_t>{5});
  REQUIRE(state.parts.size() == 2);
  CHECK(state.parts[0].part == 2);
  CHECK(state.parts[0].values.size() == 3);
  CHECK(state.parts[0].slots.at(0)[2] == 9.0F);
  CHECK(state.parts[0].counters == std::vector<std::int64_t>{5});
  CHECK(state.parts[1].values[0] == 4.0F);

  auto row_reply = std::get<RowsReply>(round_trip(Response{RowsReply{8, {a, b}}}, storage));
  CHECK(row_reply.global_step == 8);
  REQUIRE(row_reply.rows.size() == 2);
  CHECK(row_reply.rows[1].size() == 1);
  CHECK(row_reply.rows[1][0] == 4.0F);

  auto error = std::get<ErrorReply>(
      round_trip(Response{ErrorReply{ErrorCode::kNotFound, "no such part"}}, storage));
  CHECK(error.code == ErrorCode::kNotFound);
  CHECK(error.message == "no such part");

  Stats stats;
  stats.global_step = 11;
  stats.bytes_pulled = 1 << 20;
  auto got = std::get<StatsReply>(
      round_trip(Response{StatsReply{stats, "step 11", {1, 3}, false, true, 2, {0, 2, 5}, 3}}, storage));
  CHECK(got.members == std::vector<std::uint32_t>{0, 2, 5});
  CHECK(got.membership == 3);
  CHECK(got.stats.global_step == 11);
  CHECK(got.stats.bytes_pulled == 1 << 20);
  CHECK(got.waiting_for == "step 11");
  CHECK(got.lost == std::vector<std::uint32_t>{1, 3});
  const auto token =
      std::get<TokenReply>(round_trip(Response{TokenReply{Token{3, 1, 2, false}, 4}}, storage));
  CHECK(token.token == Token{3, 1, 2, false});
  CHECK(token.global_step == 4);
  CHECK(std::get<PushReply>(round_trip(Response{PushReply{2}}, storage)).stale_parts == 2);
  CHECK(std::holds_alternative<Ack>(round_trip(Response{Ack{}}, storage)));
}

TEST_CASE("a message's tensors are its declared span fields, in declaration order") {
  const std::vector<float> a{1, 2}, b{3}, c{4, 5, 6};
  const wire::Frame frame = wire::encode(Request{Push{1, 2, {{0, a}, {1, b}, {2, c}}}}, 5);
  REQUIRE(frame.payload.size() == 3);
  CHECK(frame.payload[0].data() == a.data());  // views of the sender's buffers, not copies
  CHECK(frame.payload[2].data() == c.data());
  CHECK(frame.header.payload_bytes == 6 * sizeof(float));
  Request request = Push{1, 2, {{0, a}, {1, b}, {2, c}}};
  std::vector<std::size_t> sizes;
  for_each_tensor(request, [&](std::span<const float>& t) { sizes.push_back(t.size()); });
  CHECK(sizes == std::vector<std::size_t>{2, 1, 3});
  CHECK(changes_parameters(request));
  CHECK_FALSE(changes_parameters(Request{Pull{}}));
  // Requests that may apply an update by what they set off: a worker found lost on the way
  // (GetStats, Heartbeat), held pushes taken (ReadState, Resume).
  CHECK(changes_parameters(Request{GetStats{}}));
  CHECK(changes_parameters(Request{Heartbeat{}}));
  CHECK(changes_parameters(Request{ReadState{}}));
  CHECK(changes_parameters(Request{Resume{}}));
  CHECK_FALSE(changes_parameters(Request{Pause{}}));
  CHECK(message_name(request) == "Push");
  // A reply's metadata alone gives its tensors' sizes, for a receiver that routes them.
  const wire::Frame reply = wire::encode(Response{PullReply{3, {a, c}}}, 6);
  const Response routed = wire::decode_response_meta(reply.header, reply.meta, sizes);
  CHECK(sizes == std::vector<std::size_t>{2, 3});
  CHECK(std::get<PullReply>(routed).global_step == 3);
}

TEST_CASE("a header a peer got wrong is refused before anything else is read") {
  const wire::Frame good = wire::encode(Request{TakeToken{1}}, 1);
  auto bad = [&](auto mutate) {
    wire::Header h = good.header;
    mutate(h);
    return h;
  };
  CHECK_NOTHROW(wire::check(good.header));
  CHECK_THROWS_WITH_AS(wire::check(bad([](auto& h) { h.magic = 0x47455420; })),  // "GET "
                       doctest::Contains("magic"), wire::Malformed);
  CHECK_THROWS_WITH_AS(wire::check(bad([](auto& h) { h.version = wire::kVersion + 1; })),
                       doctest::Contains(("version " + std::to_string(wire::kVersion + 1)).c_str()),
                       wire::Malformed);
  CHECK_THROWS_WITH_AS(wire::check(bad([](auto& h) { h.kind = 42; })),
                       doctest::Contains("unknown message kind"), wire::Malformed);
  CHECK_NOTHROW(wire::check(bad([](auto& h) { h.kind = wire::kRendezvousKind + 2; })));  // a ring's redirect
  CHECK_THROWS_WITH_AS(wire::check(bad([](auto& h) { h.kind = wire::kRendezvousKind + wire::kRendezvousKinds; })),
                       doctest::Contains("unknown message kind"), wire::Malformed);
  CHECK_THROWS_WITH_AS(wire::check(bad([](auto& h) { h.payload_bytes = std::uint64_t{1} << 40; })),
                       doctest::Contains("payload"), wire::Malformed);
  CHECK_THROWS_AS(wire::check(bad([](auto& h) { h.payload_bytes = 6; })), wire::Malformed);
  CHECK_THROWS_AS(wire::check(bad([](auto& h) { h.meta_bytes = 1U << 30; })), wire::Malformed);
}

TEST_CASE("metadata that lies about its tensors is refused") {
  const std::vector<float> g{1, 2, 3, 4};
  const wire::Frame frame = wire::encode(Request{Push{0, 0, {{0, g}}}}, 1);
  const std::vector<float> short_payload{1, 2};
  const std::vector<float> long_payload{1, 2, 3, 4, 5};
  CHECK_THROWS_AS(wire::decode_request(frame.header, frame.meta, short_payload), wire::Malformed);
  CHECK_THROWS_AS(wire::decode_request(frame.header, frame.meta, long_payload), wire::Malformed);
  // Truncated or garbage metadata.
  CHECK_THROWS_AS(wire::decode_request(frame.header, std::string_view(frame.meta).substr(0, 5), g),
                  wire::Malformed);
  std::string garbage(frame.meta.size(), '\xff');
  CHECK_THROWS_AS(wire::decode_request(frame.header, garbage, g), wire::Malformed);
  // Tensors attached to a message that has none.
  const wire::Frame token = wire::encode(Request{TakeToken{1}}, 2);
  CHECK_THROWS_AS(wire::decode_request(token.header, token.meta, g), wire::Malformed);
  // A response where a request belongs, and the other way round.
  CHECK_THROWS_AS(wire::decode_response(frame.header, frame.meta, g), wire::Malformed);
}

TEST_CASE("a bool that is neither 0 nor 1 is refused") {
  // Push ends with its `refill` flag (found by fuzz.wire: a byte of 93 read as a bool).
  const std::vector<float> g{1, 2, 3, 4};
  const wire::Frame frame = wire::encode(Request{Push{0, 0, {{0, g}}}}, 1);
  std::string meta = frame.meta;
  meta.back() = '\x01';
  CHECK(std::get<Push>(wire::decode_request(frame.header, meta, g)).refill);
  meta.back() = static_cast<char>(93);
  CHECK_THROWS_WITH_AS(wire::decode_request(frame.header, meta, g), doctest::Contains("a bool of value 93"),
                       wire::Malformed);
}

TEST_CASE("a length prefix larger than the metadata left is refused before allocating") {
  // Register's metadata starts with the number of variables (a uint64): claim 2^40 of them.
  wire::Frame frame = wire::encode(Request{Register{kModel}}, 3);
  for (const std::uint64_t lie : {std::uint64_t{1} << 40U, std::uint64_t{frame.meta.size()}}) {
    std::string meta = frame.meta;
    std::memcpy(meta.data(), &lie, sizeof lie);
    CHECK_THROWS_WITH_AS(wire::decode_request(frame.header, meta, {}),
                         doctest::Contains("metadata bytes left"), wire::Malformed);
  }
  // The first variable's name length (right after the count) claims 2^62 characters.
  std::string meta = frame.meta;
  const std::uint64_t huge = std::uint64_t{1} << 62U;
  std::memcpy(meta.data() + sizeof(std::uint64_t), &huge, sizeof huge);
  CHECK_THROWS_WITH_AS(wire::decode_request(frame.header, meta, {}),
                       doctest::Contains("metadata bytes left"), wire::Malformed);
  // The honest frame still decodes, and one extra byte after it does not.
  std::vector<float> none;
  CHECK(std::get<Register>(wire::decode_request(frame.header, frame.meta, none)).variables ==
        kModel);
  CHECK_THROWS_WITH_AS(wire::decode_request(frame.header, frame.meta + "x", none),
                       doctest::Contains("past the message"), wire::Malformed);
}

TEST_CASE("a vector of structs grows as its elements arrive, not to the length it claims") {
  // One variable with a 1 MiB name, and a count claiming a million of them: resizing first
  // would allocate ~1M VariableSpecs (tens of MiB) before reading the second.
  const std::vector<VariableSpec> one{{std::string(1U << 20U, 'v'), {2}, Initializer::zeros()}};
  const wire::Frame frame = wire::encode(Request{Register{one}}, 4);
  std::string meta = frame.meta;
  const std::uint64_t claimed = 1U << 20U;
  REQUIRE(claimed <= meta.size());  // passes the length-prefix check
  std::memcpy(meta.data(), &claimed, sizeof claimed);
  g_largest_allocation = 0;
  CHECK_THROWS_AS(wire::decode_request(frame.header, meta, {}), wire::Malformed);
  CHECK(g_largest_allocation.load() < (std::size_t{4} << 20U));
}
