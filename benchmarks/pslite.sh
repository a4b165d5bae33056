#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# pulley's push+pull against ps-lite's and one iperf3 stream, on this host, in the same
# rounds (issue 20, item 2; BENCHMARKS.md, "Transport: push and pull"). Each round measures,
# one after the other:
#   - one iperf3 stream over 127.0.0.1 (bytes per second, one way), 3 s;
#   - ps-lite (a checkout of github.com/dmlc/ps-lite, built here against Debian's ZeroMQ and
#     protobuf): a scheduler, one server and one worker, the worker's KVWorker::ZPushPull
#     of one key of n bytes of floats, the server applying w -= 0 * g and answering w
#     without a copy (benchmarks/pslite/pslite_push_pull.cc), over TCP and over ZeroMQ's
#     ipc:// (DMLC_LOCAL=1, Unix-domain sockets);
#   - pulley's push+pull of n bytes, 1 worker, 1 ps (Sgd with learning rate 0, Async), over
#     TCP, through the local socket alone, and through shared memory (the path tasks on one
#     host take by default; build/benchmarks/push_pull --only "push+pull, 1 worker"),
#     in-process beside it;
# at n = 4 KB, 1 MB and 16 MB. Bandwidth counts the bytes pushed and pulled (2n a call), as
# push_pull does; iperf3's counts one stream's bytes, one way. Prints each round's figures,
# then the medians and the ratios.
#   bash benchmarks/pslite.sh PSLITE_SOURCE [BUILD_DIR (build)] [ROUNDS (3)] [SECONDS (1)]
set -euo pipefail
if [[ $# -lt 1 || ! -f ${1}/include/ps/ps.h ]]; then
  echo "usage: $0 PSLITE_SOURCE [BUILD_DIR] [ROUNDS] [SECONDS]  (PSLITE_SOURCE: a ps-lite checkout)" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pslite=$(cd "$1" && pwd)
build=$(mkdir -p "${2:-$root/build}" && cd "${2:-$root/build}" && pwd)
rounds=${3:-3}
seconds=${4:-1}
sizes=(4096 1048576 16777216)

# What ps-lite and the reference need, as scripts/setup.sh installs pulley's own.
missing=()
for pkg in libzmq3-dev libprotobuf-dev protobuf-compiler iperf3; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if ((${#missing[@]} > 0)); then
  sudo=()
  [[ $(id -u) -ne 0 ]] && sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

work=$(mktemp -d)
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# build WHAT COMMAND...: runs a build step, its output in a log that is shown if it fails.
build() {
  local what=$1
  shift
  if ! "$@" >"$work/build.log" 2>&1; then
    tail -30 "$work/build.log" >&2
    echo "pslite.sh: building $what failed" >&2
    exit 1
  fi
}
echo "building ps-lite ($(git -C "$pslite" log -1 --format=%h 2>/dev/null || echo "not a git checkout")) and the benchmarks" >&2
build "ps-lite (configure)" cmake -S "$pslite" -B "$build/pslite" -DCMAKE_BUILD_TYPE=Release
build "ps-lite" cmake --build "$build/pslite" --target pslite --parallel "$(nproc)"
build "pslite_push_pull" c++ -O3 -DNDEBUG -std=c++17 -I"$pslite/include" \
  "$root/benchmarks/pslite/pslite_push_pull.cc" "$build/pslite/libpslite.a" -lzmq -lprotobuf -lpthread \
  -o "$build/pslite/pslite_push_pull"
if [[ ! -f $build/CMakeCache.txt ]]; then  # a fresh clone: pulley's own dependencies and build tree
  bash "$root/scripts/setup.sh"
  build "pulley (configure)" env BUILD_DIR="$build" bash "$root/scripts/configure.sh"
fi
build "push_pull" cmake --build "$build" --target push_pull

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# pslite_run LOCAL: one ps-lite job (a scheduler, a server, a worker), each process within a
# time limit; prints the worker's "pslite BYTES SECONDS CALLS" lines; LOCAL=1 over ipc://.
# Fails if any of them failed (a port taken between free_port and the scheduler's bind).
pslite_run() {
  local limit=$((${#sizes[@]} * (${seconds%.*} + 2) + 60)) port status=0
  port=$(free_port)
  export DMLC_NUM_SERVER=1 DMLC_NUM_WORKER=1 DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=$port \
    DMLC_NODE_HOST=127.0.0.1 DMLC_LOCAL=$1
  DMLC_ROLE=scheduler timeout "$limit" "$build/pslite/pslite_push_pull" "$seconds" "${sizes[@]}" >/dev/null &
  pids=($!)
  DMLC_ROLE=server timeout "$limit" "$build/pslite/pslite_push_pull" "$seconds" "${sizes[@]}" >/dev/null &
  pids+=($!)
  DMLC_ROLE=worker timeout "$limit" "$build/pslite/pslite_push_pull" "$seconds" "${sizes[@]}" || status=$?
  wait "${pids[@]}" || status=$?
  pids=()
  return "$status"
}

# iperf3_run: one iperf3 stream over 127.0.0.1 for 3 s; prints "iperf3 GB/S".
iperf3_run() {
  local port i
  port=$(free_port)
  iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
  pids=($!)
  for ((i = 0; i < 50; ++i)); do  # until the server listens (iperf3 -J exits 0 on a refusal too)
    iperf3 -c 127.0.0.1 -p "$port" -t 3 -J >"$work/iperf3.json" 2>/dev/null || true
    grep -q '"sum_received"' "$work/iperf3.json" && break
    sleep 0.1
  done
  python3 -c 'import json, sys; print("iperf3", json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"] / 8e9)' \
    "$work/iperf3.json"
  wait "${pids[@]}" || true
  pids=()
}

for ((r = 1; r <= rounds; ++r)); do
  echo "round $r of $rounds" >&2
  out=$work/round-$r
  iperf3_run >"$out"
  pslite_run 0 >"$work/pslite"
  sed 's/^pslite /pslite-tcp /' "$work/pslite" >>"$out"
  pslite_run 1 >"$work/pslite"
  sed 's/^pslite /pslite-ipc /' "$work/pslite" >>"$out"
  "$build/benchmarks/push_pull" --seconds-per-case "$seconds" --rounds 1 --only "push+pull, 1 worker" >>"$out"
  sed 's/^/  /' "$out" >&2
done

python3 - "$work" "$rounds" <<'EOF'
import re, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
names = {4096: "4 KB", 1048576: "1 MB", 16777216: "16 MB"}
fig = {}  # (what, size) -> [GB/s per round]
for r in range(1, rounds + 1):
    for line in open(f"{work}/round-{r}"):
        f = line.split()
        if f and f[0] == "iperf3":
            fig.setdefault(("iperf3", None), []).append(float(f[1]))
        elif f and f[0].startswith("pslite-"):
            size, seconds = int(f[1]), float(f[2])
            fig.setdefault((f[0], size), []).append(2 * size / seconds / 1e9)
        else:
            m = re.match(r"(in-process|TCP|local-socket|shared-memory) push\+pull, 1 worker, (\d+) (KB|MB)\s+([\d.]+) GB/s", line)
            if m:
                size = int(m.group(2)) << (10 if m.group(3) == "KB" else 20)
                fig.setdefault(("pulley-" + m.group(1), size), []).append(float(m.group(4)))
med = {k: statistics.median(v) for k, v in fig.items()}
iperf = med.get(("iperf3", None), float("nan"))
print(f"\nmedians of {rounds} rounds, GB/s (bytes pushed + pulled; iperf3: one stream's bytes): iperf3 {iperf:.2f}")
print("(TCP/iperf3: pulley's bytes both ways against the stream's one way; per direction: half of them)")
print(f"{'size':>6} {'pulley TCP':>11} {'ps-lite TCP':>12} {'ratio':>6} {'pulley local':>13} {'pulley shared':>14}"
      f" {'ps-lite ipc':>12} {'ratio':>6} {'TCP/iperf3':>11} {'per direction':>14} {'in-process':>11}")
print("(the ipc ratio: pulley's same-host default, shared memory, against ps-lite's ipc://)")
for size, name in names.items():
    g = lambda k: med.get((k, size), float("nan"))
    t, pt, l, sh, pl, ip = (g("pulley-TCP"), g("pslite-tcp"), g("pulley-local-socket"), g("pulley-shared-memory"),
                            g("pslite-ipc"), g("pulley-in-process"))
    print(f"{name:>6} {t:11.2f} {pt:12.2f} {t / pt:6.2f} {l:13.2f} {sh:14.2f} {pl:12.2f} {sh / pl:6.2f}"
          f" {t / iperf:11.2f} {t / 2 / iperf:14.2f} {ip:11.2f}")
EOF
