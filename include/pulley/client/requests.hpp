// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "pulley/core/placement.hpp"

namespace pulley {

/// One destination of a pull: rows `rows` of variable `variable`, written to `into`.
struct PullRequest {
  std::size_t variable = 0;
  RowRange rows;
  std::span<float> into;
};

/// Rows of one embedding table to pull into `values`, or whose gradients in `values` to
/// push. The ids are grouped by the ps that holds them: `ps_begin[p]` to `ps_begin[p + 1]`
/// are ps p's (num_ps + 1 offsets), so each ps's share of `values` is one contiguous span
/// that a reply is written into, or a push sent from, with no copy.
struct RowRequest {
  std::size_t table = 0;
  std::span<const std::uint64_t> ids;
  std::span<const std::size_t> ps_begin;
  std::span<float> values;  ///< ids.size() × dim
};

}  // namespace pulley
