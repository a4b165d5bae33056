// SPDX-License-Identifier: MIT
// Where a task's credentials come from: the secret from PULLEY_SECRET, a file, or a per-user
// file made once; the job's name from a flag, Slurm, or the cluster itself.
#include "pulley/runner/credentials.hpp"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

using namespace pulley;

namespace {

/// A fresh directory under the system's temporary one, removed afterwards.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pulley-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

/// Clears every variable the credentials are read from.
void clear_environment() {
  for (const char* name : {"PULLEY_SECRET", "PULLEY_SECRET_FILE", "SLURM_JOB_ID", "SLURM_STEP_ID",
                           "SLURM_PROCID", "XDG_CONFIG_HOME"}) {
    ::unsetenv(name);
  }
}

const ClusterSpec kCluster{{{"ps", {"h:1"}}, {"worker", {"h:2", "h:3"}}}};

}  // namespace

TEST_CASE("the secret comes from --secret-file, then PULLEY_SECRET, then PULLEY_SECRET_FILE, then a per-user file made once") {
  clear_environment();
  TempDir home;
  ::setenv("XDG_CONFIG_HOME", home.path.c_str(), 1);

  // Nothing set: a task that joins a running job makes none (it could not be the job's).
  CHECK_THROWS_WITH_AS(task_credentials(kCluster, "", "", true),
                       doctest::Contains("a task that joins a running job proves the job's secret"), Error);
  CHECK_FALSE(std::filesystem::exists(home.path / "pulley" / "secret"));

  // Nothing set: a per-user secret is made, readable by its owner only, and then reused
  // (by a task that joins too).
  const Credentials first = task_credentials(kCluster, "", "");
  const auto file = home.path / "pulley" / "secret";
  REQUIRE(std::filesystem::exists(file));
  struct stat info {};
  REQUIRE(::stat(file.c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0600);
  CHECK(first.secret.size() == 64);
  CHECK(task_credentials(kCluster, "", "").secret == first.secret);
  CHECK(task_credentials(kCluster, "", "", true).secret == first.secret);

  // A secret file (flag, or PULLEY_SECRET_FILE) wins over it; its trailing newline is not
  // part of the secret.
  const auto mine = home.path / "mine";
  std::ofstream(mine) << "s3cret-from-a-file\n";
  ::setenv("PULLEY_SECRET_FILE", mine.c_str(), 1);
  CHECK(task_credentials(kCluster, "", "").secret == "s3cret-from-a-file");
  ::unsetenv("PULLEY_SECRET_FILE");
  CHECK(task_credentials(kCluster, "", mine.string()).secret == "s3cret-from-a-file");

  // PULLEY_SECRET wins over PULLEY_SECRET_FILE and the per-user file; the command line's
  // --secret-file wins over it.
  ::setenv("PULLEY_SECRET", "from the launcher", 1);
  ::setenv("PULLEY_SECRET_FILE", (home.path / "missing").c_str(), 1);
  CHECK(task_credentials(kCluster, "", "").secret == "from the launcher");
  CHECK(task_credentials(kCluster, "", mine.string()).secret == "s3cret-from-a-file");
  ::unsetenv("PULLEY_SECRET_FILE");
  ::unsetenv("PULLEY_SECRET");

  // A file that cannot serve is an error naming it.
  std::ofstream(home.path / "empty") << "";
  CHECK_THROWS_WITH_AS(task_credentials(kCluster, "", (home.path / "empty").string()),
                       doctest::Contains("is empty"), Error);
  CHECK_THROWS_WITH_AS(task_credentials(kCluster, "", (home.path / "missing").string()),
                       doctest::Contains("cannot read the secret file"), Error);
  clear_environment();
}

TEST_CASE("the job's name comes from the flag, then the Slurm step, then the cluster") {
  clear_environment();
  ::setenv("PULLEY_SECRET", "x", 1);
  CHECK(task_credentials(kCluster, "nightly-ctr", "").job == "nightly-ctr");

  const std::string derived = task_credentials(kCluster, "", "").job;
  CHECK(derived.rfind("cluster-", 0) == 0);
  CHECK(task_credentials(kCluster, "", "").job == derived);  // every task agrees
  const ClusterSpec other{{{"ps", {"h:1"}}, {"worker", {"h:2", "h:4"}}}};
  CHECK(task_credentials(other, "", "").job != derived);  // another cluster, another job

  ::setenv("SLURM_JOB_ID", "4711", 1);
  ::setenv("SLURM_STEP_ID", "2", 1);
  ::setenv("SLURM_PROCID", "0", 1);
  CHECK(task_credentials(kCluster, "", "").job == "slurm-4711.2");
  CHECK_THROWS_AS(task_credentials(kCluster, std::string(300, 'j'), ""), Error);
  clear_environment();
}
