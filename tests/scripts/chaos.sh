#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Random faults under a job of real processes, compared with the same job unfaulted: R = N
# = 2 on 127.0.0.1 (2 ps, 2 workers or 3 with MODE=backup, a chief; TCP, local sockets off so that connections can
# be destroyed, or with SHARED_MEMORY=1 the default path of tasks on one host, shared
# memory, where there is no connection to destroy), with a copy of every shard unless
# REPLICAS=0. The job is Fashion-MNIST, or
# the CTR example with its two embedding tables when the binary is `ctr` (then DATA_DIR is
# where its generated data lives). For each seed, from the first progress line (an epoch,
# or CTR's quarter epoch) to the end, one fault at a time drawn from a seeded RANDOM:
#   - a ps stopped (SIGSTOP) for 1-12.9 s, then continued: longer than the worker timeout
#     (5 s), so a ps must not blame the workers for its own silence; with copies and
#     COPY_TIMEOUT_MS short enough, past the copy timeout too: the chief rules its process
#     lost, and once continued it starts again and is taken back (the next fault waits);
#   - a worker stopped for up to 2 s (a worker stopped past the worker timeout is held lost
#     and the job changes by design: not drawn);
#   - a worker killed (SIGKILL) and started again 0-2 s later, within the worker timeout:
#     the new process reads its share from the step the job is at;
#   - the chief stopped for up to 4 s;
#   - every TCP connection to one ps destroyed (`ss -K`): pushes sent again are counted once;
#   - the chief killed (SIGKILL) and started again 0-3 s later, at most twice: it goes on
#     from the live ps state;
#   - a ps killed and started again 0-2 s later, once, while no ps is lost for good: with
#     copies the chief takes it back into its shards, without them the job rolls back to
#     its newest checkpoint (the next fault waits until it is back);
#   - with copies, one ps killed for good (SIGKILL) from the second progress line on, once:
#     its copy takes over.
# Every job writes checkpoints (every 300 global steps; CHECKPOINTS=0: none, and no ps is
# started again without copies).
# Every task must exit 0. Under MODE=sync (the default) the job must end bit for bit where
# the unfaulted job ends (the same parameters' CRC-32C), unless a worker killed while it
# wrote its push left it with some ps tasks only and a ps logged that its step went on
# without it (README, "A push lost with its worker's process"): that job must end within
# 0.01 of the unfaulted job's test accuracy, or AUC, and says so. MODE=async and MODE=ssp (bounded
# staleness 2) are not deterministic: there the job must end within TOLERANCE (0.025) of the
# unfaulted job's test accuracy, or AUC. Nor is MODE=backup: sync with a backup worker (R =
# 2 of N = 3 workers), where a step takes the first two pushes that come, and a worker
# killed while it wrote its push, or a backup that skipped a step, must never leave a step
# standing still (README, "A push lost with its worker's process"). Prints each seed's faults. A seed draws the same
# faults while the job's pace lets it (which are drawn depends on the progress reached, and
# the draws after them follow).
#   [SEEDS="1 2"] [EPOCHS=25, CTR 2] [REPLICAS=1] [MODE=sync|async|ssp|backup] [CHECKPOINTS=1]
#   [SHARED_MEMORY=0] [COPY_TIMEOUT_MS] tests/scripts/chaos.sh BINARY [DATA_DIR]
# Needs `ss -K` (the kernel's socket destroy) for the connection kills; without it they are
# left out, and said so.
set -uo pipefail
binary=$1
seeds=${SEEDS:-1 2}
replicas=${REPLICAS:-1}
mode=${MODE:-sync}
tolerance=${TOLERANCE:-0.025}
checkpoints=${CHECKPOINTS:-1}
shared_memory=${SHARED_MEMORY:-0}
source "$(dirname "$0")/common.sh"
flags=(--wait-timeout-ms 120000 --recovery-timeout-ms 60000 --ps-replicas "$replicas")
[ -z "${COPY_TIMEOUT_MS:-}" ] || flags+=(--copy-timeout-ms "$COPY_TIMEOUT_MS")
[ "$shared_memory" = 1 ] || flags+=(--no-local-sockets)
workers=2
case $mode in
  sync) ;;
  async) flags+=(--mode async) ;;
  ssp) flags+=(--mode ssp --staleness 2) ;;
  backup) flags+=(--replicas-to-aggregate 2) workers=3 ;;
  *) fail "MODE is sync, async, ssp or backup, not '$mode'" ;;
esac
if [ "$(basename "$binary")" = ctr ]; then
  [ $# -ge 2 ] || fail "the ctr example needs DATA_DIR, where its generated data lives"
  [ "$mode" != ssp ] || fail "the ctr example has no ssp mode"
  flags+=(--epochs "${EPOCHS:-2}" --train-examples 400000 --test-examples 20000 --vocabulary 20000
          --batch 64 --data-dir "$2")
  progress='^global step [0-9]* of'
  score=auc
else
  flags+=(--epochs "${EPOCHS:-25}")
  progress='^epoch '
  score=test_accuracy
fi
crc_in() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }
score_in() { sed -n "s/^final:.* $score=\([0-9.]*\).*/\1/p" "$1"; }

job_flags() {  # job_flags DIR: the flags of the job in DIR (its checkpoints there)
  job=("${flags[@]}")
  [ "$checkpoints" = 0 ] || job+=(--checkpoint-dir "$1/checkpoints" --save-checkpoint-steps 300)
}
job_flags "$work/unfaulted"
start_job "$work/unfaulted" "$binary" 2 "$workers" "${job[@]}"
finish_job unfaulted 600
expected=$(crc_in "$work/unfaulted/chief-0.log") expected_score=$(score_in "$work/unfaulted/chief-0.log")
[ -n "$expected" ] && [ -n "$expected_score" ] || fail "the unfaulted job printed no parameters' CRC-32C or $score"
echo "unfaulted: $(grep '^final:' "$work/unfaulted/chief-0.log")"

# Does `ss -K` destroy sockets here (the kernel's SOCK_DESTROY)? ss says nothing when it
# cannot: a connection of our own must break. (Through shared memory there is no TCP
# connection to destroy.)
[ "$shared_memory" = 1 ] && can_cut=0 || can_cut=$(python3 - <<'PY'
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
if [ "$shared_memory" = 1 ]; then
  echo "shared memory: no connection kills"
elif [ "$can_cut" != 1 ]; then
  can_cut=0
  echo "ss -K does not destroy sockets here: no connection kills"
fi

# A task started again after the chief printed its final line would wait for a job that is
# over (a ps for a chief to register it, for ever): the draw stands, the start is left out.
over() { grep -q '^final:' "$chief_log" 2>/dev/null; }
# wait_back PS [LINE COUNT]: waits (2 min at most, or until training is over) until the
# chief logged LINE (with copies: PS taken back) more than COUNT times (now's count by
# default); prints the seconds waited.
wait_back() {
  local line=${2:-"ps $1 was started again and took its shards back"} began=$SECONDS
  local count=${3:-$(cat "$dir"/chief-*.log | grep -c "$line")}
  for _ in $(seq 1 1200); do
    [ "$(cat "$dir"/chief-*.log | grep -c "$line")" -gt "$count" ] && break
    grep -q '^final:' "$chief_log" 2>/dev/null && break
    sleep 0.1
  done
  echo $((SECONDS - began))
}
lost_push=()
for seed in $seeds; do
  RANDOM=$seed
  dir=$work/seed-$seed
  job_flags "$dir"
  start_job "$dir" "$binary" 2 "$workers" "${job[@]}"
  ps_pids=("${job_pids[0]}" "${job_pids[1]}")
  worker_pids=("${job_pids[@]:2:$workers}")
  chief=${job_pids[2 + workers]}
  chief_log=$dir/chief-0.log
  wait_for "$chief_log" "$progress" 300 || fail "seed $seed: the job never printed its first progress line"
  killed=-1 restarts=0 worker_starts=0 ps_starts=0 faults=()
  while kill -0 "$chief" 2>/dev/null && ! grep -q '^final:' "$chief_log" 2>/dev/null; do
    sleep "$((RANDOM % 2)).$((RANDOM % 10))"
    # Training over (the chief prints its final line before it shuts the ps tasks down; a
    # worker says when it took the last step, which a chief started again may find done):
    # no more faults, or one would land on the job's end, which is not this test's case (a
    # task started after the ps tasks and the chief stopped cannot tell the end from a lost
    # chief, and fails after its connect timeout).
    kill -0 "$chief" 2>/dev/null && ! grep -q '^final:' "$chief_log" 2>/dev/null || break
    grep -q 'training finished after' "$dir"/worker-*.log 2>/dev/null && break
    draw=$((RANDOM % 100))
    epoch=$(cat "$dir"/chief-*.log | grep -c "$progress")
    if [ "$draw" -lt 25 ]; then
      ps=$((RANDOM % 2)) secs=$((RANDOM % 12 + 1)).$((RANDOM % 10))
      [ "$ps" = "$killed" ] && continue
      faults+=("e$epoch:stop-ps$ps-${secs}s")
      ruled="ps $ps's process is lost for the job"
      rulings=$(cat "$dir"/chief-*.log | grep -c "$ruled")
      kill -STOP "${ps_pids[$ps]}"; sleep "$secs"; kill -CONT "${ps_pids[$ps]}"
      # Stopped past COPY_TIMEOUT_MS: given up, then told to start again and taken back;
      # the next fault waits for that, as for a ps started again.
      if [ "$(cat "$dir"/chief-*.log | grep -c "$ruled")" -gt "$rulings" ]; then
        faults+=("(given up; taken back after $(wait_back "$ps") s)")
      fi
    elif [ "$draw" -lt 34 ]; then
      worker=$((RANDOM % workers)) secs=$((RANDOM % 2)).$((RANDOM % 10))
      faults+=("e$epoch:stop-worker$worker-${secs}s")
      kill -STOP "${worker_pids[$worker]}"; sleep "$secs"; kill -CONT "${worker_pids[$worker]}"
    elif [ "$draw" -lt 40 ]; then
      worker=$((RANDOM % workers)) secs=$((RANDOM % 2)).$((RANDOM % 10))
      worker_starts=$((worker_starts + 1))
      faults+=("e$epoch:kill-worker$worker-start-again-after-${secs}s")
      kill -9 "${worker_pids[$worker]}"; wait "${worker_pids[$worker]}" 2>/dev/null; forget_task "${worker_pids[$worker]}"
      sleep "$secs"
      over && { faults+=("(training over: not started again)"); break; }
      start_task "$dir" worker "$worker" "worker-$worker-$worker_starts.log" "${job[@]}"
      worker_pids[$worker]=$last_pid
      job_pids=("$last_pid" "${job_pids[@]}")  # the chief stays last: finish_job waits on it
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
    elif [ "$draw" -lt 86 ] && [ "$restarts" -lt 2 ]; then
      secs=$((RANDOM % 3)).$((RANDOM % 10))
      restarts=$((restarts + 1))
      faults+=("e$epoch:kill-chief-start-again-after-${secs}s")
      kill -9 "$chief"; wait "$chief" 2>/dev/null; forget_task "$chief"
      sleep "$secs"
      start_task "$dir" chief 0 "chief-$restarts.log" "${job[@]}"
      chief=$last_pid chief_log=$dir/chief-$restarts.log
      job_pids+=("$chief")
    elif [ "$draw" -lt 93 ] && [ "$ps_starts" = 0 ] && [ "$killed" = -1 ] &&
         { [ "$replicas" = 1 ] || [ "$checkpoints" = 1 ]; }; then
      ps=$((RANDOM % 2)) secs=$((RANDOM % 2)).$((RANDOM % 10))
      ps_starts=1
      faults+=("e$epoch:kill-ps$ps-start-again-after-${secs}s")
      # Back when the chief took it into its shards again (copies) or restored the job.
      back="ps $ps was started again and took its shards back"
      [ "$replicas" = 1 ] || back='every ps restored from'
      backs=$(cat "$dir"/chief-*.log | grep -c "$back")
      kill -9 "${ps_pids[$ps]}"; wait "${ps_pids[$ps]}" 2>/dev/null; forget_task "${ps_pids[$ps]}"
      sleep "$secs"
      over && { faults+=("(training over: not started again)"); break; }
      start_task "$dir" ps "$ps" "ps-$ps-again.log" "${job[@]}"
      ps_pids[$ps]=$last_pid
      job_pids=("$last_pid" "${job_pids[@]}")
      wait_back "$ps" "$back" "$backs" >/dev/null
    elif [ "$replicas" = 1 ] && [ "$killed" = -1 ] && [ "$epoch" -ge 2 ]; then
      killed=$((RANDOM % 2))
      faults+=("e$epoch:kill-ps$killed")
      kill -9 "${ps_pids[$killed]}"; wait "${ps_pids[$killed]}" 2>/dev/null; forget_task "${ps_pids[$killed]}"
    fi
  done
  echo "seed $seed: ${faults[*]}"
  finish_job "seed $seed" 600
  echo "seed $seed: $(grep '^final:' "$chief_log")"
  if [ "$mode" = sync ] && grep -qh 'without a push for step' "$dir"/ps-*.log; then
    echo "seed $seed: $(grep -h 'without a push for step' "$dir"/ps-*.log | head -1 | cut -c1-200)"
    got=$(score_in "$chief_log")
    awk -v a="$got" -v b="$expected_score" 'BEGIN { d = a - b; exit !(a != "" && d <= 0.01 && -d <= 0.01) }' ||
      fail "seed $seed: a push was lost with its worker, and $score $got is more than 0.01 from the unfaulted job's $expected_score"
    lost_push+=("$seed")
  elif [ "$mode" = sync ]; then
    got=$(crc_in "$chief_log")
    [ "$got" = "$expected" ] || fail "seed $seed: the job ended on parameters $got, the unfaulted one on $expected"
  else
    if grep -qh 'without a push for step' "$dir"/ps-*.log; then
      echo "seed $seed: $(grep -h 'without a push for step' "$dir"/ps-*.log | head -1 | cut -c1-200)"
      lost_push+=("$seed")
    fi
    got=$(score_in "$chief_log")
    awk -v a="$got" -v b="$expected_score" -v t="$tolerance" 'BEGIN { d = a - b; exit !(a != "" && d <= t && -d <= t) }' ||
      fail "seed $seed: $score $got, the unfaulted job's $expected_score: more than $tolerance apart"
  fi
  rm -rf "$dir"
done
if [ "$mode" = sync ] && [ ${#lost_push[@]} -gt 0 ]; then
  echo "PASS: seeds $seeds: every task exited 0; each job ended bit for bit where the unfaulted one does (CRC-32C $expected) but seeds ${lost_push[*]}, where a push lost with its worker's process was logged, within 0.01 of its $score"
elif [ "$mode" = sync ]; then
  echo "PASS: seeds $seeds: every task exited 0 and each job ended bit for bit where the unfaulted one does (CRC-32C $expected)"
else
  echo "PASS: seeds $seeds ($mode): every task exited 0 and each job ended within $tolerance of the unfaulted job's $score ($expected_score)${lost_push[*]:+; a push lost with the process of its worker was logged in seeds ${lost_push[*]}}"
fi
