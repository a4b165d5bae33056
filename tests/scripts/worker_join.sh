#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Workers that join and leave a running job: real processes on 127.0.0.1, Fashion-MNIST,
# 2 ps, a chief, sync with R = N (every worker's batch in each step), every task named by
# --job-name.
#  1. 2 workers train; at about epoch 2 a third worker process starts with --join and a
#     cluster spec that lists it after the two. It asks the chief (at the chief's address)
#     and waits; the chief counts it in within a second (every ps counts 3 workers,
#     R = 3, from the step after the one they were at), and it trains.
#  2. A worker started with --join beyond the next index is refused and exits non-zero.
#  3. At about epoch 6 worker 1 is killed (SIGKILL) for good: the ps tasks hold it lost,
#     (3 s silent) and 2 s later the chief takes it out (--worker-leave-secs 2): workers {0, 2}.
#  4. With copies of each shard (flags --ps-replicas 1): once the ps tasks' lost workers
#     stopped changing, the chief made both copies of every shard alike (a push of worker
#     1's may have reached one copy only); ps 0 is then killed (SIGKILL): its copy on ps 1,
#     which took every change of workers too, serves its shard with workers {0, 2}, and
#     nothing is rolled back.
#  5. The job finishes at test accuracy >= 0.875, every task left exiting 0.
# Prints the changes of the workers as the chief and the ps tasks logged them.
#   tests/scripts/worker_join.sh FASHION_MNIST_BINARY [--ps-replicas 1]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
binary=$1
shift  # the rest: flags for every task (--ps-replicas 1: the same with copies of each shard)

# start_joiner JOB_DIR INDEX COUNT FLAGS...: worker INDEX, its cluster spec listing COUNT
# workers (the job's, then new ones), started with --join
start_joiner() {
  local dir=$1 index=$2 count=$3 spec=$job_cluster
  shift 3
  job_cluster=$(python3 -c '
import json, sys
c = json.loads(sys.argv[1])
while len(c["worker"]) < int(sys.argv[2]):
    c["worker"].append("127.0.0.1:%d" % len(c["worker"]))  # never dialled: a worker serves nothing
print(json.dumps(c))' "$spec" "$count")
  start_task "$dir" worker "$index" "worker-$index.log" "$@" --join
  job_cluster=$spec
}

flags=(--epochs 20 --job-name worker-join-test --recovery-timeout-ms 60000 --worker-timeout-ms 3000
       --worker-leave-secs 2 "$@")
dir=$work/mnist
start_job "$dir" "$binary" 2 2 "${flags[@]}"
wait_for "$dir/chief-0.log" "may join job 'worker-join-test'" 30 || fail "the chief does not take joins"

# ---- 1. a third worker joins ---------------------------------------------------------------
wait_for "$dir/chief-0.log" '^epoch  2/20' 180 || fail "the job never reached epoch 2"
start_joiner "$dir" 2 3 "${flags[@]}"
job_pids=("$last_pid" "${job_pids[@]}")  # waited for too; the chief stays last
echo "started worker 2 with --join after: $(grep -h '^epoch' "$dir/chief-0.log" | tail -1)"
wait_for "$dir/chief-0.log" 'worker 2 joined' 60 || fail "the chief did not count worker 2 in"
grep -h 'worker 2 joined' "$dir/chief-0.log" | sed 's/^[^:]*: //'

# ---- 2. a worker beyond the next index is refused ------------------------------------------
start_joiner "$dir" 4 5 "${flags[@]}"
refused=$last_pid
for _ in $(seq 1 600); do kill -0 "$refused" 2>/dev/null || break; sleep 0.05; done
wait "$refused" && fail "worker 4 (the next is 3) was not refused"
grep -q 'the next worker of the job is worker 3' "$dir/worker-4.log" ||
  fail "worker 4 did not say why it was refused: $(tail -2 "$dir/worker-4.log")"
echo "worker 4: $(grep -h 'next worker of the job' "$dir/worker-4.log" | head -1 | sed 's/^[^:]*: //')"

# ---- 3. worker 1 leaves for good -----------------------------------------------------------
wait_for "$dir/chief-0.log" '^epoch  6/20' 240 || fail "the job never reached epoch 5"
kill -9 "${job_pids[4]}"  # worker 1 (worker 2, ps 0, ps 1, worker 0, worker 1, chief)
forget_task "${job_pids[4]}"
echo "killed worker 1 after: $(grep -h '^epoch' "$dir/chief-0.log" | tail -1)"
wait_for "$dir/chief-0.log" 'worker 1 left' 60 || fail "the chief did not take worker 1 out"
grep -h 'worker 1 left' "$dir/chief-0.log" | sed 's/^[^:]*: //'

# ---- 4. with copies, ps 0 lost: its copy took the same changes -----------------------------
copies=0
[[ " $* " == *" --ps-replicas 1 "* ]] && copies=1
if [ "$copies" = 1 ]; then
  wait_for "$dir/chief-0.log" 'both copies of every shard were made alike' 60 ||
    fail "the chief did not make the copies alike after worker 1 was lost"
  wait_for "$dir/chief-0.log" '^epoch  9/20' 240 || fail "the job never reached epoch 9"
  ps_pid=${job_pids[1]}  # worker 2, ps 0, ps 1, worker 0, chief
  kill_ps_for_copy "$dir" 0 "copies" worker-0 worker-2 chief-0
fi

# ---- 5. the end ----------------------------------------------------------------------------
finish_job "fashion_mnist 2 workers -> 3 -> 2" 300
for ps in 0 1; do
  holders=("ps $ps")  # the shards ps $ps serves: its own, and with copies ps (ps - 1)'s
  [ "$copies" = 1 ] && holders+=("ps $ps's copy of ps $(((ps + 1) % 2))")
  for who in "${holders[@]}"; do
    grep -q "$who: the job's workers are {0, 1, 2} from global step" "$dir/ps-$ps.log" || fail "$who never counted worker 2"
    grep -q "$who: the job's workers are {0, 2} from global step" "$dir/ps-$ps.log" || fail "$who never let worker 1 go"
  done
done
grep -h "the job's workers are" "$dir"/ps-*.log | sed 's/^[^:]*: //' | sort | uniq -c
grep -q 'training finished after' "$dir/worker-2.log" || fail "worker 2 did not train to the end"
grep -h "training finished after" "$dir/worker-2.log" | sed "s/^[^:]*: //"
check_final "$dir" "fashion_mnist 2 workers -> 3 -> 2" 2
if [ "$copies" = 1 ]; then
  # A rollback restores an older step ("N steps' updates lost"); making the copies alike
  # after worker 1 was lost restores the step the ps tasks were at, or a copy one step
  # behind its twin at its twin's ("nothing lost").
  grep -q -i "rolled back\|every ps restored from\|steps' updates lost" "$dir"/*.log &&
    fail "the job rolled back after ps 0 was lost"
  grep -h 'both copies of every shard were made alike' "$dir/chief-0.log" | sed 's/^[^:]*: //'
fi
echo PASS
