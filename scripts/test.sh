#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the dependencies, builds everything and runs the whole test suite.
# Environment: BUILD_DIR (build), BUILD_TYPE (Release), JOBS (nproc), CTEST_JOBS (2).
# Extra arguments go to ctest, e.g.  scripts/test.sh -R unit.optimizers
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}

bash "$root/scripts/setup.sh"
BUILD_DIR=$build_dir bash "$root/scripts/configure.sh"
cmake --build "$build_dir" --parallel "${JOBS:-$(nproc)}"
if [[ $# -eq 0 ]]; then
  set -- -LE extended
fi
ctest --test-dir "$build_dir" --output-on-failure -j "${CTEST_JOBS:-2}" "$@"
