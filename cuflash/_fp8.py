"""float8_e4m3fn inputs (FlashAttention-3's FP8 forward): quantization with descale factors, the Hadamard
rotation of FlashAttention-3's incoherent processing, and the dequantization that the NumPy path and the
reference compute from.

A float8 array ``x8`` with descale factor ``s`` stands for ``x8 * s``. The factors are float32, one per
tensor (shape ``(1,)``, or ``()``) or one per (batch, kv head) (shape ``(batch, heads_kv)``, FlashAttention-3's
layout); q's query heads use the factor of the kv head they read (head ``h`` that of ``h // group``).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from ._config import FLOAT8_E4M3
from ._validate import array_module

#: the largest finite float8_e4m3fn (S.1111.110: e4m3fn has no infinity, only NaN at S.1111.111); ml_dtypes'
#: finfo (NumPy's refuses ml_dtypes' float8 types in some NumPy and ml_dtypes versions)
E4M3_MAX = float(ml_dtypes.finfo(FLOAT8_E4M3).max)
GRANULARITIES = ("tensor", "head")


def _grouped_factors(descale, batch: int, heads: int, heads_kv: int) -> np.ndarray:
    """A descale factor per (batch, head) of an array of ``heads`` heads, float64 (batch or 1, 1, heads or 1,
    1), broadcasting against (batch, seqlen, heads, head_dim)."""
    factors = np.asarray(descale, np.float64)
    if factors.size == 1:
        return factors.reshape(1, 1, 1, 1)
    return np.repeat(factors.reshape(batch, 1, heads_kv, 1), heads // heads_kv, axis=2)


def dequantize(x, descale, heads_kv: int, dtype=np.float64) -> np.ndarray:
    """``x * descale`` in ``dtype`` (NumPy), x (batch, seqlen, heads, head_dim) of any dtype (uint8: e4m3 bit
    patterns), descale None (1), shape (1,) or () or (batch, heads_kv)."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        x = x.view(FLOAT8_E4M3)
    if descale is None:
        return x.astype(dtype)
    batch, _, heads, _ = x.shape
    return (x.astype(np.float64) * _grouped_factors(descale, batch, heads, heads_kv)).astype(dtype)


def quantize(x, granularity: str = "tensor", heads_kv: int | None = None):
    """(x8, descale): ``x`` (batch, seqlen, heads, head_dim; float16, bfloat16, float32 or float64, NumPy or CuPy)
    in e4m3 and its float32 descale factors, each block scaled so that its largest magnitude maps to E4M3_MAX (the
    format's whole range; a block of zeros takes factor 1). ``granularity`` "tensor": one factor, shape (1,);
    "head": one per (batch, kv head), shape (batch, heads_kv), each over the ``heads // heads_kv`` heads of its
    group (``heads_kv`` defaults to ``heads``: a k or v; for q pass k's heads). In float32 on either path, so both
    give the same bits: each element times the float32 reciprocal of its factor, rounded to nearest (ties to
    even) and saturated to E4M3_MAX: within 2**-4 of its magnitude, or 2**-10 times the factor below e4m3's
    normal range (and float32's rounding of the product). x8 is float8_e4m3fn on NumPy, uint8 bit patterns on
    CuPy (which has no float8 dtype). Checks x for NaN and infinity (on CuPy a synchronization)."""
    xp = array_module(x=x)
    if x.ndim != 4:
        raise ValueError(f"x must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {x.shape}")
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise TypeError(f"x must be a floating-point array, got {x.dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    batch, seqlen, heads, head_dim = x.shape
    heads_kv = heads if heads_kv is None else heads_kv
    if isinstance(heads_kv, bool) or not isinstance(heads_kv, (int, np.integer)) or heads_kv <= 0 \
            or heads % heads_kv:
        raise ValueError(f"heads_kv must be a positive divisor of x's heads ({heads}), got {heads_kv!r}")
    values = x.astype(xp.float32)
    if not bool(xp.isfinite(values).all()):
        raise ValueError("x holds NaN or infinity: e4m3 has no infinity, and no factor scales them")
    blocks = (1,) if granularity == "tensor" else (batch, heads_kv)
    if values.size == 0:
        amax = xp.zeros(blocks, xp.float32)
    elif granularity == "tensor":
        amax = xp.abs(values).max().reshape(1)
    else:  # the largest magnitude per (batch, kv head): over seqlen, the group's heads and head_dim
        amax = xp.abs(values).reshape(batch, seqlen, heads_kv, heads // heads_kv, head_dim).max(axis=(1, 3, 4))
    descale = xp.where(amax > 0, amax / xp.float32(E4M3_MAX), xp.float32(1)).astype(xp.float32)
    inverse = (xp.float32(1) / descale).astype(xp.float32)
    inverse = inverse.reshape(1, 1, 1, 1) if granularity == "tensor" else xp.repeat(
        inverse.reshape(batch, 1, heads_kv, 1), heads // heads_kv, axis=2)
    if xp is np:
        return np.clip(values * inverse, -E4M3_MAX, E4M3_MAX).astype(FLOAT8_E4M3), descale
    return _e4m3_bits()(values, inverse), descale


@functools.lru_cache(maxsize=1)
def _e4m3_bits():
    """x * inverse as e4m3 bit patterns on CuPy (float32 product, rounded to nearest even, saturated)."""
    import cupy

    return cupy.ElementwiseKernel("float32 x, float32 inverse", "uint8 y",
                                  "y = __nv_cvt_float_to_fp8(x * inverse, __NV_SATFINITE, __NV_E4M3);",
                                  "cuflash_quantize_e4m3", preamble="#include <cuda_fp8.h>")


def hadamard_rotation(head_dim: int, seed: int = 0) -> np.ndarray:
    """An orthogonal (head_dim, head_dim) float64 matrix ``R = diag(signs) @ blockdiag(H, .., H) / sqrt(n)``: H
    the Sylvester-Hadamard matrix of n, the largest power of two dividing head_dim, and random signs drawn from
    ``seed``. ``q @ R`` and ``k @ R`` have the scores of q and k (``R @ R.T = I``) with each channel's outliers
    spread over n channels (FlashAttention-3's incoherent processing). An odd head_dim gets the signs alone."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    n = head_dim & -head_dim   # the largest power of two dividing head_dim
    hadamard = np.ones((1, 1))
    while hadamard.shape[0] < n:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=head_dim)
    return signs[:, None] * np.kron(np.eye(head_dim // n), hadamard / np.sqrt(n))


def quantize_qkv(q, k, v, granularity: str = "head", hadamard: bool = False, seed: int = 0):
    """(q8, k8, v8, q_descale, k_descale, v_descale): q, k and v ((batch, seqlen, heads, head_dim) and (batch,
    seqlen_k, heads_kv, head_dim); NumPy or CuPy) quantized for ``attention(q8, k8, v8, q_descale=q_descale,
    ...)``, factors per ``granularity`` (:func:`quantize`; q's per kv head of k). ``hadamard``: q and k are
    rotated first, in float32, by :func:`hadamard_rotation` (head_dim, seed), which leaves every score as it is
    and spreads outlier channels before they set a block's factor."""
    xp = array_module(q=q, k=k, v=v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(a.shape)}")
    if hadamard:
        if q.shape[3] != k.shape[3]:
            raise ValueError(f"head_dim must match: q {q.shape[3]}, k {k.shape[3]}")
        rotation = xp.asarray(hadamard_rotation(q.shape[3], seed).astype(np.float32))
        q, k = q.astype(xp.float32) @ rotation, k.astype(xp.float32) @ rotation
    heads_kv = k.shape[2]
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (
        quantize(q, granularity, heads_kv), quantize(k, granularity), quantize(v, granularity))
    return q8, k8, v8, q_descale, k_descale, v_descale
