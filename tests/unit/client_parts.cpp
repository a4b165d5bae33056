// SPDX-License-Identifier: MIT
// The parts every client is made of, on their own, with no ps and no transport: a pull split
// over the ps tasks that hold the parts (client/detail/split.hpp), a worker's gradients
// cut into one push per ps (client/detail/push_builder.hpp) and the wait for lost ps tasks
// (client/detail/recovery.hpp).
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pulley/client/detail/push_builder.hpp"
#include "pulley/client/detail/recovery.hpp"
#include "pulley/client/detail/split.hpp"
#include "pulley/sharding/partitioned.hpp"

using namespace pulley;

namespace {

// "w" [6, 2] cut in 3 parts of 2 rows and "b" [2] in 2 of 1, dealt round-robin over 2 ps
// tasks: w on ps 0, 1, 0 and b on ps 1, 0.
const std::vector<VariableSpec> kModel{{"w", {6, 2}, {}}, {"b", {2}, {}}};
Placement placement() { return FixedShards{3}.place(kModel, 2); }

std::string holders(const Placement& p) {
  std::string out;
  for (const Part& part : p.parts) out += std::to_string(part.ps);
  return out;
}

}  // namespace

TEST_CASE("a pull of some rows becomes one Pull per ps, each slice's reply written into place") {
  const Placement p = placement();
  REQUIRE(holders(p) == "01010");
  std::vector<float> w(12, 0.0F);
  // Rows 1 to 5 of w: the end of part 0, all of part 1, the start of part 2.
  const PullRequest rows{0, {1, 5}, std::span<float>(w).subspan(2, 8)};
  const auto split = detail::split_pulls(p, kModel, 2, std::span(&rows, 1), /*min_step=*/7, /*epoch=*/3);
  REQUIRE(split.pulls.size() == 2);
  std::size_t slices = 0;
  for (std::size_t ps = 0; ps < 2; ++ps) {
    CHECK(split.pulls[ps].min_step == 7);
    CHECK(split.pulls[ps].epoch == 3);
    REQUIRE(split.pulls[ps].slices.size() == split.targets[ps].size());
    for (std::size_t i = 0; i < split.pulls[ps].slices.size(); ++i) {
      const Slice& s = split.pulls[ps].slices[i];
      const Part& part = p.parts[s.part];
      CHECK(part.ps == ps);
      CHECK(s.rows.begin >= std::max<std::size_t>(part.rows.begin, 1));
      CHECK(s.rows.end <= std::min<std::size_t>(part.rows.end, 5));
      // The target is exactly those rows of the caller's buffer.
      CHECK(split.targets[ps][i].data() == w.data() + s.rows.begin * 2);
      CHECK(split.targets[ps][i].size() == s.rows.size() * 2);
      ++slices;
    }
  }
  CHECK(slices == 3);
}

TEST_CASE("a pull that does not fit its variable, or comes before the placement, is refused") {
  std::vector<float> small(3);
  const PullRequest wrong{0, {0, 2}, small};
  CHECK_THROWS_WITH_AS(detail::split_pulls(placement(), kModel, 2, std::span(&wrong, 1), 0, 0),
                       doctest::Contains("does not fit its shape"), Error);
  const PullRequest unknown{5, {0, 1}, small};
  CHECK_THROWS_WITH_AS(detail::split_pulls(placement(), kModel, 2, std::span(&unknown, 1), 0, 0),
                       doctest::Contains("unknown variable index 5"), Error);
  CHECK_THROWS_WITH_AS(detail::split_pulls(Placement{}, kModel, 2, std::span(&wrong, 1), 0, 0),
                       doctest::Contains("wait_ready"), Error);
}

TEST_CASE("row pulls larger than a message are cut, a table at most once per message") {
  const std::vector<TableSpec> tables{{"emb", 2, {}}};
  const std::size_t n = kMaxIdsPerMessage + 10;  // all on ps 1 of 2
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = i;
  const std::vector<std::size_t> ps_begin{0, 0, n};
  std::vector<float> rows(n * 2);
  const RowRequest request{0, ids, ps_begin, rows};
  std::vector<std::size_t> sent_ids;
  std::size_t floats = 0;
  detail::split_row_pulls(tables, 2, std::span(&request, 1), 0, 0,
                          [&](std::size_t ps, PullRows&& message, PullTargets&& targets) {
                            CHECK(ps == 1);
                            REQUIRE(message.tables.size() == 1);
                            REQUIRE(targets.size() == 1);
                            CHECK(targets[0].data() == rows.data() + floats);
                            sent_ids.push_back(message.tables[0].ids.size());
                            floats += targets[0].size();
                          });
  CHECK(sent_ids == std::vector<std::size_t>{kMaxIdsPerMessage, 10});
  CHECK(floats == rows.size());
  const std::vector<std::size_t> wrong_groups{0, n};  // offsets for 1 ps, not 2
  const RowRequest misgrouped{0, ids, wrong_groups, rows};
  CHECK_THROWS_AS(detail::split_row_pulls(tables, 2, std::span(&misgrouped, 1), 0, 0,
                                          [](std::size_t, PullRows&&, PullTargets&&) {}),
                  Error);
}

TEST_CASE("a push becomes one Push per ps, numbered alike, each part's gradient viewed in place") {
  const Placement p = placement();
  std::vector<float> gw(12, 1.0F), gb(2, 2.0F);
  const std::vector<std::span<const float>> gradients{gw, gb};
  detail::PushBuilder builder;
  const std::vector<Push> pushes = builder.build(p, kModel, {}, 2, /*worker=*/1, /*local_step=*/9, /*epoch=*/2,
                                                 gradients, {});
  REQUIRE(pushes.size() == 2);
  CHECK(pushes[0].sequence == pushes[1].sequence);
  CHECK(pushes[0].sequence != 0);
  std::size_t parts = 0;
  for (std::size_t ps = 0; ps < 2; ++ps) {
    CHECK(pushes[ps].worker == 1);
    CHECK(pushes[ps].local_step == 9);
    CHECK(pushes[ps].epoch == 2);
    for (const PartValues& pv : pushes[ps].gradients) {
      const Part& part = p.parts[pv.part];
      CHECK(part.ps == ps);
      const float* base = part.variable == 0 ? gw.data() : gb.data();
      CHECK(pv.values.data() == base + part.rows.begin * kModel[part.variable].row_size());
      ++parts;
    }
  }
  CHECK(parts == p.parts.size());
  const std::vector<Push> next = builder.build(p, kModel, {}, 2, 1, 10, 2, gradients, {});
  CHECK(next[0].sequence == pushes[0].sequence + 1);
  // The check that the gradients are finite also bounds them, for a ps in this process.
  for (const Push& push : pushes) CHECK(push.largest == kOrdinaryMagnitude);
  gb[1] = -0x1p60F;  // finite, not ordinary: nothing known
  for (const Push& push : builder.build(p, kModel, {}, 2, 1, 11, 2, gradients, {})) {
    CHECK(push.largest == std::numeric_limits<float>::infinity());
  }
}

TEST_CASE("a push is checked whole before anything is sent: sizes, finite values") {
  const Placement p = placement();
  std::vector<float> gw(12, 1.0F), gb(2, 2.0F), short_b(1, 0.0F);
  detail::PushBuilder builder;
  const std::vector<std::span<const float>> short_one{gw, short_b};
  CHECK_THROWS_WITH_AS(builder.build(p, kModel, {}, 2, 0, 0, 0, short_one, {}),
                       doctest::Contains("gradient of 'b' has 1 elements, expected 2"), Error);
  gw[7] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::span<const float>> with_nan{gw, gb};
  CHECK_THROWS_WITH_AS(builder.build(p, kModel, {}, 2, 0, 0, 0, with_nan, {}),
                       doctest::Contains("non-finite (NaN or Inf) gradient for 'w'"), Error);
}

TEST_CASE("clipping scales every gradient, the rows' too, by clip_norm over their global norm") {
  const std::vector<VariableSpec> model{{"w", {2}, {}}};
  const Placement p = FixedShards{1}.place(model, 1);
  const std::vector<TableSpec> tables{{"emb", 1, {}}};
  std::vector<float> gw{3.0F, 0.0F};
  std::vector<std::uint64_t> ids{5};
  std::vector<std::size_t> ps_begin{0, 1};
  std::vector<float> row{4.0F};  // global norm 5
  const std::vector<std::span<const float>> gradients{gw};
  const RowRequest rows{0, ids, ps_begin, row};
  detail::PushBuilder builder(/*clip_norm=*/1.0F);
  const std::vector<Push> pushes = builder.build(p, model, tables, 1, 0, 0, 0, gradients, std::span(&rows, 1));
  CHECK(builder.last_gradient_norm() == doctest::Approx(5.0));
  CHECK(builder.clipped_steps() == 1);
  CHECK(pushes[0].gradients[0].values[0] == doctest::Approx(0.6F));
  CHECK(gw[0] == 3.0F);  // the caller's dense gradient is not touched: a copy is pushed
  CHECK(row[0] == doctest::Approx(0.8F));  // the rows are scaled where they are
  CHECK(pushes[0].rows[0].values[0] == doctest::Approx(0.8F));
}

TEST_CASE(
    "a recovery gives each fault after the ps tasks answered its own deadline, twenty times at "
    "most") {
  ClientOptions options;
  options.recovery_timeout = std::chrono::milliseconds(40);
  const Error broke(ErrorCode::kUnavailable, "connection to ps at 127.0.0.1:1 lost");
  {
    // Without an answer between them, failures share one deadline.
    detail::Recovery recovery("worker 0", options);
    recovery.wait(broke);  // sleeps until the deadline at most
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK_THROWS_WITH(recovery.wait(broke), doctest::Contains("were not back within"));
  }
  detail::Recovery recovery("worker 0", options);
  recovery.wait(broke);
  for (int i = 0; i < detail::Recovery::kMaxAnswered; ++i) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(50));  // past the deadline before the answer
    recovery.answered();
    CHECK_NOTHROW(recovery.wait(broke));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  recovery.answered();  // one answer too many: the deadline runs on
  CHECK_THROWS_WITH(recovery.wait(broke),
                    doctest::Contains("answered again 20 times, and the call broke each time"));
}
