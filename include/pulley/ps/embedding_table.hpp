// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/detail/pages.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/id_index.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/prefetch.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

/// What an embedding table on one ps has done, for monitoring and tests.
struct TableStats {
  std::uint64_t rows = 0;              ///< rows held now
  std::uint64_t rows_created = 0;      ///< rows created (admitted), evicted ones included
  std::uint64_t rows_evicted = 0;      ///< rows removed for being untouched too long
  std::uint64_t candidates = 0;        ///< ids pulled but not admitted yet
  std::uint64_t pushes_dropped = 0;    ///< pushed rows dropped: not admitted (or evicted)
  std::uint64_t updates_refused = 0;   ///< updates dropped whole: a row would go non-finite
  std::uint64_t rows_capped = 0;       ///< rows evicted, or not created, for the spec's max_rows
  std::uint64_t bytes = 0;             ///< memory held for rows, ids and the index
};

/// The rows of one embedding table that one ps holds: a hash map from 64-bit id to a row of
/// `dim` values and the optimizer's `kRowSlots` slots, created lazily, updated row-wise.
///
/// Rows live in chunks of kChunkRows records, allocated whole: a record is the row's id and
/// last-touched step (16 bytes), then its `(1 + kRowSlots) × dim` floats (values, then slot
/// after slot), so that finding, reading and updating a row touch the same cache lines. The
/// index is an IdIndex over row numbers (4 bytes a bucket, at most 3/4 full), whose ids are
/// read from the records.
/// So a row costs its floats plus 16 bytes plus 5.3 to 10.7 bytes of index (the benchmark
/// prints the measured bytes per row), and memory never holds more than one chunk of
/// slack. Lookups of a batch are pipelined: the index buckets and records of ids a few
/// places ahead are prefetched. At most 2^32 − 2 rows per table per ps.
///
/// The index hashes ids with a random key of its own, so that no choice of ids piles them
/// onto one bucket (ids a client picked to collide would otherwise make every lookup walk
/// them all). It is the rows of one table on one ps, part of the ps's Shard (TableShard);
/// it does no I/O and takes no lock: the ps calls it for one request at a time.
///
/// @tparam O RowWiseOptimizer that updates the rows (a dense-only optimizer fails here,
///           naming the member it lacks)
template <RowWiseOptimizer O>
class EmbeddingTable {
 public:
  // The longer bodies are defined in ps/impl/ (included at the end of this header), by
  // concern: the rows, their index and the counters in embedding_table_rows.hpp; updates
  // and the proven rows in embedding_table_updates.hpp; a checkpoint's cut, its reads, the
  // eviction log and a restore in embedding_table_cut.hpp.

  static constexpr std::size_t kChunkRows = 1024;  ///< rows allocated at a time

  /// An empty table of `spec` (its dim must be positive), updated by `optimizer`, whose rows
  /// start from `initialize_row(spec, seed, id, ...)`.
  EmbeddingTable(TableSpec spec, O optimizer, std::uint64_t seed)
      : spec_(std::move(spec)),
        optimizer_(std::move(optimizer)),
        seed_(seed),
        stride_((1 + O::kRowSlots) * spec_.dim),
        record_(kHeader + stride_) {
    if (spec_.dim == 0) throw Error(ErrorCode::kInvalidArgument, "table '" + spec_.name + "' has dim 0");
  }

  [[nodiscard]] const TableSpec& spec() const noexcept { return spec_; }
  [[nodiscard]] std::size_t dim() const noexcept { return spec_.dim; }
  [[nodiscard]] std::size_t size() const noexcept { return rows_; }
  [[nodiscard]] const O& optimizer() const noexcept { return optimizer_; }

  /// Writes the rows of `ids` into `out` (`ids.size() × dim` floats, in order), at global
  /// step `step`. With `create` (a worker's pull), a row not held is created when its id is
  /// admitted (pulled `spec.admit_after` times), else read as its initial value, and a row
  /// read counts as touched; without (a reader's: the chief's, an evaluator's), nothing is
  /// created, counted or touched. Duplicate ids are allowed (each counts towards admission).
  /// `headroom`, if given, is the bytes the ps's tables may still grow by (Tables::max_bytes):
  /// each row created (budget_row_bytes()) and each id admission starts counting
  /// (kCandidateBytes) takes from it; when it is short, the table makes room as at its
  /// max_rows, and failing that the row is not created. An empty `out` reads nothing: the
  /// pull's effects on the table alone (PullRows::touch_only).
  void pull(std::span<const std::uint64_t> ids, std::span<float> out, std::int64_t step,
            bool create = true, std::uint64_t* headroom = nullptr);

  /// What a row costs against a ps's table budget: its record and its index entry.
  [[nodiscard]] std::uint64_t budget_row_bytes() const noexcept { return record_ * sizeof(float) + 8; }
  /// What an id admission counts costs against it.
  static constexpr std::uint64_t kCandidateBytes = 48;
  /// The bytes this table holds against a ps's table budget: rows (and the copies a cut
  /// being read keeps of rows updated since) and admission counts.
  [[nodiscard]] std::uint64_t budget_bytes() const noexcept {
    return (rows_ + kept_touched_.size()) * budget_row_bytes() + candidates_.size() * kCandidateBytes;
  }

  /// Applies one update at global step `step` (steps completed before it; `updates` of this
  /// table so far, this one included): for each of `ids`, which must be distinct, the mean
  /// gradient in `gradients` (`ids.size() × dim`). A row not held is dropped and counted.
  /// All or nothing: if any updated row would hold a non-finite value, nothing changes and
  /// false is returned (counted in `updates_refused`).
  ///
  /// With an optimizer that bounds rows' magnitudes (BoundsRowMagnitudes), an update whose
  /// gradient is ordinary and whose rows are all proven (see `proven`) is proven finite
  /// before a row is read, and each row is updated in place in one pass, the pass judging
  /// the values it writes; only the rows not proven are updated in a copy first and checked.
  bool apply(std::span<const std::uint64_t> ids, std::span<const float> gradients,
             std::int64_t step, std::int64_t updates);

  /// The first half of `apply`: returns true if every updated row stays finite, having
  /// computed the rows it could not prove finite in advance into scratch memory; nothing
  /// changes until `commit`, and `ids` and `gradients` must stay valid until then. A ps
  /// prepares every table of an update, and commits them only if all (and its dense parts)
  /// stay finite.
  bool prepare(std::span<const std::uint64_t> ids, std::span<const float> gradients,
               std::int64_t step, std::int64_t updates);

  /// The second half of `apply`: updates the proven rows in place and writes the others'
  /// copies back (nothing if the last `prepare` failed or was committed already).
  void commit(std::int64_t step);

  /// True if `row` (< size()) is proven (BoundsRowMagnitudes): its last update returned a
  /// bound of kOrdinaryMagnitude or less, or, created or restored since, each of its values
  /// and slots is ordinary and no slot is negative. Always false for other optimizers.
  [[nodiscard]] bool proven(std::uint32_t row) const noexcept;
  /// Rows held that are not proven.
  [[nodiscard]] std::size_t unproven() const noexcept { return unproven_; }
  /// Removes the rows untouched (neither pulled nor pushed) since global step
  /// `step - spec.evict_after_steps`, and forgets admission counts as old; returns the rows
  /// removed. Does nothing when the spec keeps rows for ever.
  std::size_t evict(std::int64_t step);

  /// Floats per row: its values and slots.
  [[nodiscard]] std::size_t stride() const noexcept { return stride_; }
  /// Ids pulled and not admitted yet.
  [[nodiscard]] std::size_t candidates() const noexcept { return candidates_.size(); }

  // ---- what a checkpoint reads and restores --------------------------------------------
  // Rows are numbered 0 to size() − 1; pulls append rows and only an update's eviction
  // renumbers them, so a ps paused for a checkpoint's cut reads rows [0, n) of the cut by
  // number, chunk after chunk, however many pulls come meanwhile.

  /// Appends rows [begin, begin + n) to `ids`, `rows` (stride() floats each: values, then
  /// slots) and `touched` (the step each was last pulled or pushed).
  void read_rows(std::size_t begin, std::size_t n, std::vector<std::uint64_t>& ids,
                 std::vector<float>& rows, std::vector<std::uint32_t>& touched) const;

  /// Appends the numbers of the rows touched at or after global step `since` to `out`: the
  /// rows an incremental checkpoint since then holds.
  void rows_touched_since(std::int64_t since, std::vector<std::uint32_t>& out) const;

  /// Appends rows `numbers` (each < size()) to `ids`, `rows` and `touched`, as read_rows.
  void read_rows(std::span<const std::uint32_t> numbers, std::vector<std::uint64_t>& ids,
                 std::vector<float>& rows, std::vector<std::uint32_t>& touched) const;

  // ---- evictions, for incremental checkpoints -------------------------------------------
  // Every row removed (by evict_after_steps or by max_rows) is logged with its step, so that
  // a checkpoint holding only the rows changed since an earlier one can say which rows went:
  // restored over the earlier one, an evicted row does not come back. The log holds the
  // evictions from `evictions_since()` on; at kMaxEvictionLog entries, or as many as the
  // table's rows if more, it is dropped and starts again (the next checkpoint is then full).

  /// Entries the eviction log holds at least before it is dropped.
  static constexpr std::size_t kMaxEvictionLog = std::size_t{1} << 20U;

  /// The global step from which every eviction is in the log.
  [[nodiscard]] std::int64_t evictions_since() const noexcept { return evictions_since_; }

  /// Appends the ids evicted at or after global step `since` (≥ evictions_since()).
  void read_evicted(std::int64_t since, std::vector<std::uint64_t>& out) const;

  /// Forgets the evictions before global step `step`: no checkpoint since an earlier step
  /// will be asked for.
  void forget_evictions_before(std::int64_t step);

  /// Appends the ids admission is counting, each with its count and the step last pulled.
  void read_candidates(std::vector<std::uint64_t>& ids, std::vector<std::uint32_t>& counts,
                       std::vector<std::uint32_t>& steps) const;

  /// A checkpoint's cut begins: until end_cut, read_rows gives rows [0, size()) as they are
  /// now, however training changes them meanwhile (an update copies a row aside the first
  /// time it changes it: copy-on-write), and no row is evicted or renumbered (the max_rows
  /// cap and evict_after_steps wait). So the ps trains on while the cut is read; the memory
  /// it costs is the rows updated meanwhile.
  void begin_cut();
  /// The cut has been read: what it kept aside goes.
  void end_cut() noexcept;
  /// Rows copied aside for the cut (updated since it began).
  [[nodiscard]] std::size_t kept_for_cut() const noexcept { return kept_touched_.size(); }

  /// Forgets every row and candidate: a restore at global step `step` follows (whose
  /// evictions are logged from then on).
  void clear(std::int64_t step) noexcept;

  /// Sets the row of `id` to `row` (stride() floats: values, then slots; or dim() floats:
  /// values, with fresh slots), last touched at `touched`, creating it if it is not held.
  /// Throws kResourceExhausted at the row limit.
  void restore_row(std::uint64_t id, std::span<const float> row, std::uint32_t touched);

  /// Sets the admission count of `id`, which has no row, to `count` pulls, the last at `step`.
  void restore_candidate(std::uint64_t id, std::uint32_t count, std::uint32_t step);

  /// Calls `f(id, values, slots)` for every row held (values: dim floats; slots:
  /// kRowSlots × dim floats), in no particular order: what a checkpoint saves.
  template <class F>
  void for_each_row(F&& f) const;

  /// Counters and the memory held now.
  [[nodiscard]] TableStats stats() const noexcept;

 private:
  static constexpr std::uint32_t kNone = IdIndex::kNone;

  /// One chunk of kChunkRows rows: their floats, ids and last-touched steps.
  /// Floats of a record's header: the id (two floats' bytes), the step last touched, and
  /// whether the row is proven (see `proven`). Read and written with memcpy: they are
  /// bytes, never arithmetic.
  static constexpr std::size_t kHeader = 4;
  struct Chunk {
    std::vector<float> records;  ///< kChunkRows records
  };
  /// An id pulled, not admitted yet.
  struct Candidate {
    std::uint32_t count = 0;
    std::uint32_t last = 0;  ///< step last pulled
  };

  [[nodiscard]] float* record(std::uint32_t row) noexcept {
    return chunks_[row / kChunkRows].records.data() + (row % kChunkRows) * record_;
  }
  [[nodiscard]] const float* record(std::uint32_t row) const noexcept {
    return chunks_[row / kChunkRows].records.data() + (row % kChunkRows) * record_;
  }
  /// The row's values, then its slots.
  [[nodiscard]] float* at(std::uint32_t row) noexcept { return record(row) + kHeader; }
  [[nodiscard]] const float* at(std::uint32_t row) const noexcept { return record(row) + kHeader; }
  [[nodiscard]] std::uint64_t id_of(std::uint32_t row) const noexcept {
    std::uint64_t id = 0;
    std::memcpy(&id, record(row), sizeof id);
    return id;
  }
  void set_id(std::uint32_t row, std::uint64_t id) noexcept { std::memcpy(record(row), &id, sizeof id); }
  [[nodiscard]] std::uint32_t touched_step(std::uint32_t row) const noexcept {
    std::uint32_t step = 0;
    std::memcpy(&step, record(row) + 2, sizeof step);
    return step;
  }
  void set_touched(std::uint32_t row, std::uint32_t step) noexcept {
    std::memcpy(record(row) + 2, &step, sizeof step);
  }
  static std::uint32_t clamp_step(std::int64_t step) noexcept {
    return static_cast<std::uint32_t>(std::clamp<std::int64_t>(step, 0, kNone - 1));
  }
  /// Marks `row` proven or not, keeping unproven_.
  void set_proven(std::uint32_t row, bool is) noexcept;
  /// Marks `row`, just created or restored, proven if every value and slot of it is
  /// ordinary and no slot is negative (a slot that must not be negative is then not):
  /// BoundsRowMagnitudes. Does nothing for other optimizers.
  void prove_as_held(std::uint32_t row) noexcept;
  /// Updates `row` in place from the pending update's gradient of `ids[i]` (proven finite
  /// in advance), keeping it for a cut first, and marks it proven by the bound it returns.
  void update_in_place(std::uint32_t row, std::size_t i,
                       std::int64_t step) requires BoundsRowMagnitudes<O>;
  void touch(std::uint32_t row, std::int64_t step);

  /// Asks the cache for the first lines of `row`'s record, at most kPrefetchBytes of it (the
  /// hardware prefetcher streams the rest of a long one; more would overrun the few line
  /// fills a core keeps in flight).
  void prefetch_record(std::uint32_t row) const noexcept {
    pulley::prefetch(record(row), std::min<std::size_t>(record_ * sizeof(float), kPrefetchBytes));
  }
  static constexpr std::size_t kPrefetchBytes = 256;

  /// Calls `f(i, row)` for each of `ids` with the row that holds it (kNone if none), in
  /// order, prefetching the index bucket 16 ids ahead and the record its entry names 8 ids
  /// ahead (prefetch_record): a batch's lookups then wait for memory in parallel, not one
  /// after the other.
  template <class F>
  void for_each_found(std::span<const std::uint64_t> ids, F&& f);

  /// Reads a row's id from its record: what the index hashes.
  struct IdOf {
    const EmbeddingTable* table;
    std::uint64_t operator()(std::uint32_t row) const noexcept { return table->id_of(row); }
  };
  [[nodiscard]] IdOf ids() const noexcept { return IdOf{this}; }

  /// The row of `id`, or kNone.
  [[nodiscard]] std::uint32_t find(std::uint64_t id) const noexcept { return index_.find(id, ids()); }

  /// Counts a pull of `id`, which has no row: true once it is admitted.
  bool admit(std::uint64_t id, std::int64_t step);

  /// True if a row can be created under the spec's max_rows: when the table is full, the
  /// least recently touched eighth of its rows go first (rows touched at `step`, which the
  /// step in progress may push, stay; none goes while rows are frozen for a cut).
  bool make_room(std::int64_t step);

  /// A new row for `id` (absent), with its initial value and fresh slots.
  /// With `values_only`, the values are left for the caller to set (a restore).
  std::uint32_t create(std::uint64_t id, bool values_only = false);

  /// Forgets the admission counts of the ids pulled longest ago: at least half of them.
  void forget_oldest_candidates();

  /// Copies `row` aside as the cut saw it, unless it was already.
  void keep_for_cut(std::uint32_t row);

  /// Appends `row` as the cut saw it (its copy, if an update changed it since).
  void read_row(std::uint32_t row, std::vector<std::uint64_t>& ids, std::vector<float>& rows,
                std::vector<std::uint32_t>& touched) const;

  void log_eviction(std::uint64_t id, std::int64_t step);

  /// Removes `row`: its index entry goes, and the last row moves into its place.
  void erase(std::uint32_t row);

  TableSpec spec_;
  [[no_unique_address]] O optimizer_;
  std::uint64_t seed_;
  std::size_t stride_;  ///< floats per row: values and slots
  std::size_t record_;  ///< floats per record: the header, values and slots
  std::vector<Chunk> chunks_;
  IdIndex index_{detail::random_u64()};  ///< id → row, the ids read from the records
  std::size_t rows_ = 0;
  std::unordered_map<std::uint64_t, Candidate> candidates_;
  TableStats stats_;
  std::uint64_t* headroom_ = nullptr;  ///< during a pull: the ps's table budget left (see pull)
  bool frozen_ = false;  ///< a cut is being read: see begin_cut
  std::size_t cut_rows_ = 0;  ///< rows at the cut
  std::unordered_map<std::uint32_t, std::size_t> kept_at_;  ///< row → its copy, as the cut saw it
  std::vector<float> kept_;                 ///< the copies, stride_ floats each
  std::vector<std::uint32_t> kept_touched_;  ///< their last-touched steps
  std::uint32_t full_at_ = kNone;  ///< the step at which no row could go (the cap's scan waits)
  std::vector<std::pair<std::uint64_t, std::uint32_t>> evicted_;  ///< id, step: see read_evicted
  std::int64_t evictions_since_ = 0;
  std::size_t unproven_ = 0;  ///< rows held that are not proven (see `proven`)
  /// The update between prepare and commit.
  struct Pending {
    std::span<const std::uint64_t> ids;
    std::span<const float> gradients;
    std::int64_t updates = 0;
    bool in_place = false;  ///< proven rows are updated in place
    bool one_pass = false;  ///< every row is: commit finds them
  };
  Pending pending_;
  std::vector<std::pair<std::uint32_t, std::size_t>> in_place_rows_;  ///< row, position in ids: proven rows
  std::vector<std::pair<std::uint32_t, std::size_t>> scratch_rows_;   ///< row, position in ids: the others
  std::vector<float> scratch_;                                        ///< the others' rows being updated
  std::vector<bool> scratch_proven_;                                  ///< whether each came out proven
};

}  // namespace pulley

// EmbeddingTable's member functions' definitions, by concern.
#include "pulley/ps/impl/embedding_table_cut.hpp"
#include "pulley/ps/impl/embedding_table_rows.hpp"
#include "pulley/ps/impl/embedding_table_updates.hpp"
