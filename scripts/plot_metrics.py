#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Plots the metrics files of a pulley job (--metrics-file: JSON lines) as one PNG.

    python3 scripts/plot_metrics.py metrics.jsonl [more.jsonl ...] -o run.png

Three panels over the seconds since the first line, one curve per task:
  - loss: each worker's mean training loss per interval (and an evaluation's loss);
  - evaluation: the scores the chief or an evaluator reported (test_accuracy, auc, ...);
  - throughput: the chief's examples/s, else each worker's steps/s.
The files of one job's tasks (one per task with "{task}" in --metrics-file) go together.
Needs matplotlib (Debian: python3-matplotlib; scripts/setup.sh installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

# What is not a score among an evaluating task's figures.
NOT_SCORES = {"global_step", "evaluation_step", "examples", "examples_per_s", "time", "task"}


def read(paths: list[Path]) -> list[dict]:
    """Every line of every file, oldest first; a line that is not JSON stops with its place."""
    lines = []
    for path in paths:
        with path.open() as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    line = json.loads(text)
                except json.JSONDecodeError as e:
                    sys.exit(f"plot_metrics.py: {path}:{number}: not JSON ({e.msg})")
                if "time" not in line or "task" not in line:
                    sys.exit(f"plot_metrics.py: {path}:{number}: no \"time\" or \"task\": not a pulley metrics line")
                lines.append(line)
    if not lines:
        sys.exit("plot_metrics.py: the files hold no lines")
    lines.sort(key=lambda line: line["time"])
    return lines


def series(lines: list[dict]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """figure -> task -> (seconds, values), null values left out; an evaluation's scores
    once, when its step is new (the lines repeat them until the next evaluation)."""
    start = lines[0]["time"]
    out: dict = defaultdict(lambda: defaultdict(lambda: ([], [])))
    evaluated: dict[str, float] = {}
    for line in lines:
        step = line.get("evaluation_step")
        repeated = step is not None and evaluated.get(line["task"]) == step
        if step is not None:
            evaluated[line["task"]] = step
        for name, value in line.items():
            if name in ("time", "task") or value is None or (repeated and name not in NOT_SCORES):
                continue
            xs, ys = out[name][line["task"]]
            xs.append(line["time"] - start)
            ys.append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="metrics files (JSON lines)")
    parser.add_argument("-o", "--output", type=Path, default=Path("metrics.png"), help="the PNG to write")
    parser.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args()
    for path in args.files:
        if not path.is_file():
            sys.exit(f"plot_metrics.py: {path}: no such file")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # Debian's python3-matplotlib is for Debian's python3: a python3 of one's own (pyenv,
        # a venv) first on the PATH does not see it.
        system = "/usr/bin/python3"
        if Path(system).is_file() and Path(sys.executable).resolve() != Path(system).resolve():
            os.execv(system, [system, *sys.argv])
        sys.exit("plot_metrics.py: needs matplotlib (apt-get install python3-matplotlib)")

    figures = series(read(args.files))
    evaluating = {t for t in figures.get("evaluation_step", {})}
    scores = sorted({name for name, tasks in figures.items() if name not in NOT_SCORES
                     and set(tasks) <= evaluating and not name.endswith("loss")})
    eval_losses = sorted({name for name, tasks in figures.items() if name.endswith("loss") and set(tasks) <= evaluating})

    fig, (loss, evaluation, throughput) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for task, (xs, ys) in sorted(figures.get("loss", {}).items()):
        loss.plot(xs, ys, label=f"{task} training loss", linewidth=1)
    for name in eval_losses:
        for task, (xs, ys) in sorted(figures[name].items()):
            loss.plot(xs, ys, "o-", label=f"{task} {name}", linewidth=1.5)
    loss.set_ylabel("loss")

    for name in scores:
        for task, (xs, ys) in sorted(figures[name].items()):
            evaluation.plot(xs, ys, "o-", label=f"{task} {name}")
    evaluation.set_ylabel("evaluation")

    if "examples_per_s" in figures:
        for task, (xs, ys) in sorted(figures["examples_per_s"].items()):
            throughput.plot(xs, ys, label=f"{task} examples/s")
        throughput.set_ylabel("examples/s")
    else:
        for task, (xs, ys) in sorted(figures.get("steps_per_s", {}).items()):
            throughput.plot(xs, ys, label=f"{task} steps/s")
        throughput.set_ylabel("steps/s")
    throughput.set_xlabel("seconds since the first line")

    for axes in (loss, evaluation, throughput):
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small", loc="best")
        else:
            axes.text(0.5, 0.5, "nothing reported", ha="center", va="center", transform=axes.transAxes)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plot_metrics.py: wrote {args.output}")


if __name__ == "__main__":
    main()
