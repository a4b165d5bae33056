// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// Where a reply's tensors go: one destination per tensor of the reply, in order (for a
/// Pull, one per requested slice).
using PullTargets = std::vector<std::span<float>>;

/// The client half of a transport: how a worker, the chief or an evaluator reaches the ps
/// tasks. The server half is a transport's serving loop, which hands every request to a
/// `Service` (concepts/service.hpp).
///
/// Required:
///   - `t.num_ps()` → number of ps tasks
///   - `t.call(ps, request, targets)` → `PendingCall`
///
/// Semantic contract:
///   - `call` never waits for another task (a request that must wait for a token or a step
///     returns a PendingCall that is answered later), so calls to different ps tasks never
///     wait for each other;
///   - a transport may hold a request until its caller waits on any of its calls, so that
///     requests made together leave together (a push and a pull in one write);
///   - requests from one client to one ps are handled in the order they were made;
///   - the caller has checked every tensor of `request` finite (pulley's clients do, before
///     anything is sent); a transport that carries requests from another process checks
///     them again (or lets the service check them: `RequestContext::tensors_finite`);
///   - a reply's tensors are copied into `targets` (tensor by tensor) before the call is
///     answered, and the reply's views then point into `targets`; a reply whose tensors do
///     not fit `targets` is answered as a `kInvalidArgument` error instead;
///   - `targets` and every view inside `request` stay valid until the call is answered or
///     the caller has cancelled it; the transport touches neither afterwards;
///   - failures arrive as an ErrorReply answer: `kUnavailable` for a dead or unreachable
///     peer; a lost message leaves the call unanswered, and the caller's deadline turns that
///     into `kDeadlineExceeded` (and a cancel).
template <class T>
concept Transport = std::move_constructible<T> &&
    requires(T& transport, const T& ctransport, std::size_t ps, Request request,
             PullTargets targets) {
  { ctransport.num_ps() } -> std::convertible_to<std::size_t>;
  { transport.call(ps, std::move(request), std::move(targets)) } -> std::same_as<PendingCall>;
};

/// A transport that can reach ps tasks beyond those it was made with: a job whose ps tasks
/// grow (Chief::join). Clients of such a transport follow a ps that joins; others refuse
/// the membership that names one.
///
/// Required, beyond Transport:
///   - `t.add_ps(address, connect)` → reaches one more ps task, task `num_ps()` before the
///     call, at `address` (a std::string): with `connect` it is reached now, and a failure
///     throws, leaving the transport as it was; without, at its first call (a task the job
///     has known, which may be gone since: its calls then fail as a lost ps's do)
///   - `ct.address(ps)` → std::string: ps task `ps`'s address as `add_ps` takes it
template <class T>
concept GrowingTransport = Transport<T> && requires(T& transport, const T& ctransport, const std::string& address,
                                                    std::size_t ps) {
  transport.add_ps(address, true);
  { ctransport.address(ps) } -> std::convertible_to<std::string>;
};

/// A transport whose ps tasks keep a copy of each other's shards (Tcp with
/// `TcpOptions::replicas`): it gives a copy up when its ps is lost for good, serves the
/// shard from the other copy alone, and serves it from both again once a process started in
/// the lost one's place was given its shards back (Chief::take_back).
///
/// Required, beyond Transport:
///   - `ct.given_up()` → std::vector<std::uint32_t>: the ps tasks some of whose copies this
///     transport gave up, ascending (none without copies)
///   - `t.reach_again(ps, serve, unreached_too)` → bool: once a copy of ps task `ps` was
///     given up, connects anew to every copy it holds (giving up those not given up yet:
///     the process behind them is gone), and true once each reached one process other than
///     the one given up (started in its place; the process given up may be alive but cut
///     off, and its state is old); with `serve` they serve again at once, without they stay
///     given up until `serve_again(ps)`; false, with every copy of `ps` given up, when one
///     is not reached, unless `serve` and `unreached_too`: then a copy not reached serves
///     again all the same (the chief reached it; this task may be the one cut off)
///   - `t.serve_again(ps)` → the copies of `ps` reached again serve their shards with the
///     other copies: what changes a shard goes to both from now on
///   - `t.give_up(ps, why)` → gives every copy of `ps` up again (taking it back failed)
///   - `t.place_copies(members)` → the job's ps tasks are now `members` (a
///     std::span<const std::uint32_t>, ascending, at least 2): member k's copy is reached at
///     copy_holder(members, k), where the ps tasks hold it once the chief registered the
///     model over them; a ps that is no member is reached alone
///
/// Optional:
///   - `ct.given_up_whole(ps)` → bool: every copy it reaches at member ps `ps` is given up
///     (none is read there as the last copy of its shard). Then the process given up, if
///     it lives on, may start again empty (Chief::given_up_whole); without it, never.
///   - `ct.copies_whole()` → bool: false when the last WaitReady of some shard was answered
///     by one copy while the other was out of reach, and that copy is still not given up
///     (reads go on; writes wait for it). A Worker counts the ps tasks as back after a
///     failure only when it holds, so a task cut off from one process for good gives up
///     within its recovery timeout rather than once per answer (detail::Recovery::answered).
///
/// Semantic contract: a copy is served again only once the chief restored it with the
/// others from one cut (Chief::take_back), at a membership newer than the one it was given
/// up at; the other tasks then follow when they learn that membership (`renew_copies`),
/// before their first request of the epoch the restore began. Likewise, copies move only
/// with the membership (a ps that left or joined: Chief::retire, Chief::join), and every
/// task places them anew (`place_copies`) when it learns it, before its first request at it.
template <class T>
concept CopyingTransport = Transport<T> &&
    requires(T& transport, const T& ctransport, std::uint32_t ps, const std::string& why,
             std::span<const std::uint32_t> members) {
  { ctransport.given_up() } -> std::same_as<std::vector<std::uint32_t>>;
  { transport.reach_again(ps, true, true) } -> std::same_as<bool>;
  transport.serve_again(ps);
  transport.give_up(ps, why);
  transport.place_copies(members);
};

/// The job's ps tasks are now `members` (ascending): a CopyingTransport places the copies
/// of their shards for them (`place_copies`); any other transport has nothing to place.
template <Transport T>
void place_copies(T& transport, std::span<const std::uint32_t> members) {
  if constexpr (CopyingTransport<T>) transport.place_copies(members);
}

/// A task that learned a newer membership of the job's ps tasks serves again the copies its
/// transport gave up whose ps is back (a process in its place: one the chief took back,
/// Chief::take_back, since only a take-back changes the membership of a job with copies
/// and keeps its members); true if it serves any again. Without copies, false.
/// `first_look`: the task learns the job's membership for the first time (it started
/// since): the copies it gave up were given up at that membership, and only those it
/// reaches now are served again (`reach_again`'s `unreached_too` false), not one it cannot
/// reach (its process may have been taken back and lost since).
template <Transport T>
bool renew_copies(T& transport, bool first_look = false) {
  if constexpr (CopyingTransport<T>) {
    bool renewed = false;
    for (const std::uint32_t ps : transport.given_up()) {
      renewed = transport.reach_again(ps, true, !first_look) || renewed;
    }
    return renewed;
  } else {
    return false;
  }
}

/// Makes `transport` know every ps task of `ps_addresses` (by task index; empty: the ones
/// it knows already), adding those beyond its count, each reached at its first call.
/// Throws kFailedPrecondition when the transport cannot grow (not a GrowingTransport).
template <Transport T>
void reach_all(T& transport, std::span<const std::string> ps_addresses) {
  if (ps_addresses.size() <= transport.num_ps()) return;
  if constexpr (GrowingTransport<T>) {
    while (transport.num_ps() < ps_addresses.size()) transport.add_ps(ps_addresses[transport.num_ps()], false);
  } else {
    throw Error(ErrorCode::kFailedPrecondition,
                "ps task " + std::to_string(transport.num_ps()) + " joined the job at " +
                    ps_addresses[transport.num_ps()] + ", and this task's transport reaches only the " +
                    std::to_string(transport.num_ps()) + " it was made with (not a GrowingTransport)");
  }
}

}  // namespace pulley
