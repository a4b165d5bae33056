#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A job started by Open MPI's mpirun (-np 5 --mpi-roles ps:2,worker:2,chief:1 on this host)
# trains to its usual accuracy and to the in-process job's parameters bit for bit; the same
# command without mpirun is refused at once, naming mpirun. Skipped (77) without mpirun.
#   tests/scripts/mpi.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
command -v mpirun >/dev/null || { echo "SKIP: no mpirun (apt-get install openmpi-bin)"; exit 77; }

roles=(--mpi-roles ps:2,worker:2,chief:1)
out=$("$binary" "${roles[@]}" --epochs 1 2>&1); rc=$?
echo "without mpirun: rc $rc: $out"
[ "$rc" != 0 ] || fail "started without mpirun, it ran"
echo "$out" | grep -q 'OMPI_COMM_WORLD_RANK is not set: start the job with mpirun' || fail "the refusal does not name mpirun"

base=$(free_port_run 5)
[ -n "$base" ] || fail "found no 5 consecutive free ports"
# README's line (one epoch, and ports known free).
timeout 240 mpirun --oversubscribe --allow-run-as-root -np 5 -x PULLEY_SECRET \
  "$binary" "${roles[@]}" --mpi-port-base "$base" --epochs 1 >"$work/mpi.log" 2>&1
rc=$?
grep -E '^(final|epoch)' "$work/mpi.log"
[ "$rc" = 0 ] || fail "mpirun exited $rc: $(tail -20 "$work/mpi.log")"
grep -Eq '^final: test_accuracy=0\.(8[3-9]|9).* workers=2 ps=2 ' "$work/mpi.log" || fail "no final line at the usual accuracy"
grep -q 'ps 1 serving its shard on 127.0.0.1:' "$work/mpi.log" || fail "ps 1 did not serve on this host"
# Sync R = N = 2 sums two gradients a step, in either order alike: the in-process job's
# parameters, bit for bit.
crc() { grep -o 'parameters_crc32c=[0-9a-f]*' "$1"; }
"$binary" --epochs 1 >"$work/in-process.log" 2>&1 || fail "the in-process job failed"
[ -n "$(crc "$work/mpi.log")" ] && [ "$(crc "$work/mpi.log")" = "$(crc "$work/in-process.log")" ] ||
  fail "mpirun's job ended at $(crc "$work/mpi.log"), the in-process one at $(crc "$work/in-process.log")"
echo "the same parameters as in-process: $(crc "$work/mpi.log")"
echo "PASS"
