// SPDX-License-Identifier: MIT
// The ps as a message handler, driven directly without any transport: bad input gets a
// clear error and leaves the server serving; sync tokens and step-gated pulls follow
// SyncReplicas' rules message by message.
#include "pulley/ps/parameter_server.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pulley/optimizers/sgd.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/tables/tables.hpp"

using namespace pulley;

namespace {

// As a request from another process arrives: nobody vouches for its tensors.
const RequestContext kFromOutside{false, std::nullopt};

template <class Server>
Response call(Server& ps, Request request) {
  std::optional<Response> out;
  ps.handle(std::move(request), kFromOutside, [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

// Sends a request whose answer may come later; returns where it will be.
template <class Server>
std::shared_ptr<std::optional<Response>> call_later(Server& ps, Request request) {
  auto out = std::make_shared<std::optional<Response>>();
  ps.handle(std::move(request), kFromOutside, [out](Response&& r) { *out = std::move(r); });
  return out;
}

/// The same, as if on connection `session` (0 is call's and call_later's).
template <class Server>
std::shared_ptr<std::optional<Response>> call_later_on(Server& ps, Request request, std::uint64_t session) {
  auto out = std::make_shared<std::optional<Response>>();
  ps.handle(std::move(request), RequestContext{false, std::nullopt, session},
            [out](Response&& r) { *out = std::move(r); });
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
  // A shape whose product wraps around (2^66 elements would read as 4) is no small model.
  const std::size_t big = std::size_t{1} << 33U;
  const auto wraps = call(ps, Register{{{"huge", {big, big, 4}, {}}}});
  CHECK(error_of(wraps) == ErrorCode::kInvalidArgument);
  CHECK(std::get<ErrorReply>(wraps).message.find("more elements than a ps can hold") != std::string::npos);
  CHECK(std::holds_alternative<PlacementReply>(call(ps, Register{kModel})));
  CHECK_THROWS_AS((ParameterServer<RoundRobin, Sgd, Async>(2, 2, Sgd{}, Async{})), Error);
}

TEST_CASE("a ps refuses to start with an optimizer whose settings are unusable, naming the field") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS((ParameterServer<RoundRobin, Sgd, Async>(0, 1, Sgd{nan}, Async{})),
                       doctest::Contains("the optimizer: learning_rate is nan: it must be a finite number of 0 or more"), Error);
  // The tables' optimizer too (Tables<Sgd>: the rows' own settings).
  CHECK_THROWS_WITH_AS((ParameterServer<RoundRobin, Sgd, Async, Tables<Sgd>>(0, 1, Sgd{}, Async{}, {}, Tables<Sgd>{Sgd{-1.0F}})),
                       doctest::Contains("the tables' optimizer: learning_rate is -1: it must be a finite number of 0 or more"), Error);
  CHECK_NOTHROW((ParameterServer<RoundRobin, Sgd, Async>(0, 1, Sgd{0.5F}, Async{})));
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
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).token.local_step == 0);
  // Worker 0 asks again on the same connection (its answer was lost): the same token.
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).token.local_step == 0);
  // A process in its place (another connection) waits: worker 0 holds one of step 0.
  auto again = call_later_on(ps, TakeToken{0}, 2);
  CHECK_FALSE(again->has_value());
  CHECK(std::get<TokenReply>(call(ps, TakeToken{1})).token.local_step == 0);
  CHECK(std::get<TokenReply>(call(ps, TakeToken{2})).token.local_step == 0);
  auto third = call_later_on(ps, TakeToken{2}, 3);
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
  CHECK(std::get<TokenReply>(**again).token.local_step == 1);
  REQUIRE(third->has_value());
  CHECK(std::get<TokenReply>(**third).token.local_step == 1);
  // The backup's gradient of step 0 arrives late: dropped and counted.
  CHECK(std::get<PushReply>(call(ps, push_b(2, 0, g))).stale_parts == 2);
  CHECK(ps.stats().stale_gradients_dropped == 2);
  CHECK(ps.stats().updates_applied == 2);  // w and b, once each
  CHECK(ps.stats().global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});
}

TEST_CASE("Shutdown tells what waits, and everything after, that training is over") {
  auto ps = ready_server(SyncReplicas{1, 1});
  CHECK(std::holds_alternative<TokenReply>(call(ps, TakeToken{0})));
  auto waiting = call_later_on(ps, TakeToken{0}, 2);  // another connection: waits
  auto gated = call_later(ps, Pull{5, {{1, {0, 2}}}});
  CHECK(std::holds_alternative<Ack>(call(ps, Shutdown{})));
  REQUIRE(waiting->has_value());
  CHECK(error_of(**waiting) == ErrorCode::kOutOfRange);
  REQUIRE(gated->has_value());
  CHECK(std::get<ErrorReply>(**gated).message.find("training finished") != std::string::npos);
  CHECK(ps.stopped());
  CHECK(ps.ended()->code == ErrorCode::kOutOfRange);
  CHECK(error_of(call(ps, GetStats{})) == ErrorCode::kOutOfRange);
}

TEST_CASE("an aborted job says why to every task that asks") {
  auto ps = ready_server(SyncReplicas{1, 1});
  auto waiting = call_later(ps, WaitReady{});  // answered at once: ready
  CHECK(std::holds_alternative<Ack>(call(ps, Shutdown{true, "the data went missing"})));
  const Response r = call(ps, TakeToken{0});
  CHECK(error_of(r) == ErrorCode::kAborted);
  CHECK(std::get<ErrorReply>(r).message.find("the data went missing") != std::string::npos);
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
  // Worker 0 takes all three tokens of step 0, one after each push (no per-worker cap
  // when R > N); asked again before its push, it gets the one it holds.
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).token.local_step == 0);
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).token.local_step == 0);  // the same
  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g1))).stale_parts == 0);
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).token.local_step == 0);
  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g2))).stale_parts == 0);
  CHECK(std::get<TokenReply>(call(ps, TakeToken{0})).token.local_step == 0);
  auto late = call_later(ps, TakeToken{1});  // the step's three tokens are taken
  CHECK_FALSE(late->has_value());
  CHECK(ps.stats().global_step == 0);
  CHECK(std::get<PushReply>(call(ps, push_b(0, 0, g3))).stale_parts == 0);
  // Exactly R gradients made the step: b = {5,6} - mean{3,6,9} = {-1, 0}.
  CHECK(ps.stats().global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{-1, 0});
  REQUIRE(late->has_value());
  CHECK(std::get<TokenReply>(**late).token.local_step == 1);
}

namespace {

/// Sgd whose make_state throws the first time it is called (out of memory, say).
struct FlakySgd : Sgd {
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  State make_state(std::size_t n) const {
    if ((*calls)++ == 0) throw std::runtime_error("no memory for the slots");
    return Sgd::make_state(n);
  }
};

/// Sgd that records what each update saw, and throws when told to.
struct WatchingSgd : Sgd {
  std::shared_ptr<std::vector<UpdateContext>> seen = std::make_shared<std::vector<UpdateContext>>();
  std::shared_ptr<bool> fail = std::make_shared<bool>(false);
  void apply(State& s, std::span<float> w, std::span<const float> g,
             const UpdateContext& context) const {
    if (*fail && context.variable == "b") throw std::runtime_error("apply blew up");
    seen->push_back(context);
    Sgd::apply(s, w, g);
  }
};

}  // namespace

TEST_CASE("a registration that failed half way leaves nothing behind: the retry starts clean") {
  FlakySgd flaky{{1.0F}};
  ParameterServer<RoundRobin, FlakySgd, Async> ps(0, 1, flaky, Async{});
  const Response first = call(ps, Register{kModel});
  CHECK(error_of(first) == ErrorCode::kInternal);
  CHECK(std::get<ErrorReply>(first).message.find("no memory for the slots") != std::string::npos);
  CHECK_FALSE(ps.stopped());  // nothing had changed: refused, not failed
  REQUIRE(std::holds_alternative<PlacementReply>(call(ps, Register{kModel})));
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6}, g{1, 1};
  CHECK(std::holds_alternative<Ack>(call(ps, Initialize{{{0, w}, {1, b}}})));
  // Exactly the model's two parts are held: a push of both is whole, one of three is not.
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(0, 0, g))));
  CHECK(std::get<ErrorReply>(call(ps, Push{0, 0, {{1, g}}})).message.find("each of the 2 parts") !=
        std::string::npos);
}

TEST_CASE("the optimizer sees the global step and the rows of the part it updates") {
  WatchingSgd sgd{{1.0F}};
  auto seen = sgd.seen;
  ParameterServer<RoundRobin, WatchingSgd, SyncReplicas> ps(0, 1, sgd, SyncReplicas(1, 1));
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6}, g{1, 1};
  call(ps, Initialize{{{0, w}, {1, b}}});
  call(ps, push_b(0, 0, g));
  call(ps, push_b(0, 1, g));
  REQUIRE(seen->size() == 4);
  CHECK((*seen)[0].global_step == 0);
  CHECK((*seen)[0].variable == "w");
  CHECK((*seen)[0].rows == RowRange{0, 2});
  CHECK((*seen)[0].row_size == 2);
  CHECK((*seen)[1].variable == "b");
  CHECK((*seen)[1].row_size == 1);
  CHECK((*seen)[3].global_step == 1);
}

TEST_CASE("a policy that throws half way through an update fails the ps, which says why") {
  WatchingSgd sgd{{1.0F}};
  ParameterServer<RoundRobin, WatchingSgd, SyncReplicas> ps(0, 1, sgd, SyncReplicas(1, 2));
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6}, g{1, 1};
  call(ps, Initialize{{{0, w}, {1, b}}});
  auto gated = call_later(ps, Pull{1, {{1, {0, 2}}}});
  *sgd.fail = true;  // 'w' is updated, then 'b' throws: the step is half applied
  const Response r = call(ps, push_b(0, 0, g));
  CHECK(error_of(r) == ErrorCode::kInternal);
  CHECK(std::get<ErrorReply>(r).message.find("apply blew up") != std::string::npos);
  CHECK(ps.stopped());
  REQUIRE(gated->has_value());  // what waited hears it too, instead of waiting forever
  CHECK(error_of(**gated) == ErrorCode::kInternal);
  CHECK(error_of(call(ps, GetStats{})) == ErrorCode::kInternal);
  CHECK(ps.ended()->message.find("ps 0 failed") != std::string::npos);
}

TEST_CASE("a policy that refuses a request before anything changed leaves the ps serving") {
  auto ps = ready_server(BoundedStaleness(1, 2));
  const std::vector<float> g{1, 1};
  const Response r = call(ps, push_b(0, 3, g));  // clock 3: no token of it was handed out
  CHECK(error_of(r) == ErrorCode::kInvalidArgument);
  CHECK(std::get<ErrorReply>(r).message.find("pushed for clock 3 but is at clock 0") != std::string::npos);
  CHECK_FALSE(ps.stopped());
  CHECK(read(ps, 1) == std::vector<float>{5, 6});
  // A worker the job does not count waits to be counted in (the handshake keeps strangers out).
  const auto outside = call_later(ps, TakeToken{9});
  CHECK_FALSE(outside->has_value());
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(0, 0, g))));
  CHECK_FALSE(outside->has_value());
}

TEST_CASE("BoundedStaleness at the message level: tokens wait for the slowest, pulls for its clock") {
  auto ps = ready_server(BoundedStaleness(1, 2));  // s = 1, two workers
  const std::vector<float> g{1, 1};
  auto token = [&](std::uint32_t w) { return std::get<TokenReply>(call(ps, TakeToken{w})); };
  CHECK(token(0).token.local_step == 0);
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(0, 0, g))));  // applied at once
  CHECK(read(ps, 1) == std::vector<float>{4, 5});
  CHECK(token(0).token.local_step == 1);  // one clock ahead of worker 1: allowed
  call(ps, push_b(0, 1, g));
  auto blocked = call_later(ps, TakeToken{0});  // clock 2 would be two ahead
  CHECK_FALSE(blocked->has_value());
  auto gated = call_later(ps, Pull{1, {{1, {0, 2}}}});  // what clock 2 must read
  CHECK_FALSE(gated->has_value());
  CHECK(std::get<StatsReply>(call(ps, GetStats{})).waiting_for.find("worker 1 at clock 0") !=
        std::string::npos);
  CHECK(token(1).token.local_step == 0);
  call(ps, push_b(1, 0, g));  // worker 1 reaches clock 1: worker 0 may go on
  REQUIRE(blocked->has_value());
  CHECK(std::get<TokenReply>(**blocked).token == Token{2, 1, 2, true, 4});  // batch 2 × 2 + 0
  CHECK(std::get<TokenReply>(**blocked).global_step == 1);
  REQUIRE(gated->has_value());
  CHECK(std::get<PullReply>(**gated).global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{2, 3});  // three pushes, each applied
}

namespace {

template <class Server>
Response call_as(Server& ps, Request request, Node peer, std::uint64_t session = 1) {
  std::optional<Response> out;
  ps.handle(std::move(request), RequestContext{false, peer, session},
            [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

/// The same, as `peer`, for a request whose answer may come later.
template <class Server>
std::shared_ptr<std::optional<Response>> call_later_as(Server& ps, Request request, Node peer,
                                                       std::uint64_t session = 1) {
  auto out = std::make_shared<std::optional<Response>>();
  ps.handle(std::move(request), RequestContext{false, peer, session},
            [out](Response&& r) { *out = std::move(r); });
  return out;
}

}  // namespace

TEST_CASE(
    "SyncReplicas at the message level: a worker whose push of a step was lost with its process is "
    "not waited "
    "for at that step") {
  // R = N = 2. Worker 1 was killed while it wrote its push of step 0 to the ps tasks: another
  // ps took it and went on to step 1, this one did not. The process started in its place
  // pulls step 1 here (the step its token, from the other ps, names): it will never push
  // step 0, so step 0 goes on with worker 0's gradient alone.
  auto ps = ready_server(SyncReplicas{2, 2});
  const std::vector<float> g{2, 4};
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
  // A pull of step 1 from the chief, or from the worker that pushed, waits as ever.
  auto chief = call_later_as(ps, Pull{1, {{1, {0, 2}}}}, Node::chief(), 2);
  auto pushed = call_later_as(ps, Pull{1, {{1, {0, 2}}}}, Node::worker(0), 3);
  CHECK_FALSE(chief->has_value());
  CHECK_FALSE(pushed->has_value());
  CHECK(ps.stats().global_step == 0);
  // A pull of a later step than the next (a worker waiting for the end) changes nothing.
  auto far = call_later_as(ps, Pull{5, {{1, {0, 2}}}}, Node::worker(1), 4);
  CHECK_FALSE(far->has_value());
  CHECK(ps.stats().global_step == 0);
  // Its token said the pacing ps took one push of worker 1 (Pull::pushes_paced).
  const Response fresh = call_as(ps, Pull{1, {{1, {0, 2}}}, 0, 1}, Node::worker(1), 5);
  REQUIRE(std::holds_alternative<PullReply>(fresh));
  CHECK(std::get<PullReply>(fresh).global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});  // b = {5, 6} - worker 0's g alone
  // The old process's push of step 0, read from its connection only now, is the push just
  // counted lost: refused, and not counted again.
  CHECK(error_of(call_as(ps, push_b(1, 0, g), Node::worker(1), 6)) == ErrorCode::kAborted);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});
  REQUIRE(chief->has_value());
  REQUIRE(pushed->has_value());
  CHECK(std::get<PullReply>(**pushed).global_step == 1);
  CHECK_FALSE(far->has_value());
  // Step 1 needs both workers again, worker 1's new process among them.
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 1, g), Node::worker(0))).stale_parts == 0);
  CHECK(ps.stats().global_step == 1);
  CHECK(std::get<PushReply>(call_as(ps, push_b(1, 1, std::vector<float>{0, 0}), Node::worker(1), 5))
            .stale_parts == 0);
  CHECK(ps.stats().global_step == 2);
  CHECK(read(ps, 1) == std::vector<float>{2, 0});  // {3, 2} - mean{g, 0}
  CHECK(ps.stats().workers_lost == 0);
  // The lost push counts as taken, as on the ps that took it: a checkpoint's cut finds
  // every ps at the same counts.
  CHECK(std::get<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)).pushes ==
        std::vector<std::uint64_t>{2, 2});
}

TEST_CASE(
    "SyncReplicas at the message level: a pull that says a push was lost while a cut is paused is "
    "judged once "
    "the pause ends") {
  auto ps = ready_server(SyncReplicas{2, 2});
  const std::vector<float> g{2, 4};
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
  REQUIRE(std::holds_alternative<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)));
  auto fresh = call_later_as(ps, Pull{1, {{1, {0, 2}}}}, Node::worker(1), 5);
  CHECK_FALSE(fresh->has_value());  // a cut sees no step complete on its own
  CHECK(ps.stats().global_step == 0);
  CHECK(std::holds_alternative<Ack>(call_as(ps, Resume{}, Node::chief(), 9)));
  REQUIRE(fresh->has_value());
  CHECK(std::get<PullReply>(**fresh).global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});
}

TEST_CASE(
    "SyncReplicas at the message level: a push a paused cut held is a push, whatever pull follows "
    "it") {
  auto ps = ready_server(SyncReplicas{2, 2});
  REQUIRE(std::holds_alternative<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)));
  auto held0 = call_later_as(ps, push_b(0, 0, std::vector<float>{2, 4}), Node::worker(0), 2);
  auto held1 = call_later_as(ps, push_b(1, 0, std::vector<float>{0, 0}), Node::worker(1), 3);
  auto pull1 = call_later_as(ps, Pull{1, {{1, {0, 2}}}}, Node::worker(1),
                             3);  // after its push, as a worker sends
  CHECK_FALSE(held0->has_value());
  CHECK_FALSE(held1->has_value());
  CHECK_FALSE(pull1->has_value());
  CHECK(std::holds_alternative<Ack>(call_as(ps, Resume{}, Node::chief(), 9)));
  REQUIRE(held1->has_value());
  CHECK(std::get<PushReply>(**held1).stale_parts == 0);  // taken, not judged lost
  REQUIRE(pull1->has_value());
  CHECK(read(ps, 1) == std::vector<float>{4, 4});  // {5, 6} - mean{{2, 4}, {0, 0}}
}

TEST_CASE(
    "SyncReplicas at the message level: a step that waits for a worker whose push was lost takes "
    "its late "
    "push as stale, and backups are not told apart") {
  SUBCASE("R = N = 3") {
    auto ps = ready_server(SyncReplicas{3, 3});
    const std::vector<float> g{2, 4};
    CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
    auto ahead = call_later_as(ps, Pull{1, {{1, {0, 2}}}}, Node::worker(2), 2);
    CHECK_FALSE(ahead->has_value());  // the step still needs worker 1's push
    // Worker 2's push of step 0 arriving all the same (its old process's, late) is stale.
    CHECK(std::get<PushReply>(call_as(ps, push_b(2, 0, g), Node::worker(2), 3)).stale_parts == 2);
    CHECK(ps.stats().global_step == 0);
    CHECK(std::get<PushReply>(call_as(ps, push_b(1, 0, g), Node::worker(1))).stale_parts == 0);
    REQUIRE(ahead->has_value());
    CHECK(ps.stats().global_step == 1);
    CHECK(read(ps, 1) == std::vector<float>{3, 2});  // the mean of workers 0 and 1
  }
  SUBCASE("R = 2 of N = 3: a step needs two gradients from the others while they can bring two") {
    auto ps = ready_server(SyncReplicas{2, 3});
    const std::vector<float> g{2, 4};
    CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
    // Worker 2 skipped step 0 (a backup), or lost its push: it brings nothing to it here.
    auto ahead = call_later_as(ps, Pull{1, {{1, {0, 2}}}}, Node::worker(2), 2);
    CHECK_FALSE(ahead->has_value());
    CHECK(ps.stats().global_step == 0);
    CHECK(std::get<PushReply>(call_as(ps, push_b(2, 0, g), Node::worker(2), 3)).stale_parts == 2);
    CHECK(ps.stats().global_step == 0);
    CHECK(std::get<PushReply>(call_as(ps, push_b(1, 0, std::vector<float>{0, 0}), Node::worker(1)))
              .stale_parts == 0);
    REQUIRE(ahead->has_value());
    CHECK(ps.stats().global_step == 1);
    CHECK(read(ps, 1) == std::vector<float>{4, 4});  // {5, 6} - mean{g, 0}: workers 0 and 1
  }
}

TEST_CASE(
    "SyncReplicas at the message level: a restore forgets the lost pushes counted, and takes the "
    "step's pushes again") {
  auto ps = ready_server(SyncReplicas{2, 2});
  const std::vector<float> g{2, 4};
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
  // Worker 1's push of step 0 was lost with its process: its new process pulls step 1.
  REQUIRE(std::holds_alternative<PullReply>(
      call_as(ps, Pull{1, {{1, {0, 2}}}, 0, 1}, Node::worker(1), 5)));
  // The chief rolls the job back to step 0, epoch 1: step 0 is trained again, and worker 1's
  // push of it is a push like any, not the lost one.
  const std::vector<float> b{5, 6};
  REQUIRE(std::holds_alternative<Ack>(
      call_as(ps, Restore{1, {0}, {{0, kZeroW, {}, {}}, {1, b, {}, {}}}}, Node::chief(), 9)));
  for (std::uint32_t w = 0; w < 2; ++w) {
    Push again = push_b(w, 0, g);
    again.epoch = 1;
    CHECK(std::get<PushReply>(call_as(ps, again, Node::worker(w), 6 + w)).stale_parts == 0);
  }
  CHECK(ps.stats().global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});  // {5, 6} - mean{g, g}
}

TEST_CASE(
    "SyncReplicas at the message level: a push said lost that comes before it was judged is "
    "taken, and counted once") {
  // R = N = 2, a cut paused. Worker 1's new process pulls step 1, its token saying the pacing
  // ps took a push of it; a paused cut judges nothing. Then the old process's push of step 0
  // is read after all (its connection was read late): the cut holds it, and at the resume it
  // is a push of step 0 like any, which completes the step and counts once.
  auto ps = ready_server(SyncReplicas{2, 2});
  const std::vector<float> g{2, 4};
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
  REQUIRE(std::holds_alternative<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)));
  auto ahead = call_later_as(ps, Pull{1, {{1, {0, 2}}}, 0, 1}, Node::worker(1), 2);
  auto late = call_later_as(ps, push_b(1, 0, std::vector<float>{0, 0}), Node::worker(1), 3);
  CHECK_FALSE(ahead->has_value());
  CHECK_FALSE(late->has_value());
  CHECK(std::holds_alternative<Ack>(call_as(ps, Resume{}, Node::chief(), 9)));
  REQUIRE(late->has_value());
  CHECK(std::get<PushReply>(**late).stale_parts == 0);
  REQUIRE(ahead->has_value());
  CHECK(ps.stats().global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{4, 4});  // {5, 6} - mean{g, 0}: both pushes
  CHECK(std::get<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)).pushes ==
        std::vector<std::uint64_t>{1, 1});
}

TEST_CASE(
    "SyncReplicas at the message level: a backup step left short of R by a push lost on the way "
    "goes on, and counts the lost push as the pacing ps did") {
  // R = 2, N = 3. The pacing ps completed step 0 with the pushes of workers 0 and 2; worker
  // 2's push never reached this ps (its process was killed while it wrote it), and worker
  // 1, the backup, skipped step 0. Nobody will bring this ps a second gradient of step 0.
  auto ps = ready_server(SyncReplicas{2, 3});
  const std::vector<float> g{2, 4};
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
  // The backup pulls step 1 with the token it took there: the pacing ps took no push of it.
  auto skipped = call_later_as(ps, Pull{1, {{1, {0, 2}}}, 0, 0}, Node::worker(1), 2);
  CHECK_FALSE(skipped->has_value());  // worker 2 could still bring the second gradient
  // Worker 2's new process pulls step 1: its token said the pacing ps took one push of it.
  const Response fresh = call_as(ps, Pull{1, {{1, {0, 2}}}, 0, 1}, Node::worker(2), 3);
  REQUIRE(std::holds_alternative<PullReply>(fresh));
  CHECK(std::get<PullReply>(fresh).global_step == 1);
  REQUIRE(skipped->has_value());
  CHECK(read(ps, 1) == std::vector<float>{3, 2});  // b = {5, 6} - worker 0's g alone
  // The lost push counts as taken, as on the pacing ps; the skipped step does not.
  CHECK(std::get<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)).pushes ==
        std::vector<std::uint64_t>{1, 0, 1});
}

TEST_CASE(
    "SyncReplicas at the message level: a push lost with its worker's process is not waited for "
    "while another worker is held lost") {
  // R = N = 3. Worker 0 pushed step 0; worker 2 fell silent during the step and is held
  // lost, so the step needs worker 1's push. Worker 1's push of step 0 was lost with its
  // process (another ps took it), and its new process pulls step 1: the step goes on with
  // worker 0's gradient alone instead of waiting for a push that never comes.
  auto ps = ready_server(SyncReplicas{3, 3});
  ps.set_worker_timeout(std::chrono::milliseconds(400));
  const std::vector<float> g{2, 4};
  for (std::uint32_t w = 0; w < 3; ++w) call_as(ps, Heartbeat{w}, Node::worker(w), 10 + w);
  CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
  for (int i = 0;
       i < 300 && std::get<StatsReply>(call_as(ps, GetStats{}, Node::chief(), 9)).lost.empty();
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    call_as(ps, Heartbeat{0}, Node::worker(0), 10);
    call_as(ps, Heartbeat{1}, Node::worker(1), 11);
  }
  REQUIRE(std::get<StatsReply>(call_as(ps, GetStats{}, Node::chief(), 9)).lost ==
          std::vector<std::uint32_t>{2});
  CHECK(ps.stats().global_step == 0);  // worker 1's push is still needed
  const Response ahead = call_as(ps, Pull{1, {{1, {0, 2}}}}, Node::worker(1), 2);
  REQUIRE(std::holds_alternative<PullReply>(ahead));
  CHECK(std::get<PullReply>(ahead).global_step == 1);
  CHECK(read(ps, 1) == std::vector<float>{3, 2});  // b = {5, 6} - worker 0's g alone
}

TEST_CASE(
    "SyncReplicas at the message level: a pull ahead counts a push as taken only when the pacing "
    "ps "
    "took more of its worker's pushes") {
  const std::vector<float> g{2, 4};
  SUBCASE("R = N: the pacing ps took none (its worker was held lost there): not counted") {
    auto ps = ready_server(SyncReplicas{2, 2});
    CHECK(std::get<PushReply>(call_as(ps, push_b(0, 0, g), Node::worker(0))).stale_parts == 0);
    const Response fresh = call_as(ps, Pull{1, {{1, {0, 2}}}, 0, 0}, Node::worker(1), 5);
    REQUIRE(std::holds_alternative<PullReply>(fresh));
    CHECK(std::get<PullReply>(fresh).global_step == 1);
    // Worker 0's push alone (the counts end at the last worker with one).
    CHECK(std::get<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)).pushes ==
          std::vector<std::uint64_t>{1});
  }
  SUBCASE("a worker held lost here, whose pull is not judged: counted once the step goes on") {
    // R = N = 2, worker 1 held lost before step 0 began here: a refill step, which worker 0
    // completes alone. Worker 1's new process pulls step 1, and the pacing ps took one push
    // of it that this ps never got: the policy does not wait for a worker held lost, so the
    // pull is not judged, and the push is counted when the step moves.
    auto ps = ready_server(SyncReplicas{2, 2});
    ps.set_worker_timeout(std::chrono::milliseconds(400));
    for (std::uint32_t w = 0; w < 2; ++w) call_as(ps, Heartbeat{w}, Node::worker(w), 10 + w);
    for (int i = 0;
         i < 300 && std::get<StatsReply>(call_as(ps, GetStats{}, Node::chief(), 9)).lost.empty();
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      call_as(ps, Heartbeat{0}, Node::worker(0), 10);
    }
    REQUIRE(std::get<StatsReply>(call_as(ps, GetStats{}, Node::chief(), 9)).lost ==
            std::vector<std::uint32_t>{1});
    auto ahead = call_later_as(ps, Pull{1, {{1, {0, 2}}}, 0, 1}, Node::worker(1), 5);
    CHECK_FALSE(ahead->has_value());
    Push refill = push_b(0, 0, g);
    refill.refill = true;  // as the pacing ps's tokens said: worker 0 brings both gradients
    CHECK(std::get<PushReply>(call_as(ps, refill, Node::worker(0))).stale_parts == 0);
    CHECK_FALSE(ahead->has_value());
    CHECK(std::get<PushReply>(call_as(ps, refill, Node::worker(0))).stale_parts == 0);
    REQUIRE(ahead->has_value());
    CHECK(std::get<PullReply>(**ahead).global_step == 1);
    CHECK(std::get<PauseReply>(call_as(ps, Pause{}, Node::chief(), 9)).pushes ==
          std::vector<std::uint64_t>{2, 1});
  }
}

TEST_CASE("each request is taken only from the jobs that may send it") {
  auto ps = ready_server(Async{});
  const std::vector<float> g{1, 1};
  const Node worker = Node::worker(0), chief = Node::chief(), evaluator = Node::evaluator();
  // The chief registers, initializes and ends training; nobody else.
  CHECK(error_of(call_as(ps, Register{kModel}, worker)) == ErrorCode::kPermissionDenied);
  CHECK(error_of(call_as(ps, Initialize{{{1, g}}}, evaluator)) == ErrorCode::kPermissionDenied);
  CHECK(error_of(call_as(ps, Shutdown{}, worker)) == ErrorCode::kPermissionDenied);
  const auto denied = call_as(ps, Shutdown{}, evaluator);
  CHECK(std::get<ErrorReply>(denied).message.find("only a chief may send it") != std::string::npos);
  // Workers take tokens and push, for their own index only.
  CHECK(error_of(call_as(ps, push_b(0, 0, g), chief)) == ErrorCode::kPermissionDenied);
  CHECK(error_of(call_as(ps, TakeToken{0}, evaluator)) == ErrorCode::kPermissionDenied);
  CHECK(error_of(call_as(ps, push_b(1, 0, g), worker)) == ErrorCode::kPermissionDenied);
  CHECK(error_of(call_as(ps, TakeToken{1}, worker)) == ErrorCode::kPermissionDenied);
  CHECK(read(ps, 1) == std::vector<float>{5, 6});  // nothing of it was applied
  // What each may do, it may.
  CHECK(std::holds_alternative<PushReply>(call_as(ps, push_b(0, 0, g), worker)));
  CHECK(std::holds_alternative<TokenReply>(call_as(ps, TakeToken{0}, worker)));
  CHECK(std::holds_alternative<PullReply>(call_as(ps, Pull{0, {{1, {0, 2}}}}, evaluator)));
  CHECK(std::holds_alternative<StatsReply>(call_as(ps, GetStats{}, evaluator)));
  CHECK(std::holds_alternative<PlacementReply>(call_as(ps, Register{kModel}, chief)));
  CHECK(std::holds_alternative<Ack>(call_as(ps, Shutdown{}, chief)));
}

TEST_CASE("a pull may ask for each row once: a reply is never larger than what the ps holds") {
  auto ps = ready_server(Async{});
  CHECK(error_of(call(ps, Pull{0, {{0, {0, 2}}, {0, {0, 2}}}})) == ErrorCode::kInvalidArgument);
  const auto overlap = call(ps, Pull{0, {{1, {0, 2}}, {0, {0, 1}}, {1, {1, 2}}}});
  CHECK(error_of(overlap) == ErrorCode::kInvalidArgument);
  CHECK(std::get<ErrorReply>(overlap).message.find("twice") != std::string::npos);
  // Adjacent or separate rows of one part are fine, in any order.
  const auto ok = call(ps, Pull{0, {{0, {1, 2}}, {1, {0, 2}}, {0, {0, 1}}}});
  REQUIRE(std::holds_alternative<PullReply>(ok));
  CHECK(std::get<PullReply>(ok).values.size() == 3);
  CHECK(ps.max_request_payload() == 6 * sizeof(float));
}

TEST_CASE("a token is a lease on the connection it was taken on") {
  ParameterServer<RoundRobin, Sgd, SyncReplicas> ps(0, 1, Sgd{1.0F}, SyncReplicas(2, 2));
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6}, g{1, 1};
  call(ps, Initialize{{{0, w}, {1, b}}});
  const Node one = Node::worker(1);
  // Worker 1 takes its token of step 0 on connection 10, and that connection goes.
  REQUIRE(std::holds_alternative<TokenReply>(call_as(ps, TakeToken{1}, one, 10)));
  // A process in its place (connection 11) asks for a token: one per worker per step.
  std::optional<Response> second;
  ps.handle(TakeToken{1}, RequestContext{false, one, 11}, [&](Response&& r) { second = std::move(r); });
  CHECK_FALSE(second.has_value());
  ps.disconnected(one, 99);  // another connection of worker 1: not the lease holder
  CHECK_FALSE(second.has_value());
  ps.disconnected(one, 10);  // the holder: its token comes back, to the one waiting
  REQUIRE(second.has_value());
  CHECK(std::get<TokenReply>(*second).token.local_step == 0);
  // Worker 1 pushes on 11; that connection goes too: nothing to give back, and worker 1 may
  // not take a second token of the step it pushed for.
  CHECK(std::holds_alternative<PushReply>(call_as(ps, push_b(1, 0, g), one, 11)));
  ps.disconnected(one, 11);
  std::optional<Response> third;
  ps.handle(TakeToken{1}, RequestContext{false, one, 12}, [&](Response&& r) { third = std::move(r); });
  CHECK_FALSE(third.has_value());
  // A parked request whose connection goes is answered, not left to take a token later.
  ps.disconnected(one, 12);
  REQUIRE(third.has_value());
  CHECK(error_of(*third) == ErrorCode::kUnavailable);
}

TEST_CASE("a sync step whose mean overflows float is skipped, counted, and the step moves on") {
  // Sgd with rate 0.1 accepts each 3e38 gradient (w - 3e37 is finite); their sum is not.
  ParameterServer<RoundRobin, Sgd, SyncReplicas> ps(0, 1, Sgd{0.1F}, SyncReplicas(2, 2));
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6}, huge{3e38F, 3e38F};
  call(ps, Initialize{{{0, w}, {1, b}}});
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(0, 0, huge))));
  CHECK(std::holds_alternative<PushReply>(call(ps, push_b(1, 0, huge))));
  const Stats stats = ps.stats();
  CHECK(stats.global_step == 1);
  CHECK(stats.updates_refused == 1);
  CHECK(stats.updates_applied == 0);
  CHECK(read(ps, 1) == std::vector<float>{5, 6});
}

namespace {

/// An optimizer that does not predict finiteness: the ps applies it to copies.
struct Blowup {
  float learning_rate = 1.0F;
  struct State {
    std::vector<float> count;
  };
  State make_state(std::size_t n) const { return {std::vector<float>(n, 0.0F)}; }
  void apply(State& state, std::span<float> w, std::span<const float> g) const {
    for (std::size_t i = 0; i < w.size(); ++i) {
      state.count[i] += 1.0F;
      w[i] = w[i] * learning_rate - g[i];
    }
  }
};

/// The same, with a State that cannot be copied.
struct UncopyableBlowup {
  struct State {
    std::unique_ptr<int> marker;
  };
  State make_state(std::size_t) const { return {std::make_unique<int>(0)}; }
  void apply(State&, std::span<float> w, std::span<const float> g) const {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = w[i] * 1e38F - g[i];
  }
};

}  // namespace

TEST_CASE("an optimizer that cannot predict finiteness is applied to copies kept only if finite") {
  ParameterServer<RoundRobin, Blowup, Async> ps(0, 1, Blowup{1e38F}, Async{});
  call(ps, Register{kModel});
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6}, g{1, 1};
  call(ps, Initialize{{{0, w}, {1, b}}});
  // 5 * 1e38 overflows: the update is skipped on every part, and the state kept too; the
  // push, an update by itself, is refused, as one that stays_finite rejects would be.
  CHECK(error_of(call(ps, push_b(0, 0, g))) == ErrorCode::kInvalidArgument);
  CHECK(read(ps, 1) == std::vector<float>{5, 6});
  CHECK(read(ps, 0) == std::vector<float>{1, 2, 3, 4});
  CHECK(ps.stats().updates_refused == 1);
  CHECK(ps.stats().updates_applied == 0);

  ParameterServer<RoundRobin, Blowup, Async> tame(0, 1, Blowup{1.0F}, Async{});
  call(tame, Register{kModel});
  call(tame, Initialize{{{0, w}, {1, b}}});
  CHECK(std::holds_alternative<PushReply>(call(tame, push_b(0, 0, g))));
  CHECK(read(tame, 1) == std::vector<float>{4, 5});  // applied: 5 - 1, 6 - 1
  CHECK(tame.stats().updates_applied == 2);

  // Without a copyable State nothing can be undone: the ps fails rather than serve Inf.
  ParameterServer<RoundRobin, UncopyableBlowup, Async> stuck(0, 1, UncopyableBlowup{}, Async{});
  call(stuck, Register{kModel});
  call(stuck, Initialize{{{0, w}, {1, b}}});
  const auto failed = call(stuck, push_b(0, 0, g));
  CHECK(error_of(failed) == ErrorCode::kInternal);
  CHECK(std::get<ErrorReply>(failed).message.find("went non-finite") != std::string::npos);
  CHECK(stuck.stopped());
}

TEST_CASE("a push one ps refuses as overflowing still counts there: the ps tasks stay in step") {
  // Two ps tasks, one variable each (RoundRobin); each push is an update by itself (R = 1,
  // a backup worker): a push whose gradient for ps 0's variable would overflow is refused
  // by ps 0, naming the sender, and taken by ps 1; both must still end the step.
  using Server = ParameterServer<RoundRobin, Sgd, SyncReplicas>;
  const std::vector<VariableSpec> model{{"a", {2}, {}}, {"b", {2}, {}}};
  std::vector<Server> ps;
  for (std::uint32_t t = 0; t < 2; ++t) {
    ps.emplace_back(t, 2, Sgd{1.0F}, SyncReplicas(1, 2));
    call(ps[t], Register{model});
  }
  const std::vector<float> one{1, 1};
  call(ps[0], Initialize{{{0, one}}});
  call(ps[1], Initialize{{{1, one}}});
  const std::vector<float> huge{3e38F, 3e38F}, small{0.5F, 0.5F};
  const auto refused = call(ps[0], Push{0, 0, {{0, huge}}});
  CHECK(error_of(refused) == ErrorCode::kInvalidArgument);
  CHECK(std::get<ErrorReply>(refused).message.find("worker 0") != std::string::npos);
  CHECK(std::get<ErrorReply>(refused).message.find("'a'") != std::string::npos);
  CHECK(std::holds_alternative<PushReply>(call(ps[1], Push{0, 0, {{1, small}}})));
  CHECK(ps[0].stats().global_step == 1);
  CHECK(ps[1].stats().global_step == 1);
  CHECK(read(ps[0], 0) == std::vector<float>{1, 1});  // nothing of it applied on ps 0
  CHECK(ps[0].stats().updates_refused == 1);
}
