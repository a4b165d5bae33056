// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "pulley/core/node.hpp"
#include "pulley/transport/wire/frame.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// A ps process that a task of a job with copies (`TcpOptions::replicas`) reached before
/// and cannot reach now, as the task asks whoever rules on lost ps processes
/// (`TcpOptions::copy_referee`); or one it reaches where it never reached the process it
/// gave up there, asked whether it is that one (a process ruled lost, continued since).
struct LostProcess {
  std::uint32_t ps = 0;        ///< the ps task
  std::uint64_t process = 0;   ///< the process this task reached there (wire::Welcome::server); 0: none yet
  std::string why;             ///< what this task saw ("its address refuses connections")
  /// The task reaches `process` now and asks whether the job ruled it lost (a process it
  /// never saw given up, continued since): "not lost" is the common answer, and not news.
  bool reached = false;
};

/// Rules whether a LostProcess is lost for the whole job: calls `answer(true)` (it is: give
/// its copies up, as every task of the job does once it meets the same) or `answer(false)`
/// (it is not, or the one who rules cannot say: wait for it, as for a ps without copies),
/// exactly once, on any thread, now or later.
using CopyReferee = std::function<void(const LostProcess& lost, std::function<void(bool)> answer)>;

/// How a Tcp client connects.
struct TcpOptions {
  /// The job this task belongs to and its shared secret, proved to every ps in the
  /// handshake (transport/wire/handshake.hpp).
  Credentials credentials;
  /// Total time to wait for a ps that is not up yet, when the transport is made, before
  /// giving up with kUnavailable.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  /// First pause between those connection attempts; doubles up to one second.
  std::chrono::milliseconds initial_backoff{std::chrono::milliseconds(20)};
  /// Longest one connection attempt may take, handshake included (a host that drops packets
  /// would otherwise hold it for the kernel's two minutes); also bounds each reconnection
  /// attempt.
  std::chrono::milliseconds attempt_timeout{std::chrono::seconds(2)};
  /// What replies may claim, checked before anything is allocated for them.
  wire::FrameLimits limits;
  /// Copies of each ps's shard the job keeps besides the ps's own (`--ps-replicas`): 0, or
  /// 1 (ps k's shard is also held by ps (k + 1) mod P: ps/shard_copies.hpp). With 1, what
  /// changes a shard goes to both copies and is answered once both hold it; reads go to
  /// one; a copy whose ps is lost for good is dropped and the other serves alone (Tcp).
  /// Every task of a job must say the same, and the ps tasks must hold the copies.
  std::uint32_t replicas = 0;
  /// With replicas, when the transport is made: how long each ps process is waited for at
  /// first, in connection attempts with backoff, at least one (0, the default:
  /// `connect_timeout`). A copy not reached then whose twin was is tried once more (one
  /// attempt), then dropped (as the referee rules, asked once per process); a shard neither
  /// of whose copies was reached is waited for `connect_timeout` by whichever copy comes
  /// first, as a ps without copies (one process may be gone, the other stopped a while). The
  /// role runner's tasks started in a job under way (a chief in a lost one's place, a worker
  /// started again) make one attempt at first (1 ms: each attempt is bounded by
  /// `attempt_timeout`), as a task in training asks the chief at its first refused attempt.
  std::chrono::milliseconds copy_connect_timeout{0};
  /// With replicas: how long WaitReady waits for ps k's own copy once the other copy is
  /// ready, so that every task reads from the same copy when both are well; a copy still
  /// not ready then (a process started in a lost ps's place, holding nothing) is dropped.
  std::chrono::milliseconds copy_grace{std::chrono::seconds(5)};
  /// With replicas: how long a copy whose connection broke may stay out of reach (attempts
  /// time out: a host gone, a process stopped) before it is dropped and the other copy
  /// serves alone. A copy whose address refuses connections is dropped at once. A copy
  /// whose connection stays open but that sends nothing this long while calls wait on it,
  /// a question it answers at once included (asked at half of it), counts as broken since
  /// its last byte (a process stopped or hung). Keep it
  /// longer than the stalls a ps may live through. With a `copy_referee`, these are the
  /// moments the task asks it, and it drops the copy only when told to (the role runner's
  /// chief rules a silent process lost once its own looks saw nothing this long).
  std::chrono::milliseconds copy_timeout{std::chrono::seconds(30)};
  /// With replicas: who rules that a ps process this task cannot reach (its address
  /// refuses connections, or it stays out of reach for `copy_timeout`) is lost for the
  /// whole job, so that every task gives the same copies up and none gives up a copy that
  /// the others still write to: a task cut off from a ps that the rest of the job reaches
  /// (a network partition) waits for it instead, as for a ps without copies. The role
  /// runner sets it: the chief rules (runner/copy_rulings.hpp). Unset, each task decides
  /// alone, which guards against lost processes and hosts, not partitions. A process
  /// started in a lost one's place, or a copy still not ready `copy_grace` after its twin,
  /// is dropped without asking: nobody can write to a process that holds nothing. A task
  /// that reaches a ps process late (its first attempt missed) or again where it never
  /// reached the one it gave up asks it too, and gives that process up if it is lost.
  CopyReferee copy_referee;
  /// Reach a ps on this host through its local socket (Linux: a Unix-domain socket with an
  /// abstract name, transport/detail/sockets.hpp) rather than TCP loopback: the same
  /// frames, handshake and limits, at a fraction of TCP's cost per byte. Tried first on
  /// every connection to an address of this host, TCP after it when the ps has none. Off:
  /// TCP always (`--no-local-sockets`), e.g. where the tasks' TCP traffic must cross a
  /// firewall rule or a traffic shaper on this host.
  bool local_sockets = true;
  /// On a local socket, move the connection's bytes through memory shared with the ps once
  /// the handshake proved it (Linux: a ring buffer in a sealed memory file each way, handed
  /// over the socket; transport/detail/shared_rings.hpp): a frame then crosses in one copy
  /// at each end and without a system call while both ends are busy, and the socket carries
  /// only wake-ups and the sign of a lost peer. Each connection holds 2 MiB of memory for
  /// it. Used where the ps takes it too (TcpServerOptions::shared_memory); off:
  /// `--no-shared-memory`.
  bool shared_memory = true;
  /// Log what changes about the copies (a copy dropped, held elsewhere, served again). A
  /// task that reaches the same ps tasks through a second transport (the role runner's
  /// heartbeats) turns it off there, so that each change is said once per task.
  bool logs_copies = true;
};

/// How a TcpServer treats its clients. Every limit protects the ps from a client that is
/// careless or hostile; README's "Limits" lists them with their defaults.
struct TcpServerOptions {
  /// The job this ps belongs to and its shared secret: a client must prove both in the
  /// handshake before it may send a request (transport/wire/handshake.hpp). A server with
  /// an empty secret refuses to start unless `allow_no_secret` says so.
  Credentials credentials;
  /// Serve with an empty secret: the handshake then checks only the job's name and the
  /// task, and anyone who knows the name (the default is "pulley") may join. For a port
  /// only trusted peers can reach; the server logs it when it starts.
  bool allow_no_secret = false;
  /// What a request frame may claim, checked before anything is allocated for it. (A frame
  /// also may not carry more tensor bytes than the service holds:
  /// `Service::max_request_payload`.)
  wire::FrameLimits frames;
  /// Bytes the ps may hold for all its connections together: receive buffers, payloads
  /// being received, and copies of replies a client has not read when a push is about to
  /// change the parameters they show. A connection whose frame or reply would overdraw it
  /// is closed, with a log line naming this limit.
  std::uint64_t max_buffered_bytes = std::uint64_t{1} << 30U;
  /// Connections of the job's own tasks (past the handshake) at most; one more is refused
  /// with a log line.
  std::uint32_t max_connections = 1024;
  /// Connections still in the handshake at most (not yet proven to be the job's); one more
  /// is closed at once. Counted apart from `max_connections`: a flood of connections that
  /// never prove the secret cannot take the slots of the job's tasks.
  std::uint32_t max_handshaking = 64;
  /// The job's tasks by role, from its cluster spec ({{Node::Role::kWorker, 2}, ...}): a
  /// client that proves the secret but claims a task outside them (worker:7 of 2 workers,
  /// a role missing here) is refused at the handshake. Empty: any task is accepted. A ps
  /// task connects as a client only where kPs is listed (the chief's JoinDesk, which new ps
  /// tasks ask to join; ps tasks do not call each other).
  std::map<Node::Role, std::uint32_t> tasks;
  /// A connection must complete the handshake within this, or is closed.
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(10)};
  /// A frame begun must be complete within this, plus its payload at `min_receive_rate`, or
  /// the connection is closed (a client that stalls, or trickles a frame in).
  std::chrono::milliseconds frame_timeout{std::chrono::seconds(60)};
  /// Bytes per second a frame's payload must at least arrive at (see `frame_timeout`).
  std::uint64_t min_receive_rate = std::uint64_t{1} << 20U;
  /// A connection with no request in the ps, no reply unsent and no frame begun for this
  /// long is closed (its client reconnects on its next call).
  std::chrono::milliseconds idle_timeout{std::chrono::minutes(10)};
  /// A connection stops being read while more than this many bytes of its replies wait to
  /// be written (a client that does not read cannot grow the ps's memory).
  std::uint64_t max_unsent_bytes = std::uint64_t{64} << 20U;
  /// A connection stops being read while this many of its requests are handled but not
  /// answered (pulls waiting for a step, token requests), since their replies come all at
  /// once later. A pulley client has at most three in flight per ps.
  std::uint32_t max_unanswered_requests = 16;
  /// Once the service stopped, how long the server goes on answering (every request then
  /// gets the service's final answer, e.g. "training finished") before it ends while
  /// clients stay connected: clients in the middle of a step hear how training ended
  /// instead of finding the connection closed. It ends sooner when every client has left
  /// and no worker is awaited (`end_grace` after that).
  std::chrono::milliseconds linger{std::chrono::seconds(60)};
  /// Once the service stopped and every client has left, how long the server still takes
  /// connections before it ends: a client whose link broke just as training ended (the
  /// answer saying so lost with it) connects again and hears how training ended, instead
  /// of finding nobody there and waiting for a lost ps. A client still connected when it
  /// runs out starts it anew once it leaves; `linger` still bounds the whole. Before it,
  /// the server waits for every worker the service still awaits (ParameterServer::
  /// awaits_workers: heard, neither leaving nor silent for the worker timeout: a worker
  /// stopped a while, or cut off, as training ended).
  std::chrono::milliseconds end_grace{std::chrono::seconds(1)};
  /// How long the server goes on once every client has left while the service still runs
  /// (the chief died before it ended training, say): then `run` returns and `orphaned()`
  /// says so, so the task can fail instead of waiting for ever. Counted only once a
  /// request was handled: a ps may wait as long as it takes for its job to start.
  std::chrono::milliseconds orphaned_after{std::chrono::minutes(5)};
  /// A task is one process: a connection that claims a task (worker:3) from another
  /// process (`wire::Hello::incarnation`) while a connection of the task's process was
  /// heard within this long is refused with kUnavailable, so that nobody can act as a live
  /// worker (take its tokens, push in its name). A process started again in place of a dead
  /// one gets in once the old one's connections are closed (a killed process's are at once)
  /// or silent this long (a lost host's, whose connections are then closed), retrying until
  /// then; a hello that names no process is refused. Keep it at least the worker timeout;
  /// 0 lets any process claim any task.
  std::chrono::milliseconds takeover_after{std::chrono::seconds(5)};
  /// Also listen on a local socket (Linux: the abstract name of this TCP address and port,
  /// transport/detail/sockets.hpp), which clients on this host reach it through (see
  /// TcpOptions::local_sockets). Every limit above holds on it as on TCP. A name another
  /// process holds already is skipped with a log line, and TCP serves alone.
  bool local_socket = true;
  /// Take a local client's offer to move its connection's bytes through shared memory
  /// (TcpOptions::shared_memory). Both rings of such a connection (1 MiB each) are charged
  /// to `max_buffered_bytes`; where the budget cannot hold it, the connection stays on its
  /// socket.
  bool shared_memory = true;
};

}  // namespace pulley
