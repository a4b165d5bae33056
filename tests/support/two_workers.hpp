// SPDX-License-Identifier: MIT
#pragma once

// Two workers training the linear model of linear_model.hpp under sync R = N = 2 on an
// in-process cluster (support/cluster.hpp), each on batches of fixed rows: what the
// checkpoint and membership tests run between their cuts, restores and kills.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

#include "pulley/checkpoint/model_state.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"

namespace pulley::testing::two_workers {

inline constexpr std::size_t kIn = 6, kOut = 4, kBatch = 4;

/// Worker w's batch of step k: rows (2k + w) · kBatch on, always the same.
inline LinearBatch batch_of(const LinearData& data, std::uint32_t w, std::int64_t k) {
  const std::size_t row = static_cast<std::size_t>((k * 2 + w) * static_cast<std::int64_t>(kBatch));
  return {std::span(data.x).subspan(row * kIn, kBatch * kIn), std::span(data.y).subspan(row * kOut, kBatch * kOut)};
}

/// Two workers step from global step `from` to `to` (one batch per step each, batch_of's),
/// each ready with what the ps tasks tell it.
template <class Net>
void run_steps(Net& cluster, const LinearData& data, std::int64_t from, std::int64_t to) {
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = from; worker.step(batch_of(data, w, k), to); ++k) {
      }
    });
  }
  for (auto& t : workers) t.join();
}

/// Starts two workers training from step `from` to `last` on threads of their own, each
/// request of theirs 3 ms late (so that training is still on when a test breaks something,
/// even once a loaded host held the test's thread back for a second), waiting out lost ps
/// tasks for up to 30 s; `failures` counts those that gave up. The caller joins the threads.
template <class Net>
std::vector<std::thread> start_steps(Net& cluster, const LinearData& data, std::int64_t from, std::int64_t last,
                                     std::atomic<int>& failures) {
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    cluster.network().delay(Node::worker(w), std::chrono::milliseconds(3));
    workers.emplace_back([&cluster, &data, &failures, from, last, w] {
      ClientOptions options;
      options.recovery_timeout = std::chrono::seconds(30);
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)), options);
      try {
        worker.wait_ready();
        const auto rows = static_cast<std::int64_t>(data.y.size() / kOut / kBatch / 2);  // steps of data
        for (std::int64_t k = from; worker.step(batch_of(data, w, k % rows), last); ++k) {
        }
      } catch (const Error&) {
        ++failures;
      }
    });
  }
  return workers;
}

/// Where a sync R = N = 2 job of the linear model ends on `num_ps` ps tasks that never
/// change (Adam, FixedShards{3}, seed 3) after global step `steps`: what a job whose ps
/// tasks change on the way must end at, bit for bit.
inline ModelState undisturbed_state(const LinearData& data, std::uint32_t num_ps, std::int64_t steps) {
  Cluster<FixedShards, Adam, SyncReplicas> cluster(num_ps, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  run_steps(cluster, data, 0, steps);
  ModelState state = chief.save_state();
  chief.shutdown();
  return state;
}

}  // namespace pulley::testing::two_workers
