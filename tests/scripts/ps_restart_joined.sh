#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps lost and started again after a worker joined the job: real processes on 127.0.0.1,
# Fashion-MNIST, 2 ps, 2 workers, a chief, sync R = N, checkpoints every 200 steps.
#  1. Worker 2 joins (--join, its cluster spec listing 3 workers): the job trains on 3.
#  2. At about epoch 3 ps 1 is killed (SIGKILL) and started again on its address, the
#     chief held (SIGSTOP) until worker 2 has met the new process. That process knows the
#     cluster spec's 2 workers only, so it refuses worker 2 until the chief's rollback
#     restores it (the restore tells it the job's workers); worker 2, let in by that
#     address before, waits as for a lost ps instead of ending.
#  3. The job finishes at test accuracy >= 0.86 with its 3 workers, every task exiting 0,
#     worker 2 among them. Not the undisturbed goal of 0.875: the job ends at the chief's
#     step 4680 (10 epochs of 2 workers), so with worker 3 counted in it reads about 13
#     epochs of examples at Adam's constant rate, and its last evaluations swing. In-process
#     runs read 0.8734-0.8885 over epochs 9-14; a CI run of this test read 0.8851 at epoch
#     9 and 0.8720 at epoch 10. The test is of the restart, not of the optimizer.
#   tests/scripts/ps_restart_joined.sh FASHION_MNIST_BINARY
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
binary=$1
flags=(--epochs 10 --job-name ps-restart-joined-test --recovery-timeout-ms 60000 --worker-timeout-ms 3000
       --checkpoint-dir "$work/ckpt" --save-checkpoint-steps 200)
dir=$work/mnist
start_job "$dir" "$binary" 2 2 "${flags[@]}"
ps1=${job_pids[1]}  # ps 0, ps 1, worker 0, worker 1, chief
wait_for "$dir/chief-0.log" "may join job 'ps-restart-joined-test'" 30 || fail "the chief does not take joins"

# ---- 1. worker 2 joins -----------------------------------------------------------------------
spec=$job_cluster
job_cluster=$(python3 -c '
import json, sys
c = json.loads(sys.argv[1])
c["worker"].append("127.0.0.1:1")  # never dialled: a worker serves nothing
print(json.dumps(c))' "$spec")
start_task "$dir" worker 2 worker-2.log "${flags[@]}" --join
job_pids=("$last_pid" "${job_pids[@]}")  # waited for too; the chief stays last
job_cluster=$spec
wait_for "$dir/chief-0.log" 'worker 2 joined' 60 || fail "the chief did not count worker 2 in"
grep -h 'worker 2 joined' "$dir/chief-0.log" | sed 's/^[^:]*: //'
# The chief answers worker 2 after it logs the join: stopping it in between would leave
# worker 2 without its answer for the whole stop.
wait_for "$dir/worker-2.log" 'counted it in' 60 || fail "worker 2 never heard that the chief counted it in"

# ---- 2. ps 1 lost and started again ----------------------------------------------------------
# ps 1 is killed at epoch 3 or later, once the chief has finished an epoch with worker 2
# counted in (so worker 2 has met ps 1).
epochs_at_join=$(grep -c '^epoch' "$dir/chief-0.log")
for _ in $(seq 1 3600); do
  epochs=$(grep -c '^epoch' "$dir/chief-0.log")
  [ "$epochs" -gt "$epochs_at_join" ] && [ "$epochs" -ge 3 ] && break
  sleep 0.05
done
[ "$epochs" -gt "$epochs_at_join" ] && [ "$epochs" -ge 3 ] || fail "the job never reached epoch 3 with worker 2"
chief=${job_pids[-1]}
kill -9 "$ps1"
wait "$ps1" 2>/dev/null
forget_task "$ps1"
echo "killed ps 1 after: $(grep -h '^epoch' "$dir/chief-0.log" | tail -1)"
# The chief is held (SIGSTOP) until worker 2 has met the new process, so that it meets it
# before the rollback, not after.
kill -STOP "$chief"
start_task "$dir" ps 1 ps-1-again.log "${flags[@]}"
job_pids=("$last_pid" "${job_pids[@]}")
wait_for "$dir/ps-1-again.log" 'refused a connection from .*worker:2 is not a task of this job' 60 ||
  { kill -CONT "$chief"; fail "worker 2 never reached the new ps 1"; }
kill -CONT "$chief"
grep -h -m1 'worker:2 is not a task of this job' "$dir/ps-1-again.log" | sed 's/^[^:]*: //'
wait_for "$dir/chief-0.log" 'every ps restored from' 90 || fail "the chief did not restore the ps tasks"
grep -h 'every ps restored from' "$dir/chief-0.log" | sed 's/^[^:]*: //'
wait_for "$dir/chief-0.log" '^epoch  5/10' 120 || fail "the job did not train on after the rollback"
if grep -q 'worker:2 failed' "$dir/worker-2.log"; then fail "worker 2 ended instead of waiting for the rollback"; fi

# ---- 3. the end --------------------------------------------------------------------------------
finish_job "fashion_mnist with a joined worker and a ps started again" 300
grep -q 'training finished after' "$dir/worker-2.log" || fail "worker 2 did not train to the end"
check_final "$dir" "fashion_mnist, worker 2 joined, ps 1 started again" 2 0.86
echo "$final" | grep -q " workers=3 " || fail "the job did not end with its 3 workers"
echo PASS
