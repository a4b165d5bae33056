// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <future>
#include <span>
#include <vector>

#include "pulley/messages.hpp"

namespace pulley {

/// Where a pull's values go: one destination per requested slice, in request order.
using PullTargets = std::vector<std::span<float>>;

/// The client side of a transport: how a worker, the chief or an evaluator reaches the ps
/// tasks. The server side is the transport's own serving loop, which hands every request to
/// `ParameterServer::handle` and sends back what it answers.
///
/// Required:
///   - `t.num_ps()` → number of ps tasks
///   - `t.call(ps, request, targets)` → `std::future<Response>`
///
/// Semantic contract:
///   - `call` returns at once; calls to different ps tasks proceed concurrently;
///   - requests from one client to one ps are handled in the order they were made;
///   - for a Pull, the transport copies the reply's values into `targets` (slice by slice)
///     before the future is ready, and the PullReply's views then point into `targets`;
///     `targets` and every view inside `request` stay valid until the future is ready;
///   - failures arrive as an ErrorReply, never as a broken future: `kUnavailable` for a
///     dead or unreachable peer; a lost message leaves the future waiting, and the caller's
///     deadline turns that into `kDeadlineExceeded`.
template <class T>
concept Transport = std::move_constructible<T> &&
    requires(T& transport, const T& ctransport, std::size_t ps, Request request,
             PullTargets targets) {
  { ctransport.num_ps() } -> std::convertible_to<std::size_t>;
  {
    transport.call(ps, std::move(request), std::move(targets))
    } -> std::same_as<std::future<Response>>;
};

}  // namespace pulley
