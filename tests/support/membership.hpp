// SPDX-License-Identifier: MIT
#pragma once

// What the tests of a job whose ps tasks change (elastic.cpp, join.cpp) compare and run:
// two cuts' dense state, a table's rows by id, and two workers training TinyTableModel
// under sync R = N = 2.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <thread>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/client/worker.hpp"
#include "support/table_model.hpp"

namespace pulley::testing::membership {

/// Checks that two cuts hold the same dense state: step, pacer, values and slots.
inline void check_same_dense(const ModelState& a, const ModelState& b) {
  CHECK(a.global_step == b.global_step);
  CHECK(a.pacer == b.pacer);
  REQUIRE(a.variables.size() == b.variables.size());
  for (std::size_t v = 0; v < a.variables.size(); ++v) {
    CHECK(a.variables[v].values == b.variables[v].values);
    CHECK(a.variables[v].slots == b.variables[v].slots);
  }
}

/// A table's rows as a map: id → values and slots.
inline std::map<std::uint64_t, std::vector<float>> rows_of(const TableState& t) {
  std::map<std::uint64_t, std::vector<float>> out;
  for (std::size_t i = 0; i < t.ids.size(); ++i) {
    const auto at = t.rows.begin() + static_cast<std::ptrdiff_t>(i * t.stride());
    out[t.ids[i]] = std::vector<float>(at, at + static_cast<std::ptrdiff_t>(t.stride()));
  }
  return out;
}

/// The table the table tests train: admitted at its second sight, never evicted.
inline const TableSpec kSpec{"emb", TinyTableModel::kDim, Initializer::uniform(0.5F), 2, 0};

/// Two workers train TinyTableModel of kSpec from global step `from` to `to`, one fixed
/// batch per step each.
template <class Net>
void train_tables(Net& cluster, std::int64_t from, std::int64_t to) {
  static const auto batches = table_batches(40, 8, 300, 4);
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, TinyTableModel(kSpec), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = from; worker.step(batches[static_cast<std::size_t>(k * 2 + w)], to); ++k) {
      }
    });
  }
  for (auto& t : workers) t.join();
}

}  // namespace pulley::testing::membership
