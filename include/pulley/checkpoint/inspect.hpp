// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "pulley/checkpoint/format.hpp"

namespace pulley::checkpoint {

/// What a checkpoint holds, as text (TensorFlow's `inspect_checkpoint`): its global step and
/// the sync policy's state, then per variable its shape, its optimizer slots and counters,
/// per embedding table its dim, rows and row slots, and with `statistics`, the smallest,
/// largest and mean value of each tensor (which reads and checks every tensor). Throws kDataLoss for a checkpoint that does not read back.
inline std::string describe(const std::filesystem::path& dir, bool statistics = false) {
  std::vector<std::uint64_t> rows;
  const ModelState state = detail::read_checkpoint(dir, statistics, nullptr, &rows);
  std::string out = "checkpoint " + dir.string() + "\n  global step " +
                    std::to_string(state.global_step) +
                    (state.incremental() ? " (incremental: the tables' rows changed since global step " +
                                               std::to_string(state.base_step) + ")"
                                         : std::string()) +
                    "\n  sync policy state [";
  for (std::size_t i = 0; i < state.pacer.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(state.pacer[i]);
  }
  out += "]\n";
  auto stats = [&](const std::vector<float>& v) {
    if (!statistics || v.empty()) return std::string();
    double sum = 0.0;
    for (const float x : v) sum += x;
    char text[96];
    std::snprintf(text, sizeof text, "  min %.6g max %.6g mean %.6g",
                  static_cast<double>(*std::min_element(v.begin(), v.end())),
                  static_cast<double>(*std::max_element(v.begin(), v.end())),
                  sum / static_cast<double>(v.size()));
    return std::string(text);
  };
  for (const VariableState& v : state.variables) {
    std::string shape;
    for (std::size_t d = 0; d < v.spec.shape.size(); ++d) {
      shape += (d ? ", " : "") + std::to_string(v.spec.shape[d]);
    }
    out += "  " + v.spec.name + " [" + shape + "]" + stats(v.values) + "\n";
    for (const SlotState& s : v.slots) out += "    slot " + s.name + stats(s.values) + "\n";
    for (std::size_t c = 0; c < v.counter_names.size(); ++c) {
      out += "    counter " + v.counter_names[c] + ":";
      for (const PartCounters& p : v.counters) {
        out += " rows [" + std::to_string(p.rows.begin) + ", " + std::to_string(p.rows.end) +
               ") = " + std::to_string(p.values[c]) + ";";
      }
      out.back() = '\n';
    }
  }
  for (std::size_t k = 0; k < state.tables.size(); ++k) {
    const TableState& t = state.tables[k];
    std::string slots;
    for (const std::string& name : t.slot_names) {
      if (!slots.empty()) slots += ", ";
      slots += name;
    }
    out += "  table " + t.spec.name + " dim " + std::to_string(t.spec.dim) + ", " + std::to_string(rows[2 * k]) +
           (state.incremental() ? " rows changed, " + std::to_string(rows[2 * k + 1]) + " evicted" : std::string(" rows")) +
           ", slots [" + slots + "]" + stats(t.rows) + "\n";
  }
  return out;
}

}  // namespace pulley::checkpoint
