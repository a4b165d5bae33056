// SPDX-License-Identifier: MIT
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "pulley/core/error.hpp"

namespace pulley {

/// A task of the cluster, named as in TF_CONFIG: its role ("ps", "worker", "chief",
/// "evaluator"; TF_CONFIG's task "type", the name of its job in a TensorFlow cluster spec)
/// and its index among the tasks of that role.
struct Node {
  /// What a task does.
  enum class Role : std::uint8_t { kPs, kWorker, kChief, kEvaluator };
  Role role = Role::kWorker;
  std::uint32_t index = 0;

  static constexpr Node ps(std::uint32_t i) noexcept { return {Role::kPs, i}; }
  static constexpr Node worker(std::uint32_t i) noexcept { return {Role::kWorker, i}; }
  static constexpr Node chief() noexcept { return {Role::kChief, 0}; }
  static constexpr Node evaluator() noexcept { return {Role::kEvaluator, 0}; }

  /// "ps", "worker", "chief" or "evaluator".
  static constexpr const char* role_name(Role role) noexcept {
    constexpr const char* roles[] = {"ps", "worker", "chief", "evaluator"};
    return static_cast<unsigned>(role) < 4 ? roles[static_cast<unsigned>(role)] : "unknown";
  }

  /// "ps:1", "worker:0", ...
  [[nodiscard]] std::string name() const {
    return std::string(role_name(role)) + ":" + std::to_string(index);
  }

  /// Its fields on the wire (see protocol/messages.hpp).
  template <class Archive>
  void serialize(Archive& archive) {
    archive(role, index);
  }

  friend constexpr auto operator<=>(const Node&, const Node&) = default;
};

/// A set of roles: who may send a message (`kSenders` on each request, in protocol/messages/).
class RoleSet {
 public:
  /// The roles listed.
  constexpr RoleSet(std::initializer_list<Node::Role> roles) noexcept {
    for (const Node::Role role : roles) bits_ = static_cast<std::uint8_t>(bits_ | bit(role));
  }
  /// Every role.
  static constexpr RoleSet all() noexcept {
    return {Node::Role::kPs, Node::Role::kWorker, Node::Role::kChief, Node::Role::kEvaluator};
  }
  /// True if `role` is in the set.
  [[nodiscard]] constexpr bool contains(Node::Role role) const noexcept {
    return (bits_ & bit(role)) != 0;
  }
  /// "chief", "worker or chief", ...
  [[nodiscard]] std::string describe() const {
    std::string out;
    for (unsigned j = 0; j < 4; ++j) {
      if (!contains(static_cast<Node::Role>(j))) continue;
      if (!out.empty()) out += " or ";
      out += Node::role_name(static_cast<Node::Role>(j));
    }
    return out.empty() ? "nobody" : out;
  }

 private:
  static constexpr std::uint8_t bit(Node::Role role) noexcept {
    return static_cast<std::uint8_t>(1U << static_cast<unsigned>(role));
  }
  std::uint8_t bits_ = 0;
};

/// Why `tasks` is no set of the job's task indices of one role (its ps tasks, or its
/// workers), or "" when it is one: not empty, ascending, each listed once. `role` names
/// one of them in the answer ("ps task", "worker").
[[nodiscard]] inline std::string check_task_set(std::span<const std::uint32_t> tasks, std::string_view role) {
  if (tasks.empty()) return "a job needs at least one " + std::string(role);
  for (std::size_t i = 1; i < tasks.size(); ++i) {
    if (tasks[i] <= tasks[i - 1]) return "the " + std::string(role) + "s must be ascending task indices, each listed once";
  }
  return {};
}

/// Throws kInvalidArgument, `context` before the reason, unless `tasks` is a set of task
/// indices of one role (check_task_set).
inline void require_task_set(std::span<const std::uint32_t> tasks, std::string_view role, std::string_view context = {}) {
  if (std::string why = check_task_set(tasks, role); !why.empty()) throw Error(ErrorCode::kInvalidArgument, std::string(context) + why);
}

/// Task indices (the job's ps tasks, or its workers) as log lines name them: "{0, 2}".
[[nodiscard]] inline std::string describe_members(std::span<const std::uint32_t> members) {
  std::string text = "{";
  for (std::size_t i = 0; i < members.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(members[i]);
  return text + "}";
}

}  // namespace pulley
