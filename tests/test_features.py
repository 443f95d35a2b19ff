"""Sliding window, alignment, softcap, ALiBi, sinks and dropout, forward and backward, against the float64
reference (on the NumPy path, and on the CuPy path where its kernels take the option; where they do not
yet, the call must be refused with NotImplementedError and nothing computed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import cuflash
from cuflash import _philox, reference

from ._checks import (BF16, DTYPES, assert_fa_close, assert_forward_close, lowp_attention_backward, make_qkv,
                      poison_pool, to_numpy)

# name -> options of attention (alibi: "heads" or "batch_heads" draws slopes of that shape; sinks: True
# draws one logit per head)
FEATURES = {
    "window": dict(window_size=(37, 11)),
    "window_left_only": dict(window_size=(20, -1)),
    "window_right_only": dict(window_size=(-1, 5)),
    "window_zero": dict(window_size=(0, 0)),  # the diagonal key alone
    "causal_window": dict(causal=True, window_size=(45, -1)),
    "causal_top_left": dict(causal=True, alignment="top_left"),
    "window_top_left": dict(window_size=(16, 3), alignment="top_left"),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi="heads"),
    "alibi_per_batch": dict(alibi="batch_heads", causal=True),
    "sinks": dict(sinks=True),
    "sinks_causal": dict(sinks=True, causal=True),
    "dropout": dict(dropout_p=0.17),
    "dropout_causal": dict(dropout_p=0.5, causal=True),
    "everything": dict(causal=True, window_size=(40, -1), softcap=3.0, alibi="heads", sinks=True, dropout_p=0.1),
    "everything_top_left": dict(window_size=(30, 7), softcap=20.0, alibi="batch_heads", sinks=True, dropout_p=0.3,
                                alignment="top_left"),
}
# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim): both seqlen orders, GQA and MQA, odd head dims,
# tiles +- 1
FEATURE_SHAPES = [
    (2, 113, 203, 2, 2, 64),
    (1, 203, 113, 4, 2, 128),  # seqlen_q > seqlen_k: bottom-right rows before 90 see no key under causal
    (1, 65, 129, 4, 1, 40),
    (1, 130, 130, 2, 2, 256),
    (1, 1, 70, 2, 1, 32),
]


def make_options(xp, rng, batch, heads, spec: dict):
    """attention's keywords for ``spec``: slopes and sinks drawn fresh; a seed and offset for dropout."""
    options = {name: value for name, value in spec.items() if name not in ("alibi", "sinks", "causal")}
    if spec.get("alibi"):
        shape = (heads,) if spec["alibi"] == "heads" else (batch, heads)
        options["alibi_slopes"] = xp.asarray(rng.uniform(0.01, 0.5, shape).astype(np.float32))
    if spec.get("sinks"):
        options["sinks"] = xp.asarray((2 * rng.standard_normal(heads)).astype(np.float32))
    if spec.get("dropout_p"):
        options["seed"] = int(rng.integers(0, 2**64, dtype=np.uint64))
        options["offset"] = int(rng.integers(0, 2**32))
    return options


def reference_options(q, k, options: dict) -> dict:
    """The reference's keywords for attention's: the dropout mask materialized instead of seed and offset."""
    ref = {name: value for name, value in options.items() if name not in ("seed", "offset")}
    if options.get("dropout_p"):
        ref["dropout_mask"] = cuflash.dropout_mask(q.shape[0], q.shape[2], q.shape[1], k.shape[1], options["dropout_p"],
                                                   options["seed"], options["offset"])
    return ref


def check_features(xp, rng, shape, dtype, spec, backward=True, deterministic=False):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    causal = spec.get("causal", False)
    q, k, v = make_qkv(xp, rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype)
    options = make_options(xp, rng, batch, heads, spec)
    poison_pool(xp)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, **options)
    ref_options = reference_options(q, k, options)
    max_score = assert_forward_close(out, lse, q, k, v, causal, ref_options, dtype)
    if not backward:
        return
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(dtype))
    poison_pool(xp)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal, deterministic=deterministic, **options)
    refs = reference.attention_backward(dout, q, k, v, causal, **ref_options)
    lowps = lowp_attention_backward(dout, q, k, v, out, causal, None, dtype, **ref_options)
    # What the rounded out costs by itself: with a sink or dropout a row's P can stay below 1 with one key,
    # and dS = P (dP - delta) cancels; the low-precision math may round dP the way out was rounded and err
    # far less by luck (bfloat16, one key, a sink: dq 13% off from delta alone, the dtype math 0.6%).
    given_out = reference.attention_backward(dout, q, k, v, causal, **ref_options, out=out)
    names = ("dq", "dk", "dv", "dsinks")
    assert len(grads) == len(refs) == (4 if spec.get("sinks") else 3)
    for name, grad, ref, lowp, given in zip(names, grads, refs, lowps, given_out):
        assert type(grad) is type(q) and grad.shape == ref.shape, name
        assert grad.dtype == (np.float32 if name == "dsinks" else q.dtype), name
        # dsinks is float32 but sums rows of delta = rowsum(dout * out), out stored in dtype: it carries that
        # dtype's rounding, so the rule's rounding term is dtype's for it too
        inherent = float(np.abs(given - ref).max()) if ref.size else 0.0
        assert_fa_close(grad, ref, lowp, dtype, 3, name, max_score, inherent)


@pytest.mark.parametrize("spec", FEATURES.values(), ids=FEATURES.keys())
@pytest.mark.parametrize("shape", FEATURE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_features(xp, rng, shape, dtype, spec):
    check_features(xp, rng, shape, dtype, spec)


# The Hopper forward's consumers each walk only the key tiles their own 64 rows see (fwd_wgmma kSkipTiles): at
# head_dim 64 (192-row blocks of 128-key tiles) a warpgroup skips the tiles above its rows' diagonal and below a
# window's left side, and one whose rows are past the sequence or see no key (seqlen_q > seqlen_k, causal) walks
# the block's lowest tile alone; at 128 (128-row blocks) only rows past the sequence skip.
SKIPPING = {
    "window": dict(window_size=(100, 0)),
    "causal": dict(causal=True),
    "window_both_sides_sinks": dict(window_size=(150, 20), sinks=True),
    "causal_alibi": dict(causal=True, alibi="heads"),
}


@pytest.mark.parametrize("spec", SKIPPING.values(), ids=SKIPPING.keys())
@pytest.mark.parametrize("shape", [(1, 700, 700, 2, 2, 64), (1, 500, 300, 2, 1, 64), (1, 450, 800, 2, 2, 128)],
                         ids=str)
def test_warpgroups_skip_the_tiles_their_rows_do_not_see(xp, rng, shape, spec):
    check_features(xp, rng, shape, BF16, spec, backward=False)


@pytest.mark.parametrize("spec", [FEATURES["everything"], FEATURES["causal_window"]], ids=["everything", "causal_window"])
@pytest.mark.parametrize("shape", [(2, 113, 203, 2, 2, 64), (1, 130, 130, 2, 2, 256)], ids=str)
def test_features_deterministic_backward(xp, rng, shape, spec):
    # on sm_90 the Hopper kernel's ordered form (at 256 with its dQ staged in the step's Q and dO)
    check_features(xp, rng, shape, BF16, spec, deterministic=True)


@pytest.mark.parametrize("spec", [FEATURES["everything"], FEATURES["causal_window"]], ids=["everything", "causal_window"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_features_deterministic_backward_is_bitwise_reproducible(xp, rng, spec, head_dim):
    shape = (2, 150, 170, 4, 2, head_dim)
    q, k, v = make_qkv(xp, rng, shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], BF16)
    options = make_options(xp, rng, shape[0], shape[3], spec)
    causal = spec.get("causal", False)
    out, lse = cuflash.attention(q, k, v, causal, return_lse=True, **options)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(BF16))
    first = [to_numpy(g) for g in cuflash.attention_backward(dout, q, k, v, out, lse, causal, deterministic=True,
                                                                **options)]
    again = [to_numpy(g) for g in cuflash.attention_backward(dout, q, k, v, out, lse, causal, deterministic=True,
                                                                **options)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_rows_that_see_no_key_give_zero_output_and_the_sink_as_lse(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 40, 10, 2, 2, 32, np.float32)
    sinks = xp.asarray(np.array([0.5, -1.5], np.float32))
    out, lse = cuflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert np.all(out[:, :30] == 0)
    np.testing.assert_array_equal(lse[:, :, :30], np.broadcast_to(np.array([0.5, -1.5], np.float32)[:, None], (1, 2, 30)))


def test_no_keys_with_sinks(xp, rng):
    q, k, v = make_qkv(xp, rng, 1, 5, 0, 2, 2, 16, np.float16)
    sinks = xp.asarray(np.array([0.25, 3.0], np.float32))
    out, lse = cuflash.attention(q, k, v, sinks=sinks, return_lse=True)
    assert np.all(to_numpy(out) == 0)
    np.testing.assert_array_equal(to_numpy(lse), np.broadcast_to(np.array([0.25, 3.0], np.float32)[:, None], (1, 2, 5)))
    grads = cuflash.attention_backward(out, q, k, v, out, lse, sinks=sinks)
    assert len(grads) == 4 and np.all(to_numpy(grads[3]) == 0)


def test_window_equals_a_causal_mask_where_they_agree(rng):
    # window (-1, 0) is causal; (seqlen_k, seqlen_k) sees everything
    q, k, v = make_qkv(np, rng, 1, 50, 70, 2, 1, 32, np.float32)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, window_size=(-1, 0)), cuflash.attention(q, k, v, True))
    np.testing.assert_array_equal(cuflash.attention(q, k, v, window_size=(70, 70)), cuflash.attention(q, k, v))


def test_alignment_only_moves_the_diagonal(rng):
    # top-left alignment of (sq, sk) is bottom-right alignment with the keys' diagonal shifted: equal when sq == sk
    q, k, v = make_qkv(np, rng, 1, 64, 64, 2, 2, 32, np.float32)
    for options in (dict(causal=True), dict(window_size=(5, 9)), dict(alibi_slopes=np.float32([0.3, 0.1]))):
        np.testing.assert_array_equal(cuflash.attention(q, k, v, alignment="top_left", **options),
                                      cuflash.attention(q, k, v, **options))


# ----------------------------------------------------------------------------------------------------------
# Dropout: the mask, exactly


@pytest.mark.parametrize("rounds, cases", [
    (7, [((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
         ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
         ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
          (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A))]),
    (10, [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
          ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
          ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
           (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))])], ids=["7 rounds", "10 rounds"])
def test_philox_known_answers(rounds, cases):
    # Random123's known-answer vectors of Philox4x32-7 (the mask's) and -10 (kat_vectors)
    assert _philox.ROUNDS == 7
    for counter, key, want in cases:
        assert tuple(int(w) for w in _philox.philox4x32(counter, key, rounds)) == want


def test_dropout_mask_keeps_its_share_and_depends_on_every_key_part():
    m = cuflash.dropout_mask(2, 3, 200, 300, dropout_p=0.3, seed=12345, offset=6)
    assert m.shape == (2, 3, 200, 300) and m.dtype == bool
    assert abs(m.mean() - 0.7) < 0.005  # 360000 draws: 5 standard deviations
    assert (m == cuflash.dropout_mask(2, 3, 200, 300, dropout_p=0.3, seed=12345, offset=6)).all()
    for other in (cuflash.dropout_mask(2, 3, 200, 300, 0.3, 12346, 6), cuflash.dropout_mask(2, 3, 200, 300, 0.3, 12345, 7),
                  cuflash.dropout_mask(2, 3, 200, 300, 0.3, 12345 + 2**32, 6)):
        assert 0.35 < (m != other).mean() < 0.49  # independent masks differ in 2 * 0.3 * 0.7 of the elements
    # batch, head, row and column each move the bits: no two (b, h) planes and no two rows repeat
    flat = m.reshape(6, 200, 300)
    assert all((flat[i] != flat[j]).any() for i in range(6) for j in range(i))
    assert len({row.tobytes() for row in m[0, 0]}) == 200
    # a mask of a larger problem contains the smaller one (no dependence on the sequence lengths)
    assert (cuflash.dropout_mask(2, 3, 100, 150, 0.3, 12345, 6) == m[:, :, :100, :150]).all()


def test_dropout_mask_gives_each_thread_of_an_mma_tile_one_call():
    # the sixteen elements a thread holds of a 16 x 32 accumulator block (rows g, g + 8; keys 2t, 2t + 1,
    # 2t + 8, 2t + 9 and each + 16) share one Philox call, and no other element reads that call: the kernels
    # draw once per sixteen elements
    rows, cols = np.meshgrid(np.arange(16, 48), np.arange(32, 96), indexing="ij")
    calls = ((cols >> 5) * 4 + ((cols >> 1) & 3)) * 2**20 + (rows >> 4) * 8 + (rows & 7)
    for g in range(8):
        for t in range(4):
            thread_rows = 16 + np.array([g, g + 8])[:, None]
            thread_cols = 32 + (np.array([2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9])[:, None] + [0, 16]).ravel()[None, :]
            mine = calls[thread_rows - 16, thread_cols - 32]
            assert len(np.unique(mine)) == 1 and (calls[:16, :32] == mine.flat[0]).sum() == 16
    assert len(np.unique(calls)) == calls.size // 16
    # and within the call each of the sixteen reads its own 8 bits: byte 2 * (key bit 4) + (key bit 0) of word
    # 2 * (key bit 3) + (row bit 3); the element flips from kept to dropped between that draw and the next
    words = _philox.philox4x32((1, 3, 7, 11), (1, 1))  # keys 2, 3, 10, 11, 18, 19, 26, 27 of rows 3, 11; bh 7, offset 11
    for i in (3, 11):
        for j in (2, 3, 10, 11, 18, 19, 26, 27):
            draw = int(words[2 * ((j >> 3) & 1) + (i >> 3)]) >> (8 * (2 * ((j >> 4) & 1) + (j & 1))) & 0xFF
            assert _philox.keep(2**32 + 1, 11, 7, i, j, draw / 2**8)
            assert draw == 255 or not _philox.keep(2**32 + 1, 11, 7, i, j, (draw + 1) / 2**8)


def test_dropout_threshold_is_dropout_p_in_256ths():
    # the dropped share is dropout_p rounded to the nearest 1/256 (halves up), never all: a draw of 255 is kept
    assert [_philox.keep_threshold(p) for p in (0.0, 0.1, 0.5, 1.5 / 256, 1.49 / 256, 0.999)] == [0, 26, 128, 2, 1, 255]
    # and the mask drops that share: 64.49 / 256 drops 64 / 256 = 0.25 of the elements, not 0.2519 (4M draws:
    # the two are 7.6 standard deviations apart)
    dropped = ~cuflash.dropout_mask(1, 1, 2048, 2048, dropout_p=64.49 / 256, seed=3)
    assert abs(dropped.mean() - 0.25) < 5 * np.sqrt(0.25 * 0.75 / dropped.size)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_dropout_is_exact_against_the_materialized_mask(xp, rng, dtype):
    # one flipped bit of the mask moves a row's out by its probability times 1 / (1 - p) times v: the bit of
    # the row's largest probability is flipped, which moves out far past the kernels' rounding (float32
    # 1e-6, float16 about 5e-4), and the gradients with it
    q, k, v = make_qkv(xp, rng, 1, 60, 50, 2, 2, 16, dtype)
    options = dict(dropout_p=0.25, seed=2**40 + 99, offset=3)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    mask = cuflash.dropout_mask(1, 2, 60, 50, 0.25, 2**40 + 99, 3)
    ref_options = dict(dropout_p=0.25, dropout_mask=mask)
    ref, _ = reference.attention(q, k, v, **ref_options)
    ref_grads = reference.attention_backward(dout, q, k, v, **ref_options)
    scores = np.einsum("id,jd->ij", to_numpy(q)[0, :, 1].astype(np.float64), to_numpy(k)[0, :, 1].astype(np.float64))
    flipped = mask.copy()
    flipped[0, 1, 17, np.argmax(scores[17])] ^= True
    wrong, _ = reference.attention(q, k, v, dropout_p=0.25, dropout_mask=flipped)
    wrong_grads = reference.attention_backward(dout, q, k, v, dropout_p=0.25, dropout_mask=flipped)
    tol = 1e-5 if dtype == np.float32 else 4e-3
    for name, got, want, off in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads),
                                    (wrong, *wrong_grads)):
        assert np.abs(to_numpy(got).astype(np.float64) - want).max() < tol, name
        assert np.abs(off - want).max() > 3 * tol, name  # the flipped bit shows


# ----------------------------------------------------------------------------------------------------------
# The reference's derivatives: central differences in float64


@pytest.mark.parametrize("spec", [FEATURES["everything"], FEATURES["everything_top_left"], FEATURES["softcap"],
                                  FEATURES["window_right_only"]], ids=["everything", "everything_top_left", "softcap",
                                                                       "window"])
def test_reference_gradients_match_finite_differences(rng, spec):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = 2, 9, 13, 4, 2, 5
    q, k, v = (rng.standard_normal(s) for s in ((batch, seqlen_q, heads, head_dim),
                                                (batch, seqlen_k, heads_kv, head_dim), (batch, seqlen_k, heads_kv, head_dim)))
    dout = rng.standard_normal(q.shape)
    causal = spec.get("causal", False)
    options = reference_options(q, k, make_options(np, rng, batch, heads, spec))
    sinks = options.get("sinks")

    def loss(q_, k_, v_, sinks_):
        opts = dict(options, sinks=sinks_) if sinks is not None else options
        return float((reference.attention(q_, k_, v_, causal, 0.7, **opts)[0] * dout).sum())

    grads = reference.attention_backward(dout, q, k, v, causal, 0.7, **options)
    arrays = [q, k, v] + ([sinks.astype(np.float64)] if sinks is not None else [])
    eps = 1e-6
    for which, (x, grad) in enumerate(zip(arrays, grads)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            pad = [None] * (4 - len(arrays))
            numeric[idx] = (loss(*plus, *pad) - loss(*minus, *pad)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, atol=1e-6, rtol=1e-5, err_msg=f"gradient {which}")


# ----------------------------------------------------------------------------------------------------------
# Fuzzed: every option at once, drawn

feature_draws = st.fixed_dictionaries({
    "causal": st.booleans(),
    "window_size": st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 150), st.integers(-1, 150))),
    "softcap": st.sampled_from([0.0, 0.0, 1.5, 30.0]),
    "alibi": st.sampled_from([None, None, "heads", "batch_heads"]),
    "sinks": st.booleans(),
    "dropout_p": st.sampled_from([0.0, 0.0, 0.1, 0.6]),
    "alignment": st.sampled_from(["bottom_right", "top_left"]),
})


@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 160), st.integers(1, 160),
                       st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]), st.integers(1, 256)),
       dtype=st.sampled_from(DTYPES), spec=feature_draws, seed=st.integers(0, 2**32 - 1))
@example(shape=(1, 1, 1, (1, 1), 1), dtype=DTYPES[0],
         spec=dict(causal=True, window_size=(0, 0), softcap=1.5, alibi="heads", sinks=True, dropout_p=0.6,
                   alignment="top_left"), seed=0)
@example(shape=(1, 1, 2, (2, 2), 1), dtype=BF16,  # one key and a sink: dS cancels (check_features' inherent)
         spec=dict(causal=True, window_size=(-1, -1), softcap=0.0, alibi=None, sinks=True, dropout_p=0.1,
                   alignment="top_left"), seed=7)
def test_fuzzed_features(xp, shape, dtype, spec, seed):
    batch, seqlen_q, seqlen_k, (heads, heads_kv), head_dim = shape
    check_features(xp, np.random.default_rng(seed), (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim), dtype,
                   spec)
