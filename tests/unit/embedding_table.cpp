// SPDX-License-Identifier: MIT
// Embedding tables on one ps: rows created lazily with a value that depends on the id alone,
// row-wise updates that touch only their rows, admission, eviction, the index against a
// reference map, memory per row, and the id sharding policies and sparse accumulator.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <new>
#include <random>
#include <span>
#include <tuple>
#include <vector>

#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/optimizers/rmsprop.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/embedding_table.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/tables/row_aggregation.hpp"

using namespace pulley;

// Every allocation of this program goes through here, so that a test can make the next
// allocation of one exact size fail, as a ps out of memory would see it.
namespace {
std::size_t fail_next_of_size = 0;
}  // namespace

// (GCC takes the std::free below for a mismatch with the operator new it sees inlined.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  if (fail_next_of_size != 0 && n == fail_next_of_size) {
    fail_next_of_size = 0;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t /*n*/) noexcept { std::free(p); }

namespace {

constexpr std::uint64_t kSeed = 42;

TableSpec spec(std::size_t dim = 4, std::uint32_t admit_after = 1, std::int64_t evict_after = 0) {
  return TableSpec{"emb", dim, Initializer::uniform(0.05F), admit_after, evict_after};
}

std::vector<float> pull(EmbeddingTable<Sgd>& table, std::vector<std::uint64_t> ids,
                        std::int64_t step = 0) {
  std::vector<float> out(ids.size() * table.dim());
  table.pull(ids, out, step);
  return out;
}

/// `O` with an `apply_row` of its own (the same rule): not BoundsRowMagnitudes, so a table
/// updates every row of it in a copy first and checks it, as before rows were proven.
template <class O>
struct ThroughCopies : O {
  void apply_row(std::span<float> w, std::span<float> slots, std::span<const float> g,
                 const RowContext& context) const {
    O::apply_row(w, slots, g, context);
  }
};
static_assert(BoundsRowMagnitudes<Adagrad> && BoundsRowMagnitudes<Adam> && BoundsRowMagnitudes<Sgd> &&
              BoundsRowMagnitudes<RmsProp>);
static_assert(RowWiseOptimizer<ThroughCopies<Adagrad>> && !BoundsRowMagnitudes<ThroughCopies<Adagrad>>);
static_assert(!BoundsRowMagnitudes<Ftrl>);  // (its weight is a quotient of its slots: nothing to prove from magnitudes)

/// Every row's id, values and slots, in row order.
template <class O>
std::vector<std::tuple<std::uint64_t, std::vector<float>, std::vector<float>>> rows_of(const EmbeddingTable<O>& table) {
  std::vector<std::tuple<std::uint64_t, std::vector<float>, std::vector<float>>> out;
  table.for_each_row([&](std::uint64_t id, std::span<const float> values, std::span<const float> slots) {
    out.emplace_back(id, std::vector<float>(values.begin(), values.end()), std::vector<float>(slots.begin(), slots.end()));
  });
  return out;
}

/// Trains a table of `O` and one of ThroughCopies<O> alike (rows created as they are
/// pulled, random subsets pushed) and checks that every row ends bit for bit the same, the
/// first table having updated every row in place.
template <class O>
void check_in_place_matches_copies(const O& optimizer) {
  const TableSpec s = spec(5);
  EmbeddingTable<O> in_place(s, optimizer, kSeed);
  EmbeddingTable<ThroughCopies<O>> copies(s, ThroughCopies<O>{optimizer}, kSeed);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0F, 0.3F);
  for (std::int64_t update = 1; update <= 30; ++update) {
    std::vector<std::uint64_t> ids;
    for (std::uint64_t id = 0; id < 40; ++id) {
      if (rng() % 3 == 0) ids.push_back(id);
    }
    std::vector<float> pulled(ids.size() * s.dim);
    in_place.pull(ids, pulled, update);
    copies.pull(ids, pulled, update);
    CHECK(in_place.unproven() == 0);  // created ordinary, slots not negative
    std::vector<float> g(ids.size() * s.dim);
    for (float& x : g) x = normal(rng);
    REQUIRE(in_place.apply(ids, g, update, update));
    REQUIRE(copies.apply(ids, g, update, update));
    CHECK(in_place.unproven() == 0);
    CHECK(copies.unproven() == copies.size());  // nothing is proven without the bound
  }
  CHECK(in_place.size() == copies.size());
  CHECK(rows_of(in_place) == rows_of(copies));
}

std::vector<float> initial(const TableSpec& s, std::uint64_t id) {
  std::vector<float> row(s.dim);
  initialize_row(s, kSeed, id, row);
  return row;
}

}  // namespace

TEST_CASE("a row is created on first pull with a value that depends only on the table, id and seed") {
  EmbeddingTable<Sgd> a(spec(), Sgd{0.1F}, kSeed);
  EmbeddingTable<Sgd> b(spec(), Sgd{0.1F}, kSeed);
  const std::uint64_t big = std::numeric_limits<std::uint64_t>::max();
  // Other orders, other neighbours: the same values.
  const auto from_a = pull(a, {7, 0, big});
  const auto from_b = pull(b, {big, 12345, 0, 7});
  CHECK(std::vector<float>(from_a.begin(), from_a.begin() + 4) == initial(spec(), 7));
  CHECK(std::vector<float>(from_b.begin() + 12, from_b.end()) == initial(spec(), 7));
  CHECK(std::vector<float>(from_a.begin() + 8, from_a.end()) == initial(spec(), big));
  CHECK(a.size() == 3);
  CHECK(a.stats().rows_created == 3);
  // Values are spread over the initializer's range, and differ from id to id and table to table.
  CHECK(initial(spec(), 1) != initial(spec(), 2));
  TableSpec other = spec();
  other.name = "other";
  CHECK(initial(other, 1) != initial(spec(), 1));
  for (const float v : initial(spec(), 99)) CHECK(std::abs(v) <= 0.05F);
  // A seed changes every row.
  std::vector<float> reseeded(4);
  initialize_row(spec(), kSeed + 1, 7, reseeded);
  CHECK(reseeded != initial(spec(), 7));
}

TEST_CASE("lazy init is the same whichever ps holds the row, for any number of ps tasks") {
  std::vector<std::uint64_t> ids;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) ids.push_back(rng());
  for (const std::uint32_t num_ps : {1U, 2U, 3U, 7U}) {
    std::vector<EmbeddingTable<Sgd>> shards;
    for (std::uint32_t p = 0; p < num_ps; ++p) shards.emplace_back(spec(), Sgd{0.1F}, kSeed);
    for (const std::uint64_t id : ids) {
      const std::uint32_t owner = HashIds{}.ps_of("emb", id, num_ps);
      REQUIRE(owner < num_ps);
      CHECK(pull(shards[owner], {id}) == initial(spec(), id));
    }
  }
}

TEST_CASE("a sparse update touches only its rows, the others stay bit for bit") {
  EmbeddingTable<Sgd> table(spec(2), Sgd{0.5F}, kSeed);
  const auto before = pull(table, {1, 2, 3});
  const std::vector<std::uint64_t> pushed{2};
  const std::vector<float> gradient{1.0F, -2.0F};
  REQUIRE(table.apply(pushed, gradient, 0, 1));
  const auto after = pull(table, {1, 2, 3});
  CHECK(after[0] == before[0]);
  CHECK(after[1] == before[1]);
  CHECK(after[2] == doctest::Approx(before[2] - 0.5F));
  CHECK(after[3] == doctest::Approx(before[3] + 1.0F));
  CHECK(after[4] == before[4]);
  CHECK(after[5] == before[5]);
}

TEST_CASE("a row-wise optimizer keeps its slots beside each row: Adagrad, two updates of one row") {
  EmbeddingTable<Adagrad> table(TableSpec{"emb", 1, Initializer::constant(1.0F)},
                                Adagrad{0.1F, 0.1F, 0.0F}, kSeed);
  std::vector<float> out(2);
  const std::vector<std::uint64_t> ids{5, 6};
  table.pull(ids, out, 0);
  const std::vector<std::uint64_t> five{5};
  const std::vector<float> g{2.0F};
  REQUIRE(table.apply(five, g, 0, 1));  // accumulator 0.1 + 4 = 4.1: w = 1 - 0.1 * 2 / sqrt(4.1)
  REQUIRE(table.apply(five, g, 1, 2));  // 8.1: w -= 0.1 * 2 / sqrt(8.1)
  table.pull(ids, out, 2);
  CHECK(out[0] == doctest::Approx(1.0 - 0.2 / std::sqrt(4.1) - 0.2 / std::sqrt(8.1)));
  CHECK(out[1] == 1.0F);  // row 6 was never pushed: its accumulator did not move either
  std::vector<float> accumulators;
  table.for_each_row([&](std::uint64_t id, std::span<const float> values, std::span<const float> slots) {
    CHECK(values.size() == 1);
    REQUIRE(slots.size() == 1);
    accumulators.push_back(id == 5 ? slots[0] - 8.1F : slots[0] - 0.1F);
  });
  REQUIRE(accumulators.size() == 2);
  for (const float a : accumulators) CHECK(std::abs(a) < 1e-5F);
}

TEST_CASE("a pushed row the ps does not hold is dropped and counted, a non-finite update changes nothing") {
  EmbeddingTable<Sgd> table(spec(2), Sgd{1.0F}, kSeed);
  const auto before = pull(table, {1, 2});
  const std::vector<std::uint64_t> ids{1, 99};
  const std::vector<float> g{1.0F, 1.0F, 1.0F, 1.0F};
  REQUIRE(table.apply(ids, g, 0, 1));
  CHECK(table.stats().pushes_dropped == 1);
  CHECK(table.size() == 2);  // a push creates nothing
  const std::vector<std::uint64_t> both{1, 2};
  const std::vector<float> overflow{0.0F, 0.0F, 0.0F, std::numeric_limits<float>::infinity()};
  CHECK_FALSE(table.apply(both, overflow, 1, 2));
  CHECK(table.stats().updates_refused == 1);
  const auto after = pull(table, {1, 2});
  CHECK(after[0] == doctest::Approx(before[0] - 1.0F));  // the first update only
  CHECK(after[2] == before[2]);
  CHECK(after[3] == before[3]);
}

TEST_CASE("admission: a row is created on the k-th pull, until then it reads as its initial value") {
  EmbeddingTable<Sgd> table(spec(2, 3), Sgd{1.0F}, kSeed);
  const std::vector<std::uint64_t> id{8};
  const std::vector<float> g{1.0F, 1.0F};
  CHECK(pull(table, {8}) == initial(spec(2), 8));
  REQUIRE(table.apply(id, g, 0, 1));  // not admitted: dropped
  CHECK(pull(table, {8}) == initial(spec(2), 8));
  CHECK(table.size() == 0);
  CHECK(table.stats().candidates == 1);
  CHECK(table.stats().pushes_dropped == 1);
  CHECK(pull(table, {8}) == initial(spec(2), 8));  // the third pull admits it
  CHECK(table.size() == 1);
  CHECK(table.stats().candidates == 0);
  REQUIRE(table.apply(id, g, 0, 2));
  const auto moved = pull(table, {8});
  CHECK(moved[0] == doctest::Approx(initial(spec(2), 8)[0] - 1.0F));
}

TEST_CASE("eviction: rows untouched for the given steps go, and come back as new") {
  EmbeddingTable<Sgd> table(spec(2, 1, 10), Sgd{1.0F}, kSeed);
  (void)pull(table, {1, 2, 3}, 0);
  const std::vector<std::uint64_t> two{2};
  const std::vector<float> g{1.0F, 1.0F};
  REQUIRE(table.apply(two, g, 5, 1));  // row 2 touched at step 5
  (void)pull(table, {3}, 8);           // row 3 at step 8
  CHECK(table.evict(10) == 0);         // nothing older than step 0
  CHECK(table.evict(12) == 1);         // row 1 (step 0 < 2)
  CHECK(table.size() == 2);
  CHECK(table.evict(16) == 1);  // row 2 (step 5 < 6)
  CHECK(table.stats().rows_evicted == 2);
  CHECK(pull(table, {2}, 16) == initial(spec(2), 2));  // back as new
  CHECK(table.size() == 2);
  EmbeddingTable<Sgd> forever(spec(2), Sgd{1.0F}, kSeed);
  (void)pull(forever, {1}, 0);
  CHECK(forever.evict(1'000'000) == 0);
}

TEST_CASE("max_rows: a full table evicts its least recently touched eighth, never a row of the step in progress") {
  TableSpec capped = spec(2);
  capped.max_rows = 16;
  EmbeddingTable<Sgd> table(capped, Sgd{1.0F}, kSeed);
  std::vector<std::uint64_t> first;
  for (std::uint64_t id = 0; id < 16; ++id) first.push_back(id);
  (void)pull(table, first, 1);
  (void)pull(table, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 3);  // 14 and 15 stay at step 1
  CHECK(table.size() == 16);
  (void)pull(table, {100}, 5);  // full: the two oldest go, 100 comes
  CHECK(table.size() == 15);
  CHECK(table.stats().rows_capped == 2);
  const std::vector<std::uint64_t> gone{14, 15}, kept{0, 100};
  const std::vector<float> g(4, 1.0F);
  REQUIRE(table.apply(gone, g, 5, 1));
  CHECK(table.stats().pushes_dropped == 2);  // evicted rows are not held
  REQUIRE(table.apply(kept, g, 5, 2));
  CHECK(table.stats().pushes_dropped == 2);
  // Every row touched at the step in progress: a new one is not created, and reads as new.
  std::vector<std::uint64_t> now;
  for (std::uint64_t id = 200; now.size() < 16; ++id) now.push_back(id);
  (void)pull(table, now, 9);  // evicts what it must, as each row comes
  CHECK(table.size() == 16);
  const auto before = table.stats().rows_capped;
  CHECK(pull(table, {999}, 9) == initial(spec(2), 999));
  CHECK(table.size() == 16);
  CHECK(table.stats().rows_capped == before + 1);
  // While a cut is read, a full table evicts nothing.
  table.begin_cut();
  CHECK(pull(table, {1000}, 12) == initial(spec(2), 1000));
  CHECK(table.size() == 16);
  table.end_cut();
  (void)pull(table, {1000}, 12);
  CHECK(table.size() <= 16);
}

TEST_CASE("max_rows bounds the ids admission counts too: the longest unseen are forgotten") {
  TableSpec capped = spec(2, 5);
  capped.max_rows = 8;
  EmbeddingTable<Sgd> table(capped, Sgd{1.0F}, kSeed);
  for (std::uint64_t id = 0; id < 1000; ++id) (void)pull(table, {id}, static_cast<std::int64_t>(id));
  CHECK(table.size() == 0);
  CHECK(table.candidates() <= 8);
  CHECK(table.candidates() >= 4);
}

TEST_CASE("the index agrees with a reference map through many creations and evictions") {
  EmbeddingTable<Sgd> table(spec(1, 1, 3), Sgd{1.0F}, kSeed);
  std::map<std::uint64_t, std::int64_t> reference;  // id -> step last touched
  std::mt19937_64 rng(11);
  std::vector<float> out(1);
  for (std::int64_t step = 0; step < 400; ++step) {
    for (int k = 0; k < 50; ++k) {
      // Few distinct ids, so rows are found again, evicted and created again; a few
      // adjacent ids collide in the index.
      const std::uint64_t id = rng() % 700 + (k % 2 == 0 ? 0 : (std::uint64_t{1} << 63U));
      const std::vector<std::uint64_t> one{id};
      table.pull(one, out, step);
      reference[id] = step;
    }
    const std::size_t removed = table.evict(step);
    std::size_t expected = 0;
    for (auto it = reference.begin(); it != reference.end();) {
      if (it->second < step - 3) {
        it = reference.erase(it);
        ++expected;
      } else {
        ++it;
      }
    }
    REQUIRE(removed == expected);
    REQUIRE(table.size() == reference.size());
  }
  std::size_t seen = 0;
  table.for_each_row([&](std::uint64_t id, std::span<const float>, std::span<const float>) {
    CHECK(reference.count(id) == 1);
    ++seen;
  });
  CHECK(seen == reference.size());
}

TEST_CASE("one pull of a million ids, and the memory a row costs") {
  EmbeddingTable<Adagrad> table(TableSpec{"emb", 16, Initializer::normal(0.01F)}, Adagrad{}, kSeed);
  std::vector<std::uint64_t> ids(1'000'000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = mix_id(i);
  std::vector<float> out(ids.size() * 16);
  table.pull(ids, out, 0);
  CHECK(table.size() == ids.size());
  std::vector<float> row(16);
  initialize_row(table.spec(), kSeed, ids[777'777], row);
  CHECK(std::vector<float>(out.begin() + 777'777 * 16, out.begin() + 777'778 * 16) == row);
  // Values and Adagrad's accumulator are 128 bytes a row; the table holds at most 1.5 times
  // that (ids, last-touched steps, the index and one chunk of slack included).
  const double per_row = static_cast<double>(table.stats().bytes) / static_cast<double>(table.size());
  MESSAGE("bytes per row: " << per_row);
  CHECK(per_row <= 1.5 * 128);
}

TEST_CASE("HashIds and RangeIds place every id on a ps that exists") {
  std::mt19937_64 rng(5);
  std::vector<std::size_t> hashed(4), ranged(4);
  for (int i = 0; i < 100'000; ++i) {
    const std::uint64_t id = rng();
    ++hashed.at(HashIds{}.ps_of("t", id, 4));
    ++ranged.at(RangeIds{}.ps_of("t", id, 4));
  }
  for (std::size_t p = 0; p < 4; ++p) {
    CHECK(hashed[p] > 23'000);  // 25 000 each, within a few percent
    CHECK(ranged[p] > 23'000);
  }
  // Sequential ids: hashed spread, ranged all on ps 0 (what its doc warns of).
  std::vector<std::size_t> sequential(4);
  for (std::uint64_t id = 0; id < 1000; ++id) ++sequential.at(HashIds{}.ps_of("t", id, 4));
  for (const std::size_t n : sequential) CHECK(n > 200);
  CHECK(RangeIds{}.ps_of("t", 999, 4) == 0);
  CHECK(RangeIds{}.ps_of("t", std::numeric_limits<std::uint64_t>::max(), 4) == 3);
  CHECK(RangeIds{}.ps_of("t", std::uint64_t{1} << 63U, 4) == 2);
  CHECK(RangeIds{}.ps_of("t", (std::uint64_t{1} << 63U) - 1, 4) == 1);
  CHECK(RangeIds{}.ps_of("t", std::numeric_limits<std::uint64_t>::max(), 7) == 6);
}

TEST_CASE("a pull that runs out of memory growing the index leaves the table as it was") {
  EmbeddingTable<Sgd> table(spec(2, 1, 5), Sgd{1.0F}, kSeed);
  for (std::uint64_t id = 0; id < 48; ++id) (void)pull(table, {id});  // 48 rows: 64 slots
  fail_next_of_size = 128 * sizeof(std::uint32_t);                   // the growth to 128
  CHECK_THROWS_AS((void)pull(table, {48}), std::bad_alloc);
  CHECK(fail_next_of_size == 0);  // the growth was tried, and failed
  CHECK(table.size() == 48);
  // Every row is still found: pulled again, none is created twice.
  for (std::uint64_t id = 0; id < 48; ++id) (void)pull(table, {id}, 10);
  CHECK(table.size() == 48);
  std::map<std::uint64_t, int> held;
  table.for_each_row([&](std::uint64_t id, auto, auto) { ++held[id]; });
  CHECK(held.size() == 48);
  (void)pull(table, {48}, 10);  // with memory, the growth goes through
  CHECK(table.size() == 49);
  CHECK(table.evict(14) == 0);  // everything was touched at step 10, kept for 5 steps
  CHECK(table.evict(16) == 49);
  CHECK(table.size() == 0);
}

TEST_CASE("an admitted id's count is kept until its row exists") {
  EmbeddingTable<Sgd> table(spec(2, 2), Sgd{1.0F}, kSeed);
  (void)pull(table, {5});
  CHECK(table.stats().candidates == 1);
  (void)pull(table, {5});  // the second pull admits it
  CHECK(table.size() == 1);
  CHECK(table.stats().candidates == 0);
}

TEST_CASE("a cut reads the rows as they were when it began, while updates go on (copy-on-write), and evicts nothing") {
  EmbeddingTable<Sgd> table(spec(2, 1, 3), Sgd{1.0F}, kSeed);
  const std::vector<std::uint64_t> ids{1, 2, 3, 4};
  (void)pull(table, ids, 1);
  const std::vector<float> g(ids.size() * 2, 0.5F);
  REQUIRE(table.apply(ids, g, 1, 1));
  auto read = [&] {
    std::vector<std::uint64_t> out_ids;
    std::vector<float> rows;
    std::vector<std::uint32_t> touched;
    table.read_rows(0, table.size(), out_ids, rows, touched);
    return std::tuple{out_ids, rows, touched};
  };
  const auto at_cut = read();
  table.begin_cut();
  // Updates while the cut is read: rows 1 and 3 twice, a new row 9, row 2 pulled.
  const std::vector<std::uint64_t> some{1, 3};
  const std::vector<float> g2(4, 1.0F);
  REQUIRE(table.apply(some, g2, 2, 2));
  REQUIRE(table.apply(some, g2, 3, 3));
  (void)pull(table, {9}, 3);
  (void)pull(table, {2}, 7);  // a pull touches row 2 later than the cut saw
  CHECK(table.kept_for_cut() == 3);  // each changed row copied once, touched ones too
  CHECK(table.evict(100) == 0);      // nothing goes during a cut, however idle
  // The cut's rows [0, 4) read as at the cut, by range and by number.
  std::vector<std::uint64_t> cut_ids;
  std::vector<float> cut_rows;
  std::vector<std::uint32_t> cut_touched;
  table.read_rows(0, 4, cut_ids, cut_rows, cut_touched);
  CHECK(std::tuple{cut_ids, cut_rows, cut_touched} == at_cut);
  std::vector<std::uint64_t> one_id;
  std::vector<float> one_row;
  std::vector<std::uint32_t> one_touched;
  const std::vector<std::uint32_t> numbers{2};
  table.read_rows(std::span<const std::uint32_t>(numbers), one_id, one_row, one_touched);
  CHECK(one_id == std::vector<std::uint64_t>{std::get<0>(at_cut)[2]});
  CHECK(one_row == std::vector<float>(std::get<1>(at_cut).begin() + 4, std::get<1>(at_cut).begin() + 6));
  // After the cut, the rows read as training left them, and eviction resumes.
  table.end_cut();
  CHECK(table.kept_for_cut() == 0);
  const auto now = read();
  CHECK(std::get<1>(now) != std::get<1>(at_cut));
  CHECK(table.evict(100) == 5);  // rows 1 to 4 and 9
  CHECK(table.size() == 0);
}

TEST_CASE("rows proven finite in advance are updated in place, bit for bit as through copies, for every bounding optimizer") {
  check_in_place_matches_copies(Sgd{0.1F});
  check_in_place_matches_copies(Adagrad{0.1F});
  check_in_place_matches_copies(Adam{0.05F});
  check_in_place_matches_copies(RmsProp{0.05F, 0.9F, 0.5F});
}

TEST_CASE("an update with a row not proven is all or nothing over the rows updated in place and those in copies") {
  EmbeddingTable<Adagrad> table(spec(2), Adagrad{0.1F, 0.1F, 1e-7F}, kSeed);
  const std::vector<std::uint64_t> ids{1, 2, 3};
  std::vector<float> pulled(6);
  table.pull(ids, pulled, 0);
  REQUIRE(table.unproven() == 0);
  // Row 3 restored with a negative accumulator, as a damaged checkpoint could: its square
  // root is NaN for a small gradient, so the table cannot prove it and updates it in a copy.
  const std::vector<float> damaged{0.5F, 0.5F, -1.0F, -1.0F};
  table.restore_row(3, damaged, 0);
  CHECK(table.unproven() == 1);
  const auto before = rows_of(table);
  const std::vector<float> g(6, 0.5F);
  CHECK_FALSE(table.apply(ids, g, 1, 1));
  CHECK(table.stats().updates_refused == 1);
  CHECK(rows_of(table) == before);  // rows 1 and 2, provable, did not move either
  // A sound accumulator again: proven once restored, and the update goes through.
  const std::vector<float> sound{0.5F, 0.5F, 0.1F, 0.1F};
  table.restore_row(3, sound, 0);
  CHECK(table.unproven() == 0);
  REQUIRE(table.apply(ids, g, 1, 1));
  CHECK(rows_of(table) != before);
  CHECK(table.unproven() == 0);
}

TEST_CASE("a row beyond ordinary magnitudes, or a gradient beyond them, goes through a copy and is checked") {
  EmbeddingTable<Sgd> table(spec(1), Sgd{1.0F}, kSeed);
  const std::vector<std::uint64_t> one{1};
  const std::vector<std::uint64_t> both{1, 2};
  std::vector<float> pulled(2);
  table.pull(both, pulled, 0);
  const float huge = 0x1p70F;  // finite, but beyond kOrdinaryMagnitude
  table.restore_row(1, std::vector<float>{huge}, 0);
  CHECK(table.unproven() == 1);
  REQUIRE(table.apply(one, std::vector<float>{0.0F}, 1, 1));  // through a copy: still huge
  CHECK(table.unproven() == 1);
  REQUIRE(table.apply(one, std::vector<float>{huge}, 2, 2));  // back to 0: proven again
  CHECK(table.unproven() == 0);
  std::vector<float> row(1);
  table.pull(one, row, 2);
  CHECK(row[0] == 0.0F);
  // A gradient beyond ordinary is not proven: the update goes through copies, applied when
  // finite, and the rows it leaves beyond ordinary are not proven either.
  REQUIRE(table.apply(both, std::vector<float>{0x1p61F, 0.0F}, 3, 3));
  CHECK(table.unproven() == 1);
  table.pull(one, row, 3);
  CHECK(row[0] == -0x1p61F);
  // A step that would overflow: refused, nothing changes.
  table.restore_row(1, std::vector<float>{-3e38F}, 3);
  const auto before = rows_of(table);
  CHECK_FALSE(table.apply(both, std::vector<float>{3e38F, 0.0F}, 4, 4));
  CHECK(rows_of(table) == before);
  // Rows evicted or cleared take their count with them.
  table.clear(5);
  CHECK(table.unproven() == 0);
}
