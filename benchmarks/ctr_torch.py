#!/usr/bin/env python3
"""A single-process PyTorch peer of pulley's CTR example, for the comparisons in BENCHMARKS.md.

It trains the same wide-and-deep click model as examples/ctr (wide_deep.hpp) on the same
data files that `build/examples/ctr` writes (data.hpp: train.bin and test.bin under
<data-dir>/v<vocabulary>-n<train-examples>-t<test-examples>/), with the same optimizers
(Adagrad for the tables, Adam for the MLP), and ends on one line shaped like the example's:

    final: auc=... logloss=... samples_per_s=... threads=...

It never generates data: run `build/examples/ctr` once with the same --data-dir and sizes
to write the files (it says how when they are missing).

Usage (Debian's python3-torch; not the pyenv python3 that may shadow it):

    /usr/bin/python3 benchmarks/ctr_torch.py                      # the example's defaults
    /usr/bin/python3 benchmarks/ctr_torch.py --threads 2 --batch 256
    /usr/bin/python3 benchmarks/ctr_torch.py --data-dir /tmp/small --train-examples 20000 \\
        --test-examples 2000 --max-examples 10000 --threads 1      # a quick check

The model, as wide_deep.hpp has it:
    logit = out_bias + sum_f wide[id_f] + out(ReLU(hidden([dense, emb_1..emb_26, dots])))
  - wide: one weight per (field, value), zeros; emb: 16 floats per (field, value),
    uniform(-0.05, 0.05);
  - dots: <emb_f, emb_g> for the 325 field pairs f < g, in row-major order;
  - hidden: 754 -> 64, ReLU; out: 64 -> 1; Glorot-uniform kernels, zero biases;
  - loss: mean sigmoid cross-entropy over the batch.
  - Adagrad (lr 0.1, initial accumulator 0.001, epsilon 1e-7) on the tables' rows, sparse:
    only the rows a batch uses move; Adam (lr 1e-3, betas 0.9/0.999, epsilon 1e-7) on the MLP.

Unlike pulley's tables (hash maps keyed by ctr::id_of(field, value), a 64-bit hash of
field << 32 | value), the tables here are dense nn.Embedding(sparse=True) tables of
fields x vocabulary rows, row field * vocabulary + value: the same one-row-per-(field, value)
map, allocated up front. A row no batch touched keeps its initial value in both.

Sync R = N with 2 workers (the example's default) is emulated by --replicas (default 2):
each global batch of --batch examples is R per-worker batches of batch / R examples, taken
as pulley's workers take them (worker r reads the r-th contiguous block of the training
examples, in order), and the gradients are aggregated as pulley aggregates them: the MLP's
is the mean over the replicas (the mean loss of the whole batch), each table row's is the
mean over the replicas whose batch held that row of their batch-mean gradients (pulley's
RowMean, TensorFlow's SparseConditionalAccumulator 'MEAN'). So --batch 256 --replicas 2
matches `build/examples/ctr` (batch 128 per worker, 2 workers, sync), and --replicas 1 is
plain PyTorch (every row's gradient that of the batch's mean loss; for a row only one
replica's batch holds that is half pulley's, which matters with Adagrad's small initial
accumulator).

Differences that remain:
  - initial values: the same distributions from a different generator (torch.manual_seed(seed)
    instead of pulley's per-name and per-id SplitMix64 hashes);
  - Adam: PyTorch adds epsilon to sqrt(v_hat), TensorFlow's form (pulley's) to sqrt(v);
    with epsilon 1e-7 the two differ only while sqrt(v) is near 1e-7;
  - samples_per_s counts the training steps' time only (from the first step to the last,
    without the quarter-epoch evaluations); pulley's counts from the chief's initialization
    to the last step, its quarter-epoch evaluations included (they run on the chief beside
    the workers);
  - one process and --threads intra-op threads; pulley runs 2 ps, 2 workers and a chief as
    threads of one process.
"""

import argparse
import os
import sys
import time

# numpy's OpenBLAS would otherwise start a thread per core that spins beside torch's own
# (--threads): measured here, two torch threads ran at 13.9 k samples/s with them and
# 23.2 k without (one thread: 24.5 k with them, 15.8-18.9 k without, on a host whose speed
# drifts that much). Set before numpy is imported; an explicit setting in the environment
# wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from torch import nn

DENSE = 13  # ctr::kDense
FIELDS = 26  # ctr::kFields
DIM = 16  # WideDeep::kDim
PAIRS = FIELDS * (FIELDS - 1) // 2
HIDDEN = 64  # WideDeep::kHidden
MAGIC = b"PLYCTR01"  # ctr::kMagic
# One example as ctr::write lays it out, packed, little-endian: 157 bytes.
RECORD = np.dtype([("label", "u1"), ("dense", "<f4", (DENSE,)), ("value", "<u4", (FIELDS,))])
assert RECORD.itemsize == 1 + 4 * DENSE + 4 * FIELDS


def data_dir_of(args):
    """Where examples/ctr/main.cpp keeps the files: <data-dir>/v<V>-n<N>-t<T> (the seed is
    not part of the name). A --data-dir that holds train.bin itself is taken as it is."""
    if os.path.exists(os.path.join(args.data_dir, "train.bin")):
        return args.data_dir
    return os.path.join(args.data_dir, f"v{args.vocabulary}-n{args.train_examples}-t{args.test_examples}")


def read_examples(path, vocabulary, limit=None):
    """Reads a file ctr::write wrote: 'PLYCTR01', a uint64 count, then count records of a
    label byte, 13 float32 dense features and 26 uint32 values. Returns the labels (float32),
    the dense features (float32, n x 13) and each field's table row (n x 26, field * V + value)."""
    with open(path, "rb") as f:
        header = f.read(16)
    if len(header) != 16 or header[:8] != MAGIC:
        sys.exit(f"{path} is not a ctr data file")
    n = int.from_bytes(header[8:16], "little")
    if os.path.getsize(path) != 16 + n * RECORD.itemsize:
        sys.exit(f"{path} is truncated or has trailing bytes")
    records = np.memmap(path, dtype=RECORD, mode="r", offset=16, shape=(n,))
    if limit is not None:
        records = records[:limit]
    labels = (records["label"] != 0).astype(np.float32)
    dense = np.ascontiguousarray(records["dense"], dtype=np.float32)
    index = np.int32 if FIELDS * vocabulary < 2**31 else np.int64
    rows = np.empty((len(records), FIELDS), dtype=index)
    offsets = (np.arange(FIELDS, dtype=np.int64) * vocabulary).astype(index)
    for start in range(0, len(records), 1 << 20):  # in chunks: the values are read once
        values = np.asarray(records["value"][start:start + (1 << 20)])
        if values.size and int(values.max()) >= vocabulary:
            sys.exit(f"{path} holds value {int(values.max())}, not below --vocabulary {vocabulary}")
        rows[start:start + len(values)] = values.astype(index) + offsets
    return torch.from_numpy(labels), torch.from_numpy(dense), torch.from_numpy(rows)


class WideDeep(nn.Module):
    """wide_deep.hpp's model: logit = out_bias + sum of wide rows + MLP([dense, embeddings, dots])."""

    def __init__(self, rows):
        super().__init__()
        self.wide = nn.Embedding(rows, 1, sparse=True)
        self.emb = nn.Embedding(rows, DIM, sparse=True)
        self.hidden = nn.Linear(DENSE + FIELDS * DIM + PAIRS, HIDDEN)
        self.out = nn.Linear(HIDDEN, 1)
        nn.init.zeros_(self.wide.weight)
        nn.init.uniform_(self.emb.weight, -0.05, 0.05)
        # Glorot uniform with fan_in = in, fan_out = out, as pulley's kernels [in, out]
        for layer in (self.hidden, self.out):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
        f, g = torch.triu_indices(FIELDS, FIELDS, offset=1)  # f < g, row-major as the C++ loops
        self.register_buffer("pair_f", f, persistent=False)
        self.register_buffer("pair_g", g, persistent=False)

    def forward(self, dense, rows, row_scale=None):
        """Logits of a batch; `row_scale` (batch x 26 x 1), if given, scales the gradient that
        reaches each looked-up row (RowMean's division by the replicas that held it)."""
        e = self.emb(rows)  # batch x 26 x 16
        w = self.wide(rows)  # batch x 26 x 1
        if row_scale is not None and torch.is_grad_enabled():
            e.register_hook(lambda grad: grad * row_scale)
            w.register_hook(lambda grad: grad * row_scale)
        dots = torch.bmm(e, e.transpose(1, 2))[:, self.pair_f, self.pair_g]  # batch x 325
        x = torch.cat([dense, e.flatten(1), dots], dim=1)  # batch x 754
        h = torch.relu(self.hidden(x))
        return self.out(h).squeeze(1) + w.sum(dim=(1, 2))


def auc(scores, labels):
    """The area under the ROC curve, ties counted half (ctr::auc)."""
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order] > 0.5
    first = np.r_[True, s[1:] != s[:-1]]
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(s)]
    mid_rank = 0.5 * (starts + ends + 1)  # 1-based average rank of each run of ties
    ranks = mid_rank[np.cumsum(first) - 1]
    positives = float(y.sum())
    negatives = len(s) - positives
    if positives == 0 or negatives == 0:
        return 0.5
    return (ranks[y].sum() - positives * (positives + 1) / 2) / (positives * negatives)


def evaluate(model, labels, dense, rows, batch=8192):
    """AUC and mean log loss of the model on held-out examples."""
    with torch.no_grad():
        logits = torch.cat([model(dense[i:i + batch], rows[i:i + batch].long())
                            for i in range(0, len(labels), batch)]).double()
    y = labels.double()
    logloss = nn.functional.binary_cross_entropy_with_logits(logits, y).item()
    return auc(logits.numpy(), labels.numpy()), logloss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="/tmp/pulley-ctr", help="the ctr example's --data-dir")
    p.add_argument("--train-examples", type=int, default=4_000_000, help="names the files, as the ctr example's")
    p.add_argument("--test-examples", type=int, default=200_000, help="names the files, as the ctr example's")
    p.add_argument("--vocabulary", type=int, default=400_000, help="values per field: the tables' rows per field")
    p.add_argument("--seed", type=int, default=1, help="of the initial values (and the command that writes the files)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--batch", type=int, default=256, help="examples per global step (2 workers x 128 in the example)")
    p.add_argument("--replicas", type=int, default=2, help="sync replicas emulated per step (1: plain PyTorch)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--table-learning-rate", type=float, default=0.1)
    p.add_argument("--table-initial-accumulator", type=float, default=0.001)
    p.add_argument("--dense-learning-rate", type=float, default=0.001)
    p.add_argument("--progress", type=int, default=4, help="progress lines per epoch, each with an AUC on a tenth of the held-out examples")
    p.add_argument("--max-examples", type=int, default=None, help="train on this prefix of train.bin only")
    args = p.parse_args()
    if args.batch % args.replicas != 0:
        sys.exit("--batch must be a multiple of --replicas")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    directory = data_dir_of(args)
    train_path, test_path = os.path.join(directory, "train.bin"), os.path.join(directory, "test.bin")
    if not (os.path.exists(train_path) and os.path.exists(test_path)):
        sys.exit(f"no {train_path} and {test_path}: write them once (this trains the pulley model too) with\n"
                 f"  build/examples/ctr --data-dir {args.data_dir} --train-examples {args.train_examples} "
                 f"--test-examples {args.test_examples} --vocabulary {args.vocabulary} --seed {args.seed}")

    start = time.perf_counter()
    train_y, train_dense, train_rows = read_examples(train_path, args.vocabulary, args.max_examples)
    test_y, test_dense, test_rows = read_examples(test_path, args.vocabulary)
    print(f"read {len(train_y)} training and {len(test_y)} held-out examples from {directory} "
          f"in {time.perf_counter() - start:.1f} s", flush=True)

    rows = FIELDS * args.vocabulary
    model = WideDeep(rows)
    tables = torch.optim.Adagrad([model.wide.weight, model.emb.weight], lr=args.table_learning_rate,
                                 initial_accumulator_value=args.table_initial_accumulator, eps=1e-7)
    mlp = torch.optim.Adam([*model.hidden.parameters(), *model.out.parameters()],
                           lr=args.dense_learning_rate, eps=1e-7)

    replicas, per_replica = args.replicas, args.batch // args.replicas
    block = len(train_y) // replicas // per_replica * per_replica  # each worker's contiguous block
    steps_per_epoch = block // per_replica
    if steps_per_epoch == 0:
        sys.exit("fewer examples per replica than one batch")
    last_step = steps_per_epoch * args.epochs
    every = max(1, steps_per_epoch // max(args.progress, 1)) if args.progress > 0 else 0
    quick = max(len(test_y) // 10, 1)
    print(f"training wide-and-deep (PyTorch {torch.__version__}, dense nn.Embedding tables of "
          f"{FIELDS} x {args.vocabulary} = {rows} rows, sparse gradients) on {len(train_y)} examples: "
          f"batch {args.batch} ({replicas} sync replicas of {per_replica}), {args.epochs} epochs "
          f"({last_step} steps), {args.threads} threads", flush=True)

    loss_fn = nn.BCEWithLogitsLoss(reduction="sum")
    train_seconds, step = 0.0, 0
    for _ in range(args.epochs):
        for k in range(steps_per_epoch):
            began = time.perf_counter()
            parts = [slice(r * block + k * per_replica, r * block + (k + 1) * per_replica) for r in range(replicas)]
            if replicas == 1:
                y, dense, idx = train_y[parts[0]], train_dense[parts[0]], train_rows[parts[0]].long()
                row_scale = None
            else:
                y = torch.cat([train_y[s] for s in parts])
                dense = torch.cat([train_dense[s] for s in parts])
                idx = torch.cat([train_rows[s] for s in parts]).long()
                # RowMean: each row's gradient is divided by the replicas whose batch held it
                held = torch.cat([torch.unique(idx[r * per_replica:(r + 1) * per_replica]) for r in range(replicas)])
                ids, count = torch.unique(held, return_counts=True)
                row_scale = (1.0 / count.float())[torch.searchsorted(ids, idx)].unsqueeze(2)
            # Each replica's mean loss, summed over the replicas: the tables' rows get the sum of
            # the replicas' gradients (scaled by row_scale to their mean); the MLP's, divided
            # by R below, is their mean.
            loss = loss_fn(model(dense, idx, row_scale), y) / per_replica
            tables.zero_grad(set_to_none=True)
            mlp.zero_grad(set_to_none=True)
            loss.backward()
            if replicas > 1:
                for q in (*model.hidden.parameters(), *model.out.parameters()):
                    q.grad.div_(replicas)
            tables.step()
            mlp.step()
            step += 1
            train_seconds += time.perf_counter() - began
            if every and step % every == 0 and step < last_step:
                a, _ = evaluate(model, test_y[:quick], test_dense[:quick], test_rows[:quick])
                print(f"step {step} of {last_step}: auc {a:.4f} on {quick} held-out examples, "
                      f"{step * args.batch / train_seconds:.0f} samples/s, {train_seconds:.1f} s", flush=True)

    a, logloss = evaluate(model, test_y, test_dense, test_rows)
    print(f"trained {step} steps in {train_seconds:.1f} s")
    print(f"final: auc={a:.4f} logloss={logloss:.4f} samples_per_s={step * args.batch / train_seconds:.0f} "
          f"threads={args.threads}", flush=True)


if __name__ == "__main__":
    main()
