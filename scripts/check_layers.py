#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Check that no include arrow in include/pulley/ points up a layer.

The layers, and what each may include besides itself:

    contracts   error, variable, placement, node, messages, call, concepts/, ...  nothing
    policies    optimizers/, sharding/, sync/, models/                            contracts
    storage     checkpoint/ (checkpoints on disk)                                 contracts
    hosts       parameter_server, worker, chief, evaluator, heartbeat, embedding_table
                (and detail/client)
                                                                                  storage, policies, contracts
    transports  transport/                                                        contracts
    cluster     cluster/                                                          contracts
    runner      runner/                                                           everything

A transport serves any Service and carries any request, so it needs no host (or policy);
cluster discovery needs neither.

pulley/pulley.hpp, the umbrella of the core, is exempt. A header no rule places is an
error too, so that a new file is given its layer. Exit status 1 lists every violation.

    python3 scripts/check_layers.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "include"
ALLOWED = {
    "contracts": {"contracts"},
    "policies": {"contracts", "policies"},
    "storage": {"contracts", "storage"},
    "hosts": {"contracts", "policies", "storage", "hosts"},
    "transports": {"contracts", "transports"},
    "cluster": {"contracts", "cluster"},
    "runner": {"contracts", "policies", "storage", "hosts", "transports", "cluster", "runner"},
}
# First match wins: (path prefix under include/, layer).
RULES = [
    ("pulley/concepts/", "contracts"),
    ("pulley/detail/client.hpp", "hosts"),
    ("pulley/detail/", "contracts"),
    ("pulley/optimizers/", "policies"),
    ("pulley/sharding/", "policies"),
    ("pulley/sync/", "policies"),
    ("pulley/models/", "policies"),
    ("pulley/checkpoint/", "storage"),
    ("pulley/parameter_server.hpp", "hosts"),
    ("pulley/worker.hpp", "hosts"),
    ("pulley/chief.hpp", "hosts"),
    ("pulley/evaluator.hpp", "hosts"),
    ("pulley/heartbeat.hpp", "hosts"),
    ("pulley/embedding_table.hpp", "hosts"),
    ("pulley/transport/", "transports"),
    ("pulley/cluster/", "cluster"),
    ("pulley/runner/", "runner"),
]
CONTRACTS = {"error", "variable", "placement", "node", "initializers", "address", "version",
             "log", "messages", "call", "call_group", "client_options"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"(pulley/[^"]+)"')


def layer_of(rel: str) -> str | None:
    for prefix, layer in RULES:
        if rel.startswith(prefix):
            return layer
    name = rel.removeprefix("pulley/").removesuffix(".hpp")
    return "contracts" if name in CONTRACTS else None


def main() -> int:
    problems = []
    for path in sorted(ROOT.rglob("*.hpp")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "pulley/pulley.hpp":
            continue
        mine = layer_of(rel)
        if mine is None:
            problems.append(f"include/{rel}: in no layer (add it to scripts/check_layers.py)")
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            theirs = layer_of(m.group(1))
            if theirs is not None and theirs not in ALLOWED[mine]:
                problems.append(f"include/{rel}:{lineno}: {mine} includes {m.group(1)} ({theirs})")
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print("no include points up or across a layer")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
