// SPDX-License-Identifier: MIT
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>

#include "pulley/cluster/slurm.hpp"
#include "pulley/runner/job.hpp"

namespace pulley {

/// Adds the flags that describe a job (JobFlags) to a CLI11 app, in a "Cluster" group:
///   --ps N --workers N                     every task in this process (the default)
///   --job TYPE --task I --ps-hosts H:P,... --worker-hosts H:P,... [--chief-host H:P]
///   --slurm-jobs ps:1,worker:2,chief:1 [--slurm-port-base 8888]
///   [--job-name NAME] [--secret-file PATH]  what every connection proves (credentials.hpp)
/// or none of them, with TF_CONFIG set. Numbers out of range are refused by CLI11. It also
/// makes a parse error print one line (the app's name, the error) instead of the usage.
inline void add_job_flags(CLI::App& app, JobFlags& flags) {
  const std::string group = "Cluster (default: every task in this process; or TF_CONFIG)";
  app.add_option("--ps", flags.ps, "ps tasks, when every task runs in this process")
      ->check(CLI::Range(1, 1024))
      ->group(group);
  app.add_option("--workers", flags.workers, "workers, when every task runs in this process")
      ->check(CLI::Range(1, 1024))
      ->group(group);
  app.add_option("--job", flags.job, "this task's job, in a cluster of processes")
      ->check(CLI::IsMember({"ps", "worker", "chief", "evaluator"}))
      ->group(group);
  app.add_option("--task", flags.task, "this task's index in its job")->group(group);
  app.add_option("--ps-hosts", flags.ps_hosts, "host:port of every ps task")
      ->delimiter(',')
      ->group(group);
  app.add_option("--worker-hosts", flags.worker_hosts, "host:port of every worker")
      ->delimiter(',')
      ->group(group);
  app.add_option("--chief-host", flags.chief_host, "host:port of the chief's own task")
      ->group(group);
  app.add_option("--slurm-jobs", flags.slurm_jobs,
                 "under srun: the step's ranks by job, in order, e.g. ps:1,worker:2,chief:1")
      ->group(group);
  app.add_option("--slurm-port-base", flags.slurm_port_base,
                 "under srun: the port of the first task on each node (the i-th: base + i)")
      ->check(CLI::Range(1, 65535))
      ->group(group);
  app.add_option("--job-name", flags.job_name,
                 "the job's name, which every connection proves (default: the Slurm job, or "
                 "a hash of the cluster)")
      ->group(group);
  app.add_option("--secret-file", flags.secret_file,
                 "a file holding the job's shared secret (default: PULLEY_SECRET, "
                 "PULLEY_SECRET_FILE, or ~/.config/pulley/secret)")
      ->check(CLI::ExistingFile)
      ->group(group);
  // A mistake is one line naming it; the usage only on --help.
  app.failure_message([](const CLI::App* failed, const CLI::Error& e) {
    return failed->get_name() + ": " + e.what() + " (--help lists the flags)\n";
  });
}

}  // namespace pulley
