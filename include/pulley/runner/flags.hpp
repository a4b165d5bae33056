// SPDX-License-Identifier: MIT
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <string>

#include "pulley/client/options.hpp"
#include "pulley/cluster/slurm.hpp"
#include "pulley/core/spin.hpp"
#include "pulley/runner/job.hpp"
#include "pulley/runner/metrics.hpp"
#include "pulley/runner/run.hpp"
#include "pulley/transport/tcp_options.hpp"

namespace pulley {

/// Adds the flags that describe a job (JobFlags) to a CLI11 app, in a "Cluster" group:
///   --ps N --workers N                     every task in this process (the default)
///   --role ROLE --task I --ps-hosts H:P,... --worker-hosts H:P,... [--chief-host H:P]
///   --role ps|worker|evaluator --join --chief-host H:P --job-name NAME [--address H:P]  (a joiner)
///   --slurm-roles ps:1,worker:2,chief:1 [--slurm-port-base PORT]
///   --mpi-roles ps:2,worker:2,chief:1 [--mpi-hosts H,...] [--mpi-port-base PORT]
///   [--job-name NAME] [--secret-file PATH]  what every connection proves (credentials.hpp)
/// or none of them, with TF_CONFIG set. `--job` and `--slurm-jobs`, their names before 0.3,
/// still work. Numbers out of range are refused by CLI11. It also
/// makes a parse error print one line (the app's name, the error) instead of the usage.
inline void add_job_flags(CLI::App& app, JobFlags& flags) {
  const std::string group = "Cluster (default: every task in this process; or TF_CONFIG)";
  app.add_option("--ps", flags.ps, "ps tasks, when every task runs in this process")
      ->check(CLI::Range(1, 1024))
      ->group(group);
  app.add_option("--workers", flags.workers, "workers, when every task runs in this process")
      ->check(CLI::Range(1, 1024))
      ->group(group);
  app.add_option("--role,--job", flags.role, "this task's role, in a cluster of processes")
      ->check(CLI::IsMember({"ps", "worker", "chief", "evaluator"}))
      ->group(group);
  app.add_option("--task", flags.task, "this task's index among the tasks of its role")->group(group);
  app.add_option("--ps-hosts", flags.ps_hosts, "host:port of every ps task")
      ->delimiter(',')
      ->group(group);
  app.add_option("--worker-hosts", flags.worker_hosts, "host:port of every worker")
      ->delimiter(',')
      ->group(group);
  app.add_option("--chief-host", flags.chief_host, "host:port of the chief's own task")
      ->group(group);
  app.add_option("--slurm-roles,--slurm-jobs", flags.slurm_roles,
                 "under srun: the step's ranks by role, in order, e.g. ps:1,worker:2,chief:1")
      ->group(group);
  app.add_option("--slurm-port-base", flags.slurm_port_base,
                 "under srun: the port of the first task on each node (the i-th: base + i; "
                 "default: derived from SLURM_JOB_ID, in 20000..32767)")
      ->check(CLI::Range(1, 65535))
      ->group(group);
  app.add_option("--mpi-roles,--mpi-jobs", flags.mpi_roles,
                 "under mpirun: the ranks by role, in order, e.g. ps:2,worker:2,chief:1")
      ->group(group);
  app.add_option("--mpi-hosts", flags.mpi_hosts,
                 "under mpirun on several hosts: the hosts in mpirun's order, the same number of "
                 "ranks on each (default: every rank on this host)")
      ->delimiter(',')
      ->group(group);
  app.add_option("--mpi-port-base", flags.mpi_port_base,
                 "under mpirun: the port of the first rank on each host (the i-th: base + i; "
                 "default: derived from the MPI job id, in 20000..32767)")
      ->check(CLI::Range(1, 65535))
      ->group(group);
  app.add_option("--job-name", flags.job_name,
                 "the job's name, which every connection proves (default: the Slurm job, or "
                 "a hash of the cluster)")
      ->group(group);
  app.add_flag("--join", flags.join,
               "this ps task or worker joins a running job: the chief takes it in as soon as it is free "
               "(its cluster lists it after the job's ps tasks or workers, or with --role and --chief-host "
               "alone the chief tells it the job's; needs --job-name); an evaluator that joins reads the "
               "job's ps tasks from the chief")
      ->group(group);
  app.add_option("--address", flags.address,
                 "host:port where this ps serves, when it joins naming the chief alone "
                 "(--join --role ps --chief-host)")
      ->group(group);
  app.add_option("--secret-file", flags.secret_file,
                 "a file holding the job's shared secret (default: PULLEY_SECRET, "
                 "PULLEY_SECRET_FILE, or ~/.config/pulley/secret)")
      ->check(CLI::ExistingFile)
      ->group(group);
  // A mistake is one line naming it; the usage only on --help.
  app.failure_message([](const CLI::App* failed, const CLI::Error& e) {
    std::string name = failed->get_name();
    name.erase(0, name.find_last_of('/') + 1);  // the program, not its path
    return name + ": " + e.what() + " (--help lists the flags)\n";
  });
}

/// Adds the checkpoint flags (TensorFlow's names) to a CLI11 app, in a "Checkpoints" group:
///   --checkpoint-dir DIR  --save-checkpoint-steps N  --save-checkpoint-secs S  --keep-checkpoints K
///   --full-checkpoint-every K
inline void add_checkpoint_flags(CLI::App& app, CheckpointOptions& options) {
  const std::string group = "Checkpoints";
  app.add_option("--checkpoint-dir", options.directory,
                 "write checkpoints here, and resume from the newest one found there")
      ->group(group);
  app.add_option("--save-checkpoint-steps", options.save_steps,
                 "global steps between checkpoints (0: not by steps)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 50))
      ->group(group);
  app.add_option_function<std::int64_t>(
         "--save-checkpoint-secs",
         [&options](std::int64_t secs) { options.save_secs = std::chrono::seconds(secs); },
         "seconds between checkpoints (0: not by time; default 600)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40))
      ->group(group);
  app.add_option("--keep-checkpoints", options.keep, "checkpoints kept, newest first (0: all)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20))
      ->group(group);
  app.add_option("--full-checkpoint-every", options.full_every,
                 "every K-th checkpoint holds every row of the tables; those between only the rows "
                 "changed since the one before (1: every checkpoint is full)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20))
      ->group(group);
}

/// Adds the flags of what a running job reports (MetricsOptions), in a "Metrics" group:
///   --metrics-file PATH  --metrics-port PORT  --metrics-bind ADDRESS  --metrics-interval-ms MS
///   --progress-secs S
inline void add_metrics_flags(CLI::App& app, MetricsOptions& options) {
  const std::string group = "Metrics";
  app.add_option("--metrics-file", options.file,
                 "append every task's figures here as JSON lines, each interval (\"{task}\" in the "
                 "path becomes the task, e.g. worker-0)")
      ->group(group);
  app.add_option_function<std::uint32_t>(
         "--metrics-port", [&options](std::uint32_t port) { options.port = static_cast<std::uint16_t>(port); },
         "serve the figures in Prometheus' format at http://ADDRESS:PORT/metrics (in a "
                 "cluster, task i at PORT + i: ps tasks, chief, workers, evaluators; 0: any port)")
      ->check(CLI::Range(0U, 65535U))
      ->group(group);
  app.add_option("--metrics-bind", options.bind,
                 "the address --metrics-port listens on (default 127.0.0.1; 0.0.0.0: every interface)")
      ->group(group);
  app.add_option_function<std::int64_t>(
         "--metrics-interval-ms",
         [&options](std::int64_t ms) { options.interval = std::chrono::milliseconds(ms); },
         "how often the figures are taken (default 5000)")
      ->check(CLI::Range(std::int64_t{10}, std::int64_t{1} << 40))
      ->group(group);
  app.add_option_function<std::int64_t>(
         "--progress-secs",
         [&options](std::int64_t secs) { options.progress = std::chrono::seconds(secs); },
         "how often the chief prints its progress line (0: never; default 10)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30))
      ->group(group);
}

/// Adds the flags of the limits a job runs under (README, Limits), in a "Limits" group,
/// writing into the options the role runner takes (`Training::client`, `::tcp`, `::server`).
/// Times are in milliseconds, sizes in bytes; every one keeps its default unless given.
inline void add_limit_flags(CLI::App& app, ClientOptions& client, TcpOptions& tcp,
                            TcpServerOptions& server) {
  const std::string group = "Limits";
  auto millis = [&](const char* name, std::chrono::milliseconds& value, const char* what) {
    app.add_option_function<std::int64_t>(
           name, [&value](std::int64_t ms) { value = std::chrono::milliseconds(ms); }, what)
        ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))
        ->group(group);
  };
  millis("--request-timeout-ms", client.request_timeout, "a request a ps answers at once");
  millis("--wait-timeout-ms", client.wait_timeout,
         "readiness, tokens and step-gated pulls while no ps makes progress");
  app.add_option("--clip-norm", client.clip_norm,
                 "workers: scale each push's gradients down to this global norm (0: off)")
      ->check(CLI::Range(0.0F, 1e30F))
      ->group(group);
  app.add_flag_callback(
         "--no-local-sockets",
         [&tcp, &server] {
           tcp.local_sockets = false;
           server.local_socket = false;
         },
         "TCP between tasks on one host too (default: ps tasks and all-reduce ranks also listen on a "
         "local socket, which tasks on their host use)")
      ->group(group);
  app.add_flag_callback(
         "--no-shared-memory",
         [&tcp, &server] {
           tcp.shared_memory = false;
           server.shared_memory = false;
         },
         "tasks on one host keep their bytes on the local socket (default: after the handshake, "
         "a ring buffer each way in memory they share)")
      ->group(group);
  app.add_option_function<std::int64_t>(
         "--spin-us", [](std::int64_t us) { set_spin_before_sleep(std::chrono::microseconds(us)); },
         "how long a waiting task looks again before it sleeps, in microseconds (default 200; 0: "
         "sleeps at once, which suits a host with many more busy tasks than cores)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1000000}))
      ->group(group);
  millis("--connect-timeout-ms", tcp.connect_timeout, "waiting for a ps that is not up");
  millis("--attempt-timeout-ms", tcp.attempt_timeout, "one connection attempt, handshake included");
  millis("--copy-timeout-ms", tcp.copy_timeout,
         "with --ps-replicas 1: a ps process out of reach this long is asked about (the chief rules "
         "whether it is lost and its copies given up); a ps that has not heard the chief for 3/4 of it "
         "(or of --worker-timeout-ms, if shorter) serves no task until it does; the same for every task; "
         "default 30000");
  app.add_option("--ps-max-buffered-bytes", server.max_buffered_bytes,
                 "ps: bytes held for all connections together (buffers, unread replies)")
      ->check(CLI::Range(std::uint64_t{1} << 20U, std::uint64_t{1} << 50U))
      ->group(group);
  app.add_option("--ps-max-connections", server.max_connections, "ps: open connections at most")
      ->check(CLI::Range(1, 1 << 20))
      ->group(group);
  app.add_option("--ps-max-unsent-bytes", server.max_unsent_bytes,
                 "ps: unsent reply bytes before it stops reading a connection")
      ->check(CLI::Range(std::uint64_t{1} << 10U, std::uint64_t{1} << 50U))
      ->group(group);
  millis("--ps-handshake-timeout-ms", server.handshake_timeout, "ps: time to complete the handshake");
  millis("--ps-frame-timeout-ms", server.frame_timeout,
         "ps: time for a frame begun to be whole (plus its payload at 1 MiB/s)");
  millis("--ps-idle-timeout-ms", server.idle_timeout, "ps: a connection with nothing to do is closed after");
  millis("--ps-linger-ms", server.linger, "ps: answering after training ended, while clients stay");
  millis("--ps-orphaned-after-ms", server.orphaned_after,
         "ps: giving up once every client left without the chief ending training");
  millis("--recovery-timeout-ms", client.recovery_timeout,
         "waiting for lost ps tasks to be back and restored (and, ps: for a lost chief to come back), "
         "before failing");
  millis("--heartbeat-interval-ms", client.heartbeat_interval,
         "workers and the chief: how often each tells every ps it is alive");
  app.add_option("--ps-replicas", tcp.replicas,
                 "copies of each ps's shard kept on another ps (0 or 1; every task must say the same): "
                 "with 1, a lost ps's copy takes over and the job goes on with no rollback")
      ->check(CLI::Range(0, 1))
      ->group("Durability");
  app.add_option_function<std::int64_t>(
         "--ps-leave-secs",
         [&client](std::int64_t s) { client.ps_leave_after = std::chrono::seconds(s); },
         "chief: a lost ps not back within this long leaves the job for good, and the others take "
         "its shard from the newest checkpoint, or with --ps-replicas 1 from its copies with "
         "nothing lost "
         "(0, the default: wait for it up to the recovery timeout; with copies, until a process "
         "takes its place)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30))
      ->group("Durability");
  app.add_option_function<std::int64_t>(
         "--worker-leave-secs",
         [&client](std::int64_t s) { client.worker_leave_after = std::chrono::seconds(s); },
         "chief: a worker held lost this long leaves the job for good, and the sync policy counts the "
         "others from the next step (0, the default: it stays a lost worker, taken back when it returns)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30))
      ->group("Durability");
}

/// add_limit_flags, and the ps tasks' worker timeout (`Training::worker_timeout`):
///   --worker-timeout-ms MS   a worker silent this long is held lost; training goes on
inline void add_limit_flags(CLI::App& app, ClientOptions& client, TcpOptions& tcp,
                            TcpServerOptions& server, std::chrono::milliseconds& worker_timeout) {
  add_limit_flags(app, client, tcp, server);
  app.add_option_function<std::int64_t>(
         "--worker-timeout-ms",
         [&worker_timeout](std::int64_t ms) { worker_timeout = std::chrono::milliseconds(ms); },
         "ps: a worker whose heartbeats stop for this long is held lost, and training goes on "
         "without it (default 5000)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))
      ->group("Limits");
}

}  // namespace pulley
