// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <deque>
#include <map>
#include <exception>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/service.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/id_index.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/ps/embedding_table.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/tables/row_aggregation.hpp"

namespace pulley {

/// One ps task: holds the parts of every variable placed on it, aggregates the gradients
/// pushed to them and applies the optimizer. When gradients are applied and how workers are
/// paced is the sync policy's decision; the ps keeps registration, storage and apply.
///
/// It is a message handler (a `Service`) and does no I/O: a transport calls `handle` for one
/// request at a time, so the same logic runs in-process and over the network, and nothing
/// here needs a lock.
///
/// @tparam S Sharding policy: which ps holds which rows (every ps computes the same placement)
/// @tparam O Optimizer applied to each part, with its per-part slots kept beside the part
/// @tparam P SyncPolicy: Async, SyncReplicas, BoundedStaleness... paces and aggregates
/// @tparam T Tables<RowWiseOptimizer, IdSharding> for models with embedding tables, or
///           NoTables; by default Tables<O> when O can update rows (Sgd, Adagrad, Adam,
///           Ftrl, RmsProp), NoTables otherwise (Momentum)
///
/// Embedding tables: the rows a ps holds are created when first pulled (PullRows), with a
/// value that depends only on the table, the id and the registered seed; a push's rows
/// share its verdict and go into a per-table SparseAccumulator, and each update applies the
/// row-wise optimizer to the rows pushed in it (each row's mean over the pushes that held
/// it), all or nothing together with the dense parts. Checkpoints do not hold tables yet:
/// a ps that holds one refuses ReadState, and a Restore leaves its tables as they are.
///
/// Bad requests are answered with an ErrorReply and change nothing; the ps keeps serving. A
/// push is all-or-nothing: it is checked whole (known parts, sizes, finite values unless
/// the transport vouches for them, the sync policy's verdict) before any of it is applied,
/// so a NaN or Inf gradient is refused with `kInvalidArgument` instead of poisoning the
/// parameters. This is the one place that decides what a throwing policy costs: a throw
/// before the ps changes anything refuses that request; a throw while it changes its
/// state (half an update applied) fails the ps: it answers every request from then on with
/// `kInternal` and the reason, and `stopped()` turns true, so its transport ends and the
/// task exits with an error instead of serving parameters it cannot vouch for.
template <Sharding S, Optimizer O, SyncPolicy P, class T = DefaultTables<O>>
class ParameterServer {
 public:
  /// @param task    this ps task's index
  /// @param num_ps  the number of ps tasks in the cluster
  /// @param tables  the embedding tables' policy; by default, when the tables' optimizer is
  ///                of the dense one's type, a copy of `optimizer` (the same settings)
  ParameterServer(std::uint32_t task, std::uint32_t num_ps, O optimizer, P sync, S sharding = {},
                  std::optional<T> tables = std::nullopt)
      : task_(task),
        num_ps_(num_ps),
        optimizer_(std::move(optimizer)),
        sync_(std::move(sync)),
        sharding_(std::move(sharding)),
        table_policy_(tables ? std::move(*tables) : default_tables(optimizer_)),
        pacer_(sync_.make_pacer()) {
    if (num_ps == 0 || task >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "ps task " + std::to_string(task) +
                                                   " is outside a cluster of " +
                                                   std::to_string(num_ps) + " ps tasks");
    }
  }

  /// Handles one request; `reply` is called exactly once, now or later.
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    if (end_) {
      ++stats_.requests_rejected;
      send(reply, ErrorReply{*end_});
      return;
    }
    changing_ = false;
    // A transport is done with every reply's views before it hands over a request that
    // changes parameters: the buffers of earlier row replies are free again.
    if (changes_parameters(request)) free_row_replies();
    try {
      if (context.peer && !senders(request).contains(context.peer->job)) {
        const std::string problem = "refused " + std::string(message_name(request)) + " from " +
                                    context.peer->name() + ": only a " +
                                    senders(request).describe() + " may send it";
        return reject(reply, ErrorCode::kPermissionDenied, problem);
      }
      std::visit([&](auto& r) { on(r, context, reply); }, request);
    } catch (const Error& e) {
      settle(reply, e.code(), e.message(), message_name(request));
    } catch (const std::exception& e) {
      settle(reply, ErrorCode::kInternal, e.what(), message_name(request));
    } catch (...) {
      settle(reply, ErrorCode::kInternal, "unknown exception", message_name(request));
    }
  }

  /// True once it serves no more: shut down by the chief, or failed.
  [[nodiscard]] bool stopped() const noexcept { return end_.has_value(); }
  /// How it ended, as it now answers every request: kOutOfRange (training finished),
  /// kAborted (the chief aborted training) or kInternal (it failed); nullopt while serving.
  [[nodiscard]] const std::optional<ErrorReply>& ended() const noexcept { return end_; }
  /// This ps task's index.
  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  /// How long a worker that sent heartbeats may fall silent before this ps holds it lost
  /// (default 5 s; see Heartbeat). Workers that never sent one are never held lost.
  void set_worker_timeout(std::chrono::milliseconds timeout) noexcept { worker_timeout_ = timeout; }
  /// Counters, as GetStats answers them.
  [[nodiscard]] Stats stats() const noexcept {
    Stats s = stats_;
    s.global_step = global_step();
    for (const Table& t : tables_) {
      const TableStats ts = t.rows.stats();
      s.table_rows += static_cast<std::int64_t>(ts.rows);
      s.table_rows_evicted += static_cast<std::int64_t>(ts.rows_evicted);
      s.table_rows_dropped += static_cast<std::int64_t>(ts.pushes_dropped);
    }
    return s;
  }
  /// The counters of each embedding table held here, in the model's table order.
  [[nodiscard]] std::vector<TableStats> table_stats() const {
    std::vector<TableStats> out;
    for (const Table& t : tables_) out.push_back(t.rows.stats());
    return out;
  }

  /// The transport lost connection `session` of task `node` (0: all of them). A worker's
  /// token requests parked on it are answered kUnavailable, and if it is the connection
  /// the worker took its last token on, the tokens it took and did not push for go back to
  /// the sync policy (`SyncPolicy::release`): a worker that vanished holding one cannot
  /// stall a step, even while a process restarted in its place is already connected.
  void disconnected(const Node& node, std::uint64_t session) noexcept {
    if (end_) return;
    if (node.job == Node::Job::kChief && paused_ && (session == 0 || session == pause_session_)) {
      try {
        log(LogLevel::kWarning, "ps " + std::to_string(task_) +
                                    ": the chief left while it paused this ps: resuming");
        resume();
      } catch (...) {
        end_ = ErrorReply{ErrorCode::kInternal, {}};
      }
      return;
    }
    if (node.job != Node::Job::kWorker) return;
    try {
      const std::string gone = "ps " + std::to_string(task_) + ": " + node.name() + " disconnected";
      std::erase_if(token_waiters_, [&](TokenWaiter& w) {
        if (w.worker != node.index || (session != 0 && w.session != session)) return false;
        send(w.reply, ErrorReply{ErrorCode::kUnavailable, gone});
        return true;
      });
      const auto holder = token_session_.find(node.index);
      if (holder != token_session_.end() && (session == 0 || holder->second == session)) {
        token_session_.erase(holder);
        const std::string before = waiting_for(sync_, pacer_);
        release(sync_, pacer_, node.index);
        if (waiting_for(sync_, pacer_) != before) {
          log(LogLevel::kInfo, gone + " holding its token: given back (" +
                                   waiting_for(sync_, pacer_) + ")");
        }
        retry_tokens();
      }
    } catch (const std::exception& e) {
      try {
        fail(std::string("giving back a disconnected worker's tokens: ") + e.what());
      } catch (...) {  // no memory even for the message
        end_ = ErrorReply{ErrorCode::kInternal, {}};
      }
    } catch (...) {
      end_ = ErrorReply{ErrorCode::kInternal, {}};
    }
  }

  /// The most tensor bytes a request can carry: a push or an initialization has one value per
  /// element held here, a restore one more per optimizer slot (0 before registration:
  /// nothing can carry a tensor yet).
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    std::uint64_t rows = 0;  // a push may carry up to kMaxRowBytes of rows of each table
    for (const TableSpec& t : table_specs_) {
      rows += std::min<std::uint64_t>(kMaxRowsPerRequest * t.dim * sizeof(float), kMaxRowBytes);
    }
    return held_bytes_ * (1 + slots_per_part_) + rows;
  }

 private:
  /// A part held here, with the optimizer's slots and the sync policy's accumulator.
  struct Slot {
    Part part;
    std::uint32_t index = 0;  ///< the part's global index in the placement
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
  struct WaitingRows {
    PullRows request;
    bool create;  ///< a worker's: creates, admits and touches rows
    Responder reply;
  };

  using TableOptimizer = typename T::Optimizer;
  /// An embedding table held here: its rows, the current update's gradients, its update
  /// count (lazy Adam's t) and the step of its next eviction pass.
  struct Table {
    EmbeddingTable<TableOptimizer> rows;
    SparseAccumulator accumulator;
    std::int64_t updates = 0;
    std::int64_t next_eviction = 0;
    bool prepared = false;  ///< its rows of the update being applied wait for commit
  };

  struct TokenWaiter {
    std::uint32_t worker;
    std::uint64_t session;  ///< the connection it came on
    Responder reply;
  };

  /// The table policy a ParameterServer gets when none is given.
  static T default_tables(const O& optimizer) {
    if constexpr (std::is_same_v<typename T::Optimizer, O>) {
      T tables{};
      tables.optimizer = optimizer;
      return tables;
    } else {
      return T{};
    }
  }

  /// Answers through `reply`, which is empty afterwards (answered, or parked elsewhere).
  static void send(Responder& reply, Response&& response) {
    Responder r = std::exchange(reply, nullptr);
    if (r) r(std::move(response));  // empty only after a policy threw half way through
  }

  /// Parks a request's `reply` in `slot`, made beforehand (so that a full container leaves
  /// the reply with its request, to be answered with the error).
  static void park(Responder& slot, Responder& reply) noexcept { slot = std::exchange(reply, nullptr); }

  /// Refuses a request: answers the error, counts it, and logs it (at most 20 lines a
  /// second), so that an operator sees what a careless or hostile client tried.
  void reject(Responder& reply, ErrorCode code, const std::string& message) {
    ++stats_.requests_rejected;
    std::string line = "ps " + std::to_string(task_) + ": " + message;
    rejections_(LogLevel::kWarning, line);
    send(reply, ErrorReply{code, std::move(line)});
  }

  /// A handler threw: refuse the request if nothing changed yet, else fail the ps.
  void settle(Responder& reply, ErrorCode code, const char* what, std::string_view request) noexcept {
    try {
      if (!changing_) {
        if (reply) reject(reply, code, std::string(request) + " refused: " + what);
        return;
      }
      fail("a policy threw while applying a " + std::string(request) + ": " + what);
      if (reply) send(reply, ErrorReply{*end_});
    } catch (...) {  // no memory even for the message
      end_ = ErrorReply{ErrorCode::kInternal, {}};
      if (reply) send(reply, ErrorReply{ErrorCode::kInternal, {}});
    }
  }

  /// The ps can no longer vouch for its state: it answers everything with `reason` from now.
  void fail(const std::string& reason) {
    end_ = ErrorReply{ErrorCode::kInternal, "ps " + std::to_string(task_) + " failed: " + reason};
    log(LogLevel::kError, end_->message);
    answer_all_waiting(*end_);
  }

  void answer_all_waiting(const ErrorReply& answer) {
    for (Responder& w : std::exchange(ready_waiters_, {})) send(w, ErrorReply{answer});
    for (TokenWaiter& w : std::exchange(token_waiters_, {})) send(w.reply, ErrorReply{answer});
    for (WaitingPull& w : std::exchange(waiting_pulls_, {})) send(w.reply, ErrorReply{answer});
    for (WaitingRows& w : std::exchange(waiting_rows_, {})) send(w.reply, ErrorReply{answer});
    for (HeldPush& h : std::exchange(held_, {})) send(h.reply, ErrorReply{answer});
    for (WaitingPause& w : std::exchange(waiting_pauses_, {})) send(w.reply, ErrorReply{answer});
    if (pending_read_) {
      send(pending_read_->reply, ErrorReply{answer});
      pending_read_.reset();
    }
    paused_ = false;
  }

  // ---- Register -------------------------------------------------------------------------

  void on(Register& r, const RequestContext& /*context*/, Responder& reply) {
    if (registered_) {
      if (r.variables == variables_ && r.tables == table_specs_ && r.table_seed == table_seed_) {
        send(reply, placement_reply());
      } else {
        reject(reply, ErrorCode::kAlreadyExists, "a different model is already registered");
      }
      return;
    }
    if (auto problem = check_variables(r.variables); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, problem);
      return;
    }
    if (!r.tables.empty() && std::is_same_v<T, NoTables>) {
      reject(reply, ErrorCode::kFailedPrecondition,
             "the model has embedding tables, and this ps serves none: its optimizer has no "
             "row-wise apply (RowWiseOptimizer); compose ParameterServer<S, O, P, "
             "Tables<Adagrad>> or another RowWiseOptimizer for the tables");
      return;
    }
    if (auto problem = check_tables(r.tables, r.variables); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, problem);
      return;
    }
    Placement placement = sharding_.place(r.variables, num_ps_);
    if (auto problem = check_placement(r.variables, placement); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, "the sharding policy is broken: " + problem);
      return;
    }
    // Everything that may throw (allocation, make_state) happens before the commit below,
    // so a failed registration leaves nothing behind and a retry starts clean.
    std::vector<Slot> slots;
    std::vector<std::size_t> slot_of_part(placement.parts.size(), kNotHere);
    for (const Part& part : placement.parts) {
      if (part.ps != task_) continue;
      const std::size_t row_size = r.variables[part.variable].row_size();
      const std::size_t n = part.rows.size() * row_size;
      slot_of_part[static_cast<std::size_t>(&part - placement.parts.data())] = slots.size();
      slots.push_back(Slot{part, static_cast<std::uint32_t>(&part - placement.parts.data()),
                           row_size, std::vector<float>(n, 0.0F), optimizer_.make_state(n),
                           sync_.make_accumulator(n), false});
    }
    std::vector<Table> tables;
    tables.reserve(r.tables.size());
    for (const TableSpec& spec : r.tables) {
      tables.push_back(Table{EmbeddingTable<TableOptimizer>(spec, table_policy_.optimizer, r.table_seed),
                             SparseAccumulator(spec.dim), 0, 0, false});
    }
    PlacementReply answer{r.variables, placement, epoch_, {}, {}, r.tables};
    optimizer_state_names(answer.slot_names, answer.counter_names);
    tables_ = std::move(tables);
    table_specs_ = std::move(r.tables);
    table_seed_ = r.table_seed;
    variables_ = std::move(r.variables);
    placement_ = std::move(placement);
    slots_ = std::move(slots);
    slot_of_part_ = std::move(slot_of_part);
    held_bytes_ = 0;
    for (const Slot& slot : slots_) held_bytes_ += slot.values.size() * sizeof(float);
    std::vector<std::string> slot_names, counter_names;
    optimizer_state_names(slot_names, counter_names);
    slots_per_part_ = slot_names.size();
    registered_ = true;
    send(reply, std::move(answer));
    if (slots_.empty()) become_ready();
  }

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
  static std::string check_tables(const std::vector<TableSpec>& tables,
                                  const std::vector<VariableSpec>& variables) {
    std::unordered_set<std::string_view> names;
    for (const VariableSpec& v : variables) names.insert(v.name);
    for (std::size_t i = 0; i < tables.size(); ++i) {
      const TableSpec& t = tables[i];
      if (t.name.empty()) return "table " + std::to_string(i) + " has no name";
      if (t.dim == 0 || t.dim > kMaxTableDim) {
        return "table '" + t.name + "' has dim " + std::to_string(t.dim) + " (1 to " +
               std::to_string(kMaxTableDim) + ")";
      }
      if (t.initializer.kind > Initializer::Kind::kNormal) {
        return "table '" + t.name + "': its rows need zeros, constant, uniform or normal "
               "initial values (Glorot's rule has no fans in a table)";
      }
      if (t.admit_after == 0) return "table '" + t.name + "' has admit_after 0 (1 admits at once)";
      if (t.evict_after_steps < 0) return "table '" + t.name + "' has a negative evict_after_steps";
      if (!names.insert(t.name).second) return "name '" + t.name + "' is used twice";
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

  void on(Initialize& r, const RequestContext& context, Responder& reply) {
    if (!registered_) {
      reject(reply, ErrorCode::kFailedPrecondition, "initialize before the model is registered");
      return;
    }
    if (!check_parts(r.parts, context, reply)) return;
    for (const PartValues& pv : r.parts) {
      const Slot& slot = slots_[slot_of_part_[pv.part]];
      if (slot.initialized) {
        reject(reply, ErrorCode::kAlreadyExists, describe(slot.part) + " is already initialized");
        return;
      }
    }
    for (const PartValues& pv : r.parts) {
      Slot& slot = slots_[slot_of_part_[pv.part]];
      std::copy(pv.values.begin(), pv.values.end(), slot.values.begin());
      slot.initialized = true;
      ++initialized_slots_;
    }
    send(reply, Ack{});
    if (initialized_slots_ == slots_.size() && !ready_) become_ready();
  }

  void on(WaitReady& /*r*/, const RequestContext& /*context*/, Responder& reply) {
    if (ready_) {
      send(reply, placement_reply());
    } else {
      park(ready_waiters_.emplace_back(), reply);
    }
  }

  void become_ready() {
    ready_ = true;
    for (Responder& waiter : std::exchange(ready_waiters_, {})) {
      send(waiter, placement_reply());
    }
  }

  // ---- TakeToken ------------------------------------------------------------------------

  void on(TakeToken& r, const RequestContext& context, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "token requested before initialization");
      return;
    }
    if (!is_sender(r.worker, context, reply, "TakeToken")) return;
    if (!current_epoch(r.epoch, reply, "token request")) return;
    revive(r.worker);  // before its heartbeat, maybe: it starts from the step in progress
    TokenWaiter& waiter = token_waiters_.emplace_back(TokenWaiter{r.worker, context.session, nullptr});
    park(waiter.reply, reply);
    retry_tokens();
  }

  /// Asks the sync policy again for every waiting token request, in arrival order. A
  /// refusal (pulley::Error) answers that request; any other throw fails the ps, since the
  /// policy may have changed its pacer half way.
  void retry_tokens() {
    const bool changing = std::exchange(changing_, true);
    std::erase_if(token_waiters_, [&](TokenWaiter& w) {
      std::optional<Token> token;
      try {
        token = sync_.take_token(pacer_, w.worker);
      } catch (const Error& e) {
        reject(w.reply, e.code(), std::string("TakeToken refused: ") + e.message());
        return true;
      }
      if (!token) return false;
      token_session_[w.worker] = w.session;  // (a throw here fails the ps: changing_)
      send(w.reply, TokenReply{*token, global_step()});
      return true;
    });
    changing_ = changing;
  }

  // ---- Pull -----------------------------------------------------------------------------

  void on(Pull& r, const RequestContext& /*context*/, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "pull before initialization");
      return;
    }
    if (r.min_step > 0 && !current_epoch(r.epoch, reply, "pull")) return;
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
    if (const Slice* twice = overlapping(r.slices)) {
      // Every row at most once: a reply is then never larger than what is held here.
      reject(reply, ErrorCode::kInvalidArgument,
             "a pull asks for rows of " + describe(slots_[slot_of_part_[twice->part]].part) +
                 " twice (around rows [" + std::to_string(twice->rows.begin) + ", " +
                 std::to_string(twice->rows.end) + "))");
      return;
    }
    if (global_step() < r.min_step) {
      WaitingPull& waiting = waiting_pulls_.emplace_back(WaitingPull{std::move(r), nullptr});
      park(waiting.reply, reply);
    } else {
      answer_pull(r, reply);
    }
  }

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
    send(reply, std::move(answer));
  }

  void answer_waiting_pulls() {
    std::erase_if(waiting_pulls_, [&](WaitingPull& w) {
      if (global_step() < w.request.min_step) return false;
      answer_pull(w.request, w.reply);
      return true;
    });
    std::erase_if(waiting_rows_, [&](WaitingRows& w) {
      if (global_step() < w.request.min_step) return false;
      // A row pull that cannot be answered (no memory for its rows) is refused alone: it is
      // answered inside the push that completed the step, which must not fail the ps.
      try {
        answer_rows(w.request, w.create, w.reply);
      } catch (const std::exception& e) {
        if (w.reply) reject(w.reply, ErrorCode::kResourceExhausted, std::string("PullRows refused: ") + e.what());
      }
      return true;
    });
    std::erase_if(waiting_pauses_, [&](WaitingPause& w) {
      if (global_step() < w.at_step) return false;
      pause(w.session, w.reply);
      return true;
    });
  }

  // ---- PullRows: rows of embedding tables ----------------------------------------------

  void on(PullRows& r, const RequestContext& context, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "row pull before initialization");
      return;
    }
    if (r.min_step > 0 && !current_epoch(r.epoch, reply, "row pull")) return;
    if (auto problem = check_rows(r.tables, false); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, problem);
      return;
    }
    // Only a worker's pull creates, admits and touches rows: the chief and evaluators read.
    const bool create = !context.peer || context.peer->job == Node::Job::kWorker;
    if (global_step() < r.min_step) {
      WaitingRows& waiting = waiting_rows_.emplace_back(WaitingRows{std::move(r), create, nullptr});
      park(waiting.reply, reply);
    } else {
      answer_rows(r, create, reply);
    }
  }

  /// Why `rows` (of a pull, or with `values` of a push) cannot be served here, or "": a
  /// table that does not exist or comes twice, too many ids or bytes, an id twice, an id
  /// another ps holds, rows of the wrong size. So a reply is never larger than the rows it
  /// names once each.
  std::string check_rows(const std::vector<TableRows>& rows, bool values) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const TableRows& tr = rows[i];
      if (tr.table >= tables_.size()) {
        return "unknown table " + std::to_string(tr.table) + " (the model has " +
               std::to_string(tables_.size()) + ")";
      }
      const TableSpec& spec = table_specs_[tr.table];
      for (std::size_t j = 0; j < i; ++j) {
        if (rows[j].table == tr.table) return "table '" + spec.name + "' comes twice";
      }
      if (tr.ids.size() > kMaxRowsPerRequest || tr.ids.size() * spec.dim * sizeof(float) > kMaxRowBytes) {
        return std::to_string(tr.ids.size()) + " ids of table '" + spec.name + "' in one request (at most " +
               std::to_string(std::min<std::size_t>(kMaxRowsPerRequest, kMaxRowBytes / sizeof(float) / spec.dim)) +
               ")";
      }
      if (tr.values.size() != (values ? tr.ids.size() * spec.dim : 0)) {
        return "table '" + spec.name + "': " + std::to_string(tr.values.size()) + " values for " +
               std::to_string(tr.ids.size()) + " rows of dim " + std::to_string(spec.dim);
      }
      if (const std::uint64_t* twice = ids_seen_.first_duplicate(tr.ids)) {
        return "row " + std::to_string(*twice) + " of table '" + spec.name +
               "' comes twice in one request (a worker sums a row's gradients before it pushes)";
      }
      for (const std::uint64_t id : tr.ids) {
        const std::uint32_t owner = table_policy_.sharding.ps_of(spec.name, id, num_ps_);
        if (owner != task_) {
          return "row " + std::to_string(id) + " of table '" + spec.name + "' is held by ps " +
                 std::to_string(owner) + ", not here (do the worker and the ps use the same " +
                 "id sharding?)";
        }
      }
    }
    return {};
  }

  /// Makes every row reply buffer free for reuse. Buffers over 64 MiB are given back, and
  /// those of more than 64 requests: an outsized pull (a careless or hostile worker's) does
  /// not hold its memory for the job's life.
  void free_row_replies() noexcept {
    while (row_replies_.size() > 64) row_replies_.pop_back();
    row_replies_used_ = 0;
    for (auto& buffers : row_replies_) {
      for (std::vector<float>& b : buffers) {
        if (b.capacity() > (std::size_t{64} << 20U) / sizeof(float)) std::vector<float>().swap(b);
      }
    }
  }

  void answer_rows(const PullRows& r, bool create, Responder& reply) {
    if (row_replies_used_ == row_replies_.size()) row_replies_.emplace_back();
    std::vector<std::vector<float>>& buffers = row_replies_[row_replies_used_++];
    buffers.resize(r.tables.size());
    RowsReply answer{global_step(), {}};
    for (std::size_t i = 0; i < r.tables.size(); ++i) {
      const TableRows& tr = r.tables[i];
      Table& table = tables_[tr.table];
      buffers[i].resize(tr.ids.size() * table.rows.dim());
      table.rows.pull(tr.ids, buffers[i], global_step(), create);
      answer.rows.emplace_back(buffers[i]);
      stats_.bytes_pulled += static_cast<std::int64_t>(buffers[i].size() * sizeof(float));
    }
    send(reply, std::move(answer));
  }

  // ---- Push -----------------------------------------------------------------------------

  void on(Push& r, const RequestContext& context, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition,
             "push before initialization: the chief has not initialized the variables");
      return;
    }
    if (!is_sender(r.worker, context, reply, "Push")) return;
    if (!check_parts(r.gradients, context, reply)) return;
    if (auto problem = check_rows(r.rows, true); !problem.empty()) {
      reject(reply, ErrorCode::kInvalidArgument, problem);
      return;
    }
    if (!context.tensors_finite) {
      for (const TableRows& tr : r.rows) {
        if (!detail::all_finite(tr.values)) {
          reject(reply, ErrorCode::kInvalidArgument,
                 "non-finite (NaN or Inf) rows for table '" + table_specs_[tr.table].name +
                     "'; nothing was applied");
          return;
        }
      }
    }
    if (r.gradients.size() != slots_.size()) {
      // Every part must see every push's verdict, or parts drift apart.
      reject(reply, ErrorCode::kInvalidArgument,
             "a push must carry a gradient for each of the " + std::to_string(slots_.size()) +
                 " parts held here, got " + std::to_string(r.gradients.size()));
      return;
    }
    if (!current_epoch(r.epoch, reply, "push")) return;
    if (r.worker >= kMaxWorkers) {
      reject(reply, ErrorCode::kInvalidArgument, "worker index " + std::to_string(r.worker) + " is too large");
      return;
    }
    if (r.sequence != 0 && r.worker < last_push_.size() &&
        last_push_[r.worker].sequence == r.sequence) {
      // Sent again after a lost connection: answered as the first time, counted once.
      send(reply, PushReply{last_push_[r.worker].stale_parts});
      return;
    }
    if (paused_) return hold(r, reply);
    take(r, reply);
  }

  /// Takes a push that passed every check: the sync policy's verdict, the gradients into
  /// the accumulators, and the update when it completes one.
  void take(const Push& r, Responder& reply) {
    const std::int64_t step_before = global_step();
    changing_ = true;  // the policy's own refusal (pulley::Error) leaves its pacer unchanged
    Verdict verdict = Verdict::kStale;
    try {
      verdict = sync_.on_push(pacer_, r.worker, r.local_step);
    } catch (const Error& e) {
      changing_ = false;
      reject(reply, e.code(), std::string("Push refused: ") + e.message());
      return;
    }
    if (taken_.size() <= r.worker) taken_.resize(r.worker + 1, 0);
    ++taken_[r.worker];
    // A push that is an update by itself (Async, BoundedStaleness; SyncReplicas with R = 1)
    // is checked now, against the state it would be applied to: if it would not stay finite
    // it is refused, naming the sender, and still counts towards this ps's step (the other
    // ps tasks may have taken their share of it, and their steps must not drift from this
    // one's), but none of it is taken here. A push that is one of several in an update is
    // taken, and their mean is checked once, when it is applied (apply_all).
    const bool alone = verdict == Verdict::kReady && accumulated_ == 0;
    std::string overflow = alone ? would_overflow(r) : std::string();
    PushReply answer;
    for (const PartValues& pv : r.gradients) {
      Slot& slot = slots_[slot_of_part_[pv.part]];
      stats_.bytes_pushed += static_cast<std::int64_t>(pv.values.size_bytes());
      if (verdict == Verdict::kStale) {
        ++stats_.stale_gradients_dropped;
        ++answer.stale_parts;
        continue;
      }
      if (!overflow.empty()) continue;
      ++stats_.gradients_accepted;
      sync_.accumulate(slot.accumulator, pv.values);
    }
    for (const TableRows& tr : r.rows) {
      stats_.bytes_pushed += static_cast<std::int64_t>(tr.values.size_bytes());
      if (verdict == Verdict::kStale) {
        stats_.table_rows_dropped += static_cast<std::int64_t>(tr.ids.size());
        continue;
      }
      if (!overflow.empty()) continue;
      tables_[tr.table].accumulator.add(tr.ids, tr.values);
    }
    if (verdict != Verdict::kStale && overflow.empty()) {
      ++accumulated_;
      contributors_.push_back(r.worker);
    }
    std::string rolled_back;  // a push alone whose rows would go non-finite is refused too
    if (verdict == Verdict::kReady) {
      // An update of nothing (its one push refused here) applies nothing.
      const std::int64_t pushes = std::exchange(accumulated_, 0);
      if (pushes > 0) rolled_back = apply_all(step_before, /*checked=*/alone);
      contributors_.clear();
    }
    if (alone && overflow.empty() && !rolled_back.empty()) {
      overflow = "push from worker " + std::to_string(r.worker) + " refused: its rows would make " +
                 rolled_back + " non-finite; none of it was applied (it counts towards the step, "
                 "as on the other ps tasks)";
    }
    if (r.sequence != 0) {
      if (last_push_.size() <= r.worker) last_push_.resize(r.worker + 1);
      last_push_[r.worker] = {r.sequence, answer.stale_parts};
    }
    if (overflow.empty()) {
      send(reply, answer);
    } else {
      if (rolled_back.empty()) ++stats_.updates_refused;  // (skip_update counted a rollback)
      reject(reply, ErrorCode::kInvalidArgument, overflow);
    }
    retry_tokens();
    if (global_step() != step_before) answer_waiting_pulls();
    changing_ = false;
  }

  /// True if `epoch` is this ps's; otherwise refuses the request: the job was rolled back
  /// (or resumed) since its sender last looked, and must start its step again.
  bool current_epoch(std::uint64_t epoch, Responder& reply, std::string_view what) {
    if (epoch == epoch_) return true;
    if (epoch > epoch_) {
      // The sender saw another ps restored already; this one's restore is on its way.
      reject(reply, ErrorCode::kUnavailable,
             "ps " + std::to_string(task_) + " is not restored to epoch " + std::to_string(epoch) +
                 " yet (it is at epoch " + std::to_string(epoch_) + "): try again");
      return false;
    }
    reject(reply, ErrorCode::kFailedPrecondition,
           std::string(what) + " of epoch " + std::to_string(epoch) + " refused: the job was " +
               "restored from a checkpoint at global step " + std::to_string(restored_step_) +
               " (epoch " + std::to_string(epoch_) + "): wait until ready and start the step again");
    return false;
  }

  // ---- Pause / ReadState / Resume: a checkpoint's cut -------------------------------------

  /// A push that arrived while paused, with its gradients copied out of the transport's
  /// buffers (they are reused once `handle` returns).
  struct HeldPush {
    Push push;
    std::vector<std::vector<float>> storage;
    Responder reply;
  };

  void hold(const Push& r, Responder& reply) {
    HeldPush& held = held_.emplace_back();
    held.push = Push{r.worker, r.local_step, {}, r.epoch, r.sequence};
    held.storage.reserve(r.gradients.size() + r.rows.size());
    for (const PartValues& pv : r.gradients) {
      held.storage.emplace_back(pv.values.begin(), pv.values.end());
      held.push.gradients.push_back({pv.part, held.storage.back()});
    }
    for (const TableRows& tr : r.rows) {
      held.storage.emplace_back(tr.values.begin(), tr.values.end());
      held.push.rows.push_back({tr.table, tr.ids, held.storage.back()});
    }
    park(held.reply, reply);
    advance_to_cut();
  }

  void on(Pause& r, const RequestContext& context, Responder& reply) {
    if (!ready_) {
      reject(reply, ErrorCode::kFailedPrecondition, "pause before initialization");
      return;
    }
    if (global_step() < r.at_step) {  // paused the moment that step completes
      WaitingPause& waiting = waiting_pauses_.emplace_back(WaitingPause{r.at_step, context.session, nullptr});
      park(waiting.reply, reply);
      return;
    }
    pause(context.session, reply);
  }

  void pause(std::uint64_t session, Responder& reply) {
    PauseReply answer{global_step(), epoch_, taken_, {}, {}, checkpoints_whole_state_v<O>};
    optimizer_state_names(answer.slot_names, answer.counter_names);
    paused_ = true;
    pause_session_ = session;
    send(reply, std::move(answer));
  }

  void on(ReadState& r, const RequestContext& /*context*/, Responder& reply) {
    if (!paused_) {
      reject(reply, ErrorCode::kFailedPrecondition, "ReadState without Pause");
      return;
    }
    if (!tables_.empty()) {
      reject(reply, ErrorCode::kFailedPrecondition,
             "checkpoints do not hold embedding tables yet: this ps holds table '" +
                 table_specs_.front().name + "'");
      return;
    }
    for (std::size_t w = 0; w < taken_.size(); ++w) {
      if (taken_[w] > (w < r.until.size() ? r.until[w] : 0)) {
        reject(reply, ErrorCode::kFailedPrecondition,
               "ReadState: this ps has taken more pushes of worker " + std::to_string(w) +
                   " than the cut");
        return;
      }
    }
    if (pending_read_) {
      send(pending_read_->reply, ErrorReply{ErrorCode::kCancelled, "a newer ReadState came"});
    }
    pending_read_.emplace(PendingRead{std::move(r.until), nullptr});
    park(pending_read_->reply, reply);
    advance_to_cut();
  }

  void on(Resume& /*r*/, const RequestContext& /*context*/, Responder& reply) {
    resume();
    send(reply, Ack{});
  }

  /// Ends a pause: a cut not reached is given up, the held pushes are taken in order.
  void resume() {
    if (!paused_) return;
    paused_ = false;
    if (pending_read_) {
      send(pending_read_->reply,
           ErrorReply{ErrorCode::kCancelled, "resumed before the cut was reached"});
      pending_read_.reset();
    }
    for (HeldPush& held : std::exchange(held_, {})) take(held.push, held.reply);
  }

  /// Takes held pushes, in order, while their workers are short of the cut; answers the
  /// pending ReadState once this ps is exactly at it.
  void advance_to_cut() {
    if (!pending_read_) return;
    const auto& until = pending_read_->until;
    auto wanted = [&](std::uint32_t w) {
      const std::uint64_t have = w < taken_.size() ? taken_[w] : 0;
      return have < (w < until.size() ? until[w] : 0);
    };
    std::deque<HeldPush> later;
    for (HeldPush& held : std::exchange(held_, {})) {
      // A worker's pushes are taken in the order they came: one held back holds back the rest.
      const bool blocked = std::any_of(later.begin(), later.end(), [&](const HeldPush& h) {
        return h.push.worker == held.push.worker;
      });
      if (!blocked && wanted(held.push.worker)) {
        take(held.push, held.reply);
      } else {
        later.push_back(std::move(held));
      }
    }
    held_ = std::move(later);
    for (std::uint32_t w = 0; w < until.size(); ++w) {
      if (wanted(w)) return;  // its push is still on its way here
    }
    StateReply answer{global_step(), save_pacer(sync_, pacer_), {}};
    for (Slot& slot : slots_) {
      PartState part{slot.index, slot.values, {}, {}};
      for (const OptimizerSlot& s : slots_of(optimizer_, slot.optimizer_state)) part.slots.push_back(s.values);
      for (const OptimizerCounter& c : counters_of(optimizer_, slot.optimizer_state)) {
        part.counters.push_back(*c.value);
      }
      answer.parts.push_back(std::move(part));
    }
    Responder reply = std::move(pending_read_->reply);
    pending_read_.reset();
    send(reply, std::move(answer));
  }

  // ---- Restore --------------------------------------------------------------------------

  void on(Restore& r, const RequestContext& /*context*/, Responder& reply) {
    if (!registered_) {
      reject(reply, ErrorCode::kFailedPrecondition, "restore before the model is registered");
      return;
    }
    // Everything is checked, and the pacer loaded aside, before anything changes.
    if (r.parts.size() != slots_.size()) {
      reject(reply, ErrorCode::kInvalidArgument,
             "a restore must carry each of the " + std::to_string(slots_.size()) +
                 " parts held here, got " + std::to_string(r.parts.size()));
      return;
    }
    std::vector<const PartState*> by_slot(slots_.size(), nullptr);
    for (const PartState& ps : r.parts) {
      if (ps.part >= slot_of_part_.size() || slot_of_part_[ps.part] == kNotHere) {
        reject(reply, ErrorCode::kNotFound, unknown_part(ps.part));
        return;
      }
      const std::size_t k = slot_of_part_[ps.part];
      Slot& slot = slots_[k];
      const auto slots = slots_of(optimizer_, slot.optimizer_state);
      const auto counters = counters_of(optimizer_, slot.optimizer_state);
      // No slots or counters at all: the optimizer's state starts afresh (a checkpoint of
      // another optimizer, or of one that does not name its state).
      bool fits = by_slot[k] == nullptr && ps.values.size() == slot.values.size() &&
                  (ps.counters.empty() || ps.counters.size() == counters.size()) &&
                  (ps.slots.empty() || ps.slots.size() == slots.size());
      for (const auto& s : ps.slots) fits = fits && s.size() == slot.values.size();
      if (!fits) {
        reject(reply, ErrorCode::kInvalidArgument,
               "the restored state of " + describe(slot.part) +
                   " does not fit it (its size, or the optimizer's slots and counters)");
        return;
      }
      if (!detail::all_finite(ps.values)) {
        reject(reply, ErrorCode::kInvalidArgument, "non-finite values restored for " + describe(slot.part));
        return;
      }
      by_slot[k] = &ps;
    }
    typename P::Pacer pacer = load_pacer(sync_, r.pacer);  // a pulley::Error refuses it
    changing_ = true;
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      Slot& slot = slots_[k];
      const PartState& ps = *by_slot[k];
      std::copy(ps.values.begin(), ps.values.end(), slot.values.begin());
      slot.optimizer_state = optimizer_.make_state(slot.values.size());
      const auto slots = slots_of(optimizer_, slot.optimizer_state);
      for (std::size_t s = 0; s < ps.slots.size(); ++s) {
        std::copy(ps.slots[s].begin(), ps.slots[s].end(), slots[s].values.begin());
      }
      const auto counters = counters_of(optimizer_, slot.optimizer_state);
      for (std::size_t c = 0; c < ps.counters.size(); ++c) *counters[c].value = ps.counters[c];
      slot.accumulator = sync_.make_accumulator(slot.values.size());
      slot.initialized = true;
    }
    initialized_slots_ = slots_.size();
    const std::int64_t step_before = ready_ ? global_step() : -1;
    pacer_ = std::move(pacer);
    relose_workers();
    accumulated_ = 0;
    contributors_.clear();
    taken_.clear();
    last_push_.clear();
    token_session_.clear();
    epoch_ = r.epoch;
    restored_step_ = global_step();
    // What waited belongs to the time before: its clients start their step again.
    const ErrorReply gone{ErrorCode::kFailedPrecondition,
                          "ps " + std::to_string(task_) + ": the job was restored from a "
                          "checkpoint at global step " + std::to_string(restored_step_) +
                          ": wait until ready and start the step again"};
    for (TokenWaiter& w : std::exchange(token_waiters_, {})) send(w.reply, ErrorReply{gone});
    for (WaitingPull& w : std::exchange(waiting_pulls_, {})) send(w.reply, ErrorReply{gone});
    for (WaitingRows& w : std::exchange(waiting_rows_, {})) send(w.reply, ErrorReply{gone});
    for (Table& table : tables_) table.accumulator.clear();
    for (HeldPush& h : std::exchange(held_, {})) send(h.reply, ErrorReply{gone});
    for (WaitingPause& w : std::exchange(waiting_pauses_, {})) send(w.reply, ErrorReply{gone});
    if (pending_read_) {
      send(pending_read_->reply, ErrorReply{gone});
      pending_read_.reset();
    }
    paused_ = false;
    // A rollback (a ps was lost) undoes what this ps applied since the checkpoint.
    const std::string undone =
        step_before < 0 ? std::string()
                        : ", rolled back from global step " + std::to_string(step_before) + ": " +
                              std::to_string(std::max<std::int64_t>(step_before - restored_step_, 0)) +
                              " steps' updates lost";
    log(LogLevel::kInfo, "ps " + std::to_string(task_) + ": restored at global step " +
                             std::to_string(restored_step_) + " (epoch " +
                             std::to_string(epoch_) + ")" + undone);
    send(reply, Ack{});
    changing_ = false;
    if (!ready_) {
      become_ready();
    }
  }

  /// Why applying push `r` alone would make a parameter or a slot non-finite (the
  /// optimizer's `stays_finite`, asked of every part against the state it would be applied
  /// to), or "" when it would not, or when the optimizer cannot tell (apply_all guards
  /// those).
  std::string would_overflow(const Push& r) const {
    if constexpr (PredictsFiniteness<O>) {
      for (const PartValues& pv : r.gradients) {
        const Slot& slot = slots_[slot_of_part_[pv.part]];
        if (!optimizer_.stays_finite(slot.optimizer_state, slot.values, pv.values)) {
          return "push from worker " + std::to_string(r.worker) + " refused: its gradient for " +
                 describe(slot.part) +
                 " would make a parameter or an optimizer slot non-finite (or larger than "
                 "float's range allows); none of it was applied (it counts towards the step, "
                 "as on the other ps tasks)";
        }
      }
    }
    return {};
  }

  /// Takes every part's update from its accumulator and applies it, unless that would make
  /// a parameter (or, for an optimizer that predicts it, a slot) non-finite: then this
  /// update is skipped on this ps (the step is rolled back here), counted and logged with
  /// the variable and the workers whose pushes made it. With `stays_finite`, the update is
  /// asked about once, unless its one push already was (`checked`); without it, the update
  /// is applied to copies that replace the parts only if every weight stayed finite.
  /// Returns what would have gone non-finite when the update was skipped, "" when applied.
  std::string apply_all(std::int64_t step_before, bool checked) {
    updates_.clear();
    for (Slot& slot : slots_) updates_.push_back(sync_.take(slot.accumulator));
    // The tables' rows first, into scratch memory: committed with the dense parts below, or
    // not at all.
    for (Table& table : tables_) {
      if (table.accumulator.empty()) continue;
      const std::span<const float> means = table.accumulator.take();
      table.prepared = table.rows.prepare(table.accumulator.ids(), means, step_before, table.updates + 1);
      if (!table.prepared) return skip_update(step_before, "table '" + table.rows.spec().name + "'");
    }
    if constexpr (PredictsFiniteness<O>) {
      for (std::size_t i = 0; !checked && i < slots_.size(); ++i) {
        if (!optimizer_.stays_finite(slots_[i].optimizer_state, slots_[i].values, updates_[i])) {
          return skip_update(step_before, describe(slots_[i].part));
        }
      }
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        apply_to(slots_[i], slots_[i].values, slots_[i].optimizer_state, updates_[i], step_before);
      }
    } else if constexpr (std::is_copy_assignable_v<typename O::State>) {
      shadows_.resize(slots_.size());
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        Slot& slot = slots_[i];
        Shadow& shadow = shadows_[i];
        shadow.values = slot.values;  // copy-assignments reuse the shadows' memory
        if (!shadow.state) {
          shadow.state.emplace(slot.optimizer_state);
        } else {
          *shadow.state = slot.optimizer_state;
        }
        apply_to(slot, shadow.values, *shadow.state, updates_[i], step_before);
        if (!detail::all_finite(shadow.values)) return skip_update(step_before, describe(slot.part));
      }
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        std::swap(slots_[i].values, shadows_[i].values);
        std::swap(slots_[i].optimizer_state, *shadows_[i].state);
      }
    } else {
      for (Slot& slot : slots_) {
        apply_to(slot, slot.values, slot.optimizer_state, updates_[&slot - slots_.data()],
                 step_before);
        if (!detail::all_finite(slot.values)) {
          throw std::runtime_error("the parameters of " + describe(slot.part) +
                                   " went non-finite, and the optimizer's State cannot be "
                                   "copied to undo it (give the optimizer stays_finite)");
        }
      }
    }
    stats_.updates_applied += static_cast<std::int64_t>(slots_.size());
    commit_tables(step_before);
    return {};
  }

  /// Writes every table's prepared rows back, and evicts rows gone untouched too long
  /// (every eighth of the eviction window: a pass costs one look at every row).
  void commit_tables(std::int64_t step_before) {
    for (Table& table : tables_) {
      if (!std::exchange(table.prepared, false)) continue;  // no row pushed in this update
      table.rows.commit(step_before);
      ++table.updates;
      table.accumulator.clear();
      ++stats_.updates_applied;
    }
    const std::int64_t step = step_before + 1;
    for (Table& table : tables_) {
      const std::int64_t window = table.rows.spec().evict_after_steps;
      if (window <= 0 || step < table.next_eviction) continue;
      table.rows.evict(step);
      table.next_eviction = step + std::max<std::int64_t>(1, window / 8);
    }
  }

  void apply_to(const Slot& slot, std::span<float> values, typename O::State& state,
                std::span<const float> update, std::int64_t step_before) {
    const UpdateContext context{step_before, variables_[slot.part.variable].name, slot.part.rows,
                                slot.row_size};
    apply_update(optimizer_, state, values, update, context);
  }

  std::string skip_update(std::int64_t step_before, const std::string& what) {
    ++stats_.updates_refused;
    for (Table& table : tables_) {
      table.accumulator.clear();
      table.prepared = false;
    }
    std::string from;
    for (const std::uint32_t w : contributors_) {
      from += (from.empty() ? "worker " : ", worker ") + std::to_string(w);
    }
    log(LogLevel::kWarning,
        "ps " + std::to_string(task_) + ": rolled back the update of global step " +
            std::to_string(step_before + 1) + " (gradients from " + from + "): it would have made " +
            what + " non-finite");
    return what;
  }

  /// Checks that a worker's request names the worker that sent it.
  bool is_sender(std::uint32_t worker, const RequestContext& context, Responder& reply,
                 std::string_view what) {
    if (!context.peer || context.peer->index == worker) return true;
    reject(reply, ErrorCode::kPermissionDenied,
           "refused " + std::string(what) + " for worker " + std::to_string(worker) + " from " +
               context.peer->name());
    return false;
  }

  // ---- GetStats / Shutdown --------------------------------------------------------------

  void on(GetStats& /*r*/, const RequestContext& /*context*/, Responder& reply) {
    check_heartbeats();
    send(reply, stats_reply());
  }

  // ---- Heartbeat: lost workers ------------------------------------------------------------

  void on(Heartbeat& r, const RequestContext& context, Responder& reply) {
    if (!is_sender(r.worker, context, reply, "Heartbeat")) return;
    if (r.worker >= kMaxWorkers) {
      reject(reply, ErrorCode::kInvalidArgument, "worker index " + std::to_string(r.worker) + " is too large");
      return;
    }
    if (r.leaving) {
      // Done: forgotten rather than held lost once quiet (one lost stays so), and the
      // tokens it took and did not push for (it found training over) go back.
      if (const auto gone = heard_.find(r.worker); gone != heard_.end() && !gone->second.lost) {
        heard_.erase(gone);
      }
      if (ready_) {
        changing_ = true;
        token_session_.erase(r.worker);
        release(sync_, pacer_, r.worker);
        changing_ = false;
        retry_tokens();
      }
      send(reply, stats_reply());
      return;
    }
    const auto now = Clock::now();
    if (now - last_heartbeat_ >= worker_timeout_) {
      // This ps heard no worker for a whole timeout: it was the one cut off (a partition,
      // a pause). Every worker gets a fresh timeout to be heard from again, instead of all
      // but the first one back being held lost.
      for (auto& [worker, heard] : heard_) heard.last = now;
    }
    last_heartbeat_ = now;
    heard_[r.worker].last = now;
    revive(r.worker);
    check_heartbeats();
    send(reply, stats_reply());
  }

  /// A worker held lost was heard from (a heartbeat, a token request): it counts again.
  void revive(std::uint32_t worker) {
    const auto heard = heard_.find(worker);
    if (heard == heard_.end() || !heard->second.lost || !ready_ || paused_) return;
    heard->second.last = Clock::now();
    changing_ = true;  // a throw from the policy leaves its pacer half changed
    worker_back(sync_, pacer_, worker);
    heard->second.lost = false;
    changing_ = false;
    log(LogLevel::kInfo, "ps " + std::to_string(task_) + ": " + Node::worker(worker).name() +
                             " is back; " + describe_wait());
    retry_tokens();
  }

  /// Holds lost every worker heard before and silent for the worker timeout: the sync
  /// policy stops waiting for it, and an update that needed only it is applied now. Not
  /// while paused for a checkpoint's cut, which must see no step complete on its own.
  void check_heartbeats() {
    if (!ready_ || paused_) return;
    const auto now = Clock::now();
    for (auto& [worker, heard] : heard_) {
      if (heard.lost || now - heard.last < worker_timeout_) continue;
      const std::int64_t step_before = global_step();
      changing_ = true;
      heard.lost = true;
      ++stats_.workers_lost;
      const Verdict verdict = worker_lost(sync_, pacer_, worker);
      token_session_.erase(worker);  // its lease is given back with it
      if (verdict == Verdict::kReady) {
        if (std::exchange(accumulated_, 0) > 0) (void)apply_all(step_before, /*checked=*/false);
        contributors_.clear();
      }
      changing_ = false;
      log(LogLevel::kWarning, "ps " + std::to_string(task_) + ": " + Node::worker(worker).name() +
                                  " lost (last heard " + seconds_since(heard.last, now) +
                                  " s ago): training goes on without it; " + describe_wait());
      retry_tokens();
      if (global_step() != step_before) answer_waiting_pulls();
    }
  }

  /// Tells a restored pacer which workers are lost.
  void relose_workers() {
    for (const auto& [worker, heard] : heard_) {
      if (heard.lost) (void)worker_lost(sync_, pacer_, worker);
    }
  }

  /// What GetStats and Heartbeat answer.
  StatsReply stats_reply() const {
    StatsReply answer{stats(), describe_wait(), {}};
    for (const auto& [worker, heard] : heard_) {
      if (heard.lost) answer.lost.push_back(worker);
    }
    return answer;
  }

  /// The sync policy's wait in words, with how long ago each awaited worker was heard:
  /// "step 812: 1 of 2 gradients in, 1 of 2 tokens left; waiting for worker:1 (last heard
  /// 14.2 s ago)".
  std::string describe_wait() const {
    std::string text = waiting_for(sync_, pacer_);
    const std::vector<std::uint32_t> workers = awaited(sync_, pacer_);
    if (workers.empty()) return text;
    text += text.empty() ? "waiting for " : "; waiting for ";
    const auto now = Clock::now();
    for (std::size_t i = 0; i < workers.size(); ++i) {
      if (i == 8) {
        text += ", and " + std::to_string(workers.size() - i) + " more";
        break;
      }
      if (i > 0) text += ", ";
      text += Node::worker(workers[i]).name();
      const auto heard = heard_.find(workers[i]);
      if (heard != heard_.end()) text += " (last heard " + seconds_since(heard->second.last, now) + " s ago)";
    }
    return text;
  }

  using Clock = std::chrono::steady_clock;

  static std::string seconds_since(Clock::time_point then, Clock::time_point now) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f", std::chrono::duration<double>(now - then).count());
    return text;
  }

  void on(Shutdown& r, const RequestContext& /*context*/, Responder& reply) {
    const std::string ps = "ps " + std::to_string(task_);
    end_ = r.aborted ? ErrorReply{ErrorCode::kAborted,
                                  ps + ": training aborted by the chief: " + r.reason}
                     : ErrorReply{ErrorCode::kOutOfRange,
                                  ps + ": training finished (the chief shut the ps tasks "
                                       "down at global step " +
                                      std::to_string(global_step()) + ")"};
    answer_all_waiting(*end_);
    send(reply, Ack{});
  }

  // ---- helpers --------------------------------------------------------------------------

  /// What Register and WaitReady answer: the model, where it lives, the epoch, and the names
  /// of the optimizer's slots and counters.
  PlacementReply placement_reply() {
    PlacementReply answer{variables_, placement_, epoch_, {}, {}, table_specs_};
    optimizer_state_names(answer.slot_names, answer.counter_names);
    return answer;
  }

  /// The names of the optimizer's slots and counters (those of a fresh State: they do not
  /// depend on its size).
  void optimizer_state_names(std::vector<std::string>& slots, std::vector<std::string>& counters) const {
    typename O::State probe = optimizer_.make_state(0);
    for (const OptimizerSlot& slot : slots_of(optimizer_, probe)) slots.emplace_back(slot.name);
    for (const OptimizerCounter& counter : counters_of(optimizer_, probe)) counters.emplace_back(counter.name);
  }

  [[nodiscard]] std::int64_t global_step() const { return sync_.global_step(pacer_); }

  /// Checks that every part is held here, appears once, has the right size and (unless the
  /// transport vouches for it) finite values; otherwise rejects the request and returns
  /// false.
  bool check_parts(const std::vector<PartValues>& parts, const RequestContext& context,
                   Responder& reply) {
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
      if (!context.tensors_finite && !detail::all_finite(pv.values)) {
        reject(reply, ErrorCode::kInvalidArgument,
               "non-finite (NaN or Inf) values for " + describe(slot.part) +
                   "; nothing was applied");
        return false;
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
  /// Ids of one table in one request, and the bytes of their rows: a reply is at most this
  /// large.
  static constexpr std::size_t kMaxRowsPerRequest = kMaxIdsPerMessage;
  static constexpr std::size_t kMaxRowBytes = kMaxRowBytesPerMessage;
  /// Floats in one row of a table.
  static constexpr std::size_t kMaxTableDim = std::size_t{1} << 16U;
  /// Elements a variable may have: 4 TiB of floats, beyond any ps, and no product of its
  /// shape wraps around on the way.
  static constexpr std::size_t kMaxElements = std::size_t{1} << 40U;
  /// Worker indices a ps keeps counts for.
  static constexpr std::uint32_t kMaxWorkers = std::uint32_t{1} << 20U;

  std::uint32_t task_;
  std::uint32_t num_ps_;
  [[no_unique_address]] O optimizer_;
  [[no_unique_address]] P sync_;
  [[no_unique_address]] S sharding_;
  [[no_unique_address]] T table_policy_;

  bool registered_ = false;
  bool ready_ = false;
  bool changing_ = false;          ///< inside a change that a throw would leave half done
  std::optional<ErrorReply> end_;  ///< set once stopped: what every request is answered
  std::vector<VariableSpec> variables_;
  Placement placement_;
  std::vector<Slot> slots_;
  std::vector<std::size_t> slot_of_part_;  ///< global part index → slot, or kNotHere
  std::vector<TableSpec> table_specs_;
  std::uint64_t table_seed_ = 0;
  std::vector<Table> tables_;
  /// Buffers of row replies, by request: those before `row_replies_used_` may be viewed by
  /// a transport until the next request that changes parameters.
  std::deque<std::vector<std::vector<float>>> row_replies_;
  std::size_t row_replies_used_ = 0;
  std::vector<WaitingRows> waiting_rows_;
  detail::IdIndex ids_seen_{detail::random_u64()};  ///< finds an id twice in a request
  std::size_t initialized_slots_ = 0;

  std::uint64_t held_bytes_ = 0;  ///< bytes of the parts held here
  std::uint64_t slots_per_part_ = 0;  ///< the optimizer's slots, which a Restore also carries

  /// A part's values and State as an update leaves them, kept only if they stay finite
  /// (optimizers without `stays_finite`).
  struct Shadow {
    std::vector<float> values;
    std::optional<typename O::State> state;
  };
  std::vector<Shadow> shadows_;
  std::vector<std::span<const float>> updates_;  ///< scratch: each part's update
  std::int64_t accumulated_ = 0;  ///< pushes whose gradients are in the accumulators
  std::uint64_t epoch_ = 0;          ///< restores so far (Restore::epoch)
  std::int64_t restored_step_ = 0;   ///< the global step of the last restore
  std::vector<std::uint64_t> taken_;  ///< by worker: pushes taken since the last restore
  /// By worker: its last push's sequence number and answer, to answer a resend as the first.
  struct LastPush {
    std::uint64_t sequence = 0;
    std::uint32_t stale_parts = 0;
  };
  std::vector<LastPush> last_push_;
  bool paused_ = false;             ///< holding pushes for a checkpoint's cut
  std::uint64_t pause_session_ = 0;  ///< the chief's connection that paused it
  std::deque<HeldPush> held_;        ///< pushes that arrived while paused, in order
  struct PendingRead {
    std::vector<std::uint64_t> until;
    Responder reply;
  };
  std::optional<PendingRead> pending_read_;  ///< a ReadState waiting for its cut
  struct WaitingPause {
    std::int64_t at_step;
    std::uint64_t session;
    Responder reply;
  };
  std::vector<WaitingPause> waiting_pauses_;  ///< Pauses for a step not completed yet
  std::vector<std::uint32_t> contributors_;  ///< ... and whose they are, for a rollback's log
  std::vector<const Slice*> order_;              ///< scratch: a pull's slices, sorted

  typename P::Pacer pacer_;  ///< the global step and the tokens, as the sync policy keeps them
  /// By worker, those that sent heartbeats: when last heard, and whether held lost.
  struct Heard {
    Clock::time_point last;
    bool lost = false;
  };
  std::map<std::uint32_t, Heard> heard_;
  std::chrono::milliseconds worker_timeout_{std::chrono::seconds(5)};
  Clock::time_point last_heartbeat_;  ///< the last heartbeat of any worker
  std::deque<TokenWaiter> token_waiters_;
  /// By worker: the connection it took its last token on, which holds its tokens' lease.
  std::map<std::uint32_t, std::uint64_t> token_session_;
  std::vector<Responder> ready_waiters_;
  std::vector<WaitingPull> waiting_pulls_;
  Stats stats_;
  LimitedLog rejections_;  ///< logs refused requests, a few a second at most
};

}  // namespace pulley
