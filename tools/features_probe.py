"""Probe of the masks and score modifiers: cuflash against FlexAttention, interleaved in one process.

``python tools/features_probe.py OUT.json [HEAD_DIM]`` (default 128; run from the repository root with
``PYTHONPATH=.``): FlashAttention's grid at seqlen 8192 (batch 2, heads * head_dim = 2048), bfloat16,
causal; plain, a 1024-key window, softcap 30, ALiBi (slopes 2^(-8 i / heads)) and sinks (cuflash only:
FlexAttention has none); forward and forward + backward. FlexAttention runs under ``torch.compile`` with a
block mask and a score_mod. Three rounds of ``bench.timing.EventTimer`` (10 repeats, L2 flushed), medians;
TFLOP/s counted on the visible score entries. The numbers that count come from ``python -m bench``; this
one answers "where does each feature stand" in about a minute of device time.
"""

from __future__ import annotations

import json
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from bench.timing import EventTimer

SEQLEN, TOKENS, WIDTH = 8192, 16384, 2048
WINDOW, SOFTCAP = 1024, 30.0
ROUNDS = 3
PASS_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}  # FLOPs of the pass over the forward's (bench.flops)


def visible_entries(window_left: int) -> float:
    """Score entries a causal row set sees at SEQLEN, with a left window side (-1: none)."""
    rows = np.arange(SEQLEN, dtype=np.float64)
    return float((np.minimum(rows + 1, window_left + 1) if window_left >= 0 else rows + 1).sum())


def cuflash_calls(q, k, v, dout, options: dict):
    def forward():
        return cuflash.attention(q, k, v, causal=True, **options)

    def forward_backward():
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **options)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **options)

    return {"fwd": forward, "fwd+bwd": forward_backward}


def flex_calls(q, k, v, dout, slopes) -> dict:
    """{feature: {pass: call}} of FlexAttention, or {} without PyTorch's FlexAttention."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        print(f"FlexAttention unavailable: {exc}")
        return {}
    flex = torch.compile(flex_attention)
    tq, tk, tv, tdout = (torch.from_dlpack(x).transpose(1, 2).contiguous().requires_grad_(True)
                         for x in (q, k, v, dout))
    tslopes = torch.from_dlpack(slopes)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - tslopes[h] * (q_idx - kv_idx).abs()

    calls = {}
    for feature, (mask_mod, score_mod) in {"causal": (causal, None), "window": (window, None),
                                           "softcap": (causal, softcap), "alibi": (causal, alibi)}.items():
        block_mask = create_block_mask(mask_mod, None, None, SEQLEN, SEQLEN)

        def forward(block_mask=block_mask, score_mod=score_mod):
            with torch.no_grad():
                return flex(tq, tk, tv, block_mask=block_mask, score_mod=score_mod)

        def forward_backward(block_mask=block_mask, score_mod=score_mod):
            flex(tq, tk, tv, block_mask=block_mask, score_mod=score_mod).backward(tdout)

        calls[feature] = {"fwd": forward, "fwd+bwd": forward_backward}
    return calls


def main():
    out_path = sys.argv[1]
    head_dim = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    batch, heads = TOKENS // SEQLEN, WIDTH // head_dim
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v, dout = (cp.asarray(rng.standard_normal((batch, SEQLEN, heads, head_dim), dtype=np.float32).astype(bf16))
                     for _ in range(4))
    slopes = cp.asarray((2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32))
    sinks = cp.asarray(rng.standard_normal(heads).astype(np.float32))
    features = {"causal": {}, "window": dict(window_size=(WINDOW, 0)), "softcap": dict(softcap=SOFTCAP),
                "alibi": dict(alibi_slopes=slopes), "sinks": dict(sinks=sinks)}
    runs = {("cuflash", feature): cuflash_calls(q, k, v, dout, options) for feature, options in features.items()}
    runs.update({("flex", feature): calls for feature, calls in flex_calls(q, k, v, dout, slopes).items()})

    timer = EventTimer(3, 10)
    times = {(impl, feature, pass_): [] for (impl, feature), calls in runs.items() for pass_ in calls}
    for _ in range(ROUNDS):
        for (impl, feature), calls in runs.items():
            for pass_, call in calls.items():
                times[impl, feature, pass_].append(float(np.median(timer(call))))
    results = {}
    for (impl, feature, pass_), rounds in times.items():
        ms = float(np.median(rounds))
        visible = visible_entries(WINDOW if feature == "window" else -1)
        rate = 4 * head_dim * visible * batch * heads * PASS_FACTOR[pass_] / ms / 1e9
        results[f"{impl} {feature} {pass_}"] = dict(ms=ms, tflops=rate, rounds=rounds)
        print(f"{impl:8s} {feature:8s} {pass_:8s} {ms:8.3f} ms {rate:7.1f} TFLOP/s")
    with open(out_path, "w") as f:
        json.dump(dict(head_dim=head_dim, batch=batch, heads=heads, seqlen=SEQLEN, results=results), f, indent=1)


if __name__ == "__main__":
    main()
