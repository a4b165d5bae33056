// SPDX-License-Identifier: MIT
// Embedding tables in checkpoints: rows, their optimizer slots, last-touched steps and
// admission counts are read at the cut and restored; a job resumed from a checkpoint ends
// bit for bit where the uninterrupted one does; a checkpoint of 2 ps restores onto 3 and
// onto 1; a rollback brings back the checkpoint's rows, never initial values; on disk,
// every chunk is checked and the older format still reads; message by message, what a
// ps refuses.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "pulley/checkpoint/delta.hpp"
#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/inspect.hpp"
#include "pulley/checkpoint/rows.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/evaluator.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "support/cluster.hpp"
#include "support/table_model.hpp"

using namespace pulley;
using pulley::testing::Cluster;
using pulley::testing::TableBatchOf;
using pulley::testing::TinyTableModel;

namespace {

constexpr std::uint64_t kSeed = 21;
constexpr std::int64_t kSteps = 24;
using Sync = Cluster<RoundRobin, Adagrad, SyncReplicas>;

/// Admission after 2 pulls, so that a checkpoint holds candidates too.
const TableSpec kSpec{"emb", TinyTableModel::kDim, Initializer::uniform(0.5F), 2, 0};

const std::vector<TableBatchOf>& batches() {
  static const auto all = pulley::testing::table_batches(kSteps * 2, 8, 300, 4);
  return all;
}

/// Two workers train from step `from` to `to` (sync R = N = 2; worker w's batch of step k
/// is batches()[2k + w]), their model's table of `spec`.
void train(Sync& cluster, std::int64_t from, std::int64_t to, const TableSpec& spec = kSpec) {
  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      Worker worker(w, TinyTableModel(spec), cluster.endpoint(Node::worker(w)));
      worker.wait_ready();
      for (std::int64_t k = from; worker.step(batches()[static_cast<std::size_t>(k * 2 + w)], to); ++k) {
      }
    });
  }
  for (auto& t : workers) t.join();
}

/// A table as a map: id → (values and slots, last touched); candidates: id → (count, step).
struct Rows {
  std::map<std::uint64_t, std::pair<std::vector<float>, std::uint32_t>> rows;
  std::map<std::uint64_t, std::pair<std::uint32_t, std::uint32_t>> candidates;
  friend bool operator==(const Rows&, const Rows&) = default;
};
Rows rows_of(const TableState& t) {
  Rows out;
  const std::size_t stride = t.stride();
  for (std::size_t i = 0; i < t.ids.size(); ++i) {
    const auto row = std::vector<float>(t.rows.begin() + static_cast<std::ptrdiff_t>(i * stride),
                                        t.rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * stride));
    REQUIRE(out.rows.emplace(t.ids[i], std::make_pair(row, t.touched[i])).second);  // each id once
  }
  for (std::size_t i = 0; i < t.candidate_ids.size(); ++i) {
    out.candidates[t.candidate_ids[i]] = {t.candidate_counts[i], t.candidate_steps[i]};
  }
  return out;
}

/// Every dense value and slot, and every table's rows, of two states agree.
void check_same(const ModelState& a, const ModelState& b) {
  CHECK(a.global_step == b.global_step);
  REQUIRE(a.variables.size() == b.variables.size());
  for (std::size_t v = 0; v < a.variables.size(); ++v) {
    CHECK(a.variables[v].values == b.variables[v].values);
    CHECK(a.variables[v].slots == b.variables[v].slots);
  }
  REQUIRE(a.tables.size() == b.tables.size());
  for (std::size_t t = 0; t < a.tables.size(); ++t) {
    CHECK(a.tables[t].spec == b.tables[t].spec);
    CHECK(a.tables[t].slot_names == b.tables[t].slot_names);
    CHECK(rows_of(a.tables[t]) == rows_of(b.tables[t]));
  }
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pulley-tables-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("a checkpoint holds every row with its slots, steps and admission counts, as the ps tasks hold them") {
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape(kSpec);
  chief.initialize(shape.variables(), shape.tables());
  train(cluster, 0, 10);
  const ModelState state = chief.save_state();
  CHECK(state.global_step == 10);
  REQUIRE(state.tables.size() == 1);
  const TableState& t = state.tables[0];
  CHECK(t.spec == kSpec);
  CHECK(t.slot_names == std::vector<std::string>{"accumulator"});
  CHECK(t.updates.size() == 2);  // one count per ps
  std::int64_t held = 0;
  for (const Stats& s : chief.stats()) held += s.table_rows;
  CHECK(static_cast<std::int64_t>(t.ids.size()) == held);
  CHECK_FALSE(t.candidate_ids.empty());  // ids pulled once: admission is counting them
  // The rows' values are what a read of the ps tasks gives, the chief's or an evaluator's.
  const std::vector<float> read = chief.read_rows("emb", t.ids);
  for (std::size_t i = 0; i < t.ids.size(); ++i) {
    for (std::size_t k = 0; k < kSpec.dim; ++k) CHECK(t.rows[i * t.stride() + k] == read[i * kSpec.dim + k]);
    CHECK(t.touched[i] <= 10);
  }
  Evaluator evaluator(cluster.endpoint(Node{Node::Role::kEvaluator, 0}));
  evaluator.wait_ready(shape.variables());
  CHECK(evaluator.read_rows("emb", t.ids) == read);
  chief.shutdown();
}

TEST_CASE("a sync job with tables resumed from a checkpoint on disk ends bit for bit where the uninterrupted one does") {
  ModelState straight;
  {
    Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
    Chief chief(cluster.endpoint(Node::chief()), kSeed);
    const TinyTableModel shape(kSpec);
    chief.initialize(shape.variables(), shape.tables());
    train(cluster, 0, kSteps);
    straight = chief.save_state();
    chief.shutdown();
  }
  TempDir tmp;
  {
    Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
    Chief chief(cluster.endpoint(Node::chief()), kSeed);
    const TinyTableModel shape(kSpec);
    chief.initialize(shape.variables(), shape.tables());
    train(cluster, 0, 9);
    CheckpointDirectory(tmp.path).save(chief.save_state());
    chief.shutdown();
  }
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const auto latest = CheckpointDirectory(tmp.path).latest();
  REQUIRE(latest.has_value());
  REQUIRE(latest->first.tables.size() == 1);
  chief.restore(latest->first);
  train(cluster, 9, kSteps);
  check_same(chief.save_state(), straight);
  chief.shutdown();
}

TEST_CASE("a checkpoint of tables written by 2 ps tasks restores onto 3, 1 and 2, every row, slot and part as saved") {
  ModelState saved;
  {
    Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
    Chief chief(cluster.endpoint(Node::chief()), kSeed);
    const TinyTableModel shape(kSpec);
    chief.initialize(shape.variables(), shape.tables());
    train(cluster, 0, 12);
    saved = chief.save_state();
    chief.shutdown();
  }
  // Each row sent to its ps only (the chief's sharding is the ps tasks'), or to every ps
  // (the chief was given another: each ps keeps its own).
  for (const auto& [q, routed] : {std::pair{3U, true}, {1U, true}, {2U, true}, {3U, false}, {2U, false}}) {
    CAPTURE(q);
    CAPTURE(routed);
    Sync cluster(q, Adagrad{0.1F}, SyncReplicas(2, 2));
    Chief chief(cluster.endpoint(Node::chief()), kSeed);
    if (routed) {
      chief.restore(saved);
    } else {
      chief.restore(saved, RangeIds{});
    }
    ModelState back = chief.save_state();
    check_same(back, saved);
    // Every ps holds only the rows its id sharding gives it, and the update count is
    // carried: as saved onto as many ps tasks, else the largest.
    std::int64_t held = 0;
    for (const Stats& s : chief.stats()) held += s.table_rows;
    CHECK(static_cast<std::size_t>(held) == saved.tables[0].ids.size());
    const std::int64_t largest = std::max(saved.tables[0].updates[0], saved.tables[0].updates[1]);
    CHECK(back.tables[0].updates ==
          (q == 2 ? saved.tables[0].updates : std::vector<std::int64_t>(q, largest)));
    // And training goes on from there.
    train(cluster, 12, 14);
    CHECK(chief.stats().at(0).global_step == 14);
    chief.shutdown();
  }
}

TEST_CASE("a checkpoint of tables written by 3 ps tasks restores onto 2, every row, slot and part as saved") {
  ModelState saved;
  {
    Sync cluster(3, Adagrad{0.1F}, SyncReplicas(2, 2));
    Chief chief(cluster.endpoint(Node::chief()), kSeed);
    const TinyTableModel shape(kSpec);
    chief.initialize(shape.variables(), shape.tables());
    train(cluster, 0, 12);
    saved = chief.save_state();
    chief.shutdown();
  }
  REQUIRE(saved.tables.at(0).updates.size() == 3);
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  chief.restore(saved);
  const ModelState back = chief.save_state();
  check_same(back, saved);
  std::int64_t held = 0;
  for (const Stats& s : chief.stats()) held += s.table_rows;
  CHECK(static_cast<std::size_t>(held) == saved.tables[0].ids.size());
  const auto& u = saved.tables[0].updates;
  CHECK(back.tables[0].updates == std::vector<std::int64_t>(2, *std::max_element(u.begin(), u.end())));
  chief.shutdown();
}

TEST_CASE("a rollback brings back the checkpoint's rows: rows created since go, and none restarts from its initial value") {
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape(kSpec);
  chief.initialize(shape.variables(), shape.tables());
  // (A cut while workers train is checkpointing's cases; here the rows after it matter.
  // Workers that ended at step 8 hold its tokens: a restore hands them out afresh.)
  train(cluster, 0, 8);
  const ModelState at8 = chief.save_state_at(8);
  chief.restore(at8);
  train(cluster, 8, 20);
  CHECK(at8.global_step == 8);
  const ModelState at20 = chief.save_state();
  CHECK(rows_of(at20.tables[0]) != rows_of(at8.tables[0]));
  chief.restore(at8);
  check_same(chief.save_state(), at8);
  chief.shutdown();
}

TEST_CASE("on disk: tables round-trip, a damaged chunk names its table, and inspect lists them") {
  ModelState state;
  state.global_step = 7;
  state.pacer = {7};
  state.variables.push_back({{"w", {2}, Initializer::zeros()}, {1.0F, 2.0F}, {{"accumulator", {0.5F, 0.5F}}}, {}, {}});
  TableState t;
  t.spec = kSpec;
  t.slot_names = {"accumulator"};
  t.updates = {5, 6};
  for (std::uint64_t id = 0; id < 1000; ++id) {
    t.ids.push_back(mix_id(id));
    for (std::size_t k = 0; k < t.stride(); ++k) t.rows.push_back(static_cast<float>(id) + 0.25F * static_cast<float>(k));
    t.touched.push_back(static_cast<std::uint32_t>(id % 7));
  }
  t.candidate_ids = {mix_id(5000), mix_id(5001)};
  t.candidate_counts = {1, 1};
  t.candidate_steps = {3, 6};
  state.tables.push_back(t);
  TempDir tmp;
  const auto dir = tmp.path / "ckpt";
  checkpoint::write_checkpoint(dir, state);
  CHECK(checkpoint::read_checkpoint(dir) == state);
  const std::string listed = checkpoint::describe(dir);
  CHECK(listed.find("table emb dim 3, 1000 rows, slots [accumulator]") != std::string::npos);
  // Index alone: the specs, no rows.
  const ModelState index_only = checkpoint::read_checkpoint(dir, false);
  REQUIRE(index_only.tables.size() == 1);
  CHECK(index_only.tables[0].spec == kSpec);
  CHECK(index_only.tables[0].ids.empty());
  // A byte of the rows flipped: refused, naming the table.
  const std::uint64_t size = std::filesystem::file_size(dir / "data");
  {
    std::fstream data(dir / "data", std::ios::in | std::ios::out | std::ios::binary);
    data.seekp(static_cast<std::streamoff>(size - 3000));
    data.put('\x7f');
  }
  CHECK_THROWS_WITH_AS(checkpoint::read_checkpoint(dir), doctest::Contains("table 'emb'"), Error);
  // A table whose rows do not fit its slots is refused before anything is written.
  TableState bad = t;
  bad.rows.pop_back();
  ModelState wrong = state;
  wrong.tables = {bad};
  CHECK_THROWS_AS(checkpoint::write_checkpoint(tmp.path / "bad", wrong), Error);
}

TEST_CASE("an index that cuts a table's arrays otherwise than the writer does is refused before anything is read") {
  // Two rows: their ids are one chunk of 16 bytes. An index that says two chunks of 4 and
  // 12 bytes (CRCs and the index's own CRC made right) must not be taken: a reader that
  // counted rows from chunk sizes would size the rows for 1 and write 2.
  ModelState state;
  state.global_step = 1;
  TableState t;
  t.spec = kSpec;
  t.slot_names = {"accumulator"};
  t.ids = {mix_id(1), mix_id(2)};
  t.rows.assign(2 * t.stride(), 0.5F);
  t.touched = {0, 0};
  state.tables.push_back(t);
  TempDir tmp;
  const auto dir = tmp.path / "ckpt";
  checkpoint::write_checkpoint(dir, state);
  std::string index;
  {
    std::ifstream in(dir / "index", std::ios::binary);
    index.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The ids' chunk list: count 1, then offset, 16 bytes, CRC of the ids.
  const std::uint32_t ids_crc = checkpoint::crc32c(std::as_bytes(std::span(t.ids)));
  std::string ref(4 + 8 + 8 + 4, '\0');
  const std::uint32_t one = 1;
  const std::uint64_t offset = 0, bytes = 16;
  std::memcpy(ref.data(), &one, 4);
  std::memcpy(ref.data() + 4, &offset, 8);
  std::memcpy(ref.data() + 12, &bytes, 8);
  std::memcpy(ref.data() + 20, &ids_crc, 4);
  const std::size_t at = index.find(ref);
  REQUIRE(at != std::string::npos);
  auto split = [&](std::uint64_t a, std::uint64_t b) {
    const auto raw = std::as_bytes(std::span(t.ids));
    std::string out(4 + 2 * 20, '\0');
    const std::uint32_t two = 2;
    const std::uint64_t second = offset + a;
    const std::uint32_t crc_a = checkpoint::crc32c(raw.first(a)), crc_b = checkpoint::crc32c(raw.subspan(a, b));
    std::memcpy(out.data(), &two, 4);
    std::memcpy(out.data() + 4, &offset, 8);
    std::memcpy(out.data() + 12, &a, 8);
    std::memcpy(out.data() + 20, &crc_a, 4);
    std::memcpy(out.data() + 24, &second, 8);
    std::memcpy(out.data() + 32, &b, 8);
    std::memcpy(out.data() + 40, &crc_b, 4);
    return out;
  };
  std::string crafted = index.substr(0, at) + split(4, 12) + index.substr(at + ref.size());
  crafted.resize(crafted.size() - 4);
  const std::uint32_t crc = checkpoint::crc32c(std::as_bytes(std::span(crafted.data(), crafted.size())));
  crafted.append(reinterpret_cast<const char*>(&crc), 4);
  {
    std::ofstream out(dir / "index", std::ios::binary | std::ios::trunc);
    out.write(crafted.data(), static_cast<std::streamsize>(crafted.size()));
  }
  CHECK_THROWS_WITH_AS(checkpoint::read_checkpoint(dir), doctest::Contains("not cut into chunks of 64 MiB"), Error);
}

TEST_CASE("a checkpoint's rows are looked up by id without a cluster, absent ones as their initial values") {
  TableState t;
  t.spec = kSpec;
  t.slot_names = {"accumulator"};
  t.ids = {mix_id(1), mix_id(2)};
  t.rows = {1, 2, 3, 9, 9, 9, 4, 5, 6, 9, 9, 9};
  t.touched = {1, 1};
  const CheckpointRows rows(t, kSeed);
  const std::vector<std::uint64_t> ids{mix_id(2), mix_id(3), mix_id(1), mix_id(2)};
  std::vector<float> out(ids.size() * kSpec.dim);
  rows.lookup(ids, out);
  std::vector<float> initial(kSpec.dim);
  initialize_row(kSpec, kSeed, mix_id(3), initial);
  CHECK(out == std::vector<float>{4, 5, 6, initial[0], initial[1], initial[2], 1, 2, 3, 4, 5, 6});
  CHECK(rows.contains(mix_id(1)));
  CHECK_FALSE(rows.contains(mix_id(3)));
  CHECK_THROWS_AS(rows.lookup(ids, std::span(out).first(3)), Error);
  TableState twice = t;
  twice.ids[1] = twice.ids[0];
  CHECK_THROWS_WITH_AS(CheckpointRows(twice, kSeed), doctest::Contains("twice"), Error);
}

TEST_CASE("checkpoints of format versions 1 (no tables) and 2 (no incremental ones) still read") {
  ModelState state;
  state.global_step = 3;
  state.pacer = {3};
  state.variables.push_back({{"w", {2}, Initializer::zeros()}, {1.0F, 2.0F}, {}, {}, {}});
  TempDir tmp;
  const auto dir = tmp.path / "ckpt";
  checkpoint::write_checkpoint(dir, state);
  std::string written;
  {
    std::ifstream in(dir / "index", std::ios::binary);
    written.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Make it version `version`: the version field, and the index's tail of the fields it
  // did not have cut (the CRC, then the base step; the table count and the tables' seed).
  for (const auto& [version, cut] : {std::pair<std::uint32_t, std::size_t>{2, 12}, {1, 24}}) {
    CAPTURE(version);
    std::string index = written;
    std::memcpy(index.data() + 8, &version, 4);
    index.resize(index.size() - cut);
    const std::uint32_t crc = checkpoint::crc32c(std::as_bytes(std::span(index.data(), index.size())));
    index.append(reinterpret_cast<const char*>(&crc), 4);
    {
      std::ofstream out(dir / "index", std::ios::binary | std::ios::trunc);
      out.write(index.data(), static_cast<std::streamsize>(index.size()));
    }
    CHECK(checkpoint::read_checkpoint(dir) == state);
  }
}

TEST_CASE("an incremental checkpoint holds the rows touched since its base and the ids evicted since, and over its base it is the full state") {
  // Rows kept for ever, rows evicted 3 steps after their last touch, rows capped at 40 per
  // ps (the least recently touched evicted): each way, the chain full(8) + delta(16) +
  // delta(24) must give exactly the full state of step 24.
  TableSpec spec = kSpec;
  SUBCASE("no eviction") {}
  SUBCASE("evict_after_steps") { spec.evict_after_steps = 3; }
  SUBCASE("max_rows") { spec.max_rows = 40; }
  CAPTURE(spec.evict_after_steps);
  CAPTURE(spec.max_rows);
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape(spec);
  chief.initialize(shape.variables(), shape.tables());
  // (Workers that stopped at a step keep its sync tokens: each phase starts with a restore
  // of where the last ended, which a delta since that step may follow.)
  train(cluster, 0, 8, spec);
  const ModelState full8 = chief.save_state();
  chief.restore(full8);
  train(cluster, 8, 16, spec);
  const ModelState delta16 = chief.save_state(CutRows{8, 8});
  const ModelState full16 = chief.save_state();
  chief.restore(full16);
  train(cluster, 16, kSteps, spec);
  const ModelState delta24 = chief.save_state(CutRows{16, 16});
  const ModelState full24 = chief.save_state();
  REQUIRE(delta16.incremental());
  CHECK(delta16.base_step == 8);
  CHECK_FALSE(full16.incremental());
  // The delta holds exactly the rows the full state says were touched since step 8, with
  // the same values; the others are not in it.
  const TableState& d = delta16.tables.at(0);
  const TableState& f = full16.tables.at(0);
  std::size_t touched_since = 0;
  for (const std::uint32_t step : f.touched) touched_since += step >= 8 ? 1 : 0;
  CHECK(d.ids.size() == touched_since);
  for (const std::uint32_t step : d.touched) CHECK(step >= 8);
  if (spec.evict_after_steps == 0 && spec.max_rows == 0) {
    CHECK(d.ids.size() < f.ids.size());  // rows untouched since step 8 stay out
    CHECK(d.evicted.empty());
  } else {
    CHECK_FALSE(delta24.tables.at(0).evicted.empty());  // rows went, and the delta says which
  }
  CHECK(d.candidate_ids.size() == f.candidate_ids.size());  // admission counts are whole
  // Applied over their bases, the deltas give the full states, evicted rows gone.
  ModelState state = full8;
  apply_delta(state, delta16);
  CHECK_FALSE(state.incremental());
  check_same(state, full16);
  apply_delta(state, delta24);
  check_same(state, full24);
  // Over the wrong base, refused.
  ModelState wrong = full8;
  CHECK_THROWS_AS(apply_delta(wrong, delta24), Error);
  CHECK(wrong == full8);
  // A ps restored (a rollback) knows its evictions from the restored step on only: a delta
  // since an earlier step is taken as a full checkpoint instead.
  chief.restore(full16);
  const ModelState after = chief.save_state(CutRows{8, 8});
  CHECK_FALSE(after.incremental());
  check_same(after, full16);
  // Restoring a delta on its own is refused: it lacks the rows it did not change.
  CHECK_THROWS_AS(chief.restore(delta24), Error);
  chief.shutdown();
}

TEST_CASE("on disk: an incremental chain is loaded over its full checkpoint, keep keeps what a kept one needs, a missing base is skipped") {
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  TableSpec spec = kSpec;
  spec.evict_after_steps = 3;
  const TinyTableModel shape(spec);
  chief.initialize(shape.variables(), shape.tables());
  TempDir tmp;
  CheckpointDirectory dir(tmp.path, 2);
  train(cluster, 0, 8, spec);
  chief.restore(chief.save_state());  // (see above: the next workers need the tokens)
  dir.save(chief.save_state());
  train(cluster, 8, 16, spec);
  dir.save(chief.save_state(CutRows{8, 8}));
  const ModelState full16 = chief.save_state();
  chief.restore(full16);
  train(cluster, 16, kSteps, spec);
  const auto path24 = dir.save(chief.save_state(CutRows{16, 16}));
  const ModelState full24 = chief.save_state();
  chief.shutdown();
  // keep = 2 keeps 24 and 16, and 8, which they need.
  CHECK(dir.list().size() == 3);
  const auto latest = dir.latest();
  REQUIRE(latest.has_value());
  CHECK(latest->second == path24);
  check_same(latest->first, full24);
  CHECK(checkpoint::read_checkpoint(path24, false).incremental());
  const std::string listed = checkpoint::describe(path24);
  CHECK(listed.find("(incremental: the tables' rows changed since global step 16)") != std::string::npos);
  CHECK(listed.find(" rows changed, ") != std::string::npos);
  // An evaluator holding step 16 reads the delta of 24 only; one holding nothing, the chain.
  ModelState held = full16;
  CheckpointDirectory::load_into(path24, held);
  check_same(held, full24);
  // The base of 24 gone: 24 cannot be read whole, and the newest that can (8) is taken.
  std::filesystem::remove_all(tmp.path / CheckpointDirectory::name_of(16));
  CHECK_THROWS_WITH_AS(CheckpointDirectory::load(path24), doctest::Contains("whose checkpoint is gone"), Error);
  const auto fallback = dir.latest();
  REQUIRE(fallback.has_value());
  CHECK(fallback->first.global_step == 8);
}

namespace {
using Server = ParameterServer<RoundRobin, Adagrad, SyncReplicas>;

Response ask(Server& ps, Request request, Node from, std::uint64_t session = 1) {
  std::optional<Response> out;
  ps.handle(std::move(request), RequestContext{false, from, session}, [&](Response&& r) { out = std::move(r); });
  REQUIRE(out.has_value());
  return std::move(*out);
}
}  // namespace

TEST_CASE("a ps refuses rows read outside a cut, rows restored outside a restore, and serves no row until they are in") {
  Server ps(0, 1, Adagrad{0.1F}, SyncReplicas(1, 1));
  const Node chief = Node::chief(), worker = Node::worker(0);
  ask(ps, Register{{{"w", {2}, {}}}, {kSpec}, kSeed}, chief);
  ask(ps, Initialize{{{0, std::vector<float>{0, 0}}}}, chief);
  CHECK(std::get<ErrorReply>(ask(ps, ReadRows{0, 0, 10, false}, chief)).code == ErrorCode::kFailedPrecondition);
  ask(ps, Pause{}, chief);
  CHECK(std::get<ErrorReply>(ask(ps, ReadRows{0, 0, 10, false}, chief)).code == ErrorCode::kFailedPrecondition);
  ask(ps, ReadState{{}}, chief);
  CHECK(std::holds_alternative<RowsChunk>(ask(ps, ReadRows{0, 0, 10, false}, chief)));
  CHECK(std::get<ErrorReply>(ask(ps, ReadRows{3, 0, 10, false}, chief)).code == ErrorCode::kInvalidArgument);
  ask(ps, Resume{}, chief);
  RestoreRows early;
  early.epoch = 1;
  early.done = true;
  CHECK(std::get<ErrorReply>(ask(ps, early, chief)).code == ErrorCode::kFailedPrecondition);
  // A restore whose rows follow: no row is served until they are in.
  const std::vector<float> w{1, 2};
  Restore restore{1, {0}, {{0, w, {}, {}}}, true};
  REQUIRE(std::holds_alternative<Ack>(ask(ps, restore, chief)));
  const std::uint64_t id = mix_id(3);
  CHECK(std::get<ErrorReply>(ask(ps, PullRows{0, 1, {{0, {id}, {}}}}, worker)).code ==
        ErrorCode::kFailedPrecondition);
  std::optional<Response> ready;
  ps.handle(WaitReady{}, RequestContext{false, worker, 2}, [&](Response&& r) { ready = std::move(r); });
  CHECK_FALSE(ready.has_value());
  const std::vector<float> row{7, 8, 9, 0.5F, 0.5F, 0.5F};
  RestoreRows rows;
  rows.epoch = 1;
  rows.slot_names = {"accumulator"};
  rows.ids = {id};
  rows.rows = row;
  rows.steps = {4};
  RestoreRows wrong = rows;
  wrong.steps = {};
  CHECK(std::get<ErrorReply>(ask(ps, wrong, chief)).code == ErrorCode::kInvalidArgument);
  REQUIRE(std::holds_alternative<Ack>(ask(ps, rows, chief)));
  CHECK_FALSE(ready.has_value());
  REQUIRE(std::holds_alternative<Ack>(ask(ps, early, chief)));  // done
  CHECK(ready.has_value());
  const auto pulled = std::get<RowsReply>(ask(ps, PullRows{0, 1, {{0, {id}, {}}}}, worker));
  CHECK(std::vector<float>(pulled.rows.at(0).begin(), pulled.rows.at(0).end()) == std::vector<float>{7, 8, 9});
}

TEST_CASE("the cut's rows read as they were at the cut while training goes on, until the chief ends the cut or leaves") {
  Server ps(0, 1, Adagrad{0.1F}, SyncReplicas(1, 1));
  const Node chief = Node::chief(), worker = Node::worker(0);
  const TableSpec spec{"emb", 3, Initializer::uniform(0.5F)};  // rows created at first pull
  ask(ps, Register{{{"w", {2}, {}}}, {spec}, kSeed}, chief);
  ask(ps, Initialize{{{0, std::vector<float>{0, 0}}}}, chief);
  const std::uint64_t id = mix_id(3);
  auto step = [&](std::int64_t k) {  // one sync step of worker 0: the row goes down
    REQUIRE(std::holds_alternative<TokenReply>(ask(ps, TakeToken{0}, worker)));
    REQUIRE(std::holds_alternative<RowsReply>(ask(ps, PullRows{k, 0, {{0, {id}, {}}}}, worker)));
    const std::vector<float> g{1, 1}, rows{1, 1, 1};
    REQUIRE(std::holds_alternative<PushReply>(ask(ps, Push{0, k, {{0, g}}, 0, 0, {{0, {id}, rows}}}, worker)));
  };
  auto read_rows = [&](std::uint64_t session = 1) {
    const Response r = ask(ps, ReadRows{0, 0, 10, false}, chief, session);
    if (!std::holds_alternative<RowsChunk>(r)) return std::vector<float>{};
    const auto& chunk = std::get<RowsChunk>(r);
    return std::vector<float>(chunk.rows.begin(), chunk.rows.end());
  };
  step(0);
  ask(ps, Pause{}, chief);
  REQUIRE(std::holds_alternative<StateReply>(ask(ps, ReadState{{1}}, chief)));
  const std::vector<float> at_cut = read_rows();
  REQUIRE(at_cut.size() == 6);  // the row's values and its accumulator
  REQUIRE(std::holds_alternative<Ack>(ask(ps, Resume{true}, chief)));
  step(1);  // training went on: the row changed...
  CHECK(read_rows() == at_cut);  // ...and the cut still reads it as it was
  REQUIRE(std::holds_alternative<Ack>(ask(ps, Resume{}, chief)));
  CHECK(read_rows().empty());  // the cut is over: ReadRows refused
  // A chief that leaves while it reads the rows ends the cut too.
  ask(ps, Pause{}, chief, 5);
  REQUIRE(std::holds_alternative<StateReply>(ask(ps, ReadState{{2}}, chief, 5)));
  REQUIRE(std::holds_alternative<Ack>(ask(ps, Resume{true}, chief, 5)));
  const std::vector<float> second = read_rows(5);
  CHECK(second != at_cut);
  step(2);
  CHECK(read_rows(5) == second);
  ps.disconnected(chief, 5);
  CHECK(read_rows(5).empty());
}

TEST_CASE(
    "a chief started in place of a lost one cuts and restores with the tables' seed the ps tasks "
    "hold") {
  Sync cluster(2, Adagrad{0.1F}, SyncReplicas(2, 2));
  Chief chief(cluster.endpoint(Node::chief()), kSeed);
  const TinyTableModel shape(kSpec);
  chief.initialize(shape.variables(), shape.tables());
  train(cluster, 0, 6);
  const ModelState before = chief.save_state();
  // The next chief registers nothing (it goes on from the live state), and was given
  // another seed: the rows that are not held yet start from the registered one all the same.
  Chief next(cluster.endpoint(Node::chief()), kSeed + 1);
  REQUIRE(next.ps_serving());
  CHECK(next.adopt(shape.variables(), shape.tables()) == 6);
  const ModelState cut = next.save_state();
  CHECK(cut.table_seed == kSeed);
  check_same(cut, before);
  next.restore(cut);  // the same model: registered again without "a different model"
  train(cluster, 6, 8);
  CHECK(next.save_state().global_step == 8);
  next.shutdown();
}
