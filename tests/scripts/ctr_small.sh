#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The CTR example end to end on a small data set: as one process per task over TCP
# (scripts/launch_local.sh) in sync mode, and in-process in sync and async mode. Each run
# must exit 0 and end with its final line, and the model must have learned (held-out AUC
# within 0.05 of the planted model's own on that data); sync R = N over TCP must end on
# exactly the in-process figures, and the last checkpoint, scored with no cluster
# (--score-checkpoint), must score exactly as the job's final line. The same for the hybrid
# (--dense allreduce), which must also end where the ps job ends.
#   tests/scripts/ctr_small.sh BINARY DATA_DIR
set -uo pipefail
binary=$1
data_dir=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
failures=0
data=(--train-examples 200000 --test-examples 20000 --vocabulary 2000 --batch 64 --data-dir "$data_dir")
run() {  # run LAUNCHER...: the launcher is "in-process" or a launch_local.sh command line
  local out rc line how=$1
  shift
  if [ "$how" = in-process ]; then
    out=$("$binary" "${data[@]}" "$@" 2>&1 </dev/null); rc=$?
  else
    out=$(bash "$root/scripts/launch_local.sh" --ps 2 --workers 2 --binary "$binary" -- "${data[@]}" "$@" 2>&1 </dev/null); rc=$?
  fi
  echo "$out"
  last_out=$out
  line=$(grep -o 'final: .*' <<<"$out")
  last=$line
  if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
    echo "FAIL: ctr $* -> rc=$rc, no final line" >&2
    failures=$((failures + 1))
    return
  fi
  if ! awk -v line="$line" 'BEGIN {
        n = split(line, f, /[ =]/); for (i = 1; i < n; ++i) v[f[i]] = f[i + 1];
        exit !(v["auc"] + 0.05 >= v["planted_auc"] && v["planted_auc"] > 0.6) }'; then
    echo "FAIL: ctr $* -> $line (the held-out AUC is not within 0.05 of the planted model's)" >&2
    failures=$((failures + 1))
  fi
}
same_end() {  # same_end WHAT TCP_LINE IN_PROCESS_LINE: every figure but samples/s agrees
  if [ "$(sed 's/ samples_per_s=[0-9]*//' <<<"$2")" != "$(sed 's/ samples_per_s=[0-9]*//' <<<"$3")" ]; then
    echo "FAIL: $1 over TCP ended elsewhere than in-process: '$2' vs '$3'" >&2
    failures=$((failures + 1))
  fi
}
scores_as_final() {  # the newest checkpoint in $checkpoints, scored with no cluster, is $last's model
  local scored want got
  scored=$("$binary" "${data[@]}" --score-checkpoint "$checkpoints" 2>&1 </dev/null)
  echo "$scored"
  want=$(grep -o 'auc=[^ ]* planted_auc=[^ ]* logloss=[^ ]*\|parameters_crc32c=[^ ]*' <<<"$last")
  got=$(grep -o 'auc=[^ ]* planted_auc=[^ ]* logloss=[^ ]*\|parameters_crc32c=[^ ]*' <<<"$scored")
  if [ -z "$want" ] || [ "$want" != "$got" ]; then
    echo "FAIL: $1: the last checkpoint scored with no cluster: '$got', the job's final line: '$want'" >&2
    failures=$((failures + 1))
  fi
}
run processes --mode sync
tcp=$last
checkpoints="$data_dir/ctr_small_checkpoints"
rm -rf "$checkpoints"
run in-process --mode sync --checkpoint-dir "$checkpoints" --save-checkpoint-steps 300 --full-checkpoint-every 4
same_end "sync R = N" "$tcp" "$last"
# The last checkpoint (of step 1562: checkpoints at 0, 300, ... 1500 and the last step, every
# fourth full, so it is incremental, read over 1200's and 1500's), scored with no cluster,
# is the trained model: the same AUC and log loss as the final line.
if ! grep -q 'checkpoint at global step 1562: .*incremental over global step' <<<"$last_out"; then
  echo "FAIL: the last checkpoint is not an incremental one, as this test means to score" >&2
  failures=$((failures + 1))
fi
scores_as_final "sync R = N"
if [ "$(ls "$checkpoints" 2>/dev/null | grep -c '^ckpt-')" -lt 2 ]; then
  echo "FAIL: fewer than 2 checkpoints written to $checkpoints" >&2
  failures=$((failures + 1))
fi
rm -rf "$checkpoints"
on_ps=$last
# The hybrid: the tables on the ps tasks, the MLP on a ring of the workers and the chief.
# It ends over TCP exactly as in-process, and its checkpoints hold the MLP. With 2 workers
# it ends bit for bit where the ps job ends: the ring adds the two gradients as a ps does
# (the chief's rank adds nothing), and every replica applies the same Adam step.
run processes --mode sync --dense allreduce
tcp=$last
run in-process --mode sync --dense allreduce --checkpoint-dir "$checkpoints" --save-checkpoint-steps 500
same_end "the hybrid (--dense allreduce)" "$tcp" "$last"
if [ "${on_ps%% samples_per_s*}" != "${last%% samples_per_s*}" ]; then
  echo "FAIL: the hybrid ended elsewhere than the ps job: '$last' vs '$on_ps'" >&2
  failures=$((failures + 1))
fi
scores_as_final "the hybrid (--dense allreduce)"
rm -rf "$checkpoints"
run in-process --mode async
exit $((failures > 0))
