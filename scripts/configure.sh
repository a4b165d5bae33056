#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Configures the build tree (default build/, Release, Ninja). Sourced by test.sh and train.sh.
# Environment: BUILD_DIR (build), BUILD_TYPE (Release).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}
build_type=${BUILD_TYPE:-Release}

generator=()
if [[ ! -f $build_dir/CMakeCache.txt ]]; then
  generator=(-G Ninja)  # an existing tree keeps the generator it was made with
fi
cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type"
