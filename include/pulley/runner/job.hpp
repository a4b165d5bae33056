// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pulley/cluster/cluster_spec.hpp"
#include "pulley/cluster/mpi.hpp"
#include "pulley/cluster/slurm.hpp"
#include "pulley/cluster/tf_config.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/runner/credentials.hpp"
#include "pulley/runner/leave.hpp"

namespace pulley {

/// Where this process stands in a job: one task of a cluster of processes talking TCP, or
/// every task of the job in this one process (threads on the in-process transport).
struct Job {
  /// This task and the cluster's addresses; nullopt: every task runs in this process.
  std::optional<TfConfig> cluster;
  std::uint32_t local_ps = 1;       ///< ps tasks when in-process
  std::uint32_t local_workers = 2;  ///< workers when in-process
  /// What this task proves to the others (its job's name and secret), in a cluster of
  /// processes (runner/credentials.hpp says where they come from).
  Credentials credentials;
  /// This ps task or worker joins a running job: it asks the chief (at the chief task's
  /// address, or worker 0's in a cluster without one) to take it in (Chief::join; a
  /// worker: Chief::change_workers). Its cluster spec lists it after the job's ps tasks
  /// (or workers). An evaluator that joins is not taken in (it only reads): it reads the
  /// ps tasks that are the job's members from the chief, as a joining worker does.
  bool join = false;

  /// True when every task runs in this process.
  [[nodiscard]] bool in_process() const noexcept { return !cluster.has_value(); }
  /// Number of ps tasks in the job.
  [[nodiscard]] std::uint32_t num_ps() const {
    return cluster ? static_cast<std::uint32_t>(cluster->cluster.tasks("ps").size()) : local_ps;
  }
  /// Number of workers in the job.
  [[nodiscard]] std::uint32_t num_workers() const {
    return cluster ? static_cast<std::uint32_t>(cluster->cluster.tasks("worker").size())
                   : local_workers;
  }
  /// "worker:1", or "in-process" when every task runs here.
  [[nodiscard]] std::string name() const {
    return cluster ? cluster->task.type + ":" + std::to_string(cluster->task.index)
                   : std::string("in-process");
  }
};

/// How a job is described on the command line (see runner/flags.hpp for the flags). The
/// first that applies wins: `slurm_roles` (under srun), `mpi_roles` (under mpirun), `role`
/// with the host lists, the TF_CONFIG environment variable, and otherwise every task in
/// this process.
struct JobFlags {
  std::string role;                       ///< this task's role: ps, worker, chief, evaluator
  std::uint32_t task = 0;                 ///< this task's index among the tasks of its role
  std::vector<std::string> ps_hosts;      ///< "host:port" of every ps task
  std::vector<std::string> worker_hosts;  ///< "host:port" of every worker
  std::string chief_host;                 ///< "host:port" of the chief, if it has its own task
  std::string slurm_roles;                ///< e.g. "ps:1,worker:2,chief:1": the step's ranks
  /// The port of the first task on each node under Slurm; nullopt: derived from the job id
  /// (derived_slurm_port_base), so that two jobs sharing a node do not collide.
  std::optional<std::uint32_t> slurm_port_base;
  std::string mpi_roles;                  ///< e.g. "ps:2,worker:2,chief:1": mpirun's ranks
  std::vector<std::string> mpi_hosts;     ///< mpirun's hosts in order (empty: one host)
  /// The port of the first rank on each host under mpirun; nullopt: derived from the job id.
  std::optional<std::uint32_t> mpi_port_base;
  std::uint32_t ps = 1;       ///< ps tasks when in-process
  std::uint32_t workers = 2;  ///< workers when in-process
  std::string job_name;       ///< the job's name in handshakes ("": derived, credentials.hpp)
  std::string secret_file;    ///< a file holding the job's shared secret ("": see credentials.hpp)
  bool join = false;          ///< this ps task, worker or evaluator joins a running job (Job::join)
  /// Where this ps serves when it joins naming the chief alone (`--join --role ps
  /// --chief-host`, no host lists): "host:port".
  std::string address;
};

namespace runner_detail {

/// What a --join of another task is told.
inline constexpr std::string_view kJoinRoles =
    "--join is for a ps task, a worker or an evaluator of a cluster of processes";

/// The cluster of a task that joins naming the chief's address alone (--join --role
/// --chief-host, no host lists; under Slurm a job step of its own): the job's shape as the
/// chief's desk tells it (Shape), this task listed after the job's tasks of its role with
/// the next index (a ps at `flags.address`; an evaluator is evaluator 0, which every ps
/// lets in; ps tasks that left the job stay listed, so that indices keep their meaning: a
/// worker or an evaluator that joins connects to the members only). Once its
/// flags are found whole, it proves the job's secret (`task_credentials` of a joiner) and
/// waits for the chief for `patience`. Throws kInvalidArgument for missing flags, else what
/// reading the secret or reaching the chief threw.
inline TfConfig cluster_from_chief(const JobFlags& flags, std::chrono::milliseconds patience = std::chrono::seconds(60)) {
  const bool ps = flags.role == "ps";
  const bool evaluator = flags.role == "evaluator";
  if (!ps && !evaluator && flags.role != "worker") {
    throw Error(ErrorCode::kInvalidArgument, std::string(kJoinRoles));
  }
  if (flags.chief_host.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "--join without --ps-hosts and --worker-hosts needs the chief's address: --chief-host HOST:PORT "
                "(the chief logs it as it starts)");
  }
  if (ps && flags.address.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "a ps that joins naming the chief alone needs where it serves: --address HOST:PORT");
  }
  (void)parse_address(flags.chief_host);  // refused here, not as an unreachable chief
  if (ps) (void)parse_address(flags.address);
  TcpOptions tcp;
  tcp.credentials = task_credentials({}, flags.job_name, flags.secret_file, true);
  const Node asking{ps ? Node::Role::kPs : evaluator ? Node::Role::kEvaluator : Node::Role::kWorker, 0};  // no index yet
  ShapeReply shape = ask_shape(asking, flags.chief_host, tcp, patience);
  const auto num_ps = static_cast<std::uint32_t>(shape.ps.size());
  TfConfig config;
  config.cluster.roles["chief"] = {flags.chief_host};
  config.cluster.roles["ps"] = std::move(shape.ps);
  // Workers serve nothing: their addresses are never dialled, and the chief knows none.
  const std::uint32_t workers =
      std::max(shape.next_worker + (ps || evaluator ? 0U : 1U), shape.workers.empty() ? 1U : shape.workers.back() + 1);
  config.cluster.roles["worker"].assign(workers, "unknown:1");
  if (ps) {
    config.cluster.roles["ps"].push_back(flags.address);
    config.task = {"ps", num_ps};
  } else if (evaluator) {
    config.task = {"evaluator", 0};
  } else {
    config.task = {"worker", shape.next_worker};
  }
  log(LogLevel::kInfo, "the chief at " + flags.chief_host + " has ps tasks " + describe_members(shape.members) +
                           " and workers " + describe_members(shape.workers) + ": this task joins as " + config.task.type +
                           " " + std::to_string(config.task.index));
  return config;
}

}  // namespace runner_detail

/// The job `flags` describe (see JobFlags for the order). Throws kInvalidArgument naming the
/// problem: a malformed or inconsistent cluster, a task out of range, --slurm-roles outside a
/// Slurm step, --mpi-roles outside mpirun, a cluster without workers, a task type the runner has no role for.
inline Job resolve_job(const JobFlags& flags) {
  Job job;
  job.local_ps = flags.ps;
  job.local_workers = flags.workers;
  if (flags.ps == 0 || flags.workers == 0) {
    throw Error(ErrorCode::kInvalidArgument, "a job needs at least one ps task and one worker");
  }
  if (!flags.slurm_roles.empty() && !flags.mpi_roles.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "--slurm-roles and --mpi-roles exclude each other");
  }
  if (!flags.mpi_roles.empty()) {
    if (!flags.role.empty()) throw Error(ErrorCode::kInvalidArgument, "--mpi-roles and --role exclude each other");
    job.cluster = mpi_config_from_environment(parse_slurm_roles(flags.mpi_roles), flags.mpi_port_base, flags.mpi_hosts);
  } else if (!flags.slurm_roles.empty()) {
    if (!flags.role.empty()) {
      throw Error(ErrorCode::kInvalidArgument, "--slurm-roles and --role exclude each other");
    }
    job.cluster =
        slurm_config_from_environment(parse_slurm_roles(flags.slurm_roles), flags.slurm_port_base);
    if (!job.cluster) {
      throw Error(ErrorCode::kInvalidArgument,
                  "--slurm-roles needs a Slurm step (SLURM_PROCID is unset): run it under srun");
    }
  } else if (flags.join && !flags.role.empty() && flags.ps_hosts.empty() && flags.worker_hosts.empty()) {
    if (flags.job_name.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "--join needs the running job's name: --job-name (the chief logs it as it starts)");
    }
    job.cluster = runner_detail::cluster_from_chief(flags);
  } else if (!flags.role.empty()) {
    // The same document TF_CONFIG would hold, so that flags are checked by the same rules.
    nlohmann::json cluster = nlohmann::json::object();
    cluster["ps"] = flags.ps_hosts;
    cluster["worker"] = flags.worker_hosts;
    if (!flags.chief_host.empty()) cluster["chief"] = std::vector<std::string>{flags.chief_host};
    const nlohmann::json doc = {{"cluster", cluster},
                                {"task", {{"type", flags.role}, {"index", flags.task}}}};
    try {
      job.cluster = parse_tf_config(doc.dump());
    } catch (const Error& e) {
      std::string message = e.message();
      if (message.starts_with("TF_CONFIG: ")) message.erase(0, 11);
      throw Error(ErrorCode::kInvalidArgument, "cluster flags: " + message);
    }
  } else {
    job.cluster = tf_config_from_environment();
  }
  if (job.cluster) {
    const std::string& type = job.cluster->task.type;
    if (type != "ps" && type != "worker" && type != "chief" && type != "evaluator") {
      throw Error(ErrorCode::kInvalidArgument, "no role for a task of type '" + type + "'");
    }
    if (job.cluster->cluster.tasks("worker").empty()) {
      throw Error(ErrorCode::kInvalidArgument, "the cluster has no \"worker\" task");
    }
    if (job.cluster->cluster.tasks("chief").size() > 1) {
      throw Error(ErrorCode::kInvalidArgument, "the cluster lists more than one chief");
    }
    job.credentials = task_credentials(job.cluster->cluster, flags.job_name, flags.secret_file, flags.join);
  }
  if (flags.join) {
    if (!job.cluster || job.cluster->task.type == "chief") throw Error(ErrorCode::kInvalidArgument, std::string(runner_detail::kJoinRoles));
    if (job.cluster->task.type == "evaluator" && job.cluster->task.index != 0) {
      // The chief's desk, which a joining evaluator asks for the job's members, lets in evaluator 0 alone.
      throw Error(ErrorCode::kInvalidArgument, "an evaluator that joins is evaluator 0, not " +
                                                   std::to_string(job.cluster->task.index) + " (--task 0, or no --join)");
    }
    if (flags.job_name.empty()) {
      // The name derived from the cluster spec differs once the spec lists the new task,
      // and under Slurm from the job step (a task that joins runs in a step of its own).
      throw Error(ErrorCode::kInvalidArgument,
                  "--join needs the running job's name: --job-name (the chief logs it as it starts)");
    }
    job.join = true;
  }
  return job;
}

}  // namespace pulley
