"""Input makers and the assertion of FlashAttention's tolerance rule (written out in cuflash.reference).

FlashAttention defines the rule for half precision. For float32 both errors sit at a few float32 ulps,
where the ordering of roundings decides the ratio, so no bound drops below FLOAT32_REL * max(max|ref|, 1),
nor below the rounding of the largest exponent (float32 arithmetic lands far under 1e-3 relative error).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from cuflash.reference import attention_backward_in_dtype as lowp_attention_backward  # noqa: F401 (re-export)
from cuflash.reference import attention_in_dtype as lowp_attention  # noqa: F401 (re-export)
from cuflash.reference import rounding

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.dtype(np.float16), BF16, np.dtype(np.float32))
FLOAT32_REL = 1e-5


def to_numpy(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def make_qkv(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype):
    """Fresh standard-normal q, k, v of ``dtype`` on the array module ``xp``."""
    def draw(*shape):
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    return (draw(batch, seqlen_q, heads, head_dim), draw(batch, seqlen_k, heads_kv, head_dim),
            draw(batch, seqlen_k, heads_kv, head_dim))


def max_abs_finite(x) -> float:
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def assert_fa_close(actual, ref, lowp, dtype, factor: float, what: str, max_score: float = 0.0,
                    inherent: float = 0.0):
    """FlashAttention's rule; NaN and infinities must sit where the reference has them.

    ``max_score`` is the largest |scaled score| (the reference's max |lse| serves): exp(x) carries the
    rounding of x, a relative error of eps * |x|, which sets the floor of any float32 bound. ``inherent``
    is an error the inputs carry by themselves, added to the bound (a backward's: what its rounded ``out``
    alone costs, ``cuflash.reference.attention_backward(..., out=out)`` against the exact gradients).
    """
    actual = to_numpy(actual).astype(np.float64)
    ref = np.asarray(ref, np.float64)
    assert actual.shape == ref.shape, f"{what}: shape {actual.shape} != reference {ref.shape}"
    nonfinite = ~np.isfinite(ref)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(ref), err_msg=f"{what}: NaN positions differ")
    np.testing.assert_array_equal(actual[nonfinite & ~np.isnan(ref)], ref[nonfinite & ~np.isnan(ref)],
                                  err_msg=f"{what}: infinities differ")
    finite = ~nonfinite
    if not finite.any():
        return
    err = np.abs(actual[finite] - ref[finite]).max()
    lowp_err = np.abs(np.asarray(lowp, np.float64)[finite] - ref[finite]).max()
    bound = factor * lowp_err + rounding(ref[finite], np.dtype(dtype)) + inherent
    # A floor at float32 precision on the inputs' unit scale (standard-normal inputs): where the
    # reference is exactly 0 (one visible key: dS = 0), neither side of the rule has a rounding term.
    floor_rel = max(FLOAT32_REL, 8 * float(np.finfo(np.float32).eps) * max_score)
    bound = max(bound, floor_rel * max(np.abs(ref[finite]).max(), 1.0))
    assert err <= bound, f"{what}: max error {err:.3g} > {factor} x {lowp_err:.3g} + rounding = {bound:.3g}"


def assert_forward_close(out, lse, q, k, v, causal: bool, ref_options: dict, dtype) -> float:
    """out and lse of an attention call on (q, k, v) against the float64 reference within FlashAttention's forward
    rule (``ref_options``: the reference's keywords); returns the largest finite |lse|, the max_score of the
    gradients' checks."""
    from cuflash import reference

    ref_out, ref_lse = reference.attention(q, k, v, causal, **ref_options)
    lp_out, lp_lse = lowp_attention(q, k, v, causal, None, dtype, **ref_options)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, lp_out, dtype, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, lp_lse, np.float32, 2, "lse", max_score)
    return max_score


def poison_pool(xp, nbytes: int = 64 << 20):
    """Fill free device-pool memory with NaN so an output element the kernel never writes shows up.

    The next ``cupy.empty`` calls reuse these blocks (CuPy's pool hands freed blocks back first).
    """
    if xp is np:
        return
    xp.get_default_memory_pool().free_all_blocks()  # the poisoned block is then the only free one
    buf = xp.full(nbytes // 4, xp.nan, xp.float32)
    del buf


def feature_arrays(xp, rng, options: dict, batch: int, heads: int) -> dict:
    """``options`` with their placeholders made arrays: ``sinks=True`` float32 logits (heads,),
    ``alibi_slopes=True`` float32 slopes in [0.01, 0.3) of shape (batch, heads)."""
    options = dict(options)
    if options.get("sinks") is True:
        options["sinks"] = xp.asarray(rng.standard_normal(heads).astype(np.float32))
    if options.get("alibi_slopes") is True:
        options["alibi_slopes"] = xp.asarray(rng.uniform(0.01, 0.3, (batch, heads)).astype(np.float32))
    return options


def paged_copies(xp, rng, caches, page_size: int, spare_pages: int = 3):
    """The contiguous ``caches`` (batch, capacity, heads_kv, d) as pages of shuffled pools, one block table for
    all of them, with spare pages of noise; the last page of a sequence is zero past its capacity."""
    hosts = [to_numpy(c) for c in caches]
    batch, capacity = hosts[0].shape[:2]
    per_sequence = -(-capacity // page_size)
    num_pages = batch * per_sequence + spare_pages
    table = rng.permutation(num_pages)[:batch * per_sequence].reshape(batch, per_sequence).astype(np.int32)
    pools = []
    for cache in hosts:
        pool = rng.standard_normal((num_pages, page_size, *cache.shape[2:])).astype(cache.dtype)
        padded = np.zeros((batch, per_sequence * page_size, *cache.shape[2:]), cache.dtype)
        padded[:, :capacity] = cache
        pool[table.reshape(-1)] = padded.reshape(batch * per_sequence, page_size, *cache.shape[2:])
        pools.append(xp.asarray(pool))
    return pools, xp.asarray(table)


def packed_pages(xp, rng, k, v, lengths, page_size):
    """k and v (total_k, heads_kv, head_dim) as shuffled pages (with spare pages of noise) and a block table."""
    per = max(1, -(-max(lengths) // page_size))
    pool = len(lengths) * per + 2
    table = rng.permutation(pool)[:len(lengths) * per].reshape(len(lengths), per).astype(np.int32)
    caches = []
    for x in (to_numpy(k), to_numpy(v)):
        cache = rng.standard_normal((pool, page_size, *x.shape[1:])).astype(x.dtype)
        start = 0
        for b, n in enumerate(lengths):
            padded = np.zeros((per * page_size, *x.shape[1:]), x.dtype)
            padded[:n] = x[start:start + n]
            cache[table[b]] = padded.reshape(per, page_size, *x.shape[1:])
            start += n
        caches.append(xp.asarray(cache))
    return caches, xp.asarray(table)
