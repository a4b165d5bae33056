// SPDX-License-Identifier: MIT
// What placing a model again moves when the ps tasks change, for the stock policies: bytes
// moved against the least that must move (a task added: its fair share, total / (P + 1); a
// task lost: what it held), and the balance after (most bytes on one task / the larger of
// the mean and the largest part), beside the balance of the same count placed from scratch.
// Exact counts, not timings: the same on every machine.
//   rebalance [--help]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "pulley/sharding/ids.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/rebalance.hpp"
#include "pulley/sharding/round_robin.hpp"

namespace {

using pulley::Placement;
using pulley::VariableSpec;

std::vector<std::uint32_t> upto(std::uint32_t n) {
  std::vector<std::uint32_t> members(n);
  std::iota(members.begin(), members.end(), 0U);
  return members;
}

std::vector<std::uint32_t> without(std::vector<std::uint32_t> members, std::uint32_t lost) {
  std::erase(members, lost);
  return members;
}

double balance(const Placement& p, const std::vector<VariableSpec>& variables, const std::vector<std::uint32_t>& members) {
  const auto per_ps = pulley::bytes_per_ps(p, variables);
  std::uint64_t most = 0;
  std::uint64_t largest = 0;
  std::uint64_t total = 0;
  for (const std::uint32_t m : members) most = std::max(most, m < per_ps.size() ? per_ps[m] : 0);
  for (const pulley::Part& part : p.parts) {
    largest = std::max(largest, pulley::part_bytes(part, variables));
    total += pulley::part_bytes(part, variables);
  }
  return static_cast<double>(most) /
         std::max(static_cast<double>(total) / static_cast<double>(members.size()), static_cast<double>(largest));
}

// "P -> Q (why)". (Text is built with snprintf here: GCC 12 at -O3 warns, wrongly, about
// std::string's operator+ in this file: -Wrestrict.)
std::string change(std::uint32_t from, std::uint32_t to, const char* why) {
  char text[64];
  std::snprintf(text, sizeof text, "%u -> %u (%s)", from, to, why);
  return text;
}

template <class S>
void dense(const char* policy, const S& sharding, const char* model, const std::vector<VariableSpec>& variables) {
  for (const std::uint32_t p : {2U, 3U, 4U}) {
    const Placement before = sharding.place(variables, p);
    const auto held = pulley::bytes_per_ps(before, variables);
    const std::uint64_t total = std::accumulate(held.begin(), held.end(), std::uint64_t{0});
    struct Case {
      std::string what;
      std::vector<std::uint32_t> members;
      std::uint64_t least;
    };
    const Case cases[] = {{change(p, p + 1, "one added"), upto(p + 1), total / (p + 1)},
                          {change(p, p - 1, "ps 1 lost"), without(upto(p), 1), held.size() > 1 ? held[1] : 0}};
    for (const Case& c : cases) {
      const Placement after = pulley::rebalance(sharding, variables, before, c.members);
      std::uint64_t moved = 0;
      for (const pulley::PartMove& m : pulley::moves_between(before, after, variables)) moved += m.bytes;
      // The same count placed from scratch (tasks 0 .. n − 1), for the balance parts allow.
      const std::vector<std::uint32_t> fresh_members = upto(static_cast<std::uint32_t>(c.members.size()));
      const Placement fresh = sharding.place(variables, c.members.size());
      std::printf("| %s | %s | %s | %zu | %llu | %llu | %.2f | %.2f | %.2f |\n", policy, model, c.what.c_str(),
                  before.parts.size(), static_cast<unsigned long long>(moved), static_cast<unsigned long long>(c.least),
                  c.least ? static_cast<double>(moved) / static_cast<double>(c.least) : 0.0,
                  balance(after, variables, c.members), balance(fresh, variables, fresh_members));
    }
  }
}

template <class I>
void rows(const char* policy, const I& ids) {
  constexpr std::uint64_t kRows = 1000000;
  for (const std::uint32_t p : {2U, 3U, 4U}) {
    const auto from = upto(p);
    const std::vector<std::uint32_t> added = upto(p + 1);
    const std::vector<std::uint32_t> lost = without(upto(p), 1);
    std::uint64_t moved_added = 0, moved_lost = 0, on_lost = 0;
    std::vector<std::uint64_t> held_added(p + 1, 0), held_lost(p, 0);
    for (std::uint64_t k = 0; k < kRows; ++k) {
      const std::uint64_t id = pulley::mix_id(k);  // ids over the whole 64-bit range (RangeIds' case)
      const std::uint32_t was = ids.ps_of("emb", id, std::span<const std::uint32_t>(from));
      const std::uint32_t a = ids.ps_of("emb", id, std::span<const std::uint32_t>(added));
      const std::uint32_t l = ids.ps_of("emb", id, std::span<const std::uint32_t>(lost));
      moved_added += a != was;
      moved_lost += l != was;
      on_lost += was == 1;
      ++held_added[a];
      ++held_lost[l];
    }
    const auto most = [](const std::vector<std::uint64_t>& held, std::size_t n) {
      return static_cast<double>(*std::max_element(held.begin(), held.end())) / (static_cast<double>(kRows) / static_cast<double>(n));
    };
    std::printf("| %s | 1 M rows | %u -> %u (one added) | - | %llu | %llu | %.2f | %.2f | - |\n", policy, p, p + 1,
                static_cast<unsigned long long>(moved_added), static_cast<unsigned long long>(kRows / (p + 1)),
                static_cast<double>(moved_added) / static_cast<double>(kRows / (p + 1)), most(held_added, p + 1));
    std::printf("| %s | 1 M rows | %u -> %u (ps 1 lost) | - | %llu | %llu | %.2f | %.2f | - |\n", policy, p, p - 1,
                static_cast<unsigned long long>(moved_lost), static_cast<unsigned long long>(on_lost),
                static_cast<double>(moved_lost) / static_cast<double>(on_lost), most(held_lost, p - 1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    std::printf("usage: %s\n  prints, for the stock sharding policies, the bytes (rows for tables) that placing\n"
                "  a model again moves when a ps task is added or lost, against the least that must\n"
                "  move, and the balance after (1.00: as even as the parts allow)\n",
                argv[0]);
    return std::strcmp(argv[1], "--help") == 0 ? 0 : 2;
  }
  // The Fashion-MNIST example's MLP (784-128-10) and a model of many mid-sized variables.
  const std::vector<VariableSpec> mlp{{"w0", {784, 128}, {}}, {"b0", {128}, {}}, {"w1", {128, 10}, {}}, {"b1", {10}, {}}};
  std::vector<VariableSpec> wide;
  for (unsigned i = 0; i < 24; ++i) {
    char name[16];
    std::snprintf(name, sizeof name, "v%u", i);
    wide.push_back({name, {200 + 37 * std::size_t{i}, 64}, {}});
  }
  std::printf("| policy | model | ps tasks | parts | moved (bytes or rows) | least that must move | moved / least | "
              "most on one / mean or largest part | the same, placed afresh |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  dense("RoundRobin", pulley::RoundRobin{}, "24 variables", wide);
  dense("FixedShards{8}", pulley::FixedShards{8}, "MLP 784-128-10", mlp);
  dense("FixedShards{8}", pulley::FixedShards{8}, "24 variables", wide);
  dense("MinSize{16 KiB, 16}", pulley::MinSize{16 << 10, 16}, "MLP 784-128-10", mlp);
  dense("MinSize{16 KiB, 16}", pulley::MinSize{16 << 10, 16}, "24 variables", wide);
  rows("HashIds", pulley::HashIds{});
  rows("RangeIds", pulley::RangeIds{});
  return 0;
}
