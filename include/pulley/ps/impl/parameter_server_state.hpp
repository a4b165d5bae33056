// SPDX-License-Identifier: MIT
#pragma once

/// ParameterServer's state as it is set, cut and moved (declared in
/// ps/parameter_server.hpp, which includes this header after the class): registration
/// (Register, Initialize, WaitReady), a checkpoint's cut (Pause, ReadState, ReadRows,
/// Resume), a restore (Restore, RestoreRows) and the end (Shutdown).

#include "pulley/ps/parameter_server.hpp"

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Register& r, const RequestContext&, Responder& reply) {
  const bool again = shard_.assigned();
  if (again) {
    if (!shard_.holds(r))
      return reject(reply, ErrorCode::kAlreadyExists, "a different model is already registered");
    if (r.membership == registration_.membership() &&
        registration_.members_of(r) == registration_.members()) {
      return respond(reply, placement_reply());
    }
    if (r.membership <= registration_.membership()) {
      return reject(reply, ErrorCode::kFailedPrecondition,
                    name_ + " holds the job at membership " +
                        std::to_string(registration_.membership()) + ": membership " +
                        std::to_string(r.membership) + " is not newer");
    }
  }
  Placement placement;
  if (refused(reply, registration_.check(r, TablePolicy<T>, placement))) return;
  const std::vector<std::uint32_t> members = registration_.members_of(r);
  if constexpr (TablePolicy<T>) {
    if (!r.tables.empty() && !first_tasks(members) && !ElasticIdSharding<typename T::Sharding>) {
      return reject(
          reply, ErrorCode::kFailedPrecondition,
          "the tables' IdSharding places rows over ps tasks 0 .. n-1 only: a job without ps " +
              std::string("task(s) of its cluster needs an ElasticIdSharding (HashIds, RangeIds)"));
    }
  }
  const std::uint64_t bytes_before = shard_.held_bytes();
  const std::uint64_t membership = r.membership;
  std::vector<std::string> addresses = r.ps_addresses;
  shard_.assign(std::move(r), std::move(placement), members,
                pacing_.policy());  // a throw changes nothing
  registration_.registered(members, membership, std::move(addresses));
  if (again) {
    // The ps tasks changed: what this ps held is placed anew and comes back with the
    // Restore that follows; what waited belongs to the shape before.
    const ErrorReply gone{ErrorCode::kFailedPrecondition,
                          name_ + ": the job's ps tasks changed (membership " +
                              std::to_string(membership) +
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
    log(LogLevel::kInfo, name_ + ": the job's ps tasks are now " + describe_members(members) +
                             " (membership " + std::to_string(registration_.membership()) +
                             "): holds " + std::to_string(shard_.held_bytes()) +
                             " bytes of dense parts' values, " + std::to_string(bytes_before) +
                             " before; waits for its restore");
  }
  respond(reply, placement_reply());
  if (!again && shard_.initialized()) become_ready();  // no part is held here
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Initialize& r, const RequestContext& context,
                                     Responder& reply) {
  if (!shard_.assigned()) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "initialize before the model is registered");
  }
  if (refused(reply, shard_.check(r.parts, context.tensors_finite)) ||
      refused(reply, shard_.check_fresh(r.parts))) {
    return;
  }
  shard_.initialize(r.parts);
  if (r.hold) cut_.pause(context.session);  // before any worker can see it ready
  respond(reply, Ack{});
  if (shard_.initialized() && !registration_.ready() && !restoring_rows_) become_ready();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(WaitReady&, const RequestContext&, Responder& reply) {
  if (registration_.ready()) return respond(reply, placement_reply());
  registration_.wait_ready(reply);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::become_ready() {
  registration_.become_ready([this] { return placement_reply(); });
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
PlacementReply ParameterServer<S, O, P, T>::placement_reply() const {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Pause& r, const RequestContext& context, Responder& reply) {
  if (!is_ready(reply, "pause")) return;
  if (pacing_.global_step() < r.at_step) return cut_.park_pause(r.at_step, context.session, reply);
  pause(context.session, reply);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::pause(std::uint64_t session, Responder& reply) {
  rows_cut_session_ = 0;  // a new cut: what an earlier one kept readable goes with its ReadState
  PauseReply answer{pacing_.global_step(),
                    registration_.epoch(),
                    ledger_.taken(),
                    {},
                    {},
                    checkpoints_whole_state_v<O>,
                    shard_.tables().evictions_since(),
                    ledger_.furthest()};
  ledger_.last_pushes(answer.last_sequences, answer.last_series);
  shard_.state_names(answer.slot_names, answer.counter_names);
  cut_.pause(session);
  respond(reply, std::move(answer));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(ReadState& r, const RequestContext&, Responder& reply) {
  if (!cut_.paused())
    return reject(reply, ErrorCode::kFailedPrecondition, "ReadState without Pause");
  const std::vector<std::uint64_t> furthest = r.until;
  r.until = CheckpointCut::own_until(ledger_, r);
  if (const auto worker = CheckpointCut::past(ledger_, r.until)) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "ReadState: this ps has taken more pushes of worker " + std::to_string(*worker) +
                      " than the cut");
  }
  for (std::uint32_t w = 0; w < r.until.size(); ++w) {
    if (r.until[w] >= furthest[w] || r.until[w] != ledger_.taken(w)) continue;
    log(LogLevel::kInfo,
        name_ + ": the cut holds " + Node::worker(w).name() + " at the " +
            std::to_string(r.until[w]) + " pushes taken here, " +
            std::to_string(furthest[w] - r.until[w]) +
            " fewer than the furthest ps (or this shard's other copy): its last push here is "
            "the furthest's last, and what this ps lacks was lost with an earlier process of "
            "that worker");
  }
  shard_.tables().end_cut();  // a cut read before is given up
  rows_cut_session_ = 0;
  cut_since_ = r.since;
  cut_forget_before_ = r.forget_evictions_before;
  cut_.read_at(std::move(r.until), reply);
  advance_cut();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::advance_cut() {
  const auto now = Clock::now();
  const auto awaited = [this, now](std::uint32_t w) {
    return workers_.counted(w) && !liveness_.is_lost(w) && !liveness_.silent(w, now);
  };
  cut_.advance(
      ledger_, [this](const Push& push, Responder& reply) { take(push, reply); },
      [this] {
        // The rows at the cut, read next (ReadRows).
        shard_.tables().mark_cut(cut_since_, cut_forget_before_);
        return StateReply{pacing_.global_step(), pacing_.save(), shard_.read_state()};
      },
      awaited);
  if (const auto waits = cut_.overdue(ledger_, now, kCutPatience, awaited)) {
    log(LogLevel::kInfo,
        name_ + ": the chief's cut has waited over " +
            std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kCutPatience).count()) +
            " s for a push of " + Node::worker(waits->first).name() + " (taken here " +
            std::to_string(ledger_.taken(waits->first)) + " of the cut's " +
            std::to_string(waits->second) +
            "): it is on its way, or the worker is held lost after the worker timeout and the "
            "cut goes on without it");
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(ReadRows& r, const RequestContext& context, Responder& reply) {
  if (!cut_.paused_by(context.session) &&
      (rows_cut_session_ != context.session || rows_cut_session_ == 0)) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "ReadRows without Pause (of this connection)");
  }
  if (refused(reply, shard_.tables().check(r))) return;
  respond(reply, shard_.tables().read(r));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Resume& r, const RequestContext& context, Responder& reply) {
  if (r.keep_rows && cut_.paused_by(context.session) && shard_.tables().cut_marked()) {
    rows_cut_session_ = context.session;
  }
  resume(r.keep_rows);
  respond(reply, Ack{});
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::resume(bool keep_rows) {
  if (!keep_rows) {
    shard_.tables().end_cut();
    rows_cut_session_ = 0;
  }
  cut_.resume([this](const Push& push, Responder& reply) { take(push, reply); });
  judge_pulls_ahead();  // once every push the cut held was taken: a held push is a push
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Restore& r, const RequestContext&, Responder& reply) {
  if (!shard_.assigned())
    return reject(reply, ErrorCode::kFailedPrecondition, "restore before the model is registered");
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
  if (kReshapes<P> && !counting.empty())
    pacing_.reshape(pacer, counting);      // a pulley::Error refuses it
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
    log(LogLevel::kWarning,
        name_ +
            ": the restore holds no rows of the embedding tables: their rows start "
            "again from their initial values");
  }
  update_.clear();
  ledger_.clear();
  ahead_.clear();
  // What waited belongs to the time before: its clients start their step again.
  const ErrorReply gone{
      ErrorCode::kFailedPrecondition,
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
                           " (restore epoch " + std::to_string(registration_.epoch()) + ")" +
                           undone);
  respond(reply, Ack{});
  changing_ = false;
  restoring_rows_ = r.tables_follow ? std::optional(r.epoch) : std::nullopt;
  if (restoring_rows_) {
    registration_.unready();  // until the rows are in (RestoreRows with done)
  } else if (!registration_.ready()) {
    become_ready();
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(RestoreRows& r, const RequestContext&, Responder& reply) {
  if (restoring_rows_ != r.epoch) {
    return reject(
        reply, ErrorCode::kFailedPrecondition,
        "RestoreRows without a Restore of epoch " + std::to_string(r.epoch) + " that awaits rows");
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Shutdown& r, const RequestContext&, Responder& reply) {
  report(true);  // the figures end where training did
  const std::string ps = name_;
  restarts_ = r.restart;
  end_ = r.restart ? ErrorReply{ErrorCode::kUnavailable,
                                ps + ": the job gave this process up and went on without it: it "
                                     "starts again empty, to be taken back by the chief"}
         : r.aborted
             ? ErrorReply{ErrorCode::kAborted, ps + ": training aborted by the chief: " + r.reason}
             : ErrorReply{
                   ErrorCode::kOutOfRange,
                   ps + ": training finished (the chief shut the ps tasks down at global step " +
                       std::to_string(pacing_.global_step()) + ")"};
  answer_all_waiting(*end_);
  respond(reply, Ack{});
}

}  // namespace pulley
