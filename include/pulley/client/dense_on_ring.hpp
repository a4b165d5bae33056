// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pulley/client/all_reduce_worker.hpp"
#include "pulley/collective/ring_all_reduce.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/ring.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/variable.hpp"

namespace pulley {

/// The hybrid of the two architectures of seed 004, as recommender systems train (PERSIA,
/// HugeCTR, TorchRec): a TableModel's embedding tables stay on the ps tasks, its dense
/// variables are all-reduced among the workers. DenseOnRing wraps the model a `Worker`
/// trains: to the ps tasks it is a TableModel with the same tables and no dense variables,
/// so the ps tasks hold, pull and push rows only; inside `compute_gradients` it runs the
/// wrapped model's, sums the dense gradients with every other worker's on the ring and
/// applies their mean with its own optimizer (`AllReduceWorker`), while the rows'
/// gradients go to the ps tasks in the worker's push, as they would without it.
///
/// Every worker of the job wraps its model over a link of one ring (rank = its place in
/// it), and every worker calls `compute_gradients` once a step, the same number of times:
/// sync training with R = N (SyncReplicas::kEveryWorker), where each global step is every
/// worker's step. The dense replicas start from rank 0's (`initialize(seed)`, or `restore`
/// on one rank and `synchronize` from it) on the first step and stay bit-identical.
///
/// @tparam M the TableModel (owned)
/// @tparam O the optimizer of the dense variables (the tables' is the ps tasks')
/// @tparam R the Ring linking the workers (owned)
template <TableModel M, Optimizer O, Ring R>
class DenseOnRing {
 public:
  using Batch = typename M::Batch;
  /// `compute_gradients` applies the dense step: a Worker never computes a step twice
  /// (where it would, it fails with kAborted instead of applying it again).
  static constexpr bool kAppliesWhenComputed = true;

  /// @param seed the dense variables' initial values are rank 0's from this seed, unless
  ///   `dense().restore` or `dense().synchronize` ran first on every rank
  DenseOnRing(M model, O optimizer, R ring, std::uint64_t seed,
              std::size_t segment = RingAllReduce::kDefaultSegment)
      : dense_(std::move(model), std::move(optimizer), std::move(ring), segment), seed_(seed) {}

  /// None: the dense variables are not the ps tasks'.
  [[nodiscard]] std::span<const VariableSpec> variables() const { return {}; }
  /// There is no variable `i` (`variables()` is empty): throws std::out_of_range.
  std::span<float> parameter(std::size_t i) { throw std::out_of_range(no_variable(i)); }
  /// There is no variable `i` (`variables()` is empty): throws std::out_of_range.
  [[nodiscard]] std::span<const float> gradient(std::size_t i) const { throw std::out_of_range(no_variable(i)); }

  /// The wrapped model's tables.
  [[nodiscard]] std::span<const TableSpec> tables() const { return dense_.model().tables(); }
  /// The wrapped model's lookup.
  void lookup(const Batch& batch, std::size_t table, std::vector<std::uint64_t>& ids) const {
    dense_.model().lookup(batch, table, ids);
  }

  /// One step of the wrapped model on `batch`: the rows' gradients into `tables`, the dense
  /// variables updated by the mean of every worker's gradient. Returns the mean of every
  /// worker's batch loss. The first call starts the replicas (`initialize(seed)`) unless
  /// they were started. Throws what the ring throws when a worker is lost.
  float compute_gradients(const Batch& batch, std::span<const TableBatch> tables) {
    try {
      if (!started_) start();
      last_ = dense_.step(batch, tables);
    } catch (const Error& e) {
      // Not kUnavailable: a Worker would take it for a lost ps and compute the step again.
      throw Error(ErrorCode::kAborted, std::string("the ring of the dense variables failed: ") + e.what());
    }
    return last_.loss;
  }

  /// Starts the replicas, on every rank at the same point: from rank 0's initial values,
  /// or from rank `start_from`'s replica; the first `compute_gradients` calls it if nothing did.
  void start() {
    if (started_) return;
    if (source_) {
      dense_.synchronize(*source_);
    } else {
      dense_.initialize(seed_);
    }
    started_ = true;
  }
  /// The replicas start from rank `root`'s, which its owner started (the chief's follower
  /// in a hybrid job: initialized from the seed or restored from a checkpoint), instead
  /// of from rank 0's initial values.
  DenseOnRing& start_from(std::size_t root) {
    source_ = root;
    return *this;
  }
  /// The replicas were started otherwise (every rank restored, or synchronized from one):
  /// the first step starts from them.
  void started() noexcept { started_ = true; }

  /// The all-reduce worker holding the dense replica: the model (`dense().model()`), the
  /// optimizer's state, the step count, checkpoints of the dense part (`state`, `restore`).
  [[nodiscard]] AllReduceWorker<M, O, R>& dense() noexcept { return dense_; }
  [[nodiscard]] const AllReduceWorker<M, O, R>& dense() const noexcept { return dense_; }
  /// What the last step did (`applied` false: its mean dense gradient was not finite and no
  /// worker applied it; the rows' gradients went to the ps tasks all the same).
  [[nodiscard]] const AllReduceStep& last_step() const noexcept { return last_; }

 private:
  static std::string no_variable(std::size_t i) {
    return "DenseOnRing holds no ps variable " + std::to_string(i) + ": its dense variables are all-reduced";
  }

  AllReduceWorker<M, O, R> dense_;
  std::uint64_t seed_;
  std::optional<std::size_t> source_;  ///< start_from's root
  bool started_ = false;
  AllReduceStep last_;
};

}  // namespace pulley
