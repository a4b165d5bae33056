// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "pulley/cluster/cluster_spec.hpp"
#include "pulley/core/error.hpp"

namespace pulley {

// The same TfConfig, built from the variables Slurm gives each task of a step, by the rules of
// TensorFlow's `SlurmClusterResolver`: nodes in nodelist order, the i-th task on a node at
// `port_base + i`, ranks handed to the roles in the order they are listed. Unlike the resolver,
// the default port base comes from the job id (so that two jobs sharing a node do not fight
// over ports), and a task that is not where its rank says, or that no srun launched, is
// refused at once instead of waiting for peers that will never answer.

/// The roles of a Slurm step and their task counts, in rank order: {{"ps", 1}, {"worker", 2}}
/// makes rank 0 ps 0 and ranks 1 and 2 workers 0 and 1. Names are those of kRoleNames
/// ("master" is read as "chief"); the counts must add up to the step's number of tasks.
using SlurmRoles = std::vector<std::pair<std::string, std::uint32_t>>;

/// The ports a derived port base (derived_slurm_port_base) lies in: [begin, end). They end
/// below Linux's default ephemeral range (net.ipv4.ip_local_port_range, 32768..60999), from
/// which the kernel takes the local port of every outgoing connection, so that a task seldom
/// finds its port already held by some connection.
inline constexpr std::uint32_t kSlurmPortRangeBegin = 20000;
inline constexpr std::uint32_t kSlurmPortRangeEnd = 32768;  ///< see kSlurmPortRangeBegin

/// An environment for slurm_config: the value of a variable, nullopt when it is unset. The
/// exact return type is required so that a `getenv`-like `const char*` (null when unset)
/// cannot slip in through an implicit conversion.
template <class F>
concept SlurmEnvironment = std::invocable<F&, std::string_view> &&
    std::same_as<std::invoke_result_t<F&, std::string_view>, std::optional<std::string>>;

namespace detail {

inline Error slurm_error(const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, "Slurm: " + what);
}

/// Bounds the nodes a list may expand to, so a typo like "n[0-999999999]" fails fast instead
/// of exhausting memory.
inline constexpr std::size_t kSlurmMaxNodes = std::size_t{1} << 20;

/// Comma-separated fields, empty ones kept (so that "a,,b" can be refused).
inline std::vector<std::string_view> slurm_fields(std::string_view text) {
  std::vector<std::string_view> fields;
  for (std::size_t start = 0;;) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    fields.push_back(text.substr(start, comma - start));
    if (comma == text.size()) return fields;
    start = comma + 1;
  }
}

/// A number written in decimal digits only (no sign, no space); nullopt otherwise.
inline std::optional<std::uint64_t> slurm_number(std::string_view text) {
  std::uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || stop != end) return std::nullopt;
  return value;
}

inline Error slurm_bad_hostlist(std::string_view hostlist, const std::string& why) {
  return slurm_error("malformed hostlist \"" + std::string(hostlist) + "\": " + why);
}

inline bool slurm_blank(char c) noexcept { return c == ' ' || c == '\t' || c == '\n'; }

/// A number in a bracket as Slurm reads it (strtoul): blanks and a '+' may come first and
/// blanks after the digits; nullopt otherwise.
inline std::optional<std::uint64_t> slurm_bracket_number(std::string_view text) {
  std::size_t first = 0;
  while (first < text.size() && slurm_blank(text[first])) ++first;
  if (first < text.size() && text[first] == '+') ++first;
  std::size_t last = text.size();
  while (last > first && slurm_blank(text[last - 1])) --last;
  return slurm_number(text.substr(first, last - first));
}

/// The values of a bracket's body such as "01-03,7": each field a number or a range lo-hi,
/// zero-padded to the width lo is written in, as Slurm does ("08-10" is 08, 09, 10; the
/// width counts what strtoul skips: "[ 1-2]" is 01, 02); "lo-" is lo alone.
inline std::vector<std::string> slurm_bracket_values(std::string_view body,
                                                     std::string_view hostlist) {
  std::vector<std::string> values;
  for (std::string_view field : slurm_fields(body)) {
    const std::size_t dash = field.find('-');
    const std::string_view lo_text = field.substr(0, dash);
    const std::string_view hi_text =
        dash == std::string_view::npos || dash + 1 == field.size() ? lo_text : field.substr(dash + 1);
    const auto lo = slurm_bracket_number(lo_text);
    const auto hi = slurm_bracket_number(hi_text);
    if (!lo || !hi) {
      throw slurm_bad_hostlist(hostlist, "\"" + std::string(field) + "\" in [" + std::string(body) +
                                             "] is not a number or a range lo-hi");
    }
    if (*lo > *hi) {
      throw slurm_bad_hostlist(hostlist, "range \"" + std::string(field) + "\" runs backwards");
    }
    if (*hi - *lo >= kSlurmMaxNodes - values.size()) {
      throw slurm_bad_hostlist(hostlist, "more than " + std::to_string(kSlurmMaxNodes) + " nodes");
    }
    for (std::uint64_t k = 0; k <= *hi - *lo; ++k) {  // (v <= hi would never end at 2^64 − 1)
      std::string digits = std::to_string(*lo + k);
      if (digits.size() < lo_text.size()) digits.insert(0, lo_text.size() - digits.size(), '0');
      values.push_back(std::move(digits));
    }
  }
  return values;
}

/// `roles` with "master" renamed "chief", checked: known names, each once, each with a task.
/// Roles without "ps" are an all-reduce job's (workers only); the ps runner refuses them.
inline SlurmRoles checked_slurm_roles(const SlurmRoles& roles) {
  SlurmRoles checked;
  for (const auto& [name, count] : roles) {
    const std::string role = name == "master" ? "chief" : name;
    if (std::find(std::begin(kRoleNames), std::end(kRoleNames), role) == std::end(kRoleNames)) {
      throw slurm_error("unknown role \"" + name + "\" (chief, worker, ps, evaluator)");
    }
    if (count == 0) throw slurm_error("role \"" + role + "\" has no tasks");
    for (const auto& seen : checked) {
      if (seen.first == role) throw slurm_error("role \"" + role + "\" is listed twice");
    }
    checked.emplace_back(role, count);
  }
  return checked;
}

/// The TfConfig of rank `rank` when ranks fill `hosts` in order, `per_node[n]` on host n
/// (block distribution), the i-th on a host listening on `base` + i, and go to the roles of
/// `checked` in their order. Throws kInvalidArgument ("<launcher>: ...") when a port would
/// be over 65535.
inline TfConfig block_config(const SlurmRoles& checked, std::uint64_t rank, const std::vector<std::string>& hosts,
                             const std::vector<std::uint32_t>& per_node, std::uint32_t base,
                             const std::string& launcher) {
  const std::uint32_t busiest = *std::max_element(per_node.begin(), per_node.end());
  if (base == 0 || std::uint64_t{base} + busiest - 1 > 65535) {
    throw Error(ErrorCode::kInvalidArgument,
                launcher + ": port base " + std::to_string(base) + " with " + std::to_string(busiest) +
                    " task(s) on a node needs ports " + std::to_string(base) + ".." +
                    std::to_string(std::uint64_t{base} + busiest - 1) + ", outside 1..65535");
  }
  std::vector<std::string> addresses;
  for (std::size_t n = 0; n < hosts.size(); ++n) {
    for (std::uint32_t i = 0; i < per_node[n]; ++i) addresses.push_back(hosts[n] + ":" + std::to_string(base + i));
  }
  TfConfig config;
  std::uint64_t first = 0;
  for (const auto& [role, count] : checked) {
    const auto begin = addresses.begin() + static_cast<std::ptrdiff_t>(first);
    config.cluster.roles[role].assign(begin, begin + count);
    if (rank >= first && rank < first + count) config.task = {role, static_cast<std::uint32_t>(rank - first)};
    first += count;
  }
  return config;
}

}  // namespace detail

/// Parses a list of roles such as "ps:1,worker:2,chief:1" (the form a command-line flag takes)
/// into SlurmRoles, keeping its order. Throws kInvalidArgument ("Slurm: ...") for a field that
/// is not role:count, an unknown or repeated role, or a count of 0.
inline SlurmRoles parse_slurm_roles(std::string_view text) {
  SlurmRoles roles;
  for (std::string_view field : detail::slurm_fields(text)) {
    const std::size_t colon = field.find(':');
    const auto count = colon == std::string_view::npos
                           ? std::nullopt
                           : detail::slurm_number(field.substr(colon + 1));
    if (colon == 0 || !count || *count > std::numeric_limits<std::uint32_t>::max()) {
      throw detail::slurm_error("roles \"" + std::string(text) + "\": \"" + std::string(field) +
                                "\" is not role:count (as in \"ps:1,worker:2,chief:1\")");
    }
    roles.emplace_back(std::string(field.substr(0, colon)), static_cast<std::uint32_t>(*count));
  }
  return detail::checked_slurm_roles(roles);
}

/// Expands a Slurm hostlist such as "node[01-03,07],gpu5" into its host names, in order and
/// without removing duplicates: node01, node02, node03, node07, gpu5, as `scontrol show
/// hostnames` does (tests/unit/slurm.cpp compares them on a table of cases). Names are
/// separated by commas or blanks, and empty ones are skipped ("a,,b," is a, b). A bracket
/// holds numbers and ranges lo-hi, zero-padded to the width of lo; several brackets in one
/// name multiply, the leftmost varying slowest ("r[1-2]n[1-2]" is r1n1, r1n2, r2n1, r2n2),
/// and a name with brackets ends with one, as Slurm demands ("n[1-2]-ib" is refused,
/// "n[1-2]-ib[1]" is not). Throws kInvalidArgument ("Slurm: malformed hostlist ...") for
/// anything else: nested or unbalanced brackets (where Slurm prints names made of the
/// broken text), non-numbers or backward ranges in brackets, more than 2^20 names.
inline std::vector<std::string> expand_slurm_hostlist(std::string_view hostlist) {
  std::vector<std::string> hosts;
  for (std::size_t start = 0;; ++start) {
    while (start < hostlist.size() && (hostlist[start] == ',' || detail::slurm_blank(hostlist[start]))) ++start;
    if (start == hostlist.size()) return hosts;
    // One name runs to the next comma or blank outside brackets.
    std::size_t end = start;
    bool open = false;
    for (; end < hostlist.size() && (open || (hostlist[end] != ',' && !detail::slurm_blank(hostlist[end]))); ++end) {
      const char c = hostlist[end];
      if (c == '[' && open) throw detail::slurm_bad_hostlist(hostlist, "nested '['");
      if (c == ']' && !open) throw detail::slurm_bad_hostlist(hostlist, "']' without '['");
      if (c == '[' || c == ']') open = c == '[';
    }
    if (open) throw detail::slurm_bad_hostlist(hostlist, "'[' without ']'");
    const std::string_view name = hostlist.substr(start, end - start);
    if (name.find('[') != std::string_view::npos && name.back() != ']') {
      throw detail::slurm_bad_hostlist(hostlist, "\"" + std::string(name.substr(name.rfind(']') + 1)) +
                                                     "\" after the last bracket of a name (Slurm takes more "
                                                     "only as another bracket, as in n[1-2]-ib[1])");
    }

    std::vector<std::string> names{""};
    for (std::size_t i = 0; i < name.size();) {
      if (name[i] != '[') {
        const std::size_t bracket = std::min(name.find('[', i), name.size());
        for (std::string& n : names) n.append(name.substr(i, bracket - i));
        i = bracket;
        continue;
      }
      const std::size_t close = name.find(']', i);
      const auto values = detail::slurm_bracket_values(name.substr(i + 1, close - i - 1), hostlist);
      if (names.size() * values.size() > detail::kSlurmMaxNodes - hosts.size()) {
        throw detail::slurm_bad_hostlist(
            hostlist, "more than " + std::to_string(detail::kSlurmMaxNodes) + " nodes");
      }
      std::vector<std::string> product;
      product.reserve(names.size() * values.size());
      for (const std::string& n : names) {
        for (const std::string& v : values) product.push_back(n + v);
      }
      names = std::move(product);
      i = close + 1;
    }
    hosts.insert(hosts.end(), std::make_move_iterator(names.begin()),
                 std::make_move_iterator(names.end()));
    if (end == hostlist.size()) return hosts;
    start = end;
  }
}

/// Expands Slurm's tasks-per-node list, one count per node in nodelist order: "2(x3),1" is
/// 2, 2, 2, 1. Throws kInvalidArgument ("Slurm: malformed tasks per node ...") for a field
/// that is not N or N(xM) with N, M >= 1.
inline std::vector<std::uint32_t> expand_slurm_tasks_per_node(std::string_view text) {
  std::vector<std::uint32_t> tasks;
  for (std::string_view field : detail::slurm_fields(text)) {
    const std::size_t paren = field.find('(');
    const auto count = detail::slurm_number(field.substr(0, paren));
    std::optional<std::uint64_t> repeat = 1;
    if (paren != std::string_view::npos) {
      const bool shaped =
          field.size() > paren + 3 && field.substr(paren, 2) == "(x" && field.back() == ')';
      repeat = shaped ? detail::slurm_number(field.substr(paren + 2, field.size() - paren - 3))
                      : std::nullopt;
    }
    if (!count || !repeat || *count == 0 || *repeat == 0 ||
        *count > std::numeric_limits<std::uint32_t>::max()) {
      throw detail::slurm_error("malformed tasks per node \"" + std::string(text) + "\": \"" +
                                std::string(field) + "\" is not N or N(xM) with N, M >= 1");
    }
    if (*repeat > detail::kSlurmMaxNodes - tasks.size()) {
      throw detail::slurm_error("malformed tasks per node \"" + std::string(text) +
                                "\": more than " + std::to_string(detail::kSlurmMaxNodes) +
                                " nodes");
    }
    tasks.insert(tasks.end(), *repeat, static_cast<std::uint32_t>(*count));
  }
  return tasks;
}

/// The port base of a Slurm job that names none: the ports [kSlurmPortRangeBegin,
/// kSlurmPortRangeEnd) cut into slots of `busiest` ports (the most tasks any node of the step
/// runs), the job taking slot `job_id` mod slots:
///   base = 20000 + (job_id mod floor(12768 / busiest)) * busiest
/// so that its tasks on a node listen on base .. base + busiest - 1, all inside the range.
/// Every task of a step computes the same base. Two jobs with the same `busiest` whose ids
/// differ by less than the number of slots (6384 for 2 tasks a node, 3192 for 4) listen on
/// disjoint ports on any node they share; others may meet, as with any fixed base. Throws
/// kInvalidArgument when `busiest` is 0 or more than the range holds.
inline std::uint32_t derived_slurm_port_base(std::uint64_t job_id, std::uint32_t busiest) {
  constexpr std::uint32_t ports = kSlurmPortRangeEnd - kSlurmPortRangeBegin;
  if (busiest == 0 || busiest > ports) {
    throw detail::slurm_error(std::to_string(busiest) + " task(s) on a node do not fit in the " +
                              std::to_string(ports) +
                              " ports of derived port bases: give a port base");
  }
  const std::uint32_t slots = ports / busiest;
  return kSlurmPortRangeBegin + static_cast<std::uint32_t>(job_id % slots) * busiest;
}

/// Builds this task's TfConfig from Slurm's variables, read through `env`:
///   SLURM_PROCID                                             this task's rank in the step
///   SLURM_STEP_ID, else SLURM_STEPID                         that srun launched it
///   SLURM_STEP_NUM_TASKS, else SLURM_NTASKS                  the step's number of tasks
///   SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST             its nodes (a hostlist)
///   SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE     tasks on each node
///   SLURM_JOB_ID, else SLURM_JOBID                           only for the derived port base
///   SLURMD_NODENAME (if set)                                 the node this task runs on
/// (the step's own variables first, as the rank counts within the step). Ranks fill the nodes
/// in nodelist order, which is Slurm's default block distribution; the i-th task on a node
/// gets "host:port_base+i", where port_base is `port_base`, or when nullopt
/// derived_slurm_port_base(job id, most tasks on a node); the ranks go to `roles` in their order
/// (TensorFlow's resolver sorts them by name; an explicit order says which rank is which). The
/// result is what parse_tf_config would return for the equivalent TF_CONFIG.
///
/// Two launches that would otherwise hang are refused: a batch script (or an salloc shell)
/// that ran the program itself instead of through srun, which Slurm gives SLURM_PROCID=0 but
/// no step id; and a task whose node (SLURMD_NODENAME) is not the one its rank maps to, as
/// under `--distribution=cyclic`, which is not supported. Throws kInvalidArgument ("Slurm:
/// ...") naming the problem: those two, a missing or malformed variable, a node count that
/// differs from the tasks-per-node entries, a host listed twice, task counts that disagree,
/// a rank out of range, a port over 65535, or bad `roles` (see parse_slurm_roles).
template <SlurmEnvironment Env>
TfConfig slurm_config(const SlurmRoles& roles, std::optional<std::uint32_t> port_base, Env&& env) {
  using detail::slurm_error;
  const SlurmRoles checked = detail::checked_slurm_roles(roles);

  struct Variable {
    std::string name;
    std::string value;
  };
  // The first of `names` that is set and not empty.
  auto find = [&](std::initializer_list<std::string_view> names) -> std::optional<Variable> {
    for (std::string_view n : names) {
      std::optional<std::string> value = std::invoke(env, n);
      if (value && !value->empty()) return Variable{std::string(n), std::move(*value)};
    }
    return std::nullopt;
  };
  auto read = [&](std::string_view name, std::string_view fallback) -> Variable {
    if (std::optional<Variable> v = find({name, fallback})) return std::move(*v);
    throw slurm_error("neither " + std::string(name) + " nor " + std::string(fallback) +
                      " is set (not inside a Slurm step?)");
  };
  auto number = [](const Variable& v) {
    const auto n = detail::slurm_number(v.value);
    if (!n || *n > std::numeric_limits<std::uint32_t>::max()) {
      throw slurm_error(v.name + " is not a number: \"" + v.value + "\"");
    }
    return *n;
  };
  const std::optional<Variable> procid = find({"SLURM_PROCID"});
  if (!procid) throw slurm_error("SLURM_PROCID is not set (not inside a Slurm step?)");
  const std::uint64_t rank = number(*procid);
  // srun sets the step id for its tasks; the batch step (and salloc's interactive one) has
  // none, though Slurm gives its one process SLURM_PROCID=0, which would make it rank 0.
  const std::optional<Variable> step = find({"SLURM_STEP_ID", "SLURM_STEPID"});
  if (!step) {
    throw slurm_error(
        "SLURM_PROCID is set but SLURM_STEP_ID is not: this is a batch script, not a task srun "
        "launched; launch the tasks with srun, as in `srun -K ./program --slurm-roles ...`");
  }
  number(*step);  // refused, as any variable, when it is not a number
  const Variable ntasks_var = read("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS");
  const Variable nodelist = read("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST");
  const Variable per_node_var = read("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE");
  const std::uint64_t ntasks = number(ntasks_var);
  const std::vector<std::string> hosts = expand_slurm_hostlist(nodelist.value);
  const std::vector<std::uint32_t> per_node = expand_slurm_tasks_per_node(per_node_var.value);

  if (hosts.size() != per_node.size()) {
    throw slurm_error(nodelist.name + " names " + std::to_string(hosts.size()) + " node(s) but " +
                      per_node_var.name + " gives tasks for " + std::to_string(per_node.size()));
  }
  std::set<std::string_view> seen;
  for (const std::string& host : hosts) {
    if (!seen.insert(host).second) {
      throw slurm_error("node \"" + host + "\" is listed twice in " + nodelist.name);
    }
  }
  std::uint64_t placed = 0;
  for (std::uint32_t n : per_node) placed += n;
  if (placed != ntasks) {
    throw slurm_error(per_node_var.name + " places " + std::to_string(placed) + " task(s) but " +
                      ntasks_var.name + " is " + std::to_string(ntasks));
  }
  std::uint64_t asked = 0;
  std::string listed;
  for (const auto& [role, count] : checked) {
    asked += count;
    listed += (listed.empty() ? "" : ",") + role + ":" + std::to_string(count);
  }
  if (asked != ntasks) {
    throw slurm_error("the roles " + listed + " have " + std::to_string(asked) +
                      " task(s) but the step has " + std::to_string(ntasks) + " (" +
                      ntasks_var.name + ")");
  }
  if (rank >= ntasks) {
    throw slurm_error("SLURM_PROCID " + std::to_string(rank) + " is out of range: the step has " +
                      std::to_string(ntasks) + " task(s)");
  }
  std::size_t node = 0;      // the node `rank` runs on under block distribution
  std::uint64_t before = 0;  // the tasks on the nodes before `node`
  while (before + per_node[node] <= rank) before += per_node[node++];
  if (const std::optional<Variable> here = find({"SLURMD_NODENAME"});
      here && here->value != hosts[node]) {
    throw slurm_error("rank " + std::to_string(rank) + " maps to node \"" + hosts[node] + "\" in " +
                      nodelist.name + ", but this task runs on \"" + here->value +
                      "\" (SLURMD_NODENAME): launch with srun's default --distribution=block");
  }
  const std::uint32_t busiest = *std::max_element(per_node.begin(), per_node.end());
  const std::uint32_t base =
      port_base ? *port_base
                : derived_slurm_port_base(number(read("SLURM_JOB_ID", "SLURM_JOBID")), busiest);
  return detail::block_config(checked, rank, hosts, per_node, base, "Slurm");
}

/// slurm_config over this process's environment; nullopt when SLURM_PROCID is unset or empty,
/// that is, outside a Slurm job. `port_base` nullopt: derived from the job id. Throws as
/// slurm_config does (in a batch script that did not use srun, too).
inline std::optional<TfConfig> slurm_config_from_environment(
    const SlurmRoles& roles, std::optional<std::uint32_t> port_base = std::nullopt) {
  const char* rank = std::getenv("SLURM_PROCID");
  if (rank == nullptr || *rank == '\0') return std::nullopt;
  return slurm_config(roles, port_base, [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    return value == nullptr ? std::nullopt : std::optional<std::string>(value);
  });
}

}  // namespace pulley
