// SPDX-License-Identifier: MIT
// The ps as a message handler, driven directly without any transport: bad input gets a
// clear error and leaves the server serving; sync tokens and step-gated pulls follow
// SyncReplicas' rules message by message.
#include "pulley/parameter_server.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pulley/optimizers/sgd.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/sync_replicas.hpp"

using namespace pulley;

namespace {

template <class Server>
Response call(Server& ps, Request request) {
  std::optional<Response> out;
  ps.handle(std::move(request), [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

// Sends a request whose answer may come later; returns where it will be.
template <class Server>
std::shared_ptr<std::optional<Response>> call_later(Server& ps, Request request) {
  auto out = std::make_shared<std::optional<Response>>();
  ps.handle(std::move(request), [out](Response&& r) { *out = std::move(r); });
  return out;
}

ErrorCode error_of(const Response& r) {
  REQUIRE(std::holds_alternative<ErrorReply>(r));
  return std::get<ErrorReply>(r).code;
}

const std::vector<VariableSpec> kModel{{"w", {2, 2}, {}}, {"b", {2}, {}}};
const std::vector<float> kZeroW(4, 0.0F);

// A push of `g` to the bias (part 1) and zeros to w (part 0): a push carries every part.
Push push_b(std::uint32_t worker, std::int64_t local_step, std::span<const float> g) {
  return Push{worker, local_step, {{0, kZeroW}, {1, g}}};
}

template <class Sync>
ParameterServer<RoundRobin, Sgd, Sync> ready_server(Sync sync) {
  ParameterServer<RoundRobin, Sgd, Sync> ps(0, 1, Sgd{1.0F}, sync);
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6};
  CHECK(std::holds_alternative<Ack>(call(ps, Initialize{{{0, w}, {1, b}}})));
  return ps;
}

std::vector<float> read(auto& ps, std::uint32_t part) {
  auto r = call(ps, Pull{0, {{part, {0, part == 0 ? 2U : 2U}}}});
  auto& values = std::get<PullReply>(r).values.at(0);
  return {values.begin(), values.end()};
}

}  // namespace

TEST_CASE("a ps refuses work before initialization, then serves") {
  ParameterServer<RoundRobin, Sgd, Async> ps(0, 1, Sgd{1.0F}, Async{});
  const std::vector<float> g{1, 1};
  CHECK(error_of(call(ps, push_b(0, 0, g))) == ErrorCode::kFailedPrecondition);
  CHECK(error_of(call(ps, Initialize{{{1, g}}})) == ErrorCode::kFailedPrecondition);
  const auto placement = call(ps, Register{kModel});
  REQUIRE(std::holds_alternative<PlacementReply>(placement));
  // Registered but not initialized: a push is still refused, with a message saying why.
  const auto early = call(ps, push_b(0, 0, g));
  CHECK(error_of(early) == ErrorCode::kFailedPrecondition);
  CHECK(std::get<ErrorReply>(early).message.find("initializ") != std::string::npos);
  // WaitReady is answered only once every part is initialized.
  auto ready = call_later(ps, WaitReady{});
  const std::vector<float> w{1, 2, 3, 4};
  CHECK(std::holds_alternative<Ack>(call(ps, Initialize{{{0, w}}})));
  CHECK_FALSE(ready->has_value());
  CHECK(std::holds_alternative<Ack>(call(ps, Initialize{{{1, g}}})));
  REQUIRE(ready->has_value());
  CHECK(std::holds_alternative<PlacementReply>(**ready));
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(0, 0, g))));
  CHECK(ps.stats().requests_rejected == 3);
}

TEST_CASE("bad requests get clear errors and change nothing") {
  auto ps = ready_server(Async{});
  const std::vector<float> ok{1, 1}, wrong_size{1, 1, 1}, nan{1, std::nanf("")},
      inf{std::numeric_limits<float>::infinity(), 0};

  SUBCASE("duplicate initialization") {
    const auto r = call(ps, Initialize{{{1, ok}}});
    CHECK(error_of(r) == ErrorCode::kAlreadyExists);
    CHECK(std::get<ErrorReply>(r).message.find("'b'") != std::string::npos);
  }
  SUBCASE("unknown part") {
    CHECK(error_of(call(ps, Push{0, 0, {{9, ok}}})) == ErrorCode::kNotFound);
    CHECK(error_of(call(ps, Pull{0, {{9, {0, 1}}}})) == ErrorCode::kNotFound);
  }
  SUBCASE("wrong shape") {
    const auto r = call(ps, Push{0, 0, {{1, wrong_size}}});
    CHECK(error_of(r) == ErrorCode::kInvalidArgument);
    CHECK(std::get<ErrorReply>(r).message.find("has 2 elements, got 3") != std::string::npos);
    CHECK(error_of(call(ps, Pull{0, {{1, {1, 3}}}})) == ErrorCode::kInvalidArgument);
  }
  SUBCASE("NaN gradient is refused whole") {
    const auto r = call(ps, Push{0, 0, {{0, std::vector<float>{1, 1, 1, 1}}, {1, nan}}});
    CHECK(error_of(r) == ErrorCode::kInvalidArgument);
    CHECK(std::get<ErrorReply>(r).message.find("non-finite") != std::string::npos);
    CHECK(error_of(call(ps, push_b(0, 0, inf))) == ErrorCode::kInvalidArgument);
  }
  SUBCASE("a part pushed twice in one message") {
    CHECK(error_of(call(ps, Push{0, 0, {{1, ok}, {1, ok}}})) == ErrorCode::kInvalidArgument);
  }
  SUBCASE("a different model registered again") {
    CHECK(error_of(call(ps, Register{{{"x", {3}, {}}}})) == ErrorCode::kAlreadyExists);
    // The same model again is harmless (a retried registration).
    CHECK(std::holds_alternative<PlacementReply>(call(ps, Register{kModel})));
  }
  // Whatever was refused, nothing was applied and the server still serves.
  CHECK(read(ps, 0) == std::vector<float>{1, 2, 3, 4});
  CHECK(read(ps, 1) == std::vector<float>{5, 6});
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(0, 0, ok))));
  CHECK(read(ps, 1) == std::vector<float>{4, 5});
}

TEST_CASE("invalid models are refused at registration") {
  ParameterServer<RoundRobin, Sgd, Async> ps(0, 1, Sgd{}, Async{});
  CHECK(error_of(call(ps, Register{{{"a", {2}, {}}, {"a", {3}, {}}}})) ==
        ErrorCode::kInvalidArgument);
  CHECK(error_of(call(ps, Register{{{"", {2}, {}}}})) == ErrorCode::kInvalidArgument);
  CHECK(error_of(call(ps, Register{{{"empty", {0, 3}, {}}}})) == ErrorCode::kInvalidArgument);
  CHECK(std::holds_alternative<PlacementReply>(call(ps, Register{kModel})));
  CHECK_THROWS_AS((ParameterServer<RoundRobin, Sgd, Async>(2, 2, Sgd{}, Async{})), Error);
}

TEST_CASE("a broken user sharding policy is caught, not trusted") {
  struct Overlapping {  // both parts claim row 0
    Placement place(std::span<const VariableSpec>, std::size_t) const {
      PlacementBuilder b;
      b.begin_variable();
      b.add(0, {0, 1});
      b.add(0, {0, 2});
      return std::move(b).finish();
    }
  };
  ParameterServer<Overlapping, Sgd, Async> ps(0, 1, Sgd{}, Async{});
  const auto r = call(ps, Register{{{"v", {2}, {}}}});
  CHECK(error_of(r) == ErrorCode::kInvalidArgument);
  CHECK(std::get<ErrorReply>(r).message.find("sharding policy") != std::string::npos);
}

TEST_CASE("SyncReplicas at the message level: tokens, staleness, gated pulls") {
  auto ps = ready_server(SyncReplicas{2, 3});  // R = 2 of N = 3: one backup
  const std::vector<float> g{2, 4};
  // max(R, N) = 3 tokens of step 0, one per worker.
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).local_step == 0);
  auto again = call_later(ps, TakeToken{0});  // worker 0 already holds one of step 0
  CHECK_FALSE(again->has_value());
  CHECK(std::get<TokenReply>(call(ps, TakeToken{1})).local_step == 0);
  CHECK(std::get<TokenReply>(call(ps, TakeToken{2})).local_step == 0);
  auto third = call_later(ps, TakeToken{2});
  CHECK_FALSE(third->has_value());
  auto gated = call_later(ps, Pull{1, {{1, {0, 2}}}});  // wants step 1
  CHECK_FALSE(gated->has_value());

  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g))).stale_parts == 0);
  CHECK_FALSE(gated->has_value());
  CHECK(std::get<PushReply>(call(ps, push_b(1, 0, g))).stale_parts == 0);
  // Step 1 done: b = {5,6} - mean{g} = {3, 2}; max(R, N) = 3 tokens of step 1 released,
  // the waiters get theirs in order, and the gated pull is answered.
  REQUIRE(gated->has_value());
  CHECK(std::get<PullReply>(**gated).global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});
  REQUIRE(again->has_value());
  CHECK(std::get<TokenReply>(**again).local_step == 1);
  REQUIRE(third->has_value());
  CHECK(std::get<TokenReply>(**third).local_step == 1);
  // The backup's gradient of step 0 arrives late: dropped and counted.
  CHECK(std::get<PushReply>(call(ps, push_b(2, 0, g))).stale_parts == 2);
  CHECK(ps.stats().stale_gradients_dropped == 2);
  CHECK(ps.stats().updates_applied == 2);  // w and b, once each
  CHECK(ps.stats().global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});
}

TEST_CASE("Shutdown cancels what waits") {
  auto ps = ready_server(SyncReplicas{1, 1});
  CHECK(std::holds_alternative<TokenReply>(call(ps, TakeToken{0})));
  auto waiting = call_later(ps, TakeToken{0});
  CHECK(std::holds_alternative<Ack>(call(ps, Shutdown{})));
  REQUIRE(waiting->has_value());
  CHECK(error_of(**waiting) == ErrorCode::kCancelled);
  CHECK(ps.stopped());
  CHECK(error_of(call(ps, GetStats{})) == ErrorCode::kCancelled);
}

TEST_CASE("a part initialized twice in one message is refused, and the ps is not ready") {
  ParameterServer<RoundRobin, Sgd, Async> ps(0, 1, Sgd{}, Async{});
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4};
  CHECK(error_of(call(ps, Initialize{{{0, w}, {0, w}}})) == ErrorCode::kInvalidArgument);
  CHECK(error_of(call(ps, TakeToken{0})) == ErrorCode::kFailedPrecondition);
}

TEST_CASE("a push must carry every part the ps holds") {
  auto ps = ready_server(SyncReplicas{1, 1});
  const std::vector<float> g{1, 1};
  const auto r = call(ps, Push{0, 0, {{1, g}}});
  CHECK(error_of(r) == ErrorCode::kInvalidArgument);
  CHECK(std::get<ErrorReply>(r).message.find("each of the 2 parts") != std::string::npos);
  CHECK(ps.stats().global_step == 0);
}

TEST_CASE("SyncReplicas R > N at the message level: one worker fills a step with R batches") {
  auto ps = ready_server(SyncReplicas{3, 2});  // R = 3 of N = 2
  const std::vector<float> g1{3, 3}, g2{6, 6}, g3{9, 9};
  // Worker 0 takes all three tokens of step 0 (no per-worker cap when R > N).
  for (int i = 0; i < 3; ++i) CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).local_step == 0);
  auto late = call_later(ps, TakeToken{1});
  CHECK_FALSE(late->has_value());
  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g1))).stale_parts == 0);
  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g2))).stale_parts == 0);
  CHECK(ps.stats().global_step == 0);
  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g3))).stale_parts == 0);
  // Exactly R gradients made the step: b = {5,6} - mean{3,6,9} = {-1, 0}.
  CHECK(ps.stats().global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{-1, 0});
  REQUIRE(late->has_value());
  CHECK(std::get<TokenReply>(**late).local_step == 1);
}
