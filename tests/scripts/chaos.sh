#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Random faults under a job of real processes, compared with the same job unfaulted:
# Fashion-MNIST sync R = N = 2 on 127.0.0.1 (2 ps, 2 workers, a chief; TCP, local sockets
# off so that connections can be destroyed), with a copy of every shard unless REPLICAS=0.
# For each seed, from epoch 1 to the end, one fault at a time drawn from a seeded RANDOM:
#   - a ps stopped (SIGSTOP) for 1-12.9 s, then continued: longer than the worker timeout
#     (5 s), so a ps must not blame the workers for its own silence;
#   - a worker stopped for up to 2 s (a worker stopped past the worker timeout is held lost
#     and the job changes by design: not drawn);
#   - the chief stopped for up to 4 s;
#   - every TCP connection to one ps destroyed (`ss -K`): pushes sent again are counted once;
#   - the chief killed (SIGKILL) and started again 0-3 s later, at most twice: it goes on
#     from the live ps state;
#   - with copies, one ps killed for good (SIGKILL) from epoch 2 on, once: its copy takes over.
# Every task must exit 0 and the job must end bit for bit where the unfaulted job ends (the
# same parameters' CRC-32C). Prints each seed's faults. A seed draws the same faults while
# the job's pace lets it (which are drawn depends on the epoch reached, and the draws
# after them follow).
#   [SEEDS="1 2"] [EPOCHS=25] [REPLICAS=1] tests/scripts/chaos.sh FASHION_MNIST_BINARY
# Needs `ss -K` (the kernel's socket destroy) for the connection kills; without it they are
# left out, and said so.
set -uo pipefail
binary=$1
seeds=${SEEDS:-1 2}
epochs=${EPOCHS:-25}
replicas=${REPLICAS:-1}
source "$(dirname "$0")/common.sh"
flags=(--epochs "$epochs" --wait-timeout-ms 120000 --recovery-timeout-ms 60000 --no-local-sockets
       --ps-replicas "$replicas")
crc_in() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }

start_job "$work/unfaulted" "$binary" 2 2 "${flags[@]}"
finish_job unfaulted 600
expected=$(crc_in "$work/unfaulted/chief-0.log")
[ -n "$expected" ] || fail "the unfaulted job printed no parameters' CRC-32C"
echo "unfaulted: $(grep '^final:' "$work/unfaulted/chief-0.log")"

# Does `ss -K` destroy sockets here (the kernel's SOCK_DESTROY)? ss says nothing when it
# cannot: a connection of our own must break.
can_cut=$(python3 - <<'PY'
import socket, subprocess
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(1)
port = server.getsockname()[1]
client = socket.create_connection(("127.0.0.1", port)); peer, _ = server.accept()
subprocess.run(["ss", "-K", "dport = :%d" % port], capture_output=True)
client.settimeout(1)
try:
    print(1 if client.recv(1) == b"" else 0)
except OSError as e:
    print(0 if isinstance(e, socket.timeout) else 1)
PY
)
[ "$can_cut" = 1 ] || { can_cut=0; echo "ss -K does not destroy sockets here: no connection kills"; }

for seed in $seeds; do
  RANDOM=$seed
  dir=$work/seed-$seed
  start_job "$dir" "$binary" 2 2 "${flags[@]}"
  ps_pids=("${job_pids[0]}" "${job_pids[1]}")
  worker_pids=("${job_pids[2]}" "${job_pids[3]}")
  chief=${job_pids[4]}
  chief_log=$dir/chief-0.log
  wait_for "$chief_log" '^epoch  1/' 300 || fail "seed $seed: the job never reached epoch 1"
  killed=-1 restarts=0 faults=()
  while kill -0 "$chief" 2>/dev/null && ! grep -q '^final:' "$chief_log"; do
    sleep "$((RANDOM % 2)).$((RANDOM % 10))"
    # Training over (the chief prints its final line before it shuts the ps tasks down):
    # no more faults, or one would land on the job's end, which is not this test's case.
    kill -0 "$chief" 2>/dev/null && ! grep -q '^final:' "$chief_log" || break
    draw=$((RANDOM % 100))
    epoch=$(cat "$dir"/chief-*.log | grep -c '^epoch')
    if [ "$draw" -lt 25 ]; then
      ps=$((RANDOM % 2)) secs=$((RANDOM % 12 + 1)).$((RANDOM % 10))
      [ "$ps" = "$killed" ] && continue
      faults+=("e$epoch:stop-ps$ps-${secs}s")
      kill -STOP "${ps_pids[$ps]}"; sleep "$secs"; kill -CONT "${ps_pids[$ps]}"
    elif [ "$draw" -lt 40 ]; then
      worker=$((RANDOM % 2)) secs=$((RANDOM % 2)).$((RANDOM % 10))
      faults+=("e$epoch:stop-worker$worker-${secs}s")
      kill -STOP "${worker_pids[$worker]}"; sleep "$secs"; kill -CONT "${worker_pids[$worker]}"
    elif [ "$draw" -lt 52 ]; then
      secs=$((RANDOM % 4)).$((RANDOM % 10))
      faults+=("e$epoch:stop-chief-${secs}s")
      kill -STOP "$chief"; sleep "$secs"; kill -CONT "$chief"
    elif [ "$draw" -lt 78 ]; then
      ps=$((RANDOM % 2))
      [ "$ps" = "$killed" ] || [ "$can_cut" = 0 ] && continue
      port=$(python3 -c "import json, sys; print(json.loads(sys.argv[1])['ps'][$ps].rsplit(':', 1)[1])" "$job_cluster")
      faults+=("e$epoch:cut-ps$ps")
      ss -K "( dport = :$port or sport = :$port )" >/dev/null 2>&1
    elif [ "$draw" -lt 92 ] && [ "$restarts" -lt 2 ]; then
      secs=$((RANDOM % 3)).$((RANDOM % 10))
      restarts=$((restarts + 1))
      faults+=("e$epoch:kill-chief-start-again-after-${secs}s")
      kill -9 "$chief"; wait "$chief" 2>/dev/null; forget_task "$chief"
      sleep "$secs"
      start_task "$dir" chief 0 "chief-$restarts.log" "${flags[@]}"
      chief=$last_pid chief_log=$dir/chief-$restarts.log
      job_pids+=("$chief")
    elif [ "$replicas" = 1 ] && [ "$killed" = -1 ] && [ "$epoch" -ge 2 ]; then
      killed=$((RANDOM % 2))
      faults+=("e$epoch:kill-ps$killed")
      kill -9 "${ps_pids[$killed]}"; wait "${ps_pids[$killed]}" 2>/dev/null; forget_task "${ps_pids[$killed]}"
    fi
  done
  echo "seed $seed: ${faults[*]}"
  finish_job "seed $seed" 600
  got=$(crc_in "$chief_log")
  echo "seed $seed: $(grep '^final:' "$chief_log")"
  [ "$got" = "$expected" ] || fail "seed $seed: the job ended on parameters $got, the unfaulted one on $expected"
  rm -rf "$dir"
done
echo "PASS: seeds $seeds: every task exited 0 and each job ended bit for bit where the unfaulted one does (CRC-32C $expected)"
