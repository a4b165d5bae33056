// SPDX-License-Identifier: MIT
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pulley/protocol/token.hpp"

namespace pulley {

/// What one push message counts for (`SyncPolicy::on_push`).
enum class Verdict : std::uint8_t {
  kStale,    ///< too old: its gradients are dropped (and counted), never applied
  kPending,  ///< its gradients are accumulated; the step needs more
  kReady,    ///< its gradients are accumulated and complete an update: take and apply it
};

/// An aggregation (sync) policy decides when gradients are applied and how workers are
/// paced. It has two halves, both state the policy defines and the ps keeps:
///   - an `Accumulator` per part the ps holds (TF's ConditionalAccumulator): it gathers the
///     part's gradients of one update and hands the optimizer their mean;
///   - one `Pacer` per ps task: it counts push messages towards the ps's global step, judges
///     them fresh or stale, and (on the pacing ps: the lowest member, ps 0 while none left) hands
///     out sync tokens.
///
/// Required:
///   - `typename P::Accumulator`, `typename P::Pacer` (both movable)
///   - `p.make_accumulator(n)` → an empty accumulator for `n`-element gradients
///   - `p.accumulate(acc, gradient)` → void: adds one fresh gradient
///   - `p.take(acc)` → `std::span<const float>`: what the optimizer applies; empties `acc`
///   - `p.make_pacer()` → the pacer at global step 0
///   - `p.on_push(pacer, worker, local_step)` → `Verdict` for one push message
///   - `p.global_step(pacer)` → `std::int64_t`: global steps completed on this ps
///   - `p.take_token(pacer, worker)` → `std::optional<Token>`; nullopt: the request waits
/// Optional:
///   - `p.waiting_for(pacer)` → `std::string`: what the next step waits for, in words; the
///     ps reports it (StatsReply) and clients quote it when a token or a step never comes
///   - `p.save(pacer)` → `std::vector<std::int64_t>` and `p.load(pacer, state)` (state: a
///     `std::span<const std::int64_t>` that `save` gave): the pacer as a checkpoint keeps it.
///     The ps saves at a cut where no push is half counted (every ps took the same pushes),
///     and loads into a fresh pacer; `load` throws `pulley::Error` for a state it cannot take
///     (say, of another number of workers), leaving the pacer as it was. Without them a
///     checkpoint keeps only the global step, and a restore starts the pacer afresh.
///   - `p.release(pacer, worker)` → void, noexcept: the connection worker `worker` took its
///     last token on is gone (its process ended, or its link broke): give back the tokens
///     it took and did not push for, so a vanished taker cannot hold a step up (a token is
///     a lease). The worker, or a process restarted in its place, may take tokens again; a
///     worker that pushed for a step still may not take a second token of it when R <= N.
///   - `p.held_token(pacer, worker)` → `std::optional<Token>`: a token of the step in
///     progress that `worker` took and has not pushed for (else nullopt). A worker pushes
///     for each token before it asks for another, so one that asks on the connection that
///     took it is asking again (its answer was lost with another ps's connection): it gets
///     that token again, counted once. Asked on another connection, the request waits for
///     the first to go, as any.
///   - `p.on_worker_lost(pacer, worker)` → `Verdict`: the ps holds `worker` lost (its
///     heartbeats stopped): stop waiting for it. kReady when that completes the update in
///     progress (the ps then takes and applies it as after a push), else kPending. The
///     policy gives back its tokens as `release` does. `p.on_worker_back(pacer, worker)` →
///     void: its heartbeats came back; it counts again from the step in progress. A throw
///     from either fails the ps. Without them a lost worker is only released, and the
///     policy waits for it.
///   - `p.on_pull_ahead(pacer, worker, min_step)` → `std::optional<Verdict>`: `worker`
///     (not held lost) asks for the parameters of step `min_step`, the one after the step in
///     progress, for which it has not pushed here. A worker pushes a step on a connection
///     before it pulls the next there, so this one will not push it: its push was lost with
///     its process (killed while it wrote the push to several ps tasks; those that took it
///     went on, and the process started in its place pulls the step they are at), or it
///     skipped the step (a backup worker, given the next step's token). A policy whose step
///     waits for that very worker stops waiting for it for this step alone (the update is
///     the mean of the others' gradients, or none), and says so: kReady when that
///     completes the step, else kPending; nullopt when the pull changes nothing (it waits,
///     as any gated pull). A push of the worker for that step that comes all the same is
///     stale. The ps asks again while the pull waits, whenever what the policy judges by
///     changed (a push taken, a worker back). Without it, such a pull waits
///     until the ps holds the worker lost, which it may never do while the worker's new
///     process beats.
///   - `p.awaited(pacer)` → `std::vector<std::uint32_t>`: the workers the next step waits
///     for; the ps quotes each with how long ago it last heard it.
///   - `p.reshape(pacer, workers)` → void: the job's workers are now `workers` (task
///     indices, ascending, not empty; workers joined or left for good): count them from the
///     step in progress on. The ps calls it the moment its global step reaches the step the
///     chief chose (ChangeWorkers), before it hands out a token of that step (under
///     SyncReplicas every ps is then at the same boundary, the step untouched), and after a
///     `load` when the job's workers are not the cluster spec's. A worker outside them is
///     not waited for; its token requests may wait and its pushes be stale. A throw
///     (`pulley::Error`) refuses the change and leaves the pacer as it was. Without it, no worker
///     can join or leave the job for good.
///   - `p.follow(pacer, local_step, refill)` → void, noexcept: called before `on_push` with
///     what the token the push was made for said (`Token::refill`, which the pacing ps's
///     policy sets): every ps follows the pacing ps's word on the push's step.
///
/// Semantic contract:
///   - the ps calls `on_push` once per push message, after checking it and before touching
///     any part: kStale drops every part gradient of the message, kPending accumulates them,
///     kReady accumulates them and then takes and applies every part's update. So the parts
///     one ps holds all see the same verdicts and never drift apart. (Parts on different ps
///     tasks are paced by each ps's own pacer, as TensorFlow's accumulators are: with
///     backup workers, two ps may average the gradients of different workers for one step.)
///   - `take` returns the mean of the gradients accumulated since the last `take` (or the
///     one gradient); the span stays valid until the next `accumulate` and may alias the
///     last gradient passed in; `accumulate` may keep a view of its gradient until then;
///   - `global_step` never decreases. A Pull with `min_step` waits until it reaches
///     `min_step`, and is answered the moment it does (before the ps handles anything
///     else), so the values it reads are this ps's at that step;
///   - `take_token` is asked for every TakeToken (sent to the pacing ps only); a request it answers
///     nullopt waits, and is asked again, in arrival order, after every push the ps handles;
///   - `on_push` and `take_token` may refuse a request by throwing `pulley::Error` (e.g. a
///     worker index out of range), and must then leave the pacer unchanged. Any other throw
///     from a policy while the ps changes its state fails the ps (it stops serving, and says
///     why), since half an update cannot be undone;
///   - the ps calls the policy from one thread at a time; the policy object itself is never
///     modified after construction: everything that changes lives in the Accumulators and
///     the Pacer.
template <class P>
concept SyncPolicy = std::copy_constructible<P> && std::movable<typename P::Accumulator> &&
    std::movable<typename P::Pacer> &&
    requires(const P& policy, typename P::Accumulator& acc, typename P::Pacer& pacer,
             const typename P::Pacer& cpacer, std::span<const float> gradient,
             std::uint32_t worker, std::int64_t local_step, std::size_t n) {
  { policy.make_accumulator(n) } -> std::same_as<typename P::Accumulator>;
  { policy.accumulate(acc, gradient) } -> std::same_as<void>;
  { policy.take(acc) } -> std::same_as<std::span<const float>>;
  { policy.make_pacer() } -> std::same_as<typename P::Pacer>;
  { policy.on_push(pacer, worker, local_step) } -> std::same_as<Verdict>;
  { policy.global_step(cpacer) } -> std::same_as<std::int64_t>;
  { policy.take_token(pacer, worker) } -> std::same_as<std::optional<Token>>;
};

/// What `policy` says the next step waits for, or "" when it does not say.
template <SyncPolicy P>
std::string waiting_for(const P& policy, const typename P::Pacer& pacer) {
  if constexpr (requires { { policy.waiting_for(pacer) } -> std::convertible_to<std::string>; }) {
    return policy.waiting_for(pacer);
  } else {
    return {};
  }
}

/// The pacer's state for a checkpoint (`save`), or {global step} when the policy has none.
template <SyncPolicy P>
std::vector<std::int64_t> save_pacer(const P& policy, const typename P::Pacer& pacer) {
  if constexpr (requires { { policy.save(pacer) } -> std::convertible_to<std::vector<std::int64_t>>; }) {
    return policy.save(pacer);
  } else {
    return {policy.global_step(pacer)};
  }
}

/// A pacer restored from `state` (`load` on a fresh one), or a fresh one when the policy
/// cannot load.
template <SyncPolicy P>
typename P::Pacer load_pacer(const P& policy, std::span<const std::int64_t> state) {
  typename P::Pacer pacer = policy.make_pacer();
  if constexpr (requires { policy.load(pacer, state); }) policy.load(pacer, state);
  return pacer;
}

/// Gives back what worker `worker` held, if the policy leases tokens (`release`).
template <SyncPolicy P>
void release(const P& policy, typename P::Pacer& pacer, std::uint32_t worker) noexcept {
  if constexpr (requires { policy.release(pacer, worker); }) {
    static_assert(noexcept(policy.release(pacer, worker)), "SyncPolicy::release must be noexcept");
    policy.release(pacer, worker);
  }
}

/// The token of the current step `worker` holds, if the policy says (`held_token`).
template <SyncPolicy P>
std::optional<Token> held_token(const P& policy, const typename P::Pacer& pacer, std::uint32_t worker) {
  if constexpr (requires { { policy.held_token(pacer, worker) } -> std::same_as<std::optional<Token>>; }) {
    return policy.held_token(pacer, worker);
  } else {
    return std::nullopt;
  }
}

/// Tells the policy `worker` is lost (`on_worker_lost`; without it, `release`): kReady
/// when the update in progress is complete without it.
template <SyncPolicy P>
Verdict worker_lost(const P& policy, typename P::Pacer& pacer, std::uint32_t worker) {
  if constexpr (requires { { policy.on_worker_lost(pacer, worker) } -> std::same_as<Verdict>; }) {
    return policy.on_worker_lost(pacer, worker);
  } else {
    release(policy, pacer, worker);
    return Verdict::kPending;
  }
}

/// Tells the policy `worker` pulls step `min_step` past the one in progress without having
/// pushed for it (`on_pull_ahead`, if it has one): nullopt when that changes nothing.
template <SyncPolicy P>
std::optional<Verdict> pull_ahead(const P& policy, typename P::Pacer& pacer, std::uint32_t worker,
                                  std::int64_t min_step) {
  if constexpr (requires {
                  {
                    policy.on_pull_ahead(pacer, worker, min_step)
                    } -> std::same_as<std::optional<Verdict>>;
                }) {
    return policy.on_pull_ahead(pacer, worker, min_step);
  } else {
    return std::nullopt;
  }
}

/// Tells the policy a lost `worker` is back (`on_worker_back`, if it has one).
template <SyncPolicy P>
void worker_back(const P& policy, typename P::Pacer& pacer, std::uint32_t worker) {
  if constexpr (requires { policy.on_worker_back(pacer, worker); }) {
    policy.on_worker_back(pacer, worker);
  }
}

/// True if the policy can count workers that join or leave (`reshape`).
template <SyncPolicy P>
inline constexpr bool kReshapes = requires(const P& policy, typename P::Pacer& pacer,
                                           std::span<const std::uint32_t> workers) {
  policy.reshape(pacer, workers);
};

/// Tells the policy what the pacing ps said about the push's step (`follow`, if it has one).
template <SyncPolicy P>
void follow(const P& policy, typename P::Pacer& pacer, std::int64_t local_step, bool refill) noexcept {
  if constexpr (requires { policy.follow(pacer, local_step, refill); }) {
    static_assert(noexcept(policy.follow(pacer, local_step, refill)), "SyncPolicy::follow must be noexcept");
    policy.follow(pacer, local_step, refill);
  }
}

/// The workers the next step waits for (`awaited`), or none when the policy does not say.
template <SyncPolicy P>
std::vector<std::uint32_t> awaited(const P& policy, const typename P::Pacer& pacer) {
  if constexpr (requires { { policy.awaited(pacer) } -> std::convertible_to<std::vector<std::uint32_t>>; }) {
    return policy.awaited(pacer);
  } else {
    return {};
  }
}

}  // namespace pulley
