#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds the tests of the TCP transport, the wire format and the chief's copy rulings with
# AddressSanitizer and UndefinedBehaviorSanitizer (any finding aborts) and runs them:
#   tests/scripts/sanitize.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
tests=(test_tcp test_tcp_hostile test_replicas test_tcp_ring test_hybrid test_wire test_frame_reader test_hmac test_parameter_server
       test_sparse_training test_table_requests test_embedding_table test_tcp_probe test_copy_rulings test_shared_ring)
# -O0: the tests' own option (tests/CMakeLists.txt) comes after these flags and wins anyway.
generator=()
[ -f "$build_dir/CMakeCache.txt" ] || generator=(-G Ninja)
cmake -S "$source_dir" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O0 -g1" \
  -DPULLEY_BUILD_EXAMPLES=OFF -DPULLEY_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build_dir" --target "${tests[@]}" >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
failed=0
for t in "${tests[@]}"; do
  if "$build_dir/tests/$t" >"$build_dir/$t.log" 2>&1; then
    echo "sanitized $t: $(grep -E 'test cases' "$build_dir/$t.log" | tail -1)"
  else
    echo "sanitized $t FAILED:"
    grep -v '^pulley: ' "$build_dir/$t.log" | tail -n 60
    failed=1
  fi
done
exit "$failed"
