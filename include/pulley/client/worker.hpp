// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/client/client.hpp"
#include "pulley/client/detail/recovery.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/sharding/ids.hpp"

namespace pulley {

/// What one training step did.
struct StepResult {
  float loss = 0.0F;              ///< the batch's mean loss
  std::int64_t local_step = 0;    ///< the step its gradient was computed for
  std::int64_t global_step = 0;   ///< steps completed when its token was taken
  std::uint32_t stale_parts = 0;  ///< part gradients the ps dropped as stale
  /// Updates of other pushes applied between the parameters its gradient was computed on
  /// and the pull that ended the step (0 under SyncReplicas with R = N; under Async, how
  /// many pushes of other workers came in between).
  std::int64_t staleness = 0;
};

/// A worker task: pulls parameters into its model, computes gradients on its own batches
/// and pushes them (seed 002's pull → feed → compute → push; the ps does the update).
///
/// With a TableModel, each step also pulls the rows of the embedding tables its batch
/// touches (their distinct ids, grouped by the ps that holds them: `lookup`), in the same
/// round trip as the dense parameters it needs then, and pushes their gradients with the
/// dense ones. A worker never holds, pulls or pushes a whole table.
///
/// @tparam M the Model or TableModel it trains (owned: the worker pulls into its parameters
///           in place)
/// @tparam T the Transport that reaches the ps tasks
/// @tparam I the IdSharding of the tables' rows: the ps tasks' (HashIds by default; name it
///           once, `MyTables::Sharding` of the ps tasks' `Tables<O, MyIds>`): a worker whose
///           sharding puts rows elsewhere is refused by `wait_ready`
template <Model M, Transport T, IdSharding I = HashIds>
class Worker {
 public:
  /// @param index this worker's task index (tags its pushes and token requests)
  Worker(std::uint32_t index, M model, T transport, ClientOptions options = {}, I sharding = {})
      : index_(index),
        model_(std::move(model)),
        client_(std::move(transport), options),
        sharding_(std::move(sharding)) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    all_.reserve(variables.size());
    for (std::size_t v = 0; v < variables.size(); ++v) {
      all_.push_back({v, {0, variables[v].rows()}, model_.parameter(v)});
      gradients_.push_back(model_.gradient(v));
    }
    if constexpr (TableModel<M>) {
      const auto tables = std::span<const TableSpec>(model_.tables());
      batches_.resize(tables.size());
      for (std::size_t t = 0; t < tables.size(); ++t) batches_[t].spec = tables[t];
    }
  }

  /// Not copyable or movable: it keeps views of its model's buffers.
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Blocks until the chief has initialized every ps, and learns where variables live.
  void wait_ready() {
    if constexpr (TableModel<M>) {
      client_.wait_ready(model_.variables(), std::span<const TableSpec>(model_.tables()));
      client_.check_id_sharding(sharding_);  // a worker that would send rows astray is refused now
    } else {
      client_.wait_ready(model_.variables());
    }
  }

  /// One training step on `batch`, paced by the sync policy: take a sync token (under
  /// Async, whose tokens never wait, only once: the pulls report the global step), make sure
  /// the model holds the parameters the token requires (pulling them unless the last step
  /// already did), compute the gradient, then push it and pull the next step's parameters
  /// in one round trip (`push_pull`). Under Async that prefetch is what the next step
  /// computes on (as MXNet's kvstore does): after a long pause, `pull()` first to start
  /// from the newest values.
  ///
  /// Returns nullopt when training is over: the token shows that `last_step` global steps
  /// are done (TF's StopAtStepHook), or the chief has ended training (the ps tasks answer
  /// `kOutOfRange`); `finished()` then says so.
  ///
  /// A ps that is lost (`kUnavailable`) or a job rolled back to a checkpoint while the step
  /// ran (`kFailedPrecondition`: the chief restored the ps tasks after losing one) is
  /// waited out: the worker waits until every ps is ready again and learns the epoch. If
  /// the ps tasks were not rolled back and the step's push had gone out, the same push
  /// (same number, same gradients) is sent again, so a ps that took it counts it once and
  /// every ps ends the step with the same pushes; otherwise the step starts again on the
  /// same batch, as TensorFlow's workers do after a ps failure. It gives up after `ClientOptions::recovery_timeout` with `kUnavailable`
  /// naming the last failure (the ps). Any other failure throws at once.
  std::optional<StepResult> step(
      const typename M::Batch& batch,
      std::int64_t last_step = std::numeric_limits<std::int64_t>::max()) {
    return run_step([&](const Token&) -> const typename M::Batch& { return batch; }, last_step);
  }

  /// One training step, as `step(batch)`, on the batch `source(number)` gives once the step's
  /// token is taken: `number` is the token's batch number (Token::batch), -1 when the sync
  /// policy does not number batches. A step retried after a failure reads again only if its
  /// new token numbers another batch (a source numbered -1 is read once a step). So a worker
  /// that takes a lost worker's token reads the lost worker's batch.
  template <class Source>
    requires std::invocable<Source&, std::int64_t> &&
             std::convertible_to<std::invoke_result_t<Source&, std::int64_t>, typename M::Batch>
  std::optional<StepResult> step(Source&& source,
                                 std::int64_t last_step = std::numeric_limits<std::int64_t>::max()) {
    std::optional<typename M::Batch> read;
    std::int64_t number = -1;
    return run_step(
        [&](const Token& token) -> const typename M::Batch& {
          if (!read || token.batch != number) {
            read.reset();
            read.emplace(source(token.batch));
            number = token.batch;
          }
          return *read;
        },
        last_step);
  }

  /// Pushes the model's current gradients tagged with `local_step`, then pulls every
  /// variable once the ps tasks have completed `pull_step` steps (0: at once, with this
  /// push applied), in one round trip: both requests go out together and each ps answers
  /// the pull after handling the push. Returns the number of part gradients dropped as
  /// stale.
  std::uint32_t push_pull(std::int64_t local_step, std::int64_t pull_step) {
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    const auto done = client_.push_pull(index_, local_step, gradients_, all_, pull_step, push_rows_);
    pulled_step_ = done.pulled_step;
    return done.stale_parts;
  }

  /// After `step` returned nullopt for reaching `last_step`, before the chief ended
  /// training: waits until it does, so that no worker ends successfully unless the chief
  /// ended the job (its last checkpoint and evaluation done). Returns true once it has
  /// (`ended()`), false when the job must train on (it was rolled back below `last_step`
  /// after a lost ps, or a ps went away and is back: `step` again). A ps that is away is
  /// waited for here with the recovery's pauses, and fails this wait (kUnavailable) after
  /// `ClientOptions::recovery_timeout`; a break after every ps answered again is a fault of
  /// its own, 20 times at most (detail::Recovery); a ps that answers, once back, that the
  /// chief ended training meanwhile ends this wait with true. Throws kAborted
  /// when the chief aborted training, or the ps tasks gave up waiting for a lost chief;
  /// kDeadlineExceeded when no ps advanced for `ClientOptions::wait_timeout` (the chief's
  /// last checkpoint and evaluation take longer).
  bool wait_for_end() {
    if (ended_) return true;
    try {
      client_.wait_for_end();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kOutOfRange) {
        if (e.code() != ErrorCode::kFailedPrecondition && !detail::Recovery::may_recover(e.code())) throw;
        if (!ending_) ending_.emplace("worker " + std::to_string(index_), client_.options());
        if (e.code() == ErrorCode::kFailedPrecondition || !ended_while_away(e)) {
          finished_ = false;
          pulled_step_ = -1;
          return false;
        }
      }
    }
    ending_.reset();
    finished_ = ended_ = true;
    return true;
  }

  /// True once the chief ended training (a step or `wait_for_end` was answered so).
  [[nodiscard]] bool ended() const noexcept { return ended_; }

  /// Pulls every variable.
  void pull() { pull_all(0); }
  /// Pulls one variable.
  void pull(std::string_view variable) {
    const std::size_t v = client_.variable_index(variable);
    const PullRequest request = all_[v];
    pulled_step_ = -1;  // the model now mixes steps: the next step pulls everything
    client_.pull(std::span(&request, 1), 0);
  }
  /// Pulls rows `rows` of one variable into the same rows of the model's copy.
  void pull(std::string_view variable, RowRange rows) {
    const std::size_t v = client_.variable_index(variable);
    const std::size_t row_size = client_.variables()[v].row_size();
    if (rows.end > client_.variables()[v].rows() || rows.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rows out of range for '" + std::string(variable) + "'");
    }
    const PullRequest request{v, rows,
                              all_[v].into.subspan(rows.begin * row_size, rows.size() * row_size)};
    pulled_step_ = -1;  // the model now mixes steps: the next step pulls everything
    client_.pull(std::span(&request, 1), 0);
  }

  /// Pushes the model's current gradients tagged with `local_step`, pulling nothing;
  /// returns the number of part gradients dropped as stale. (Unlike `step`, a failed call
  /// is not retried here: calling it again sends a new push, which a ps that took the
  /// first also counts.)
  std::uint32_t push(std::int64_t local_step) {
    return client_.push(index_, local_step, gradients_, push_rows_);
  }

  /// The model it trains, with the parameters of the last pull.
  [[nodiscard]] M& model() noexcept { return model_; }
  /// The model it trains, with the parameters of the last pull.
  [[nodiscard]] const M& model() const noexcept { return model_; }
  /// Counters of every member ps, in member order (their global steps among them).
  std::vector<Stats> stats() { return client_.stats(); }
  /// Steps whose gradients `ClientOptions::clip_norm` scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return client_.clipped_steps(); }
  /// The global norm of the last pushed gradients before clipping (0 unless clipping is on).
  [[nodiscard]] double last_gradient_norm() const noexcept { return client_.last_gradient_norm(); }
  /// This worker's task index.
  [[nodiscard]] std::uint32_t index() const noexcept { return index_; }
  /// True once `step` returned nullopt: training is over.
  [[nodiscard]] bool finished() const noexcept { return finished_; }
  /// The global step seen with the last token (Async: with the last pull).
  [[nodiscard]] std::int64_t global_step() const noexcept { return global_step_; }
  /// Where each variable lives, once `wait_ready` returned.
  [[nodiscard]] const Placement& placement() const noexcept { return client_.placement(); }

 private:
  /// A step, its batch read by `read(token)` once the token is taken.
  template <class Read>
  std::optional<StepResult> run_step(Read&& read, std::int64_t last_step) {
    if (finished_) return std::nullopt;
    pushing_ = false;
    client_.forget_push();  // what an earlier step left unanswered is not this step's
    std::optional<detail::Recovery> recovery;
    for (bool again = false;; again = true) {
      try {
        if (again) {
          recover();
          if (recovery && whole_again())
            recovery->answered();  // a break after this is a fault of its own
        }
        if (again && pushing_ && client_.push_unanswered()) return finish_step();
        if constexpr (AppliesWhenComputed<M>) {
          if (again && pushing_) {
            throw Error(ErrorCode::kAborted, "worker " + std::to_string(index_) +
                                                 ": the step's push cannot be sent again as it was (the job was "
                                                 "rolled back, or its members changed), and the model applied part "
                                                 "of the step when it computed it: it cannot be computed again");
          }
        }
        std::optional<StepResult> result = try_step(read, last_step);
        if (result) ending_.reset();  // training went on: a later wait for the end starts afresh
        return result;
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kOutOfRange) {
          finished_ = ended_ = true;  // the chief ended training; this step's gradient is not needed
          return std::nullopt;
        }
        if (e.code() == ErrorCode::kFailedPrecondition && !rolled_back()) throw;
        if (!recovery) recovery.emplace("worker " + std::to_string(index_), client_.options());
        if (e.code() != ErrorCode::kFailedPrecondition) {
          if (!detail::Recovery::may_recover(e.code())) throw;
          recovery->wait(e);  // throws once the ps tasks stay lost too long
        }
      }
    }
  }

  template <class Read>
  std::optional<StepResult> try_step(Read& read, std::int64_t last_step) {
    // Unpaced (Async) tokens are never waited for: after the first, the step the last
    // pull reported serves as the token, and the round trip is saved.
    const TokenReply reply = paced_ || pulled_step_ < 0
                                 ? client_.take_token(index_)
                                 : TokenReply{Token{0, 0, 0, false}, pulled_step_};
    const Token& token = reply.token;
    paced_ = token.paced;
    global_step_ = reply.global_step;
    if (reply.global_step >= last_step) {
      finished_ = true;
      return std::nullopt;
    }
    const typename M::Batch& batch = read(token);
    StepResult result;
    if constexpr (TableModel<M>) {
      gather_rows(batch);
      if (pulled_step_ < token.pull_step) {
        pulled_step_ = -1;
        pulled_step_ = client_.pull_with_rows(all_, row_requests_, token.pull_step);
      } else {
        (void)client_.pull_rows(row_requests_, token.pull_step);
      }
      for (TableState& t : batches_) std::fill(t.gradients.begin(), t.gradients.end(), 0.0F);
      result.loss = static_cast<float>(model_.compute_gradients(batch, std::span<const TableBatch>(views_)));
    } else {
      if (pulled_step_ < token.pull_step) pull_all(token.pull_step);
      result.loss = static_cast<float>(model_.compute_gradients(batch));
    }
    result.local_step = token.local_step;
    result.global_step = reply.global_step;
    interrupted_ = result;  // what finish_step completes if the push loses a connection
    interrupted_pull_step_ = token.next_pull_step;
    pushing_ = true;
    const std::int64_t computed_on = pulled_step_;
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    const auto done = client_.push_pull(index_, token.local_step, gradients_, all_, token.next_pull_step,
                                        push_rows_, token.refill);
    pulled_step_ = done.pulled_step;
    result.stale_parts = done.stale_parts;
    result.staleness = std::max<std::int64_t>(0, done.pulled_step - computed_on - 1);
    return result;
  }

  /// Completes the step whose push a lost connection interrupted: the same push again (a
  /// ps that took it answers as it did), then the pull the step ends with.
  StepResult finish_step() {
    StepResult result = interrupted_;
    pulled_step_ = -1;
    const auto done = client_.push_pull_again(all_, interrupted_pull_step_);
    pulled_step_ = done.pulled_step;
    result.stale_parts = done.stale_parts;
    return result;
  }

  /// After `recover`: every ps answered, with every copy of its shard that a write needs
  /// (with copies, one out of reach and not given up is the fault still under way: a
  /// worker cut off from a process the chief still reaches; Tcp::copies_whole).
  [[nodiscard]] bool whole_again() const {
    if constexpr (requires(const T& t) {
                    { t.copies_whole() } -> std::convertible_to<bool>;
                  }) {
      return client_.transport().copies_whole();
    } else {
      return true;
    }
  }

  /// After a lost ps or a rollback: ready again, at the ps tasks' epoch, pulling afresh.
  void recover() {
    pulled_step_ = -1;
    paced_ = true;
    wait_ready();
  }

  /// `wait_for_end`'s wait for the ps tasks after `failure`: tries `recover` with the
  /// recovery's pauses until it succeeds (with every copy whole, the next break is then a
  /// fault of its own), a rollback is coming (kFailedPrecondition), a ps says the chief
  /// ended training meanwhile (kOutOfRange: true), or `ending_`'s deadline passes
  /// (kUnavailable). Trying once and leaving the rest to `step` would let the step's token
  /// (one ps) answer while another ps stays unreached, and the deadline run out across
  /// faults that were each over long before it.
  bool ended_while_away(Error failure) {
    while (true) {
      ending_->wait(failure);  // no busy loop while a ps is away
      try {
        recover();
        if (whole_again()) ending_->answered();
        return false;
      } catch (const Error& away) {
        if (away.code() == ErrorCode::kOutOfRange) return true;
        if (away.code() == ErrorCode::kFailedPrecondition) return false;
        if (!detail::Recovery::may_recover(away.code())) throw;
        failure = away;
      }
    }
  }

  /// After a kFailedPrecondition: true if the ps tasks were restored since this worker
  /// last looked (it is then ready at the new epoch); false if the refusal was about the
  /// request itself. Waits while a restarted ps is not restored yet; a ps lost meanwhile
  /// counts as a rollback to come.
  bool rolled_back() {
    const std::uint64_t before = client_.epoch();
    try {
      recover();
    } catch (const Error& e) {
      return detail::Recovery::may_recover(e.code());
    }
    return client_.epoch() != before;
  }

  void pull_all(std::int64_t min_step) {
    pulled_step_ = -1;  // a pull that fails part way leaves the model mixed: pull again
    pulled_step_ = client_.pull(all_, min_step);
  }

  /// One table's rows for the current batch: its distinct ids grouped by ps (ascending
  /// within each), where each id is, the rows pulled and their gradients.
  struct TableState {
    TableSpec spec;
    std::vector<std::uint64_t> ids;
    std::vector<std::size_t> ps_begin;
    IdPositions positions;  ///< id → index in ids
    std::vector<float> rows;
    std::vector<float> gradients;
  };

  /// Asks the model which ids the batch uses, and lays out every table's buffers for them.
  void gather_rows(const typename M::Batch& batch) {
    const auto num_ps = static_cast<std::uint32_t>(client_.num_ps());
    row_requests_.clear();
    push_rows_.clear();
    views_.clear();
    for (std::size_t t = 0; t < batches_.size(); ++t) {
      TableState& table = batches_[t];
      table.ids.clear();
      model_.lookup(batch, t, table.ids);
      // The distinct ids in the order the batch first uses them, then grouped by ps by a
      // stable counting sort: each ps's ids are one run, in the same order on every run.
      table.positions.clear();
      table.positions.reserve(table.ids.size());
      table.ps_begin.assign(num_ps + 1, 0);
      ps_of_.clear();
      for (const std::uint64_t id : table.ids) {
        if (!table.positions.insert(id).second) continue;
        const std::uint32_t ps = row_owner(sharding_, table.spec.name, id, client_.members());
        if (ps >= num_ps) {
          throw Error(ErrorCode::kInvalidArgument, "the id sharding put row " + std::to_string(id) +
                                                       " of table '" + table.spec.name + "' on ps " +
                                                       std::to_string(ps) + " of " + std::to_string(num_ps));
        }
        ps_of_.push_back(ps);
        ++table.ps_begin[ps + 1];
      }
      for (std::uint32_t p = 0; p < num_ps; ++p) table.ps_begin[p + 1] += table.ps_begin[p];
      const std::span<const std::uint64_t> distinct = table.positions.ids();
      if (num_ps == 1) {
        table.ids.assign(distinct.begin(), distinct.end());
      } else {
        table.ids.resize(distinct.size());
        next_.assign(table.ps_begin.begin(), table.ps_begin.end() - 1);
        for (std::size_t i = 0; i < distinct.size(); ++i) table.ids[next_[ps_of_[i]]++] = distinct[i];
        table.positions.clear();
        for (const std::uint64_t id : table.ids) (void)table.positions.insert(id);  // numbered as ids
      }
      table.rows.resize(table.ids.size() * table.spec.dim);
      table.gradients.resize(table.ids.size() * table.spec.dim);
      // The pulls write into the rows; the pushes send the gradients.
      row_requests_.push_back({t, table.ids, table.ps_begin, table.rows});
      push_rows_.push_back({t, table.ids, table.ps_begin, table.gradients});
      views_.push_back({table.spec.dim, table.ids, table.rows, table.gradients, &table.positions});
    }
  }

  std::uint32_t index_;
  M model_;
  Client<T> client_;
  std::vector<PullRequest> all_;                   ///< every variable into the model
  std::vector<std::span<const float>> gradients_;  ///< the model's gradient buffers
  [[no_unique_address]] I sharding_;
  std::vector<TableState> batches_;                ///< by table: the current batch's rows
  std::vector<RowRequest> row_requests_;           ///< pulls into batches_' rows
  std::vector<RowRequest> push_rows_;              ///< pushes of batches_' gradients
  std::vector<TableBatch> views_;                  ///< what the model computes with
  std::vector<std::uint32_t> ps_of_;               ///< scratch: each distinct id's ps
  std::vector<std::size_t> next_;                  ///< scratch: where each ps's next id goes
  std::int64_t global_step_ = 0;
  bool pushing_ = false;                    ///< this step's push went out (or may have)
  StepResult interrupted_;                 ///< the step whose push is on its way
  std::int64_t interrupted_pull_step_ = 0;  ///< and the step its pull waits for
  std::int64_t pulled_step_ = -1;  ///< the model holds every variable as of this step or later
  bool paced_ = true;              ///< the sync policy makes workers wait for tokens
  bool finished_ = false;          ///< training is over
  bool ended_ = false;             ///< the chief ended it
  std::optional<detail::Recovery> ending_;  ///< wait_for_end's wait for a ps that is away
};

}  // namespace pulley
