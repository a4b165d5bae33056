#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Generate the single headers in single_include/pulley/ from the split headers.

Each single header starts at one or more entry headers; every `#include "pulley/..."` is
replaced by the text of that header, recursively and depth-first, each header once (a
later include of an already inlined header is dropped). The inlined headers lose their
`#pragma once` and SPDX line (the banner carries one of each); `#include <...>` lines stay
as they are. The output depends only on the headers, so it is byte-for-byte reproducible.

    single_include/pulley/pulley.hpp      the core (include/pulley/pulley.hpp)
    single_include/pulley/pulley_tcp.hpp  the core and the TCP transport (needs Asio, cereal)

    python3 scripts/amalgamate.py            # (re)write the single headers
    python3 scripts/amalgamate.py --check    # exit 1 if a file on disk is stale
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Output (under single_include/) -> (entry headers, what it is).
SINGLE_HEADERS = {
    "pulley/pulley.hpp": (["pulley/pulley.hpp"], "the core: standard library only"),
    "pulley/pulley_tcp.hpp": (["pulley/pulley.hpp", "pulley/transport/tcp.hpp"],
                              "the core and the TCP transport: needs standalone Asio and cereal"),
}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"(?P<path>[^"]+)"')
PRAGMA_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\b")
SPDX_RE = re.compile(r"^\s*//\s*SPDX-License-Identifier:")


class AmalgamationError(Exception):
    pass


def project_version(root: Path) -> str:
    cmakelists = root / "CMakeLists.txt"
    if cmakelists.is_file():
        m = re.search(r"project\s*\(\s*pulley\b[^)]*?\bVERSION\s+([0-9][0-9.]*)",
                      cmakelists.read_text(encoding="utf-8"), re.S)
        if m:
            return m.group(1)
    return "unknown"


class Amalgamator:
    def __init__(self, include_dir: Path) -> None:
        self.include_dir = include_dir
        self.seen: set[str] = set()
        self.stack: list[str] = []

    def header(self, rel: str, included_from: str | None) -> list[str]:
        path = self.include_dir / rel
        if not path.is_file():
            where = f" (included from {included_from})" if included_from else ""
            raise AmalgamationError(f"include/{rel} not found{where}")
        if rel in self.stack:
            cycle = " -> ".join(self.stack + [rel])
            raise AmalgamationError(f"include cycle: {cycle}")
        self.seen.add(rel)
        self.stack.append(rel)
        out = [f"// ---- begin {rel} ----\n"]
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        for lineno, line in enumerate(text.splitlines(keepends=True), start=1):
            if PRAGMA_ONCE_RE.match(line) or SPDX_RE.match(line):
                continue
            m = INCLUDE_RE.match(line)
            if m:
                target = m.group("path")
                if not target.startswith("pulley/"):
                    raise AmalgamationError(
                        f'include/{rel}:{lineno}: quoted include "{target}" is not a pulley '
                        'header; use <...> for other libraries')
                if target not in self.seen:
                    out.extend(self.header(target, f"include/{rel}:{lineno}"))
                continue
            out.append(line if line.endswith("\n") else line + "\n")
        out.append(f"// ---- end {rel} ----\n")
        self.stack.pop()
        return out


def generate(root: Path, entries: list[str], what: str) -> str:
    amalgamator = Amalgamator(root / "include")
    body = []
    for entry in entries:
        if entry not in amalgamator.seen:
            body.extend(amalgamator.header(entry, None))
    sources = " and ".join(f"include/{e}" for e in entries)
    banner = [
        "// SPDX-License-Identifier: MIT\n",
        "//\n",
        f"// pulley {project_version(root)} - single-header edition: {what}.\n",
        "//\n",
        f"// GENERATED FILE - DO NOT EDIT. It is {sources} with every\n",
        "// pulley header inlined, produced by scripts/amalgamate.py; edit the headers\n",
        "// under include/ and rerun the script.\n",
        "#pragma once\n",
        "\n",
    ]
    # Collapse runs of blank lines left where includes and pragmas were removed.
    lines: list[str] = []
    for line in banner + body:
        if line.strip() == "" and lines and lines[-1].strip() == "":
            continue
        lines.append(line)
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; fail if the file on disk differs from a fresh run")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="source tree root (default: this script's parent's parent)")
    args = parser.parse_args()

    root = args.root.resolve()
    status = 0
    for name, (entries, what) in SINGLE_HEADERS.items():
        status = max(status, process(root, Path("single_include") / name, entries, what,
                                     args.check))
    return status


def process(root: Path, relative: Path, entries: list[str], what: str, check: bool) -> int:
    output = root / relative
    try:
        text = generate(root, entries, what)
    except AmalgamationError as e:
        print(f"amalgamate.py: error: {e}", file=sys.stderr)
        return 2

    if check:
        current = output.read_text(encoding="utf-8") if output.is_file() else None
        if current == text:
            print(f"{relative} is up to date")
            return 0
        if current is None:
            print(f"error: {relative} does not exist.", file=sys.stderr)
        else:
            print(f"error: {relative} is out of date with include/:", file=sys.stderr)
            diff = list(difflib.unified_diff(current.splitlines(keepends=True),
                                             text.splitlines(keepends=True),
                                             f"{relative} (on disk)", f"{relative} (expected)"))
            sys.stderr.writelines(diff[:40])
            if len(diff) > 40:
                print(f"... ({len(diff) - 40} more diff lines)", file=sys.stderr)
        print("Regenerate it with:  python3 scripts/amalgamate.py", file=sys.stderr)
        return 1

    output.parent.mkdir(parents=True, exist_ok=True)
    if output.is_file() and output.read_text(encoding="utf-8") == text:
        print(f"{relative} is already up to date")
        return 0
    with open(output, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    print(f"wrote {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
