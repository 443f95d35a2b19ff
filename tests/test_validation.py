"""Bad input: a clear TypeError or ValueError naming the argument, on both paths."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash

from cuflash import reference
from cuflash._validate import max_softmax_scale

from ._checks import BF16, make_qkv, to_numpy


@pytest.fixture
def qkv(xp, rng):
    return make_qkv(xp, rng, 2, 16, 24, 4, 2, 32, np.float16)


def _fwd(q, k, v, **kw):
    return cuflash.attention(q, k, v, **kw)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_number_of_dimensions(qkv, which):
    arrays = dict(zip("qkv", qkv))
    arrays[which] = arrays[which][0]
    with pytest.raises(ValueError, match=f"{which} must have 4 dimensions"):
        _fwd(**arrays)


def test_batch_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="batch size must match"):
        _fwd(q, k[:1], v[:1])


def test_seqlen_mismatch_between_k_and_v(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="same seqlen_k"):
        _fwd(q, k, v[:, :5])


def test_head_dim_mismatch(xp, rng, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="head_dim must match"):
        _fwd(q, k[..., :16], v[..., :16])


def test_value_head_dim_differs_from_the_keys(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="head_dim must match: q 32, k 32, v 16"):
        _fwd(q, k, v[..., :16])


def test_heads_not_multiple_of_kv_heads(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 8, 8, 5, 2, 32, np.float16)
    with pytest.raises(ValueError, match=r"multiple of heads_kv"):
        _fwd(q, k, v)


def test_kv_heads_differ(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="same number of heads"):
        _fwd(q, k, v[:, :, :1])


@pytest.mark.parametrize("head_dim", [0, 257])
def test_head_dim_out_of_range(xp, rng, head_dim):
    q, k, v = make_qkv(xp, rng, 1, 4, 4, 1, 1, head_dim, np.float16)
    with pytest.raises(ValueError, match=r"head_dim must be in 1\.\.256"):
        _fwd(q, k, v)


def test_mixed_dtypes(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="share one dtype"):
        _fwd(q, k.astype(np.float32), v)


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.complex64, np.bool_])
def test_unsupported_dtypes(qkv, dtype):
    q, k, v = (x.astype(dtype) for x in qkv)
    with pytest.raises(TypeError, match="q must have dtype float16, bfloat16, float32"):
        _fwd(q, k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_bad_scale_values(qkv, scale):
    with pytest.raises(ValueError, match="softmax_scale must be positive and finite"):
        _fwd(*qkv, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, [0.5]])
def test_bad_scale_types(qkv, scale):
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        _fwd(*qkv, softmax_scale=scale)


@pytest.mark.parametrize("head_dim", [1, 32, 256])
def test_scale_past_the_kernels_range_is_refused(xp, rng, head_dim):
    # 1e37 turned every score into inf and the output into NaN, where the float64 reference is finite
    q, k, v = make_qkv(xp, rng, 1, 8, 8, 2, 2, head_dim, np.float32)
    for scale in (1e37, 1e20):  # NaN rows: scores overflowed, or lost every bit of the softmax to rounding
        with pytest.raises(ValueError, match=f"softmax_scale must be at most .* at head_dim {head_dim}"):
            _fwd(q, k, v, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale must be at most"):
        _fwd(q, k, v, softmax_scale=math.nextafter(max_softmax_scale(head_dim), math.inf))


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("head_dim", [1, 64, 256])
def test_largest_scale_is_exact_for_unit_inputs(xp, rng, head_dim, dtype):
    # q . k reaches head_dim on key 0 (all ones) and stays far below it elsewhere: at the largest scale the
    # base-2 scores reach MAX_BASE2_SCORE and the softmax puts all weight on key 0, as the reference does
    q = xp.asarray(np.ones((1, 4, 1, head_dim), dtype))
    keys = np.concatenate([np.ones((1, head_dim)), -np.ones((1, head_dim)), rng.uniform(-0.5, 0.5, (6, head_dim))])
    k = xp.asarray(keys[None, :, None].astype(dtype))
    v = xp.asarray(rng.standard_normal((1, 8, 1, head_dim)).astype(dtype))
    scale = max_softmax_scale(head_dim)
    out, lse = cuflash.attention(q, k, v, softmax_scale=scale, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, softmax_scale=scale)
    np.testing.assert_array_equal(to_numpy(out), np.broadcast_to(to_numpy(v)[:, :1], out.shape))
    np.testing.assert_allclose(to_numpy(lse), ref_lse, rtol=1e-6)
    np.testing.assert_array_equal(to_numpy(out).astype(np.float64), ref_out.astype(dtype).astype(np.float64))


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_forward_flags_must_be_bools(qkv, flag, value):
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        _fwd(*qkv, **{flag: value})


def test_a_seen_call_with_a_non_bool_flag_is_still_refused(qkv):
    # the plan cache's key holds the option's type: causal=1 equals causal=True as a dict key
    _fwd(*qkv, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        _fwd(*qkv, causal=1)
    _fwd(*qkv, softmax_scale=1)
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        _fwd(*qkv, softmax_scale=True)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_masked_arrays_are_refused(rng, which):
    # the kernels would read the masked-out values: outputs up to 9.5e8 where masked inputs were large
    arrays = dict(zip("qkv", make_qkv(np, rng, 1, 8, 8, 2, 2, 32, np.float32)))
    arrays[which] = np.ma.masked_greater(arrays[which], 1.0)
    with pytest.raises(TypeError, match=f"{which} must be a plain numpy.ndarray, got numpy.ma.*MaskedArray: its mask"):
        _fwd(**arrays)
    q, k, v = (np.asarray(x) for x in arrays.values())
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="dout must be a plain numpy.ndarray"):
        cuflash.attention_backward(np.ma.masked_array(out), q, k, v, out, lse)


def test_callers_arrays_are_not_written(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 33, 47, 2, 1, 40, np.float16)
    before = [to_numpy(x).copy() for x in (q, k, v)]
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    cuflash.attention_backward(out, q, k, v, out, lse, causal=True)
    for x, copy in zip((q, k, v), before):
        np.testing.assert_array_equal(to_numpy(x), copy)


@pytest.mark.parametrize("obj", [[[[[1.0]]]], 3.0, "q"])
def test_not_an_array(qkv, obj):
    _, k, v = qkv
    with pytest.raises(TypeError, match="q must be a numpy.ndarray or cupy.ndarray"):
        _fwd(obj, k, v)


def test_numpy_and_cupy_mixed(rng):
    cupy = pytest.importorskip("cupy")
    from .conftest import GPU

    if not GPU:
        pytest.skip("needs a CUDA GPU and CuPy")
    q, k, v = make_qkv(np, rng, 1, 8, 8, 1, 1, 32, np.float16)
    with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
        cuflash.attention(q, cupy.asarray(k), v)


class TestBackward:
    @pytest.fixture
    def args(self, qkv):
        q, k, v = qkv
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        return dict(dout=out, q=q, k=k, v=v, out=out, lse=lse)

    @pytest.mark.parametrize("which", ["dout", "out"])
    def test_shape_mismatch(self, args, which):
        args[which] = args[which][:, :5]
        with pytest.raises(ValueError, match=f"{which} must have the shape of q"):
            cuflash.attention_backward(**args)

    @pytest.mark.parametrize("which", ["dout", "out"])
    def test_dtype_mismatch(self, args, which):
        args[which] = args[which].astype(np.float32)
        with pytest.raises(TypeError, match=f"{which} must have the dtype of q"):
            cuflash.attention_backward(**args)

    def test_lse_shape(self, args):
        args["lse"] = args["lse"][:, :, :3]
        with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads, seqlen_q\)"):
            cuflash.attention_backward(**args)

    def test_lse_dtype(self, args):
        args["lse"] = args["lse"].astype(np.float16)
        with pytest.raises(TypeError, match="lse must be float32"):
            cuflash.attention_backward(**args)

    def test_deterministic_must_be_bool(self, args):
        with pytest.raises(TypeError, match="deterministic must be a bool"):
            cuflash.attention_backward(**args, deterministic=1)

    def test_dout_not_an_array(self, args):
        args["dout"] = 1.0
        with pytest.raises(TypeError, match="dout must be a numpy.ndarray"):
            cuflash.attention_backward(**args)


class TestFeatureArguments:
    """window_size, softcap, alibi_slopes, sinks, dropout_p, seed, offset and alignment (test_features checks
    their values); validation comes before the GPU path's refusal of options it does not take yet."""

    @pytest.mark.parametrize("window", [(-2, 0), (0, -5)])
    def test_window_sides_below_minus_one(self, qkv, window):
        with pytest.raises(ValueError, match="window_size's (left|right) side must be -1 \\(unbounded\\) or at least 0"):
            _fwd(*qkv, window_size=window)

    @pytest.mark.parametrize("window", [5, (1, 2, 3), "abc", None])
    def test_window_not_a_pair(self, qkv, window):
        with pytest.raises(TypeError, match="window_size must be a pair"):
            _fwd(*qkv, window_size=window)

    @pytest.mark.parametrize("window", [(1.5, 0), (True, 0), (0, "1")])
    def test_window_sides_not_ints(self, qkv, window):
        with pytest.raises(TypeError, match="window_size's (left|right) side must be an int"):
            _fwd(*qkv, window_size=window)

    @pytest.mark.parametrize("softcap", [-1.0, math.nan, math.inf])
    def test_softcap_values(self, qkv, softcap):
        with pytest.raises(ValueError, match="softcap must be 0 \\(off\\) or positive and finite"):
            _fwd(*qkv, softcap=softcap)

    @pytest.mark.parametrize("softcap", ["30", None, True])
    def test_softcap_types(self, qkv, softcap):
        with pytest.raises(TypeError, match="softcap must be a real number"):
            _fwd(*qkv, softcap=softcap)

    @pytest.mark.parametrize("name,shape,match", [
        ("alibi_slopes", (3,), "alibi_slopes must have shape \\(heads,\\) or \\(batch, heads\\)"),
        ("alibi_slopes", (4, 2), "alibi_slopes must have shape"),
        ("sinks", (2, 4), "sinks must have shape \\(heads,\\)"),
        ("sinks", (2,), "sinks must have shape"),
    ])
    def test_vector_shapes(self, xp, qkv, name, shape, match):
        with pytest.raises(ValueError, match=match):
            _fwd(*qkv, **{name: xp.zeros(shape, np.float32)})

    @pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
    def test_vector_dtypes_and_kinds(self, xp, qkv, name):
        with pytest.raises(TypeError, match=f"{name} must be float32, got float16"):
            _fwd(*qkv, **{name: xp.zeros(4, np.float16)})
        with pytest.raises(TypeError, match=f"{name} must be a numpy.ndarray or cupy.ndarray, got builtins.list"):
            _fwd(*qkv, **{name: [0.1] * 4})

    @pytest.mark.parametrize("p", [1.0, -0.1, 1.5, math.nan])
    def test_dropout_p_range(self, qkv, p):
        with pytest.raises(ValueError, match="dropout_p must be in \\[0, 1\\)"):
            _fwd(*qkv, dropout_p=p, seed=1)

    @pytest.mark.parametrize("p", ["0.1", None, True])
    def test_dropout_p_type(self, qkv, p):
        with pytest.raises(TypeError, match="dropout_p must be a real number"):
            _fwd(*qkv, dropout_p=p, seed=1)

    def test_dropout_needs_a_seed(self, qkv):
        with pytest.raises(ValueError, match="seed must be given with dropout_p > 0"):
            _fwd(*qkv, dropout_p=0.1)

    @pytest.mark.parametrize("name,value,error", [("seed", -1, ValueError), ("seed", 2**64, ValueError),
                                                  ("seed", 1.0, TypeError), ("offset", 2**32, ValueError),
                                                  ("offset", "0", TypeError)])
    def test_seed_and_offset(self, qkv, name, value, error):
        kw = dict(seed=3, offset=0)
        kw[name] = value
        with pytest.raises(error, match=f"{name} must be"):
            _fwd(*qkv, dropout_p=0.1, **kw)

    def test_alignment(self, qkv):
        with pytest.raises(ValueError, match="alignment must be one of \\('bottom_right', 'top_left'\\), got 'top'"):
            _fwd(*qkv, alignment="top")

    def test_backward_validates_the_same_options(self, xp, qkv):
        q, k, v = qkv
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        with pytest.raises(ValueError, match="softcap must be 0"):
            cuflash.attention_backward(out, q, k, v, out, lse, softcap=-2.0)
        with pytest.raises(ValueError, match="sinks must have shape"):
            cuflash.attention_backward(out, q, k, v, out, lse, sinks=xp.zeros(3, np.float32))
