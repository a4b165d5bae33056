// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/core/node.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/sharding/rebalance.hpp"

namespace pulley {

/// Where a ps task learns its model, and whether it may serve: what the chief registers is
/// checked (names, shapes, initializers, tables), placed with the sharding policy (every
/// ps computes the same placement, and the chief compares them), and the ps turns ready
/// once every part it holds is initialized or restored; WaitReady requests wait until
/// then. It also keeps the epoch: the restores so far, which every request of a step
/// carries, so that what a client began before a rollback is refused after it.
///
/// @tparam S the Sharding policy
template <Sharding S>
class Registration {
 public:
  /// Elements a variable may have: 4 TiB of floats, beyond any ps, and no product of its
  /// shape wraps around on the way.
  static constexpr std::size_t kMaxElements = std::size_t{1} << 40U;
  /// Floats in a row of an embedding table.
  static constexpr std::size_t kMaxTableDim = std::size_t{1} << 16U;

  Registration(std::uint32_t task, std::uint32_t num_ps, S sharding)
      : task_(task), num_ps_(num_ps), sharding_(std::move(sharding)) {}

  /// Why the model of `r` cannot be registered, or nullopt with its placement in `placement`.
  /// `serves_tables`: the ps has a table policy.
  [[nodiscard]] std::optional<ErrorReply> check(const Register& r, bool serves_tables, Placement& placement) const {
    if (auto problem = check_variables(r.variables); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, std::move(problem)};
    }
    if (!r.tables.empty() && !serves_tables) {
      return ErrorReply{ErrorCode::kFailedPrecondition,
                        "the model has embedding tables, and this ps serves none: its optimizer has no "
                        "row-wise apply (RowWiseOptimizer); compose ParameterServer<S, O, P, "
                        "Tables<Adagrad>> or another RowWiseOptimizer for the tables"};
    }
    if (auto problem = check_tables(r.tables, r.variables); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, std::move(problem)};
    }
    const std::vector<std::uint32_t> members = members_of(r);
    if (auto problem = check_members(r, members); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, std::move(problem)};
    }
    const std::uint32_t tasks = tasks_of(r);
    placement = sharding_.place(r.variables, tasks);
    if (auto problem = check_placement(r.variables, placement, all_tasks(tasks)); !problem.empty()) {
      return ErrorReply{ErrorCode::kInvalidArgument, "the sharding policy is broken: " + problem};
    }
    if (members.size() != tasks) {
      // Placed again from the cluster's first placement, so that every process computes
      // the same from the members alone, whatever changes came before.
      try {
        placement = rebalance(sharding_, r.variables, placement, members);
      } catch (const Error& e) {
        return ErrorReply{ErrorCode::kInvalidArgument, std::string("the sharding policy cannot rebalance: ") + e.what()};
      }
      if (auto problem = check_placement(r.variables, placement, members); !problem.empty()) {
        return ErrorReply{ErrorCode::kInvalidArgument, "the sharding policy's rebalance is broken: " + problem};
      }
    }
    return std::nullopt;
  }

  /// The ps tasks `r` registers the model over: its members, or every ps task.
  [[nodiscard]] std::vector<std::uint32_t> members_of(const Register& r) const {
    return r.members.empty() ? all_tasks(num_ps_) : r.members;
  }

  /// The ps tasks the job has known when `r` is registered (members or not): the cluster
  /// spec's, or as many as `r` names addresses of once a ps joined. The placement is
  /// computed over this many, then placed again over the members.
  [[nodiscard]] std::uint32_t tasks_of(const Register& r) const {
    return r.ps_addresses.empty() ? num_ps_ : static_cast<std::uint32_t>(r.ps_addresses.size());
  }

  /// The job's ps tasks, ascending, as last registered (every ps task before that).
  [[nodiscard]] const std::vector<std::uint32_t>& members() const noexcept { return members_; }
  /// Their version (Register::membership).
  [[nodiscard]] std::uint64_t membership() const noexcept { return membership_; }
  /// Every ps task's address once a ps joined beyond the cluster spec (empty before).
  [[nodiscard]] const std::vector<std::string>& ps_addresses() const noexcept { return ps_addresses_; }
  /// A model is registered over `members` (members_of), at version `membership`, with the
  /// ps tasks' addresses `ps_addresses` (Register::ps_addresses).
  void registered(std::vector<std::uint32_t> members, std::uint64_t membership,
                  std::vector<std::string> ps_addresses) {
    members_ = std::move(members);
    membership_ = membership;
    ps_addresses_ = std::move(ps_addresses);
  }

  /// True once every part held here is initialized (or restored): the ps serves training.
  [[nodiscard]] bool ready() const noexcept { return ready_; }

  /// Parks a WaitReady until the ps is ready.
  void wait_ready(Responder& reply) { waiters_.emplace_back(std::exchange(reply, nullptr)); }

  /// The ps is ready: each waiting WaitReady gets `answer()` (a PlacementReply).
  template <class Answer>
  void become_ready(Answer&& answer) {
    ready_ = true;
    for (Responder& waiter : std::exchange(waiters_, {})) respond(waiter, answer());
  }

  /// The ps stops serving training until it is ready again (a restore in progress).
  void unready() noexcept { ready_ = false; }

  /// Answers every waiting WaitReady with `error`.
  void answer_all(const ErrorReply& error) {
    for (Responder& waiter : std::exchange(waiters_, {})) respond(waiter, ErrorReply{error});
  }

  /// Restores so far.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// A restore at global step `step` began epoch `epoch`.
  void restored(std::uint64_t epoch, std::int64_t step) noexcept {
    epoch_ = epoch;
    restored_step_ = step;
  }
  /// The global step of the last restore.
  [[nodiscard]] std::int64_t restored_step() const noexcept { return restored_step_; }

  /// Why a request (`what`) of epoch `epoch` is refused, or nullopt if it is this ps's. A
  /// later epoch: the sender saw another ps restored already, and this one's restore is on
  /// its way (kUnavailable: try again). An earlier one: the job was rolled back since its
  /// sender last looked (kFailedPrecondition: start the step again).
  [[nodiscard]] std::optional<ErrorReply> check_epoch(std::uint64_t epoch, std::string_view what) const {
    if (epoch == epoch_) return std::nullopt;
    if (epoch > epoch_) {
      return ErrorReply{ErrorCode::kUnavailable, "ps " + std::to_string(task_) + " is not restored to epoch " +
                                                     std::to_string(epoch) + " yet (it is at epoch " +
                                                     std::to_string(epoch_) + "): try again"};
    }
    return ErrorReply{ErrorCode::kFailedPrecondition,
                      std::string(what) + " of epoch " + std::to_string(epoch) + " refused: the job was " +
                          "restored at global step " + std::to_string(restored_step_) + " (restore epoch " +
                          std::to_string(epoch_) + "; from a checkpoint, or its state moved between ps tasks): "
                          "wait until ready and start the step again"};
  }

  /// Why `variables` cannot be registered, or "": a name missing or used twice, no
  /// elements, more than kMaxElements, an unknown initializer.
  static std::string check_variables(const std::vector<VariableSpec>& variables) {
    std::unordered_set<std::string_view> names;
    for (std::size_t i = 0; i < variables.size(); ++i) {
      const VariableSpec& v = variables[i];
      if (v.name.empty()) return "variable " + std::to_string(i) + " has no name";
      std::size_t elements = 1;  // the shape's product, which must not wrap around
      for (const std::size_t d : v.shape) {
        if (d != 0 && elements > kMaxElements / d) {
          return "variable '" + v.name + "' has more elements than a ps can hold (2^40 at most)";
        }
        elements *= d;
      }
      if (elements == 0) return "variable '" + v.name + "' has no elements";
      if (v.initializer.kind > Initializer::Kind::kGlorotUniform) {
        return "variable '" + v.name + "' has an unknown initializer";
      }
      if (!names.insert(v.name).second) return "variable name '" + v.name + "' is used twice";
    }
    return {};
  }

  /// Why `tables` cannot be registered beside `variables`, or "".
  static std::string check_tables(const std::vector<TableSpec>& tables, const std::vector<VariableSpec>& variables) {
    std::unordered_set<std::string_view> names;
    for (const VariableSpec& v : variables) names.insert(v.name);
    for (std::size_t i = 0; i < tables.size(); ++i) {
      const TableSpec& t = tables[i];
      if (t.name.empty()) return "table " + std::to_string(i) + " has no name";
      if (t.dim == 0 || t.dim > kMaxTableDim) {
        return "table '" + t.name + "' has dim " + std::to_string(t.dim) + " (1 to " + std::to_string(kMaxTableDim) +
               ")";
      }
      if (t.initializer.kind > Initializer::Kind::kNormal) {
        return "table '" + t.name +
               "': its rows need zeros, constant, uniform or normal initial values (Glorot's rule has no "
               "fans in a table)";
      }
      if (t.admit_after == 0) return "table '" + t.name + "' has admit_after 0 (1 admits at once)";
      if (t.evict_after_steps < 0) return "table '" + t.name + "' has a negative evict_after_steps";
      if (!names.insert(t.name).second) return "name '" + t.name + "' is used twice";
    }
    return {};
  }

  /// Why `placement` is not one of `variables` over the ps tasks `members` (ascending), or
  /// "": each variable's parts in order, on members, covering its rows exactly once.
  static std::string check_placement(const std::vector<VariableSpec>& variables, const Placement& placement,
                                     std::span<const std::uint32_t> members) {
    if (placement.num_variables() != variables.size()) return "wrong number of variables";
    for (std::size_t v = 0; v < variables.size(); ++v) {
      std::size_t next_row = 0;
      std::uint32_t index = 0;
      for (const Part& part : placement.parts_of(v)) {
        if (part.variable != v || part.index != index++) return "parts are out of order";
        if (!std::binary_search(members.begin(), members.end(), part.ps)) {
          return "a part is placed on ps " + std::to_string(part.ps) + ", which is not a ps task of the job";
        }
        if (part.rows.begin != next_row || part.rows.empty()) {
          return "the parts of '" + variables[v].name + "' do not cover its rows exactly once";
        }
        next_row = part.rows.end;
      }
      if (next_row != variables[v].rows()) {
        return "the parts of '" + variables[v].name + "' do not cover its rows exactly once";
      }
    }
    return {};
  }

 private:
  /// Why `members` cannot be the job's ps tasks, or "": each a ps task of the cluster, once,
  /// ascending, this one among them; its tables' rows placeable over them.
  [[nodiscard]] std::string check_members(const Register& r, const std::vector<std::uint32_t>& members) const {
    if (std::string why = check_task_set(members, "ps task"); !why.empty()) return why;
    if (!r.ps_addresses.empty()) {
      // A new ps's own cluster spec may list tasks beyond the job's: the chief's list rules.
      if (r.ps_addresses.size() <= task_ || r.ps_addresses.size() > kMaxTasks) {
        return "the registration names " + std::to_string(r.ps_addresses.size()) + " ps addresses: not this ps " +
               std::to_string(task_) + ", or more than a job's " + std::to_string(kMaxTasks);
      }
      for (const std::string& address : r.ps_addresses) {
        if (address.empty() || address.size() > 255) return "a ps address of the registration is empty or too long";
      }
      if (r.membership == 0) return "ps addresses beyond the cluster spec come with a membership above 0";
    }
    const std::uint32_t tasks = tasks_of(r);
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] >= tasks) {
        return "ps " + std::to_string(members[i]) + " is not a ps task of the cluster (it has " +
               std::to_string(tasks) + ")";
      }
    }
    if (!std::binary_search(members.begin(), members.end(), task_)) {
      return "ps " + std::to_string(task_) + " is not among the members registered";
    }
    if (members.size() != tasks && r.membership == 0) {
      return "the members differ from the cluster's ps tasks at membership 0 (the cluster's own shape)";
    }
    return {};
  }

  [[nodiscard]] static std::vector<std::uint32_t> all_tasks(std::uint32_t n) {
    std::vector<std::uint32_t> all(n);
    for (std::uint32_t i = 0; i < n; ++i) all[i] = i;
    return all;
  }

  /// Ps tasks a job may ever have known: a bound on what a registration may name.
  static constexpr std::size_t kMaxTasks = 4096;

  std::uint32_t task_;
  std::uint32_t num_ps_;
  std::vector<std::uint32_t> members_ = all_tasks(num_ps_);
  std::uint64_t membership_ = 0;
  std::vector<std::string> ps_addresses_;
  [[no_unique_address]] S sharding_;
  bool ready_ = false;
  std::vector<Responder> waiters_;
  std::uint64_t epoch_ = 0;           ///< restores so far (Restore::epoch)
  std::int64_t restored_step_ = 0;    ///< the global step of the last restore
};

}  // namespace pulley
