// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pulley/concepts/transport.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/transport/detail/tcp_client.hpp"
#include "pulley/transport/tcp_options.hpp"

namespace pulley {

/// The TCP `Transport`: one connection per ps task. Tensors are gather-written from the
/// caller's own buffers, and a reply's tensors are received straight into the call's
/// targets.
///
/// It has no thread of its own: its I/O runs on the caller's thread while the caller waits
/// on a PendingCall (the client waits right after sending). Requests made before a wait
/// leave together when it begins, one gather-write per ps (a push and its pull in one), to
/// every ps at once; replies are read as they arrive, several per receive when small. A
/// round trip thus costs the network's two wake-ups and no thread hand-off. The price: a
/// Tcp and its PendingCalls are used from one thread at a time, and a transfer moves only
/// while that thread waits.
///
/// Every connection opens with the handshake: the client proves its job, its task and the
/// job's secret, and the ps proves the same back, naming its task index. A ps of another
/// job, one that cannot prove the secret, or one listed at the wrong index is refused at
/// once with a message that says so (kUnauthenticated), and so is this client by a ps that
/// refuses it; neither is retried while the transport is made. A refusal for now (its task
/// is another live process's: TcpServerOptions::takeover_after) is retried as an
/// unreachable ps is, within `connect_timeout`, then fails kUnavailable. A worker beyond
/// the cluster spec's, refused by an address that let it in before, fails its calls with
/// kUnavailable too (the caller waits as for a lost ps): a ps started again in a lost one's
/// place knows the spec's workers only until the chief restores it.
///
/// A lost connection fails the calls waiting on it with kUnavailable (whether a request in
/// flight was handled is then unknown). The next call to that ps reconnects first (one
/// attempt, `attempt_timeout`), so a ps that restarts on the same address is reached
/// again; a restarted ps has lost its state and says so (kFailedPrecondition) until the
/// chief initializes it anew. A caller that gives up on a call in the middle of its
/// transfer (its deadline passed while a stalled peer was not reading) closes that
/// connection, the only way to stop a transfer half done.
///
/// With `TcpOptions::replicas` = 1 (a job whose ps tasks hold copies: ps/shard_copies.hpp)
/// it also connects to the copy of ps k's shard that the next member of the job holds
/// (copy_holder: ps (k + 1) mod P while every ps is a member; `place_copies` moves it when
/// the membership changes), and `call(k)` reaches shard k wherever it is whole:
///   - what changes a shard (Register, Initialize, Push, a worker's PullRows, Pause,
///     Resume, Restore, RestoreRows, Shutdown) goes to both copies and is
///     answered once both have answered: the answer of the copy it reads from (a row pull
///     reaches the other copy as `PullRows::touch_only`: it creates and touches the rows
///     and sends none back; a Shutdown one copy answers with training's end while the
///     other was not reached is answered kUnavailable, so that the chief sends it again);
///   - reads (TakeToken, Pull, GetStats, ReadState, ReadRows, the chief's row reads) and
///     heartbeats (a ps process hands them to both copies it holds) go to the copy it
///     reads from: ps k's own unless that one was dropped, so every task reads tokens from
///     the same pacer. A Pull that waits for a step also asks the other copy to
///     say when it completed that step (no values), so that no worker pushes for the next
///     step before both copies took this one's pushes. WaitReady goes to both and is
///     answered once both are ready, so that no push reaches a copy the chief has not
///     initialized yet: by ps k's own copy, or by the one left when the other is lost,
///     refuses, or is still not ready `copy_grace` after the first was (then it is dropped);
///   - a copy is dropped (given up), with one log line, when it is lost
///     for sure: its address refuses connections after it was reached (no process listens
///     there), another process answers there (wire::Welcome::server: one started in a lost
///     one's place holds nothing), it stays out of reach for `copy_timeout`, or it is still
///     not ready `copy_grace` after the other copy was. Calls waiting for it go to the
///     other copy; a connection that merely broke is reconnected as without copies (the
///     caller sends again, and each copy counts a push once). The last copy of a shard is
///     never dropped: it is waited for as a ps without copies is. A copy that refuses what
///     the other took is not dropped either: the answer of the copy read from stands;
///   - a dropped copy serves again once the chief gave a process started in the lost one's
///     place its shards back (Chief::take_back, at a newer membership): every task that
///     learns that membership reaches it again (`renew_copies`: `reach_again`, which takes
///     only a new process, and `serve_again`) before its first request of the new epoch.
/// Whether a process that refuses connections, or stays out of reach for `copy_timeout`, is
/// lost is ruled by `TcpOptions::copy_referee` when it is set (the role runner's chief):
/// the task drops its copies when told to, and until then waits for it as for a ps without
/// copies, so that a task cut off from a ps the rest of the job reaches (a partition) gives
/// up nothing that the others still write to. Without a referee each task decides alone,
/// and a ps cut off from some tasks for `copy_timeout` is dropped by those tasks only.
class Tcp {
 public:
  /// Connects task `self` to every ps ("host:port", by task index), retrying with backoff
  /// while they start; throws kInvalidArgument for a malformed address (`parse_address`) or
  /// job name, kUnavailable naming the first address that stays unreachable, and
  /// kUnauthenticated when a ps and this task do not belong to the same job (or secret).
  /// With `reach_now`, it connects now to those ps tasks only (task indices: the job's
  /// members, when some ps task left the job); the others are reached at their first call,
  /// as after a broken connection (ps tasks the job has known, which may be gone since).
  Tcp(Node self, const std::vector<std::string>& ps_addresses, TcpOptions options = {},
      std::optional<std::span<const std::uint32_t>> reach_now = std::nullopt)
      : impl_(std::make_unique<transport_detail::TcpClient>(self, parse_all(ps_addresses),
                                                            std::move(options), reach_now)) {}
  /// The same with parsed addresses.
  Tcp(Node self, std::vector<Address> ps_addresses, TcpOptions options = {})
      : impl_(std::make_unique<transport_detail::TcpClient>(self, std::move(ps_addresses),
                                                            std::move(options))) {}

  /// Number of ps tasks.
  [[nodiscard]] std::size_t num_ps() const noexcept { return impl_->num_ps(); }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    return impl_->call(ps, std::move(request), std::move(targets));
  }

  /// Reaches one more ps task, at `address`, as task num_ps() (a ps that joined the job:
  /// Chief::join). With `connect`, connects to it now as the constructor does, and throws
  /// as it does (the transport is unchanged then); else it connects at its first call, as
  /// after a broken connection (a ps the job has known, which may be gone since). With
  /// `TcpOptions::replicas` it is no member until `place_copies` names it: its shard has
  /// no copy until then.
  void add_ps(const std::string& address, bool connect = true) {
    impl_->add_ps(parse_address(address), connect);
  }

  /// Places the copies of the shards for the job's ps tasks `members` (ascending, at least
  /// 2; with `TcpOptions::replicas`, else nothing changes): member k's copy is on the next
  /// member (copy_holder), as the ps tasks place them once the chief registered the model
  /// over those members; the shard of a ps that is no member is reached at that ps alone.
  /// A copy that moved is reached at its new ps from its next call on: what waited on the
  /// old connection fails with kUnavailable (the caller sends again). Every task does this
  /// when it learns a new membership (Client), before its first request at it.
  void place_copies(std::span<const std::uint32_t> members) { impl_->place_copies(members); }

  /// The member ps tasks (place_copies; every ps task until then) some of whose copies this
  /// transport gave up (lost for good), ascending; none without `TcpOptions::replicas`. See
  /// CopyingTransport.
  [[nodiscard]] std::vector<std::uint32_t> given_up() const { return impl_->given_up(); }
  /// True when every copy this transport reaches at member ps `ps` is given up: none is
  /// read there as the last copy of its shard. See CopyingTransport.
  [[nodiscard]] bool given_up_whole(std::uint32_t ps) const { return impl_->given_up_whole(ps); }
  /// False when the last WaitReady of some shard was answered by one copy while the other
  /// was out of reach, and that copy is still not given up: the shard reads, but a write
  /// waits for it (a task cut off from a process the chief still reaches). True without
  /// copies. A Worker counts the ps tasks as back after a failure only when this holds
  /// (detail::Recovery::answered).
  [[nodiscard]] bool copies_whole() const { return impl_->copies_whole(); }
  /// Once a copy of ps `ps` was given up, connects anew to every copy it holds (those not
  /// given up yet are given up first, but the last copy of a shard): true once each reached
  /// one process other than the one given up (started in its place), with the copies served
  /// again at once when `serve`, else left given up until serve_again(ps). False, with
  /// them given up, when one is not reached (in one attempt of `attempt_timeout`; with
  /// `serve`, within `copy_grace` unless its address refuses), refuses this task, or is the
  /// process given up (alive but cut off: its state is old). With `serve` a copy not
  /// reached is served all the same (the chief reached it: this task may be cut off), unless
  /// `unreached_too` is false: then only the copies reached serve again (a task that learns
  /// the job's membership for the first time, whose copies were given up at that very
  /// membership). See CopyingTransport.
  bool reach_again(std::uint32_t ps, bool serve, bool unreached_too) {
    return impl_->reach_again(ps, serve, unreached_too);
  }
  /// The given-up copies of `ps` serve their shards again: what changes a shard goes to both
  /// copies from now on, and ps k's own copy is read from again. Logged once per copy.
  void serve_again(std::uint32_t ps) { impl_->serve_again(ps); }
  /// Gives every copy that ps `ps` holds up again (`why` is logged), unless it is the last
  /// copy of its shard.
  void give_up(std::uint32_t ps, const std::string& why) { impl_->give_up(ps, why); }

  /// Ps task `ps`'s address, "host:port".
  [[nodiscard]] std::string address(std::size_t ps) const { return impl_->address(ps); }
  /// True if this task's connection to ps `ps` (to its own copy, with replicas) is through
  /// the ps's local socket (TcpOptions::local_sockets), false over TCP or not connected.
  [[nodiscard]] bool local(std::size_t ps) const { return impl_->local(ps); }
  /// True if that connection moves its bytes through memory shared with the ps
  /// (TcpOptions::shared_memory), false on a socket's bytes or not connected.
  [[nodiscard]] bool shared_memory(std::size_t ps) const { return impl_->shared_memory(ps); }

 private:
  static std::vector<Address> parse_all(const std::vector<std::string>& addresses) {
    std::vector<Address> parsed;
    for (const std::string& a : addresses) parsed.push_back(parse_address(a));
    return parsed;
  }

  std::unique_ptr<transport_detail::TcpClient> impl_;
};
static_assert(GrowingTransport<Tcp>);
static_assert(CopyingTransport<Tcp>);

}  // namespace pulley
