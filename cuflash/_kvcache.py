"""The KV cache's side of attention_with_kvcache, on either array module: appending keys and values, and
reading a sequence's keys back (the NumPy path and the reference).

A contiguous cache is (batch, seqlen_cache, heads_kv, head_dim); a paged one (num_blocks, page_size,
heads_kv, head_dim) with ``block_table`` (batch, max_blocks_per_sequence): key ``n`` of sequence ``b`` is
row ``n % page_size`` of page ``block_table[b, n // page_size]``.
"""

from __future__ import annotations

import numpy as np


def append(xp, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Write ``k`` and ``v`` (batch, seqlen_new, heads_kv, head_dim) into the caches at positions
    ``cache_seqlens[b]``.. of each sequence (``cache_seqlens`` an int or an int32 array (batch,)). Array
    operations: a slice assignment for a contiguous cache and an int, else one scatter per cache."""
    batch, seqlen_new = k.shape[:2]
    if block_table is None and not hasattr(cache_seqlens, "dtype"):
        k_cache[:, cache_seqlens:cache_seqlens + seqlen_new] = k
        v_cache[:, cache_seqlens:cache_seqlens + seqlen_new] = v
        return
    start = cache_seqlens[:, None] if hasattr(cache_seqlens, "dtype") else xp.full((batch, 1), cache_seqlens, np.int32)
    positions = start + xp.arange(seqlen_new, dtype=np.int32)[None, :]  # (batch, seqlen_new)
    sequence = xp.arange(batch, dtype=np.int32)[:, None]
    if block_table is None:
        index = (sequence, positions)
    else:
        page_size = k_cache.shape[1]
        index = (block_table[sequence, positions // page_size], positions % page_size)
    k_cache[index] = k
    v_cache[index] = v


def sequence_keys(cache: np.ndarray, block_table, b: int, length: int) -> np.ndarray:
    """The first ``length`` keys (or values) of sequence ``b``, (length, heads_kv, head_dim), host arrays."""
    if block_table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    pages = block_table[b, :-(-length // page_size)]
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def lengths_of(cache_seqlens, batch: int, full: int) -> np.ndarray:
    """Each sequence's keys before the call, on the host: ``cache_seqlens`` (int or array) or ``full``."""
    if cache_seqlens is None:
        return np.full(batch, full, np.int64)
    if hasattr(cache_seqlens, "dtype"):
        host = cache_seqlens.get() if hasattr(cache_seqlens, "get") else cache_seqlens
        return np.asarray(host, np.int64)
    return np.full(batch, int(cache_seqlens), np.int64)


def per_sequence(attend, q, k_cache, v_cache, keys: np.ndarray, block_table, alibi_slopes):
    """Attention of every sequence over its own keys, as a loop of dense calls: ``attend(q_b, k_b, v_b,
    alibi_b)`` -> (out_b, lse_b) on (1, ...) arrays. Returns (out, lse) of the batch. Host arrays."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k_b = sequence_keys(k_cache, block_table, b, int(keys[b]))[None]
        v_b = sequence_keys(v_cache, block_table, b, int(keys[b]))[None]
        slopes = None if alibi_slopes is None else alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes
        out, lse = attend(q[b:b + 1], k_b, v_b, slopes)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)
