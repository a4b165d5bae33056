#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A lost worker's examples are not lost: a sync R = N = 2 job of real processes on
# 127.0.0.1 (1 ps, a chief, 2 workers), where worker 1 is killed (SIGKILL) at about epoch 3
# of 10 and started again at about epoch 6. While it is gone, worker 0 takes its tokens
# and reads its batches, so every step keeps its two batches; once back, worker 1 takes
# its own again. The job must end within 0.005 of the same job without the kill, and every
# task must exit 0.
#   tests/scripts/lost_share.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
epochs=10
source "$(dirname "$0")/common.sh"
flags=(--epochs "$epochs" --worker-timeout-ms 1500 --heartbeat-interval-ms 250 --wait-timeout-ms 120000)

run_job() {  # run_job NAME KILL: one job in $work/NAME; KILL=1 kills worker 1 and restarts it
  local dir=$work/$1 kill=$2
  start_job "$dir" "$binary" 1 2 "${flags[@]}"
  local w1=${job_pids[2]}
  if [ "$kill" = 1 ]; then
    wait_for "$dir/chief-0.log" '^epoch  3/' 300 || fail "$1: the job never reached epoch 3"
    kill -9 "$w1"
    wait "$w1" 2>/dev/null
    forget_task "$w1"
    echo "$1: killed worker 1 after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    wait_for "$dir/ps-0.log" 'worker:1 lost' 10 || fail "$1: the ps did not hold worker 1 lost"
    wait_for "$dir/chief-0.log" '^epoch  6/' 600 || fail "$1: the job did not reach epoch 6 without worker 1"
    start_task "$dir" worker 1 worker-1-again.log "${flags[@]}"
    job_pids+=("$last_pid")
    echo "$1: started worker 1 again after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
  fi
  finish_job "$1" 600
}

run_job clean 0
run_job killed 1

grep -h -E 'worker:1 (lost|is back)' "$work"/killed/ps-0.log | sed 's/^/killed: /'
grep -q 'worker:1 is back' "$work/killed/ps-0.log" || fail "the ps did not see worker 1 come back"
steps_back=$(sed -n 's/.*training finished after \([0-9]*\) steps here.*/\1/p' "$work/killed/worker-1-again.log")
[ -n "$steps_back" ] && [ "$steps_back" -gt 0 ] || fail "worker 1, started again, took no step"
echo "worker 1, started again, took $steps_back steps"
steps_of() { sed -n 's/.*training finished after \([0-9]*\) steps here.*/\1/p' "$1"; }
clean0=$(steps_of "$work/clean/worker-0.log") killed0=$(steps_of "$work/killed/worker-0.log")
echo "worker 0 took $killed0 steps ($clean0 in the clean job): it read worker 1's batches while it was gone"
[ -n "$clean0" ] && [ -n "$killed0" ] && [ "$killed0" -ge $((clean0 + 500)) ] ||
  fail "worker 0 did not take worker 1's tokens while it was gone ($killed0 steps, $clean0 in the clean job)"
grep -h 'updates applied' "$work"/*/chief-0.log
clean=$(sed -n 's/^final: test_accuracy=\([0-9.]*\).*/\1/p' "$work/clean/chief-0.log")
killed=$(sed -n 's/^final: test_accuracy=\([0-9.]*\).*/\1/p' "$work/killed/chief-0.log")
echo "final test accuracy: clean $clean, worker 1 killed and restarted $killed"
python3 -c "import sys; sys.exit(0 if abs(float('$clean') - float('$killed')) <= 0.005 else 1)" ||
  fail "the killed job's accuracy $killed is not within 0.005 of the clean job's $clean"
echo "PASS: worker 1 killed at epoch 3 and back at epoch 6: accuracy $killed against $clean without the kill"
