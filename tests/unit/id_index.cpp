// SPDX-License-Identifier: MIT
// detail::IdIndex: the id → position table of a batch's rows (worker) and of an update's
// pushed rows (ps), checked against std::unordered_map.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "pulley/core/id_index.hpp"

using pulley::detail::IdIndex;

TEST_CASE("ids are numbered in the order they first come, through growth and clears") {
  IdIndex index(0x1234);
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
    CHECK(index.find(2001) == IdIndex::npos);  // never inserted this round
  }
}

TEST_CASE("a cleared index holds nothing, and finds nothing of before") {
  IdIndex index;
  CHECK(index.find(0) == IdIndex::npos);  // empty, no slots yet
  for (std::uint64_t id = 0; id < 100; ++id) index.insert(id);
  index.clear();
  CHECK(index.size() == 0);
  for (std::uint64_t id = 0; id < 100; ++id) REQUIRE(index.find(id) == IdIndex::npos);
  CHECK(index.insert(42) == std::pair<std::size_t, bool>{0, true});
}

TEST_CASE("first_duplicate names the second sighting of an id, or nothing") {
  IdIndex index(99);
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
  IdIndex index(0xfeed);
  for (std::uint64_t i = 0; i < 100'000; ++i) REQUIRE(index.insert(i << 20U).second);
  for (std::uint64_t i = 0; i < 100'000; ++i) REQUIRE(index.insert((i << 20U) + 1).first == 100'000 + i);
  CHECK(index.size() == 200'000);
  CHECK(index.find(99'999ULL << 20U) == 99'999);
  CHECK(index.find(2) == IdIndex::npos);
}
