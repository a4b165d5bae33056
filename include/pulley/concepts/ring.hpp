// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <span>

namespace pulley {

/// The link a worker has in a ring of workers (the all-reduce architecture, seed 004
/// section 2): N ranks 0 .. N − 1, each sending to the next rank, (rank + 1) mod N, and
/// receiving from the previous one, (rank + N − 1) mod N. `collective/ring_all_reduce.hpp`
/// runs the reduce-scatter and all-gather over it; `InProcessRing` (threads of one
/// process) and `TcpRing` (processes, proving the job's secret) are the stock links.
///
/// Required:
///   - `r.rank()`, `r.size()` → this worker's rank and the ring's size (convertible to
///     std::size_t), fixed for the link's lifetime
///   - `r.send(bytes)` with a `std::span<const std::byte>`: queues `bytes` for the next rank
///   - `r.receive(bytes)` with a `std::span<std::byte>`: fills `bytes` with what the previous
///     rank sent next, waiting until it has come
///   - `r.flush()`: returns once everything queued by `send` has left this rank
///
/// Semantic contract:
///   - what one rank sends arrives at the next in the order sent, as one byte stream: a
///     `receive` need not match a `send` in size;
///   - `send` never waits for the next rank to receive: sends in flight make progress while
///     the rank waits in `receive` (so that every rank may send a chunk before any receives
///     one without a deadlock). The caller keeps `bytes` unchanged and alive until `flush`
///     returns or, sooner, until a `receive` has returned bytes that the next rank could
///     only have sent after reading them (a ring's causality: the all-reduce relies on it);
///   - a lost or stopped neighbour makes `receive`, `send` or `flush` throw pulley::Error
///     (`kUnavailable`, or `kDeadlineExceeded` after the link's timeout) naming it; the link
///     is then unusable, and no bytes received before the failure are valid;
///   - a ring of size 1 never sends or receives.
template <class R>
concept Ring = requires(R& ring, const R& cring, std::span<const std::byte> out, std::span<std::byte> in) {
  { cring.rank() } -> std::convertible_to<std::size_t>;
  { cring.size() } -> std::convertible_to<std::size_t>;
  { ring.send(out) } -> std::same_as<void>;
  { ring.receive(in) } -> std::same_as<void>;
  { ring.flush() } -> std::same_as<void>;
};

}  // namespace pulley
