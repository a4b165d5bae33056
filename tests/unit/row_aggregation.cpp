// SPDX-License-Identifier: MIT
// The stock row aggregations of embedding tables: what the rows pushed for one update add up
// to (TensorFlow's SparseConditionalAccumulator, MEAN and SUM).
#include "pulley/tables/row_aggregation.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

using namespace pulley;

namespace {

const std::vector<std::uint64_t> kA{1, 2};
const std::vector<float> kGa{1.0F, 1.0F, 2.0F, 2.0F};
const std::vector<std::uint64_t> kB{2, 3};
const std::vector<float> kGb{4.0F, 0.0F, 5.0F, 5.0F};

template <class A>
std::vector<float> update_of(const A& policy, typename A::Accumulator& acc) {
  policy.add(acc, kA, kGa);
  policy.add(acc, kB, kGb);
  REQUIRE(policy.ids(acc).size() == 3);
  CHECK(policy.ids(acc)[0] == 1);  // in the order they first came
  CHECK(policy.ids(acc)[1] == 2);
  CHECK(policy.ids(acc)[2] == 3);
  const auto rows = policy.take(acc);
  return {rows.begin(), rows.end()};
}

}  // namespace

TEST_CASE("RowMean averages each row over the pushes that held it") {
  const RowMean mean;
  RowSums acc = mean.make_accumulator(2);
  CHECK(update_of(mean, acc) == std::vector<float>{1.0F, 1.0F, 3.0F, 1.0F, 5.0F, 5.0F});
  mean.clear(acc);
  CHECK(mean.ids(acc).empty());
  mean.add(acc, kB, kGb);  // a new update: the first push is kept as it came
  CHECK(mean.ids(acc).size() == 2);
  CHECK(mean.take(acc)[0] == 4.0F);
}

TEST_CASE("RowSum adds each row's gradients over the pushes") {
  const RowSum sum;
  RowSums acc = sum.make_accumulator(2);
  CHECK(update_of(sum, acc) == std::vector<float>{1.0F, 1.0F, 6.0F, 2.0F, 5.0F, 5.0F});
}
