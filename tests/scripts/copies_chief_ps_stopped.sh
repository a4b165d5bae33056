#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ps stopped across a chief's restart, in a job that keeps a copy of every shard
# (--ps-replicas 1): sync R = N = 2 Fashion-MNIST, real processes on 127.0.0.1 (2 ps, a
# chief, 2 workers). At epoch 3 the chief is killed (SIGKILL) and ps 1 stopped (SIGSTOP) at
# once; a chief is started again 0.7 s later. It never reaches ps 1's process: the workers,
# which had, ask it about that process by name, it rules it lost (its looks get no
# handshake), the workers turn to the copies, and the chief goes on from the live state. ps 1 is continued 1 s later, while training goes on. The chief must
# tell that process from one started in its place, though it never reached it: it tells it
# to start again empty and takes it back, before training ends, and the job ends bit for
# bit where the same job ends unbroken, every task exiting 0.
#   tests/scripts/copies_chief_ps_stopped.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "$0")/common.sh"
flags=(--epochs 30 --ps-replicas 1 --copy-timeout-ms 3000 --wait-timeout-ms 120000
       --recovery-timeout-ms 60000 --no-local-sockets)

start_job "$work/unbroken" "$binary" 2 2 "${flags[@]}"
finish_job unbroken 180

dir=$work/stopped
start_job "$dir" "$binary" 2 2 "${flags[@]}"
chief=${job_pids[4]} ps1=${job_pids[1]}
wait_for "$dir/chief-0.log" '^epoch  3/' 120 || fail "the job never reached epoch 3"
kill -9 "$chief"; kill -STOP "$ps1"; wait "$chief" 2>/dev/null; forget_task "$chief"
echo "killed the chief and stopped ps 1 after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
sleep 0.7
start_task "$dir" chief 0 chief-again.log "${flags[@]}"; job_pids+=("$last_pid")
wait_for "$dir/chief-again.log" "ps 1's process is lost for the job" 60 ||
  { kill -CONT "$ps1"; fail "the new chief did not rule ps 1 lost"; }
wait_for "$dir/chief-again.log" 'going on from their live state' 60 ||
  { kill -CONT "$ps1"; fail "the new chief did not go on from the live state"; }
sleep 1
kill -CONT "$ps1"
continued_at=$(date +%s.%N)
echo "continued ps 1, 1 s after the new chief went on from global step $(sed -n 's/.*at global step \([0-9]*\): going on.*/\1/p' "$dir/chief-again.log")"
wait_for "$dir/chief-again.log" "ps 1 was started again and took its shards back" 60 ||
  fail "the chief did not take ps 1 back within 60 s of its SIGCONT"
echo "the chief took ps 1 back $(python3 -c "import time; print(f'{time.time() - $continued_at:.1f}')") s after its SIGCONT"
taken=$(grep -n "ps 1 was started again and took its shards back" "$dir/chief-again.log" | head -1 | cut -d: -f1)
final=$(grep -n '^final:' "$dir/chief-again.log" | head -1 | cut -d: -f1)
[ -z "$final" ] || [ "$taken" -lt "$final" ] || fail "ps 1 was taken back only after training ended"
grep -q "told it to start again empty" "$dir/chief-again.log" ||
  fail "the chief took ps 1's old process back without telling it to start again"
finish_job stopped 240
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }
unbroken=$(crc_of "$work/unbroken/chief-0.log") stopped=$(crc_of "$dir/chief-again.log")
echo "unbroken: $(grep '^final:' "$work/unbroken/chief-0.log")"
echo "stopped:  $(grep '^final:' "$dir/chief-again.log")"
[ -n "$unbroken" ] && [ "$stopped" = "$unbroken" ] ||
  fail "the job ended elsewhere ($stopped) than the unbroken one ($unbroken)"
echo "PASS: ps 1 stopped across the chief's restart was told to start again and taken back during training, and the job ended bit for bit where the unbroken one does (parameters' CRC-32C $stopped)"
