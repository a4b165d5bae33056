// SPDX-License-Identifier: MIT
#pragma once

#include <compare>
#include <cstdint>
#include <string>

namespace pulley {

/// A task of the cluster, named as in TF_CONFIG: a job ("ps", "worker", "chief",
/// "evaluator") and an index inside it.
struct Node {
  enum class Job : std::uint8_t { kPs, kWorker, kChief, kEvaluator };
  Job job = Job::kWorker;
  std::uint32_t index = 0;

  static constexpr Node ps(std::uint32_t i) noexcept { return {Job::kPs, i}; }
  static constexpr Node worker(std::uint32_t i) noexcept { return {Job::kWorker, i}; }
  static constexpr Node chief() noexcept { return {Job::kChief, 0}; }
  static constexpr Node evaluator() noexcept { return {Job::kEvaluator, 0}; }

  /// "ps:1", "worker:0", ...
  [[nodiscard]] std::string name() const {
    constexpr const char* jobs[] = {"ps", "worker", "chief", "evaluator"};
    return std::string(jobs[static_cast<int>(job)]) + ":" + std::to_string(index);
  }

  friend constexpr auto operator<=>(const Node&, const Node&) = default;
};

}  // namespace pulley
