// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/client/client.hpp"
#include "pulley/client/snapshot.hpp"
#include "pulley/concepts/transport.hpp"

namespace pulley {

/// The evaluator task: follows training without taking part in it. It waits for the chief's
/// initialization, then reads parameter snapshots at chosen global steps to score on
/// held-out data. It takes no tokens and pushes nothing, so it never slows a sync step.
/// When the chief ends training, its calls throw `kOutOfRange`.
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Evaluator {
 public:
  /// @param transport reaches the ps tasks
  /// @param options   its calls' deadlines
  explicit Evaluator(T transport, ClientOptions options = {})
      : client_(std::move(transport), options) {}

  /// Blocks until the chief has initialized every ps and checks that `variables` (the
  /// evaluator's model) are the registered ones.
  void wait_ready(std::span<const VariableSpec> variables) { client_.wait_ready(variables); }

  /// Blocks until every ps has completed `step` global steps; returns the lowest global
  /// step they report.
  std::int64_t wait_for_step(std::int64_t step) { return client_.wait_for_step(step); }

  /// Every variable at one global step of at least `step`, the same on every ps (see
  /// Snapshot); waits until the ps tasks reach it.
  Snapshot snapshot(std::int64_t step) { return pulley::snapshot(client_, step); }

  /// Current values of every variable, one vector per variable, as each ps holds them now.
  std::vector<std::vector<float>> read_variables() { return pulley::read_variables(client_); }

  /// The current rows `ids` of embedding table `table` (ids.size() × dim floats, in
  /// order) under id sharding `sharding` (the ps tasks'); see pulley::read_rows. A row not
  /// held reads as its initial value; reading creates and touches nothing.
  template <IdSharding I = HashIds>
  std::vector<float> read_rows(std::string_view table, std::span<const std::uint64_t> ids,
                               I sharding = {}) {
    return pulley::read_rows(client_, table, ids, std::move(sharding));
  }

  /// Counters of every member ps, in member order (Client::stats).
  std::vector<Stats> stats() { return client_.stats(); }
  /// Blocks until the chief ends training (Client::wait_for_end).
  void wait_for_end() { client_.wait_for_end(); }

 private:
  Client<T> client_;
};

}  // namespace pulley
