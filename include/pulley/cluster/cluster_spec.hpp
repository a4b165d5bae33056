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

/// The jobs of a cluster and their tasks' addresses ("host:port"), as TensorFlow's
/// `ClusterSpec`: {"chief": [...], "worker": [...], "ps": [...], "evaluator": [...]}.
struct ClusterSpec {
  /// Job name ("chief", "worker", "ps", "evaluator") to its tasks' addresses, by task index.
  std::map<std::string, std::vector<std::string>, std::less<>> jobs;

  /// Addresses of `job`'s tasks (empty if the job is absent).
  [[nodiscard]] const std::vector<std::string>& tasks(std::string_view job) const {
    static const std::vector<std::string> kNone;
    auto it = jobs.find(job);
    return it == jobs.end() ? kNone : it->second;
  }
};

/// Which task this process is: a job name and an index into it.
struct TaskSpec {
  /// The job's name, as in ClusterSpec::jobs ("master" is already read as "chief").
  std::string type;
  /// The task's position in its job's address list.
  std::uint32_t index = 0;
};

/// A parsed TF_CONFIG document.
struct TfConfig {
  /// Every task of the cluster.
  ClusterSpec cluster;
  /// This process's task.
  TaskSpec task;
};

/// The job names pulley knows; "master" is TensorFlow's old name for the chief.
inline constexpr std::string_view kJobNames[] = {"chief", "worker", "ps", "evaluator", "master"};

}  // namespace pulley
