#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Renders the diagrams of docs/ from their text sources (docs/*.dot, Graphviz) into SVG,
# each stamped with the SHA-256 of its source: `--check` (ctest docs.diagrams) fails when a
# committed SVG was not rendered from the source beside it.
#   bash scripts/render_docs.sh            # (re)render; installs graphviz when missing
#   bash scripts/render_docs.sh --check
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
check=0
[[ ${1:-} == --check ]] && check=1
status=0
for source in "$root"/docs/*.dot; do
  svg=${source%.dot}.svg
  stamp="<!-- rendered from $(basename "$source") sha256:$(sha256sum "$source" | cut -d' ' -f1) -->"
  if ((check)); then
    if ! grep -qF -- "$stamp" "$svg" 2>/dev/null; then
      echo "render_docs: $(basename "$svg") is not rendered from $(basename "$source"): run bash scripts/render_docs.sh" >&2
      status=1
    fi
    continue
  fi
  if ! command -v dot >/dev/null 2>&1; then
    sudo=()
    [[ $(id -u) -ne 0 ]] && sudo=(sudo)
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends graphviz </dev/null
  fi
  { dot -Tsvg "$source"; echo "$stamp"; } > "$svg"
  echo "wrote $svg"
done
exit "$status"
