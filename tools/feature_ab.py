"""A/B of a feature's cost in two cuflash trees, in one process: causal bfloat16 attention on FlashAttention's
grid (16k tokens, model width 2048), forward and forward + backward.

``python tools/feature_ab.py BASE_TREE [--new .] [--cases 64:8192,128:2048] [--options dropout_p=0.1,seed=5,offset=1]
[--portable] [--passes fwd,fwd+bwd] [--rounds 3] [--out OUT.json]``

Per case it times the new tree without the options (plain causal, the baseline), then the base tree and the new
tree with them; with ``--portable`` also both trees with the Hopper kernels off (the ``mma.sync`` kernels an
A100 runs). Every round runs the variants in a rotated order, each as ``bench.timing.EventTimer`` does (L2
flushed before each repeat). Prints the medians, in ms and in TFLOP/s on the visible score entries, and writes
them with every round's time as JSON. A tree is a directory holding a ``cuflash`` package (``git archive REV
cuflash | tar -x -C DIR``). Options are keyword arguments of ``attention`` and ``attention_backward`` with
number values (``window_size=1024:0`` for a pair; ``deterministic=1`` goes to the backward alone);
``alibi_slopes=1`` and ``sinks=1`` take the features suite's arrays for the case's head count
(``bench.features``). Run from the repository root with ``PYTHONPATH=.`` on a GPU machine. The numbers that
count come from ``python -m bench``; this answers "which tree is faster" with the least drift between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys

import cupy as cp
import ml_dtypes
import numpy as np

from ab_probe import TOKENS, WIDTH, load_tree
from bench.features import Feature, alibi_slopes, sink_logits
from bench.flops import attention_flops, tflops
from bench.timing import EventTimer


#: the keywords that take integers (the others take floats, or ``a:b`` pairs of integers)
INTEGER_OPTIONS = ("seed", "offset")
#: the keywords that take booleans, as 0 or 1
BOOLEAN_OPTIONS = ("deterministic",)
#: the keywords of attention_backward alone (the forward runs without them)
BACKWARD_OPTIONS = ("deterministic",)
#: the array keywords, given as 1: the features suite's array for a head count
ARRAY_OPTIONS = {"alibi_slopes": alibi_slopes, "sinks": sink_logits}


def parse_options(text: str) -> dict:
    """``key=value,...`` into keyword arguments."""
    options = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        if ":" in value:
            options[key] = tuple(int(x) for x in value.split(":"))
        elif key in BOOLEAN_OPTIONS:
            options[key] = bool(int(value))
        else:
            options[key] = int(value) if key in INTEGER_OPTIONS else float(value)
    return options


def forward_options(options: dict) -> dict:
    """The keyword arguments of ``options`` that ``attention`` takes (all but BACKWARD_OPTIONS)."""
    return {key: value for key, value in options.items() if key not in BACKWARD_OPTIONS}


def without_hopper_kernels(module_name: str, max_smem_per_block: int | None = None) -> None:
    """Make the tree imported as ``module_name`` plan as on a GPU without tensor maps (the mma.sync kernels),
    and with ``max_smem_per_block`` bytes of shared memory a block where given (an A100's: 166912)."""
    cupy_path = importlib.import_module(f"{module_name}._cupy_path")
    props = cupy_path.device_props

    def portable_props(device_id):
        own = props(device_id)
        return dataclasses.replace(own, tensor_maps=False,
                                   max_smem_per_block=max_smem_per_block or own.max_smem_per_block)

    cupy_path.device_props = portable_props


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="the base tree: a directory holding a cuflash package")
    parser.add_argument("--new", default=".", help="the new tree (default: this checkout)")
    parser.add_argument("--cases", default="64:8192,128:2048,128:8192,256:8192", help="head_dim:seqlen,...")
    parser.add_argument("--options", default="dropout_p=0.1,seed=5,offset=1", help="the feature's keywords")
    parser.add_argument("--portable", action="store_true", help="also time both trees without the Hopper kernels")
    parser.add_argument("--passes", default="fwd,fwd+bwd", help="the passes timed: fwd, fwd+bwd or both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the times here as JSON")
    args = parser.parse_args()
    options = parse_options(args.options)
    passes = args.passes.split(",")
    if not passes or set(passes) - {"fwd", "fwd+bwd"}:
        parser.error(f"--passes: fwd, fwd+bwd or both, comma-separated; got {args.passes!r}")
    window_left = options.get("window_size", (-1, 0))[0]
    trees = {"base": load_tree("ab_base", args.base), "new": load_tree("ab_new", args.new)}
    if args.portable:
        for name, path in (("base", args.base), ("new", args.new)):
            trees[f"{name}-portable"] = load_tree(f"ab_{name}_portable", path)
            without_hopper_kernels(f"ab_{name}_portable")
    variants = [("new", "plain", False)] + [(tree, "feature", True) for tree in trees]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    timer = EventTimer(2, 10)
    rows = {}
    for case in args.cases.split(","):
        head_dim, seqlen = (int(x) for x in case.split(":"))
        batch, heads = TOKENS // seqlen, WIDTH // head_dim
        rng = np.random.default_rng(0)
        q, k, v, dout = (cp.asarray(rng.standard_normal((batch, seqlen, heads, head_dim), np.float32).astype(bf16))
                         for _ in range(4))
        case_options = {key: cp.asarray(ARRAY_OPTIONS[key](heads)) if key in ARRAY_OPTIONS else value
                        for key, value in options.items()}

        def forward(cf, opts):
            fwd_opts = forward_options(opts)
            return lambda: cf.attention(q, k, v, causal=True, **fwd_opts)

        def forward_backward(cf, opts):
            fwd_opts = forward_options(opts)

            def run():
                out, lse = cf.attention(q, k, v, causal=True, return_lse=True, **fwd_opts)
                return cf.attention_backward(dout, q, k, v, out, lse, causal=True, **opts)
            return run

        fns = {}
        for tree, variant, featured in variants:
            for pass_, make in (("fwd", forward), ("fwd+bwd", forward_backward)):
                if pass_ in passes:
                    fns[(tree, variant, pass_)] = make(trees[tree], case_options if featured else {})
        times = {key: [] for key in fns}
        keys = list(fns)
        for round_ in range(args.rounds):
            shift = round_ % len(keys)
            for key in keys[shift:] + keys[:shift]:
                times[key].append(float(np.median(timer(fns[key]))))
        # the entries each variant's mask leaves visible, as the features suite counts them
        visible = {"plain": Feature("plain").visible_entries(seqlen),
                   "feature": Feature("feature", window_left=window_left).visible_entries(seqlen)}
        for (tree, variant, pass_), rounds in times.items():
            ms = float(np.median(rounds))
            rate = tflops(attention_flops(batch, heads, seqlen, seqlen, head_dim, True, pass_, visible[variant]), ms)
            rows[f"d{head_dim} s{seqlen} {tree} {variant} {pass_}"] = dict(ms=ms, tflops=rate, rounds=rounds)
            print(f"d{head_dim} s{seqlen} {tree:14s} {variant:8s} {pass_:8s} {ms:8.3f} ms {rate:6.1f} TFLOP/s",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(options=args.options, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
