"""Input makers, the low-precision reference and FlashAttention's tolerance rule.

FlashAttention's tests (shared/ANCHORS.md) compare a kernel with a float reference ``ref`` and with the
same math done in the input dtype, ``pt``: pass when

    max|out - ref| <= factor * max|pt - ref| + rounding(ref)

with factor 2 for the forward and 3 for gradients, and rounding(ref) the reference's rounding in the
input dtype (see ``rounding``). FlashAttention defines the rule for half precision. For float32 both
errors sit at a few float32 ulps, where the ordering of roundings decides the ratio, so no bound drops
below FLOAT32_REL * max(max|ref|, 1), nor below the rounding of the largest exponent (METHOD.md:
float32 arithmetic lands far under 1e-3).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from cuflash import reference

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


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> dtype -> float32: what storing an intermediate in the input dtype does."""
    return x.astype(dtype).astype(np.float32)


def _grouped_repeat(x: np.ndarray, heads: int) -> np.ndarray:
    return np.repeat(x, heads // x.shape[2], axis=2)


def lowp_attention(q, k, v, causal, softmax_scale, dtype):
    """The same math with every stored intermediate in ``dtype`` (float32 accumulation inside products,
    as a framework's half-precision matmul and softmax do). Returns float32 (out, lse)."""
    q, k, v = (to_numpy(x).astype(np.float32) for x in (q, k, v))
    heads = q.shape[2]
    scale = 1 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale
    k, v = _grouped_repeat(k, heads), _grouped_repeat(v, heads)
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * np.float32(scale), dtype)
    visible = reference.causal_mask(q.shape[1], k.shape[1]) if causal else np.ones(s.shape[-2:], bool)
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


def lowp_attention_backward(dout, q, k, v, out, causal, softmax_scale, dtype):
    """Gradients with every stored intermediate in ``dtype``; float32 (dq, dk, dv).

    ``out`` is the forward output handed to the backward, stored in ``dtype``: the backward's
    rowsum(dout * out) inherits its rounding, so the low-precision math uses the same ``out``.
    """
    delta = (to_numpy(out).astype(np.float32) * to_numpy(dout).astype(np.float32)).sum(axis=-1)
    delta = delta.transpose(0, 2, 1)[..., None]  # (batch, heads, seqlen_q, 1)
    q, k, v, dout = (to_numpy(x).astype(np.float32) for x in (q, k, v, dout))
    heads, heads_kv = q.shape[2], k.shape[2]
    scale = np.float32(1 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale)
    kr, vr = _grouped_repeat(k, heads), _grouped_repeat(v, heads)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    visible = reference.causal_mask(q.shape[1], k.shape[1]) if causal else np.ones(s.shape[-2:], bool)
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


def max_abs_finite(x) -> float:
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def rounding(ref: np.ndarray, dtype) -> float:
    """The reference's own rounding in ``dtype``: FlashAttention's 2 * max|(ref + 0.3 - 0.3) - ref|.

    Over many elements that maximum reaches one ulp of 0.3 + |ref|; on a handful (hypothesis draws
    outputs of one element) it can fall to 0 by luck. Use its deterministic value,
    eps(dtype) * (max|ref| + 0.3), so the bound does not depend on where one rounding happens to land.
    """
    if ref.size == 0:
        return 0.0
    return float(ml_dtypes.finfo(dtype).eps) * (float(np.nanmax(np.abs(ref))) + 0.3)


def assert_fa_close(actual, ref, lowp, dtype, factor: float, what: str, max_score: float = 0.0):
    """FlashAttention's rule; NaN and infinities must sit where the reference has them.

    ``max_score`` is the largest |scaled score| (the reference's max |lse| serves): exp(x) carries the
    rounding of x, a relative error of eps * |x|, which sets the floor of any float32 bound.
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
    bound = factor * lowp_err + rounding(ref[finite], np.dtype(dtype))
    # A floor at float32 precision on the inputs' unit scale (standard-normal inputs): where the
    # reference is exactly 0 (one visible key: dS = 0), neither side of the rule has a rounding term.
    floor_rel = max(FLOAT32_REL, 8 * float(np.finfo(np.float32).eps) * max_score)
    bound = max(bound, floor_rel * max(np.abs(ref[finite]).max(), 1.0))
    assert err <= bound, f"{what}: max error {err:.3g} > {factor} x {lowp_err:.3g} + rounding = {bound:.3g}"


def poison_pool(xp, nbytes: int = 64 << 20):
    """Fill free device-pool memory with NaN so an output element the kernel never writes shows up.

    The next ``cupy.empty`` calls reuse these blocks (CuPy's pool hands freed blocks back first).
    """
    if xp is np:
        return
    xp.get_default_memory_pool().free_all_blocks()  # the poisoned block is then the only free one
    buf = xp.full(nbytes // 4, xp.nan, xp.float32)
    del buf
