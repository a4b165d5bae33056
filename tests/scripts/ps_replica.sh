#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps lost from a job that keeps a copy of every shard (--ps-replicas 1): sync R = N = 2
# Fashion-MNIST, real processes on 127.0.0.1 (2 ps, a chief, 2 workers). ps 0 (the one that
# paces the workers) is killed with SIGKILL mid-training and never started again: its copy
# on ps 1 takes over, nothing is rolled back, every task left exits 0, and the job ends bit
# for bit where the same job ends unbroken (the same parameters' CRC-32C) and where it ends
# without copies. Prints how long the tasks took to turn to the copy.
#   tests/scripts/ps_replica.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
epochs=${EPOCHS:-6}
source "$(dirname "$0")/common.sh"
flags=(--epochs "$epochs" --wait-timeout-ms 120000 --recovery-timeout-ms 60000)

run_job() {  # run_job NAME REPLICAS KILL: one job in $work/NAME; KILL=1 kills ps 0 at epoch 2
  local dir=$work/$1 replicas=$2 kill=$3
  start_job "$dir" "$binary" 2 2 "${flags[@]}" --ps-replicas "$replicas"
  if [ "$kill" = 1 ]; then
    local ps_pid=${job_pids[0]} killed_at
    wait_for "$dir/chief-0.log" '^epoch  2/' 300 || fail "$1: the job never reached epoch 2"
    killed_at=$(date +%s.%N)
    kill_ps_for_copy "$dir" 0 "$1" worker-0 worker-1 chief-0
    echo "$1: every task reads ps 0's shard from its copy $(python3 -c "import time; print(f'{time.time() - $killed_at:.2f}')") s after the kill"
  fi
  finish_job "$1" 600
}

run_job plain 0 0
run_job copies 1 0
run_job killed 1 1

grep -q -i 'restored\|rolled back' "$work"/killed/*.log && fail "the killed job rolled back"
grep -h "dropping the copy" "$work"/killed/*.log | sed 's/^/killed: /'
final_of() { sed -n 's/^final: \(.*\)/\1/p' "$1/chief-0.log"; }
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1/chief-0.log"; }
for job in plain copies killed; do echo "$job: $(final_of "$work/$job")"; done
plain=$(crc_of "$work/plain") copies=$(crc_of "$work/copies") killed=$(crc_of "$work/killed")
[ -n "$plain" ] && [ "$plain" = "$copies" ] || fail "with copies the job ended elsewhere ($copies) than without ($plain)"
[ "$killed" = "$copies" ] || fail "with ps 0 killed the job ended elsewhere ($killed) than unbroken ($copies)"
echo "PASS: ps 0 killed at epoch 2 of $epochs: the job ended bit for bit where the unbroken one does (parameters' CRC-32C $killed)"
