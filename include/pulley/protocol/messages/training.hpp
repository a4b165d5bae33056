// SPDX-License-Identifier: MIT
#pragma once

/// The messages of setting up and training (protocol/messages.hpp lists every message):
/// the chief's registration of the model and its initial values, a client's wait for them,
/// a worker's token, pulls and pushes, and the end of training; the requests, then their
/// replies.

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/core/node.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/messages/fields.hpp"
#include "pulley/protocol/token.hpp"

namespace pulley {

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
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// Worker → the pacing ps (the lowest member, ps 0 while none left): take a sync token before a
/// step (TF's `sync_token_queue.dequeue()`). Waits while the sync policy has no token to give this
/// worker.
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
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};
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
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};
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

/// Chief → ps: training is over. Every request waiting there and every later one is
/// answered `kOutOfRange` ("training finished"), or `kAborted` with `reason` when the chief
/// gave up, so each task learns how the job ended; the ps then stops serving.
///
/// With `restart`, training goes on without this process: the chief ruled it lost (a job
/// with copies: it was stopped, hung or cut off past the copy timeout) and it came back.
/// Both copies it holds end, answering `kUnavailable`, and the process serves again empty,
/// as one started in its place would, for the chief to take it back (Chief::take_back).
struct Shutdown {
  static constexpr std::string_view kName = "Shutdown";
  static constexpr RoleSet kSenders{Node::Role::kChief};
  bool aborted = false;  ///< the job failed: tasks end with an error, not with success
  std::string reason;    ///< why it was aborted
  bool restart = false;  ///< the job gave this process up: it starts again empty

  template <class Archive>
  void serialize(Archive& archive) {
    archive(aborted, reason, restart);
  }
};

// ---- replies ----------------------------------------------------------------------------

/// Answer to Register and WaitReady: the registered variables and where they live, so a
/// client can check that its model is the one the chief registered.
struct PlacementReply {
  static constexpr std::string_view kName = "PlacementReply";
  std::vector<VariableSpec> variables;
  Placement placement;
  std::uint64_t epoch = 0;                 ///< restores so far: requests carry it
  std::vector<std::string> slot_names;     ///< the optimizer's slots, in PartState order
  std::vector<std::string> counter_names;  ///< the optimizer's counters
  std::vector<TableSpec> tables = {};      ///< the registered embedding tables
  /// Where the ps's IdSharding puts the tables' rows (`id_sharding_fingerprint`): a worker
  /// with another one is refused when it gets ready.
  std::uint64_t id_sharding = 0;
  std::vector<std::uint32_t> members = {};  ///< the job's ps tasks, ascending (Register::members)
  std::uint64_t membership = 0;             ///< their version (Register::membership)
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

}  // namespace pulley
