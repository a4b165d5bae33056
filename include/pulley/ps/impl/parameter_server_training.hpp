// SPDX-License-Identifier: MIT
#pragma once

/// ParameterServer's training path (declared in ps/parameter_server.hpp, which includes
/// this header after the class): tokens (TakeToken, pacing.hpp), pulls (Pull, PullRows),
/// pushes (Push: update.hpp, push_ledger.hpp) and the workers the chief sets
/// (ChangeWorkers).

#include "pulley/ps/parameter_server.hpp"

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(TakeToken& r, const RequestContext& context,
                                     Responder& reply) {
  if (!is_ready(reply, "token requested") || !is_sender(r.worker, context, reply, "TakeToken") ||
      refused(reply, registration_.check_epoch(r.epoch, "token request"))) {
    return;
  }
  if (!workers_.counted(r.worker))
    return reject(reply, ErrorCode::kPermissionDenied, workers_.left_message(r.worker));
  revive(r.worker);  // before its heartbeat, maybe: it starts from the step in progress
  pacing_.wait_for_token(r.worker, context.session, reply, ledger_);
  hand_out_tokens();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::hand_out_tokens() {
  count_next_workers();
  const bool changing = std::exchange(changing_, true);
  pacing_.hand_out(ledger_, [this](Responder& reply, ErrorCode code, const std::string& message) {
    reject(reply, code, message);
  });
  changing_ = changing;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::pulls_ahead(const RequestContext& context, std::int64_t min_step,
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::judge_pulls_ahead() {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::forget_pulls_ahead() {
  for (const Ahead& a : ahead_) {
    if (a.lost_here) ledger_.count_lost(a.worker, ahead_step_);
  }
  ahead_.clear();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
template <class Change>
bool ParameterServer<S, O, P, T>::go_on_without(Change change) {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::release_step_gates() {
  const std::int64_t step = pacing_.global_step();
  pulls_.release(step, [&](Pull& pull, Responder& reply) {
    respond(reply, shard_.read(pull.slices, step, stats_));
  });
  row_pulls_.release(step, [&](RowPull& pull, Responder& reply) {
    // A row pull that cannot be answered (no memory for its rows) is refused alone: it is
    // answered inside the push that completed the step, which must not fail the ps.
    try {
      answer_rows(pull.request, pull.create, step, reply);
    } catch (const std::exception& e) {
      if (reply)
        reject(reply, ErrorCode::kResourceExhausted, std::string("PullRows refused: ") + e.what());
    }
  });
  cut_.release_pauses(step,
                      [&](std::uint64_t session, Responder& reply) { pause(session, reply); });
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Pull& r, const RequestContext& context, Responder& reply) {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(PullRows& r, const RequestContext& context, Responder& reply) {
  if (!is_ready(reply, "row pull") ||
      (r.min_step > 0 && refused(reply, registration_.check_epoch(r.epoch, "row pull"))) ||
      refused(reply, of_epoch(shard_.tables().check(r.tables, false, context.tensors_finite),
                              r.epoch, "row pull"))) {
    return;
  }
  // Only a worker's pull creates, admits and touches rows: the chief and evaluators read.
  const bool create = !context.peer || context.peer->role == Node::Role::kWorker;
  pulls_ahead(context, r.min_step, r.pushes_paced);
  const std::int64_t step = pacing_.global_step();
  if (step < r.min_step) return row_pulls_.park(r.min_step, RowPull{std::move(r), create}, reply);
  answer_rows(r, create, step, reply);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::answer_rows(const PullRows& r, bool create, std::int64_t step,
                                              Responder& reply) {
  RowsReply rows = shard_.tables().pull(r, create, step, stats_);
  if (r.touch_only) return respond(reply, Ack{});
  respond(reply, std::move(rows));
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Push& r, const RequestContext& context, Responder& reply) {
  if (!registration_.ready()) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "push before initialization: the chief has not initialized the variables");
  }
  // The epoch first: a push of the shape before a restore (another membership's parts and
  // rows) is refused as late, to be started again, not as malformed.
  if (!is_sender(r.worker, context, reply, "Push") ||
      refused(reply, registration_.check_epoch(r.epoch, "push")) ||
      refused(reply, shard_.check(r.gradients, context.tensors_finite)) ||
      refused(reply, shard_.tables().check(r.rows, true, context.tensors_finite))) {
    return;
  }
  if (r.gradients.size() != shard_.parts().size()) {
    // Every part must see every push's verdict, or parts drift apart.
    return reject(reply, ErrorCode::kInvalidArgument,
                  "a push must carry a gradient for each of the " +
                      std::to_string(shard_.parts().size()) + " parts held here, got " +
                      std::to_string(r.gradients.size()));
  }
  if (const PushLedger::Answer* answer = ledger_.repeated(r.worker, r.sequence, r.series)) {
    ++stats_.pushes_repeated;  // sent again after a lost connection: answered, counted once
    if (!answer->refused.empty())
      return reject(reply, ErrorCode::kInvalidArgument, answer->refused);
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
    return reject(
        reply, ErrorCode::kAborted,
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
  take(r, reply,
       context.tensors_finite ? context.tensors_largest : std::numeric_limits<float>::infinity());
  judge_pulls_ahead();  // (the push may have said whether the step is a refill step)
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::counted_lost(const Push& r, Responder& reply) {
  if (!ledger_.counted_lost(r.worker, r.local_step)) return false;
  ++stats_.pushes_repeated;
  reject(reply, ErrorCode::kAborted,
         "push of step " + std::to_string(r.local_step) + " of worker " + std::to_string(r.worker) +
             " came after the process in its place pulled past that step here, which "
             "counted it then as a push lost with its process: a late copy, not counted again");
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::take(const Push& r, Responder& reply, float largest) {
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
  const auto outcome =
      update_.take(shard_, pacing_.policy(), r, verdict, step_before, stats_, largest);
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(ChangeWorkers& r, const RequestContext& context,
                                     Responder& reply) {
  if (!is_ready(reply, "change the workers")) return;
  if (!cut_.paused_by(context.session)) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  "ChangeWorkers without Pause (of this connection)");
  }
  if (r.workers.empty()) {  // the chief takes back the change of that step (another ps refused it)
    workers_.take_back(r.from_step);
    return respond(reply, Ack{});
  }
  if (std::string why = JobWorkers::check(r.workers);
      !why.empty() || (!r.before.empty() && !(why = JobWorkers::check(r.before)).empty())) {
    return reject(reply, ErrorCode::kInvalidArgument, "ChangeWorkers: " + why);
  }
  if constexpr (!kReshapes<P>) {
    return reject(
        reply, ErrorCode::kFailedPrecondition,
        name_ +
            ": its sync policy cannot count workers that join or leave (no SyncPolicy::reshape)");
  }
  if (r.from_step <= pacing_.global_step()) {
    return reject(reply, ErrorCode::kFailedPrecondition,
                  name_ + " is at global step " + std::to_string(pacing_.global_step()) +
                      " already: the workers change at a step to come, not " +
                      std::to_string(r.from_step));
  }
  workers_.change_at(std::move(r.workers), r.from_step, std::move(r.before));
  respond(reply, Ack{});
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::count_next_workers() {
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
  log(LogLevel::kInfo, name_ + ": the job's workers are " + describe_members(after) +
                           " from global step " + std::to_string(pacing_.global_step()) + " on");
}

}  // namespace pulley
