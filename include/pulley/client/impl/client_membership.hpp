// SPDX-License-Identifier: MIT
#pragma once

/// Client's view of the job's ps tasks (declared in client/client.hpp, which includes this
/// header after the class): the members the chief sets or a ps names, asking each ps
/// which members the job has, telling the ps tasks outside it, and the copies placed or
/// renewed when the members change.

#include "pulley/client/client.hpp"

namespace pulley {

template <Transport T>
void Client<T>::change_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                               std::vector<std::string> ps_addresses) {
  if (membership <= membership_) {
    throw Error(ErrorCode::kInvalidArgument, "membership " + std::to_string(membership) +
                                                 " is not newer than " +
                                                 std::to_string(membership_));
  }
  set_members(std::move(members), membership, std::move(ps_addresses), ErrorCode::kInvalidArgument);
}

template <Transport T>
bool Client<T>::learn_membership() {
  std::optional<StatsReply> newest;
  bool heard = false;
  // A few seconds: the ps tasks that answer do so at once; one that is gone may never.
  for (std::optional<StatsReply>& reply :
       ask_each(std::min(options_.request_timeout, kAskPatience))) {
    heard = heard || reply.has_value();
    if (!reply || reply->members.empty()) continue;
    if (!newest || reply->membership > newest->membership) newest = std::move(reply);
  }
  const bool first_look = !membership_heard_;
  membership_heard_ = membership_heard_ || heard;
  if (!newest || newest->membership <= membership_) return false;
  take_membership(std::move(newest->members), newest->membership, std::move(newest->ps_addresses),
                  first_look);
  return true;
}

template <Transport T>
void Client<T>::tell_others(const Request& request, std::chrono::milliseconds timeout) noexcept {
  try {
    std::vector<PendingCall> calls;
    for (std::uint32_t ps = 0; ps < num_ps(); ++ps) {
      if (!std::binary_search(members_.begin(), members_.end(), ps))
        calls.push_back(transport_.call(ps, Request(request), {}));
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (PendingCall& call : calls) {
      if (!call.wait_until(deadline)) call.cancel();
    }
  } catch (...) {  // no memory, a transport that throws: it was a courtesy
  }
}

template <Transport T>
std::vector<std::optional<StatsReply>> Client<T>::ask_each(std::chrono::milliseconds timeout) {
  std::vector<PendingCall> calls;
  for (const std::uint32_t ps : members_) calls.push_back(transport_.call(ps, GetStats{}, {}));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::optional<StatsReply>> answers(calls.size());
  for (std::size_t k = 0; k < calls.size(); ++k) {
    if (!calls[k].wait_until(deadline)) {
      calls[k].cancel();
      continue;
    }
    Response answer = calls[k].take();
    if (auto* reply = std::get_if<StatsReply>(&answer)) answers[k] = std::move(*reply);
  }
  return answers;
}

template <Transport T>
void Client<T>::take_membership(std::vector<std::uint32_t> members, std::uint64_t membership,
                                std::vector<std::string> ps_addresses, bool first_look) {
  log(LogLevel::kInfo, "the job's ps tasks are now " + describe_members(members) + " (membership " +
                           std::to_string(membership) + ", was " + std::to_string(membership_) +
                           ")");
  const bool same = members == members_;
  set_members(std::move(members), membership, std::move(ps_addresses),
              ErrorCode::kFailedPrecondition);
  // A ps the chief took back (Chief::take_back, which keeps the members) is written to
  // again; a ps that left or joined changes nobody's given-up copies.
  if (same || first_look) (void)renew_copies(transport_, first_look);
}

template <Transport T>
void Client<T>::set_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                            std::vector<std::string> ps_addresses, ErrorCode code) {
  require_task_set(members, "ps task");
  reach_all(transport_, ps_addresses);
  if (members.back() >= num_ps()) {
    throw Error(code, "ps " + std::to_string(members.back()) +
                          " is named a member of the job, and this task knows " +
                          std::to_string(num_ps()) +
                          " ps tasks: are they configured with the same cluster?");
  }
  place_copies(transport_, members);  // (before any request at the new membership)
  members_ = std::move(members);
  membership_ = membership;
  if (!ps_addresses.empty()) ps_addresses_ = std::move(ps_addresses);
  unanswered_.clear();  // a push of the shape before is not sent again
}

template <Transport T>
bool Client<T>::follow_membership(std::vector<PlacementReply>& replies) {
  const auto newest =
      std::max_element(replies.begin(), replies.end(),
                       [](const auto& a, const auto& b) { return a.membership < b.membership; });
  const bool first_look = !membership_heard_;
  membership_heard_ = true;
  if (newest->membership < membership_) return false;  // a ps behind: `adopt` names the mismatch
  if (newest->membership == membership_ && newest->members == members_) return false;
  if (newest->members == members_) {
    membership_ = newest->membership;
    // A ps the chief took back (its shards restored beside their copies): asked again,
    // both copies, before anything of the new epoch is sent.
    return renew_copies(transport_, first_look);
  }
  take_membership(std::move(newest->members), newest->membership, std::move(newest->ps_addresses),
                  first_look);
  return true;
}

}  // namespace pulley
