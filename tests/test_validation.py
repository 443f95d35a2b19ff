"""Bad input: a clear TypeError or ValueError naming the argument, on both paths."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash

from ._checks import make_qkv


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


def test_causal_must_be_bool(qkv):
    with pytest.raises(TypeError, match="causal must be a bool"):
        _fwd(*qkv, causal="yes")


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
