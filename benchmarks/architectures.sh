#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The seed's comparison of the two architectures, as processes on 127.0.0.1: Fashion-MNIST
# trained by a ps job (2 ps tasks, N workers and a chief, sync R = N) and by a ring
# all-reduce among N worker processes (--mode allreduce), for each model size (the hidden
# layer's width) and each N. Prints one line per run: samples/s and test accuracy from the
# job's final line, and the bytes that crossed the loopback interface per worker and global
# step (/proc/net/dev, TCP/IP headers and heartbeats included), beside the model's size.
# The tasks link over TCP (--no-local-sockets), as on separate hosts, so that their bytes
# cross the loopback interface; --local links them as tasks on one host do by default
# (local sockets, and shared memory in the ring), faster, with no bytes to count.
#
#   benchmarks/architectures.sh [--hidden "128 512 2048"] [--workers "2 4"] [--epochs E]
#                               [--binary PATH] [--local]
#
# The two runs of a pair follow each other; nothing else should run on the host meanwhile.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
hidden_sizes="128 512 2048"
worker_counts="2 4"
epochs=1
binary=$root/build/examples/fashion_mnist
local=0
while [ $# -gt 0 ]; do
  case $1 in
    --hidden) hidden_sizes=$2; shift 2 ;;
    --workers) worker_counts=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --binary) binary=$2; shift 2 ;;
    --local) local=1; shift ;;
    *) echo "architectures.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -x "$binary" ] || { echo "architectures.sh: $binary is not built" >&2; exit 2; }
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
export PULLEY_SECRET=${PULLEY_SECRET:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}

loopback_bytes() { awk '$1 == "lo:" { print $10 }' /proc/net/dev; }

# report ARCH HIDDEN N LOG BYTES: one line from a run's log and the loopback bytes it moved.
report() {
  local final steps
  final=$(grep -h 'final: ' "$4" | head -1 || true)
  steps=$(grep -hoE '\(([0-9]+) steps\)' "$4" | head -1 | tr -dc '0-9' || true)
  [ -n "$final" ] && [ -n "$steps" ] || { echo "architectures.sh: the $1 run failed:" >&2; cat "$4" >&2; exit 1; }
  python3 - "$1" "$2" "$3" "$steps" "$5" "$final" "$local" <<'PY'
import re, sys
arch, hidden, n, steps, moved, final, local = sys.argv[1:]
hidden, n, steps, moved = int(hidden), int(n), int(steps), int(moved)
model = (795 * hidden + 10) * 4
fig = dict(re.findall(r"(\w+)=([0-9.]+)", final))
per = moved / steps / n
wire = ("wire: local links, not counted" if local == "1" else
        f"wire per worker-step {per / 1024:8.0f} KiB = {per / model:5.2f} x model")
print(f"{arch:10} hidden {hidden:5}  model {model / 1024:8.0f} KiB  workers {n}  "
      f"samples/s {float(fig['samples_per_s']):8.0f}  accuracy {fig['test_accuracy']}  {wire}")
PY
}

ports() {  # ports K: K free ports on 127.0.0.1
  python3 "$(dirname "${BASH_SOURCE[0]}")/../scripts/free_ports.py" "$1" | tr '\n' ' ' 
}

for hidden in $hidden_sizes; do
  for n in $worker_counts; do
    flags=(--epochs "$epochs" --hidden "$hidden" --progress-secs 0)
    [ "$local" -eq 1 ] || flags+=(--no-local-sockets)
    # The ps job: 2 ps tasks, n workers, a chief.
    before=$(loopback_bytes)
    bash "$root/scripts/launch_local.sh" --ps 2 --workers "$n" --binary "$binary" -- "${flags[@]}" \
      > "$work/ps.log" 2>&1 || { cat "$work/ps.log" >&2; exit 1; }
    report ps "$hidden" "$n" "$work/ps.log" $(($(loopback_bytes) - before))
    # The ring: n worker processes, no ps task.
    read -ra p <<< "$(ports "$n")"
    hosts=$(printf '"127.0.0.1:%s",' "${p[@]}")
    before=$(loopback_bytes)
    pids=()
    for ((i = 0; i < n; i++)); do
      TF_CONFIG="{\"cluster\": {\"worker\": [${hosts%,}]}, \"task\": {\"type\": \"worker\", \"index\": $i}}" \
        "$binary" --mode allreduce "${flags[@]}" > "$work/ring$i.log" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || { cat "$work"/ring*.log >&2; exit 1; }; done
    pids=()
    report allreduce "$hidden" "$n" "$work/ring0.log" $(($(loopback_bytes) - before))
  done
done
