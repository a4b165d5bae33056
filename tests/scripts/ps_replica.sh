#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps lost from a job that keeps a copy of every shard (--ps-replicas 1), started again and
# taken back, then the other ps lost: sync R = N = 2 Fashion-MNIST, real processes on
# 127.0.0.1 (2 ps, a chief, 2 workers).
#  1. ps 0 (the one that paces the workers) is killed with SIGKILL mid-training: its copy
#     on ps 1 takes over, and every task turns to it.
#  2. ps 0 is started again on its address: the chief takes it back (its shard and its copy
#     of ps 1's, restored from a cut of the copies that served meanwhile), and every task
#     writes to both copies of each shard again.
#  3. ps 1 is killed with SIGKILL and never started again: ps 0 serves both shards.
# Nothing is rolled back, every task left exits 0, and the job ends bit for bit where the
# same job ends unbroken (the same parameters' CRC-32C) and where it ends without copies.
# Prints how long the tasks took to turn to the copy, how long after its start ps 0 was
# taken back, and how long training stood still while it took its shards back.
#   tests/scripts/ps_replica.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
epochs=${EPOCHS:-12}  # room after the take-back (about 3 s) for the second kill, on a host twice as fast as ours
source "$(dirname "$0")/common.sh"
flags=(--epochs "$epochs" --wait-timeout-ms 120000 --recovery-timeout-ms 60000)

run_job() {  # run_job NAME REPLICAS KILL: one job in $work/NAME; KILL=1: steps 1-3 above
  local dir=$work/$1 replicas=$2 kill=$3
  start_job "$dir" "$binary" 2 2 "${flags[@]}" --ps-replicas "$replicas"
  if [ "$kill" = 1 ]; then
    local ps_pid=${job_pids[0]} killed_at who
    wait_for "$dir/chief-0.log" '^epoch  2/' 300 || fail "$1: the job never reached epoch 2"
    killed_at=$(date +%s.%N)
    kill_ps_for_copy "$dir" 0 "$1" worker-0 worker-1 chief-0
    echo "$1: every task reads ps 0's shard from its copy $(python3 -c "import time; print(f'{time.time() - $killed_at:.2f}')") s after the kill"
    local started_at
    started_at=$(date +%s.%N)
    start_task "$dir" ps 0 ps-0-again.log "${flags[@]}" --ps-replicas "$replicas"
    job_pids=("$last_pid" "${job_pids[@]}")  # ps 0 again, ps 1, workers, chief
    wait_for "$dir/chief-0.log" "ps 0 was started again and took its shards back" 120 ||
      fail "$1: the chief did not take ps 0 back"
    for who in worker-0 worker-1 chief-0; do
      wait_for "$dir/$who.log" "ps 0's shard is served by two copies again" 60 ||
        fail "$1: $who does not write to ps 0's new process"
    done
    echo "$1: taken back $(python3 -c "import time; print(f'{time.time() - $started_at:.2f}')") s after ps 0 was started again, every task writing to it: $(grep -h -o 'ps 0 was started again.*' "$dir/chief-0.log")"
    grep -q '^final:' "$dir/chief-0.log" && fail "$1: training ended before ps 1 could be killed (more --epochs?)"
    ps_pid=${job_pids[1]}
    kill_ps_for_copy "$dir" 1 "$1" worker-0 worker-1 chief-0
  fi
  finish_job "$1" 600
}

run_job plain 0 0
run_job copies 1 0
run_job killed 1 1

grep -q 'every ps restored from' "$work"/killed/chief-0.log && fail "the killed job rolled back"
grep -h "dropping the copy" "$work"/killed/*.log | sed 's/^/killed: /'
# Each task says each change of the copies once, though a worker reaches the ps tasks
# through two transports (its training and its heartbeats).
for who in worker-0 worker-1 chief-0; do
  for line in "dropping the copy of ps 1's shard held by ps 1 " "ps 0's shard is served by two copies again"; do
    n=$(grep -c -F "$line" "$work/killed/$who.log")
    [ "$n" = 1 ] || fail "killed: $who logged \"$line\" $n times, where it happened once"
  done
done
final_of() { sed -n 's/^final: \(.*\)/\1/p' "$1/chief-0.log"; }
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1/chief-0.log"; }
for job in plain copies killed; do echo "$job: $(final_of "$work/$job")"; done
plain=$(crc_of "$work/plain") copies=$(crc_of "$work/copies") killed=$(crc_of "$work/killed")
[ -n "$plain" ] && [ "$plain" = "$copies" ] || fail "with copies the job ended elsewhere ($copies) than without ($plain)"
[ "$killed" = "$copies" ] || fail "with ps 0 killed, taken back and ps 1 killed the job ended elsewhere ($killed) than unbroken ($copies)"
echo "PASS: ps 0 killed at epoch 2 of $epochs, started again and taken back, then ps 1 killed: the job ended bit for bit where the unbroken one does (parameters' CRC-32C $killed)"
