// SPDX-License-Identifier: MIT
// A ps's Shard (the parts and table rows it holds, the unit a checkpoint reads and a restore
// sets) and the Update that applies pushes to it, on their own: no ps, no transport.
#include "pulley/ps/shard.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/update.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/tables/tables.hpp"

using namespace pulley;

namespace {

const std::vector<VariableSpec> kModel{{"w", {2, 2}, {}}, {"b", {2}, {}}};

/// The shard ps `task` of 2 holds of kModel (RoundRobin: w on ps 0, b on ps 1), initialized.
template <class O, class P, class T = NoTables>
Shard<O, P, T> shard_of(std::uint32_t task, O optimizer, const P& sync, T tables = {},
                        std::vector<TableSpec> specs = {}) {
  Shard<O, P, T> shard(task, optimizer, tables);
  Register r{kModel, std::move(specs), 7};
  const std::uint32_t members[] = {0, 1};
  shard.assign(std::move(r), RoundRobin{}.place(kModel, 2), members, sync);
  std::vector<PartValues> values;
  const std::vector<float> w{1, 2, 3, 4}, b{5, 6};
  for (const auto& part : shard.parts()) values.push_back({part.index, part.index == 0 ? std::span<const float>(w) : std::span<const float>(b)});
  REQUIRE_FALSE(shard.check(values, false).has_value());
  shard.initialize(values);
  return shard;
}

std::vector<float> values_of(const auto& shard, std::uint32_t part) {
  const auto* held = const_cast<std::remove_cvref_t<decltype(shard)>&>(shard).find(part);
  REQUIRE(held != nullptr);
  return held->values;
}

}  // namespace

TEST_CASE("a shard holds the parts its placement gives this ps, and names the rest") {
  const SyncReplicas sync(2, 2);
  auto shard = shard_of(1, Sgd{1.0F}, sync);
  CHECK(shard.initialized());
  REQUIRE(shard.parts().size() == 1);
  CHECK(shard.find(0) == nullptr);
  CHECK(shard.unknown_part(0) == "variable 'w' part 0 is held by ps 0, not here");
  CHECK(shard.unknown_part(9) == "unknown part 9 (the model has 2 parts)");
  const std::vector<float> short_g{1.0F};
  const auto refused = shard.check(std::vector<PartValues>{{1, short_g}}, false);
  REQUIRE(refused.has_value());
  CHECK(refused->message == "variable 'b' part 0 has 2 elements, got 1");
  const std::vector<float> nan{1.0F, std::numeric_limits<float>::quiet_NaN()};
  CHECK(shard.check(std::vector<PartValues>{{1, nan}}, false)->code == ErrorCode::kInvalidArgument);
  CHECK_FALSE(shard.check(std::vector<PartValues>{{1, nan}}, /*finite_known=*/true).has_value());
  CHECK(shard.check_fresh(std::vector<PartValues>{{1, nan}})->code == ErrorCode::kAlreadyExists);
  // Reads are views of the part; overlapping slices are refused.
  Stats stats;
  const PullReply read = shard.read({Slice{1, {1, 2}}}, 4, stats);
  CHECK(read.global_step == 4);
  CHECK(read.values.at(0)[0] == 6.0F);
  CHECK(stats.bytes_pulled == 4);
  CHECK(shard.check(std::vector<Slice>{{1, {0, 2}}, {1, {1, 2}}}).has_value());
  CHECK(shard.max_request_payload() == 2 * sizeof(float));  // Sgd keeps no slots
}

TEST_CASE("a shard's state reads back and restores, optimizer slots included") {
  const Async sync;
  auto shard = shard_of(0, Adagrad{0.5F}, sync);
  Update<Adagrad, Async, NoTables> update;
  Stats stats;
  const std::vector<float> g{1, 1, 1, 1};
  (void)update.take(shard, sync, Push{0, 0, {{0, g}}}, Verdict::kReady, 0, stats);
  const std::vector<float> after = values_of(shard, 0);
  CHECK(after[0] < 1.0F);
  // Read, copy aside, change, restore: back where it was.
  std::vector<PartState> state = shard.read_state();
  REQUIRE(state.size() == 1);
  REQUIRE(state[0].slots.size() == 1);  // Adagrad's accumulator
  const std::vector<float> values(state[0].values.begin(), state[0].values.end());
  const std::vector<float> slot(state[0].slots[0].begin(), state[0].slots[0].end());
  (void)update.take(shard, sync, Push{0, 1, {{0, g}}}, Verdict::kReady, 1, stats);
  CHECK(values_of(shard, 0) != after);
  const std::vector<PartState> saved{PartState{0, values, {slot}, {}}};
  std::vector<const PartState*> by_part;
  REQUIRE_FALSE(shard.check_restore(saved, by_part).has_value());
  shard.restore(by_part, sync);
  CHECK(values_of(shard, 0) == after);
  CHECK(std::vector<float>(shard.read_state()[0].slots[0].begin(), shard.read_state()[0].slots[0].end()) == slot);
  // A restore of the wrong shape is refused whole.
  const std::vector<float> wrong(3, 0.0F);
  CHECK(shard.check_restore({PartState{0, wrong, {}, {}}}, by_part)->code == ErrorCode::kInvalidArgument);
  CHECK(shard.check_restore({}, by_part)->message == "a restore must carry each of the 1 parts held here, got 0");
}

TEST_CASE("an update applies the mean of its fresh pushes once, and drops stale ones") {
  const SyncReplicas sync(2, 2);
  auto shard = shard_of(1, Sgd{1.0F}, sync);
  Update<Sgd, SyncReplicas, NoTables> update;
  Stats stats;
  const std::vector<float> g1{2, 0}, g2{0, 4}, stale{100, 100};
  auto out = update.take(shard, sync, Push{0, 0, {{1, g1}}}, Verdict::kPending, 0, stats);
  CHECK(out.refused.empty());
  CHECK(values_of(shard, 1) == std::vector<float>{5, 6});  // nothing applied yet
  out = update.take(shard, sync, Push{1, 0, {{1, stale}}}, Verdict::kStale, 0, stats);
  CHECK(out.stale_parts == 1);
  out = update.take(shard, sync, Push{1, 0, {{1, g2}}}, Verdict::kReady, 0, stats);
  CHECK(values_of(shard, 1) == std::vector<float>{4, 4});  // 5 - 1, 6 - 2
  CHECK(stats.stale_gradients_dropped == 1);
  CHECK(stats.gradients_accepted == 2);
  CHECK(stats.updates_applied == 1);
}

TEST_CASE("an update that would go non-finite is refused alone, or rolled back when averaged") {
  const float huge = std::numeric_limits<float>::max();
  SUBCASE("a push that is an update by itself, with stays_finite (Sgd): refused, naming its sender") {
    const Async sync;
    auto shard = shard_of(1, Sgd{1.0F}, sync);
    Update<Sgd, Async, NoTables> update;
    Stats stats;
    const std::vector<float> g{-huge, -huge};
    const auto out = update.take(shard, sync, Push{3, 0, {{1, g}}}, Verdict::kReady, 0, stats);
    CHECK(out.refused.find("push from worker 3 refused: its gradient for variable 'b' part 0") == 0);
    CHECK(values_of(shard, 1) == std::vector<float>{5, 6});
    CHECK(stats.updates_refused == 1);
  }
  SUBCASE("an averaged update of an optimizer without stays_finite (Momentum): rolled back whole") {
    const SyncReplicas sync(2, 2);
    auto shard = shard_of(1, Momentum{1.0F, 0.9F}, sync);
    Update<Momentum, SyncReplicas, NoTables> update;
    Stats stats;
    const std::vector<float> g{-huge, -huge};
    (void)update.take(shard, sync, Push{0, 0, {{1, g}}}, Verdict::kPending, 0, stats);
    const auto out = update.take(shard, sync, Push{1, 0, {{1, g}}}, Verdict::kReady, 0, stats);
    CHECK(out.refused.empty());  // not this push's fault alone: logged, not refused
    CHECK(values_of(shard, 1) == std::vector<float>{5, 6});
    CHECK(stats.updates_refused == 1);
    CHECK(stats.updates_applied == 0);
  }
}

namespace {

/// Sgd that counts the calls of its full check, stays_finite.
struct CountedSgd : Sgd {
  int* asked = nullptr;
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w, std::span<const float> g) const {
    ++*asked;
    return Sgd::stays_finite(state, w, g);
  }
};
static_assert(BoundsMagnitudes<CountedSgd>);

}  // namespace

TEST_CASE("an update proven finite from magnitudes is applied at once, one that is not is checked as before") {
  const Async sync;
  int asked = 0;
  auto shard = shard_of(1, CountedSgd{Sgd{1.0F}, &asked}, sync);  // b = {5, 6}
  Update<CountedSgd, Async, NoTables> update;
  Stats stats;
  const float unknown = std::numeric_limits<float>::infinity();
  CHECK(shard.find(1)->largest == unknown);  // initialized: not measured yet
  const std::vector<float> small{1, -2};
  CHECK(update.take(shard, sync, Push{0, 0, {{1, small}}}, Verdict::kReady, 0, stats, 2.0F).refused.empty());
  CHECK(values_of(shard, 1) == std::vector<float>{4, 8});
  CHECK(shard.find(1)->largest == kOrdinaryMagnitude);  // bounded by the update
  CHECK(asked == 1);  // nothing to prove it from: checked in full
  // Proven from the magnitudes (the part's bound and 2, then the gradient's, which the
  // update reads when not told): the part is not read twice.
  CHECK(update.take(shard, sync, Push{0, 1, {{1, small}}}, Verdict::kReady, 1, stats, 2.0F).refused.empty());
  const std::vector<float> one{1, 1};
  CHECK(update.take(shard, sync, Push{0, 2, {{1, one}}}, Verdict::kReady, 2, stats).refused.empty());
  CHECK(values_of(shard, 1) == std::vector<float>{2, 9});
  CHECK(asked == 1);
  // The bound a push carries (its client in this process measured it) is taken as told,
  // not read again: from a loose one (1e38), nothing is proven.
  Push loose{0, 3, {{1, one}}};
  loose.largest = 1e38F;
  CHECK(update.take(shard, sync, loose, Verdict::kReady, 3, stats).refused.empty());
  CHECK(values_of(shard, 1) == std::vector<float>{1, 8});
  CHECK(asked == 2);
  // Too large to prove (1e38 > 2^126), finite all the same: applied after stays_finite.
  const std::vector<float> large{-1e38F, 0};
  CHECK(update.take(shard, sync, Push{0, 4, {{1, large}}}, Verdict::kReady, 4, stats, 1e38F).refused.empty());
  CHECK(values_of(shard, 1) == std::vector<float>{1e38F, 8});
  CHECK(shard.find(1)->largest == unknown);  // 1e38 is not ordinary
  CHECK(asked == 3);
  // Twice that overflows: not proven, and refused by stays_finite; nothing changes.
  const auto out = update.take(shard, sync, Push{0, 5, {{1, large}}}, Verdict::kReady, 5, stats);
  CHECK(out.refused.find("push from worker 0 refused") == 0);
  CHECK(values_of(shard, 1) == std::vector<float>{1e38F, 8});
  CHECK(stats.updates_refused == 1);
  CHECK(asked == 4);
  // Values set otherwise are not measured: the next update is checked in full.
  const std::vector<float> b{5, 6};
  shard.initialize({PartValues{1, b}});
  CHECK(shard.find(1)->largest == unknown);
}

namespace {

/// Ftrl that counts the calls of its full check.
struct CountedFtrl : Ftrl {
  int* asked = nullptr;
  [[nodiscard]] bool stays_finite(const State& state, std::span<const float> w,
                                  std::span<const float> g) const {
    ++*asked;
    return Ftrl::stays_finite(state, w, g);
  }
};
static_assert(BoundsMagnitudes<CountedFtrl>);

}  // namespace

TEST_CASE(
    "Ftrl's updates are proven from magnitudes once an update measured the part, and one beyond is "
    "checked and refused") {
  const Async sync;
  int asked = 0;
  auto shard = shard_of(1, CountedFtrl{Ftrl{0.1F}, &asked}, sync);  // b = {5, 6}
  Update<CountedFtrl, Async, NoTables> update;
  Stats stats;
  const std::vector<float> small{1, -2};
  CHECK(update.take(shard, sync, Push{0, 0, {{1, small}}}, Verdict::kReady, 0, stats)
            .refused.empty());
  CHECK(asked == 1);  // initialized: the weights were not solved from the slots, checked in full
  CHECK(shard.find(1)->largest == kOrdinaryMagnitude);
  for (std::int64_t step = 1; step <= 3; ++step) {
    CHECK(update.take(shard, sync, Push{0, step, {{1, small}}}, Verdict::kReady, step, stats)
              .refused.empty());
  }
  CHECK(asked == 1);  // proven: the part read once per update
  // A gradient whose square overflows the accumulator: not proven, refused by the check.
  const std::vector<float> values_before = values_of(shard, 1);
  const std::vector<float> huge{1e30F, 0};
  const auto out = update.take(shard, sync, Push{0, 4, {{1, huge}}}, Verdict::kReady, 4, stats);
  CHECK(out.refused.find("push from worker 0 refused") == 0);
  CHECK(asked == 2);
  CHECK(values_of(shard, 1) == values_before);
  // Values set otherwise: the next update is checked in full again.
  const std::vector<float> b{5, 6};
  shard.initialize({PartValues{1, b}});
  CHECK(update.take(shard, sync, Push{0, 5, {{1, small}}}, Verdict::kReady, 5, stats)
            .refused.empty());
  CHECK(asked == 3);
}

TEST_CASE("a shard with tables: rows are checked, pulled, and updated with the dense parts") {
  using T = Tables<Adagrad>;
  const Async sync;
  auto shard = shard_of(0, Adagrad{0.5F}, sync, T{Adagrad{1.0F}}, {TableSpec{"emb", 2, {}}});
  REQUIRE(shard.tables().size() == 1);
  // Rows of another ps are refused, naming it.
  std::uint64_t foreign = 0;
  while (HashIds{}.ps_of("emb", foreign, 2) == 0) ++foreign;
  const auto refused = shard.tables().check({TableRows{0, {foreign}, {}}}, false, false);
  REQUIRE(refused.has_value());
  CHECK(refused->message.find("is held by ps 1, not here") != std::string::npos);
  std::uint64_t mine = 0;
  while (HashIds{}.ps_of("emb", mine, 2) != 0) ++mine;
  Stats stats;
  const RowsReply first = shard.tables().pull(PullRows{0, 0, {TableRows{0, {mine}, {}}}}, true, 0, stats);
  const std::vector<float> before(first.rows.at(0).begin(), first.rows.at(0).end());
  Update<Adagrad, Async, T> update;
  const std::vector<float> g{1, 1, 1, 1};
  const std::vector<float> row_g{1, -1};
  (void)update.take(shard, sync, Push{0, 0, {{0, g}}, 0, 0, {TableRows{0, {mine}, row_g}}}, Verdict::kReady, 0, stats);
  shard.tables().free_replies();
  const RowsReply after = shard.tables().pull(PullRows{0, 0, {TableRows{0, {mine}, {}}}}, true, 1, stats);
  CHECK(after.rows.at(0)[0] < before[0]);
  CHECK(after.rows.at(0)[1] > before[1]);
  CHECK(stats.updates_applied == 2);  // the part and the table
  // A row that would go non-finite rolls the whole update back, dense part included.
  const std::vector<float> w_before = values_of(shard, 0);
  const std::vector<float> inf_row{std::numeric_limits<float>::infinity(), 0};
  const auto out = update.take(shard, sync, Push{0, 1, {{0, g}}, 0, 0, {TableRows{0, {mine}, inf_row}}},
                               Verdict::kReady, 1, stats);
  CHECK(out.refused.find("push from worker 0 refused: it would make table 'emb' non-finite") == 0);
  CHECK(values_of(shard, 0) == w_before);
}

TEST_CASE("a shard without tables refuses any row") {
  const Async sync;
  auto shard = shard_of(0, Momentum{0.1F, 0.9F}, sync);
  const auto refused = shard.tables().check({TableRows{0, {1}, {}}}, false, false);
  REQUIRE(refused.has_value());
  CHECK(refused->message == "unknown table 0 (the model has 0)");
}
