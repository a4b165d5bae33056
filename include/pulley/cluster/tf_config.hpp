// SPDX-License-Identifier: MIT
#pragma once

/// TF_CONFIG, TensorFlow's description of a cluster and of this process's task in it, read
/// with nlohmann/json (link pulley::cluster).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "pulley/cluster/cluster_spec.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

namespace detail {

inline Error tf_config_error(const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, "TF_CONFIG: " + what);
}

/// A task index as JSON writes it: an integer in 0..2^32-1. A float is taken only when it is
/// such an integer exactly (2.0, as some writers print it); 1.5, -1, "1" and 1e10 are not.
inline std::optional<std::uint32_t> tf_config_index(const nlohmann::json& index) {
  constexpr std::uint32_t kMax = std::numeric_limits<std::uint32_t>::max();
  if (index.is_number_unsigned()) {
    const auto v = index.get<std::uint64_t>();
    if (v <= kMax) return static_cast<std::uint32_t>(v);
  } else if (index.is_number_integer()) {  // negative, or "-0"
    if (index.get<std::int64_t>() == 0) return 0;
  } else if (index.is_number_float()) {
    const auto v = index.get<double>();
    if (v >= 0 && v <= static_cast<double>(kMax) && std::floor(v) == v) {
      return static_cast<std::uint32_t>(v);
    }
  }
  return std::nullopt;
}

}  // namespace detail

/// Parses a TF_CONFIG document in TensorFlow's exact format,
///   {"cluster": {"chief": ["host:port"], "worker": [...], "ps": [...]},
///    "task": {"type": "worker", "index": 1}}
/// and checks it: known roles ("master" is read as "chief"), addresses that
/// parse_address accepts, no address listed twice in the whole cluster, a "ps" role, and a task
/// whose type is a role of the cluster and whose index (a non-negative integer, 0 when absent)
/// is in range. An evaluator need not be listed in the cluster (TensorFlow does not list it).
/// Addresses are kept as written. Throws kInvalidArgument "TF_CONFIG: ..." naming the problem,
/// malformed JSON included.
inline TfConfig parse_tf_config(std::string_view text) {
  using detail::tf_config_error;
  using nlohmann::json;
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    throw tf_config_error(std::string("invalid JSON: ") + e.what());
  }
  if (!doc.is_object()) throw tf_config_error("not a JSON object");

  TfConfig config;
  const auto cluster = doc.find("cluster");
  if (cluster == doc.end() || !cluster->is_object()) {
    throw tf_config_error("needs a \"cluster\" object");
  }
  // Every address seen so far, and which task it belongs to ("ps 0"), to name both of a pair.
  std::map<std::pair<std::string, std::uint16_t>, std::string> owners;
  for (const auto& [name, tasks] : cluster->get_ref<const json::object_t&>()) {
    bool known = false;
    for (std::string_view n : kRoleNames) known = known || name == n;
    if (!known) {
      throw tf_config_error("unknown role \"" + name + "\" (chief, worker, ps, evaluator)");
    }
    if (!tasks.is_array()) throw tf_config_error("role \"" + name + "\" must list addresses");
    const std::string role = name == "master" ? "chief" : name;
    auto& addresses = config.cluster.roles[role];
    for (const json& task : tasks) {
      const std::string* written = task.is_string() ? task.get_ptr<const std::string*>() : nullptr;
      const detail::AddressParts parts =
          written ? detail::scan_address(*written) : detail::AddressParts{{}, 0, "not a string"};
      if (!parts.problem.empty()) {
        throw tf_config_error("role \"" + role + "\" has an address that is not \"host:port\": " +
                              task.dump() + " (" + std::string(parts.problem) + ")");
      }
      const std::string owner = role + " " + std::to_string(addresses.size());
      const auto [seen, fresh] = owners.try_emplace({std::string(parts.host), parts.port}, owner);
      if (!fresh) {
        const Address address{seen->first.first, seen->first.second};
        throw tf_config_error("address '" + address.to_string() + "' is listed twice (" +
                              seen->second + " and " + owner + ")");
      }
      addresses.push_back(*written);
    }
  }

  const auto task = doc.find("task");
  if (task == doc.end() || !task->is_object()) {
    throw tf_config_error("needs a \"task\" object naming this process's type and index");
  }
  const auto type = task->find("type");
  if (type == task->end() || !type->is_string()) throw tf_config_error("task needs a \"type\"");
  const auto& type_name = type->get_ref<const std::string&>();
  config.task.type = type_name == "master" ? "chief" : type_name;
  const auto index = task->find("index");
  if (index != task->end()) {
    const auto i = detail::tf_config_index(*index);
    if (!i) throw tf_config_error("task \"index\" must be a non-negative integer");
    config.task.index = *i;
  }
  const auto& tasks = config.cluster.tasks(config.task.type);
  const bool listed = config.cluster.roles.contains(config.task.type);
  if (!listed && config.task.type != "evaluator") {
    throw tf_config_error("task type \"" + config.task.type + "\" is not a role of the cluster");
  }
  if (listed && config.task.index >= tasks.size()) {
    throw tf_config_error("task index " + std::to_string(config.task.index) +
                          " is out of range: role \"" + config.task.type + "\" has " +
                          std::to_string(tasks.size()) + " task(s)");
  }
  return config;  // no ps task: an all-reduce job's (the ps runner refuses it by name)
}

/// Reads and parses the TF_CONFIG environment variable; nullopt when it is unset or empty.
/// Throws as parse_tf_config does.
inline std::optional<TfConfig> tf_config_from_environment() {
  const char* text = std::getenv("TF_CONFIG");
  if (text == nullptr || *text == '\0') return std::nullopt;
  return parse_tf_config(text);
}

}  // namespace pulley
