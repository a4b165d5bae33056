// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/client/detail/push_builder.hpp"
#include "pulley/client/detail/split.hpp"
#include "pulley/client/detail/stall.hpp"
#include "pulley/client/options.hpp"
#include "pulley/client/requests.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/sharding/rebalance.hpp"

namespace pulley {

/// What every client role (Worker, Chief, Evaluator) is made of: a transport to the ps
/// tasks, the model as they registered it (variables, tables, placement, epoch), and the
/// calls that turn variable-level pulls and pushes into one request per ps, sent
/// concurrently and awaited together. Waits for other tasks (a token, a step) last as long
/// as training progresses and explain themselves when it does not (`ClientOptions`).
///
/// A Client is used from one thread at a time, as the role that owns it.
///
/// It speaks to the job's ps tasks, its members (`members()`): every ps task of the
/// cluster until one leaves the job for good (the chief's `Chief::leave`); it learns a
/// change from the ps tasks when it gets ready again (`wait_ready`).
///
/// @tparam T the Transport that reaches the ps tasks
template <Transport T>
class Client {
 public:
  // The members whose bodies are longer than a line or two are defined in client/impl/, by
  // concern (included at the end of this header): client_model.hpp (the model: looking it
  // up, registering it, waiting until the ps tasks are ready, adopting their placement),
  // client_membership.hpp (the job's ps tasks and the copies) and client_calls.hpp (the
  // calls to every ps and their answers).

  Client(T transport, ClientOptions options)
      : transport_(std::move(transport)), options_(options), pushes_(options.clip_norm) {
    for (std::uint32_t ps = 0; ps < transport_.num_ps(); ++ps) members_.push_back(ps);
  }

  /// The ps tasks of the cluster (its spec), members of the job or not: task indices are
  /// below it.
  [[nodiscard]] std::size_t num_ps() const { return transport_.num_ps(); }
  /// The job's ps tasks, ascending task indices, as last learned.
  [[nodiscard]] std::span<const std::uint32_t> members() const noexcept { return members_; }
  /// Their version: 0 for the cluster's own shape, one more for each change.
  [[nodiscard]] std::uint64_t membership() const noexcept { return membership_; }
  /// The ps task that paces the workers (hands out sync tokens): the lowest member.
  [[nodiscard]] std::uint32_t pacing_ps() const noexcept { return members_.front(); }
  /// Where each variable lives, once registered or ready.
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  /// The registered variables.
  [[nodiscard]] const std::vector<VariableSpec>& variables() const noexcept { return variables_; }
  /// The embedding tables the ps tasks hold.
  [[nodiscard]] const std::vector<TableSpec>& tables() const noexcept { return tables_; }
  /// Where the ps tasks' IdSharding puts the tables' rows (`id_sharding_fingerprint`).
  [[nodiscard]] std::uint64_t id_sharding() const noexcept { return id_sharding_; }
  /// True if `sharding` puts the tables' rows where the ps tasks' own IdSharding does (or
  /// the model has no tables).
  template <IdSharding I>
  [[nodiscard]] bool same_id_sharding(const I& sharding) const;
  /// Throws kFailedPrecondition, naming the fix, unless `sharding` (a worker's, or the
  /// chief's read_rows') puts the tables' rows where the ps tasks' own sharding does.
  template <IdSharding I>
  void check_id_sharding(const I& sharding) const;
  /// The seed of the tables' rows, as this client registered it or learned it from the ps tasks.
  [[nodiscard]] std::uint64_t table_seed() const noexcept { return table_seed_; }
  /// True once the placement is known.
  [[nodiscard]] bool has_placement() const noexcept { return !placement_.first_part.empty(); }
  /// The ps tasks' epoch (restores so far), as last learned.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// The ps tasks were restored at `epoch` (by this client).
  void adopt_epoch(std::uint64_t epoch) noexcept { epoch_ = epoch; }
  /// The optimizer's slot and counter names, as the ps tasks said at registration.
  [[nodiscard]] const std::vector<std::string>& slot_names() const noexcept { return slot_names_; }
  [[nodiscard]] const std::vector<std::string>& counter_names() const noexcept { return counter_names_; }
  [[nodiscard]] T& transport() noexcept { return transport_; }
  [[nodiscard]] const T& transport() const noexcept { return transport_; }
  [[nodiscard]] const ClientOptions& options() const noexcept { return options_; }

  /// Index of the variable called `name`; throws kNotFound naming it.
  [[nodiscard]] std::size_t variable_index(std::string_view name) const;

  /// Sends `make_request(ps)` to every member ps at once and returns the replies of type
  /// R, in member order.
  template <class R, class MakeRequest>
  std::vector<R> broadcast(MakeRequest make_request, std::chrono::milliseconds timeout,
                           std::string_view what);

  /// Registers the model (its variables, and its embedding tables with the seed of their
  /// rows) on every member ps, over the members, and checks that their placements agree.
  void register_model(std::span<const VariableSpec> variables,
                      std::span<const TableSpec> tables = {}, std::uint64_t table_seed = 0);

  /// The job's ps tasks are now `members` (ascending task indices, not empty), at version
  /// `membership` (above the one known), with every ps task's address `ps_addresses` once
  /// one joined beyond the cluster spec (the transport then reaches them: reach_all): what
  /// the next `register_model` places the model over. For the chief, which decides it
  /// (Chief::leave, Chief::join).
  void change_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                      std::vector<std::string> ps_addresses = {});

  /// Every ps task's address, once a ps joined beyond the cluster spec (empty before).
  [[nodiscard]] const std::vector<std::string>& ps_addresses() const noexcept { return ps_addresses_; }

  /// The job's workers, ascending, once workers joined or left (ChangeWorkers), as last
  /// learned (StatsReply::workers) or set; empty while they are the cluster spec's.
  [[nodiscard]] std::span<const std::uint32_t> workers() const noexcept { return workers_; }
  /// Takes `workers` as the job's (an empty list leaves them as they are).
  void set_workers(std::vector<std::uint32_t> workers) {
    if (!workers.empty()) workers_ = std::move(workers);
  }

  /// Waits until every member ps is initialized and learns the placement; with `tables`,
  /// checks that the ps tasks hold exactly those embedding tables. The members are asked
  /// first which ps tasks the job has (a ps that left it for good, or a process started
  /// again in its place, is not waited for), and again when one cannot be reached
  /// (kUnavailable): it may have left meanwhile.
  void wait_ready(std::span<const VariableSpec> variables,
                  std::optional<std::span<const TableSpec>> tables = std::nullopt);

  /// Asks every member ps it can reach (each alone: one that is gone hides no other's
  /// answer) which ps tasks the job has now, and takes a newer membership than it knows.
  /// True if it took one.
  bool learn_membership();

  /// Sends `request` to every ps task of the cluster that is no member of the job (one that
  /// left it, or a process started in its place), each awaited alone until `timeout`
  /// passes; answers and failures are ignored: a courtesy (a Shutdown, so that it ends too).
  void tell_others(const Request& request, std::chrono::milliseconds timeout) noexcept;

  /// GetStats to every member ps, each answer awaited alone until `timeout` passes: the
  /// answers in member order, nullopt for a ps that did not answer in time or refused.
  std::vector<std::optional<StatsReply>> ask_each(std::chrono::milliseconds timeout);

  /// Takes a sync token from the pacing ps (the lowest member).
  TokenReply take_token(std::uint32_t worker);

  /// Pulls every request's rows into its destination, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported: every value pulled is at least that recent.
  std::int64_t pull(std::span<const PullRequest> requests, std::int64_t min_step);

  /// Pulls the rows of every request into its values, from all ps tasks at once; no ps
  /// answers before it completed `min_step` steps. Returns the lowest global step the ps
  /// tasks reported.
  std::int64_t pull_rows(std::span<const RowRequest> requests, std::int64_t min_step);

  /// `pull` and `pull_rows` together, in one round trip; returns the lowest global step
  /// reported.
  std::int64_t pull_with_rows(std::span<const PullRequest> requests,
                              std::span<const RowRequest> rows, std::int64_t min_step);

  /// Pushes the gradients of whole variables (one span per variable, in variable order)
  /// tagged with `local_step`; every ps gets a message, which counts towards its step.
  /// Returns the number of part gradients dropped as stale.
  std::uint32_t push(std::uint32_t worker, std::int64_t local_step,
                     std::span<const std::span<const float>> gradients,
                     std::span<const RowRequest> rows = {});

  /// What push_pull did.
  struct PushPullResult {
    std::uint32_t stale_parts = 0;  ///< part gradients dropped as stale
    std::int64_t pulled_step = 0;   ///< lowest global step of the pulled values
  };

  /// `push`, then `pull` once each ps has completed `min_step` steps, in one round trip:
  /// both requests go out together, and each ps handles the pull after the push (requests
  /// from one client to one ps keep their order). A refused push ends the wait at once,
  /// although its pull may be waiting for a step that will not come. Both are checked
  /// before either is sent.
  PushPullResult push_pull(std::uint32_t worker, std::int64_t local_step,
                           std::span<const std::span<const float>> gradients,
                           std::span<const PullRequest> requests, std::int64_t min_step,
                           std::span<const RowRequest> rows = {}, bool refill = false);

  /// True if the last push was not answered by every ps (a connection was lost while it was
  /// on its way) and the ps tasks are still at the restore it was sent at: the same push
  /// can be sent again (`push_pull_again`), and each ps counts it once.
  [[nodiscard]] bool push_unanswered() const noexcept {
    return !unanswered_.empty() && unanswered_.front().epoch == epoch_;
  }

  /// Forgets the last push, answered or not (a new step begins).
  void forget_push() noexcept { unanswered_.clear(); }

  /// Sends the last push again as it was (its number and gradients: the buffers it views
  /// must hold what they held), then pulls as `push_pull` does. A ps that took it answers
  /// as it did the first time; one that did not takes it now. Needs `push_unanswered()`.
  PushPullResult push_pull_again(std::span<const PullRequest> requests, std::int64_t min_step);

  /// Blocks until every ps has completed `step` steps; returns the lowest global step they
  /// report.
  std::int64_t wait_for_step(std::int64_t step) {
    return *wait_for_step_until(step, std::chrono::steady_clock::time_point::max());
  }

  /// Like wait_for_step, but nullopt once `deadline` passes first, or `meanwhile` voided
  /// the wait (detail::wait_progressing).
  std::optional<std::int64_t> wait_for_step_until(std::int64_t step,
                                                  std::chrono::steady_clock::time_point deadline,
                                                  const std::function<bool()>& meanwhile = {});

  /// Blocks until the chief ends training: returns when the ps tasks answer kOutOfRange,
  /// throws anything else they answer (kAborted: the chief aborted training, or the ps
  /// tasks gave up waiting for a lost chief; kFailedPrecondition: the job was rolled back;
  /// kUnavailable: a ps was lost). A wait during which no ps advances for `wait_timeout`
  /// fails kDeadlineExceeded; long waits are logged as any step-gated one.
  void wait_for_end();

  /// Counters of every member ps, in member order (by task index while no ps left).
  std::vector<Stats> stats();

  /// Sends each ps its share of `requests` (checked), answered once it completed
  /// `min_step` steps, into `group`: the pulls of one round trip, awaited by the caller.
  void send_pulls(CallGroup& group, std::span<const PullRequest> requests, std::int64_t min_step) {
    send(group, split(requests, min_step));
  }

  /// Sends each ps its share of row pulls (checked) into `group`.
  void send_row_pulls(CallGroup& group, std::span<const RowRequest> requests,
                      std::int64_t min_step);

  /// The lowest global step of the replies of type R in `group` from `first` to `end`
  /// (0 when there are none).
  template <class R>
  static std::int64_t lowest_step(CallGroup& group, std::size_t first, std::size_t end);

  /// Pushes whose gradients `ClientOptions::clip_norm` scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return pushes_.clipped_steps(); }
  /// The global norm of the last push's gradients, when clipping is on (else 0).
  [[nodiscard]] double last_gradient_norm() const noexcept { return pushes_.last_gradient_norm(); }

 private:
  detail::PullSplit split(std::span<const PullRequest> requests, std::int64_t min_step) const;

  /// What the pulls say of this worker's pushes the pacing ps took: its latest token's
  /// count, if taken at the restore the client is at (0: none known).
  [[nodiscard]] std::uint64_t pushes_paced() const noexcept {
    return paced_.epoch == epoch_ ? paced_.pushes : 0;
  }

  void send(CallGroup& group, detail::PullSplit&& split);

  /// Builds one push per ps, kept (in `unanswered_`) until every ps has answered them.
  void build_pushes(std::uint32_t worker, std::int64_t local_step,
                    std::span<const std::span<const float>> gradients,
                    std::span<const RowRequest> rows);

  /// Sends a copy of each kept push (the copies view the same tensors).
  void send_pushes(CallGroup& group) {
    for (const std::uint32_t ps : members_) group.add(transport_.call(ps, Push(unanswered_[ps]), {}));
  }

  /// The kept pushes, then `pulls`, in one round trip; the pushes are forgotten once every
  /// ps has answered.
  PushPullResult push_pull_sent(detail::PullSplit&& pulls, std::int64_t min_step);

  static std::uint32_t stale_parts(CallGroup& group, std::size_t first, std::size_t end);

  /// Rounds of `wait_ready` that may follow a change of the ps tasks: changes come one at a
  /// time, and each takes a round or two.
  static constexpr std::size_t kMembershipRounds = 8;
  /// How long `learn_membership` waits for the ps tasks' answers.
  static constexpr std::chrono::milliseconds kAskPatience{5000};

  /// The job's ps tasks are `members` at version `membership`, with `ps_addresses`, as a
  /// ps said.
  /// `first_look`: the first membership this client hears of (renew_copies).
  void take_membership(std::vector<std::uint32_t> members, std::uint64_t membership,
                       std::vector<std::string> ps_addresses, bool first_look);

  /// Takes `members` at `membership` after reaching every ps of `ps_addresses`; a member
  /// this client cannot reach is refused with `code`.
  void set_members(std::vector<std::uint32_t> members, std::uint64_t membership,
                   std::vector<std::string> ps_addresses, ErrorCode code);

  /// True if a reply of `replies` (one per member) names a newer membership with other
  /// members than were asked, or with the same members and copies that serve again (a ps
  /// the chief took back): they are taken, to be asked again.
  bool follow_membership(std::vector<PlacementReply>& replies);

  /// Learns the model from every member ps's PlacementReply, checking that they agree with
  /// each other and with `variables` (and `tables`, when given).
  void adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables,
             const std::vector<TableSpec>* tables = nullptr);

  T transport_;
  ClientOptions options_;
  detail::PushBuilder pushes_;
  /// The last push, one message per ps, until every ps has answered it: what a retry after
  /// a lost connection sends again.
  std::vector<Push> unanswered_;
  std::uint64_t epoch_ = 0;  ///< the ps tasks' restores so far, as last learned
  /// The latest token's TokenReply::pushes_taken, and the epoch it was taken at.
  struct Paced {
    std::uint64_t epoch = 0;
    std::uint64_t pushes = 0;
  } paced_;
  std::vector<std::uint32_t> members_;  ///< the job's ps tasks, ascending, as last learned
  std::uint64_t membership_ = 0;        ///< their version
  /// A ps told this client the membership (any, the spec's too): changes after this are
  /// ones it lived through (renew_copies' `first_look` before).
  bool membership_heard_ = false;
  std::vector<std::string> ps_addresses_;  ///< every ps task's, once one joined (else empty)
  std::vector<std::uint32_t> workers_;     ///< the job's workers, once they changed (else empty)
  std::vector<std::string> slot_names_;     ///< the optimizer's slots, as the ps tasks name them
  std::vector<std::string> counter_names_;  ///< the optimizer's counters
  Placement placement_;
  std::vector<VariableSpec> variables_;
  std::vector<TableSpec> tables_;  ///< the embedding tables the ps tasks hold
  std::uint64_t table_seed_ = 0;   ///< as registered (kept for a restore's registration)
  std::uint64_t id_sharding_ = 0;  ///< where the ps tasks put the tables' rows
};

}  // namespace pulley

// Client's member functions' definitions, by concern.
#include "pulley/client/impl/client_calls.hpp"
#include "pulley/client/impl/client_membership.hpp"
#include "pulley/client/impl/client_model.hpp"
