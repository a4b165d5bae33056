// SPDX-License-Identifier: MIT
#pragma once

/// ChiefLoop's schedule (declared in runner/chief_loop.hpp, which includes this header at
/// its end): the first step (initialized, restored, or adopted from the live ps tasks), the
/// wait for each step due, and the checkpoints and evaluations taken there.

#include "pulley/runner/chief_loop.hpp"

namespace pulley::runner_detail {

template <Model M, Transport T, IdSharding I>
std::int64_t ChiefLoop<M, T, I>::begin() {
  const std::int64_t step = begin_tables();
  if (dense_ != nullptr) dense_->launch();
  return step;
}

template <Model M, Transport T, IdSharding I>
std::int64_t ChiefLoop<M, T, I>::begin_tables() {
  if (chief_.ps_serving() && dense_ != nullptr) {
    throw Error(
        ErrorCode::kFailedPrecondition,
        "the ps tasks still serve a hybrid job whose chief was lost: its dense variables were on "
        "the lost "
        "chief's ring; start the whole job again, and it resumes from the newest checkpoint");
  }
  if (chief_.ps_serving()) {
    if constexpr (TableModel<M>) {
      start_step_ = chief_.adopt(model_.variables(), std::span<const TableSpec>(model_.tables()));
    } else {
      start_step_ = chief_.adopt(model_.variables());
    }
    note_restored(start_step_);  // the next checkpoint is a full one
    adopted_ = true;
    log(LogLevel::kInfo,
        "chief: every ps still serves the job, at global step " + std::to_string(start_step_) +
            ": going on from their live state (the chief before this one was lost)");
    return start_step_;
  }
  if (auto latest = checkpoints_ ? checkpoints_->latest() : std::nullopt) {
    check_model(latest->first, model_, latest->second);
    if (dense_ != nullptr) {  // the tables go to the ps tasks, the variables to the replica
      ModelState tables = latest->first;
      tables.variables.clear();
      chief_.restore(tables, id_sharding_);
      dense_->begin(&latest->first);
    } else {
      chief_.restore(latest->first, id_sharding_);
    }
    start_step_ = latest->first.global_step;
    note_restored(start_step_);
    log(LogLevel::kInfo, "chief: resumed from " + latest->second.string() + " at global step " +
                             std::to_string(start_step_));
    return start_step_;
  }
  const auto initialize = [&] {
    if constexpr (TableModel<M>) {
      if (dense_ != nullptr) {
        dense_->begin(nullptr);
        ModelState state =
            chief_.initialize_and_save({}, std::span<const TableSpec>(model_.tables()));
        state.variables = dense_->variables();
        return state;
      }
      return chief_.initialize_and_save(model_.variables(),
                                        std::span<const TableSpec>(model_.tables()));
    } else {
      return chief_.initialize_and_save(model_.variables());
    }
  };
  if (checkpoints_) {
    note_saved(save_checkpoint(*checkpoints_, initialize));
  } else {
    initial_ = initialize();
  }
  return 0;
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::step_to(ChiefSchedule& schedule) {
  if (dense_ != nullptr) return step_to_with_dense(schedule);
  const ChiefSchedule::Due due = schedule.next();
  std::optional<ModelState> saved;
  std::optional<Snapshot> shot;
  bool reached = true;
  voided_ = false;
  std::function<bool()> meanwhile;
  if (joins_ != nullptr || CopyingTransport<T>)
    meanwhile = [this] { return take_joins_meanwhile(); };
  if (due.checkpoint) {
    reached = chief_.wait_for_step_until(due.step, due.deadline, meanwhile).has_value();
    if (voided_) return;  // a ps joined: the ps tasks were restored, the wait is done again
    if (reached)
      saved = save_checkpoint(*checkpoints_,
                              [&] { return chief_.save_state_at(due.step, cut_rows()); });
  } else {
    shot = chief_.snapshot_until(due.step, due.deadline, meanwhile);
    if (voided_) return;
    reached = shot.has_value();
  }
  if (!reached)
    saved =
        save_checkpoint(*checkpoints_, [&] { return chief_.save_state(cut_rows()); });  // by time
  if (saved) {
    note_saved(*saved);
    schedule.saved(saved->global_step, Clock::now());
  }
  if (!reached || !due.evaluation) return;
  if (!shot) {
    if (saved && saved->global_step == due.step) {  // the checkpoint is this step's values
      shot.emplace();
      shot->step = saved->global_step;
      shot->consistent = true;
      for (VariableState& v : saved->variables) shot->values.push_back(std::move(v.values));
    } else {
      shot = chief_.snapshot(due.step);
    }
  }
  evaluate(*shot, due.last, saved && saved->global_step == shot->step ? &*saved : nullptr);
  schedule.evaluated();
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::step_to_with_dense(ChiefSchedule& schedule) {
  const ChiefSchedule::Due due = schedule.next();
  const bool reached = dense_step_until(due.step, due.deadline);
  const bool saving = !reached || due.checkpoint;
  const bool evaluating = reached && due.evaluation;
  if (!saving && !evaluating) return;
  const std::int64_t at = dense_->pause();
  std::vector<VariableState> dense;
  std::optional<ModelState> cut;
  try {  // only what must see training stand still: the replica's copy and the ps tasks' cut
    dense = dense_->variables();
    if (saving) {
      // The workers' pushes of that step (none comes after it), within a ring's timeout.
      if (!dense_step_until(at, Clock::now() + training_.client.request_timeout)) {
        throw Error(ErrorCode::kDeadlineExceeded,
                    "the workers did not push global step " + std::to_string(at) + " within " +
                        std::to_string(training_.client.request_timeout.count()) +
                        " ms of taking it (--request-timeout-ms): is one lost?");
      }
      cut = chief_.save_state_at(at, cut_rows());
    }
  } catch (...) {
    dense_->resume();
    throw;
  }
  dense_->resume();  // training goes on while the snapshot is taken and the checkpoint written
  Snapshot shot;
  shot.step = at;
  shot.consistent = true;  // the dense values are one step's
  if (evaluating) {
    for (VariableState& v : dense) shot.values.push_back(cut ? v.values : std::move(v.values));
  }
  std::optional<ModelState> saved;
  if (cut) {
    cut->variables = std::move(dense);
    saved = save_checkpoint(*checkpoints_, [&] { return std::move(*cut); });
    note_saved(*saved);
    schedule.saved(saved->global_step, Clock::now());
  }
  if (!evaluating) return;
  evaluate(shot, due.last, saved ? &*saved : nullptr);
  schedule.evaluated();
}

template <Model M, Transport T, IdSharding I>
bool ChiefLoop<M, T, I>::dense_step_until(std::int64_t step, Clock::time_point deadline) {
  return chief_
      .wait_for_step_until(step, deadline,
                           [this] {
                             dense_->check();
                             return false;
                           })
      .has_value();
}

template <Model M, Transport T, IdSharding I>
CutRows ChiefLoop<M, T, I>::cut_rows() const {
  const std::int64_t every = std::max<std::int64_t>(training_.checkpoint.full_every, 1);
  if (base_ < 0 || incremental_in_a_row_ + 1 >= every) return CutRows{-1, base_};
  return CutRows{base_, base_};
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::note_saved(const ModelState& state) {
  if (!checkpoints_->wrote()) return note_restored(state.global_step);
  base_ = state.global_step;
  incremental_in_a_row_ = state.incremental() ? incremental_in_a_row_ + 1 : 0;
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::note_restored(std::int64_t step) {
  base_ = step;
  incremental_in_a_row_ = std::numeric_limits<std::int64_t>::max() / 2;
}

template <Model M, Transport T, IdSharding I>
void ChiefLoop<M, T, I>::evaluate(const Snapshot& shot, bool last, const ModelState* saved) {
  if (dense_ != nullptr) {
    const auto variables = std::span<const VariableSpec>(model_.variables());
    check_finite(shot, {variables.begin(), variables.end()});
  } else {
    check_finite(shot, chief_.variables());
  }
  Evaluation evaluation;
  evaluation.step = shot.step;
  evaluation.consistent = shot.consistent;
  evaluation.last = last;
  evaluation.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  evaluation.samples_per_s =
      static_cast<double>((shot.step - start_step_) * training_.samples_per_step) /
      std::max(evaluation.seconds, 1e-9);
  if (evaluation.last) {
    evaluation.stats = chief_.stats();
    evaluation.workers.assign(chief_.workers().begin(), chief_.workers().end());
  }
  EvaluationScores scores(metrics_, "chief", shot.step);
  evaluation.report = scores.reporter();
  std::vector<CheckpointRows> saved_rows;
  if constexpr (TableModel<M>) {
    if (saved != nullptr && !saved->tables.empty() && !saved->incremental()) {
      saved_rows = checkpoint_rows(*saved);
      evaluation.rows = [&saved_rows](std::size_t t, std::span<const std::uint64_t> ids,
                                      std::span<float> out) { saved_rows.at(t).lookup(ids, out); };
    } else {
      evaluation.rows = [this](std::size_t t, std::span<const std::uint64_t> ids,
                               std::span<float> out) {
        const std::vector<float> read =
            chief_.read_rows(model_.tables()[t].name, ids, id_sharding_);
        if (read.size() != out.size())
          throw Error(ErrorCode::kInvalidArgument, "rows: `out` does not fit the rows");
        std::copy(read.begin(), read.end(), out.begin());
      };
    }
  }
  if (training_.evaluate) {
    load(model_, shot);
    training_.evaluate(model_, evaluation);
    scores.commit();
  } else {
    log(LogLevel::kInfo, "chief: global step " + std::to_string(shot.step) + " of " +
                             std::to_string(training_.last_step) + ", " +
                             std::to_string(static_cast<long long>(evaluation.samples_per_s)) +
                             " samples/s");
  }
}

}  // namespace pulley::runner_detail
