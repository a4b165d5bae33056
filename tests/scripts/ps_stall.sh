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
# later step than it was due, is not compared.
#   [REPLICAS=0|1] [STOP=ps1|chief] tests/scripts/ps_stall.sh FASHION_MNIST_BINARY
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

run_job() {  # run_job NAME STOP: one job in $work/NAME; STOP=1 stops ps 1 (or the chief) after epoch 1
  local dir=$work/$1 stop=$2
  start_job "$dir" "$binary" 2 2 "${flags[@]}"
  local stopped=${job_pids[1]}
  [ "$stop_task" = chief ] && stopped=${job_pids[4]}
  if [ "$stop" = 1 ]; then
    wait_for "$dir/chief-0.log" '^epoch  1/' 120 || fail "$1: the job never reached epoch 1"
    kill -STOP "$stopped"
    echo "$1: stopped $stop_task for $stop_s s (copies: $replicas) after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    sleep "$stop_s"
    kill -CONT "$stopped"
  fi
  finish_job "$1" 180
}

run_job clean 0
run_job stalled 1

grep -h -E 'worker:[0-9]+ lost|is back|disconnected|chief|dropping' "$work"/stalled/*.log | sed 's/^/stalled: /' | head -20
grep -q -E 'worker:[0-9]+ lost' "$work"/stalled/ps-*.log && fail "a ps held a worker lost for a stall not the worker's"
grep -q 'dropping the copy' "$work"/stalled/*.log && fail "a task gave a copy up for a stall shorter than the copy timeout"
grep -h 'updates applied' "$work"/*/chief-0.log
# epoch, global step, test loss, test accuracy. A chief that was stopped evaluates late: the
# workers may have trained past an evaluation's step before the ps tasks stopped serving
# them, and the chief then scores the step they are at (its line says which). Only the
# evaluations of the same step are compared; the last one always is.
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
    [ "$stop_task" = chief ] && [ "$s_epoch" = "$c_epoch" ] && [ "$s_step" -gt "$c_step" ] ||
      fail "epoch $c_epoch was scored at step $s_step, not $c_step"
    late=$((late + 1))
    continue
  fi
  [ "$c_loss $c_accuracy" = "$s_loss $s_accuracy" ] ||
    fail "epoch $c_epoch (step $c_step): the stalled job's test loss and accuracy $s_loss $s_accuracy, the clean job's $c_loss $c_accuracy"
done < <(echo "$clean") 3< <(echo "$stalled")
[ "$late" = 0 ] || echo "the stopped chief scored $late epoch(s) late, at a later step (not compared)"
echo "PASS: $stop_task stopped for $stop_s s (worker timeout $timeout_ms ms, copies: $replicas) held nobody lost, and the job ended exactly where the clean one did"
