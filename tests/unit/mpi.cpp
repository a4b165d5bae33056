// SPDX-License-Identifier: MIT
// The cluster read from Open MPI's rank variables: ranks fill the hosts in order and map to
// roles, tasks and addresses as under Slurm; a launch pulley cannot place (no mpirun,
// uneven hosts, another mapping) is refused naming the problem.
#include "pulley/cluster/mpi.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

using namespace pulley;

namespace {

using Env = std::map<std::string, std::string, std::less<>>;

std::function<std::optional<std::string>(std::string_view)> reader(const Env& env) {
  return [&env](std::string_view name) -> std::optional<std::string> {
    const auto it = env.find(name);
    return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
}

/// Open MPI's variables for rank `rank` of `size`, `per_host` on each host.
Env ranks(unsigned rank, unsigned size, unsigned per_host) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank % per_host)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(per_host)},
          {"OMPI_MCA_ess_base_jobid", "1640169473"}};
}

std::string error_of(const SlurmRoles& roles, const std::vector<std::string>& hosts, const Env& env,
                     std::optional<std::uint32_t> base = 21000) {
  try {
    (void)mpi_config(roles, base, hosts, reader(env));
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("no error thrown");
  return {};
}

const SlurmRoles kRoles = {{"ps", 2}, {"worker", 2}, {"chief", 1}};

}  // namespace

TEST_CASE("on one host every rank listens on 127.0.0.1, the i-th at base + i, and ranks go to roles in order") {
  for (unsigned rank = 0; rank < 5; ++rank) {
    const Env env = ranks(rank, 5, 5);
    const TfConfig config = mpi_config(kRoles, 21000, {}, reader(env));
    CHECK(config.cluster.tasks("ps") == std::vector<std::string>{"127.0.0.1:21000", "127.0.0.1:21001"});
    CHECK(config.cluster.tasks("worker") == std::vector<std::string>{"127.0.0.1:21002", "127.0.0.1:21003"});
    CHECK(config.cluster.tasks("chief") == std::vector<std::string>{"127.0.0.1:21004"});
    const TaskSpec expected = rank < 2 ? TaskSpec{"ps", rank} : rank < 4 ? TaskSpec{"worker", rank - 2} : TaskSpec{"chief", 0};
    CHECK(config.task.type == expected.type);
    CHECK(config.task.index == expected.index);
  }
}

TEST_CASE("on several hosts the ranks fill them in mpirun's order, and the port base derives from the job id") {
  const Env env = ranks(3, 6, 3);
  const TfConfig config = mpi_config(SlurmRoles{{"ps", 2}, {"worker", 3}, {"chief", 1}}, std::nullopt,
                                     {"node-a", "node-b"}, reader(env));
  const std::uint32_t base = derived_slurm_port_base(mpi_port_key(1640169473), 3);
  const auto at = [&](const char* host, std::uint32_t i) { return std::string(host) + ":" + std::to_string(base + i); };
  CHECK(config.cluster.tasks("ps") == std::vector<std::string>{at("node-a", 0), at("node-a", 1)});
  CHECK(config.cluster.tasks("worker") == std::vector<std::string>{at("node-a", 2), at("node-b", 0), at("node-b", 1)});
  CHECK(config.cluster.tasks("chief") == std::vector<std::string>{at("node-b", 2)});
  CHECK(config.task.type == "worker");
  CHECK(config.task.index == 1);
  CHECK(base >= kSlurmPortRangeBegin);
  CHECK(base + 2 < kSlurmPortRangeEnd);
  // Job ids of successive mpirun invocations differ in their family (the high 16 bits):
  // their bases spread over the range as Slurm's job ids do.
  std::set<std::uint32_t> bases;
  for (std::uint64_t family = 25000; family < 25400; ++family) {
    bases.insert(derived_slurm_port_base(mpi_port_key(family << 16U | 1U), 2));
  }
  CHECK(bases.size() == 400);
}

TEST_CASE("a launch pulley cannot place is refused, naming the problem") {
  CHECK(error_of(kRoles, {}, Env{}).find("MPI: OMPI_COMM_WORLD_RANK is not set: start the job with mpirun") !=
        std::string::npos);
  Env bad = ranks(0, 5, 5);
  bad["OMPI_COMM_WORLD_SIZE"] = "five";
  CHECK(error_of(kRoles, {}, bad).find("OMPI_COMM_WORLD_SIZE is not a number: \"five\"") != std::string::npos);
  CHECK(error_of(kRoles, {}, ranks(0, 4, 4)).find("have 5 task(s) but mpirun started 4 rank(s)") != std::string::npos);
  CHECK(error_of(kRoles, {}, ranks(0, 5, 3)).find("name the hosts in mpirun's order with --mpi-hosts") !=
        std::string::npos);
  CHECK(error_of(kRoles, {"a", "b"}, ranks(0, 5, 3)).find("do not fill 2 host(s) evenly") != std::string::npos);
  CHECK(error_of(kRoles, {"a", "a"}, ranks(0, 5, 3)).find("\"a\" is named twice") != std::string::npos);
  // --map-by node puts rank 1 on the second host: its local rank is 0, not 1.
  SlurmRoles six{{"ps", 2}, {"worker", 4}};
  Env by_node = ranks(1, 6, 3);
  by_node["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  CHECK(error_of(six, {"a", "b"}, by_node).find("--map-by ppr:3:node") != std::string::npos);
  CHECK(error_of(kRoles, {}, ranks(0, 5, 5), 65533).find("MPI: port base 65533 with 5 task(s) on a node") !=
        std::string::npos);
  // Workers only: an all-reduce job's launch, placed as any other.
  CHECK(mpi_config(SlurmRoles{{"worker", 5}}, 21000, {}, reader(ranks(0, 5, 5))).task.type == "worker");
  Env no_job = ranks(0, 5, 5);
  no_job.erase("OMPI_MCA_ess_base_jobid");
  CHECK(error_of(kRoles, {}, no_job, std::nullopt).find("give --mpi-port-base") != std::string::npos);
  CHECK_NOTHROW(mpi_config(kRoles, 21000, {}, reader(no_job)));  // a base given needs no job id
}

TEST_CASE("a rank on a host --mpi-hosts names for another place is refused: the list is not in mpirun's order") {
  const Env env = ranks(0, 6, 3);  // rank 0: the first host's
  const SlurmRoles six{{"ps", 2}, {"worker", 4}};
  try {
    (void)mpi_config(six, 21000, {"node-a", "node-b"}, reader(env), "node-b");
    FAIL("no error thrown");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("runs on \"node-b\", but filling the hosts in --mpi-hosts order puts it on "
                                     "\"node-a\"") != std::string::npos);
  }
  CHECK_NOTHROW(mpi_config(six, 21000, {"node-a", "node-b"}, reader(env), "node-a"));
  CHECK_NOTHROW(mpi_config(six, 21000, {"10.0.0.1", "10.0.0.2"}, reader(env), "node-a"));  // not comparable
}
