// SPDX-License-Identifier: MIT
#pragma once

/// ParameterServer's tasks heard and lost (declared in ps/parameter_server.hpp, which
/// includes this header after the class): connections that close, heartbeats and the
/// chief's silence, the membership requests a ps only refuses, and the counters
/// (GetStats).

#include "pulley/ps/parameter_server.hpp"

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::disconnected(const Node& node, std::uint64_t session) noexcept {
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
      log(LogLevel::kWarning,
          name_ + ": the chief left while it read a checkpoint's rows: the cut ends");
      changing_ = true;
      shard_.tables().end_cut();
      rows_cut_session_ = 0;
    } else if (node.role == Node::Role::kWorker) {
      const std::string gone = name_ + ": " + node.name() + " disconnected";
      const std::string before = pacing_.waiting_for();
      changing_ = true;
      if (pacing_.disconnected(node.index, session, gone)) {
        if (pacing_.waiting_for() != before) {
          log(LogLevel::kInfo,
              gone + " holding its token: given back (" + pacing_.waiting_for() + ")");
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::heard_after_end(std::uint32_t worker,
                                                  const Request& request) noexcept {
  const auto* beat = std::get_if<Heartbeat>(&request);
  if (beat != nullptr && beat->leaving) {
    liveness_.leave(worker);  // (a find and an erase: nothing allocates)
  } else {
    liveness_.touch(worker, Clock::now());
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Heartbeat& r, const RequestContext& context,
                                     Responder& reply) {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Join&, const RequestContext&, Responder& reply) {
  reject(
      reply, ErrorCode::kInvalidArgument,
      name_ +
          " is a ps task: a new ps or worker asks the chief to join (the chief's address, --join)");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Leave&, const RequestContext&, Responder& reply) {
  reject(reply, ErrorCode::kInvalidArgument,
         name_ + " is a ps task: a task asks the chief to leave the job");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(Shape&, const RequestContext&, Responder& reply) {
  reject(reply, ErrorCode::kInvalidArgument,
         name_ + " is a ps task: a task asks the chief for the job's shape");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(LostPs&, const RequestContext&, Responder& reply) {
  reject(reply, ErrorCode::kInvalidArgument,
         name_ + " is a ps task: a task asks the chief whether a ps is lost");
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::on(GetStats&, const RequestContext&, Responder& reply) {
  report();
  check_heartbeats();
  respond(reply, stats_reply());
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::report(bool now_anyway) {
  if (!stats_sink_) return;
  const auto now = Clock::now();
  if (!now_anyway && now - last_report_ < stats_every_) return;
  last_report_ = now;
  stats_sink_(stats());
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::revive(std::uint32_t worker) {
  if (!liveness_.is_lost(worker) || !registration_.ready() || cut_.paused()) return;
  changing_ = true;  // a throw from the policy leaves its pacer half changed
  pacing_.back(worker);
  liveness_.back(worker, Clock::now());
  ++stats_.workers_returned;
  changing_ = false;
  log(LogLevel::kInfo, name_ + ": " + Node::worker(worker).name() + " is back; " + describe_wait());
  hand_out_tokens();
  judge_pulls_ahead();
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::check_heartbeats() {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::check_chief(Clock::time_point now) {
  liveness_.expire_chief(now, [&](Clock::time_point last) {
    log(LogLevel::kWarning,
        name_ + ": the chief is lost (last heard " + Liveness::seconds_between(last, now) +
            " s ago): the model is kept and " +
            (serves_without_chief_ ? "the workers go on" : "no task is served meanwhile") +
            "; waiting up to " + std::to_string(chief_wait_.count() / 1000) +
            " s for a chief to come back");
  });
  if (const auto since = liveness_.chief_lost_since();
      since && now - *since >= chief_wait_ + liveness_.timeout()) {
    fail_for_chief(*since, now);
    return false;
  }
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::fail_for_chief(Clock::time_point since, Clock::time_point now) {
  end_ =
      ErrorReply{ErrorCode::kAborted,
                 name_ + ": the chief was lost " + Liveness::seconds_between(since, now) +
                     " s ago and no chief came back (--recovery-timeout-ms): training cannot end; "
                     "restart the job (it resumes from its newest checkpoint)"};
  log(LogLevel::kError, end_->message);
  answer_all_waiting(*end_);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
StatsReply ParameterServer<S, O, P, T>::stats_reply() const {
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

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
std::string ParameterServer<S, O, P, T>::describe_wait() const {
  std::string text = pacing_.waiting_for();
  const std::string workers = liveness_.describe(pacing_.awaited(), Clock::now());
  if (workers.empty()) return text;
  return text + (text.empty() ? "waiting for " : "; waiting for ") + workers;
}

}  // namespace pulley
