"""merge_states: partial attention over disjoint key sets, merged, against attention over all the keys; the
rule's edge cases (parts and rows that saw no key, large logsumexps) against the float64 reference merge;
bad arguments refused with the argument named."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import reference

from ._checks import DTYPES, assert_fa_close, lowp_attention, make_qkv, max_abs_finite, to_numpy
from .conftest import requires_gpu


def split_points(rng, seqlen_k: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` consecutive key ranges covering [0, seqlen_k); some may be empty."""
    cuts = np.sort(rng.integers(0, seqlen_k + 1, parts - 1))
    return [0, *cuts.tolist(), seqlen_k]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("options", [{}, dict(softcap=4.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_merge_of_split_keys_is_attention_over_all(xp, rng, dtype, parts, options, stacked):
    """Attention over consecutive key ranges (an empty one among them where the draw makes it), merged, is
    attention over all the keys within FlashAttention's forward rule (against the same math in the dtype)."""
    q, k, v = make_qkv(xp, rng, 2, 37, 77, 4, 2, 40, dtype)
    bounds = split_points(rng, k.shape[1], parts)
    halves = [cuflash.attention(q, k[:, a:b], v[:, a:b], return_lse=True, **options)
              for a, b in zip(bounds[:-1], bounds[1:])]
    outs, lses = [o for o, _ in halves], [l for _, l in halves]
    if stacked:
        outs, lses = xp.stack(outs), xp.stack(lses)
    out, lse = cuflash.merge_states(outs, lses)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert out.shape == q.shape and lse.shape == (2, 4, 37)
    args = [to_numpy(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*args, **options)
    low_out, low_lse = lowp_attention(*args, False, None, dtype, **options)
    assert_fa_close(out, ref_out, low_out, dtype, 2, "out", max_score=max_abs_finite(ref_lse))
    assert_fa_close(lse, ref_lse, low_lse, np.float32, 2, "lse", max_score=max_abs_finite(ref_lse))


def test_sinks_join_as_a_part(xp, rng):
    """A sink is one more part with output 0 and lse the sink: the merge is attention with sinks."""
    q, k, v = make_qkv(xp, rng, 1, 9, 30, 3, 3, 16, np.float32)
    sinks = xp.asarray((2 * rng.standard_normal(3)).astype(np.float32))
    halves = [cuflash.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 12), slice(12, 30))]
    sink_lse = xp.ascontiguousarray(xp.broadcast_to(sinks[None, :, None], (1, 3, 9)))
    out, lse = cuflash.merge_states([*(o for o, _ in halves), xp.zeros_like(q)], [*(l for _, l in halves), sink_lse])
    ref_out, ref_lse = reference.attention(*(to_numpy(x) for x in (q, k, v)), sinks=to_numpy(sinks))
    np.testing.assert_allclose(to_numpy(out), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unseen_parts_count_for_nothing(xp, rng, dtype):
    """Where a part's lse is -inf its output is ignored (NaN there), a row no part saw gets 0 and -inf, and
    logsumexps far beyond float32's exp range merge without overflow: against the float64 reference merge."""
    batch, seqlen_q, heads, head_dim, parts = 2, 6, 3, 8, 3
    outs = rng.standard_normal((parts, batch, seqlen_q, heads, head_dim), dtype=np.float32).astype(dtype)
    lses = rng.uniform(-2000, 2000, (parts, batch, heads, seqlen_q)).astype(np.float32)
    lses[0, :, :, 1] = lses[1, :, :, 1] + 1e-3  # two parts of nearly equal weight
    lses[1, 0] = -np.inf  # part 1 saw no key in batch 0's rows
    outs[1, 0] = np.nan
    lses[:, 1, 2, 4] = -np.inf  # no part saw this row
    outs[:, 1, 4, 2] = np.nan
    out, lse = cuflash.merge_states(xp.asarray(outs), xp.asarray(lses))
    ref_out, ref_lse = reference.merge_states(list(outs.astype(np.float32)), list(lses))
    assert not np.isnan(to_numpy(out)).any()
    np.testing.assert_array_equal(to_numpy(out)[1, 4, 2], 0)
    assert to_numpy(lse)[1, 2, 4] == -np.inf
    # float32 arithmetic on float32 inputs, then one rounding to the dtype
    np.testing.assert_allclose(to_numpy(out).astype(np.float64), ref_out, rtol=0,
                               atol=2 * float(np.finfo(np.float32).eps) * 4 + reference.rounding(ref_out, dtype))
    np.testing.assert_allclose(to_numpy(lse), ref_lse, rtol=2e-7)


def test_one_part_is_itself(xp, rng):
    """A single part with finite lse merges to itself, bit for bit (its weight is exactly 1)."""
    out = xp.asarray(rng.standard_normal((2, 5, 3, 16), dtype=np.float32))
    lse = xp.asarray(rng.uniform(-50, 50, (2, 3, 5)).astype(np.float32))
    merged, merged_lse = cuflash.merge_states([out], [lse])
    np.testing.assert_array_equal(to_numpy(merged), to_numpy(out))
    np.testing.assert_array_equal(to_numpy(merged_lse), to_numpy(lse))


def test_inputs_are_not_written(xp, rng):
    outs = xp.asarray(rng.standard_normal((3, 1, 4, 2, 8), dtype=np.float32))
    lses = xp.asarray(rng.standard_normal((3, 1, 2, 4)).astype(np.float32))
    before = to_numpy(outs).copy(), to_numpy(lses).copy()
    cuflash.merge_states(outs, lses)
    np.testing.assert_array_equal(to_numpy(outs), before[0])
    np.testing.assert_array_equal(to_numpy(lses), before[1])


OUT = np.zeros((2, 1, 4, 3, 8), np.float32)
LSE = np.zeros((2, 1, 3, 4), np.float32)


@pytest.mark.parametrize("outs, lses, error, message", [
    (OUT[0], LSE, ValueError, "outs must have 5 dimensions"),
    (OUT, LSE[0], ValueError, "lses must have 4 dimensions"),
    ([], [], ValueError, "outs must hold at least one part"),
    ("x", LSE, TypeError, "outs must be an array"),
    ([OUT[0], "x"], LSE, TypeError, r"outs\[1\] must be an array"),
    ([OUT[0], OUT[1, :, :2]], LSE, ValueError, r"outs\[1\] must have the shape of outs\[0\]"),
    ([OUT[0], OUT[1].astype(np.float16)], LSE, TypeError, r"outs\[1\] must have the dtype of outs\[0\]"),
    (OUT.astype(np.float64), LSE, TypeError, "outs must have dtype float16, bfloat16, float32, got float64"),
    (OUT, LSE[:1], ValueError, "outs and lses must hold the same number of parts, got 2 and 1"),
    (OUT, LSE.astype(np.float64), TypeError, r"lses\[0\] must be float32, got float64"),
    (OUT, LSE.transpose(0, 1, 3, 2), ValueError, r"lses\[0\] must have shape \(batch, heads, seqlen_q\)"),
    ([OUT[0], OUT[1][None]], LSE, ValueError, r"outs\[1\] must have 4 dimensions"),
], ids=["outs_ndim", "lses_ndim", "no_parts", "outs_not_array", "part_not_array", "part_shape", "part_dtype",
        "outs_float64", "part_counts", "lse_dtype", "lse_shape", "part_ndim"])
def test_bad_arguments_are_refused(outs, lses, error, message):
    with pytest.raises(error, match=message):
        cuflash.merge_states(outs, lses)


@requires_gpu
def test_mixed_array_kinds_are_refused():
    import cupy

    with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
        cuflash.merge_states(cupy.asarray(OUT), LSE)
