#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps added to a running job (--join): real processes on 127.0.0.1, a chief, 2 workers,
# sync R = N, every task named by --job-name.
#  1. Fashion-MNIST on 2 ps: at about epoch 3 a third ps process starts with --join and a
#     cluster spec that lists it after the two; it asks the chief (at the chief's address)
#     to join, the chief pauses every ps at one cut, registers the model over 3 ps tasks
#     (membership 1: {0, 1, 2}) and restores them from the cut, the workers follow, and the
#     job finishes on 3 ps at test accuracy >= 0.875, every task exiting 0, bit for bit
#     where the same job on 2 ps ends (the parameters' CRC-32C): nothing is lost.
#  2. (with a CTR binary) the same with embedding tables, 2 ps -> 3: rows move to the new
#     ps, and the job ends at its AUC goal.
# Prints the membership change and the pause the chief measured.
#   tests/scripts/ps_join.sh FASHION_MNIST_BINARY [CTR_BINARY CTR_DATA_DIR]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
binary=$1
ctr=${2:-}
ctr_data=${3:-}

# join_ps_after JOB_DIR PATTERN SECONDS FLAGS...: a third ps, listed after the job's two
# in its own cluster spec, started with --join once the chief logs PATTERN
join_ps_after() {
  local dir=$1 pattern=$2 seconds=$3
  shift 3
  wait_for "$dir/chief-0.log" "$pattern" "$seconds" || fail "$dir: the chief never logged '$pattern'"
  start_joining_ps "$dir" 2 "$@"
  echo "started ps 2 with --join after: $(grep -h '^epoch\|checkpoint at' "$dir/chief-0.log" | tail -1)"
}

# report JOB_DIR: what the chief, the ps tasks and the workers said of the change; each
# worker must have followed the job onto three ps tasks
report() {
  grep -h 'joined the job\|asked the chief\|ps tasks are now\|updates lost' "$1"/*.log | sed 's/^[^:]*: //' | sort | uniq -c
  grep -q 'ps 2 at 127.0.0.1:[0-9]* joined the job; membership 1: ps tasks {0, 1, 2}' "$1/chief-0.log" ||
    fail "$1: the chief did not take ps 2 in"
  for w in 0 1; do
    grep -q "ps tasks are now {0, 1, 2} (membership 1" "$1/worker-$w.log" || fail "$1: worker $w did not follow"
  done
  grep -h 'joined the job' "$1/chief-0.log" | sed 's/.*holding/chief: holding/'
}

crc_of() { sed -n 's/.*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }

# ---- 1. Fashion-MNIST, 2 ps -> 3 ----------------------------------------------------------
flags=(--epochs 10 --job-name ps-join-test --recovery-timeout-ms 60000)
start_job "$work/plain" "$binary" 2 2 "${flags[@]}"
finish_job "fashion_mnist undisturbed" 240
plain=$(crc_of "$work/plain/chief-0.log")
[ -n "$plain" ] || fail "the undisturbed job printed no final line"
# Every task serves its figures (--metrics-port): ps 0, ps 1, the chief, worker 0 and 1 on
# base + 0 .. 4. The ps that joins must not take base + 2, the chief's (its own spec counts
# 3 ps), but a port the system picks.
base=$(free_port_run 5)
[ -n "$base" ] || fail "found no 5 consecutive free ports"
start_job "$work/mnist" "$binary" 2 2 "${flags[@]}" --metrics-port "$base"
grep -q "may join job 'ps-join-test'" "$work/mnist/chief-0.log" 2>/dev/null ||
  wait_for "$work/mnist/chief-0.log" "may join job" 30 || fail "the chief does not take joins"
join_ps_after "$work/mnist" '^epoch  3/10' 180 "${flags[@]}" --metrics-port "$base"
wait_for "$work/mnist/ps-2.log" 'takes a port the system picks' 30 ||
  fail "the ps that joined did not serve its figures on a port of its own: $(head -c 600 "$work/mnist/ps-2.log")"
grep -q "metrics: http://127.0.0.1:$((base + 2))/metrics" "$work/mnist/chief-0.log" ||
  fail "the chief does not serve on base + 2"
wait_for "$work/mnist/chief-0.log" 'joined the job' 60 || fail "the chief did not take ps 2 in"
finish_job "fashion_mnist 2 ps -> 3" 240
report "$work/mnist"
check_final "$work/mnist" "fashion_mnist 2 ps -> 3" 3
[ "$(crc_of "$work/mnist/chief-0.log")" = "$plain" ] ||
  fail "the parameters differ from the undisturbed job's (CRC-32C $plain)"
echo "fashion_mnist: the parameters' CRC-32C $plain equals the undisturbed 2-ps job's"

# ---- 2. CTR with tables, 2 ps -> 3 ---------------------------------------------------------
if [ -n "$ctr" ]; then
  flags=(--train-examples 400000 --test-examples 20000 --vocabulary 20000 --batch 64 --job-name ps-join-ctr
         --checkpoint-dir "$work/ctr/ckpt" --save-checkpoint-steps 300 --recovery-timeout-ms 60000
         --data-dir "$ctr_data")
  start_job "$work/ctr" "$ctr" 2 2 "${flags[@]}"
  join_ps_after "$work/ctr" 'checkpoint at global step [6-9][0-9][0-9]:' 180 "${flags[@]}"
  wait_for "$work/ctr/chief-0.log" 'joined the job' 60 || fail "ctr: the chief did not take ps 2 in"
  finish_job "ctr 2 ps -> 3" 240
  report "$work/ctr"
  grep -h 'rows of the embedding tables restored' "$work/ctr"/ps-*.log
  check_final "$work/ctr" "ctr 2 ps -> 3" 3
fi
echo PASS
