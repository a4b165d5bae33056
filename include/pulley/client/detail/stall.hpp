// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/client/options.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley::detail {

/// How often `wait_progressing` runs its `meanwhile` while calls wait.
inline constexpr std::chrono::milliseconds kMeanwhileEvery{500};

/// Every member ps's global step (`members`: the job's ps tasks), and in `why` what each
/// waits for; empty if a ps does not answer in time (the question is a courtesy: the wait
/// is what matters).
template <Transport T>
std::vector<std::int64_t> global_steps(T& transport, std::span<const std::uint32_t> members,
                                       const ClientOptions& options, std::string& why) {
  std::vector<std::int64_t> steps;
  try {
    CallGroup group;
    for (const std::uint32_t ps : members) group.add(transport.call(ps, GetStats{}, {}));
    group.wait(std::min(options.request_timeout, std::chrono::milliseconds(5000)), "ask the ps tasks what they wait for");
    for (std::size_t k = 0; k < group.size(); ++k) {
      const std::uint32_t ps = members[k];
      const StatsReply reply = group.take_as<StatsReply>(k);
      steps.push_back(reply.stats.global_step);
      why += "; ps " + std::to_string(ps) + " is at step " + std::to_string(reply.stats.global_step) +
             ", waiting for " + reply.waiting_for;
    }
  } catch (const Error& e) {
    why += std::string("; the ps tasks do not say why (") + e.what() + ")";
    steps.clear();
  }
  return steps;
}

/// Waits for `group`, whose calls wait for other tasks (a token, a step), for as long as
/// the ps tasks make progress: every so often it asks them their global steps, logs what
/// they wait for once none has moved for `stall_report` ("worker 2 at clock 5", "worker:1
/// (last heard 14.2 s ago)"), and gives up (kDeadlineExceeded, cancelling the calls) once
/// none has moved for `wait_timeout`, naming the same: a long wait for a step far ahead is
/// no stall. With a `deadline`, returns false (the calls cancelled) when it passes first.
///
/// `meanwhile`, if given, runs on the waiting thread every `kMeanwhileEvery` while the calls
/// wait (the chief counts in workers that asked to join while it waits for a step); what
/// it throws ends the wait (the calls cancelled), and when it returns true, what it did
/// voids the wait: false is returned, the calls cancelled, as for a deadline.
template <Transport T>
bool wait_progressing(T& transport, std::span<const std::uint32_t> members, const ClientOptions& options, CallGroup& group, std::string_view what,
                      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
                      const std::function<bool()>& meanwhile = {}) {
  using Clock = std::chrono::steady_clock;
  const auto patience = options.wait_timeout;
  const auto look_every = std::min({patience, options.stall_report, std::chrono::milliseconds(10000)});
  std::vector<std::int64_t> steps;  // the ps tasks' global steps when last looked at
  auto still_since = Clock::now();
  // The first look comes early: it is the steps later looks compare with, so that a wait
  // that outlasts `stall_report` while the ps tasks advance is not reported as stalled
  // (the later looks stay on the `look_every` grid).
  const auto first = std::max(look_every / 8, std::chrono::milliseconds(1));
  auto wait = first;
  bool looked = false;
  for (;;) {
    const auto now0 = Clock::now();
    const auto slice = deadline == Clock::time_point::max()
                           ? wait
                           : std::min<std::chrono::milliseconds>(
                                 wait, std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::max(deadline - now0, Clock::duration::zero())));
    wait = looked ? look_every : std::max(look_every - first, std::chrono::milliseconds(1));
    looked = true;
    if (!meanwhile) {
      if (group.wait_for(slice)) return true;
    } else {
      bool voided = false;
      for (const auto end = Clock::now() + slice; !voided;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
        if (group.wait_for(std::clamp(left, std::chrono::milliseconds(0), kMeanwhileEvery))) return true;
        if (Clock::now() >= end) break;
        voided = meanwhile();
      }
      if (voided) {
        group.cancel();
        return false;
      }
    }
    if (Clock::now() >= deadline) {
      group.cancel();
      return false;
    }
    std::string why;
    const std::vector<std::int64_t> now_steps = global_steps(transport, members, options, why);
    const auto now = Clock::now();
    if (!now_steps.empty()) {
      // Moved since the last look, or the first answer (what came before it is unknown):
      // the stall clock starts again.
      if (steps.empty() || now_steps != steps) still_since = now;
      steps = now_steps;
    }
    const auto stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - still_since);
    if (stalled >= patience) {
      group.cancel();
      throw Error(ErrorCode::kDeadlineExceeded,
                  std::string(what) + ": no progress for " + std::to_string(stalled.count()) + " ms" + why);
    }
    if (stalled >= options.stall_report) {  // a hang explains itself while it lasts
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.1f", static_cast<double>(stalled.count()) / 1000.0);
      log(LogLevel::kWarning, std::string(what) + ": no progress for " + seconds + " s" + why);
    }
  }
}

/// Waits for `group`, whose calls wait for the ps tasks to complete global step `min_step`
/// (none when it is 0: then they are answered at once).
template <Transport T>
void wait_gated(T& transport, std::span<const std::uint32_t> members, const ClientOptions& options, CallGroup& group, std::int64_t min_step,
                std::string_view what) {
  if (min_step <= 0) return group.wait(options.request_timeout, what);
  (void)wait_progressing(transport, members, options, group, what);
}

}  // namespace pulley::detail
