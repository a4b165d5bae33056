#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Check that no include arrow in include/pulley/ points up (or across) a layer.

A header's layer is its folder, the first one under include/pulley/; what each layer may
include besides itself:

    layer       folders                                        may include
    core        core/                                          -
    protocol    protocol/                                      core
    concepts    concepts/                                      core, protocol
    policies    optimizers/ sharding/ sync/ tables/ models/    core, protocol, concepts
                collective/
    storage     checkpoint/                                    core
    ps          ps/                                            core ... storage
    client      client/                                        core ... storage
    transports  transport/                                     core, protocol, concepts
    cluster     cluster/                                       core
    runner      runner/                                        everything

core, protocol and concepts are the contracts: their public headers include no `detail/`
header. A transport serves any Service and carries any request, so it needs no host (or
policy); the ps and the clients never include each other. pulley/pulley.hpp, the umbrella
of the core, is the one header outside a folder. A header in no layer folder is an error
too, so that a new folder is given its layer here. Exit status 1 lists every violation.

    python3 scripts/check_layers.py            # the tree
    python3 scripts/check_layers.py --self-test  # the checker catches what it must
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "include"
FOLDERS = {
    "core": "core",
    "protocol": "protocol",
    "concepts": "concepts",
    "optimizers": "policies",
    "sharding": "policies",
    "sync": "policies",
    "tables": "policies",
    "models": "policies",
    "collective": "policies",
    "checkpoint": "storage",
    "ps": "ps",
    "client": "client",
    "transport": "transports",
    "cluster": "cluster",
    "runner": "runner",
}
CONTRACTS = {"core", "protocol", "concepts"}
_BELOW_HOSTS = {"core", "protocol", "concepts", "policies", "storage"}
ALLOWED = {
    "core": {"core"},
    "protocol": {"core", "protocol"},
    "concepts": {"core", "protocol", "concepts"},
    "policies": {"core", "protocol", "concepts", "policies"},
    "storage": {"core", "storage"},
    "ps": _BELOW_HOSTS | {"ps"},
    "client": _BELOW_HOSTS | {"client"},
    "transports": {"core", "protocol", "concepts", "transports"},
    "cluster": {"core", "cluster"},
    "runner": set(FOLDERS.values()),
}
UMBRELLA = "pulley/pulley.hpp"
INCLUDE = re.compile(r'^\s*#\s*include\s*"(pulley/[^"]+)"')


def layer_of(rel: str) -> str | None:
    """The layer of include/<rel>, or None when its folder has none."""
    parts = rel.split("/")
    if len(parts) < 3 or parts[0] != "pulley":
        return None
    return FOLDERS.get(parts[1])


def check(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.hpp")):
        rel = path.relative_to(root).as_posix()
        if rel == UMBRELLA:
            continue
        mine = layer_of(rel)
        if mine is None:
            problems.append(f"include/{rel}: in no layer folder (see scripts/check_layers.py)")
            continue
        public_contract = mine in CONTRACTS and "/detail/" not in rel
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            if target == UMBRELLA:
                problems.append(f"include/{rel}:{lineno}: includes the umbrella {target}")
                continue
            theirs = layer_of(target)
            if theirs is None:
                problems.append(f"include/{rel}:{lineno}: includes {target}, in no layer folder")
            elif theirs not in ALLOWED[mine]:
                problems.append(f"include/{rel}:{lineno}: {mine} includes {target} ({theirs})")
            elif public_contract and "/detail/" in target:
                problems.append(f"include/{rel}:{lineno}: a contract includes {target} (an internal)")
    return problems


def self_test() -> int:
    """Builds small trees with one violation each and checks that each is found."""
    cases = {
        "an arrow up": {"pulley/core/a.hpp": '#include "pulley/ps/b.hpp"', "pulley/ps/b.hpp": ""},
        "an arrow across": {"pulley/ps/a.hpp": '#include "pulley/client/b.hpp"', "pulley/client/b.hpp": ""},
        "a transport on a host": {"pulley/transport/a.hpp": '#include "pulley/ps/b.hpp"', "pulley/ps/b.hpp": ""},
        "a contract on an internal": {
            "pulley/concepts/a.hpp": '#include "pulley/core/detail/b.hpp"',
            "pulley/core/detail/b.hpp": "",
        },
        "a header outside the layers": {"pulley/loose.hpp": ""},
        "an unknown folder": {"pulley/misc/a.hpp": ""},
    }
    clean = {"pulley/runner/a.hpp": '#include "pulley/ps/b.hpp"\n#include "pulley/client/c.hpp"',
             "pulley/ps/b.hpp": '#include "pulley/core/detail/d.hpp"',
             "pulley/client/c.hpp": '#include "pulley/concepts/e.hpp"',
             "pulley/core/detail/d.hpp": "", "pulley/concepts/e.hpp": '#include "pulley/protocol/f.hpp"',
             "pulley/protocol/f.hpp": "", "pulley/pulley.hpp": '#include "pulley/ps/b.hpp"'}
    failed = 0
    for name, files in [("a clean tree", clean)] + list(cases.items()):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for rel, text in files.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(text + "\n", encoding="utf-8")
            found = check(root)
            expected = name != "a clean tree"
            if bool(found) != expected:
                print(f"self-test: {name}: {'not found' if expected else 'wrongly flagged: ' + '; '.join(found)}",
                      file=sys.stderr)
                failed = 1
            else:
                print(f"self-test: {name}: {'found: ' + found[0] if found else 'clean'}")
    return failed


def main() -> int:
    if "--self-test" in sys.argv[1:]:
        return self_test()
    problems = check(ROOT)
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print("no include points up or across a layer")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
