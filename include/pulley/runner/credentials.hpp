// SPDX-License-Identifier: MIT
#pragma once

/// Where a task of a cluster of processes takes its Credentials from (the job's name and
/// shared secret, which every connection proves: transport/wire/handshake.hpp).
///
/// The secret, first found (what the command line says wins over the environment):
///   1. the file named by `--secret-file`;
///   2. the environment variable PULLEY_SECRET (launchers set it: scripts/launch_local.sh
///      makes one per run; under Slurm, export it before srun and every task inherits it);
///   3. the file named by the environment variable PULLEY_SECRET_FILE;
///   4. `$XDG_CONFIG_HOME/pulley/secret` (else `$HOME/.config/pulley/secret`), created with 32
///      random bytes, readable by its owner only, the first time a task needs it: the tasks
///      of one user on hosts that share a home directory then agree without configuration.
///      Not for a task that joins a running job: a secret made now cannot be the job's.
/// The job's name, first found: `--job-name`; under Slurm "slurm-<job id>.<step id>"; else
/// "cluster-" and a hash of the cluster's addresses, so two jobs are told apart even when
/// one user runs both with the same secret.

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

#include "pulley/cluster/cluster_spec.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/hash.hpp"
#include "pulley/core/log.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

namespace runner_detail {

inline std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

/// The secret in `path`: its bytes, less one trailing newline. Throws kInvalidArgument for
/// a file that cannot be read or is empty; warns when others may read it.
inline std::string read_secret_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot read the secret file " + path + ": " + std::strerror(errno));
  }
  std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (secret.empty()) throw Error(ErrorCode::kInvalidArgument, "the secret file " + path + " is empty");
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0 && (info.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    log(LogLevel::kWarning, "the secret file " + path + " may be read by other users (chmod 600 it)");
  }
  return secret;
}

/// 64 hexadecimal digits of fresh randomness.
inline std::string random_hex_secret() {
  const std::string bytes = wire::make_nonce();
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (const char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    hex += kDigits[b >> 4U];
    hex += kDigits[b & 15U];
  }
  return hex;
}

/// The per-user secret file, created (mode 0600, atomically: two tasks that start together
/// agree on one) when absent and `create`; else an absent file is kInvalidArgument.
inline std::string user_secret(bool create = true) {
  std::string dir = environment("XDG_CONFIG_HOME");
  if (dir.empty()) {
    const std::string home = environment("HOME");
    if (home.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "no shared secret: set PULLEY_SECRET or PULLEY_SECRET_FILE (HOME is unset)");
    }
    dir = home + "/.config";
  }
  ::mkdir(dir.c_str(), 0700);
  dir += "/pulley";
  ::mkdir(dir.c_str(), 0700);
  const std::string path = dir + "/secret";
  if (::access(path.c_str(), F_OK) != 0) {
    if (!create) {
      throw Error(ErrorCode::kInvalidArgument,
                  "no shared secret: a task that joins a running job proves the job's secret: set PULLEY_SECRET or "
                  "PULLEY_SECRET_FILE, or give --secret-file (there is no per-user secret " + path + ")");
    }
    const std::string temporary = path + "." + std::to_string(::getpid()) + ".tmp";
    const mode_t old_mask = ::umask(077);
    {
      std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
      out << random_hex_secret() << '\n';
    }
    ::umask(old_mask);
    // link() fails if another task created the file first: then both use that one.
    if (::link(temporary.c_str(), path.c_str()) == 0) {
      log(LogLevel::kInfo, "created the job secret " + path);
    }
    ::unlink(temporary.c_str());
  }
  return read_secret_file(path);
}

/// A short, stable name for a cluster: FNV-1a over its roles and addresses.
inline std::string cluster_name(const ClusterSpec& cluster) {
  std::uint64_t hash = name_hash({});
  auto mix = [&](std::string_view text) {
    hash = name_hash(std::string_view("\xFF", 1), name_hash(text, hash));  // a separator no address holds
  };
  for (const auto& [role, addresses] : cluster.roles) {
    mix(role);
    for (const std::string& address : addresses) mix(address);
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return std::string("cluster-") + text;
}

}  // namespace runner_detail

/// The credentials of a task of `cluster`: see this header's comment for where the job name
/// and the secret come from. `job_name` and `secret_file` are the flags' values ("" when not
/// given). `joining`: the task joins a running job (`--join`), so the per-user secret is
/// used only if it exists. Throws kInvalidArgument naming the problem (an unreadable secret
/// file, no way to find or make a secret).
inline Credentials task_credentials(const ClusterSpec& cluster, const std::string& job_name,
                                    const std::string& secret_file, bool joining = false) {
  Credentials credentials;
  if (!job_name.empty()) {
    credentials.job = job_name;
  } else if (const std::string slurm_job = runner_detail::environment("SLURM_JOB_ID");
             !slurm_job.empty() && !runner_detail::environment("SLURM_PROCID").empty()) {
    const std::string step = runner_detail::environment("SLURM_STEP_ID");
    credentials.job = "slurm-" + slurm_job + (step.empty() ? "" : "." + step);
  } else {
    credentials.job = runner_detail::cluster_name(cluster);
  }
  wire::check_credentials(credentials);
  if (!secret_file.empty()) {
    credentials.secret = runner_detail::read_secret_file(secret_file);
  } else if (std::string secret = runner_detail::environment("PULLEY_SECRET"); !secret.empty()) {
    credentials.secret = std::move(secret);
  } else if (const std::string file = runner_detail::environment("PULLEY_SECRET_FILE");
             !file.empty()) {
    credentials.secret = runner_detail::read_secret_file(file);
  } else {
    credentials.secret = runner_detail::user_secret(!joining);
  }
  return credentials;
}

}  // namespace pulley
