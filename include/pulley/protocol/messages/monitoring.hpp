// SPDX-License-Identifier: MIT
#pragma once

/// The messages by which tasks watch each other (protocol/messages.hpp lists every
/// message): a ps's counters (GetStats), a task's heartbeat, and the StatsReply that answers
/// both.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/core/node.hpp"

namespace pulley {

// ---- requests ---------------------------------------------------------------------------

/// Any client → ps: counters for monitoring and tests.
struct GetStats {
  static constexpr std::string_view kName = "GetStats";
  /// A worker found lost on the way may complete the step that waited for it.
  static constexpr bool kChangesParameters = true;
  static constexpr RoleSet kSenders{Node::Role::kWorker, Node::Role::kChief,
                                    Node::Role::kEvaluator};

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

// ---- replies ----------------------------------------------------------------------------

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
    archive(stats, waiting_for, lost, chief_lost, ready, epoch, members, membership, ps_addresses,
            workers);
  }
};

}  // namespace pulley
