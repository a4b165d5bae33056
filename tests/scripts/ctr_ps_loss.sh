#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The CTR example as one process per task over TCP (scripts/launch_local.sh: 2 ps, 2
# workers, a chief, sync R = N, checkpoints every 300 global steps), run twice: once
# untouched, once with ps 1 killed (SIGKILL) mid-training and started again by
# `launch_local.sh --restart-failed`. The second job must finish, restore its tables from
# the newest checkpoint (its log says so, with the steps lost), and end within 0.003 AUC of
# the first.
#   tests/scripts/ctr_ps_loss.sh CTR_BINARY DATA_DIR
set -uo pipefail
binary=$1
data_dir=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
launcher=
cleanup() {
  [ -z "$launcher" ] || kill "$launcher" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; tail -n 25 "$work"/*.log; exit 1; }
flags=(--train-examples 400000 --test-examples 20000 --vocabulary 20000 --batch 64
       --save-checkpoint-steps 300 --recovery-timeout-ms 60000 --data-dir "$data_dir")

auc_of() { sed -n 's/.*final: auc=\([0-9.]*\).*/\1/p' "$1"; }

# 1. untouched
bash "$root/scripts/launch_local.sh" --ps 2 --workers 2 --binary "$binary" -- \
  "${flags[@]}" --checkpoint-dir "$work/plain" >"$work/plain.log" 2>&1 || fail "the untouched job failed"
plain=$(auc_of "$work/plain.log")
[ -n "$plain" ] || fail "the untouched job printed no final line"

# 2. ps 1 killed after the checkpoint due at global step 900 (the chief cuts it when it gets
#    there: at 900 or a step or two later), and restarted
due='checkpoint at global step 9[0-9][0-9]:'
bash "$root/scripts/launch_local.sh" --ps 2 --workers 2 --restart-failed 1 --binary "$binary" -- \
  "${flags[@]}" --checkpoint-dir "$work/killed" >"$work/killed.log" 2>&1 &
launcher=$!
for _ in $(seq 1 1200); do
  grep -Eq "$due" "$work/killed.log" && break
  kill -0 "$launcher" 2>/dev/null || fail "the job ended before its checkpoint of step 900"
  sleep 0.05
done
grep -Eq "$due" "$work/killed.log" || fail "no checkpoint of step 900 within 60 s"
sleep 0.3  # a few steps past the checkpoint: their updates are lost, and redone
victim=
for pid in $(pgrep -P "$launcher"); do
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -q '"type": "ps", "index": 1' && victim=$pid
done
[ -n "$victim" ] || fail "ps 1's process not found among the launcher's children"
kill -9 "$victim"
echo "killed ps 1 (pid $victim) after: $(grep 'global step [0-9]* of\|checkpoint at' "$work/killed.log" | tail -1)"
wait "$launcher"
rc=$?
launcher=
[ "$rc" -eq 0 ] || fail "the job with a killed ps exited $rc"
grep -q 'ps:1 failed.*starting it again' "$work/killed.log" || fail "launch_local.sh did not restart ps 1"
grep -q 'every ps restored from' "$work/killed.log" || fail "the chief did not restore the ps tasks"
grep -h 'every ps restored\|updates lost\|starting it again' "$work/killed.log"
killed=$(auc_of "$work/killed.log")
[ -n "$killed" ] || fail "the job with a killed ps printed no final line"
echo "AUC untouched $plain, with ps 1 killed and restored $killed"
python3 -c "import sys; sys.exit(0 if abs($plain - $killed) <= 0.003 else 1)" ||
  fail "the AUCs differ by more than 0.003"
echo PASS
