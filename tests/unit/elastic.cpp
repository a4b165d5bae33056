// SPDX-License-Identifier: MIT
// A ps task that leaves a job for good, in-process: the chief takes it out of the job's
// membership, the model is placed over the others (its parts moved whole) and restored
// there from the checkpoint, exactly as saved (dense parts, slots, counters, table rows);
// workers that knew the old members follow; a sync R = N job that lost a ps ends bit for
// bit where the same job with all its ps tasks ends; a request of the shape before is
// refused as late; a process started on the lost ps's address is not waited for and ends
// with the job; and, message by message, what a ps refuses of a membership.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/linear_model.hpp"
#include "support/membership.hpp"
#include "support/two_workers.hpp"
#include "support/table_model.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::LinearBatch;
using pulley::testing::LinearData;
using pulley::testing::LinearModel;
using namespace pulley::testing::two_workers;
using namespace pulley::testing::membership;
using pulley::testing::TableBatchOf;
using pulley::testing::TinyTableModel;

namespace {

using SyncAdam = Cluster<FixedShards, Adam, SyncReplicas>;

bool places_on(const Placement& placement, std::uint32_t ps) {
  return std::any_of(placement.parts.begin(), placement.parts.end(), [&](const Part& p) { return p.ps == ps; });
}

}  // namespace

TEST_CASE("a ps killed for good leaves: the others take its parts from the checkpoint, exactly as saved") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  REQUIRE(places_on(chief.placement(), 1));
  run_steps(cluster, data, 0, 10);
  const ModelState saved = chief.save_state();

  cluster.network().kill(Node::ps(1));
  CHECK(chief.unreachable(std::chrono::milliseconds(500)) == std::vector<std::uint32_t>{1});
  chief.leave(std::vector<std::uint32_t>{1});
  CHECK(chief.membership() == 1);
  chief.restore(saved);
  CHECK(std::vector<std::uint32_t>(chief.members().begin(), chief.members().end()) ==
        std::vector<std::uint32_t>{0, 2});
  CHECK_FALSE(places_on(chief.placement(), 1));
  CHECK(chief.placement().parts.size() == saved.variables.size() * 3);  // the parts stay, whole
  CHECK(chief.stats().size() == 2);
  check_same_dense(chief.save_state(), saved);
  CHECK(chief.unreachable(std::chrono::milliseconds(500)).empty());  // ps 1 is no member now
}

TEST_CASE("a sync R = N job whose ps leaves at a checkpoint ends bit for bit where the job with every ps ends") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  const ModelState whole = undisturbed_state(data, 3, 30);
  SyncAdam cluster(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  run_steps(cluster, data, 0, 12);
  const ModelState saved = chief.save_state();
  cluster.network().kill(Node::ps(2));
  chief.leave(std::vector<std::uint32_t>{2});
  chief.restore(saved);
  run_steps(cluster, data, 12, 30);  // the workers start knowing 3 ps tasks, and learn of 2
  const ModelState end = chief.save_state();
  check_same_dense(end, whole);
  chief.shutdown();
}

TEST_CASE("workers training when a ps is lost for good follow the job onto the other ps tasks") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  run_steps(cluster, data, 0, 10);
  const ModelState saved = chief.save_state();
  chief.restore(saved);  // the tokens of step 10 the first workers took go with their epoch
  std::atomic<int> failures{0};
  constexpr std::int64_t kLast = 120;
  std::vector<std::thread> workers = start_steps(cluster, data, 10, kLast, failures);
  REQUIRE(chief.wait_for_step(20) < kLast - 20);
  cluster.network().kill(Node::ps(0));  // the pacing ps: ps 1 paces from now on
  chief.leave(chief.unreachable(std::chrono::milliseconds(500)));
  chief.restore(saved);
  for (auto& t : workers) t.join();
  CHECK(failures == 0);
  CHECK(chief.members().front() == 1);
  for (const Stats& s : chief.stats()) CHECK(s.global_step == kLast);
  chief.shutdown();
}

using SyncTables = Cluster<RoundRobin, Adagrad, SyncReplicas>;

TEST_CASE("a ps with table rows leaves: its rows go to the others by rendezvous hashing, every row as saved") {
  SyncTables cluster(3, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), 21);
  const TinyTableModel shape(kSpec);
  chief.initialize(shape.variables(), shape.tables());
  train_tables(cluster, 0, 12);
  const ModelState saved = chief.save_state();
  REQUIRE(saved.tables.at(0).ids.size() > 30);
  cluster.network().kill(Node::ps(1));
  chief.leave(std::vector<std::uint32_t>{1});
  chief.restore(saved);
  const ModelState back = chief.save_state();
  check_same_dense(back, saved);
  CHECK(rows_of(back.tables.at(0)) == rows_of(saved.tables.at(0)));
  // Each member holds the rows HashIds gives it over {0, 2}: their sum is every row.
  std::int64_t held = 0;
  for (const Stats& s : chief.stats()) held += s.table_rows;
  CHECK(static_cast<std::size_t>(held) == saved.tables[0].ids.size());
  const std::uint32_t members[] = {0, 2};
  std::size_t on_0 = 0;
  for (const std::uint64_t id : saved.tables[0].ids) on_0 += HashIds{}.ps_of("emb", id, members) == 0 ? 1 : 0;
  CHECK(chief.stats().at(0).table_rows == static_cast<std::int64_t>(on_0));
  train_tables(cluster, 12, 16);  // and training goes on over two ps tasks
  CHECK(chief.stats().at(1).global_step == 16);
  chief.shutdown();
}

namespace {

using SgdSync = ParameterServer<FixedShards, Adam, SyncReplicas>;

Response ask(SgdSync& ps, Request request) {
  std::optional<Response> out;
  ps.handle(std::move(request), RequestContext{false, Node::chief(), 1}, [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

std::string refusal(const Response& r) {
  const auto* e = std::get_if<ErrorReply>(&r);
  return e == nullptr ? std::string("(accepted)") : e->message;
}

/// An id sharding written for a fixed count of ps tasks (no `ps_of(table, id, members)`).
struct ModuloIds {
  [[nodiscard]] std::uint32_t ps_of(std::string_view, std::uint64_t id, std::uint32_t num_ps) const noexcept {
    return static_cast<std::uint32_t>(id % num_ps);
  }
};

}  // namespace

TEST_CASE("a ps refuses a membership that is not newer, that leaves it out, or names a task outside the cluster") {
  const LinearModel model(kIn, kOut);
  const std::vector<VariableSpec> list(model.variables().begin(), model.variables().end());
  SgdSync ps(1, 3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  CHECK(refusal(ask(ps, Register{list, {}, 0, {0, 1}, 0})).find("at membership 0") != std::string::npos);
  CHECK(refusal(ask(ps, Register{list, {}, 0, {0, 2}, 1})).find("ps 1 is not among the members") != std::string::npos);
  CHECK(refusal(ask(ps, Register{list, {}, 0, {1, 3}, 1})).find("not a ps task of the cluster") != std::string::npos);
  CHECK(refusal(ask(ps, Register{list, {}, 0, {2, 1}, 1})).find("ascending") != std::string::npos);
  const auto first = ask(ps, Register{list, {}, 0, {}, 0});
  REQUIRE(std::holds_alternative<PlacementReply>(first));
  CHECK(std::get<PlacementReply>(first).members == std::vector<std::uint32_t>{0, 1, 2});
  const auto moved = ask(ps, Register{list, {}, 0, {1, 2}, 1});
  REQUIRE(std::holds_alternative<PlacementReply>(moved));
  CHECK_FALSE(places_on(std::get<PlacementReply>(moved).placement, 0));
  CHECK(std::get<PlacementReply>(moved).membership == 1);
  // The same again is harmless; an older or equal one with other members is refused.
  CHECK(std::holds_alternative<PlacementReply>(ask(ps, Register{list, {}, 0, {1, 2}, 1})));
  CHECK(refusal(ask(ps, Register{list, {}, 0, {}, 0})).find("is not newer") != std::string::npos);
  CHECK(refusal(ask(ps, Register{list, {}, 0, {1}, 1})).find("is not newer") != std::string::npos);
  // Unready until its restore: its new share holds nothing yet.
  const auto stats = std::get<StatsReply>(ask(ps, GetStats{}));
  CHECK_FALSE(stats.ready);
  CHECK(stats.members == std::vector<std::uint32_t>{1, 2});
  CHECK(stats.membership == 1);

  ParameterServer<RoundRobin, Adagrad, SyncReplicas, Tables<Adagrad, ModuloIds>> fixed(1, 2, Adagrad{0.1F},
                                                                                        SyncReplicas(2, 2));
  std::optional<Response> answer;
  const TinyTableModel shape(kSpec);
  const std::vector<VariableSpec> dense(shape.variables().begin(), shape.variables().end());
  const std::vector<TableSpec> tables(shape.tables().begin(), shape.tables().end());
  fixed.handle(Register{dense, tables, 0, {1}, 1}, RequestContext{false, Node::chief(), 1},
               [&](Response&& r) { answer = std::move(r); });
  REQUIRE(answer.has_value());
  CHECK(refusal(*answer).find("ElasticIdSharding") != std::string::npos);
}

TEST_CASE("Chief::leave refuses a ps that is no member, or leaving no ps task") {
  SyncAdam cluster(2, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{2});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  CHECK_THROWS_WITH_AS(chief.leave(std::vector<std::uint32_t>{5}), doctest::Contains("not a member"), Error);
  CHECK_THROWS_WITH_AS(chief.leave(std::vector<std::uint32_t>{0, 1}), doctest::Contains("without any ps"), Error);
  CHECK(chief.membership() == 0);
  chief.shutdown();
}

namespace {

/// `request` sent to ps `ps` as worker 0, answered within 10 s.
Response send_as_worker(SyncAdam& cluster, std::uint32_t ps, Request request) {
  InProcess transport(cluster.network(), Node::worker(0));
  PendingCall call = transport.call(ps, std::move(request));
  REQUIRE(call.wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  return call.take();
}

ErrorCode code_of(const Response& r) {
  const auto* e = std::get_if<ErrorReply>(&r);
  REQUIRE(e != nullptr);
  return e->code;
}

}  // namespace

TEST_CASE("a push or a read of the shape before a leave is refused as late (start again), not as malformed") {
  SyncAdam cluster(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  const LinearModel model(kIn, kOut);
  chief.initialize(model.variables());
  const Placement before = chief.placement();
  const ModelState saved = chief.save_state();
  cluster.network().kill(Node::ps(1));
  chief.leave(std::vector<std::uint32_t>{1});
  chief.restore(saved);
  // A worker's push of epoch 0, made for ps 0's parts before: ps 0 holds another part now.
  std::vector<std::vector<float>> zeros;
  Push push{0, 0, {}, 0, 1, {}, 1};
  for (std::size_t i = 0; i < before.parts.size(); ++i) {
    const Part& part = before.parts[i];
    if (part.ps != 0) continue;
    zeros.emplace_back(part.rows.size() * model.variables()[part.variable].row_size(), 0.0F);
    push.gradients.push_back({static_cast<std::uint32_t>(i), zeros.back()});
  }
  CHECK(code_of(send_as_worker(cluster, 0, push)) == ErrorCode::kFailedPrecondition);
  // A read unbound to a step, of epoch 0, naming a part ps 2 does not hold.
  const auto on_0 = std::find_if(before.parts.begin(), before.parts.end(), [](const Part& p) { return p.ps == 0; });
  const Pull pull{0, {{static_cast<std::uint32_t>(on_0 - before.parts.begin()), on_0->rows}}, 0};
  CHECK(code_of(send_as_worker(cluster, 2, pull)) == ErrorCode::kFailedPrecondition);
  // The same read at the current epoch names a part that is not there.
  const Pull current{0, {{static_cast<std::uint32_t>(on_0 - before.parts.begin()), on_0->rows}}, 1};
  CHECK(code_of(send_as_worker(cluster, 2, current)) == ErrorCode::kNotFound);
  chief.shutdown();
}

TEST_CASE("a process started again on the address of a ps that left is not waited for, and ends with the job") {
  const LinearData data(2 * kBatch * 40, kIn, kOut, 12);
  SyncAdam cluster(3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3});
  Chief chief(cluster.endpoint(Node::chief()), 3);
  chief.initialize(LinearModel(kIn, kOut).variables());
  run_steps(cluster, data, 0, 6);
  const ModelState saved = chief.save_state();
  cluster.network().kill(Node::ps(1));
  chief.leave(std::vector<std::uint32_t>{1});
  chief.restore(saved);
  cluster.network().restart(SgdSync(1, 3, Adam{0.01F}, SyncReplicas(2, 2), FixedShards{3}));
  // New workers know the cluster's 3 ps tasks: they learn that the job has 2, and never
  // wait for the new process, which holds no model (a short wait timeout would fail them).
  ClientOptions options;
  options.wait_timeout = std::chrono::seconds(20);
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, LinearModel(kIn, kOut), cluster.endpoint(Node::worker(w)), options);
      worker.wait_ready();
      CHECK_FALSE(places_on(worker.placement(), 1));
      for (std::int64_t k = 6; worker.step(batch_of(data, w, k % 40), 12); ++k) {
      }
    });
  }
  for (auto& t : workers) t.join();
  CHECK(chief.stats().at(0).global_step == 12);
  chief.shutdown();  // the new process on ps 1's address is told too
  CHECK(code_of(send_as_worker(cluster, 1, GetStats{})) == ErrorCode::kOutOfRange);
}
