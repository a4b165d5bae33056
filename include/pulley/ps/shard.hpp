// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/ps/table_shard.hpp"

namespace pulley {

/// A part of a dense variable held by a ps task, with what the ps keeps beside it.
template <Optimizer O, SyncPolicy P>
struct HeldPart {
  Part part;                            ///< which rows of which variable
  std::uint32_t index = 0;              ///< its global index in the placement
  std::size_t row_size = 0;             ///< elements per row
  std::vector<float> values;            ///< the parameters
  typename O::State optimizer_state;    ///< the optimizer's slots and counters for it
  typename P::Accumulator accumulator;  ///< gradients of the update in progress
  bool initialized = false;
  /// The largest magnitude among its values and slots as the last `apply_bounded` left
  /// them (BoundsMagnitudes); +infinity while unknown: set otherwise since (initialized,
  /// restored), or never measured.
  float largest = std::numeric_limits<float>::infinity();
};

/// What one ps task holds of the model: the parts of dense variables placed on it, each
/// with its optimizer State and the sync policy's accumulator, and the rows of every
/// embedding table it holds (TableShard). It is the unit a checkpoint reads and a restore
/// sets; it also knows the model it is a shard of (variables, tables, placement), to check
/// requests against it and to name what it refuses.
///
/// It neither paces nor applies: the ps's Update applies the pushes the sync policy lets
/// through.
///
/// @tparam O the dense variables' Optimizer
/// @tparam P the SyncPolicy (its Accumulator is kept per part)
/// @tparam T the table policy (Tables<...>, or NoTables)
template <Optimizer O, SyncPolicy P, class T>
class Shard {
 public:
  using Part = HeldPart<O, P>;
  static constexpr std::size_t kNotHere = static_cast<std::size_t>(-1);

  Shard(std::uint32_t task, O optimizer, T tables)
      : task_(task), optimizer_(std::move(optimizer)), tables_(std::move(tables)) {}

  /// Holds the parts of `r`'s model that `placement` puts on this ps (zeros, a fresh
  /// optimizer State, an empty accumulator; not initialized) and empty tables. Everything
  /// that may throw (allocation, `make_state`) happens before anything is kept: a throw
  /// leaves the shard as it was.
  void assign(Register&& r, Placement&& placement, std::span<const std::uint32_t> members, const P& sync) {
    std::vector<Part> parts;
    std::vector<std::size_t> local(placement.parts.size(), kNotHere);
    for (std::size_t i = 0; i < placement.parts.size(); ++i) {
      const pulley::Part& part = placement.parts[i];
      if (part.ps != task_) continue;
      const std::size_t row_size = r.variables[part.variable].row_size();
      const std::size_t n = part.rows.size() * row_size;
      local[i] = parts.size();
      parts.push_back(Part{part, static_cast<std::uint32_t>(i), row_size, std::vector<float>(n, 0.0F),
                           optimizer_.make_state(n), sync.make_accumulator(n), false});
    }
    TableShard<T> tables(tables_.policy());
    tables.assign(task_, members, r.tables, r.table_seed);
    std::uint64_t bytes = 0;
    for (const Part& part : parts) bytes += part.values.size() * sizeof(float);
    std::vector<std::string> slot_names, counter_names;
    state_names(slot_names, counter_names);
    tables_ = std::move(tables);
    parts_ = std::move(parts);
    local_ = std::move(local);
    variables_ = std::move(r.variables);
    table_specs_ = std::move(r.tables);
    table_seed_ = r.table_seed;
    placement_ = std::move(placement);
    held_bytes_ = bytes;
    slots_per_part_ = slot_names.size();
    initialized_ = 0;
    assigned_ = true;
  }

  /// Bytes of the values of the dense parts held here.
  [[nodiscard]] std::uint64_t held_bytes() const noexcept { return held_bytes_; }
  /// True once `assign`ed: a model is registered.
  [[nodiscard]] bool assigned() const noexcept { return assigned_; }
  /// True if `r` registers the model held here.
  [[nodiscard]] bool holds(const Register& r) const {
    return r.variables == variables_ && r.tables == table_specs_ && r.table_seed == table_seed_;
  }

  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  [[nodiscard]] const O& optimizer() const noexcept { return optimizer_; }
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept { return variables_; }
  [[nodiscard]] const std::vector<TableSpec>& table_specs() const noexcept { return table_specs_; }
  [[nodiscard]] std::uint64_t table_seed() const noexcept { return table_seed_; }
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  [[nodiscard]] std::span<Part> parts() noexcept { return parts_; }
  [[nodiscard]] std::span<const Part> parts() const noexcept { return parts_; }
  [[nodiscard]] TableShard<T>& tables() noexcept { return tables_; }
  [[nodiscard]] const TableShard<T>& tables() const noexcept { return tables_; }

  /// The part of global index `part` if it is held here, else null.
  [[nodiscard]] Part* find(std::uint32_t part) noexcept {
    return part < local_.size() && local_[part] != kNotHere ? &parts_[local_[part]] : nullptr;
  }

  /// True once every part held here is initialized (or restored).
  [[nodiscard]] bool initialized() const noexcept { return initialized_ == parts_.size(); }

  /// The names of the optimizer's slots and counters (those of a fresh State: they do not
  /// depend on its size).
  void state_names(std::vector<std::string>& slots, std::vector<std::string>& counters) const {
    typename O::State probe = optimizer_.make_state(0);
    for (const OptimizerSlot& slot : slots_of(optimizer_, probe)) slots.emplace_back(slot.name);
    for (const OptimizerCounter& counter : counters_of(optimizer_, probe)) counters.emplace_back(counter.name);
  }

  /// The most tensor bytes a request can carry: a push or an initialization has one value
  /// per element held here, a restore one more per optimizer slot, a push its rows.
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return held_bytes_ * (1 + slots_per_part_) + tables_.max_payload();
  }

  /// Why `parts` (of an Initialize or a Push) cannot be taken, or nullopt: a part not held
  /// here, sent twice, of the wrong size, or with non-finite values (unless `finite_known`).
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<PartValues>& parts, bool finite_known) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const PartValues& pv = parts[i];
      const Part* held = find(pv.part);
      if (held == nullptr) return ErrorReply{ErrorCode::kNotFound, unknown_part(pv.part)};
      if (pv.values.size() != held->values.size()) {
        return ErrorReply{ErrorCode::kInvalidArgument, describe(held->part) + " has " +
                                                           std::to_string(held->values.size()) +
                                                           " elements, got " + std::to_string(pv.values.size())};
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (parts[j].part == pv.part) {
          return ErrorReply{ErrorCode::kInvalidArgument, describe(held->part) + " is sent twice"};
        }
      }
      if (!finite_known && !detail::all_finite(pv.values)) {
        return ErrorReply{ErrorCode::kInvalidArgument, "non-finite (NaN or Inf) values for " +
                                                           describe(held->part) + "; nothing was applied"};
      }
    }
    return std::nullopt;
  }

  /// Why `slices` (of a Pull) cannot be read here, or nullopt: a part not held here, rows
  /// outside it, or rows asked twice (so a reply is never larger than what is held here).
  [[nodiscard]] std::optional<ErrorReply> check(const std::vector<Slice>& slices) {
    for (const Slice& s : slices) {
      const Part* held = find(s.part);
      if (held == nullptr) return ErrorReply{ErrorCode::kNotFound, unknown_part(s.part)};
      if (s.rows.empty() || s.rows.begin < held->part.rows.begin || s.rows.end > held->part.rows.end) {
        return ErrorReply{ErrorCode::kInvalidArgument, "rows [" + std::to_string(s.rows.begin) + ", " +
                                                           std::to_string(s.rows.end) + ") are outside " +
                                                           describe(held->part)};
      }
    }
    if (const Slice* twice = overlapping(slices)) {
      return ErrorReply{ErrorCode::kInvalidArgument,
                        "a pull asks for rows of " + describe(find(twice->part)->part) + " twice (around rows [" +
                            std::to_string(twice->rows.begin) + ", " + std::to_string(twice->rows.end) + "))"};
    }
    return std::nullopt;
  }

  /// Why `parts` cannot be initialized (a part initialized already), or nullopt; checked
  /// with `check` first.
  [[nodiscard]] std::optional<ErrorReply> check_fresh(const std::vector<PartValues>& parts) {
    for (const PartValues& pv : parts) {
      const Part& held = *find(pv.part);
      if (held.initialized) {
        return ErrorReply{ErrorCode::kAlreadyExists, describe(held.part) + " is already initialized"};
      }
    }
    return std::nullopt;
  }

  /// Sets the initial values of `parts` (checked).
  void initialize(const std::vector<PartValues>& parts) {
    for (const PartValues& pv : parts) {
      Part& held = *find(pv.part);
      std::copy(pv.values.begin(), pv.values.end(), held.values.begin());
      held.initialized = true;
      held.largest = std::numeric_limits<float>::infinity();
      ++initialized_;
    }
  }

  /// The values `slices` (checked) name, as views of the parts, at global step `step`.
  PullReply read(const std::vector<Slice>& slices, std::int64_t step, Stats& stats) {
    PullReply answer{step, {}};
    answer.values.reserve(slices.size());
    for (const Slice& s : slices) {
      const Part& held = *find(s.part);
      const std::size_t offset = (s.rows.begin - held.part.rows.begin) * held.row_size;
      answer.values.push_back(std::span<const float>(held.values).subspan(offset, s.rows.size() * held.row_size));
      stats.bytes_pulled += static_cast<std::int64_t>(answer.values.back().size_bytes());
    }
    return answer;
  }

  /// Every part with its optimizer State, as views: a checkpoint's share of this ps.
  std::vector<PartState> read_state() {
    std::vector<PartState> out;
    out.reserve(parts_.size());
    for (Part& held : parts_) {
      PartState part{held.index, held.values, {}, {}};
      for (const OptimizerSlot& s : slots_of(optimizer_, held.optimizer_state)) part.slots.push_back(s.values);
      for (const OptimizerCounter& c : counters_of(optimizer_, held.optimizer_state)) part.counters.push_back(*c.value);
      out.push_back(std::move(part));
    }
    return out;
  }

  /// Why `parts` cannot restore this shard, or nullopt; else fills `by_part` (one per part
  /// held here, in part order) for `restore`. Each part held here must come once, with its
  /// size, finite values and the optimizer's slots and counters (or none: the optimizer
  /// then starts afresh, as for a checkpoint of another optimizer).
  [[nodiscard]] std::optional<ErrorReply> check_restore(const std::vector<PartState>& parts,
                                                        std::vector<const PartState*>& by_part) {
    if (parts.size() != parts_.size()) {
      return ErrorReply{ErrorCode::kInvalidArgument, "a restore must carry each of the " +
                                                         std::to_string(parts_.size()) + " parts held here, got " +
                                                         std::to_string(parts.size())};
    }
    by_part.assign(parts_.size(), nullptr);
    for (const PartState& ps : parts) {
      Part* held = find(ps.part);
      if (held == nullptr) return ErrorReply{ErrorCode::kNotFound, unknown_part(ps.part)};
      const std::size_t k = local_[ps.part];
      const auto slots = slots_of(optimizer_, held->optimizer_state);
      const auto counters = counters_of(optimizer_, held->optimizer_state);
      bool fits = by_part[k] == nullptr && ps.values.size() == held->values.size() &&
                  (ps.counters.empty() || ps.counters.size() == counters.size()) &&
                  (ps.slots.empty() || ps.slots.size() == slots.size());
      for (const auto& s : ps.slots) fits = fits && s.size() == held->values.size();
      if (!fits) {
        return ErrorReply{ErrorCode::kInvalidArgument,
                          "the restored state of " + describe(held->part) +
                              " does not fit it (its size, or the optimizer's slots and counters)"};
      }
      if (!detail::all_finite(ps.values)) {
        return ErrorReply{ErrorCode::kInvalidArgument, "non-finite values restored for " + describe(held->part)};
      }
      by_part[k] = &ps;
    }
    return std::nullopt;
  }

  /// Sets every part from `by_part` (checked by `check_restore`), its accumulator emptied.
  void restore(const std::vector<const PartState*>& by_part, const P& sync) {
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      Part& held = parts_[k];
      const PartState& ps = *by_part[k];
      std::copy(ps.values.begin(), ps.values.end(), held.values.begin());
      held.optimizer_state = optimizer_.make_state(held.values.size());
      const auto slots = slots_of(optimizer_, held.optimizer_state);
      for (std::size_t s = 0; s < ps.slots.size(); ++s) {
        std::copy(ps.slots[s].begin(), ps.slots[s].end(), slots[s].values.begin());
      }
      const auto counters = counters_of(optimizer_, held.optimizer_state);
      for (std::size_t c = 0; c < ps.counters.size(); ++c) *counters[c].value = ps.counters[c];
      held.accumulator = sync.make_accumulator(held.values.size());
      held.initialized = true;
      held.largest = std::numeric_limits<float>::infinity();
    }
    initialized_ = parts_.size();
    tables_.clear();
  }

  /// "variable 'w' part 2".
  [[nodiscard]] std::string describe(const pulley::Part& part) const {
    return "variable '" + variables_[part.variable].name + "' part " + std::to_string(part.index);
  }

  /// Why part `part` is not held here.
  [[nodiscard]] std::string unknown_part(std::uint32_t part) const {
    if (part >= placement_.parts.size()) {
      return "unknown part " + std::to_string(part) + " (the model has " +
             std::to_string(placement_.parts.size()) + " parts)";
    }
    return describe(placement_.parts[part]) + " is held by ps " + std::to_string(placement_.parts[part].ps) +
           ", not here";
  }

 private:
  /// A slice that overlaps another of `slices` (of the same part), or null.
  const Slice* overlapping(const std::vector<Slice>& slices) {
    if (slices.size() < 2) return nullptr;
    order_.resize(slices.size());
    for (std::size_t i = 0; i < slices.size(); ++i) order_[i] = &slices[i];
    std::sort(order_.begin(), order_.end(), [](const Slice* a, const Slice* b) {
      return a->part != b->part ? a->part < b->part : a->rows.begin < b->rows.begin;
    });
    for (std::size_t i = 1; i < order_.size(); ++i) {
      if (order_[i]->part == order_[i - 1]->part && order_[i]->rows.begin < order_[i - 1]->rows.end) {
        return order_[i];
      }
    }
    return nullptr;
  }

  std::uint32_t task_;
  [[no_unique_address]] O optimizer_;
  std::vector<Part> parts_;
  std::vector<std::size_t> local_;  ///< global part index → index in parts_, or kNotHere
  bool assigned_ = false;
  std::size_t initialized_ = 0;
  std::uint64_t held_bytes_ = 0;      ///< bytes of the parts' values
  std::uint64_t slots_per_part_ = 0;  ///< the optimizer's slots, which a Restore also carries
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> table_specs_;
  std::uint64_t table_seed_ = 0;
  Placement placement_;
  TableShard<T> tables_;
  std::vector<const Slice*> order_;  ///< scratch: a pull's slices, sorted
};

}  // namespace pulley
