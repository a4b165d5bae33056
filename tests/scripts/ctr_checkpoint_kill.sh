#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The CTR example (in-process, sync R = N, checkpoints of its tables every 400 global steps,
# every second one full) killed with SIGKILL while a checkpoint is being written, then
# started again with the same command: the checkpoint it was writing must not count, the
# job must resume from the newest whole one (full, or incremental over its base) and end
# on exactly the final line of the same job run without the kill.
#   tests/scripts/ctr_checkpoint_kill.sh CTR_BINARY DATA_DIR
set -uo pipefail
binary=$1
data_dir=$2
work=$(mktemp -d)
pid=
cleanup() {
  [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; tail -n 20 "$work"/*.log; exit 1; }
flags=(--train-examples 200000 --test-examples 20000 --vocabulary 100000 --batch 64 --progress 0
       --save-checkpoint-steps 400 --full-checkpoint-every 2 --data-dir "$data_dir")
final_of() { grep -o 'final: .*' "$1" | sed 's/ samples_per_s=[0-9]*//'; }

"$binary" "${flags[@]}" --checkpoint-dir "$work/straight" >"$work/straight.log" 2>&1 </dev/null \
  || fail "the job without a kill failed"
straight=$(final_of "$work/straight.log")
[ -n "$straight" ] || fail "the job without a kill printed no final line"
echo "without a kill: $straight"

# Killed while a checkpoint is being written (its temporary directory is there) after one
# of a step past 0 was written whole (the one of step 0 is written at the start). The job
# is stopped (SIGSTOP) the moment a temporary is seen, and killed if it is still there; if
# the write finished in between, it goes on and the next one is caught. Three tries.
ckpt=$work/ckpt
caught=
for attempt in 1 2 3; do
  rm -rf "$ckpt"
  "$binary" "${flags[@]}" --checkpoint-dir "$ckpt" >"$work/killed.log" 2>&1 </dev/null &
  pid=$!
  for _ in $(seq 1 60000); do
    kill -0 "$pid" 2>/dev/null || break
    if compgen -G "$ckpt/ckpt-0*[1-9]*" >/dev/null && compgen -G "$ckpt/.tmp-ckpt-*" >/dev/null; then
      kill -STOP "$pid"
      caught=$(cd "$ckpt" && ls -d .tmp-ckpt-* 2>/dev/null | head -1)
      if [ -n "$caught" ]; then
        kill -KILL "$pid"
        break
      fi
      kill -CONT "$pid"
    fi
    sleep 0.002
  done
  wait "$pid" 2>/dev/null
  pid=
  [ -n "$caught" ] && break
  echo "try $attempt: no checkpoint caught being written"
done
[ -n "$caught" ] || fail "no checkpoint was caught being written in 3 tries"
whole=$(cd "$ckpt" && ls -d ckpt-* | sort | tail -1)
echo "killed while writing $caught; the newest whole checkpoint: $whole"
grep -q 'final:' "$work/killed.log" && fail "killed too late"

"$binary" "${flags[@]}" --checkpoint-dir "$ckpt" >"$work/resumed.log" 2>&1 </dev/null \
  || fail "the job started again failed"
grep -q "chief: resumed from .*/$whole at global step" "$work/resumed.log" \
  || fail "the job did not resume from $whole: $(grep 'resumed' "$work/resumed.log")"
grep -h 'resumed from' "$work/resumed.log"
grep -h "checkpoint at global step ${whole#ckpt-}\|checkpoint at global step $((10#${whole#ckpt-}))" "$work/killed.log" \
  | sed 's/^/  written before the kill: /'
compgen -G "$ckpt/.tmp-ckpt-*" >/dev/null && fail "the half-written checkpoint was left behind"
resumed=$(final_of "$work/resumed.log")
echo "resumed:        $resumed"
[ "$resumed" = "$straight" ] || fail "the resumed job ended elsewhere than the job without a kill"
echo "resumed == without a kill"
