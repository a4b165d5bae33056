#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A network link cut under a job of real processes (sync, unless MODE says otherwise) on
# real (non-loopback) addresses: ps 0 in one network namespace, the chief and 2 workers in
# another, joined by a veth pair. After the chief's second epoch the link is cut for 5 s
# (the ps's end set down) and brought back. TCP carries the open connections across the
# cut, so the job must finish with a normal accuracy and every task must exit 0. Then,
# from epoch 5 on, the workers' connections to the ps are destroyed (`ss -K`) at random
# moments, 12 times: each worker reconnects and sends again what was unanswered, and the
# ps counts each push once (pushes sent again are counted in the chief's summary;
# exactly-once itself is checked bit for bit by unit.tcp and unit.exactly_once). Prints
# what the tasks logged about the cuts (workers held lost and back, waits) and how long
# training stood still.
# With REPLICAS=1 the ps namespace holds 2 ps tasks keeping a copy of each other's shard
# (--ps-replicas 1): the cut is shorter than the copy timeout, so nothing is given up, and
# the job must end bit for bit where the same job ends uncut (run after it in the same
# namespaces): the same parameters' CRC-32C.
# With MODE=async or ssp (BoundedStaleness, staleness 2) the job is not deterministic: it
# must end at the accuracy goal, with every task exited 0 and, with copies, none given up.
# Needs root and `ip netns`; skips (exit 77, a line "SKIP: ...") without them.
#   [REPLICAS=0|1] [MODE=sync|async|ssp] [EPOCHS=20] tests/scripts/link_cut.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
epochs=${EPOCHS:-20}
cut_s=5
replicas=${REPLICAS:-0}
mode=${MODE:-sync}

work=$(mktemp -d)
ns_ps=pulley-ps-$$
ns_wk=pulley-wk-$$
pids=()
uncut_pids=()
source "$(dirname "$0")/netns.sh"
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  netns_delete
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP  # the namespaces go with the EXIT trap
# The verdict first (a CI summary may keep only a test's first lines), then what the tasks
# logged about the cuts, then each log's tail.
fail() {
  echo "FAIL: $*"
  [ -s "$work/logged" ] && cat "$work/logged"
  for f in "$work"/*.log; do echo "--- $f"; tail -n 15 "$f"; done
  exit 1
}
now() { date +%s.%N; }

net=10.213.$((RANDOM % 250 + 1))
netns_pair "$ns_ps" "$ns_wk" "$net"
veth_ps=$netns_veth_a
ps_ip=$net.1
wk_ip=$net.2
echo "ps 0 at $ps_ip in $ns_ps; chief and workers at $wk_ip in $ns_wk"

# Fresh namespaces: every port is free.
ps_list="\"$ps_ip:2222\""
[ "$replicas" = 1 ] && ps_list="$ps_list, \"$ps_ip:2226\""
cluster="{\"ps\": [$ps_list], \"worker\": [\"$wk_ip:2223\", \"$wk_ip:2224\"], \"chief\": [\"$wk_ip:2225\"]}"
export PULLEY_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
# Default worker timeout (5 s) and heartbeats (1 s): a cut as long as the timeout may hold
# the workers lost until their heartbeats come through again. A request deadline (60 s)
# must not be reached; a wait that fails names its cause rather than hanging.
flags=(--epochs "$epochs" --wait-timeout-ms 120000 --recovery-timeout-ms 60000 --ps-replicas "$replicas"
       --mode "$mode" --staleness 2)
start() {  # start NAMESPACE TYPE INDEX: one task, its output in $work/TYPE-INDEX.log
  TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$2\", \"index\": $3}}" \
    ip netns exec "$1" "$binary" "${flags[@]}" >"$work/$2-$3.log" 2>&1 &
  pids+=("$!")  # ip netns exec execs the binary: the same process
  last_pid=$!
}
start "$ns_ps" ps 0; ps_pid=$last_pid
ps1_pid=
if [ "$replicas" = 1 ]; then start "$ns_ps" ps 1; ps1_pid=$last_pid; fi
start "$ns_wk" worker 0; w0=$last_pid
start "$ns_wk" worker 1; w1=$last_pid
start "$ns_wk" chief 0; chief=$last_pid

# When each epoch line appeared (the chief's log carries no times).
( seen=0
  for _ in $(seq 1 6000); do
    n=$(grep -c '^epoch' "$work/chief-0.log" 2>/dev/null)
    while [ "${n:-0}" -gt "$seen" ]; do seen=$((seen + 1)); echo "$seen $(now)"; done
    [ "$seen" -ge "$epochs" ] && break
    sleep 0.05
  done ) >"$work/epoch_times" &
pids+=("$!")
watcher=$!

for _ in $(seq 1 1200); do  # 60 s, or until the chief fails
  grep -q "^epoch  2/$epochs" "$work/chief-0.log" && break
  kill -0 "$chief" 2>/dev/null || break
  sleep 0.05
done
grep -q "^epoch  2/$epochs" "$work/chief-0.log" || fail "the job never reached epoch 2"
ip -n "$ns_ps" link set "$veth_ps" down || fail "could not cut the link"
cut_at=$(now)
echo "cut the link after: $(grep '^epoch' "$work/chief-0.log" | tail -1)"
sleep "$cut_s"
ip -n "$ns_ps" link set "$veth_ps" up || fail "could not restore the link"
restored_at=$(now)
echo "link restored after $cut_s s, at: $(grep '^epoch' "$work/chief-0.log" | tail -1)"

# Connections destroyed at random moments, once the job is past epoch 5.
for _ in $(seq 1 1200); do
  grep -q "^epoch  5/$epochs" "$work/chief-0.log" && break
  kill -0 "$chief" 2>/dev/null || break
  sleep 0.05
done
kills=0
if ip netns exec "$ns_wk" ss -K dst "$ps_ip" >/dev/null 2>&1; then kills=1; fi  # supported?
while [ "$kills" -gt 0 ] && [ "$kills" -le 12 ] && kill -0 "$chief" 2>/dev/null; do
  sleep "0.$((RANDOM % 6 + 2))"
  ip netns exec "$ns_wk" ss -K dst "$ps_ip" >/dev/null 2>&1
  kills=$((kills + 1))
done
echo "destroyed the workers' and chief's connections to the ps $kills time(s) after epoch 5"
if [ "$kills" -gt 0 ]; then  # they must have been cut for real: the tasks reconnected
  grep -q "connection to ps at .* lost" "$work"/worker-*.log "$work"/chief-0.log ||
    fail "ss -K ran, but no task lost a connection"
fi

for _ in $(seq 1 3000); do kill -0 "$chief" 2>/dev/null || break; sleep 0.05; done
kill -0 "$chief" 2>/dev/null && fail "the chief did not finish within 150 s of the cut"
wait "$chief"; chief_rc=$?
wait "$w0"; w0_rc=$?
wait "$w1"; w1_rc=$?
for _ in $(seq 1 400); do kill -0 "$ps_pid" 2>/dev/null || break; sleep 0.05; done
wait "$ps_pid"; ps_rc=$?
if [ -n "$ps1_pid" ]; then
  for _ in $(seq 1 400); do kill -0 "$ps1_pid" 2>/dev/null || break; sleep 0.05; done
  wait "$ps1_pid"; ps_rc=$ps_rc$?
fi
for _ in $(seq 1 100); do kill -0 "$watcher" 2>/dev/null || break; sleep 0.05; done

{ echo "--- what the tasks logged"
  for f in ps-0 ${ps1_pid:+ps-1} worker-0 worker-1 chief-0; do
    grep -E 'lost|is back|waiting|no progress|warning|error|failed' "$work/$f.log" | sed "s/^/$f: /"
  done
  echo "---"; } >"$work/logged"
[ "$chief_rc$w0_rc$w1_rc$ps_rc" = 000${ps1_pid:+0}0 ] ||
  fail "a task failed (chief $chief_rc, workers $w0_rc $w1_rc, ps $ps_rc)"
python3 - "$work/epoch_times" "$cut_at" "$restored_at" "$cut_s" <<'PY'
import statistics, sys
times = [float(line.split()[1]) for line in open(sys.argv[1]) if line.strip()]
cut, restored = float(sys.argv[2]), float(sys.argv[3])
gaps = [b - a for a, b in zip(times, times[1:])]
if not gaps:
    sys.exit(0)
typical = statistics.median(gaps)
across = [g for a, g in zip(times, gaps) if a + g > cut and a < restored + typical]
longest = max(across) if across else max(gaps)
print("epochs took %.2f s (median); the one across the cut %.2f s: training stood still "
      "about %.1f s for a %.1f s cut; epoch gaps: %s"
      % (typical, longest, longest - typical, restored - cut,
         " ".join("%.1f" % g for g in gaps)))
# A cut that does not stop the job (every ps is behind it) was no cut: the test would
# prove nothing.
if longest - typical < float(sys.argv[4]) / 2:
    print("FAIL: training went on through the cut: the link was not cut")
    sys.exit(1)
PY
[ $? = 0 ] || fail "the cut did not stop training"
final=$(grep '^final:' "$work/chief-0.log")
grep '^updates applied' "$work/chief-0.log"  # stale gradients: steps applied without a worker
echo "$final"
# A request past its deadline; not the courtesy question of a stall report, which the
# ps cannot answer while the link is down.
grep -i 'deadline' "$work"/*.log | grep -vq 'ask the ps tasks what they wait for' &&
  fail "a request reached its deadline across the cut"
for w in 0 1; do  # a worker held lost in the cut must have been heard again
  lost=$(grep -c "worker:$w lost" "$work/ps-0.log")
  back=$(grep -c "worker:$w is back" "$work/ps-0.log")
  [ "$lost" = "$back" ] || fail "worker $w was held lost $lost times but back only $back"
  [ "$lost" = 0 ] || echo "worker $w: held lost $lost time(s) when the link came back, and back each time"
done
accuracy=$(echo "$final" | sed -n 's/.*test_accuracy=\([0-9.]*\).*/\1/p')
[ -n "$accuracy" ] || fail "the chief printed no final accuracy"
python3 -c "import sys; sys.exit(0 if float('$accuracy') >= 0.85 else 1)" \
  || fail "accuracy $accuracy is below 0.85"
if [ "$replicas" = 1 ]; then
  grep -q 'dropping the copy' "$work"/*.log && fail "a task gave a copy up across a cut shorter than the copy timeout"
  if [ "$mode" != sync ]; then  # pushes applied in the order they come: nothing to compare bit for bit
    cat "$work/logged"
    echo "PASS: $mode with copies: accuracy $accuracy, no copy given up, across a $cut_s s link cut and $kills connection kills"
    exit 0
  fi
  # The same job uncut, in the same namespaces, for its parameters' CRC-32C.
  crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1"; }
  mkdir -p "$work/uncut"
  for task in "ps 0" "ps 1" "worker 0" "worker 1" "chief 0"; do
    set -- $task
    ns=$ns_wk; [ "$1" = ps ] && ns=$ns_ps
    TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$1\", \"index\": $2}}" \
      ip netns exec "$ns" "$binary" "${flags[@]}" >"$work/uncut/$1-$2.log" 2>&1 &
    pids+=("$!")
    uncut_pids+=("$!")
  done
  for pid in "${uncut_pids[@]}"; do
    for _ in $(seq 1 3000); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    wait "$pid" || fail "the uncut job's task (pid $pid) failed"
  done
  cut_crc=$(crc_of "$work/chief-0.log") uncut_crc=$(crc_of "$work/uncut/chief-0.log")
  echo "uncut: $(grep '^final:' "$work/uncut/chief-0.log")"
  [ -n "$uncut_crc" ] && [ "$cut_crc" = "$uncut_crc" ] ||
    fail "with copies the cut job ended elsewhere ($cut_crc) than the uncut one ($uncut_crc)"
  cat "$work/logged"
  echo "PASS: with copies the job ended bit for bit where the uncut one does (CRC-32C $cut_crc) across a $cut_s s link cut and $kills connection kills"
  exit 0
fi
cat "$work/logged"
echo "PASS: the job finished at accuracy $accuracy across a $cut_s s link cut"
