// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/client/client.hpp"
#include "pulley/client/detail/stall.hpp"
#include "pulley/core/detail/pages.hpp"
#include "pulley/core/log.hpp"
#include "pulley/sharding/ids.hpp"

namespace pulley {

namespace detail {

/// Reads table `t`'s rows and admission counts at the cut from every ps (paused, its cut
/// read), chunk by chunk: each ps holds at most one chunk more than its rows meanwhile. An
/// `incremental` cut's rows are those changed since its base, and its evicted ids follow;
/// nullopt when a ps could not make its part incremental (its eviction log no longer
/// reaches back to the base: RowsChunk::since).
template <Transport T>
std::optional<TableState> read_table(Client<T>& client, std::uint32_t t, bool incremental) {
  const std::size_t num_ps = client.num_ps();
  const auto timeout = client.options().request_timeout;
  TableState table;
  table.spec = client.tables()[t];
  // What each ps holds: its rows at the cut, its update count, the optimizer's slots.
  // Rows by task index: the members' (the others hold nothing).
  std::vector<std::uint64_t> total(num_ps, 0);
  const std::span<const std::uint32_t> members = client.members();
  {
    CallGroup group;
    for (const std::uint32_t ps : members) {
      group.add(client.transport().call(ps, ReadRows{t, 0, 0, false, false}, PullTargets{std::span<float>()}));
    }
    group.wait(timeout, "read the rows of table '" + table.spec.name + "'");
    for (std::size_t k = 0; k < members.size(); ++k) {
      const std::uint32_t ps = members[k];
      RowsChunk head = group.take_as<RowsChunk>(k);
      if (incremental && head.since < 0) return std::nullopt;
      if (k == 0) table.slot_names = std::move(head.slot_names);
      total[ps] = head.total;
      table.updates.push_back(head.updates);
    }
  }
  if (!first_tasks(members) && !table.updates.empty()) {
    // The counts are read in member order, which is task order while the members are the
    // cluster's first ps tasks (TableState::updates); with one gone, all are the largest.
    table.updates.assign(table.updates.size(), *std::max_element(table.updates.begin(), table.updates.end()));
  }
  const std::size_t stride = table.stride();
  std::uint64_t rows = 0;
  for (const std::uint64_t n : total) rows += n;
  table.ids.reserve(rows);
  table.touched.reserve(rows);
  detail::resize_on_huge_pages(table.rows, rows * stride);
  // Chunks of every ps at once, round after round, each read straight into its place.
  std::vector<std::uint64_t> begin(num_ps, 0);
  std::size_t filled = 0;
  for (;;) {
    CallGroup group;
    std::vector<std::size_t> asked;
    std::vector<std::size_t> at;
    for (std::size_t ps = 0; ps < num_ps; ++ps) {
      if (begin[ps] >= total[ps]) continue;
      const std::size_t n = std::min<std::size_t>(total[ps] - begin[ps], rows_per_chunk(stride));
      PullTargets target{std::span(table.rows).subspan(filled * stride, n * stride)};
      group.add(client.transport().call(ps, ReadRows{t, begin[ps], static_cast<std::uint32_t>(n), false, false},
                                        std::move(target)));
      asked.push_back(ps);
      at.push_back(n);
      filled += n;
    }
    if (asked.empty()) break;
    group.wait(timeout, "read the rows of table '" + table.spec.name + "'");
    for (std::size_t k = 0; k < asked.size(); ++k) {
      RowsChunk chunk = group.take_as<RowsChunk>(k);
      if (chunk.ids.size() != at[k] || chunk.steps.size() != at[k]) {
        throw Error(ErrorCode::kInternal, "ps " + std::to_string(asked[k]) + " answered a chunk of table '" +
                                              table.spec.name + "' of the wrong size");
      }
      table.ids.insert(table.ids.end(), chunk.ids.begin(), chunk.ids.end());
      table.touched.insert(table.touched.end(), chunk.steps.begin(), chunk.steps.end());
      begin[asked[k]] += at[k];
    }
  }
  // The ids admission was counting, and those an incremental cut says were evicted, a ps
  // after the other (their chunks' rows are empty).
  auto read_ids = [&](bool evicted, auto&& take, const std::string& what) {
    for (const std::uint32_t ps : members) {
      for (std::uint64_t from = 0;;) {
        CallGroup group;
        ReadRows r{t, from, static_cast<std::uint32_t>(kMaxCandidatesPerMessage), !evicted, evicted};
        group.add(client.transport().call(ps, r, PullTargets{std::span<float>()}));
        group.wait(timeout, what);
        RowsChunk chunk = group.take_as<RowsChunk>(0);
        take(chunk);
        from += chunk.ids.size();
        if (chunk.ids.empty() || from >= chunk.total) break;
      }
    }
  };
  read_ids(false, [&](const RowsChunk& chunk) {
    table.candidate_ids.insert(table.candidate_ids.end(), chunk.ids.begin(), chunk.ids.end());
    table.candidate_counts.insert(table.candidate_counts.end(), chunk.counts.begin(), chunk.counts.end());
    table.candidate_steps.insert(table.candidate_steps.end(), chunk.steps.begin(), chunk.steps.end());
  }, "read the admission counts of table '" + table.spec.name + "'");
  if (incremental) {
    read_ids(true, [&](const RowsChunk& chunk) {
      table.evicted.insert(table.evicted.end(), chunk.ids.begin(), chunk.ids.end());
    }, "read the evicted ids of table '" + table.spec.name + "'");
  }
  return table;
}

/// Sends table `t` of `table` to the ps tasks in chunks, at epoch `epoch`: each row (and
/// admission count) to the ps `sharding` gives it when that is where the ps tasks' own
/// IdSharding puts it (`routed`), else every chunk to every ps, each keeping its own. The
/// table's update count goes to every ps: as saved when the ps tasks are those that wrote
/// it, else the largest.
template <Transport T, IdSharding I>
void restore_table(Client<T>& client, std::uint32_t t, const TableState& table, std::uint64_t epoch,
                   const I& sharding, bool routed) {
  const std::size_t num_ps = client.num_ps();
  const auto timeout = client.options().request_timeout;
  const std::string what = "restore the rows of table '" + table.spec.name + "'";
  const std::int64_t largest =
      table.updates.empty() ? 0 : *std::max_element(table.updates.begin(), table.updates.end());
  const std::size_t stride = table.stride();
  const std::size_t rows = table.ids.size();
  // The counts were saved by task index (TableState::updates; all the largest when a ps
  // had left): they stay each ps's while the ps tasks are the cluster's first ones, as
  // many as wrote them.
  const bool same_tasks = table.updates.size() == num_ps && first_tasks(client.members()) &&
                          client.members().size() == num_ps;
  std::vector<std::vector<std::size_t>> mine(num_ps);  // a chunk's rows, by ps (routed)
  std::vector<std::vector<float>> values(num_ps);
  // Rows, then candidates; the first message to each ps carries its update count.
  bool first = true;
  auto send = [&](std::size_t from, std::size_t n, bool candidates) {
    if (routed) {
      for (auto& m : mine) m.clear();
      const auto& ids = candidates ? table.candidate_ids : table.ids;
      for (std::size_t i = from; i < from + n; ++i) {
        const std::uint32_t ps = row_owner(sharding, table.spec.name, ids[i], client.members());
        if (ps >= num_ps) throw Error(ErrorCode::kInternal, "the id sharding put a row outside the cluster");
        mine[ps].push_back(i);
      }
    }
    client.template broadcast<Ack>(
        [&](std::size_t ps) {
          RestoreRows m;
          m.epoch = epoch;
          m.table = t;
          if (first) m.updates = same_tasks ? table.updates[ps] : largest;
          m.slot_names = table.slot_names;
          m.candidates = candidates;
          if (routed) {
            values[ps].clear();
            detail::reserve_on_huge_pages(values[ps], candidates ? 0 : mine[ps].size() * stride);
            m.ids.reserve(mine[ps].size());
            m.steps.reserve(mine[ps].size());
            if (candidates) m.counts.reserve(mine[ps].size());
            for (const std::size_t i : mine[ps]) {
              if (candidates) {
                m.ids.push_back(table.candidate_ids[i]);
                m.counts.push_back(table.candidate_counts[i]);
                m.steps.push_back(table.candidate_steps[i]);
              } else {
                m.ids.push_back(table.ids[i]);
                values[ps].insert(values[ps].end(), table.rows.begin() + static_cast<std::ptrdiff_t>(i * stride),
                                  table.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * stride));
                m.steps.push_back(table.touched[i]);
              }
            }
            m.rows = values[ps];
          } else if (candidates) {
            m.ids.assign(table.candidate_ids.begin() + from, table.candidate_ids.begin() + from + n);
            m.counts.assign(table.candidate_counts.begin() + from, table.candidate_counts.begin() + from + n);
            m.steps.assign(table.candidate_steps.begin() + from, table.candidate_steps.begin() + from + n);
          } else {
            m.ids.assign(table.ids.begin() + from, table.ids.begin() + from + n);
            m.rows = std::span(table.rows).subspan(from * stride, n * stride);
            m.steps.assign(table.touched.begin() + from, table.touched.begin() + from + n);
          }
          return m;
        },
        timeout, what);
    first = false;
  };
  const std::size_t chunk = rows_per_chunk(stride);
  for (std::size_t from = 0; from < rows; from += chunk) send(from, std::min(chunk, rows - from), false);
  const std::size_t candidates = table.candidate_ids.size();
  for (std::size_t from = 0; from < candidates; from += kMaxCandidatesPerMessage) {
    send(from, std::min(kMaxCandidatesPerMessage, candidates - from), true);
  }
  if (first) send(0, 0, false);  // an empty table: its update count still goes
}

/// Why `table` cannot be restored (its name or dim differs from `spec`, the model's, or
/// its rows do not fit its shape), or "".
inline std::string check_table(const TableState& table, const TableSpec& spec) {
  if (table.spec.name != spec.name || table.spec.dim != spec.dim) {
    return "the checkpoint's table '" + table.spec.name + "' (dim " + std::to_string(table.spec.dim) +
           ") is not the model's '" + spec.name + "' (dim " + std::to_string(spec.dim) + ")";
  }
  const std::size_t n = table.ids.size();
  if (table.rows.size() != n * table.stride() || table.touched.size() != n ||
      table.candidate_counts.size() != table.candidate_ids.size() ||
      table.candidate_steps.size() != table.candidate_ids.size()) {
    return "the checkpoint's table '" + spec.name + "' has rows that do not fit its shape";
  }
  return {};
}

/// The cut that every ps is read at (ReadState), from what each answered to Pause: for
/// each worker, the largest count of its pushes taken over all ps tasks, and the last push
/// taken by the ps with that count. Each ps holds itself to it by its own ledger (a ps
/// short of the count by a push lost with an earlier process is not waited for:
/// CheckpointCut::own_until).
inline ReadState cut_of(std::span<const PauseReply> paused) {
  std::size_t workers = 0;
  for (const PauseReply& p : paused) workers = std::max(workers, p.pushes.size());
  ReadState cut;
  cut.until.assign(workers, 0);
  cut.last_sequences.assign(workers, 0);
  cut.last_series.assign(workers, 0);
  for (std::size_t w = 0; w < workers; ++w) {
    const PauseReply* furthest = &paused.front();
    for (const PauseReply& p : paused) {
      if (of_worker(p.pushes, w) > of_worker(furthest->pushes, w)) furthest = &p;
    }
    cut.until[w] = of_worker(furthest->pushes, w);
    cut.last_sequences[w] = of_worker(furthest->last_sequences, w);
    cut.last_series[w] = of_worker(furthest->last_series, w);
  }
  return cut;
}

}  // namespace detail

/// Which of the tables' rows a checkpoint's cut reads.
struct CutRows {
  /// An incremental checkpoint's base: the global step of the checkpoint it is relative
  /// to. Only the rows touched since are read, with the ids evicted since. -1: every row (a
  /// full checkpoint).
  std::int64_t since = -1;
  /// The ps tasks forget the evictions before this global step (the newest checkpoint on
  /// disk: no later incremental one will be relative to an older one). -1: none.
  std::int64_t forget_evictions_before = -1;
};

/// The chief's half of a checkpoint's cut (the ps's half is `ps/checkpoint_cut.hpp`): every
/// variable with its optimizer state, and the sync policy's state, read as one cut across
/// all ps tasks. Every ps is paused (at once, or the moment it completes `at_step`; pushes
/// that arrive then wait), each is brought to the same count of pushes taken from every
/// worker (the largest any had, with that ps's last push, cut_of; each ps less a push lost
/// with its worker's process, CheckpointCut::own_until),
/// read there, and resumed. Training stands still only while
/// the dense state is read: the tables' rows are read after the ps tasks resume, each ps
/// answering with the rows as they were at the cut (copy-on-write). With `rows.since` ≥ 0 the
/// tables' part is incremental (ModelState:: base_step); when a ps no longer knows every eviction
/// since then (its log overflowed, or it was restored later), the cut reads every row instead, with
/// a log line.
///
/// With `hold`, the ps tasks stay paused once the state is read (every row at the cut
/// included): nothing trains until the caller registers the model again (which ends the
/// pause, as Chief::join does) or resumes them. A failure resumes them all the same.
template <Transport T>
ModelState read_state(Client<T>& client, std::int64_t at_step = 0, CutRows rows = {}, bool hold = false) {
  if (!client.has_placement()) throw Error(ErrorCode::kFailedPrecondition, "no model registered yet");
  struct Resumer {  // whatever happens, the ps tasks go on (unless held on success)
    Client<T>& client;
    bool armed = true;
    ~Resumer() {
      if (!armed) return;
      try {
        client.template broadcast<Ack>([](std::size_t) { return Resume{}; }, client.options().request_timeout,
                                       "resume the ps tasks");
      } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
      }
    }
  } resumer{client};
  std::vector<PauseReply> paused;
  {
    CallGroup group;
    for (const std::uint32_t ps : client.members()) group.add(client.transport().call(ps, Pause{at_step}, {}));
    detail::wait_gated(client.transport(), client.members(), client.options(), group, at_step, "pause the ps tasks at step " + std::to_string(at_step));
    for (std::size_t k = 0; k < group.size(); ++k) paused.push_back(group.take_as<PauseReply>(k));
  }
  if (rows.since >= 0) {
    for (std::size_t k = 0; k < paused.size(); ++k) {
      if (paused[k].evictions_since <= rows.since) continue;
      log(LogLevel::kInfo, "ps " + std::to_string(client.members()[k]) + " knows its evictions from global step " +
                               std::to_string(paused[k].evictions_since) + " on only, not since " +
                               std::to_string(rows.since) + ": this checkpoint holds every row");
      rows.since = -1;
      break;
    }
  }
  ReadState cut = detail::cut_of(paused);
  cut.since = rows.since;
  cut.forget_evictions_before = rows.forget_evictions_before;
  ModelState state;
  const std::size_t num_slots = paused[0].slot_names.size();
  for (const VariableSpec& spec : client.variables()) {
    VariableState v;
    v.spec = spec;
    detail::resize_on_huge_pages(v.values, spec.size());
    for (const std::string& name : paused[0].slot_names) {
      std::vector<float> slot;
      detail::resize_on_huge_pages(slot, spec.size());
      v.slots.push_back({name, std::move(slot)});
    }
    v.counter_names = paused[0].counter_names;
    state.variables.push_back(std::move(v));
  }
  const Placement& placement = client.placement();
  CallGroup group;
  for (std::size_t m = 0; m < client.members().size(); ++m) {
    const std::uint32_t ps = client.members()[m];
    PullTargets targets;
    for (const Part& part : placement.parts) {
      if (part.ps != ps) continue;
      VariableState& v = state.variables[part.variable];
      const std::size_t row = v.spec.row_size();
      const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
      targets.push_back(std::span(v.values).subspan(at, n));
      for (std::size_t k = 0; k < num_slots; ++k) {
        targets.push_back(std::span(v.slots[k].values).subspan(at, n));
      }
    }
    group.add(client.transport().call(ps, cut, std::move(targets)));
  }
  group.wait(client.options().request_timeout, "read the ps tasks' state at one cut");
  for (std::size_t k = 0; k < group.size(); ++k) {
    const std::uint32_t ps = client.members()[k];
    const StateReply reply = group.take_as<StateReply>(k);
    if (k == 0) {
      state.global_step = reply.global_step;
      state.pacer = reply.pacer;
    } else if (reply.pacer != state.pacer) {
      log(LogLevel::kWarning, "ps " + std::to_string(ps) + " and ps " + std::to_string(client.pacing_ps()) +
                                  " disagree on the sync policy's state at the cut: the checkpoint keeps ps " +
                                  std::to_string(client.pacing_ps()) + "'s");
    }
    for (const PartState& p : reply.parts) {
      if (p.part >= placement.parts.size() || placement.parts[p.part].ps != ps) {
        throw Error(ErrorCode::kInternal, "ps " + std::to_string(ps) + " answered for a part it does not hold");
      }
      const Part& part = placement.parts[p.part];
      state.variables[part.variable].counters.push_back({part.rows, p.counters});
    }
  }
  for (VariableState& v : state.variables) {
    std::sort(v.counters.begin(), v.counters.end(),
              [](const PartCounters& a, const PartCounters& b) { return a.rows.begin < b.rows.begin; });
  }
  if (!client.tables().empty() && !hold) {
    // Training goes on while the rows are read: each ps reads them as they were at the cut.
    client.template broadcast<Ack>([](std::size_t) { return Resume{true}; }, client.options().request_timeout,
                                   "resume the ps tasks");
  }
  for (std::uint32_t t = 0; t < client.tables().size(); ++t) {
    std::optional<TableState> table = detail::read_table(client, t, rows.since >= 0);
    if (!table) {
      log(LogLevel::kInfo, "a ps lost track of its evictions since global step " + std::to_string(rows.since) +
                               " while it was paused: the checkpoint is cut again, with every row");
      resumer.armed = false;  // the cut made again resumes (or holds) the ps tasks itself
      return read_state(client, 0, CutRows{-1, rows.forget_evictions_before}, hold);
    }
    state.tables.push_back(std::move(*table));
  }
  resumer.armed = !hold;
  state.table_seed = client.table_seed();
  if (!state.tables.empty()) state.base_step = rows.since;
  // At global step 0 nothing was applied yet: state a restore starts afresh is exact then.
  if (!paused[0].whole && state.global_step > 0) {
    log(LogLevel::kWarning, "the optimizer keeps state it does not name (slots, counters): this cut at global "
                            "step " + std::to_string(state.global_step) + " holds the rest, and a restore from "
                            "it starts that afresh");
  }
  return state;
}

/// Registers `state`'s model and sets every ps from it (Restore): values, optimizer state
/// (slots and counters matched by name: a checkpoint of another optimizer restores the
/// values alone), the sync policy's state, at a new epoch. The placement may differ from
/// the checkpoint's (another number of ps tasks): tensors are split anew, and each part
/// takes the counters of the saved part that held its first row. The embedding tables'
/// rows follow in chunks, each row sent to the ps `sharding` gives it when that is the ps
/// tasks' own IdSharding (else to every ps, each keeping its own), so any number of ps
/// tasks can take them, and no ps serves until its rows are in; rows created later
/// start from the checkpoint's table seed (or `table_seed` for a checkpoint without tables).
template <Transport T, IdSharding I = HashIds>
void restore_state(Client<T>& client, const ModelState& state, std::uint64_t table_seed, const I& sharding = {}) {
  if (state.incremental()) {
    throw Error(ErrorCode::kInvalidArgument,
                "an incremental checkpoint (over global step " + std::to_string(state.base_step) +
                    ") restores only applied over its base (apply_delta, or CheckpointDirectory::load)");
  }
  // The model's tables when this client knows them (it registered them), else the
  // checkpoint's; a checkpoint's tables must be the model's.
  const std::vector<TableSpec> tables = client.tables().empty() ? state.table_specs() : client.tables();
  if (!state.tables.empty() && tables.size() != state.tables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "the checkpoint has " + std::to_string(state.tables.size()) +
                                                 " embedding tables, the model " + std::to_string(tables.size()));
  }
  for (std::size_t t = 0; t < state.tables.size(); ++t) {
    if (auto problem = detail::check_table(state.tables[t], tables[t]); !problem.empty()) {
      throw Error(ErrorCode::kInvalidArgument, problem);
    }
  }
  // A checkpoint with tables says their seed; one without keeps the caller's.
  client.register_model(state.specs(), tables, state.tables.empty() ? table_seed : state.table_seed);
  const std::uint64_t epoch = client.epoch() + 1;
  const Placement& placement = client.placement();
  const std::vector<std::string>& slot_names = client.slot_names();
  const std::vector<std::string>& counter_names = client.counter_names();
  const std::vector<std::uint32_t> workers(client.workers().begin(), client.workers().end());
  std::vector<Restore> messages(client.num_ps(), Restore{epoch, state.pacer, {}, !state.tables.empty(), workers});
  bool whole = true;
  for (const Part& part : placement.parts) {
    const VariableState& v = state.variables[part.variable];
    const std::size_t row = v.spec.row_size();
    const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
    PartState ps{static_cast<std::uint32_t>(&part - placement.parts.data()), std::span<const float>(v.values).subspan(at, n), {}, {}};
    for (const std::string& name : slot_names) {
      const auto it = std::find_if(v.slots.begin(), v.slots.end(),
                                   [&](const SlotState& s) { return s.name == name; });
      if (it == v.slots.end() || v.slots.size() != slot_names.size()) {
        ps.slots.clear();
        whole = false;
        break;
      }
      ps.slots.push_back(std::span<const float>(it->values).subspan(at, n));
    }
    const auto saved = std::find_if(v.counters.begin(), v.counters.end(), [&](const PartCounters& c) {
      return c.rows.begin <= part.rows.begin && part.rows.begin < c.rows.end;
    });
    for (const std::string& name : counter_names) {
      const auto k = std::find(v.counter_names.begin(), v.counter_names.end(), name);
      if (saved == v.counters.end() || k == v.counter_names.end() ||
          v.counter_names.size() != counter_names.size()) {
        ps.counters.clear();
        whole = false;
        break;
      }
      ps.counters.push_back(saved->values[static_cast<std::size_t>(k - v.counter_names.begin())]);
    }
    messages[part.ps].parts.push_back(std::move(ps));
  }
  if (!whole) {
    log(LogLevel::kWarning, "the checkpoint's optimizer state does not match this optimizer's "
                            "slots and counters: the values are restored, the optimizer starts afresh");
  }
  client.template broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); },
                                 client.options().request_timeout, "restore the ps tasks");
  if (!state.tables.empty()) {
    const bool routed = client.same_id_sharding(sharding);
    for (std::uint32_t t = 0; t < state.tables.size(); ++t) {
      detail::restore_table(client, t, state.tables[t], epoch, sharding, routed);
    }
    client.template broadcast<Ack>(
        [&](std::size_t) {
          RestoreRows done;
          done.epoch = epoch;
          done.done = true;
          return done;
        },
        client.options().request_timeout, "end the restore of the tables");
  }
  client.adopt_epoch(epoch);
}

}  // namespace pulley
