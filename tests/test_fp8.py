"""float8 e4m3 inputs: quantization and its descale factors, the Hadamard rotation, and the forwards on them
(attention, attention_with_kvcache) against the float64 reference of their dequantized values: the NumPy path
(float8_e4m3fn arrays, and uint8 bit patterns for attention) and, on a Hopper GPU, attention's float8 kernel
(uint8 bit patterns: CuPy has no float8 dtype), within FlashAttention's rule against the same math with P
rounded to e4m3 and q.k summed as Hopper's e4m3 tensor cores sum it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import _fp8, reference

from ._checks import (BF16, assert_fa_close, lowp_attention, max_abs_finite, paged_copies, poison_pool,
                      to_numpy)
from .conftest import GPU, requires_gpu

E4M3 = cuflash.FLOAT8_E4M3
# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim): both seqlen orders, GQA and MQA, odd head dims
FLOAT8_SHAPES = [
    (2, 70, 90, 4, 2, 64),
    (1, 129, 65, 2, 2, 128),
    (1, 33, 200, 4, 1, 40),
    (1, 1, 130, 2, 1, 256),
]
# attention's options under which the float8 forward runs (every mask and score modifier)
FLOAT8_OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(24, 3)),
    "softcap": dict(softcap=4.0, causal=True),
    "alibi": dict(alibi_slopes="heads"),
    "sinks": dict(sinks=True, causal=True),
}


def _inputs(rng, shape, dtype=np.float32):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    draw = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    return (draw(batch, seqlen_q, heads, head_dim), draw(batch, seqlen_k, heads_kv, head_dim),
            draw(batch, seqlen_k, heads_kv, head_dim))


def _options(rng, heads, spec):
    options = dict(spec)
    if options.get("alibi_slopes") == "heads":
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, heads).astype(np.float32)
    if options.pop("sinks", False):
        options["sinks"] = (2 * rng.standard_normal(heads)).astype(np.float32)
    return options


@pytest.mark.parametrize("granularity", _fp8.GRANULARITIES)
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_quantization_rounds_each_element_to_e4m3(rng, granularity, dtype):
    x = (rng.standard_normal((2, 37, 6, 40)) * rng.uniform(0.01, 100, (2, 1, 6, 1))).astype(dtype)
    x8, descale = cuflash.quantize_fp8(x, granularity, heads_kv=3)
    assert x8.dtype == E4M3 and x8.shape == x.shape
    assert descale.dtype == np.float32 and descale.shape == ((1,) if granularity == "tensor" else (2, 3))
    values = x.astype(np.float64)
    restored = _fp8.dequantize(x8, descale, heads_kv=3)
    factors = _fp8._grouped_factors(descale, 2, 6, 3)
    # within half an e4m3 ulp: 2**-4 of the magnitude in the normal range, 2**-10 of the factor below it
    assert (np.abs(restored - values) <= (2.0**-4 * np.abs(values) + 2.0**-10 * factors) * (1 + 1e-6)).all()
    # each block's largest magnitude maps to the format's largest value (the whole range is used)
    blocks = np.abs(x8.astype(np.float64)).reshape(2, 37, 3, 2, 40).max(axis=(1, 3, 4))
    assert blocks.max() == _fp8.E4M3_MAX
    if granularity == "head":
        assert (blocks == _fp8.E4M3_MAX).all()


def test_quantization_of_zeros_takes_factor_one():
    x8, descale = cuflash.quantize_fp8(np.zeros((1, 4, 2, 8), np.float32), "head")
    assert (x8.astype(np.float32) == 0).all() and (descale == 1).all()


@pytest.mark.parametrize("bad, error, words", [
    (dict(x=np.full((1, 2, 2, 8), np.inf, np.float32)), ValueError, "infinity"),
    (dict(x=np.zeros((2, 8), np.float32)), ValueError, "4 dimensions"),
    (dict(x=np.zeros((1, 2, 2, 8), np.int32)), TypeError, "floating-point"),
    (dict(granularity="row"), ValueError, "granularity"),
    (dict(granularity="head", heads_kv=3), ValueError, "heads_kv"),
    (dict(x=[[[[1.0]]]]), TypeError, "numpy.ndarray"),
])
def test_quantization_refuses_what_it_cannot_scale(bad, error, words):
    arguments = dict(x=np.ones((1, 2, 4, 8), np.float32), granularity="tensor", heads_kv=None) | bad
    with pytest.raises(error, match=words):
        cuflash.quantize_fp8(arguments["x"], arguments["granularity"], arguments["heads_kv"])


def test_quantization_of_an_empty_tensor_takes_factor_one():
    x8, descale = cuflash.quantize_fp8(np.zeros((2, 0, 4, 8), np.float32), "head", heads_kv=2)
    assert x8.shape == (2, 0, 4, 8) and x8.dtype == E4M3
    assert descale.shape == (2, 2) and descale.dtype == np.float32 and (descale == 1).all()


def test_quantize_qkv_refuses_by_name(rng):
    q, k, v = _inputs(rng, (1, 4, 6, 2, 1, 16))
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        cuflash.quantize_qkv(q, k[0], v)
    with pytest.raises(ValueError, match="head_dim must match: q 16, k 8"):
        cuflash.quantize_qkv(q, k[..., :8], v, hadamard=True)
    for head_dim in (0, 2.0, True, "16"):
        with pytest.raises(ValueError, match="head_dim must be a positive int"):
            cuflash.hadamard_rotation(head_dim)


@pytest.mark.parametrize("head_dim", [1, 3, 40, 64, 96, 128, 256])
def test_the_hadamard_rotation_is_orthogonal_and_keeps_the_scores(rng, head_dim):
    rotation = cuflash.hadamard_rotation(head_dim, seed=int(rng.integers(1 << 30)))
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(head_dim), atol=1e-12)
    q, k = rng.standard_normal((2, 5, head_dim)), rng.standard_normal((2, 7, head_dim))
    np.testing.assert_allclose((q @ rotation) @ (k @ rotation).swapaxes(-1, -2), q @ k.swapaxes(-1, -2), atol=1e-11)
    # channels mix in blocks of the largest power of two dividing head_dim: every entry of a block is +-1/sqrt(n)
    n = head_dim & -head_dim
    np.testing.assert_allclose(np.abs(rotation[:n, :n]), np.full((n, n), n**-0.5))
    # the signs are the seed's: another seed, another rotation
    assert head_dim == 1 or not np.array_equal(rotation, cuflash.hadamard_rotation(head_dim, seed=1 + (1 << 30)))


def test_the_hadamard_rotation_spreads_outlier_channels():
    # FlashAttention-3's case for incoherent processing: a few channels of q and k 30x the rest set the factor of
    # their block, and the other channels lose their bits. Rotated first, the error falls (measured: 3x in RMS)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 256, 4, 128)) for _ in range(3))
    for x in (q, k):
        x[..., :4] *= 30
        x /= 3 * 128**0.25
    exact, _ = reference.attention(q, k, v)
    errors = {}
    for hadamard in (False, True):
        q8, k8, v8, *descales = cuflash.quantize_qkv(q, k, v, "head", hadamard=hadamard)
        out, _ = reference.attention(q8, k8, v8, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
        errors[hadamard] = np.sqrt(((out - exact) ** 2).mean())
    assert errors[True] < 0.5 * errors[False], errors


@pytest.mark.parametrize("granularity", _fp8.GRANULARITIES)
@pytest.mark.parametrize("option", FLOAT8_OPTIONS)
@pytest.mark.parametrize("shape", FLOAT8_SHAPES, ids=str)
def test_float8_forward_matches_the_reference_of_its_values(rng, shape, option, granularity):
    q, k, v = _inputs(rng, shape)
    q8, k8, v8, q_descale, k_descale, v_descale = cuflash.quantize_qkv(q, k, v, granularity)
    options = _options(rng, shape[3], FLOAT8_OPTIONS[option])
    kept = [x.copy() for x in (q8, k8, v8, q_descale, k_descale, v_descale)]
    out, lse = cuflash.attention(q8, k8, v8, return_lse=True, q_descale=q_descale, k_descale=k_descale,
                                 v_descale=v_descale, **options)
    assert out.dtype == BF16 and lse.dtype == np.float32
    for before, after in zip(kept, (q8, k8, v8, q_descale, k_descale, v_descale)):
        assert before.tobytes() == after.tobytes()   # the caller's arrays are never written
    ref, ref_lse = reference.attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                       **options)
    values = [_fp8.dequantize(x, d, shape[4], np.float32) for x, d in ((q8, q_descale), (k8, k_descale),
                                                                          (v8, v_descale))]
    lowp, lowp_lse = lowp_attention(*values, options.pop("causal", False), None, BF16, **options)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref, lowp, BF16, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, lowp_lse, np.float32, 2, "lse", max_score)


def test_descale_factors_are_read_on_every_call(rng):
    # the factors are values of each call, not of its plan: a second call of the same shapes with other factors
    # scales its output by them
    q, k, v = _inputs(rng, FLOAT8_SHAPES[0])
    q8, k8, v8, q_descale, k_descale, v_descale = cuflash.quantize_qkv(q, k, v, "tensor")
    first = cuflash.attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    doubled = cuflash.attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=2 * v_descale)
    np.testing.assert_array_equal(doubled.astype(np.float32), 2 * first.astype(np.float32))


def test_float8_output_dtype(rng):
    q8, k8, v8, *_ = cuflash.quantize_qkv(*_inputs(rng, FLOAT8_SHAPES[0]))
    assert cuflash.attention(q8, k8, v8).dtype == BF16   # factors of 1
    assert cuflash.attention(q8, k8, v8, out_dtype=np.float16).dtype == np.float16
    assert cuflash.attention(q8, k8, v8, out_dtype="bfloat16").dtype == BF16
    out, lse = cuflash.attention(q8, k8[:, :0], v8[:, :0], return_lse=True)   # no keys: zeros in out_dtype
    assert out.dtype == BF16 and (out.astype(np.float32) == 0).all() and (lse == -np.inf).all()


def _float8_call(rng, **changes):
    q8, k8, v8, q_descale, k_descale, v_descale = cuflash.quantize_qkv(*_inputs(rng, FLOAT8_SHAPES[0]))
    arguments = dict(q=q8, k=k8, v=v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale) | changes
    return cuflash.attention(**arguments)


@pytest.mark.parametrize("changes, error, words", [
    (dict(q_descale=np.ones(3, np.float32)), ValueError, "q_descale must have shape"),
    (dict(k_descale=np.ones((1,), np.float64)), TypeError, "k_descale must be float32"),
    (dict(v_descale=1.0), TypeError, "v_descale must be a numpy.ndarray"),
    (dict(out_dtype=np.float32), TypeError, "out_dtype of float8_e4m3fn inputs"),
    (dict(out_dtype="float9"), TypeError, "out_dtype must name a dtype"),
    (dict(k=np.zeros((2, 90, 2, 64), BF16)), TypeError, "share one dtype"),
])
def test_bad_float8_arguments_are_refused(rng, changes, error, words):
    with pytest.raises(error, match=words):
        _float8_call(rng, **changes)


def test_descales_and_out_dtype_belong_to_float8_inputs(rng):
    q, k, v = _inputs(rng, FLOAT8_SHAPES[0])
    with pytest.raises(ValueError, match="q_descale applies to float8_e4m3fn inputs only"):
        cuflash.attention(q, k, v, q_descale=np.ones(1, np.float32))
    with pytest.raises(ValueError, match="out_dtype is for float8_e4m3fn inputs"):
        cuflash.attention(q, k, v, out_dtype=np.float16)
    assert cuflash.attention(q, k, v, out_dtype=np.float32).dtype == np.float32   # its own dtype: allowed


def test_only_the_forwards_take_float8(rng):
    q8, k8, v8, *_ = cuflash.quantize_qkv(*_inputs(rng, FLOAT8_SHAPES[0]))
    lse = np.zeros((2, 4, 70), np.float32)
    with pytest.raises(TypeError, match=r"only the forwards attention\(\) and attention_with_kvcache\(\)"):
        cuflash.attention_backward(q8, q8, k8, v8, q8, lse)
    cu = np.array([0, 70], np.int32)
    with pytest.raises(TypeError, match=r"only the forwards"):
        cuflash.attention_varlen(q8[0], k8[0, :70], v8[0, :70], cu, cu)


def _quantize_with(x, descale, heads_kv: int):
    """``x`` in e4m3 under given factors (the new keys or values of a cache quantized with the cache's)."""
    return (x.astype(np.float64) / _fp8._grouped_factors(descale, x.shape[0], x.shape[2], heads_kv)).astype(E4M3)


@pytest.mark.parametrize("granularity", _fp8.GRANULARITIES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("option", ["plain", "causal", "window", "alibi", "sinks"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_float8_kvcache_matches_the_reference_of_its_values(xp, rng, granularity, paged, option, head_dim):
    """Decoding on float8 caches (GQA, appending new float8 keys and values under the cache's factors): out
    and lse against the float64 reference of the dequantized values; the cache written at the new rows only,
    with the new bits. The NumPy path takes float8_e4m3fn arrays, the GPU's KV-cache forward uint8 bit patterns
    (it converts the tiles to float16 on chip: its P is finer than the bfloat16 rounding the rule allows)."""
    batch, heads, heads_kv, capacity, seqlen_q, seqlen_new = 3, 4, 2, 192, 2, 3
    q, k_cache, v_cache = _inputs(rng, (batch, seqlen_q, capacity, heads, heads_kv, head_dim))
    q8, k8_cache, v8_cache, q_descale, k_descale, v_descale = cuflash.quantize_qkv(q, k_cache, v_cache, granularity)
    k_new, v_new = (_quantize_with(rng.standard_normal((batch, seqlen_new, heads_kv, head_dim)), d, heads_kv)
                    for d in (k_descale, v_descale))
    lengths = np.array([0, 77, capacity - seqlen_new], np.int32)
    options = _options(rng, heads, FLOAT8_OPTIONS[option])
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)

    def on_path(x):   # the path's form of an array: uint8 bit patterns on CuPy
        return x if xp is np else xp.asarray(x.view(np.uint8) if x.dtype == E4M3 else x)

    caches = [on_path(k8_cache.copy()), on_path(v8_cache.copy())]
    table = None
    if paged:
        caches, table = paged_copies(xp, rng, caches, page_size=64)
    before = [to_numpy(c).view(np.uint8).copy() for c in caches]
    poison_pool(xp)
    out, lse = cuflash.attention_with_kvcache(
        on_path(q8), *caches, on_path(k_new), on_path(v_new), cache_seqlens=on_path(lengths), block_table=table,
        return_lse=True, **{name: on_path(d) for name, d in descales.items()},
        **{name: on_path(x) if isinstance(x, np.ndarray) else x for name, x in options.items()})
    assert out.dtype == BF16 and lse.dtype == np.float32
    ref, ref_lse = reference.attention_with_kvcache(q8, k8_cache, v8_cache, k_new, v_new, cache_seqlens=lengths,
                                                    **descales, **options)
    values = [_fp8.dequantize(x, d, heads_kv, np.float32) for x, d in
              ((q8, q_descale), (k8_cache, k_descale), (v8_cache, v_descale), (k_new, k_descale), (v_new, v_descale))]
    lowp, lowp_lse = reference.attention_with_kvcache(*values, cache_seqlens=lengths, in_dtype=BF16, **options)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref, lowp, BF16, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, lowp_lse, np.float32, 2, "lse", max_score)
    table = None if table is None else to_numpy(table)
    for cache, old, new in zip(caches, before, (k_new, v_new)):   # the new rows hold the new bits, nothing else moved
        cache = to_numpy(cache).view(np.uint8)
        for b, start in enumerate(lengths):
            for i in range(seqlen_new):
                n = start + i
                page, row = (b, n) if table is None else (table[b, n // 64], n % 64)
                assert cache[page, row].tobytes() == new[b, i].tobytes()
                old[page, row] = new[b, i].view(np.uint8)
        assert cache.tobytes() == old.tobytes()


def test_float8_kvcache_refuses_rotary_and_stray_factors(rng):
    q, k_cache, v_cache = _inputs(rng, (1, 1, 64, 2, 2, 32))
    q8, k8, v8, *descales = cuflash.quantize_qkv(q, k_cache, v_cache)
    table = np.ones((8, 8), np.float32)
    with pytest.raises(TypeError, match="rotate before quantizing"):
        cuflash.attention_with_kvcache(q8, k8, v8, cache_seqlens=8, rotary_cos=table, rotary_sin=table)
    with pytest.raises(ValueError, match="k_descale applies to float8_e4m3fn inputs only"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k_descale=descales[1])
    with pytest.raises(TypeError, match="share one dtype"):
        cuflash.attention_with_kvcache(q8, k_cache, v_cache)
    out = cuflash.attention_with_kvcache(q8[:, :, :0], k8, v8, out_dtype=np.float16)   # no heads: zeros of out_dtype
    assert out.dtype == np.float16 and out.shape == (1, 1, 0, 32)


def test_uint8_bit_patterns_are_float8(rng):
    # CuPy has no float8 dtype: uint8 arrays of e4m3 bit patterns are read as float8_e4m3fn
    q8, k8, v8, *descales = cuflash.quantize_qkv(*_inputs(rng, FLOAT8_SHAPES[0]))
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    as_float8 = cuflash.attention(q8, k8, v8, causal=True, **names)
    as_bytes = cuflash.attention(q8.view(np.uint8), k8.view(np.uint8), v8.view(np.uint8), causal=True, **names)
    np.testing.assert_array_equal(as_bytes.astype(np.float32), as_float8.astype(np.float32))
    cache_bytes = cuflash.attention_with_kvcache(q8.view(np.uint8), k8.view(np.uint8), v8.view(np.uint8), **names)
    np.testing.assert_array_equal(cache_bytes.astype(np.float32),
                                  cuflash.attention_with_kvcache(q8, k8, v8, **names).astype(np.float32))
    with pytest.raises(TypeError, match=r"uint8 \(float8 e4m3\), which only the forwards attention\(\)"):
        cuflash.attention_backward(q8.view(np.uint8), q8.view(np.uint8), k8.view(np.uint8), v8.view(np.uint8),
                                   q8.view(np.uint8), np.zeros((2, 4, 70), np.float32))


def test_the_float8_kernel_is_planned_where_it_serves():
    from cuflash import _config, _plan
    from cuflash._validate import Problem

    def problem(head_dim=128, dropout_p=0.0, causal=True):
        return Problem(2, 1000, 1000, 8, 2, head_dim, E4M3, causal, head_dim**-0.5, -1, 0 if causal else -1, 0,
                       dropout_p=dropout_p, out_dtype=BF16, descale_shapes=((2, 2),) * 3)

    for head_dim, tile in ((64, "192, 128"), (128, "128, 192"), (256, "128, 64")):
        launch = _plan.forward(problem(head_dim), _config.H100)
        assert launch.spec.kernel == "fwd_wgmma" and launch.spec.dtype == E4M3 and launch.spec.head_dim == head_dim
        assert launch.spec.name.startswith(f"cuflash::fwd_wgmma<__nv_fp8_e4m3, {head_dim}, 1, 0, {tile}")
        # V^T of the keys rounded up to 128 (a whole number of key tiles), written by a block per (128 keys, kv
        # head, batch)
        assert launch.transpose.spec.name == f"cuflash::transpose_v_float8<{head_dim}>"
        assert launch.transpose_shape == (2, 2, head_dim, 1024) and launch.transpose.grid == (8, 2, 2)
        # the maps' box rows: 64 bytes where a row of q and k (head_dim 64) is, and V^T's boxes of 64 keys where
        # 128 do not divide the key tile (64 or 192 keys)
        assert _config.wgmma_row_bytes(launch.spec) == ((64, 64, 128) if head_dim == 64 else (128, 128, 64))
    # under a window head_dim 128 keeps 128-key tiles (one box of V^T's a tile)
    windowed = dataclasses.replace(problem(128), window_left=100)
    launch = _plan.forward(windowed, _config.H100)
    assert (launch.spec.block_m, launch.spec.block_n) == (128, 128)
    assert _config.wgmma_row_bytes(launch.spec) == (128, 128, 128)
    with pytest.raises(TypeError, match="compute capability 9.0"):
        _plan.forward(problem(), _config.A100)
    with pytest.raises(TypeError, match=r"head_dim in \(64, 128, 256\) \(got 96\)"):
        _plan.forward(problem(head_dim=96), _config.H100)
    with pytest.raises(TypeError, match="got dropout"):
        _plan.forward(problem(dropout_p=0.1), _config.H100)


def test_the_float8_cache_is_planned_where_it_serves():
    # the KV-cache forward of float8 caches: fwd_mma of e4m3 (its tiles converted to float16), the 16-bit
    # tiles and splits, a staging area for the bytes as loaded; append_rotary copies the new rows' bytes
    from cuflash import _config, _plan
    from cuflash._validate import check_kvcache

    def problem(head_dim, paged=False):
        q = np.zeros((2, 1, 8, head_dim), E4M3)
        cache = np.zeros((64, 64, 2, head_dim) if paged else (2, 4096, 2, head_dim), E4M3)
        new = np.zeros((2, 1, 2, head_dim), E4M3)
        table = np.zeros((2, 64), np.int32) if paged else None
        return check_kvcache(q, cache, cache, new, new, np.zeros(2, np.int32), table, True, None, (-1, -1), 0.0,
                             None, None, 0)

    for head_dim, paged, tile in ((64, False, 128), (128, False, 128), (128, True, 64), (256, False, 64)):
        p = problem(head_dim, paged)
        launches = _plan.kvcache(p, _config.H100)
        bf16 = _config.kvcache_forward_spec(head_dim, BF16, p.attn.mask_kind, _config.H100, 0, p.page_size)
        spec = launches.forward.spec
        assert spec.name.startswith(f"cuflash::fwd_mma<__nv_fp8_e4m3, {head_dim}, 1, 0, 16, {tile}, 4, 1, true")
        assert (spec.block_m, spec.block_n, spec.threads) == (bf16.block_m, bf16.block_n, bf16.threads)
        # float16 Q, one stage of K and V; then the bytes: Q, two stages of K and V
        row = _config.forward_row_elems(head_dim)
        assert spec.smem_bytes == (16 + 2 * tile) * row * 2 + (16 + 4 * tile) * head_dim
        assert launches.append.spec.name == "cuflash::append_rotary<__nv_fp8_e4m3>"
    with pytest.raises(TypeError, match=r"float8 caches run on the GPU at head_dim in \(64, 128, 256\), got 96"):
        _plan.kvcache(problem(96), _config.H100)


def test_the_e4m3_sums_model_truncates_to_13_fraction_bits():
    """reference._truncate keeps 13 bits after the leading one, toward zero, of either sign."""
    values = np.array([1 + 2.0**-13, 1 + 2.0**-14, -(1 + 2.0**-14), 3 * 2.0**-20 + 2.0**-40, 0.0])
    np.testing.assert_array_equal(reference._truncate(values, 13), [1 + 2.0**-13, 1, -1, 3 * 2.0**-20, 0])


def test_the_e4m3_sums_model_aligns_each_step_to_its_largest_term():
    """A k32 step drops what lies below 13 fraction bits of its largest product or accumulator: 31 products
    of 2**-14 beside one of 1 vanish (their exact sum 1.0019 would keep them); beside each other they count."""
    small = np.full(reference.FLOAT8_MMA_K, 2.0**-14)
    with_one = small.copy()
    with_one[0] = 1.0
    assert reference._float8_step(np.zeros(()), with_one) == 1.0
    assert reference._float8_step(np.zeros(()), small) == reference.FLOAT8_MMA_K * 2.0**-14
    assert reference._float8_step(np.array(1.0), small) == 1.0   # the accumulator sets the alignment too


def test_the_e4m3_sums_model_is_exact_where_the_sums_fit_13_bits(rng):
    """Small integers (e4m3 holds them exactly) whose running sums stay below 2**14: nothing truncates, so the
    model's scores are the exact products, at head dims that end in a partial k32 step too."""
    for head_dim in (16, 64, 80):
        q = rng.integers(-4, 5, (1, 5, 2, head_dim)).astype(np.float32).astype(E4M3)
        k = rng.integers(-4, 5, (1, 7, 2, head_dim)).astype(np.float32).astype(E4M3)
        exact = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64))
        np.testing.assert_array_equal(reference._float8_scores(q, k, None, None, 2), exact)


@pytest.mark.parametrize("option", FLOAT8_OPTIONS)
@pytest.mark.parametrize("shape", [(1, 40, 70, 4, 2, 64), (2, 70, 33, 4, 1, 40)], ids=str)
def test_the_float8_model_is_exact_attention_but_for_p_and_the_sums(rng, shape, option):
    """reference.attention_float8_in_dtype, the low-precision side of the GPU tests, under every mask and score
    modifier: it differs from the exact attention of the same values only by P's e4m3 rounding (each weight
    within 2**-4 of itself, so out within 2**-4 max|v| and bfloat16's rounding) and the e4m3 units' sums of the
    scores (lse within 2**-8 of (1 + |lse|), the row sum taking P unrounded); it sees the rows the exact one
    sees. A modifier the model dropped or misapplied moves its scores by whole units."""
    q8, k8, v8, *descales = cuflash.quantize_qkv(*_inputs(rng, shape), "head")
    options = _options(rng, shape[3], FLOAT8_OPTIONS[option])
    ref, ref_lse = reference.attention(q8, k8, v8, q_descale=descales[0], k_descale=descales[1],
                                       v_descale=descales[2], **options)
    causal = options.pop("causal", False)
    model, model_lse = reference.attention_float8_in_dtype(q8, k8, v8, causal, None, *descales, **options)
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(model_lse), seen)
    assert (np.abs(model_lse[seen] - ref_lse[seen]) <= 2.0**-8 * (1 + np.abs(ref_lse[seen]))).all()
    v_max = np.abs(_fp8.dequantize(v8, descales[2], shape[4])).max()
    assert np.abs(model - ref).max() <= 2.0**-4 * v_max + reference.rounding(ref, BF16)


def _hopper_gpu() -> bool:
    if not GPU:
        return False
    from cuflash import _cupy_path

    return _cupy_path.device_props(0).tensor_maps


@requires_gpu
@pytest.mark.parametrize("granularity", _fp8.GRANULARITIES)
@pytest.mark.parametrize("option", FLOAT8_OPTIONS)
@pytest.mark.parametrize("shape", [(2, 70, 90, 4, 2, 128), (1, 300, 1000, 2, 1, 128), (1, 1000, 300, 2, 2, 128),
                                   (1, 1, 130, 2, 1, 128), (2, 300, 400, 4, 2, 64), (1, 1, 1000, 2, 1, 64),
                                   (1, 400, 300, 2, 1, 256), (2, 70, 1000, 2, 2, 256)], ids=str)
def test_the_float8_kernel_matches_the_reference_of_its_values(rng, shape, option, granularity):
    import cupy as cp

    if not _hopper_gpu():
        pytest.skip("the float8 kernel runs on compute capability 9.0 with tensor maps")
    q8, k8, v8, *descales = cuflash.quantize_qkv(*_inputs(rng, shape), granularity)
    options = _options(rng, shape[3], FLOAT8_OPTIONS[option])
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    on_device = {name: cp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in {**names, **options}.items()}
    poison_pool(cp)
    out, lse = cuflash.attention(*(cp.asarray(x.view(np.uint8)) for x in (q8, k8, v8)), return_lse=True, **on_device)
    assert out.dtype == BF16
    ref, ref_lse = reference.attention(q8, k8, v8, **names, **options)
    causal = options.pop("causal", False)
    lowp, lowp_lse = reference.attention_float8_in_dtype(q8, k8, v8, causal, None, *descales, **options)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref, lowp, BF16, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, lowp_lse, np.float32, 2, "lse", max_score)


@requires_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_float8_transpose_writes_v_t_in_the_order_of_p(rng, head_dim):
    # transpose_v_float8 alone: V^T (batch, heads_kv, head_dim, keys rounded up to 128) with each 16 keys in the
    # order in which P's A fragments hold them (column 4 t + i: key 2 t + i for i < 2, 8 + 2 t + i - 2 else), zeros
    # past seqlen_k, and every byte of a poisoned buffer written; 300 keys end inside a tile, 3 kv heads
    import cupy as cp

    if not _hopper_gpu():
        pytest.skip("the float8 kernel runs on compute capability 9.0 with tensor maps")
    batch, seqlen_k, heads_kv = 2, 300, 3
    v = rng.integers(0, 256, (batch, seqlen_k, heads_kv, head_dim), dtype=np.uint8)
    q = rng.integers(0, 120, (batch, 5, heads_kv, head_dim), dtype=np.uint8)
    q8, k8, v8 = cp.asarray(q), cp.asarray(v[:, ::-1].copy()), cp.asarray(v)
    run = cuflash._plan_forward(q8, k8, v8, False, None, (-1, -1), 0.0, None, None, 0.0, "bottom_right")
    plan = run.__self__
    keys = 384
    assert plan.transpose_shape == (batch, heads_kv, head_dim, keys)
    vt = cp.full(plan.transpose_shape, 0xA5, np.uint8)
    plan.transpose((v8, vt))
    column = np.arange(keys)
    t, i = column % 16 // 4, column % 4
    key = column // 16 * 16 + np.where(i < 2, 2 * t + i, 8 + 2 * t + i - 2)
    padded = np.concatenate([v, np.zeros((batch, keys - seqlen_k, heads_kv, head_dim), np.uint8)], axis=1)
    np.testing.assert_array_equal(vt.get(), padded[:, key].transpose(0, 2, 3, 1))


@requires_gpu
@pytest.mark.parametrize("granularity", _fp8.GRANULARITIES)
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_quantization_on_the_gpu_gives_the_hosts_bits(rng, granularity, dtype):
    import cupy as cp

    q, k, v = _inputs(rng, (2, 70, 90, 4, 2, 64), dtype)
    q[..., :3] *= 40   # outlier channels
    host = cuflash.quantize_qkv(q, k, v, granularity)
    device = cuflash.quantize_qkv(*(cp.asarray(x) for x in (q, k, v)), granularity)
    for h, d in zip(host, device):
        assert d.dtype == (np.uint8 if h.dtype == E4M3 else h.dtype)
        np.testing.assert_array_equal(d.get(), h.view(np.uint8) if h.dtype == E4M3 else h)
    # rotated, the matrix products sum in other orders: each value within one e4m3 step of the host's
    host = cuflash.quantize_qkv(q, k, v, granularity, hadamard=True, seed=5)
    device = cuflash.quantize_qkv(*(cp.asarray(x) for x in (q, k, v)), granularity, hadamard=True, seed=5)
    for (h8, h_descale), (d8, d_descale) in zip(zip(host[:3], host[3:]), zip(device[:3], device[3:])):
        np.testing.assert_allclose(d_descale.get(), h_descale, rtol=1e-5)
        expected = _fp8.dequantize(h8, h_descale, 2)
        restored = _fp8.dequantize(d8.get(), d_descale.get(), 2)
        assert (np.abs(restored - expected) <= 2.0**-3 * np.abs(expected) + 2.0**-9 * h_descale.max()).all()


@requires_gpu
def test_float8_on_the_gpu_outside_the_kernel_is_refused(rng):
    import cupy as cp

    q8, k8, v8, *_ = cuflash.quantize_qkv(*_inputs(rng, (1, 64, 64, 2, 2, 96)))
    with pytest.raises(TypeError, match="float8 inputs run on the GPU in the Hopper float8 forward"):
        cuflash.attention(*(cp.asarray(x.view(np.uint8)) for x in (q8, k8, v8)))


@requires_gpu
def test_the_error_bench_measures_the_kernel_as_the_model_predicts(monkeypatch):
    # bench.fp8_error's two sources: the kernel's errors are the model's (the README's table is the kernel's)
    from bench import fp8_error

    if not _hopper_gpu():
        pytest.skip("the float8 kernel runs on compute capability 9.0 with tensor maps")
    monkeypatch.setattr(fp8_error, "SHAPE", (1, 256, 2, 128))
    kernel, model = fp8_error.measure(on_gpu=True), fp8_error.measure(on_gpu=False)
    for got, want in zip(kernel, model, strict=True):
        if got["method"] == fp8_error.METHODS[0][0]:
            assert got["relative_rmse_exact"] < 0.01, got
        else:
            assert 0.8 < got["rmse_exact"] / want["rmse_exact"] < 1.25, (got, want)


@requires_gpu
def test_float8_caches_on_the_gpu_refuse_what_16_byte_copies_cannot_read(rng):
    import cupy as cp

    def on_gpu(*arrays):
        return [cp.asarray(x.view(np.uint8)) for x in arrays]

    q8, k8, v8, *_ = cuflash.quantize_qkv(*_inputs(rng, (1, 1, 64, 2, 2, 96)))
    with pytest.raises(TypeError, match=r"float8 caches run on the GPU at head_dim in \(64, 128, 256\), got 96"):
        cuflash.attention_with_kvcache(*on_gpu(q8, k8, v8))
    q8, k8, v8, *_ = cuflash.quantize_qkv(*_inputs(rng, (1, 1, 64, 2, 2, 64)))
    q, k, v = on_gpu(q8, k8, v8)
    wide = cp.zeros((1, 64, 2, 72), cp.uint8)   # rows of 72 bytes: the cache a view of their first 64
    wide[..., :64] = k
    with pytest.raises(ValueError, match="strides must be multiples of 16 bytes"):
        cuflash.attention_with_kvcache(q, wide[..., :64], v)
    shifted = cp.zeros(k.size + 16, cp.uint8)[1:k.size + 1].reshape(k.shape)   # one byte off a 16-byte boundary
    with pytest.raises(ValueError, match="must start on a 16-byte boundary"):
        cuflash.attention_with_kvcache(q, shifted, v)
