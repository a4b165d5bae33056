#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A lost chief is handled: sync R = N jobs of real processes on 127.0.0.1 (1 ps, a chief,
# 2 workers, a checkpoint every epoch).
#  1. The chief is killed (SIGKILL) after epoch 1 and started again 3 s later. The ps and
#     the workers log that they hold it lost and train on; the new chief goes on from the
#     ps's live state (nothing is rolled back), and the job ends where the same job
#     without the kill ends (the chief only reads): the same final accuracy; every task
#     exits 0.
#  2. The chief is killed and never comes back: within the recovery timeout every task
#     fails with a line naming the chief, and none exits 0.
#   tests/scripts/chief_loss.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "$0")/common.sh"
flags=(--epochs 12 --worker-timeout-ms 1500 --heartbeat-interval-ms 250 --wait-timeout-ms 120000
       --recovery-timeout-ms 8000)

# start_job NAME: a job's tasks in $work/NAME; sets cluster, dir, ps0, w0, w1, chief.
start_job() {
  dir=$work/$1
  mkdir -p "$dir"
  mapfile -t ports < <(free_ports 4)
  cluster="{\"ps\": [\"127.0.0.1:${ports[0]}\"], \"worker\": [\"127.0.0.1:${ports[1]}\", \"127.0.0.1:${ports[2]}\"], \"chief\": [\"127.0.0.1:${ports[3]}\"]}"
  start ps 0 ps-0; ps0=$!
  start worker 0 worker-0; w0=$!
  start worker 1 worker-1; w1=$!
  start chief 0 chief-0; chief=$!
}
start() {  # start TYPE INDEX LOGNAME
  TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$1\", \"index\": $2}}" \
    "$binary" "${flags[@]}" --checkpoint-dir "$dir/checkpoints" --save-checkpoint-secs 0 \
    --save-checkpoint-steps 468 >"$dir/$3.log" 2>&1 &
  pids+=("$!")
}
wait_all() {  # wait_all NAME PID...: every pid must exit 0
  local name=$1 pid rc
  shift
  for pid in "$@"; do
    wait "$pid"; rc=$?
    [ "$rc" = 0 ] || fail "$name: a task (pid $pid) exited $rc"
  done
}

start_job clean
wait_all clean "$chief" "$w0" "$w1" "$ps0"

start_job restarted
wait_for "$dir/chief-0.log" '^epoch  1/' 120 || fail "restarted: the job never reached epoch 1"
kill -9 "$chief"; wait "$chief" 2>/dev/null
killed_at=$(date +%s.%N)
echo "restarted: killed the chief after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
wait_for "$dir/ps-0.log" 'the chief is lost' 10 || fail "restarted: the ps did not hold the chief lost"
wait_for "$dir/worker-0.log" 'hold the chief lost' 10 || fail "restarted: worker 0 did not log the lost chief"
sleep 1
start chief 0 chief-again; chief=$!
wait_for "$dir/ps-0.log" 'the chief is back' 30 || fail "restarted: the ps did not see the new chief"
echo "restarted: a new chief was back $(python3 -c "import time; print(f'{time.time() - $killed_at:.1f}')") s after the kill" 
wait_all restarted "$chief" "$w0" "$w1" "$ps0"
grep -h -E 'chief is (lost|back)|going on from' "$dir"/*.log | sed 's/^/restarted: /'
grep -q 'going on from their live state' "$dir/chief-again.log" ||
  fail "the new chief did not go on from the live state"
killed_step=$(grep '^epoch' "$dir/chief-0.log" | tail -1 | awk '{print $4}')
adopted_step=$(sed -n 's/.*at global step \([0-9]*\): going on.*/\1/p' "$dir/chief-again.log")
echo "restarted: training went on without a chief from step $killed_step (the last evaluated) to step $adopted_step"
grep -q -i 'restored' "$dir/ps-0.log" && fail "the job was rolled back to a checkpoint"
clean=$(sed -n 's/^final: test_accuracy=\([0-9.]*\).*/\1/p' "$work/clean/chief-0.log")
again=$(sed -n 's/^final: test_accuracy=\([0-9.]*\).*/\1/p' "$dir/chief-again.log")
echo "final test accuracy: clean $clean, chief killed and started again $again"
[ -n "$clean" ] && [ "$clean" = "$again" ] || fail "the job with a new chief ended at $again, the clean one at $clean"

start_job abandoned
wait_for "$dir/chief-0.log" '^epoch  1/' 120 || fail "abandoned: the job never reached epoch 1"
kill -9 "$chief"; wait "$chief" 2>/dev/null
echo "abandoned: killed the chief after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
for pid in "$ps0" "$w0" "$w1"; do
  for _ in $(seq 1 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$pid" 2>/dev/null && fail "abandoned: a task (pid $pid) still runs 60 s after the chief was lost"
  wait "$pid"; rc=$?
  [ "$rc" = 0 ] && fail "abandoned: a task (pid $pid) exited 0 though the chief never ended training"
done
for task in ps-0 worker-0 worker-1; do
  line=$(grep -h 'chief was lost' "$dir/$task.log" | tail -1)
  [ -n "$line" ] || fail "abandoned: $task did not say the chief was lost"
  echo "abandoned: $task: $line"
done
echo "PASS: a chief started again went on from the live state (accuracy $again, as without the kill); without one every task failed naming the chief"
