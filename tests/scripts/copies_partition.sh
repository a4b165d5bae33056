#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A partition in a job that keeps a copy of every shard (--ps-replicas 1): sync R = N = 2
# Fashion-MNIST, real processes. Worker 0 runs in a network namespace of its own, the ps
# tasks, the chief and worker 1 in another, joined by a veth pair. At epoch 2 a firewall
# rule in worker 0's namespace cuts it off from ps 1 alone, for CUT_S seconds (10): ps 1's
# address refuses worker 0, while everyone else, the chief included, reaches it.
# Worker 0 asks the chief whether ps 1 is lost; the chief still reaches it, so nothing is
# given up: worker 0 waits, and when the rule goes, the job goes on and ends bit for bit
# where the same job ends uncut (the same parameters' CRC-32C). Without the chief's
# ruling, worker 0 would give ps 1's copies up and write the other copies alone while
# worker 1 writes both: the two copies of ps 1's shard would part.
# Then ps 1 is killed with SIGKILL: every task asks, the chief rules it lost (its address
# refuses), and ps 1's copy takes its shard over with nothing rolled back.
# SCENARIO=chief: the chief runs beside worker 0, so the same rule cuts the chief off from
# ps 1 as well, while worker 1 still reaches it. The chief rules ps 1 lost (its address
# refuses the chief) and worker 0 gives it up; ps 1, no longer hearing the chief, serves
# no task past its lease (3/4 of the copy timeout), so worker 1 gives it up too, and the
# job ends bit for bit where the uncut one does. Without the lease, worker 1 would go on
# reading ps 1's own copy, which misses worker 0's pushes: the job would stall for the
# worker timeout and then end elsewhere.
# Needs root, `ip netns` and iptables; skips (exit 77, a line "SKIP: ...") without them.
#   [SCENARIO=worker|chief] tests/scripts/copies_partition.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
scenario=${SCENARIO:-worker}
epochs=${EPOCHS:-12}
cut_s=${CUT_S:-10}
chief_ns_of() { [ "$scenario" = chief ] && echo "$ns_w0" || echo "$ns_main"; }
source "$(dirname "$0")/common.sh"

ns_main=pulley-main-$$
ns_w0=pulley-w0-$$
source "$(dirname "$0")/netns.sh"
trap 'cleanup; netns_delete' EXIT  # the tasks first, then their namespaces
trap 'exit 1' INT TERM HUP
net=10.214.$((RANDOM % 250 + 1))
netns_pair "$ns_main" "$ns_w0" "$net"
main_ip=$net.1
w0_ip=$net.2
command -v iptables >/dev/null || { echo "SKIP: no iptables"; exit 77; }
if ! error=$(ip netns exec "$ns_w0" iptables -L OUTPUT 2>&1); then echo "SKIP: iptables unusable here: $error"; exit 77; fi

# Fresh namespaces: every port is free.
ps0=2222 ps1=2223 chief_port=2226
chief_ip=$main_ip
[ "$scenario" = chief ] && chief_ip=$w0_ip
cluster="{\"ps\": [\"$main_ip:$ps0\", \"$main_ip:$ps1\"], \"worker\": [\"$w0_ip:2224\", \"$main_ip:2225\"], \"chief\": [\"$chief_ip:$chief_port\"]}"
# Nobody is held lost across the cut (a worker timeout beyond it): the cut job can then
# take exactly the uncut job's steps. The rule rejects (a reset for every packet worker 0
# sends ps 1): its connections break and its new ones are refused, as when ps 1's process
# is gone, so it asks the chief at once. (A rule that drops packets silently breaks no
# connection: worker 0 finds ps 1 silent after the copy timeout and asks the chief then,
# and nothing is given up either way.)
flags=(--epochs "$epochs" --ps-replicas 1 --copy-timeout-ms 2000 --worker-timeout-ms 60000
       --wait-timeout-ms 120000 --recovery-timeout-ms 60000)
start_in() {  # start_in NAMESPACE DIR TYPE INDEX: one task, its output in DIR/TYPE-INDEX.log
  TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"$3\", \"index\": $4}}" \
    ip netns exec "$1" "$binary" "${flags[@]}" >"$2/$3-$4.log" 2>&1 &
  last_pid=$!  # ip netns exec execs the binary: the same process
  pids+=("$last_pid")
}
run_job() {  # run_job NAME CUT: the job in $work/NAME; CUT=1: the partition, then ps 1 killed
  local dir=$work/$1 cut=$2 chief_pid ps1_pid rc pid
  mkdir -p "$dir"
  local job=()
  start_in "$ns_main" "$dir" ps 0; job+=("$last_pid")
  start_in "$ns_main" "$dir" ps 1; ps1_pid=$last_pid; job+=("$last_pid")
  start_in "$ns_w0" "$dir" worker 0; job+=("$last_pid")
  start_in "$ns_main" "$dir" worker 1; job+=("$last_pid")
  start_in "$(chief_ns_of)" "$dir" chief 0; chief_pid=$last_pid
  if [ "$cut" = 1 ] && [ "$scenario" = chief ]; then
    wait_for "$dir/chief-0.log" "^epoch  2/" 300 || fail "$1: the job never reached epoch 2"
    ip netns exec "$ns_w0" iptables -A OUTPUT -p tcp -d "$main_ip" --dport "$ps1" -j REJECT --reject-with tcp-reset ||
      fail "could not cut"
    echo "$1: the chief and worker 0 cut off from ps 1 for good after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    wait_for "$dir/chief-0.log" "ps 1's process is lost for the job" 60 || fail "$1: the chief did not rule ps 1 lost"
    wait_for "$dir/ps-1.log" "has not heard the chief for" 60 || fail "$1: ps 1 did not stop serving the tasks"
    for who in worker-0 worker-1 chief-0; do
      wait_for "$dir/$who.log" "dropping the copy of ps 1's shard held by ps 1 " 60 || fail "$1: $who did not turn to ps 1's copy"
    done
    job=("${job[0]}" "${job[@]:2}")  # ps 1 is given up: ended below, by its pid
  elif [ "$cut" = 1 ]; then
    wait_for "$dir/chief-0.log" "^epoch  2/" 300 || fail "$1: the job never reached epoch 2"
    ip netns exec "$ns_w0" iptables -A OUTPUT -p tcp -d "$main_ip" --dport "$ps1" -j REJECT --reject-with tcp-reset ||
      fail "could not cut"
    echo "$1: worker 0 cut off from ps 1 after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    sleep "$cut_s"
    ip netns exec "$ns_w0" iptables -F || fail "could not end the cut"
    echo "$1: the cut ended after $cut_s s, at: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    wait_for "$dir/worker-0.log" "ps 1 is not lost for the job (the chief reaches it)" 1 || fail "$1: worker 0 did not ask the chief about ps 1"
    grep -h "dropping the copy" "$dir"/*.log && fail "$1: a copy was given up over a partition"
    # Now ps 1 is lost for real: every task asks, the chief rules it lost, its copy takes over.
    wait_for "$dir/chief-0.log" "^epoch  $((epochs - 3))/" 300 || fail "$1: the job never reached epoch $((epochs - 3))"
    grep -q '^final:' "$dir/chief-0.log" && fail "$1: training ended before ps 1 could be killed"
    kill -9 "$ps1_pid"
    wait "$ps1_pid" 2>/dev/null
    echo "$1: ps 1 killed after: $(grep '^epoch' "$dir/chief-0.log" | tail -1)"
    job=("${job[0]}" "${job[@]:2}")
    wait_for "$dir/chief-0.log" "ps 1's process is lost for the job" 60 || fail "$1: the chief did not rule ps 1 lost"
    for who in worker-0 worker-1 chief-0; do
      wait_for "$dir/$who.log" "dropping the copy of ps 1's shard held by ps 1 " 60 || fail "$1: $who did not turn to ps 1's copy"
    done
  fi
  for _ in $(seq 1 6000); do kill -0 "$chief_pid" 2>/dev/null || break; sleep 0.05; done
  for pid in "${job[@]}" "$chief_pid"; do
    wait "$pid"; rc=$?
    [ "$rc" = 0 ] || fail "$1: a task (pid $pid) exited $rc"
  done
  if [ "$cut" = 1 ] && [ "$scenario" = chief ]; then  # alive, cut off, given up: nobody ends it
    kill "$ps1_pid" 2>/dev/null
    wait "$ps1_pid" 2>/dev/null
    ip netns exec "$ns_w0" iptables -F
  fi
}

run_job uncut 0
run_job cut 1
echo "--- what the cut job's tasks logged"
grep -h -E "asks the chief|is not lost for the job|lost for the job|dropping the copy" "$work"/cut/*.log | sort | uniq -c | sed 's/^/cut: /'
grep -q 'every ps restored from' "$work"/cut/chief-0.log && fail "the cut job rolled back"
crc_of() { sed -n 's/^final: .*parameters_crc32c=\([0-9a-f]*\).*/\1/p' "$1/chief-0.log"; }
uncut=$(crc_of "$work/uncut") cut=$(crc_of "$work/cut")
echo "uncut: $(grep '^final:' "$work/uncut/chief-0.log")"
echo "cut:   $(grep '^final:' "$work/cut/chief-0.log")"
[ -n "$uncut" ] && [ "$cut" = "$uncut" ] || fail "the cut job ended elsewhere ($cut) than the uncut one ($uncut)"
if [ "$scenario" = chief ]; then
  echo "PASS: the chief and worker 0 cut off from ps 1: the chief ruled it lost, ps 1 served worker 1 no more past its lease, every task turned to ps 1's copy, and the job ended bit for bit where the uncut one does (parameters' CRC-32C $cut)"
else
  echo "PASS: worker 0 cut off from ps 1 for $cut_s s gave nothing up and waited; ps 1 then killed was ruled lost and its copy took over; the job ended bit for bit where the uncut one does (parameters' CRC-32C $cut)"
fi
