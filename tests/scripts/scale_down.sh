#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A running job scaled down by the operator: SIGTERM asks a ps task or a worker to leave,
# and the chief takes it out with nothing trained lost. Real processes on 127.0.0.1,
# Fashion-MNIST, a chief, sync R = N, every task named by --job-name.
#  1. 3 ps, 2 workers, 10 epochs: at about epoch 2 ps 1 gets SIGTERM. It asks the chief, which pauses
#     every ps at one cut, registers the model over ps {0, 2} (membership 1) and restores
#     them from the cut; ps 1 then exits 0, the workers follow, and the job ends bit for
#     bit where the same job on 3 ps ends (the parameters' CRC-32C).
#  2. 2 ps, 3 workers: at about epoch 2 worker 1 gets SIGTERM. The chief takes it out of
#     the job's workers (every ps counts {0, 2} from the next step), its next token request
#     is refused and it exits 0; the others finish at test accuracy >= 0.86 (15 epochs of
#     the 3-worker schedule). Not 0.875: where the leave lands depends on the host's pace,
#     and at Adam's constant rate the last evaluations of this job swing 0.870-0.885 (a
#     fresh-clone CI read 0.8749 after readings of 0.8845 three epochs before; runs here
#     0.8814-0.8844). The test checks the leave, not the optimizer, as the all-reduce
#     scripts and ps_restart_joined hold their disturbed jobs to 0.86.
# Every task exits 0. Prints the changes as the chief and the ps tasks logged them.
#   tests/scripts/scale_down.sh FASHION_MNIST_BINARY
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
binary=$1
flags=(--job-name scale-down-test --recovery-timeout-ms 60000)
crc_of() { sed -n 's/.*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }

# term_after JOB_DIR PID WHO: SIGTERM to PID once the chief logs epoch 2
term_after() {
  wait_for "$1/chief-0.log" '^epoch  2/' 240 || fail "$1: the job never reached epoch 2"
  kill -TERM "$2"
  echo "SIGTERM to $3 after: $(grep -h '^epoch' "$1/chief-0.log" | tail -1)"
}

# ---- 1. a ps leaves: 3 ps -> 2 ---------------------------------------------------------------
start_job "$work/plain" "$binary" 3 2 "${flags[@]}" --epochs 10
finish_job "fashion_mnist on 3 ps" 240
plain=$(crc_of "$work/plain/chief-0.log")
[ -n "$plain" ] || fail "the job on 3 ps printed no final line"

dir=$work/ps
start_job "$dir" "$binary" 3 2 "${flags[@]}" --epochs 10
term_after "$dir" "${job_pids[1]}" "ps 1"  # ps 0, ps 1, ps 2, worker 0, worker 1, chief
wait_for "$dir/ps-1.log" "left the job at its request" 120 || fail "ps 1 did not leave"
finish_job "fashion_mnist 3 ps -> 2" 240  # ps 1 included: it exited 0
grep -h "ps 1 left the job at its request" "$dir/chief-0.log" | sed 's/^[^:]*: //'
grep -q "ps 1 left the job at its request; membership 1: ps tasks {0, 2}" "$dir/chief-0.log" ||
  fail "the chief did not take ps 1 out"
for w in 0 1; do
  grep -q "ps tasks are now {0, 2} (membership 1" "$dir/worker-$w.log" || fail "worker $w did not follow"
done
grep -h "SIGTERM\|left the job" "$dir/ps-1.log" | sed 's/^[^:]*: //'
check_final "$dir" "fashion_mnist 3 ps -> 2" 2
left=$(crc_of "$dir/chief-0.log")
[ "$left" = "$plain" ] || fail "with ps 1 gone the job ended elsewhere ($left) than on 3 ps ($plain)"
echo "ps 1 left: the job ended bit for bit where it ends on 3 ps (parameters' CRC-32C $left)"

# ---- 2. a worker leaves: 3 workers -> 2 ------------------------------------------------------
dir=$work/worker
# 15 epochs of the 3-worker schedule: after the leave a step reads 2 batches, not 3.
start_job "$dir" "$binary" 2 3 "${flags[@]}" --epochs 15
term_after "$dir" "${job_pids[3]}" "worker 1"  # ps 0, ps 1, worker 0, worker 1, worker 2, chief
wait_for "$dir/worker-1.log" "left the job at its request" 120 || fail "worker 1 did not leave"
finish_job "fashion_mnist 3 workers -> 2" 240  # worker 1 included: it exited 0
grep -q "worker 1 left at its request; the job's workers are {0, 2}" "$dir/chief-0.log" ||
  fail "the chief did not take worker 1 out"
for ps in 0 1; do
  grep -q "the job's workers are {0, 2} from global step" "$dir/ps-$ps.log" || fail "ps $ps never let worker 1 go"
done
grep -h "worker 1 left" "$dir/chief-0.log" | sed 's/^[^:]*: //'
grep -h "left the job" "$dir/worker-1.log" | sed 's/^[^:]*: //'
check_final "$dir" "fashion_mnist 3 workers -> 2" 2 0.86
echo PASS
