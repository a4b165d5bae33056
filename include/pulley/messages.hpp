// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "pulley/error.hpp"
#include "pulley/placement.hpp"
#include "pulley/variable.hpp"

namespace pulley {

// The protocol between clients (workers, chief, evaluator) and ps tasks. Every transport
// carries exactly these structs: in-process they are moved through a mailbox, over TCP
// they are serialized. The server logic sees the same values either way.
//
// Tensor payloads are `std::span` views, never owned vectors, so that a push reads the
// worker's gradient buffers and a pull reply reads the server's storage in place. Lifetime
// rule: a view in a request stays valid until the reply arrives (the sender waits); a view
// in a reply stays valid only while the transport's reply callback runs, which copies it to
// the caller's destination (or onto the wire) before returning.

/// Values for one part, addressed by its global index in `Placement::parts`.
struct PartValues {
  std::uint32_t part = 0;
  std::span<const float> values;
};

/// Rows `rows` (relative to the variable, inside the part) of part `part`.
struct Slice {
  std::uint32_t part = 0;
  RowRange rows;
};

/// Chief → every ps: the model's variables. Each ps computes the placement with its Sharding
/// policy and answers with it, so the chief can check that all ps tasks agree. Repeating the
/// same registration is harmless; a different one is refused.
struct Register {
  std::vector<VariableSpec> variables;
};

/// Chief → ps: initial values of parts this ps holds. Each part is initialized once.
struct Initialize {
  std::vector<PartValues> parts;
};

/// Client → ps: answered with the placement once every part on this ps is initialized.
struct WaitReady {};

/// Worker → ps 0: take a sync token before a step (TF's `sync_token_queue.dequeue()`).
/// Waits while the sync policy has no token to give.
struct TakeToken {
  std::uint32_t worker = 0;
};

/// Client → ps: read slices. Waits until the ps has completed `min_step` global steps, so a
/// worker holding the token of step k reads parameters that include every update before k.
struct Pull {
  std::int64_t min_step = 0;
  std::vector<Slice> slices;
};

/// Worker → ps: gradients computed from parameters of `local_step`. Every worker pushes to
/// every ps once per step (possibly with no parts): the message is also its vote towards
/// the ps's global step.
struct Push {
  std::uint32_t worker = 0;
  std::int64_t local_step = 0;
  std::vector<PartValues> gradients;
  /// The gradients were checked finite by whoever hands this message to the ps: pulley's
  /// clients check before sending anything, so the ps need not read them twice. Not part of
  /// the wire format: a message from a socket arrives unchecked, unless the transport
  /// checked its bytes on receipt.
  bool finite_checked = false;
};

/// Any client → ps: counters for monitoring and tests.
struct GetStats {};

/// Chief → ps: stop serving; requests still waiting are answered `kCancelled`.
struct Shutdown {};

/// Everything a ps task is asked.
using Request =
    std::variant<Register, Initialize, WaitReady, TakeToken, Pull, Push, GetStats, Shutdown>;

/// Success with nothing to say.
struct Ack {};

/// A refused or failed request. The server keeps serving after sending one.
struct ErrorReply {
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;
};

/// Answer to Register and WaitReady: the registered variables and where they live, so a
/// client can check that its model is the one the chief registered.
struct PlacementReply {
  std::vector<VariableSpec> variables;
  Placement placement;
};

/// Answer to TakeToken: `local_step` tags the next push and gates the next pull;
/// `global_step` is the number of steps completed, for progress and stopping.
/// `one_token_per_step` says the worker gets no other token of `local_step` (R <= N, or no
/// pacing at all), so after pushing it may wait for the step to complete without holding
/// it up; with R > N the step may need its next push. `paced` is false when the sync policy
/// hands tokens without ever waiting (Async): the worker need not ask for them again.
struct TokenReply {
  std::int64_t local_step = 0;
  std::int64_t global_step = 0;
  bool one_token_per_step = true;
  bool paced = true;
};

/// Answer to Pull: one view per requested slice, in request order.
struct PullReply {
  std::int64_t global_step = 0;
  std::vector<std::span<const float>> values;
};

/// Answer to Push: how many of its part gradients were dropped as stale.
struct PushReply {
  std::uint32_t stale_parts = 0;
};

/// Counters of one ps task.
struct Stats {
  std::int64_t global_step = 0;              ///< steps completed (sync) or pushes applied (async)
  std::int64_t updates_applied = 0;          ///< optimizer applications over all parts
  std::int64_t gradients_accepted = 0;       ///< part gradients taken into an accumulator
  std::int64_t stale_gradients_dropped = 0;  ///< part gradients older than the step, dropped
  std::int64_t requests_rejected = 0;        ///< requests answered with an ErrorReply
  std::int64_t bytes_pushed = 0;             ///< gradient payload received
  std::int64_t bytes_pulled = 0;             ///< parameter payload sent
};

/// Answer to GetStats.
struct StatsReply {
  Stats stats;
};

/// Everything a ps task answers.
using Response =
    std::variant<Ack, ErrorReply, PlacementReply, TokenReply, PullReply, PushReply, StatsReply>;

/// Returns the reply of type `T` or throws the Error the server sent.
template <class T>
T expect(Response&& response) {
  if (auto* error = std::get_if<ErrorReply>(&response)) throw Error(error->code, error->message);
  if (auto* reply = std::get_if<T>(&response)) return std::move(*reply);
  throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind from server");
}

}  // namespace pulley
