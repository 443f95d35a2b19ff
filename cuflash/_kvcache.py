"""The KV cache's side of attention_with_kvcache as array operations: rotary embeddings of the new queries and
keys, appending keys and values, and reading a sequence's keys back, for the NumPy path and the reference (and
on CuPy only for a call with no query rows (batch, seqlen_q or heads 0), which may still append); other CuPy calls
run the same steps in one kernel (append_rotary, kernels/cache.cu).

A contiguous cache is (batch, seqlen_cache, heads_kv, head_dim); a paged one (num_blocks, page_size,
heads_kv, head_dim) with ``block_table`` (batch, max_blocks_per_sequence): key ``n`` of sequence ``b`` is
row ``n % page_size`` of page ``block_table[b, n // page_size]``.
"""

from __future__ import annotations

import numpy as np


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array: a CuPy array copied to the host (a synchronization), anything else as it is."""
    return np.asarray(x.get() if hasattr(x, "get") else x)


def sequence_slopes(alibi_slopes, b: int):
    """Sequence ``b``'s ALiBi slopes (heads,) from slopes of shape (heads,) or (batch, heads); None without."""
    return None if alibi_slopes is None else alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes


def sequence_descale(descale, b: int):
    """Sequence ``b``'s float8 descale factors: (1, heads_kv) from factors per (batch, kv head), per-tensor
    factors ((1,) or ()) as they are; None without."""
    return descale[b:b + 1] if descale is not None and descale.ndim == 2 else descale


def positions(xp, cache_seqlens, batch: int, count: int, advance: bool = True):
    """(batch, count) int32: ``cache_seqlens[b] + i`` for i < count, or ``cache_seqlens[b]`` for every i where
    not ``advance`` (``cache_seqlens`` an int or an int32 array (batch,))."""
    start = cache_seqlens[:, None] if hasattr(cache_seqlens, "dtype") else xp.full((batch, 1), cache_seqlens, np.int32)
    step = xp.arange(count, dtype=np.int32) if advance else xp.zeros(count, np.int32)
    return start + step[None, :]


def rotate(xp, x, cos, sin, at, interleaved: bool, dtype=None, compute=np.float32):
    """The rotary embedding of ``x`` (batch, seqlen, heads, head_dim) at positions ``at`` (batch, seqlen): its
    first rotary_dim = 2 * cos.shape[1] channels taken as pairs, (2i, 2i + 1) where ``interleaved`` (GPT-J),
    (i, i + rotary_dim / 2) otherwise (GPT-NeoX), each pair (x1, x2) turned into (x1 cos - x2 sin, x1 sin + x2
    cos) with cos and sin the rows ``cos[at]``, ``sin[at]``; the other channels as they are. Computed in
    ``compute``, returned as a new C-contiguous array of ``dtype`` (x's by default): FlashAttention's rotary."""
    half = cos.shape[1]
    c = cos[at][:, :, None, :].astype(compute)  # (batch, seqlen, 1, rotary_dim / 2)
    s = sin[at][:, :, None, :].astype(compute)
    out = xp.ascontiguousarray(x).astype(dtype or x.dtype, copy=True)
    head = x[..., :2 * half].astype(compute)
    x1, x2 = (head[..., 0::2], head[..., 1::2]) if interleaved else (head[..., :half], head[..., half:])
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    rotated = xp.stack([r1, r2], axis=-1).reshape(head.shape) if interleaved else xp.concatenate([r1, r2], axis=-1)
    out[..., :2 * half] = rotated.astype(out.dtype)
    return out


def prepare(xp, q, k, cache_seqlens, rotary_cos, rotary_sin, interleaved: bool, q_advances: bool, dtype=None,
            compute=np.float32, cache_leftpad=None):
    """(q, k) as the call attends with them and appends k: rotated where rotary_cos is given (k at positions
    ``cache_seqlens[b] - cache_leftpad[b] + i``, q there too where ``q_advances`` (causal or windowed), else all at
    ``cache_seqlens[b] - cache_leftpad[b]``: FlashAttention's rule, positions counted from a sequence's first
    key), else as given. New arrays; the caller's are not written."""
    if rotary_cos is None:
        return q, k
    batch = q.shape[0]
    if cache_leftpad is not None:
        cache_seqlens = positions(xp, cache_seqlens, batch, 1)[:, 0] - cache_leftpad
    q = rotate(xp, q, rotary_cos, rotary_sin, positions(xp, cache_seqlens, batch, q.shape[1], q_advances),
               interleaved, dtype, compute)
    if k is not None:
        k = rotate(xp, k, rotary_cos, rotary_sin, positions(xp, cache_seqlens, batch, k.shape[1]), interleaved, dtype,
                   compute)
    return q, k


def rotate_and_append(xp, q, k, v, k_cache, v_cache, cache_seqlens, block_table, rotary_cos, rotary_sin,
                      interleaved: bool, q_advances: bool, cache_leftpad=None):
    """A call's work before attention: q and k rotated (``prepare``), k and v written into the caches
    (``append``). Returns q as the call attends with it."""
    q, k = prepare(xp, q, k, cache_seqlens, rotary_cos, rotary_sin, interleaved, q_advances,
                   cache_leftpad=cache_leftpad)
    if k is not None:
        append(xp, k_cache, v_cache, k, v, cache_seqlens, block_table)
    return q


def append(xp, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Write ``k`` and ``v`` (batch, seqlen_new, heads_kv, head_dim) into the caches at positions
    ``cache_seqlens[b]``.. of each sequence (``cache_seqlens`` an int or an int32 array (batch,)). Array
    operations: a slice assignment for a contiguous cache and an int, else one scatter per cache."""
    batch, seqlen_new = k.shape[:2]
    if block_table is None and not hasattr(cache_seqlens, "dtype"):
        k_cache[:, cache_seqlens:cache_seqlens + seqlen_new] = k
        v_cache[:, cache_seqlens:cache_seqlens + seqlen_new] = v
        return
    at = positions(xp, cache_seqlens, batch, seqlen_new)
    sequence = xp.arange(batch, dtype=np.int32)[:, None]
    if block_table is None:
        index = (sequence, at)
    else:
        page_size = k_cache.shape[1]
        index = (block_table[sequence, at // page_size], at % page_size)
    k_cache[index] = k
    v_cache[index] = v


def sequence_keys(cache: np.ndarray, block_table, b: int, length: int, start: int = 0) -> np.ndarray:
    """Keys (or values) ``start .. length - 1`` of sequence ``b``, (length - start, heads_kv, head_dim), host
    arrays (``start`` > 0: a contiguous cache's, cache_leftpad)."""
    if block_table is None:
        return cache[b, start:length]
    page_size = cache.shape[1]
    pages = block_table[b, :-(-length // page_size)]
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def lengths_of(cache_seqlens, batch: int, full: int) -> np.ndarray:
    """Each sequence's keys before the call, on the host: ``cache_seqlens`` (int or array) or ``full``."""
    if cache_seqlens is None:
        return np.full(batch, full, np.int64)
    if hasattr(cache_seqlens, "dtype"):
        return to_host(cache_seqlens).astype(np.int64)
    return np.full(batch, int(cache_seqlens), np.int64)


def per_sequence(attend, q, k_cache, v_cache, keys: np.ndarray, block_table, starts=None):
    """Attention of every sequence over its own keys (cache rows ``starts[b] .. keys[b] - 1``; ``starts`` None:
    from 0), as a loop of dense calls: ``attend(b, q_b, k_b, v_b)`` -> (out_b, lse_b) on (1, ...) arrays.
    Returns (out, lse) of the batch. Host arrays."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        start = 0 if starts is None else int(starts[b])
        k_b = sequence_keys(k_cache, block_table, b, int(keys[b]), start)[None]
        v_b = sequence_keys(v_cache, block_table, b, int(keys[b]), start)[None]
        out, lse = attend(b, q[b:b + 1], k_b, v_b)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)
