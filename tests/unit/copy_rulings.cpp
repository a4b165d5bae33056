// SPDX-License-Identifier: MIT
// The chief's rulings on lost ps processes (runner/copy_rulings.hpp), with the looks at a
// ps's address made up: a process is lost when the chief's own transports found it so, or
// its look finds the address refusing, silent or held by another process; not lost when
// the look reaches that very process; a ruling "lost" stands for good.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "pulley/runner/copy_rulings.hpp"

using namespace pulley;

namespace {

/// What the looks find at each ps's address, as the test sets it, and how many were made.
struct Addresses {
  std::mutex mutex;
  std::map<std::uint32_t, CopyRulings::Sight> at;
  std::atomic<int> looks{0};

  CopyRulings::LookAt look_at() {
    return [this](std::uint32_t ps) {
      ++looks;
      const std::scoped_lock lock(mutex);
      return at[ps];
    };
  }
  void set(std::uint32_t ps, CopyRulings::Sight sight) {
    const std::scoped_lock lock(mutex);
    at[ps] = std::move(sight);
  }
};

/// The ruling on `lost` once the chief has looked (asking again, as a task does, for 5 s at most).
std::optional<bool> ruling(CopyRulings& rulings, const LostProcess& lost) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    if (const std::optional<bool> r = rulings.rule(lost)) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return std::nullopt;
}

constexpr std::uint64_t kProcess = 0xABCDEF;

}  // namespace

TEST_CASE("a process the chief's look reaches is not lost, and one whose address refuses, is silent or holds another is") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(4, addresses.look_at());
  addresses.set(0, {true, kProcess, "reached"});
  addresses.set(1, {false, 0, "its address refuses connections"});
  addresses.set(2, {false, 0, "no connection within 500 ms"});
  addresses.set(3, {true, kProcess + 1, "reached"});

  CHECK_FALSE(rulings->rule(LostProcess{0, kProcess, "out of reach"}).has_value());  // the chief looks first
  CHECK(ruling(*rulings, LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(false));
  CHECK(ruling(*rulings, LostProcess{1, kProcess, "refused"}) == std::optional<bool>(true));
  CHECK(ruling(*rulings, LostProcess{2, kProcess, "out of reach"}) == std::optional<bool>(true));
  CHECK(ruling(*rulings, LostProcess{3, kProcess, "out of reach"}) == std::optional<bool>(true));  // another process
  // A process never reached (0): lost only when nothing answers there.
  CHECK(ruling(*rulings, LostProcess{3, 0, "never reached"}) == std::optional<bool>(false));
  CHECK(ruling(*rulings, LostProcess{1, 0, "never reached"}) == std::optional<bool>(true));
  // A ps the job does not have: nothing to give up.
  CHECK(rulings->rule(LostProcess{4, kProcess, "no such ps"}) == std::optional<bool>(false));

  // Lost stands for good: the same process is back at the address (a look now reaches it),
  // yet every task that asks about it hears "lost", so that none keeps a copy the others
  // gave up.
  addresses.set(1, {true, kProcess, "reached"});
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the last look is stale
  CHECK(ruling(*rulings, LostProcess{1, kProcess, "refused"}) == std::optional<bool>(true));
  // A process started in its place since is another matter: it is looked at.
  addresses.set(1, {true, kProcess + 7, "reached"});
  CHECK(ruling(*rulings, LostProcess{1, kProcess + 7, "out of reach"}) == std::optional<bool>(false));
}

TEST_CASE("one look answers every task that lost the same ps at once") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(2, addresses.look_at());
  addresses.set(1, {true, kProcess, "reached"});
  for (int task = 0; task < 8; ++task) {
    CHECK(ruling(*rulings, LostProcess{1, kProcess, "out of reach"}) == std::optional<bool>(false));
  }
  CHECK(addresses.looks == 1);
}

TEST_CASE("what the chief's own transports find lost is lost for the job, without a look") {
  Addresses addresses;
  auto rulings = std::make_shared<CopyRulings>(2, addresses.look_at());
  addresses.set(0, {true, kProcess, "reached"});  // a look would reach it
  const CopyReferee own = rulings->own();
  std::optional<bool> answered;
  own(LostProcess{0, kProcess, "its address refuses connections"}, [&](bool lost) { answered = lost; });
  CHECK(answered == std::optional<bool>(true));
  CHECK(rulings->rule(LostProcess{0, kProcess, "out of reach"}) == std::optional<bool>(true));
  CHECK(addresses.looks == 0);
}
