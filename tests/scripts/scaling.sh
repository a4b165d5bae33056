#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# benchmarks/scaling.py: its cost model recovers the constants of rows made from known ones;
# a short sweep of real processes (--quick) measures what a ps job moves per worker-step
# (its push and its pull: 2 x the model, plus framing), and the model and the plots are made
# from it.
#   tests/scripts/scaling.sh FASHION_MNIST_BINARY
set -uo pipefail
binary=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Debian's python3 has numpy and matplotlib (scripts/setup.sh); another one on PATH may not.
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3
"$py" -c "import numpy, matplotlib" || fail "$py lacks numpy or matplotlib (scripts/setup.sh installs them)"

"$py" - "$root/benchmarks" <<'PY' || fail "the cost model does not recover known constants"
import sys
sys.path.insert(0, sys.argv[1])
import scaling
# Rows made by a model of known constants; the fit must find them again.
true = scaling.Model.__new__(scaling.Model)
true.cores, true.c, true.g, true.u = 2, (1e-6, 6e-11), (2e-5, 1e-9), (1e-5, 1.5e-9)
true.k, true.o = 2e-9, {"sync": 3e-4, "async": 5e-5}
rows = []
for h in (128, 512, 2048, 8192):
    m = scaling.parameters(h)
    for n in (1, 2):
        step = n * scaling.BATCH * (true.c[0] + true.c[1] * m) + true.g[0] + true.g[1] * m + true.update(m)
        rows.append({"mode": "plain", "workers": n, "parameters": m, "samples_per_s": n * scaling.BATCH / step,
                     "update_s": true.update(m)})
for mode in ("sync", "async"):
    for n, h in ((1, 128), (2, 128), (4, 128), (8, 128), (2, 2048), (2, 8192)):
        row = {"mode": mode, "workers": n, "ps": 2, "parameters": scaling.parameters(h)}
        row["samples_per_s"] = true.host(row)
        rows.append(row)
fitted = scaling.Model(rows, 2)
assert abs(fitted.k / true.k - 1) < 1e-3, (fitted.k, true.k)
for mode in ("sync", "async"):
    assert abs(fitted.o[mode] / true.o[mode] - 1) < 1e-3, (mode, fitted.o, true.o)
for r in rows[8:]:
    assert abs(fitted.host(r) / r["samples_per_s"] - 1) < 1e-3, r
# The cluster's arithmetic: sync 64 x 16 with the ps links the bound moves N 4 M / P bytes
# each way per step through a ps link.
m, beta = scaling.parameters(8192), 1.25e9
p = fitted.cluster("sync", 64, 16, m, beta)
assert p["bound"] == "ps links" and abs(p["transfer"] - 2 * max(64 * 4 * m / 16 / beta, 64 * 4 * m / 16 * fitted.k / 2)) < 1e-9, p
print(f"the fit recovers k = {fitted.k:.3g} (made with {true.k:.3g}), o = {fitted.o}")
PY

csv=$work/scaling.csv
"$py" "$root/benchmarks/scaling.py" run --quick --seconds 2 --binary "$binary" --out "$csv" > "$work/run.log" 2>&1 ||
  { cat "$work/run.log"; fail "scaling.py run --quick failed"; }
cat "$work/run.log"
"$py" - "$csv" <<'PY' || fail "the sweep's rows are wrong"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 7, len(rows)
for r in rows:
    assert float(r["samples_per_s"]) > 0 and int(r["steps"]) >= 10, r
    if r["mode"] == "plain":
        assert float(r["update_s"]) > 0, r
        continue
    steps = int(r["steps"]) * (int(r["workers"]) if r["mode"] == "sync" else 1)
    per = float(r["wire_bytes"]) / steps / (4 * int(r["parameters"]))
    # A worker pushes the model's gradient and pulls the model each step: 2 x, plus the
    # framing, headers, handshakes and the chief's reads.
    assert 2.0 <= per < 2.3, (r, per)
print("the rows add up: each worker-step moved 2.0-2.3 x the model")
PY
"$py" "$root/benchmarks/scaling.py" model "$csv" > "$work/model.txt" || fail "scaling.py model failed"
grep -q "predicted: 64 workers x 16 ps" "$work/model.txt" || fail "no prediction: $(cat "$work/model.txt")"
head -3 "$work/model.txt"
"$py" "$root/benchmarks/scaling.py" plot "$csv" -o "$work/plots" || fail "scaling.py plot failed"
for png in workers model cluster; do
  [ "$(head -c 8 "$work/plots/$png.png" | od -An -tx1 | tr -d ' ')" = 89504e470d0a1a0a ] || fail "no $png.png"
done
echo "PASS"
