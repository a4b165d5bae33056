// SPDX-License-Identifier: MIT
// Embedding-table requests sent straight to a ps, as a raw client could: every malformed or
// oversized one is refused by name and changes nothing; readers create no rows; a push alone
// whose rows would go non-finite is refused, not applied in part.
#include "pulley/ps/parameter_server.hpp"

#include <doctest/doctest.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "pulley/optimizers/sgd.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"

using namespace pulley;

namespace {

using Server = ParameterServer<RoundRobin, Sgd, Async>;

Response call(Server& ps, Request request, std::optional<Node> from = Node::worker(0)) {
  std::optional<Response> out;
  ps.handle(std::move(request), RequestContext{false, from, 1}, [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}

std::string refusal(const Response& r) {
  REQUIRE(std::holds_alternative<ErrorReply>(r));
  return std::get<ErrorReply>(r).message;
}

const std::vector<VariableSpec> kModel{{"b", {1}, {}}};
const std::vector<TableSpec> kTables{{"emb", 2, Initializer::constant(0.5F)}};
const std::vector<float> kZero{0.0F};

/// A ready ps (1 of `num_ps`) with the model and its table.
Server ready(std::uint32_t task = 0, std::uint32_t num_ps = 1) {
  Server ps(task, num_ps, Sgd{4.0F}, Async{});
  const auto placed = call(ps, Register{kModel, kTables, 7}, Node::chief());
  REQUIRE(std::holds_alternative<PlacementReply>(placed));
  const auto& parts = std::get<PlacementReply>(placed).placement.parts;
  if (parts[0].ps == task) REQUIRE(std::holds_alternative<Ack>(call(ps, Initialize{{{0, kZero}}}, Node::chief())));
  return ps;
}

/// An id that ps `task` of `num_ps` holds.
std::uint64_t id_on(std::uint32_t task, std::uint32_t num_ps, std::uint64_t from = 1) {
  while (HashIds{}.ps_of("emb", from, num_ps) != task) ++from;
  return from;
}

}  // namespace

TEST_CASE("a row pull or push that names an id twice is refused, and counts nothing") {
  Server ps = ready();
  CHECK(refusal(call(ps, PullRows{0, 0, {{0, {3, 4, 3}, {}}}})).find("row 3 of table 'emb' comes twice") !=
        std::string::npos);
  const std::vector<float> rows(6, 1.0F);
  CHECK(refusal(call(ps, Push{0, 0, {{0, kZero}}, 0, 0, {{0, {5, 5, 6}, rows}}})).find("comes twice") !=
        std::string::npos);
  CHECK(ps.stats().table_rows == 0);
  CHECK(ps.stats().global_step == 0);  // the refused push did not count
}

TEST_CASE("row requests of unknown tables, wrong sizes, other ps's ids or too many ids are refused") {
  Server ps = ready(0, 2);
  const std::uint64_t mine = id_on(0, 2), theirs = id_on(1, 2);
  CHECK(refusal(call(ps, PullRows{0, 0, {{1, {mine}, {}}}})).find("unknown table 1") != std::string::npos);
  CHECK(refusal(call(ps, PullRows{0, 0, {{0, {mine}, {}}, {0, {}, {}}}})).find("comes twice") != std::string::npos);
  CHECK(refusal(call(ps, PullRows{0, 0, {{0, {theirs}, {}}}})).find("is held by ps 1") != std::string::npos);
  const std::vector<float> three(3, 1.0F);
  CHECK(refusal(call(ps, Push{0, 0, {}, 0, 0, {{0, {mine}, three}}})).find("3 values for 1 rows of dim 2") !=
        std::string::npos);
  std::vector<std::uint64_t> many;
  for (std::uint64_t id = 0; many.size() <= kMaxIdsPerMessage; ++id) {
    if (HashIds{}.ps_of("emb", id, 2) == 0) many.push_back(id);
  }
  CHECK(refusal(call(ps, PullRows{0, 0, {{0, many, {}}}})).find("in one request (at most") != std::string::npos);
  const std::vector<float> nan{std::numeric_limits<float>::quiet_NaN(), 0.0F};
  CHECK(refusal(call(ps, Push{0, 0, {}, 0, 0, {{0, {mine}, nan}}})).find("non-finite") != std::string::npos);
  CHECK(ps.stats().table_rows == 0);
  // What is well-formed is served.
  const auto rows = call(ps, PullRows{0, 0, {{0, {mine}, {}}}});
  REQUIRE(std::holds_alternative<RowsReply>(rows));
  CHECK(std::get<RowsReply>(rows).rows.at(0).size() == 2);
}

TEST_CASE("the chief and evaluators read rows without creating them, a worker's pull creates them") {
  Server ps = ready();
  const auto read = call(ps, PullRows{0, 0, {{0, {9, 10}, {}}}}, Node::evaluator());
  REQUIRE(std::holds_alternative<RowsReply>(read));
  CHECK(std::get<RowsReply>(read).rows[0][3] == 0.5F);  // the initial value
  (void)call(ps, PullRows{0, 0, {{0, {9}, {}}}}, Node::chief());
  CHECK(ps.stats().table_rows == 0);
  (void)call(ps, PullRows{0, 0, {{0, {9, 10}, {}}}}, Node::worker(0));
  CHECK(ps.stats().table_rows == 2);
}

TEST_CASE("a touch-only row pull creates and touches the rows as a worker's pull does, and sends none back") {
  // What the copy of a shard gets in place of the pull its other copy answers (ShardCopies).
  Server copy = ready();
  Server read_from = ready();
  PullRows touch{0, 0, {{0, {9, 10}, {}}}};
  touch.touch_only = true;
  CHECK(std::holds_alternative<Ack>(call(copy, touch, Node::worker(0))));
  const auto rows = call(read_from, PullRows{0, 0, {{0, {9, 10}, {}}}}, Node::worker(0));
  REQUIRE(std::holds_alternative<RowsReply>(rows));
  CHECK(copy.stats().table_rows == 2);
  CHECK(copy.stats().table_rows == read_from.stats().table_rows);
  // The same push then leaves both with the same rows.
  const std::vector<float> gradient{1.0F, 2.0F, 3.0F, 4.0F};
  for (Server* ps : {&copy, &read_from}) {
    REQUIRE(std::holds_alternative<PushReply>(call(*ps, Push{0, 0, {{0, kZero}}, 0, 1, {{0, {9, 10}, gradient}}})));
  }
  const auto values = [](Server& ps) {
    const auto read = call(ps, PullRows{0, 0, {{0, {9, 10}, {}}}}, Node::chief());
    REQUIRE(std::holds_alternative<RowsReply>(read));
    const auto table = std::get<RowsReply>(read).rows[0];
    return std::vector<float>(table.begin(), table.end());
  };
  CHECK(values(copy) == values(read_from));
  CHECK(values(copy) != std::vector<float>(4, 0.5F));  // the push changed them
}

TEST_CASE("an async push whose rows would go non-finite is refused whole, naming the table") {
  Server ps = ready();
  (void)call(ps, PullRows{0, 0, {{0, {1}, {}}}});  // row 1 exists
  const std::vector<float> b_gradient{1.0F};
  const std::vector<float> huge{3e38F, 3e38F};  // 4 x 3e38 overflows float
  const Response r = call(ps, Push{0, 0, {{0, b_gradient}}, 0, 0, {{0, {1}, huge}}});
  CHECK(refusal(r).find("table 'emb'") != std::string::npos);
  CHECK(ps.stats().updates_refused == 1);
  // Neither the dense part nor the row moved.
  const auto b = call(ps, Pull{0, {{0, {0, 1}}}});
  CHECK(std::get<PullReply>(b).values[0][0] == 0.0F);
  const auto row = call(ps, PullRows{0, 0, {{0, {1}, {}}}});
  CHECK(std::get<RowsReply>(row).rows[0][0] == 0.5F);
  // A finite one is applied: the row and the dense part move together.
  const std::vector<float> small{1.0F, 2.0F};
  REQUIRE(std::holds_alternative<PushReply>(call(ps, Push{0, 0, {{0, b_gradient}}, 0, 0, {{0, {1}, small}}})));
  CHECK(std::get<RowsReply>(call(ps, PullRows{0, 0, {{0, {1}, {}}}})).rows[0][1] == -7.5F);  // 0.5 - 4 x 2
  CHECK(std::get<PullReply>(call(ps, Pull{0, {{0, {0, 1}}}})).values[0][0] == -4.0F);
}

TEST_CASE("a worker pulling fresh ids without end cannot grow a table past its max_rows") {
  Server ps(0, 1, Sgd{4.0F}, Async{});
  TableSpec capped{"emb", 2, Initializer::constant(0.5F)};
  capped.max_rows = 1000;
  REQUIRE(std::holds_alternative<PlacementReply>(call(ps, Register{kModel, {capped}, 7}, Node::chief())));
  REQUIRE(std::holds_alternative<Ack>(call(ps, Initialize{{{0, kZero}}}, Node::chief())));
  // Requests of the most ids one may carry, every id new, all at the same step.
  std::uint64_t next = 1;
  for (int request = 0; request < 4; ++request) {
    std::vector<std::uint64_t> ids(kMaxIdsPerMessage);
    for (std::uint64_t& id : ids) id = next++;
    const Response r = call(ps, PullRows{0, 0, {{0, ids, {}}}});
    REQUIRE(std::holds_alternative<RowsReply>(r));
    CHECK(std::get<RowsReply>(r).rows.at(0)[2 * (ids.size() - 1)] == 0.5F);  // the last reads as new
  }
  const Stats s = ps.stats();
  CHECK(s.table_rows == 1000);
  CHECK(s.table_rows_capped == static_cast<std::int64_t>(4 * kMaxIdsPerMessage - 1000));
}

TEST_CASE("a ps's tables stay within its byte budget (Tables::max_bytes), shared by its tables, whatever workers pull") {
  // Two tables of dim 2 (Sgd: no slots): a row costs a 16-byte header, 2 floats and 8 bytes
  // of index = 32 bytes; with admission, each id counted costs 48.
  const std::vector<TableSpec> tables{{"ta", 2, Initializer::constant(0.5F)}, {"tb", 2, Initializer::constant(0.5F), 3}};
  constexpr std::uint64_t kBudget = 32 * 1000;
  Server ps(0, 1, Sgd{4.0F}, Async{}, RoundRobin{}, Tables<Sgd>{Sgd{4.0F}, {}, {}, kBudget});
  REQUIRE(std::holds_alternative<PlacementReply>(call(ps, Register{kModel, tables, 7}, Node::chief())));
  REQUIRE(std::holds_alternative<Ack>(call(ps, Initialize{{{0, kZero}}}, Node::chief())));
  auto bytes = [&] {  // rows and admission counts held, as the budget counts them
    const Stats s = ps.stats();
    std::int64_t counted = 0;
    for (const TableStats& t : ps.table_stats()) counted += static_cast<std::int64_t>(t.candidates);
    return static_cast<std::uint64_t>(s.table_rows) * 32 + static_cast<std::uint64_t>(counted) * 48;
  };
  // A flood of fresh ids into table ta: it stops at the budget, the rest read as new.
  std::uint64_t next = 1;
  for (int request = 0; request < 3; ++request) {
    std::vector<std::uint64_t> ids(2000);
    for (std::uint64_t& id : ids) id = next++;
    const Response r = call(ps, PullRows{0, 0, {{0, ids, {}}}});
    REQUIRE(std::holds_alternative<RowsReply>(r));
    CHECK(bytes() <= kBudget);
  }
  CHECK(ps.stats().table_rows > 800);  // it filled up (evicting an eighth at a time)...
  CHECK(ps.stats().table_rows_capped > 0);  // ...and then made room or refused rows, counted
  // Table tb's admission counts share the budget: counting fresh ids evicts its own or
  // is refused, never passes it.
  for (int request = 0; request < 3; ++request) {
    std::vector<std::uint64_t> ids(2000);
    for (std::uint64_t& id : ids) id = next++;
    REQUIRE(std::holds_alternative<RowsReply>(call(ps, PullRows{0, 0, {{1, ids, {}}}})));
    CHECK(bytes() <= kBudget);
  }
  // A reader creates nothing, budget or not.
  const std::vector<std::uint64_t> fresh{next + 1, next + 2};
  const auto before = ps.stats().table_rows;
  REQUIRE(std::holds_alternative<RowsReply>(call(ps, PullRows{0, 0, {{0, fresh, {}}}}, Node::chief())));
  CHECK(ps.stats().table_rows == before);
}
