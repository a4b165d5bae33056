#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Tasks that join a running job naming the chief's address alone (--join --role
# --chief-host --job-name, no cluster spec: as a task started in a Slurm job step of its
# own, whose variables they carry, is): real processes on 127.0.0.1, Fashion-MNIST, 2 ps,
# 2 workers, a chief, sync R = N.
#  1. At about epoch 2 a ps starts with --role ps --address 127.0.0.1:PORT: the chief tells
#     it the job's shape, it takes the next index (ps 2) and the chief takes it in.
#  2. Then a worker starts with --role worker: it becomes worker 2 and trains to the end.
#  3. ps 1 then leaves (SIGTERM): the job's ps tasks are {0, 2}. A worker that joins naming
#     the chief alone becomes worker 3, and one whose cluster spec lists every ps task the
#     job has known (ps 1 among them, gone) joins as worker 4: both connect to the members
#     only and train to the end.
#     An evaluator then joins naming the chief alone: it reads the members' snapshots and
#     scores them to the end of training.
#  4. A ps without --address is refused at once, naming the flag.
#  5. The job finishes at test accuracy >= 0.875 on ps tasks {0, 2} and 5 workers, every
#     task exiting 0.
#   tests/scripts/join_by_chief.sh FASHION_MNIST_BINARY
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
binary=$1
flags=(--epochs 16 --job-name join-by-chief-test --recovery-timeout-ms 60000 --worker-timeout-ms 3000)
dir=$work/mnist
start_job "$dir" "$binary" 2 2 "${flags[@]}"
ps1=${job_pids[1]}  # ps 0, ps 1, worker 0, worker 1, chief
chief=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["chief"][0])' "$job_cluster")
wait_for "$dir/chief-0.log" "may join job 'join-by-chief-test' at $chief" 30 || fail "the chief does not take joins"

# join ROLE LOG FLAGS...: a task that knows the chief's address alone, in a Slurm step of
# its own (no TF_CONFIG; the step's variables must not change its job name or its spec)
join() {
  local role=$1 log=$2
  shift 2
  env -u TF_CONFIG SLURM_JOB_ID=4242 SLURM_STEP_ID=7 SLURM_PROCID=0 SLURM_NTASKS=1 \
    "$binary" --role "$role" --join --chief-host "$chief" "${flags[@]}" "$@" >"$dir/$log" 2>&1 &
  last_pid=$!
  pids+=("$last_pid")
  job_pids=("$last_pid" "${job_pids[@]}")  # waited for too; the chief stays last
}

# ---- 1. a ps joins -------------------------------------------------------------------------
wait_for "$dir/chief-0.log" '^epoch  2/16' 180 || fail "the job never reached epoch 2"
new_ps="127.0.0.1:$(free_ports 1)"
join ps ps-new.log --address "$new_ps"
wait_for "$dir/chief-0.log" 'ps 2 at 127.0.0.1:[0-9]* joined the job' 60 || fail "the chief did not take the new ps in"
grep -h 'this task joins as' "$dir/ps-new.log" | sed 's/^[^:]*: /ps: /'
grep -h 'joined the job' "$dir/chief-0.log" | sed 's/^[^:]*: //'

# ---- 2. a worker joins ---------------------------------------------------------------------
join worker worker-new.log
wait_for "$dir/chief-0.log" 'worker 2 joined' 60 || fail "the chief did not count the new worker in"
grep -h 'this task joins as' "$dir/worker-new.log" | sed 's/^[^:]*: /worker: /'
grep -h 'worker 2 joined' "$dir/chief-0.log" | sed 's/^[^:]*: //'

# ---- 3. ps 1 leaves; workers join the ps tasks {0, 2} -------------------------------------
kill -TERM "$ps1"
wait_for "$dir/chief-0.log" 'ps 1 left the job at its request' 120 || fail "ps 1 did not leave"
grep -h 'ps 1 left the job' "$dir/chief-0.log" | sed 's/^[^:]*: //'
join worker worker-after-leave.log
wait_for "$dir/chief-0.log" 'worker 3 joined' 90 || fail "a worker naming the chief alone did not join after ps 1 left"
grep -h 'this task joins as' "$dir/worker-after-leave.log" | sed 's/^[^:]*: /worker: /'
# worker 4: a cluster spec listing ps 0, 1 (gone) and 2, and 5 workers, started with --join
spec=$job_cluster
job_cluster=$(python3 -c '
import json, sys
c = json.loads(sys.argv[1])
c["ps"].append(sys.argv[2])
while len(c["worker"]) < 5:
    c["worker"].append("127.0.0.1:%d" % len(c["worker"]))  # never dialled: a worker serves nothing
print(json.dumps(c))' "$spec" "$new_ps")
start_task "$dir" worker 4 worker-4.log "${flags[@]}" --join
job_cluster=$spec
job_pids=("$last_pid" "${job_pids[@]}")
wait_for "$dir/chief-0.log" 'worker 4 joined' 90 || fail "a worker whose spec lists a ps that left did not join"
grep -h 'worker [34] joined' "$dir/chief-0.log" | sed 's/^[^:]*: //'
join evaluator evaluator-new.log
wait_for "$dir/evaluator-new.log" '^evaluation at step' 120 || fail "an evaluator naming the chief alone scored nothing"
grep -h 'this task joins as' "$dir/evaluator-new.log" | sed 's/^[^:]*: /evaluator: /'

# ---- 4. a ps that does not say where it serves ----------------------------------------------
env -u TF_CONFIG "$binary" --role ps --join --chief-host "$chief" "${flags[@]}" >"$dir/bad.log" 2>&1 &&
  fail "a ps without --address joined"
grep -q 'needs where it serves: --address' "$dir/bad.log" || fail "the ps without --address did not say why: $(cat "$dir/bad.log")"

# ---- 5. the end ----------------------------------------------------------------------------
finish_job "fashion_mnist joined by the chief's address: 2 ps -> 3 -> 2, 2 workers -> 5" 300
for log in worker-new worker-after-leave worker-4; do
  grep -q 'training finished after' "$dir/$log.log" || fail "$log did not train to the end"
done
grep -q "ps 2: training finished" "$dir/ps-new.log" || fail "the new ps did not serve to the end"
grep -q "evaluator: training finished" "$dir/evaluator-new.log" || fail "the evaluator did not follow the job to its end"
echo "evaluator: $(grep -c '^evaluation at step' "$dir/evaluator-new.log") evaluations, the last: $(grep '^evaluation at step' "$dir/evaluator-new.log" | tail -1)"
check_final "$dir" "fashion_mnist joined by the chief's address" 2
echo "$final" | grep -q " workers=5 " || fail "the final line does not count the 5 workers the job ended with"
echo PASS
