#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Fashion-MNIST with --mode allreduce (no ps tasks: a ring all-reduce among the workers):
#   1. in-process, 2 worker threads: reaches the accuracy goal, ends on 0 ps tasks, and on
#      the parameters the same job on 2 ps tasks (sync R = N = 2) ends on, bit for bit;
#   2. 2 worker processes over TCP (a cluster of workers only): ends bit for bit where the
#      threads end (the same parameters' CRC-32C: the ring adds in the same order);
#   3. the same with worker 1 killed (SIGKILL) after epoch 2: worker 0 fails at once naming
#      it (the ring is not rebuilt), and the job started again resumes from the newest
#      checkpoint and still ends bit for bit where the undisturbed job ends.
#   tests/scripts/all_reduce.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "$0")/common.sh"
flags=(--mode allreduce --epochs 10)

crc() { sed -n 's/.*parameters_crc32c=\([0-9a-f]*\).*/\1/p' <<<"$1"; }

# A cluster that names a ps task is not an all-reduce job: refused at once, by name.
TF_CONFIG='{"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}' \
  timeout 60 "$binary" "${flags[@]}" >"$work/refused.log" 2>&1 && fail "refused: a cluster with a ps trained"
grep -q "workers only: its cluster has ps tasks" "$work/refused.log" || fail "refused: no reason given"

"$binary" "${flags[@]}" --workers 2 >"$work/threads.log" 2>&1 || fail "threads: exit $?"
final=$(grep '^final:' "$work/threads.log")
echo "threads: $final"
mkdir -p "$work/threads" && cp "$work/threads.log" "$work/threads/chief-0.log"
check_final "$work/threads" threads 0
reference=$(crc "$final")
# The same job on ps tasks, SyncReplicas R = N = 2: each step applies the same mean of the
# same two batches' gradients, so it ends on the same parameters, bit for bit.
"$binary" --epochs 10 --workers 2 --ps 2 >"$work/ps.log" 2>&1 || fail "ps job: exit $?"
ps_final=$(grep '^final:' "$work/ps.log")
echo "ps job: $ps_final"
[ "$(crc "$ps_final")" = "$reference" ] || fail "ps job: CRC $(crc "$ps_final"), the all-reduce threads' $reference"

mapfile -t ports < <(free_ports 2)
cluster="{\"worker\": [\"127.0.0.1:${ports[0]}\", \"127.0.0.1:${ports[1]}\"]}"
start() {  # start LOG INDEX FLAGS...: worker INDEX of the 2-worker cluster
  local log=$1 index=$2
  shift 2
  TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"worker\", \"index\": $index}}" \
    "$binary" "$@" >"$work/$log" 2>&1 &
  last_pid=$!
  pids+=("$last_pid")
}

start tcp-0.log 0 "${flags[@]}"; w0=$last_pid
start tcp-1.log 1 "${flags[@]}"; w1=$last_pid
wait "$w0" || fail "tcp: worker 0 exited $?"
wait "$w1" || fail "tcp: worker 1 exited $?"
final=$(grep '^final:' "$work/tcp-0.log")
echo "tcp: $final"
[ "$(crc "$final")" = "$reference" ] || fail "tcp: CRC $(crc "$final"), the threads' $reference"

checkpoints=(--checkpoint-dir "$work/ckpt" --save-checkpoint-steps 100)
start kill-0.log 0 "${flags[@]}" "${checkpoints[@]}"; w0=$last_pid
start kill-1.log 1 "${flags[@]}" "${checkpoints[@]}"; w1=$last_pid
wait_for "$work/kill-0.log" '^epoch  2/10' 120 || fail "kill: the job never reached epoch 2"
kill -9 "$w1"
echo "kill: killed worker 1 after: $(grep '^epoch' "$work/kill-0.log" | tail -1)"
started=$(date +%s)
wait "$w0"; rc=$?
[ "$rc" != 0 ] || fail "kill: worker 0 exited 0 without worker 1"
(($(date +%s) - started <= 20)) || fail "kill: worker 0 took $(($(date +%s) - started)) s to fail"
grep -q 'lost rank 1' "$work/kill-0.log" || fail "kill: worker 0 did not name the lost rank 1"
grep 'lost rank 1' "$work/kill-0.log" | tail -1

start resume-0.log 0 "${flags[@]}" "${checkpoints[@]}"; w0=$last_pid
start resume-1.log 1 "${flags[@]}" "${checkpoints[@]}"; w1=$last_pid
wait "$w0" || fail "resume: worker 0 exited $?"
wait "$w1" || fail "resume: worker 1 exited $?"
grep 'resumed from' "$work/resume-0.log" || fail "resume: the job did not resume from a checkpoint"
final=$(grep '^final:' "$work/resume-0.log")
echo "resume: $final"
[ "$(crc "$final")" = "$reference" ] || fail "resume: CRC $(crc "$final"), the undisturbed job's $reference"
echo "PASS: a ps job, threads, processes and a killed-and-resumed job end at CRC $reference"
