"""The Hopper backward's dK/dV grid in its two band orders, in one process: the backward as planned against the
same backward on the wave-sized bands, or on one (batch, kv head) pair per band.

``python tools/band_ab.py [--head-dims 128,256,64] [--seqlens 512,1024,2048,4096] [--rounds 3] [--deterministic]``

Per case (bfloat16, full and causal, FlashAttention's grid: 16k tokens, model width 2048) it builds three
``BackwardPlan`` objects, differing only in ``_config.block_band``'s answer: as planned, the wave-sized bands
(block_band without the kernel's own rules, ``pair_major_tiles`` and ``least_pairs``, where the tree has them) and
one pair per band (a pair's key blocks fastest).
The gradients of each are checked against the planned one's (within rounding: the order of the dQ adds
differs), then every round times the three in a rotated order, each as
``bench.timing.EventTimer`` does (L2 flushed before each repeat). Prints each variant's grid, median ms and the
planned median over it. Run from the repository root with ``PYTHONPATH=.`` on a GPU of compute capability 9.0.
The numbers that count come from ``python -m bench``; this answers "which order is faster" in about half a
minute of device time.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

import cuflash
from ab_probe import TOKENS, WIDTH
from bench.impls import make_inputs
from bench.records import Shape
from bench.timing import EventTimer
from cuflash import _config, _cupy_path, _validate

PLANNED = _config.block_band
#: variant name -> block_band in its place while its plan is built
VARIANTS = {
    "planned": PLANNED,
    "bands": lambda tiles, pairs, sm_count, *band_rule: PLANNED(tiles, pairs, sm_count),
    "pair": lambda tiles, pairs, sm_count, *band_rule: 1,
}


def plan_with(band, problem, deterministic, q, k, v, dout, out, lse):
    _config.block_band = band
    try:
        return _cupy_path.BackwardPlan(problem, q.data.device_id, deterministic, dout, q, k, v, out, lse)
    finally:
        _config.block_band = PLANNED


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="128,256,64")
    parser.add_argument("--seqlens", default="512,1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deterministic", action="store_true", help="the deterministic backward's plans")
    args = parser.parse_args()
    timer = EventTimer(warmup=2, repeats=10)
    for head_dim in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in (int(x) for x in args.seqlens.split(",")):
                x = make_inputs(Shape.square(TOKENS // seqlen, seqlen, WIDTH // head_dim, head_dim), "bfloat16")
                q, k, v, dout = x.q, x.k, x.v, x.dout
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                problem = _validate.check_backward(dout, q, k, v, out, lse, causal, None)
                plans = {name: plan_with(band, problem, args.deterministic, q, k, v, dout, out, lse)
                         for name, band in VARIANTS.items()}
                planned = [g.astype(cp.float32) for g in plans["planned"].run(dout, q, k, v, out, lse)]
                for name, plan in plans.items():
                    got = plan.run(dout, q, k, v, out, lse)
                    apart = max(float(cp.abs(g.astype(cp.float32) - r).max() / cp.abs(r).max())
                                for g, r in zip(got, planned))
                    # the dQ adds' order differs (the atomic adds', or the ordered form's where a pair's key blocks
                    # run side by side in one variant only: _config.ordered_side_by_side); beyond rounding, a fault
                    if apart > 2e-2:
                        raise SystemExit(f"{name}: gradients {apart:.1e} apart from the planned ones")
                names = list(plans)
                times = {name: [] for name in names}
                for r in range(args.rounds):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        plan = plans[name]
                        times[name] += timer(lambda: plan.run(dout, q, k, v, out, lse))
                median = {name: float(np.median(t)) for name, t in times.items()}
                print(f"d={head_dim} {'causal' if causal else 'full  '} {seqlen:5d}: " + " | ".join(
                    f"{name} {plans[name].dkdv[0].grid} {median[name]:.3f} ms ({median['planned'] / median[name]:.3f})"
                    for name in names), flush=True)


if __name__ == "__main__":
    main()
