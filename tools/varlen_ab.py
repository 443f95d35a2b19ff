"""A/B probe of the packed forward: several cuflash trees on the varlen suite's batches, interleaved in one process.

``python tools/varlen_ab.py --trees base,new --rounds 5 --dims 64,128``: each tree is a directory holding a
``cuflash`` package (``git archive REV cuflash | tar -x -C exp/base``), imported under its own module name (as
``tools/ab_probe.py`` does). Every round times each tree's ``attention_varlen`` forward, their order rotated per
round, on the varlen suite's batches (``bench.varlen.BATCHES``: 16384 tokens, bfloat16, heads x head_dim = 2048),
causal and not, as ``bench.timing.EventTimer`` does (repeats back to back, the L2 flushed before each); then the
first tree's dense call on the batch padded to its longest sequence. Checks that the trees' outputs are equal bit
for bit (a change of the walk's order must not change a result), and prints the median ms per tree.
``--persistent`` adds each tree once more as ``TREE+persistent``, its Hopper forward on the persistent grid
whatever the keys (``_config.wgmma_forward_persistent``). Run from the repository root with ``PYTHONPATH=.``. The
numbers that count come from ``python -m bench varlen``.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from ab_probe import load_tree
from bench.timing import EventTimer
from bench.varlen import BATCHES, VARLEN_DTYPE, VARLEN_MODEL_DIM, PackedInputs


def draw(*shape):
    """Standard-normal values of ``shape`` in the varlen suite's dtype (the dense call's padded batch)."""
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(VARLEN_DTYPE)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", required=True, help="comma-separated directories, each holding a cuflash package")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dims", default="64,128", help="comma-separated head dims")
    parser.add_argument("--persistent", action="store_true",
                        help="also each tree with its Hopper forward on the persistent grid at any length")
    args = parser.parse_args()
    paths = args.trees.split(",")
    trees = {path: load_tree(f"cuflash_tree{i}", path) for i, path in enumerate(paths)}
    if args.persistent:
        for i, path in enumerate(paths):
            module = load_tree(f"cuflash_persistent{i}", path)
            module._config.wgmma_forward_persistent = lambda *keys: True
            trees[f"{path}+persistent"] = module
    dims = [int(d) for d in args.dims.split(",")]
    timer = EventTimer(warmup=2, repeats=10)
    ms: dict[tuple, list[float]] = {}
    for round_ in range(args.rounds):
        names = list(trees)
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for head_dim in dims:
            heads = VARLEN_MODEL_DIM // head_dim
            for batch_name, lengths in BATCHES.items():
                inputs = PackedInputs(lengths, heads, head_dim, seed=round_)
                q, k, v, cu, longest = inputs.q, inputs.k, inputs.v, inputs.cu, inputs.longest
                dense = [draw(len(lengths), longest, heads, head_dim) for _ in range(3)]
                for causal in (False, True):
                    outs = []
                    for name in order:
                        def packed(module=trees[name]):
                            return module.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
                        outs.append(packed())
                        ms.setdefault((head_dim, batch_name, causal, name), []).append(float(np.median(timer(packed))))
                    assert all(bool(cp.array_equal(outs[0], out)) for out in outs[1:]), (head_dim, batch_name, causal)
                    first = trees[names[0]]
                    ms.setdefault((head_dim, batch_name, causal, "dense"), []).append(
                        float(np.median(timer(lambda: first.attention(*dense, causal=causal)))))
        print(f"round {round_}", flush=True)
    for head_dim in dims:
        for batch_name in BATCHES:
            for causal in (False, True):
                line = f"d={head_dim} {batch_name:9s} causal={int(causal)}:"
                for name in list(trees) + ["dense"]:
                    line += f" {name} {np.median(ms[head_dim, batch_name, causal, name]):.3f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
