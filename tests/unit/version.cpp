// SPDX-License-Identifier: MIT
// pulley::version is the version CMake's project() declares (and the release tag names).
#include "pulley/core/version.hpp"

#include <doctest/doctest.h>

#include <string>

TEST_CASE("pulley::version agrees with the CMake project version") {
  const std::string headers = std::to_string(pulley::version.major) + "." +
                              std::to_string(pulley::version.minor) + "." +
                              std::to_string(pulley::version.patch);
  CHECK(headers == PULLEY_CMAKE_PROJECT_VERSION);
  CHECK(pulley::version >= pulley::Version{0, 3, 0});
  CHECK(pulley::Version{0, 10, 0} > pulley::Version{0, 9, 7});
}
