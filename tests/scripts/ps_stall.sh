#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps that stalls blames nobody: a sync R = N job of real processes on 127.0.0.1 (2 ps, a
# chief, 2 workers), where ps 1 is stopped (SIGSTOP) for three worker timeouts after the
# first epoch and then continued. It must hold no worker lost (its own silence is not
# theirs), every ps must take the same pushes, and the job must end exactly where the same
# job without the stop ends: the same test loss and accuracy at every epoch.
# With REPLICAS=1 the job keeps a copy of every shard (--ps-replicas 1): the stopped ps is
# not given up (its stop is shorter than the copy timeout). With STOP=chief the chief is
# stopped instead: with copies every ps serves no task once its lease on the chief ran
# out, and all go on when it continues; an evaluation the stopped chief makes late, at a
# later step than it was due, is not compared. With STOP=ps1-past (copies) ps 1 is stopped
# past the copy timeout (2 s here), until the chief scores an epoch more (12 epochs): a
# process stopped or hung keeps its connections open, yet the tasks must find it silent,
# the chief must rule it lost, and training must go on from the copies while it is
# stopped; once continued, the chief tells it to start again empty and takes it back (every
# shard has two copies again), and it exits 0 with the others.
#   [REPLICAS=0|1] [STOP=ps1|chief|ps1-past] tests/scripts/ps_stall.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
epochs=6
timeout_ms=1500
stop_s=5
replicas=${REPLICAS:-0}
stop_task=${STOP:-ps1}
source "$(dirname "$0")/common.sh"
flags=(--epochs "$epochs" --worker-timeout-ms "$timeout_ms" --heartbeat-interval-ms 250
       --wait-timeout-ms 120000 --ps-replicas "$replicas")
past=0
if [ "$stop_task" = ps1-past ]; then
  [ "$replicas" = 1 ] || fail "STOP=ps1-past needs REPLICAS=1"
  past=1 stop_task=ps1 epochs=12
  flags=(--epochs "$epochs" "${flags[@]:2}" --copy-timeout-ms 2000)
fi

run_job() {  # run_job NAME STOP: one job in $work/NAME; STOP=1 stops ps 1 (or the chief) after epoch 1
  local dir=$work/$1 stop=$2
  start_job "$dir" "$binary" 2 2 "${flags[@]}"
  local stopped=${job_pids[1]}
  [ "$stop_task" = chief ] && stopped=${job_pids[4]}
  if [ "$stop" = 1 ]; then
    wait_for "$dir/chief-0.log" '^epoch  1/' 120 || fail "$1: the job never reached epoch 1"
    kill -STOP "$stopped"
    echo "$1: stopped $stop_task (copies: $replicas) after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    if [ "$past" = 1 ]; then  # until an epoch more is scored, while it is stopped (60 s at most)
      local scored began=$SECONDS
      scored=$(grep -c '^epoch' "$dir/chief-0.log")
      for _ in $(seq 1 600); do
        [ "$(grep -c '^epoch' "$dir/chief-0.log")" -gt "$scored" ] && break
        sleep 0.1
      done
      stop_scored=$(($(grep -c '^epoch' "$dir/chief-0.log") - scored)) stop_s=$((SECONDS - began))
    else
      sleep "$stop_s"
    fi
    kill -CONT "$stopped"
    if [ "$past" = 1 ]; then  # how long until the chief took it back (60 s at most)
      local continued
      continued=$(date +%s%N)
      wait_for "$dir/chief-0.log" 'ps 1 was started again and took its shards back' 60 &&
        back_ms=$((($(date +%s%N) - continued) / 1000000))
    fi
  fi
  finish_job "$1" 180
}

run_job clean 0
run_job stalled 1

grep -h -E 'worker:[0-9]+ lost|is back|disconnected|chief|dropping' "$work"/stalled/*.log | sed 's/^/stalled: /' | head -20
grep -q -E 'worker:[0-9]+ lost' "$work"/stalled/ps-*.log && fail "a ps held a worker lost for a stall not the worker's"
if [ "$past" = 1 ]; then
  for task in chief-0 worker-0 worker-1; do
    grep -q "dropping the copy of ps 1's shard held by ps 1" "$work/stalled/$task.log" ||
      fail "$task did not give up ps 1's process, stopped for $stop_s s past the copy timeout"
  done
  [ "$stop_scored" -ge 1 ] || fail "training stood still while ps 1 was stopped (no epoch scored in $stop_s s)"
  echo "stalled: ps 1 stopped $stop_s s, until the chief scored an epoch more without it"
  grep -q "ps 1's process, ruled lost for the job, answers again" "$work/stalled/chief-0.log" ||
    fail "the chief did not tell ps 1's process, continued, to start again"
  grep -q "starts again empty" "$work/stalled/ps-1.log" || fail "ps 1's process did not start again"
  grep -q "ps 1 was started again and took its shards back" "$work/stalled/chief-0.log" ||
    fail "the chief did not take ps 1 back once it started again"
  grep -h -E "answers again|took its shards back" "$work/stalled/chief-0.log" | sed 's/^/stalled: /'
  echo "stalled: ps 1's process restarted $(grep -c 'starts again empty' "$work/stalled/ps-1.log") time(s) and was taken back ${back_ms:-?} ms after it was continued"
else
  grep -q 'dropping the copy' "$work"/stalled/*.log && fail "a task gave a copy up for a stall shorter than the copy timeout"
fi
grep -h 'updates applied' "$work"/*/chief-0.log
# epoch, global step, test loss, test accuracy. A chief that was stopped evaluates late: the
# workers may have trained past an evaluation's step before the ps tasks stopped serving
# them, and the chief then scores the step they are at (its line says which); so does one
# that waited for ps 1 to be ruled lost. Only the evaluations of the same step are
# compared; the last one always is.
epochs_of() { grep '^epoch' "$1" | awk '{print $2, $4, $6, $8}'; }
clean=$(epochs_of "$work/clean/chief-0.log")
stalled=$(epochs_of "$work/stalled/chief-0.log")
echo "clean:   $(echo "$clean" | tail -1)"
echo "stalled: $(echo "$stalled" | tail -1)"
[ -n "$clean" ] && [ "$(echo "$clean" | wc -l)" = "$(echo "$stalled" | wc -l)" ] &&
  [ "$(echo "$clean" | tail -1)" = "$(echo "$stalled" | tail -1)" ] ||
  fail "the stalled job's epochs differ from the clean job's: $(diff <(echo "$clean") <(echo "$stalled") | tr '\n' ' ')"
late=0
while read -r c_epoch c_step c_loss c_accuracy && read -r s_epoch s_step s_loss s_accuracy <&3; do
  if [ "$s_step" != "$c_step" ]; then
    # (A chief that waited for the ruling on ps 1 scores the steps the workers reached
    # since, each labelled by its own epoch.)
    { [ "$stop_task" = chief ] && [ "$s_epoch" = "$c_epoch" ] || [ "$past" = 1 ]; } && [ "$s_step" -gt "$c_step" ] ||
      fail "epoch $c_epoch was scored at step $s_step, not $c_step"
    late=$((late + 1))
    continue
  fi
  [ "$c_loss $c_accuracy" = "$s_loss $s_accuracy" ] ||
    fail "epoch $c_epoch (step $c_step): the stalled job's test loss and accuracy $s_loss $s_accuracy, the clean job's $c_loss $c_accuracy"
done < <(echo "$clean") 3< <(echo "$stalled")
[ "$late" = 0 ] || echo "the chief scored $late epoch(s) late, at a later step (not compared)"
if [ "$past" = 1 ]; then
  echo "PASS: ps 1 stopped for $stop_s s, past the copy timeout: given up by every task, training went on from its copies, ps 1's process was taken back once continued, every task exited 0, and the job ended exactly where the clean one did"
else
  echo "PASS: $stop_task stopped for $stop_s s (worker timeout $timeout_ms ms, copies: $replicas) held nobody lost, and the job ended exactly where the clean one did"
fi
