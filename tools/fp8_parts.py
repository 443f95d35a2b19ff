"""The float8 forward's parts on the GPU: V^T's transpose alone, the forward without it, and the whole call, beside
cuflash's bfloat16 forward on the same values.

``python tools/fp8_parts.py [--head-dims 64,128,256] [--seqlens 512,1024,2048,4096,16384]``: per case
(FlashAttention's grid: batch * seqlen = 16384, heads * head_dim = 2048; full and causal) the bfloat16 inputs are
quantized per (batch, kv head) by ``cuflash.quantize_qkv``, and each part is timed as ``bench.timing.EventTimer``
does (L2 flushed before each repeat, medians): the bfloat16 call, the float8 call, ``transpose_v_float8`` alone
(with its rate over the bytes it moves) and the float8 forward with the transpose skipped (it reads a stale V^T:
for time only). Run from the repository root with ``PYTHONPATH=.`` on a GPU of compute capability 9.0. The
numbers that count come from ``python -m bench grid --impl cuflash,cuflash-fp8``; this one says where a float8
call's time goes.
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,16384")
    args = parser.parse_args()
    timer = EventTimer(warmup=3, repeats=15)

    def median(fn) -> float:
        return float(np.median(timer(fn)))

    for head_dim in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in (int(x) for x in args.seqlens.split(",")):
                x = make_inputs(Shape.square(TOKENS // seqlen, seqlen, WIDTH // head_dim, head_dim), "bfloat16")
                q8, k8, v8, *descales = cuflash.quantize_qkv(x.q, x.k, x.v, "head")
                descales = tuple(descales)
                # a plan of the call, as cuflash.attention makes it (a fresh one, outside its cache): its launches
                # by name
                plan = cuflash._plan_forward(q8, k8, v8, causal, None, (-1, -1), 0.0, None, None, 0.0,
                                             "bottom_right", descales).__self__
                vt = cp.ndarray(plan.transpose_shape, np.uint8)
                bf16 = median(lambda: cuflash.attention(x.q, x.k, x.v, causal=causal))
                whole = median(lambda: plan.run(q8, k8, v8, descales=descales))
                transpose = median(lambda: plan.transpose((v8, vt)))
                launch, plan.transpose = plan.transpose, lambda arrays: None
                try:
                    forward = median(lambda: plan.run(q8, k8, v8, descales=descales))
                finally:
                    plan.transpose = launch
                moved = 2 * v8.nbytes   # V read, V^T written (as many bytes, but the padding of the last tile)
                print(f"d={head_dim} {'causal' if causal else 'full  '} {seqlen:5d}: bf16 {bf16:.4f} ms | float8 "
                      f"{whole:.4f} ({bf16 / whole:.2f}x) = transpose {transpose:.4f} ({moved / transpose / 1e9:.2f} "
                      f"TB/s) + forward {forward:.4f} ({bf16 / forward:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
