"""A/B of the backward in two cuflash trees, in one process, beside FlashAttention-2's backward (SDPA flash).

``python tools/backward_ab.py BASE_TREE [--new .] [--cases 256:1:2048,192:0:4096] [--portable [--smem BYTES]]
[--deterministic] [--rounds 2] [--out OUT.json]``

A case is ``head_dim:causal:seqlen`` on FlashAttention's grid (16k tokens, model width 2048), bfloat16. Per
round and case, on fresh inputs: FA2's backward, then each tree's ``attention_backward`` on its own forward's
out and lse, each as ``bench.timing.EventTimer`` does (L2 flushed before each repeat); the two trees take turns
to run first, round by round (on the H200 the tree run second in a round measured up to 10% slower, whichever
it was: bench/NOTES.md b17), so an even number of rounds weighs both orders alike. With ``--portable`` both
trees plan as on a GPU without tensor maps (the ``mma.sync`` kernels an A100 runs), and with ``--smem`` as on
one with that much shared memory a block (an A100's 166912 bytes picks its tiles); with ``--deterministic`` both
trees run ``attention_backward(..., deterministic=True)``. Prints how far the two trees' gradients are apart
(max |new - base| over max |base|), then the medians in ms with each tree's ratio to FA2, and writes every
round's times as JSON. A tree is a directory holding a ``cuflash`` package (``git
archive REV cuflash | tar -x -C DIR``). Run from the repository root with ``PYTHONPATH=.`` on a GPU machine.
The numbers that count come from ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np

from ab_probe import TOKENS, WIDTH, load_tree
from bench.flops import attention_flops, tflops
from bench.impls import TorchSdpa, make_inputs
from bench.records import Shape
from bench.timing import EventTimer
from feature_ab import without_hopper_kernels


def parse_case(text: str) -> tuple[int, bool, int]:
    head_dim, causal, seqlen = (int(x) for x in text.split(":"))
    return head_dim, bool(causal), seqlen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="the base tree: a directory holding a cuflash package")
    parser.add_argument("--new", default=".", help="the new tree (default: this checkout)")
    parser.add_argument("--cases", default="256:0:2048,256:1:8192,192:1:4096", help="head_dim:causal:seqlen,...")
    parser.add_argument("--portable", action="store_true", help="both trees without the Hopper kernels")
    parser.add_argument("--smem", type=int, default=None,
                        help="with --portable: plan with this many bytes of shared memory a block (A100: 166912)")
    parser.add_argument("--deterministic", action="store_true", help="both trees' deterministic backward")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the times here as JSON")
    args = parser.parse_args()
    trees = {"base": load_tree("ab_base", args.base), "new": load_tree("ab_new", args.new)}
    if args.portable:
        for name in ("ab_base", "ab_new"):
            without_hopper_kernels(name, args.smem)
    cases = [parse_case(c) for c in args.cases.split(",")]
    timer = EventTimer(warmup=2, repeats=10)
    flash = TorchSdpa("torch-flash")
    times: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for head_dim, causal, seqlen in cases:
            key = f"{head_dim}:{int(causal)}:{seqlen}"
            x = make_inputs(Shape.square(TOKENS // seqlen, seqlen, WIDTH // head_dim, head_dim), "bfloat16",
                            seed=round_)
            with flash.context():
                times.setdefault(f"{key}:fa2", []).append(float(np.median(timer(flash.make_call("bwd", x, causal)))))
            grads = {}
            order = list(trees.items())
            for name, module in order if round_ % 2 == 0 else order[::-1]:
                out, lse = module.attention(x.q, x.k, x.v, causal=causal, return_lse=True)

                def backward(module=module, out=out, lse=lse):
                    return module.attention_backward(x.dout, x.q, x.k, x.v, out, lse, causal=causal,
                                                     deterministic=args.deterministic)

                times.setdefault(f"{key}:{name}", []).append(float(np.median(timer(backward))))
                grads[name] = [g.astype(cp.float32) for g in backward()]
            apart = max(float(cp.abs(a - b).max() / cp.abs(b).max()) for a, b in zip(grads["new"], grads["base"]))
            print(f"round {round_} {key}: max |new - base| / max |base| {apart:.2e}", flush=True)
    for head_dim, causal, seqlen in cases:
        key = f"{head_dim}:{int(causal)}:{seqlen}"
        shape = Shape.square(TOKENS // seqlen, seqlen, WIDTH // head_dim, head_dim)
        flop = attention_flops(shape.batch, shape.heads, seqlen, seqlen, head_dim, causal, "bwd")
        fa2 = float(np.median(times[f"{key}:fa2"]))
        line = f"d={head_dim} causal={int(causal)} n={seqlen}: fa2 {fa2:.3f} ms ({tflops(flop, fa2):.0f} TFLOP/s)"
        for name in trees:
            ms = float(np.median(times[f"{key}:{name}"]))
            line += f" | {name} {ms:.3f} ms ({fa2 / ms:.2f}x fa2)"
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(times, f, indent=1)


if __name__ == "__main__":
    main()
