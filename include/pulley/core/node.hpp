// SPDX-License-Identifier: MIT
#pragma once

#include <compare>
#include <cstdint>
#include <initializer_list>
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

  /// "ps", "worker", "chief" or "evaluator".
  static constexpr const char* job_name(Job job) noexcept {
    constexpr const char* jobs[] = {"ps", "worker", "chief", "evaluator"};
    return static_cast<unsigned>(job) < 4 ? jobs[static_cast<unsigned>(job)] : "unknown";
  }

  /// "ps:1", "worker:0", ...
  [[nodiscard]] std::string name() const {
    return std::string(job_name(job)) + ":" + std::to_string(index);
  }

  /// Its fields on the wire (see messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(job, index);
  }

  friend constexpr auto operator<=>(const Node&, const Node&) = default;
};

/// A set of jobs: who may send a message (`kSenders` in messages.hpp).
class JobSet {
 public:
  /// The jobs listed.
  constexpr JobSet(std::initializer_list<Node::Job> jobs) noexcept {
    for (const Node::Job job : jobs) bits_ = static_cast<std::uint8_t>(bits_ | bit(job));
  }
  /// Every job.
  static constexpr JobSet all() noexcept {
    return {Node::Job::kPs, Node::Job::kWorker, Node::Job::kChief, Node::Job::kEvaluator};
  }
  /// True if `job` is in the set.
  [[nodiscard]] constexpr bool contains(Node::Job job) const noexcept {
    return (bits_ & bit(job)) != 0;
  }
  /// "chief", "worker or chief", ...
  [[nodiscard]] std::string describe() const {
    std::string out;
    for (unsigned j = 0; j < 4; ++j) {
      if (!contains(static_cast<Node::Job>(j))) continue;
      if (!out.empty()) out += " or ";
      out += Node::job_name(static_cast<Node::Job>(j));
    }
    return out.empty() ? "nobody" : out;
  }

 private:
  static constexpr std::uint8_t bit(Node::Job job) noexcept {
    return static_cast<std::uint8_t>(1U << static_cast<unsigned>(job));
  }
  std::uint8_t bits_ = 0;
};

}  // namespace pulley
