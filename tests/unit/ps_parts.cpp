// SPDX-License-Identifier: MIT
// The parts a ParameterServer is made of, each on its own, with no ps and no transport:
// Liveness (lost workers), PushLedger (pushes taken, resends), StepGate (requests waiting
// for a step), CheckpointCut (the ps's half of a cut), Pacing (tokens and their leases) and
// Registration (the model's checks, readiness, the epoch).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "pulley/ps/checkpoint_cut.hpp"
#include "pulley/ps/liveness.hpp"
#include "pulley/ps/pacing.hpp"
#include "pulley/ps/push_ledger.hpp"
#include "pulley/ps/registration.hpp"
#include "pulley/ps/step_gate.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/sync_replicas.hpp"

using namespace pulley;
using namespace std::chrono_literals;

namespace {

/// A reply slot: where a Responder's answer lands.
struct Answer {
  std::optional<Response> response;
  Responder responder() {
    return [this](Response&& r) { response = std::move(r); };
  }
  template <class R>
  [[nodiscard]] bool is() const {
    return response && std::holds_alternative<R>(*response);
  }
  [[nodiscard]] ErrorCode code() const { return std::get<ErrorReply>(*response).code; }
};

const Liveness::Clock::time_point kT0{};

}  // namespace

TEST_CASE("Liveness: a worker heard once and then silent for the timeout is lost, once") {
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard(0, kT0 + 1s);
  liveness.heard(1, kT0 + 1s);
  std::vector<std::uint32_t> lost;
  auto expire = [&](auto at) { liveness.expire(at, [&](std::uint32_t w, auto) { lost.push_back(w); }); };
  liveness.heard(0, kT0 + 5s);
  expire(kT0 + 5900ms);  // worker 1 silent 4.9 s: not yet
  CHECK(lost.empty());
  expire(kT0 + 6s);
  CHECK(lost == std::vector<std::uint32_t>{1});
  expire(kT0 + 7s);  // held lost already: not again
  CHECK(lost == std::vector<std::uint32_t>{1});
  CHECK(liveness.lost() == std::vector<std::uint32_t>{1});
  CHECK(liveness.describe({1, 0}, kT0 + 7s) == "worker:1 (last heard 6.0 s ago), worker:0 (last heard 2.0 s ago)");
  liveness.back(1, kT0 + 8s);
  CHECK_FALSE(liveness.is_lost(1));
  CHECK(liveness.lost().empty());
}

TEST_CASE("Liveness: silent says whom expire would hold lost, without holding anyone lost") {
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard(0, kT0 + 1s);
  liveness.heard(1, kT0 + 1s);
  liveness.heard(0, kT0 + 5s);
  CHECK_FALSE(liveness.silent(1, kT0 + 5900ms));
  CHECK(liveness.silent(1, kT0 + 6s));
  CHECK_FALSE(liveness.silent(0, kT0 + 6s));
  CHECK_FALSE(liveness.silent(7, kT0 + 6s));  // never heard: never lost
  CHECK_FALSE(liveness.is_lost(1));
  // Nobody heard for a whole timeout: the silence may be the ps's own, nobody is silent.
  CHECK_FALSE(liveness.silent(1, kT0 + 10s));
  CHECK_FALSE(liveness.silent(0, kT0 + 10s));
  std::vector<std::uint32_t> lost;
  liveness.expire(kT0 + 6s, [&](std::uint32_t w, auto) { lost.push_back(w); });
  CHECK(lost == std::vector<std::uint32_t>{1});
  CHECK_FALSE(liveness.silent(1, kT0 + 6s));  // held lost already: is_lost says so
}

TEST_CASE("Liveness: a chief heard once and then silent for the timeout is lost, and back when heard") {
  Liveness liveness;
  liveness.set_timeout(5s);
  CHECK(liveness.timeout() == 5s);
  int chief_lost = 0;
  auto expire = [&](auto at) {
    liveness.expire_chief(at, [&](auto last) {
      CHECK(last == kT0 + 1s);
      ++chief_lost;
    });
    liveness.expire(at, [](std::uint32_t, auto) {});
  };
  expire(kT0 + 60s);  // never heard: never lost
  CHECK(chief_lost == 0);
  CHECK_FALSE(liveness.heard_chief(kT0 + 1s));
  liveness.heard(0, kT0 + 3s);
  liveness.heard(0, kT0 + 5s);
  expire(kT0 + 5900ms);
  CHECK(chief_lost == 0);
  liveness.heard(0, kT0 + 6s);
  expire(kT0 + 6s);  // silent 5 s while a worker is heard: lost, once
  expire(kT0 + 7s);
  CHECK(chief_lost == 1);
  CHECK(liveness.chief_lost_since() == kT0 + 1s);
  CHECK(liveness.heard_chief(kT0 + 8s));  // back
  CHECK_FALSE(liveness.chief_lost_since().has_value());
  liveness.chief_left();  // ended normally: silence is not lost
  liveness.heard(0, kT0 + 12s);
  expire(kT0 + 30s);
  expire(kT0 + 40s);
  CHECK(chief_lost == 1);
  CHECK_FALSE(liveness.chief_lost_since().has_value());
}

TEST_CASE("Liveness: a ps that heard nobody for a whole timeout gives the chief a fresh one too") {
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard_chief(kT0);
  liveness.heard(0, kT0);
  bool lost = false;
  liveness.expire_chief(kT0 + 20s, [&](auto) { lost = true; });  // the ps was stopped
  CHECK_FALSE(lost);
  liveness.heard(0, kT0 + 21s);  // a worker is heard; the chief not yet
  liveness.heard(0, kT0 + 24s);
  liveness.expire_chief(kT0 + 25s, [&](auto) { lost = true; });
  CHECK_FALSE(lost);  // a whole fresh timeout from the first word after the silence
  liveness.expire_chief(kT0 + 26s, [&](auto) { lost = true; });
  CHECK(lost);
  CHECK(liveness.chief_lost_since() == kT0 + 21s);
}

TEST_CASE("Liveness: a ps that heard nobody for a whole timeout gives every worker a fresh one") {
  // The ps was the one cut off (stopped, partitioned): the first worker back must not make
  // the others look lost.
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard(0, kT0);
  liveness.heard(1, kT0);
  liveness.heard(0, kT0 + 20s);  // the first heartbeat after 20 s of silence
  bool any = false;
  liveness.expire(kT0 + 21s, [&](std::uint32_t, auto) { any = true; });
  CHECK_FALSE(any);
  liveness.heard(0, kT0 + 24s);
  liveness.expire(kT0 + 25s, [&](std::uint32_t, auto) { any = true; });
  CHECK(any);  // worker 1 stayed silent for a whole fresh timeout
}

TEST_CASE("Liveness: a ps that was stopped longer than the timeout holds nobody lost before it hears anyone") {
  // Stopped (SIGSTOP, a long pause) for 20 s: the first thing it does after is a check (a
  // GetStats), before any worker's heartbeat is read. Its own silence is not theirs.
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard(0, kT0);
  liveness.heard(1, kT0);
  std::vector<std::uint32_t> lost;
  auto expire = [&](auto at) { liveness.expire(at, [&](std::uint32_t w, auto) { lost.push_back(w); }); };
  expire(kT0 + 20s);
  CHECK(lost.empty());
  liveness.heard(1, kT0 + 21s);  // worker 1's heartbeat comes through; worker 0's never does
  liveness.heard(1, kT0 + 24s);
  expire(kT0 + 25s);
  CHECK(lost.empty());
  expire(kT0 + 26s);  // a whole timeout from the first word after the silence
  CHECK(lost == std::vector<std::uint32_t>{0});
  // Every worker gone at once: held lost after two timeouts (the first is the grace).
  Liveness alone;
  alone.set_timeout(5s);
  alone.heard(3, kT0);
  std::vector<std::uint32_t> gone;
  alone.expire(kT0 + 5s, [&](std::uint32_t w, auto) { gone.push_back(w); });
  CHECK(gone.empty());
  alone.expire(kT0 + 9s, [&](std::uint32_t w, auto) { gone.push_back(w); });
  CHECK(gone.empty());
  alone.expire(kT0 + 10s, [&](std::uint32_t w, auto) { gone.push_back(w); });
  CHECK(gone == std::vector<std::uint32_t>{3});
}

TEST_CASE("Liveness: after a silence whose grace began, the first word heard gives every worker a fresh timeout") {
  // A ps with copies that lost the chief's lease hears no task: its clock (Service::tick)
  // finds the silence and begins the grace long before the chief is back. The workers,
  // refused meanwhile, come back only after the chief: they must not be held lost for a
  // silence that was the ps's own.
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard(0, kT0);
  liveness.heard(1, kT0);
  liveness.heard_chief(kT0);
  std::vector<std::uint32_t> lost;
  auto expire = [&](auto at) { liveness.expire(at, [&](std::uint32_t w, auto) { lost.push_back(w); }); };
  bool chief_lost = false;
  liveness.expire_chief(kT0 + 6s, [&](auto) { chief_lost = true; });  // the tick: the grace begins
  CHECK_FALSE(chief_lost);
  CHECK_FALSE(liveness.heard_chief(kT0 + 10s));  // back before the grace ran out
  liveness.heard(1, kT0 + 12s);                  // worker 1 is let in again; worker 0 never is
  expire(kT0 + 14s);
  CHECK(lost.empty());  // 8 s after the grace began, but within a timeout of the chief's word
  expire(kT0 + 15s);
  CHECK(lost == std::vector<std::uint32_t>{0});
}

TEST_CASE("Liveness: a fence's silence is forgiven, not the silence before it") {
  // A ps with copies refused every task from kT0 + 7 s to kT0 + 20 s (ShardCopies' fence).
  Liveness liveness;
  liveness.set_timeout(5s);
  liveness.heard(0, kT0);
  liveness.heard(2, kT0);
  liveness.heard(1, kT0 + 4s);
  std::vector<std::uint32_t> lost;
  auto expire = [&](auto at) { liveness.expire(at, [&](std::uint32_t w, auto) { lost.push_back(w); }); };
  liveness.heard(0, kT0 + 6s);
  liveness.heard(1, kT0 + 6s);
  liveness.heard(3, kT0 + 7s);  // the ps heard a task up to the fence
  expire(kT0 + 10500ms);        // worker 2 stayed silent
  REQUIRE(lost == std::vector<std::uint32_t>{2});
  lost.clear();
  liveness.forgive(kT0 + 7s, kT0 + 20s);  // refused from 7 s on (the fence)
  CHECK(liveness.is_lost(2));             // a verdict stands
  expire(kT0 + 23s);
  CHECK(lost.empty());  // 1 s of their own silence before the fence, 3 s after it
  expire(kT0 + 24s);
  CHECK(lost == std::vector<std::uint32_t>{0, 1});
  CHECK(liveness.last_heard(3, kT0 + 24s) == " (last heard 4.0 s ago)");  // heard up to the fence
}

TEST_CASE("Liveness: a ps that heard nobody before its fence forgives that silence too") {
  // The ps was stopped (or cut off) from 0 s to 5 s: its lease on the chief ran out at
  // 1.125 s, in that time, and it fenced itself off once it ran again.
  Liveness liveness;
  liveness.set_timeout(1500ms);
  liveness.heard(1, kT0 - 300ms);  // silent 0.3 s longer: that still counts
  liveness.heard(0, kT0);
  std::vector<std::uint32_t> lost;
  auto expire = [&](auto at) { liveness.expire(at, [&](std::uint32_t w, auto) { lost.push_back(w); }); };
  liveness.forgive(kT0 + 1125ms, kT0 + 5s);
  expire(kT0 + 6100ms);
  CHECK(lost.empty());  // not the 3.9 s from the lease's end to 5 s only: all 5 s
  expire(kT0 + 6200ms);
  CHECK(lost == std::vector<std::uint32_t>{1});
  CHECK(liveness.last_heard(0, kT0 + 6200ms) == " (last heard 1.2 s ago)");
}

TEST_CASE("Liveness: a worker that leaves is forgotten, one already lost stays lost") {
  Liveness liveness;
  liveness.set_timeout(1s);
  liveness.heard(0, kT0);
  liveness.heard(1, kT0);
  liveness.leave(0);
  liveness.expire(kT0 + 2s, [](std::uint32_t, auto) {});  // nobody heard: a fresh timeout first
  CHECK(liveness.lost().empty());
  liveness.expire(kT0 + 3s, [](std::uint32_t, auto) {});
  CHECK(liveness.lost() == std::vector<std::uint32_t>{1});
  liveness.leave(1);
  CHECK(liveness.lost() == std::vector<std::uint32_t>{1});
  CHECK(liveness.last_heard(7, kT0).empty());  // never heard: nothing to say
}

TEST_CASE("PushLedger: counts pushes by worker and answers a resend as the first") {
  PushLedger ledger;
  CHECK(ledger.furthest() == -1);
  ledger.count(2, 5);
  ledger.count(0, 3);  // the furthest step pushed for stays 5
  ledger.answered(2, 41, {3, ""});
  CHECK(ledger.furthest() == 5);
  CHECK(ledger.taken(2) == 1);
  CHECK(ledger.taken(0) == 1);
  ledger.clear();
  CHECK(ledger.furthest() == -1);
  ledger.count(2, 5);
  ledger.answered(2, 41, {3, ""});
  CHECK(ledger.taken(0) == 0);
  CHECK(ledger.taken() == std::vector<std::uint64_t>{0, 0, 1});
  REQUIRE(ledger.repeated(2, 41) != nullptr);
  CHECK(ledger.repeated(2, 41)->stale_parts == 3);
  CHECK(ledger.repeated(2, 41)->refused.empty());
  CHECK(ledger.repeated(2, 42) == nullptr);
  CHECK(ledger.repeated(1, 41) == nullptr);
  ledger.answered(0, 0, {5, ""});  // unnumbered: nothing to recognize it by
  CHECK(ledger.repeated(0, 0) == nullptr);
  // A refused update is refused again, with its reason.
  ledger.answered(1, 7, {0, "would make 'w' non-finite"});
  REQUIRE(ledger.repeated(1, 7) != nullptr);
  CHECK(ledger.repeated(1, 7)->refused == "would make 'w' non-finite");
  // Numbered in a series: the same number of another series is another push, and a lower
  // number of the same series is a late copy.
  ledger.answered(3, 50, {0, ""}, 8);
  CHECK(ledger.repeated(3, 50, 8) != nullptr);
  CHECK(ledger.repeated(3, 50, 9) == nullptr);
  CHECK(ledger.older(3, 49, 8));
  CHECK_FALSE(ledger.older(3, 50, 8));
  CHECK_FALSE(ledger.older(3, 49, 9));
  CHECK_FALSE(ledger.older(3, 49, 0));
  CHECK_FALSE(ledger.older(4, 1, 8));
  ledger.clear();
  CHECK(ledger.repeated(2, 41) == nullptr);
  CHECK(ledger.taken(2) == 0);
}

TEST_CASE("StepGate: requests are answered once their step comes, in the order they came") {
  StepGate<int> gate;
  Answer a, b, c;
  Responder ra = a.responder(), rb = b.responder(), rc = c.responder();
  gate.park(3, 1, ra);
  gate.park(2, 2, rb);
  gate.park(3, 3, rc);
  CHECK(!ra);  // parked: the gate holds the reply now
  std::vector<int> order;
  auto answer = [&](int& request, Responder& reply) {
    order.push_back(request);
    respond(reply, Ack{});
  };
  gate.release(1, answer);
  CHECK(order.empty());
  gate.release(2, answer);
  CHECK(order == std::vector<int>{2});
  gate.release(5, answer);
  CHECK(order == std::vector<int>{2, 1, 3});
  CHECK(a.is<Ack>());
  CHECK(gate.size() == 0);
  Answer d;
  Responder rd = d.responder();
  gate.park(9, 4, rd);
  gate.answer_all(ErrorReply{ErrorCode::kOutOfRange, "over"});
  CHECK(d.code() == ErrorCode::kOutOfRange);
}

/// Every worker awaited by a cut (none held lost).
constexpr auto kEveryWorker = [](std::uint32_t) { return true; };

TEST_CASE("CheckpointCut: held pushes are taken up to the cut, in order, then the state is read") {
  CheckpointCut cut;
  PushLedger ledger;
  cut.pause(7);
  CHECK(cut.paused_by(7));
  CHECK(cut.paused_by(0));
  CHECK_FALSE(cut.paused_by(8));
  const std::vector<float> g{1.0F};
  Answer p1, p2, p3, read;
  Responder r1 = p1.responder(), r2 = p2.responder(), r3 = p3.responder(), rr = read.responder();
  // Worker 0 pushes twice, worker 1 once; the cut holds one of each worker 0 and 1.
  cut.hold(Push{0, 0, {{0, g}}, 0, 1}, r1);
  cut.hold(Push{0, 1, {{0, g}}, 0, 2}, r2);
  cut.hold(Push{1, 0, {{0, g}}, 0, 3}, r3);
  std::vector<std::uint64_t> taken_sequences;
  auto take = [&](const Push& push, Responder& reply) {
    CHECK(push.gradients.at(0).values[0] == 1.0F);  // copied out of the sender's buffer
    taken_sequences.push_back(push.sequence);
    ledger.count(push.worker, push.local_step);
    respond(reply, PushReply{});
  };
  auto state = [] { return StateReply{42, {}, {}}; };
  CHECK_FALSE(CheckpointCut::past(ledger, {1, 1}).has_value());
  cut.read_at({1, 1}, rr);
  cut.advance(ledger, take, state, kEveryWorker);
  CHECK(taken_sequences == std::vector<std::uint64_t>{1, 3});
  REQUIRE(read.is<StateReply>());
  CHECK(std::get<StateReply>(*read.response).global_step == 42);
  CHECK_FALSE(p2.response.has_value());  // past the cut: still held
  CHECK(CheckpointCut::past(ledger, {0, 1}) == std::optional<std::uint32_t>{0});
  cut.resume(take);  // the rest is taken in order
  CHECK(taken_sequences == std::vector<std::uint64_t>{1, 3, 2});
  CHECK(p2.is<PushReply>());
  CHECK_FALSE(cut.paused());
}

TEST_CASE("CheckpointCut: a worker the ps no longer awaits (held lost) is not waited for") {
  CheckpointCut cut;
  PushLedger ledger;
  cut.pause(1);
  Answer read;
  Responder rr = read.responder();
  cut.read_at({0, 1}, rr);  // another ps took a push of worker 1 that never comes here
  const auto nothing = [](const Push&, Responder&) {};
  const auto state = [] { return StateReply{7, {}, {}}; };
  cut.advance(ledger, nothing, state, kEveryWorker);
  CHECK_FALSE(read.response.has_value());  // waited for while awaited
  cut.advance(ledger, nothing, state, [](std::uint32_t w) { return w != 1; });
  REQUIRE(read.is<StateReply>());
  CHECK(std::get<StateReply>(*read.response).global_step == 7);
}

TEST_CASE("CheckpointCut: a cut not reached is cancelled by Resume, and a failure answers everything") {
  CheckpointCut cut;
  PushLedger ledger;
  cut.pause(1);
  Answer read, held, pause;
  Responder rr = read.responder(), rh = held.responder(), rp = pause.responder();
  cut.read_at({2}, rr);  // worker 0's second push never came
  cut.advance(
      ledger, [](const Push&, Responder&) {}, [] { return StateReply{}; }, kEveryWorker);
  CHECK_FALSE(read.response.has_value());
  cut.resume([](const Push&, Responder&) {});
  CHECK(read.code() == ErrorCode::kCancelled);
  cut.pause(1);
  cut.hold(Push{0, 0, {}, 0, 0}, rh);
  cut.park_pause(10, 1, rp);
  cut.answer_all(ErrorReply{ErrorCode::kAborted, "gone"});
  CHECK(held.code() == ErrorCode::kAborted);
  CHECK(pause.code() == ErrorCode::kAborted);
  CHECK_FALSE(cut.paused());
}

TEST_CASE("Pacing: a token is a lease on the connection it was taken on") {
  Pacing<SyncReplicas> pacing(SyncReplicas(1, 2));
  const auto no_refusal = [](Responder&, ErrorCode, const std::string&) { FAIL("no refusal expected"); };
  PushLedger ledger;
  ledger.count(0, -1);
  ledger.count(0, -1);  // two pushes of worker 0 taken: the token says so
  Answer first, again, other;
  Responder r1 = first.responder();
  pacing.wait_for_token(0, /*session=*/5, r1, ledger);
  pacing.hand_out(ledger, no_refusal);
  REQUIRE(first.is<TokenReply>());
  CHECK(std::get<TokenReply>(*first.response).token.local_step == 0);
  CHECK(std::get<TokenReply>(*first.response).pushes_taken == 2);
  // Asked again on the connection it was taken on (its answer was lost on the way): the
  // same token, at once, and no second one is taken.
  Responder r2 = again.responder();
  ledger.count(0, -1);
  pacing.wait_for_token(0, 5, r2, ledger);
  REQUIRE(again.is<TokenReply>());
  CHECK(std::get<TokenReply>(*again.response).token.local_step == 0);
  CHECK(std::get<TokenReply>(*again.response).pushes_taken == 3);
  CHECK(pacing.waiting_for().find("1 of 2 tokens left") != std::string::npos);
  // Asked on another connection (a process in its place), it waits; that connection
  // closing answers it and gives no token back...
  Responder r3 = other.responder();
  pacing.wait_for_token(0, 6, r3, ledger);
  pacing.hand_out(ledger, no_refusal);
  CHECK_FALSE(other.response.has_value());
  CHECK_FALSE(pacing.disconnected(0, 6, "gone"));
  CHECK(other.code() == ErrorCode::kUnavailable);
  // ... the connection it was taken on does.
  CHECK(pacing.disconnected(0, 5, "ps 0: worker:0 disconnected"));
  CHECK(pacing.waiting_for().find("2 of 2 tokens left") != std::string::npos);
  CHECK(pacing.global_step() == 0);
  CHECK(pacing.on_push(1, 0) == Verdict::kReady);  // R = 1: a push is a step
  CHECK(pacing.global_step() == 1);
  CHECK(pacing.on_push(1, 0) == Verdict::kStale);
  // A restore puts a loaded pacer in place and answers what waited.
  const auto saved = pacing.save();
  Answer waiting;
  Responder rw = waiting.responder();
  pacing.wait_for_token(1, 9, rw, ledger);
  pacing.reset(pacing.load(saved), ErrorReply{ErrorCode::kFailedPrecondition, "restored"});
  CHECK(waiting.code() == ErrorCode::kFailedPrecondition);
  CHECK(pacing.global_step() == 1);
}

TEST_CASE("Registration: a model is checked and placed, the epoch refuses what came before") {
  Registration<RoundRobin> registration(1, 2, RoundRobin{});
  Placement placement;
  CHECK_FALSE(registration.check(Register{{{"w", {4}, {}}, {"b", {2}, {}}}}, true, placement).has_value());
  CHECK(placement.parts.size() == 2);
  CHECK(registration.check(Register{{{"w", {4}, {}}, {"w", {2}, {}}}}, true, placement)->message ==
        "variable name 'w' is used twice");
  CHECK(registration.check(Register{{{"w", {0}, {}}}}, true, placement)->message == "variable 'w' has no elements");
  const auto no_tables = registration.check(Register{{{"w", {4}, {}}}, {TableSpec{"emb", 8, {}}}}, false, placement);
  REQUIRE(no_tables.has_value());
  CHECK(no_tables->code == ErrorCode::kFailedPrecondition);
  CHECK(registration.check(Register{{{"w", {4}, {}}}, {TableSpec{"w", 8, {}}}}, true, placement)->message ==
        "name 'w' is used twice");
  // Readiness: a WaitReady waits, then every waiter gets the answer.
  Answer waiter;
  Responder rw = waiter.responder();
  registration.wait_ready(rw);
  CHECK_FALSE(registration.ready());
  registration.become_ready([] { return PlacementReply{}; });
  CHECK(registration.ready());
  CHECK(waiter.is<PlacementReply>());
  // The epoch: a request of an earlier one is refused (start the step again), a later one
  // waits for this ps's restore (try again).
  registration.restored(2, 300);
  CHECK_FALSE(registration.check_epoch(2, "push").has_value());
  CHECK(registration.check_epoch(1, "push")->code == ErrorCode::kFailedPrecondition);
  CHECK(registration.check_epoch(3, "push")->code == ErrorCode::kUnavailable);
}

TEST_CASE("Registration: a broken sharding policy is named") {
  struct Broken {  // places every part on a ps that does not exist
    Placement place(std::span<const VariableSpec> variables, std::size_t num_ps) const {
      Placement p = RoundRobin{}.place(variables, num_ps);
      for (Part& part : p.parts) part.ps = 99;
      return p;
    }
  };
  Registration<Broken> registration(0, 2, Broken{});
  Placement placement;
  const auto refused = registration.check(Register{{{"w", {4}, {}}}}, true, placement);
  REQUIRE(refused.has_value());
  CHECK(refused->message == "the sharding policy is broken: a part is placed on ps 99, which is not a ps task of the job");
}
