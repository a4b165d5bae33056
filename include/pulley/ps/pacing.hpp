// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/core/error.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/ps/push_ledger.hpp"

namespace pulley {

/// Where a ps task hands out sync tokens: the front of the ps that its sync policy drives.
/// It holds the policy's `Pacer` (the global step, fresh or stale, tokens), the TakeToken
/// requests that wait for a token, and each worker's lease: the connection it took its
/// last token on. When that connection closes before the push, the policy gets the tokens
/// back (`SyncPolicy::release`), so a vanished worker cannot hold a step up.
///
/// Every call that changes the pacer may throw from the policy; the ps decides what a
/// throw costs (a refusal before anything changed, else the ps fails).
///
/// @tparam P the SyncPolicy
template <SyncPolicy P>
class Pacing {
 public:
  explicit Pacing(P sync) : sync_(std::move(sync)), pacer_(sync_.make_pacer()) {}

  /// The sync policy (its accumulators are the ps's parts').
  [[nodiscard]] const P& policy() const noexcept { return sync_; }
  /// Global steps completed on this ps.
  [[nodiscard]] std::int64_t global_step() const { return sync_.global_step(pacer_); }

  /// The policy's verdict on one push message (`SyncPolicy::on_push`); a `pulley::Error`
  /// refuses the push and leaves the pacer as it was.
  Verdict on_push(std::uint32_t worker, std::int64_t local_step, bool refill = false) {
    follow(sync_, pacer_, local_step, refill);
    return sync_.on_push(pacer_, worker, local_step);
  }

  /// Parks a TakeToken of `worker`, which came on connection `session`, until `hand_out`
  /// gives it a token. Asked again on the connection that holds the worker's lease, for
  /// the step it took a token of and has not pushed for (its answer was lost), it is
  /// answered that token again at once (`SyncPolicy::held_token`). A token says how many
  /// of the worker's pushes `ledger` holds taken (TokenReply::pushes_taken).
  void wait_for_token(std::uint32_t worker, std::uint64_t session, Responder& reply,
                      const PushLedger& ledger) {
    if (const auto lease = leases_.find(worker); lease != leases_.end() && lease->second == session) {
      if (const std::optional<Token> token = held_token(sync_, pacer_, worker)) {
        return respond(reply, TokenReply{*token, global_step(), ledger.taken(worker)});
      }
    }
    TokenWaiter& waiter = waiters_.emplace_back(TokenWaiter{worker, session, nullptr});
    waiter.reply = std::exchange(reply, nullptr);
  }

  /// Asks the policy again for every waiting token request, in arrival order: a token is
  /// answered (with the pushes `ledger` holds taken of its worker), a refusal
  /// (`pulley::Error`) goes to `refuse(reply, code, message)`, nullopt keeps waiting. The
  /// worker's lease moves to the connection it took the token on. Any other throw is the
  /// caller's to handle (the pacer may be half changed).
  template <class Refuse>
  void hand_out(const PushLedger& ledger, Refuse&& refuse) {
    std::erase_if(waiters_, [&](TokenWaiter& w) {
      std::optional<Token> token;
      try {
        token = sync_.take_token(pacer_, w.worker);
      } catch (const Error& e) {
        refuse(w.reply, e.code(), std::string("TakeToken refused: ") + e.message());
        return true;
      }
      if (!token) return false;
      leases_[w.worker] = w.session;
      respond(w.reply, TokenReply{*token, global_step(), ledger.taken(w.worker)});
      return true;
    });
  }

  /// Connection `session` of `worker` is gone (0: all of them): its waiting token requests
  /// are answered `gone` (kUnavailable). Returns true if it held the worker's lease, whose
  /// tokens then went back to the policy.
  bool disconnected(std::uint32_t worker, std::uint64_t session, const std::string& gone) {
    std::erase_if(waiters_, [&](TokenWaiter& w) {
      if (w.worker != worker || (session != 0 && w.session != session)) return false;
      respond(w.reply, ErrorReply{ErrorCode::kUnavailable, gone});
      return true;
    });
    const auto lease = leases_.find(worker);
    if (lease == leases_.end() || (session != 0 && lease->second != session)) return false;
    leases_.erase(lease);
    release(sync_, pacer_, worker);
    return true;
  }

  /// `worker` left the job: its waiting token requests are answered `refusal`, and the
  /// tokens it took and did not push for go back.
  void refuse(std::uint32_t worker, const ErrorReply& refusal) {
    std::erase_if(waiters_, [&](TokenWaiter& w) {
      if (w.worker != worker) return false;
      respond(w.reply, ErrorReply{refusal});
      return true;
    });
    leave(worker);
  }

  /// `worker` ends normally: the tokens it took and did not push for go back.
  void leave(std::uint32_t worker) {
    leases_.erase(worker);
    release(sync_, pacer_, worker);
  }

  /// The ps holds `worker` lost: the policy stops waiting for it, and its lease goes with
  /// it. kReady when that completes the update in progress.
  Verdict lost(std::uint32_t worker) {
    const Verdict verdict = worker_lost(sync_, pacer_, worker);
    leases_.erase(worker);
    return verdict;
  }

  /// `worker` pulls step `min_step` without a push for the step in progress here
  /// (SyncPolicy::on_pull_ahead): nullopt when that changes nothing; else its lease goes
  /// with its tokens, and kReady when the update in progress is complete without it.
  std::optional<Verdict> pulled_ahead(std::uint32_t worker, std::int64_t min_step) {
    const std::optional<Verdict> verdict = pull_ahead(sync_, pacer_, worker, min_step);
    if (verdict) leases_.erase(worker);
    return verdict;
  }

  /// A lost `worker` is back: it counts again from the step in progress.
  void back(std::uint32_t worker) { worker_back(sync_, pacer_, worker); }

  /// Counts the job's workers `workers` from the step in progress on (SyncPolicy::reshape);
  /// a `pulley::Error` refuses the change and leaves the pacer as it was.
  void reshape(std::span<const std::uint32_t> workers) { reshape(pacer_, workers); }
  /// The same on `pacer` (one loaded aside).
  void reshape(typename P::Pacer& pacer, std::span<const std::uint32_t> workers) const {
    if constexpr (kReshapes<P>) {
      sync_.reshape(pacer, workers);
    } else {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the sync policy cannot count workers that join or leave (it has no SyncPolicy::reshape)");
    }
  }

  /// Token requests waiting for a token.
  [[nodiscard]] std::size_t waiting() const noexcept { return waiters_.size(); }

  /// What the next step waits for, in the policy's words ("" if it does not say).
  [[nodiscard]] std::string waiting_for() const { return pulley::waiting_for(sync_, pacer_); }
  /// The workers the next step waits for (none if the policy does not say).
  [[nodiscard]] std::vector<std::uint32_t> awaited() const { return pulley::awaited(sync_, pacer_); }

  /// The pacer as a checkpoint keeps it.
  [[nodiscard]] std::vector<std::int64_t> save() const { return save_pacer(sync_, pacer_); }
  /// A pacer loaded from `state`, aside (a `pulley::Error` refuses the state); `reset`
  /// puts it in place.
  [[nodiscard]] typename P::Pacer load(std::span<const std::int64_t> state) const {
    return load_pacer(sync_, state);
  }
  /// Puts `pacer` in place (a restore): leases are forgotten, and waiting token requests
  /// are answered `gone`.
  void reset(typename P::Pacer pacer, const ErrorReply& gone) {
    pacer_ = std::move(pacer);
    leases_.clear();
    answer_all(gone);
  }

  /// Answers every waiting token request with `error`.
  void answer_all(const ErrorReply& error) {
    for (TokenWaiter& w : std::exchange(waiters_, {})) respond(w.reply, ErrorReply{error});
  }

 private:
  struct TokenWaiter {
    std::uint32_t worker;
    std::uint64_t session;  ///< the connection it came on
    Responder reply;
  };

  P sync_;
  typename P::Pacer pacer_;
  std::deque<TokenWaiter> waiters_;
  /// By worker: the connection it took its last token on, which holds its tokens' lease.
  std::map<std::uint32_t, std::uint64_t> leases_;
};

}  // namespace pulley
