#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps lost for good, and the job goes on without it (--ps-leave-secs): real processes on
# 127.0.0.1, a chief, 2 workers, sync R = N, checkpoints every 200 global steps.
#  1. Fashion-MNIST on 3 ps: ps 1 is killed (SIGKILL) at about epoch 3 and never comes
#     back; after 3 s the chief takes it out of the job (membership 1: ps tasks {0, 2}),
#     its parts are placed on ps 0 and ps 2 from the newest checkpoint, the workers follow,
#     and the job finishes at test accuracy >= 0.875 with every task left exiting 0, and
#     bit for bit where the same job undisturbed ends (the parameters' CRC-32C): sync R = N
#     with numbered batches replays the steps since the checkpoint exactly.
#  2. (with a CTR binary) the same with embedding tables, 3 ps -> 2: the rows of the lost
#     ps come back on the others from the checkpoint, and the job ends at its AUC goal.
# Prints the membership change, the steps lost and the time from the kill to training again.
#   tests/scripts/ps_leave.sh FASHION_MNIST_BINARY [CTR_BINARY CTR_DATA_DIR]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
binary=$1
ctr=${2:-}
ctr_data=${3:-}

# kill_ps_after JOB_DIR PATTERN SECONDS: ps 1 of the job killed once the chief logs PATTERN
kill_ps_after() {
  wait_for "$1/chief-0.log" "$2" "$3" || fail "$1: the chief never logged '$2'"
  kill -9 "${job_pids[1]}"
  killed_at=$(date +%s.%N)
  forget_task "${job_pids[1]}"
  echo "killed ps 1 after: $(grep -h '^epoch\|checkpoint at' "$1/chief-0.log" | tail -1)"
}

# report JOB_DIR: what the chief, the ps tasks and the workers said of the change; each
# worker must have followed the job onto ps 0 and ps 2
report() {
  grep -h 'leaves the job\|every ps restored\|updates lost\|ps tasks are now' "$1"/*.log | sed 's/^[^:]*: //' | sort | uniq -c
  grep -q 'ps 1 not back within 3 s: it leaves the job; membership 1: ps tasks {0, 2}' "$1/chief-0.log" ||
    fail "$1: the chief did not take ps 1 out of the job"
  for w in 0 1; do
    grep -q "ps tasks are now {0, 2} (membership 1" "$1/worker-$w.log" || fail "$1: worker $w did not follow"
  done
}

# since WHEN: seconds from the epoch time WHEN to now
since() { python3 -c "import sys, time; print('%.1f' % (time.time() - float(sys.argv[1])))" "$1"; }

crc_of() { sed -n 's/.*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }

# ---- 1. Fashion-MNIST, 3 ps -> 2 ----------------------------------------------------------
flags=(--epochs 10 --save-checkpoint-steps 200 --recovery-timeout-ms 60000 --ps-leave-secs 3)
start_job "$work/plain" "$binary" 3 2 "${flags[@]}" --checkpoint-dir "$work/plain/ckpt"
finish_job "fashion_mnist undisturbed" 240
plain=$(crc_of "$work/plain/chief-0.log")
[ -n "$plain" ] || fail "the undisturbed job printed no final line"
start_job "$work/mnist" "$binary" 3 2 "${flags[@]}" --checkpoint-dir "$work/mnist/ckpt"
kill_ps_after "$work/mnist" '^epoch  3/10' 180
wait_for "$work/mnist/chief-0.log" 'every ps restored from' 60 || fail "the chief did not restore ps 0 and ps 2"
echo "fashion_mnist: ps 0 and ps 2 restored $(since "$killed_at") s after the kill (3 s of it the leave grace)"
finish_job "fashion_mnist 3 ps -> 2" 240
report "$work/mnist"
check_final "$work/mnist" "fashion_mnist 3 ps -> 2" 2
[ "$(crc_of "$work/mnist/chief-0.log")" = "$plain" ] ||
  fail "the parameters differ from the undisturbed job's (CRC-32C $plain)"
echo "fashion_mnist: the parameters' CRC-32C $plain equals the undisturbed 3-ps job's"

# ---- 2. CTR with tables, 3 ps -> 2 ---------------------------------------------------------
if [ -n "$ctr" ]; then
  flags=(--train-examples 400000 --test-examples 20000 --vocabulary 20000 --batch 64
         --checkpoint-dir "$work/ctr/ckpt" --save-checkpoint-steps 300 --recovery-timeout-ms 60000
         --ps-leave-secs 3 --data-dir "$ctr_data")
  start_job "$work/ctr" "$ctr" 3 2 "${flags[@]}"
  kill_ps_after "$work/ctr" 'checkpoint at global step [6-9][0-9][0-9]:' 180
  wait_for "$work/ctr/chief-0.log" 'every ps restored from' 60 || fail "ctr: the chief did not restore"
  echo "ctr: ps 0 and ps 2 restored $(since "$killed_at") s after the kill (3 s of it the leave grace)"
  finish_job "ctr 3 ps -> 2" 240
  report "$work/ctr"
  grep -h 'rows of the embedding tables restored' "$work/ctr"/ps-*.log
  check_final "$work/ctr" "ctr 3 ps -> 2" 2
fi
echo PASS
