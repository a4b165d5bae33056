// SPDX-License-Identifier: MIT
#include <doctest/doctest.h>

#include <vector>

#include "pulley/sync/async.hpp"
#include "pulley/sync/sync_replicas.hpp"

using pulley::Verdict;

TEST_CASE("SyncReplicas averages R fresh gradients and drops stale ones") {
  const pulley::SyncReplicas sync{2, 3};
  auto acc = sync.make_accumulator(2);
  const std::vector<float> g1{1.0F, 2.0F}, g2{3.0F, 6.0F}, g3{100.0F, 100.0F};
  CHECK(sync.accumulate(acc, g1, 0) == Verdict::kPending);
  CHECK(sync.accumulate(acc, g2, 0) == Verdict::kReady);
  const auto mean = sync.take(acc);
  CHECK(mean[0] == 2.0F);
  CHECK(mean[1] == 4.0F);
  CHECK(sync.step(acc) == 1);
  // The third replica of step 0 arrives late: stale, and it must not leak into step 1.
  CHECK(sync.accumulate(acc, g3, 0) == Verdict::kStale);
  CHECK(sync.accumulate(acc, g1, 1) == Verdict::kPending);
  CHECK(sync.accumulate(acc, g1, 1) == Verdict::kReady);
  CHECK(sync.take(acc)[0] == 1.0F);
  // A gradient from a step ahead of the accumulator counts (TF drops only older ones).
  CHECK(sync.accumulate(acc, g1, 7) == Verdict::kPending);
}

TEST_CASE("SyncReplicas tokens: max(R, N) per step, one per worker if R <= N") {
  const pulley::TokenRule backups = pulley::SyncReplicas{2, 3}.token_rule();
  CHECK(backups.per_step == 3);
  CHECK(backups.per_worker == 1);
  const pulley::TokenRule several = pulley::SyncReplicas{5, 2}.token_rule();
  CHECK(several.per_step == 5);
  CHECK(several.per_worker == 0);  // a fast worker may take several
}

TEST_CASE("SyncReplicas rejects a non-positive R or N") {
  CHECK_THROWS_AS(pulley::SyncReplicas(0, 2), pulley::Error);
  CHECK_THROWS_AS(pulley::SyncReplicas(2, 0), pulley::Error);
}

TEST_CASE("Async applies every gradient as it comes, without copying it") {
  const pulley::Async async;
  auto acc = async.make_accumulator(2);
  const std::vector<float> g{1.0F, 2.0F};
  CHECK(async.accumulate(acc, g, 123) == Verdict::kReady);
  const auto taken = async.take(acc);
  CHECK(taken.data() == g.data());
  CHECK(async.step(acc) == 1);
  CHECK(async.accumulate(acc, g, 0) == Verdict::kReady);  // never stale
  CHECK(async.token_rule().per_step == 0);                // no pacing
}
