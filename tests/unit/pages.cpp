// SPDX-License-Identifier: MIT
// Large buffers advised onto huge pages (core/detail/pages.hpp): the vector's contract is
// kept, and on Linux with transparent huge pages the advice reaches the kernel.
#include "pulley/core/detail/pages.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

// The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps), or "".
std::string vm_flags_at(std::uintptr_t address) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    const auto dash = line.find('-');
    const auto space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        line.find_first_not_of("0123456789abcdef") == dash) {
      const std::uintptr_t begin = std::stoull(line.substr(0, dash), nullptr, 16);
      const std::uintptr_t end = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
      inside = begin <= address && address < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

}  // namespace

TEST_CASE(
    "reserve_on_huge_pages keeps the vector's elements and reserves at least what it is asked") {
  std::vector<float> v{1.0F, 2.0F, 3.0F};
  pulley::detail::reserve_on_huge_pages(v, std::size_t{4} << 20U);  // 16 MiB
  CHECK(v.size() == 3);
  CHECK(v.capacity() >= (std::size_t{4} << 20U));
  CHECK(v == std::vector<float>{1.0F, 2.0F, 3.0F});
  const float* data = v.data();
  pulley::detail::reserve_on_huge_pages(v, 10);  // room enough already: nothing moves
  CHECK(v.data() == data);
  std::vector<float> empty;
  pulley::detail::reserve_on_huge_pages(empty, 0);
  CHECK(empty.capacity() == 0);
  pulley::detail::advise_huge_pages(nullptr,
                                    std::size_t{64} << 20U);  // no memory: no advice, no fault
}

TEST_CASE("resize_on_huge_pages keeps the elements held and value-initializes the new ones") {
  std::vector<float> v{1.0F, 2.0F};
  pulley::detail::resize_on_huge_pages(v, std::size_t{2} << 20U);  // 8 MiB
  REQUIRE(v.size() == (std::size_t{2} << 20U));
  CHECK(v[0] == 1.0F);
  CHECK(v[1] == 2.0F);
  CHECK(v[2] == 0.0F);
  CHECK(v.back() == 0.0F);
  pulley::detail::resize_on_huge_pages(v, 1);  // shrinking keeps the first
  CHECK(v == std::vector<float>{1.0F});
}

#if defined(__linux__)
TEST_CASE("a buffer of megabytes is advised onto transparent huge pages where Linux has them") {
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
    MESSAGE("this kernel has no transparent huge pages: nothing to advise");
    return;
  }
  {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("THP_enabled:", 0) == 0 && line.find('0') != std::string::npos) {
        MESSAGE("transparent huge pages are off for this process (prctl PR_SET_THP_DISABLE)");
        return;
      }
    }
  }
  std::vector<float> v;
  pulley::detail::reserve_on_huge_pages(v, std::size_t{4} << 20U);  // 16 MiB, not written yet
  const auto from = reinterpret_cast<std::uintptr_t>(v.data());
  const std::uintptr_t aligned = (from + pulley::detail::kHugePageBytes - 1) &
                                 ~(std::uintptr_t{pulley::detail::kHugePageBytes} - 1);
  const std::string flags = vm_flags_at(aligned);
  INFO("VmFlags of the buffer's mapping: " << flags);
  CHECK(flags.find(" hg") != std::string::npos);  // VM_HUGEPAGE: the madvise took
  v.assign(std::size_t{4} << 20U, 1.5F);          // written after the advice, read back whole
  CHECK(v.front() == 1.5F);
  CHECK(v.back() == 1.5F);
}
#endif
