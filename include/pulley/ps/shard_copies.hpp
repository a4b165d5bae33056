// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "pulley/concepts/service.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// One ps task of a job that keeps a copy of every shard (`--ps-replicas 1`, beyond
/// TensorFlow): it serves its own shard, ps k's, and a copy of ps k − 1's (mod P), each a
/// whole ParameterServer: parts, optimizer slots, table rows and the sync policy's state.
///
/// It holds no replication logic of its own. The clients keep the copies alike: what
/// changes a shard they send to both of its copies, and they count it done once both have
/// answered (Tcp with `TcpOptions::replicas`); both copies take the same requests, so
/// under SyncReplicas with R = N their state is the same at every step boundary (bit for
/// bit with 2 workers, or one; with more, each copy may sum a step's gradients in another
/// order). With backup workers each copy takes the first R fresh pushes it sees, and
/// under Async and BoundedStaleness each applies pushes in the order they reach it: the
/// copies may then differ by what arrived first. When a ps is lost, the clients read its
/// shard from the copy, and training goes on without a rollback.
///
/// A connection names the shard it wants at its handshake (wire::Hello::shard,
/// RequestContext::shard). Heartbeats reach both copies whichever connection brings them,
/// as does a lost connection: each copy judges the workers and the chief on its own.
///
/// @tparam PS the ParameterServer type of both copies
template <class PS>
class ShardCopies {
 public:
  /// @param own  ps k, serving its own shard
  /// @param copy the copy of ps (k − 1) mod P's shard, of the same type
  ShardCopies(PS own, PS copy) : own_(std::move(own)), copy_(std::move(copy)) {
    copy_.set_name("ps " + std::to_string(own_.task()) + "'s copy of ps " + std::to_string(copy_.task()));
  }

  /// Hands `request` to the copy its connection asked for; a heartbeat to both.
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    if (const auto* beat = std::get_if<Heartbeat>(&request)) {
      Heartbeat twin = *beat;
      (context.shard ? own_ : copy_).handle(Request{std::move(twin)}, context, [](Response&&) {});
    }
    (context.shard ? copy_ : own_).handle(std::move(request), context, std::move(reply));
  }

  /// ps k's index.
  [[nodiscard]] std::uint32_t task() const noexcept { return own_.task(); }
  /// True for the shard whose copy it holds.
  [[nodiscard]] bool holds_copy(std::uint32_t shard) const noexcept { return shard == copy_.task(); }
  /// True once both copies serve no more (the chief shuts both down).
  [[nodiscard]] bool stopped() const noexcept { return own_.stopped() && copy_.stopped(); }
  /// How it ended: its own shard's end, else the copy's.
  [[nodiscard]] const std::optional<ErrorReply>& ended() const noexcept {
    return own_.ended() ? own_.ended() : copy_.ended();
  }
  void disconnected(const Node& node, std::uint64_t session) noexcept {
    own_.disconnected(node, session);
    copy_.disconnected(node, session);
  }
  /// The job's workers, as ps k's own copy has them (both take every ChangeWorkers).
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return own_.workers(); }
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return std::max(own_.max_request_payload(), copy_.max_request_payload());
  }

  /// ps k's own shard.
  [[nodiscard]] PS& own() noexcept { return own_; }
  /// The copy of ps k − 1's shard.
  [[nodiscard]] PS& copy() noexcept { return copy_; }

 private:
  PS own_;
  PS copy_;
};

}  // namespace pulley
