// SPDX-License-Identifier: MIT
#pragma once

/// What a call sent to both copies of a shard answers when both copies answered
/// (`TcpOptions::replicas`): each copy completes steps on its own, so the two can be a
/// step apart, and the answer must tell what holds for both.

#include <algorithm>
#include <cstddef>
#include <variant>

#include "pulley/protocol/messages.hpp"

namespace pulley::transport_detail {

/// Folds `other`, the other copy's answer, into `read`, the answer of the copy read from:
/// - a pull (PullReply, RowsReply) names the step both reached, the lower of the two: a
///   worker that skipped its next pull on the higher step's word would push for the next
///   step to a copy still in this one, which would count it for this step;
/// - a pause (PauseReply) names the furthest step, the furthest step pushed for, the most
///   pushes taken of each worker, with the last push of the copy that took them, and the
///   later start of known evictions of either copy: a change of workers "from the next step"
///   must be to come on both copies, and a cut must wait for every push either copy took
///   (the cut names the furthest ps's last push: a count with another copy's last would let
///   a ps one push short hold itself at its count, CheckpointCut::own_until).
/// Other answers are left as they are.
inline void merge_copy_answers(Response& read, const Response& other) {
  const auto lower = [](auto* r, const auto* o) {
    if (r != nullptr && o != nullptr) r->global_step = std::min(r->global_step, o->global_step);
  };
  lower(std::get_if<PullReply>(&read), std::get_if<PullReply>(&other));
  lower(std::get_if<RowsReply>(&read), std::get_if<RowsReply>(&other));
  auto* paused = std::get_if<PauseReply>(&read);
  const auto* twin = std::get_if<PauseReply>(&other);
  if (paused == nullptr || twin == nullptr) return;
  paused->global_step = std::max(paused->global_step, twin->global_step);
  paused->evictions_since = std::max(paused->evictions_since, twin->evictions_since);
  paused->furthest_pushed = std::max(paused->furthest_pushed, twin->furthest_pushed);
  const std::size_t workers = std::max(paused->pushes.size(), twin->pushes.size());
  paused->pushes.resize(workers, 0);
  paused->last_sequences.resize(workers, 0);
  paused->last_series.resize(workers, 0);
  for (std::size_t w = 0; w < twin->pushes.size(); ++w) {
    if (twin->pushes[w] <= paused->pushes[w]) continue;
    paused->pushes[w] = twin->pushes[w];
    paused->last_sequences[w] = of_worker(twin->last_sequences, w);
    paused->last_series[w] = of_worker(twin->last_series, w);
  }
}

}  // namespace pulley::transport_detail
