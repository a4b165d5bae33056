// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
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
      throw Error(ErrorCode::kInvalidArgument, "ps task " + std::to_string(task) +
                                                   " is outside a cluster of " +
                                                   std::to_string(num_ps) + " ps tasks");
    }
    check_optimizer_settings(optimizer);  // a NaN learning rate would have every update refused
    if constexpr (TablePolicy<T>)
      check_optimizer_settings(shard_.tables().policy().optimizer, "the tables' optimizer");
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
                      "refused " + std::string(message_name(request)) + " from " +
                          context.peer->name() + ": only a " + senders(request).describe() +
                          " may send it");
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
    return end_.has_value() && !restarts_ && liveness_.awaits_any(Clock::now());
  }
  /// True once the chief told it to start again empty (Shutdown::restart): its process
  /// serves anew, as one started in its place (the role runner's ps task does).
  [[nodiscard]] bool restarts() const noexcept { return restarts_; }
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
  void set_worker_timeout(std::chrono::milliseconds timeout) noexcept {
    liveness_.set_timeout(timeout);
  }
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
    s.requests_waiting =
        static_cast<std::int64_t>(pacing_.waiting() + pulls_.size() + row_pulls_.size());
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

  /// The transport lost connection `session` of task `node` (0: all of them). A worker's
  /// token requests parked on it are answered kUnavailable, and if it is the connection
  /// the worker took its last token on, the tokens it took and did not push for go back to
  /// the sync policy: a worker that vanished holding one cannot stall a step, even while a
  /// process restarted in its place is already connected. A chief that paused this ps for
  /// a checkpoint's cut and left resumes it.
  void disconnected(const Node& node, std::uint64_t session) noexcept;

  /// The job's workers as the chief last set them (ChangeWorkers, Restore::workers),
  /// ascending; empty while they are the cluster spec's. A transport lets a worker connect
  /// if it is one of them (a worker joining is, from the moment the chief counted it in).
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept {
    return workers_.admitted();
  }

  /// The most tensor bytes a request can carry now: a push or an initialization has one
  /// value per element held here, a restore one more per optimizer slot, a push its rows
  /// (0 before registration: nothing can carry a tensor yet).
  [[nodiscard]] std::uint64_t max_request_payload() const noexcept {
    return shard_.max_request_payload();
  }

 private:
  // Every handler and helper below is defined in ps/impl/, in the header its section
  // names (included at the end of this one).

  using Clock = Liveness::Clock;

  // ---- answering, refusing, failing: impl/parameter_server_answers.hpp -----------------

  /// Refuses a request: answers the error, counts it, and logs it (at most 20 lines a
  /// second), so that an operator sees what a careless or hostile client tried.
  void reject(Responder& reply, ErrorCode code, const std::string& message);
  /// Refuses with a part's verdict; true if there was one.
  bool refused(Responder& reply, std::optional<ErrorReply>&& refusal);

  /// A handler threw: refuse the request if nothing changed yet, else fail the ps.
  void settle(Responder& reply, ErrorCode code, const char* what,
              std::string_view request) noexcept;

  /// The ps can no longer vouch for its state: it answers everything with `reason` from now.
  void fail(const std::string& reason);
  void fail_quietly(const std::string& reason) noexcept;

  void answer_all_waiting(const ErrorReply& answer);

  /// Checks that a worker's request names the worker that sent it (and a sane index).
  bool is_sender(std::uint32_t worker, const RequestContext& context, Responder& reply,
                 std::string_view what);

  /// `problem` with a request of epoch `epoch`, unless the request is of an earlier epoch
  /// than this ps's: then the epoch's refusal (kFailedPrecondition: start again), since
  /// what it names may have moved with the restore (a membership's change places parts
  /// and rows anew). A read unbound to a step (min_step 0) is not refused for its epoch
  /// alone.
  [[nodiscard]] std::optional<ErrorReply> of_epoch(std::optional<ErrorReply> problem,
                                                   std::uint64_t epoch,
                                                   std::string_view what) const;

  /// True if the ps is ready for `what`; otherwise refuses it.
  bool is_ready(Responder& reply, std::string_view what);

  // ---- Register / Initialize / WaitReady (registration.hpp): impl/parameter_server_state.hpp

  void on(Register& r, const RequestContext&, Responder& reply);

  void on(Initialize& r, const RequestContext& context, Responder& reply);

  void on(WaitReady&, const RequestContext&, Responder& reply);

  void become_ready();

  /// What Register and WaitReady answer: the model, where it lives, the epoch, and the
  /// names of the optimizer's slots and counters.
  PlacementReply placement_reply() const;

  // ---- TakeToken (pacing.hpp): impl/parameter_server_training.hpp --------------------------

  void on(TakeToken& r, const RequestContext& context, Responder& reply);

  /// Asks the sync policy again for every waiting token request (once the workers the
  /// chief set are counted, if their step came). A refusal answers that request; any other
  /// throw fails the ps (the policy may have changed its pacer half way).
  void hand_out_tokens();

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
                   std::uint64_t pushes_paced);

  /// Asks the sync policy about each worker remembered by `pulls_ahead` at the step in
  /// progress.
  void judge_pulls_ahead();

  /// Forgets the workers that pulled ahead of a step that went on without a verdict on them
  /// (held lost here, or a refill step): a push of one that the pacing ps took and this ps
  /// never did counts as taken all the same, so that a checkpoint's cut finds them alike.
  void forget_pulls_ahead();

  /// The sync policy stops waiting for a worker at the step in progress, as `change` (the
  /// pacing call) says: an update that needed only that worker is applied now, and the
  /// tokens and step gates that waited are answered. False when the policy still waits.
  template <class Change>
  bool go_on_without(Change change);

  /// The global step moved: the pulls and pauses waiting for it are answered.
  void release_step_gates();

  // ---- Pull / PullRows (shard.hpp, table_shard.hpp): impl/parameter_server_training.hpp ----

  void on(Pull& r, const RequestContext& context, Responder& reply);

  void on(PullRows& r, const RequestContext& context, Responder& reply);

  /// The rows of `r` at global step `step`, or only Ack when the client wants no rows back
  /// (`PullRows::touch_only`: what the pull does to them is done all the same).
  void answer_rows(const PullRows& r, bool create, std::int64_t step, Responder& reply);

  // ---- Push (update.hpp, push_ledger.hpp): impl/parameter_server_training.hpp -------------

  void on(Push& r, const RequestContext& context, Responder& reply);

  /// Refuses `r` if it is the push of a process lost while writing it, counted when the
  /// process in its place pulled past its step here (PushLedger::count_lost): its bytes
  /// read late from the lost process's connection, or held by a cut meanwhile.
  bool counted_lost(const Push& r, Responder& reply);

  /// Takes a push that passed every check: the sync policy's verdict, then the update
  /// (`largest`: its largest magnitude, +infinity when not known: Update::take). A push a
  /// cut held is checked again here for a lost push counted meanwhile.
  void take(const Push& r, Responder& reply,
            float largest = std::numeric_limits<float>::infinity());

  // ---- ChangeWorkers (pacing.hpp): impl/parameter_server_training.hpp ----------------------

  void on(ChangeWorkers& r, const RequestContext& context, Responder& reply);

  /// Counts the workers the chief set (ChangeWorkers) once this ps reached their step.
  /// Under SyncReplicas that is the boundary of that step on every ps: a push of the step
  /// needs a pull of it, which waits until this ps is there (BoundedStaleness's slowest
  /// clock may reach it on one ps before another, see there). A new worker is heard now
  /// (where workers send heartbeats), so that one that never comes is held lost after the
  /// worker timeout; those gone are forgotten, and their waiting token requests refused.
  /// A throw from the policy fails the ps (it would disagree with the others).
  void count_next_workers();

  // ---- Pause / ReadState / ReadRows / Resume (checkpoint_cut.hpp):
  //      impl/parameter_server_state.hpp

  void on(Pause& r, const RequestContext& context, Responder& reply);

  void pause(std::uint64_t session, Responder& reply);

  void on(ReadState& r, const RequestContext&, Responder& reply);

  /// Takes held pushes toward the pending cut, and answers it once reached; tells the
  /// operator once of a cut that waited kCutPatience for a worker's push.
  void advance_cut();
  static constexpr std::chrono::seconds kCutPatience{2};

  void on(ReadRows& r, const RequestContext& context, Responder& reply);

  void on(Resume& r, const RequestContext& context, Responder& reply);

  /// Ends the pause; with `keep_rows`, the cut's rows stay readable while training goes on.
  void resume(bool keep_rows = false);

  // ---- Restore / RestoreRows (shard.hpp): impl/parameter_server_state.hpp ------------------

  void on(Restore& r, const RequestContext&, Responder& reply);

  void on(RestoreRows& r, const RequestContext&, Responder& reply);

  // ---- Heartbeat / GetStats / Join / Leave / Shape / LostPs (liveness.hpp):
  //      impl/parameter_server_liveness.hpp

  /// A request of worker `worker` after the end (answered with it): heard, or gone for good
  /// with its leaving heartbeat (awaits_workers).
  void heard_after_end(std::uint32_t worker, const Request& request) noexcept;

  void on(Heartbeat& r, const RequestContext& context, Responder& reply);

  void on(Join&, const RequestContext&, Responder& reply);

  void on(Leave&, const RequestContext&, Responder& reply);

  void on(Shape&, const RequestContext&, Responder& reply);

  void on(LostPs&, const RequestContext&, Responder& reply);

  void on(GetStats&, const RequestContext&, Responder& reply);

  /// Hands the counters to the sink of `report_stats` when it is due (or `now`).
  void report(bool now_anyway = false);

  /// A worker held lost was heard from (a heartbeat, a token request): it counts again.
  /// Not while paused for a checkpoint's cut, which must see no pacing change on its own.
  void revive(std::uint32_t worker);

  /// Holds lost every worker heard before and silent for the worker timeout: the sync
  /// policy stops waiting for it, and an update that needed only it is applied now. Not
  /// while paused for a checkpoint's cut, which must see no step complete on its own; a
  /// read of the cut then stops waiting for such a worker's pushes instead. The
  /// same for the chief, which is waited for (`set_chief_wait`), then given up on.
  void check_heartbeats();

  /// Holds the chief lost once silent for the worker timeout, and ends training as aborted
  /// once no chief came back within the chief wait after that; false then.
  bool check_chief(Clock::time_point now);

  /// No chief came back in time: training cannot end, so it ends here as aborted, and
  /// every task hears why.
  void fail_for_chief(Clock::time_point since, Clock::time_point now);

  /// What GetStats and Heartbeat answer.
  StatsReply stats_reply() const;

  /// The sync policy's wait in words, with how long ago each awaited worker was heard:
  /// "step 812: 1 of 2 gradients in, 1 of 2 tokens left; waiting for worker:1 (last heard
  /// 14.2 s ago)".
  std::string describe_wait() const;

  // ---- Shutdown: impl/parameter_server_state.hpp ---------------------------------------------

  void on(Shutdown& r, const RequestContext&, Responder& reply);

  /// A row pull waiting for its step.
  struct RowPull {
    PullRows request;
    bool create;  ///< a worker's: creates, admits and touches rows
  };

  std::uint32_t task_;
  std::string name_;       ///< "ps 3", as log lines and errors name it
  bool changing_ = false;  ///< inside a change that a throw would leave half done
  bool replaced_ = false;  ///< placed anew for another membership, not restored yet
  std::optional<std::uint64_t> restoring_rows_;  ///< a Restore of this epoch awaits its rows
  std::size_t restored_rows_ = 0;                ///< rows of that restore kept so far
  std::optional<ErrorReply> end_;  ///< set once stopped: what every request is answered
  bool restarts_ = false;          ///< stopped by a Shutdown with `restart`
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
  bool serves_without_chief_ = true;                               ///< see set_serves_without_chief
  StepGate<Pull> pulls_;                                           ///< pulls waiting for their step
  StepGate<RowPull> row_pulls_;  ///< row pulls waiting for their step
  Stats stats_;
  std::function<void(const Stats&)> stats_sink_;  ///< report_stats
  std::chrono::milliseconds stats_every_{500};
  Clock::time_point last_report_{};
  LimitedLog rejections_;  ///< logs refused requests, a few a second at most
};

}  // namespace pulley

// The member functions' definitions, by concern.
#include "pulley/ps/impl/parameter_server_answers.hpp"
#include "pulley/ps/impl/parameter_server_liveness.hpp"
#include "pulley/ps/impl/parameter_server_state.hpp"
#include "pulley/ps/impl/parameter_server_training.hpp"
