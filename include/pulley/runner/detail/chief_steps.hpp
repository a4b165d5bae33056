// SPDX-License-Identifier: MIT
#pragma once

/// The chief's steps that stand alone (ChiefLoop, runner/chief_loop.hpp, takes them in
/// turn): a snapshot loaded into a model and checked finite, a checkpoint checked against
/// the model and saved, the ps tasks out of reach taken out of the job, and every ps
/// rolled back to the newest checkpoint.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/detail/recovery.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/log.hpp"
#include "pulley/sharding/ids.hpp"

namespace pulley::runner_detail {

using Clock = std::chrono::steady_clock;

/// Copies a snapshot's values into `model`'s parameters.
template <Model M>
void load(M& model, const Snapshot& shot) {
  for (std::size_t v = 0; v < shot.values.size(); ++v) {
    const auto into = model.parameter(v);
    std::copy(shot.values[v].begin(), shot.values[v].end(), into.begin());
  }
}

/// Throws kInternal naming the first variable of `shot` with a value that is not finite: a
/// job whose parameters diverged ends with an error, never "successfully". (The ps tasks
/// refuse updates that would get there; this is the last line, for any that slipped by.)
inline void check_finite(const Snapshot& shot, const std::vector<VariableSpec>& variables) {
  for (std::size_t v = 0; v < shot.values.size(); ++v) {
    if (!detail::all_finite(shot.values[v])) {
      throw Error(ErrorCode::kInternal, "the parameters of '" + variables.at(v).name +
                                            "' are not finite at global step " +
                                            std::to_string(shot.step) + ": training diverged");
    }
  }
}

/// Throws kFailedPrecondition unless the checkpoint `state` (read from `path`) holds
/// `model`'s variables (by name and shape) and its embedding tables (by name and dim).
template <Model M>
void check_model(const ModelState& state, const M& model, const std::filesystem::path& path) {
  const std::span<const VariableSpec> variables = model.variables();
  bool same = state.variables.size() == variables.size();
  for (std::size_t v = 0; same && v < variables.size(); ++v) {
    same = state.variables[v].spec.name == variables[v].name &&
           state.variables[v].spec.shape == variables[v].shape;
  }
  std::span<const TableSpec> tables;
  if constexpr (TableModel<M>) tables = model.tables();
  // A checkpoint without tables (of a dense job, or of format 1) restores the dense parts.
  if (!state.tables.empty()) {
    same = same && state.tables.size() == tables.size();
    for (std::size_t t = 0; same && t < tables.size(); ++t) {
      same =
          state.tables[t].spec.name == tables[t].name && state.tables[t].spec.dim == tables[t].dim;
    }
  }
  if (!same) {
    throw Error(ErrorCode::kFailedPrecondition,
                "checkpoint " + path.string() + " holds " + std::to_string(state.variables.size()) +
                    " variables and " + std::to_string(state.tables.size()) +
                    " tables that are not the model's " + std::to_string(variables.size()) +
                    " and " + std::to_string(tables.size()) +
                    " (by name and shape): is it another model's checkpoint directory?");
  }
}

/// Saves the checkpoint `read()` cuts from the ps tasks to `directory`, logs it, and
/// returns what it saved.
template <class Read>
ModelState save_checkpoint(CheckpointDirectory& directory, Read&& read) {
  const auto began = Clock::now();
  ModelState state = read();
  const auto cut = Clock::now();
  const std::filesystem::path path = directory.save(state);
  const auto saved = Clock::now();
  std::uint64_t bytes = 0, rows = 0;
  for (const VariableState& v : state.variables)
    bytes += 4 * v.values.size() * (1 + v.slots.size());
  for (const TableState& t : state.tables) {
    bytes += 4 * t.rows.size() + 12 * t.ids.size() + 16 * t.candidate_ids.size();
    rows += t.ids.size();
  }
  auto ms = [](Clock::duration d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  log(LogLevel::kInfo,
      "chief: checkpoint at global step " + std::to_string(state.global_step) + ": " +
          path.string() + " (" + std::to_string(bytes >> 20U) + " MiB" +
          (state.tables.empty() ? std::string() : ", " + std::to_string(rows) + " rows") +
          (state.incremental() ? ", incremental over global step " + std::to_string(state.base_step)
                               : std::string()) +
          "; read in " + ms(cut - began) + " ms, written in " + ms(saved - cut) + " ms)");
  return state;
}

/// The member ps tasks that do not answer now, asked twice a second apart and given a few
/// seconds each time (a busy ps answers by then), leave the job for good (Chief::leave),
/// unless none would be left; logs the new shape once.
template <Transport T>
void leave_unreachable(Chief<T>& chief, const ClientOptions& options) {
  const auto patience = std::min(options.request_timeout, std::chrono::milliseconds(5000));
  const std::vector<std::uint32_t> first = chief.unreachable(patience);
  if (first.empty() || first.size() == chief.members().size()) return;
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::vector<std::uint32_t> gone;
  for (const std::uint32_t ps : chief.unreachable(patience)) {
    if (std::find(first.begin(), first.end(), ps) != first.end()) gone.push_back(ps);
  }
  if (gone.empty() || gone.size() == chief.members().size()) return;
  try {
    chief.leave(gone);
  } catch (const Error& e) {  // too few would be left to hold the copies of the shards
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    log(LogLevel::kWarning,
        std::string("chief: the ps tasks not back stay members of the job: ") + e.what());
    return;
  }
  const auto seconds = std::to_string(options.ps_leave_after.count() / 1000);
  std::string names;
  for (const std::uint32_t ps : gone)
    names += (names.empty() ? "ps " : ", ps ") + std::to_string(ps);
  log(LogLevel::kWarning, "chief: " + names + " not back within " + seconds +
                              " s: " + (gone.size() == 1 ? "it leaves" : "they leave") +
                              " the job; membership " + std::to_string(chief.membership()) +
                              ": ps tasks " + describe_members(chief.members()) +
                              ", which take its shard from the checkpoint");
}

/// After losing a ps (`lost`): waits until every ps answers again (a restarted one, or a
/// new one on its address), then restores them all from the newest checkpoint in
/// `checkpoints` (or `initial`), at a new epoch; returns its global step. The updates
/// applied since that checkpoint are lost (each ps logs how many). With
/// `ClientOptions::ps_leave_after`, a ps still away after that long leaves the job for
/// good: the restore places the model over the others (Chief::leave), and nothing waits
/// for it again. Throws kUnavailable once `ClientOptions::recovery_timeout` passes without
/// every ps back.
template <Transport T, IdSharding I = HashIds>
std::int64_t roll_back(Chief<T>& chief, const Error& lost, const CheckpointDirectory* checkpoints,
                       const std::optional<ModelState>& initial, const ClientOptions& options,
                       const I& id_sharding = {}) {
  std::optional<std::pair<ModelState, std::filesystem::path>> latest;
  if (checkpoints != nullptr) latest = checkpoints->latest();
  if (!latest && !initial) throw lost;  // nothing to roll back to
  const ModelState& target = latest ? latest->first : *initial;
  const std::string from = latest ? latest->second.string() : std::string("the initial values");
  detail::Recovery recovery("chief", options);
  for (Error failure = lost;;) {
    recovery.wait(failure);
    if (options.ps_leave_after.count() > 0 && recovery.waited() >= options.ps_leave_after) {
      leave_unreachable(chief, options);
    }
    try {
      chief.restore(target, id_sharding);
      log(LogLevel::kWarning, "chief: every ps restored from " + from + " at global step " +
                                  std::to_string(target.global_step) + " after " +
                                  std::to_string(recovery.tries()) + " tries; training goes on");
      return target.global_step;
    } catch (const Error& e) {
      if (!detail::Recovery::may_recover(e.code())) throw;
      failure = e;
    }
  }
}

}  // namespace pulley::runner_detail
