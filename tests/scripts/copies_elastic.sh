#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps leaves or joins a job that keeps a copy of every shard (--ps-replicas 1), and the
# copies move with the membership, with nothing rolled back: sync R = N = 2 Fashion-MNIST,
# real processes on 127.0.0.1 (3 ps, a chief, 2 workers; 2 ps in the third job).
#  1. lost for good: ps 1 is killed with SIGKILL at epoch 2 and never started again. Its
#     copy on ps 2 serves shard 1 at once; 3 s later (--ps-leave-secs 3) the chief takes
#     ps 1 out of the job: one cut from the copies that served, the model placed over ps 0
#     and ps 2 (membership 1), each holding its shard and a copy of the other's (ps 2's
#     copy moves from shard 1 to shard 0). Then ps 0 is killed too: ps 2 serves both
#     shards, shard 0 from the copy that moved to it.
#  2. on purpose: ps 2 gets SIGTERM at epoch 2, asks the chief, and exits 0 once the chief
#     moved its share (ps 0's copy moves from shard 2 to shard 1). Then ps 1 is killed:
#     ps 0 serves both shards.
#  3. joins: on 2 ps, a third ps process starts with --join at epoch 2; the chief takes it
#     in (membership 1: ps tasks {0, 1, 2}): ps 2 holds its shard and a copy of ps 1's,
#     and ps 0's copy moves from shard 1 to shard 2. Then ps 1 is killed: ps 2 serves
#     shard 1 from its copy.
# Every task left exits 0, nothing is rolled back, and each job ends bit for bit where the
# same job ends undisturbed (the parameters' CRC-32C). Prints the membership change and
# how long training stood still while the share moved.
#   tests/scripts/copies_elastic.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
epochs=${EPOCHS:-16}  # room after the leave (3 s of grace, a look every 2 s) for the second kill
source "$(dirname "$0")/common.sh"
flags=(--epochs "$epochs" --ps-replicas 1 --ps-leave-secs 3 --wait-timeout-ms 120000 --recovery-timeout-ms 60000
       --job-name copies-elastic-test)
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1/chief-0.log"; }

# after_change DIR LABEL MEMBERS HOLDER MOVED INDEX PS: every worker followed the job onto MEMBERS
# (membership 1), ps HOLDER took the copy that moved (its log says so), then ps PS (the
# pid at job_pids[INDEX]) is killed for good, and the job must finish
after_change() {
  local dir=$1 label=$2 members=$3 holder=$4 moved=$5 index=$6 ps=$7 who
  for who in worker-0 worker-1; do
    wait_for "$dir/$who.log" "ps tasks are now $members (membership 1" 60 ||
      fail "$label: $who did not follow the job onto $members"
  done
  grep -q "$moved" "$dir/ps-$holder.log" || fail "$label: ps $holder did not log: $moved"
  grep -q '^final:' "$dir/chief-0.log" && fail "$label: training ended before ps $ps could be killed (more --epochs?)"
  ps_pid=${job_pids[$index]}
  kill_ps_for_copy "$dir" "$ps" "$label" worker-0 worker-1 chief-0
  finish_job "$label" 600
}

start_job "$work/plain" "$binary" 3 2 "${flags[@]}"
finish_job "undisturbed" 600
plain=$(crc_of "$work/plain")
[ -n "$plain" ] || fail "the undisturbed job printed no final line"
echo "undisturbed: $(grep -h '^final:' "$work/plain/chief-0.log")"

# ---- 1. ps 1 lost for good ------------------------------------------------------------------
dir=$work/lost
start_job "$dir" "$binary" 3 2 "${flags[@]}"  # ps 0, ps 1, ps 2, worker 0, worker 1, chief
wait_for "$dir/chief-0.log" '^epoch  2/' 300 || fail "lost: the job never reached epoch 2"
ps_pid=${job_pids[1]}
killed_at=$(date +%s.%N)
kill_ps_for_copy "$dir" 1 lost worker-0 worker-1 chief-0
wait_for "$dir/chief-0.log" "ps 1 was lost for 3 s or more (--ps-leave-secs): it left the job" 60 ||
  fail "lost: the chief did not take ps 1 out of the job"
echo "lost: ps 1 left the job $(python3 -c "import time; print(f'{time.time() - $killed_at:.2f}')") s after the kill: $(grep -h -o 'membership 1: .*' "$dir/chief-0.log")"
after_change "$dir" lost "{0, 2}" 2 "ps 2 holds a copy of ps 0's shard from membership 1 on, in place of ps 1's" 0 0

# ---- 2. ps 2 leaves at its request ------------------------------------------------------------
dir=$work/asked
start_job "$dir" "$binary" 3 2 "${flags[@]}"
wait_for "$dir/chief-0.log" '^epoch  2/' 300 || fail "asked: the job never reached epoch 2"
kill -TERM "${job_pids[2]}"
echo "asked: SIGTERM to ps 2 after: $(grep -h '^epoch' "$dir/chief-0.log" | tail -1)"
wait_for "$dir/ps-2.log" "left the job at its request" 120 || fail "asked: ps 2 did not leave"
wait "${job_pids[2]}" || fail "asked: ps 2 exited $? after it left"
forget_task "${job_pids[2]}"
echo "asked: $(grep -h -o 'ps 2 left the job at its request.*' "$dir/chief-0.log")"
after_change "$dir" asked "{0, 1}" 0 "ps 0 holds a copy of ps 1's shard from membership 1 on, in place of ps 2's" 1 1

# ---- 3. ps 2 joins ------------------------------------------------------------------------------
dir=$work/joined
start_job "$dir" "$binary" 2 2 "${flags[@]}"  # ps 0, ps 1, worker 0, worker 1, chief
wait_for "$dir/chief-0.log" '^epoch  2/' 300 || fail "joined: the job never reached epoch 2"
start_joining_ps "$dir" 2 "${flags[@]}"  # job_pids: ps 2, ps 0, ps 1, workers, chief
echo "joined: started ps 2 with --join after: $(grep -h '^epoch' "$dir/chief-0.log" | tail -1)"
wait_for "$dir/chief-0.log" 'ps 2 at 127.0.0.1:[0-9]* joined the job' 60 || fail "joined: the chief did not take ps 2 in"
echo "joined: $(grep -h -o 'ps 2 at .* joined the job.*' "$dir/chief-0.log")"
after_change "$dir" joined "{0, 1, 2}" 0 "ps 0 holds a copy of ps 2's shard from membership 1 on, in place of ps 1's" 2 1

for job in lost asked joined; do
  grep -q 'every ps restored from' "$work/$job/chief-0.log" && fail "$job: the job rolled back"
  echo "$job: $(grep -h '^final:' "$work/$job/chief-0.log")"
  [ "$(crc_of "$work/$job")" = "$plain" ] ||
    fail "$job: the job ended elsewhere ($(crc_of "$work/$job")) than undisturbed ($plain)"
done
echo "PASS: a ps lost for good and a ps that asked to leave each left a job with copies, a ps joined another, a ps was lost after each change, and every job ended bit for bit where the undisturbed one does (parameters' CRC-32C $plain), nothing rolled back"
