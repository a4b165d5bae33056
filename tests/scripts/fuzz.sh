#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds the libFuzzer target with clang (AddressSanitizer and UBSan on) and runs it for a
# bounded time from seed inputs it writes (tests/fuzz/make_seeds.cpp) and what earlier runs
# found, kept in BUILD_DIR/corpus:
#   tests/scripts/fuzz.sh SOURCE_DIR BUILD_DIR [SECONDS]      (default: PULLEY_FUZZ_SECONDS or 60)
# Exits 77 (ctest: skipped) when clang++-14 is not installed; non-zero on any finding.
set -euo pipefail
source_dir=$1
build_dir=$2
seconds=${3:-${PULLEY_FUZZ_SECONDS:-60}}
clang=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$clang" ]; then
  echo "fuzz: no clang++ (bash scripts/setup.sh installs clang-14): skipped"
  exit 77
fi
cmake -S "$source_dir/tests/fuzz" -B "$build_dir" -DCMAKE_CXX_COMPILER="$clang" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPULLEY_SOURCE_DIR="$source_dir" >/dev/null
cmake --build "$build_dir" >/dev/null
corpus="$build_dir/corpus"
mkdir -p "$corpus"
"$build_dir/make_seeds" "$corpus"  # well-formed streams to start from (kept across runs)
# A huge Register may ask for more than fits: the ps refuses it; let the allocator say so.
ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 \
  "$build_dir/wire_fuzz" -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 25
