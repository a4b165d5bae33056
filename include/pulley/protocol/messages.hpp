// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/token.hpp"

namespace pulley {

// The protocol between clients (workers, the chief, the evaluator) and ps tasks. Every
// transport carries exactly these structs: in-process they are moved, over TCP they are
// encoded. A message is declared here and nowhere else:
//
//   - `kName`, for logs and errors;
//   - `serialize(archive)` lists its fields in wire order, for cereal and for pulley's own
//     walkers. A `std::span<const float>` field is a tensor: its size travels with the
//     other fields, its values in the frame's payload, in field order, so that a sender
//     writes them from its own buffers and a receiver reads them into place;
//   - `kChangesParameters = true` on a request that may change the ps's parameters, by
//     itself or by what it sets off (a push held, a step that waited for a worker found
//     lost): a transport must not let a reply still being sent see them change;
//   - `kSenders`, on a request: the roles whose tasks may send it (the ps refuses it from
//     any other with `kPermissionDenied`): only the chief registers, initializes and ends
//     training, only workers take tokens and push, evaluators only read.
//
// Adding a message is its declaration here, its place in Request or Response, and its
// handler in the ps (an `on` overload in ps/parameter_server.hpp, which hands it to the
// part that owns what it reads or changes).
//
// Tensors are views, never owned vectors. A view in a request stays valid until its call
// is answered or cancelled. A view in a reply stays valid and unchanged until the service
// handles a request that `changes_parameters` (see Responder, concepts/service.hpp): a
// transport copies it to the caller's destination, or writes it onto the wire, before then.

/// Values for one part, addressed by its global index in `Placement::parts`.
struct PartValues {
  std::uint32_t part = 0;
  std::span<const float> values;  ///< a tensor

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, values);
  }
};

/// One part with its optimizer state, as a checkpoint reads and restores it: its values, its
/// optimizer slots (one value per element each, in the order the ps names them) and its
/// counters.
struct PartState {
  std::uint32_t part = 0;
  std::span<const float> values;               ///< a tensor
  std::vector<std::span<const float>> slots;   ///< tensors
  std::vector<std::int64_t> counters;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, values, slots, counters);
  }
};

/// The most ids one PullRows or Push carries to one ps, over all its tables (2 MiB of ids,
/// half the metadata a TCP frame may hold): a client splits a larger row pull into several
/// and refuses a larger push (its batch is too large), a ps refuses more.
inline constexpr std::size_t kMaxIdsPerMessage = std::size_t{1} << 18U;
/// The most bytes of rows of one table that one PullRows answer or Push carries: a client
/// splits larger row pulls, a ps refuses more.
inline constexpr std::size_t kMaxRowBytesPerMessage = std::size_t{256} << 20U;

/// Rows of one embedding table: which ids, and in a push one row of the table's dim floats
/// per id. The ids ride in the metadata (8 bytes each); the rows are a tensor.
struct TableRows {
  std::uint32_t table = 0;          ///< index into the model's tables
  std::vector<std::uint64_t> ids;   ///< distinct
  std::span<const float> values;    ///< a tensor: ids.size() × dim (empty in a pull)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(table, ids, values);
  }
};

/// Rows `rows` (relative to the variable, inside the part) of part `part`.
struct Slice {
  std::uint32_t part = 0;
  RowRange rows;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(part, rows);
  }
};

// ---- requests ---------------------------------------------------------------------------

/// Chief → every ps: the model's variables. Each ps computes the placement with its Sharding
/// policy and answers with it, so the chief can check that all ps tasks agree. Repeating the
/// same registration is harmless; a different one is refused.
///
/// A registration of a later membership (a ps task left the job for good) places the same
/// model over `members` (sharding/rebalance.hpp): each member drops what it held and waits,
/// unready, for the Restore that fills its new share.
struct Register {
  static constexpr std::string_view kName = "Register";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  /// A registration of a later membership drops what the ps held (and may replace the
  /// copy a ShardCopies holds): no reply may still view it.
  static constexpr bool kChangesParameters = true;
  std::vector<VariableSpec> variables;
  /// The model's embedding tables: each ps creates the rows it holds as they are first
  /// pulled, from `table_seed` (no Initialize).
  std::vector<TableSpec> tables = {};
  std::uint64_t table_seed = 0;
  /// The ps tasks of the job, ascending task indices; empty: every ps task of the cluster.
  std::vector<std::uint32_t> members = {};
  /// The membership's version: 0 for the cluster's first shape, one more for each change.
  std::uint64_t membership = 0;
  /// Every ps task's address by task index, once a ps joined beyond the cluster spec
  /// (Chief::join); empty: the spec's. The placement is computed over this many tasks.
  std::vector<std::string> ps_addresses = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(variables, tables, table_seed, members, membership, ps_addresses);
  }
};

/// Chief → ps: initial values of parts this ps holds. Each part is initialized once.
struct Initialize {
  static constexpr std::string_view kName = "Initialize";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  static constexpr bool kChangesParameters = true;
  std::vector<PartValues> parts;
  /// True: the ps is paused for the sender's checkpoint cut from the moment it is
  /// initialized (pushes are held until Resume), so the chief reads global step 0 exactly
  /// however fast the workers start.
  bool hold = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(parts, hold);
  }
};

/// Client → ps: answered with the placement once every part on this ps is initialized.
struct WaitReady {
  static constexpr std::string_view kName = "WaitReady";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief, Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// Worker → the pacing ps (the lowest member, ps 0 while none left): take a sync token before a step (TF's `sync_token_queue.dequeue()`).
/// Waits while the sync policy has no token to give this worker.
struct TakeToken {
  static constexpr std::string_view kName = "TakeToken";
  static constexpr RoleSet kSenders{Node::Role::kWorker};
  std::uint32_t worker = 0;
  std::uint64_t epoch = 0;  ///< the restore the worker knows of (PlacementReply::epoch)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(worker, epoch);
  }
};

/// Client → ps: read slices. Waits until the ps has completed `min_step` global steps, so a
/// worker holding a token reads parameters that include every update its token requires.
/// A pull that waits is answered the moment the step completes, before any later push.
struct Pull {
  static constexpr std::string_view kName = "Pull";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief, Node::Role::kEvaluator};
  std::int64_t min_step = 0;
  std::vector<Slice> slices;
  /// The restore the client knows of: a pull that waits for a step of an earlier one is
  /// refused (`kFailedPrecondition`), as that step means something else now.
  std::uint64_t epoch = 0;
  /// From a worker: `TokenReply::pushes_taken` of its latest token, the pushes of its task
  /// the pacing ps had taken. A ps that took fewer, asked for the next step without this
  /// worker's push of the one in progress, learns that the push was lost on the way here
  /// and counts it as taken (on_pull_ahead: every ps then counts the same pushes).
  std::uint64_t pushes_paced = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(min_step, slices, epoch, pushes_paced);
  }
};

/// Worker → ps: gradients computed from parameters of `local_step`. Every worker pushes to
/// every ps once per step (possibly with no parts): the message also counts towards the
/// ps's global step (`SyncPolicy::on_push`).
struct Push {
  static constexpr std::string_view kName = "Push";
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker};
  std::uint32_t worker = 0;
  std::int64_t local_step = 0;
  std::vector<PartValues> gradients;
  /// The restore the worker knows of: a push of an earlier one is refused.
  std::uint64_t epoch = 0;
  /// Numbers the worker's pushes (0: none): a push sent again after a lost connection (the
  /// same push: same number, same gradients) is answered as the first was, counted once.
  std::uint64_t sequence = 0;
  /// Gradient rows of embedding tables held here, duplicates summed by the worker; they
  /// share the push's verdict (stale rows are dropped with its parts).
  std::vector<TableRows> rows = {};
  /// Whose numbers `sequence` counts in: drawn at random by each client (0: none). A push
  /// numbered below the last one the ps took of the same series is an old copy that came
  /// late on a connection its worker gave up (the worker sent it again and went on): it is
  /// refused, never counted.
  std::uint64_t series = 0;
  /// The token it was made for said its step is a refill step (Token::refill).
  bool refill = false;
  /// No element of `gradients` is larger in magnitude, as the client that made the push
  /// measured it while checking it finite (kOrdinaryMagnitude, or +infinity: not known).
  /// Not on the wire: it serves a ps in the client's own process, which trusts its checks
  /// (RequestContext::tensors_finite); over TCP the ps measures the push as it reads it.
  float largest = std::numeric_limits<float>::infinity();

  template <class Archive>
  void serialize(Archive& archive) {
    archive(worker, local_step, gradients, epoch, sequence, rows, series, refill);
  }
};

/// Client → ps: read rows of embedding tables (`TableRows::values` empty), gated on
/// `min_step` and `epoch` as Pull is. Rows not held yet are created (or read as their
/// initial value until admitted), so it counts as changing the ps.
struct PullRows {
  static constexpr std::string_view kName = "PullRows";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief, Node::Role::kEvaluator};
  static constexpr bool kChangesParameters = true;
  std::int64_t min_step = 0;
  std::uint64_t epoch = 0;
  std::vector<TableRows> tables;  ///< distinct ids per table, each table at most once
  /// Only what the pull does to the rows (a worker's creates, admits and touches them), no
  /// rows back: the ps answers Ack. A client sends it to the copy of a shard it does not
  /// read from, which must see the same pulls (ShardCopies).
  bool touch_only = false;
  /// From a worker: as Pull::pushes_paced.
  std::uint64_t pushes_paced = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(min_step, epoch, tables, touch_only, pushes_paced);
  }
};

/// Any client → ps: counters for monitoring and tests.
struct GetStats {
  static constexpr std::string_view kName = "GetStats";
  /// A worker found lost on the way may complete the step that waited for it.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief, Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// Worker or chief → every ps, every second or so from a thread of its own
/// (`HeartbeatSender`, heartbeat.hpp): the task is alive. A ps that heard a worker once and
/// then hears nothing for its worker timeout holds it lost: the sync policy stops waiting
/// for it (`SyncPolicy::on_worker_lost`) until its heartbeats come back. A chief silent for
/// as long is held lost too: the ps keeps the model and waits for a chief to come back
/// (ParameterServer::set_chief_wait), then gives up and ends training as aborted. Answered
/// with a StatsReply, whose `lost` and `chief_lost` tell the task who is gone.
struct Heartbeat {
  static constexpr std::string_view kName = "Heartbeat";
  /// Another worker found lost on the way may complete the step that waited for it.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief};
  std::uint32_t worker = 0;  ///< the sender's task index (its worker index; 0 for the chief)
  /// The worker ends (its training is over): the ps forgets it instead of holding it lost
  /// once it is quiet.
  bool leaving = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(worker, leaving);
  }
};

/// Chief → ps: training is over. Every request waiting there and every later one is
/// answered `kOutOfRange` ("training finished"), or `kAborted` with `reason` when the chief
/// gave up, so each task learns how the job ended; the ps then stops serving.
struct Shutdown {
  static constexpr std::string_view kName = "Shutdown";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  bool aborted = false;  ///< the job failed: tasks end with an error, not with success
  std::string reason;    ///< why it was aborted

  template <class Archive>
  void serialize(Archive& archive) {
    archive(aborted, reason);
  }
};

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

/// Chief → a paused ps: once it has taken exactly `until[w]` pushes of each worker w (taking
/// held ones as needed, in order), answer with its state: every part it holds with its
/// optimizer state, and the sync policy's. With the largest counts over all ps tasks as
/// `until`, every ps answers at the same cut.
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

  template <class Archive>
  void serialize(Archive& archive) {
    archive(until, since, forget_evictions_before);
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
  return std::max<std::size_t>(1, std::min(kMaxIdsPerMessage, kBytes / (std::max<std::size_t>(stride, 1) * sizeof(float))));
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
  std::span<const float> rows;          ///< a tensor: ids.size() × (1 + slot_names.size()) × dim
  std::vector<std::uint32_t> steps;     ///< per id: last touched (rows) or last pulled (candidates)
  std::vector<std::uint32_t> counts;    ///< per id, candidates only
  bool candidates = false;
  bool done = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(epoch, table, updates, slot_names, ids, rows, steps, counts, candidates, done);
  }
};

/// A new task → the chief (its JoinDesk, runner/join_desk.hpp; never a ps). The task index
/// is the one its handshake proved.
///   - A ps, started beyond the job's ps tasks, serves at `address` and asks to take a
///     share of the model. Its index must be the next one (the count of ps tasks the job
///     has known; a lower one, a joined ps started again, is answered and left alone: the
///     chief takes it back by a rollback, as any ps started again). Answered with an Ack
///     once the chief has queued it: the chief takes it in as soon as it is free
///     (Chief::join; ChiefLoop), which registers the model on it.
///   - A worker (no address) asks to train with the job: an index that is not one of the
///     job's workers (the next one, or one that left). Answered kUnavailable while it waits
///     (ask again), a JoinReply once the chief counted it in (Chief::change_workers, as
///     soon as it is free): the ps tasks then let it connect.
struct Join {
  static constexpr std::string_view kName = "Join";
  static constexpr RoleSet kSenders{Node::Role::kPs, Node::Role::kWorker};
  std::string address;  ///< host:port where the new ps serves (a ps's Join)

  template <class Archive>
  void serialize(Archive& archive) {
    archive(address);
  }
};

/// A task of the job → the chief (its JoinDesk, runner/join_desk.hpp; never a ps): take it
/// out of the job, which goes on without it (the operator sent its process SIGTERM: a job
/// scaled down). The task index is the one its handshake proved.
///   - A worker: the chief takes it out of the job's workers (Chief::change_workers) as
///     soon as it is free; it trains until then, and its token request of the first step
///     the job counts it no more is refused (kPermissionDenied): then it ends.
///   - A ps: the chief moves its share to the other ps tasks through one cut, nothing
///     trained lost (Chief::retire); then it ends.
/// Answered LeaveReply (out or not yet: ask again), or kFailedPrecondition when it cannot
/// leave (the job's last worker or ps task, or the others refused to take its share).
struct Leave {
  static constexpr std::string_view kName = "Leave";
  static constexpr RoleSet kSenders{Node::Role::kPs, Node::Role::kWorker};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A task about to join, started with the chief's address alone (`--join --chief-host`,
/// no cluster spec: under Slurm a job step of its own, say) → the chief's JoinDesk: the
/// job's shape now, from which it makes its cluster spec and takes the next task index of
/// its role (an evaluator: the ps tasks to read from). It asks as task 0 of its role (it
/// has no index yet): the desk answers whoever proved the job's secret. Answered ShapeReply.
struct Shape {
  static constexpr std::string_view kName = "Shape";
  static constexpr RoleSet kSenders{Node::Role::kPs, Node::Role::kWorker, Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A worker or the evaluator → the chief's JoinDesk (never a ps), in a job whose ps tasks
/// keep copies of each other's shards (`--ps-replicas 1`): process `process` of ps `ps`
/// (wire::Welcome::server; 0: one this task never reached), which this task reached
/// before, is out of its reach (`why`: its address refuses connections, or it stayed out of
/// reach for the copy timeout). Is it lost for the job, so that its copies are given up?
/// The chief rules by its own look at the address (runner/copy_rulings.hpp): lost if it
/// refuses connections, something else answers there, or it stays silent for the copy
/// timeout; not lost if that very process serves there. Answered LostPsReply, or
/// kUnavailable while the chief looks (ask again).
struct LostPs {
  static constexpr std::string_view kName = "LostPs";
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kEvaluator};
  std::uint32_t ps = 0;
  std::uint64_t process = 0;
  std::string why;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(ps, process, why);
  }
};

/// Chief → every ps, paused (Pause): the job's workers are `workers` (task indices,
/// ascending) from global step `from_step` on: workers joined, or left for good. Each ps
/// counts them (SyncPolicy::reshape) the moment its global step reaches `from_step`, and
/// lets a new worker connect at once (its requests wait until then). The chief picks a step beyond every ps's while they are
/// paused; a ps already there refuses it (kFailedPrecondition). A later ChangeWorkers
/// replaces one still waiting for its step; one with no workers takes back the one of
/// `from_step` (another ps refused it). Under SyncReplicas every ps counts them at the
/// same step boundary (a push of that step needs a pull of it, which waits until the ps
/// is there); see BoundedStaleness for how its clocks take a change.
struct ChangeWorkers {
  static constexpr std::string_view kName = "ChangeWorkers";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  std::vector<std::uint32_t> workers;
  std::int64_t from_step = 0;
  /// The job's workers until then, as the chief has them (the cluster spec's, the first
  /// time), so that a ps that never heard them knows who leaves; empty: not known.
  std::vector<std::uint32_t> before = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(workers, from_step, before);
  }
};

/// Everything a ps task (or the chief's JoinDesk: Join, Leave, Shape, LostPs) is asked.
using Request = std::variant<Register, Initialize, WaitReady, TakeToken, Pull, Push, GetStats,
                             Shutdown, Pause, ReadState, Resume, Restore, Heartbeat, PullRows,
                             ReadRows, RestoreRows, Join, ChangeWorkers, Leave, Shape, LostPs>;

// ---- responses --------------------------------------------------------------------------

/// Success with nothing to say.
struct Ack {
  static constexpr std::string_view kName = "Ack";

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A refused or failed request.
struct ErrorReply {
  static constexpr std::string_view kName = "ErrorReply";
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(code, message);
  }
};

/// Answer to Register and WaitReady: the registered variables and where they live, so a
/// client can check that its model is the one the chief registered.
struct PlacementReply {
  static constexpr std::string_view kName = "PlacementReply";
  std::vector<VariableSpec> variables;
  Placement placement;
  std::uint64_t epoch = 0;  ///< restores so far: requests carry it
  std::vector<std::string> slot_names;     ///< the optimizer's slots, in PartState order
  std::vector<std::string> counter_names;  ///< the optimizer's counters
  std::vector<TableSpec> tables = {};      ///< the registered embedding tables
  /// Where the ps's IdSharding puts the tables' rows (`id_sharding_fingerprint`): a worker
  /// with another one is refused when it gets ready.
  std::uint64_t id_sharding = 0;
  std::vector<std::uint32_t> members = {};  ///< the job's ps tasks, ascending (Register::members)
  std::uint64_t membership = 0;        ///< their version (Register::membership)
  std::vector<std::string> ps_addresses = {};  ///< every ps task's address (Register::ps_addresses)
  /// The seed the tables' rows start from (Register::table_seed): a chief that takes over a
  /// lost one's job keeps it in its checkpoints and restores.
  std::uint64_t table_seed = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(variables, placement, epoch, slot_names, counter_names, tables, id_sharding, members,
            membership, ps_addresses, table_seed);
  }
};

/// Answer to TakeToken: the sync policy's token, and the global step (steps completed), for
/// progress and stopping.
struct TokenReply {
  static constexpr std::string_view kName = "TokenReply";
  Token token;
  std::int64_t global_step = 0;
  /// Pushes of the asking worker's task this ps had taken (since its last restore) when it
  /// handed out the token: the worker's pulls carry it (Pull::pushes_paced).
  std::uint64_t pushes_taken = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(token, global_step, pushes_taken);
  }
};

/// Answer to Pull: one tensor per requested slice, in request order.
struct PullReply {
  static constexpr std::string_view kName = "PullReply";
  std::int64_t global_step = 0;
  std::vector<std::span<const float>> values;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, values);
  }
};

/// Answer to PullRows: one tensor per requested table, its rows in the order of its ids.
struct RowsReply {
  static constexpr std::string_view kName = "RowsReply";
  std::int64_t global_step = 0;
  std::vector<std::span<const float>> rows;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, rows);
  }
};

/// Answer to Push: how many of its part gradients were dropped as stale.
struct PushReply {
  static constexpr std::string_view kName = "PushReply";
  std::uint32_t stale_parts = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(stale_parts);
  }
};

/// The chief's answer to a worker's Join once it counted the worker in: the job's
/// schedule as the chief runs it, which the new worker follows rather than what its own
/// flags give (they may derive it from another count of workers).
struct JoinReply {
  static constexpr std::string_view kName = "JoinReply";
  std::int64_t last_step = 0;            ///< training ends at this global step
  std::vector<std::uint32_t> workers;    ///< the job's workers now, ascending

  template <class Archive>
  void serialize(Archive& archive) {
    archive(last_step, workers);
  }
};

/// The chief's answer to a Leave: whether the task is out of the job now (a ps may end:
/// its share is held by the others), or the chief has it queued (ask again).
struct LeaveReply {
  static constexpr std::string_view kName = "LeaveReply";
  bool out = false;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(out);
  }
};

/// The chief's ruling on a LostPs: whether that process is lost for the job (every task
/// gives its copies up), or the chief still reaches it (the task waits for it).
struct LostPsReply {
  static constexpr std::string_view kName = "LostPsReply";
  bool lost = false;
  std::string why;  ///< the chief's reason, for the asker's log

  template <class Archive>
  void serialize(Archive& archive) {
    archive(lost, why);
  }
};

/// The chief's answer to a Shape: the job as it stands. The next ps to join takes task
/// index `ps.size()`, the next worker `next_worker`.
struct ShapeReply {
  static constexpr std::string_view kName = "ShapeReply";
  std::vector<std::string> ps;          ///< every ps task's address by task index, members or not
  std::vector<std::uint32_t> members;   ///< the job's ps tasks now, ascending
  std::vector<std::uint32_t> workers;   ///< the job's workers now, ascending
  std::uint32_t next_worker = 0;        ///< the task index the next worker to join takes

  template <class Archive>
  void serialize(Archive& archive) {
    archive(ps, members, workers, next_worker);
  }
};

/// Counters of one ps task.
struct Stats {
  std::int64_t global_step = 0;              ///< steps completed (sync) or pushes applied (async)
  std::int64_t updates_applied = 0;          ///< optimizer applications over all parts
  std::int64_t gradients_accepted = 0;       ///< part gradients taken into an accumulator
  std::int64_t stale_gradients_dropped = 0;  ///< part gradients older than the step, dropped
  std::int64_t requests_rejected = 0;        ///< requests answered with an ErrorReply
  std::int64_t bytes_pushed = 0;             ///< gradient payload received
  std::int64_t bytes_pulled = 0;             ///< parameter payload sent
  /// Pushes refused, and updates skipped, because applying them would have made a
  /// parameter or an optimizer slot non-finite.
  std::int64_t updates_refused = 0;
  /// Times a worker was held lost: heard once, then silent for the worker timeout.
  std::int64_t workers_lost = 0;
  std::int64_t table_rows = 0;          ///< embedding-table rows held now
  std::int64_t table_rows_evicted = 0;  ///< rows removed for being untouched too long
  /// Pushed rows dropped: not admitted yet (or evicted), or stale.
  std::int64_t table_rows_dropped = 0;
  /// Rows evicted, or not created, to keep a table within its max_rows (TableSpec).
  std::int64_t table_rows_capped = 0;
  /// Pushes that came again after a lost connection (the same sequence number as one taken
  /// or held): answered as the first, not counted again.
  std::int64_t pushes_repeated = 0;
  /// Pushes taken to the sync policy (each once, whatever its verdict).
  std::int64_t pushes_taken = 0;
  /// Times a worker held lost was heard from again and counted again.
  std::int64_t workers_returned = 0;
  /// Time spent applying updates (the optimizer, dense and rows), in microseconds.
  std::int64_t apply_microseconds = 0;
  /// Requests held now until the global step moves, token requests and step-gated pulls:
  /// the ps's queue (a gauge, not a counter).
  std::int64_t requests_waiting = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, updates_applied, gradients_accepted, stale_gradients_dropped,
            requests_rejected, bytes_pushed, bytes_pulled, updates_refused, workers_lost,
            table_rows, table_rows_evicted, table_rows_dropped, table_rows_capped, pushes_repeated,
            pushes_taken, workers_returned, apply_microseconds, requests_waiting);
  }
};

/// Answer to GetStats and Heartbeat: the counters, what the sync policy waits for before
/// the next step, to explain a wait that lasts ("step 812: 1 of 2 gradients in; waiting for
/// worker:1 (last heard 14.2 s ago)"), the workers this ps holds lost now, whether it holds
/// the chief lost, and whether it serves training (holds an initialized or restored model).
struct StatsReply {
  static constexpr std::string_view kName = "StatsReply";
  Stats stats;
  std::string waiting_for;
  std::vector<std::uint32_t> lost;  ///< workers held lost, ascending
  bool chief_lost = false;          ///< the chief's heartbeats stopped, and no chief is back yet
  bool ready = false;               ///< the ps serves training (a new chief goes on from it)
  std::uint64_t epoch = 0;          ///< the restores it has seen (a new chief needs them alike)
  /// The job's ps tasks as this ps knows them (empty before registration), and their
  /// version: how a client that lost a ps learns whether the job went on without it.
  std::vector<std::uint32_t> members = {};
  std::uint64_t membership = 0;
  /// Every ps task's address, once one joined beyond the cluster spec (Register::ps_addresses).
  std::vector<std::string> ps_addresses = {};
  /// The job's workers, ascending, once they changed (ChangeWorkers); empty: the spec's.
  std::vector<std::uint32_t> workers = {};

  template <class Archive>
  void serialize(Archive& archive) {
    archive(stats, waiting_for, lost, chief_lost, ready, epoch, members, membership, ps_addresses, workers);
  }
};

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

  template <class Archive>
  void serialize(Archive& archive) {
    archive(global_step, epoch, pushes, slot_names, counter_names, whole, evictions_since, furthest_pushed);
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
  std::uint64_t total = 0;    ///< rows (or candidates) at the cut: read until `begin` reaches it
  std::int64_t updates = 0;   ///< the table's update count on this ps
  std::vector<std::string> slot_names;  ///< the row-wise optimizer's, in row order
  std::vector<std::uint64_t> ids;
  std::span<const float> rows;          ///< a tensor: ids.size() × stride (empty for candidates)
  std::vector<std::uint32_t> steps;     ///< per id: last touched (rows) or last pulled (candidates)
  std::vector<std::uint32_t> counts;    ///< per id, candidates only
  std::int64_t since = -1;              ///< the cut's ReadState::since

  template <class Archive>
  void serialize(Archive& archive) {
    archive(total, updates, slot_names, ids, rows, steps, counts, since);
  }
};

/// Everything a ps task answers.
using Response = std::variant<Ack, ErrorReply, PlacementReply, TokenReply, PullReply, PushReply,
                              StatsReply, PauseReply, StateReply, RowsReply, RowsChunk, JoinReply, LeaveReply,
                              ShapeReply, LostPsReply>;

// ---- what follows from the declarations ---------------------------------------------------

/// True for a message declared with `kChangesParameters = true`.
template <class Message>
inline constexpr bool changes_parameters_v = [] {
  if constexpr (requires { Message::kChangesParameters; }) {
    return Message::kChangesParameters;
  } else {
    return false;
  }
}();

/// The roles that may send `request` (its declared `kSenders`).
inline RoleSet senders(const Request& request) noexcept {
  return std::visit([](const auto& m) { return std::remove_cvref_t<decltype(m)>::kSenders; },
                    request);
}

/// True if handling `request` may change the ps's parameters.
inline bool changes_parameters(const Request& request) noexcept {
  return std::visit(
      [](const auto& m) { return changes_parameters_v<std::remove_cvref_t<decltype(m)>>; },
      request);
}

/// The declared name of the message a Request or Response holds.
template <class Variant>
std::string_view message_name(const Variant& message) noexcept {
  return std::visit([](const auto& m) { return std::remove_cvref_t<decltype(m)>::kName; },
                    message);
}

namespace detail {

/// Walks a message's fields as its `serialize` lists them, calling `f` on each tensor.
template <class F>
class TensorWalker {
 public:
  explicit TensorWalker(F& f) : f_(f) {}

  template <class... Fields>
  void operator()(Fields&... fields) {
    (visit(fields), ...);
  }

 private:
  void visit(std::span<const float>& tensor) { f_(tensor); }
  template <class T, class A>
  void visit(std::vector<T, A>& items) {
    if constexpr (!std::is_arithmetic_v<T> && !std::is_same_v<T, std::string>) {
      for (T& item : items) visit(item);
    }
  }
  template <class T>
  void visit(T& field) {
    if constexpr (requires(TensorWalker& w) { field.serialize(w); }) field.serialize(*this);
  }

  F& f_;
};

}  // namespace detail

/// Calls `f(std::span<const float>&)` on every tensor of `message` (a message struct, a
/// Request or a Response), in wire order. `f` may re-point the views.
template <class Message, class F>
void for_each_tensor(Message& message, F&& f) {
  if constexpr (requires { std::visit([](auto&) {}, message); }) {
    std::visit([&](auto& m) { for_each_tensor(m, f); }, message);
  } else {
    detail::TensorWalker<std::remove_reference_t<F>> walker(f);
    message.serialize(walker);
  }
}

/// Returns the reply of type `T` or throws the Error the server sent.
template <class T>
T expect(Response&& response) {
  if (auto* error = std::get_if<ErrorReply>(&response)) throw Error(error->code, error->message);
  if (auto* reply = std::get_if<T>(&response)) return std::move(*reply);
  throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind " +
                                               std::string(message_name(response)) +
                                               " from server, expected " + std::string(T::kName));
}

}  // namespace pulley
