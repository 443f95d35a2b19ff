"""Forward pass and lse against the float64 reference, on the NumPy path and (with a GPU) the CuPy path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import cuflash
from cuflash import reference

from ._checks import (BF16, DTYPES, assert_fa_close, lowp_attention, make_qkv, max_abs_finite, poison_pool,
                      to_numpy)
from .conftest import GPU

# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal): seqlen 1, tile +- 1 (tiles are 32,
# 64 and 128 long), seqlen_q != seqlen_k both ways, odd head dims, MQA and GQA.
AWKWARD_SHAPES = [
    (1, 1, 1, 1, 1, 64, False),
    (1, 1, 1, 1, 1, 64, True),
    (2, 113, 203, 2, 2, 64, False),
    (2, 113, 203, 2, 2, 64, True),
    (1, 203, 113, 2, 2, 64, True),   # seqlen_q > seqlen_k: the first 90 rows see no key
    (1, 128, 217, 2, 1, 32, True),
    (1, 108, 256, 4, 2, 128, False),
    (1, 1023, 1024, 1, 1, 64, True),
    (1, 512, 256, 2, 2, 128, True),
    (1, 63, 65, 2, 2, 40, False),
    (1, 127, 129, 3, 3, 59, True),
    (1, 129, 127, 2, 2, 111, False),
    (1, 65, 33, 8, 1, 80, True),     # MQA
    (2, 31, 97, 6, 2, 96, False),    # GQA
    (1, 77, 77, 2, 2, 160, True),
    (1, 70, 90, 2, 1, 192, False),
    (1, 33, 66, 2, 2, 224, True),
    (1, 100, 100, 2, 2, 256, True),
    (1, 129, 200, 4, 2, 256, False),  # head_dim 256 on sm_90: warp pairs share rows (KEY_SPLIT)
    (2, 200, 63, 2, 2, 250, False),
    (1, 17, 19, 2, 2, 1, False),
    (1, 17, 19, 2, 2, 7, True),
]


def check_forward(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, dtype, scale=None):
    q, k, v = make_qkv(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype)
    check_forward_of(xp, q, k, v, causal, dtype, scale)


def check_forward_of(xp, q, k, v, causal, dtype, scale=None):
    """cuflash.attention of these inputs (into a poisoned pool) against the float64 reference."""
    poison_pool(xp)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    assert type(out) is type(q) and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    lp_out, lp_lse = lowp_attention(q, k, v, causal, scale, dtype)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, lp_out, dtype, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, lp_lse, np.float32, 2, "lse", max_score)


@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_awkward_shapes(xp, rng, shape, dtype):
    check_forward(xp, rng, *shape, dtype)


def test_fully_masked_rows_are_zero_with_minus_inf_lse(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 40, 10, 2, 2, 64, np.float16)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    hidden = 40 - 10  # rows i < seqlen_q - seqlen_k see no key
    assert np.all(out[:, :hidden] == 0) and np.all(np.isneginf(lse[:, :, :hidden]))
    assert np.all(np.isfinite(lse[:, :, hidden:])) and not np.isnan(out).any()


def test_empty_keys_give_zero_output(xp, rng):
    q, k, v = make_qkv(xp, rng, 2, 5, 0, 2, 2, 32, np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert np.all(to_numpy(out) == 0) and np.all(np.isneginf(to_numpy(lse)))


def test_empty_keys_with_sinks_give_the_sink(xp, rng):
    """No key at all: out 0, each row's lse its head's sink, and every gradient (dsinks too) 0."""
    q, k, v = make_qkv(xp, rng, 2, 5, 0, 3, 3, 32, np.float32)
    sinks = xp.asarray(np.array([0.5, -1.0, 2.0], np.float32))
    out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=sinks)
    assert np.all(to_numpy(out) == 0)
    np.testing.assert_array_equal(to_numpy(lse), np.broadcast_to(to_numpy(sinks)[None, :, None], (2, 3, 5)))
    grads = cuflash.attention_backward(q, q, k, v, out, lse, sinks=sinks)
    assert len(grads) == 4 and grads[3].shape == (3,) and grads[3].dtype == np.float32
    assert all(np.all(to_numpy(g) == 0) for g in grads)


@pytest.mark.parametrize("shape", [(0, 4, 4, 2, 2), (2, 0, 4, 2, 2), (2, 4, 4, 0, 0)])
def test_zero_length_axes_give_empty_results(xp, rng, shape):
    batch, seqlen_q, seqlen_k, heads, heads_kv = shape
    q, k, v = make_qkv(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, 16, np.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)


def test_nan_and_inf_stay_in_their_rows(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 50, 50, 2, 2, 64, np.float16)
    q[0, 7, 1, 3] = np.nan
    q[0, 20, 0, 5] = np.inf
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v)
    out, lse = to_numpy(out).astype(np.float64), to_numpy(lse)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out[0, 7, 1]).all() and np.isnan(out[0, 20, 0]).all()
    clean = np.isfinite(ref_out)
    assert np.abs(out[clean] - ref_out[clean]).max() < 1e-2


def test_strided_inputs_are_read_and_not_written(xp, rng):
    # q as a (seq, head)-transposed view, k with a non-contiguous last axis, v sliced from a wider array
    base = xp.asarray(rng.standard_normal((2, 3, 70, 64), dtype=np.float32).astype(np.float16))
    q = base.transpose(0, 2, 1, 3)                                        # (2, 70, 3, 64), strided
    k = xp.asarray(rng.standard_normal((2, 50, 3, 128), dtype=np.float32).astype(np.float16))[..., ::2]
    v = xp.asarray(rng.standard_normal((2, 50, 3, 80), dtype=np.float32).astype(np.float16))[..., 5:69]
    copies = [to_numpy(x).copy() for x in (q, k, v)]
    out = cuflash.attention(q, k, v, causal=True)
    for before, after in zip(copies, (q, k, v)):
        np.testing.assert_array_equal(before, to_numpy(after))
    ref_out, _ = reference.attention(q, k, v, causal=True)
    lp_out, _ = lowp_attention(q, k, v, True, None, np.float16)
    assert_fa_close(out, ref_out, lp_out, np.float16, 2, "out")


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True), (256, False), (256, True)])
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: d.name)
def test_scores_growing_along_the_keys(xp, rng, head_dim, causal, dtype):
    # Scores climb ~14-28 (base 2) per 64 keys, far past the kernels' rescale slack (8, fwd_mma.cu):
    # every key tile moves the rows' exponent reference and rescales acc and l, in warp pairs (head_dim
    # 256 without the mask on sm_90) both partners alike. The softmax ends up on the last keys.
    batch, seqlen, heads = 1, 333, 2
    shape = (batch, seqlen, heads, head_dim)
    ramp = np.linspace(0, 12, seqlen, dtype=np.float32)[None, :, None, None]
    q = 0.5 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    k = ramp + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    check_forward_of(xp, *(xp.asarray(x.astype(dtype)) for x in (q, k, v)), causal, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_softmax_scale(xp, rng, dtype):
    check_forward(xp, rng, 1, 70, 90, 2, 2, 64, False, dtype, scale=0.37)


def test_numpy_and_cupy_agree_on_bfloat16():
    # the NumPy path is the kernels' specification: with a GPU, both paths must match closely
    if not GPU:
        pytest.skip("needs a CUDA GPU and CuPy")
    import cupy

    rng = np.random.default_rng(7)
    q, k, v = make_qkv(np, rng, 1, 300, 300, 2, 2, 128, BF16)
    out_np, lse_np = cuflash.attention(q, k, v, causal=True, return_lse=True)
    out_cp, lse_cp = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    np.testing.assert_allclose(lse_cp.get(), lse_np, atol=1e-4)
    np.testing.assert_allclose(out_cp.get().astype(np.float32), out_np.astype(np.float32), atol=2e-2)


shapes = st.tuples(
    st.integers(1, 2),                      # batch
    st.integers(1, 300),                    # seqlen_q
    st.integers(1, 300),                    # seqlen_k
    st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (3, 3)]),  # (heads, heads_kv)
    st.integers(1, 256),                    # head_dim
    st.booleans(),                          # causal
)


@given(shape=shapes, dtype=st.sampled_from(DTYPES),
       scale=st.one_of(st.none(), st.floats(0.01, 2.0)), seed=st.integers(0, 2**32 - 1))
@example(shape=(1, 1, 1, (1, 1), 1, True), dtype=DTYPES[0], scale=None, seed=0)
@example(shape=(2, 129, 65, (4, 2), 200, True), dtype=BF16, scale=None, seed=1)
@example(shape=(1, 35, 10, (1, 1), 234, False), dtype=DTYPES[2], scale=2.0, seed=0)  # float32, |score| ~ 100
def test_fuzzed_forward(xp, shape, dtype, scale, seed):
    batch, seqlen_q, seqlen_k, (heads, heads_kv), head_dim, causal = shape
    check_forward(xp, np.random.default_rng(seed), batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim,
                  causal, dtype, scale)
