#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A job killed (SIGKILL) after its second epoch's checkpoint and started again with the
# same command resumes from that checkpoint and ends bit for bit where the uninterrupted
# job does (sync R = N, the data order continued from the restored step).
#   tests/scripts/resume.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--epochs 4)
straight=$("$binary" "${common[@]}" 2>/dev/null | grep '^final:' | sed 's/ samples_per_s=[0-9]*//')
[ -n "$straight" ] || { echo "FAIL: the uninterrupted job printed no final line"; exit 1; }
echo "uninterrupted: $straight"

args=("${common[@]}" --checkpoint-dir "$work/ckpt" --save-checkpoint-steps 468)
"$binary" "${args[@]}" >"$work/first.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  grep -q '^epoch  2/4' "$work/first.log" && break
  sleep 0.05
done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
grep -q '^epoch  2/4' "$work/first.log" || { echo "FAIL: the first run never reached epoch 2"; cat "$work/first.log"; exit 1; }
if grep -q '^final:' "$work/first.log"; then echo "FAIL: killed too late"; exit 1; fi
echo "killed after: $(grep '^epoch' "$work/first.log" | tail -1)"

resumed_log=$("$binary" "${args[@]}" 2>&1)
echo "$resumed_log" | grep -E 'resumed from|^epoch|^final'
resumed=$(echo "$resumed_log" | grep '^final:' | sed 's/ samples_per_s=[0-9]*//')
echo "$resumed_log" | grep -q 'chief: resumed from .*ckpt-0000000009[0-9][0-9] at global step 9' \
  || { echo "FAIL: the second run did not resume from the epoch-2 checkpoint"; exit 1; }
[ "$resumed" = "$straight" ] || { echo "FAIL: resumed '$resumed' != uninterrupted '$straight'"; exit 1; }
echo "resumed == uninterrupted"
