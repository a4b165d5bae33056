# SPDX-License-Identifier: MIT
# What the durability scripts share; sourced, not run. Sets `work` (a scratch folder,
# removed at exit with every process whose pid is in `pids`, which are killed) and a job
# secret, and defines:
#   fail MESSAGE...             prints FAIL and the tail of every log under $work, exits 1
#   wait_for FILE PATTERN SECS  until PATTERN appears in FILE (status 1 if it never does)
#   free_ports N                N free TCP ports on 127.0.0.1, one a line
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null; kill -9 "$pid" 2>/dev/null; done
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
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held:
    s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in held))
PY
}
export PULLEY_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
