// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/client/client.hpp"
#include "pulley/client/detail/stall.hpp"
#include "pulley/sharding/ids.hpp"

namespace pulley {

/// The values of every variable, read from every ps task at one global step.
struct Snapshot {
  /// The global step every ps had completed when it was read (the lowest of them when
  /// `consistent` is false).
  std::int64_t step = 0;
  /// Every ps was read at the same global step. Under SyncReplicas that makes the values
  /// one step's: `step` updates applied on every ps, nothing after them. Under Async and
  /// BoundedStaleness a ps's global step counts what that ps has seen, so even equal steps
  /// may hold different pushes, and while training runs they seldom agree.
  bool consistent = false;
  std::vector<std::vector<float>> values;  ///< one vector per variable, in variable order
};

namespace detail {

/// Reads every variable into `values` once every ps has completed `min_step` steps, and
/// returns the lowest and highest global step the ps tasks were read at. `patient`: as long
/// as training makes progress (or until `deadline`, `meanwhile` running as
/// wait_progressing says); otherwise only briefly, and nullopt (the values half read) if
/// the ps tasks do not answer at once.
template <Transport T>
std::optional<std::pair<std::int64_t, std::int64_t>> read_into(
    Client<T>& client, std::vector<std::vector<float>>& values, std::int64_t min_step, bool patient,
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
    const std::function<bool()>& meanwhile = {}) {
  const auto& variables = client.variables();
  std::vector<PullRequest> requests;
  values.resize(variables.size());
  for (std::size_t v = 0; v < variables.size(); ++v) {
    values[v].resize(variables[v].size());
    requests.push_back({v, {0, variables[v].rows()}, values[v]});
  }
  const ClientOptions& options = client.options();
  CallGroup group;
  client.send_pulls(group, requests, min_step);
  if (patient) {
    if (min_step <= 0) {
      group.wait(options.request_timeout, "read the variables");
    } else if (!wait_progressing(client.transport(), client.members(), options, group,
                                 "read the variables at step " + std::to_string(min_step), deadline, meanwhile)) {
      return std::nullopt;
    }
  } else if (!group.wait_for(std::min(options.request_timeout, std::chrono::milliseconds(2000)))) {
    return std::nullopt;  // the group cancels the reads as it goes
  }
  std::int64_t lowest = std::numeric_limits<std::int64_t>::max();
  std::int64_t highest = std::numeric_limits<std::int64_t>::min();
  for (std::size_t i = 0; i < group.size(); ++i) {
    const std::int64_t step = group.take_as<PullReply>(i).global_step;
    lowest = std::min(lowest, step);
    highest = std::max(highest, step);
  }
  if (group.size() == 0) lowest = highest = 0;
  return std::pair{lowest, highest};
}

}  // namespace detail

/// Current values of every variable, pulled from every ps at once once it has completed
/// `min_step` steps (while training runs, the ps tasks may be at different steps: use
/// `snapshot` for one step's values).
template <Transport T>
std::vector<std::vector<float>> read_variables(Client<T>& client, std::int64_t min_step = 0) {
  std::vector<std::vector<float>> values;
  detail::read_into(client, values, min_step, true);
  return values;
}

/// Every variable at one global step of at least `step`, the same on every ps when the ps
/// tasks can agree (see Snapshot): each ps is read once it reaches the target step, and
/// answers at that step's end (pulls waiting for a step are answered the moment it
/// completes). A ps read past the target sets the next round's target; a few rounds settle
/// it while sync training runs. A later round that does not complete at once (the ps tasks
/// count pushes that will never agree) leaves the last read as it is. nullopt if `deadline`
/// passes before the ps tasks reach `step`, or `meanwhile` voided the wait
/// (detail::wait_progressing).
template <Transport T>
std::optional<Snapshot> snapshot_until(Client<T>& client, std::int64_t step,
                                       std::chrono::steady_clock::time_point deadline,
                                       const std::function<bool()>& meanwhile = {}) {
  constexpr int kRounds = 8;
  Snapshot shot;
  const auto first = detail::read_into(client, shot.values, step, true, deadline, meanwhile);  // (lowest, highest)
  if (!first) return std::nullopt;
  auto steps = *first;
  for (int round = 1; round < kRounds && steps.first != steps.second; ++round) {
    std::vector<std::vector<float>> again;
    const auto read = detail::read_into(client, again, steps.second, false);
    if (!read) break;
    steps = *read;
    shot.values = std::move(again);
  }
  shot.step = steps.first;
  shot.consistent = steps.first == steps.second;
  return shot;
}

/// Like snapshot_until, with no deadline: waits as long as training progresses.
template <Transport T>
Snapshot snapshot(Client<T>& client, std::int64_t step) {
  return *snapshot_until(client, step, std::chrono::steady_clock::time_point::max());
}

/// The current rows `ids` of embedding table `table` (ids.size() × dim floats, in order),
/// read from the ps tasks that hold them under id sharding `sharding` (the ps tasks'); a
/// row not held reads as its initial value, and the read creates, admits and touches
/// nothing (only a worker's pull does). The rows are each ps's as it holds them when read
/// (not one global step's while training runs). Ids, any number and any of them more than
/// once, go in messages of kMaxIdsPerMessage at most, each id once.
template <Transport T, IdSharding I = HashIds>
std::vector<float> read_rows(Client<T>& client, std::string_view table,
                             std::span<const std::uint64_t> ids, I sharding = {}) {
  const auto& tables = client.tables();
  const auto it = std::find_if(tables.begin(), tables.end(),
                               [&](const TableSpec& t) { return t.name == table; });
  if (it == tables.end()) throw Error(ErrorCode::kNotFound, "unknown table '" + std::string(table) + "'");
  client.check_id_sharding(sharding);
  const auto num_ps = static_cast<std::uint32_t>(client.num_ps());
  // Each id once, grouped by ps for the pull (a ps refuses an id twice in a request), then
  // every one of the caller's ids gets its row back, in the caller's order.
  struct Wanted {
    std::uint32_t ps;
    std::uint64_t id;
    std::size_t at;  ///< in the caller's ids
    auto operator<=>(const Wanted&) const = default;
  };
  std::vector<Wanted> order;
  order.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::uint32_t ps = row_owner(sharding, table, ids[i], client.members());
    if (ps >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "the id sharding put row " + std::to_string(ids[i]) +
                                                   " on ps " + std::to_string(ps) + " of " + std::to_string(num_ps));
    }
    order.push_back({ps, ids[i], i});
  }
  std::sort(order.begin(), order.end());
  std::vector<std::uint64_t> grouped;
  std::vector<std::size_t> row_of(ids.size());  // caller's index → index in grouped
  std::vector<std::size_t> ps_begin(num_ps + 1, 0);
  for (const Wanted& w : order) {
    if (grouped.empty() || grouped.back() != w.id) {  // an id always has the same ps
      grouped.push_back(w.id);
      ++ps_begin[w.ps + 1];
    }
    row_of[w.at] = grouped.size() - 1;
  }
  for (std::uint32_t p = 0; p < num_ps; ++p) ps_begin[p + 1] += ps_begin[p];
  std::vector<float> rows(grouped.size() * it->dim);
  const RowRequest request{static_cast<std::size_t>(it - tables.begin()), grouped, ps_begin, rows};
  (void)client.pull_rows(std::span(&request, 1), 0);
  std::vector<float> out(ids.size() * it->dim);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(row_of[i] * it->dim), it->dim,
                out.begin() + static_cast<std::ptrdiff_t>(i * it->dim));
  }
  return out;
}


}  // namespace pulley
