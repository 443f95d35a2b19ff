"""FlashAttention-2's own test grid, as data: the parameters of each test function of its tests/test_flash_attn.py
(v2.8), the cases it skips itself, how each case maps onto a cuflash call or why it cannot, and a runner that
checks a case's cuflash call against the float64 reference with FlashAttention's tolerance rule.

Shapes follow the FlashAttention tests (batch, heads, GQA counts, windows drawn below seqlen_k, ALiBi slopes of
(batch, heads) in [0, 0.3), q scaled by the softcap, padded sequences 0-20 shorter than the longest). The checks
are cuflash's: out and lse within twice the error of the same math in the inputs' dtype, the gradients within
three times, deterministic backwards and repeated calls bitwise equal.

``python -m tests.fa_grid`` counts the cases per test function and what cuflash cannot run;
``python -m tests.fa_grid --sample N [--test NAME] [--numpy]`` runs N cases drawn from the runnable ones.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import numpy as np

HALF = ("float16", "bfloat16")
BOOL = (False, True)
DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
CAUSAL_PAIRS = ((1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211), (108, 256),
                (256, 512), (1023, 1024))
OUTPUT_PAIRS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
                (1024, 1023), (2048, 2048))

#: test function -> (its parameters: name -> values, in its parametrize order; the call cuflash makes: "dense",
#: "varlen", "kvcache", "bounds" or "generator")
GRID = {
    "test_flash_attn_qkvpacked": (dict(
        dtype=HALF, deterministic=BOOL, alibi=BOOL, local=BOOL, causal=BOOL, d=DIMS,
        seqlen=(97, 128, 200, 384, 768, 1024, 1025, 2048), dropout_p=(0.0, 0.17)), "dense"),
    "test_flash_attn_varlen_qkvpacked": (dict(
        dtype=HALF, deterministic=BOOL, alibi=BOOL, local=BOOL, causal=BOOL,
        d=(32, 59, 64, 80, 96, 128, 160, 192, 224, 256), seqlen=(97, 128, 200, 257, 384, 512, 768, 1025, 2048),
        dropout_p=(0.0, 0.17)), "varlen"),
    "test_flash_attn_output": (dict(
        kvpacked=BOOL, dtype=HALF, mha_type=("mha", "mqa", "gqa"), deterministic=BOOL, alibi=BOOL, local=BOOL,
        causal=BOOL, d=(32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256), seqlens=OUTPUT_PAIRS,
        dropout_p=(0.0, 0.17), softcap=(0.0, 50.0)), "dense"),
    "test_flash_attn_varlen_output": (dict(
        kvpacked=BOOL, dtype=HALF, mha_type=("mha", "mqa", "gqa"), deterministic=BOOL, alibi=BOOL, local=BOOL,
        causal=BOOL, d=(32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256), seqlens=((1, 147),) + OUTPUT_PAIRS,
        dropout_p=(0.0, 0.17), softcap=(0.0, 50.0)), "varlen"),
    "test_flash_attn_causal": (dict(dtype=HALF, local=BOOL, d=DIMS, swap_sq_sk=BOOL, seqlens=CAUSAL_PAIRS), "dense"),
    "test_flash_attn_varlen_causal": (dict(
        dtype=HALF, local=BOOL, d=DIMS, swap_sq_sk=BOOL, seqlens=CAUSAL_PAIRS, paged_kv_block_size=(None, 256, 512)),
        "varlen"),
    "test_flash_attn_splitkv": (dict(
        dtype=HALF, deterministic=BOOL, alibi=BOOL, local=BOOL, causal=BOOL, d=DIMS, swap_sq_sk=BOOL,
        seqlens=((3, 1024), (1, 339), (64, 800), (3, 799), (64, 2048), (16, 20000), (16, 100000), (128, 128),
                 (256, 256))), "dense"),
    "test_flash_attn_kvcache": (dict(
        dtype=("float16",), num_splits=(1, 0), mha_type=("mha", "mqa", "gqa"), new_kv=BOOL, alibi=BOOL, local=BOOL,
        causal=BOOL, seqlen_new_eq_seqlen_q=BOOL, rotary_interleaved=BOOL, rotary_fraction=(0.0, 0.5, 1.0),
        paged_kv_block_size=(None, 256), has_leftpad=BOOL, has_batch_idx=(False,), d=(32, 59, 64, 80, 128, 256),
        seqlens=((1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
                 (1, 128 * 1024), (16, 128 * 1024), (128, 128))), "kvcache"),
    "test_flash_attn_race_condition": (dict(
        dtype=("float16",), causal=BOOL, d=DIMS,
        seqlens=((1, 239), (239, 1), (3, 799), (799, 3), (1024, 128), (97, 97), (128, 128), (200, 200), (256, 256),
                 (257, 257), (384, 384), (512, 512), (768, 768), (1024, 1024)), dropout_p=(0.0, 0.17)), "dense"),
    "test_flash_attn_bwd_overflow": (dict(dtype=("float16",), causal=BOOL, d=(16, 32, 64), seqlen=(1, 2, 5, 17, 128)),
                                     "dense"),
    "test_flash_attn_bwd_transpose": (dict(dtype=HALF, causal=BOOL, d=(64, 128), seqlen=(97, 128, 200, 256)), "dense"),
    "test_flash_attn_bwd_varlen_overflow": (dict(dtype=("float16",), causal=BOOL, d=(16, 32, 64)), "varlen"),
    "test_flash_attn_deterministic": (dict(dtype=HALF, local=BOOL, causal=BOOL, d=DIMS, swap_sq_sk=BOOL,
                                           seqlens=CAUSAL_PAIRS), "dense"),
    "test_flash_attn_varlen_deterministic": (dict(dtype=HALF, local=BOOL, causal=BOOL, d=DIMS, swap_sq_sk=BOOL,
                                                  seqlens=CAUSAL_PAIRS), "varlen"),
    "test_flash_attn_varlen_paged_kv_num_splits": (dict(dtype=HALF), "varlen"),
    "test_flash_attn_kvcache_paged_block_table_bounds": (dict(dtype=("float16",), paged_kv_block_size=(256,),
                                                              append_knew=BOOL), "bounds"),
    "test_flash_attn_generator_arg_must_be_none": ({}, "generator"),
}


def cases(test: str):
    """Every case of ``test``: a dict of its parameters (``seqlens`` as (seqlen_q, seqlen_k))."""
    params, _ = GRID[test]
    for values in itertools.product(*params.values()):
        yield dict(zip(params, values))


def skipped_by_flashattention(test: str, case: dict) -> bool:
    """The cases FlashAttention's test skips itself on a large GPU (besides its reference's memory on small ones)."""
    if test in ("test_flash_attn_output", "test_flash_attn_varlen_output"):
        return case["softcap"] > 0 and case["dropout_p"] > 0   # "Softcap and dropout not supported together"
    if test == "test_flash_attn_kvcache":
        seqlen_q, seqlen_k = case["seqlens"]
        return ((seqlen_q > seqlen_k and case["new_kv"]) or (not case["new_kv"] and case["rotary_fraction"] > 0)
                or (case["has_leftpad"] and case["paged_kv_block_size"] is not None))
    return False


def unsupported(test: str, case: dict) -> str | None:
    """Why cuflash cannot run the case (None: it can)."""
    kind = GRID[test][1]
    if kind == "generator":
        return "a torch.Generator argument (PyTorch's API)"
    if test.endswith("paged_kv_num_splits"):
        return "num_splits of the packed forward (FlashAttention's internal _flash_attn_varlen_forward)"
    return None


def counts() -> dict:
    """Per test: (cases, skipped by FlashAttention itself, runnable by cuflash, {reason: cases})."""
    table = {}
    for test in GRID:
        total = skipped = runnable = 0
        reasons: dict = {}
        for case in cases(test):
            total += 1
            if skipped_by_flashattention(test, case):
                skipped += 1
                continue
            why = unsupported(test, case)
            if why is None:
                runnable += 1
            else:
                reasons[why] = reasons.get(why, 0) + 1
        table[test] = (total, skipped, runnable, reasons)
    return table


# --- running a case ---------------------------------------------------------------------------------------------

def _dims(test: str, case: dict) -> tuple[int, int, int, int, int]:
    """(batch, seqlen_q, seqlen_k, heads, heads_kv) as FlashAttention's test makes them."""
    if "seqlens" in case:
        seqlen_q, seqlen_k = case["seqlens"]
        if case.get("swap_sq_sk"):
            seqlen_q, seqlen_k = seqlen_k, seqlen_q
    else:
        seqlen_q = seqlen_k = case.get("seqlen", 128)
    batch, heads = {"test_flash_attn_qkvpacked": (4, 9), "test_flash_attn_varlen_qkvpacked": (5, 6),
                    "test_flash_attn_causal": (8, 9), "test_flash_attn_varlen_causal": (8, 9),
                    "test_flash_attn_splitkv": (1, 12), "test_flash_attn_kvcache": (2, 6),
                    "test_flash_attn_race_condition": (60, 4), "test_flash_attn_bwd_overflow": (2, 5),
                    "test_flash_attn_bwd_transpose": (5, 2), "test_flash_attn_bwd_varlen_overflow": (2, 5),
                    "test_flash_attn_deterministic": (4, 9), "test_flash_attn_varlen_deterministic": (2, 9),
                    }.get(test, (4, 6 if case.get("softcap", 0.0) == 0.0 else 4))
    if test == "test_flash_attn_bwd_varlen_overflow":
        seqlen_q, seqlen_k = 3, 3
    group = {"mha": 1, "mqa": heads, "gqa": heads // (3 if test == "test_flash_attn_kvcache" else 2)}
    return batch, seqlen_q, seqlen_k, heads, heads // group[case.get("mha_type", "mha")]


def _options(xp, rng, test: str, case: dict, batch: int, heads: int, seqlen_k: int) -> dict:
    causal = case.get("causal", test in ("test_flash_attn_causal", "test_flash_attn_varlen_causal"))
    options = dict(causal=causal)
    if case.get("local"):
        options["window_size"] = tuple(int(x) for x in rng.integers(0, seqlen_k, 2))
    if case.get("alibi"):
        options["alibi_slopes"] = xp.asarray((rng.random((batch, heads)) * 0.3).astype(np.float32))
    if case.get("softcap"):
        options["softcap"] = case["softcap"]
    if case.get("dropout_p"):
        options.update(dropout_p=case["dropout_p"], seed=int(rng.integers(1 << 31)), offset=0)
    return options


def _reference_options(options: dict, q_shape: tuple, seqlen_k: int) -> dict:
    import cuflash

    ref = {k: v for k, v in options.items() if k not in ("causal", "seed", "offset")}
    if options.get("dropout_p"):
        batch, seqlen_q, heads, _ = q_shape
        ref["dropout_mask"] = cuflash.dropout_mask(batch, heads, seqlen_q, seqlen_k, options["dropout_p"],
                                                   options["seed"], options["offset"])
    return ref


def run_case(test: str, case: dict, xp, rng) -> None:
    """Run one runnable case with cuflash on ``xp`` (numpy or cupy); AssertionError where it fails."""
    kind = GRID[test][1]
    if kind == "dense":
        _run_dense(test, case, xp, rng)
    elif kind == "varlen":
        _run_varlen(test, case, xp, rng)
    elif kind == "kvcache":
        _run_kvcache(case, xp, rng)
    elif kind == "bounds":
        _run_bounds(case, xp, rng)
    else:
        raise ValueError(f"{test} has no cuflash call")


def _draw(xp, rng, shape, dtype, scale: float = 1.0):
    return xp.asarray((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtype))


def _dtype(case: dict) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if case["dtype"] == "bfloat16" else np.dtype(np.float16)


def _check_forward_backward(xp, rng, q, k, v, options, dtype, deterministic, backward=True):
    import cuflash
    from cuflash import reference

    from ._checks import assert_fa_close, assert_forward_close, lowp_attention_backward

    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    causal = options["causal"]
    ref_options = _reference_options(options, tuple(q.shape), k.shape[1])
    max_score = assert_forward_close(out, lse, q, k, v, causal, ref_options, dtype)
    if not backward:
        return out, lse, None
    dout = _draw(xp, rng, q.shape, dtype)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    refs = reference.attention_backward(dout, q, k, v, causal, **ref_options)
    lowps = lowp_attention_backward(dout, q, k, v, out, causal, None, dtype, **ref_options)
    given = reference.attention_backward(dout, q, k, v, causal, **ref_options, out=out)
    for name, grad, ref, lowp, g in zip(("dq", "dk", "dv"), grads, refs, lowps, given):
        assert_fa_close(grad, ref, lowp, dtype, 3, name, max_score, float(np.abs(g - ref).max()) if ref.size else 0.0)
    if deterministic:   # FlashAttention's deterministic tests: a second backward gives the same bits
        again = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
        for name, first, second in zip(("dq", "dk", "dv"), grads, again):
            assert bool((first == second).all()), f"{name} differs between two deterministic backwards"
    return out, lse, dout


def _run_dense(test: str, case: dict, xp, rng):
    import cuflash

    batch, seqlen_q, seqlen_k, heads, heads_kv = _dims(test, case)
    d, dtype = case["d"], _dtype(case)
    q = _draw(xp, rng, (batch, seqlen_q, heads, d), dtype, case.get("softcap") or 1.0)
    k, v = (_draw(xp, rng, (batch, seqlen_k, heads_kv, d), dtype) for _ in range(2))
    options = _options(xp, rng, test, case, batch, heads, seqlen_k)
    deterministic = case.get("deterministic", test == "test_flash_attn_deterministic")
    out, lse, _ = _check_forward_backward(xp, rng, q, k, v, options, dtype, deterministic)
    if test == "test_flash_attn_race_condition":   # repeated calls give the same bits
        for _ in range(2):
            again, again_lse = cuflash.attention(q, k, v, return_lse=True, **options)
            assert bool((again == out).all()) and bool((again_lse == lse).all()), "a repeated forward differs"


def _lengths(rng, longest: int, batch: int) -> np.ndarray:
    """Sequence lengths as FlashAttention's random padding mask makes them: each in [longest - 20, longest]."""
    return rng.integers(max(1, longest - 20), longest + 1, batch)


def _run_varlen(test: str, case: dict, xp, rng):
    import cuflash
    from cuflash import reference

    from ._checks import assert_fa_close, max_abs_finite

    batch, seqlen_q, seqlen_k, heads, heads_kv = _dims(test, case)
    d, dtype = case.get("d", 64), _dtype(case)
    lengths_q, lengths_k = _lengths(rng, seqlen_q, batch), _lengths(rng, seqlen_k, batch)
    if test == "test_flash_attn_varlen_qkvpacked":
        lengths_k = lengths_q
    cu_q, cu_k = (xp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    q = _draw(xp, rng, (int(lengths_q.sum()), heads, d), dtype, case.get("softcap") or 1.0)
    k, v = (_draw(xp, rng, (int(lengths_k.sum()), heads_kv, d), dtype) for _ in range(2))
    options = _options(xp, rng, test, case, batch, heads, seqlen_k)
    deterministic = case.get("deterministic", test == "test_flash_attn_varlen_deterministic")
    if case.get("paged_kv_block_size"):   # paged keys: the forward (as FlashAttention tests it)
        from ._checks import packed_pages

        caches, table = packed_pages(xp, rng, k, v, lengths_k.tolist(), case["paged_kv_block_size"])
        out, lse = cuflash.attention_varlen(q, *caches, cu_q, cu_k, return_lse=True, block_table=table,
                                            check_indices=True, **options)
    else:
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    ref_options = {name: value for name, value in options.items() if name not in ("seed", "offset")}
    if options.get("dropout_p"):
        ref_options["dropout_mask"] = cuflash.dropout_mask(batch, heads, int(lengths_q.max()), int(lengths_k.max()),
                                                           options["dropout_p"], options["seed"], options["offset"])
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **ref_options)
    low_out, low_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **ref_options, in_dtype=dtype)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, low_out, dtype, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, low_lse, np.float32, 2, "lse", max_score)
    if case.get("paged_kv_block_size"):
        return
    dout = _draw(xp, rng, q.shape, dtype)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, deterministic=deterministic,
                                              **options)
    refs = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_options)
    lows = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_options, in_dtype=dtype, out=out)
    given = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_options, out=out)
    for name, grad, ref, low, g in zip(("dq", "dk", "dv"), grads, refs, lows, given):
        assert_fa_close(grad, ref, low, dtype, 3, name, max_score, float(np.abs(g - ref).max()) if ref.size else 0.0)
    if deterministic:
        again = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, deterministic=True, **options)
        for name, first, second in zip(("dq", "dk", "dv"), grads, again):
            assert bool((first == second).all()), f"{name} differs between two deterministic backwards"


def _run_kvcache(case: dict, xp, rng):
    import cuflash
    from cuflash import reference

    from ._checks import assert_fa_close, max_abs_finite, paged_copies, to_numpy

    test = "test_flash_attn_kvcache"
    batch, seqlen_q, seqlen_k, heads, heads_kv = _dims(test, case)
    d, dtype = case["d"], _dtype(case)
    rotary_dim = math.floor(int(case["rotary_fraction"] * d) / 16) * 16
    seqlen_new = seqlen_q if case["seqlen_new_eq_seqlen_q"] else int(rng.integers(1, seqlen_q + 1))
    q = _draw(xp, rng, (batch, seqlen_q, heads, d), dtype)
    new = {}
    if case["new_kv"]:
        new = dict(k=_draw(xp, rng, (batch, seqlen_new, heads_kv, d), dtype),
                   v=_draw(xp, rng, (batch, seqlen_new, heads_kv, d), dtype))
    caches = [_draw(xp, rng, (batch, seqlen_k, heads_kv, d), dtype) for _ in range(2)]
    options = _options(xp, rng, test, case, batch, heads, seqlen_k)
    masked = options["causal"] or "window_size" in options
    room = (seqlen_k - (seqlen_q if masked and rotary_dim > 1 else seqlen_new) + 1) if case["new_kv"] else seqlen_k + 1
    lengths = rng.integers(0 if case["new_kv"] else 1, room, batch).astype(np.int32)
    if case["has_leftpad"]:   # each sequence's first key below its length, as FlashAttention draws it
        new["cache_leftpad"] = np.array([rng.integers(0, n) if n else 0 for n in lengths], np.int32)
    if rotary_dim:
        angles = rng.random((seqlen_k, rotary_dim // 2)) * 2 * np.pi
        new.update(rotary_cos=xp.asarray(np.cos(angles).astype(np.float32)),
                   rotary_sin=xp.asarray(np.sin(angles).astype(np.float32)),
                   rotary_interleaved=case["rotary_interleaved"])
    host = {name: to_numpy(value) if hasattr(value, "shape") else value for name, value in {**new, **options}.items()}
    if "cache_leftpad" in new:
        new["cache_leftpad"] = xp.asarray(new["cache_leftpad"])
    ref_args = (to_numpy(q), *(to_numpy(c) for c in caches))
    ref_out, ref_lse = reference.attention_with_kvcache(*ref_args, cache_seqlens=lengths, **host)
    low_out, low_lse = reference.attention_with_kvcache(*ref_args, cache_seqlens=lengths, **host, in_dtype=dtype)
    table = None
    if case["paged_kv_block_size"] is not None:
        caches, table = paged_copies(xp, rng, caches, case["paged_kv_block_size"])
    out, lse = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=xp.asarray(lengths), block_table=table,
                                              num_splits=case["num_splits"], return_lse=True, **new, **options)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, low_out, dtype, 2, "out", max_score)
    assert_fa_close(lse, ref_lse, low_lse, np.float32, 2, "lse", max_score)


def _run_bounds(case: dict, xp, rng):
    """A paged cache of one page per sequence: lengths past it, or a full one with a key appended, are refused
    (cuflash: with check_indices; FlashAttention checks always); a full cache without an append is not."""
    import cuflash
    import pytest

    page_size, d = case["paged_kv_block_size"], 64
    caches = [_draw(xp, rng, (4, page_size, 1, d), np.float16) for _ in range(2)]
    table = xp.asarray(np.zeros((1, 1), np.int32))
    q = _draw(xp, rng, (1, 1, 1, d), np.float16)
    new = dict(k=_draw(xp, rng, (1, 1, 1, d), np.float16), v=_draw(xp, rng, (1, 1, 1, d), np.float16)) \
        if case["append_knew"] else {}
    past = page_size if new else page_size + 1
    with pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(q, *caches, cache_seqlens=xp.asarray(np.array([past], np.int32)),
                                       block_table=table, check_indices=True, **new)
    out = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=xp.asarray(np.array([page_size], np.int32)),
                                         block_table=table, check_indices=True)
    assert out.shape == (1, 1, 1, d) and not bool(xp.isnan(out.astype(np.float32)).any())


def runnable(test: str | None = None) -> list[tuple[str, dict]]:
    """Every (test, case) cuflash can run (of ``test``, or of every test)."""
    return [(t, case) for t in ([test] if test else GRID) for case in cases(t)
            if not skipped_by_flashattention(t, case) and unsupported(t, case) is None]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fa_grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=0, metavar="N", help="run N cases drawn from the runnable ones")
    parser.add_argument("--test", default=None, choices=list(GRID), help="draw from this test function only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--numpy", action="store_true", help="run on the NumPy path (default: CuPy)")
    args = parser.parse_args(argv)
    if not args.sample:
        grand = [0, 0, 0]
        for test, (total, skipped, ran, reasons) in counts().items():
            grand = [grand[0] + total, grand[1] + skipped, grand[2] + ran]
            why = "; ".join(f"{n}: {reason}" for reason, n in reasons.items())
            print(f"{test}: {total} cases, {skipped} skipped by FlashAttention, {ran} run by cuflash"
                  + (f" (not: {why})" if why else ""))
        print(f"all: {grand[0]} cases, {grand[1]} skipped by FlashAttention, {grand[2]} run by cuflash "
              f"({grand[2] / (grand[0] - grand[1]):.3%} of those it runs)")
        return 0
    if args.numpy:
        xp = np
    else:
        import cupy as xp
    pool = runnable(args.test)
    rng = np.random.default_rng(args.seed)
    failed = 0
    for index in rng.choice(len(pool), size=min(args.sample, len(pool)), replace=False):
        test, case = pool[index]
        try:
            run_case(test, case, xp, np.random.default_rng([args.seed, int(index)]))
            status = "ok"
        except AssertionError as error:
            status = f"FAILED {str(error).splitlines()[0]}"
        failed += status != "ok"
        print(f"{test} {case}: {status}", flush=True)
    print(f"{args.sample - failed if args.sample <= len(pool) else len(pool) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
