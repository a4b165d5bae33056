#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Scaling curves of a pulley ps job, and a cost model checked against them.

    /usr/bin/python3 benchmarks/scaling.py run   [--binary PATH] [--out scaling.csv] [--axes workers,ps,model]
                                        [--seconds S] [--quick]
    /usr/bin/python3 benchmarks/scaling.py model scaling.csv [--workers 64] [--ps 16] [--gbit 10]
    /usr/bin/python3 benchmarks/scaling.py plot  scaling.csv [-o docs/scaling]

`run` trains Fashion-MNIST's MLP (784-H-10, Adam 1e-3, batch 64 per worker) as one process
per task on 127.0.0.1 (scripts/launch_local.sh: P ps tasks, N workers and a chief), sync
R = N and async, along three axes through one base point (N = 2, P = 2, H = 128):
  - workers: N in 1 2 3 4 6 8;
  - ps: P in 1 2 3 4, with H = 2048;
  - model: H in 128 512 2048 8192 16384 32768 65536 (0.1 M to 52 M parameters);
every job with each variable split evenly over its ps tasks (--shards P) and every
connection over TCP (--no-local-sockets: the model is of tasks on separate hosts);
and, to calibrate the cost model, `--mode plain` (one thread, no ps) at every H, stepping on
batches of 64 and of 128. Each run trains about S seconds (--max-steps from a first guess
of its speed). A row of the CSV: the axis, mode, N, P, H, parameters, global steps,
samples/s from the chief's final line, test accuracy, and the bytes that crossed the
loopback interface during the run (/proc/net/dev: TCP/IP headers, handshakes, heartbeats,
the chief's initialization and reads included). Nothing else should run on the host meanwhile.

`model` fits the cost model to the rows (below), prints its constants, every measured row
beside its prediction, and the prediction for a cluster of --workers x --ps hosts on a
--gbit network. `plot` draws the measured points and the model's curves as PNGs.

The cost model (seconds; M parameters, b = 64 examples per batch, C cores on this host):
  - from the plain runs, each linear in M: compute c(M) per example (a plain step on 128
    examples costs 64 c more than one on 64), the optimizer's update u(M) (timed apart by
    the plain run) and g(M), the rest of a step, which the batch's size does not change
    (the model's matrices packed for the products, the gradients cleared);
  - k: CPU seconds per byte a worker-step moves (both ends' kernel work, the copies, the
    ps's sum), and o: fixed seconds per worker-step (messages, wake-ups, round trips; for
    sync also the wait for the step's last push), one for each mode: fitted to the job's
    rows. A worker-step moves B = 8 M bytes (its push and its pull).
  - On this host, a worker-step costs w = b c + g + k B + o. Sync: a global step of N of them
    and one update takes max((N w + u) / min(C, N), w + u) (the cores shared; or one
    worker's own chain, compute, push, update, pull, one after another). Async: every push
    is applied, so min(C, N) / (w + u) pushes per second.
  - A cluster, every task on a host of its own with one core as fast as one of this host's,
    a full-duplex link of beta bytes/s each way per host, a non-blocking switch and an even
    placement (FixedShards): moving x bytes costs a host max(x / beta, x k / 2) (half of k
    is each end's). Sync: b c + g + push + u(M / P) + pull + o, where a push (and a pull)
    takes the longer of a worker's 4 M bytes and a ps's N 4 M / P. Async: each worker pushes
    at 1 / (b c + g + 2 move(4 M) + u(M / P) + o) per second, up to what the ps tasks take: each
    push gives a ps 4 M / P bytes in and out (full duplex) and u(M / P) of work.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 64          # examples per batch, per worker (the example's default)
EXAMPLES = 60_000   # Fashion-MNIST's training examples
FIELDS = ["axis", "mode", "workers", "ps", "hidden", "parameters", "steps", "samples_per_s",
          "test_accuracy", "update_s", "wire_bytes", "seconds"]


def parameters(hidden: int) -> int:
    """Floats of the 784-H-10 MLP: two weight matrices and two bias vectors."""
    return 795 * hidden + 10


def loopback_bytes() -> int:
    """Bytes sent on the loopback interface since boot (each byte on lo is counted once)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def guess_samples_per_s(mode: str, workers: int, hidden: int) -> float:
    """A first guess of a run's speed on a 2-core host, to size its --max-steps."""
    per_core = 6e9 / parameters(hidden)  # from BENCHMARKS.md's runs: 39 k/s at 0.1 M, 950 at 6.5 M
    return per_core * (1.0 if mode == "plain" else min(workers, 2) * 0.6)


def run_one(binary: Path, axis: str, mode: str, workers: int, ps: int, hidden: int,
            seconds: float, work: Path) -> dict:
    """One run; returns its CSV row (raises with the run's log when it fails)."""
    per_step = BATCH * (workers if mode in ("sync", "plain") else 1)
    steps_per_epoch = EXAMPLES // per_step
    steps = max(10, int(seconds * guess_samples_per_s(mode, workers, hidden) / per_step))
    epochs = min(1000, math.ceil(steps / steps_per_epoch))
    flags = ["--mode", mode, "--hidden", str(hidden), "--max-steps", str(steps),
             "--epochs", str(epochs), "--progress-secs", "0"]
    if mode == "plain":
        command = [str(binary), *flags, "--workers", str(workers)]
    else:
        command = ["bash", str(ROOT / "scripts/launch_local.sh"), "--ps", str(ps), "--workers",
                   str(workers), "--binary", str(binary), "--", *flags, "--shards", str(max(ps, 1)),
                   "--no-local-sockets"]  # TCP, as between hosts: its bytes cross the loopback interface
    log = work / "run.log"
    before, start = loopback_bytes(), time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    wall, moved = time.monotonic() - start, loopback_bytes() - before
    text = log.read_text()
    final = re.search(r"final: (.*)", text)
    trained = re.search(r"\((\d+) steps\)", text)
    if done.returncode != 0 or final is None or trained is None:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{text[-3000:]}")
    figures = dict(re.findall(r"(\w+)=([0-9.]+)", final.group(1)))
    return {"axis": axis, "mode": mode, "workers": workers, "ps": ps if mode != "plain" else 0,
            "hidden": hidden, "parameters": parameters(hidden), "steps": int(trained.group(1)),
            "samples_per_s": float(figures["samples_per_s"]),
            "test_accuracy": float(figures["test_accuracy"]),
            "update_s": float(figures.get("update_us_per_step", 0)) * 1e-6,
            "wire_bytes": moved if mode != "plain" else 0, "seconds": round(wall, 2)}


def plan(axes: list[str], quick: bool) -> list[tuple[str, str, int, int, int]]:
    """The runs: (axis, mode, workers, ps, hidden)."""
    if quick:  # what tests/scripts/scaling.sh runs: a point of each kind
        return [("model", "plain", 1, 0, 128), ("model", "plain", 2, 0, 128),
                ("model", "plain", 1, 0, 512), ("model", "plain", 2, 0, 512),
                ("workers", "sync", 2, 2, 128), ("workers", "async", 2, 2, 128),
                ("model", "sync", 2, 2, 512)]
    runs = []
    hiddens = [128, 512, 2048, 8192, 16384, 32768, 65536]
    if "model" in axes:  # the plain runs calibrate the model: first
        runs += [("model", "plain", n, 0, h) for h in hiddens for n in (1, 2)]
    for mode in ("sync", "async"):
        if "workers" in axes:
            runs += [("workers", mode, n, 2, 128) for n in (1, 2, 3, 4, 6, 8)]
        if "ps" in axes:
            runs += [("ps", mode, 2, p, 2048) for p in (1, 2, 3, 4)]
        if "model" in axes:
            runs += [("model", mode, 2, 2, h) for h in hiddens]
    return runs


def command_run(args: argparse.Namespace) -> None:
    binary = Path(args.binary)
    if not os.access(binary, os.X_OK):
        sys.exit(f"scaling.py: {binary} is not built (cmake --build build --target fashion_mnist)")
    runs = plan(args.axes.split(","), args.quick)
    out = Path(args.out)
    with out.open("w", newline="") as f, tempfile.TemporaryDirectory() as work:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for i, (axis, mode, n, p, h) in enumerate(runs, 1):
            row = run_one(binary, axis, mode, n, p, h, args.seconds, Path(work))
            writer.writerow(row)
            f.flush()
            per = row["wire_bytes"] / max(1, worker_steps(row)) / (4 * row["parameters"])
            print(f"[{i}/{len(runs)}] {axis:7} {mode:5} N={n} P={p} H={h:5}: "
                  f"{row['samples_per_s']:9.0f} samples/s, {row['steps']} steps, "
                  f"wire {per:5.2f} x model per worker-step, accuracy {row['test_accuracy']:.4f}, "
                  f"{row['seconds']:.0f} s", flush=True)
    print(f"wrote {out}")


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in FIELDS[2:]:
            r[k] = float(r[k])
    return rows


def worker_steps(row: dict) -> float:
    """Pushes of a run: a sync step takes one of every worker, an async step is one push."""
    return row["steps"] * (row["workers"] if row["mode"] == "sync" else 1)


class Model:
    """The cost model of the module's doc, fitted to a run's rows."""

    def __init__(self, rows: list[dict], cores: int):
        import numpy as np
        self.cores = cores
        plain = {(r["parameters"], int(r["workers"])): r for r in rows if r["mode"] == "plain"}
        sizes = sorted({m for m, _ in plain if (m, 1) in plain and (m, 2) in plain})
        if len(sizes) < 2:
            raise SystemExit("scaling.py: the model needs plain runs at two sizes at least (--axes model)")

        def step(m, n):  # seconds of a plain step on n batches, and of its update
            r = plain[(m, n)]
            return BATCH * n / r["samples_per_s"], r["update_s"]
        m = np.array(sizes, dtype=float)
        per_example = np.array([(step(s, 2)[0] - step(s, 1)[0]) / BATCH for s in sizes])
        update = np.array([(step(s, 1)[1] + step(s, 2)[1]) / 2 for s in sizes])
        fixed = np.array([step(s, 1)[0] - step(s, 1)[1] for s in sizes]) - BATCH * per_example
        self.c = self._fit_linear(m, per_example)
        self.g = self._fit_linear(m, fixed)
        self.u = self._fit_linear(m, update)
        jobs = [r for r in rows if r["mode"] in ("sync", "async")]
        if not jobs:
            raise SystemExit("scaling.py: no job rows to fit")
        # k, and o for each mode: a row's predicted time per example is linear in them on
        # each side of the max() in `host`, so a least squares of relative errors for the
        # sides the current fit picks, again until the sides settle.
        self.k, self.o = 0.0, {"sync": 0.0, "async": 0.0}
        for _ in range(20):
            a, y = [], []
            for r in jobs:
                const, coef = self._linear(r)
                measured = 1.0 / r["samples_per_s"]
                a.append([c / measured for c in coef])
                y.append(1.0 - const / measured)
            x, *_ = np.linalg.lstsq(np.array(a), np.array(y), rcond=None)
            x = np.maximum(x, 0.0)
            before = (self.k, dict(self.o))
            self.k, self.o = float(x[0]), {"sync": float(x[1]), "async": float(x[2])}
            if before == (self.k, self.o):
                break

    def _linear(self, row: dict) -> tuple[float, list[float]]:
        """A row's predicted seconds per example as const + coef . (k, o_sync, o_async), on
        the side of `host`'s max() the current constants pick."""
        n, m, mode = row["workers"], row["parameters"], row["mode"]
        fixed, u, lanes = self.compute(m), self.update(m), min(self.cores, n)
        if mode == "async":
            return (fixed + u) / (lanes * BATCH), [8 * m / (lanes * BATCH), 0.0, 1 / (lanes * BATCH)]
        w = fixed + self.k * 8 * m + self.o["sync"]
        if (n * w + u) / lanes >= w + u:  # the cores shared
            return (n * fixed + u) / (lanes * n * BATCH), [8 * m / (lanes * BATCH), 1 / (lanes * BATCH), 0.0]
        return (fixed + u) / (n * BATCH), [8 * m / (n * BATCH), 1 / (n * BATCH), 0.0]

    @staticmethod
    def _fit_linear(m, y):
        """a + b m through the points, each weighted by 1 / its value (relative errors)."""
        import numpy as np
        w = 1.0 / np.maximum(np.abs(y), 1e-12)
        a = np.stack([np.ones_like(m), m], axis=1) * w[:, None]
        coef, *_ = np.linalg.lstsq(a, y * w, rcond=None)
        return (max(float(coef[0]), 0.0), max(float(coef[1]), 0.0))

    def compute(self, m: float) -> float:
        """A worker-step's compute: the batch's examples and what does not depend on them."""
        return BATCH * (self.c[0] + self.c[1] * m) + self.g[0] + self.g[1] * m

    def update(self, m: float) -> float:
        """The optimizer's update of m parameters."""
        return self.u[0] + self.u[1] * m

    def host(self, row: dict) -> float:
        """Predicted samples/s of a row's job on this host (the doc's formulas, as `_linear`
        writes them)."""
        const, coef = self._linear(row)
        return 1.0 / (const + coef[0] * self.k + coef[1] * self.o["sync"] + coef[2] * self.o["async"])

    def cluster(self, mode: str, n: int, p: int, m: float, beta: float) -> dict:
        """Predicted samples/s of n workers and p ps tasks, each on its own host."""
        def move(x: float) -> float:
            return max(x / beta, x * self.k / 2)
        compute = self.compute(m)
        apply = self.update(m / p)
        worker_side, ps_side = move(4 * m), move(n * 4 * m / p)
        if mode == "sync":
            transfer = 2 * max(worker_side, ps_side)
            step = compute + transfer + apply + self.o[mode]
            return {"samples_per_s": n * BATCH / step, "compute": compute, "transfer": transfer,
                    "apply": apply, "bound": "ps links" if ps_side > worker_side else "worker links"}
        chain = compute + 2 * worker_side + apply + self.o[mode]
        ps_per_push = max(4 * m / p / beta, 4 * m / p * self.k + apply)  # in and out at once
        pushes = min(n / chain, 1.0 / ps_per_push)
        return {"samples_per_s": pushes * BATCH, "compute": compute, "transfer": 2 * worker_side,
                "apply": apply, "bound": "ps tasks" if pushes < n / chain else "workers"}


def command_model(args: argparse.Namespace) -> None:
    rows = read(args.csv)
    model = Model(rows, args.cores)
    # A sweep too short or too noisy can leave no per-byte cost above the noise: the fit's
    # k is then 0 (it is kept non-negative), and the links alone bound the moves.
    speed = f"{1 / model.k / 1e9:.2f} GB/s of one core" if model.k > 0 else "none seen above the noise"
    print(f"fitted on {len(rows)} rows ({args.cores} cores): compute {model.c[1] * 1e9:.4f} ns per parameter "
          f"and example + {model.c[0] * 1e6:.2f} us, and {model.g[1] * 1e9:.3f} ns per parameter + "
          f"{model.g[0] * 1e6:.1f} us per step; update {model.u[1] * 1e9:.3f} ns per parameter + "
          f"{model.u[0] * 1e6:.1f} us; k = {model.k * 1e9:.3f} ns per byte moved "
          f"({speed}); o = {model.o['sync'] * 1e6:.0f} us (sync), "
          f"{model.o['async'] * 1e6:.0f} us (async) per worker-step")
    print("\n| axis | mode | N | P | parameters | measured samples/s | model | model / measured |"
          " wire per worker-step (x model) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    errors = []
    for r in rows:
        if r["mode"] == "plain":
            continue
        predicted = model.host(r)
        errors.append(predicted / r["samples_per_s"])
        per = r["wire_bytes"] / worker_steps(r) / (4 * r["parameters"])
        print(f"| {r['axis']} | {r['mode']} | {r['workers']:.0f} | {r['ps']:.0f} | {r['parameters'] / 1e6:.2f} M | "
              f"{r['samples_per_s']:.0f} | {predicted:.0f} | {predicted / r['samples_per_s']:.2f} | {per:.2f} |")
    errors.sort()
    print(f"\nmodel / measured over {len(errors)} runs: median {errors[len(errors) // 2]:.2f}, "
          f"range {errors[0]:.2f}-{errors[-1]:.2f}")
    beta = args.gbit * 1e9 / 8
    print(f"\npredicted: {args.workers} workers x {args.ps} ps on a {args.gbit:g} Gb/s network "
          f"(one host per task, one core each, as fast as this host's)\n")
    print("| parameters | mode | samples/s | per worker | compute ms | transfer ms | update ms | bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for h in (128, 2048, 8192, 65536):
        for mode in ("sync", "async"):
            p = model.cluster(mode, args.workers, args.ps, parameters(h), beta)
            one = model.cluster(mode, 1, args.ps, parameters(h), beta)["samples_per_s"]
            print(f"| {parameters(h) / 1e6:.2f} M | {mode} | {p['samples_per_s']:.0f} | "
                  f"{p['samples_per_s'] / args.workers / one:.2f} of 1 | {p['compute'] * 1e3:.2f} | "
                  f"{p['transfer'] * 1e3:.2f} | {p['apply'] * 1e3:.3f} | {p['bound']} |")


def command_plot(args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read(args.csv)
    model = Model(rows, args.cores)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    axes = [("workers", "workers", "workers N (P = 2, 0.1 M parameters)", False),
            ("ps", "ps", "ps tasks P (N = 2, 1.6 M parameters)", False),
            ("model", "parameters", "parameters (N = 2, P = 2)", True)]
    for axis, key, label, log in axes:
        chosen = [r for r in rows if r["axis"] == axis and r["mode"] in ("sync", "async")]
        if not chosen:
            continue
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
        for mode, colour in (("sync", "tab:blue"), ("async", "tab:orange")):
            mine = sorted((r for r in chosen if r["mode"] == mode), key=lambda r: r[key])
            if not mine:
                continue
            xs = [r[key] for r in mine]
            top.plot(xs, [r["samples_per_s"] for r in mine], "o", color=colour, label=f"{mode}, measured")
            top.plot(xs, [model.host(r) for r in mine], "-", color=colour, alpha=0.6, label=f"{mode}, model")
            bottom.plot(xs, [r["wire_bytes"] / worker_steps(r) / (4 * r["parameters"]) for r in mine],
                        "o-", color=colour, label=mode)
        top.set_ylabel("samples/s")
        top.legend(fontsize=8)
        top.grid(alpha=0.3)
        bottom.set_ylabel("wire bytes per worker-step\n/ model bytes")
        bottom.set_xlabel(label)
        bottom.set_ylim(0, 3)
        bottom.axhline(2, color="grey", lw=0.8, ls="--")
        bottom.grid(alpha=0.3)
        if log:
            top.set_xscale("log")
            top.set_yscale("log")
        fig.suptitle(f"Fashion-MNIST MLP, one process per task on 127.0.0.1 ({args.cores} cores)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / f"{axis}.png", dpi=90)
        plt.close(fig)
    beta = args.gbit * 1e9 / 8
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = [1, 2, 4, 8, 16, 32, 64]
    for h, colour in ((128, "tab:green"), (2048, "tab:blue"), (8192, "tab:purple"), (65536, "tab:red")):
        for mode, style in (("sync", "-"), ("async", "--")):
            ax.plot(ns, [model.cluster(mode, n, args.ps, parameters(h), beta)["samples_per_s"] for n in ns],
                    style, color=colour, label=f"{parameters(h) / 1e6:.1f} M, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"workers ({args.ps} ps tasks, one host each, {args.gbit:g} Gb/s)")
    ax.set_ylabel("samples/s (model)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "cluster.png", dpi=90)
    plt.close(fig)
    print(f"wrote {', '.join(str(p) for p in sorted(out.glob('*.png')))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure the curves into a CSV")
    run.add_argument("--binary", default=str(ROOT / "build/examples/fashion_mnist"))
    run.add_argument("--out", default="scaling.csv")
    run.add_argument("--axes", default="workers,ps,model")
    run.add_argument("--seconds", type=float, default=10.0, help="about how long each run trains")
    run.add_argument("--quick", action="store_true", help="a point of each kind, for the test")
    for name in ("model", "plot"):
        p = sub.add_parser(name)
        p.add_argument("csv")
        p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the host's cores")
        p.add_argument("--workers", type=int, default=64)
        p.add_argument("--ps", type=int, default=16)
        p.add_argument("--gbit", type=float, default=10.0, help="each host's link, Gb/s each way")
        if name == "plot":
            p.add_argument("-o", "--output", default=str(ROOT / "docs/scaling"))
    args = parser.parse_args()
    {"run": command_run, "model": command_model, "plot": command_plot}[args.command](args)


if __name__ == "__main__":
    main()
