// SPDX-License-Identifier: MIT
// The cluster read from Slurm's task variables: hostlists and tasks-per-node lists expand as
// Slurm writes them, ranks map to jobs, tasks and addresses, and bad input is refused with a
// message that names the problem.
#include "pulley/cluster/slurm.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pulley/cluster/tf_config.hpp"

using namespace pulley;

namespace {

using Env = std::map<std::string, std::string, std::less<>>;

// What `f` throws: it must be a kInvalidArgument pulley::Error, and its message is returned.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const pulley::Error& e) {
    CHECK(e.code() == pulley::ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("no error thrown");
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return true;
  MESSAGE("\"" << text << "\" lacks \"" << part << "\"");
  return false;
}

// Two nodes with two tasks each, as srun starts them: ranks 0, 1 on node01 and ranks 2, 3 on
// node02 (SLURMD_NODENAME, which Slurm sets too, is left out where a test does not need it).
Env two_nodes(const std::string& rank) {
  return {{"SLURM_PROCID", rank},
          {"SLURM_JOB_ID", "1000"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NUM_TASKS", "4"},
          {"SLURM_STEP_NODELIST", "node[01-02]"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}};
}

// An explicit port base (TensorFlow's default), which most tests give to read addresses.
constexpr std::uint32_t kBase = 8888;

pulley::TfConfig slurm(const Env& env, const std::string& jobs = "ps:1,worker:2,chief:1",
                       std::optional<std::uint32_t> port_base = kBase) {
  return pulley::slurm_config(pulley::parse_slurm_roles(jobs), port_base,
                              [&env](std::string_view name) -> std::optional<std::string> {
                                auto it = env.find(name);
                                if (it == env.end()) return std::nullopt;
                                return it->second;
                              });
}

std::string slurm_error(const Env& env, const std::string& jobs = "ps:1,worker:2,chief:1",
                        std::optional<std::uint32_t> port_base = kBase) {
  return error_of([&] { slurm(env, jobs, port_base); });
}

Env with(Env env, const std::string& name, const std::string& value) {
  env[name] = value;
  return env;
}

Env without(Env env, const std::string& name) {
  env.erase(name);
  return env;
}

using Hosts = std::vector<std::string>;

}  // namespace

TEST_CASE("Slurm hostlists expand ranges, zero padding, single numbers and several groups") {
  using pulley::expand_slurm_hostlist;
  CHECK(expand_slurm_hostlist("node[01-03,07],gpu5") ==
        Hosts{"node01", "node02", "node03", "node07", "gpu5"});
  CHECK(expand_slurm_hostlist("n[8-10]") == Hosts{"n8", "n9", "n10"});
  CHECK(expand_slurm_hostlist("n[08-10]") == Hosts{"n08", "n09", "n10"});
  CHECK(expand_slurm_hostlist("n[007]") == Hosts{"n007"});
  CHECK(expand_slurm_hostlist("a[1-2],b[3],c") == Hosts{"a1", "a2", "b3", "c"});
  CHECK(expand_slurm_hostlist("rack[1-2]x[3-4]") ==
        Hosts{"rack1x3", "rack1x4", "rack2x3", "rack2x4"});
  CHECK(expand_slurm_hostlist("n[1-2]-ib[7]") == Hosts{"n1-ib7", "n2-ib7"});
  CHECK(expand_slurm_hostlist("login-1.cluster") == Hosts{"login-1.cluster"});
  CHECK(expand_slurm_hostlist("n2,n1") == Hosts{"n2", "n1"});  // order kept, not sorted
}

TEST_CASE("Slurm hostlists that are not comma lists of names with numeric brackets are refused") {
  auto error = [](const char* hostlist) {
    return error_of([&] { pulley::expand_slurm_hostlist(hostlist); });
  };
  CHECK(contains(error("n[1-3"), "malformed hostlist \"n[1-3\": '[' without ']'"));
  CHECK(contains(error("n1-3]"), "']' without '['"));
  CHECK(contains(error("n[1-[2]]"), "nested '['"));
  CHECK(contains(error("n[a-c]"), "\"a-c\" in [a-c] is not a number or a range lo-hi"));
  CHECK(contains(error("n[1-2-3]"), "is not a number or a range"));
  CHECK(contains(error("n[]"), "is not a number or a range"));
  CHECK(contains(error("n[1,,2]"), "is not a number or a range"));
  CHECK(contains(error("n[5-3]"), "range \"5-3\" runs backwards"));
  CHECK(contains(error("n[1-2]-ib"), "\"-ib\" after the last bracket of a name"));
  CHECK(contains(error("n[0-99999999999]"), "more than"));
  CHECK(contains(error("n[18446744073709551616]"), "is not a number"));  // past 2^64 − 1
}

namespace {

// What Debian 12's Slurm (22.05) prints for `scontrol show hostnames LIST`, recorded on
// 2026-11-26; "!" marks a list it refuses. Where pulley differs on purpose, `pulley` says
// what it does instead ("!": refuses), and why.
struct HostlistCase {
  const char* list;
  std::vector<std::string> slurm;
  std::optional<std::vector<std::string>> pulley = std::nullopt;
  const char* why = "";
};

const std::vector<HostlistCase>& hostlist_cases() {
  static const std::vector<HostlistCase> cases{
      {"n[1-3],", {"n1", "n2", "n3"}},
      {"a,,b", {"a", "b"}},
      {",n1", {"n1"}},
      {"n[1-2],,", {"n1", "n2"}},
      {"", {}},
      {"a, b", {"a", "b"}},
      {"n[1-2] m[3]", {"n1", "n2", "m3"}},
      {"n[ 1-2]", {"n01", "n02"}},  // strtoul skips the blank, the width counts it
      {"n[1 -2]", {"n01", "n02"}},
      {"n[1- 2]", {"n1", "n2"}},
      {"n[+1]", {"n01"}},
      {"n[1-]", {"n1"}},
      {"n[01-03,7]", {"n01", "n02", "n03", "n7"}},
      {"n[001-3]", {"n001", "n002", "n003"}},
      {"n[9-11]", {"n9", "n10", "n11"}},
      {"n[09-11]", {"n09", "n10", "n11"}},
      {"n[00-01]", {"n00", "n01"}},
      {"n[1,1]", {"n1", "n1"}},
      {"r[1-2]n[1-2]", {"r1n1", "r1n2", "r2n1", "r2n2"}},
      {"n[1-2]-ib[3-4]", {"n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"}},
      {"n[1-2]-ib", {"!"}},
      {"n[1-2]-ib,m", {"!"}},
      {"x[1]y", {"!"}},
      {"login-1.cluster", {"login-1.cluster"}},
      {"n2,n1", {"n2", "n1"}},
      {"n[18446744073709551615]", {"n18446744073709551615"}},
      {"n[4294967295-4294967296]", {"n4294967295", "n4294967296"}},
      {"n[3-1]", {"!"}},
      {"n[a]", {"!"}},
      {"n[0x1]", {"!"}},
      {"n[]", {"!"}},
      {"n[-2]", {"!"}},
      {"n[1-2,]", {"!"}},
      {"n[1-2-3]", {"!"}},
      {"n[1-[2]]", {"!"}},
      {"n[0-99999999]", {"!"}},
      {"n[1-2", {"n]"}, Hosts{"!"}, "an unbalanced bracket: Slurm prints a name made of the broken text"},
      {"n1-2]", {"n1-2]"}, Hosts{"!"}, "an unbalanced bracket"},
      // Slurm 22.05 crashes (SIGSEGV) on this one; it is two names.
      {"n[18446744073709551614-18446744073709551615]", {"?"},
       Hosts{"n18446744073709551614", "n18446744073709551615"}, "scontrol crashes on the top of the range"},
  };
  return cases;
}

std::vector<std::string> expanded_or_refused(const char* list) {
  try {
    return pulley::expand_slurm_hostlist(list);
  } catch (const pulley::Error&) {
    return {"!"};
  }
}

}  // namespace

TEST_CASE("Slurm hostlists expand as scontrol show hostnames does, on a table of cases") {
  for (const HostlistCase& c : hostlist_cases()) {
    CAPTURE(c.list);
    CHECK(expanded_or_refused(c.list) == c.pulley.value_or(c.slurm));
  }
}

TEST_CASE("the hostlist table matches the scontrol installed here (skipped without one)") {
  // Only where Slurm's client is installed (scripts/setup.sh installs slurm-client): a
  // minimal configuration lets `scontrol show hostnames` run without a cluster.
  if (std::system("command -v scontrol >/dev/null 2>&1") != 0) {
    MESSAGE("scontrol is not installed: the table stands as recorded from Slurm 22.05");
    return;
  }
  const std::string conf = "/tmp/pulley-slurm-" + std::to_string(::getpid()) + ".conf";
  REQUIRE(std::system(("printf 'ClusterName=pulley\\nSlurmctldHost=localhost\\n' > " + conf).c_str()) == 0);
  int compared = 0;
  for (const HostlistCase& c : hostlist_cases()) {
    if (c.slurm == Hosts{"?"}) continue;  // crashes scontrol
    CAPTURE(c.list);
    const std::string command =
        "SLURM_CONF=" + conf + " scontrol show hostnames '" + c.list + "' 2>&1";
    FILE* pipe = ::popen(command.c_str(), "r");
    REQUIRE(pipe != nullptr);
    std::string out;
    char buffer[256];
    while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) out += buffer;
    ::pclose(pipe);
    std::vector<std::string> said;
    bool refused = false;
    for (std::size_t at = 0; at < out.size();) {
      const std::size_t newline = std::min(out.find('\n', at), out.size());
      const std::string line = out.substr(at, newline - at);
      refused = refused || line.find("Invalid hostlist") != std::string::npos;
      if (!line.empty() && line.find("error") == std::string::npos && line.find("Invalid") == std::string::npos) {
        said.push_back(line);
      }
      at = newline + 1;
    }
    if (said.empty() && out.find("fatal") != std::string::npos) {
      FAIL("scontrol did not run: " << out);
    }
    CHECK((refused ? Hosts{"!"} : said) == c.slurm);
    ++compared;
  }
  std::remove(conf.c_str());
  CHECK(compared > 30);
}

TEST_CASE("Slurm tasks per node expand N(xM) repetitions in order") {
  using pulley::expand_slurm_tasks_per_node;
  using Counts = std::vector<std::uint32_t>;
  CHECK(expand_slurm_tasks_per_node("2(x3),1") == Counts{2, 2, 2, 1});
  CHECK(expand_slurm_tasks_per_node("4") == Counts{4});
  CHECK(expand_slurm_tasks_per_node("1,3(x2),2") == Counts{1, 3, 3, 2});
  for (const char* bad :
       {"", "2,", "x", "2(x)", "2(3)", "2(x3", "(x3)", "0", "2(x0)", "-1", "2x3"}) {
    CAPTURE(bad);
    CHECK(contains(error_of([&] { pulley::expand_slurm_tasks_per_node(bad); }),
                   "malformed tasks per node \"" + std::string(bad) + "\""));
  }
}

TEST_CASE("Slurm jobs strings parse in order, and bad ones are refused") {
  using pulley::parse_slurm_roles;
  CHECK(parse_slurm_roles("ps:1,worker:2,chief:1") ==
        pulley::SlurmRoles{{"ps", 1}, {"worker", 2}, {"chief", 1}});
  CHECK(parse_slurm_roles("master:1,ps:2") == pulley::SlurmRoles{{"chief", 1}, {"ps", 2}});
  CHECK(parse_slurm_roles("worker:4") == pulley::SlurmRoles{{"worker", 4}});  // all-reduce: workers only
  auto error = [](const char* jobs) { return error_of([&] { parse_slurm_roles(jobs); }); };
  CHECK(contains(error("ps:1,worker"), "\"worker\" is not role:count"));
  CHECK(contains(error("ps:1,worker:two"), "\"worker:two\" is not role:count"));
  CHECK(contains(error("ps:1,:2"), "\":2\" is not role:count"));
  CHECK(contains(error("ps:1,,worker:1"), "\"\" is not role:count"));
  CHECK(contains(error("ps:-1"), "is not role:count"));
  CHECK(contains(error("ps:1,gpu:2"), "unknown role \"gpu\""));
  CHECK(contains(error("ps:1,worker:0"), "role \"worker\" has no tasks"));
  CHECK(contains(error("ps:1,worker:1,ps:1"), "role \"ps\" is listed twice"));
  CHECK(contains(error("chief:1,master:1,ps:1"), "role \"chief\" is listed twice"));
  // A SlurmRoles built in code is checked as well.
  CHECK(contains(error_of([] {
                   pulley::slurm_config(
                       pulley::SlurmRoles{{"trainer", 1}}, 8888,
                       [](std::string_view) -> std::optional<std::string> { return "0"; });
                 }),
                 "unknown role \"trainer\""));
}

TEST_CASE(
    "Slurm ranks map to jobs in the given order, to their node and to base plus local index") {
  const Hosts ps{"node01:8888"};
  const Hosts workers{"node01:8889", "node02:8888"};
  const Hosts chief{"node02:8889"};
  const char* expected[][2] = {{"ps", "0"}, {"worker", "0"}, {"worker", "1"}, {"chief", "0"}};
  for (int rank = 0; rank < 4; ++rank) {
    CAPTURE(rank);
    const pulley::TfConfig c = slurm(two_nodes(std::to_string(rank)));
    CHECK(c.task.type == expected[rank][0]);
    CHECK(std::to_string(c.task.index) == expected[rank][1]);
    CHECK(c.cluster.tasks("ps") == ps);
    CHECK(c.cluster.tasks("worker") == workers);
    CHECK(c.cluster.tasks("chief") == chief);
    CHECK(c.cluster.roles.size() == 3);
  }
  // The same as the equivalent TF_CONFIG.
  const auto tf = parse_tf_config(
      R"({"cluster": {"ps": ["node01:8888"], "worker": ["node01:8889", "node02:8888"],
                      "chief": ["node02:8889"]}, "task": {"type": "worker", "index": 1}})");
  const auto s = slurm(two_nodes("2"));
  CHECK(s.cluster.roles == tf.cluster.roles);
  CHECK(s.task.type == tf.task.type);
  CHECK(s.task.index == tf.task.index);
}

TEST_CASE("Slurm: uneven nodes, another port base and another role order") {
  const Env env{{"SLURM_PROCID", "3"},
                {"SLURM_STEP_ID", "2"},
                {"SLURM_STEP_NUM_TASKS", "5"},
                {"SLURM_STEP_NODELIST", "gpu[7-8],cpu1"},
                {"SLURM_STEP_TASKS_PER_NODE", "3,1(x2)"}};
  const pulley::TfConfig c = slurm(env, "chief:1,worker:2,ps:2", 2222);
  CHECK(c.cluster.tasks("chief") == Hosts{"gpu7:2222"});
  CHECK(c.cluster.tasks("worker") == Hosts{"gpu7:2223", "gpu7:2224"});
  CHECK(c.cluster.tasks("ps") == Hosts{"gpu8:2222", "cpu1:2222"});
  CHECK(c.task.type == "ps");
  CHECK(c.task.index == 0);
  CHECK(slurm(with(env, "SLURM_PROCID", "4"), "chief:1,worker:2,ps:2", 2222).task.index == 1);
}

TEST_CASE("Slurm: the step's variables win, and the job's are the fallback") {
  const Env job_only{{"SLURM_PROCID", "1"},
                     {"SLURM_STEP_ID", "0"},
                     {"SLURM_NTASKS", "2"},
                     {"SLURM_JOB_NODELIST", "a[1-2]"},
                     {"SLURM_TASKS_PER_NODE", "1(x2)"}};
  const auto c = slurm(job_only, "ps:1,worker:1");
  CHECK(c.task.type == "worker");
  CHECK(c.cluster.tasks("worker") == Hosts{"a2:8888"});
  // A step on one node of a larger allocation: the step's variables describe it.
  Env step = job_only;
  step["SLURM_NTASKS"] = "8";
  step["SLURM_TASKS_PER_NODE"] = "4(x2)";
  step["SLURM_STEP_NUM_TASKS"] = "2";
  step["SLURM_STEP_NODELIST"] = "a2";
  step["SLURM_STEP_TASKS_PER_NODE"] = "2";
  const auto s = slurm(step, "ps:1,worker:1");
  CHECK(s.cluster.tasks("ps") == Hosts{"a2:8888"});
  CHECK(s.cluster.tasks("worker") == Hosts{"a2:8889"});
}

TEST_CASE("Slurm errors name the problem") {
  CHECK(contains(slurm_error(without(two_nodes("0"), "SLURM_PROCID")),
                 "Slurm: SLURM_PROCID is not set"));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_PROCID", "")), "SLURM_PROCID is not set"));
  CHECK(contains(slurm_error(without(two_nodes("0"), "SLURM_STEP_NUM_TASKS")),
                 "neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is set"));
  CHECK(contains(slurm_error(without(two_nodes("0"), "SLURM_STEP_NODELIST")),
                 "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set"));
  CHECK(contains(slurm_error(without(two_nodes("0"), "SLURM_STEP_TASKS_PER_NODE")),
                 "neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set"));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_PROCID", "x1")),
                 "SLURM_PROCID is not a number: \"x1\""));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_STEP_NUM_TASKS", "-4")),
                 "SLURM_STEP_NUM_TASKS is not a number"));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_STEP_NODELIST", "node[01-02")),
                 "malformed hostlist \"node[01-02\""));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_STEP_TASKS_PER_NODE", "2(x2")),
                 "malformed tasks per node \"2(x2\""));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_STEP_NODELIST", "node[01-03]")),
                 "SLURM_STEP_NODELIST names 3 node(s) but SLURM_STEP_TASKS_PER_NODE gives tasks "
                 "for 2"));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_STEP_NODELIST", "n1,n1")),
                 "node \"n1\" is listed twice in SLURM_STEP_NODELIST"));
  CHECK(contains(slurm_error(with(two_nodes("0"), "SLURM_STEP_TASKS_PER_NODE", "2,3")),
                 "SLURM_STEP_TASKS_PER_NODE places 5 task(s) but SLURM_STEP_NUM_TASKS is 4"));
  CHECK(
      contains(slurm_error(two_nodes("0"), "ps:1,worker:2"),
               "the roles ps:1,worker:2 have 3 task(s) but the step has 4 (SLURM_STEP_NUM_TASKS)"));
  CHECK(contains(slurm_error(two_nodes("0"), "ps:2,worker:2,chief:1"), "have 5 task(s)"));
  CHECK(contains(slurm_error(two_nodes("4")),
                 "SLURM_PROCID 4 is out of range: the step has 4 task(s)"));
  CHECK(contains(slurm_error(two_nodes("0"), "ps:1,worker:2,chief:1", 65535),
                 "port base 65535 with 2 task(s) on a node needs ports 65535..65536"));
  CHECK(slurm(two_nodes("3"), "ps:1,worker:2,chief:1", 65534).cluster.tasks("chief") ==
        Hosts{"node02:65535"});
  CHECK(contains(slurm_error(two_nodes("0"), "ps:1,worker:2,chief:1", 0), "port base 0"));
  CHECK(contains(slurm_error(two_nodes("0"), "ps:1,evaluator:2,trainer:1"),
                 "unknown role \"trainer\""));
}

TEST_CASE("Slurm: with no port base, the base comes from the job id and stays in the range") {
  using pulley::derived_slurm_port_base;
  // 20000 + (id mod floor(12768 / busiest)) * busiest
  CHECK(derived_slurm_port_base(1000, 2) == 22000);
  CHECK(derived_slurm_port_base(1001, 2) == 22002);
  CHECK(derived_slurm_port_base(1000, 4) == 24000);
  CHECK(derived_slurm_port_base(6384 + 7, 2) == 20014);  // 6384 slots of 2 ports: wraps
  CHECK(derived_slurm_port_base(5, 12768) == 20000);     // one slot, the whole range
  for (const std::uint32_t busiest : {1U, 2U, 3U, 7U, 64U, 1000U, 12768U}) {
    for (std::uint64_t id = 0; id < 40000; id += 37) {
      CAPTURE(busiest);
      CAPTURE(id);
      const std::uint32_t base = derived_slurm_port_base(id, busiest);
      REQUIRE(base >= pulley::kSlurmPortRangeBegin);
      REQUIRE(base + busiest <= pulley::kSlurmPortRangeEnd);
      if (busiest < 12768) CHECK(derived_slurm_port_base(id + 1, busiest) != base);
    }
  }
  CHECK(contains(error_of([] { derived_slurm_port_base(1, 12769); }),
                 "12769 task(s) on a node do not fit in the 12768 ports"));
  CHECK(contains(error_of([] { derived_slurm_port_base(1, 0); }), "0 task(s) on a node"));

  // Two jobs sharing node01: each task's addresses follow its job's id, and do not meet.
  const pulley::TfConfig a = slurm(two_nodes("0"), "ps:1,worker:2,chief:1", std::nullopt);
  const pulley::TfConfig b =
      slurm(with(two_nodes("0"), "SLURM_JOB_ID", "1001"), "ps:1,worker:2,chief:1", std::nullopt);
  CHECK(a.cluster.tasks("ps") == Hosts{"node01:22000"});
  CHECK(a.cluster.tasks("worker") == Hosts{"node01:22001", "node02:22000"});
  CHECK(b.cluster.tasks("ps") == Hosts{"node01:22002"});
  CHECK(b.cluster.tasks("worker") == Hosts{"node01:22003", "node02:22002"});
  // SLURM_JOBID, the old name, serves as well; neither set is an error only when it is needed.
  const Env old_name = with(without(two_nodes("0"), "SLURM_JOB_ID"), "SLURM_JOBID", "1001");
  CHECK(slurm(old_name, "ps:1,worker:2,chief:1", std::nullopt).cluster.tasks("ps") ==
        Hosts{"node01:22002"});
  CHECK(contains(
      slurm_error(without(two_nodes("0"), "SLURM_JOB_ID"), "ps:1,worker:2,chief:1", std::nullopt),
      "neither SLURM_JOB_ID nor SLURM_JOBID is set"));
  CHECK(slurm(without(two_nodes("0"), "SLURM_JOB_ID")).cluster.tasks("ps") == Hosts{"node01:8888"});
}

TEST_CASE("Slurm: an explicit port base wins over the derived one") {
  const pulley::TfConfig c = slurm(two_nodes("3"), "ps:1,worker:2,chief:1", 9000);
  CHECK(c.cluster.tasks("ps") == Hosts{"node01:9000"});
  CHECK(c.cluster.tasks("worker") == Hosts{"node01:9001", "node02:9000"});
  CHECK(c.cluster.tasks("chief") == Hosts{"node02:9001"});
}

TEST_CASE("Slurm: a task on another node than its rank maps to is refused, naming both") {
  // Ranks 0, 1 belong on node01 and ranks 2, 3 on node02.
  for (const auto& [rank, host] : {std::pair{"0", "node01"}, std::pair{"1", "node01"},
                                   std::pair{"2", "node02"}, std::pair{"3", "node02"}}) {
    CAPTURE(rank);
    CHECK_NOTHROW(slurm(with(two_nodes(rank), "SLURMD_NODENAME", host)));
  }
  // What --distribution=cyclic does: rank 1 on the second node.
  const std::string error = slurm_error(with(two_nodes("1"), "SLURMD_NODENAME", "node02"));
  CHECK(contains(error, "Slurm: rank 1 maps to node \"node01\" in SLURM_STEP_NODELIST"));
  CHECK(contains(error, "but this task runs on \"node02\" (SLURMD_NODENAME)"));
  CHECK(contains(slurm_error(with(two_nodes("2"), "SLURMD_NODENAME", "node01")),
                 "rank 2 maps to node \"node02\""));
  // An uneven step: rank 3 is the first task of the third node.
  const Env uneven{{"SLURM_PROCID", "3"},
                   {"SLURM_STEP_ID", "0"},
                   {"SLURM_STEP_NUM_TASKS", "4"},
                   {"SLURM_STEP_NODELIST", "a,b,c"},
                   {"SLURM_STEP_TASKS_PER_NODE", "2,1,1"}};
  CHECK(slurm(with(uneven, "SLURMD_NODENAME", "c")).task.type == "chief");
  CHECK(contains(slurm_error(with(uneven, "SLURMD_NODENAME", "b")),
                 "rank 3 maps to node \"c\" in SLURM_STEP_NODELIST, but this task runs on \"b\""));
}

TEST_CASE("Slurm: a batch script that runs the program without srun is refused") {
  // What sbatch gives its script: the job's variables and SLURM_PROCID=0, but no step id and
  // no step variables (a step of its own would have been launched by srun).
  const Env batch{{"SLURM_PROCID", "0"},
                  {"SLURM_JOB_ID", "1000"},
                  {"SLURM_NTASKS", "4"},
                  {"SLURM_JOB_NODELIST", "node[01-02]"},
                  {"SLURM_TASKS_PER_NODE", "2(x2)"},
                  {"SLURMD_NODENAME", "node01"}};
  const std::string error = slurm_error(batch);
  CHECK(contains(error, "Slurm: SLURM_PROCID is set but SLURM_STEP_ID is not"));
  CHECK(contains(error, "launch the tasks with srun"));
  CHECK(error.find('\n') == std::string::npos);
  CHECK(contains(slurm_error(with(batch, "SLURM_STEP_ID", "")), "launch the tasks with srun"));
  // A task that srun launched has a step id (SLURM_STEPID is the old name), and runs.
  CHECK(slurm(with(batch, "SLURM_STEP_ID", "0")).task.type == "ps");
  CHECK(slurm(with(batch, "SLURM_STEPID", "3")).task.type == "ps");
  CHECK(contains(slurm_error(with(batch, "SLURM_STEP_ID", "batch")),
                 "SLURM_STEP_ID is not a number: \"batch\""));
}

TEST_CASE("Slurm is read from the environment, and absent outside a Slurm step") {
  const auto jobs = pulley::parse_slurm_roles("ps:1,worker:2,chief:1");
  ::unsetenv("SLURM_PROCID");
  CHECK_FALSE(pulley::slurm_config_from_environment(jobs).has_value());
  for (const auto& [name, value] : two_nodes("1")) ::setenv(name.c_str(), value.c_str(), 1);
  const auto c = pulley::slurm_config_from_environment(jobs, 9000);
  REQUIRE(c.has_value());
  CHECK(c->task.type == "worker");
  CHECK(c->task.index == 0);
  CHECK(c->cluster.tasks("worker") == Hosts{"node01:9001", "node02:9000"});
  ::unsetenv("SLURM_STEP_NODELIST");
  CHECK(contains(error_of([&] { pulley::slurm_config_from_environment(jobs); }),
                 "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set"));
  for (const auto& entry : two_nodes("1")) ::unsetenv(entry.first.c_str());
  CHECK_FALSE(pulley::slurm_config_from_environment(jobs).has_value());
}
