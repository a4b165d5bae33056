#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""PyTorch's gloo all-reduce among N processes on loopback: the reference for
benchmarks/all_reduce.cpp (the same sizes and the same figures: bus bandwidth of a 16 MB sum,
2 (N - 1) / N x bytes / time, and the time per ring step of a 4 KB sum).

    python3 benchmarks/all_reduce_torch.py [--ranks 2,4] [--mb 16] [--iterations 10]

Needs Debian's python3-torch (1.13); prints figures, asserts nothing.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, ranks: int, port: int, floats: int, iterations: int, out) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    big = torch.ones(floats)
    small = torch.ones(1024)
    for _ in range(2):
        dist.all_reduce(big)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        dist.all_reduce(big)
        times.append(time.perf_counter() - start)
    for _ in range(20):
        dist.all_reduce(small)
    start = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(small)
    small_time = (time.perf_counter() - start) / 200
    if rank == 0:
        out.put((statistics.median(times), small_time))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    nbytes = args.mb << 20
    floats = nbytes // 4
    print(f"torch {torch.__version__} gloo all-reduce of {args.mb} MB, {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'time (ms)':>12} {'bus GB/s':>10} {'4 KB call (us)':>16} {'per step (us)':>14}")
    ctx = mp.get_context("spawn")
    for n in [int(x) for x in args.ranks.split(",")]:
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, n, port, floats, args.iterations, out)) for r in range(n)]
        for p in procs:
            p.start()
        big, small = out.get(timeout=600)
        for p in procs:
            p.join()
        bus = 2 * (n - 1) / n * nbytes / big
        steps = 2 * (n - 1)
        print(f"{n:>5} {big * 1e3:>12.2f} {bus / 1e9:>10.2f} {small * 1e6:>16.1f} {small / steps * 1e6:>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
