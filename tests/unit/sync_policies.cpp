// SPDX-License-Identifier: MIT
// The stock sync policies as their concept describes them: accumulators, verdicts, the
// global step and tokens, driven directly.
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"

using pulley::Token;
using pulley::Verdict;

TEST_CASE("SyncReplicas averages R fresh pushes and drops stale ones") {
  const pulley::SyncReplicas sync{2, 3};
  auto pacer = sync.make_pacer();
  auto acc = sync.make_accumulator(2);
  const std::vector<float> g1{1.0F, 2.0F}, g2{3.0F, 6.0F};
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);
  sync.accumulate(acc, g1);
  CHECK(sync.global_step(pacer) == 0);
  CHECK(sync.on_push(pacer, 1, 0) == Verdict::kReady);
  sync.accumulate(acc, g2);
  const auto mean = sync.take(acc);
  CHECK(mean[0] == 2.0F);
  CHECK(mean[1] == 4.0F);
  CHECK(sync.global_step(pacer) == 1);
  // The third replica of step 0 arrives late: stale.
  CHECK(sync.on_push(pacer, 2, 0) == Verdict::kStale);
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kPending);
  // A push from a step ahead of the ps counts (TF drops only older ones).
  CHECK(sync.on_push(pacer, 1, 7) == Verdict::kReady);
  CHECK(sync.global_step(pacer) == 2);
  // The accumulator starts over after take: the next mean is of the next gradients only.
  sync.accumulate(acc, g1);
  sync.accumulate(acc, g1);
  CHECK(sync.take(acc)[1] == 2.0F);
}

TEST_CASE("SyncReplicas tokens: max(R, N) per step, one per worker when R <= N") {
  const pulley::SyncReplicas backups{2, 3};
  auto pacer = backups.make_pacer();
  for (std::uint32_t w = 0; w < 3; ++w) {
    const std::optional<Token> t = backups.take_token(pacer, w);
    REQUIRE(t.has_value());
    CHECK(*t == Token{0, 0, 1, true, w});  // pulls step 0, prefetches step 1; batch w of step 0
  }
  CHECK_FALSE(backups.take_token(pacer, 0).has_value());  // one each
  backups.on_push(pacer, 0, 0);
  backups.on_push(pacer, 1, 0);  // step 1: three fresh tokens, the old ones withdrawn
  const std::optional<Token> next = backups.take_token(pacer, 0);
  REQUIRE(next.has_value());
  CHECK(next->local_step == 1);
  CHECK(next->batch == 3);  // step 1 reads batches 3, 4, 5

  const pulley::SyncReplicas several{5, 2};
  auto p = several.make_pacer();
  for (int i = 0; i < 5; ++i) {
    const std::optional<Token> t = several.take_token(p, 0);  // a fast worker takes them all
    REQUIRE(t.has_value());
    CHECK(t->next_pull_step == 0);  // its next token may be of this very step
  }
  CHECK_FALSE(several.take_token(p, 1).has_value());
}

TEST_CASE("SyncReplicas rejects a non-positive R or N") {
  CHECK_THROWS_AS(pulley::SyncReplicas(-1, 2), pulley::Error);
  CHECK_THROWS_AS(pulley::SyncReplicas(pulley::SyncReplicas::kEveryWorker, 0), pulley::Error);
  CHECK_THROWS_AS(pulley::SyncReplicas(2, 0), pulley::Error);
}

TEST_CASE("Async applies every gradient as it comes, without copying it") {
  const pulley::Async async;
  auto pacer = async.make_pacer();
  auto acc = async.make_accumulator(2);
  const std::vector<float> g{1.0F, 2.0F};
  CHECK(async.on_push(pacer, 0, 123) == Verdict::kReady);
  async.accumulate(acc, g);
  CHECK(async.take(acc).data() == g.data());
  CHECK(async.on_push(pacer, 1, 0) == Verdict::kReady);  // never stale
  CHECK(async.global_step(pacer) == 2);
  CHECK(async.take_token(pacer, 5) == Token{0, 0, 0, false});  // never waits, need not ask again
}

TEST_CASE("SyncReplicas: every ps follows the pacing ps's word on whether a step is a refill step") {
  const pulley::SyncReplicas sync{2, 2};
  // Worker 1 pushed step 0 to ps 0 and died before its push reached ps 1: ps 0 ends step 0
  // with both gradients, ps 1 only once it holds worker 1 lost, and begins step 1 as a
  // refill step by its own count.
  auto ps0 = sync.make_pacer();
  auto ps1 = sync.make_pacer();
  CHECK(sync.on_push(ps0, 0, 0) == Verdict::kPending);
  CHECK(sync.on_push(ps0, 1, 0) == Verdict::kReady);
  CHECK(sync.on_push(ps1, 0, 0) == Verdict::kPending);
  CHECK(sync.on_worker_lost(ps1, 1) == Verdict::kReady);
  CHECK(ps1.refill);
  // ps 0 hands out step 1's tokens as a normal step (worker 1 is not lost there yet): one
  // token each, whose push waits for step 2. Worker 0 will bring one gradient: ps 1 takes
  // ps 0's word from the push and needs one, instead of waiting for a second never sent.
  const std::optional<Token> t = sync.take_token(ps0, 0);
  REQUIRE(t.has_value());
  CHECK_FALSE(t->refill);
  CHECK(sync.on_worker_lost(ps0, 1) == Verdict::kPending);
  sync.follow(ps1, t->local_step, t->refill);
  CHECK_FALSE(ps1.refill);
  CHECK(sync.on_push(ps0, 0, 1) == Verdict::kReady);
  CHECK(sync.on_push(ps1, 0, 1) == Verdict::kReady);
  // Step 2 is a refill step on ps 0; a ps that has not held worker 1 lost follows it too.
  auto ps2 = sync.make_pacer();
  ps2.step = 2;
  const std::optional<Token> r = sync.take_token(ps0, 0);
  REQUIRE(r.has_value());
  CHECK(r->refill);
  sync.follow(ps2, r->local_step, r->refill);
  CHECK(ps2.refill);
  CHECK(sync.on_push(ps2, 0, 2) == Verdict::kPending);  // both batches, as on ps 0
  CHECK(sync.on_push(ps2, 0, 2) == Verdict::kReady);
  // Only the step's first push decides; a push of another step changes nothing.
  sync.follow(ps2, 2, false);
  sync.follow(ps2, 3, false);
  CHECK(ps2.refill == false);  // step 3 began as a normal step there (nobody lost)
}

TEST_CASE("BoundedStaleness: a worker runs at most s clocks ahead of the slowest") {
  const pulley::BoundedStaleness ssp{2, 3};
  auto pacer = ssp.make_pacer();
  // Worker 0 alone: clocks 0, 1, 2 are within 2 of the others' 0; clock 3 is not.
  for (std::int64_t c = 0; c < 3; ++c) {
    const std::optional<Token> t = ssp.take_token(pacer, 0);
    REQUIRE(t.has_value());
    CHECK(t->local_step == c);
    CHECK(t->pull_step == 0);  // c - s, not below 0
    CHECK(ssp.on_push(pacer, 0, c) == Verdict::kReady);  // applied at once, never stale
  }
  CHECK_FALSE(ssp.take_token(pacer, 0).has_value());
  CHECK(ssp.on_push(pacer, 0, 1) == Verdict::kStale);  // a repeat (a retried step) counts once
  CHECK(pacer.clocks[0] == 3);
  CHECK(ssp.global_step(pacer) == 0);
  CHECK(ssp.waiting_for(pacer).find("worker 1, worker 2 at clock 0") != std::string::npos);
  // Workers 1 and 2 catch up one clock: the slowest is at 1, so clock 3 is allowed.
  ssp.on_push(pacer, 1, 0);
  CHECK_FALSE(ssp.take_token(pacer, 0).has_value());
  ssp.on_push(pacer, 2, 0);
  CHECK(ssp.global_step(pacer) == 1);
  const std::optional<Token> t = ssp.take_token(pacer, 0);
  REQUIRE(t.has_value());
  CHECK(*t == Token{3, 1, 2, true, 9});  // reads step 1; its push prefetches step 2; batch 3 × 3 + 0
  CHECK(ssp.take_token(pacer, 0) == t);  // asking again before pushing: the same token
}

TEST_CASE("BoundedStaleness: 0 is lockstep, kUnbounded never waits") {
  const pulley::BoundedStaleness lockstep{0, 2};
  auto pacer = lockstep.make_pacer();
  CHECK(lockstep.take_token(pacer, 0).has_value());
  lockstep.on_push(pacer, 0, 0);
  CHECK_FALSE(lockstep.take_token(pacer, 0).has_value());
  lockstep.on_push(pacer, 1, 0);
  CHECK(lockstep.take_token(pacer, 0)->pull_step == 1);

  const pulley::BoundedStaleness unbounded{pulley::BoundedStaleness::kUnbounded, 2};
  auto p = unbounded.make_pacer();
  for (std::int64_t c = 0; c < 1000; ++c) {
    const std::optional<Token> token = unbounded.take_token(p, 0);
    REQUIRE(token.has_value());
    CHECK(token->pull_step == 0);
    unbounded.on_push(p, 0, c);
  }
}

TEST_CASE("BoundedStaleness refuses what no worker could send, and changes nothing") {
  const pulley::BoundedStaleness ssp{1, 2};
  auto pacer = ssp.make_pacer();
  CHECK_FALSE(ssp.take_token(pacer, 2).has_value());  // only workers 0 and 1: 2 waits to be counted in
  CHECK(ssp.on_push(pacer, 5, 0) == Verdict::kStale);  // not a worker of the job: dropped
  CHECK_THROWS_AS(ssp.on_push(pacer, 0, 3), pulley::Error);  // clock 3 was never granted
  CHECK_THROWS_AS(ssp.on_push(pacer, 0, -1), pulley::Error);
  CHECK(pacer.clocks == std::vector<std::int64_t>{0, 0});
  CHECK_THROWS_AS(pulley::BoundedStaleness(-1, 2), pulley::Error);
  CHECK_THROWS_AS(pulley::BoundedStaleness(1, 0), pulley::Error);
}

TEST_CASE("SyncReplicas: worker w takes token w whatever the order the workers ask in") {
  // So a copy of the pacing ps that never handed a token out (ShardCopies) hands out the same.
  const pulley::SyncReplicas backups{2, 3};
  auto forward = backups.make_pacer();
  auto backward = backups.make_pacer();
  for (std::uint32_t w = 0; w < 3; ++w) {
    const std::optional<Token> a = backups.take_token(forward, w);
    const std::optional<Token> b = backups.take_token(backward, 2 - w);
    REQUIRE(a.has_value());
    REQUIRE(b.has_value());
    CHECK(a->batch == w);
    CHECK(b->batch == 2 - w);
  }
  // A worker that asks a pacer that did not hand its token out gets the same one again.
  auto fresh = backups.make_pacer();
  CHECK(backups.take_token(fresh, 1)->batch == 1);
  // With R > N any worker takes any token: the lowest left.
  const pulley::SyncReplicas several{3, 2};
  auto p = several.make_pacer();
  CHECK(several.take_token(p, 1)->batch == 0);
  CHECK(several.take_token(p, 1)->batch == 1);
}

TEST_CASE("SyncReplicas gives back the tokens of a worker that left without pushing") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  REQUIRE(sync.take_token(pacer, 0).has_value());
  REQUIRE(sync.take_token(pacer, 1).has_value());
  CHECK_FALSE(sync.take_token(pacer, 1).has_value());  // one each
  sync.release(pacer, 1);                               // worker 1 left holding it
  const std::optional<Token> again = sync.take_token(pacer, 1);  // its successor takes it again,
  REQUIRE(again.has_value());
  CHECK(again->batch == 1);                                      // with its number
  CHECK(sync.on_push(pacer, 1, 0) == Verdict::kPending);
  sync.release(pacer, 1);  // it pushed: nothing to give back...
  CHECK_FALSE(sync.take_token(pacer, 1).has_value());  // ...and no second token of the step
  sync.release(pacer, 0);  // worker 0's token comes back, as it had not pushed
  CHECK(sync.take_token(pacer, 0).has_value());
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kReady);
  // A step that completes ends every lease of it: step 1 starts with all its tokens.
  CHECK(sync.take_token(pacer, 0)->local_step == 1);
  CHECK(sync.take_token(pacer, 1)->local_step == 1);
}

TEST_CASE("SyncReplicas names the token of the step a worker holds until it pushes") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  CHECK_FALSE(sync.held_token(pacer, 0).has_value());
  REQUIRE(sync.take_token(pacer, 0).has_value());
  const auto held = sync.held_token(pacer, 0);
  REQUIRE(held.has_value());
  CHECK(held->local_step == 0);
  CHECK(held->next_pull_step == 1);
  CHECK_FALSE(sync.held_token(pacer, 1).has_value());  // worker 1 took none
  sync.release(pacer, 0);                              // its connection went: given back
  CHECK_FALSE(sync.held_token(pacer, 0).has_value());
  REQUIRE(sync.take_token(pacer, 0).has_value());
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);
  CHECK_FALSE(sync.held_token(pacer, 0).has_value());  // pushed: nothing held
  // With R > N a worker takes several tokens of a step, one after each push.
  const pulley::SyncReplicas more{3, 2};
  auto pacer3 = more.make_pacer();
  REQUIRE(more.take_token(pacer3, 0).has_value());
  const auto again = more.held_token(pacer3, 0);
  REQUIRE(again.has_value());
  CHECK(again->next_pull_step == 0);  // its next token may be of this step
  CHECK(more.on_push(pacer3, 0, 0) == Verdict::kPending);
  CHECK_FALSE(more.held_token(pacer3, 0).has_value());
  REQUIRE(more.take_token(pacer3, 0).has_value());  // its second of step 0
  CHECK(more.held_token(pacer3, 0).has_value());
}

TEST_CASE("a worker that pushed for a step gets no second token of it, even after a release") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  REQUIRE(sync.take_token(pacer, 0).has_value());
  sync.release(pacer, 0);  // its connection went first...
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);  // ...then its push came on a new one
  CHECK_FALSE(sync.take_token(pacer, 0).has_value());
}

TEST_CASE("SyncReplicas completes a step over the live workers, and waits again for one back") {
  const pulley::SyncReplicas sync{3, 3};
  auto pacer = sync.make_pacer();
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 1, 0) == Verdict::kPending);
  CHECK(sync.awaited(pacer) == std::vector<std::uint32_t>{2});
  // Worker 2 is lost: the two gradients in are all step 0 needs, and it completes now.
  CHECK(sync.on_worker_lost(pacer, 2) == Verdict::kReady);
  CHECK(sync.global_step(pacer) == 1);
  CHECK(sync.awaited(pacer) == std::vector<std::uint32_t>{0, 1});
  // Step 1 began with worker 2 lost: a refill step, which still needs three gradients
  // (the live workers bring the lost one's).
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 1, 1) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kReady);
  // What the lost worker pushes for a step done without it is stale.
  CHECK(sync.on_push(pacer, 2, 0) == Verdict::kStale);
  // Back: step 2 needs all three again, one from each.
  sync.on_worker_back(pacer, 2);
  CHECK(sync.on_push(pacer, 0, 2) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 1, 2) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 2, 2) == Verdict::kReady);
  CHECK(sync.global_step(pacer) == 3);
}

TEST_CASE("SyncReplicas: a lost worker's gradient pushed before it was lost still counts") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  CHECK(sync.on_push(pacer, 1, 0) == Verdict::kPending);
  // It pushed and then went quiet (finished, or died): the step still waits for worker 0,
  // and ends as the mean of both, as without the loss.
  CHECK(sync.on_worker_lost(pacer, 1) == Verdict::kPending);
  CHECK(sync.awaited(pacer) == std::vector<std::uint32_t>{0});
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kReady);
  // Losing the last worker too completes nothing.
  CHECK(sync.on_worker_lost(pacer, 0) == Verdict::kPending);
  CHECK(sync.global_step(pacer) == 1);
}

TEST_CASE("SyncReplicas: the live workers take a lost worker's tokens, so every step keeps its R batches") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  const std::optional<Token> t0 = sync.take_token(pacer, 0);
  const std::optional<Token> t1 = sync.take_token(pacer, 1);
  REQUIRE(t0.has_value());
  REQUIRE(t1.has_value());
  CHECK(t0->batch == 0);
  CHECK(t1->batch == 1);
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);
  // Worker 1 is lost holding its token during step 0, whose tokens wait for step 1 (worker
  // 0 may be waiting in its pull): step 0 completes on worker 0's gradient alone.
  CHECK(sync.on_worker_lost(pacer, 1) == Verdict::kReady);
  // Step 1 begins with worker 1 lost: a refill step. Worker 0 takes both its tokens, one
  // after each push, reading both its batches, and pulls at once after each push.
  const std::optional<Token> a = sync.take_token(pacer, 0);
  REQUIRE(a.has_value());
  CHECK(a->batch == 2);
  CHECK(a->next_pull_step == 1);
  CHECK(a->refill);
  CHECK_FALSE(sync.take_token(pacer, 0).has_value());  // it holds one: it pushes first
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kPending);
  const std::optional<Token> b = sync.take_token(pacer, 0);
  REQUIRE(b.has_value());
  CHECK(b->batch == 3);
  CHECK(sync.held_token(pacer, 0) == b);  // asked again, it is the same token
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kReady);
  CHECK(sync.global_step(pacer) == 2);
  // Worker 1 comes back during step 2: a token is kept for it, and worker 0 gets no
  // second while worker 1 has not taken its own.
  sync.on_worker_back(pacer, 1);
  REQUIRE(sync.take_token(pacer, 0).has_value());
  CHECK(sync.on_push(pacer, 0, 2) == Verdict::kPending);
  CHECK_FALSE(sync.take_token(pacer, 0).has_value());
  const std::optional<Token> c = sync.take_token(pacer, 1);
  REQUIRE(c.has_value());
  CHECK(c->batch == 5);
  CHECK(sync.on_push(pacer, 1, 2) == Verdict::kReady);
  // Step 3 has nobody lost: one token each, whose push waits for the next step.
  const std::optional<Token> d = sync.take_token(pacer, 0);
  REQUIRE(d.has_value());
  CHECK(d->batch == 6);
  CHECK(d->next_pull_step == 4);
  CHECK_FALSE(d->refill);
  CHECK(sync.on_push(pacer, 0, 3) == Verdict::kPending);
  CHECK_FALSE(sync.take_token(pacer, 0).has_value());

  // A worker lost before anything of a step was taken or pushed: the step begins without
  // it, a refill step (as the step a restore makes, while a worker is held lost, does).
  const pulley::SyncReplicas three{3, 3};
  auto q = three.make_pacer();
  CHECK(three.on_worker_lost(q, 2) == Verdict::kPending);
  const std::optional<Token> first = three.take_token(q, 0);
  REQUIRE(first.has_value());
  CHECK(first->refill);
  CHECK(three.on_push(q, 0, 0) == Verdict::kPending);
  CHECK(three.on_push(q, 1, 0) == Verdict::kPending);  // three batches, as with three workers
  CHECK(three.on_push(q, 0, 0) == Verdict::kReady);

  // A worker lost during a refill step gives its token to the live ones.
  auto p = three.make_pacer();
  REQUIRE(three.take_token(p, 0).has_value());  // step 0 under way
  CHECK(three.on_worker_lost(p, 2) == Verdict::kPending);
  CHECK(three.on_push(p, 0, 0) == Verdict::kPending);
  CHECK(three.on_push(p, 1, 0) == Verdict::kReady);  // step 0 was not a refill step: two of two
  REQUIRE(three.take_token(p, 0).has_value());        // step 1 is: batch 3
  const std::optional<Token> held = three.take_token(p, 1);  // batch 4
  REQUIRE(held.has_value());
  CHECK(three.on_push(p, 0, 1) == Verdict::kPending);
  const std::optional<Token> spare = three.take_token(p, 0);
  REQUIRE(spare.has_value());
  CHECK(spare->batch == 5);
  CHECK(three.on_worker_lost(p, 1) == Verdict::kPending);  // still three gradients to a step
  CHECK(three.on_push(p, 0, 1) == Verdict::kPending);
  const std::optional<Token> taken_over = three.take_token(p, 0);
  REQUIRE(taken_over.has_value());
  CHECK(taken_over->batch == held->batch);  // worker 1's batch, read by worker 0
  CHECK(three.on_push(p, 0, 1) == Verdict::kReady);
}

TEST_CASE("SyncReplicas with backups needs R while R workers live, fewer below") {
  const pulley::SyncReplicas sync{2, 4};
  auto pacer = sync.make_pacer();
  CHECK(sync.on_worker_lost(pacer, 3) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 1, 0) == Verdict::kReady);  // R = 2 of the three left
  CHECK(sync.on_worker_lost(pacer, 2) == Verdict::kPending);
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kPending);
  CHECK(sync.on_worker_lost(pacer, 1) == Verdict::kReady);  // one worker left: one gradient
  // The lost worker's token goes back with it.
  const pulley::SyncReplicas one{1, 2};
  auto p = one.make_pacer();
  REQUIRE(one.take_token(p, 0));
  REQUIRE(one.take_token(p, 1));
  CHECK_FALSE(one.take_token(p, 0));
  CHECK(one.on_worker_lost(p, 1) == Verdict::kPending);
  CHECK(one.take_token(p, 0).has_value() == false);  // one per step when R <= N
  CHECK(p.free == std::vector<std::uint32_t>{1});
}

TEST_CASE("BoundedStaleness goes on without a lost worker, which starts back at the slowest clock") {
  const pulley::BoundedStaleness ssp{1, 3};
  auto pacer = ssp.make_pacer();
  for (std::uint32_t w = 0; w < 2; ++w) {
    CHECK(ssp.on_push(pacer, w, 0) == Verdict::kReady);
    CHECK(ssp.on_push(pacer, w, 1) == Verdict::kReady);
  }
  // Workers 0 and 1 are at clock 2, worker 2 at 0: they wait for it.
  CHECK_FALSE(ssp.take_token(pacer, 0));
  CHECK(ssp.awaited(pacer) == std::vector<std::uint32_t>{2});
  CHECK(ssp.on_worker_lost(pacer, 2) == Verdict::kPending);
  CHECK(ssp.global_step(pacer) == 2);
  REQUIRE(ssp.take_token(pacer, 0));
  CHECK(ssp.on_push(pacer, 0, 2) == Verdict::kReady);
  CHECK(ssp.on_push(pacer, 1, 2) == Verdict::kReady);
  CHECK(ssp.global_step(pacer) == 3);
  // Back, worker 2 skips to clock 3: the global step does not go back, and its old
  // clocks' pushes are repeats.
  ssp.on_worker_back(pacer, 2);
  CHECK(ssp.global_step(pacer) == 3);
  CHECK(ssp.on_push(pacer, 2, 0) == Verdict::kStale);
  const auto token = ssp.take_token(pacer, 2);
  REQUIRE(token);
  CHECK(token->local_step == 3);
}

TEST_CASE("SyncReplicas counts workers that join or leave from a step boundary, its batches numbered on") {
  const pulley::SyncReplicas sync{pulley::SyncReplicas::kEveryWorker, 2};  // R follows N
  CHECK(sync.replicas_to_aggregate() == 2);
  auto pacer = sync.make_pacer();
  std::vector<std::int64_t> batches;
  auto step = [&](const std::vector<std::uint32_t>& workers) {
    for (const std::uint32_t w : workers) {
      const std::optional<Token> t = sync.take_token(pacer, w);
      REQUIRE(t.has_value());
      batches.push_back(t->batch);
    }
    for (std::size_t k = 0; k < workers.size(); ++k) {
      const Verdict v = sync.on_push(pacer, workers[k], sync.global_step(pacer));
      CHECK(v == (k + 1 == workers.size() ? Verdict::kReady : Verdict::kPending));
    }
  };
  step({0, 1});
  step({0, 1});  // steps 0 and 1: batches 0 .. 3
  CHECK_FALSE(sync.take_token(pacer, 2).has_value());  // not a worker yet: it waits
  CHECK(sync.on_push(pacer, 2, 2) == Verdict::kStale);
  const std::vector<std::uint32_t> three{0, 1, 2};
  sync.reshape(pacer, three);
  CHECK(sync.global_step(pacer) == 2);
  step({2, 0, 1});  // step 2 needs all three (R = N = 3); worker 2's own token is number 2
  step({0, 1, 2});
  CHECK(batches == std::vector<std::int64_t>{0, 1, 2, 3, 6, 4, 5, 7, 8, 9});
  // Worker 1 leaves for good: ranks move up, the step needs two, nobody waits for it.
  const std::vector<std::uint32_t> two{0, 2};
  sync.reshape(pacer, two);
  CHECK(sync.awaited(pacer) == two);
  CHECK_FALSE(sync.take_token(pacer, 1).has_value());
  CHECK(sync.on_push(pacer, 1, sync.global_step(pacer)) == Verdict::kStale);
  step({2, 0});
  CHECK(batches.back() == 10);  // worker 0's own token is number 0: batch 10 (worker 2 took 11)
  CHECK(batches[batches.size() - 2] == 11);
  // The state keeps the numbering; a fresh pacer loaded from it and told the workers goes on alike.
  const std::vector<std::int64_t> saved = sync.save(pacer);
  CHECK(saved == std::vector<std::int64_t>{5, 12});
  auto loaded = sync.make_pacer();
  sync.load(loaded, saved);
  sync.reshape(loaded, two);
  CHECK(sync.take_token(loaded, 2)->batch == 13);
  CHECK(sync.take_token(pacer, 2)->batch == 13);
  // An unchanged job saves the global step alone, as before.
  auto plain = sync.make_pacer();
  CHECK(sync.save(plain) == std::vector<std::int64_t>{0});
}

TEST_CASE("SyncReplicas with backups keeps R when workers join, and refuses a change mid-step") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  const std::vector<std::uint32_t> three{0, 1, 2};
  sync.reshape(pacer, three);  // R = 2 of N = 3: one backup, three tokens a step
  CHECK(sync.waiting_for(pacer).find("0 of 2 gradients in, 3 of 3 tokens left") != std::string::npos);
  REQUIRE(sync.take_token(pacer, 0).has_value());
  const auto before = sync.save(pacer);
  CHECK_THROWS_AS(sync.reshape(pacer, std::vector<std::uint32_t>{0, 1}), pulley::Error);  // a token is out
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kPending);
  CHECK_THROWS_AS(sync.reshape(pacer, std::vector<std::uint32_t>{0, 1}), pulley::Error);
  CHECK(sync.save(pacer) == before);
  auto fresh = sync.make_pacer();
  CHECK_THROWS_AS(sync.reshape(fresh, std::vector<std::uint32_t>{}), pulley::Error);
  CHECK_THROWS_AS(sync.reshape(fresh, std::vector<std::uint32_t>{2, 1}), pulley::Error);
  CHECK(sync.awaited(fresh) == std::vector<std::uint32_t>{0, 1});
}

TEST_CASE("BoundedStaleness: a worker that joins starts at the slowest clock, and one that left holds nobody back") {
  const pulley::BoundedStaleness ssp{1, 2};
  auto pacer = ssp.make_pacer();
  for (std::int64_t c = 0; c < 3; ++c) {  // both at clock 3
    for (std::uint32_t w = 0; w < 2; ++w) {
      REQUIRE(ssp.take_token(pacer, w).has_value());
      CHECK(ssp.on_push(pacer, w, c) == Verdict::kReady);
    }
  }
  CHECK(ssp.global_step(pacer) == 3);
  ssp.reshape(pacer, std::vector<std::uint32_t>{0, 1, 2});
  CHECK(pacer.clocks == std::vector<std::int64_t>{3, 3, 3});
  const std::optional<Token> joined = ssp.take_token(pacer, 2);
  REQUIRE(joined.has_value());
  CHECK(joined->local_step == 3);
  CHECK(joined->pull_step == 3);  // not 3 - s: every ps counts it in before its first push
  CHECK(joined->next_pull_step == 3);
  CHECK(joined->batch == 3 * 3 + 2);
  // Worker 0 leaves; worker 2, not heard yet, holds nobody back: worker 1 runs on.
  ssp.reshape(pacer, std::vector<std::uint32_t>{1, 2});
  CHECK(ssp.on_push(pacer, 0, 3) == Verdict::kStale);
  for (std::int64_t c = 3; c < 5; ++c) {
    REQUIRE(ssp.take_token(pacer, 1).has_value());
    CHECK(ssp.on_push(pacer, 1, c) == Verdict::kReady);
  }
  CHECK(ssp.global_step(pacer) == 5);
  CHECK(ssp.awaited(pacer) == std::vector<std::uint32_t>{1});
  CHECK(ssp.save(pacer) == std::vector<std::int64_t>{5, 5, 5});  // a resume does not go back for worker 2
  // Worker 2's first push, of the clock its token named, is taken although the slowest
  // moved on: it catches up from there, holding the slowest clock until it does.
  CHECK(ssp.on_push(pacer, 2, 3) == Verdict::kReady);
  CHECK(pacer.clocks[2] == 4);
  CHECK(ssp.global_step(pacer) == 5);
  CHECK(ssp.take_token(pacer, 2)->pull_step == 3);  // heard now: it reads c - s again
  for (std::int64_t c = 5; c < 7; ++c) {
    REQUIRE(ssp.take_token(pacer, 1).has_value());
    CHECK(ssp.on_push(pacer, 1, c) == Verdict::kReady);
  }
  CHECK_FALSE(ssp.take_token(pacer, 1).has_value());  // clock 7 is 2 ahead of the slowest, 5
  CHECK(ssp.awaited(pacer) == std::vector<std::uint32_t>{2});
  CHECK(ssp.waiting_for(pacer).find("worker 2 catching up at clock 4") != std::string::npos);
  CHECK(ssp.on_push(pacer, 2, 3) == Verdict::kStale);  // a repeat
  CHECK(ssp.on_push(pacer, 2, 4) == Verdict::kReady);
  CHECK(ssp.global_step(pacer) == 5);
  CHECK(ssp.on_push(pacer, 2, 5) == Verdict::kReady);
  CHECK(ssp.global_step(pacer) == 6);
  CHECK(ssp.take_token(pacer, 1).has_value());
}

TEST_CASE("BoundedStaleness: ps tasks that counted a worker in at different clocks take its pushes alike") {
  const pulley::BoundedStaleness ssp{2, 2};
  auto behind = ssp.make_pacer();  // the pacing ps: counts worker 2 in at clock 3
  auto ahead = ssp.make_pacer();   // at clock 5 (a lost worker's clocks skipped)
  for (std::int64_t c = 0; c < 3; ++c) {
    for (std::uint32_t w = 0; w < 2; ++w) {
      CHECK(ssp.on_push(behind, w, c) == Verdict::kReady);
      CHECK(ssp.on_push(ahead, w, c) == Verdict::kReady);
    }
  }
  CHECK(ssp.on_push(ahead, 0, 3) == Verdict::kReady);
  CHECK(ssp.on_push(ahead, 0, 4) == Verdict::kReady);
  (void)ssp.on_worker_lost(ahead, 1);
  CHECK(ssp.global_step(ahead) == 5);
  ssp.reshape(behind, std::vector<std::uint32_t>{0, 1, 2});
  ssp.reshape(ahead, std::vector<std::uint32_t>{0, 1, 2});
  for (std::int64_t c = 3; c < 5; ++c) {  // its first two tokens, from the pacing ps
    const std::optional<Token> token = ssp.take_token(behind, 2);
    REQUIRE(token.has_value());
    CHECK(token->local_step == c);
    CHECK(ssp.on_push(behind, 2, c) == Verdict::kReady);
    CHECK(ssp.on_push(ahead, 2, c) == Verdict::kReady);
    CHECK(behind.clocks[2] == c + 1);
    CHECK(ahead.clocks[2] == c + 1);
  }
  CHECK(ssp.global_step(ahead) == 5);
}

TEST_CASE("Async counts no workers: any may join") {
  const pulley::Async async;
  auto pacer = async.make_pacer();
  async.reshape(pacer, std::vector<std::uint32_t>{0, 5});
  CHECK(async.take_token(pacer, 5).has_value());
}

TEST_CASE(
    "SyncReplicas: a worker that pulls the next step without pushing this one is not waited for at "
    "this step "
    "alone") {
  const pulley::SyncReplicas sync{2, 2};
  auto pacer = sync.make_pacer();
  REQUIRE(sync.take_token(pacer, 1).has_value());
  // Only a pull of the very next step says the push is lost.
  CHECK_FALSE(sync.on_pull_ahead(pacer, 1, 2).has_value());
  CHECK(sync.on_pull_ahead(pacer, 1, 1) ==
        Verdict::kPending);  // worker 0's gradient is still to come
  CHECK(sync.awaited(pacer) == std::vector<std::uint32_t>{0});
  CHECK_FALSE(sync.on_pull_ahead(pacer, 1, 1).has_value());  // said once
  CHECK_FALSE(sync.take_token(pacer, 1).has_value());        // its next token is step 1's
  CHECK(sync.on_push(pacer, 1, 0) == Verdict::kStale);       // the lost push, late
  CHECK(sync.on_push(pacer, 0, 0) == Verdict::kReady);
  CHECK(sync.global_step(pacer) == 1);
  // Step 1 waits for both again; a worker that pushed is not taken for one that lost its push.
  CHECK(sync.awaited(pacer) == std::vector<std::uint32_t>{0, 1});
  CHECK(sync.on_push(pacer, 0, 1) == Verdict::kPending);
  CHECK_FALSE(sync.on_pull_ahead(pacer, 0, 2).has_value());
  CHECK(sync.on_push(pacer, 1, 1) == Verdict::kReady);
  // A worker held lost with R = N makes a refill step: the live workers bring R gradients,
  // whoever brings them, and nothing is judged; nor is a pull of a worker held lost.
  CHECK(sync.on_worker_lost(pacer, 1) == Verdict::kPending);
  CHECK_FALSE(sync.on_pull_ahead(pacer, 0, 3).has_value());
  CHECK_FALSE(sync.on_pull_ahead(pacer, 1, 3).has_value());

  // A step whose one push so far was lost, then its other worker held lost: done, with no
  // update (as in the other order), not waiting for ever.
  const pulley::SyncReplicas pair{2, 2};
  auto both = pair.make_pacer();
  CHECK(pair.on_pull_ahead(both, 1, 1) == Verdict::kPending);
  CHECK(pair.on_worker_lost(both, 0) == Verdict::kReady);
  CHECK(pair.global_step(both) == 1);

  // A single worker's lost push: the step goes on with no update.
  const pulley::SyncReplicas alone{1, 1};
  auto one = alone.make_pacer();
  CHECK(alone.on_pull_ahead(one, 0, 1) == Verdict::kReady);
  CHECK(alone.global_step(one) == 1);

  // With a backup worker (R = 2, N = 3): a worker that pulls ahead brings nothing to the
  // step (it skipped it, or lost its push), and the step still needs R from the others
  // while they can bring R.
  const pulley::SyncReplicas backups{2, 3};
  auto spare = backups.make_pacer();
  CHECK(backups.on_push(spare, 0, 0) == Verdict::kPending);
  CHECK(backups.on_pull_ahead(spare, 2, 1) == Verdict::kPending);
  CHECK(backups.awaited(spare) == std::vector<std::uint32_t>{1});
  CHECK(backups.waiting_for(spare).find("1 of 2 gradients in") != std::string::npos);
  CHECK(backups.on_push(spare, 2, 0) == Verdict::kStale);  // its late push, if any
  CHECK(backups.on_push(spare, 1, 0) == Verdict::kReady);
  CHECK(backups.global_step(spare) == 1);
  // Once the others that could bring R are held lost, or pull ahead too, the step goes on
  // with what it has instead of standing still.
  CHECK(backups.on_push(spare, 0, 1) == Verdict::kPending);
  CHECK(backups.on_worker_lost(spare, 1) ==
        Verdict::kPending);  // workers 0 and 2 can still bring 2
  CHECK(backups.on_pull_ahead(spare, 2, 2) == Verdict::kReady);
  CHECK(backups.global_step(spare) == 2);
  auto skipped = backups.make_pacer();
  CHECK(backups.on_push(skipped, 0, 0) == Verdict::kPending);
  CHECK(backups.on_pull_ahead(skipped, 1, 1) == Verdict::kPending);
  CHECK(backups.on_pull_ahead(skipped, 2, 1) == Verdict::kReady);  // nobody else can bring one
  CHECK(backups.global_step(skipped) == 1);
  // A pull of a step further on, or a worker that pushed, is no such word.
  CHECK(backups.on_push(skipped, 1, 1) == Verdict::kPending);
  CHECK_FALSE(backups.on_pull_ahead(skipped, 1, 2).has_value());
  CHECK_FALSE(backups.on_pull_ahead(skipped, 2, 3).has_value());

  // R = N = 3, a worker held lost during the step (not a refill step: it began with every
  // worker live), then another's push lost: the step needs the third's push, and goes on
  // with worker 0's alone instead of waiting for ever.
  const pulley::SyncReplicas three{3, 3};
  auto compound = three.make_pacer();
  CHECK(three.on_push(compound, 0, 0) == Verdict::kPending);
  CHECK(three.on_worker_lost(compound, 2) == Verdict::kPending);  // needs workers 0 and 1
  CHECK_FALSE(three.on_pull_ahead(compound, 2, 1).has_value());   // held lost: not waited for
  CHECK(three.on_pull_ahead(compound, 1, 1) == Verdict::kReady);
  CHECK(three.global_step(compound) == 1);
}
