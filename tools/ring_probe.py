"""What a step of ring attention costs on one GPU beside its attention: the merge of the step's part into the
float32 state (kernels/merge.cu, merge_into), and the ring at world size 1 against attention itself.

``python tools/ring_probe.py [--shards 16384 65536] [--heads 32] [--head-dim 128]``. For each shard length (the
tokens a rank holds), bfloat16, batch 1: ms of a step's attention (the rank's queries against a whole shard of
keys, non-causal: the work of a step off the diagonal at a full shard), of the merge of its output into the state,
and the merge's share of the two; then ms of ``ring_attention`` on a local group of one against ``attention``
(equal: the same call). The scaling suite (``python -m bench scaling``) measures the ring across GPUs.
"""

from __future__ import annotations

import argparse

import cupy as cp

import cuflash
from cuflash import distributed

from speed_probe import time_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    comm = distributed.local_communicators(1)[0]
    print(f"{'shard':>7} {'attention ms':>13} {'merge ms':>9} {'merge share':>12} {'ring(1) ms':>11} {'attn ms':>8}")
    for shard in args.shards:
        rng = cp.random.default_rng(0)
        shape = (1, shard, args.heads, args.head_dim)
        q, k, v = (rng.standard_normal(shape, dtype=cp.float32).astype(cp.dtype("bfloat16")) for _ in range(3))
        part, part_lse = cuflash.attention(q, k, v, return_lse=True)
        acc = cp.zeros(shape, cp.float32)
        acc_lse = cp.full((1, args.heads, shard), -cp.inf, cp.float32)
        step = time_ms(lambda: cuflash.attention(q, k, v, return_lse=True))
        merge = time_ms(lambda: distributed._merge_into(cp, acc, acc_lse, slice(0, shard), part, part_lse))
        ring = time_ms(lambda: distributed.ring_attention(q, k, v, comm, causal=True))
        plain = time_ms(lambda: cuflash.attention(q, k, v, causal=True))
        print(f"{shard:>7} {step:>13.3f} {merge:>9.3f} {merge / (step + merge):>12.1%} {ring:>11.3f} {plain:>8.3f}")


if __name__ == "__main__":
    main()
