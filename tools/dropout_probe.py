"""Dropout's cost on the GPU: cuflash, causal, bfloat16, (2, 8192, 2048 / head_dim, head_dim), with and
without dropout 0.1, forward, forward + backward and the deterministic forward + backward; medians of three
interleaved rounds of 10 event-timed repeats. Writes the times as JSON and prints the ratios.

    PYTHONPATH=. python3 tools/dropout_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np

from bench.timing import EventTimer

BATCH, SEQLEN, MODEL_DIM = 2, 8192, 2048
DROPOUT = dict(dropout_p=0.1, seed=5, offset=1)
ROUNDS = 3
#: a pass's FLOPs over the forward's (the backward's five products over the forward's two, plus the forward)
PASSES = {"fwd": 1.0, "fwd+bwd": 3.5, "fwd+bwd det": 3.5}


def main(out_path: str) -> None:
    import cupy
    import ml_dtypes

    import cuflash

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rows = {}
    for head_dim in (64, 128):
        heads = MODEL_DIM // head_dim
        rng = np.random.default_rng(0)
        q, k, v, dout = (cupy.asarray(rng.standard_normal((BATCH, SEQLEN, heads, head_dim), np.float32).astype(bf16))
                         for _ in range(4))

        def call(pass_, options):
            if pass_ == "fwd":
                return lambda: cuflash.attention(q, k, v, causal=True, **options)

            def forward_backward():
                out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **options)
                return cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                  deterministic=pass_.endswith("det"), **options)
            return forward_backward

        fns = {(name, pass_): call(pass_, options) for name, options in (("plain", {}), ("dropout0.1", DROPOUT))
               for pass_ in PASSES}
        timer = EventTimer(3, 10)
        times = {key: [] for key in fns}
        for _ in range(ROUNDS):
            for key, fn in fns.items():
                times[key].append(float(np.median(timer(fn))))
        visible = SEQLEN * (SEQLEN + 1) / 2 * BATCH * heads
        for (name, pass_), rounds in times.items():
            ms = float(np.median(rounds))
            tflops = 4 * visible * head_dim * PASSES[pass_] / (ms * 1e-3) / 1e12
            rows[f"d{head_dim} {name} {pass_}"] = dict(ms=ms, tflops=tflops, rounds=rounds)
            print(f"d{head_dim} {name:10s} {pass_:12s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s", flush=True)
        for pass_ in PASSES:
            ratio = rows[f"d{head_dim} dropout0.1 {pass_}"]["ms"] / rows[f"d{head_dim} plain {pass_}"]["ms"]
            print(f"d{head_dim} {pass_}: dropout / plain time {ratio:.3f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
