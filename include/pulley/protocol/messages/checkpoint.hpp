// SPDX-License-Identifier: MIT
#pragma once

/// The messages of a checkpoint's cut and of a restore (protocol/messages.hpp lists every
/// message): the chief pauses every ps, reads its state and its tables' rows in chunks and
/// lets it go on; or sets a state and rows from a checkpoint.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/core/node.hpp"
#include "pulley/protocol/messages/fields.hpp"

namespace pulley {

/// Worker `w`'s entry of a cut's by-worker vector (PauseReply::pushes, ReadState::until,
/// the last pushes' numbers and series), 0 past its end: a vector may be shorter than the
/// workers another ps knows of, and a ps that never heard of a worker took none of its
/// pushes.
inline std::uint64_t of_worker(const std::vector<std::uint64_t>& by_worker,
                               std::size_t w) noexcept {
  return w < by_worker.size() ? by_worker[w] : 0;
}

// ---- requests ---------------------------------------------------------------------------

/// Chief → every ps, to read a checkpoint's cut: once the ps has completed `at_step` global
/// steps (at once for 0; the moment that step completes otherwise, as a step-gated pull),
/// hold the pushes that arrive from then on (their workers wait), and say how many pushes
/// of each worker were taken so far. Ends with Resume, or when the chief's connection
/// closes.
struct Pause {
  static constexpr std::string_view kName = "Pause";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::int64_t at_step = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(at_step);
  }
};

/// Chief → a paused ps: once it has taken the cut's pushes of each worker w (taking held
/// ones as needed, in order), answer with its state: every part it holds with its optimizer
/// state, and the sync policy's. The cut is `until[w]` pushes, the largest count over all
/// ps tasks, less a push this ps will never take: one that is short of `until[w]` and whose
/// own last push of w is the one named here (the furthest ps's last) took every push still
/// to come, and what it lacks was lost with an earlier process of w, written to other ps
/// tasks only; one whose last differs waits for that one push (CheckpointCut::own_until).
/// Each ps judges by what it took itself (with copies, the copy read from, which is the
/// one that gets it), so every one answers at the same cut.
struct ReadState {
  static constexpr std::string_view kName = "ReadState";
  /// Held pushes taken to reach the cut are applied.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::vector<std::uint64_t> until;
  /// An incremental checkpoint's cut: the tables' rows touched at or after this global step
  /// only, with the ids evicted since (ReadRows::evicted); -1: every row. A ps whose log of
  /// evictions starts later (PauseReply::evictions_since) refuses it.
  std::int64_t since = -1;
  /// Evictions before this global step are forgotten: no later cut will be since an
  /// earlier step (the newest checkpoint on disk). -1: none.
  std::int64_t forget_evictions_before = -1;
  /// By worker: the number (Push::sequence) and series of the last push taken by the ps
  /// with the most (PauseReply::last_sequences); 0 and 0: unnumbered, `until` stands.
  std::vector<std::uint64_t> last_sequences = {};
  std::vector<std::uint64_t> last_series = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(until, since, forget_evictions_before, last_sequences, last_series);
  }
};

/// Chief → a paused ps: take the held pushes, and go on.
struct Resume {
  static constexpr std::string_view kName = "Resume";
  /// The held pushes are applied.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  /// Training goes on, but the tables' rows stay readable as they were at the cut
  /// (ReadRows; the ps copies a row aside before it first updates it) until a Resume
  /// without it, or until the chief's connection closes.
  bool keep_rows = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(keep_rows);
  }
};

/// Chief → ps: set every part this ps holds, with its optimizer state, and the sync
/// policy's state, from a checkpoint: to resume a job, or to roll every ps back to one
/// when a ps was lost (TensorFlow restores every variable then). The ps is ready after it,
/// at epoch `epoch`: what waited there, and whatever arrives for an earlier epoch, is
/// refused (`kFailedPrecondition`), so that clients start their step again.
struct Restore {
  static constexpr std::string_view kName = "Restore";
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::uint64_t epoch = 0;
  std::vector<std::int64_t> pacer;  ///< SyncPolicy::save's, or {global step}
  std::vector<PartState> parts;     ///< every part held here
  /// True: the tables are emptied, and their rows follow in RestoreRows; the ps is not
  /// ready (WaitReady waits, pulls are refused) until the one with `done`.
  bool tables_follow = false;
  /// The job's workers (ChangeWorkers), counted by the restored pacer; empty: the cluster
  /// spec's, or as the ps has them.
  std::vector<std::uint32_t> workers = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(epoch, pacer, parts, tables_follow, workers);
  }
};

/// Admission counts one ReadRows answer or RestoreRows carries at most: 16 bytes each (id,
/// count, step), 2 MiB of metadata in all.
inline constexpr std::size_t kMaxCandidatesPerMessage = std::size_t{1} << 17U;

/// Rows of `stride` floats one ReadRows answer carries at most: kMaxIdsPerMessage, and 64 MiB.
inline std::size_t rows_per_chunk(std::size_t stride) noexcept {
  constexpr std::size_t kBytes = std::size_t{64} << 20U;
  return std::max<std::size_t>(
      1, std::min(kMaxIdsPerMessage, kBytes / (std::max<std::size_t>(stride, 1) * sizeof(float))));
}

/// Chief → a ps paused at a checkpoint's cut, after its ReadState: the rows of table `table`
/// the cut holds (every row, or those changed since ReadState::since), from the `begin`-th
/// on, at most `max_rows` of them (the ps caps a chunk at kMaxIdsPerMessage rows and 64 MiB,
/// so its memory for a checkpoint is bounded however large its tables are); with
/// `candidates`, the ids admission was counting instead; with `evicted`, the ids an
/// incremental cut says were evicted. Answered with a RowsChunk.
struct ReadRows {
  static constexpr std::string_view kName = "ReadRows";
  /// Its reply views buffers the next request reuses (as a pull of rows).
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::uint32_t table = 0;
  std::uint64_t begin = 0;
  std::uint32_t max_rows = 0;
  bool candidates = false;
  bool evicted = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(table, begin, max_rows, candidates, evicted);
  }
};

/// Chief → ps, after a Restore with `tables_follow`: rows of table `table` (each its values,
/// then one dim of floats per name in `slot_names`, the checkpoint's optimizer slots) with
/// the step each was last touched, or with `candidates` admission counts (`counts`,
/// `steps`; `rows` empty); the ps keeps those its id sharding gives it and ignores the rest.
/// Slots named otherwise than the ps's optimizer names its own are dropped (the rows'
/// optimizer starts afresh). `updates` sets the table's update count (-1: leave it). The
/// message with `done` ends the restore: the ps turns ready.
struct RestoreRows {
  static constexpr std::string_view kName = "RestoreRows";
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::uint64_t epoch = 0;
  std::uint32_t table = 0;
  std::int64_t updates = -1;
  std::vector<std::string> slot_names;
  std::vector<std::uint64_t> ids;
  std::span<const float> rows;        ///< a tensor: ids.size() × (1 + slot_names.size()) × dim
  std::vector<std::uint32_t> steps;   ///< per id: last touched (rows) or last pulled (candidates)
  std::vector<std::uint32_t> counts;  ///< per id, candidates only
  bool candidates = false;
  bool done = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(epoch, table, updates, slot_names, ids, rows, steps, counts, candidates, done);
  }
};

// ---- replies ----------------------------------------------------------------------------

/// Answer to Pause: where this ps stands, and what its parts' optimizer state is made of.
struct PauseReply {
  static constexpr std::string_view kName = "PauseReply";
  std::int64_t global_step = 0;
  std::uint64_t epoch = 0;
  std::vector<std::uint64_t> pushes;       ///< by worker: pushes taken so far
  std::vector<std::string> slot_names;     ///< the optimizer's slots, in PartState order
  std::vector<std::string> counter_names;  ///< the optimizer's counters
  bool whole = true;  ///< the optimizer's State is all in the slots and counters
  /// The global step from which this ps knows every row its tables evicted: the earliest
  /// an incremental checkpoint's cut may be since (ReadState::since).
  std::int64_t evictions_since = 0;
  /// The furthest step a push taken since the last restore was made for (Push::local_step;
  /// -1: none). Under BoundedStaleness it may be past `global_step`: a change of workers is
  /// set for a step no push was taken for yet, so that every ps takes the same pushes of a
  /// worker that leaves (those made for earlier steps).
  std::int64_t furthest_pushed = -1;
  /// By worker: the number (Push::sequence) and series of the last push taken, 0 and 0 when
  /// none was numbered. The cut names the furthest ps's (ReadState::last_sequences).
  std::vector<std::uint64_t> last_sequences = {};
  std::vector<std::uint64_t> last_series = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, epoch, pushes, slot_names, counter_names, whole, evictions_since,
            furthest_pushed, last_sequences, last_series);
  }
};

/// Answer to ReadState: this ps's part of the cut.
struct StateReply {
  static constexpr std::string_view kName = "StateReply";
  std::int64_t global_step = 0;
  std::vector<std::int64_t> pacer;  ///< SyncPolicy::save's
  std::vector<PartState> parts;     ///< every part held here, in part order

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, pacer, parts);
  }
};

/// Answer to ReadRows: one chunk of a table's rows at the cut (or of its candidates).
struct RowsChunk {
  static constexpr std::string_view kName = "RowsChunk";
  std::uint64_t total = 0;   ///< rows (or candidates) at the cut: read until `begin` reaches it
  std::int64_t updates = 0;  ///< the table's update count on this ps
  std::vector<std::string> slot_names;  ///< the row-wise optimizer's, in row order
  std::vector<std::uint64_t> ids;
  std::span<const float> rows;        ///< a tensor: ids.size() × stride (empty for candidates)
  std::vector<std::uint32_t> steps;   ///< per id: last touched (rows) or last pulled (candidates)
  std::vector<std::uint32_t> counts;  ///< per id, candidates only
  std::int64_t since = -1;            ///< the cut's ReadState::since

  template <class Archive>
  void serialize(Archive& archive) {
    archive(total, updates, slot_names, ids, rows, steps, counts, since);
  }
};

}  // namespace pulley
