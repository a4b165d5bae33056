// SPDX-License-Identifier: MIT
#pragma once

/// The messages that change who is in the job (protocol/messages.hpp lists every message):
/// a task that joins or leaves, or asks the job's shape (all three at the chief's JoinDesk),
/// a question whether a ps is lost, and the chief's change of the job's workers; the
/// requests, then their replies.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/core/node.hpp"

namespace pulley {

// ---- requests ---------------------------------------------------------------------------

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
/// lets a new worker connect at once (its requests wait until then). The chief picks a step beyond
/// every ps's while they are paused; a ps already there refuses it (kFailedPrecondition). A later
/// ChangeWorkers replaces one still waiting for its step; one with no workers takes back the one of
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

// ---- replies ----------------------------------------------------------------------------

/// The chief's answer to a worker's Join once it counted the worker in: the job's
/// schedule as the chief runs it, which the new worker follows rather than what its own
/// flags give (they may derive it from another count of workers).
struct JoinReply {
  static constexpr std::string_view kName = "JoinReply";
  std::int64_t last_step = 0;          ///< training ends at this global step
  std::vector<std::uint32_t> workers;  ///< the job's workers now, ascending

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
  std::vector<std::string> ps;         ///< every ps task's address by task index, members or not
  std::vector<std::uint32_t> members;  ///< the job's ps tasks now, ascending
  std::vector<std::uint32_t> workers;  ///< the job's workers now, ascending
  std::uint32_t next_worker = 0;       ///< the task index the next worker to join takes

  template <class Archive>
  void serialize(Archive& archive) {
    archive(ps, members, workers, next_worker);
  }
};

}  // namespace pulley
