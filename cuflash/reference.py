"""The float64 safe-softmax reference, the same math in a low-precision dtype, and the tolerance rule.

Everything here materializes the full score matrix, so it is only for checking.

Same conventions and options as :func:`cuflash.attention`: q ``(batch, seqlen_q, heads, head_dim)``, k and
v ``(batch, seqlen_k, heads_kv, head_dim)``; the causal mask and windows are aligned to the bottom-right
corner by default (query ``i`` sees key ``j`` when ``j <= i + seqlen_k - seqlen_q``; :func:`mask`); a
query row that sees no key gets output 0 and lse ``-inf`` (the sink with sinks). Dropout takes the mask
itself (``dropout_mask``; :func:`cuflash.dropout_mask` gives cuflash's). NaN and inf propagate as the
softmax formula makes them.

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

from . import _fp8, _kvcache, _varlen
from ._kvcache import to_host as _host  # a CuPy argument comes to the host

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "attention_in_dtype", "attention_float8_in_dtype",
           "attention_backward_in_dtype", "causal_mask", "mask", "merge_states", "rounding", "tolerance"]


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """``(seqlen_q, seqlen_k)`` bool: True where query i sees key j (bottom-right aligned)."""
    return mask(seqlen_q, seqlen_k, causal=True)


def mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1),
         alignment: str = "bottom_right") -> np.ndarray:
    """``(seqlen_q, seqlen_k)`` bool: True where query i sees key j, FlashAttention's rule: with ``diagonal``
    ``seqlen_k - seqlen_q`` (bottom_right) or 0 (top_left), ``i + diagonal - left <= j <= i + diagonal +
    right``, a side of -1 unbounded, ``causal`` setting right to 0."""
    left, right = window_size
    if causal:
        right = 0
    diagonal = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    rel = np.arange(seqlen_k)[None, :] - np.arange(seqlen_q)[:, None] - diagonal  # j - (i + diagonal)
    visible = np.ones((seqlen_q, seqlen_k), bool)
    if left >= 0:
        visible &= rel >= -left
    if right >= 0:
        visible &= rel <= right
    return visible


def _keep_all(x):
    return x


def _options(q, k, causal, softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
             dropout_p=0.0, dropout_mask=None, alignment="bottom_right"):
    """The options of attention as plain values: scale, visible (sq, sk), softcap, ALiBi bias (b|1, h, sq, sk),
    sinks (1, h, 1, 1), dropout factor (b, h, sq, sk) or None."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    visible = mask(seqlen_q, seqlen_k, causal, window_size, alignment)
    bias = None
    if alibi_slopes is not None:
        diagonal = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
        distance = np.abs(np.arange(seqlen_q)[:, None] + diagonal - np.arange(seqlen_k)[None, :])
        slopes = _host(alibi_slopes).astype(np.float64)
        slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape)  # (b or 1, h)
        bias = -slopes[..., None, None] * distance
    sink = None if sinks is None else _host(sinks).astype(np.float64).reshape(1, -1, 1, 1)
    factor = None
    if dropout_p:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs the dropout_mask (cuflash.dropout_mask) to apply")
        factor = _host(dropout_mask).astype(np.float64) / (1.0 - dropout_p)
    return scale, visible, float(softcap), bias, sink, factor


def _by_head(x):
    """(batch, seqlen, heads, n) <-> (batch, heads, seqlen, n): a view, its own inverse."""
    return x.transpose(0, 2, 1, 3)


# The score-sized products as batched matrix products (BLAS, several times np.einsum's speed); q, k, v, dout and
# out are (batch, seqlen, heads, head_dim) with k and v repeated to q's heads, p (batch, heads, seqlen_q, seqlen_k).
def _qk(q, k):
    """q k^T: (batch, heads, seqlen_q, seqlen_k)."""
    return _by_head(q) @ _by_head(k).swapaxes(-1, -2)


def _pv(p, v):
    """p v: (batch, seqlen_q, heads, head_dim)."""
    return _by_head(p @ _by_head(v))


def _ptx(p, x):
    """p^T x of x with q's rows: (batch, seqlen_k, heads, head_dim)."""
    return _by_head(p.swapaxes(-1, -2) @ _by_head(x))


def _softmax_terms(y, visible, sink, work):
    """(e, l, lse) of the scores y (batch, heads, seqlen_q, seqlen_k) in ``work`` (call under np.errstate): e =
    exp(y - m) on the visible entries and 0 elsewhere, m the row max with the sink (0 for a row that sees nothing
    and has no sink: the safe max), l the row sum of e with the sink's term, lse = m + log(l) (-inf where l is 0).
    A row with a NaN score has m NaN and is NaN throughout."""
    z = np.where(visible, y, -np.inf)
    m = z.max(axis=-1, keepdims=True) if z.shape[-1] else np.full(z.shape[:-1] + (1,), -np.inf, work)
    if sink is not None:
        m = np.maximum(m, sink.astype(work))
    m = np.where(m == -np.inf, work(0), m)
    e = np.exp(z - m)   # hidden entries: exp(-inf - m) = 0 (m finite, or +inf)
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink.astype(work) - m)
    return e, l, np.where(l[..., 0] == 0, -np.inf, (m + np.log(l))[..., 0])


def _forward(q, k, v, causal, softmax_scale, options, rnd, work, with_out: bool = True):
    """out (None without ``with_out``), lse and the backward's saved values (p, dy/dx of the softcap, dropout
    factor, scale), computed in ``work`` with every stored intermediate passed through ``rnd``."""
    scale, visible, softcap, bias, sink, factor = _options(q, k, causal, softmax_scale, **options)
    q, k, v = (_host(x).astype(work) for x in (q, k, v))
    heads, heads_kv = q.shape[2], k.shape[2]
    group = heads // heads_kv if heads_kv else 1
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        y = rnd(_qk(q, k) * work(scale))  # scores, (b, h, sq, sk)
        dy = None
        if softcap:
            tanh = np.tanh(y / work(softcap))
            y, dy = rnd(work(softcap) * tanh), 1 - tanh * tanh
        if bias is not None:
            y = rnd(y + bias.astype(work))
        e, l, lse = _softmax_terms(y, visible, sink, work)
        p = rnd(e / np.where(l == 0, 1, l))  # l == 0: e's row is all zeros; NaN stays NaN
        kept = p if factor is None else rnd(p * factor.astype(work))
        out = rnd(_pv(kept, v)) if with_out else None
    return out, lse, (p, dy, factor, scale, sink)


def _backward(dout, q, k, v, out, causal, softmax_scale, options, rnd, work):
    """dq, dk, dv and (with sinks) dsinks; ``out`` None: delta from the probabilities themselves."""
    _, lse, (p, dy, factor, scale, sink) = _forward(q, k, v, causal, softmax_scale, options, rnd, work,
                                                    with_out=False)
    q, k, v, dout = (_host(x).astype(work) for x in (q, k, v, dout))
    heads, heads_kv = q.shape[2], k.shape[2]
    group = heads // heads_kv if heads_kv else 1
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    with np.errstate(invalid="ignore", over="ignore"):
        kept = p if factor is None else rnd(p * factor.astype(work))
        dv = rnd(_ptx(kept, dout))
        dkept = rnd(_qk(dout, v_rep))  # d loss / d (kept probability)
        dp = dkept if factor is None else dkept * factor.astype(work)
        if out is None:
            delta = (p * dp).sum(axis=-1, keepdims=True)  # rowsum(dout * out), exactly
        else:
            delta = (_host(out).astype(work) * dout).sum(axis=-1).transpose(0, 2, 1)[..., None]
        ds = rnd(p * (dp - delta))
        if dy is not None:
            ds = rnd(ds * dy)  # through the softcap: d tanh
        dq = rnd(_pv(ds, k_rep) * work(scale))
        dk = rnd(_ptx(ds, q) * work(scale))

    def fold(x):  # sum the query heads of each group onto their kv head
        b, n, _, d = x.shape
        return x.reshape(b, n, heads_kv, group, d).sum(axis=3)

    grads = (dq, fold(dk), fold(dv))
    if sink is None:
        return grads
    with np.errstate(invalid="ignore", over="ignore"):
        sink_p = np.exp(sink[..., 0] - lse)  # (b, h, sq): the sink's probability in each row
        dsinks = -(np.where(np.isfinite(lse), sink_p, 0) * delta[..., 0]).sum(axis=(0, 2))
    return (*grads, dsinks)


def attention(q, k, v, causal: bool = False, softmax_scale=None, *, window_size=(-1, -1), softcap: float = 0.0,
              alibi_slopes=None, sinks=None, dropout_p: float = 0.0, dropout_mask=None,
              alignment: str = "bottom_right", q_descale=None, k_descale=None, v_descale=None):
    """Exact attention in float64 (of float8 inputs: of their values times their descale factors).

    Parameters
    ----------
    q : array, (batch, seqlen_q, heads, head_dim)
    k, v : array, (batch, seqlen_k, heads_kv, head_dim)
    causal : bool
    softmax_scale : float, optional
        Defaults to ``1/sqrt(head_dim)``.
    window_size, softcap, alibi_slopes, sinks, dropout_p, alignment
        As in :func:`cuflash.attention`: the score of a visible pair is ``softcap * tanh(scale q.k /
        softcap)`` (the product itself where softcap is 0) ``- slope * |i + diagonal - j|``; a sink joins
        each row's denominator.
    dropout_mask : bool array (batch, heads, seqlen_q, seqlen_k), needed where dropout_p > 0
        True where a probability is kept (:func:`cuflash.dropout_mask` gives cuflash's); kept ones are
        scaled by ``1 / (1 - dropout_p)``. The lse does not see dropout.
    q_descale, k_descale, v_descale : float32 arrays (1,), () or (batch, heads_kv), optional
        As in :func:`cuflash.attention`: q, k and v stand for their values times these (None: 1).

    Returns
    -------
    out : numpy.ndarray, float64, (batch, seqlen_q, heads, head_dim)
    lse : numpy.ndarray, float64, (batch, heads, seqlen_q)
        Natural-log logsumexp of the scores over the visible keys (and the sink); -inf where nothing is
        visible.
    """
    heads_kv = k.shape[2]
    q, k, v = (x if descale is None else _fp8.dequantize(_host(x), _host(descale), heads_kv)
               for x, descale in zip((q, k, v), (q_descale, k_descale, v_descale)))
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                   dropout_p=dropout_p, dropout_mask=dropout_mask, alignment=alignment)
    out, lse, _ = _forward(q, k, v, causal, softmax_scale, options, _keep_all, np.float64)
    return out, lse


def attention_backward(dout, q, k, v, causal: bool = False, softmax_scale=None, *, window_size=(-1, -1),
                       softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                       dropout_mask=None, alignment: str = "bottom_right", out=None):
    """Gradients of :func:`attention` in float64, from the materialized softmax.

    Parameters
    ----------
    dout : array, (batch, seqlen_q, heads, head_dim)
    q : array, (batch, seqlen_q, heads, head_dim)
    k, v : array, (batch, seqlen_k, heads_kv, head_dim)
    causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_mask, alignment
        As given to :func:`attention`.
    out : array, (batch, seqlen_q, heads, head_dim), optional
        The forward output a backward is handed: delta = rowsum(dout * out) from it, as a kernel's backward
        computes it, instead of from the exact probabilities. Its difference from the exact gradients is
        the error that receiving ``out`` rounded to its dtype causes by itself: large where dS cancels
        (dP close to delta: one key and a sink or dropout).

    Returns
    -------
    dq : numpy.ndarray, float64, (batch, seqlen_q, heads, head_dim)
    dk, dv : numpy.ndarray, float64, (batch, seqlen_k, heads_kv, head_dim)
        Summed over the query heads that share a kv head.
    dsinks : numpy.ndarray, float64, (heads,), only with ``sinks``
    """
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                   dropout_p=dropout_p, dropout_mask=dropout_mask, alignment=alignment)
    return _backward(dout, q, k, v, out, causal, softmax_scale, options, _keep_all, np.float64)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, causal: bool = False,
                           softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           sinks=None, in_dtype=None, q_descale=None, k_descale=None, v_descale=None,
                           cache_leftpad=None):
    """:func:`cuflash.attention_with_kvcache` in float64, without writing the caches: sequence ``b``'s keys
    are its cached ones from row ``cache_leftpad[b]`` (0 where None) up to ``cache_seqlens[b]`` (all of them
    where None) followed by ``k[b]`` (likewise the values), and its queries attend to them as :func:`attention` with the bottom-right diagonal
    (:func:`attention_in_dtype` where ``in_dtype`` is given: the low-precision side of the tolerance rule).
    With ``rotary_cos`` the new keys and the queries are rotated first, in float64 (rounded to ``in_dtype``
    where it is given), at the positions :func:`cuflash.attention_with_kvcache` documents. Of float8 inputs,
    the values times their descale factors (``k_descale`` and ``v_descale`` those of the cache and the new keys
    and values alike; per (batch, kv head): sequence b's).

    Returns (out (batch, seqlen_q, heads, head_dim), lse (batch, heads, seqlen_q)), float64.
    """
    k_cache, v_cache = np.array(_host(k_cache)), np.array(_host(v_cache))  # copies: the appends land in them
    block_table = None if block_table is None else _host(block_table)
    batch = q.shape[0]
    full = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    keys = _kvcache.lengths_of(cache_seqlens, batch, full)
    start = cache_seqlens if cache_seqlens is None or isinstance(cache_seqlens, int) else _host(cache_seqlens)
    q, k = _host(q), None if k is None else _host(k)
    lead = None if cache_leftpad is None else _host(cache_leftpad)
    if rotary_cos is not None:
        masked = causal or tuple(window_size) != (-1, -1)
        q, k = _kvcache.prepare(np, q, k, start, _host(rotary_cos), _host(rotary_sin), rotary_interleaved, masked,
                                np.float64, np.float64, lead)
        if in_dtype is not None:
            q, k = (None if x is None else x.astype(in_dtype).astype(np.float64) for x in (q, k))
    if k is not None:
        k_cache, v_cache = k_cache.astype(np.result_type(k_cache, k)), v_cache.astype(np.result_type(v_cache, k))
        _kvcache.append(np, k_cache, v_cache, k, _host(v), start, block_table)
        keys = keys + k.shape[1]

    alibi = None if alibi_slopes is None else _host(alibi_slopes)
    descales = [None if d is None else _host(d) for d in (q_descale, k_descale, v_descale)]

    def attend(b, q_b, k_b, v_b):
        options = dict(window_size=window_size, softcap=softcap, alibi_slopes=_kvcache.sequence_slopes(alibi, b),
                       sinks=None if sinks is None else _host(sinks))
        if in_dtype is None:
            q_d, k_d, v_d = (_kvcache.sequence_descale(d, b) for d in descales)
            return attention(q_b, k_b, v_b, causal, softmax_scale, q_descale=q_d, k_descale=k_d, v_descale=v_d,
                             **options)
        return attention_in_dtype(q_b, k_b, v_b, causal, softmax_scale, in_dtype, **options)

    return _kvcache.per_sequence(attend, q, k_cache, v_cache, keys, block_table, lead)


def _padded_dropout_mask(dropout_p, dropout_mask):
    """A packed call's padded dropout mask on the host (None without dropout), read once for every sequence."""
    if not dropout_p:
        return None
    if dropout_mask is None:
        raise ValueError("dropout_p > 0 needs the dropout_mask (cuflash.dropout_mask of the padded batch) to apply")
    return _host(dropout_mask)


def _sequence_dropout(dropout_p, mask, b, q_b, k_b) -> dict:
    """The dropout options of packed sequence b: its corner of batch entry b of the padded host ``mask``."""
    if mask is None:
        return {}
    return dict(dropout_p=dropout_p, dropout_mask=mask[b:b + 1, :, :q_b.shape[1], :k_b.shape[1]])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, softmax_scale=None, *,
                     window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                     dropout_mask=None, in_dtype=None):
    """:func:`cuflash.attention_varlen` in float64 (:func:`attention_in_dtype` where ``in_dtype`` is given): each
    packed sequence on its own. ``dropout_mask`` is bool (batch, heads, max_seqlen_q, max_seqlen_k), sequence
    b's mask in the top-left corner of entry b (:func:`cuflash.dropout_mask` of the padded batch gives
    cuflash's). Returns (out (total_q, heads, head_dim), lse (heads, total_q))."""
    packing = _varlen.Packing(_host(cu_seqlens_q).astype(np.int64), _host(cu_seqlens_k).astype(np.int64))
    options = dict(window_size=window_size, softcap=softcap, sinks=None if sinks is None else _host(sinks))
    mask = _padded_dropout_mask(dropout_p, dropout_mask)

    def attend(b, q_b, k_b, v_b, alibi_slopes):
        dropout = _sequence_dropout(dropout_p, mask, b, q_b, k_b)
        if in_dtype is None:
            return attention(q_b, k_b, v_b, causal, softmax_scale, alibi_slopes=alibi_slopes, **options, **dropout)
        return attention_in_dtype(q_b, k_b, v_b, causal, softmax_scale, in_dtype, alibi_slopes=alibi_slopes, **options,
                                  **dropout)

    host = [np.asarray(_host(x), np.float64) for x in (q, k, v)]
    alibi = None if alibi_slopes is None else _host(alibi_slopes)
    return _varlen.per_sequence_forward(np, attend, packing, *host, alibi)


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, softmax_scale=None, *,
                              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
                              dropout_p: float = 0.0, dropout_mask=None, out=None, in_dtype=None):
    """:func:`cuflash.attention_varlen_backward` in float64, each packed sequence on its own; ``dropout_mask`` as
    :func:`attention_varlen` takes it, ``out`` as :func:`attention_backward` does; with ``in_dtype``,
    :func:`attention_backward_in_dtype` (which needs ``out``). Returns (dq, dk, dv[, dsinks])."""
    packing = _varlen.Packing(_host(cu_seqlens_q).astype(np.int64), _host(cu_seqlens_k).astype(np.int64))
    options = dict(window_size=window_size, softcap=softcap, sinks=None if sinks is None else _host(sinks))
    mask = _padded_dropout_mask(dropout_p, dropout_mask)

    def backward(b, dout_b, q_b, k_b, v_b, out_b, lse_b, alibi_slopes):
        dropout = _sequence_dropout(dropout_p, mask, b, q_b, k_b)
        if in_dtype is None:
            return attention_backward(dout_b, q_b, k_b, v_b, causal, softmax_scale, alibi_slopes=alibi_slopes,
                                      out=None if out is None else out_b, **options, **dropout)
        return attention_backward_in_dtype(dout_b, q_b, k_b, v_b, out_b, causal, softmax_scale, in_dtype,
                                           alibi_slopes=alibi_slopes, **options, **dropout)

    host = [np.asarray(_host(x), np.float64) for x in (dout, q, k, v)]
    host_out = np.zeros_like(host[1]) if out is None else np.asarray(_host(out), np.float64)
    lse = np.zeros((host[1].shape[1], host[1].shape[0]), np.float32)  # unread: the reference recomputes it
    alibi = None if alibi_slopes is None else _host(alibi_slopes)
    return _varlen.per_sequence_backward(np, backward, packing, host[0], *host[1:], host_out, lse, alibi,
                                         options["sinks"])


def merge_states(outs, lses):
    """:func:`cuflash.merge_states` in float64: parts ``outs[i]`` (batch, seqlen_q, heads, head_dim) with
    logsumexps ``lses[i]`` (batch, heads, seqlen_q) over disjoint key sets, combined into ``(out, lse)`` over
    their union; a row that no part saw gets output 0 and lse ``-inf``."""
    outs = [np.asarray(_host(o), np.float64) for o in outs]
    lses = np.stack([np.asarray(_host(x), np.float64) for x in lses])
    shift = lses.max(axis=0)
    shift = np.where(np.isneginf(shift), 0.0, shift)
    weights = np.exp(lses - shift)
    total = weights.sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + shift, -np.inf)
    out = np.zeros_like(outs[0])
    for weight, part in zip(weights, outs):
        row_weight = np.divide(weight, total, out=np.zeros_like(weight), where=total > 0)
        row_weight = row_weight.transpose(0, 2, 1)[..., None]
        out += np.where(row_weight > 0, row_weight * part, 0.0)
    return out, lse


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> dtype -> float32: what storing an intermediate in the input dtype does."""
    return x.astype(dtype).astype(np.float32)


#: the float8 kernels' P is exp(score - row max) times 2**FLOAT8_P_OFFSET rounded to e4m3 (FlashAttention-3's max
#: offset: the probabilities down to 2**-17 of the largest keep e4m3's subnormal bits)
FLOAT8_P_OFFSET = 8
#: Hopper's e4m3 matrix units (wgmma k32) sum each step's FLOAT8_MMA_K products and the accumulator aligned to the
#: largest of them, every term truncated toward zero to FLOAT8_MMA_FRACTION_BITS below that one's leading bit, and
#: truncate the sum to as many fraction bits: an e8m13 accumulator, not float32's 23 bits (the DeepSeek-V3 report
#: measured the 13 bits; this model matched the float8 kernel's lse errors on the H200 to within 8% in every test
#: case, where plain truncation of the sums was off by up to 2.7x)
FLOAT8_MMA_FRACTION_BITS = 13
FLOAT8_MMA_K = 32
#: query rows whose products a step of _float8_scores holds at once (bounds its memory)
_FLOAT8_ROWS = 64


def _truncate(x: np.ndarray, fraction_bits: int) -> np.ndarray:
    """x (float64) truncated toward zero to ``fraction_bits`` bits after its leading one."""
    mantissa, exponent = np.frexp(x)   # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    return np.ldexp(np.trunc(np.ldexp(mantissa, fraction_bits + 1)), exponent - fraction_bits - 1)


def _float8_step(acc: np.ndarray, products: np.ndarray) -> np.ndarray:
    """acc + the sum of ``products`` (acc's shape + (FLOAT8_MMA_K,)) as one e4m3 wgmma k step adds them."""
    largest = np.maximum(np.abs(products).max(axis=-1), np.abs(acc))
    quantum = np.ldexp(1.0, np.frexp(largest)[1] - 1 - FLOAT8_MMA_FRACTION_BITS)
    total = (np.trunc(products / quantum[..., None]).sum(axis=-1) + np.trunc(acc / quantum)) * quantum
    return _truncate(total, FLOAT8_MMA_FRACTION_BITS)


def _float8_scores(q, k, q_descale, k_descale, heads_kv: int) -> np.ndarray:
    """q.k of e4m3 q (batch, seqlen_q, heads, head_dim) and k (batch, seqlen_k, heads, head_dim; heads repeated
    from heads_kv) as the e4m3 matrix units sum them (``_float8_step`` per FLOAT8_MMA_K elements), then times the
    two descale factors of the head in float32 (the kernels fold them into the softmax scale). float64 (batch,
    heads, seqlen_q, seqlen_k)."""
    batch, seqlen_q, heads, head_dim = q.shape
    q, k = (_fp8.dequantize(x, None, heads_kv) for x in (q, k))
    scores = np.zeros((batch, heads, seqlen_q, k.shape[1]))
    for r0 in range(0, seqlen_q, _FLOAT8_ROWS):
        rows = slice(r0, r0 + _FLOAT8_ROWS)
        for d0 in range(0, head_dim, FLOAT8_MMA_K):
            dims = slice(d0, d0 + FLOAT8_MMA_K)
            products = np.einsum("bihd,bjhd->bhijd", q[:, rows, :, dims], k[..., dims])
            scores[:, :, rows] = _float8_step(scores[:, :, rows], products)
    for descale in (q_descale, k_descale):
        if descale is not None:
            factors = _fp8._grouped_factors(_host(descale), batch, heads, heads_kv)   # (b|1, 1, h|1, 1)
            scores = scores * factors.reshape(factors.shape[0], factors.shape[2], 1, 1).astype(np.float32)
    return scores


def attention_float8_in_dtype(q, k, v, causal, softmax_scale, q_descale=None, k_descale=None, v_descale=None,
                              **options):
    """The float8 kernels' math, the low-precision side of the tolerance rule for them: q, k and v (float8_e4m3fn
    or uint8 bit patterns) dequantized, q.k summed as the e4m3 matrix units sum it (``_float8_scores``), the
    scores and their modifiers in float32, each probability's exp(score - max) * 2**FLOAT8_P_OFFSET rounded to
    e4m3 for P V while the row sum l takes it unrounded, out = P V / (2**FLOAT8_P_OFFSET l) rounded to bfloat16.
    ``options``: :func:`attention`'s (no dropout). Returns float32 (out, lse)."""
    heads_kv = k.shape[2]
    q, k, v = (np.asarray(_host(x)) for x in (q, k, v))
    v = _fp8.dequantize(v, None if v_descale is None else _host(v_descale), heads_kv, np.float32)
    scale, visible, softcap, bias, sink, _ = _options(q, k, causal, softmax_scale, **options)
    group = q.shape[2] // heads_kv if heads_kv else 1
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    work = np.float32
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        y = _float8_scores(q, k, q_descale, k_descale, heads_kv).astype(work) * work(scale)
        if softcap:
            y = work(softcap) * np.tanh(y / work(softcap))
        if bias is not None:
            y = y + bias.astype(work)
        e, l, lse = _softmax_terms(y, visible, sink, work)
        p = _round(e * work(2.0**FLOAT8_P_OFFSET), ml_dtypes.float8_e4m3fn)
        out = _pv(p / np.where(l == 0, 1, l * work(2.0**FLOAT8_P_OFFSET)), v)
    return _round(out, ml_dtypes.bfloat16), lse.astype(np.float32)


def attention_in_dtype(q, k, v, causal, softmax_scale, dtype, **options):
    """The same math with every stored intermediate in ``dtype`` (float32 accumulation inside products,
    as a framework's half-precision matmul and softmax do); ``options`` are :func:`attention`'s keywords.
    Returns float32 (out, lse)."""
    out, lse, _ = _forward(q, k, v, causal, softmax_scale, options, lambda x: _round(x, dtype), np.float32)
    return out, lse


def attention_backward_in_dtype(dout, q, k, v, out, causal, softmax_scale, dtype, **options):
    """Gradients with every stored intermediate in ``dtype``; float32 (dq, dk, dv), and dsinks with sinks.

    ``out`` is the forward output handed to the backward, stored in ``dtype``: the backward's
    rowsum(dout * out) inherits its rounding, so the low-precision math uses the same ``out``.
    """
    return _backward(dout, q, k, v, out, causal, softmax_scale, options, lambda x: _round(x, dtype), np.float32)


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
