"""The materialized baseline: matmul, float32 safe softmax, matmul; and its manual backward.

Array-module generic (CuPy on the GPU, NumPy in the tests), in the layout of cuflash: q, k, v and
dout are (batch, seqlen, heads, head_dim). One kv head per query head. The score matrix is
materialized, as an eager framework would: float32 scores and probabilities of
batch x heads x seqlen_q x seqlen_k elements, so it runs out of memory at long sequences.
"""

from __future__ import annotations

import math

import numpy as np

#: Device bytes per score element at the peak, a safe over-estimate used to skip shapes that cannot
#: fit: the forward holds the low-precision scores and their float32 copy, then the float32
#: probabilities and their low-precision copy (about 6 bytes); the backward adds dP and dS next to the
#: saved probabilities (about 12); bfloat16 adds float32 copies for the matmuls. Rounded up for the
#: allocator's slack.
BYTES_PER_SCORE = {"fwd": 16, "bwd": 24, "fwd+bwd": 24}


def _module(x):
    """The array module owning ``x``; CuPy is imported only for its own arrays."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _heads_first(x):
    """(batch, seq, heads, dim) -> (batch, heads, seq, dim) view."""
    return x.transpose(0, 2, 1, 3)


def _swap_last(x):
    return x.swapaxes(-1, -2)


def _matmul(xp, a, b):
    """``a @ b`` in the inputs' dtype. CuPy's matmul has no bfloat16 kernel: a CuPy user upcasts to
    float32 (cuBLAS SGEMM) and rounds the product back, so the baseline does that too."""
    if a.dtype.name == "bfloat16":
        return xp.matmul(a.astype(xp.float32), b.astype(xp.float32)).astype(a.dtype)
    return xp.matmul(a, b)


def causal_bias(xp, seqlen_q: int, seqlen_k: int):
    """float32 (seqlen_q, seqlen_k): 0 where query i sees key j (j <= i + seqlen_k - seqlen_q), else -inf."""
    return xp.triu(xp.full((seqlen_q, seqlen_k), -xp.inf, xp.float32), k=seqlen_k - seqlen_q + 1)


def forward(q, k, v, causal: bool, softmax_scale: float | None = None, keep_probs: bool = False):
    """Attention with the full score matrix.

    Returns
    -------
    out : array, (batch, seqlen_q, heads, head_dim), dtype of q (a transposed view)
    probs : float32 array (batch, heads, seqlen_q, seqlen_k) when ``keep_probs`` (saved for the
        backward, as autograd would), else None
    """
    xp = _module(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qh, kh, vh = _heads_first(q), _heads_first(k), _heads_first(v)
    scores = _matmul(xp, qh, _swap_last(kh)).astype(xp.float32)
    scores *= xp.float32(scale)
    if causal:
        scores += causal_bias(xp, q.shape[1], k.shape[1])
    # safe softmax in place: subtract the row max before exp
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = _matmul(xp, scores.astype(q.dtype), vh)
    return _heads_first(out), (scores if keep_probs else None)


def backward(dout, q, k, v, out, probs, softmax_scale: float | None = None):
    """Gradients from the saved float32 probabilities of :func:`forward`.

    Returns
    -------
    dq, dk, dv : arrays, (batch, seqlen, heads, head_dim), dtype of q (transposed views)
    """
    xp = _module(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qh, kh, vh, douth, outh = (_heads_first(x) for x in (q, k, v, dout, out))
    dv = _matmul(xp, _swap_last(probs.astype(q.dtype)), douth)
    dprobs = _matmul(xp, douth, _swap_last(vh)).astype(xp.float32)
    # softmax backward: dS = P * (dP - rowsum(dO * O)); masked entries have P = 0, so dS = 0 there
    delta = (douth.astype(xp.float32) * outh.astype(xp.float32)).sum(axis=-1, keepdims=True)
    dprobs -= delta
    dprobs *= probs
    dprobs *= xp.float32(scale)
    dscores = dprobs.astype(q.dtype)
    del dprobs
    dq = _matmul(xp, dscores, kh)
    dk = _matmul(xp, _swap_last(dscores), qh)
    return _heads_first(dq), _heads_first(dk), _heads_first(dv)
