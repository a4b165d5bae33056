// SPDX-License-Identifier: MIT
// IdIndex, pulley's one index of 64-bit ids, and IdPositions over it: the id → position
// table of a batch's rows (worker) and of an update's pushed rows (ps), and with churn the
// id → row index of an embedding table; checked against std::unordered_map.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "pulley/core/id_index.hpp"

using pulley::IdIndex;
using pulley::IdPositions;

TEST_CASE("ids are numbered in the order they first come, through growth and clears") {
  IdPositions index(0x1234);
  std::mt19937_64 rng(7);
  for (int round = 0; round < 50; ++round) {
    index.clear();
    std::unordered_map<std::uint64_t, std::size_t> reference;
    const std::size_t n = 1 + rng() % 3000;
    for (std::size_t i = 0; i < n; ++i) {
      // draws from a small range so that ids come again, and the edges of the id space
      const std::uint64_t id = i % 97 == 0 ? ~std::uint64_t{0} - rng() % 2 : rng() % 2000;
      const auto [at, fresh] = index.insert(id);
      const auto [it, ref_fresh] = reference.try_emplace(id, reference.size());
      REQUIRE(fresh == ref_fresh);
      REQUIRE(at == it->second);
    }
    CHECK(index.size() == reference.size());
    for (const auto& [id, at] : reference) REQUIRE(index.find(id) == at);
    CHECK(index.find(2001) == IdPositions::npos);  // never inserted this round
  }
}

TEST_CASE("a cleared index holds nothing, and finds nothing of before") {
  IdPositions index;
  CHECK(index.find(0) == IdPositions::npos);  // empty, no slots yet
  for (std::uint64_t id = 0; id < 100; ++id) index.insert(id);
  index.clear();
  CHECK(index.size() == 0);
  for (std::uint64_t id = 0; id < 100; ++id) REQUIRE(index.find(id) == IdPositions::npos);
  CHECK(index.insert(42) == std::pair<std::size_t, bool>{0, true});
}

TEST_CASE("first_duplicate names the second sighting of an id, or nothing") {
  IdPositions index(99);
  const std::vector<std::uint64_t> distinct{0, 1, ~std::uint64_t{0}, 5, 1ULL << 63U};
  CHECK(index.first_duplicate(distinct) == nullptr);
  const std::vector<std::uint64_t> twice{3, 9, 4, 9, 3};
  const std::uint64_t* dup = index.first_duplicate(twice);
  REQUIRE(dup != nullptr);
  CHECK(dup == &twice[3]);
  CHECK(index.first_duplicate(std::vector<std::uint64_t>{}) == nullptr);
}

TEST_CASE("ids that share their low bits are held and found like any others") {
  // Multiples of 2^20 (std::hash would give them the same low bits) and their neighbours.
  IdPositions index(0xfeed);
  for (std::uint64_t i = 0; i < 100'000; ++i) REQUIRE(index.insert(i << 20U).second);
  for (std::uint64_t i = 0; i < 100'000; ++i) REQUIRE(index.insert((i << 20U) + 1).first == 100'000 + i);
  CHECK(index.size() == 200'000);
  CHECK(index.find(99'999ULL << 20U) == 99'999);
  CHECK(index.find(2) == IdPositions::npos);
}

TEST_CASE("with erasures and renumbering, every id is found where it lives and no other is") {
  // As an embedding table uses it: entries are rows; removing a row moves the last one into
  // its place (renumber), and the index shifts entries back instead of leaving tombstones.
  std::vector<std::uint64_t> rows;  // row -> id
  auto id_of = [&](std::uint32_t row) { return rows[row]; };
  IdIndex index(0xabcdef, 3);
  std::unordered_map<std::uint64_t, std::uint32_t> reference;
  std::mt19937_64 rng(11);
  for (int op = 0; op < 200'000; ++op) {
    const std::uint64_t id = rng() % 5000;
    const auto found = reference.find(id);
    REQUIRE(index.find(id, id_of) == (found == reference.end() ? IdIndex::kNone : found->second));
    if (found == reference.end()) {
      rows.push_back(id);
      index.insert(static_cast<std::uint32_t>(rows.size() - 1), id_of);
      reference.emplace(id, static_cast<std::uint32_t>(rows.size() - 1));
    } else if (rng() % 2 == 0) {
      const std::uint32_t row = found->second;
      const auto last = static_cast<std::uint32_t>(rows.size() - 1);
      index.erase(row, id_of);
      reference.erase(found);
      if (row != last) {
        index.renumber(last, row, id_of);
        rows[row] = rows[last];
        reference[rows[row]] = row;
      }
      rows.pop_back();
    }
    REQUIRE(index.size() == reference.size());
  }
  for (const auto& [id, row] : reference) REQUIRE(index.find(id, id_of) == row);
  // At most 3/4 full: 4 bytes a slot, and at least 4/3 slots an entry.
  CHECK(index.bytes() >= index.size() * 4 * 4 / 3);
}

TEST_CASE("a cleared index that held many ids keeps little memory") {
  IdPositions positions(5);
  for (std::uint64_t id = 0; id < 100'000; ++id) positions.insert(id);
  positions.clear();
  positions.insert(1);
  positions.clear();  // a small batch after a huge one does not clear the huge one's slots
  for (std::uint64_t id = 0; id < 10; ++id) CHECK(positions.insert(id * 7).first == id);
  CHECK(positions.find(7) == 1);
  CHECK(positions.find(100) == IdPositions::npos);
}
