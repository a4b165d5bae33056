// expect: policy\.take\(acc\)
// SPDX-License-Identifier: MIT
// A row aggregation (how an update's pushed rows of a table add up) without `take` is
// rejected where the table policy names it, and the diagnostic names the member.
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/optimizers/adagrad.hpp"
#include "pulley/tables/tables.hpp"

struct ForgotTake {
  struct Accumulator {
    std::vector<std::uint64_t> ids;
  };
  Accumulator make_accumulator(std::size_t) const { return {}; }
  void add(Accumulator&, std::span<const std::uint64_t>, std::span<const float>) const {}
  std::span<const std::uint64_t> ids(const Accumulator& acc) const { return acc.ids; }
  void clear(Accumulator&) const noexcept {}
};

int main() {
  pulley::Tables<pulley::Adagrad, pulley::HashIds, ForgotTake> tables;
  (void)tables;
}
