"""The CPU path: the kernels' blocked online-softmax algorithm, written with NumPy.

This is the executable specification of the CUDA kernels: the same base-2 online softmax with the
same names (m_i, l_i, acc), vectorized over batch, heads and query rows, one key block at a time, in
float32. Arrays are viewed as (batch, heads_kv, group, seqlen, head_dim) so grouped-query attention
needs no copy of k or v.
"""

from __future__ import annotations

import numpy as np

from . import _fp8, _philox
from ._config import FLOAT8_E4M3
from ._validate import Problem

LOG2E = float(np.log2(np.e))
LN2 = float(np.log(2.0))
#: keys per block; any value gives the same result up to float32 rounding
BLOCK_N = 128


def _grouped(x: np.ndarray, heads_kv: int) -> np.ndarray:
    """(batch, seqlen, heads, d) -> float32 (batch, heads_kv, group, seqlen, d)."""
    b, n, h, d = x.shape
    return x.astype(np.float32).reshape(b, n, heads_kv, h // heads_kv, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x: np.ndarray) -> np.ndarray:
    """(batch, heads_kv, group, seqlen, d) -> (batch, seqlen, heads, d)."""
    b, hk, g, n, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, n, hk * g, d)


def _key_blocks(p: Problem):
    """(n0, n1, r0, r1, visible) per key block that some query row sees: the block's keys n0 .. n1 - 1, the
    rows r0 .. r1 - 1 that see any of them (the rows outside see none: their state, and so the result, is
    what it would be with the block masked), and the (rows, keys) bool mask of the pairs they see, None
    where every one of those rows sees every key of the block."""
    for n0 in range(0, p.seqlen_k, BLOCK_N):
        n1 = min(n0 + BLOCK_N, p.seqlen_k)
        # query i sees key j when -left <= j - (i + diagonal) <= right (a side of -1 unbounded)
        r0 = max(0, n0 - p.diagonal - p.window_right) if p.window_right >= 0 else 0
        r1 = min(p.seqlen_q, n1 - p.diagonal + p.window_left) if p.window_left >= 0 else p.seqlen_q
        if r0 >= r1:
            continue
        visible = None
        if p.masked:
            rel = np.arange(n0, n1)[None, :] - np.arange(r0, r1)[:, None] - p.diagonal
            visible = np.ones(rel.shape, bool)
            if p.window_left >= 0:
                visible &= rel >= -p.window_left
            if p.window_right >= 0:
                visible &= rel <= p.window_right
            if visible.all():
                visible = None
        yield n0, n1, r0, r1, visible


class _Scores:
    """The base-2 scores of the kernels' specification (and, with a softcap, the factor d score / d
    (scale q.k)) for a block of rows and keys: scale * q.k, through softcap * tanh(x / softcap), minus
    slope * |i + diagonal - j|, times log2(e)."""

    def __init__(self, p: Problem, alibi_slopes):
        self.p = p
        self.scale = np.float32(p.softmax_scale)
        self.scale_log2 = np.float32(p.softmax_scale * LOG2E)
        self.slopes = None
        if alibi_slopes is not None:  # (batch or 1, heads_kv, group, 1, 1), float32
            slopes = np.asarray(alibi_slopes, np.float32)
            slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape)
            self.slopes = slopes.reshape(slopes.shape[0], p.heads_kv, p.group, 1, 1)

    def __call__(self, dots, n0: int, n1: int, r0: int, r1: int):
        """(base-2 scores, the softcap's factor or None) of q.k products ``dots`` (rows r0.., keys n0..)."""
        p = self.p
        if not (p.softcap or self.slopes is not None):
            return dots * self.scale_log2, None  # one multiply: the kernels' fused scale
        x, factor = dots * self.scale, None
        if p.softcap:
            tanh = np.tanh(x / np.float32(p.softcap))
            x, factor = np.float32(p.softcap) * tanh, np.float32(1) - tanh * tanh
        if self.slopes is not None:
            distance = np.abs(np.arange(r0, r1)[:, None] + p.diagonal - np.arange(n0, n1)[None, :])
            x = x - self.slopes * distance.astype(np.float32)
        return x * np.float32(LOG2E), factor


def _dropout_keep(p: Problem, seed: int, offset: int, n0: int, n1: int, r0: int, r1: int, batch_index: int):
    """The kept elements of rows r0.., keys n0.., (batch, heads_kv, group, rows, keys), or None without
    dropout; the batch's entries draw the streams of batch entries ``batch_index`` onwards."""
    if not p.dropout_p:
        return None
    bh = np.arange(batch_index * p.heads, (batch_index + p.batch) * p.heads)
    bh = bh.reshape(p.batch, p.heads_kv, p.group, 1, 1)
    return _philox.keep(seed, offset, bh, np.arange(r0, r1)[:, None], np.arange(n0, n1)[None, :], p.dropout_p)


def _kept(probs, keep, p: Problem):
    return probs if keep is None else np.where(keep, probs * np.float32(1 / (1 - p.dropout_p)), np.float32(0))


def _grouped_sinks(sinks, p: Problem):
    """sinks (heads,) -> base 2, (1, heads_kv, group)."""
    return np.asarray(sinks, np.float32).reshape(1, p.heads_kv, p.group) * np.float32(LOG2E)


def forward(q, k, v, p: Problem, alibi_slopes=None, sinks=None, seed: int = 0, offset: int = 0,
            batch_index: int = 0, descales=(None, None, None)):
    """out (p.output_dtype), lse float32 (batch, heads, seqlen_q). ``batch_index``: the dropout stream of batch
    entry 0 is that of entry ``batch_index`` (a packed sequence's, computed on its own). ``descales``: a float8
    call's (q_descale, k_descale, v_descale): q, k and v are dequantized to float32 first."""
    if p.dtype == FLOAT8_E4M3:   # float8_e4m3fn or its uint8 bit patterns
        q, k, v = (_fp8.dequantize(x, descale, p.heads_kv, np.float32) for x, descale in zip((q, k, v), descales))
    qg = _grouped(q, p.heads_kv)  # (b, hk, g, sq, d)
    kg = k.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]  # (b, hk, 1, sk, d)
    vg = v.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]
    scores = _Scores(p, alibi_slopes)
    m_i = np.full(qg.shape[:-1], -np.inf, np.float32)
    l_i = np.zeros(qg.shape[:-1], np.float32)
    acc = np.zeros(qg.shape, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for n0, n1, r0, r1, visible in _key_blocks(p):
            s, _ = scores(qg[..., r0:r1, :] @ kg[..., n0:n1, :].swapaxes(-1, -2), n0, n1, r0, r1)
            if visible is not None:
                s = np.where(visible, s, np.float32(-np.inf))
            m_new = np.maximum(m_i[..., r0:r1], s.max(axis=-1))
            base = np.where(m_new == -np.inf, np.float32(0), m_new)  # safe max: all-masked rows
            alpha = np.exp2(m_i[..., r0:r1] - base)
            probs = np.exp2(s - base[..., None])
            l_i[..., r0:r1] = l_i[..., r0:r1] * alpha + probs.sum(axis=-1)
            probs = _kept(probs, _dropout_keep(p, seed, offset, n0, n1, r0, r1, batch_index), p)
            acc[..., r0:r1, :] = acc[..., r0:r1, :] * alpha[..., None] + probs @ vg[..., n0:n1, :]
            m_i[..., r0:r1] = m_new
        if sinks is not None:  # the sink joins each row's denominator: rescale to max(m_i, sink)
            sink2 = _grouped_sinks(sinks, p)[..., None]
            m_new = np.maximum(m_i, sink2)
            base = np.where(m_new == -np.inf, np.float32(0), m_new)
            alpha = np.exp2(m_i - base)
            l_i = l_i * alpha + np.exp2(sink2 - base)
            acc = acc * alpha[..., None]
            m_i = m_new
        out = np.where(l_i[..., None] == 0, np.float32(0), acc / l_i[..., None])
        lse = np.where(l_i == 0, np.float32(-np.inf), (m_i + np.log2(l_i)) * np.float32(LN2))
    b, hk, g, sq = lse.shape
    return _ungrouped(out).astype(p.output_dtype), lse.reshape(b, hk * g, sq).astype(np.float32)


def backward(dout, q, k, v, out, lse, p: Problem, alibi_slopes=None, sinks=None, seed: int = 0, offset: int = 0,
             batch_index: int = 0):
    """dq, dk, dv (dtype of q), and dsinks (float32, (heads,)) with sinks: the FlashAttention-2 backward,
    one key block at a time. ``batch_index`` as in :func:`forward`."""
    qg, dog = _grouped(q, p.heads_kv), _grouped(dout, p.heads_kv)
    kg = k.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]
    vg = v.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]
    b = p.batch
    lse2 = lse.reshape(b, p.heads_kv, p.group, p.seqlen_q).astype(np.float32) * np.float32(LOG2E)
    delta = (_grouped(out, p.heads_kv) * dog).sum(axis=-1)  # rowsum(dout * out)
    scores = _Scores(p, alibi_slopes)
    dq = np.zeros(qg.shape, np.float32)
    dk = np.zeros((b, p.heads_kv, p.seqlen_k, p.head_dim), np.float32)
    dv = np.zeros_like(dk)
    with np.errstate(invalid="ignore", over="ignore"):
        for n0, n1, r0, r1, visible in _key_blocks(p):  # rows outside r0..r1 see none of the block's keys
            k_blk, v_blk = kg[..., n0:n1, :], vg[..., n0:n1, :]
            q_rows, do_rows = qg[..., r0:r1, :], dog[..., r0:r1, :]
            s, softcap_factor = scores(q_rows @ k_blk.swapaxes(-1, -2), n0, n1, r0, r1)
            probs = np.exp2(s - lse2[..., r0:r1, None])
            if visible is not None:
                probs = np.where(visible, probs, np.float32(0))
            keep = _dropout_keep(p, seed, offset, n0, n1, r0, r1, batch_index)
            dp = _kept(do_rows @ v_blk.swapaxes(-1, -2), keep, p)
            ds = probs * (dp - delta[..., r0:r1, None])
            if softcap_factor is not None:
                ds = ds * softcap_factor
            dv[:, :, n0:n1] = (_kept(probs, keep, p).swapaxes(-1, -2) @ do_rows).sum(axis=2)
            dk[:, :, n0:n1] = scores.scale * (ds.swapaxes(-1, -2) @ q_rows).sum(axis=2)
            dq[..., r0:r1, :] += scores.scale * (ds @ k_blk)
        dtype = q.dtype
        grads = (_ungrouped(dq).astype(dtype), dk.transpose(0, 2, 1, 3).astype(dtype),
                 dv.transpose(0, 2, 1, 3).astype(dtype))
        if sinks is None:
            return grads
        # d lse / d sink is the sink's probability exp(sink - lse); d out / d sink = -that * out
        sink_p = np.where(lse2 == -np.inf, np.float32(0), np.exp2(_grouped_sinks(sinks, p)[..., None] - lse2))
        dsinks = -(sink_p * delta).sum(axis=(0, 3)).reshape(p.heads)
    return (*grads, dsinks.astype(np.float32))
