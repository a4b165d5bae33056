// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>

namespace pulley {

/// How a client (worker, chief, evaluator) calls the ps tasks: its requests' deadlines (a
/// request past its deadline fails with `kDeadlineExceeded` and is cancelled: the transport
/// no longer touches its buffers), and a worker's gradient clipping.
struct ClientOptions {
  /// For requests a ps answers at once (push, ungated pull, stats, initialize).
  std::chrono::milliseconds request_timeout{std::chrono::seconds(60)};
  /// For requests that wait on other tasks: readiness, sync tokens, step-gated pulls.
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(30)};
  /// A wait with no progress for this long logs what the ps tasks wait for, and again each
  /// time as long again passes ("step 812: waiting for worker:1 (last heard 14.2 s ago)").
  std::chrono::milliseconds stall_report{std::chrono::seconds(10)};
  /// Workers: when positive, each push's gradients are scaled down to this global norm
  /// (the L2 norm over every variable together) when theirs is larger, as TensorFlow's
  /// `clip_by_global_norm` before `apply_gradients`; a gradient that explodes then moves
  /// the parameters no further than a normal one. 0: no clipping.
  float clip_norm = 0.0F;
  /// How long a worker (and the role runner's chief and evaluator) waits for lost ps tasks
  /// to be back and restored, retrying, before it fails naming the ps; and how long the
  /// role runner's ps tasks wait for a lost chief to come back (ParameterServer::set_chief_wait).
  std::chrono::milliseconds recovery_timeout{std::chrono::minutes(5)};
  /// The chief: how long a lost ps may stay away before the job goes on without it (it
  /// leaves for good: its shard is placed on the other ps tasks, restored from the newest
  /// checkpoint: ChiefLoop; with copies, `TcpOptions::replicas`, moved from the copies that
  /// served it meanwhile, once 3 ps tasks or more are members). 0: never; the job waits for
  /// it as long as `recovery_timeout` (with copies, the copies serve until a process takes
  /// its place). Below `recovery_timeout`, so that the other tasks still wait when it happens.
  std::chrono::milliseconds ps_leave_after{0};
  /// The chief: a worker the ps tasks hold lost for this long (its heartbeats stopped)
  /// leaves the job for good: the sync policies stop counting it (Chief::change_workers),
  /// and a restarted process in its place asks to join again. 0: never; the job goes on
  /// without it as a lost worker, and takes it back when it returns.
  std::chrono::milliseconds worker_leave_after{0};
  /// Workers run by the role runner: how often they tell every ps they are alive
  /// (HeartbeatSender). Keep it well below the ps tasks' worker timeout.
  std::chrono::milliseconds heartbeat_interval{std::chrono::seconds(1)};
};

}  // namespace pulley
