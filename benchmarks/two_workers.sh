#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Two workers against one plain thread (issue 20, item 4): the in-process Fashion-MNIST job
# (2 ps, 2 workers, a chief; sync R = N = 2 and async, batch 64 per worker) against
# `--mode plain`, the same model, data and optimizer in one thread with no ps: "plain 64"
# steps on one batch of 64 (what each worker computes: the reference), "plain 128"
# on one batch of 2 × 64 (what a sync step applies: as many updates as the job). Runs them
# in turn, ROUNDS rounds, and prints each run's samples/s, then the medians and the ratios
# to plain 64. With OTHERS set (binaries, space-separated: other builds, before and after a
# change), every round runs each of them too, in turn.
#   benchmarks/two_workers.sh BUILD_DIR [ROUNDS] [EPOCHS]      (BENCHMARKS.md, "Training")
set -euo pipefail
build=$1
rounds=${2:-3}
epochs=${3:-10}
binaries=("$build/examples/fashion_mnist")
# shellcheck disable=SC2206  # the paths are words
[ -n "${OTHERS:-}" ] && binaries+=($OTHERS)
for b in "${binaries[@]}"; do [ -x "$b" ] || { echo "no $b: build the examples first" >&2; exit 2; }; done

median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# samples BINARY FLAGS...: the run's samples/s; a run that fails or prints no final line
# ends the script with its last lines.
samples() {
  local binary=$1
  shift
  if ! "$binary" --epochs "$epochs" "$@" >"$log" 2>&1 || ! grep -q '^final: ' "$log"; then
    echo "$binary $* failed:" >&2
    tail -n 5 "$log" >&2
    return 1
  fi
  sed -n 's/^final: .*samples_per_s=\([0-9]*\).*/\1/p' "$log"
}

labels=("plain 64" "plain 128" "sync" "async")
flags=("--mode plain --workers 1" "--mode plain --workers 2" "--mode sync" "--mode async")
declare -A runs
for r in $(seq 1 "$rounds"); do
  for b in "${!binaries[@]}"; do
    for k in "${!labels[@]}"; do
      # shellcheck disable=SC2086  # the flags are words
      s=$(samples "${binaries[b]}" ${flags[k]}) || exit 1
      runs[$b,$k]+="$s "
      echo "round $r  ${binaries[b]}  ${labels[k]}  $s samples/s"
    done
  done
done
for b in "${!binaries[@]}"; do
  echo "${binaries[b]}, medians of $rounds rounds of $epochs epochs:"
  base=$(echo "${runs[$b,0]}" | tr ' ' '\n' | grep . | median)
  for k in "${!labels[@]}"; do
    m=$(echo "${runs[$b,$k]}" | tr ' ' '\n' | grep . | median)
    awk -v label="${labels[k]}" -v m="$m" -v p="$base" \
      'BEGIN {printf "  %-10s %8.0f samples/s  / plain 64 %.2f\n", label, m, m / p}'
  done
done
