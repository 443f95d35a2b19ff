"""attention_with_kvcache: decoding against a KV cache, contiguous and paged, with and without appending,
every key split, every mask and score modifier, against the float64 reference (a loop of dense calls over
each sequence's keys); the cache written exactly where the call says and nowhere else; refused calls write
nothing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cuflash
from cuflash import reference

from ._checks import (BF16, assert_fa_close, feature_arrays, max_abs_finite, paged_copies, poison_pool,
                      to_numpy)
from .conftest import requires_gpu

HALF = (np.dtype(np.float16), BF16)


def dtypes_of(xp):
    """The dtypes the path takes: the GPU's KV-cache forward runs float16 and bfloat16."""
    return HALF if xp is not np else (*HALF, np.dtype(np.float32))


def draw(xp, rng, shape, dtype):
    return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def check_against_reference(out, lse, q, k_cache, v_cache, k, v, dtype, **options):
    """out and lse against the float64 reference within FlashAttention's forward rule (caches as before the
    call: the reference appends k and v itself)."""
    host = {name: None if x is None else to_numpy(x) for name, x in
            dict(k=k, v=v, alibi_slopes=options.pop("alibi_slopes", None), sinks=options.pop("sinks", None),
                 cache_seqlens=options.pop("cache_seqlens", None), block_table=options.pop("block_table", None)).items()}
    if isinstance(host["cache_seqlens"], np.ndarray) and host["cache_seqlens"].ndim == 0:
        host["cache_seqlens"] = int(host["cache_seqlens"])
    args = (to_numpy(q), to_numpy(k_cache), to_numpy(v_cache))
    ref_out, ref_lse = reference.attention_with_kvcache(*args, **host, **options)
    low_out, low_lse = reference.attention_with_kvcache(*args, **host, **options, in_dtype=dtype)
    assert_fa_close(out, ref_out, low_out, dtype, 2, "out", max_score=max_abs_finite(ref_lse))
    assert_fa_close(lse, ref_lse, low_lse, np.float32, 2, "lse", max_score=max_abs_finite(ref_lse))


FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(37, 5)),
    "causal-window": dict(causal=True, window_size=(70, -1)),
    "softcap-sinks": dict(softcap=3.0, sinks=True),
    "alibi": dict(alibi_slopes=True, causal=True),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (1, 1), (4, 4), (5, 0)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_matches_the_reference(xp, rng, feature, heads, heads_kv, seqlen_q, seqlen_new, paged):
    """Per-sequence lengths (one empty, one full), appended keys, GQA packing, every mask and modifier."""
    batch, capacity, head_dim = 3, 200, 64
    dtype = dtypes_of(xp)[rng.integers(len(dtypes_of(xp)))]
    q = draw(xp, rng, (batch, seqlen_q, heads, head_dim), dtype)
    k_cache, v_cache = (draw(xp, rng, (batch, capacity, heads_kv, head_dim), dtype) for _ in range(2))
    lengths = xp.asarray(np.array([0, capacity - seqlen_new, rng.integers(1, capacity - seqlen_new)], np.int32))
    k, v = (draw(xp, rng, (batch, seqlen_new, heads_kv, head_dim), dtype) if seqlen_new else None for _ in range(2))
    options = feature_arrays(xp, rng, FEATURES[feature], batch, heads)
    table = None
    if paged:
        (k_cache, v_cache), table = paged_copies(xp, rng, (k_cache, v_cache), 64)
    before = [to_numpy(x).copy() for x in (k_cache, v_cache)]
    poison_pool(xp)
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table,
                                              return_lse=True, **options)
    assert out.dtype == dtype and lse.dtype == np.float32 and lse.shape == (batch, heads, seqlen_q)
    check_against_reference(out, lse, q, *(xp.asarray(x) for x in before), k, v, dtype, cache_seqlens=lengths,
                            block_table=table, **options)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lengths_kind", ["int", "array"])
def test_append_writes_exactly_the_new_rows(xp, rng, paged, lengths_kind):
    """k and v land at positions cache_seqlens[b].. of each sequence; every other element of the caches is
    unchanged; a second step appends after the first."""
    batch, capacity, heads_kv, head_dim, seqlen_new = 2, 128, 2, 32, 3
    dtype = dtypes_of(xp)[0]
    caches = [draw(xp, rng, (batch, capacity, heads_kv, head_dim), dtype) for _ in range(2)]
    table = None
    if paged:
        caches, table = paged_copies(xp, rng, caches, 64)
    q = draw(xp, rng, (batch, 1, 4, head_dim), dtype)
    start = np.array([5, 61], np.int32) if lengths_kind == "array" else 61
    expected = [to_numpy(c).copy() for c in caches]
    for step in range(2):
        k, v = (draw(xp, rng, (batch, seqlen_new, heads_kv, head_dim), dtype) for _ in range(2))
        lengths = start + step * seqlen_new
        cuflash.attention_with_kvcache(q, *caches, k, v, causal=True, block_table=table,
                                       cache_seqlens=xp.asarray(lengths) if lengths_kind == "array" else lengths)
        for b in range(batch):
            first = int(np.broadcast_to(lengths, (batch,))[b])
            for pos in range(first, first + seqlen_new):
                for cache, new in zip(expected, (k, v)):
                    if table is None:
                        cache[b, pos] = to_numpy(new)[b, pos - first]
                    else:
                        cache[to_numpy(table)[b, pos // 64], pos % 64] = to_numpy(new)[b, pos - first]
    for cache, want in zip(caches, expected):
        np.testing.assert_array_equal(to_numpy(cache), want)


@pytest.mark.parametrize("lengths_kind", ["int", "full"])
def test_int_and_full_lengths(xp, rng, lengths_kind):
    """cache_seqlens as one int for every sequence, or None (every sequence fills the cache)."""
    batch, capacity, heads, heads_kv, head_dim = 2, 150, 8, 2, 128
    dtype = dtypes_of(xp)[-1]
    q = draw(xp, rng, (batch, 2, heads, head_dim), dtype)
    caches = [draw(xp, rng, (batch, capacity, heads_kv, head_dim), dtype) for _ in range(2)]
    lengths = 77 if lengths_kind == "int" else None
    out, lse = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lengths, causal=True, return_lse=True)
    check_against_reference(out, lse, q, *caches, None, None, dtype, cache_seqlens=lengths, causal=True)


@pytest.mark.parametrize("sinks", [False, True])
def test_sequences_without_keys(xp, rng, sinks):
    """A sequence with no key gives output 0 and lse -inf (the sink with sinks), whatever the splits."""
    dtype = dtypes_of(xp)[0]
    q = draw(xp, rng, (2, 1, 4, 64), dtype)
    caches = [draw(xp, rng, (2, 256, 2, 64), dtype) for _ in range(2)]
    sink = xp.asarray(rng.standard_normal(4).astype(np.float32)) if sinks else None
    for num_splits in (1, 3):
        out, lse = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=xp.asarray(np.array([0, 9], np.int32)),
                                                  sinks=sink, num_splits=num_splits, return_lse=True)
        np.testing.assert_array_equal(to_numpy(out)[0], 0)
        want = to_numpy(sink)[:, None] if sinks else np.full((4, 1), -np.inf, np.float32)
        np.testing.assert_array_equal(to_numpy(lse)[0], want)


@requires_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 72])
@pytest.mark.parametrize("feature", ["plain", "window", "softcap-sinks"])
def test_every_split_count_agrees_with_one(rng, head_dim, feature):
    """num_splits 2..n (the in-kernel merge) against 1 (no merge) within the tolerance rule, and the plan's own
    choice; paged equals contiguous bit for bit (the same tiles in the same order)."""
    import cupy as xp

    batch, heads, heads_kv, capacity = 2, 16, 4, 1000
    q = draw(xp, rng, (batch, 1, heads, head_dim), BF16)
    caches = [draw(xp, rng, (batch, capacity, heads_kv, head_dim), BF16) for _ in range(2)]
    lengths = xp.asarray(np.array([capacity, 517], np.int32))
    options = feature_arrays(xp, rng, FEATURES[feature], batch, heads)
    runs = {}
    for num_splits in (1, 2, 5, 16, 0):
        poison_pool(xp)
        runs[num_splits] = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lengths, num_splits=num_splits,
                                                          return_lse=True, **options)
        check_against_reference(*runs[num_splits], q, *caches, None, None, BF16, cache_seqlens=lengths, **options)
    pools, table = paged_copies(xp, rng, caches, 128)
    for num_splits in (1, 5):
        paged = cuflash.attention_with_kvcache(q, *pools, cache_seqlens=lengths, block_table=table,
                                               num_splits=num_splits, return_lse=True, **options)
        for got, want in zip(paged, runs[num_splits]):
            np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


@requires_gpu
def test_split_counters_are_left_zero_between_calls(rng):
    """The last block of each row group to finish merges the group's splits and resets its counter: the same
    call repeated after calls of other shapes and splits gives the same result bit for bit (a counter left
    non-zero would leave its rows unmerged: NaN from the poisoned pool), a call on another stream counts in
    its own buffer, and every counter is zero afterwards."""
    import cupy as xp

    from cuflash import _cupy_path

    def call(batch, heads, num_splits):
        q = draw(xp, np.random.default_rng(batch), (batch, 1, heads, 128), BF16)
        caches = [draw(xp, np.random.default_rng(batch + i), (batch, 1000, 4, 128), BF16) for i in (1, 2)]
        return cuflash.attention_with_kvcache(q, *caches, cache_seqlens=900, num_splits=num_splits, return_lse=True)

    first = [to_numpy(x) for x in call(2, 16, 5)]
    assert np.isfinite(first[0].astype(np.float32)).all()
    for other in ((3, 8, 3), (1, 16, 8), (2, 16, 2)):
        call(*other)
        poison_pool(xp)
        for got, want in zip(call(2, 16, 5), first):
            np.testing.assert_array_equal(to_numpy(got), want)
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        on_stream = call(2, 16, 5)
        stream.synchronize()
    for got, want in zip(on_stream, first):
        np.testing.assert_array_equal(to_numpy(got), want)
    device = xp.cuda.Device().id
    own = [(device, s.ptr) for s in (xp.cuda.get_current_stream(), stream)]
    assert own[0] != own[1] and all(key in _cupy_path._SPLIT_COUNTERS for key in own)
    for counters in _cupy_path._SPLIT_COUNTERS.values():
        assert not counters.any()


def test_split_counters_are_kept_per_stream_and_bounded(monkeypatch):
    """The split counters' bookkeeping (no GPU: CuPy stood in for by NumPy and a stream pointer): one zeroed
    buffer per (device, stream), the same one while it is large enough, a larger one when a call needs it,
    and all of them dropped once more than MAX_COUNTER_STREAMS streams have asked, so a program that makes
    a stream per call keeps a bounded set."""
    import types

    from cuflash import _cupy_path

    stream = types.SimpleNamespace(ptr=0)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream), zeros=np.zeros)
    monkeypatch.setattr(_cupy_path, "cupy", fake)
    monkeypatch.setattr(_cupy_path, "_SPLIT_COUNTERS", {})
    first = _cupy_path.split_counters(0, 8)
    assert first.size == 8 and first.dtype == np.int32 and not first.any()
    assert _cupy_path.split_counters(0, 4) is first
    grown = _cupy_path.split_counters(0, 16)
    assert grown is not first and grown.size == 16 and not grown.any()
    assert _cupy_path.split_counters(1, 4) is not grown  # another device
    seen = []
    for ptr in range(1, 2 * _cupy_path.MAX_COUNTER_STREAMS):
        stream.ptr = ptr
        seen.append(len(_cupy_path._SPLIT_COUNTERS))
        assert _cupy_path.split_counters(0, 4) is _cupy_path.split_counters(0, 4)
    assert max(seen) == _cupy_path.MAX_COUNTER_STREAMS and len(_cupy_path._SPLIT_COUNTERS) < max(seen)


@st.composite
def decode_problems(draw_from):
    """Shapes, lengths and options of a decoding call: packed query heads, odd head dims, lengths from empty
    to full, pages of 64 or 128 keys."""
    heads_kv = draw_from(st.sampled_from([1, 2, 3]))
    return dict(batch=draw_from(st.integers(1, 4)), seqlen_q=draw_from(st.integers(1, 6)),
                heads_kv=heads_kv, group=draw_from(st.sampled_from([1, 2, 5, 8])),
                head_dim=draw_from(st.sampled_from([8, 40, 64, 96, 128, 160, 256])),
                capacity=draw_from(st.integers(1, 400)), seqlen_new=draw_from(st.integers(0, 3)),
                page_size=draw_from(st.sampled_from([0, 64, 128])), num_splits=draw_from(st.sampled_from([0, 1, 3])),
                feature=draw_from(st.sampled_from(sorted(FEATURES))), seed=draw_from(st.integers(0, 2**31)))


@given(decode_problems())
def test_fuzzed_decoding(xp, case):
    rng = np.random.default_rng(case["seed"])
    batch, seqlen_q, heads_kv = case["batch"], case["seqlen_q"], case["heads_kv"]
    heads, head_dim, seqlen_new = heads_kv * case["group"], case["head_dim"], case["seqlen_new"]
    capacity = max(case["capacity"], seqlen_new)
    dtype = dtypes_of(xp)[case["seed"] % 2]
    q = draw(xp, rng, (batch, seqlen_q, heads, head_dim), dtype)
    caches = [draw(xp, rng, (batch, capacity, heads_kv, head_dim), dtype) for _ in range(2)]
    lengths = xp.asarray(rng.integers(0, capacity - seqlen_new + 1, batch).astype(np.int32))
    k, v = (draw(xp, rng, (batch, seqlen_new, heads_kv, head_dim), dtype) if seqlen_new else None for _ in range(2))
    table = None
    if case["page_size"]:
        caches, table = paged_copies(xp, rng, caches, case["page_size"])
    before = [to_numpy(c).copy() for c in caches]
    options = feature_arrays(xp, rng, FEATURES[case["feature"]], batch, heads)
    out, lse = cuflash.attention_with_kvcache(q, *caches, k, v, cache_seqlens=lengths, block_table=table,
                                              num_splits=case["num_splits"], return_lse=True, **options)
    check_against_reference(out, lse, q, *(xp.asarray(c) for c in before), k, v, dtype, cache_seqlens=lengths,
                            block_table=table, **options)


def test_refused_calls_write_nothing(xp, rng):
    """Each bad argument is a ValueError or TypeError naming it, raised before k and v touch the cache."""
    dtype = dtypes_of(xp)[0]
    q = draw(xp, rng, (2, 1, 4, 32), dtype)
    caches = [draw(xp, rng, (2, 100, 2, 32), dtype) for _ in range(2)]
    k, v = (draw(xp, rng, (2, 3, 2, 32), dtype) for _ in range(2))
    pools = [draw(xp, rng, (6, 64, 2, 32), dtype) for _ in range(2)]
    table = xp.asarray(np.array([[0, 1], [2, 3]], np.int32))
    before = [to_numpy(c).copy() for c in (*caches, *pools)]
    lengths = xp.asarray(np.array([1, 2], np.int32))
    bad = [
        (dict(cache_seqlens=98), ValueError, "cache_seqlens must be in \\[0, 97\\]"),
        (dict(cache_seqlens=-1), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=None), ValueError, "k and v need cache_seqlens"),
        (dict(cache_seqlens=2.0), TypeError, "cache_seqlens must be an int"),
        (dict(cache_seqlens=xp.asarray(np.array([1, 2], np.int64))), TypeError, "int32 array"),
        (dict(cache_seqlens=xp.asarray(np.array([1, 2, 3], np.int32))), TypeError, "\\(batch,\\) = \\(2,\\)"),
        (dict(cache_seqlens=lengths, num_splits=-1), ValueError, "num_splits"),
        (dict(cache_seqlens=lengths, num_splits=129), ValueError, "num_splits"),
        (dict(cache_seqlens=lengths, sinks=xp.zeros(3, np.float32)), ValueError, "sinks must have shape"),
        (dict(cache_seqlens=lengths, window_size=(-2, 0)), ValueError, "window_size"),
        (dict(cache_seqlens=lengths, k=k[:, :, :1]), ValueError, "k and v must have shape"),
        (dict(cache_seqlens=lengths, v=None), ValueError, "k and v must be given together"),
        (dict(cache_seqlens=lengths, k=k.astype(np.float32)), TypeError, "k must have the dtype of q"),
    ]
    for overrides, error, message in bad:
        args = {"k": k, "v": v, **overrides}
        with pytest.raises(error, match=message):
            cuflash.attention_with_kvcache(q, *caches, **args)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must have one shape, got \(2, 100, 2, 32\) and "
                                         r"\(2, 99, 2, 32\)"):
        cuflash.attention_with_kvcache(q, caches[0], caches[1][:, :99], k, v, cache_seqlens=lengths)
    with pytest.raises(TypeError, match="q, k_cache and v_cache must share one dtype"):
        cuflash.attention_with_kvcache(q, caches[0], caches[1].astype(np.float32), k, v, cache_seqlens=lengths)
    paged_bad = [
        (dict(block_table=table.astype(np.int64)), TypeError, "block_table must be an int32"),
        (dict(block_table=table[:1]), ValueError, "block_table must have batch = 2"),
        (dict(block_table=table, cache_seqlens=126), ValueError, "cache_seqlens must be in \\[0, 125\\]"),
    ]
    for overrides, error, message in paged_bad:
        args = {"k": k, "v": v, "cache_seqlens": lengths, **overrides}
        with pytest.raises(error, match=message):
            cuflash.attention_with_kvcache(q, *pools, **args)
    with pytest.raises(ValueError, match="page_size .* multiple of 64"):
        cuflash.attention_with_kvcache(q, *(p[:, :48] for p in pools), k, v, cache_seqlens=lengths,
                                       block_table=table)
    with pytest.raises(ValueError, match="k_cache must hold batch = 2"):
        cuflash.attention_with_kvcache(q, *(c[:1] for c in caches), cache_seqlens=1)
    with pytest.raises(ValueError, match="must be a multiple of heads_kv of the cache"):
        cuflash.attention_with_kvcache(q[:, :, :3], *caches, cache_seqlens=1)
    for cache, want in zip((*caches, *pools), before):
        np.testing.assert_array_equal(to_numpy(cache), want)


def test_caches_past_int32_are_refused():
    """A cache of 2**31 keys a sequence, plain or through a block_table's pages (zero-stride views: no memory
    behind them), cannot be indexed by the kernels' int32 positions."""
    q = np.zeros((2, 1, 4, 32), np.float16)
    tall = np.broadcast_to(np.zeros((1, 1, 1, 32), np.float16), (2, 2**31, 2, 32))
    with pytest.raises(ValueError, match="the cache holds 2147483648 keys per sequence, past int32"):
        cuflash.attention_with_kvcache(q, tall, tall, cache_seqlens=1)
    pool = np.zeros((1, 64, 2, 32), np.float16)
    wide_table = np.broadcast_to(np.zeros((1, 1), np.int32), (2, 2**25 + 1))
    with pytest.raises(ValueError, match="the cache holds 2147483712 keys per sequence, past int32"):
        cuflash.attention_with_kvcache(q, pool, pool, cache_seqlens=1, block_table=wide_table)


@requires_gpu
def test_gpu_refuses_float32_and_strided_caches(rng):
    import cupy as xp

    q = draw(xp, rng, (1, 1, 2, 32), np.float32)
    caches = [draw(xp, rng, (1, 64, 2, 32), np.float32) for _ in range(2)]
    with pytest.raises(TypeError, match="float16, bfloat16 and float8 e4m3 on the GPU"):
        cuflash.attention_with_kvcache(q, *caches, cache_seqlens=3)
    caches = [draw(xp, rng, (1, 64, 2, 64), BF16)[..., ::2] for _ in range(2)]
    with pytest.raises(ValueError, match="k_cache must have a contiguous last axis"):
        cuflash.attention_with_kvcache(q.astype(BF16), *caches, cache_seqlens=3)


def rotary_tables(xp, seqlen_ro: int, rotary_dim: int, dtype):
    """cos and sin of RoPE's angles, position x 10000^(-2i / rotary_dim), (seqlen_ro, rotary_dim / 2)."""
    angles = np.arange(seqlen_ro)[:, None] * 10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim)[None, :]
    return xp.asarray(np.cos(angles).astype(dtype)), xp.asarray(np.sin(angles).astype(dtype))


def test_rotation_of_known_pairs():
    """A pair (1, 0) at angle t becomes (cos t, sin t); GPT-J pairs neighbours, GPT-NeoX the two halves; the
    channels past rotary_dim stay as they are; queries all at cache_seqlens where they do not advance."""
    from cuflash import _kvcache

    t = np.array([[0.0, 0.0], [0.3, 0.7]])  # positions 0 and 1, two pairs
    cos, sin = np.cos(t), np.sin(t)
    x = np.array([1.0, 2.0, 0.0, 0.0, 5.0])[None, None, None, :]  # one channel past rotary_dim 4
    at = np.array([[1]])
    interleaved = _kvcache.rotate(np, x, cos, sin, at, True, np.float64, np.float64)[0, 0, 0]
    np.testing.assert_allclose(interleaved, [np.cos(0.3) - 2 * np.sin(0.3), np.sin(0.3) + 2 * np.cos(0.3), 0, 0, 5])
    halves = _kvcache.rotate(np, x, cos, sin, at, False, np.float64, np.float64)[0, 0, 0]
    np.testing.assert_allclose(halves, [np.cos(0.3), 2 * np.cos(0.7), np.sin(0.3), 2 * np.sin(0.7), 5])
    np.testing.assert_array_equal(_kvcache.positions(np, np.array([3, 7], np.int32), 2, 3),
                                  [[3, 4, 5], [7, 8, 9]])
    np.testing.assert_array_equal(_kvcache.positions(np, 4, 2, 3, advance=False), [[4, 4, 4], [4, 4, 4]])


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lengths_kind", ["int", "array"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_rotary_matches_the_reference(xp, rng, interleaved, causal, lengths_kind, paged):
    """q and the appended k rotated at FlashAttention's positions, k written rotated into the cache, q and k
    themselves untouched; the output within the tolerance rule of the float64 reference."""
    from cuflash import _kvcache

    batch, heads, heads_kv, head_dim, capacity, seqlen_new, rotary_dim = 2, 8, 2, 64, 256, 2, 32
    dtype = dtypes_of(xp)[rng.integers(len(dtypes_of(xp)))]
    cos, sin = rotary_tables(xp, capacity, rotary_dim, np.float32)
    q = draw(xp, rng, (batch, seqlen_new, heads, head_dim), dtype)
    caches = [draw(xp, rng, (batch, capacity, heads_kv, head_dim), dtype) for _ in range(2)]
    k, v = (draw(xp, rng, (batch, seqlen_new, heads_kv, head_dim), dtype) for _ in range(2))
    host_lengths = np.array([5, 130], np.int32) if lengths_kind == "array" else 37
    lengths = xp.asarray(host_lengths) if lengths_kind == "array" else host_lengths
    table = None
    if paged:
        caches, table = paged_copies(xp, rng, caches, 64)
    before = [to_numpy(x).copy() for x in (*caches, q, k)]
    out, lse = cuflash.attention_with_kvcache(q, *caches, k, v, cache_seqlens=lengths, block_table=table,
                                              rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                                              causal=causal, return_lse=True)
    np.testing.assert_array_equal(to_numpy(q), before[2])
    np.testing.assert_array_equal(to_numpy(k), before[3])
    check_against_reference(out, lse, q, *(xp.asarray(c) for c in before[:2]), k, v, dtype, cache_seqlens=lengths,
                            block_table=table, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                            causal=causal)
    rotated = _kvcache.rotate(np, before[3], to_numpy(cos), to_numpy(sin),
                              _kvcache.positions(np, host_lengths, batch, seqlen_new), interleaved, np.float64,
                              np.float64)
    host_table = None if table is None else to_numpy(table)
    for b in range(batch):
        first = int(np.broadcast_to(host_lengths, (batch,))[b])
        written = _kvcache.sequence_keys(to_numpy(caches[0]), host_table, b, first + seqlen_new)[first:]
        scale = np.abs(rotated[b]).max()
        np.testing.assert_allclose(written.astype(np.float64), rotated[b], rtol=0,
                                   atol=2 * float(ml_dtypes.finfo(dtype).eps) * scale)


@requires_gpu
@pytest.mark.parametrize("table_dtype", ["float32", "q"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(40, 16), (128, 128), (72, 64)])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_fused_append_matches_the_array_steps(rng, table_dtype, head_dim, rotary_dim, interleaved):
    """The GPU's one append_rotary launch writes the caches as the NumPy path's array operations do (within
    one rounding of the float32 rotation), on strided q, k and v views (every other head of larger arrays),
    tables of either dtype, rotary_dim below head_dim, several queries at advancing positions, pages of 64
    keys; every row it does not write stays as it was, and the output is the reference's."""
    import cupy as xp

    batch, seqlen_q, seqlen_new, heads, heads_kv, capacity = 3, 3, 5, 4, 2, 200
    dtype = BF16
    cos, sin = rotary_tables(np, capacity, rotary_dim, np.float32 if table_dtype == "float32" else dtype)
    q_host = rng.standard_normal((batch, seqlen_q, 2 * heads, head_dim)).astype(dtype)[:, :, ::2]
    k_host, v_host = (rng.standard_normal((batch, seqlen_new, 2 * heads_kv, head_dim)).astype(dtype)[:, :, ::2]
                      for _ in range(2))
    caches = [rng.standard_normal((batch, capacity, heads_kv, head_dim)).astype(dtype) for _ in range(2)]
    lengths = np.array([0, 61, 195], np.int32)
    pools, table = paged_copies(np, rng, caches, 64)
    results = {}
    for path in (np, xp):
        arrays = [q_host, k_host, v_host]
        if path is xp:  # the same strided views, on the device: every other head of a larger array
            arrays = [xp.asarray(np.repeat(x, 2, axis=2))[:, :, ::2] for x in arrays]
            assert not arrays[0].flags.c_contiguous
        run_pools = [path.array(pool) for pool in pools]
        out, lse = cuflash.attention_with_kvcache(arrays[0], *run_pools, arrays[1], arrays[2],
                                                  cache_seqlens=path.asarray(lengths), block_table=path.asarray(table),
                                                  rotary_cos=path.asarray(cos), rotary_sin=path.asarray(sin),
                                                  rotary_interleaved=interleaved, causal=True, return_lse=True)
        results[path] = [to_numpy(x) for x in (out, lse, *run_pools)]
    eps = float(ml_dtypes.finfo(dtype).eps)
    for got, want in zip(results[xp][2:], results[np][2:]):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=eps, atol=eps)
    written = np.zeros(pools[0].shape[:2], bool)
    for b in range(batch):
        for n in range(lengths[b], lengths[b] + seqlen_new):
            written[table[b, n // 64], n % 64] = True
    for got, before in zip(results[xp][2:], pools):
        np.testing.assert_array_equal(got[~written], before[~written])
    # the paged GPU call's own output against the reference on the contiguous caches it paged
    out, lse = results[xp][:2]
    check_against_reference(out, lse, q_host, *caches, k_host, v_host, dtype, cache_seqlens=lengths, rotary_cos=cos,
                            rotary_sin=sin, rotary_interleaved=interleaved, causal=True)


def test_rotary_refusals(xp, rng):
    dtype = dtypes_of(xp)[0]
    q = draw(xp, rng, (2, 1, 4, 32), dtype)
    caches = [draw(xp, rng, (2, 100, 2, 32), dtype) for _ in range(2)]
    k, v = (draw(xp, rng, (2, 1, 2, 32), dtype) for _ in range(2))
    cos, sin = rotary_tables(xp, 50, 16, np.float32)
    before = [to_numpy(c).copy() for c in caches]
    bad = [
        (dict(cache_seqlens=3, rotary_cos=cos), ValueError, "given together"),
        (dict(cache_seqlens=None, k=None, v=None, rotary_cos=cos, rotary_sin=sin), ValueError, "need cache_seqlens"),
        (dict(cache_seqlens=3, rotary_cos=cos.astype(np.float64), rotary_sin=sin), TypeError, "rotary_cos must be"),
        (dict(cache_seqlens=3, rotary_cos=cos[:, :4], rotary_sin=sin), ValueError, "one shape"),
        (dict(cache_seqlens=3, rotary_cos=xp.concatenate([cos] * 3, 1), rotary_sin=xp.concatenate([sin] * 3, 1)),
         ValueError, "rotary_dim"),
        (dict(cache_seqlens=3, rotary_cos=cos[None], rotary_sin=sin[None]), ValueError, "2 dimensions"),
        (dict(cache_seqlens=50, rotary_cos=cos, rotary_sin=sin), ValueError, "cover positions \\[0, 50\\)"),
        (dict(cache_seqlens=3, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1), TypeError, "rotary_interleaved"),
    ]
    for overrides, error, message in bad:
        with pytest.raises(error, match=message):
            cuflash.attention_with_kvcache(q, *caches, **{"k": k, "v": v, **overrides})
    for cache, want in zip(caches, before):
        np.testing.assert_array_equal(to_numpy(cache), want)


def test_check_indices_reads_the_lengths_and_the_table(xp, rng):
    """check_indices=True refuses an array length past the cache's room, a length that the rotary tables do
    not cover and a used block_table entry outside the pool, before anything is written; entries past a
    sequence's last page (padding, -1 here) are not read; without the flag the same call is not checked."""
    dtype = dtypes_of(xp)[0]
    q = draw(xp, rng, (2, 1, 4, 32), dtype)
    k, v = (draw(xp, rng, (2, 1, 2, 32), dtype) for _ in range(2))
    pools = [draw(xp, rng, (5, 64, 2, 32), dtype) for _ in range(2)]
    table = np.array([[0, 1, -1], [2, 3, 4]], np.int32)
    before = [to_numpy(p).copy() for p in pools]
    good = xp.asarray(np.array([10, 150], np.int32))  # sequence 0 uses page 0 only: its -1 is padding
    cuflash.attention_with_kvcache(q, *(xp.array(p) for p in before), k, v, cache_seqlens=good,  # copies
                                   block_table=xp.asarray(table), check_indices=True)
    cases = [
        (np.array([10, 192], np.int32), table, "cache_seqlens\\[1\\] = 192 is outside \\[0, 191\\]"),
        (np.array([150, 10], np.int32), table, "block_table\\[0, 2\\] = -1 is outside \\[0, 5\\)"),
        (np.array([10, 150], np.int32), np.array([[0, 1, -1], [2, 9, 4]], np.int32),
         "block_table\\[1, 1\\] = 9 is outside \\[0, 5\\)"),
    ]
    for lengths, bad_table, message in cases:
        with pytest.raises(ValueError, match=message):
            cuflash.attention_with_kvcache(q, *pools, k, v, cache_seqlens=xp.asarray(lengths),
                                           block_table=xp.asarray(bad_table), check_indices=True)
    cos, sin = rotary_tables(xp, 100, 16, np.float32)
    with pytest.raises(ValueError, match="sequence 1 rotates up to position 150"):
        cuflash.attention_with_kvcache(q, *pools, k, v, cache_seqlens=good, block_table=xp.asarray(table),
                                       rotary_cos=cos, rotary_sin=sin, check_indices=True)
    with pytest.raises(TypeError, match="check_indices must be a bool"):
        cuflash.attention_with_kvcache(q, *pools, k, v, cache_seqlens=good, block_table=xp.asarray(table),
                                       check_indices=1)
    for pool, want in zip(pools, before):
        np.testing.assert_array_equal(to_numpy(pool), want)


@pytest.mark.parametrize("feature", ["plain", "causal-window", "alibi", "softcap-sinks"])
@pytest.mark.parametrize("seqlen_new,rotary", [(0, False), (2, False), (2, True)], ids=["read", "append", "rotary"])
def test_leftpad_is_a_cache_that_starts_later(xp, rng, feature, seqlen_new, rotary):
    """cache_leftpad[b] = L: the call equals the same call on a cache whose rows L.. moved to 0 (lengths less L),
    bit for bit, and the reference; new keys land at rows cache_seqlens[b].. of the padded cache."""
    batch, capacity, heads, heads_kv, head_dim, seqlen_q = 3, 200, 8, 2, 64, 2
    dtype = dtypes_of(xp)[rng.integers(len(dtypes_of(xp)))]
    q = draw(xp, rng, (batch, seqlen_q, heads, head_dim), dtype)
    caches = [draw(xp, rng, (batch, capacity, heads_kv, head_dim), dtype) for _ in range(2)]
    lengths = np.array([50, 120, capacity - seqlen_new], np.int32)
    leftpad = np.array([0, 37, capacity - seqlen_new - 3], np.int32)   # the last: 3 cached keys
    new = {}
    if seqlen_new:
        new = dict(k=draw(xp, rng, (batch, seqlen_new, heads_kv, head_dim), dtype),
                   v=draw(xp, rng, (batch, seqlen_new, heads_kv, head_dim), dtype))
    if rotary:
        angles = rng.random((capacity, 16)) * 2 * np.pi
        new.update(rotary_cos=xp.asarray(np.cos(angles).astype(np.float32)),
                   rotary_sin=xp.asarray(np.sin(angles).astype(np.float32)))
    options = feature_arrays(xp, rng, FEATURES[feature], batch, heads)
    shifted = [np.zeros_like(to_numpy(c)) for c in caches]
    for b in range(batch):
        for cache, moved in zip(caches, shifted):
            moved[b, :lengths[b] - leftpad[b]] = to_numpy(cache)[b, leftpad[b]:lengths[b]]
    shifted = [xp.asarray(c) for c in shifted]
    before = [to_numpy(c).copy() for c in caches]
    out, lse = cuflash.attention_with_kvcache(q, *caches, **new, cache_seqlens=xp.asarray(lengths),
                                              cache_leftpad=xp.asarray(leftpad), check_indices=True, return_lse=True,
                                              **options)
    want, want_lse = cuflash.attention_with_kvcache(q, *shifted, **new, cache_seqlens=xp.asarray(lengths - leftpad),
                                                    return_lse=True, **options)
    np.testing.assert_array_equal(to_numpy(out).astype(np.float32), to_numpy(want).astype(np.float32))
    np.testing.assert_array_equal(to_numpy(lse), to_numpy(want_lse))
    if seqlen_new:   # written at the padded cache's rows cache_seqlens[b].., the same bits as the shifted one's
        for b in range(batch):
            for cache, moved, old in zip(caches, shifted, before):
                rows = slice(lengths[b], lengths[b] + seqlen_new)
                np.testing.assert_array_equal(to_numpy(cache)[b, rows],
                                              to_numpy(moved)[b, lengths[b] - leftpad[b]:][:seqlen_new])
                old[b, rows] = to_numpy(cache)[b, rows]
    for cache, old in zip(caches, before):
        np.testing.assert_array_equal(to_numpy(cache), old)
    host_new = {name: value for name, value in new.items() if name not in ("k", "v")}
    check_against_reference(out, lse, q, *(xp.asarray(x) for x in before), new.get("k"), new.get("v"), dtype,
                            cache_seqlens=lengths, cache_leftpad=leftpad, **host_new, **options)


def test_leftpad_refusals(rng):
    q = draw(np, rng, (2, 1, 4, 32), np.float16)
    caches = [draw(np, rng, (2, 64, 2, 32), np.float16) for _ in range(2)]
    lengths = np.array([10, 20], np.int32)
    with pytest.raises(TypeError, match="cache_leftpad must be an int32 array"):
        cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lengths, cache_leftpad=np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="cache_leftpad must be an int32 array"):
        cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lengths, cache_leftpad=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 21 is outside \[0, 20\]"):
        cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lengths, cache_leftpad=np.array([0, 21], np.int32),
                                       check_indices=True)
    pools, table = paged_copies(np, rng, caches, 64)
    with pytest.raises(ValueError, match="cache_leftpad takes a contiguous cache"):
        cuflash.attention_with_kvcache(q, *pools, cache_seqlens=lengths, block_table=table,
                                       cache_leftpad=np.zeros(2, np.int32))
