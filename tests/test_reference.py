"""The float64 reference against textbook formulas, and its gradients against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference


def textbook_attention(q, k, v, scale, mask):
    """softmax(scale * q k^T) v per (batch, head), with exp/sum and no max subtraction."""
    out = np.zeros(q.shape)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    group = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = scale * q[b, :, h] @ k[b, :, h // group].T
            e = np.exp(s) * mask
            out[b, :, h] = (e / e.sum(axis=1, keepdims=True)) @ v[b, :, h // group]
            lse[b, h] = np.log(e.sum(axis=1))
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,heads_kv", [(2, 2), (4, 2), (3, 1)])
def test_reference_matches_textbook(rng, causal, heads, heads_kv):
    q = rng.standard_normal((2, 9, heads, 8))
    k = rng.standard_normal((2, 13, heads_kv, 8))
    v = rng.standard_normal((2, 13, heads_kv, 8))
    mask = reference.causal_mask(9, 13) if causal else np.ones((9, 13), bool)
    out, lse = reference.attention(q, k, v, causal=causal, softmax_scale=0.3)
    exp_out, exp_lse = textbook_attention(q, k, v, 0.3, mask)
    np.testing.assert_allclose(out, exp_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, exp_lse, rtol=1e-12)


def test_causal_mask_is_bottom_right_aligned():
    np.testing.assert_array_equal(reference.causal_mask(2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(reference.causal_mask(3, 2), [[0, 0], [1, 0], [1, 1]])


def test_reference_masked_rows(rng):
    q = rng.standard_normal((1, 4, 1, 8))
    k = rng.standard_normal((1, 2, 1, 8))
    out, lse = reference.attention(q, k, k, causal=True)
    assert np.all(out[0, :2] == 0) and np.all(np.isneginf(lse[0, 0, :2])) and np.all(np.isfinite(lse[0, 0, 2:]))


def test_reference_is_stable_for_large_scores(rng):
    q = 100 * rng.standard_normal((1, 5, 1, 16))
    out, lse = reference.attention(q, q, q)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))


def test_reference_backward_matches_finite_differences(rng):
    q = rng.standard_normal((1, 5, 2, 4))
    k = rng.standard_normal((1, 6, 1, 4))
    v = rng.standard_normal((1, 6, 1, 4))
    dout = rng.standard_normal(q.shape)

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, causal=True)[0] * dout).sum())

    grads = reference.attention_backward(dout, q, k, v, causal=True)
    eps = 1e-6
    for arg, grad in zip(range(3), grads):
        arrays = [q, k, v]
        numeric = np.zeros_like(arrays[arg])
        for idx in np.ndindex(arrays[arg].shape):
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[arg][idx] += eps
            minus[arg][idx] -= eps
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7)


def test_reference_dropout_needs_its_mask(rng):
    """The reference applies a given keep mask (cuflash.dropout_mask draws it); dropout_p without one is refused,
    dense and packed, rather than computed without dropout."""
    q = rng.standard_normal((1, 4, 2, 8))
    with pytest.raises(ValueError, match="dropout_p > 0 needs the dropout_mask"):
        reference.attention(q, q, q, dropout_p=0.1)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match="dropout_p > 0 needs the dropout_mask"):
        reference.attention_varlen(q[0], q[0], q[0], cu, cu, dropout_p=0.1)
