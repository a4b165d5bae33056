#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The CTR example end to end on a small data set, over TCP in sync mode and in-process in
# async mode: each run must exit 0 and end with its final line, and the model must have
# learned (held-out AUC within 0.05 of the planted model's own on that data).
#   tests/scripts/ctr_small.sh BINARY DATA_DIR
set -uo pipefail
binary=$1
data_dir=$2
failures=0
run() {
  local out rc line
  out=$("$binary" --train-examples 200000 --test-examples 20000 --vocabulary 2000 --batch 64 \
        --data-dir "$data_dir" "$@" 2>&1 </dev/null); rc=$?
  echo "$out"
  line=$(grep '^final: ' <<<"$out")
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
run --transport tcp --mode sync
run --transport in-process --mode async
exit $((failures > 0))
