# SPDX-License-Identifier: MIT
# What the durability scripts share; sourced, not run. Sets `work` (a scratch folder,
# removed at exit with every process whose pid is in `pids`, which are killed) and a job
# secret, and defines:
#   fail MESSAGE...             prints FAIL and the tail of every log under $work, exits 1
#   wait_for FILE PATTERN SECS  until PATTERN appears in FILE (status 1 if it never does)
#   free_ports N                N free TCP ports on 127.0.0.1, one a line
#   free_port_run N             the first of N consecutive free ports on 127.0.0.1
#   start_job, start_task, start_joining_ps, forget_task, finish_job: a job of real
#                               processes (below)
#   check_final JOB_DIR NAME PS   the chief's final line: Fashion-MNIST's test accuracy at
#                                 least 0.875, or CTR's AUC within 0.05 of the planted
#                                 model's; ended on PS ps tasks; sets `final`
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null; kill -9 "$pid" 2>/dev/null; done
  [ -n "${KEEP_LOGS:-}" ] && cp -r "$work" "$KEEP_LOGS" 2>/dev/null  # KEEP_LOGS=DIR: the logs kept there
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  find "$work" -name '*.log' | sort | while read -r f; do echo "--- $f"; tail -n 15 "$f"; done
  exit 1
}
wait_for() {
  for _ in $(seq 1 $(($3 * 20))); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  return 1
}
free_ports() { python3 "$(dirname "${BASH_SOURCE[0]}")/../../scripts/free_ports.py" "$1"; }
free_port_run() { python3 "$(dirname "${BASH_SOURCE[0]}")/../../scripts/free_ports.py" --run "$1"; }
export PULLEY_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')

# A job of real processes on 127.0.0.1, each task on its TF_CONFIG:
#   start_job DIR BINARY NUM_PS NUM_WORKERS FLAGS...   ps tasks, workers and a chief, each
#       writing DIR/TYPE-INDEX.log; sets job_pids (ps tasks, then workers, then the chief)
#   start_task DIR TYPE INDEX LOG FLAGS...             one more process of that job's (a
#       task started again), writing DIR/LOG; sets last_pid
#   forget_task PID                                    a task killed on purpose: not waited for
#   finish_job NAME SECONDS                            waits up to SECONDS for the chief, then
#       fails unless every task of job_pids exits 0
start_job() {
  local dir=$1 num_ps=$3 num_workers=$4 i
  job_binary=$2
  shift 4
  mkdir -p "$dir"
  mapfile -t ports < <(free_ports $((num_ps + num_workers + 1)))
  local hosts=() next=0
  for role_count in "ps:$num_ps" "worker:$num_workers" "chief:1"; do
    local list=""
    for ((i = 0; i < ${role_count#*:}; ++i)); do list+="${list:+, }\"127.0.0.1:${ports[next++]}\""; done
    hosts+=("\"${role_count%:*}\": [$list]")
  done
  job_cluster="{${hosts[0]}, ${hosts[1]}, ${hosts[2]}}"
  job_pids=()
  for ((i = 0; i < num_ps; ++i)); do start_task "$dir" ps "$i" "ps-$i.log" "$@"; job_pids+=("$last_pid"); done
  for ((i = 0; i < num_workers; ++i)); do start_task "$dir" worker "$i" "worker-$i.log" "$@"; job_pids+=("$last_pid"); done
  start_task "$dir" chief 0 chief-0.log "$@"
  job_pids+=("$last_pid")
}
start_task() {
  local dir=$1 type=$2 index=$3 log=$4
  shift 4
  TF_CONFIG="{\"cluster\": $job_cluster, \"task\": {\"type\": \"$type\", \"index\": $index}}" \
    "$job_binary" "$@" >"$dir/$log" 2>&1 &
  last_pid=$!
  pids+=("$last_pid")
}
# start_joining_ps DIR INDEX FLAGS...: ps INDEX on a free port, its own cluster spec listing
# it after the job's ps tasks, started with --join (writing DIR/ps-INDEX.log); put first in
# job_pids, so it is waited for too and the chief stays last
start_joining_ps() {
  local dir=$1 index=$2 spec=$job_cluster
  shift 2
  job_cluster=$(python3 -c 'import json, sys; c = json.loads(sys.argv[1]); c["ps"].append(sys.argv[2]); print(json.dumps(c))' \
    "$spec" "127.0.0.1:$(free_ports 1)")
  start_task "$dir" ps "$index" "ps-$index.log" "$@" --join
  job_cluster=$spec
  job_pids=("$last_pid" "${job_pids[@]}")
}
forget_task() {
  local left=() pid
  for pid in "${job_pids[@]}"; do [ "$pid" = "$1" ] || left+=("$pid"); done
  job_pids=("${left[@]}")
}
# kill_ps_for_copy DIR PS LABEL TASK_LOGS...: SIGKILL ps PS (its pid in $ps_pid) for good
# and wait until each task named (chief-0, worker-1, ...) turned to the copy of its shard
kill_ps_for_copy() {
  local dir=$1 ps=$2 label=$3 who
  shift 3
  kill -9 "$ps_pid"
  wait "$ps_pid" 2>/dev/null
  forget_task "$ps_pid"
  echo "$label: killed ps $ps after: $(grep -h '^epoch\|of [0-9]*: auc' "$dir/chief-0.log" | tail -1)"
  for who in "$@"; do
    wait_for "$dir/$who.log" "dropping the copy of ps $ps's shard held by ps $ps " 60 || fail "$label: $who did not turn to ps $ps's copy"
  done
}
finish_job() {
  local chief=${job_pids[-1]} pid rc
  for _ in $(seq 1 $(($2 * 20))); do kill -0 "$chief" 2>/dev/null || break; sleep 0.05; done
  for pid in "${job_pids[@]}"; do
    wait "$pid"; rc=$?
    [ "$rc" = 0 ] || fail "$1: a task (pid $pid) exited $rc"
  done
}
check_final() {  # check_final DIR NAME PS [ACCURACY_GOAL (0.875)]
  local goal=${4:-0.875}
  final=$(grep '^final:' "$1/chief-0.log")
  echo "$2: $final"
  [ -n "$final" ] || fail "$2: no final line"
  echo "$final" | grep -q " ps=$3 " || fail "$2: the job did not end on $3 ps tasks"
  awk -v line="$final" -v goal="$goal" 'BEGIN { n = split(line, f, /[ =]/); for (i = 1; i < n; ++i) v[f[i]] = f[i + 1];
    if ("test_accuracy" in v) exit !(v["test_accuracy"] >= goal + 0);
    exit !(v["auc"] + 0.05 >= v["planted_auc"] && v["planted_auc"] > 0.6) }' ||
    fail "$2: below its goal (test accuracy $goal, or an AUC within 0.05 of the planted model's)"
}
