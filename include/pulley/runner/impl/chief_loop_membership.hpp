// SPDX-License-Identifier: MIT
#pragma once

/// ChiefLoop's handling of the job's shape (declared in runner/chief_loop.hpp, which
/// includes this header at its end): ps tasks and workers that join or leave, ps tasks lost
/// and taken back or gone for good, and the copies of every shard made alike.

#include "pulley/runner/chief_loop.hpp"

namespace pulley::runner_detail {

template <Model M, Transport T, IdSharding I>
bool ChiefLoop<M, T, I>::whole_again(const Error& failure) {
  if (reconnects_ >= kMaxReconnects) {
    throw Error(ErrorCode::kUnavailable,
                "chief: the ps tasks answered again " + std::to_string(reconnects_) +
                    " times since its last checkpoint or evaluation, and its work "
                    "failed after each; last: " +
                    failure.what());
  }
  // Each fault has its own deadline, counted from its first failure.
  detail::Recovery recovery("chief", training_.client);
  const ClientOptions& options = training_.client;
  for (Error last = failure;;) {
    recovery.wait(last);
    // (With copies a ps out of reach is ruled on, and leaves from its copies: take_back.)
    if (options.ps_leave_after.count() > 0 && training_.tcp.replicas == 0 &&
        recovery.waited() >= options.ps_leave_after) {
      const std::uint64_t before = chief_.membership();
      leave_unreachable(chief_, options);
      if (chief_.membership() != before) return false;  // the others take its shard: a rollback
    }
    try {
      (void)chief_.wait_for_step(0);  // a ready ps answers at once, a restarted one refuses
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kFailedPrecondition) return false;
      if (!detail::Recovery::may_recover(e.code())) throw;
      last = e;
      continue;
    }
    ++reconnects_;
    log(LogLevel::kInfo, "chief: every ps answers again and holds the job after " +
                             std::to_string(recovery.tries()) + " tries: training goes on");
    return true;
  }
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::take_joins() {
  take_back();
  align_copies();
  if (joins_ == nullptr) return;
  joins_->set_ps({chief_.members().begin(), chief_.members().end()});
  std::vector<JoinQueue::Asked> workers;
  while (std::optional<JoinQueue::Asked> asked = joins_->take()) {
    if (asked->role == Node::Role::kWorker) {
      workers.push_back(std::move(*asked));
      continue;
    }
    if (asked->leaving) {
      retire(std::move(*asked));
      continue;
    }
    const std::string who = "ps " + std::to_string(asked->task) + " at " + asked->address;
    const std::size_t index = chief_.join_index(asked->address);
    if (asked->task != index) {
      log(LogLevel::kWarning,
          "chief: " + who + " cannot join: the next ps task is ps " + std::to_string(index));
      continue;
    }
    const std::uint64_t before = chief_.membership();
    const auto began = Clock::now();
    try {
      (void)chief_.join(asked->address, id_sharding_);
    } catch (const Error& e) {
      joins_->expect(chief_.ps_addresses());
      // A ps of the job lost on the way: it is rolled back, and the join tried after
      // (thrice at most), unless the new ps was registered and told to end already.
      if (e.code() == ErrorCode::kUnavailable) {
        if (chief_.membership() == before && ++asked->tries < 3)
          joins_->put_back(std::move(*asked));
        throw;
      }
      log(LogLevel::kWarning, std::string("chief: ") + e.what());
      continue;
    }
    joins_->expect(chief_.ps_addresses());
    joins_->set_ps({chief_.members().begin(), chief_.members().end()});
    log(LogLevel::kInfo, "chief: " + who + " joined the job; " + new_shape(began));
  }
  change_workers(workers);
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::take_back() {
  if (Clock::now() < next_take_back_) return;
  const std::vector<std::uint32_t> given_up = chief_.given_up();
  std::erase_if(given_up_since_, [&](const auto& seen) {
    return !std::binary_search(given_up.begin(), given_up.end(), seen.first);
  });
  for (const std::uint32_t ps : given_up) {
    const auto began = Clock::now();
    if (!chief_.take_back(ps, id_sharding_)) {
      // Nobody reads from the process given up there: if it lives on, it starts again.
      if (joins_ != nullptr && chief_.given_up_whole(ps)) joins_->may_restart(ps);
      leave_for_good(ps);
      continue;
    }
    given_up_since_.erase(ps);
    log(LogLevel::kInfo, "chief: ps " + std::to_string(ps) +
                             " was started again and took its shards back (every "
                             "shard has two copies again); " +
                             new_shape(began));
  }
  // Counted from the end: an attempt at a host that does not answer takes attempt_timeout.
  next_take_back_ = Clock::now() + kTakeBackEvery;
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::leave_for_good(std::uint32_t ps) {
  const ClientOptions& options = training_.client;
  if (options.ps_leave_after.count() <= 0) return;
  const auto now = Clock::now();
  const auto seen = given_up_since_.try_emplace(ps, now).first;
  if (now - seen->second < options.ps_leave_after) return;
  const std::string who = "ps " + std::to_string(ps);
  if (chief_.members().size() <= 2) {
    if (told_stays_.insert(ps).second) {
      log(LogLevel::kWarning,
          "chief: " + who + " is still lost, and stays a member of the job: of 2 ps tasks " +
              "with copies, the other serves both shards until a process takes its place");
    }
    return;
  }
  const auto began = Clock::now();
  try {
    chief_.retire(ps, id_sharding_);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnavailable) throw;  // another ps lost on the way: rolled back
    log(LogLevel::kWarning, std::string("chief: ") + e.what());
    seen->second = Clock::now();  // tried again after the grace
    return;
  }
  given_up_since_.erase(ps);
  if (joins_ != nullptr) joins_->set_ps({chief_.members().begin(), chief_.members().end()});
  log(LogLevel::kWarning,
      "chief: " + who + " was lost for " + std::to_string(options.ps_leave_after.count() / 1000) +
          " s or more (--ps-leave-secs): it left the job, and its share moved from its copies "
          "to the other ps tasks (" +
          (chief_.given_up().empty() ? "every shard has two copies again, " : "") +
          "nothing rolled back); " + new_shape(began));
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::align_copies() {
  if constexpr (CopyingTransport<T>) {
    if (training_.tcp.replicas == 0 || Clock::now() < next_lost_look_) return;
    bool all_answered = false;
    std::vector<std::uint32_t> lost = chief_.lost_workers(kLostLookEvery, &all_answered);
    const auto now = Clock::now();
    next_lost_look_ = now + kLostLookEvery;
    if (!all_answered) return;
    if (lost != lost_seen_) {
      lost_seen_ = std::move(lost);
      lost_changed_ = now;
      return;
    }
    if (!lost_changed_ || now - *lost_changed_ < training_.worker_timeout) return;
    if (!chief_.align_copies(id_sharding_)) {
      next_lost_look_ = Clock::now() + kTakeBackEvery;
      return;
    }
    lost_changed_.reset();
    log(LogLevel::kInfo,
        "chief: the workers held lost changed (now " + describe_members(lost_seen_) +
            "): both copies of every shard were made alike from the copy the tasks read (one "
            "may have counted a lost worker's last push that never reached the other); " +
            new_shape(now));
  }
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::retire(JoinQueue::Asked asked) {
  if (!std::binary_search(chief_.members().begin(), chief_.members().end(), asked.task)) {
    joins_->took_out(Node::ps(asked.task));  // out already
    return;
  }
  const std::string who = "ps " + std::to_string(asked.task);
  const auto began = Clock::now();
  try {
    chief_.retire(asked.task, id_sharding_);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnavailable) {
      if (++asked.tries < 3) joins_->put_back(std::move(asked));
      throw;
    }
    joins_->refuse(Node::ps(asked.task), e.message());
    log(LogLevel::kWarning, std::string("chief: ") + e.what());
    return;
  }
  joins_->set_ps({chief_.members().begin(), chief_.members().end()});
  joins_->took_out(Node::ps(asked.task));
  log(LogLevel::kInfo, "chief: " + who + " left the job at its request; " + new_shape(began));
}

template <Model M, Transport T, IdSharding I>
std::string ChiefLoop<M, T, I>::new_shape(Clock::time_point began) {
  const auto paused = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began);
  note_restored(chief_.wait_for_step(0));  // the next checkpoint is a full one
  std::vector<std::uint64_t> bytes = bytes_per_ps(chief_.placement(), chief_.variables());
  bytes.resize(chief_.num_ps(), 0);
  const std::uint64_t most = *std::max_element(bytes.begin(), bytes.end());
  const bool mib = most >= (std::uint64_t{1} << 20U);
  std::string held;
  for (const std::uint32_t ps : chief_.members()) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f",
                  static_cast<double>(bytes[ps]) / (mib ? 1048576.0 : 1024.0));
    held += (held.empty() ? "" : " / ") + std::string(text);
  }
  return "membership " + std::to_string(chief_.membership()) + ": ps tasks " +
         describe_members(chief_.members()) + ", holding " + held + (mib ? " MiB" : " KiB") +
         " of dense values; training stood still " + std::to_string(paused.count()) +
         " ms while the state moved";
}

template <Model M, Transport T, IdSharding I>
bool ChiefLoop<M, T, I>::take_joins_meanwhile() {
  const std::uint64_t membership = chief_.membership();
  take_joins();
  voided_ = chief_.membership() != membership;
  return voided_;
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::change_workers(const std::vector<JoinQueue::Asked>& asking) {
  const std::vector<std::uint32_t> before = joins_->workers();
  std::vector<std::uint32_t> after = before;
  std::string change;
  std::vector<JoinQueue::Asked> changing;  // those that asked and change the workers
  for (const JoinQueue::Asked& asked : asking) {
    const auto at = std::lower_bound(after.begin(), after.end(), asked.task);
    const bool in = at != after.end() && *at == asked.task;
    if (asked.leaving != in) {  // in already, or out already
      if (asked.leaving) joins_->took_out(Node::worker(asked.task));
      continue;
    }
    if (asked.leaving && after.size() == 1) {
      joins_->refuse(Node::worker(asked.task), "worker " + std::to_string(asked.task) +
                                                   " is the job's last worker: it cannot leave");
      continue;
    }
    if (asked.leaving) {
      after.erase(at);
    } else {
      after.insert(at, asked.task);
    }
    change += (change.empty() ? "worker " : ", worker ") + std::to_string(asked.task) +
              (asked.leaving ? " left at its request" : " joined");
    changing.push_back(asked);
  }
  if (const auto patience = training_.client.worker_leave_after; patience.count() > 0) {
    const auto now = Clock::now();
    std::vector<std::uint32_t> lost = chief_.lost_workers();
    std::erase_if(lost,
                  [&](std::uint32_t w) {  // one that asked to join again, or to leave, is not lost
                    return !std::binary_search(before.begin(), before.end(), w) ||
                           std::any_of(changing.begin(), changing.end(),
                                       [w](const JoinQueue::Asked& a) { return a.task == w; });
                  });
    std::erase_if(lost_since_, [&](const auto& entry) {
      return !std::binary_search(lost.begin(), lost.end(), entry.first);
    });
    for (const std::uint32_t w : lost) {
      const auto since = lost_since_.try_emplace(w, now).first->second;
      const auto at = std::lower_bound(after.begin(), after.end(), w);
      if (now - since < patience || at == after.end() || *at != w || after.size() == 1) continue;
      after.erase(at);
      lost_since_.erase(w);
      change +=
          (change.empty() ? "worker " : ", worker ") + std::to_string(w) + " left (held lost for " +
          std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - since).count()) +
          " s)";
    }
  }
  if (after == before) return;
  const auto began = Clock::now();
  std::int64_t from = 0;
  try {
    from = chief_.change_workers(after);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnavailable) {
      for (const JoinQueue::Asked& asked : changing) joins_->put_back(asked);
      throw;
    }
    for (const JoinQueue::Asked& asked : changing)
      joins_->refuse(Node::worker(asked.task), e.message());
    log(LogLevel::kWarning, "chief: the job's workers stay " + describe_members(before) + " (" +
                                change + " refused): " + e.message());
    return;
  }
  joins_->set_workers(after);
  for (const JoinQueue::Asked& asked : changing) {
    if (asked.leaving) joins_->took_out(Node::worker(asked.task));
  }
  const auto paused = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began);
  log(LogLevel::kInfo, "chief: " + change + "; the job's workers are " + describe_members(after) +
                           " from global step " + std::to_string(from) +
                           " on; training stood still " + std::to_string(paused.count()) + " ms");
}

}  // namespace pulley::runner_detail
