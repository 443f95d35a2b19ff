"""The float64 safe-softmax reference, the same math in a low-precision dtype, and the tolerance rule.

Everything here materializes the full score matrix, so it is only for checking.

Same conventions as :func:`cuflash.attention`: q ``(batch, seqlen_q, heads, head_dim)``, k and v
``(batch, seqlen_k, heads_kv, head_dim)``; the causal mask is aligned to the bottom-right corner (query
``i`` sees key ``j`` when ``j <= i + seqlen_k - seqlen_q``); a query row that sees no key gets output 0
and lse ``-inf``. NaN and inf propagate as the softmax formula makes them.

The tolerance rule is FlashAttention's (its own tests use it): with ``ref`` the float64 result and ``pt``
the same math done in the input dtype (:func:`attention_in_dtype`, every stored intermediate rounded to
it), a result ``out`` passes when

    max|out - ref| <= factor * max|pt - ref| + rounding(ref)

with factor 2 for the forward and 3 for the gradients, and ``rounding(ref)`` the reference's own rounding
in the dtype (:func:`rounding`). :func:`tolerance` returns the right-hand side.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

__all__ = ["attention", "attention_backward", "attention_in_dtype", "attention_backward_in_dtype", "causal_mask",
           "rounding", "tolerance"]


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """``(seqlen_q, seqlen_k)`` bool: True where query i sees key j (bottom-right aligned)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)  # a CuPy array comes to the host


def _as64(x) -> np.ndarray:
    x = x.get() if hasattr(x, "get") else x  # a CuPy array comes to the host
    return np.asarray(x).astype(np.float64)


def _scores(q, k, causal, softmax_scale):
    q, k = _as64(q), _as64(k)
    heads, heads_kv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    k = np.repeat(k, heads // heads_kv, axis=2) if heads_kv else k
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    visible = causal_mask(q.shape[1], k.shape[1]) if causal else np.ones((q.shape[1], k.shape[1]), bool)
    return s, visible, scale


def _softmax(s, visible):
    """Safe softmax over the last axis of ``s`` restricted to ``visible``; rows with nothing visible -> 0."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        masked = np.where(visible, s, -np.inf)
        any_visible = visible.any(axis=-1)  # (seqlen_q,)
        m = masked.max(axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,))
        m = np.where(any_visible[:, None], m, 0.0)
        e = np.where(visible, np.exp(masked - m), 0.0)
        l = e.sum(axis=-1, keepdims=True)
        p = np.where(any_visible[:, None], e / np.where(any_visible[:, None], l, 1.0), 0.0)
        lse = np.where(any_visible, (m + np.log(l))[..., 0], -np.inf)
    return p, lse


def attention(q, k, v, causal: bool = False, softmax_scale=None):
    """Exact attention in float64.

    Parameters
    ----------
    q : array, (batch, seqlen_q, heads, head_dim)
    k, v : array, (batch, seqlen_k, heads_kv, head_dim)
    causal : bool
    softmax_scale : float, optional
        Defaults to ``1/sqrt(head_dim)``.

    Returns
    -------
    out : numpy.ndarray, float64, (batch, seqlen_q, heads, head_dim)
    lse : numpy.ndarray, float64, (batch, heads, seqlen_q)
        Natural-log logsumexp of the scaled scores over the visible keys; -inf where none is visible.
    """
    s, visible, _ = _scores(q, k, causal, softmax_scale)
    p, lse = _softmax(s, visible)
    v = _as64(v)
    v = np.repeat(v, s.shape[1] // v.shape[2], axis=2) if v.shape[2] else v
    out = np.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def attention_backward(dout, q, k, v, causal: bool = False, softmax_scale=None):
    """Gradients of :func:`attention` in float64, from the materialized softmax.

    Parameters
    ----------
    dout : array, (batch, seqlen_q, heads, head_dim)
    q : array, (batch, seqlen_q, heads, head_dim)
    k, v : array, (batch, seqlen_k, heads_kv, head_dim)
    causal : bool
    softmax_scale : float, optional

    Returns
    -------
    dq : numpy.ndarray, float64, (batch, seqlen_q, heads, head_dim)
    dk, dv : numpy.ndarray, float64, (batch, seqlen_k, heads_kv, head_dim)
        Summed over the query heads that share a kv head.
    """
    s, visible, scale = _scores(q, k, causal, softmax_scale)
    p, _ = _softmax(s, visible)
    q, k, v, dout = _as64(q), _as64(k), _as64(v), _as64(dout)
    heads, heads_kv = q.shape[2], k.shape[2]
    group = heads // heads_kv if heads_kv else 1
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    dv_rep = np.einsum("bhij,bihd->bjhd", p, dout)
    dp = np.einsum("bihd,bjhd->bhij", dout, v_rep)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, k_rep)
    dk_rep = scale * np.einsum("bhij,bihd->bjhd", ds, q)

    def fold(x):  # sum the query heads of each group onto their kv head
        b, n, _, d = x.shape
        return x.reshape(b, n, heads_kv, group, d).sum(axis=3)

    return dq, fold(dk_rep), fold(dv_rep)


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> dtype -> float32: what storing an intermediate in the input dtype does."""
    return x.astype(dtype).astype(np.float32)


def _grouped_repeat(x: np.ndarray, heads: int) -> np.ndarray:
    return np.repeat(x, heads // x.shape[2], axis=2)


def attention_in_dtype(q, k, v, causal, softmax_scale, dtype):
    """The same math with every stored intermediate in ``dtype`` (float32 accumulation inside products,
    as a framework's half-precision matmul and softmax do). Returns float32 (out, lse)."""
    q, k, v = (_host(x).astype(np.float32) for x in (q, k, v))
    heads = q.shape[2]
    scale = 1 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale
    k, v = _grouped_repeat(k, heads), _grouped_repeat(v, heads)
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * np.float32(scale), dtype)
    visible = causal_mask(q.shape[1], k.shape[1]) if causal else np.ones(s.shape[-2:], bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(visible, s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,), np.float32)
        m = np.where(np.isfinite(m), m, 0)
        e = np.exp(s - m)
        l = e.sum(axis=-1, keepdims=True)
        p = _round(np.where(l > 0, e / l, 0), dtype)
        lse = np.where(l[..., 0] > 0, (m + np.log(l))[..., 0], -np.inf)
    out = _round(np.einsum("bhij,bjhd->bihd", p, v), dtype)
    return out, lse


def attention_backward_in_dtype(dout, q, k, v, out, causal, softmax_scale, dtype):
    """Gradients with every stored intermediate in ``dtype``; float32 (dq, dk, dv).

    ``out`` is the forward output handed to the backward, stored in ``dtype``: the backward's
    rowsum(dout * out) inherits its rounding, so the low-precision math uses the same ``out``.
    """
    delta = (_host(out).astype(np.float32) * _host(dout).astype(np.float32)).sum(axis=-1)
    delta = delta.transpose(0, 2, 1)[..., None]  # (batch, heads, seqlen_q, 1)
    q, k, v, dout = (_host(x).astype(np.float32) for x in (q, k, v, dout))
    heads, heads_kv = q.shape[2], k.shape[2]
    scale = np.float32(1 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale)
    kr, vr = _grouped_repeat(k, heads), _grouped_repeat(v, heads)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    visible = causal_mask(q.shape[1], k.shape[1]) if causal else np.ones(s.shape[-2:], bool)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s = np.where(visible, _round(s, dtype), -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        e = np.exp(s - m)
        l = e.sum(axis=-1, keepdims=True)
        p = _round(np.where(l > 0, e / l, 0), dtype)
    dv = _round(np.einsum("bhij,bihd->bjhd", p, dout), dtype)
    dp = _round(np.einsum("bihd,bjhd->bhij", dout, vr), dtype)
    ds = _round(p * (dp - delta), dtype)
    dq = _round(np.einsum("bhij,bjhd->bihd", ds, kr) * scale, dtype)
    dk = _round(np.einsum("bhij,bihd->bjhd", ds, q) * scale, dtype)

    def fold(x):
        b, n, _, d = x.shape
        return x.reshape(b, n, heads_kv, heads // heads_kv, d).sum(axis=3)

    return dq, fold(dk), fold(dv)


def rounding(ref: np.ndarray, dtype) -> float:
    """The reference's own rounding in ``dtype``: FlashAttention's 2 * max|(ref + 0.3 - 0.3) - ref|.

    Over many elements that maximum reaches one ulp of 0.3 + |ref|; on a handful (hypothesis draws
    outputs of one element) it can fall to 0 by luck. Use its deterministic value,
    eps(dtype) * (max|ref| + 0.3), so the bound does not depend on where one rounding happens to land.
    """
    if ref.size == 0:
        return 0.0
    return float(ml_dtypes.finfo(dtype).eps) * (float(np.nanmax(np.abs(ref))) + 0.3)


def tolerance(ref, in_dtype, dtype, factor: float) -> float:
    """The largest ``max|out - ref|`` FlashAttention's rule allows: ``factor * max|in_dtype - ref| +
    rounding(ref)`` over the elements where ``ref`` is finite (``in_dtype``: the result of
    :func:`attention_in_dtype` or :func:`attention_backward_in_dtype`; factor 2 forward, 3 gradients)."""
    ref = np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    in_dtype_err = float(np.abs(np.asarray(in_dtype, np.float64)[finite] - ref[finite]).max())
    return factor * in_dtype_err + rounding(ref[finite], np.dtype(dtype))
