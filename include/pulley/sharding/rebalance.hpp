// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/concepts/sharding.hpp"
#include "pulley/core/node.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

// When the ps tasks of a job change (one lost for good, one added), the parts of the dense
// variables are placed again: the parts stay as they are (their rows, hence their optimizer
// slots, move whole), and as few of them as keeps the ps tasks balanced change ps task.
// Ps tasks are named by their task index for the job's life: after ps 1 of {0, 1, 2} is
// lost, the members are {0, 2}.

/// One part of a dense variable that changes ps task between two placements.
struct PartMove {
  std::uint32_t variable = 0;  ///< index into the model's variable list
  std::uint32_t index = 0;     ///< position among the variable's parts
  std::uint32_t from = 0;      ///< the ps task that held it
  std::uint32_t to = 0;        ///< the ps task that holds it now
  std::uint64_t bytes = 0;     ///< its values (its optimizer slots move with it)
};

/// The bytes of values a part holds.
[[nodiscard]] inline std::uint64_t part_bytes(const Part& part, std::span<const VariableSpec> variables) {
  return std::uint64_t{part.rows.size()} * variables[part.variable].row_size() * sizeof(float);
}

/// The bytes of values each ps task holds under `placement`, by task index (the vector is
/// as long as the highest ps task named, plus one).
[[nodiscard]] inline std::vector<std::uint64_t> bytes_per_ps(const Placement& placement,
                                                             std::span<const VariableSpec> variables) {
  std::vector<std::uint64_t> bytes;
  for (const Part& part : placement.parts) {
    if (part.ps >= bytes.size()) bytes.resize(part.ps + 1, 0);
    bytes[part.ps] += part_bytes(part, variables);
  }
  return bytes;
}

/// The parts that changed ps task from `before` to `after`, two placements of the same parts
/// (rebalance keeps them); throws kInvalidArgument when the parts differ.
[[nodiscard]] inline std::vector<PartMove> moves_between(const Placement& before, const Placement& after,
                                                         std::span<const VariableSpec> variables) {
  if (before.parts.size() != after.parts.size() || before.first_part != after.first_part) {
    throw Error(ErrorCode::kInvalidArgument, "the two placements do not hold the same parts");
  }
  std::vector<PartMove> moves;
  for (std::size_t i = 0; i < before.parts.size(); ++i) {
    const Part& a = before.parts[i];
    const Part& b = after.parts[i];
    if (a.variable != b.variable || a.index != b.index || a.rows != b.rows) {
      throw Error(ErrorCode::kInvalidArgument, "the two placements do not hold the same parts");
    }
    if (a.ps != b.ps) moves.push_back({a.variable, a.index, a.ps, b.ps, part_bytes(a, variables)});
  }
  return moves;
}

/// `before`'s parts placed over the ps tasks `members` (ascending task indices) moving as
/// few bytes as it can: the parts of a ps task no longer a member go, largest first, to the
/// member holding least; then, while the ps task holding most holds more than
/// (1 + `tolerance`) × the least any placement of these parts can give (the mean, or the
/// largest part), it hands the one holding least the part that brings both closest to the
/// mean. A new
/// member starts empty and takes its share from the others this way. Deterministic (every
/// process computes the same). Throws kInvalidArgument for bad members or a `before` that
/// does not place `variables`.
[[nodiscard]] inline Placement rebalance_parts(std::span<const VariableSpec> variables, const Placement& before,
                                               std::span<const std::uint32_t> members, double tolerance = 0.05) {
  require_task_set(members, "ps task");
  if (before.num_variables() != variables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "the placement holds " + std::to_string(before.num_variables()) +
                                                 " variables, the model " + std::to_string(variables.size()));
  }
  Placement after = before;
  const auto slot_of = [&](std::uint32_t ps) -> std::size_t {
    const auto it = std::lower_bound(members.begin(), members.end(), ps);
    return it != members.end() && *it == ps ? static_cast<std::size_t>(it - members.begin()) : members.size();
  };
  std::vector<std::uint64_t> load(members.size(), 0);
  std::vector<std::size_t> orphans;  // parts of ps tasks no longer members
  std::uint64_t total = 0;
  std::uint64_t largest = 0;
  for (std::size_t i = 0; i < after.parts.size(); ++i) {
    const std::uint64_t bytes = part_bytes(after.parts[i], variables);
    total += bytes;
    largest = std::max(largest, bytes);
    const std::size_t slot = slot_of(after.parts[i].ps);
    if (slot == members.size()) {
      orphans.push_back(i);
    } else {
      load[slot] += bytes;
    }
  }
  const auto least = [&] { return static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin()); };
  const auto most = [&] { return static_cast<std::size_t>(std::max_element(load.begin(), load.end()) - load.begin()); };
  std::stable_sort(orphans.begin(), orphans.end(), [&](std::size_t a, std::size_t b) {
    return part_bytes(after.parts[a], variables) > part_bytes(after.parts[b], variables);
  });
  for (const std::size_t i : orphans) {
    const std::size_t to = least();
    after.parts[i].ps = members[to];
    load[to] += part_bytes(after.parts[i], variables);
  }
  const std::uint64_t mean = (total + members.size() - 1) / members.size();
  const auto bound = static_cast<double>(std::max(mean, largest)) * (1.0 + tolerance);
  // Each move lowers the sum of squared loads, so the loop ends; the cap is a second guard.
  for (std::size_t round = 0; round < 4 * after.parts.size() + 4; ++round) {
    const std::size_t h = most();
    const std::size_t l = least();
    if (static_cast<double>(load[h]) <= bound) break;
    // A part b with 0 < b < gap lowers the larger of the two; the best brings them towards
    // the mean without overshooting it (bytes moved between two ps tasks that both hold
    // their share would be bytes moved for nothing).
    const std::uint64_t gap = load[h] - load[l];
    const std::uint64_t desired = std::min(load[h] - std::min(load[h], mean), mean - std::min(mean, load[l]));
    std::size_t best = after.parts.size();
    std::uint64_t best_miss = 0;
    for (std::size_t i = 0; i < after.parts.size(); ++i) {
      if (after.parts[i].ps != members[h]) continue;
      const std::uint64_t b = part_bytes(after.parts[i], variables);
      if (b == 0 || b >= gap) continue;
      const std::uint64_t miss = b > desired ? b - desired : desired - b;
      if (best == after.parts.size() || miss < best_miss) {
        best = i;
        best_miss = miss;
      }
    }
    if (best == after.parts.size()) break;  // no part of it helps: as balanced as parts allow
    const std::uint64_t bytes = part_bytes(after.parts[best], variables);
    after.parts[best].ps = members[l];
    load[h] -= bytes;
    load[l] += bytes;
  }
  return after;
}

/// `before` placed again over `members` by `sharding`: its own `rebalance(variables,
/// before, members)` when it has one (see the Sharding concept), else `rebalance_parts`.
template <Sharding S>
[[nodiscard]] Placement rebalance(const S& sharding, std::span<const VariableSpec> variables, const Placement& before,
                                  std::span<const std::uint32_t> members) {
  if constexpr (requires { { sharding.rebalance(variables, before, members) } -> std::same_as<Placement>; }) {
    require_task_set(members, "ps task");
    return sharding.rebalance(variables, before, members);
  } else {
    return rebalance_parts(variables, before, members);
  }
}

}  // namespace pulley
