// SPDX-License-Identifier: MIT
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/cluster/slurm.hpp"
#include "pulley/cluster/tf_config.hpp"
#include "pulley/core/error.hpp"

/// A job started by Open MPI's `mpirun`: each rank's task from the roles given in rank order
/// (as under Slurm) and Open MPI's environment. pulley does not link MPI: it reads the
/// variables mpirun sets and talks TCP as in any cluster of processes.

namespace pulley {

/// What a derived port base is taken from, for Open MPI's job id `job_id`: the id is its job
/// family << 16 | the job's number in the family, so the two are mixed (taken as they are,
/// the modulo of derived_slurm_port_base would see few distinct values).
inline std::uint64_t mpi_port_key(std::uint64_t job_id) noexcept {
  return (job_id >> 16U) ^ ((job_id & 0xffffU) * 40503U);
}

/// Builds this task's TfConfig from Open MPI's variables, read through `env`:
///   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE          this rank, the ranks
///   OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE  its place on its host
///   OMPI_MCA_ess_base_jobid                           only for the derived port base
/// `hosts` are the job's hosts in mpirun's order (its --host list); empty when every rank
/// runs on this host, which is then 127.0.0.1. `hostname` is this host's name (gethostname;
/// "": not checked): a rank on a host `hosts` names for another place is refused. Ranks fill the hosts in order, the same
/// number on each (mpirun's default mapping by slot, or `--map-by ppr:K:node`); the i-th
/// rank on a host listens on port_base + i, where port_base is `port_base`, or when nullopt
/// derived_slurm_port_base(mpi_port_key(job id), ranks per host) (two jobs seldom meet);
/// the ranks go to `roles` in their order ("ps:2,worker:2,chief:1": ranks 0-1 are the ps
/// tasks). The result is what parse_tf_config would return for the equivalent TF_CONFIG.
///
/// Throws kInvalidArgument ("MPI: ...") naming the problem: a missing or malformed variable,
/// role counts that are not the ranks', ranks that do not fill the hosts evenly, or a rank
/// whose place on its host is not the one its number maps to (another mapping, such as
/// --map-by node, which is refused rather than guessed), hosts not in mpirun's order, no
/// job id to derive the port base from, a port over 65535, bad roles.
template <SlurmEnvironment Env>
TfConfig mpi_config(const SlurmRoles& roles, std::optional<std::uint32_t> port_base,
                    const std::vector<std::string>& hosts, Env&& env, const std::string& hostname = {}) {
  const auto error = [](const std::string& what) { return Error(ErrorCode::kInvalidArgument, "MPI: " + what); };
  SlurmRoles checked;
  try {
    checked = detail::checked_slurm_roles(roles);
  } catch (const Error& e) {
    std::string message = e.message();
    if (message.starts_with("Slurm: ")) message.erase(0, 7);
    throw error(message);
  }
  const auto number = [&](std::string_view name, bool required) -> std::optional<std::uint64_t> {
    const std::optional<std::string> value = std::invoke(env, name);
    if (!value || value->empty()) {
      if (!required) return std::nullopt;
      throw error(std::string(name) + " is not set: start the job with mpirun");
    }
    const auto n = detail::slurm_number(*value);
    if (!n || *n > std::numeric_limits<std::uint32_t>::max()) {
      throw error(std::string(name) + " is not a number: \"" + *value + "\"");
    }
    return n;
  };
  const std::uint64_t rank = *number("OMPI_COMM_WORLD_RANK", true);
  const std::uint64_t size = *number("OMPI_COMM_WORLD_SIZE", true);
  const std::uint64_t local_rank = *number("OMPI_COMM_WORLD_LOCAL_RANK", true);
  const std::uint64_t local_size = *number("OMPI_COMM_WORLD_LOCAL_SIZE", true);
  if (size == 0 || rank >= size) {
    throw error("OMPI_COMM_WORLD_RANK " + std::to_string(rank) + " is out of range: the job has " +
                std::to_string(size) + " rank(s)");
  }
  std::uint64_t asked = 0;
  std::string listed;
  for (const auto& [role, count] : checked) {
    asked += count;
    listed += (listed.empty() ? "" : ",") + role + ":" + std::to_string(count);
  }
  if (asked != size) {
    throw error("the roles " + listed + " have " + std::to_string(asked) + " task(s) but mpirun started " +
                std::to_string(size) + " rank(s) (-np)");
  }
  std::vector<std::string> where = hosts;
  if (where.empty()) {
    if (local_size != size) {
      throw error("the ranks run on more than one host (" + std::to_string(local_size) + " of " +
                  std::to_string(size) + " here): name the hosts in mpirun's order with --mpi-hosts");
    }
    where = {"127.0.0.1"};
  }
  std::set<std::string_view> seen;
  for (const std::string& host : where) {
    if (host.empty()) throw error("--mpi-hosts names an empty host");
    if (!seen.insert(host).second) throw error("host \"" + host + "\" is named twice in --mpi-hosts");
  }
  if (size % where.size() != 0) {
    throw error(std::to_string(size) + " rank(s) do not fill " + std::to_string(where.size()) +
                " host(s) evenly: start the same number on each (mpirun --map-by ppr:K:node)");
  }
  const auto per_host = static_cast<std::uint32_t>(size / where.size());
  if (local_size != per_host || local_rank != rank % per_host) {
    throw error("rank " + std::to_string(rank) + " is rank " + std::to_string(local_rank) + " of " +
                std::to_string(local_size) + " on its host, not " + std::to_string(rank % per_host) + " of " +
                std::to_string(per_host) + " as filling the hosts in order would make it: start the ranks "
                "by slot (mpirun's default, or --map-by ppr:" + std::to_string(per_host) + ":node)");
  }
  if (!hostname.empty() && hosts.size() > 1) {
    // Names that are not the hosts' own (addresses, aliases) cannot be compared; a host
    // named for another rank's place can: --mpi-hosts is not in mpirun's order.
    const std::string& mine = where[rank / per_host];
    for (const std::string& host : where) {
      if (host == hostname && host != mine) {
        throw error("rank " + std::to_string(rank) + " runs on \"" + hostname + "\", but filling the hosts in "
                    "--mpi-hosts order puts it on \"" + mine + "\": give the hosts in mpirun's order");
      }
    }
  }
  std::uint32_t base = 0;
  if (port_base) {
    base = *port_base;
  } else {
    const std::optional<std::uint64_t> job = number("OMPI_MCA_ess_base_jobid", false);
    if (!job) throw error("OMPI_MCA_ess_base_jobid is not set, so no port base can be derived: give --mpi-port-base");
    base = derived_slurm_port_base(mpi_port_key(*job), per_host);
  }
  return detail::block_config(checked, rank, where, std::vector<std::uint32_t>(where.size(), per_host), base, "MPI");
}

/// mpi_config over this process's environment and host name. Throws kInvalidArgument when
/// the process was not started by mpirun (OMPI_COMM_WORLD_RANK is unset), and as mpi_config
/// does.
inline TfConfig mpi_config_from_environment(const SlurmRoles& roles, std::optional<std::uint32_t> port_base = std::nullopt,
                                            const std::vector<std::string>& hosts = {}) {
  char name[256] = {};
  const std::string hostname = ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string();
  return mpi_config(
      roles, port_base, hosts,
      [](std::string_view variable) -> std::optional<std::string> {
        const char* value = std::getenv(std::string(variable).c_str());
        return value == nullptr ? std::nullopt : std::optional<std::string>(value);
      },
      hostname);
}

}  // namespace pulley
