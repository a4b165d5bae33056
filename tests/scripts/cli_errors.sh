#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# An operator's mistakes on the command line of a program built on the role runner: each
# must exit non-zero with exactly one line on stderr that names the mistake (the usage only
# on --help).   tests/scripts/cli_errors.sh BINARY
set -uo pipefail
binary=$1
failures=0
expect() {  # expect "TEXT IN THE LINE" ARGS...
  local want=$1; shift
  local err rc
  err=$("$binary" "$@" 2>&1 >/dev/null </dev/null); rc=$?
  local lines
  lines=$(printf '%s' "$err" | grep -c '')
  if [ "$rc" -eq 0 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$want" <<<"$err"; then
    echo "FAIL: $* -> rc=$rc, $lines lines: $err" >&2
    failures=$((failures + 1))
  else
    echo "ok: $* -> rc=$rc: $err"
  fi
}
expect "Could not convert: --task = 4294967296" --role worker --task 4294967296 --ps-hosts a:1 --worker-hosts b:2
expect "not in range" --steps 99999999999999999999
expect "not in range" --steps -5
expect "--bogus" --bogus
expect "address 'a:1' is listed twice" --role worker --task 0 --ps-hosts a:1,a:1 --worker-hosts b:2
expect "port" --role worker --task 0 --ps-hosts a:99999 --worker-hosts b:2
expect "task index 3" --role worker --task 3 --ps-hosts a:1 --worker-hosts b:2
expect "needs a Slurm step" --slurm-roles ps:1,worker:1
expect "not in range 0 to 1" --ps-replicas 2
expect "needs a cluster of processes" --ps-replicas 1
PULLEY_SECRET=a-secret-for-this-test expect "at least 2 ps tasks" \
  --role ps --task 0 --ps-hosts 127.0.0.1:1 --worker-hosts 127.0.0.1:2 --ps-replicas 1
PULLEY_SECRET=a-secret-for-this-test expect 'the cluster has no "ps" task: a parameter-server job needs one' \
  --role worker --task 0 --worker-hosts 127.0.0.1:2
expect "must be below the recovery timeout" --ps-leave-secs 300
expect "not in range" --ps-leave-secs -1
expect "--join is for a ps task, a worker or an evaluator of a cluster of processes" --join
PULLEY_SECRET=a-secret-for-this-test expect "--join needs the running job's name" \
  --join --role worker --task 1 --ps-hosts 127.0.0.1:1 --worker-hosts 127.0.0.1:2,127.0.0.1:3
PULLEY_SECRET=a-secret-for-this-test expect "--join needs the running job's name" \
  --join --role ps --task 1 --ps-hosts 127.0.0.1:1,127.0.0.1:3 --worker-hosts 127.0.0.1:2
PULLEY_SECRET=a-secret-for-this-test expect "needs the chief's address: --chief-host" --join --role worker --job-name j
PULLEY_SECRET=a-secret-for-this-test expect "needs where it serves: --address" \
  --join --role ps --chief-host 127.0.0.1:1 --job-name j
PULLEY_SECRET=a-secret-for-this-test expect "--join needs the running job's name" --join --role worker --chief-host 127.0.0.1:1
# A joiner's flags are judged before its secret is looked for: these name the misuse, with
# or without a secret.
expect "--join is for a ps task, a worker or an evaluator" --join --role chief --chief-host 127.0.0.1:1 --job-name j
expect "needs the chief's address: --chief-host" --join --role ps --job-name j
PULLEY_SECRET=a-secret-for-this-test expect "an evaluator that joins is evaluator 0" \
  --join --job-name j --role evaluator --task 1 --ps-hosts 127.0.0.1:1 --worker-hosts 127.0.0.1:2
# The names of 0.2 still work: --job for --role, --slurm-jobs for --slurm-roles.
expect "task index 3" --job worker --task 3 --ps-hosts a:1 --worker-hosts b:2
expect "needs a Slurm step" --slurm-jobs ps:1,worker:1
TF_CONFIG='{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "task": {"type": "worker", "index": 0' \
  expect "TF_CONFIG"
out=$("$binary" --help 2>&1); rc=$?
if [ "$rc" -ne 0 ] || ! grep -q -- "--ps-hosts" <<<"$out"; then
  echo "FAIL: --help -> rc=$rc" >&2
  failures=$((failures + 1))
fi
[ "$failures" -eq 0 ] && echo "all operator errors are one line and a non-zero exit"
exit "$failures"
