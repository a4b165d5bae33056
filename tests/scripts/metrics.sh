#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A job of real processes (2 ps, 2 workers, a chief; sync R = N) with --metrics-file and
# --metrics-port: while it trains, curl scrapes every task's port (task i at PORT + i) and
# finds its figures; at the end every task's file holds JSON lines whose last figures add up
# (the ps took 2 pushes a step, the workers stepped to the last step, the chief's accuracy
# is the printed one), the chief printed progress lines, and scripts/plot_metrics.py draws
# the files.
#   tests/scripts/metrics.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
command -v curl >/dev/null || fail "curl is not installed (scripts/setup.sh installs it)"

# Five consecutive free ports for the tasks' endpoints.
base=$(free_port_run 5)
[ -n "$base" ] || fail "found no 5 consecutive free ports"

# (10 epochs: 3 s or more of training here, so that a progress line falls within it)
start_job "$work" "$binary" 2 2 --epochs 10 --metrics-file "$work/{task}.jsonl" --metrics-port "$base" \
  --metrics-interval-ms 300 --progress-secs 1
# ps tasks at base + 0, 1; the chief at base + 2; the workers at base + 3, 4.
declare -A expect=([0]=pulley_pushes_taken [1]=pulley_apply_seconds [2]=pulley_examples_per_s
                   [3]=pulley_loss [4]=pulley_staleness)
declare -A task=([0]=ps:0 [1]=ps:1 [2]=chief [3]=worker:0 [4]=worker:1)
for i in 0 1 2 3 4; do
  found=""
  for _ in $(seq 1 300); do
    if curl -s --max-time 2 "http://127.0.0.1:$((base + i))/metrics" >"$work/scrape-$i.txt" &&
       grep -q "^${expect[$i]}{task=\"${task[$i]}\"} [0-9]" "$work/scrape-$i.txt"; then
      found=yes
      break
    fi
    sleep 0.05
  done
  [ -n "$found" ] || fail "port $((base + i)) never served ${expect[$i]} of ${task[$i]}: $(head -c 400 "$work/scrape-$i.txt")"
  echo "scraped ${task[$i]} on port $((base + i)): $(grep -c '^pulley_' "$work/scrape-$i.txt") samples, e.g. $(grep "^${expect[$i]}{" "$work/scrape-$i.txt")"
done
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$base/elsewhere")
[ "$code" = 404 ] || fail "a path other than /metrics got $code, not 404"
finish_job "metrics" 200

python3 - "$work" <<'PY' || fail "the metrics files do not add up"
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
last = {}
for name in ["ps-0", "ps-1", "chief-0", "worker-0", "worker-1"]:
    lines = [json.loads(l) for l in (work / f"{name}.jsonl").read_text().splitlines()]
    assert len(lines) >= 2, f"{name}: {len(lines)} lines"
    for l in lines:
        last[l["task"]] = l
steps = 10 * 468
for ps in ["ps:0", "ps:1"]:
    assert last[ps]["global_step"] == steps, last[ps]
    assert last[ps]["pushes_taken"] == 2 * steps, last[ps]
    assert last[ps]["bytes_in"] > 0 and last[ps]["bytes_out"] > 0, last[ps]
    assert last[ps]["workers_lost"] == 0, last[ps]
for w in ["worker:0", "worker:1"]:
    assert last[w]["steps"] == steps, last[w]
    assert 0 < last[w]["loss"] < 1.0, last[w]
    assert last[w]["staleness"] == 0, last[w]  # sync R = N
chief = last["chief"]
assert chief["global_step"] == steps and chief["evaluation_step"] == steps, chief
final = [l for l in (work / "chief-0.log").read_text().splitlines() if l.startswith("final:")][0]
printed = float(final.split("test_accuracy=")[1].split()[0])
assert abs(chief["test_accuracy"] - printed) < 1e-4, (chief, final)
print(f"files add up: {steps} steps, {last['ps:0']['pushes_taken']} pushes on ps 0, test_accuracy {chief['test_accuracy']:.4f}")
PY
grep -Eq 'chief: global step [0-9]+ of 4680 \(epoch [0-9]+ of 10\)' "$work/chief-0.log" || fail "the chief printed no progress line"
grep -E 'chief: global step' "$work/chief-0.log" | head -2
python3 "$root/scripts/plot_metrics.py" "$work"/*.jsonl -o "$work/metrics.png" || fail "plot_metrics.py failed"
[ "$(head -c 8 "$work/metrics.png" | od -An -tx1 | tr -d ' ')" = 89504e470d0a1a0a ] || fail "no PNG was written"
echo "PASS"
