// SPDX-License-Identifier: MIT
#pragma once

/// Chief's handling of the job's shape (declared in client/chief.hpp, which includes this
/// header after the class): ps tasks that cannot be reached, leave, join, are taken back or
/// retire (unreachable, leave, join, given_up, take_back, retire), the copies of every shard
/// made alike (align_copies), the job's workers changed or lost (change_workers,
/// lost_workers), where the ps tasks serve (join_index, ps_addresses), and the cut and
/// move of the state that those changes share (paused_cut, move_state, ask_one).

#include "pulley/client/chief.hpp"

namespace pulley {

template <Transport T>
std::vector<std::uint32_t> Chief<T>::unreachable(std::chrono::milliseconds timeout) {
  const auto answers = client_.ask_each(timeout);
  std::vector<std::uint32_t> gone;
  for (std::size_t k = 0; k < answers.size(); ++k) {
    if (!answers[k]) gone.push_back(client_.members()[k]);
  }
  return gone;
}

template <Transport T>
void Chief<T>::leave(std::span<const std::uint32_t> gone) {
  const auto members = client_.members();
  for (const std::uint32_t ps : gone) {
    if (!std::binary_search(members.begin(), members.end(), ps)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ps " + std::to_string(ps) + " is not a member of the job");
    }
  }
  std::vector<std::uint32_t> left;
  std::copy_if(members.begin(), members.end(), std::back_inserter(left), [&](std::uint32_t ps) {
    return std::find(gone.begin(), gone.end(), ps) == gone.end();
  });
  if (left.empty())
    throw Error(ErrorCode::kInvalidArgument, "a job cannot go on without any ps task");
  client_.change_members(std::move(left), client_.membership() + 1);
}

template <Transport T>
template <IdSharding I>
std::uint32_t Chief<T>::join(const std::string& address, const I& sharding) {
  if constexpr (!GrowingTransport<T>) {
    throw Error(ErrorCode::kFailedPrecondition,
                "ps at " + address +
                    " cannot join: this chief's transport cannot reach ps tasks beyond those "
                    "it was made with (not a GrowingTransport)");
  } else {
    if (!client_.has_placement()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "a ps joins a job whose model is registered: initialize first");
    }
    T& transport = client_.transport();
    const std::vector<std::uint32_t> before(client_.members().begin(), client_.members().end());
    const auto task = static_cast<std::uint32_t>(join_index(address));
    if (task == transport.num_ps()) {
      try {
        transport.add_ps(address, true);
      } catch (const Error& e) {  // nothing changed: not a lost ps of the job
        throw Error(ErrorCode::kFailedPrecondition,
                    "ps at " + address + " cannot join: " + e.message());
      }
    }
    unfinished_join_.emplace(task, address);  // until it joined, or was told to end
    const std::string who = "ps " + std::to_string(task) + " at " + address;
    const auto refuse = [&](const std::string& why) {  // the new ps ends, saying why
      unfinished_join_.reset();
      (void)ask_one(task, Shutdown{true, who + " could not join the job: " + why},
                    std::chrono::seconds(2));
      return Error(ErrorCode::kFailedPrecondition,
                   who + " cannot join: " + why + "; the job goes on as it was");
    };
    {
      const Response answer = ask_one(task, GetStats{}, timeouts().request_timeout);
      const auto* stats = std::get_if<StatsReply>(&answer);
      if (const auto* error = std::get_if<ErrorReply>(&answer))
        throw refuse("it answered: " + error->message);
      if (stats == nullptr) throw refuse("it answered GetStats with something else");
      if (stats->ready || !stats->members.empty())
        throw refuse("it holds a model already (another job's?)");
    }
    std::vector<std::string> addresses;
    for (std::uint32_t ps = 0; ps <= task; ++ps) addresses.push_back(transport.address(ps));
    std::vector<std::uint32_t> members = before;
    members.push_back(task);
    std::optional<ModelState> cut;
    try {
      cut = read_state(client_, 0, {}, true);  // the ps tasks stay paused (resumed if it throws)
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) throw;  // a ps of the job lost: tried again after
      throw refuse(std::string("the cut failed: ") + e.message());
    }
    std::optional<Error> failed;
    try {
      failed = move_state(*cut, std::move(members), before, addresses, sharding);
    } catch (const Error& e) {
      (void)refuse(e.message());
      throw Error(ErrorCode::kUnavailable, who + " was registered: " + e.message());
    }
    if (failed) throw refuse(failed->message());
    unfinished_join_.reset();
    return task;
  }
}

template <Transport T>
std::vector<std::uint32_t> Chief<T>::given_up() const {
  if constexpr (CopyingTransport<T>) {
    std::vector<std::uint32_t> members;
    for (const std::uint32_t ps : client_.transport().given_up()) {
      if (std::binary_search(client_.members().begin(), client_.members().end(), ps))
        members.push_back(ps);
    }
    return members;
  } else {
    return {};
  }
}

template <Transport T>
bool Chief<T>::given_up_whole(std::uint32_t ps) const {
  if constexpr (requires(const T& t) {
                  { t.given_up_whole(std::uint32_t{}) } -> std::convertible_to<bool>;
                }) {
    return client_.transport().given_up_whole(ps);
  } else {
    (void)ps;
    return false;
  }
}

template <Transport T>
template <IdSharding I>
bool Chief<T>::take_back(std::uint32_t ps, const I& sharding) {
  if constexpr (!CopyingTransport<T>) {
    (void)ps;
    (void)sharding;
    return false;
  } else {
    T& transport = client_.transport();
    if (!transport.reach_again(ps, false, true)) return false;
    const std::string who = "ps " + std::to_string(ps);
    const std::vector<std::uint32_t> members(client_.members().begin(), client_.members().end());
    const std::optional<ModelState> cut = paused_cut(who + " cannot take its shards back yet");
    if (!cut) return false;
    transport.serve_again(ps);
    const std::optional<Error> failed =
        move_state(*cut, members, members, {}, sharding, [&](const Error& e) {
          transport.give_up(ps, std::string("taking it back failed: ") + e.message());
        });
    const std::vector<std::uint32_t> still = transport.given_up();
    if (!failed && !std::binary_search(still.begin(), still.end(), ps)) return true;
    // A copy it holds was given up again on the way (lost, or not ready in time): the
    // restore went to the other copies alone.
    log(LogLevel::kWarning,
        "chief: " + who + " could not take its shards back (" +
            (failed ? std::string(failed->message()) : "a copy it holds was given up on the way") +
            "): they stay served by one copy each");
    return false;
  }
}

template <Transport T>
template <IdSharding I>
bool Chief<T>::align_copies(const I& sharding) {
  if constexpr (!CopyingTransport<T>) {
    (void)sharding;
    return false;
  } else {
    const std::vector<std::uint32_t> members(client_.members().begin(), client_.members().end());
    const std::optional<ModelState> cut = paused_cut("cannot make the copies of every shard alike");
    if (!cut) return false;
    if (const std::optional<Error> failed = move_state(*cut, members, members, {}, sharding)) {
      log(LogLevel::kWarning,
          std::string("chief: could not make the copies of every shard alike: ") +
              failed->message());
      return false;
    }
    return true;
  }
}

template <Transport T>
template <IdSharding I>
void Chief<T>::retire(std::uint32_t ps, const I& sharding) {
  const std::vector<std::uint32_t> before(client_.members().begin(), client_.members().end());
  if (!std::binary_search(before.begin(), before.end(), ps)) {
    throw Error(ErrorCode::kInvalidArgument,
                "ps " + std::to_string(ps) + " is not a member of the job");
  }
  const std::string who = "ps " + std::to_string(ps);
  if (before.size() == 1)
    throw Error(ErrorCode::kFailedPrecondition,
                who + " is the job's last ps task: it cannot leave");
  std::vector<std::uint32_t> after;
  std::copy_if(before.begin(), before.end(), std::back_inserter(after),
               [ps](std::uint32_t m) { return m != ps; });
  if constexpr (!ElasticIdSharding<I>) {
    if (!client_.tables().empty() && !first_tasks(after)) {
      throw Error(
          ErrorCode::kFailedPrecondition,
          who +
              " cannot leave: the tables' IdSharding places rows over ps tasks 0 .. n-1 only (an "
              "ElasticIdSharding, HashIds or RangeIds, can place them over the others)");
    }
  }
  const ModelState cut =
      read_state(client_, 0, {}, true);  // the ps tasks stay paused (resumed if it throws)
  std::optional<Error> failed;
  try {
    failed = move_state(cut, std::move(after), before, {}, sharding);
  } catch (const Error& e) {
    throw Error(ErrorCode::kUnavailable, who + " could not leave: " + e.message());
  }
  if (failed) {
    throw Error(ErrorCode::kFailedPrecondition,
                who + " cannot leave: " + failed->message() + "; the job goes on as it was");
  }
}

template <Transport T>
std::int64_t Chief<T>::change_workers(std::vector<std::uint32_t> workers) {
  require_task_set(workers, "worker");
  const std::span<const std::uint32_t> members = client_.members();
  std::int64_t furthest = 0;
  try {
    const auto paused = client_.template broadcast<PauseReply>(
        [](std::size_t) { return Pause{0}; }, timeouts().request_timeout, "pause the ps tasks");
    for (const PauseReply& p : paused)
      furthest = std::max({furthest, p.global_step, p.furthest_pushed});
    const std::int64_t from = furthest + 1;
    const std::vector<std::uint32_t> before(client_.workers().begin(), client_.workers().end());
    // Each ps is asked alone: every answer is looked at. One that refused is told to take
    // the change back too: with no answer in time it may have taken it (the change is
    // given up as a lost ps's would be, and tried again), and with copies one copy may
    // have taken what the other refused. Taking back a change never taken changes nothing.
    std::vector<std::uint32_t> took;
    std::optional<Error> refused;
    for (const std::uint32_t ps : members) {
      const Response answer =
          ask_one(ps, ChangeWorkers{workers, from, before}, timeouts().request_timeout);
      took.push_back(ps);
      if (std::holds_alternative<Ack>(answer)) continue;
      const auto* error = std::get_if<ErrorReply>(&answer);
      const ErrorCode code = error != nullptr ? error->code : ErrorCode::kInternal;
      refused.emplace(
          code == ErrorCode::kDeadlineExceeded ? ErrorCode::kUnavailable : code,
          "ps " + std::to_string(ps) + " cannot count the workers " + describe_members(workers) +
              ": " +
              (error != nullptr ? error->message : std::string("it answered something else")));
      break;
    }
    if (refused) {  // those that took it take it back, before anyone trains on
      for (const std::uint32_t ps : took) {
        if (!std::holds_alternative<Ack>(
                ask_one(ps, ChangeWorkers{{}, from}, timeouts().request_timeout))) {
          throw Error(ErrorCode::kUnavailable,
                      std::string(refused->message()) + "; and ps " + std::to_string(ps) +
                          ", which took the change, could not be told to take it back");
        }
      }
      throw *refused;
    }
    client_.template broadcast<Ack>([](std::size_t) { return Resume{}; },
                                    timeouts().request_timeout, "resume the ps tasks");
    client_.set_workers(std::move(workers));
    return from;
  } catch (const Error&) {
    resume_all();  // a ps that is gone resumes when the chief's link closes
    throw;
  }
}

template <Transport T>
std::vector<std::uint32_t> Chief<T>::lost_workers(std::chrono::milliseconds timeout,
                                                  bool* all_answered) {
  std::vector<std::uint32_t> lost;
  bool all = true;
  for (const std::optional<StatsReply>& r :
       client_.ask_each(std::min(timeouts().request_timeout, timeout))) {
    if (r) {
      lost.insert(lost.end(), r->lost.begin(), r->lost.end());
    } else {
      all = false;
    }
  }
  if (all_answered != nullptr) *all_answered = all;
  std::sort(lost.begin(), lost.end());
  lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
  return lost;
}

template <Transport T>
std::size_t Chief<T>::join_index(const std::string& address) const {
  if (unfinished_join_ && unfinished_join_->second == address) return unfinished_join_->first;
  return client_.num_ps();
}

template <Transport T>
std::vector<std::string> Chief<T>::ps_addresses() const {
  std::vector<std::string> addresses;
  for (std::size_t ps = 0; ps < client_.num_ps(); ++ps)
    addresses.push_back(client_.transport().address(ps));
  return addresses;
}

template <Transport T>
std::optional<ModelState> Chief<T>::paused_cut(const std::string& what) {
  try {
    return read_state(client_, 0, {}, true);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnavailable) throw;
    log(LogLevel::kWarning, "chief: " + what + ", the cut failed: " + e.message());
    return std::nullopt;
  }
}

template <Transport T>
template <IdSharding I, class Undo>
std::optional<Error> Chief<T>::move_state(const ModelState& cut, std::vector<std::uint32_t> members,
                                          const std::vector<std::uint32_t>& before,
                                          const std::vector<std::string>& addresses,
                                          const I& sharding, Undo undo) {
  try {
    client_.change_members(std::move(members), client_.membership() + 1, addresses);
  } catch (const Error& e) {
    undo(e);
    resume_all();
    return e;
  }
  try {
    restore_state(client_, cut, seed_, sharding);
    return std::nullopt;
  } catch (const Error& e) {
    undo(e);
    try {
      client_.adopt_epoch(client_.epoch() + 1);
      client_.change_members(before, client_.membership() + 1, addresses);
      restore_state(client_, cut, seed_, sharding);
    } catch (const Error& again) {
      throw Error(ErrorCode::kUnavailable,
                  "its restore failed (" + std::string(e.message()) +
                      "), and so did restoring the ps tasks before: " + again.message());
    }
    return e;
  }
}

template <Transport T>
Response Chief<T>::ask_one(std::uint32_t ps, Request request, std::chrono::milliseconds timeout) {
  PendingCall call = client_.transport().call(ps, std::move(request), {});
  if (call.wait_until(std::chrono::steady_clock::now() + timeout)) return call.take();
  call.cancel();
  return ErrorReply{ErrorCode::kDeadlineExceeded,
                    "no answer within " + std::to_string(timeout.count()) + " ms"};
}

}  // namespace pulley
