// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <span>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "pulley/protocol/messages.hpp"

namespace pulley {

/// How a service answers one request: called exactly once, now or later, from the thread
/// that serves it. A Responder never throws. It may keep the Response's views (a TCP server
/// writes a pull reply straight from the parameters as the socket drains), so a service
/// keeps what they view valid and unchanged until it handles a request that
/// `changes_parameters`, or is destroyed; a transport finishes with the views before it
/// hands the service such a request.
using Responder = std::function<void(Response&&)>;

/// Answers through `reply`, which is empty afterwards: a request is answered once, and a
/// reply already given (or parked elsewhere) is left alone.
inline void respond(Responder& reply, Response&& response) {
  Responder r = std::exchange(reply, nullptr);
  if (r) r(std::move(response));
}

/// What a transport vouches for about a request, besides its content.
struct RequestContext {
  /// Every tensor of the request is finite: the transport checked it as it arrived, or the
  /// request comes from a client in this process (pulley's clients check before sending).
  bool tensors_finite = false;
  /// The task that sent it, as the transport knows it (over TCP: as the handshake proved
  /// it); the service refuses what that task's role may not send (`kSenders`). nullopt: a
  /// caller the transport does not name, trusted (pulley's transports always name it).
  std::optional<Node> peer;
  /// The connection (or in-process endpoint) it came on, unique while the transport lives;
  /// 0: unknown. What a peer takes on a connection (a sync token) it holds while that
  /// connection lives: see `disconnected`.
  std::uint64_t session = 0;
  /// The shard the connection asked for at its handshake (wire::Hello::shard): nullopt for
  /// the service's own, or the index of a shard whose copy it may hold (`holds_copy`).
  std::optional<std::uint32_t> shard = std::nullopt;
  /// With `tensors_finite`: no float of the request is larger in magnitude, as the
  /// transport measured it while checking (+infinity: not measured). A ps proves updates
  /// finite from it without reading the gradient again (BoundsMagnitudes).
  float tensors_largest = std::numeric_limits<float>::infinity();
};

/// The server half of a transport's contract: what a transport serves. A ParameterServer is
/// one; `TcpServer` and `InProcessNetwork` serve any Service.
///
/// Required:
///   - `s.handle(request, context, reply)`, declared noexcept
///   - `s.task()` → this ps task's index
///   - `s.stopped()` → bool: true once it serves no more (shut down, or failed)
///
/// Optional:
///   - `s.disconnected(node, session)`, noexcept: the transport lost connection `session`
///     from task `node` (its process ended, or the link broke; session 0: every connection
///     of that task, e.g. an in-process task that was killed). The service gives back what
///     was taken on it, such as a sync token whose push will not come (a lease).
///   - `s.holds_copy(shard)` → bool: a connection may ask for a copy of ps `shard`'s shard
///     besides its own (ShardCopies: the one it holds, or one the chief may move to it); a
///     transport refuses a connection that asks for any other shard.
///   - `s.max_request_payload()` → std::uint64_t: the most tensor bytes a request can
///     legitimately carry now (a ParameterServer: the bytes of the parts it holds). A
///     transport refuses a frame that claims more before it receives any of it.
///   - `s.fenced(node)` → std::string: why task `node` may not be served now, or "" (it
///     may). A transport closes that task's connections at their next request or reply,
///     or within a second while they wait, and refuses its new ones for now
///     (kUnavailable), so that the task finds this ps out of reach (ShardCopies: a process
///     that lost the chief's lease).
///   - `s.tick()`, noexcept: time passed with no request, at least once a second while the
///     transport serves (its own clock: a deadline that must pass even while nobody sends,
///     such as the chief's recovery timeout at a ps no task may reach). Called between
///     requests, never during one.
///   - `s.awaits_workers()` → bool: once stopped, true while a worker may still come to
///     hear that it stopped (its answer lost with its link, its process stopped a while):
///     the transport keeps taking connections for it, every client gone or not.
///   - `s.restarts()` → bool: it stopped to start again empty (the job gave its process
///     up: Shutdown::restart). Whoever is still connected holds a process given up: the
///     transport ends within a second, not `linger`, so that it serves anew at once.
///   - `s.workers()` → `std::span<const std::uint32_t>`: the job's workers now, ascending,
///     once workers joined or left (ChangeWorkers); empty while they are the cluster
///     spec's. A transport that checks who connects lets a worker in only if it is one.
///
/// Semantic contract:
///   - the transport calls `handle` (and `disconnected`) for one request at a time (never
///     concurrently), in the order each client sent them, and never after the service is
///     destroyed;
///   - `handle` answers every request exactly once through `reply`, now or later (a request
///     that waits for a token or a step is answered when another request completes it);
///     whatever goes wrong, including a throwing policy, becomes an answer: `handle` does
///     not throw, so the transport has no failure of the service to decide about;
///   - a stopped service still answers what it is sent (with the error that says why it
///     stopped): the transport keeps serving it until its clients have heard, then ends.
template <class S>
concept Service = requires(S& service, const S& cservice, Request&& request,
                           const RequestContext& context, Responder reply) {
  requires noexcept(service.handle(std::move(request), context, std::move(reply)));
  { cservice.task() } -> std::convertible_to<std::uint32_t>;
  { cservice.stopped() } -> std::convertible_to<bool>;
};

/// Tells `service` that connection `session` of task `node` is gone, if the service cares
/// (`disconnected`).
template <Service S>
void notify_disconnected(S& service, const Node& node, std::uint64_t session) noexcept {
  if constexpr (requires { service.disconnected(node, session); }) {
    static_assert(noexcept(service.disconnected(node, session)),
                  "Service::disconnected must be noexcept");
    service.disconnected(node, session);
  }
}

/// True if `service` serves a copy of shard `shard` (`holds_copy`); none by default.
template <Service S>
bool holds_copy(const S& service, std::uint32_t shard) noexcept {
  if constexpr (requires { { service.holds_copy(shard) } -> std::convertible_to<bool>; }) {
    return service.holds_copy(shard);
  } else {
    return false;
  }
}

/// Lets `service` look at its clock between requests (`tick`), if it cares.
template <Service S>
void tick(S& service) noexcept {
  if constexpr (requires { service.tick(); }) {
    static_assert(noexcept(service.tick()), "Service::tick must be noexcept");
    service.tick();
  }
}

/// Why `service` serves task `node` no more for now (`fenced`), or "" (it does, as by
/// default).
template <Service S>
std::string fence_reason(S& service, const Node& node) {
  if constexpr (requires { { service.fenced(node) } -> std::convertible_to<std::string>; }) {
    return service.fenced(node);
  } else {
    return {};
  }
}

/// True if `service` stopped to start again empty (`restarts`); false by default.
template <Service S>
bool restarts(const S& service) {
  if constexpr (requires {
                  { service.restarts() } -> std::convertible_to<bool>;
                }) {
    return service.restarts();
  } else {
    return false;
  }
}

/// True if `service` stopped and a worker may still come to hear it (`awaits_workers`);
/// false by default.
template <Service S>
bool awaits_workers(const S& service) {
  if constexpr (requires {
                  { service.awaits_workers() } -> std::convertible_to<bool>;
                }) {
    return service.awaits_workers();
  } else {
    return false;
  }
}

/// The job's workers as `service` has them (`workers`), or none (the cluster spec's).
template <Service S>
std::span<const std::uint32_t> job_workers(const S& service) noexcept {
  if constexpr (requires { { service.workers() } -> std::convertible_to<std::span<const std::uint32_t>>; }) {
    return service.workers();
  } else {
    return {};
  }
}

/// The most tensor bytes a request to `service` can carry now (`max_request_payload`), or no
/// limit if it does not say.
template <Service S>
std::uint64_t max_request_payload(const S& service) noexcept {
  if constexpr (requires { { service.max_request_payload() } -> std::convertible_to<std::uint64_t>; }) {
    return service.max_request_payload();
  } else {
    return std::numeric_limits<std::uint64_t>::max();
  }
}

}  // namespace pulley
