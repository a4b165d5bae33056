// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <vector>

#include "pulley/core/variable.hpp"

namespace pulley {

/// One contiguous slice of a variable (rows `rows` of variable `variable`) held by ps task
/// `ps`. A whole variable is a single part; a partitioned one has several, ordered by row.
struct Part {
  std::uint32_t variable = 0;  ///< index into the model's variable list
  std::uint32_t index = 0;     ///< position among the variable's parts
  std::uint32_t ps = 0;        ///< ps task that holds it
  RowRange rows;

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(variable, index, ps, rows);
  }

  friend constexpr bool operator==(const Part&, const Part&) = default;
};

/// Where every part of every variable lives: the output of a Sharding policy. Parts are
/// grouped by variable in variable order, and by row inside a variable, so the parts of
/// variable `v` are `parts_of(v)` and cover its rows exactly once.
struct Placement {
  std::vector<Part> parts;
  std::vector<std::size_t> first_part;  ///< first_part[v] .. first_part[v+1] are v's parts

  /// The parts of variable `v`, ordered by row.
  [[nodiscard]] std::span<const Part> parts_of(std::size_t v) const {
    return std::span(parts).subspan(first_part[v], first_part[v + 1] - first_part[v]);
  }
  /// Number of variables placed.
  [[nodiscard]] std::size_t num_variables() const noexcept {
    return first_part.empty() ? 0 : first_part.size() - 1;
  }

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(parts, first_part);
  }

  friend bool operator==(const Placement&, const Placement&) = default;
};

/// Builds a Placement by appending parts variable by variable.
class PlacementBuilder {
 public:
  /// Starts the next variable; its parts follow with `add`.
  void begin_variable() { placement_.first_part.push_back(placement_.parts.size()); }
  /// Appends the next part of the current variable: rows `rows` on ps task `ps`.
  void add(std::uint32_t ps, RowRange rows) {
    const auto variable = static_cast<std::uint32_t>(placement_.first_part.size() - 1);
    const auto index =
        static_cast<std::uint32_t>(placement_.parts.size() - placement_.first_part.back());
    placement_.parts.push_back({variable, index, ps, rows});
  }
  /// The finished placement.
  [[nodiscard]] Placement finish() && {
    placement_.first_part.push_back(placement_.parts.size());
    return std::move(placement_);
  }

 private:
  Placement placement_;
};

/// Which ps task holds the copy of ps `shard`'s shard in a job whose ps tasks keep copies
/// of each other's shards (`--ps-replicas 1`, ps/shard_copies.hpp), the job's ps tasks
/// being `members` (ascending): the next member after `shard`, the first one after the
/// last. `shard` itself when it is no member, or the only one: its shard has no copy then.
/// With every ps task of the cluster a member, ps k's copy is on ps (k + 1) mod P; when
/// a member leaves, only the copy it held moves (to the member after it).
[[nodiscard]] inline std::uint32_t copy_holder(std::span<const std::uint32_t> members,
                                               std::uint32_t shard) {
  const auto at = std::lower_bound(members.begin(), members.end(), shard);
  if (at == members.end() || *at != shard || members.size() < 2) return shard;
  return std::next(at) == members.end() ? members.front() : *std::next(at);
}

}  // namespace pulley
