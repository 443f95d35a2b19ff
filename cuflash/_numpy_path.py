"""The CPU path: the kernels' blocked online-softmax algorithm, written with NumPy.

This is the executable specification of the CUDA kernels: the same base-2 online softmax with the
same names (m_i, l_i, acc), vectorized over batch, heads and query rows, one key block at a time, in
float32. Arrays are viewed as (batch, heads_kv, group, seqlen, head_dim) so grouped-query attention
needs no copy of k or v.
"""

from __future__ import annotations

import numpy as np

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
    """(n0, n1, r0, band) per key block that some query row sees: the block's keys n0 .. n1 - 1, the first
    row that sees any of them (r0; 0 without the mask) and how many rows from r0 on see only part of them
    (band; the causal diagonal crosses those rows, every later row sees the whole block)."""
    offset = p.seqlen_k - p.seqlen_q  # query i sees key j when j <= i + offset (bottom-right aligned)
    for n0 in range(0, p.seqlen_k, BLOCK_N):
        n1 = min(n0 + BLOCK_N, p.seqlen_k)
        if not p.causal:
            yield n0, n1, 0, 0
            continue
        r0 = max(0, n0 - offset)
        if r0 >= p.seqlen_q:
            return  # no row sees this block or any later one
        yield n0, n1, r0, min(p.seqlen_q, n1 - 1 - offset) - r0


def _mask_band(x: np.ndarray, p: Problem, n0: int, n1: int, r0: int, band: int, fill) -> np.ndarray:
    """``x`` (rows r0.., keys n0..n1) with ``fill`` where the causal mask hides a key from a row."""
    if band <= 0:
        return x
    rows = np.arange(r0, r0 + band)[:, None]
    keys = np.arange(n0, n1)[None, :]
    x[..., :band, :] = np.where(keys <= rows + (p.seqlen_k - p.seqlen_q), x[..., :band, :], fill)
    return x


def forward(q, k, v, p: Problem):
    """out (dtype of q), lse float32 (batch, heads, seqlen_q)."""
    qg = _grouped(q, p.heads_kv)  # (b, hk, g, sq, d)
    kg = k.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]  # (b, hk, 1, sk, d)
    vg = v.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]
    scale_log2 = np.float32(p.softmax_scale * LOG2E)
    m_i = np.full(qg.shape[:-1], -np.inf, np.float32)
    l_i = np.zeros(qg.shape[:-1], np.float32)
    acc = np.zeros(qg.shape, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # under the causal mask, key block n0 updates only the rows from r0 on: the rows before it see
        # none of its keys (their state, and so the result, is what it would be with the block masked)
        for n0, n1, r0, band in _key_blocks(p):
            s = (qg[..., r0:, :] @ kg[..., n0:n1, :].swapaxes(-1, -2)) * scale_log2  # base-2 scores
            s = _mask_band(s, p, n0, n1, r0, band, np.float32(-np.inf))
            m_new = np.maximum(m_i[..., r0:], s.max(axis=-1))
            base = np.where(m_new == -np.inf, np.float32(0), m_new)  # safe max: all-masked rows
            alpha = np.exp2(m_i[..., r0:] - base)
            probs = np.exp2(s - base[..., None])
            l_i[..., r0:] = l_i[..., r0:] * alpha + probs.sum(axis=-1)
            acc[..., r0:, :] = acc[..., r0:, :] * alpha[..., None] + probs @ vg[..., n0:n1, :]
            m_i[..., r0:] = m_new
        out = np.where(l_i[..., None] == 0, np.float32(0), acc / l_i[..., None])
        lse = np.where(l_i == 0, np.float32(-np.inf), (m_i + np.log2(l_i)) * np.float32(LN2))
    b, hk, g, sq = lse.shape
    return _ungrouped(out).astype(q.dtype), lse.reshape(b, hk * g, sq).astype(np.float32)


def backward(dout, q, k, v, out, lse, p: Problem):
    """dq, dk, dv (dtype of q): the FlashAttention-2 backward, one key block at a time."""
    qg, dog = _grouped(q, p.heads_kv), _grouped(dout, p.heads_kv)
    kg = k.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]
    vg = v.astype(np.float32).transpose(0, 2, 1, 3)[:, :, None]
    b = p.batch
    lse2 = lse.reshape(b, p.heads_kv, p.group, p.seqlen_q).astype(np.float32) * np.float32(LOG2E)
    delta = (_grouped(out, p.heads_kv) * dog).sum(axis=-1)  # rowsum(dout * out)
    scale = np.float32(p.softmax_scale)
    scale_log2 = np.float32(p.softmax_scale * LOG2E)
    dq = np.zeros(qg.shape, np.float32)
    dk = np.zeros((b, p.heads_kv, p.seqlen_k, p.head_dim), np.float32)
    dv = np.zeros_like(dk)
    with np.errstate(invalid="ignore", over="ignore"):
        for n0, n1, r0, band in _key_blocks(p):  # rows before r0 see none of the block's keys
            k_blk, v_blk = kg[..., n0:n1, :], vg[..., n0:n1, :]
            q_rows, do_rows = qg[..., r0:, :], dog[..., r0:, :]
            probs = np.exp2((q_rows @ k_blk.swapaxes(-1, -2)) * scale_log2 - lse2[..., r0:, None])
            probs = _mask_band(probs, p, n0, n1, r0, band, np.float32(0))
            dp = do_rows @ v_blk.swapaxes(-1, -2)
            ds = probs * (dp - delta[..., r0:, None])
            dv[:, :, n0:n1] = (probs.swapaxes(-1, -2) @ do_rows).sum(axis=2)
            dk[:, :, n0:n1] = scale * (ds.swapaxes(-1, -2) @ q_rows).sum(axis=2)
            dq[..., r0:, :] += scale * (ds @ k_blk)
    dtype = q.dtype
    return (_ungrouped(dq).astype(dtype), dk.transpose(0, 2, 1, 3).astype(dtype),
            dv.transpose(0, 2, 1, 3).astype(dtype))
