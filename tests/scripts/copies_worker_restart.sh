#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A worker started again after a ps was lost for good, in a job that keeps a copy of every
# shard (--ps-replicas 1): sync R = N = 2 Fashion-MNIST, real processes on 127.0.0.1 (2 ps,
# a chief, 2 workers). ps 1 is killed with SIGKILL at epoch 2 and the tasks turn to its
# copy; at epoch 3 worker 1 is killed and started again a second later. The new process
# finds the job under way and ps 1's address refusing: it waits one connection attempt, not
# the 60 s connect timeout, asks the chief (which ruled ps 1 lost), reads ps 1's shard from
# its copy, and takes the step it left, within the worker timeout: the job ends bit for bit
# where the same job ends unbroken (the same parameters' CRC-32C).
#   tests/scripts/copies_worker_restart.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "$0")/common.sh"
# The connect timeout stays the default (60 s). The worker timeout covers the new worker's
# start, so that it is never held lost (a lost worker changes a sync job by design).
flags=(--epochs 6 --ps-replicas 1 --worker-timeout-ms 20000 --wait-timeout-ms 120000 --recovery-timeout-ms 60000)

start_job "$work/unbroken" "$binary" 2 2 "${flags[@]}"
finish_job unbroken 120

dir=$work/broken
start_job "$dir" "$binary" 2 2 "${flags[@]}"
ps_pid=${job_pids[1]} worker1=${job_pids[3]}
wait_for "$dir/chief-0.log" '^epoch  2/' 120 || fail "the job never reached epoch 2"
kill_ps_for_copy "$dir" 1 broken chief-0 worker-0 worker-1
wait_for "$dir/chief-0.log" '^epoch  3/' 120 || fail "the job never reached epoch 3 after ps 1 was lost"
kill -9 "$worker1"; wait "$worker1" 2>/dev/null; forget_task "$worker1"
echo "killed worker 1 after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
sleep 1
start_task "$dir" worker 1 worker-1-again.log "${flags[@]}"
job_pids=("$last_pid" "${job_pids[@]}")  # the chief stays last
started_at=$(date +%s.%N)
wait_for "$dir/worker-1-again.log" "ps 1's shard is served by one copy only" 30 ||
  fail "worker 1 started again did not turn to ps 1's copy within 30 s (it waited the connect timeout for ps 1?)"
echo "worker 1 started again reads ps 1's shard from its copy $(python3 -c "import time; print(f'{time.time() - $started_at:.1f}')") s after it started"
finish_job broken 240
grep -q 'worker:1 lost' "$dir/ps-0.log" && fail "worker 1 was held lost: the test's worker timeout is too short for this host"
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }
unbroken=$(crc_of "$work/unbroken/chief-0.log") broken=$(crc_of "$dir/chief-0.log")
echo "unbroken: $(grep '^final:' "$work/unbroken/chief-0.log")"
echo "broken:   $(grep '^final:' "$dir/chief-0.log")"
[ -n "$unbroken" ] || fail "the unbroken job printed no parameters' CRC-32C"
if grep -q 'without a push for step' "$dir/ps-0.log"; then
  # Worker 1 was killed while it wrote its push, and ps 1's last copy missed it: that step
  # went on without it there (README, "A push lost with its worker's process").
  echo "$(grep -h 'without a push for step' "$dir/ps-0.log" | head -1)"
  accuracy_of() { sed -n 's/^final: test_accuracy=\([0-9.]*\).*/\1/p' "$1"; }
  python3 -c "import sys; sys.exit(abs($(accuracy_of "$dir/chief-0.log") - $(accuracy_of "$work/unbroken/chief-0.log")) > 0.01)" ||
    fail "a job whose push was lost with worker 1 ended more than 0.01 from the unbroken one"
  echo "PASS: worker 1 started again after ps 1 was lost for good turned to ps 1's copy without waiting out the connect timeout; its last push had been lost with its process, that step went on without it, and the job ended near the unbroken one"
  exit 0
fi
[ "$broken" = "$unbroken" ] || fail "the job ended elsewhere ($broken) than the unbroken one ($unbroken)"
echo "PASS: worker 1 started again after ps 1 was lost for good turned to ps 1's copy without waiting out the connect timeout, and the job ended bit for bit where the unbroken one does (parameters' CRC-32C $broken)"
