// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/ps/push_ledger.hpp"
#include "pulley/ps/step_gate.hpp"

namespace pulley {

/// A ps task's half of a checkpoint's cut (Pause, ReadState, Resume; the chief's half is
/// `client/checkpoint_cut.hpp`): while paused, pushes that arrive are held, copied out of
/// the transport's buffers; a ReadState names the largest count of each worker's pushes any
/// ps had taken and that ps's last push, the ps works out its own count from them (less a
/// push lost with its worker's process that never comes here: own_until), and takes held
/// pushes, in the order they came, until it has taken exactly that many of every worker,
/// then answers with its state.
/// So every ps is read at the same pushes, under any sync policy.
///
/// The part keeps the pause, the held pushes and the pending read; the ps takes the pushes
/// and builds the state (the callbacks of `advance` and `resume`).
class CheckpointCut {
 public:
  using Clock = std::chrono::steady_clock;

  /// A push that arrived while paused, with its tensors copied.
  struct HeldPush {
    Push push;
    std::vector<std::vector<float>> storage;
    Responder reply;
  };

  /// True while paused: pushes are held.
  [[nodiscard]] bool paused() const noexcept { return paused_; }

  /// Pauses, for the chief's connection `session`.
  void pause(std::uint64_t session) noexcept {
    paused_ = true;
    session_ = session;
  }

  /// True if a pause is on and connection `session` made it (0: any connection).
  [[nodiscard]] bool paused_by(std::uint64_t session) const noexcept {
    return paused_ && (session == 0 || session == session_);
  }

  /// Holds `push`, with its reply, until the cut or Resume takes it.
  void hold(const Push& push, Responder& reply) {
    HeldPush& held = held_.emplace_back();
    held.push = Push{push.worker, push.local_step, {}, push.epoch, push.sequence, {}, push.series, push.refill};
    held.storage.reserve(push.gradients.size() + push.rows.size());
    for (const PartValues& pv : push.gradients) {
      held.storage.emplace_back(pv.values.begin(), pv.values.end());
      held.push.gradients.push_back({pv.part, held.storage.back()});
    }
    for (const TableRows& tr : push.rows) {
      held.storage.emplace_back(tr.values.begin(), tr.values.end());
      held.push.rows.push_back({tr.table, tr.ids, held.storage.back()});
    }
    held.reply = std::exchange(reply, nullptr);
  }

  /// If the cut holds a push of `push`'s worker with its sequence number (a push sent again
  /// after its connection was lost), its answer goes to `reply` instead, and true.
  bool rehold(const Push& push, Responder& reply) {
    if (push.sequence == 0) return false;
    for (HeldPush& held : held_) {
      if (held.push.worker == push.worker && held.push.sequence == push.sequence &&
          held.push.series == push.series) {
        held.reply = std::exchange(reply, nullptr);
        return true;
      }
    }
    return false;
  }

  /// Asks for the state at the cut `until` (pushes of each worker), answered through
  /// `reply` by `advance`; a read asked before is cancelled.
  void read_at(std::vector<std::uint64_t> until, Responder& reply) {
    if (pending_) respond(pending_->reply, ErrorReply{ErrorCode::kCancelled, "a newer ReadState came"});
    pending_.emplace(PendingRead{std::move(until), std::exchange(reply, nullptr), Clock::now()});
  }

  /// A worker that the pending read, asked `patience` before `now` or earlier, still waits
  /// for (short of the cut and `awaited`), with the count of its pushes the cut holds: once
  /// per read (what an operator is told of a cut that stands still), else nullopt.
  template <class Awaited>
  std::optional<std::pair<std::uint32_t, std::uint64_t>> overdue(const PushLedger& ledger,
                                                                 Clock::time_point now,
                                                                 Clock::duration patience,
                                                                 Awaited&& awaited) {
    if (!pending_ || pending_->told || now - pending_->asked < patience) return std::nullopt;
    const std::optional<std::uint32_t> w = awaited_short(ledger, awaited);
    if (!w) return std::nullopt;
    pending_->told = true;
    return std::pair{*w, pending_->until[*w]};
  }

  /// The pushes of each worker that `read` holds this ps to, by what its `ledger` took: the
  /// cut's count (ReadState::until), but a worker of whom it took fewer is waited for one
  /// push at most, and none when its own last push is the one the cut names (the furthest
  /// ps's last). A worker has one push in flight at a time and sends again only its last,
  /// so what such a ps lacks was lost with an earlier process of that worker, written to
  /// other ps tasks only: under Async and BoundedStaleness nothing counts it here, and
  /// waiting for it stood the cut still until the request timeout once no push came any
  /// more, as at the end of training. The ps judges by its own ledger: with copies, the
  /// copy read from (the one ReadState goes to) by its own, not by the answer folded from
  /// both copies' pauses. An unnumbered last push (sequence 0): the cut's count.
  ///
  /// Left as it was: a ps at the cut's count whose last push differs from the one named
  /// (the furthest ps took a push lost with an earlier process and one more, this ps the
  /// new process's push and holds its next) is read without the push it holds.
  [[nodiscard]] static std::vector<std::uint64_t> own_until(const PushLedger& ledger,
                                                            const ReadState& read) {
    std::vector<std::uint64_t> until = read.until;
    for (std::uint32_t w = 0; w < until.size(); ++w) {
      const std::uint64_t taken = ledger.taken(w), sequence = of_worker(read.last_sequences, w);
      if (taken >= until[w] || sequence == 0) continue;
      const bool took_last = ledger.last(w) == std::pair{sequence, of_worker(read.last_series, w)};
      until[w] = took_last ? taken : taken + 1;
    }
    return until;
  }

  /// A worker of whom the ps has taken more pushes than `until` allows, if any.
  [[nodiscard]] static std::optional<std::uint32_t> past(const PushLedger& ledger,
                                                         const std::vector<std::uint64_t>& until) {
    const auto& taken = ledger.taken();
    for (std::size_t w = 0; w < taken.size(); ++w) {
      if (taken[w] > of_worker(until, w)) return static_cast<std::uint32_t>(w);
    }
    return std::nullopt;
  }

  /// Takes held pushes (`take(push, reply)`), in the order they came, while their workers
  /// are short of the cut; once every worker is exactly at it, answers the pending read
  /// with `state()` (a StateReply). A worker for whom `awaited(w)` is false (held lost,
  /// silent for the worker timeout, or no longer the job's) is not waited for: a push it
  /// sent another ps before it died may never come here. What of it is held is still taken
  /// up to the cut. Called again as time passes (a worker falls silent while paused).
  template <class Take, class State, class Awaited>
  void advance(const PushLedger& ledger, Take&& take, State&& state, Awaited&& awaited) {
    if (!pending_) return;
    const std::vector<std::uint64_t>& until = pending_->until;
    auto short_of_cut = [&](std::uint32_t w) { return ledger.taken(w) < of_worker(until, w); };
    std::deque<HeldPush> later;
    for (HeldPush& held : std::exchange(held_, {})) {
      // A worker's pushes are taken in the order they came: one held back holds back the rest.
      const bool blocked = std::any_of(later.begin(), later.end(), [&](const HeldPush& h) {
        return h.push.worker == held.push.worker;
      });
      if (!blocked && short_of_cut(held.push.worker)) {
        take(held.push, held.reply);
      } else {
        later.push_back(std::move(held));
      }
    }
    held_ = std::move(later);
    if (awaited_short(ledger, awaited)) return;  // its push is still on its way here
    Responder reply = std::move(pending_->reply);
    pending_.reset();
    respond(reply, state());
  }

  /// Ends the pause: a cut not reached is given up, and the held pushes are taken in order.
  template <class Take>
  void resume(Take&& take) {
    if (!paused_) return;
    paused_ = false;
    if (pending_) {
      respond(pending_->reply, ErrorReply{ErrorCode::kCancelled, "resumed before the cut was reached"});
      pending_.reset();
    }
    for (HeldPush& held : std::exchange(held_, {})) take(held.push, held.reply);
  }

  /// Parks a Pause of connection `session` that waits for global step `at_step`.
  void park_pause(std::int64_t at_step, std::uint64_t session, Responder& reply) {
    pauses_.park(at_step, session, reply);
  }

  /// Pauses for each parked Pause whose step `step` reached: `pause(session, reply)`.
  template <class Pause>
  void release_pauses(std::int64_t step, Pause&& pause) {
    pauses_.release(step, pause);
  }

  /// Answers everything held or waiting with `answer`, and ends the pause.
  void answer_all(const ErrorReply& answer) {
    for (HeldPush& h : std::exchange(held_, {})) respond(h.reply, ErrorReply{answer});
    pauses_.answer_all(answer);
    if (pending_) {
      respond(pending_->reply, ErrorReply{answer});
      pending_.reset();
    }
    paused_ = false;
  }

 private:
  struct PendingRead {
    std::vector<std::uint64_t> until;
    Responder reply;
    Clock::time_point asked;
    bool told = false;  ///< overdue() said it
  };

  /// The first worker the pending read still waits for: short of the cut and `awaited`.
  template <class Awaited>
  std::optional<std::uint32_t> awaited_short(const PushLedger& ledger, Awaited&& awaited) const {
    const std::vector<std::uint64_t>& until = pending_->until;
    for (std::uint32_t w = 0; w < until.size(); ++w) {
      if (ledger.taken(w) < until[w] && awaited(w)) return w;
    }
    return std::nullopt;
  }

  bool paused_ = false;
  std::uint64_t session_ = 0;        ///< the chief's connection that paused it
  std::deque<HeldPush> held_;        ///< pushes that arrived while paused, in order
  std::optional<PendingRead> pending_;  ///< a ReadState waiting for its cut
  StepGate<std::uint64_t> pauses_;      ///< Pauses for a step to come, by the chief's connection
};

}  // namespace pulley
