// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/client/requests.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley::detail {

/// Each ps's share of a pull: its Pull message (no slices: nothing to send) and where the
/// reply's tensors go.
struct PullSplit {
  std::vector<Pull> pulls;
  std::vector<PullTargets> targets;
};

/// Splits `requests` (checked against the variables' shapes) over the parts `placement`
/// puts on each of `num_ps` ps tasks: each part's rows become a slice of its ps's Pull, and
/// the matching span of the caller's buffer its target.
inline PullSplit split_pulls(const Placement& placement, const std::vector<VariableSpec>& variables,
                             std::size_t num_ps, std::span<const PullRequest> requests, std::int64_t min_step,
                             std::uint64_t epoch) {
  PullSplit out{std::vector<Pull>(num_ps, Pull{min_step, {}, epoch}), std::vector<PullTargets>(num_ps)};
  for (const PullRequest& r : requests) {
    if (placement.first_part.empty()) {
      throw Error(ErrorCode::kFailedPrecondition, "no placement yet: call wait_ready() first");
    }
    if (r.variable >= variables.size()) {
      throw Error(ErrorCode::kNotFound, "unknown variable index " + std::to_string(r.variable));
    }
    const VariableSpec& spec = variables[r.variable];
    if (r.rows.empty() || r.rows.end > spec.rows() || r.into.size() != r.rows.size() * spec.row_size()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "pull of '" + spec.name + "' rows [" + std::to_string(r.rows.begin) + ", " +
                      std::to_string(r.rows.end) + ") into " + std::to_string(r.into.size()) +
                      " floats does not fit its shape");
    }
    for (const Part& part : placement.parts_of(r.variable)) {
      const std::size_t begin = std::max(part.rows.begin, r.rows.begin);
      const std::size_t end = std::min(part.rows.end, r.rows.end);
      if (begin >= end) continue;
      out.pulls[part.ps].slices.push_back({static_cast<std::uint32_t>(&part - placement.parts.data()), {begin, end}});
      out.targets[part.ps].push_back(
          r.into.subspan((begin - r.rows.begin) * spec.row_size(), (end - begin) * spec.row_size()));
    }
  }
  return out;
}

/// Checks a row request against `tables`: a known table, ids grouped by `num_ps` ps tasks
/// as `ps_begin` says, values of ids × dim.
inline void check_rows(const RowRequest& r, const std::vector<TableSpec>& tables, std::size_t num_ps) {
  if (r.table >= tables.size()) throw Error(ErrorCode::kNotFound, "unknown table index " + std::to_string(r.table));
  const TableSpec& spec = tables[r.table];
  if (r.ps_begin.size() != num_ps + 1 || r.ps_begin.front() != 0 || r.ps_begin.back() != r.ids.size() ||
      !std::is_sorted(r.ps_begin.begin(), r.ps_begin.end()) || r.values.size() != r.ids.size() * spec.dim) {
    throw Error(ErrorCode::kInvalidArgument,
                "rows of table '" + spec.name + "': " + std::to_string(r.ids.size()) + " ids, " +
                    std::to_string(r.values.size()) + " values of dim " + std::to_string(spec.dim) +
                    ", grouped by " + std::to_string(r.ps_begin.size()) + " offsets for " + std::to_string(num_ps) +
                    " ps tasks: they do not fit");
  }
}

/// Splits row pulls (checked) into PullRows messages, one per kMaxIdsPerMessage ids and
/// table piece at most (a larger share of a ps goes as several), and calls
/// `send(ps, message, targets)` for each: its replies are written into place.
template <class Send>
void split_row_pulls(const std::vector<TableSpec>& tables, std::size_t num_ps, std::span<const RowRequest> requests,
                     std::int64_t min_step, std::uint64_t epoch, Send&& send) {
  for (const RowRequest& r : requests) check_rows(r, tables, num_ps);
  for (std::size_t ps = 0; ps < num_ps; ++ps) {
    PullRows pull{min_step, epoch, {}};
    PullTargets targets;
    std::size_t ids = 0;
    auto flush = [&] {
      if (pull.tables.empty()) return;
      send(ps, std::move(pull), std::move(targets));
      pull = PullRows{min_step, epoch, {}};
      targets = {};
      ids = 0;
    };
    for (const RowRequest& r : requests) {
      const std::size_t dim = tables[r.table].dim;
      for (std::size_t begin = r.ps_begin[ps], end = r.ps_begin[ps + 1]; begin < end;) {
        if (ids == kMaxIdsPerMessage) flush();
        const std::size_t n = std::min({end - begin, kMaxIdsPerMessage - ids,
                                        std::max<std::size_t>(1, kMaxRowBytesPerMessage / (dim * sizeof(float)))});
        pull.tables.push_back({static_cast<std::uint32_t>(r.table),
                               std::vector<std::uint64_t>(r.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                                          r.ids.begin() + static_cast<std::ptrdiff_t>(begin + n)),
                               {}});
        targets.push_back(r.values.subspan(begin * dim, n * dim));
        ids += n;
        begin += n;
        // A table comes once per request: the next piece of this one goes in the next.
        if (begin < end) flush();
      }
    }
    flush();
  }
}

}  // namespace pulley::detail
