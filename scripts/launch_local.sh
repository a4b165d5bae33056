#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Starts a whole pulley cluster on 127.0.0.1, one process per task, each told its role by
# TF_CONFIG exactly as TensorFlow's launchers do:
#
#   scripts/launch_local.sh [--ps N] [--workers M] [--evaluator] [--ps-delay S]
#                           [--restart-failed K] [--binary PATH] [-- FLAGS...]
#
# N ps tasks (default 1), M workers (default 2), a chief and optionally an evaluator run PATH (default
# build/examples/fashion_mnist) with FLAGS. Every output line is prefixed with its task
# ("[worker:1] ..."). When the chief ends, the others get a few seconds to finish; when any
# task fails, all are stopped. Exits 0 only if every task did. --ps-delay starts the ps
# tasks S seconds after the others, to show that clients wait for them. --restart-failed K
# starts a ps or worker that fails again on its address (K times in all) instead of stopping
# the cluster, as a cluster scheduler would: a ps restarted is restored by the chief from the
# newest checkpoint, a worker rejoins. The tasks share a fresh PULLEY_SECRET (or the one
# exported).
set -euo pipefail

if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
  echo "launch_local.sh: needs bash 5.1 or newer (wait -n -p)" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
num_ps=1
num_workers=2
evaluator=0
ps_delay=0
restarts=0
binary="$root/build/examples/fashion_mnist"
while [ $# -gt 0 ]; do
  case "$1" in
    --ps) num_ps=$2; shift 2 ;;
    --workers) num_workers=$2; shift 2 ;;
    --binary) binary=$2; shift 2 ;;
    --evaluator) evaluator=1; shift ;;
    --ps-delay) ps_delay=$2; shift 2 ;;
    --restart-failed) restarts=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "launch_local.sh: unknown option $1 (use -- before the program's flags)" >&2; exit 2 ;;
  esac
done
[ -x "$binary" ] || { echo "launch_local.sh: $binary is not built (bash scripts/train.sh builds it)" >&2; exit 2; }

# Free ports on 127.0.0.1, all held at once so they differ.
mapfile -t ports < <(python3 "$(dirname "${BASH_SOURCE[0]}")/free_ports.py" "$((num_ps + num_workers + 1))")
hosts() {  # hosts FIRST COUNT → "127.0.0.1:p1","127.0.0.1:p2"
  local out=""
  for ((i = $1; i < $1 + $2; i++)); do out+="${out:+,}\"127.0.0.1:${ports[$i]}\""; done
  echo "$out"
}
cluster="{\"ps\": [$(hosts 0 "$num_ps")], \"worker\": [$(hosts "$num_ps" "$num_workers")], \"chief\": [$(hosts $((num_ps + num_workers)) 1)]}"

# One fresh secret per run, which every task proves when it connects (README, Security);
# an exported PULLEY_SECRET is kept.
if [ -z "${PULLEY_SECRET:-}" ]; then
  PULLEY_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
fi
export PULLEY_SECRET

declare -A task_of=()
pids=()
stop_all() {  # SIGTERM (a ps or worker may first ask the chief to leave), then SIGKILL
  local pid left
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 30); do
    left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && return
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT  # whatever ends this script ends the tasks it started
trap 'exit 130' INT
trap 'exit 143' TERM
# The program's flags follow the role; TF_CONFIG carries the cluster.
start_task() { local type=$1 index=$2; shift 2; TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$type\", \"index\": $index}}" \
    "$binary" "$@" > >(sed -u "s/^/[$type:$index] /") 2>&1 &
  pids+=("$!"); task_of[$!]="$type:$index"; }

for ((i = 0; i < num_workers; i++)); do start_task worker "$i" "$@"; done
start_task chief 0 "$@"
chief_pid=${pids[-1]}
[ "$evaluator" -eq 0 ] || start_task evaluator 0 "$@"  # not listed in the cluster, as in TF
sleep "$ps_delay"
for ((i = 0; i < num_ps; i++)); do start_task ps "$i" "$@"; done

status=0
remove() { local keep=() p; for p in "${pids[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done; pids=("${keep[@]}"); }
# Until the chief ends: any task that fails stops the cluster.
while :; do
  pid=""
  set +e
  wait -n -p pid "${pids[@]}"
  rc=$?
  set -e
  [ -n "$pid" ] || { echo "launch_local.sh: lost track of the tasks" >&2; stop_all; exit 1; }
  remove "$pid"
  task=${task_of[$pid]}
  if [ "$rc" -ne 0 ] && [ "$restarts" -gt 0 ] && [[ $task == ps:* || $task == worker:* ]]; then
    restarts=$((restarts - 1))
    echo "launch_local.sh: $task failed (exit $rc); starting it again ($restarts restarts left)" >&2
    start_task "${task%%:*}" "${task##*:}" "$@"
    continue
  fi
  if [ "$rc" -ne 0 ]; then
    echo "launch_local.sh: $task failed (exit $rc); stopping the cluster" >&2
    stop_all
    wait 2>/dev/null || true
    exit 1
  fi
  [ "$pid" = "$chief_pid" ] && break
done
# The chief is done: the others get 10 s to finish.
for ((tick = 0; tick < 50 && ${#pids[@]} > 0; tick++)); do
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      set +e; wait "$pid"; rc=$?; set -e
      remove "$pid"
      if [ "$rc" -ne 0 ]; then
        echo "launch_local.sh: ${task_of[$pid]} failed (exit $rc)" >&2
        status=1
      fi
    fi
  done
  [ ${#pids[@]} -eq 0 ] || sleep 0.2
done
if [ ${#pids[@]} -gt 0 ]; then
  echo "launch_local.sh: tasks still running 10 s after the chief ended; stopping them" >&2
  stop_all
  status=1
fi
wait 2>/dev/null || true
exit "$status"
