// SPDX-License-Identifier: MIT
#pragma once

/// pulley's version, as `project(pulley VERSION ...)` in CMakeLists.txt says (a test checks
/// that they agree) and as the release tag `v<major>.<minor>.<patch>` names it.
#define PULLEY_VERSION_MAJOR 0
#define PULLEY_VERSION_MINOR 3
#define PULLEY_VERSION_PATCH 0

namespace pulley {

/// A version number; compare it to require a minimum.
struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;

  friend constexpr auto operator<=>(const Version&, const Version&) = default;
};

/// The version of these headers.
inline constexpr Version version{PULLEY_VERSION_MAJOR, PULLEY_VERSION_MINOR, PULLEY_VERSION_PATCH};

}  // namespace pulley
