#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Workers lost from a sync R = N job of real processes on 127.0.0.1 (1 ps, a chief, 3
# workers): worker 2 is killed (SIGKILL) after the first epoch, worker 1 is stopped
# (SIGSTOP) until the ps holds it lost (the worker timeout) and then continued. The job must finish
# with a normal accuracy, the ps must log each loss by name and worker 1's return, the
# waits must explain themselves, and every task left must exit 0.
#   tests/scripts/worker_loss.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "$0")/common.sh"
mapfile -t ports < <(free_ports 5)
cluster="{\"ps\": [\"127.0.0.1:${ports[0]}\"], \"worker\": [\"127.0.0.1:${ports[1]}\", \"127.0.0.1:${ports[2]}\", \"127.0.0.1:${ports[3]}\"], \"chief\": [\"127.0.0.1:${ports[4]}\"]}"
flags=(--epochs 30 --worker-timeout-ms 1500 --heartbeat-interval-ms 250 --wait-timeout-ms 120000)
start() {  # start TYPE INDEX: one task, its output in $work/TYPE-INDEX.log
  TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$1\", \"index\": $2}}" \
    "$binary" "${flags[@]}" >"$work/$1-$2.log" 2>&1 &
  pids+=("$!")
}
start ps 0; ps_pid=$!
start worker 0; w0=$!
start worker 1; w1=$!
start worker 2; w2=$!
start chief 0; chief=$!

wait_for "$work/chief-0.log" '^epoch  1/30' 120 || fail "the job never reached epoch 1"
kill -9 "$w2"
echo "killed worker 2 after: $(grep '^epoch' "$work/chief-0.log" | tail -1)"
wait_for "$work/ps-0.log" 'worker:2 lost' 10 || fail "the ps did not name the lost worker 2"
kill -STOP "$w1"
echo "stopped worker 1"
wait_for "$work/ps-0.log" 'worker:1 lost' 10 || fail "the ps did not name the stopped worker 1"
kill -CONT "$w1"
echo "continued worker 1"
wait_for "$work/ps-0.log" 'worker:1 is back' 10 || fail "the ps did not see worker 1 come back"

for _ in $(seq 1 2400); do kill -0 "$chief" 2>/dev/null || break; sleep 0.05; done
wait "$chief"; chief_rc=$?
wait "$w0"; w0_rc=$?
wait "$w1"; w1_rc=$?
wait "$ps_pid"; ps_rc=$?
grep -E 'lost|is back' "$work/ps-0.log"
final=$(grep '^final:' "$work/chief-0.log")
echo "$final"
[ "$chief_rc" = 0 ] || fail "the chief exited $chief_rc"
[ "$w0_rc" = 0 ] && [ "$w1_rc" = 0 ] || fail "a surviving worker failed ($w0_rc, $w1_rc)"
[ "$ps_rc" = 0 ] || fail "the ps exited $ps_rc"
accuracy=$(echo "$final" | sed -n 's/.*test_accuracy=\([0-9.]*\).*/\1/p')
python3 -c "import sys; sys.exit(0 if float('$accuracy') >= 0.85 else 1)" \
  || fail "accuracy $accuracy is below 0.85"
echo "PASS: the job finished at accuracy $accuracy without worker 2 and across worker 1's stop"
