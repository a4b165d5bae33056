// SPDX-License-Identifier: MIT
#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"

using pulley::VariableSpec;

namespace {

// Counts how often each element of each variable is covered by some part, and checks the
// structural rules of a Placement.
template <class S>
void check_exact_cover(const S& sharding, const std::vector<VariableSpec>& variables,
                       std::size_t num_ps) {
  const pulley::Placement p = sharding.place(variables, num_ps);
  REQUIRE(p.num_variables() == variables.size());
  for (std::size_t v = 0; v < variables.size(); ++v) {
    std::vector<int> hits(variables[v].size(), 0);
    const std::size_t row_size = variables[v].row_size();
    std::uint32_t index = 0;
    for (const pulley::Part& part : p.parts_of(v)) {
      CHECK(part.variable == v);
      CHECK(part.index == index++);
      CHECK(part.ps < num_ps);
      CHECK_FALSE(part.rows.empty());
      for (std::size_t e = part.rows.begin * row_size; e < part.rows.end * row_size; ++e) {
        ++hits[e];
      }
    }
    for (int h : hits) REQUIRE(h == 1);
  }
}

const std::vector<VariableSpec> kOddShapes{
    {"scalar", {}, {}},      {"vector7", {7}, {}},         {"matrix13x3", {13, 3}, {}},
    {"tall1x5", {1, 5}, {}}, {"cube3x2x2", {3, 2, 2}, {}}, {"big101x9", {101, 9}, {}}};

}  // namespace

TEST_CASE("RoundRobin keeps variables whole and deals them in turn") {
  const auto p = pulley::RoundRobin{}.place(kOddShapes, 4);
  REQUIRE(p.parts.size() == kOddShapes.size());
  for (std::size_t v = 0; v < kOddShapes.size(); ++v) {
    CHECK(p.parts_of(v).size() == 1);
    CHECK(p.parts_of(v)[0].ps == v % 4);
    CHECK(p.parts_of(v)[0].rows == pulley::RowRange{0, kOddShapes[v].rows()});
  }
  check_exact_cover(pulley::RoundRobin{}, kOddShapes, 1);
  check_exact_cover(pulley::RoundRobin{}, kOddShapes, 3);
}

TEST_CASE("FixedShards covers every element once, for odd sizes and more shards than rows") {
  for (std::size_t shards : {1U, 2U, 3U, 4U, 7U, 16U, 200U}) {
    for (std::size_t num_ps : {1U, 2U, 3U, 5U}) {
      CAPTURE(shards);
      CAPTURE(num_ps);
      check_exact_cover(pulley::FixedShards{shards}, kOddShapes, num_ps);
    }
  }
}

TEST_CASE("FixedShards splits like TF: min(shards, rows) parts, the first rows % k one larger") {
  const std::vector<VariableSpec> v{{"v", {10, 2}, {}}, {"w", {2}, {}}};
  const auto p = pulley::FixedShards{4}.place(v, 3);
  REQUIRE(p.parts_of(0).size() == 4);
  CHECK(p.parts_of(0)[0].rows == pulley::RowRange{0, 3});
  CHECK(p.parts_of(0)[1].rows == pulley::RowRange{3, 6});
  CHECK(p.parts_of(0)[2].rows == pulley::RowRange{6, 8});
  CHECK(p.parts_of(0)[3].rows == pulley::RowRange{8, 10});
  REQUIRE(p.parts_of(1).size() == 2);  // only two rows
  // Parts are dealt round-robin in creation order: 0 1 2 0 | 1 2.
  CHECK(p.parts[0].ps == 0);
  CHECK(p.parts[3].ps == 0);
  CHECK(p.parts[4].ps == 1);
  CHECK(p.parts[5].ps == 2);
}

TEST_CASE("MinSize splits only what is large, as min_max_variable_partitioner does") {
  // 1000 rows of 64 floats = 256 B per row.
  const std::vector<VariableSpec> v{{"embedding", {1000, 64}, {}}, {"bias", {64}, {}}};
  // 16 KiB per part → 64 rows per part → ceil(1000/64) = 16 parts, capped at 4.
  const auto capped = pulley::MinSize{16 << 10, 4}.place(v, 2);
  CHECK(capped.parts_of(0).size() == 4);
  CHECK(capped.parts_of(1).size() == 1);  // 64 rows of 4 B: 4096 rows per part → whole
  // 64 KiB per part → 256 rows → ceil(1000/256) = 4 parts, cap 10 not reached.
  CHECK(pulley::MinSize{64 << 10, 10}.place(v, 2).parts_of(0).size() == 4);
  // The default (256 KiB) keeps a 256 KB variable whole.
  CHECK(pulley::MinSize{}.place(v, 2).parts_of(0).size() == 1);
  // A row bigger than the slice is one row per part.
  CHECK(pulley::MinSize{16, 1000}.place(v, 2).parts_of(0).size() == 1000);
  check_exact_cover(pulley::MinSize{100, 7}, kOddShapes, 3);
}

TEST_CASE("placement needs at least one ps task") {
  CHECK_THROWS_AS(pulley::RoundRobin{}.place(kOddShapes, 0), pulley::Error);
}
