// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/detail/json.hpp"
#include "pulley/error.hpp"

namespace pulley {

/// The jobs of a cluster and their tasks' addresses ("host:port"), as TensorFlow's
/// `ClusterSpec`: {"chief": [...], "worker": [...], "ps": [...], "evaluator": [...]}.
struct ClusterSpec {
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
  std::string type;
  std::uint32_t index = 0;
};

/// A parsed TF_CONFIG document.
struct TfConfig {
  ClusterSpec cluster;
  TaskSpec task;
};

/// The job names pulley knows; "master" is TensorFlow's old name for the chief.
inline constexpr std::string_view kJobNames[] = {"chief", "worker", "ps", "evaluator", "master"};

/// Parses a TF_CONFIG document in TensorFlow's exact format,
///   {"cluster": {"chief": ["host:port"], "worker": [...], "ps": [...]},
///    "task": {"type": "worker", "index": 1}}
/// and checks it: known job names, "host:port" addresses with a port in 1..65535, a task
/// whose type is a job of the cluster and whose index is in range. An evaluator need not be
/// listed in the cluster (TensorFlow does not list it). Throws kInvalidArgument naming the
/// problem.
inline TfConfig parse_tf_config(std::string_view text) {
  auto fail = [](const std::string& what) -> Error {
    return Error(ErrorCode::kInvalidArgument, "TF_CONFIG: " + what);
  };
  const detail::Json doc = detail::JsonReader(text).document();
  const auto* root = doc.object();
  if (root == nullptr) throw fail("not a JSON object");

  TfConfig config;
  auto cluster = root->find("cluster");
  if (cluster == root->end() || cluster->second.object() == nullptr) {
    throw fail("needs a \"cluster\" object");
  }
  for (const auto& [job, tasks] : *cluster->second.object()) {
    bool known = false;
    for (std::string_view name : kJobNames) known = known || job == name;
    if (!known) throw fail("unknown job type \"" + job + "\" (chief, worker, ps, evaluator)");
    if (tasks.array() == nullptr) throw fail("job \"" + job + "\" must list addresses");
    auto& addresses = config.cluster.jobs[job == "master" ? "chief" : job];
    for (const detail::Json& t : *tasks.array()) {
      const std::string* address = t.string();
      const auto colon = address ? address->rfind(':') : std::string::npos;
      const std::string port = colon == std::string::npos ? "" : address->substr(colon + 1);
      const bool digits = !port.empty() && port.size() <= 5 &&
                          port.find_first_not_of("0123456789") == std::string::npos;
      const long p = digits ? std::stol(port) : 0;
      if (address == nullptr || colon == 0 || !digits || p < 1 || p > 65535) {
        throw fail("job \"" + job + "\" has an address that is not \"host:port\"" +
                   (address ? ": \"" + *address + "\"" : std::string()));
      }
      addresses.push_back(*address);
    }
  }

  auto task = root->find("task");
  if (task == root->end() || task->second.object() == nullptr) {
    throw fail("needs a \"task\" object naming this process's type and index");
  }
  const auto& t = *task->second.object();
  auto type = t.find("type");
  auto index = t.find("index");
  if (type == t.end() || type->second.string() == nullptr) throw fail("task needs a \"type\"");
  config.task.type = *type->second.string() == "master" ? "chief" : *type->second.string();
  const double* i = index == t.end() ? nullptr : index->second.number();
  if (index != t.end() && (i == nullptr || *i < 0 || *i > 4294967295.0 ||
                           *i != static_cast<double>(static_cast<std::uint32_t>(*i)))) {
    throw fail("task \"index\" must be a non-negative integer");
  }
  config.task.index = i ? static_cast<std::uint32_t>(*i) : 0;
  const auto& tasks = config.cluster.tasks(config.task.type);
  const bool listed = config.cluster.jobs.contains(config.task.type);
  if (!listed && config.task.type != "evaluator") {
    throw fail("task type \"" + config.task.type + "\" is not a job of the cluster");
  }
  if (listed && config.task.index >= tasks.size()) {
    throw fail("task index " + std::to_string(config.task.index) + " is out of range: job \"" +
               config.task.type + "\" has " + std::to_string(tasks.size()) + " task(s)");
  }
  if (config.cluster.tasks("ps").empty()) throw fail("the cluster has no \"ps\" job");
  return config;
}

/// Reads and parses the TF_CONFIG environment variable; nullopt when it is unset or empty.
inline std::optional<TfConfig> tf_config_from_environment() {
  const char* text = std::getenv("TF_CONFIG");
  if (text == nullptr || *text == '\0') return std::nullopt;
  return parse_tf_config(text);
}

}  // namespace pulley
