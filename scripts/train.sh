#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the dependencies, builds the Fashion-MNIST example (Release) and runs it.
# Arguments go to the example:  scripts/train.sh --help
# Environment: BUILD_DIR (build), BUILD_TYPE (Release), JOBS (nproc).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}

bash "$root/scripts/setup.sh"
BUILD_DIR=$build_dir bash "$root/scripts/configure.sh"
cmake --build "$build_dir" --target fashion_mnist --parallel "${JOBS:-$(nproc)}"
exec "$build_dir/examples/fashion_mnist" "$@"
