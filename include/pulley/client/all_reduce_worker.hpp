// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/collective/ring_all_reduce.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/ring.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/initializers.hpp"

namespace pulley {

/// What one all-reduce step did.
struct AllReduceStep {
  float loss = 0.0F;             ///< the mean of every rank's batch loss
  std::int64_t global_step = 0;  ///< steps this replica has taken, this one included
  /// False if the averaged gradient (or what it would make of a parameter or a slot) was not
  /// finite: no rank applied it, and every replica stays as it was.
  bool applied = true;
  /// Some rank voted to form the ring again after this step (`step`'s `regroup`): every
  /// rank sees the same answer.
  bool regroup = false;
};

/// A worker of the all-reduce architecture (seed 004, section 2): no ps task; every worker
/// holds the whole model and the optimizer's state, computes a gradient on its own batch,
/// and the ring sums the gradients (`RingAllReduce`) so that every worker applies the same
/// mean with the same optimizer. The replicas stay bit-identical: the same starting values
/// (`initialize` broadcasts rank 0's), the same averaged gradient bits on every rank, and a
/// deterministic optimizer (Optimizer's contract) give the same parameters after any number
/// of steps. It is synchronous data parallelism, as SyncReplicas with R = N is on ps tasks.
///
/// Nothing non-finite is applied, and a step is applied whole or not at all, on every rank
/// alike: the averaged gradient is checked, and then `stays_finite` of each variable
/// (PredictsFiniteness), or the update is made into a copy that replaces the variable and its
/// state only if every value stayed finite.
///
/// @tparam M the Model it trains (owned; the parameters are its own buffers)
/// @tparam O the Optimizer every rank applies (the same settings on every rank)
/// @tparam R the Ring that links it to the other workers (owned)
template <Model M, Optimizer O, Ring R>
class AllReduceWorker {
  static_assert(PredictsFiniteness<O> || std::copyable<typename O::State>,
                "AllReduceWorker undoes an update that went non-finite: give the optimizer stays_finite "
                "(PredictsFiniteness), or a copyable State");
  static_assert(checkpoints_whole_state_v<O>,
                "AllReduceWorker copies the optimizer's State from one replica to the others (synchronize) and "
                "checkpoints it: name its slots and counters (slots(state), counters(state): ExposesState), or "
                "keep it empty");

 public:
  /// @param segment floats per segment of the ring's pipeline (RingAllReduce::kDefaultSegment)
  AllReduceWorker(M model, O optimizer, R ring, std::size_t segment = RingAllReduce::kDefaultSegment)
      : model_(std::move(model)), optimizer_(std::move(optimizer)), ring_(std::move(ring)), reduce_(segment) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    std::size_t offset = 0;
    for (const VariableSpec& spec : variables) {
      offsets_.push_back(offset);
      offset += spec.size();
      states_.push_back(optimizer_.make_state(spec.size()));
    }
    offsets_.push_back(offset);
    flat_.resize(offset + 3);  // the loss, the ranks that added a gradient and the vote ride at the end
  }

  AllReduceWorker(const AllReduceWorker&) = delete;
  AllReduceWorker& operator=(const AllReduceWorker&) = delete;
  /// Movable between calls (a `Worker` takes the `DenseOnRing` holding one by value).
  AllReduceWorker(AllReduceWorker&&) = default;
  AllReduceWorker& operator=(AllReduceWorker&&) = default;

  /// Starts every replica from rank 0's parameters: rank 0 fills each variable from its
  /// initializer and `seed` (as a chief fills the ps tasks), and `synchronize` copies them,
  /// with the fresh optimizer state, to the others. Every rank calls it once, before the
  /// first step (or `restore` instead).
  void initialize(std::uint64_t seed) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    if (ring_.rank() == 0) {
      for (std::size_t v = 0; v < variables.size(); ++v) pulley::initialize(variables[v], seed, model_.parameter(v));
    }
    synchronize(0);
  }

  /// Copies rank `root`'s replica to every rank: the parameters, every optimizer slot and
  /// counter, and the step count. Every rank calls it, at the same point of its calls (after
  /// a checkpoint restored on one rank only, say).
  void synchronize(std::size_t root) {
    for (std::size_t v = 0; v < states_.size(); ++v) {
      reduce_.broadcast(ring_, model_.parameter(v), root);
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) reduce_.broadcast(ring_, slot.values, root);
    }
    // The counters and the step, their bits carried as floats (a broadcast copies bits).
    std::vector<std::int64_t> counts{global_step_, refused_};
    for (auto& state : states_) {
      for (const OptimizerCounter& c : counters_of(optimizer_, state)) counts.push_back(*c.value);
    }
    std::vector<float> bits(counts.size() * 2);
    std::memcpy(bits.data(), counts.data(), counts.size() * sizeof(std::int64_t));
    reduce_.broadcast(ring_, bits, root);
    std::memcpy(counts.data(), bits.data(), counts.size() * sizeof(std::int64_t));
    global_step_ = counts[0];
    refused_ = counts[1];
    std::size_t at = 2;
    for (auto& state : states_) {
      for (const OptimizerCounter& c : counters_of(optimizer_, state)) *c.value = counts[at++];
    }
  }

  /// This replica as a checkpoint holds a model (any rank's: they are the same): each
  /// variable's values, slots and counters (one part: the whole variable), at global_step().
  /// `CheckpointDirectory::save` writes it.
  [[nodiscard]] ModelState state() {
    ModelState out;
    out.global_step = global_step_;
    const auto variables = std::span<const VariableSpec>(model_.variables());
    for (std::size_t v = 0; v < states_.size(); ++v) {
      VariableState held;
      held.spec = variables[v];
      const std::span<float> w = model_.parameter(v);
      held.values.assign(w.begin(), w.end());
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) {
        held.slots.push_back({std::string(slot.name), {slot.values.begin(), slot.values.end()}});
      }
      PartCounters counters{{0, variables[v].rows()}, {}};
      for (const OptimizerCounter& c : counters_of(optimizer_, states_[v])) {
        held.counter_names.emplace_back(c.name);
        counters.values.push_back(*c.value);
      }
      held.counters.push_back(std::move(counters));
      out.variables.push_back(std::move(held));
    }
    return out;
  }

  /// Takes `state` (a checkpoint of this model: this worker's or a ps job's) into this
  /// replica: values, the slots and counters it names, and its global step. Every rank
  /// restores the same checkpoint, or one rank restores and all `synchronize` from it.
  /// Throws kInvalidArgument naming the first variable that differs from the model's, or a
  /// slot or counter the optimizer does not have (a checkpoint of another optimizer).
  void restore(const ModelState& state) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    if (state.global_step < 0) {
      throw Error(ErrorCode::kInvalidArgument, "the checkpoint's global step " + std::to_string(state.global_step) +
                                                   " is negative");
    }
    if (state.variables.size() != variables.size()) {
      throw Error(ErrorCode::kInvalidArgument, "the checkpoint holds " + std::to_string(state.variables.size()) +
                                                   " variables, the model " + std::to_string(variables.size()));
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      const VariableState& held = state.variables[v];
      if (!(held.spec.name == variables[v].name && held.spec.shape == variables[v].shape) ||
          held.values.size() != variables[v].size()) {
        throw Error(ErrorCode::kInvalidArgument, "the checkpoint's variable '" + held.spec.name +
                                                     "' is not the model's '" + variables[v].name + "'");
      }
      bool finite = detail::all_finite(held.values);
      for (const SlotState& slot : held.slots) finite = finite && detail::all_finite(slot.values);
      if (!finite) {
        throw Error(ErrorCode::kInvalidArgument, "the checkpoint's '" + held.spec.name + "' holds non-finite values");
      }
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) {
        auto it = std::find_if(held.slots.begin(), held.slots.end(),
                               [&](const SlotState& s) { return s.name == slot.name; });
        if (it == held.slots.end() || it->values.size() != slot.values.size()) {
          throw Error(ErrorCode::kInvalidArgument, "the checkpoint holds no slot '" + std::string(slot.name) +
                                                       "' of the right size for '" + held.spec.name + "'");
        }
      }
      for (const OptimizerCounter& c : counters_of(optimizer_, states_[v])) {
        const auto k = static_cast<std::size_t>(
            std::find(held.counter_names.begin(), held.counter_names.end(), c.name) - held.counter_names.begin());
        const bool counted = std::any_of(held.counters.begin(), held.counters.end(),
                                         [&](const PartCounters& part) { return k < part.values.size(); });
        if (k == held.counter_names.size() || !counted) {
          throw Error(ErrorCode::kInvalidArgument, "the checkpoint holds no counter '" + std::string(c.name) +
                                                       "' for '" + held.spec.name + "'");
        }
      }
    }
    for (std::size_t v = 0; v < variables.size(); ++v) {
      const VariableState& held = state.variables[v];
      std::copy(held.values.begin(), held.values.end(), model_.parameter(v).begin());
      for (const OptimizerSlot& slot : slots_of(optimizer_, states_[v])) {
        auto it = std::find_if(held.slots.begin(), held.slots.end(),
                               [&](const SlotState& s) { return s.name == slot.name; });
        std::copy(it->values.begin(), it->values.end(), slot.values.begin());
      }
      const auto names = held.counter_names;
      for (const OptimizerCounter& c : counters_of(optimizer_, states_[v])) {
        // A ps job's checkpoint holds one count per part: the parts of a variable were
        // updated alike, and the largest count is the variable's.
        const auto k = static_cast<std::size_t>(std::find(names.begin(), names.end(), c.name) - names.begin());
        std::int64_t largest = 0;
        for (const PartCounters& part : held.counters) {
          if (k < part.values.size()) largest = std::max(largest, part.values[k]);
        }
        *c.value = largest;
      }
    }
    global_step_ = state.global_step;
  }

  /// One synchronous step on this rank's `batch`: compute the gradient, sum it with every
  /// other rank's, apply the mean. Every rank calls it the same number of times. A lost
  /// neighbour throws what the ring throws (kUnavailable, kDeadlineExceeded) before
  /// anything is applied: no partial sum ever reaches the parameters (though a rank that
  /// had its whole sum before the ring broke has applied it: ranks may then stand a step
  /// apart, and `synchronize` from the one furthest on brings them together). `regroup`
  /// is this rank's vote to form the ring again after this step (a worker waits to join):
  /// the sum carries it, and AllReduceStep::regroup tells every rank alike.
  AllReduceStep step(const typename M::Batch& batch, bool regroup = false) {
    return sum_and_apply(static_cast<float>(model_.compute_gradients(batch)), regroup);
  }

  /// `step` for a model with embedding tables (TableModel): `tables` are the rows the batch
  /// uses, as a ps worker pulled them, and their gradients are written into them as
  /// `compute_gradients(batch, tables)` writes them; only the dense gradients are summed on
  /// the ring and applied here (`DenseOnRing` pushes the rows' to the ps tasks).
  AllReduceStep step(const typename M::Batch& batch, std::span<const TableBatch> tables, bool regroup = false)
    requires TableModel<M>
  {
    return sum_and_apply(static_cast<float>(model_.compute_gradients(batch, tables)), regroup);
  }

 private:
  /// Sums the gradients `compute_gradients` left in the model (none when `adds` is false:
  /// zeros), `loss`, a count of the ranks that added one, and the vote with every rank's,
  /// and applies the mean over the ranks that added one.
  AllReduceStep sum_and_apply(float loss, bool regroup, bool adds = true) {
    const std::size_t nvars = states_.size();
    if (adds) {
      for (std::size_t v = 0; v < nvars; ++v) {
        const std::span<const float> g = model_.gradient(v);
        std::copy(g.begin(), g.end(), flat_.begin() + static_cast<std::ptrdiff_t>(offsets_[v]));
      }
    } else {
      std::fill(flat_.begin(), flat_.end(), -0.0F);  // the exact identity of +: x + -0 is x, -0 too
    }
    const std::size_t tail = offsets_.back();
    flat_[tail] = adds ? loss : 0.0F;
    flat_[tail + 1] = adds ? 1.0F : 0.0F;
    flat_[tail + 2] = regroup ? 1.0F : 0.0F;
    reduce_.sum(ring_, flat_);
    const bool voted = flat_[tail + 2] > 0.0F;
    const float added = flat_[tail + 1];
    if (added < 1.0F) {
      throw Error(ErrorCode::kFailedPrecondition, "ring: no rank added a gradient to step " +
                                                      std::to_string(global_step_ + 1) + " (every rank follows)");
    }
    for (float& x : std::span<float>(flat_).first(tail + 1)) x /= added;
    ++global_step_;
    AllReduceStep result{flat_[tail], global_step_, apply(), voted};
    if (!result.applied) ++refused_;
    return result;
  }

 public:
  /// Takes the step the other ranks take without a batch of its own: this rank adds no
  /// gradient (nor loss), and every rank applies the mean over the ranks that added one, so
  /// this replica stays bit-identical to theirs. A replica that follows training: the
  /// chief's of a hybrid job (runner/hybrid.hpp), which it checkpoints and evaluates. Every
  /// rank of the ring calls `step` or `follow` once a step; at least one calls `step`.
  AllReduceStep follow() { return sum_and_apply(0.0F, false, false); }

  /// Returns once every rank has called it: a sum of one float per rank, which no rank
  /// holds whole before every rank has added its part (torch.distributed's barrier). Every
  /// rank calls it at the same point of its calls. Each rank's part is its step count, so
  /// it also checks that every rank has taken as many steps as this one: kFailedPrecondition
  /// if not. A lost neighbour throws as in `step`.
  void barrier() {
    // Each rank's step in its own slot (the others add zeros, exactly): every rank sees every
    // rank's step, its low 24 bits, which a float holds exactly.
    const auto mine = static_cast<float>(global_step_ % (std::int64_t{1} << 24));
    std::vector<float> parts(ring_.size(), 0.0F);
    parts[ring_.rank()] = mine;
    reduce_.sum(ring_, parts);
    for (const float part : parts) {
      if (part != mine) {
        throw Error(ErrorCode::kFailedPrecondition, "ring: rank " + std::to_string(ring_.rank()) +
                                                        " reached the barrier at global step " +
                                                        std::to_string(global_step_) + ", another rank at another");
      }
    }
  }

  /// Goes on over `ring` (one formed again after the old one broke, or to take a worker
  /// in): every rank of it then calls `synchronize` from the same root before its next step.
  void reform(R ring) {
    ring_ = std::move(ring);
    sent_before_ += reduce_.bytes_sent();
    reduce_ = RingAllReduce(reduce_.segment());
  }

  /// The model, its parameters those of every replica.
  [[nodiscard]] M& model() noexcept { return model_; }
  [[nodiscard]] const M& model() const noexcept { return model_; }
  /// The optimizer's state of variable `v`.
  [[nodiscard]] const typename O::State& optimizer_state(std::size_t v) const { return states_.at(v); }
  /// Steps taken (the same on every rank).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }
  /// Steps whose mean gradient was not applied (non-finite).
  [[nodiscard]] std::int64_t refused_steps() const noexcept { return refused_; }
  /// This rank, the ring's size, and the bytes it has sent.
  [[nodiscard]] std::size_t rank() const { return ring_.rank(); }
  [[nodiscard]] std::size_t num_workers() const { return ring_.size(); }
  [[nodiscard]] std::uint64_t bytes_sent() const noexcept { return sent_before_ + reduce_.bytes_sent(); }

 private:
  /// Applies the mean in flat_ to every variable, or to none; true if it did.
  bool apply() {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    const std::size_t nvars = states_.size();
    // The loss rides at the end: a non-finite loss is reported, not a reason to refuse.
    if (!detail::all_finite(std::span<const float>(flat_).first(offsets_.back()))) return false;
    auto gradient = [&](std::size_t v) {
      return std::span<const float>(flat_).subspan(offsets_[v], offsets_[v + 1] - offsets_[v]);
    };
    auto context = [&](std::size_t v) {
      return UpdateContext{global_step_ - 1, variables[v].name, {0, variables[v].rows()}, variables[v].row_size()};
    };
    if constexpr (PredictsFiniteness<O>) {
      for (std::size_t v = 0; v < nvars; ++v) {
        if (!optimizer_.stays_finite(states_[v], model_.parameter(v), gradient(v))) return false;
      }
      for (std::size_t v = 0; v < nvars; ++v) {
        apply_update(optimizer_, states_[v], model_.parameter(v), gradient(v), context(v));
      }
    } else {
      std::vector<std::vector<float>> values(nvars);
      std::vector<typename O::State> states;
      states.reserve(nvars);
      for (std::size_t v = 0; v < nvars; ++v) {
        const std::span<float> w = model_.parameter(v);
        values[v].assign(w.begin(), w.end());
        states.push_back(states_[v]);
        apply_update(optimizer_, states.back(), std::span<float>(values[v]), gradient(v), context(v));
        if (!detail::all_finite(values[v])) return false;
        for (const OptimizerSlot& slot : slots_of(optimizer_, states.back())) {
          if (!detail::all_finite(slot.values)) return false;
        }
      }
      for (std::size_t v = 0; v < nvars; ++v) {
        std::copy(values[v].begin(), values[v].end(), model_.parameter(v).begin());
        states_[v] = std::move(states[v]);
      }
    }
    return true;
  }

  M model_;
  O optimizer_;
  R ring_;
  RingAllReduce reduce_;
  std::vector<typename O::State> states_;  ///< one per variable
  std::vector<std::size_t> offsets_;       ///< where each variable's gradient starts in flat_
  std::vector<float> flat_;  ///< every gradient, the loss, the ranks that added, the vote: what the ring sums
  std::int64_t global_step_ = 0;
  std::int64_t refused_ = 0;
  std::uint64_t sent_before_ = 0;  ///< over the rings before this one
};

}  // namespace pulley
