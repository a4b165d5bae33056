// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/client/client.hpp"
#include "pulley/client/detail/stall.hpp"
#include "pulley/core/log.hpp"

namespace pulley {

/// The chief's half of a checkpoint's cut (the ps's half is `ps/checkpoint_cut.hpp`): every
/// variable with its optimizer state, and the sync policy's state, read as one cut across
/// all ps tasks. Every ps is paused (at once, or the moment it completes `at_step`; pushes
/// that arrive then wait), each is brought to the same count of pushes taken from every
/// worker (the largest any had), read there, and resumed. Training stands still only while
/// the state is read.
template <Transport T>
ModelState read_state(Client<T>& client, std::int64_t at_step = 0) {
  if (!client.has_placement()) throw Error(ErrorCode::kFailedPrecondition, "no model registered yet");
  struct Resumer {  // whatever happens, the ps tasks go on
    Client<T>& client;
    ~Resumer() {
      try {
        client.template broadcast<Ack>([](std::size_t) { return Resume{}; }, client.options().request_timeout,
                                       "resume the ps tasks");
      } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
      }
    }
  } resumer{client};
  std::vector<PauseReply> paused;
  {
    CallGroup group;
    for (std::size_t ps = 0; ps < client.num_ps(); ++ps) group.add(client.transport().call(ps, Pause{at_step}, {}));
    detail::wait_gated(client.transport(), client.options(), group, at_step, "pause the ps tasks at step " + std::to_string(at_step));
    for (std::size_t ps = 0; ps < client.num_ps(); ++ps) paused.push_back(group.take_as<PauseReply>(ps));
  }
  std::vector<std::uint64_t> until;
  for (const PauseReply& p : paused) {
    if (until.size() < p.pushes.size()) until.resize(p.pushes.size(), 0);
    for (std::size_t w = 0; w < p.pushes.size(); ++w) until[w] = std::max(until[w], p.pushes[w]);
  }
  if (!paused[0].whole) {
    log(LogLevel::kWarning, "the optimizer keeps state it does not name (slots, counters): a "
                            "checkpoint holds the rest, and a restore starts that afresh");
  }
  ModelState state;
  const std::size_t num_slots = paused[0].slot_names.size();
  for (const VariableSpec& spec : client.variables()) {
    VariableState v;
    v.spec = spec;
    v.values.resize(spec.size());
    for (const std::string& name : paused[0].slot_names) {
      v.slots.push_back({name, std::vector<float>(spec.size())});
    }
    v.counter_names = paused[0].counter_names;
    state.variables.push_back(std::move(v));
  }
  const Placement& placement = client.placement();
  CallGroup group;
  for (std::size_t ps = 0; ps < client.num_ps(); ++ps) {
    PullTargets targets;
    for (const Part& part : placement.parts) {
      if (part.ps != ps) continue;
      VariableState& v = state.variables[part.variable];
      const std::size_t row = v.spec.row_size();
      const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
      targets.push_back(std::span(v.values).subspan(at, n));
      for (std::size_t k = 0; k < num_slots; ++k) {
        targets.push_back(std::span(v.slots[k].values).subspan(at, n));
      }
    }
    group.add(client.transport().call(ps, ReadState{until}, std::move(targets)));
  }
  group.wait(client.options().request_timeout, "read the ps tasks' state at one cut");
  for (std::size_t ps = 0; ps < client.num_ps(); ++ps) {
    const StateReply reply = group.take_as<StateReply>(ps);
    if (ps == 0) {
      state.global_step = reply.global_step;
      state.pacer = reply.pacer;
    } else if (reply.pacer != state.pacer) {
      log(LogLevel::kWarning, "ps " + std::to_string(ps) + " and ps 0 disagree on the sync "
                              "policy's state at the cut: the checkpoint keeps ps 0's");
    }
    for (const PartState& p : reply.parts) {
      if (p.part >= placement.parts.size() || placement.parts[p.part].ps != ps) {
        throw Error(ErrorCode::kInternal, "ps " + std::to_string(ps) + " answered for a part it does not hold");
      }
      const Part& part = placement.parts[p.part];
      state.variables[part.variable].counters.push_back({part.rows, p.counters});
    }
  }
  for (VariableState& v : state.variables) {
    std::sort(v.counters.begin(), v.counters.end(),
              [](const PartCounters& a, const PartCounters& b) { return a.rows.begin < b.rows.begin; });
  }
  return state;
}

/// Registers `state`'s model and sets every ps from it (Restore): values, optimizer state
/// (slots and counters matched by name: a checkpoint of another optimizer restores the
/// values alone), the sync policy's state, at a new epoch. The placement may differ from
/// the checkpoint's (another number of ps tasks): tensors are split anew, and each part
/// takes the counters of the saved part that held its first row.
template <Transport T>
void restore_state(Client<T>& client, const ModelState& state) {
  client.register_model(state.specs(), std::vector<TableSpec>(client.tables()), client.table_seed());
  const std::uint64_t epoch = client.epoch() + 1;
  const Placement& placement = client.placement();
  const std::vector<std::string>& slot_names = client.slot_names();
  const std::vector<std::string>& counter_names = client.counter_names();
  std::vector<Restore> messages(client.num_ps(), Restore{epoch, state.pacer, {}});
  bool whole = true;
  for (const Part& part : placement.parts) {
    const VariableState& v = state.variables[part.variable];
    const std::size_t row = v.spec.row_size();
    const std::size_t at = part.rows.begin * row, n = part.rows.size() * row;
    PartState ps{static_cast<std::uint32_t>(&part - placement.parts.data()), std::span<const float>(v.values).subspan(at, n), {}, {}};
    for (const std::string& name : slot_names) {
      const auto it = std::find_if(v.slots.begin(), v.slots.end(),
                                   [&](const SlotState& s) { return s.name == name; });
      if (it == v.slots.end() || v.slots.size() != slot_names.size()) {
        ps.slots.clear();
        whole = false;
        break;
      }
      ps.slots.push_back(std::span<const float>(it->values).subspan(at, n));
    }
    const auto saved = std::find_if(v.counters.begin(), v.counters.end(), [&](const PartCounters& c) {
      return c.rows.begin <= part.rows.begin && part.rows.begin < c.rows.end;
    });
    for (const std::string& name : counter_names) {
      const auto k = std::find(v.counter_names.begin(), v.counter_names.end(), name);
      if (saved == v.counters.end() || k == v.counter_names.end() ||
          v.counter_names.size() != counter_names.size()) {
        ps.counters.clear();
        whole = false;
        break;
      }
      ps.counters.push_back(saved->values[static_cast<std::size_t>(k - v.counter_names.begin())]);
    }
    messages[part.ps].parts.push_back(std::move(ps));
  }
  if (!whole) {
    log(LogLevel::kWarning, "the checkpoint's optimizer state does not match this optimizer's "
                            "slots and counters: the values are restored, the optimizer starts afresh");
  }
  client.template broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); },
                                 client.options().request_timeout, "restore the ps tasks");
  client.adopt_epoch(epoch);
}

}  // namespace pulley
