"""A/B probe of the forward: several cuflash trees and FlashAttention-2 (SDPA flash), interleaved in one process.

``python tools/ab_probe.py --trees base,new --rounds 5 --cases 256:0:2048:0,128:1:1024:1``: each tree is a
directory holding a ``cuflash`` package (``git archive REV cuflash | tar -x -C exp/base``), imported under its
own module name; a case is ``head_dim:causal:seqlen:dtype`` on FlashAttention's grid, the last field 0 for
bfloat16, 1 for float16, 2 for float8 e4m3 (the bfloat16 inputs quantized per (batch, kv head) by the first tree's
``quantize_qkv``; FA2 runs the bfloat16 ones). Every round times FA2 and then the trees, their order rotated per
round, each as ``bench.timing.EventTimer`` does (repeats back to back, the L2 flushed before each, one sync), on the same
fresh arrays. Prints the median TFLOP/s per case and the ratio to FA2 (``--no-fa2``: to the first tree, and
torch is not imported). Each timing is also written to stderr as it is taken, so that a tree whose kernel
hangs shows at once which case and tree never returned. Run from the repository root with ``PYTHONPATH=.``.
The numbers that count come from ``python -m bench``; this one answers "which version is faster" in about a
minute of device time, with less drift between the versions than separate processes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import cupy as cp
import numpy as np

from bench.timing import EventTimer

TOKENS, WIDTH = 16384, 2048  # FlashAttention's grid: batch * seqlen, heads * head_dim


def load_tree(name: str, root: str):
    """The cuflash package under ``root`` as module ``name`` (its imports are relative, so copies coexist)."""
    package = os.path.join(root, "cuflash")
    spec = importlib.util.spec_from_file_location(name, os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


DTYPES = ("bf16", "fp16", "float8")


def parse_case(text: str) -> tuple[int, bool, int, str]:
    head_dim, causal, seqlen, dtype = (int(x) for x in text.split(":"))
    return head_dim, bool(causal), seqlen, DTYPES[dtype]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", required=True, help="comma-separated directories, each holding a cuflash package")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-fa2", action="store_true", help="time the trees alone, without torch")
    parser.add_argument("--cases", required=True,
                        help="comma-separated head_dim:causal:seqlen:dtype (0 bfloat16, 1 float16, 2 float8)")
    args = parser.parse_args()
    trees = {path: load_tree(f"cuflash_tree{i}", path) for i, path in enumerate(args.trees.split(","))}
    cases = [parse_case(c) for c in args.cases.split(",")]
    timer = EventTimer(warmup=2, repeats=args.repeats)
    if not args.no_fa2:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    tflops: dict[tuple, list[float]] = {}
    start = time.perf_counter()
    for round_ in range(args.rounds):
        names = list(trees)
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for case in cases:
            head_dim, causal, seqlen, dtype_name = case
            dtype = cp.float16 if dtype_name == "fp16" else cp.dtype("bfloat16")
            batch, heads = TOKENS // seqlen, WIDTH // head_dim
            q, k, v = (cp.random.standard_normal((batch, seqlen, heads, head_dim), dtype=cp.float32).astype(dtype)
                       for _ in range(3))
            flop = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
            runs = []
            if not args.no_fa2:
                tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

                def flash():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                runs.append(("fa2", flash))

            inputs, options = (q, k, v), {}
            if dtype_name == "float8":
                *inputs, q_descale, k_descale, v_descale = trees[names[0]].quantize_qkv(q, k, v, "head")
                options = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
            runs += [(name, lambda m=trees[name]: m.attention(*inputs, causal=causal, **options)) for name in order]
            for name, fn in runs:
                ms = float(np.median(timer(fn)))
                tflops.setdefault(case + (name,), []).append(flop / ms / 1e9)
                print(f"[{time.perf_counter() - start:7.1f} s] round {round_} {case}: {name} {ms:.4f} ms",
                      file=sys.stderr, flush=True)
        print(f"round {round_}", flush=True)
    reference = "fa2" if not args.no_fa2 else next(iter(trees))
    for case in cases:
        base = float(np.median(tflops[case + (reference,)]))
        line = f"d={case[0]} causal={int(case[1])} n={case[2]} {case[3]}:"
        if not args.no_fa2:
            line += f" fa2 {base:.1f}"
        for name in trees:
            ours = float(np.median(tflops[case + (name,)]))
            line += f" | {name} {ours:.1f} ({ours / base:.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
