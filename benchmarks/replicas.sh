#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# What a copy of every shard costs (--ps-replicas 1): the same job of real processes on
# 127.0.0.1 (2 ps, 2 workers, a chief, sync R = N) with copies and without, interleaved,
# for Fashion-MNIST and the CTR example. Prints, per round, samples/s, each ps's peak
# resident memory and the CPU seconds the ps tasks and the workers used, then the medians
# and the ratios (copies / none).
#   benchmarks/replicas.sh BUILD_DIR [ROUNDS]      (BENCHMARKS.md, "Failures")
# EXAMPLES="ctr" (or "fashion_mnist") runs one of them only.
set -uo pipefail
build=$1
rounds=${2:-3}
source "$(dirname "$0")/../tests/scripts/common.sh"  # work, start_job, finish_job

# job NAME BINARY FLAGS...: one job; prints "samples_per_s peak_rss_ps0_kib peak_rss_ps1_kib
# ps_cpu_s workers_cpu_s"
job() {
  local name=$1 binary=$2
  shift 2
  start_job "$work/$name" "$binary" 2 2 "$@"
  local peak0=0 peak1=0 v i
  local ticks=(0 0 0 0)  # utime + stime of ps 0, ps 1, worker 0, worker 1: the last seen
  while kill -0 "${job_pids[4]}" 2>/dev/null; do  # VmHWM: the peak so far
    v=$(awk '/VmHWM/ {print $2}' "/proc/${job_pids[0]}/status" 2>/dev/null) && [ -n "$v" ] && peak0=$v
    v=$(awk '/VmHWM/ {print $2}' "/proc/${job_pids[1]}/status" 2>/dev/null) && [ -n "$v" ] && peak1=$v
    for i in 0 1 2 3; do
      v=$(awk '{print $14 + $15}' "/proc/${job_pids[i]}/stat" 2>/dev/null) && [ -n "$v" ] && ticks[i]=$v
    done
    sleep 0.2
  done
  finish_job "$name" 60 >&2
  local hz
  hz=$(getconf CLK_TCK)
  echo "$(sed -n 's/^final: .*samples_per_s=\([0-9]*\).*/\1/p' "$work/$name/chief-0.log") $peak0 $peak1" \
    "$(awk -v t="$((ticks[0] + ticks[1]))" -v hz="$hz" 'BEGIN {printf "%.2f", t / hz}')" \
    "$(awk -v t="$((ticks[2] + ticks[3]))" -v hz="$hz" 'BEGIN {printf "%.2f", t / hz}')"
}

median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

fmnist=(--epochs 3)
ctr_data=$work/ctr-data
ctr=(--train-examples 200000 --test-examples 20000 --vocabulary 2000 --batch 64 --epochs 1 --data-dir "$ctr_data")
"$build/examples/ctr" "${ctr[@]}" --epochs 1 --train-examples 1000 --test-examples 1000 >/dev/null 2>&1 || true  # writes the data once

for example in ${EXAMPLES:-fashion_mnist ctr}; do
  for copies in 0 1; do : >"$work/$example-$copies.results"; done
  for round in $(seq 1 "$rounds"); do
    for copies in 0 1; do
      if [ "$example" = fashion_mnist ]; then flags=("${fmnist[@]}"); else flags=("${ctr[@]}"); fi
      result=$(job "$example-$copies-$round" "$build/examples/$example" "${flags[@]}" --ps-replicas "$copies") || exit 1
      echo "$example round $round, --ps-replicas $copies: samples/s, peak RSS ps 0 / ps 1 (KiB)," \
        "CPU s ps tasks / workers: $result"
      echo "$result" >>"$work/$example-$copies.results"
    done
  done
  for copies in 0 1; do
    speed[$copies]=$(awk '{print $1}' "$work/$example-$copies.results" | median)
    rss[$copies]=$(awk '{print ($2 + $3) / 2}' "$work/$example-$copies.results" | median)
    ps_cpu[$copies]=$(awk '{print $4}' "$work/$example-$copies.results" | median)
    worker_cpu[$copies]=$(awk '{print $5}' "$work/$example-$copies.results" | median)
  done
  python3 - "$example" "${speed[0]}" "${speed[1]}" "${rss[0]}" "${rss[1]}" \
    "${ps_cpu[0]}" "${ps_cpu[1]}" "${worker_cpu[0]}" "${worker_cpu[1]}" <<'PY'
import sys
name, s0, s1, r0, r1, p0, p1, w0, w1 = sys.argv[1], *map(float, sys.argv[2:])
print(f"{name}: median samples/s {s0:.0f} without copies, {s1:.0f} with: step time x{s0 / s1:.2f}; "
      f"median peak RSS per ps {r0 / 1024:.1f} MiB without, {r1 / 1024:.1f} MiB with: x{r1 / r0:.2f}; "
      f"CPU s of the ps tasks {p0:.2f} without, {p1:.2f} with: x{p1 / p0:.2f}; "
      f"of the workers {w0:.2f} without, {w1:.2f} with: x{w1 / w0:.2f}")
PY
done
