"""Backward pass against the float64 reference backward, on both paths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import cuflash
from cuflash import _config, reference

from ._checks import (BF16, DTYPES, assert_fa_close, lowp_attention_backward, make_qkv, max_abs_finite,
                      poison_pool, to_numpy)
from .conftest import requires_gpu

BACKWARD_SHAPES = [
    (1, 1, 1, 1, 1, 64, True),
    (2, 113, 203, 2, 2, 64, False),
    (1, 203, 113, 2, 2, 64, True),
    (1, 128, 217, 4, 1, 32, True),     # MQA: dk, dv sum over 4 query heads
    (1, 108, 256, 4, 2, 128, False),   # GQA
    (1, 512, 256, 2, 2, 128, True),
    (1, 63, 65, 2, 2, 40, True),
    (1, 127, 129, 3, 3, 59, False),
    (1, 65, 33, 2, 2, 111, True),
    (1, 70, 90, 2, 1, 192, False),
    (1, 33, 66, 2, 2, 256, True),
    (1, 17, 19, 2, 2, 3, True),
    # 1024 (batch, kv head) pairs of one key block each: the dK/dV grid has two or more bands of pairs
    # on any GPU of up to 256 SMs (_config.block_band), with GQA groups of 2
    (4, 9, 65, 512, 256, 32, True),
    # the deterministic backward on sm_90 (a pair's key blocks side by side; bwd_wgmma.cu): more key blocks than
    # query tiles without a mask (all start at tile 0), two query tiles per key block, and under the causal
    # mask with more keys than queries
    (1, 60, 700, 2, 1, 128, False),
    (1, 700, 300, 4, 2, 64, False),
    (1, 200, 700, 2, 2, 256, True),
    # at head_dim 256 up to 32 key blocks side by side (_config.ORDERED_PAIR_MAJOR_MAX_KEYS): 24 of them over 13
    # query tiles without a mask (stride 0), 30 over 30 tiles under the causal mask
    (1, 800, 1500, 2, 1, 256, False),
    (1, 1900, 1900, 2, 2, 256, True),
]


def check_backward(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, dtype, scale=None,
                   deterministic=False):
    q, k, v = make_qkv(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(dtype))
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    poison_pool(xp)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                       deterministic=deterministic)
    refs = reference.attention_backward(dout, q, k, v, causal=causal, softmax_scale=scale)
    lowps = lowp_attention_backward(dout, q, k, v, out, causal, scale, dtype)
    max_score = max_abs_finite(reference.attention(q, k, v, causal=causal, softmax_scale=scale)[1])
    for name, grad, ref, lowp, like in zip(("dq", "dk", "dv"), grads, refs, lowps, (q, k, v)):
        assert type(grad) is type(q) and grad.dtype == q.dtype and grad.shape == like.shape, name
        assert_fa_close(grad, ref, lowp, dtype, 3, name, max_score)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_backward_shapes(xp, rng, shape, dtype, deterministic):
    check_backward(xp, rng, *shape, dtype, deterministic=deterministic)


@requires_gpu
def test_backward_past_the_grid_rows_of_the_dq_conversion(rng):
    """More (batch, head) pairs than a grid has rows (65535): bwd_dq_convert walks the pairs past them."""
    import cupy

    check_backward(cupy, rng, 65_600, 2, 3, 1, 1, 64, True, BF16)


# The deterministic backward's split grid (one launch per pass, one float32 dQ copy per split), forced at
# shapes too small to choose it: key blocks that do not fill the last one, the causal mask, GQA and MQA,
# and last passes in which some splits have no key block left (3 splits of 2 or 3 key blocks).
SPLIT_GRID_SHAPES = [
    (2, 113, 203, 2, 2, 64, False),
    (1, 203, 300, 4, 2, 128, True),
    (1, 65, 129, 4, 1, 32, True),
    (1, 150, 200, 4, 2, 256, True),
]


@requires_gpu
@pytest.mark.parametrize("dq_splits", [1, 2, 3])
@pytest.mark.parametrize("shape", SPLIT_GRID_SHAPES, ids=str)
def test_deterministic_split_grid(rng, monkeypatch, request, shape, dq_splits):
    import cupy

    monkeypatch.setattr(_config, "ordered_dq_kernel", lambda cfg: None)
    monkeypatch.setattr(_config, "deterministic_dq_splits",
                        lambda cfg, *_: dq_splits if _config.split_grid_serves(cfg) else 0)
    cuflash.clear_plans()  # a plan of the same shape made before the patch (or with another count) holds its own
    request.addfinalizer(cuflash.clear_plans)
    check_backward(cupy, rng, *shape, BF16, deterministic=True)


def test_backward_with_scale(xp, rng):
    check_backward(xp, rng, 1, 70, 90, 2, 2, 64, True, BF16, scale=0.21)


def test_backward_of_fully_masked_rows_is_zero(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 40, 10, 2, 2, 32, np.float32)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert np.all(to_numpy(dq)[:, :30] == 0)
    assert np.all(np.isfinite(to_numpy(dk))) and np.all(np.isfinite(to_numpy(dv)))


def test_backward_empty_keys(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 6, 0, 2, 2, 32, np.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and np.all(to_numpy(dq) == 0)


def test_backward_does_not_write_inputs(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 50, 60, 2, 2, 64, np.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(np.float16))
    arrays = (dout, q, k, v, out, lse)
    copies = [to_numpy(x).copy() for x in arrays]
    cuflash.attention_backward(*arrays)
    for before, after in zip(copies, arrays):
        np.testing.assert_array_equal(before, to_numpy(after))


shapes = st.tuples(
    st.integers(1, 2), st.integers(1, 200), st.integers(1, 200),
    st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]), st.integers(1, 256), st.booleans())


@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1), deterministic=st.booleans())
@example(shape=(1, 1, 1, (1, 1), 1, False), dtype=DTYPES[0], seed=0, deterministic=False)
@example(shape=(1, 97, 33, (4, 1), 130, True), dtype=BF16, seed=3, deterministic=False)
@example(shape=(1, 1, 98, (1, 1), 1, False), dtype=DTYPES[0], seed=204402, deterministic=False)  # dq ~ 1e-4 by cancellation
def test_fuzzed_backward(xp, shape, dtype, seed, deterministic):
    batch, seqlen_q, seqlen_k, (heads, heads_kv), head_dim, causal = shape
    check_backward(xp, np.random.default_rng(seed), batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim,
                   causal, dtype, deterministic=deterministic)
