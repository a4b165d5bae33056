// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

/// What a cluster is, as data: TensorFlow's cluster and task description. Reading one is
/// elsewhere: from TF_CONFIG in pulley/cluster/tf_config.hpp, from Slurm's variables in
/// pulley/cluster/slurm.hpp.

namespace pulley {

/// The tasks of a cluster by role, and their addresses ("host:port"), as TensorFlow's
/// `ClusterSpec`: {"chief": [...], "worker": [...], "ps": [...], "evaluator": [...]}
/// (TensorFlow calls the tasks of one role a job; pulley keeps "job" for the training run).
struct ClusterSpec {
  /// Role ("chief", "worker", "ps", "evaluator") to its tasks' addresses, by task index.
  std::map<std::string, std::vector<std::string>, std::less<>> roles;

  /// Addresses of the tasks of `role` (empty if the cluster has none).
  [[nodiscard]] const std::vector<std::string>& tasks(std::string_view role) const {
    static const std::vector<std::string> kNone;
    auto it = roles.find(role);
    return it == roles.end() ? kNone : it->second;
  }
};

/// Which task this process is: its role and its index among the tasks of that role.
struct TaskSpec {
  /// Its role, TF_CONFIG's task "type" ("master" is already read as "chief").
  std::string type;
  /// The task's position in its role's address list.
  std::uint32_t index = 0;
};

/// A parsed TF_CONFIG document.
struct TfConfig {
  /// Every task of the cluster.
  ClusterSpec cluster;
  /// This process's task.
  TaskSpec task;
};

/// The roles pulley knows; "master" is TensorFlow's old name for the chief.
inline constexpr std::string_view kRoleNames[] = {"chief", "worker", "ps", "evaluator", "master"};

}  // namespace pulley
