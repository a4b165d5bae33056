#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the dependencies, builds everything and runs the test suite: every test but the
# `extended` tier (the TCP tests rebuilt with sanitizers, and the fuzzer: about 20 minutes
# more on 2 cores), which `scripts/test.sh -L extended` runs, as .ci/run does after this,
# and the `chaos` label (seeded random faults under real processes: `-L chaos`).
# Environment: BUILD_DIR (build), BUILD_TYPE (Release), JOBS (nproc), CTEST_JOBS (2).
# Extra arguments go to ctest; those that choose tests (-L, -LE, -R, -E) replace the
# default choice, e.g.  scripts/test.sh -R unit.optimizers
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}

bash "$root/scripts/setup.sh"
BUILD_DIR=$build_dir bash "$root/scripts/configure.sh"
cmake --build "$build_dir" --parallel "${JOBS:-$(nproc)}"
# The extended tier stays out unless the arguments choose tests themselves.
chosen=0
for arg in "$@"; do
  case $arg in -L | -LE | -R | -E | --label-regex* | --label-exclude* | --tests-regex* | --exclude-regex* | -L?* | -R?* | -E?*) chosen=1 ;; esac
done
if [[ $chosen -eq 0 ]]; then
  set -- -LE 'extended|chaos' "$@"
fi
ctest --test-dir "$build_dir" --output-on-failure -j "${CTEST_JOBS:-2}" "$@"
