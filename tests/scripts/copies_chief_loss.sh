#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps lost while the chief is lost, in a job that keeps a copy of every shard
# (--ps-replicas 1): sync R = N = 2 Fashion-MNIST, real processes on 127.0.0.1 (2 ps, a
# chief, 2 workers). The chief is killed with SIGKILL at epoch 2, ps 1 a second later, and
# a chief is started again 3 s after that. While no chief is there the ps tasks serve no
# task (their lease on the chief ran out) and nobody may give ps 1 up: the workers wait.
# The new chief rules ps 1 lost (its address refuses), the tasks turn to ps 1's copy, the
# chief goes on from the ps tasks' live state, and the job ends bit for bit where the same
# job ends unbroken (the same parameters' CRC-32C), with nothing rolled back. Then a chief
# lost for good: every task fails within its timeouts, naming the chief.
#   tests/scripts/copies_chief_loss.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "$0")/common.sh"
# The connect timeout stays the default (60 s): a new chief that finds the job under way
# waits one connection attempt for a ps that does not answer, not that long.
base=(--epochs 6 --ps-replicas 1 --copy-timeout-ms 2000 --worker-timeout-ms 1500 --heartbeat-interval-ms 250
      --wait-timeout-ms 120000)
flags=("${base[@]}" --recovery-timeout-ms 60000)

start_job "$work/unbroken" "$binary" 2 2 "${flags[@]}"
finish_job unbroken 120

dir=$work/broken
start_job "$dir" "$binary" 2 2 "${flags[@]}"
chief=${job_pids[4]} ps1=${job_pids[1]}
wait_for "$dir/chief-0.log" '^epoch  2/' 120 || fail "the job never reached epoch 2"
kill -9 "$chief"; wait "$chief" 2>/dev/null
echo "killed the chief after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
sleep 1
kill -9 "$ps1"; wait "$ps1" 2>/dev/null
echo "killed ps 1"
wait_for "$dir/ps-0.log" "has not heard the chief" 30 || fail "ps 0 did not stop serving the tasks without a chief"
sleep 3
start_task "$dir" chief 0 chief-again.log "${flags[@]}"
started_at=$(date +%s.%N)
wait_for "$dir/chief-again.log" "ps 1's process is lost for the job" 45 || fail "the new chief did not rule ps 1 lost"
echo "the new chief ruled ps 1 lost $(python3 -c "import time; print(f'{time.time() - $started_at:.1f}')") s after it started"
for who in worker-0 worker-1; do
  wait_for "$dir/$who.log" "dropping the copy of ps 1's shard held by ps 1 " 60 || fail "$who did not turn to ps 1's copy"
done
echo "every worker reads ps 1's shard from its copy $(python3 -c "import time; print(f'{time.time() - $started_at:.1f}')") s after the new chief started"
wait_for "$dir/chief-again.log" 'going on from their live state' 45 ||
  fail "the new chief did not go on within 45 s (it waited the connect timeout for ps 1?)"
echo "the new chief went on from the live state $(python3 -c "import time; print(f'{time.time() - $started_at:.1f}')") s after it started"
job_pids=("${job_pids[0]}" "${job_pids[2]}" "${job_pids[3]}" "$last_pid")  # ps 0, the workers, the new chief
finish_job broken 240
grep -q -i 'restored' "$dir/ps-0.log" && fail "the job was rolled back to a checkpoint"
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }
unbroken=$(crc_of "$work/unbroken/chief-0.log") broken=$(crc_of "$dir/chief-again.log")
echo "unbroken: $(grep '^final:' "$work/unbroken/chief-0.log")"
echo "broken:   $(grep '^final:' "$dir/chief-again.log")"
[ -n "$unbroken" ] && [ "$broken" = "$unbroken" ] || fail "the job ended elsewhere ($broken) than the unbroken one ($unbroken)"

# The chief lost for good: no task may exit 0, and none may wait for ever (a pull parked
# on a ps that serves no task is closed, so the worker's recovery timeout runs; a ps that
# serves no task still gives the chief up after the recovery timeout, well before
# --ps-orphaned-after-ms, 5 min by default).
dir=$work/abandoned
start_job "$dir" "$binary" 2 2 "${base[@]}" --recovery-timeout-ms 8000
chief=${job_pids[4]}
wait_for "$dir/chief-0.log" '^epoch  2/' 120 || fail "abandoned: the job never reached epoch 2"
kill -9 "$chief"; wait "$chief" 2>/dev/null
for pid in "${job_pids[@]:0:4}"; do
  for _ in $(seq 1 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$pid" 2>/dev/null && fail "abandoned: a task (pid $pid) still runs 60 s after the chief was lost"
  wait "$pid"; rc=$?
  [ "$rc" = 0 ] && fail "abandoned: a task (pid $pid) exited 0 though the chief never ended training"
done
for task in ps-0 ps-1 worker-0 worker-1; do
  line=$(grep -h -E 'error: .*chief' "$dir/$task.log" | tail -1)
  [ -n "$line" ] || fail "abandoned: $task did not fail naming the chief"
  echo "abandoned: $task: ${line:0:200}"
done
echo "PASS: ps 1 lost while the chief was lost: the new chief ruled it lost, went on from the live state, and the job ended bit for bit where the unbroken one does (parameters' CRC-32C $broken); with the chief lost for good, every task failed naming it"
