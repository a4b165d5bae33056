#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps lost from a job of real processes on 127.0.0.1 (2 ps, a chief, 2 workers, sync):
#  1. ps 1 is killed (SIGKILL) mid-training and started again on its address: the chief
#     restores every ps from the newest checkpoint, the workers wait and go on, and the
#     job finishes at a normal accuracy; prints the updates lost and the time to recover.
#  2. ps 1 is killed and never comes back: every task left fails (exit != 0) within the
#     recovery timeout, with a line naming the lost ps.
#   tests/scripts/ps_loss.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -n 12 "$f"; done; exit 1; }
wait_for() {  # wait_for FILE PATTERN SECONDS
  for _ in $(seq 1 $(($3 * 20))); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  return 1
}
export PULLEY_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')

new_cluster() {
  mapfile -t ports < <(python3 "$(dirname "$0")/../../scripts/free_ports.py" 5)
  cluster="{\"ps\": [\"127.0.0.1:${ports[0]}\", \"127.0.0.1:${ports[1]}\"], \"worker\": [\"127.0.0.1:${ports[2]}\", \"127.0.0.1:${ports[3]}\"], \"chief\": [\"127.0.0.1:${ports[4]}\"]}"
}
start() {  # start NAME TYPE INDEX FLAGS...: one task, its output appended to $work/NAME.log
  local name=$1 type=$2 index=$3
  shift 3
  TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$type\", \"index\": $index}}" \
    "$binary" "$@" >>"$work/$name.log" 2>&1 &
  pids+=("$!")
  last_pid=$!
}

# ---- 1. killed and restarted ------------------------------------------------------------
new_cluster
flags=(--epochs 6 --checkpoint-dir "$work/ckpt" --save-checkpoint-steps 200 --recovery-timeout-ms 60000)
start ps0 ps 0 "${flags[@]}"; ps0=$last_pid
start ps1 ps 1 "${flags[@]}"; ps1=$last_pid
start w0 worker 0 "${flags[@]}"; w0=$last_pid
start w1 worker 1 "${flags[@]}"; w1=$last_pid
start chief chief 0 "${flags[@]}"; chief=$last_pid
wait_for "$work/chief.log" '^epoch  2/6' 120 || fail "the job never reached epoch 2"
kill -9 "$ps1"
killed_at=$(date +%s.%N)
echo "killed ps 1 after: $(grep '^epoch' "$work/chief.log" | tail -1)"
sleep 1
start ps1 ps 1 "${flags[@]}"; ps1=$last_pid
wait_for "$work/chief.log" 'every ps restored from' 60 || fail "the chief did not restore the ps tasks"
restored_at=$(date +%s.%N)
for _ in $(seq 1 2400); do kill -0 "$chief" 2>/dev/null || break; sleep 0.05; done
kill -0 "$chief" 2>/dev/null && fail "the chief did not finish within 120 s of the restore"
for pid in "$w0" "$w1" "$ps0" "$ps1"; do  # the others end with the chief's shutdown
  for _ in $(seq 1 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$pid" 2>/dev/null && fail "a task did not end within 30 s of the chief"
done
wait "$chief"; chief_rc=$?
wait "$w0"; w0_rc=$?
wait "$w1"; w1_rc=$?
wait "$ps0"; ps0_rc=$?
wait "$ps1"; ps1_rc=$?
grep -h 'every ps restored\|updates lost\|waiting for the ps tasks' "$work"/*.log
final=$(grep '^final:' "$work/chief.log")
echo "$final"
[ "$chief_rc$w0_rc$w1_rc$ps0_rc$ps1_rc" = 00000 ] ||
  fail "a task failed (chief $chief_rc, workers $w0_rc $w1_rc, ps $ps0_rc $ps1_rc)"
accuracy=$(echo "$final" | sed -n 's/.*test_accuracy=\([0-9.]*\).*/\1/p')
python3 -c "import sys; sys.exit(0 if float('$accuracy') >= 0.85 else 1)" || fail "accuracy $accuracy < 0.85"
lost=$(grep -h -o "[0-9]* steps. updates lost" "$work/ps0.log" | head -1)
python3 - "$killed_at" "$restored_at" "$lost" <<'PY'
import sys
print("ps 1 restart: every ps restored %.1f s after the kill (the ps was down 1 s of it); %s"
      % (float(sys.argv[2]) - float(sys.argv[1]), sys.argv[3]))
PY

# ---- 2. killed for good -----------------------------------------------------------------
rm -f "$work"/*.log
new_cluster
flags=(--epochs 50 --recovery-timeout-ms 3000)
start ps0 ps 0 "${flags[@]}"; ps0=$last_pid
start ps1 ps 1 "${flags[@]}"; ps1=$last_pid
start w0 worker 0 "${flags[@]}"; w0=$last_pid
start w1 worker 1 "${flags[@]}"; w1=$last_pid
start chief chief 0 "${flags[@]}"; chief=$last_pid
wait_for "$work/chief.log" '^epoch  1/50' 120 || fail "the second job never reached epoch 1"
kill -9 "$ps1"
for pid in "$chief" "$w0" "$w1"; do
  for _ in $(seq 1 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  wait "$pid" && fail "a task exited 0 though ps 1 never came back"
done
for name in chief w0 w1; do
  line=$(grep 'failed:' "$work/$name.log" | tail -1)
  echo "$name: $line"
  echo "$line" | grep -q "${ports[1]}\|ps 1" || fail "$name's failure does not name ps 1"
done
kill "$ps0" 2>/dev/null
echo "PASS"
