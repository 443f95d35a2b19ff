"""The float64 safe-softmax reference: materializes the full score matrix, so only for checking.

Same conventions as :func:`cuflash.attention`: q ``(batch, seqlen_q, heads, head_dim)``, k and v
``(batch, seqlen_k, heads_kv, head_dim)``; the causal mask is aligned to the bottom-right corner (query
``i`` sees key ``j`` when ``j <= i + seqlen_k - seqlen_q``); a query row that sees no key gets output 0
and lse ``-inf``. NaN and inf propagate as the softmax formula makes them.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward", "causal_mask"]


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """``(seqlen_q, seqlen_k)`` bool: True where query i sees key j (bottom-right aligned)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


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
