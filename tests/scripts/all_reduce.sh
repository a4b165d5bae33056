#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Fashion-MNIST with --mode allreduce (no ps tasks: a ring all-reduce among the workers):
#   1. in-process, 2 worker threads: reaches the accuracy goal, ends on 0 ps tasks, and on
#      the parameters the same job on 2 ps tasks (sync R = N = 2) ends on, bit for bit;
#   2. 2 worker processes over TCP (a cluster of workers only): ends bit for bit where the
#      threads end (the same parameters' CRC-32C: the ring adds in the same order);
#      the same job watched: its workers' figures, rank 0's progress line, an evaluator;
#   3. the failure rules, 3 worker processes: worker 1 killed (SIGKILL) mid-training, the
#      others form the ring again and go on; worker 1 started again with --join is taken
#      back in; then worker 0 (rank 0, which evaluates and checkpoints) killed, and another
#      takes its rank and its chief's work; the job ends, on its accuracy goal; and a
#      worker stopped (SIGSTOP) past the timeout is left out, and taken back once continued;
#   4. every worker killed after epoch 2: the job started again resumes from the newest
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
grep -q "its cluster has ps tasks" "$work/refused.log" || fail "refused: no reason given"

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
start_in() {  # start_in CLUSTER LOG INDEX FLAGS...: worker INDEX of CLUSTER (its JSON)
  local in=$1 log=$2 index=$3
  shift 3
  TF_CONFIG="{\"cluster\": $in, \"task\": {\"type\": \"worker\", \"index\": $index}}" \
    "$binary" "$@" >"$work/$log" 2>&1 &
  last_pid=$!
  pids+=("$last_pid")
}
start() { start_in "$cluster" "$@"; }  # start LOG INDEX FLAGS...: of the 2-worker cluster

start tcp-0.log 0 "${flags[@]}"; w0=$last_pid
start tcp-1.log 1 "${flags[@]}"; w1=$last_pid
wait "$w0" || fail "tcp: worker 0 exited $?"
wait "$w1" || fail "tcp: worker 1 exited $?"
final=$(grep '^final:' "$work/tcp-0.log")
echo "tcp: $final"
[ "$(crc "$final")" = "$reference" ] || fail "tcp: CRC $(crc "$final"), the threads' $reference"

# A job watched: each worker's figures (--metrics-file), rank 0's progress line, and an
# evaluator task (beside the workers, no ps) scoring the checkpoints worker 0 writes.
mapfile -t portsw < <(free_ports 3)
clusterw="{\"worker\": [\"127.0.0.1:${portsw[0]}\", \"127.0.0.1:${portsw[1]}\"], \"evaluator\": [\"127.0.0.1:${portsw[2]}\"]}"
# (10 epochs: 3 s or more here, so that a progress line falls within even on a faster host)
watched=(--mode allreduce --epochs 10 --checkpoint-dir "$work/watched" --save-checkpoint-steps 1200
  --metrics-file "$work/metrics-{task}.jsonl" --metrics-interval-ms 200 --progress-secs 1)
start_in "$clusterw" watch-0.log 0 "${watched[@]}"; w0=$last_pid
start_in "$clusterw" watch-1.log 1 "${watched[@]}"; w1=$last_pid
TF_CONFIG="{\"cluster\": $clusterw, \"task\": {\"type\": \"evaluator\", \"index\": 0}}" \
  "$binary" "${watched[@]}" >"$work/watch-evaluator.log" 2>&1 &
we=$!
pids+=("$we")
for pid in "$w0" "$w1" "$we"; do wait "$pid" || fail "watched: a task exited $?"; done
grep -Eq 'all-reduce: global step [0-9]+ of 4680 \(epoch [0-9]+ of 10\), [0-9]+ examples/s' "$work/watch-0.log" ||
  fail "watched: no progress line"
grep 'all-reduce: global step' "$work/watch-0.log" | tail -1
grep -q '^evaluation at step 4680: ' "$work/watch-evaluator.log" || fail "watched: the evaluator did not score the last checkpoint"
grep '^evaluation at step' "$work/watch-evaluator.log" | tail -1
for w in 0 1; do
  figures=$(tail -1 "$work/metrics-worker-$w.jsonl")
  for figure in '"ring_workers": *2' '"bytes_sent": *[1-9]' '"global_step": *[1-9]' '"loss": *[0-9]'; do
    grep -q "$figure" <<<"$figures" || fail "watched: worker $w's figures lack $figure: $figures"
  done
done
grep -q '"test_accuracy": *0\.[0-9]' "$work/metrics-worker-0.jsonl" || fail "watched: worker 0 recorded no evaluation"
echo "watched: $(tail -1 "$work/metrics-worker-1.jsonl")"

# 3. Workers lost and taken in while the job runs.
mapfile -t ports3 < <(free_ports 3)
cluster3="{\"worker\": [\"127.0.0.1:${ports3[0]}\", \"127.0.0.1:${ports3[1]}\", \"127.0.0.1:${ports3[2]}\"]}"
# 12 epochs: room for every kill, join and stop below. A job that lost workers reads fewer
# examples a step, and its last evaluations swing: 0.868-0.883 over epochs 8-12 of one
# run, and at 24 epochs one run ended at 0.8733 after 0.8874 the epoch before. So these
# jobs are held to 0.86, not the undisturbed goal of 0.875: they must go on learning.
start3() {  # start3 LOG INDEX FLAGS...: worker INDEX of the 3-worker cluster, 12 epochs
  local log=$1 index=$2
  shift 2
  start_in "$cluster3" "$log" "$index" --mode allreduce --epochs 12 --job-name elastic-ring \
    --checkpoint-dir "$work/$ring_dir" --save-checkpoint-steps 200 "$@"
}
ring_dir=elastic
start3 elastic-0.log 0; e0=$last_pid
start3 elastic-1.log 1; e1=$last_pid
start3 elastic-2.log 2; e2=$last_pid
wait_for "$work/elastic-0.log" '^epoch  2/' 120 || fail "elastic: the job never reached epoch 2"
kill -9 "$e1"
echo "elastic: killed worker 1 after: $(grep '^epoch' "$work/elastic-0.log" | tail -1)"
wait_for "$work/elastic-0.log" 'generation [0-9]* of 2 workers' 30 || fail "elastic: the ring was not formed again without worker 1"
grep -h 'generation [0-9]* of 2' "$work/elastic-0.log"
start3 elastic-1-join.log 1 --join; e1=$last_pid
wait_for "$work/elastic-0.log" 'generation [0-9]* of 3 workers' 60 || fail "elastic: worker 1 was not taken back in"
grep -h 'generation [0-9]* of 3' "$work/elastic-0.log"
# (waited for: the joiner may write its line a moment after rank 0 writes its own)
wait_for "$work/elastic-1-join.log" 'rank 2 of 3 (ring generation [0-9]*) goes on' 30 ||
  fail "elastic: the joiner did not go on as rank 2"
wait_for "$work/elastic-0.log" "^epoch *$(( $(grep -c '^epoch' "$work/elastic-0.log") + 1 ))/" 60 ||
  fail "elastic: no epoch ended after worker 1 came back"
kill -9 "$e0"
echo "elastic: killed worker 0 (rank 0) after: $(grep '^epoch' "$work/elastic-0.log" | tail -1)"
wait "$e2" || fail "elastic: worker 2 exited $?"
wait "$e1" || fail "elastic: worker 1 (joined) exited $?"
grep -q 'generation [0-9]* of 2 workers' "$work/elastic-2.log" || fail "elastic: worker 2 did not form the ring again without worker 0"
grep -h 'generation [0-9]* of 2' "$work/elastic-2.log"
mkdir -p "$work/elastic-job" && cp "$work/elastic-2.log" "$work/elastic-job/chief-0.log"
check_final "$work/elastic-job" elastic 0 0.86
grep -q ' workers=2 ' <<<"$final" || fail "elastic: the job did not end on 2 workers"
ls "$work/elastic"/* >/dev/null 2>&1 || fail "elastic: no checkpoint written"

# A worker stopped (SIGSTOP) for longer than the timeout is left out; continued, it finds
# its ring gone and checks in, and is taken back in.
ring_dir=stopped
start3 stop-0.log 0 --request-timeout-ms 4000; e0=$last_pid
start3 stop-1.log 1 --request-timeout-ms 4000; e1=$last_pid
start3 stop-2.log 2 --request-timeout-ms 4000; e2=$last_pid
wait_for "$work/stop-0.log" '^epoch  2/' 120 || fail "stop: the job never reached epoch 2"
kill -STOP "$e2"
echo "stop: stopped worker 2 after: $(grep '^epoch' "$work/stop-0.log" | tail -1)"
wait_for "$work/stop-0.log" 'generation [0-9]* of 2 workers' 30 || fail "stop: the ring was not formed again without worker 2"
grep -h 'leaves out\|generation 1 of 2' "$work/stop-0.log"
kill -CONT "$e2"
wait_for "$work/stop-0.log" 'generation [0-9]* of 3 workers' 60 || fail "stop: worker 2 was not taken back in"
wait_for "$work/stop-2.log" 'ring generation [0-9]*) goes on' 30 || fail "stop: worker 2 did not go on in a new ring"
grep -h 'generation [0-9]* of 3' "$work/stop-0.log"
for pid in "$e0" "$e1" "$e2"; do wait "$pid" || fail "stop: a worker exited $?"; done
# Worker 0 stays rank 0 unless a stall under load made the others leave it out for a while.
mkdir -p "$work/stop-job" && grep -l '^final:' "$work"/stop-*.log | head -1 | xargs -I{} cp {} "$work/stop-job/chief-0.log"
check_final "$work/stop-job" stop 0 0.86
grep -q ' workers=3 ' <<<"$final" || fail "stop: the job did not end on 3 workers"

# 4. The whole job killed, and started again: it resumes from its newest checkpoint.
checkpoints=(--checkpoint-dir "$work/ckpt" --save-checkpoint-steps 100)
start kill-0.log 0 "${flags[@]}" "${checkpoints[@]}"; w0=$last_pid
start kill-1.log 1 "${flags[@]}" "${checkpoints[@]}"; w1=$last_pid
wait_for "$work/kill-0.log" '^epoch  2/10' 120 || fail "kill: the job never reached epoch 2"
kill -9 "$w0" "$w1"
echo "kill: killed both workers after: $(grep '^epoch' "$work/kill-0.log" | tail -1)"
wait "$w0" "$w1"

start resume-0.log 0 "${flags[@]}" "${checkpoints[@]}"; w0=$last_pid
start resume-1.log 1 "${flags[@]}" "${checkpoints[@]}"; w1=$last_pid
wait "$w0" || fail "resume: worker 0 exited $?"
wait "$w1" || fail "resume: worker 1 exited $?"
grep 'resumed from' "$work/resume-0.log" || fail "resume: the job did not resume from a checkpoint"
final=$(grep '^final:' "$work/resume-0.log")
echo "resume: $final"
[ "$(crc "$final")" = "$reference" ] || fail "resume: CRC $(crc "$final"), the undisturbed job's $reference"
echo "PASS: a ps job, threads, processes and a killed-and-resumed job end at CRC $reference; workers lost and joined mid-job"
