// SPDX-License-Identifier: MIT
// The role runner: a job in one process and as one task per thread over TCP, the end of
// training said by a message, failures that end in a non-zero status and one line naming
// the cause, and the job read from flags and TF_CONFIG.
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/runner/run.hpp"
#include "pulley/sharding/partitioned.hpp"

#include <doctest/doctest.h>
#include <stdlib.h>

#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pulley/optimizers/sgd.hpp"
#include "pulley/runner/job.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cut_proxy.hpp"
#include "support/linear_model.hpp"
#include "support/log_capture.hpp"
#include "support/table_model.hpp"
#include "support/tcp.hpp"

using namespace pulley;
using pulley::testing::free_addresses;
using pulley::testing::LogCapture;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;

namespace {

/// A linear-regression job: 60 steps, evaluated every 20.
struct Recorded {
  std::mutex mutex;
  std::vector<Evaluation> evaluations;
};

Training<LinearModel> linear_training(const LinearData& data, Recorded& recorded) {
  Training<LinearModel> training;
  training.model = [] { return LinearModel(3, 2); };
  training.data = [&data](const DataShard&) {
    return [&data] { return LinearBatch{data.x, data.y}; };
  };
  training.last_step = 60;
  training.evaluate_every = 20;
  training.samples_per_step = 4;
  training.evaluate = [&recorded](LinearModel&, const Evaluation& e) {
    std::scoped_lock lock(recorded.mutex);
    recorded.evaluations.push_back(e);
  };
  return training;
}

Job task_of(const ClusterSpec& cluster, const std::string& type, std::uint32_t index) {
  Job job;
  job.cluster = TfConfig{cluster, {type, index}};
  job.credentials = {"runner-test", "a secret only these tests know"};  // a ps refuses to serve without one
  return job;
}

/// Runs each of `tasks` (pulley::run with RoundRobin and Sgd) on a thread of its own,
/// which sets the task's status; join them before reading it.
template <class M, class Sync>
std::vector<std::thread> start_tasks(std::vector<std::pair<Job, int>>& tasks,
                                     const Training<M>& training, const Sync& sync) {
  std::vector<std::thread> threads;
  for (auto& [job, status] : tasks) {
    threads.emplace_back([&training, sync, &job = job, &status = status] {
      status = run(job, training, RoundRobin{}, Sgd{0.05F}, sync);
    });
  }
  return threads;
}

/// Stands a data source still at its 10th batch until released (15 s at most).
struct Gate {
  std::atomic<int> batches{0};
  std::atomic<bool> held{true};

  /// A batch's way through: waits here from the 10th on while held.
  void pass() {
    for (int i = 0; i < 3000 && held && batches >= 10; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ++batches;
  }
  /// Waits (10 s at most) until a source stands at the gate; true once one does.
  bool reached() const {
    for (int i = 0; i < 1000 && batches < 10; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return batches >= 10;
  }
  void release() { held = false; }
};

/// Two ps tasks, `workers` workers and a chief on free addresses of 127.0.0.1.
ClusterSpec two_ps_cluster(std::size_t workers) {
  const auto addresses = free_addresses(3 + workers);
  ClusterSpec cluster;
  cluster.roles["ps"] = {addresses[0], addresses[1]};
  cluster.roles["worker"].assign(addresses.begin() + 2,
                                 addresses.begin() + 2 + static_cast<std::ptrdiff_t>(workers));
  cluster.roles["chief"] = {addresses[2 + workers]};
  return cluster;
}

/// Checks that every task ended with `expected`; prints the captured log beside one that
/// did not.
void check_statuses(const std::vector<std::pair<Job, int>>& tasks, LogCapture& log, int expected) {
  for (const auto& [job, status] : tasks) {
    INFO(job.name(), " ended so; the log:\n", log.text());
    CHECK(status == expected);
  }
}

/// Proxies in front of a cluster's ps tasks (they pass everything until told otherwise),
/// and the cluster as a task that reaches the ps tasks through them sees it.
struct Proxied {
  std::vector<std::unique_ptr<pulley::testing::CutProxy>> proxies;
  ClusterSpec view;

  explicit Proxied(const ClusterSpec& cluster) : view(cluster) {
    const std::vector<std::string>& ps = cluster.roles.at("ps");
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto port = static_cast<std::uint16_t>(std::stoi(ps[i].substr(ps[i].rfind(':') + 1)));
      proxies.push_back(std::make_unique<pulley::testing::CutProxy>(port, 0.0, i));
      view.roles["ps"][i] = "127.0.0.1:" + std::to_string(proxies.back()->port());
    }
  }

  /// Cuts the tasks behind the proxies off `faults` times, `cut` each (0.4 s: well within a
  /// 2.5 s recovery timeout), 1.5 s apart: four of 0.4 s 6.1 s from first to last.
  void cut_off(int faults, std::chrono::milliseconds cut = std::chrono::milliseconds(400)) {
    for (int fault = 0; fault < faults; ++fault) {
      for (auto& p : proxies) p->partition(true);
      std::this_thread::sleep_for(cut);
      for (auto& p : proxies) p->partition(false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
  }
};

/// What the proxied jobs below share: a captured log, two ps tasks, `Workers` workers and a
/// chief on 127.0.0.1 with proxies in front of the ps tasks (Proxied), and the linear
/// model's training, whose evaluations are recorded.
template <std::size_t Workers>
struct ProxiedJob {
  LogCapture log;
  const ClusterSpec cluster = two_ps_cluster(Workers);
  Proxied proxied{cluster};
  const LinearData data{4, 3, 2, 1};
  Recorded recorded;
  Training<LinearModel> training = linear_training(data, recorded);
};

}  // namespace

TEST_CASE("an in-process job trains, evaluates at the steps asked, and ends with status 0") {
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  Job job;
  job.local_ps = 2;
  job.local_workers = 2;
  const int status = run(job, linear_training(data, recorded), RoundRobin{}, Sgd{0.05F},
                         SyncReplicas(2, 2));
  CHECK(status == 0);
  REQUIRE(recorded.evaluations.size() == 3);
  // Training does not wait for the chief: a snapshot is read at its step or, when the chief
  // comes late (a loaded machine), at the step the ps tasks are at then.
  CHECK(recorded.evaluations[0].step >= 20);
  CHECK(recorded.evaluations[1].step >= 40);
  CHECK(recorded.evaluations[1].step >= recorded.evaluations[0].step);
  CHECK(recorded.evaluations[2].step == 60);
  for (const Evaluation& e : recorded.evaluations) CHECK(e.consistent);
  CHECK(recorded.evaluations[2].last);
  CHECK_FALSE(recorded.evaluations[1].last);
  REQUIRE(recorded.evaluations[2].stats.size() == 2);
  CHECK(recorded.evaluations[2].stats[0].global_step == 60);
}

TEST_CASE("a job whose optimizer settings are unusable fails at once, naming the field, before any task starts") {
  pulley::testing::LogCapture captured;
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  Job job;
  job.local_ps = 1;
  job.local_workers = 1;
  const int status = run(job, linear_training(data, recorded), RoundRobin{},
                         Sgd{std::numeric_limits<float>::quiet_NaN()}, SyncReplicas(1, 1));
  CHECK(status == 1);
  CHECK(recorded.evaluations.empty());
  CHECK(captured.find(LogLevel::kError, "learning_rate is nan: it must be a finite number of 0 or more").size() == 1);
}

TEST_CASE("an in-process job whose worker fails ends every task and names the worker") {
  LogCapture log;
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  Training<LinearModel> training = linear_training(data, recorded);
  training.last_step = 100000;  // it would run for long: the failure must end it
  training.data = [&data](const DataShard& shard) {
    const std::uint32_t worker = shard.index;
    return [&data, worker, calls = 0]() mutable {
      if (worker == 1 && ++calls == 30) throw std::runtime_error("the disk went away");
      return LinearBatch{data.x, data.y};
    };
  };
  Job job;
  job.local_workers = 3;
  const int status =
      run(job, training, RoundRobin{}, Sgd{0.05F}, SyncReplicas(3, 3));
  CHECK(status == 1);
  const auto lines = log.find(LogLevel::kError, "worker 1 failed: the disk went away");
  CHECK(lines.size() == 1);  // one line: the cause, not its consequences
}

TEST_CASE("one task per thread over TCP: ps, chief, workers and evaluator all end with 0") {
  const ClusterSpec cluster = two_ps_cluster(2);
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  const Training<LinearModel> training = linear_training(data, recorded);
  std::vector<std::pair<Job, int>> tasks;
  for (std::uint32_t i = 0; i < 2; ++i) tasks.emplace_back(task_of(cluster, "ps", i), -1);
  for (std::uint32_t i = 0; i < 2; ++i) tasks.emplace_back(task_of(cluster, "worker", i), -1);
  tasks.emplace_back(task_of(cluster, "chief", 0), -1);
  tasks.emplace_back(task_of(cluster, "evaluator", 0), -1);
  std::vector<std::thread> threads = start_tasks(tasks, training, BoundedStaleness(1, 2));
  for (auto& t : threads) t.join();
  for (const auto& [job, status] : tasks) {
    INFO(job.name());
    CHECK(status == 0);
  }
  std::size_t chief = 0, evaluator = 0;
  for (const Evaluation& e : recorded.evaluations) {
    (e.role == Node::Role::kChief ? chief : evaluator) += 1;
  }
  CHECK(chief == 3);
  CHECK(evaluator <= 3);  // it may hear of the end before its last evaluation
}

TEST_CASE("over TCP a chief that fails aborts the job, and every task fails naming why") {
  LogCapture log;
  const auto addresses = free_addresses(3);
  ClusterSpec cluster;
  cluster.roles["ps"] = {addresses[0]};
  cluster.roles["worker"] = {addresses[1]};
  cluster.roles["chief"] = {addresses[2]};
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  Training<LinearModel> training = linear_training(data, recorded);
  training.evaluate = [](LinearModel&, const Evaluation&) {
    throw std::runtime_error("the evaluation set is corrupt");
  };
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "worker", 0), -1},
                                         {task_of(cluster, "chief", 0), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(1, 1));
  for (auto& t : threads) t.join();
  check_statuses(tasks, log, 1);
  CHECK(log.find(LogLevel::kError, "chief:0 failed: the evaluation set is corrupt").size() == 1);
  CHECK(log.find(LogLevel::kError, "worker:0 failed: aborted").size() == 1);
  CHECK(log.find(LogLevel::kError, "ps:0 failed: aborted").size() == 1);
  CHECK(log.find(LogLevel::kError, "the evaluation set is corrupt").size() == 3);
}

TEST_CASE_FIXTURE(ProxiedJob<1>,
                  "over TCP a chief whose connections break goes on, rolling nothing back") {
  // The chief reaches the ps tasks through proxies; at its first evaluation (due at step
  // 20: a loaded machine may read it later), the next answer each ps sends it is lost with
  // its connection.
  auto& proxies = proxied.proxies;
  const ClusterSpec& chief_view = proxied.view;
  training.evaluate = [&](LinearModel&, const Evaluation& e) {
    std::scoped_lock lock(recorded.mutex);
    recorded.evaluations.push_back(e);
    if (recorded.evaluations.size() == 1) {
      for (auto& p : proxies) p->cut_next(1);
    }
  };
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "ps", 1), -1},
                                         {task_of(cluster, "worker", 0), -1},
                                         {task_of(chief_view, "chief", 0), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(1, 1));
  for (auto& t : threads) t.join();
  check_statuses(tasks, log, 0);
  CHECK(proxies[0]->cuts() + proxies[1]->cuts() >= 1);
  CHECK(log.find(LogLevel::kInfo, "every ps answers again and holds the job").size() >= 1);
  CHECK(log.find(LogLevel::kWarning, "restored").empty());  // nothing rolled back
  // Every evaluation came, in order (the one due at 40 may read a later step: the worker
  // does not wait for the chief's reconnection).
  std::vector<std::int64_t> steps;
  for (const Evaluation& e : recorded.evaluations) steps.push_back(e.step);
  REQUIRE(steps.size() == 3);
  CHECK(steps[0] >= 20);
  CHECK(steps[1] >= 40);
  CHECK(steps[2] == 60);
}

TEST_CASE_FIXTURE(
    ProxiedJob<1>,
    "over TCP a chief cut off again and again while it waits goes on: each fault has its own "
    "recovery deadline") {
  const ClusterSpec& chief_view = proxied.view;
  // The worker stands still at its 10th batch until the faults are over, so the chief's
  // wait for step 20 (its first evaluation) spans all of them.
  Gate gate;
  training.data = [&](const DataShard&) {
    return [&] {
      gate.pass();
      return LinearBatch{data.x, data.y};
    };
  };
  training.client.recovery_timeout = std::chrono::milliseconds(2500);
  training.tcp.attempt_timeout = std::chrono::milliseconds(200);
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "ps", 1), -1},
                                         {task_of(cluster, "worker", 0), -1},
                                         {task_of(chief_view, "chief", 0), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(1, 1));
  // Four faults (Proxied::cut_off): the chief's wait breaks at each.
  CHECK(gate.reached());
  proxied.cut_off(4);
  gate.release();
  for (auto& t : threads) t.join();
  check_statuses(tasks, log, 0);
  // The chief saw the faults (each one's wait logged once) and came back from each.
  CHECK(log.find(LogLevel::kWarning, "chief: unavailable").size() >= 3);
  CHECK(log.find(LogLevel::kInfo, "every ps answers again and holds the job").size() >= 3);
  CHECK(log.find(LogLevel::kWarning, "restored").empty());  // nothing rolled back
  REQUIRE(recorded.evaluations.size() == 3);
  CHECK(recorded.evaluations[2].step == 60);
}

TEST_CASE_FIXTURE(ProxiedJob<2>,
                  "over TCP a worker cut off again and again within one long sync step trains on") {
  // Worker 0 reaches the ps tasks through proxies. Worker 1 stands still at its 10th batch
  // while they cut worker 0 off four times (Proxied::cut_off): worker 0's step (R = N = 2:
  // it needs worker 1's push) spans all four faults.
  const ClusterSpec& worker_view = proxied.view;
  Gate gate;
  training.data = [&](const DataShard& shard) {
    return [&, slow = shard.index == 1] {
      if (slow) gate.pass();
      return LinearBatch{data.x, data.y};
    };
  };
  training.client.recovery_timeout = std::chrono::milliseconds(2500);
  training.tcp.attempt_timeout = std::chrono::milliseconds(200);
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "ps", 1), -1},
                                         {task_of(worker_view, "worker", 0), -1},
                                         {task_of(cluster, "worker", 1), -1},
                                         {task_of(cluster, "chief", 0), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(2, 2));
  CHECK(gate.reached());
  std::this_thread::sleep_for(
      std::chrono::milliseconds(200));  // worker 0 waits for worker 1's push
  proxied.cut_off(4);
  gate.release();
  for (auto& t : threads) t.join();
  check_statuses(tasks, log, 0);
  // It saw the faults (one step's wait is logged once) and came back from each.
  CHECK(log.find(LogLevel::kWarning, "worker 0: unavailable").size() >= 1);
  CHECK(log.find(LogLevel::kWarning, "lost (last heard").empty());  // nobody held lost
  REQUIRE(recorded.evaluations.size() == 3);
  CHECK(recorded.evaluations[2].step == 60);
}

TEST_CASE_FIXTURE(
    ProxiedJob<1>,
    "over TCP a worker cut off again and again while it waits for the chief to end training ends "
    "with 0") {
  // The worker reaches the ps tasks through proxies; the chief's last evaluation lasts
  // while they cut the worker off four times (Proxied::cut_off).
  const ClusterSpec& worker_view = proxied.view;
  training.evaluate = [&](LinearModel&, const Evaluation& e) {
    if (e.last) proxied.cut_off(4);
    std::scoped_lock lock(recorded.mutex);
    recorded.evaluations.push_back(e);
  };
  training.client.recovery_timeout = std::chrono::milliseconds(2500);
  training.tcp.attempt_timeout = std::chrono::milliseconds(200);
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "ps", 1), -1},
                                         {task_of(worker_view, "worker", 0), -1},
                                         {task_of(cluster, "chief", 0), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(1, 1));
  for (auto& t : threads) t.join();
  check_statuses(tasks, log, 0);
  CHECK(log.find(LogLevel::kWarning, "worker 0: unavailable").size() >=
        1);  // it saw the faults (one wait, logged once)
  CHECK(log.find(LogLevel::kInfo, "worker 0: training finished after 60 steps").size() == 1);
  REQUIRE(recorded.evaluations.size() == 3);
  CHECK(recorded.evaluations[2].step == 60);
}

TEST_CASE_FIXTURE(
    ProxiedJob<1>,
    "over TCP a worker cut off while the chief ends training hears the end once the cut heals, "
    "and ends with 0") {
  // The worker reaches the ps tasks through proxies. At the last evaluation, once the worker
  // waits for the chief to end training, they cut it off for 1.5 s; the chief ends training
  // inside the cut, so the worker's tries to reach the ps tasks again fail until it heals,
  // and the first that gets through hears that training ended.
  const ClusterSpec& worker_view = proxied.view;
  std::thread cutter;
  training.evaluate = [&](LinearModel&, const Evaluation& e) {
    if (e.last) {
      cutter = std::thread([&] {
        std::this_thread::sleep_for(
            std::chrono::milliseconds(200));  // the worker waits for the end
        proxied.cut_off(1, std::chrono::milliseconds(1500));
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the cut has begun
    }
    std::scoped_lock lock(recorded.mutex);
    recorded.evaluations.push_back(e);
  };
  training.client.recovery_timeout = std::chrono::milliseconds(5000);
  training.tcp.attempt_timeout = std::chrono::milliseconds(200);
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "ps", 1), -1},
                                         {task_of(worker_view, "worker", 0), -1},
                                         {task_of(cluster, "chief", 0), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(1, 1));
  for (auto& t : threads) t.join();
  if (cutter.joinable()) cutter.join();
  check_statuses(tasks, log, 0);
  CHECK(log.find(LogLevel::kWarning, "worker 0: unavailable").size() == 1);  // it saw the cut
  CHECK(log.find(LogLevel::kInfo, "worker 0: training finished after 60 steps").size() == 1);
  REQUIRE(recorded.evaluations.size() == 3);
  CHECK(recorded.evaluations[2].step == 60);
}

TEST_CASE(
    "a task that gave its ps tasks up says so of the chief too when its address takes no "
    "connection") {
  const std::string chief = free_addresses(1)[0];
  TcpOptions tcp;
  tcp.attempt_timeout = std::chrono::milliseconds(500);
  const auto lost_ps = [] {
    throw Error(ErrorCode::kUnavailable, "the ps tasks were not back within 8 s");
  };
  // Nobody at the chief's address: the failure names the chief.
  try {
    runner_detail::naming_a_lost_chief(chief, tcp, lost_ps);
    FAIL("it did not fail");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK(std::string(e.message()) ==
          "the ps tasks were not back within 8 s; the chief's address " + chief +
              " takes no connection either: the chief has ended or is lost");
  }
  // Another failure, or a chief that listens: the failure as it was.
  try {
    runner_detail::naming_a_lost_chief(
        chief, tcp, [] { throw Error(ErrorCode::kAborted, "aborted by the chief"); });
    FAIL("it did not fail");
  } catch (const Error& e) {
    CHECK(std::string(e.message()) == "aborted by the chief");
  }
  asio::io_context io;
  const auto port = static_cast<std::uint16_t>(std::stoi(chief.substr(chief.rfind(':') + 1)));
  asio::ip::tcp::acceptor listening(io, {asio::ip::make_address("127.0.0.1"), port});
  try {
    runner_detail::naming_a_lost_chief(chief, tcp, lost_ps);
    FAIL("it did not fail");
  } catch (const Error& e) {
    CHECK(std::string(e.message()) == "the ps tasks were not back within 8 s");
  }
}

TEST_CASE("a cluster without a chief task makes worker 0 the chief, as TensorFlow does") {
  const auto addresses = free_addresses(3);
  ClusterSpec cluster;
  cluster.roles["ps"] = {addresses[0]};
  cluster.roles["worker"] = {addresses[1], addresses[2]};
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  const Training<LinearModel> training = linear_training(data, recorded);
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "worker", 0), -1},
                                         {task_of(cluster, "worker", 1), -1}};
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(2, 2));
  for (auto& t : threads) t.join();
  for (const auto& [job, status] : tasks) CHECK(status == 0);
  CHECK(recorded.evaluations.size() == 3);
}

TEST_CASE("the job comes from --slurm-roles, then --role, then TF_CONFIG, then in-process") {
  ::setenv("PULLEY_SECRET", "the runner test's secret", 1);  // no secret file is made
  ::unsetenv("TF_CONFIG");
  ::unsetenv("SLURM_PROCID");
  JobFlags flags;
  flags.ps = 3;
  flags.workers = 4;
  Job job = resolve_job(flags);
  CHECK(job.in_process());
  CHECK(job.num_ps() == 3);
  CHECK(job.num_workers() == 4);

  ::setenv("TF_CONFIG",
           R"({"cluster": {"ps": ["h:1"], "worker": ["h:2", "h:3"]}, "task": {"type": "worker", "index": 1}})",
           1);
  job = resolve_job(flags);
  REQUIRE_FALSE(job.in_process());
  CHECK(job.name() == "worker:1");
  CHECK(job.num_workers() == 2);

  flags.role = "ps";
  flags.ps_hosts = {"a:10"};
  flags.worker_hosts = {"b:11"};
  job = resolve_job(flags);  // flags win over TF_CONFIG
  CHECK(job.name() == "ps:0");
  CHECK(job.num_workers() == 1);

  flags.worker_hosts = {"a:10"};  // the same address twice
  CHECK_THROWS_WITH_AS(resolve_job(flags), doctest::Contains("cluster flags: address"), Error);
  flags.worker_hosts = {};
  CHECK_THROWS_WITH_AS(resolve_job(flags), doctest::Contains("no \"worker\" task"), Error);
  flags.slurm_roles = "ps:1,worker:1";
  CHECK_THROWS_WITH_AS(resolve_job(flags), doctest::Contains("exclude each other"), Error);
  flags.role.clear();
  CHECK_THROWS_WITH_AS(resolve_job(flags), doctest::Contains("needs a Slurm step"), Error);
  ::unsetenv("TF_CONFIG");
}

TEST_CASE("when worker 0 is also the chief and fails, it ends the job at once, naming why") {
  LogCapture log;
  const auto addresses = free_addresses(3);
  ClusterSpec cluster;
  cluster.roles["ps"] = {addresses[0]};
  cluster.roles["worker"] = {addresses[1], addresses[2]};
  const LinearData data(4, 3, 2, 1);
  Recorded recorded;
  Training<LinearModel> training = linear_training(data, recorded);
  training.last_step = 100000;
  training.data = [&data](const DataShard& shard) {
    const std::uint32_t worker = shard.index;
    return [&data, worker, calls = 0]() mutable {
      if (worker == 0 && ++calls == 20) throw std::runtime_error("out of examples");
      return LinearBatch{data.x, data.y};
    };
  };
  std::vector<std::pair<Job, int>> tasks{{task_of(cluster, "ps", 0), -1},
                                         {task_of(cluster, "worker", 0), -1},
                                         {task_of(cluster, "worker", 1), -1}};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads = start_tasks(tasks, training, SyncReplicas(2, 2));
  for (auto& t : threads) t.join();
  // Without the abort, the chief's thread would wait for steps until its 30-minute deadline.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
  for (const auto& [job, status] : tasks) CHECK(status == 1);
  CHECK(log.find(LogLevel::kError, "worker:0 failed: out of examples").size() == 1);
  CHECK(log.find(LogLevel::kError, "worker:1 failed: aborted").size() == 1);
}

TEST_CASE("a job resumed from its checkpoints ends where the uninterrupted one does") {
  // Sync R = N = 2 with a batch per worker per step from DataShard::start_step: a job that
  // stops at step 30 and one that resumes from its checkpoint to step 60 together are the
  // 60-step job, bit for bit.
  const LinearData data(2 * 4 * 60, 3, 2, 11);
  auto training_to = [&](std::int64_t last, const std::string& directory, std::vector<float>& out) {
    Training<LinearModel> training;
    training.model = [] { return LinearModel(3, 2); };
    training.data = [&data](const DataShard& shard) {
      return [&data, shard, k = shard.start_step]() mutable {
        const std::size_t row = static_cast<std::size_t>((k++ * 2 + shard.index) * 4);
        return LinearBatch{std::span(data.x).subspan(row * 3, 12), std::span(data.y).subspan(row * 2, 8)};
      };
    };
    training.last_step = last;
    training.evaluate_every = 10;
    training.checkpoint.directory = directory;
    training.checkpoint.save_steps = 10;
    training.evaluate = [&out](LinearModel& model, const Evaluation& e) {
      if (!e.last) return;
      out.assign(model.parameter(0).begin(), model.parameter(0).end());
      out.insert(out.end(), model.parameter(1).begin(), model.parameter(1).end());
    };
    Job job;
    job.local_ps = 2;
    job.local_workers = 2;
    return run(job, training, FixedShards{2}, Adam{0.01F}, SyncReplicas(2, 2));
  };
  const auto tmp = std::filesystem::temp_directory_path() / ("pulley-runner-" + std::to_string(::getpid()));
  std::filesystem::remove_all(tmp);
  std::vector<float> straight, first, resumed;
  REQUIRE(training_to(60, "", straight) == 0);
  REQUIRE(training_to(30, tmp.string(), first) == 0);
  CHECK(CheckpointDirectory::list(tmp).front().first == 30);
  REQUIRE(training_to(60, tmp.string(), resumed) == 0);
  CHECK(CheckpointDirectory::list(tmp).front().first == 60);
  CHECK(resumed == straight);
  CHECK(first != straight);
  std::filesystem::remove_all(tmp);
}

TEST_CASE("a job with embedding tables checkpoints its rows, and resumed from them ends where the uninterrupted one does") {
  // Every checkpoint full, or every third one (those between incremental: a resume then
  // applies them over the full one before).
  std::int64_t full_every = 1;
  SUBCASE("full checkpoints") { full_every = 1; }
  SUBCASE("incremental checkpoints") { full_every = 3; }
  CAPTURE(full_every);
  using pulley::testing::TableBatchOf;
  using pulley::testing::TinyTableModel;
  const auto batches = pulley::testing::table_batches(2 * 40, 8, 300, 6);
  // Rows the last evaluation reads: some a batch used, and one none did.
  std::vector<std::uint64_t> ids{mix_id(987654321)};
  for (std::size_t b = 0; ids.size() < 30; ++b) ids.push_back(batches[b][0].ids[0]);
  std::vector<float> evaluated;
  auto training_to = [&](std::int64_t last, const std::string& directory) {
    Training<TinyTableModel> training;
    training.evaluate = [&](TinyTableModel&, const Evaluation& e) {
      if (!e.last) return;
      REQUIRE(e.rows);
      evaluated.assign(ids.size() * TinyTableModel::kDim, 0.0F);
      e.rows(0, ids, evaluated);
    };
    training.model = [] { return TinyTableModel(); };
    training.data = [&batches](const DataShard& shard) {
      return [&batches, shard, k = shard.start_step]() mutable {
        return batches[static_cast<std::size_t>((k++ % 40) * 2 + shard.index)];  // a worker may read past the end
      };
    };
    training.last_step = last;
    training.checkpoint.directory = directory;
    training.checkpoint.save_steps = 10;
    training.checkpoint.keep = 0;
    training.checkpoint.full_every = full_every;
    Job job;
    job.local_ps = 2;
    job.local_workers = 2;
    return run(job, training, RoundRobin{}, Adagrad{0.1F}, SyncReplicas(2, 2));
  };
  const auto tmp = std::filesystem::temp_directory_path() /
                   ("pulley-runner-tables-" + std::to_string(::getpid()) + "-" + std::to_string(full_every));
  std::filesystem::remove_all(tmp);
  REQUIRE(training_to(40, (tmp / "straight").string()) == 0);
  // The chief's last evaluation read the rows of the last checkpoint, absent ones as their
  // initial values from the checkpoint's table seed; an evaluator on the directory reads
  // the same from disk.
  const ModelState last = CheckpointDirectory::load(tmp / "straight" / CheckpointDirectory::name_of(40));
  // With full_every 3, checkpoints 1, 2, 4, 5, ... (in order) hold only the rows changed
  // since the one before; 0, 3, 6, ... all of them. (How many there are depends on how far
  // the workers outrun the chief; step 0 and the last step always have one.)
  {
    auto all = CheckpointDirectory::list(tmp / "straight");  // newest first
    std::reverse(all.begin(), all.end());
    REQUIRE(all.size() >= 2);
    for (std::size_t k = 0; k < all.size(); ++k) {
      CAPTURE(k);
      const ModelState head = checkpoint::read_checkpoint(all[k].second, false);
      CHECK(head.incremental() == (k % static_cast<std::size_t>(full_every) != 0));
      if (head.incremental()) CHECK(head.base_step == all[k - 1].first);
    }
  }
  std::vector<float> expected(ids.size() * TinyTableModel::kDim);
  CheckpointRows(last.tables.at(0), last.table_seed).lookup(ids, expected);
  CHECK(evaluated == expected);
  CHECK_FALSE(CheckpointRows(last.tables.at(0), last.table_seed).contains(ids[0]));
  std::vector<float> initial(TinyTableModel::kDim);
  initialize_row(TinyTableModel().tables()[0], last.table_seed, ids[0], initial);
  CHECK(std::vector<float>(expected.begin(), expected.begin() + TinyTableModel::kDim) == initial);
  evaluated.clear();
  {
    Training<TinyTableModel> reader;
    reader.model = [] { return TinyTableModel(); };
    reader.checkpoint.directory = (tmp / "straight").string();
    reader.last_step = 40;
    reader.evaluate = [&](TinyTableModel&, const Evaluation& e) {
      if (!e.last) return;
      REQUIRE(e.rows);
      evaluated.assign(ids.size() * TinyTableModel::kDim, 0.0F);
      e.rows(0, ids, evaluated);
    };
    runner_detail::follow_checkpoints(reader);
  }
  CHECK(evaluated == expected);
  REQUIRE(training_to(20, (tmp / "resumed").string()) == 0);
  // With full_every 3 the job resumes from an incremental checkpoint (step 20 is at least
  // the second), applied over the full one before it.
  CHECK(checkpoint::read_checkpoint(tmp / "resumed" / CheckpointDirectory::name_of(20), false).incremental() ==
        (full_every == 3));
  REQUIRE(training_to(40, (tmp / "resumed").string()) == 0);
  // Each table as id → (values and slots, last touched): the order of rows is the ps's own.
  auto rows_at = [&](const char* run, std::int64_t step) {
    const ModelState state = CheckpointDirectory::load(tmp / run / CheckpointDirectory::name_of(step));
    REQUIRE(state.tables.size() == 1);
    const TableState& t = state.tables[0];
    std::map<std::uint64_t, std::pair<std::vector<float>, std::uint32_t>> rows;
    for (std::size_t i = 0; i < t.ids.size(); ++i) {
      rows[t.ids[i]] = {std::vector<float>(t.rows.begin() + static_cast<std::ptrdiff_t>(i * t.stride()),
                                           t.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * t.stride())),
                        t.touched[i]};
    }
    return std::make_pair(rows, state.variables[1].values);
  };
  {
    // Checkpoint 0 is step 0: a row the workers' first pulls created before the cut holds
    // its initial value.
    const ModelState zero = checkpoint::read_checkpoint(tmp / "straight" / CheckpointDirectory::name_of(0));
    const TableState& t = zero.tables.at(0);
    std::vector<float> fresh(TinyTableModel::kDim);
    for (std::size_t i = 0; i < t.ids.size(); ++i) {
      initialize_row(t.spec, zero.table_seed, t.ids[i], fresh);
      CHECK(std::equal(fresh.begin(), fresh.end(), t.rows.begin() + static_cast<std::ptrdiff_t>(i * t.stride())));
    }
  }
  CHECK_FALSE(rows_at("resumed", 20).first.empty());
  // (A checkpoint due by steps is cut later when the workers outrun the chief: only the
  // first and last steps' are certain.)
  CHECK(rows_at("resumed", 40) == rows_at("straight", 40));
  // Another model's tables are not restored from it.
  {
    LogCapture log;
    Training<TinyTableModel> other;
    other.model = [] { return TinyTableModel(TableSpec{"other", TinyTableModel::kDim, Initializer::zeros()}); };
    other.data = [&batches](const DataShard&) { return [&batches] { return batches[0]; }; };
    other.last_step = 50;
    other.checkpoint.directory = (tmp / "straight").string();
    Job job;
    job.local_ps = 1;
    job.local_workers = 1;
    CHECK(run(job, other, RoundRobin{}, Adagrad{0.1F}, SyncReplicas(1, 1)) != 0);
    CHECK_FALSE(log.find(LogLevel::kError, "is it another model's checkpoint directory?").empty());
  }
  std::filesystem::remove_all(tmp);
}

namespace {

/// What an evaluator scored: each evaluation, and the parameters it was given.
struct Scored {
  std::mutex mutex;
  std::vector<Evaluation> evaluations;
  std::vector<std::vector<float>> values;  ///< every parameter, concatenated, by evaluation
};

/// The linear job with a checkpoint every 10 steps to `directory`, all kept; its evaluator
/// records into `scored` (the chief's evaluations are not recorded).
Training<LinearModel> checkpointed_training(const LinearData& data, const std::string& directory,
                                            Scored& scored) {
  Recorded unused;
  Training<LinearModel> training = linear_training(data, unused);
  training.checkpoint.directory = directory;
  training.checkpoint.save_steps = 10;
  training.checkpoint.keep = 0;
  training.evaluate = [&scored](LinearModel& model, const Evaluation& e) {
    if (e.role != Node::Role::kEvaluator) return;
    std::vector<float> values(model.parameter(0).begin(), model.parameter(0).end());
    values.insert(values.end(), model.parameter(1).begin(), model.parameter(1).end());
    std::scoped_lock lock(scored.mutex);
    scored.evaluations.push_back(e);
    scored.values.push_back(std::move(values));
  };
  return training;
}

/// A checkpoint's parameters, concatenated as the evaluate callback records them.
std::vector<float> checkpoint_values(const std::filesystem::path& directory, std::int64_t step) {
  const ModelState state =
      checkpoint::read_checkpoint(directory / CheckpointDirectory::name_of(step));
  std::vector<float> values;
  for (const VariableState& v : state.variables) values.insert(values.end(), v.values.begin(), v.values.end());
  return values;
}

/// Writes the checkpoints of the linear job to `directory`: step 0 (cut before any push is
/// taken), then 10, ..., 60, each the last step of a job resumed from the one before.
void write_checkpoints(const LinearData& data, const std::string& directory) {
  Scored unused;
  Training<LinearModel> training = checkpointed_training(data, directory, unused);
  Job job;
  job.local_ps = 2;
  job.local_workers = 2;
  for (training.last_step = 10; training.last_step <= 60; training.last_step += 10) {
    REQUIRE(run(job, training, RoundRobin{}, Sgd{0.05F}, SyncReplicas(2, 2)) == 0);
  }
}

/// A transport factory for an evaluator that must not use one.
InProcess no_ps() { throw std::logic_error("the evaluator connected to the ps tasks"); }

}  // namespace

TEST_CASE("an evaluator on the checkpoint directory scores each checkpoint once, from disk") {
  const auto tmp = std::filesystem::temp_directory_path() / ("pulley-follow-" + std::to_string(::getpid()));
  std::filesystem::remove_all(tmp);
  const LinearData data(4, 3, 2, 1);
  Scored scored;
  const Training<LinearModel> training = checkpointed_training(data, tmp.string(), scored);
  // The evaluator starts before the job (the directory does not exist yet) and follows it.
  std::exception_ptr failed;
  std::thread evaluator([&] {
    try {
      runner_detail::follow(training, no_ps);
    } catch (...) {
      failed = std::current_exception();
    }
  });
  write_checkpoints(data, tmp.string());
  evaluator.join();
  REQUIRE_FALSE(failed);
  // Every checkpoint written, each once, in order, with its values; only the last marked last.
  const std::vector<std::int64_t> written{0, 10, 20, 30, 40, 50, 60};
  REQUIRE(CheckpointDirectory::list(tmp).size() == written.size());
  REQUIRE(scored.evaluations.size() == written.size());
  for (std::size_t i = 0; i < written.size(); ++i) {
    const Evaluation& e = scored.evaluations[i];
    INFO("step " << written[i]);
    CHECK(e.step == written[i]);
    CHECK(e.consistent);
    CHECK(e.last == (i + 1 == written.size()));
    CHECK(scored.values[i] == checkpoint_values(tmp, written[i]));
  }
  CHECK(scored.values.front() != scored.values.back());  // it trained: the values differ

  // A finished job's directory, read again: the same evaluations.
  Scored again;
  runner_detail::follow(checkpointed_training(data, tmp.string(), again), no_ps);
  REQUIRE(again.evaluations.size() == written.size());
  CHECK(again.values == scored.values);
  std::filesystem::remove_all(tmp);
}

TEST_CASE("an evaluator skips a damaged checkpoint, and fails naming the wait for the last one") {
  LogCapture log;
  const auto tmp = std::filesystem::temp_directory_path() / ("pulley-follow-bad-" + std::to_string(::getpid()));
  std::filesystem::remove_all(tmp);
  const LinearData data(4, 3, 2, 1);
  Scored scored;
  Training<LinearModel> training = checkpointed_training(data, tmp.string(), scored);
  write_checkpoints(data, tmp.string());
  std::filesystem::resize_file(tmp / CheckpointDirectory::name_of(30) / "data", 10);
  std::filesystem::remove_all(tmp / CheckpointDirectory::name_of(60));  // the last never comes
  training.client.wait_timeout = std::chrono::milliseconds(100);
  CHECK_THROWS_WITH_AS(runner_detail::follow(training, no_ps),
                       doctest::Contains(("no new checkpoint in " + tmp.string()).c_str()), Error);
  std::vector<std::int64_t> steps;
  std::string listed;  // for the failure message: doctest prints a vector as {?}
  for (const Evaluation& e : scored.evaluations) {
    steps.push_back(e.step);
    listed += std::to_string(e.step) + " ";
  }
  for (const auto& [step, path] : CheckpointDirectory::list(tmp)) listed += "[on disk: " + std::to_string(step) + "] ";
  INFO("scored: " << listed);
  CHECK(steps == std::vector<std::int64_t>{0, 10, 20, 40, 50});
  for (const Evaluation& e : scored.evaluations) CHECK_FALSE(e.last);
  CHECK(log.find(LogLevel::kWarning, "skipping checkpoint " + (tmp / CheckpointDirectory::name_of(30)).string() + ": ")
            .size() == 1);
  std::filesystem::remove_all(tmp);
}
