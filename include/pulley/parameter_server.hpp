// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/detail/finite.hpp"
#include "pulley/messages.hpp"

namespace pulley {

/// How a transport hands a ps its way to answer one request. It may be called later (a
/// TakeToken waits for a token) but exactly once, and it must copy or send any views in the
/// Response before returning.
using Responder = std::function<void(Response&&)>;

/// One ps task: holds the parts of every variable placed on it, aggregates the gradients
/// pushed to them and applies the optimizer.
///
/// It is a message handler and does no I/O: a transport's serving loop calls `handle` for
/// every request from one thread, so the same logic runs in-process and over the network,
/// and nothing here needs a lock.
///
/// @tparam S Sharding policy: which ps holds which rows (every ps computes the same placement)
/// @tparam O Optimizer applied to each part, with its per-part slots kept beside the part
/// @tparam P SyncPolicy: async, SyncReplicas, ... decides when gradients are applied
///
/// Bad requests are answered with an ErrorReply and change nothing; the server keeps
/// serving. A push is all-or-nothing: it is checked whole (known parts, sizes, finite
/// values, the last unless `Push::finite_checked` says that was done) before any of it is
/// accumulated, so a NaN or Inf gradient is refused with `kInvalidArgument` instead of
/// poisoning the parameters.
template <Sharding S, Optimizer O, SyncPolicy P>
class ParameterServer {
 public:
  /// @param task    this ps task's index
  /// @param num_ps  the number of ps tasks in the cluster
  ParameterServer(std::uint32_t task, std::uint32_t num_ps, O optimizer, P sync, S sharding = {})
      : task_(task),
        num_ps_(num_ps),
        optimizer_(std::move(optimizer)),
        sync_(std::move(sync)),
        sharding_(std::move(sharding)),
        step_votes_(sync_.make_accumulator(0)) {
    if (num_ps == 0 || task >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "ps task " + std::to_string(task) +
                                                   " is outside a cluster of " +
                                                   std::to_string(num_ps) + " ps tasks");
    }
  }

  /// Handles one request; `reply` is called exactly once, now or later.
  void handle(Request&& request, Responder reply) {
    if (stopped_) {
      reply(ErrorReply{ErrorCode::kCancelled, "ps " + std::to_string(task_) + " is shut down"});
      return;
    }
    std::visit([&](auto& r) { on(r, reply); }, request);
  }

  /// True once a Shutdown request was handled; the serving loop then ends.
  [[nodiscard]] bool stopped() const noexcept { return stopped_; }
  /// This ps task's index.
  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  /// Counters, as GetStats answers them.
  [[nodiscard]] Stats stats() const noexcept {
    Stats s = stats_;
    s.global_step = global_step();
    return s;
  }

 private:
  /// A part held here, with the optimizer's slots and the sync policy's accumulator.
  struct Slot {
    Part part;
    std::size_t row_size = 0;
    std::vector<float> values;
    typename O::State optimizer_state;
    typename P::Accumulator accumulator;
    bool initialized = false;
  };

  struct WaitingPull {
    Pull request;
    Responder reply;
  };

  struct TokenWaiter {
    std::uint32_t worker;
    Responder reply;
  };

  void reject(Responder& reply, ErrorCode code, std::string message) {
    ++stats_.requests_rejected;
    reply(ErrorReply{code, "ps " + std::to_string(task_) + ": " + std::move(message)});
  }

  // ---- Register -------------------------------------------------------------------------

  void on(Register& r, Responder& reply) {
    if (registered_) {
      if (r.variables == variables_) {
        reply(PlacementReply{variables_, placement_});
      } else {
        reject(reply, ErrorCode::kAlreadyExists, "a different model is already registered");
      }
      return;
    }
    if (auto problem = check_variables(r.variables); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, problem);
      return;
    }
    Placement placement = sharding_.place(r.variables, num_ps_);
    if (auto problem = check_placement(r.variables, placement); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, "the sharding policy is broken: " + problem);
      return;
    }
    variables_ = std::move(r.variables);
    placement_ = std::move(placement);
    slot_of_part_.assign(placement_.parts.size(), kNotHere);
    for (const Part& part : placement_.parts) {
      if (part.ps != task_) continue;
      const std::size_t row_size = variables_[part.variable].row_size();
      const std::size_t n = part.rows.size() * row_size;
      slot_of_part_[&part - placement_.parts.data()] = slots_.size();
      slots_.push_back(Slot{part, row_size, std::vector<float>(n, 0.0F), optimizer_.make_state(n),
                            sync_.make_accumulator(n), false});
    }
    registered_ = true;
    reply(PlacementReply{variables_, placement_});
    if (slots_.empty()) become_ready();
  }

  static std::string check_variables(const std::vector<VariableSpec>& variables) {
    for (std::size_t i = 0; i < variables.size(); ++i) {
      const VariableSpec& v = variables[i];
      if (v.name.empty()) return "variable " + std::to_string(i) + " has no name";
      if (v.size() == 0) return "variable '" + v.name + "' has no elements";
      for (std::size_t j = 0; j < i; ++j) {
        if (variables[j].name == v.name) return "variable name '" + v.name + "' is used twice";
      }
    }
    return {};
  }

  std::string check_placement(const std::vector<VariableSpec>& variables,
                              const Placement& placement) const {
    if (placement.num_variables() != variables.size()) return "wrong number of variables";
    for (std::size_t v = 0; v < variables.size(); ++v) {
      std::size_t next_row = 0;
      std::uint32_t index = 0;
      for (const Part& part : placement.parts_of(v)) {
        if (part.variable != v || part.index != index++) return "parts are out of order";
        if (part.ps >= num_ps_) return "a part is placed on a ps task that does not exist";
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

  // ---- Initialize / WaitReady -----------------------------------------------------------

  void on(Initialize& r, Responder& reply) {
    if (!registered_) {
      reject(reply, ErrorCode::kFailedPrecondition, "initialize before the model is registered");
      return;
    }
    if (!check_parts(r.parts, reply)) return;
    for (const PartValues& pv : r.parts) {
      const Slot* slot = &slots_[slot_of_part_[pv.part]];
      if (slot->initialized) {
        reject(reply, ErrorCode::kAlreadyExists, describe(slot->part) + " is already initialized");
        return;
      }
    }
    for (const PartValues& pv : r.parts) {
      Slot& slot = slots_[slot_of_part_[pv.part]];
      std::copy(pv.values.begin(), pv.values.end(), slot.values.begin());
      slot.initialized = true;
      ++initialized_slots_;
    }
    reply(Ack{});
    if (initialized_slots_ == slots_.size() && !ready_) become_ready();
  }

  void on(WaitReady& /*r*/, Responder& reply) {
    if (ready_) {
      reply(PlacementReply{variables_, placement_});
    } else {
      ready_waiters_.push_back(std::move(reply));
    }
  }

  void become_ready() {
    ready_ = true;
    release_tokens();
    for (Responder& waiter : std::exchange(ready_waiters_, {}))
      waiter(PlacementReply{variables_, placement_});
  }

  // ---- TakeToken ------------------------------------------------------------------------

  void on(TakeToken& r, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "token requested before initialization");
      return;
    }
    if (sync_.token_rule().per_step <= 0) {  // the policy does not pace workers
      reply(TokenReply{0, global_step(), true, false});
    } else if (!give_token(r.worker, reply)) {
      token_waiters_.push_back({r.worker, std::move(reply)});
    }
  }

  /// Hands `worker` a token of the current step if one is left and it may take one more.
  bool give_token(std::uint32_t worker, Responder& reply) {
    const std::int64_t cap = sync_.token_rule().per_worker;
    std::int64_t& taken = tokens_taken_[worker];
    if (tokens_left_ == 0 || (cap > 0 && taken >= cap)) return false;
    --tokens_left_;
    ++taken;
    reply(TokenReply{global_step(), global_step(), cap == 1});
    return true;
  }

  /// Replaces the tokens of the last step by the policy's tokens of the current one.
  void release_tokens() {
    tokens_left_ = std::max<std::int64_t>(sync_.token_rule().per_step, 0);
    tokens_taken_.clear();
    std::erase_if(token_waiters_, [&](TokenWaiter& w) { return give_token(w.worker, w.reply); });
  }

  // ---- Pull -----------------------------------------------------------------------------

  void on(Pull& r, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "pull before initialization");
      return;
    }
    for (const Slice& s : r.slices) {
      if (s.part >= slot_of_part_.size() || slot_of_part_[s.part] == kNotHere) {
        reject(reply, ErrorCode::kNotFound, unknown_part(s.part));
        return;
      }
      const Part& part = slots_[slot_of_part_[s.part]].part;
      if (s.rows.empty() || s.rows.begin < part.rows.begin || s.rows.end > part.rows.end) {
        reject(reply, ErrorCode::kInvalidArgument,
               "rows [" + std::to_string(s.rows.begin) + ", " + std::to_string(s.rows.end) +
                   ") are outside " + describe(part));
        return;
      }
    }
    if (global_step() < r.min_step) {
      waiting_pulls_.push_back({std::move(r), std::move(reply)});
    } else {
      answer_pull(r, reply);
    }
  }

  void answer_pull(const Pull& r, Responder& reply) {
    PullReply answer{global_step(), {}};
    answer.values.reserve(r.slices.size());
    for (const Slice& s : r.slices) {
      const Slot& slot = slots_[slot_of_part_[s.part]];
      const std::size_t offset = (s.rows.begin - slot.part.rows.begin) * slot.row_size;
      answer.values.push_back(
          std::span<const float>(slot.values).subspan(offset, s.rows.size() * slot.row_size));
      stats_.bytes_pulled += static_cast<std::int64_t>(answer.values.back().size_bytes());
    }
    reply(std::move(answer));
  }

  // ---- Push -----------------------------------------------------------------------------

  void on(Push& r, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition,
             "push before initialization: the chief has not initialized the variables");
      return;
    }
    if (!check_parts(r.gradients, reply)) return;
    if (r.gradients.size() != slots_.size()) {
      // Every part's accumulator must see every step's votes, or parts drift apart.
      reject(reply, ErrorCode::kInvalidArgument,
             "a push must carry a gradient for each of the " + std::to_string(slots_.size()) +
                 " parts held here, got " + std::to_string(r.gradients.size()));
      return;
    }
    for (const PartValues& pv : r.gradients) {
      const Slot* slot = &slots_[slot_of_part_[pv.part]];
      if (!r.finite_checked && !detail::all_finite(pv.values)) {
        reject(reply, ErrorCode::kInvalidArgument,
               "non-finite (NaN or Inf) gradient for " + describe(slot->part) + " from worker " +
                   std::to_string(r.worker) + "; nothing was applied");
        return;
      }
    }
    PushReply answer;
    for (const PartValues& pv : r.gradients) {
      Slot& slot = slots_[slot_of_part_[pv.part]];
      stats_.bytes_pushed += static_cast<std::int64_t>(pv.values.size_bytes());
      switch (sync_.accumulate(slot.accumulator, pv.values, r.local_step)) {
        case Verdict::kStale:
          ++stats_.stale_gradients_dropped;
          ++answer.stale_parts;
          break;
        case Verdict::kPending:
          ++stats_.gradients_accepted;
          break;
        case Verdict::kReady:
          ++stats_.gradients_accepted;
          optimizer_.apply(slot.optimizer_state, slot.values, sync_.take(slot.accumulator));
          ++stats_.updates_applied;
          break;
      }
    }
    const Verdict vote = sync_.accumulate(step_votes_, {}, r.local_step);
    reply(answer);
    if (vote == Verdict::kReady) {
      sync_.take(step_votes_);
      release_tokens();
      answer_waiting_pulls();
    }
  }

  void answer_waiting_pulls() {
    std::erase_if(waiting_pulls_, [&](WaitingPull& w) {
      if (global_step() < w.request.min_step) return false;
      answer_pull(w.request, w.reply);
      return true;
    });
  }

  // ---- GetStats / Shutdown --------------------------------------------------------------

  void on(GetStats& /*r*/, Responder& reply) { reply(StatsReply{stats()}); }

  void on(Shutdown& /*r*/, Responder& reply) {
    stopped_ = true;
    const ErrorReply cancelled{ErrorCode::kCancelled,
                               "ps " + std::to_string(task_) + " shut down while waiting"};
    for (Responder& w : std::exchange(ready_waiters_, {})) w(ErrorReply{cancelled});
    for (TokenWaiter& w : std::exchange(token_waiters_, {})) w.reply(ErrorReply{cancelled});
    for (WaitingPull& w : std::exchange(waiting_pulls_, {})) w.reply(ErrorReply{cancelled});
    reply(Ack{});
  }

  // ---- helpers --------------------------------------------------------------------------

  [[nodiscard]] std::int64_t global_step() const { return sync_.step(step_votes_); }

  /// Checks that every part is held here, appears once and has the right size; otherwise
  /// rejects the request and returns false.
  bool check_parts(const std::vector<PartValues>& parts, Responder& reply) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const PartValues& pv = parts[i];
      if (pv.part >= slot_of_part_.size() || slot_of_part_[pv.part] == kNotHere) {
        reject(reply, ErrorCode::kNotFound, unknown_part(pv.part));
        return false;
      }
      const Slot& slot = slots_[slot_of_part_[pv.part]];
      if (pv.values.size() != slot.values.size()) {
        reject(reply, ErrorCode::kInvalidArgument,
               describe(slot.part) + " has " + std::to_string(slot.values.size()) +
                   " elements, got " + std::to_string(pv.values.size()));
        return false;
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (parts[j].part == pv.part) {
          reject(reply, ErrorCode::kInvalidArgument, describe(slot.part) + " is sent twice");
          return false;
        }
      }
    }
    return true;
  }

  std::string unknown_part(std::uint32_t part) const {
    if (part >= placement_.parts.size()) {
      return "unknown part " + std::to_string(part) + " (the model has " +
             std::to_string(placement_.parts.size()) + " parts)";
    }
    return describe(placement_.parts[part]) + " is held by ps " +
           std::to_string(placement_.parts[part].ps) + ", not here";
  }

  std::string describe(const Part& part) const {
    return "variable '" + variables_[part.variable].name + "' part " + std::to_string(part.index);
  }

  static constexpr std::size_t kNotHere = static_cast<std::size_t>(-1);

  std::uint32_t task_;
  std::uint32_t num_ps_;
  [[no_unique_address]] O optimizer_;
  [[no_unique_address]] P sync_;
  [[no_unique_address]] S sharding_;

  bool registered_ = false;
  bool ready_ = false;
  bool stopped_ = false;
  std::vector<VariableSpec> variables_;
  Placement placement_;
  std::vector<Slot> slots_;
  std::vector<std::size_t> slot_of_part_;  ///< global part index → slot, or kNotHere
  std::size_t initialized_slots_ = 0;

  typename P::Accumulator step_votes_;  ///< the global step: one vote per push message
  std::int64_t tokens_left_ = 0;        ///< tokens of the current step
  std::map<std::uint32_t, std::int64_t> tokens_taken_;  ///< by worker, this step
  std::deque<TokenWaiter> token_waiters_;
  std::vector<Responder> ready_waiters_;
  std::vector<WaitingPull> waiting_pulls_;
  Stats stats_;
};

}  // namespace pulley
