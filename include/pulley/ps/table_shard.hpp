// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/core/detail/finite.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/core/id_index.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/ps/embedding_table.hpp"
#include "pulley/tables/tables.hpp"

namespace pulley {

/// The rows of embedding tables a ps task holds: one EmbeddingTable per table of the model,
/// the accumulator of each table's rows pushed for the update in progress (the table
/// policy's RowAggregation), its update count (lazy Adam's t) and the step of its next
/// eviction pass. Part of the ps's Shard. `TableShard<NoTables>` holds none and refuses
/// every row.
///
/// An update of the tables is two-phase: `prepare` computes every pushed row's new value
/// aside and says whether all stay finite, `commit` writes them; the ps commits only when
/// its dense parts stay finite too, so an update is applied whole or not at all.
///
/// @tparam T the ParameterServer's table policy (Tables<...>)
template <class T>
class TableShard {
 public:
  using Optimizer = typename T::Optimizer;
  /// Floats in one row of a table.
  static constexpr std::size_t kMaxDim = std::size_t{1} << 16U;

  explicit TableShard(T policy = {}) : policy_(std::move(policy)) {}

  /// The table policy.
  [[nodiscard]] const T& policy() const noexcept { return policy_; }

  /// Empty tables for `specs` (checked: see ParameterServer), whose rows start from
  /// `seed`, on ps `task` of the job's ps tasks `members`. All of it is built before any
  /// of it is kept.
  void assign(std::uint32_t task, std::span<const std::uint32_t> members, const std::vector<TableSpec>& specs,
              std::uint64_t seed) {
    std::vector<Table> tables;
    tables.reserve(specs.size());
    for (const TableSpec& spec : specs) {
      tables.push_back(Table{EmbeddingTable<Optimizer>(spec, policy_.optimizer, seed),
                             policy_.aggregation.make_accumulator(spec.dim), 0, 0, false, 0, -1, 0, false, {}, {}, {}});
    }
    std::vector<std::uint32_t> kept(members.begin(), members.end());
    tables_ = std::move(tables);
    task_ = task;
    members_ = std::move(kept);
  }

  /// Tables held.
  [[nodiscard]] std::size_t size() const noexcept { return tables_.size(); }
  /// Where this ps's id sharding puts the tables' rows (`id_sharding_fingerprint`).
  [[nodiscard]] std::uint64_t id_sharding(const std::vector<TableSpec>& specs) const {
    return id_sharding_fingerprint(policy_.sharding, specs, members_);
  }
  /// The spec of table `t`.
  [[nodiscard]] const TableSpec& spec(std::size_t t) const { return tables_[t].rows.spec(); }

  /// Why `rows` (of a pull, or with values of a push) cannot be served here, or nullopt: a
  /// table that does not exist or comes twice, too many ids or bytes, an id twice, an id
  /// another ps holds, rows of the wrong size, non-finite values (unless `finite_known`).
  /// So a reply is never larger than the rows it names once each.
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<TableRows>& rows, bool with_values,
                                                bool finite_known) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const TableRows& tr = rows[i];
      if (tr.table >= tables_.size()) {
        return refuse("unknown table " + std::to_string(tr.table) + " (the model has " +
                      std::to_string(tables_.size()) + ")");
      }
      const TableSpec& s = spec(tr.table);
      for (std::size_t j = 0; j < i; ++j) {
        if (rows[j].table == tr.table) return refuse("table '" + s.name + "' comes twice");
      }
      if (tr.ids.size() > kMaxIdsPerMessage || tr.ids.size() * s.dim * sizeof(float) > kMaxRowBytesPerMessage) {
        return refuse(std::to_string(tr.ids.size()) + " ids of table '" + s.name + "' in one request (at most " +
                      std::to_string(std::min<std::size_t>(kMaxIdsPerMessage,
                                                           kMaxRowBytesPerMessage / sizeof(float) / s.dim)) +
                      ")");
      }
      if (tr.values.size() != (with_values ? tr.ids.size() * s.dim : 0)) {
        return refuse("table '" + s.name + "': " + std::to_string(tr.values.size()) + " values for " +
                      std::to_string(tr.ids.size()) + " rows of dim " + std::to_string(s.dim));
      }
      if (const std::uint64_t* twice = seen_.first_duplicate(tr.ids)) {
        return refuse("row " + std::to_string(*twice) + " of table '" + s.name +
                      "' comes twice in one request (a worker sums a row's gradients before it pushes)");
      }
      for (const std::uint64_t id : tr.ids) {
        const std::uint32_t owner = row_owner(policy_.sharding, s.name, id, members_);
        if (owner != task_) {
          return refuse("row " + std::to_string(id) + " of table '" + s.name + "' is held by ps " +
                        std::to_string(owner) + ", not here (do the worker and the ps use the same " +
                        "id sharding?)");
        }
      }
      if (with_values && !finite_known && !detail::all_finite(tr.values)) {
        return refuse("non-finite (NaN or Inf) rows for table '" + s.name + "'; nothing was applied");
      }
    }
    return std::nullopt;
  }

  /// The rows `request` asks for, at global step `step`, in buffers that stay valid until
  /// `free_replies` (none for `PullRows::touch_only`); `create` (a worker's pull) creates,
  /// admits and touches rows.
  RowsReply pull(const PullRows& request, bool create, std::int64_t step, Stats& stats) {
    if (used_ == replies_.size()) replies_.emplace_back();
    std::vector<std::vector<float>>& buffers = replies_[used_++];
    buffers.resize(request.tables.size());
    RowsReply answer{step, {}};
    // The ps's budget for its tables (Tables::max_bytes) left, shared by the tables pulled.
    std::uint64_t headroom = 0;
    const std::uint64_t budget = max_bytes();
    if (budget > 0 && create) {
      std::uint64_t used = 0;
      for (const Table& t : tables_) used += t.rows.budget_bytes();
      headroom = budget - std::min(budget, used);
    }
    for (std::size_t i = 0; i < request.tables.size(); ++i) {
      const TableRows& tr = request.tables[i];
      EmbeddingTable<Optimizer>& table = tables_[tr.table].rows;
      buffers[i].resize(request.touch_only ? 0 : tr.ids.size() * table.dim());
      const std::uint64_t capped = table.stats().rows_capped;
      table.pull(tr.ids, buffers[i], step, create, budget > 0 && create ? &headroom : nullptr);
      if (!tables_[tr.table].warned && table.stats().rows_capped > capped) {
        tables_[tr.table].warned = true;  // once: Stats::table_rows_capped counts the rest
        log(LogLevel::kWarning, "ps " + std::to_string(task_) + ": table '" + table.spec().name +
                                    "' is full (" + full_because(table.spec(), budget) +
                                    "): rows not created read as their initial values and their pushes "
                                    "are dropped, counted in Stats::table_rows_capped");
      }
      answer.rows.emplace_back(buffers[i]);
      stats.bytes_pulled += static_cast<std::int64_t>(buffers[i].size() * sizeof(float));
    }
    return answer;
  }

  /// Makes every row reply buffer free for reuse (a transport is done with the replies'
  /// views before it hands the ps a request that changes it). Buffers over 64 MiB are given
  /// back, and those of more than 64 requests: an outsized pull (a careless or hostile
  /// worker's) does not hold its memory for the job's life.
  void free_replies() noexcept {
    while (replies_.size() > 64) replies_.pop_back();
    used_ = 0;
    for (auto& buffers : replies_) {
      for (std::vector<float>& b : buffers) {
        if (b.capacity() > (std::size_t{64} << 20U) / sizeof(float)) std::vector<float>().swap(b);
      }
    }
  }

  /// Adds a fresh push's rows to the update in progress.
  void add(const TableRows& rows) { policy_.aggregation.add(tables_[rows.table].accumulator, rows.ids, rows.values); }

  /// Computes every table's update from its accumulated rows, at global step `step`
  /// (steps completed before it), aside; returns the name of a table whose rows would go
  /// non-finite (the update must then be dropped: `clear`), or nullopt.
  [[nodiscard]] std::optional<std::string> prepare(std::int64_t step) {
    for (Table& table : tables_) {
      const auto ids = policy_.aggregation.ids(table.accumulator);
      if (ids.empty()) continue;
      const auto means = policy_.aggregation.take(table.accumulator);
      table.prepared = table.rows.prepare(ids, means, step, table.updates + 1);
      if (!table.prepared) return table.rows.spec().name;
    }
    return std::nullopt;
  }

  /// Writes the prepared rows back and evicts rows gone untouched too long (every eighth of
  /// the eviction window: a pass costs one look at every row). Returns the tables updated.
  std::int64_t commit(std::int64_t step) {
    std::int64_t updated = 0;
    for (Table& table : tables_) {
      if (!std::exchange(table.prepared, false)) continue;  // no row pushed in this update
      table.rows.commit(step);
      ++table.updates;
      policy_.aggregation.clear(table.accumulator);
      ++updated;
    }
    const std::int64_t next = step + 1;
    for (Table& table : tables_) {
      const std::int64_t window = table.rows.spec().evict_after_steps;
      if (window <= 0 || next < table.next_eviction) continue;
      table.rows.evict(next);
      table.next_eviction = next + std::max<std::int64_t>(1, window / 8);
    }
    return updated;
  }

  /// Drops the update in progress.
  void clear() noexcept {
    for (Table& table : tables_) {
      policy_.aggregation.clear(table.accumulator);
      table.prepared = false;
    }
  }

  // ---- a checkpoint's cut and a restore ---------------------------------------------------

  /// The global step from which this ps can say every row evicted: an incremental cut
  /// since an earlier step would miss some (see mark_cut).
  [[nodiscard]] std::int64_t evictions_since() const noexcept {
    std::int64_t since = 0;
    for (const Table& t : tables_) since = std::max(since, t.rows.evictions_since());
    return since;
  }

  /// The cut was read (the ps is paused): remembers each table's rows and admission counts
  /// at this moment, which ReadRows then reads chunk by chunk, as they were then, whether
  /// the ps stays paused or trains on (EmbeddingTable::begin_cut), until end_cut. With `since` ≥ 0 (an
  /// incremental checkpoint, `since` ≥ evictions_since()), the rows are those touched at or
  /// after global step `since`, with the ids evicted since; else every row (also when the
  /// table's eviction log no longer reaches back to `since`: RowsChunk::since then says -1,
  /// and the chief takes a full checkpoint instead). Evictions before `forget_before` are
  /// forgotten first (no later cut will be since an earlier step).
  void mark_cut(std::int64_t since = -1, std::int64_t forget_before = -1) {
    for (Table& t : tables_) {
      if (forget_before > 0) t.rows.forget_evictions_before(forget_before);
      t.cut_rows = t.rows.size();
      t.cut_updates = t.updates;
      t.cut_selected.clear();
      t.cut_evicted.clear();
      t.cut_since = since >= 0 && since >= t.rows.evictions_since() ? since : -1;
      if (t.cut_since >= 0) {
        t.rows.rows_touched_since(since, t.cut_selected);
        t.rows.read_evicted(since, t.cut_evicted);
      }
      t.cut_candidates = {};
      t.rows.read_candidates(t.cut_candidates.ids, t.cut_candidates.counts, t.cut_candidates.steps);
      t.rows.begin_cut();  // read as it is now, while training goes on (copy-on-write)
    }
    cut_marked_ = true;
  }
  /// The cut has been read (or given up): what it remembered goes.
  void end_cut() noexcept {
    for (Table& t : tables_) {
      t.cut_candidates = {};
      std::vector<std::uint32_t>().swap(t.cut_selected);
      std::vector<std::uint64_t>().swap(t.cut_evicted);
      t.cut_since = -1;
      t.rows.end_cut();
    }
    cut_marked_ = false;
  }

  /// A cut's rows are being read.
  [[nodiscard]] bool cut_marked() const noexcept { return cut_marked_; }

  /// Why `r` cannot be read, or nullopt.
  [[nodiscard]] std::optional<ErrorReply> check(const ReadRows& r) const {
    if (!cut_marked_) return ErrorReply{ErrorCode::kFailedPrecondition, "ReadRows before the cut was read"};
    if (r.table >= tables_.size()) return refuse("unknown table " + std::to_string(r.table));
    return std::nullopt;
  }

  /// A chunk of the rows (or candidates, or evicted ids) of `r.table` at the cut
  /// (`check`ed): rows [r.begin, r.begin + n) of those the cut holds, n = min(r.max_rows,
  /// rows_per_chunk(stride), rows left), in a buffer valid until `free_replies`.
  RowsChunk read(const ReadRows& r) {
    const Table& t = tables_[r.table];
    RowsChunk answer;
    answer.updates = t.cut_updates;
    answer.since = t.cut_since;
    for (const std::string_view name : policy_.optimizer.row_slot_names()) answer.slot_names.emplace_back(name);
    if (r.evicted) {
      const std::vector<std::uint64_t>& gone = t.cut_evicted;
      answer.total = gone.size();
      const std::size_t begin = std::min<std::size_t>(r.begin, gone.size());
      const std::size_t n = std::min<std::size_t>({r.max_rows, kMaxCandidatesPerMessage, gone.size() - begin});
      answer.ids.assign(gone.begin() + begin, gone.begin() + begin + n);
      return answer;
    }
    if (r.candidates) {
      const Candidates& c = t.cut_candidates;
      answer.total = c.ids.size();
      const std::size_t begin = std::min<std::size_t>(r.begin, c.ids.size());
      const std::size_t n = std::min<std::size_t>({r.max_rows, kMaxCandidatesPerMessage, c.ids.size() - begin});
      answer.ids.assign(c.ids.begin() + begin, c.ids.begin() + begin + n);
      answer.counts.assign(c.counts.begin() + begin, c.counts.begin() + begin + n);
      answer.steps.assign(c.steps.begin() + begin, c.steps.begin() + begin + n);
      return answer;
    }
    const bool selected = t.cut_since >= 0;
    answer.total = selected ? t.cut_selected.size() : t.cut_rows;
    const std::size_t begin = std::min<std::size_t>(r.begin, answer.total);
    const std::size_t n = std::min<std::size_t>({r.max_rows, rows_per_chunk(t.rows.stride()), answer.total - begin});
    if (used_ == replies_.size()) replies_.emplace_back();
    std::vector<std::vector<float>>& buffers = replies_[used_++];
    buffers.resize(1);
    buffers[0].clear();
    if (selected) {
      t.rows.read_rows(std::span(t.cut_selected).subspan(begin, n), answer.ids, buffers[0], answer.steps);
    } else {
      t.rows.read_rows(begin, n, answer.ids, buffers[0], answer.steps);
    }
    answer.rows = buffers[0];
    return answer;
  }

  /// Empties every table for a restore at global step `step`: their rows follow
  /// (`restore`), or the tables start afresh.
  void begin_restore(std::int64_t step) noexcept {
    for (Table& t : tables_) {
      t.rows.clear(step);
      policy_.aggregation.clear(t.accumulator);
      t.updates = 0;
      t.next_eviction = 0;
      t.prepared = false;
    }
    end_cut();
  }

  /// Why the rows of `r` cannot be restored, or nullopt: an unknown table, sizes that do not
  /// match, non-finite values.
  [[nodiscard]] std::optional<ErrorReply> check(const RestoreRows& r) const {
    if (r.table >= tables_.size()) {
      if (r.ids.empty() && r.done) return std::nullopt;
      return refuse("unknown table " + std::to_string(r.table));
    }
    const std::size_t n = r.ids.size();
    const std::size_t stride = (1 + r.slot_names.size()) * spec(r.table).dim;
    const bool fits = r.steps.size() == n && (r.candidates ? r.rows.empty() && r.counts.size() == n
                                                           : r.rows.size() == n * stride && r.counts.empty());
    if (!fits) return refuse("RestoreRows of table '" + spec(r.table).name + "': sizes do not match its rows");
    if (!detail::all_finite(r.rows)) return refuse("RestoreRows of table '" + spec(r.table).name + "': non-finite rows");
    return std::nullopt;
  }

  /// Takes the rows (or candidates) of `r` (`check`ed) that this ps's id sharding gives it;
  /// returns how many.
  std::size_t restore(const RestoreRows& r) {
    if (r.table >= tables_.size()) return 0;
    Table& t = tables_[r.table];
    if (r.updates >= 0) t.updates = r.updates;
    const std::string& name = spec(r.table).name;
    const std::size_t dim = spec(r.table).dim;
    const std::size_t stride = (1 + r.slot_names.size()) * dim;
    // The checkpoint's slots when they are this optimizer's, else the values alone.
    const auto own = policy_.optimizer.row_slot_names();
    const bool same_slots = std::equal(own.begin(), own.end(), r.slot_names.begin(), r.slot_names.end());
    const std::size_t take = same_slots ? stride : dim;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < r.ids.size(); ++i) {
      if (row_owner(policy_.sharding, name, r.ids[i], members_) != task_) continue;
      if (r.candidates) {
        t.rows.restore_candidate(r.ids[i], r.counts[i], r.steps[i]);
      } else {
        t.rows.restore_row(r.ids[i], r.rows.subspan(i * stride, take), r.steps[i]);
      }
      ++kept;
    }
    return kept;
  }

  /// The most row bytes one request can carry to this ps: a push's rows, or a chunk of a
  /// restore (RestoreRows: 64 MiB at most, whatever its slots).
  [[nodiscard]] std::uint64_t max_payload() const noexcept {
    std::uint64_t bytes = 0;
    for (const Table& t : tables_) {
      bytes += std::min<std::uint64_t>(kMaxIdsPerMessage * t.rows.dim() * sizeof(float), kMaxRowBytesPerMessage);
    }
    constexpr std::uint64_t kRestoreChunk = std::uint64_t{64} << 20U;
    return tables_.empty() ? 0 : std::max(bytes, kRestoreChunk);
  }

  /// Adds the tables' rows held, evicted and dropped to `stats`.
  void count(Stats& stats) const noexcept {
    for (const Table& t : tables_) {
      const TableStats ts = t.rows.stats();
      stats.table_rows += static_cast<std::int64_t>(ts.rows);
      stats.table_rows_evicted += static_cast<std::int64_t>(ts.rows_evicted);
      stats.table_rows_dropped += static_cast<std::int64_t>(ts.pushes_dropped);
      stats.table_rows_capped += static_cast<std::int64_t>(ts.rows_capped);
    }
  }

  /// Each table's counters, in the model's order.
  [[nodiscard]] std::vector<TableStats> stats() const {
    std::vector<TableStats> out;
    for (const Table& t : tables_) out.push_back(t.rows.stats());
    return out;
  }

 private:
  /// Admission counts as a cut saw them.
  struct Candidates {
    std::vector<std::uint64_t> ids;
    std::vector<std::uint32_t> counts, steps;
  };
  struct Table {
    EmbeddingTable<Optimizer> rows;
    typename T::Aggregation::Accumulator accumulator;
    std::int64_t updates = 0;
    std::int64_t next_eviction = 0;
    bool prepared = false;  ///< its rows of the update being applied wait for commit
    std::size_t cut_rows = 0;       ///< rows held at the last cut
    std::int64_t cut_since = -1;    ///< an incremental cut's step (-1: every row)
    std::int64_t cut_updates = 0;   ///< the update count at the cut
    bool warned = false;            ///< it was logged full once
    std::vector<std::uint32_t> cut_selected;  ///< an incremental cut's rows, by number
    std::vector<std::uint64_t> cut_evicted;   ///< ids an incremental cut says went
    Candidates cut_candidates;      ///< admission counts at the last cut
  };

  static ErrorReply refuse(std::string message) { return ErrorReply{ErrorCode::kInvalidArgument, std::move(message)}; }

  /// Why a table is full: its max_rows, the ps's budget, or both.
  static std::string full_because(const TableSpec& spec, std::uint64_t budget) {
    std::string why;
    if (spec.max_rows > 0) why = "max_rows " + std::to_string(spec.max_rows) + " per ps";
    if (budget > 0) {
      if (!why.empty()) why += " or ";
      why += "the ps's budget of " + std::to_string(budget) + " bytes";
    }
    return why;
  }

  /// The policy's budget for this ps's tables (0: none); a policy without one has none.
  [[nodiscard]] std::uint64_t max_bytes() const noexcept {
    if constexpr (requires { policy_.max_bytes; }) {
      return static_cast<std::uint64_t>(policy_.max_bytes);
    } else {
      return 0;
    }
  }

  T policy_;
  bool cut_marked_ = false;  ///< a cut was read and the pause goes on
  std::uint32_t task_ = 0;
  std::vector<std::uint32_t> members_{0};  ///< the job's ps tasks (Register::members)
  std::vector<Table> tables_;
  IdPositions seen_{detail::random_u64()};  ///< finds an id twice in a request
  /// Buffers of row replies, by request: those before `used_` may be viewed by a transport
  /// until the next request that changes the ps.
  std::deque<std::vector<std::vector<float>>> replies_;
  std::size_t used_ = 0;
};

/// A ps that serves no embedding tables: it holds none, and refuses any row.
template <>
class TableShard<NoTables> {
 public:
  explicit TableShard(NoTables = {}) noexcept {}
  [[nodiscard]] NoTables policy() const noexcept { return {}; }
  void assign(std::uint32_t, std::span<const std::uint32_t>, const std::vector<TableSpec>&, std::uint64_t) noexcept {}
  [[nodiscard]] std::size_t size() const noexcept { return 0; }
  [[nodiscard]] std::uint64_t id_sharding(const std::vector<TableSpec>&) const noexcept { return 0; }
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<TableRows>& rows, bool, bool) const {
    if (rows.empty()) return std::nullopt;
    return ErrorReply{ErrorCode::kInvalidArgument,
                      "unknown table " + std::to_string(rows.front().table) + " (the model has 0)"};
  }
  RowsReply pull(const PullRows&, bool, std::int64_t step, Stats&) const { return RowsReply{step, {}}; }
  void free_replies() noexcept {}
  void add(const TableRows&) noexcept {}
  [[nodiscard]] std::optional<std::string> prepare(std::int64_t) noexcept { return std::nullopt; }
  std::int64_t commit(std::int64_t) noexcept { return 0; }
  void clear() noexcept {}
  [[nodiscard]] std::int64_t evictions_since() const noexcept { return 0; }
  [[nodiscard]] bool cut_marked() const noexcept { return false; }
  void mark_cut(std::int64_t = -1, std::int64_t = -1) noexcept {}
  void end_cut() noexcept {}
  [[nodiscard]] std::optional<ErrorReply> check(const ReadRows& r) const {
    return ErrorReply{ErrorCode::kInvalidArgument, "unknown table " + std::to_string(r.table) + " (the model has 0)"};
  }
  RowsChunk read(const ReadRows&) const { return {}; }
  void begin_restore(std::int64_t) noexcept {}
  [[nodiscard]] std::optional<ErrorReply> check(const RestoreRows& r) const {
    if (r.ids.empty()) return std::nullopt;
    return ErrorReply{ErrorCode::kInvalidArgument, "unknown table " + std::to_string(r.table) + " (the model has 0)"};
  }
  std::size_t restore(const RestoreRows&) const noexcept { return 0; }
  [[nodiscard]] std::uint64_t max_payload() const noexcept { return 0; }
  void count(Stats&) const noexcept {}
  [[nodiscard]] std::vector<TableStats> stats() const { return {}; }
};

}  // namespace pulley
