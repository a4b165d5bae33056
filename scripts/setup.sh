#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what building, testing and training pulley need (Debian/Ubuntu; clang-14 and its
# runtime build the fuzz target; slurm-client's scontrol checks the Slurm hostlist
# expansion against Slurm's own; openmpi-bin's mpirun launches the MPI test job;
# python3-matplotlib and curl serve scripts/plot_metrics.py and the metrics test; iptables
# cuts one link of a job in network namespaces for durability.copies_partition). Idempotent:
# packages already present are not touched, and apt is not called when nothing is missing.
set -euo pipefail

packages=(
  g++ cmake ninja-build python3
  zlib1g-dev libasio-dev libcereal-dev
  libxtensor-dev libxtensor-blas-dev libopenblas-dev liblapack-dev
  nlohmann-json3-dev libcli11-dev doctest-dev dataset-fashion-mnist
  clang-14 libclang-rt-14-dev
  slurm-client openmpi-bin python3-matplotlib curl iptables
)

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup.sh: not a Debian-like system; install these (or equivalents) yourself:" >&2
  echo "  ${packages[*]}" >&2
  exit 0
fi

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  sudo=(sudo)
fi
echo "setup.sh: installing ${missing[*]}"
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
