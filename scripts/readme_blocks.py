#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Extract every ```cpp block of README.md into its own translation unit.

Each block becomes <out>/readme_block_<n>.cpp: a `#line` directive pointing at the block's
first line in README.md, then the block exactly as printed, so that a compiler error names
the README line. Files are rewritten only when their text changes (no needless rebuilds).
The paths written are printed, one per line, for CMake.

    python3 scripts/readme_blocks.py README.md build/readme
"""

from __future__ import annotations

import sys
from pathlib import Path


def blocks(text: str) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```cpp":
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise SystemExit(f"README.md:{i + 1}: a ```cpp block is never closed")
            found.append((start + 1, "".join(lines[start:j])))
            i = j
        i += 1
    return found


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    readme, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for n, (line, body) in enumerate(blocks(readme.read_text(encoding="utf-8")), start=1):
        path = out / f"readme_block_{n}.cpp"
        text = f'#line {line} "{readme}"\n{body}'
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        print(path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
