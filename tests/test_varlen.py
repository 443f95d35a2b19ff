"""attention_varlen and its backward: packed sequences of mixed lengths (empty ones among them) against the
float64 reference of each sequence on its own, every mask and modifier (dropout against the padded batch's mask,
cut to each sequence); bad packings refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import cuflash
from cuflash import reference

from ._checks import (DTYPES, assert_fa_close, feature_arrays, max_abs_finite, packed_pages, poison_pool,
                      to_numpy)

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(9, 3)),
    "softcap-sinks": dict(softcap=4.0, sinks=True),
    "alibi": dict(alibi_slopes=True, causal=True),
    "dropout": dict(dropout_p=0.3, causal=True),
    "everything": dict(dropout_p=0.15, window_size=(9, 3), softcap=4.0, sinks=True, alibi_slopes=True),
}


def packed(xp, rng, lengths_q, lengths_k, heads, heads_kv, head_dim, dtype):
    """q, k, v, dout packed along their first axis, and the int32 prefix sums of the lengths."""
    def draw(*shape):
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    cu_q, cu_k = (xp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    return (draw(total_q, heads, head_dim), draw(total_k, heads_kv, head_dim), draw(total_k, heads_kv, head_dim),
            draw(total_q, heads, head_dim), cu_q, cu_k)


def dropout_options(rng, options, batch, heads, max_q, max_k):
    """(cuflash's options, the reference's): with dropout, a fresh seed and offset for cuflash and the mask they
    give a dense batch of the longest lengths for the reference."""
    if not options.get("dropout_p"):
        return options, options
    seed, offset = int(rng.integers(2**63)), int(rng.integers(2**32))
    mask = cuflash.dropout_mask(batch, heads, max_q, max_k, options["dropout_p"], seed, offset)
    return {**options, "seed": seed, "offset": offset}, {**options, "dropout_mask": mask}


def check_varlen(xp, rng, lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, options):
    q, k, v, dout, cu_q, cu_k = packed(xp, rng, lengths_q, lengths_k, heads, heads_kv, head_dim, dtype)
    options, ref_options = dropout_options(rng, feature_arrays(xp, rng, options, len(lengths_q), heads),
                                           len(lengths_q), heads, max(lengths_q), max(lengths_k))
    poison_pool(xp)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (heads, q.shape[0])
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **ref_options)
    low_out, low_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **ref_options, in_dtype=dtype)
    score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, low_out, dtype, 2, "out", max_score=score)
    assert_fa_close(lse, ref_lse, low_lse, np.float32, 2, "lse", max_score=score)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    refs = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_options)
    lows = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_options, out=out, in_dtype=dtype)
    # What the rounded out costs by itself (test_features says why); dsinks sums rows of rowsum(dout * out),
    # out stored in dtype, so its rounding term is dtype's too
    given_out = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_options, out=out)
    names = ("dq", "dk", "dv", "dsinks")
    for name, grad, ref, low, given in zip(names, grads, refs, lows, given_out):
        inherent = float(np.abs(np.asarray(given, np.float64) - ref).max()) if ref.size else 0.0
        assert_fa_close(grad, ref, low, dtype, 3, name, max_score=score, inherent=inherent)
    assert len(grads) == (4 if options.get("sinks") is not None else 3)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_packed_sequences_match_the_reference(xp, rng, feature, dtype):
    """Five sequences: an empty query side, an empty key side, self-attention, more queries than keys (causal:
    the first rows see nothing), GQA."""
    check_varlen(xp, rng, [17, 0, 40, 33, 5], [23, 11, 40, 0, 70], 4, 2, 64, dtype, FEATURES[feature])


@given(lengths=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 90)), min_size=1, max_size=6),
       group=st.sampled_from([1, 3]), head_dim=st.sampled_from([8, 40, 64, 128]),
       feature=st.sampled_from(sorted(FEATURES)), seed=st.integers(0, 2**31))
# bfloat16 and float32 dsinks past a bound that left out what the rounded out costs by itself
@example(lengths=[(4, 4)], group=1, head_dim=8, feature="softcap-sinks", seed=4)
@example(lengths=[(8, 26), (0, 27)], group=1, head_dim=8, feature="softcap-sinks", seed=777096)
def test_fuzzed_packings(xp, lengths, group, head_dim, feature, seed):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    check_varlen(xp, rng, [a for a, _ in lengths], [b for _, b in lengths], 2 * group, 2, head_dim, dtype,
                 FEATURES[feature])


def test_bad_packings_are_refused(xp, rng):
    q, k, v, dout, cu_q, cu_k = packed(xp, rng, [3, 4], [5, 6], 2, 2, 16, np.float32)
    as_cu = lambda *values: xp.asarray(np.array(values, np.int32))  # noqa: E731
    bad = [
        (dict(cu_seqlens_q=as_cu(0, 8, 7)), ValueError, "never decrease"),
        (dict(cu_seqlens_q=as_cu(1, 3, 7)), ValueError, "start at 0"),
        (dict(cu_seqlens_q=as_cu(0, 3, 8)), ValueError, "end at the packed length 7"),
        (dict(cu_seqlens_k=as_cu(0, 11)), ValueError, "one length"),
        (dict(cu_seqlens_q=xp.asarray(np.array([0, 3, 7], np.int64))), TypeError, "cu_seqlens_q must be an int32"),
        (dict(max_seqlen_q=3), ValueError, "max_seqlen_q must be an int of at least the longest sequence \\(4\\)"),
        (dict(q=q[None]), ValueError, "q must have 3 dimensions"),
        (dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]), ValueError, r"head_dim must be in 1\.\.256"),
        (dict(q=q[:, :1].repeat(3, axis=1)), ValueError, r"heads of q \(3\) must be a multiple of heads_kv of k and v"),
        (dict(dropout_p=0.1), ValueError, "seed must be given with dropout_p > 0"),
        (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(alibi_slopes=xp.zeros((3, 2), np.float32)), ValueError, "alibi_slopes must have shape"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(v=v[:5]), ValueError, r"k and v must have one shape, got \(11, 2, 16\) and \(5, 2, 16\)"),
        (dict(v=v.astype(np.float16)), TypeError, "q, k and v must share one dtype"),
    ]
    if xp is np:  # a packed length past int32, as a zero-stride view (no memory behind it)
        huge = np.broadcast_to(np.zeros((1, 2, 16), np.float32), (2**31, 2, 16))
        bad.append((dict(q=huge), ValueError, "q packs 2147483648 rows, past int32"))
    for overrides, error, message in bad:
        args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, **overrides}
        with pytest.raises(error, match=message):
            cuflash.attention_varlen(**args)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=4, max_seqlen_k=6, return_lse=True)
    with pytest.raises(ValueError, match="lse must be float32 \\(heads, total_q\\)"):
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse.T, cu_q, cu_k)
    with pytest.raises(ValueError, match="dout must have the shape and dtype of q"):
        cuflash.attention_varlen_backward(dout[:5], q, k, v, out, lse, cu_q, cu_k)
    assert to_numpy(lse).shape == (2, 7)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float32)], ids=lambda d: d.name)
def test_given_max_lengths_give_the_checked_call_bitwise(xp, rng, dtype):
    """Max lengths given (and longer than any sequence: a larger grid whose extra blocks idle) skip the device
    read; the results equal the checked call's bit for bit, the deterministic backward's too, twice over."""
    lengths_q, lengths_k = [150, 0, 7, 300, 64], [90, 33, 0, 300, 200]
    q, k, v, dout, cu_q, cu_k = packed(xp, rng, lengths_q, lengths_k, 4, 2, 64, dtype)
    options = dict(causal=True, window_size=(40, -1), softcap=8.0)
    poison_pool(xp)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    for max_q, max_k in ((300, 300), (333, 517)):
        given = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **options)
        np.testing.assert_array_equal(to_numpy(given[0]), to_numpy(out))
        np.testing.assert_array_equal(to_numpy(given[1]), to_numpy(lse))
    grads = [cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, *maxes, deterministic=True,
                                               **options) for maxes in ((None, None), (333, 517), (333, 517))]
    for again in grads[1:]:
        for first, second in zip(grads[0], again):
            np.testing.assert_array_equal(to_numpy(second), to_numpy(first))
    ref = reference.attention_varlen(q, k, v, cu_q, cu_k, **options)[0]
    low = reference.attention_varlen(q, k, v, cu_q, cu_k, **options, in_dtype=dtype)[0]
    assert_fa_close(out, ref, low, dtype, 2, "out", max_score=max_abs_finite(to_numpy(lse)))


def test_check_indices_reads_the_prefix_sums(xp, rng):
    """With both max lengths given, check_indices=True still reads and checks the prefix sums."""
    q, k, v, _, cu_q, cu_k = packed(xp, rng, [3, 4], [5, 6], 2, 2, 16, np.float32)
    bad = xp.asarray(np.array([0, 8, 7], np.int32))
    with pytest.raises(ValueError, match="never decrease"):
        cuflash.attention_varlen(q, k, v, bad, cu_k, 7, 6, check_indices=True)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int of at least the longest sequence \\(6\\)"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, check_indices=True)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int of at least the longest sequence and at most"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 8, 6)


def test_calls_with_given_max_lengths_are_planned_once(xp, rng, monkeypatch):
    """CuPy calls that read nothing from the device reuse their plan (validation and planning once per kind of
    call); NumPy calls, and calls that read the prefix sums, are checked every time."""
    q, k, v, dout, cu_q, cu_k = packed(xp, rng, [3, 4], [5, 6], 2, 2, 16, np.float32)
    cuflash.clear_plans()
    planned = []
    for name in ("_plan_varlen_forward", "_plan_varlen_backward"):
        original = getattr(cuflash, name)
        monkeypatch.setattr(cuflash, name, lambda *args, original=original, name=name: planned.append(name)
                            or original(*args))
    for _ in range(3):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 4, 6, return_lse=True)
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 4, 6)
    cuflash.attention_varlen(q, k, v, cu_q, cu_k)  # a max length missing: read and planned from the values
    for _ in range(2):  # an unhashable option (a list for the window): no plan key, planned each time
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 4, 6, window_size=[1, 1])
    expected = 1 if xp is not np else 3
    assert planned.count("_plan_varlen_forward") == expected + 3 and planned.count("_plan_varlen_backward") == expected


def order_keys(lengths_q, lengths_k, block_m, block_n, window_left, window_right, masked):
    """{(sequence, query block): the key tiles its rows see} for every query block with rows (varlen_order's
    entries, kernels/varlen.cu): KeyTiles under the Window of the sequence's own diagonal, with the kernels' window
    sides (an unbounded side past any key)."""
    keys = {}
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        diagonal = n_k - n_q
        for m_block in range(-(-n_q // block_m)):
            m0 = m_block * block_m
            begin = max(0, m0 + diagonal - window_left) if window_left is not None else 0
            end = max(0, min(n_k, m0 + block_m + diagonal + window_right)) if masked else n_k
            first = begin // block_n * block_n
            keys[b, m_block] = (end - first + block_n - 1) // block_n
    return keys


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_varlen_order_walks_every_query_block_with_rows_once_most_tiles_first(mask):
    """The Hopper forward's item order for a packed batch (varlen_order): every (sequence, query block) with rows
    once, none past its sequence's end, their key tiles never increasing along the order; each entry is sequence
    b's query block m as b * num_m_blocks + m (num_m_blocks: the longest sequence's)."""
    cupy = pytest.importorskip("cupy")
    from cuflash import _config, _cupy_path, _plan, _varlen

    from .conftest import GPU
    if not GPU or not _cupy_path.device_props(0).tensor_maps:
        pytest.skip("the Hopper forward's packed order runs where the plan has tensor maps (compute capability 9.0)")
    lengths_q = [3072, 0, 1, 700, 128, 129, 2500, 64, 1000, 5]
    lengths_k = [3072, 40, 0, 900, 128, 300, 2500, 64, 1000, 2048]
    options = dict(none={}, causal=dict(causal=True), window=dict(window_size=(300, 20)))[mask]
    heads = 6
    rng = np.random.default_rng(7)
    q, k, _, _, cu_q, cu_k = packed(cupy, rng, lengths_q, lengths_k, heads, 2, 64, np.float16)
    batch = _varlen.check_packing(q, k, k, cu_q, cu_k, None, None, read=True)
    p = _varlen.problem(q, k, batch, options.get("causal", False), None, options.get("window_size", (-1, -1)),
                        0.0, None, None, 0.0)
    launch = _plan.forward(p, _cupy_path.device_props(0), packed=True, total_q=q.shape[0])
    assert launch.spec.kernel == "fwd_wgmma" and launch.order is not None
    order = cupy.full(launch.order_ints, -1, np.int32)
    _cupy_path._Launch(launch.order, 0)((order, cu_q, cu_k))
    order = cupy.asnumpy(order)
    left, right = p.kernel_window
    keys = order_keys(lengths_q, lengths_k, launch.spec.block_m, launch.spec.block_n,
                      left if p.mask_kind == _config.MASK_WINDOW else None, right, p.masked)
    num_m_blocks = -(-p.seqlen_q // launch.spec.block_m)
    index = {b * num_m_blocks + m: (b, m) for b, m in keys}
    count = int(order[0])
    assert count == len(keys) and (order[1 + count:] == -1).all()
    walked = [index[int(i)] for i in order[1:1 + count]]
    assert sorted(walked) == sorted(keys)
    tiles = [max(keys[entry], 0) for entry in walked]
    assert tiles == sorted(tiles, reverse=True)


@pytest.mark.parametrize("head_dim, equal", [(64, False), (128, False), (128, True)])
def test_the_sections_of_the_packed_causal_hopper_forward_walk_every_item(rng, monkeypatch, head_dim, equal):
    """Under the causal mask the packed Hopper forward walks its heads in sections sized to the L2 (in
    varlen_order's order sections of heads; in QueryBlock's, at 128 on equal lengths, sections of (sequence, head)
    pairs). An item's result does not depend on the order, so an L2 that makes sections of 1 to 3 (the last
    partial) gives the one section's output (an L2 of unknown size) bit for bit, on both grids."""
    cupy = pytest.importorskip("cupy")
    from cuflash import _config, _cupy_path, _plan, _varlen

    from .conftest import GPU
    if not GPU or not _cupy_path.device_props(0).tensor_maps:
        pytest.skip("the Hopper forward runs where the plan has tensor maps (compute capability 9.0)")
    lengths_q = [300] * 4 if equal else [700, 0, 1, 300, 129, 1000, 64]
    lengths_k = [300] * 4 if equal else [700, 40, 0, 500, 129, 1000, 64]
    heads = 7
    q, k, v, _, cu_q, cu_k = packed(cupy, rng, lengths_q, lengths_k, heads, heads, head_dim, np.float16)
    batch = _varlen.check_packing(q, k, v, cu_q, cu_k, None, None, read=True)
    p = _varlen.problem(q, k, batch, True, None, (-1, -1), 0.0, None, None, 0.0)
    real = _cupy_path.device_props
    launch = _plan.forward(p, real(0), packed=True, total_q=q.shape[0], total_k=k.shape[0])
    assert launch.spec.kernel == "fwd_wgmma" and (launch.order is None) == equal
    pairs = heads if launch.order is not None else p.batch * heads
    keys = k.shape[0] if launch.order is not None else p.seqlen_k
    pair_bytes = 2 * keys * launch.spec.head_dim * 2   # float16, no groups
    for persistent in (True, False):
        def plan(l2_bytes):
            monkeypatch.setattr(_cupy_path, "device_props", lambda i: dataclasses.replace(real(i), l2_bytes=l2_bytes))
            forward = _cupy_path.ForwardPlan(p, 0, q, k, v, packed=True, persistent=persistent)
            launch = _plan.forward(p, _cupy_path.device_props(0), packed=True, total_q=q.shape[0],
                                   total_k=k.shape[0])
            return forward, launch.tail[0]
        forward, sections = plan(0)
        assert sections == pairs
        want, want_lse = forward.run(q, k, v, None, None, 0, 0, True, (cu_q, cu_k))
        for expected in (1, 2, 3):
            forward, sections = plan(int((expected + 0.5) * pair_bytes / _config.FORWARD_SECTION_L2_SHARE))
            assert sections == expected, (head_dim, persistent)
            out, lse = forward.run(q, k, v, None, None, 0, 0, True, (cu_q, cu_k))
            assert cupy.array_equal(out, want) and cupy.array_equal(lse, want_lse), (head_dim, persistent, expected)


def test_packed_batches_past_the_persistent_grids_keys_match_the_reference(xp, rng):
    """Sequences of several query blocks each, their mean past fwd_wgmma's persistent grid (one block per item
    in varlen_order's order) and not (the persistent grid, the longest past it or not), causal and not, at the
    head dims that walk that order: every query block computed once."""
    if xp is np:
        pytest.skip("the order of the GPU path's packed kernels; the NumPy path runs each sequence on its own")
    for head_dim in (64, 128):
        for lengths in ([2200, 2100], [2200, 100, 700, 0, 1300], [900, 64, 1, 500]):
            for options in ({}, dict(causal=True), dict(window_size=(200, 0))):
                check_varlen(xp, rng, lengths, lengths, 4, 2, head_dim, np.dtype("float16"), options)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("feature", ["plain", "causal", "window-alibi"])
def test_paged_keys_are_the_packed_keys(xp, rng, page_size, feature):
    """attention_varlen with block_table gives the packed call's bits (an empty sequence and ragged tails among
    them)."""
    lengths_q, lengths_k = [17, 0, 40, 33], [23, 0, 300, 70]
    dtype = DTYPES[0] if xp is not np else DTYPES[2]
    cu_q, cu_k = (xp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    q = xp.asarray(rng.standard_normal((sum(lengths_q), 4, 64), dtype=np.float32).astype(dtype))
    k, v = (xp.asarray(rng.standard_normal((sum(lengths_k), 2, 64), dtype=np.float32).astype(dtype)) for _ in range(2))
    options = {"plain": {}, "causal": dict(causal=True),
               "window-alibi": dict(window_size=(50, 3), alibi_slopes=True)}[feature]
    options = feature_arrays(xp, rng, options, len(lengths_q), 4)
    (k_cache, v_cache), table = packed_pages(xp, rng, k, v, lengths_k, page_size)
    paged, paged_lse = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, return_lse=True,
                                                check_indices=True, **options)
    packed, packed_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    np.testing.assert_array_equal(to_numpy(paged).astype(np.float32), to_numpy(packed).astype(np.float32))
    np.testing.assert_array_equal(to_numpy(paged_lse), to_numpy(packed_lse))


def test_paged_keys_refusals(rng):
    lengths = [5, 40]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = rng.standard_normal((10, 2, 32)).astype(np.float32)
    k = rng.standard_normal((45, 2, 32)).astype(np.float32)
    (k_cache, v_cache), table = packed_pages(np, rng, k, k, lengths, 16)
    with pytest.raises(TypeError, match="block_table must be an int32 array"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu, cu, block_table=table.astype(np.int64))
    with pytest.raises(ValueError, match="a row per sequence"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu, cu, block_table=table[:1])
    with pytest.raises(ValueError, match="4 dimensions"):
        cuflash.attention_varlen(q, k, k, cu, cu, block_table=table)
    bad = table.copy()
    bad[1, 2] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu, cu, block_table=bad)
    with pytest.raises(ValueError, match="past its block_table"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu, cu, block_table=table[:, :2])
    with pytest.raises(ValueError, match="k and v must have one shape"):
        cuflash.attention_varlen(q, k_cache, v_cache[:-1], cu, cu, block_table=table)
    with pytest.raises(ValueError, match=r"page_size \(k.shape\[1\]\) must be positive, got 0"):
        cuflash.attention_varlen(q, k_cache[:, :0], v_cache[:, :0], cu, cu, block_table=table)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be prefix sums from 0, never decreasing, got "
                                         r"\[0, 40, 30\]"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu, np.array([0, 40, 30], np.int32), block_table=table)
