// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/service.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/ps/checkpoint_cut.hpp"
#include "pulley/ps/liveness.hpp"
#include "pulley/ps/pacing.hpp"
#include "pulley/ps/push_ledger.hpp"
#include "pulley/ps/registration.hpp"
#include "pulley/ps/shard.hpp"
#include "pulley/ps/step_gate.hpp"
#include "pulley/ps/update.hpp"
#include "pulley/ps/workers.hpp"
#include "pulley/tables/tables.hpp"

namespace pulley {

/// One ps task: holds the parts of every variable placed on it (and the rows of embedding
/// tables), aggregates the gradients pushed to them and applies the optimizer.
///
/// It is a message handler (a `Service`) and does no I/O: a transport calls `handle` for
/// one request at a time, so the same logic runs in-process and over the network, and
/// nothing here needs a lock. It is a thin host over named parts, each in `ps/`:
///
///   Registration   the model's checks and placement, readiness, epoch  Register, WaitReady
///   Shard          the parts and table rows held here                 Initialize, Pull, PullRows,
///                                                                     ReadState, ReadRows,
///                                                                     Restore, RestoreRows
///   Pacing         the sync policy's pacer, tokens and their leases   TakeToken
///   Update         the update in progress: where a push is applied    Push
///   PushLedger     pushes taken from each worker, resends             Push, ReadState
///   CheckpointCut  the pause, held pushes, the cut                    Pause, ReadState, Resume
///   Liveness       workers heard and lost                             Heartbeat, GetStats
///   JobWorkers     the job's workers, and a change to come            ChangeWorkers, Restore,
///                                                                     TakeToken
///
/// Bad requests are answered with an ErrorReply and change nothing; the ps keeps serving.
/// A push is all-or-nothing: it is checked whole (known parts, sizes, finite values unless
/// the transport vouches for them, the sync policy's verdict) before any of it is applied.
/// This is the one place that decides what a throwing policy costs: a throw before the ps
/// changes anything refuses that request; a throw while it changes its state (half an
/// update applied) fails the ps: it answers every request from then on with `kInternal`
/// and the reason, and `stopped()` turns true, so its transport ends and the task exits
/// with an error instead of serving parameters it cannot vouch for.
///
/// @tparam S Sharding policy: which ps holds which rows (every ps computes the same placement)
/// @tparam O Optimizer applied to each part, with its per-part slots kept beside the part
/// @tparam P SyncPolicy: Async, SyncReplicas, BoundedStaleness... paces and aggregates
/// @tparam T Tables<RowWiseOptimizer, IdSharding, RowAggregation> for models with embedding
///           tables, or NoTables; by default Tables<O> when O can update rows (Sgd, Adagrad,
///           Adam, Ftrl, RmsProp), NoTables otherwise (Momentum)
template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T = DefaultTables<O>>
class ParameterServer {
 public:
  /// @param task    this ps task's index
  /// @param num_ps  the number of ps tasks in the cluster
  /// @param tables  the embedding tables' policy; by default, when the tables' optimizer is
  ///                of the dense one's type, a copy of `optimizer` (the same settings)
  ParameterServer(std::uint32_t task, std::uint32_t num_ps, O optimizer, P sync, S sharding = {},
                  std::optional<T> tables = std::nullopt)
      : task_(task),
        name_("ps " + std::to_string(task)),
        registration_(task, num_ps, std::move(sharding)),
        shard_(task, optimizer, tables ? std::move(*tables) : default_table_policy<T>(optimizer)),
        pacing_(std::move(sync)) {
    if (num_ps == 0 || task >= num_ps) {
      throw Error(ErrorCode::kInvalidArgument, "ps task " + std::to_string(task) + " is outside a cluster of " +
                                                   std::to_string(num_ps) + " ps tasks");
    }
    check_optimizer_settings(optimizer);  // a NaN learning rate would have every update refused
    if constexpr (TablePolicy<T>) check_optimizer_settings(shard_.tables().policy().optimizer, "the tables' optimizer");
  }

  /// Handles one request; `reply` is called exactly once, now or later.
  void handle(Request&& request, const RequestContext& context, Responder reply) noexcept {
    if (end_) {
      ++stats_.requests_rejected;
      if (context.peer && context.peer->role == Node::Role::kWorker)
        heard_after_end(context.peer->index, request);
      respond(reply, ErrorReply{*end_});
      return;
    }
    changing_ = false;
    // A transport is done with every reply's views before it hands over a request that
    // changes the ps: the buffers of earlier row replies are free again.
    if (changes_parameters(request)) shard_.tables().free_replies();
    try {
      if (context.peer && !senders(request).contains(context.peer->role)) {
        return reject(reply, ErrorCode::kPermissionDenied,
                      "refused " + std::string(message_name(request)) + " from " + context.peer->name() +
                          ": only a " + senders(request).describe() + " may send it");
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
  /// Once it serves no more: true while a worker it heard has neither said it is leaving
  /// (its last heartbeat, sent once it learnt that training ended) nor been silent for the
  /// worker timeout. That worker may still come to hear the end: its answer was lost with
  /// its link, or its process was stopped a while. The transport serves on for it (up to
  /// TcpServerOptions::linger).
  [[nodiscard]] bool awaits_workers() const {
    return end_.has_value() && liveness_.awaits_any(Clock::now());
  }
  /// How it ended, as it now answers every request: kOutOfRange (training finished),
  /// kAborted (the chief aborted training, or no chief came back in place of a lost one:
  /// set_chief_wait) or kInternal (it failed); nullopt while serving.
  [[nodiscard]] const std::optional<ErrorReply>& ended() const noexcept { return end_; }
  /// This ps task's index (of the shard it holds).
  [[nodiscard]] std::uint32_t task() const noexcept { return task_; }
  /// How log lines and errors name it ("ps 3"; a copy: "ps 4's copy of ps 3").
  void set_name(std::string name) { name_ = std::move(name); }
  /// How long a worker that sent heartbeats may fall silent before this ps holds it lost
  /// (default 5 s; see Liveness). Workers that never sent one are never held lost.
  void set_worker_timeout(std::chrono::milliseconds timeout) noexcept { liveness_.set_timeout(timeout); }
  /// How long this ps waits for a chief to come back once it holds the chief lost (its
  /// heartbeats stopped for the worker timeout; default 5 min): meanwhile it keeps the model
  /// and serves the workers (unless `set_serves_without_chief(false)`), and a chief started
  /// again goes on from it. Then it ends training as aborted (every task fails, naming the
  /// chief). A chief that never beat is never held lost.
  void set_chief_wait(std::chrono::milliseconds wait) noexcept { chief_wait_ = wait; }
  /// False: this ps serves no task while it misses the chief (ShardCopies' lease), so a
  /// lost chief pauses the job here rather than letting the workers go on; its log says so.
  void set_serves_without_chief(bool serves) noexcept { serves_without_chief_ = serves; }

  /// Counters, as GetStats answers them.
  [[nodiscard]] Stats stats() const noexcept {
    Stats s = stats_;
    s.global_step = pacing_.global_step();
    s.requests_waiting = static_cast<std::int64_t>(pacing_.waiting() + pulls_.size() + row_pulls_.size());
    shard_.tables().count(s);
    return s;
  }
  /// Hands the counters (`stats()`) to `sink` now and then: when a heartbeat or a GetStats
  /// comes and `every` has passed since the last time (clients beat every second, so a ps
  /// with clients reports about that often). `sink` runs on the thread that handles
  /// requests and must not call back into this ps. What the role runner's metrics read.
  void report_stats(std::function<void(const Stats&)> sink,
                    std::chrono::milliseconds every = std::chrono::milliseconds(500)) {
    stats_sink_ = std::move(sink);
    stats_every_ = every;
  }

  /// The counters of each embedding table held here, in the model's table order.
  [[nodiscard]] std::vector<TableStats> table_stats() const { return shard_.tables().stats(); }

  /// The transport lost connection `session` of task `node` (0: all of them). A worker's
  /// token requests parked on it are answered kUnavailable, and if it is the connection
  /// the worker took its last token on, the tokens it took and did not push for go back to
  /// the sync policy: a worker that vanished holding one cannot stall a step, even while a
  /// process restarted in its place is already connected. A chief that paused this ps for
  /// a checkpoint's cut and left resumes it.
  /// Time passed with no request (Service::tick): the chief is held lost, and given up on,
  /// even when no task sends anything (a ps with copies serves none while the chief is
  /// away: ShardCopies). Workers are judged by what they send only.
  void tick() noexcept {
    if (end_) return;
    try {
      (void)check_chief(Clock::now());
    } catch (const std::exception&) {  // no memory for a log line: the next tick tries again
    }
  }

  /// It serves the tasks again after refusing all but the chief since `since` (ShardCopies'
  /// fence): the workers' silence meanwhile, and before it while this ps heard nobody
  /// at all, was this ps's doing and is not held against them (Liveness::forgive).
  void fence_lifted(Liveness::Clock::time_point since) noexcept {
    liveness_.forgive(since, Clock::now());
  }

  /// Its shard moves elsewhere (a copy ShardCopies holds no more): every request waiting
  /// here is answered kUnavailable with `why`, so that its sender asks the job's ps tasks
  /// again. Then it may be destroyed.
  void let_go(const std::string& why) {
    end_ = ErrorReply{ErrorCode::kUnavailable, why};
    answer_all_waiting(*end_);
  }

  void disconnected(const Node& node, std::uint64_t session) noexcept {
    if (end_) return;
    try {
      if (node.role == Node::Role::kChief && cut_.paused_by(session)) {
        // (the chief ended, or it moved this shard's copy elsewhere and closed its
        // connection here before letting go of it)
        log(LogLevel::kWarning,
            name_ + ": the chief's connection closed while it paused this ps: resuming");
        changing_ = true;
        resume();
      } else if (node.role == Node::Role::kChief && rows_cut_session_ == session && session != 0) {
        log(LogLevel::kWarning, name_ + ": the chief left while it read a checkpoint's rows: the cut ends");
        changing_ = true;
        shard_.tables().end_cut();
        rows_cut_session_ = 0;
      } else if (node.role == Node::Role::kWorker) {
        const std::string gone = name_ + ": " + node.name() + " disconnected";
        const std::string before = pacing_.waiting_for();
        changing_ = true;
        if (pacing_.disconnected(node.index, session, gone)) {
          if (pacing_.waiting_for() != before) {
            log(LogLevel::kInfo, gone + " holding its token: given back (" + pacing_.waiting_for() + ")");
          }
          hand_out_tokens();
        }
      }
      changing_ = false;
    } catch (const std::exception& e) {
      fail_quietly(std::string("after a disconnection: ") + e.what());
    } catch (...) {
      fail_quietly("after a disconnection: unknown exception");
    }
  }

  /// The job's workers as the chief last set them (ChangeWorkers, Restore::workers),
  /// ascending; empty while they are the cluster spec's. A transport lets a worker connect
  /// if it is one of them (a worker joining is, from the moment the chief counted it in).
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return workers_.admitted(); }

  /// The most tensor bytes a request can carry now: a push or an initialization has one
  /// value per element held here, a restore one more per optimizer slot, a push its rows
  /// (0 before registration: nothing can carry a tensor yet).
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept { return shard_.max_request_payload(); }

 private:
  using Clock = Liveness::Clock;

  // ---- answering, refusing, failing ----------------------------------------------------

  /// Refuses a request: answers the error, counts it, and logs it (at most 20 lines a
  /// second), so that an operator sees what a careless or hostile client tried.
  void reject(Responder& reply, ErrorCode code, const std::string& message) {
    ++stats_.requests_rejected;
    std::string line = name_ + ": " + message;
    rejections_(LogLevel::kWarning, line);
    respond(reply, ErrorReply{code, std::move(line)});
  }
  /// Refuses with a part's verdict; true if there was one.
  bool refused(Responder& reply, std::optional<ErrorReply>&& refusal) {
    if (!refusal) return false;
    reject(reply, refusal->code, refusal->message);
    return true;
  }

  /// A handler threw: refuse the request if nothing changed yet, else fail the ps.
  void settle(Responder& reply, ErrorCode code, const char* what, std::string_view request) noexcept {
    try {
      if (!changing_) {
        if (reply) reject(reply, code, std::string(request) + " refused: " + what);
        return;
      }
      fail("a policy threw while applying a " + std::string(request) + ": " + what);
      if (reply) respond(reply, ErrorReply{*end_});
    } catch (...) {  // no memory even for the message
      end_ = ErrorReply{ErrorCode::kInternal, {}};
      if (reply) respond(reply, ErrorReply{ErrorCode::kInternal, {}});
    }
  }

  /// The ps can no longer vouch for its state: it answers everything with `reason` from now.
  void fail(const std::string& reason) {
    end_ = ErrorReply{ErrorCode::kInternal, name_ + " failed: " + reason};
    log(LogLevel::kError, end_->message);
    answer_all_waiting(*end_);
  }
  void fail_quietly(const std::string& reason) noexcept {
    try {
      fail(reason);
    } catch (...) {  // no memory even for the message
      end_ = ErrorReply{ErrorCode::kInternal, {}};
    }
  }

  void answer_all_waiting(const ErrorReply& answer) {
    registration_.answer_all(answer);
    pacing_.answer_all(answer);
    pulls_.answer_all(answer);
    row_pulls_.answer_all(answer);
    cut_.answer_all(answer);
  }

  /// Checks that a worker's request names the worker that sent it (and a sane index).
  bool is_sender(std::uint32_t worker, const RequestContext& context, Responder& reply, std::string_view what) {
    if (context.peer && context.peer->index != worker) {
      reject(reply, ErrorCode::kPermissionDenied, "refused " + std::string(what) + " for worker " +
                                                      std::to_string(worker) + " from " + context.peer->name());
      return false;
    }
    if (worker >= JobWorkers::kMaxIndex) {
      reject(reply, ErrorCode::kInvalidArgument, "worker index " + std::to_string(worker) + " is too large");
      return false;
    }
    return true;
  }

  /// `problem` with a request of epoch `epoch`, unless the request is of an earlier epoch
  /// than this ps's: then the epoch's refusal (kFailedPrecondition: start again), since
  /// what it names may have moved with the restore (a membership's change places parts
  /// and rows anew). A read unbound to a step (min_step 0) is not refused for its epoch
  /// alone.
  [[nodiscard]] std::optional<ErrorReply> of_epoch(std::optional<ErrorReply> problem, std::uint64_t epoch,
                                                   std::string_view what) const {
    if (problem && epoch < registration_.epoch()) return registration_.check_epoch(epoch, what);
    return problem;
  }

  /// True if the ps is ready for `what`; otherwise refuses it.
  bool is_ready(Responder& reply, std::string_view what) {
    if (registration_.ready()) return true;
    reject(reply, ErrorCode::kFailedPrecondition, std::string(what) + " before initialization");
    return false;
  }

  // ---- Register / Initialize / WaitReady: registration.hpp -------------------------------

  void on(Register& r, const RequestContext&, Responder& reply) {
    const bool again = shard_.assigned();
    if (again) {
      if (!shard_.holds(r)) return reject(reply, ErrorCode::kAlreadyExists, "a different model is already registered");
      if (r.membership == registration_.membership() && registration_.members_of(r) == registration_.members()) {
        return respond(reply, placement_reply());
      }
      if (r.membership <= registration_.membership()) {
        return reject(reply, ErrorCode::kFailedPrecondition,
                      name_ + " holds the job at membership " + std::to_string(registration_.membership()) +
                          ": membership " + std::to_string(r.membership) + " is not newer");
      }
    }
    Placement placement;
    if (refused(reply, registration_.check(r, TablePolicy<T>, placement))) return;
    const std::vector<std::uint32_t> members = registration_.members_of(r);
    if constexpr (TablePolicy<T>) {
      if (!r.tables.empty() && !first_tasks(members) && !ElasticIdSharding<typename T::Sharding>) {
        return reject(reply, ErrorCode::kFailedPrecondition,
                      "the tables' IdSharding places rows over ps tasks 0 .. n-1 only: a job without ps " +
                          std::string("task(s) of its cluster needs an ElasticIdSharding (HashIds, RangeIds)"));
      }
    }
    const std::uint64_t bytes_before = shard_.held_bytes();
    const std::uint64_t membership = r.membership;
    std::vector<std::string> addresses = r.ps_addresses;
    shard_.assign(std::move(r), std::move(placement), members, pacing_.policy());  // a throw changes nothing
    registration_.registered(members, membership, std::move(addresses));
    if (again) {
      // The ps tasks changed: what this ps held is placed anew and comes back with the
      // Restore that follows; what waited belongs to the shape before.
      const ErrorReply gone{ErrorCode::kFailedPrecondition,
                            name_ + ": the job's ps tasks changed (membership " + std::to_string(membership) +
                                "): wait until ready and start the step again"};
      registration_.unready();
      pacing_.answer_all(gone);
      pulls_.answer_all(gone);
      row_pulls_.answer_all(gone);
      cut_.answer_all(gone);
      update_.clear();
      ledger_.clear();
      ahead_.clear();
      replaced_ = true;
      log(LogLevel::kInfo, name_ + ": the job's ps tasks are now " + describe_members(members) + " (membership " +
                               std::to_string(registration_.membership()) + "): holds " +
                               std::to_string(shard_.held_bytes()) + " bytes of dense parts' values, " +
                               std::to_string(bytes_before) + " before; waits for its restore");
    }
    respond(reply, placement_reply());
    if (!again && shard_.initialized()) become_ready();  // no part is held here
  }

  void on(Initialize& r, const RequestContext& context, Responder& reply) {
    if (!shard_.assigned()) {
      return reject(reply, ErrorCode::kFailedPrecondition, "initialize before the model is registered");
    }
    if (refused(reply, shard_.check(r.parts, context.tensors_finite)) || refused(reply, shard_.check_fresh(r.parts))) {
      return;
    }
    shard_.initialize(r.parts);
    if (r.hold) cut_.pause(context.session);  // before any worker can see it ready
    respond(reply, Ack{});
    if (shard_.initialized() && !registration_.ready() && !restoring_rows_) become_ready();
  }

  void on(WaitReady&, const RequestContext&, Responder& reply) {
    if (registration_.ready()) return respond(reply, placement_reply());
    registration_.wait_ready(reply);
  }

  void become_ready() {
    registration_.become_ready([this] { return placement_reply(); });
  }

  /// What Register and WaitReady answer: the model, where it lives, the epoch, and the
  /// names of the optimizer's slots and counters.
  PlacementReply placement_reply() const {
    PlacementReply answer{shard_.variables(),
                          shard_.placement(),
                          registration_.epoch(),
                          {},
                          {},
                          shard_.table_specs(),
                          shard_.tables().id_sharding(shard_.table_specs()),
                          registration_.members(),
                          registration_.membership(),
                          registration_.ps_addresses(),
                          shard_.table_seed()};
    shard_.state_names(answer.slot_names, answer.counter_names);
    return answer;
  }

  // ---- TakeToken: pacing.hpp -------------------------------------------------------------

  void on(TakeToken& r, const RequestContext& context, Responder& reply) {
    if (!is_ready(reply, "token requested") || !is_sender(r.worker, context, reply, "TakeToken") ||
        refused(reply, registration_.check_epoch(r.epoch, "token request"))) {
      return;
    }
    if (!workers_.counted(r.worker)) return reject(reply, ErrorCode::kPermissionDenied, workers_.left_message(r.worker));
    revive(r.worker);  // before its heartbeat, maybe: it starts from the step in progress
    pacing_.wait_for_token(r.worker, context.session, reply, ledger_);
    hand_out_tokens();
  }

  /// Asks the sync policy again for every waiting token request (once the workers the
  /// chief set are counted, if their step came). A refusal answers that request; any other
  /// throw fails the ps (the policy may have changed its pacer half way).
  void hand_out_tokens() {
    count_next_workers();
    const bool changing = std::exchange(changing_, true);
    pacing_.hand_out(ledger_, [this](Responder& reply, ErrorCode code, const std::string& message) {
      reject(reply, code, message);
    });
    changing_ = changing;
  }

  /// A worker's pull gated at the step after the one in progress, from a worker that has
  /// not pushed that step here: it will not push it here (a worker pushes a step on a
  /// connection before it pulls the next there). Either its push was lost with its process
  /// (killed while it wrote the push to several ps tasks, which took it or not; the process
  /// started in its place pulls the step the others are at), or, with backup workers, it
  /// skipped the step. The sync policy may then go on without it for this step
  /// (SyncPolicy::on_pull_ahead), as the ps tasks that took the push went on with it: a
  /// step would otherwise wait for a push that never comes while the new process beats.
  /// The push is counted as taken when the pacing ps took more of the worker's pushes than
  /// this ps (`pushes_paced`, from the worker's token): a checkpoint's cut brings every ps to
  /// the same counts. The worker is remembered until the step moves, and asked about again
  /// when what the policy judges by changed (a push taken, a worker back, a cut's pause
  /// ended); never while paused for a cut, which must see no step complete on its own.
  /// A lost push is logged; a skipped step is not.
  void pulls_ahead(const RequestContext& context, std::int64_t min_step,
                   std::uint64_t pushes_paced) {
    if (!context.peer || context.peer->role != Node::Role::kWorker ||
        min_step != pacing_.global_step() + 1)
      return;
    if (ahead_step_ != pacing_.global_step()) forget_pulls_ahead();
    ahead_step_ = pacing_.global_step();
    const std::uint32_t worker = context.peer->index;
    const bool lost_here =
        pushes_paced > ledger_.taken(worker);  // judged now: its later pushes count later
    const auto known = std::find_if(ahead_.begin(), ahead_.end(),
                                    [&](const Ahead& a) { return a.worker == worker; });
    if (known == ahead_.end()) {
      ahead_.push_back({worker, lost_here});
    } else {
      known->lost_here = known->lost_here || lost_here;
    }
    judge_pulls_ahead();
  }

  /// Asks the sync policy about each worker remembered by `pulls_ahead` at the step in
  /// progress.
  void judge_pulls_ahead() {
    if (ahead_.empty() || cut_.paused()) return;
    const std::int64_t step_before = pacing_.global_step();
    if (ahead_step_ != step_before) return forget_pulls_ahead();
    for (std::size_t i = 0; i < ahead_.size() && pacing_.global_step() == step_before;) {
      const std::uint32_t worker = ahead_[i].worker;
      const bool lost_here = ahead_[i].lost_here;
      const bool judged = go_on_without([&]() -> std::optional<Verdict> {
        std::optional<Verdict> verdict = pacing_.pulled_ahead(worker, step_before + 1);
        if (verdict && lost_here) ledger_.count_lost(worker, step_before);
        return verdict;
      });
      if (!judged) {
        ++i;
        continue;
      }
      ahead_.erase(ahead_.begin() + static_cast<std::ptrdiff_t>(i));
      // A backup that skipped the step (the pacing ps took no push of it either) is no news.
      if (!lost_here) continue;
      log(LogLevel::kWarning,
          name_ + ": " + Node::worker(worker).name() + " pulls step " +
              std::to_string(step_before + 1) + " without a push for step " +
              std::to_string(step_before) +
              " here: its push was lost with its process (the ps tasks that took it "
              "went on); this step goes on without it; " +
              describe_wait());
    }
    if (pacing_.global_step() != step_before) forget_pulls_ahead();
  }

  /// Forgets the workers that pulled ahead of a step that went on without a verdict on them
  /// (held lost here, or a refill step): a push of one that the pacing ps took and this ps
  /// never did counts as taken all the same, so that a checkpoint's cut finds them alike.
  void forget_pulls_ahead() {
    for (const Ahead& a : ahead_) {
      if (a.lost_here) ledger_.count_lost(a.worker, ahead_step_);
    }
    ahead_.clear();
  }

  /// The sync policy stops waiting for a worker at the step in progress, as `change` (the
  /// pacing call) says: an update that needed only that worker is applied now, and the
  /// tokens and step gates that waited are answered. False when the policy still waits.
  template <class Change>
  bool go_on_without(Change change) {
    const std::int64_t step_before = pacing_.global_step();
    changing_ = true;  // a throw from the policy leaves its pacer half changed
    const std::optional<Verdict> verdict = change();
    if (verdict == Verdict::kReady) update_.complete(shard_, pacing_.policy(), step_before, stats_);
    changing_ = false;
    if (!verdict) return false;
    hand_out_tokens();
    if (pacing_.global_step() != step_before) release_step_gates();
    return true;
  }

  /// The global step moved: the pulls and pauses waiting for it are answered.
  void release_step_gates() {
    const std::int64_t step = pacing_.global_step();
    pulls_.release(step, [&](Pull& pull, Responder& reply) { respond(reply, shard_.read(pull.slices, step, stats_)); });
    row_pulls_.release(step, [&](RowPull& pull, Responder& reply) {
      // A row pull that cannot be answered (no memory for its rows) is refused alone: it is
      // answered inside the push that completed the step, which must not fail the ps.
      try {
        answer_rows(pull.request, pull.create, step, reply);
      } catch (const std::exception& e) {
        if (reply) reject(reply, ErrorCode::kResourceExhausted, std::string("PullRows refused: ") + e.what());
      }
    });
    cut_.release_pauses(step, [&](std::uint64_t session, Responder& reply) { pause(session, reply); });
  }

  // ---- Pull / PullRows: shard.hpp, table_shard.hpp ----------------------------------------

  void on(Pull& r, const RequestContext& context, Responder& reply) {
    if (!is_ready(reply, "pull") ||
        (r.min_step > 0 && refused(reply, registration_.check_epoch(r.epoch, "pull"))) ||
        refused(reply, of_epoch(shard_.check(r.slices), r.epoch, "pull"))) {
      return;
    }
    pulls_ahead(context, r.min_step, r.pushes_paced);
    const std::int64_t step = pacing_.global_step();
    if (step < r.min_step) return pulls_.park(r.min_step, std::move(r), reply);
    respond(reply, shard_.read(r.slices, step, stats_));
  }

  void on(PullRows& r, const RequestContext& context, Responder& reply) {
    if (!is_ready(reply, "row pull") ||
        (r.min_step > 0 && refused(reply, registration_.check_epoch(r.epoch, "row pull"))) ||
        refused(reply, of_epoch(shard_.tables().check(r.tables, false, context.tensors_finite), r.epoch,
                                "row pull"))) {
      return;
    }
    // Only a worker's pull creates, admits and touches rows: the chief and evaluators read.
    const bool create = !context.peer || context.peer->role == Node::Role::kWorker;
    pulls_ahead(context, r.min_step, r.pushes_paced);
    const std::int64_t step = pacing_.global_step();
    if (step < r.min_step) return row_pulls_.park(r.min_step, RowPull{std::move(r), create}, reply);
    answer_rows(r, create, step, reply);
  }

  /// The rows of `r` at global step `step`, or only Ack when the client wants no rows back
  /// (`PullRows::touch_only`: what the pull does to them is done all the same).
  void answer_rows(const PullRows& r, bool create, std::int64_t step, Responder& reply) {
    RowsReply rows = shard_.tables().pull(r, create, step, stats_);
    if (r.touch_only) return respond(reply, Ack{});
    respond(reply, std::move(rows));
  }

  // ---- Push: update.hpp, push_ledger.hpp --------------------------------------------------

  void on(Push& r, const RequestContext& context, Responder& reply) {
    if (!registration_.ready()) {
      return reject(reply, ErrorCode::kFailedPrecondition,
                    "push before initialization: the chief has not initialized the variables");
    }
    // The epoch first: a push of the shape before a restore (another membership's parts and
    // rows) is refused as late, to be started again, not as malformed.
    if (!is_sender(r.worker, context, reply, "Push") || refused(reply, registration_.check_epoch(r.epoch, "push")) ||
        refused(reply, shard_.check(r.gradients, context.tensors_finite)) ||
        refused(reply, shard_.tables().check(r.rows, true, context.tensors_finite))) {
      return;
    }
    if (r.gradients.size() != shard_.parts().size()) {
      // Every part must see every push's verdict, or parts drift apart.
      return reject(reply, ErrorCode::kInvalidArgument,
                    "a push must carry a gradient for each of the " + std::to_string(shard_.parts().size()) +
                        " parts held here, got " + std::to_string(r.gradients.size()));
    }
    if (const PushLedger::Answer* answer = ledger_.repeated(r.worker, r.sequence, r.series)) {
      ++stats_.pushes_repeated;  // sent again after a lost connection: answered, counted once
      if (!answer->refused.empty()) return reject(reply, ErrorCode::kInvalidArgument, answer->refused);
      return respond(reply, PushReply{answer->stale_parts});
    }
    count_next_workers();  // a change due at this step is counted before the sender is judged
    // Under Async too, which takes no token a step; and a push for a step past the change
    // to come that takes its worker out, as a ps that counted the change refuses it.
    if (!workers_.counted(r.worker) || workers_.leaves_by(r.worker, r.local_step)) {
      return reject(reply, ErrorCode::kPermissionDenied, workers_.left_message(r.worker));
    }
    if (ledger_.older(r.worker, r.sequence, r.series)) {
      ++stats_.pushes_repeated;
      return reject(reply, ErrorCode::kAborted,
                    "push " + std::to_string(r.sequence) + " of worker " + std::to_string(r.worker) +
                        " came after a later one of the same client: a late copy from a connection it gave "
                        "up (it sent the push again), not counted");
    }
    if (counted_lost(r, reply)) return;
    if (cut_.paused()) {
      if (cut_.rehold(r, reply)) {
        ++stats_.pushes_repeated;  // the cut holds it already: this connection gets the answer
        return;
      }
      cut_.hold(r, reply);
      return advance_cut();
    }
    take(r, reply, context.tensors_finite ? context.tensors_largest : std::numeric_limits<float>::infinity());
    judge_pulls_ahead();  // (the push may have said whether the step is a refill step)
  }

  /// Refuses `r` if it is the push of a process lost while writing it, counted when the
  /// process in its place pulled past its step here (PushLedger::count_lost): its bytes
  /// read late from the lost process's connection, or held by a cut meanwhile.
  bool counted_lost(const Push& r, Responder& reply) {
    if (!ledger_.counted_lost(r.worker, r.local_step)) return false;
    ++stats_.pushes_repeated;
    reject(reply, ErrorCode::kAborted,
           "push of step " + std::to_string(r.local_step) + " of worker " +
               std::to_string(r.worker) +
               " came after the process in its place pulled past that step here, which "
               "counted it then as a push lost with its process: a late copy, not counted again");
    return true;
  }

  /// Takes a push that passed every check: the sync policy's verdict, then the update
  /// (`largest`: its largest magnitude, +infinity when not known: Update::take). A push a
  /// cut held is checked again here for a lost push counted meanwhile.
  void take(const Push& r, Responder& reply, float largest = std::numeric_limits<float>::infinity()) {
    if (counted_lost(r, reply)) return;
    const std::int64_t step_before = pacing_.global_step();
    changing_ = true;  // the policy's own refusal (pulley::Error) leaves its pacer unchanged
    Verdict verdict = Verdict::kStale;
    try {
      verdict = pacing_.on_push(r.worker, r.local_step, r.refill);
    } catch (const Error& e) {
      changing_ = false;
      return reject(reply, e.code(), std::string("Push refused: ") + e.message());
    }
    ledger_.count(r.worker, r.local_step);
    // A push judged lost here when its worker pulled ahead came after all (read late from the
    // connection of the process lost): counted now, it is not counted again when its step moves.
    if (r.local_step <= ahead_step_) {
      for (Ahead& a : ahead_) a.lost_here = a.lost_here && a.worker != r.worker;
    }
    ++stats_.pushes_taken;
    const auto outcome = update_.take(shard_, pacing_.policy(), r, verdict, step_before, stats_, largest);
    ledger_.answered(r.worker, r.sequence, {outcome.stale_parts, outcome.refused}, r.series);
    if (outcome.refused.empty()) {
      respond(reply, PushReply{outcome.stale_parts});
    } else {
      reject(reply, ErrorCode::kInvalidArgument, outcome.refused);
    }
    hand_out_tokens();
    if (pacing_.global_step() != step_before) release_step_gates();
    changing_ = false;
  }

  // ---- ChangeWorkers: pacing.hpp -----------------------------------------------------------

  void on(ChangeWorkers& r, const RequestContext& context, Responder& reply) {
    if (!is_ready(reply, "change the workers")) return;
    if (!cut_.paused_by(context.session)) {
      return reject(reply, ErrorCode::kFailedPrecondition, "ChangeWorkers without Pause (of this connection)");
    }
    if (r.workers.empty()) {  // the chief takes back the change of that step (another ps refused it)
      workers_.take_back(r.from_step);
      return respond(reply, Ack{});
    }
    if (std::string why = JobWorkers::check(r.workers); !why.empty() || (!r.before.empty() && !(why = JobWorkers::check(r.before)).empty())) {
      return reject(reply, ErrorCode::kInvalidArgument, "ChangeWorkers: " + why);
    }
    if constexpr (!kReshapes<P>) {
      return reject(reply, ErrorCode::kFailedPrecondition,
                    name_ + ": its sync policy cannot count workers that join or leave (no SyncPolicy::reshape)");
    }
    if (r.from_step <= pacing_.global_step()) {
      return reject(reply, ErrorCode::kFailedPrecondition,
                    name_ + " is at global step " + std::to_string(pacing_.global_step()) +
                        " already: the workers change at a step to come, not " + std::to_string(r.from_step));
    }
    workers_.change_at(std::move(r.workers), r.from_step, std::move(r.before));
    respond(reply, Ack{});
  }

  /// Counts the workers the chief set (ChangeWorkers) once this ps reached their step.
  /// Under SyncReplicas that is the boundary of that step on every ps: a push of the step
  /// needs a pull of it, which waits until this ps is there (BoundedStaleness's slowest
  /// clock may reach it on one ps before another, see there). A new worker is heard now
  /// (where workers send heartbeats), so that one that never comes is held lost after the
  /// worker timeout; those gone are forgotten, and their waiting token requests refused.
  /// A throw from the policy fails the ps (it would disagree with the others).
  void count_next_workers() {
    const std::optional<JobWorkers::Change> change = workers_.due(pacing_.global_step());
    if (!change) return;
    const std::vector<std::uint32_t>& before = change->before;
    const std::vector<std::uint32_t>& after = change->after;
    const auto in = [](const std::vector<std::uint32_t>& set, std::uint32_t w) {
      return std::binary_search(set.begin(), set.end(), w);
    };
    const bool changing = std::exchange(changing_, true);
    for (const std::uint32_t w : after) {  // a new one is not lost unless this ps holds it so
      if ((before.empty() || !in(before, w)) && !liveness_.is_lost(w)) pacing_.back(w);
    }
    pacing_.reshape(after);
    for (const std::uint32_t w : before) {
      if (in(after, w)) continue;
      liveness_.forget(w);
      pacing_.back(w);  // not held lost by the policy either: counted again, it starts afresh
      pacing_.refuse(w, ErrorReply{ErrorCode::kPermissionDenied, workers_.left_message(w)});
    }
    for (const std::uint32_t w : after) {
      // Where workers beat their hearts, a new one is held lost if it never comes.
      if ((before.empty() || !in(before, w)) && !liveness_.known(w) && liveness_.any()) {
        liveness_.heard(w, Clock::now());
      }
    }
    changing_ = changing;
    log(LogLevel::kInfo, name_ + ": the job's workers are " + describe_members(after) + " from global step " +
                             std::to_string(pacing_.global_step()) + " on");
  }

  // ---- Pause / ReadState / Resume: checkpoint_cut.hpp --------------------------------------

  void on(Pause& r, const RequestContext& context, Responder& reply) {
    if (!is_ready(reply, "pause")) return;
    if (pacing_.global_step() < r.at_step) return cut_.park_pause(r.at_step, context.session, reply);
    pause(context.session, reply);
  }

  void pause(std::uint64_t session, Responder& reply) {
    rows_cut_session_ = 0;  // a new cut: what an earlier one kept readable goes with its ReadState
    PauseReply answer{pacing_.global_step(), registration_.epoch(), ledger_.taken(), {}, {},
                      checkpoints_whole_state_v<O>, shard_.tables().evictions_since(), ledger_.furthest()};
    shard_.state_names(answer.slot_names, answer.counter_names);
    cut_.pause(session);
    respond(reply, std::move(answer));
  }

  void on(ReadState& r, const RequestContext&, Responder& reply) {
    if (!cut_.paused()) return reject(reply, ErrorCode::kFailedPrecondition, "ReadState without Pause");
    if (const auto worker = CheckpointCut::past(ledger_, r.until)) {
      return reject(reply, ErrorCode::kFailedPrecondition, "ReadState: this ps has taken more pushes of worker " +
                                                               std::to_string(*worker) + " than the cut");
    }
    shard_.tables().end_cut();  // a cut read before is given up
    rows_cut_session_ = 0;
    cut_since_ = r.since;
    cut_forget_before_ = r.forget_evictions_before;
    cut_.read_at(std::move(r.until), reply);
    advance_cut();
  }

  void advance_cut() {
    cut_.advance(
        ledger_, [this](const Push& push, Responder& reply) { take(push, reply); },
        [this] {
          // The rows at the cut, read next (ReadRows).
          shard_.tables().mark_cut(cut_since_, cut_forget_before_);
          return StateReply{pacing_.global_step(), pacing_.save(), shard_.read_state()};
        },
        [this, now = Clock::now()](std::uint32_t w) {
          return workers_.counted(w) && !liveness_.is_lost(w) && !liveness_.silent(w, now);
        });
  }

  void on(ReadRows& r, const RequestContext& context, Responder& reply) {
    if (!cut_.paused_by(context.session) && (rows_cut_session_ != context.session || rows_cut_session_ == 0)) {
      return reject(reply, ErrorCode::kFailedPrecondition, "ReadRows without Pause (of this connection)");
    }
    if (refused(reply, shard_.tables().check(r))) return;
    respond(reply, shard_.tables().read(r));
  }

  void on(Resume& r, const RequestContext& context, Responder& reply) {
    if (r.keep_rows && cut_.paused_by(context.session) && shard_.tables().cut_marked()) {
      rows_cut_session_ = context.session;
    }
    resume(r.keep_rows);
    respond(reply, Ack{});
  }

  /// Ends the pause; with `keep_rows`, the cut's rows stay readable while training goes on.
  void resume(bool keep_rows = false) {
    if (!keep_rows) {
      shard_.tables().end_cut();
      rows_cut_session_ = 0;
    }
    cut_.resume([this](const Push& push, Responder& reply) { take(push, reply); });
    judge_pulls_ahead();  // once every push the cut held was taken: a held push is a push
  }

  // ---- Restore: shard.hpp ------------------------------------------------------------------

  void on(Restore& r, const RequestContext&, Responder& reply) {
    if (!shard_.assigned()) return reject(reply, ErrorCode::kFailedPrecondition, "restore before the model is registered");
    // Everything is checked, and the pacer loaded aside, before anything changes.
    std::vector<const PartState*> by_part;
    if (refused(reply, shard_.check_restore(r.parts, by_part))) return;
    typename P::Pacer pacer = pacing_.load(r.pacer);  // a pulley::Error refuses it
    if (!r.workers.empty()) {
      if (const std::string why = JobWorkers::check(r.workers); !why.empty()) {
        return reject(reply, ErrorCode::kInvalidArgument, "Restore: " + why);
      }
    }
    const std::vector<std::uint32_t>& counting = r.workers.empty() ? workers_.now() : r.workers;
    // A policy that cannot count workers that change has the spec's (ChangeWorkers is refused).
    if (kReshapes<P> && !counting.empty()) pacing_.reshape(pacer, counting);  // a pulley::Error refuses it
    workers_.restore(std::move(r.workers));  // the chief's Restore says the workers as they are now
    changing_ = true;
    // Served before (ready, or placed anew for another membership): a rollback.
    const std::int64_t step_before = registration_.ready() || replaced_ ? pacing_.global_step() : -1;
    replaced_ = false;
    const std::int64_t step = pacing_.policy().global_step(pacer);
    shard_.restore(by_part, pacing_.policy());
    shard_.tables().begin_restore(step);
    rows_cut_session_ = 0;
    if (shard_.tables().size() > 0 && !r.tables_follow) {
      log(LogLevel::kWarning, name_ + ": the restore holds no rows of the embedding tables: their rows start "
                                      "again from their initial values");
    }
    update_.clear();
    ledger_.clear();
    ahead_.clear();
    // What waited belongs to the time before: its clients start their step again.
    const ErrorReply gone{ErrorCode::kFailedPrecondition,
                          name_ + ": the job was restored at global step " + std::to_string(step) +
                              " (from a checkpoint, or its state moved between ps tasks): wait until ready and "
                              "start the step again"};
    pacing_.reset(std::move(pacer), gone);
    for (const std::uint32_t worker : liveness_.lost()) (void)pacing_.lost(worker);  // still lost
    registration_.restored(r.epoch, step);
    pulls_.answer_all(gone);
    row_pulls_.answer_all(gone);
    cut_.answer_all(gone);
    // A rollback (a ps was lost) undoes what this ps applied since the checkpoint; a move
    // (a ps joined or left) restores the step it was at, or, for a copy of a shard one step
    // behind its twin when the cut was read, the step its twin was at.
    std::string undone;
    if (step_before == step) {
      undone = ", the step it was at: nothing lost";
    } else if (step_before >= 0 && step_before < step) {
      undone =
          ", ahead of global step " + std::to_string(step_before) + " where it was: nothing lost";
    } else if (step_before >= 0) {
      undone = ", rolled back from global step " + std::to_string(step_before) + ": " +
               std::to_string(std::max<std::int64_t>(step_before - step, 0)) + " steps' updates lost";
    }
    log(LogLevel::kInfo, name_ + ": restored at global step " + std::to_string(step) +
                             " (restore epoch " + std::to_string(registration_.epoch()) + ")" + undone);
    respond(reply, Ack{});
    changing_ = false;
    restoring_rows_ = r.tables_follow ? std::optional(r.epoch) : std::nullopt;
    if (restoring_rows_) {
      registration_.unready();  // until the rows are in (RestoreRows with done)
    } else if (!registration_.ready()) {
      become_ready();
    }
  }

  void on(RestoreRows& r, const RequestContext&, Responder& reply) {
    if (restoring_rows_ != r.epoch) {
      return reject(reply, ErrorCode::kFailedPrecondition, "RestoreRows without a Restore of epoch " +
                                                               std::to_string(r.epoch) + " that awaits rows");
    }
    if (refused(reply, shard_.tables().check(r))) return;
    try {
      restored_rows_ += shard_.tables().restore(r);
    } catch (const Error& e) {  // the row limit: the restore cannot complete
      return reject(reply, e.code(), e.what());
    }
    respond(reply, Ack{});
    if (r.done) {
      restoring_rows_.reset();
      log(LogLevel::kInfo, name_ + ": " + std::to_string(std::exchange(restored_rows_, 0)) +
                               " rows of the embedding tables restored");
      become_ready();
    }
  }

  // ---- Heartbeat / GetStats: liveness.hpp ---------------------------------------------------

  /// A request of worker `worker` after the end (answered with it): heard, or gone for good
  /// with its leaving heartbeat (awaits_workers).
  void heard_after_end(std::uint32_t worker, const Request& request) noexcept {
    const auto* beat = std::get_if<Heartbeat>(&request);
    if (beat != nullptr && beat->leaving) {
      liveness_.leave(worker);  // (a find and an erase: nothing allocates)
    } else {
      liveness_.touch(worker, Clock::now());
    }
  }

  void on(Heartbeat& r, const RequestContext& context, Responder& reply) {
    if (!is_sender(r.worker, context, reply, "Heartbeat")) return;
    report();
    if (context.peer && context.peer->role == Node::Role::kChief) {
      if (r.leaving) {
        liveness_.chief_left();
      } else if (liveness_.heard_chief(Clock::now())) {
        log(LogLevel::kInfo, name_ + ": the chief is back; training goes on");
      }
      check_heartbeats();
      return respond(reply, stats_reply());
    }
    if (r.leaving) {
      // Done: forgotten rather than held lost once quiet, and the tokens it took and did
      // not push for (it found training over) go back.
      liveness_.leave(r.worker);
      if (registration_.ready()) {
        changing_ = true;
        pacing_.leave(r.worker);
        changing_ = false;
        hand_out_tokens();
      }
      return respond(reply, stats_reply());
    }
    liveness_.heard(r.worker, Clock::now());
    revive(r.worker);
    check_heartbeats();
    respond(reply, stats_reply());
  }

  void on(Join&, const RequestContext&, Responder& reply) {
    reject(reply, ErrorCode::kInvalidArgument,
           name_ + " is a ps task: a new ps or worker asks the chief to join (the chief's address, --join)");
  }

  void on(Leave&, const RequestContext&, Responder& reply) {
    reject(reply, ErrorCode::kInvalidArgument, name_ + " is a ps task: a task asks the chief to leave the job");
  }

  void on(Shape&, const RequestContext&, Responder& reply) {
    reject(reply, ErrorCode::kInvalidArgument, name_ + " is a ps task: a task asks the chief for the job's shape");
  }

  void on(LostPs&, const RequestContext&, Responder& reply) {
    reject(reply, ErrorCode::kInvalidArgument, name_ + " is a ps task: a task asks the chief whether a ps is lost");
  }

  void on(GetStats&, const RequestContext&, Responder& reply) {
    report();
    check_heartbeats();
    respond(reply, stats_reply());
  }

  /// Hands the counters to the sink of `report_stats` when it is due (or `now`).
  void report(bool now_anyway = false) {
    if (!stats_sink_) return;
    const auto now = Clock::now();
    if (!now_anyway && now - last_report_ < stats_every_) return;
    last_report_ = now;
    stats_sink_(stats());
  }

  /// A worker held lost was heard from (a heartbeat, a token request): it counts again.
  /// Not while paused for a checkpoint's cut, which must see no pacing change on its own.
  void revive(std::uint32_t worker) {
    if (!liveness_.is_lost(worker) || !registration_.ready() || cut_.paused()) return;
    changing_ = true;  // a throw from the policy leaves its pacer half changed
    pacing_.back(worker);
    liveness_.back(worker, Clock::now());
    ++stats_.workers_returned;
    changing_ = false;
    log(LogLevel::kInfo, name_ + ": " + Node::worker(worker).name() + " is back; " +
                             describe_wait());
    hand_out_tokens();
    judge_pulls_ahead();
  }

  /// Holds lost every worker heard before and silent for the worker timeout: the sync
  /// policy stops waiting for it, and an update that needed only it is applied now. Not
  /// while paused for a checkpoint's cut, which must see no step complete on its own; a
  /// read of the cut then stops waiting for such a worker's pushes instead. The
  /// same for the chief, which is waited for (`set_chief_wait`), then given up on.
  void check_heartbeats() {
    const auto now = Clock::now();
    // The chief first, even while a cut it made is paused: a chief lost mid-cut ends the
    // job once nobody came back in its place.
    if (!check_chief(now) || !registration_.ready()) return;
    if (cut_.paused()) return advance_cut();  // a worker that fell silent is no longer awaited
    liveness_.expire(now, [&](std::uint32_t worker, Clock::time_point last) {
      ++stats_.workers_lost;
      go_on_without([&]() -> std::optional<Verdict> { return pacing_.lost(worker); });
      log(LogLevel::kWarning, name_ + ": " + Node::worker(worker).name() + " lost (last heard " +
                                  Liveness::seconds_between(last, now) +
                                  " s ago): training goes on without it; " + describe_wait());
    });
  }

  /// Holds the chief lost once silent for the worker timeout, and ends training as aborted
  /// once no chief came back within the chief wait after that; false then.
  bool check_chief(Clock::time_point now) {
    liveness_.expire_chief(now, [&](Clock::time_point last) {
      log(LogLevel::kWarning,
          name_ + ": the chief is lost (last heard " + Liveness::seconds_between(last, now) +
              " s ago): the model is kept and " +
              (serves_without_chief_ ? "the workers go on" : "no task is served meanwhile") +
              "; waiting up to " +
              std::to_string(chief_wait_.count() / 1000) + " s for a chief to come back");
    });
    if (const auto since = liveness_.chief_lost_since(); since && now - *since >= chief_wait_ + liveness_.timeout()) {
      fail_for_chief(*since, now);
      return false;
    }
    return true;
  }

  /// No chief came back in time: training cannot end, so it ends here as aborted, and
  /// every task hears why.
  void fail_for_chief(Clock::time_point since, Clock::time_point now) {
    end_ = ErrorReply{ErrorCode::kAborted,
                      name_ + ": the chief was lost " + Liveness::seconds_between(since, now) +
                          " s ago and no chief came back (--recovery-timeout-ms): training cannot end; "
                          "restart the job (it resumes from its newest checkpoint)"};
    log(LogLevel::kError, end_->message);
    answer_all_waiting(*end_);
  }

  /// What GetStats and Heartbeat answer.
  StatsReply stats_reply() const {
    return StatsReply{stats(),
                      describe_wait(),
                      liveness_.lost(),
                      liveness_.chief_lost_since().has_value(),
                      registration_.ready(),
                      registration_.epoch(),
                      shard_.assigned() ? registration_.members() : std::vector<std::uint32_t>{},
                      registration_.membership(),
                      registration_.ps_addresses(),
                      std::vector<std::uint32_t>(workers().begin(), workers().end())};
  }

  /// The sync policy's wait in words, with how long ago each awaited worker was heard:
  /// "step 812: 1 of 2 gradients in, 1 of 2 tokens left; waiting for worker:1 (last heard
  /// 14.2 s ago)".
  std::string describe_wait() const {
    std::string text = pacing_.waiting_for();
    const std::string workers = liveness_.describe(pacing_.awaited(), Clock::now());
    if (workers.empty()) return text;
    return text + (text.empty() ? "waiting for " : "; waiting for ") + workers;
  }

  // ---- Shutdown ------------------------------------------------------------------------------

  void on(Shutdown& r, const RequestContext&, Responder& reply) {
    report(true);  // the figures end where training did
    const std::string ps = name_;
    end_ = r.aborted ? ErrorReply{ErrorCode::kAborted, ps + ": training aborted by the chief: " + r.reason}
                     : ErrorReply{ErrorCode::kOutOfRange,
                                  ps + ": training finished (the chief shut the ps tasks down at global step " +
                                      std::to_string(pacing_.global_step()) + ")"};
    answer_all_waiting(*end_);
    respond(reply, Ack{});
  }

  /// A row pull waiting for its step.
  struct RowPull {
    PullRows request;
    bool create;  ///< a worker's: creates, admits and touches rows
  };

  std::uint32_t task_;
  std::string name_;  ///< "ps 3", as log lines and errors name it
  bool changing_ = false;          ///< inside a change that a throw would leave half done
  bool replaced_ = false;          ///< placed anew for another membership, not restored yet
  std::optional<std::uint64_t> restoring_rows_;  ///< a Restore of this epoch awaits its rows
  std::size_t restored_rows_ = 0;                ///< rows of that restore kept so far
  std::optional<ErrorReply> end_;  ///< set once stopped: what every request is answered
  Registration<S> registration_;
  Shard<O, P, T> shard_;
  Pacing<P> pacing_;
  Update<O, P, T> update_;
  PushLedger ledger_;
  /// A worker that pulled step `ahead_step_` + 1 without a push of `ahead_step_` here.
  struct Ahead {
    std::uint32_t worker = 0;
    bool lost_here = false;  ///< the pacing ps took a push of it this ps did not
  };
  /// Such workers, not judged yet (pulls_ahead).
  std::vector<Ahead> ahead_;
  std::int64_t ahead_step_ = -1;
  CheckpointCut cut_;
  std::int64_t cut_since_ = -1;          ///< the cut read last: rows since (ReadState::since)
  std::uint64_t rows_cut_session_ = 0;   ///< the chief's connection reading the cut's rows
  std::int64_t cut_forget_before_ = -1;  ///< and evictions forgotten before
  Liveness liveness_;
  JobWorkers workers_;  ///< the job's workers once changed, and a change waiting for its step
  std::chrono::milliseconds chief_wait_{std::chrono::minutes(5)};  ///< see set_chief_wait
  bool serves_without_chief_ = true;                                 ///< see set_serves_without_chief
  StepGate<Pull> pulls_;         ///< pulls waiting for their step
  StepGate<RowPull> row_pulls_;  ///< row pulls waiting for their step
  Stats stats_;
  std::function<void(const Stats&)> stats_sink_;  ///< report_stats
  std::chrono::milliseconds stats_every_{500};
  Clock::time_point last_report_{};
  LimitedLog rejections_;  ///< logs refused requests, a few a second at most
};

}  // namespace pulley
