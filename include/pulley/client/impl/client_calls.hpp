// SPDX-License-Identifier: MIT
#pragma once

/// Client's calls to the ps tasks and their answers (declared in client/client.hpp, which
/// includes this header after the class): a request to every member, tokens, pulls of
/// values and rows, pushes (kept until answered, sent again), the waits for a step or for
/// the end, and the counters.

#include "pulley/client/client.hpp"

namespace pulley {

template <Transport T>
template <class R, class MakeRequest>
std::vector<R> Client<T>::broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                                    std::string_view what) {
  CallGroup group;
  for (const std::uint32_t ps : members_)
    group.add(transport_.call(ps, Request{make_request(ps)}, {}));
  group.wait(timeout, what);
  std::vector<R> replies;
  for (std::size_t k = 0; k < members_.size(); ++k) replies.push_back(group.take_as<R>(k));
  return replies;
}

template <Transport T>
TokenReply Client<T>::take_token(std::uint32_t worker) {
  CallGroup group;
  group.add(transport_.call(pacing_ps(), TakeToken{worker, epoch_}, {}));
  (void)detail::wait_progressing(transport_, members_, options_, group,
                                 "worker " + std::to_string(worker) + ": take a sync token");
  TokenReply reply = group.take_as<TokenReply>(0);
  paced_ = {epoch_, reply.pushes_taken};
  return reply;
}

template <Transport T>
std::int64_t Client<T>::pull(std::span<const PullRequest> requests, std::int64_t min_step) {
  CallGroup group;
  send_pulls(group, requests, min_step);
  detail::wait_gated(transport_, members_, options_, group, min_step, "pull");
  return lowest_step<PullReply>(group, 0, group.size());
}

template <Transport T>
std::int64_t Client<T>::pull_rows(std::span<const RowRequest> requests, std::int64_t min_step) {
  CallGroup group;
  send_row_pulls(group, requests, min_step);
  detail::wait_gated(transport_, members_, options_, group, min_step, "pull rows");
  return lowest_step<RowsReply>(group, 0, group.size());
}

template <Transport T>
std::int64_t Client<T>::pull_with_rows(std::span<const PullRequest> requests,
                                       std::span<const RowRequest> rows, std::int64_t min_step) {
  // The rows first: a row pull counts as changing the ps (it may create rows), which makes
  // a TCP server copy whatever of the dense replies before it is still unsent.
  CallGroup group;
  send_row_pulls(group, rows, min_step);
  const std::size_t row_pulls = group.size();
  send_pulls(group, requests, min_step);
  detail::wait_gated(transport_, members_, options_, group, min_step, "pull");
  std::int64_t step = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = 0; i < row_pulls; ++i)
    step = std::min(step, group.take_as<RowsReply>(i).global_step);
  for (std::size_t i = row_pulls; i < group.size(); ++i)
    step = std::min(step, group.take_as<PullReply>(i).global_step);
  return group.size() == 0 ? 0 : step;
}

template <Transport T>
std::uint32_t Client<T>::push(std::uint32_t worker, std::int64_t local_step,
                              std::span<const std::span<const float>> gradients,
                              std::span<const RowRequest> rows) {
  build_pushes(worker, local_step, gradients, rows);
  CallGroup group;
  send_pushes(group);
  group.wait(options_.request_timeout, "push");
  unanswered_.clear();
  return stale_parts(group, 0, group.size());
}

template <Transport T>
auto Client<T>::push_pull(std::uint32_t worker, std::int64_t local_step,
                          std::span<const std::span<const float>> gradients,
                          std::span<const PullRequest> requests, std::int64_t min_step,
                          std::span<const RowRequest> rows, bool refill) -> PushPullResult {
  detail::PullSplit pulls = split(requests, min_step);
  build_pushes(worker, local_step, gradients, rows);
  for (Push& p : unanswered_) p.refill = refill;  // the token's word, for every ps (Token::refill)
  return push_pull_sent(std::move(pulls), min_step);
}

template <Transport T>
auto Client<T>::push_pull_again(std::span<const PullRequest> requests, std::int64_t min_step)
    -> PushPullResult {
  if (!push_unanswered())
    throw Error(ErrorCode::kFailedPrecondition, "no unanswered push to send again");
  return push_pull_sent(split(requests, min_step), min_step);
}

template <Transport T>
std::optional<std::int64_t> Client<T>::wait_for_step_until(
    std::int64_t step, std::chrono::steady_clock::time_point deadline,
    const std::function<bool()>& meanwhile) {
  CallGroup group;
  for (const std::uint32_t ps : members_)
    group.add(transport_.call(ps, Pull{step, {}, epoch_}, {}));
  if (step <= 0) {
    group.wait(options_.request_timeout, "read the global step");
  } else if (!detail::wait_progressing(transport_, members_, options_, group,
                                       "wait for step " + std::to_string(step), deadline,
                                       meanwhile)) {
    return std::nullopt;
  }
  return lowest_step<PullReply>(group, 0, group.size());
}

template <Transport T>
void Client<T>::wait_for_end() {
  CallGroup group;
  constexpr std::int64_t kNever =
      std::numeric_limits<std::int64_t>::max() / 2;  // a step no job reaches
  for (const std::uint32_t ps : members_)
    group.add(transport_.call(ps, Pull{kNever, {}, epoch_}, {}));
  (void)detail::wait_progressing(transport_, members_, options_, group,
                                 "wait for the chief to end training");
  for (std::size_t ps = 0; ps < group.size(); ++ps)
    (void)group.take_as<PullReply>(ps);  // throws its error
}

template <Transport T>
std::vector<Stats> Client<T>::stats() {
  std::vector<Stats> all;
  for (auto& r : broadcast<StatsReply>([](std::size_t) { return GetStats{}; },
                                       options_.request_timeout, "stats")) {
    all.push_back(r.stats);
  }
  return all;
}

template <Transport T>
void Client<T>::send_row_pulls(CallGroup& group, std::span<const RowRequest> requests,
                               std::int64_t min_step) {
  detail::split_row_pulls(tables_, num_ps(), requests, min_step, epoch_,
                          [&](std::size_t ps, PullRows&& message, PullTargets&& targets) {
                            message.pushes_paced = pushes_paced();
                            group.add(transport_.call(ps, std::move(message), std::move(targets)));
                          });
}

template <Transport T>
template <class R>
std::int64_t Client<T>::lowest_step(CallGroup& group, std::size_t first, std::size_t end) {
  std::int64_t step = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = first; i < end; ++i) step = std::min(step, group.take_as<R>(i).global_step);
  return first == end ? 0 : step;
}

template <Transport T>
detail::PullSplit Client<T>::split(std::span<const PullRequest> requests,
                                   std::int64_t min_step) const {
  detail::PullSplit out =
      detail::split_pulls(placement_, variables_, num_ps(), requests, min_step, epoch_);
  for (Pull& pull : out.pulls) pull.pushes_paced = pushes_paced();
  return out;
}

template <Transport T>
void Client<T>::send(CallGroup& group, detail::PullSplit&& split) {
  for (const std::uint32_t ps : members_) {
    if (split.pulls[ps].slices.empty()) continue;
    group.add(transport_.call(ps, std::move(split.pulls[ps]), std::move(split.targets[ps])));
  }
}

template <Transport T>
void Client<T>::build_pushes(std::uint32_t worker, std::int64_t local_step,
                             std::span<const std::span<const float>> gradients,
                             std::span<const RowRequest> rows) {
  unanswered_.clear();
  unanswered_ = pushes_.build(placement_, variables_, tables_, num_ps(), worker, local_step, epoch_,
                              gradients, rows);
}

template <Transport T>
auto Client<T>::push_pull_sent(detail::PullSplit&& pulls, std::int64_t min_step) -> PushPullResult {
  CallGroup group;
  send_pushes(group);
  const std::size_t pushes = group.size();
  send(group, std::move(pulls));
  detail::wait_gated(transport_, members_, options_, group, min_step, "push and pull");
  unanswered_.clear();
  return {stale_parts(group, 0, pushes), lowest_step<PullReply>(group, pushes, group.size())};
}

template <Transport T>
std::uint32_t Client<T>::stale_parts(CallGroup& group, std::size_t first, std::size_t end) {
  std::uint32_t stale = 0;
  for (std::size_t i = first; i < end; ++i) stale += group.take_as<PushReply>(i).stale_parts;
  return stale;
}

}  // namespace pulley
