"""A/B probe of decoding: several cuflash trees' ``attention_with_kvcache``, SDPA's backends and a copy of the cache,
interleaved in one process.

``python tools/decode_ab.py --trees base,new --rounds 3 --shapes 64:1:4096:32:8,1:1:1024:32:8``: each tree is a
directory holding a ``cuflash`` package (as for tools/ab_probe.py), imported under its own module name; a shape is
``batch:seqlen_q:keys:heads:heads_kv`` at the decode suite's head_dim and dtype (``bench.decode.DecodeInputs``: every
sequence fills its cache, non-causal, a paged copy of 256-key pages in shuffled order). Each tree runs at every
``--splits`` (0: the plan's choice) and, with ``--paged``, on the paged copy at the plan's; ``--peers`` adds
SDPA's backends and the copy (``bench.decode.make_call``'s names). Every round times each run once per shape, as
``bench.decode.gpu_ms`` does (L2 flushed, the call behind a spin kernel: GPU time without the host's launch work),
the runs' order rotated per round, on the same inputs. The first round also checks each tree's output against the
first tree's at the plan's splits (the largest difference, printed). Prints the median GPU microseconds per shape
and run and the ratio to the first tree's plan; each timing goes to stderr as it is taken. Run from the repository
root with ``PYTHONPATH=.``; the numbers that count come from ``python -m bench decode``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_probe import load_tree  # noqa: E402

from bench.decode import DECODE_HEAD_DIM, DecodeInputs, gpu_ms, make_call  # noqa: E402
from bench.records import Shape  # noqa: E402
from bench.timing import L2_FLUSH_BYTES  # noqa: E402


def parse_shape(text: str) -> Shape:
    batch, seqlen_q, keys, heads, heads_kv = (int(x) for x in text.split(":"))
    return Shape(batch, seqlen_q, keys, heads, heads_kv, DECODE_HEAD_DIM)


def runs_of(trees: dict, x: DecodeInputs, splits: list[int], paged: bool, peers: list[str]) -> list[tuple]:
    """(name, zero-argument call returning out) of every run on inputs ``x``."""
    runs = []
    for name, module in trees.items():
        for s in splits:
            runs.append((f"{name} splits={s}", lambda m=module, s=s: m.attention_with_kvcache(
                x.q, x.k_cache, x.v_cache, cache_seqlens=x.lengths, num_splits=s)))
        if paged:
            runs.append((f"{name} paged", lambda m=module: m.attention_with_kvcache(
                x.q, x.k_pages, x.v_pages, cache_seqlens=x.lengths, block_table=x.block_table)))
    runs += [(peer, lambda call=make_call(peer, x): call()[0]) for peer in peers]
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", required=True, help="comma-separated directories, each holding a cuflash package")
    parser.add_argument("--shapes", required=True, help="comma-separated batch:seqlen_q:keys:heads:heads_kv")
    parser.add_argument("--splits", default="0", help="comma-separated num_splits of each tree (0: the plan's)")
    parser.add_argument("--paged", action="store_true", help="each tree on the paged cache too")
    parser.add_argument("--peers", default="torch-cudnn",
                        help="comma-separated bench.decode peers (torch-cudnn, torch-flash, copy), or none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    trees = {path: load_tree(f"cuflash_tree{i}", path) for i, path in enumerate(args.trees.split(","))}
    splits = [int(s) for s in args.splits.split(",")]
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    flush_buffer = cp.empty(L2_FLUSH_BYTES, cp.uint8)

    def flush():
        flush_buffer.fill(0)

    start = time.perf_counter()
    us: dict[tuple[str, str], list[float]] = {}
    names: dict[str, list[str]] = {}
    for text in args.shapes.split(","):
        x = DecodeInputs(parse_shape(text))
        runs = runs_of(trees, x, splits, args.paged, peers)
        names[text] = [name for name, _ in runs]
        first = None
        for name, module in trees.items():   # each tree's out at the plan's splits against the first tree's
            out = module.attention_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.lengths)
            if first is None:
                first = out
            else:
                diff = float(cp.abs(out.astype(cp.float32) - first.astype(cp.float32)).max())
                print(f"{text}: {name} out differs from the first tree's by {diff:.3g} at most", flush=True)
        for round_ in range(args.rounds):
            order = runs[round_ % len(runs):] + runs[:round_ % len(runs)]
            for name, fn in order:
                value = float(np.median(gpu_ms(fn, 2, args.repeats, flush))) * 1000
                us.setdefault((text, name), []).append(value)
                print(f"[{time.perf_counter() - start:7.1f} s] round {round_} {text}: {name} {value:.1f} us",
                      file=sys.stderr, flush=True)
        del x, runs, first
        cp.get_default_memory_pool().free_all_blocks()
    for text, run_names in names.items():
        base = float(np.median(us[text, run_names[0]]))
        line = f"{text}:"
        for name in run_names:
            value = float(np.median(us[text, name]))
            line += f" | {name} {value:.1f} ({value / base:.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
