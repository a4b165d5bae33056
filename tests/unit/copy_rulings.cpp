// SPDX-License-Identifier: MIT
// The chief's rulings on lost ps processes (runner/copy_rulings.hpp), with the looks at a
// ps's address made up: the chief rules by its own look, not by what it is told. A process
// that serves there is not lost; one replaced there is gone; an address that refuses, or
// where something else answers, is lost; silence is lost only once it lasts; "lost" stands
// for good; the chief's own transports hear the same rulings once the chief has looked; a
// process ruled lost that answers again is told to start again, and the end of training
// reaches whichever process serves the address of one ruled lost.
#include "pulley/runner/copy_rulings.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace pulley;
using Kind = CopyRulings::Sight::Kind;

namespace {

/// What the looks find at each ps's address, as the test sets it, and how many were made.
struct Addresses {
  std::mutex mutex;
  std::map<std::uint32_t, CopyRulings::Sight> at;
  std::atomic<int> looks{0};
  std::chrono::milliseconds lasts{0};  ///< how long each look takes (set before the first)

  CopyRulings::LookAt look_at() {
    return [this](std::uint32_t ps) {
      ++looks;
      std::this_thread::sleep_for(lasts);
      const std::scoped_lock lock(mutex);
      return at[ps];
    };
  }
  /// What the chief told at each address (CopyRulings::Tell): whatever a look finds there.
  struct Told {
    std::uint32_t ps;
    std::set<std::uint64_t> only;
    bool restart;
  };
  std::vector<Told> told;
  CopyRulings::Tell tell() {
    return [this](std::uint32_t ps, const std::set<std::uint64_t>& only, bool restart) {
      const std::scoped_lock lock(mutex);
      told.push_back({ps, only, restart});
      return at[ps];
    };
  }
  std::vector<Told> told_so_far() {
    const std::scoped_lock lock(mutex);
    return told;
  }
  void set(std::uint32_t ps, CopyRulings::Sight sight) {
    const std::scoped_lock lock(mutex);
    at[ps] = std::move(sight);
  }
};

/// Whether `lost` is ruled lost once the chief has looked (asking again, as a task does,
/// for 5 s at most).
std::optional<bool> ruling(CopyRulings& rulings, const LostProcess& lost) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    if (const auto r = rulings.rule(lost)) return r->lost;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return std::nullopt;
}

constexpr std::uint64_t kProcess = 0xABCDEF;
constexpr auto kSilence = std::chrono::hours(1);  // silence is never long enough, unless a test says so

}  // namespace

TEST_CASE("the chief rules by its own look: a process serving there is not lost, a refusing address or something else there is, a replaced one is gone") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(4, addresses.look_at(), kSilence);
  addresses.set(0, {Kind::kServes, kProcess, "it serves"});
  addresses.set(1, {Kind::kGone, 0, "its address refuses connections"});
  addresses.set(2, {Kind::kGone, 0, "another task answers there"});
  addresses.set(3, {Kind::kServes, kProcess + 1, "it serves"});

  CHECK_FALSE(rulings->rule(LostProcess{0, kProcess, "out of reach"}).has_value());  // the chief looks first
  CHECK(ruling(*rulings, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(false));
  CHECK(ruling(*rulings, LostProcess{1, kProcess, "refused"}) == std::optional<bool>(true));
  CHECK(ruling(*rulings, LostProcess{2, kProcess, "out of reach"}) == std::optional<bool>(true));
  CHECK(ruling(*rulings, LostProcess{3, kProcess, "out of reach"}) == std::optional<bool>(true));  // replaced
  // A process never reached (0): lost only when no ps of the job serves there.
  CHECK(ruling(*rulings, LostProcess{3, 0, "never reached"}) == std::optional<bool>(false));
  CHECK(ruling(*rulings, LostProcess{1, 0, "never reached"}) == std::optional<bool>(true));
  // A ps the job does not have: nothing to give up.
  CHECK(ruling(*rulings, LostProcess{4, kProcess, "no such ps"}) == std::optional<bool>(false));

  // Lost stands for good: the same process is back at the address (a look now reaches it),
  // yet every task that asks about it hears "lost", so that none keeps a copy the others
  // gave up.
  addresses.set(1, {Kind::kServes, kProcess, "it serves"});
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the last look is stale
  CHECK(ruling(*rulings, LostProcess{1, kProcess, "refused"}) == std::optional<bool>(true));
  // A process started in its place since is another matter: it is looked at.
  addresses.set(1, {Kind::kServes, kProcess + 7, "it serves"});
  CHECK(ruling(*rulings, LostProcess{1, kProcess + 7, "out of reach"}) == std::optional<bool>(false));
}

TEST_CASE("silence is lost only once the chief's looks have seen nothing for the copy timeout") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(1, addresses.look_at(), std::chrono::milliseconds(1500));
  addresses.set(0, {Kind::kSilent, 0, "no connection within 2000 ms"});
  const auto began = std::chrono::steady_clock::now();
  CHECK(ruling(*rulings, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(false));
  std::optional<bool> last;
  while (std::chrono::steady_clock::now() - began < std::chrono::seconds(10)) {  // as a task asks, every second
    std::this_thread::sleep_for(std::chrono::milliseconds(1050));
    last = ruling(*rulings, LostProcess{0, kProcess, "out of reach"});
    if (last == std::optional<bool>(true)) break;
  }
  CHECK(last == std::optional<bool>(true));
  CHECK(std::chrono::steady_clock::now() - began >= std::chrono::milliseconds(1500));
  // A process heard again in between starts the count again.
  addresses.set(0, {Kind::kSilent, 0, "no connection"});
  auto again = std::make_shared<CopyRulings>(1, addresses.look_at(), std::chrono::milliseconds(1500));
  CHECK(ruling(*again, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(false));
  std::this_thread::sleep_for(std::chrono::milliseconds(1050));
  addresses.set(0, {Kind::kServes, kProcess, "it serves"});
  CHECK(ruling(*again, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(false));
  std::this_thread::sleep_for(std::chrono::milliseconds(1050));
  addresses.set(0, {Kind::kSilent, 0, "no connection"});
  CHECK(ruling(*again, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(false));  // 0 ms silent
}

TEST_CASE("silence is lost even when each look lasts longer than the copy timeout") {
  // A look at a stopped process waits out its attempt timeout (its kernel takes the
  // connection, no handshake comes), which may be longer than the copy timeout: the
  // silence counts from the start of the first such look, and looks that follow each
  // other with no gap as long as the silence keep counting it. (Counted from each look's
  // end, with the gap measured end to end, such a process was never ruled lost.)
  Addresses addresses;
  addresses.lasts = std::chrono::milliseconds(1600);
  auto rulings =
      std::make_shared<CopyRulings>(1, addresses.look_at(), std::chrono::milliseconds(1500));
  addresses.set(0, {Kind::kSilent, 0, "the handshake's read did not complete in time"});
  const auto began = std::chrono::steady_clock::now();
  std::optional<bool> last;
  while (std::chrono::steady_clock::now() - began < std::chrono::seconds(12)) {
    last = ruling(*rulings, LostProcess{0, kProcess, "silent"});
    if (last == std::optional<bool>(true)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(last == std::optional<bool>(true));
  CHECK(std::chrono::steady_clock::now() - began >= std::chrono::milliseconds(1500));
}

TEST_CASE("one look answers every task that lost the same ps at once") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(2, addresses.look_at(), kSilence);
  addresses.set(1, {Kind::kServes, kProcess, "it serves"});
  for (int task = 0; task < 8; ++task) {
    CHECK(ruling(*rulings, LostProcess{1, kProcess, "out of reach"}) == std::optional<bool>(false));
  }
  CHECK(addresses.looks == 1);
}

TEST_CASE("the chief's own transports hear the same rulings, once the chief has looked") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(2, addresses.look_at(), kSilence);
  addresses.set(0, {Kind::kServes, kProcess, "it serves"});       // the chief alone lost it for a moment
  addresses.set(1, {Kind::kGone, 0, "its address refuses connections"});
  const CopyReferee referee = rulings->referee();
  std::mutex mutex;
  std::map<std::uint32_t, bool> answered;
  for (const std::uint32_t ps : {0U, 1U}) {
    referee(LostProcess{ps, kProcess, "its address refuses connections"}, [&, ps](bool lost) {
      const std::scoped_lock lock(mutex);
      answered[ps] = lost;
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    {
      const std::scoped_lock lock(mutex);
      if (answered.size() == 2) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::scoped_lock lock(mutex);
  CHECK(answered == std::map<std::uint32_t, bool>{{0, false}, {1, true}});
}

TEST_CASE(
    "a process ruled lost that answers again is told to start again, and one in its place is "
    "left alone") {
  // ps 0's process was stopped past the copy timeout and is continued; ps 1's was killed
  // and another process started in its place (the chief takes that one back by itself);
  // ps 2's process was never ruled lost. The chief's loop asks for each (`revive`).
  constexpr std::uint64_t kKilled = 0xABCDF0;  // ps 1's process ruled lost
  constexpr std::uint64_t kOther = 0x123456;   // the one started in its place
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(3, addresses.look_at(), kSilence, addresses.tell());
  addresses.set(0, {Kind::kGone, 0, "its address refuses connections"});
  addresses.set(1, {Kind::kGone, 0, "its address refuses connections"});
  CHECK(ruling(*rulings, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(true));
  CHECK(ruling(*rulings, LostProcess{1, kKilled, "out of reach"}) == std::optional<bool>(true));
  addresses.set(0, {Kind::kServes, kProcess, "at ps 0's address"});
  addresses.set(1, {Kind::kServes, kOther, "at ps 1's address"});
  addresses.set(2, {Kind::kServes, 0x777, "at ps 2's address"});
  const auto told = [&](std::size_t n) {  // the first n tells, once made (3 s at most)
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (addresses.told_so_far().size() < n && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return addresses.told_so_far();
  };
  CHECK(addresses.told_so_far().empty());  // nothing before the chief's loop asks
  rulings->revive(2);                      // never ruled lost: nothing to tell
  rulings->revive(0);
  REQUIRE(told(1).size() == 1);
  CHECK(told(1)[0].ps == 0);
  CHECK(told(1)[0].restart);
  CHECK(told(1)[0].only == std::set<std::uint64_t>{kProcess});  // only the process ruled lost
  rulings->revive(1);  // the look finds another process: told nothing (the fake's kOther)
  REQUIRE(told(2).size() == 2);
  CHECK(told(2)[1].ps == 1);
  CHECK(told(2)[1].only == std::set<std::uint64_t>{kKilled});
  // ps 0's process, told once, is not told again while it starts again.
  rulings->revive(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(addresses.told_so_far().size() == 2);
  // The end of training reaches whichever process serves each address of a ps ruled lost.
  rulings->finish();
  const auto all = addresses.told_so_far();
  REQUIRE(all.size() == 4);
  for (std::size_t i = 2; i < 4; ++i) {
    CHECK(all[i].ps == i - 2);
    CHECK(!all[i].restart);
    CHECK(all[i].only.empty());
  }
  rulings->revive(1);  // after the end: nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(addresses.told_so_far().size() == 4);
}

TEST_CASE("a process ruled lost and still stopped is told nothing until it answers") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(1, addresses.look_at(), kSilence, addresses.tell());
  addresses.set(0, {Kind::kGone, 0, "its address refuses connections"});
  CHECK(ruling(*rulings, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(true));
  addresses.set(0, {Kind::kSilent, 0, "the handshake's read did not complete in time"});
  const auto looks = [&](std::size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (addresses.told_so_far().size() < n && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return addresses.told_so_far().size();
  };
  rulings->revive(0);
  CHECK(looks(1) == 1);  // silent: nothing told, asked again at the loop's next look
  rulings->revive(0);
  CHECK(looks(2) == 2);
  addresses.set(0, {Kind::kServes, kProcess, "at ps 0's address"});
  rulings->revive(0);
  REQUIRE(looks(3) == 3);
  CHECK(addresses.told_so_far().back().restart);
}

TEST_CASE(
    "the end of training tells a process ruled lost that is there but silent again, within its "
    "grace") {
  // ps 0's process was stopped past the copy timeout and is still stopped when training
  // ends: its address takes connections, its handshake does not come. ps 1's address
  // takes none (its host is gone). ps 0's is continued while the chief still tells.
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(2, addresses.look_at(), kSilence, addresses.tell());
  addresses.set(0, {Kind::kGone, 0, "its address refuses connections"});
  addresses.set(1, {Kind::kGone, 0, "its address refuses connections"});
  REQUIRE(ruling(*rulings, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(true));
  REQUIRE(ruling(*rulings, LostProcess{1, kProcess + 1, "out of reach"}) ==
          std::optional<bool>(true));
  addresses.set(0, {Kind::kSilent, 0, "the handshake's read did not complete in time", true});
  addresses.set(1, {Kind::kSilent, 0, "no connection within 1000 ms", false});
  std::thread end([&] { rulings->finish(std::chrono::minutes(1)); });
  const auto told_at = [&](std::uint32_t ps) {
    std::size_t n = 0;
    for (const auto& t : addresses.told_so_far()) n += t.ps == ps ? 1 : 0;
    return n;
  };
  for (int i = 0; i < 600 && told_at(0) < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(told_at(0) >= 2);  // told again while it is there and silent
  addresses.set(0, {Kind::kServes, kProcess, "at ps 0's address"});  // continued
  end.join();  // once told, the end is over: well within the minute
  const auto all = addresses.told_so_far();
  REQUIRE(!all.empty());
  CHECK(told_at(1) == 1);  // an address that takes no connection is told once
  CHECK(all.back().ps == 0);
  for (const auto& t : all) CHECK(!t.restart);

  // A process that stays silent is told until the grace ends, and the end goes on without it.
  Addresses stopped;
  auto again = std::make_shared<CopyRulings>(1, stopped.look_at(), kSilence, stopped.tell());
  stopped.set(0, {Kind::kGone, 0, "its address refuses connections"});
  REQUIRE(ruling(*again, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(true));
  stopped.set(0, {Kind::kSilent, 0, "the handshake's read did not complete in time", true});
  again->finish(std::chrono::milliseconds(1500));
  CHECK(stopped.told_so_far().size() >= 2);
}
