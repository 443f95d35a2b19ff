"""Small calls of every kernel family, for compute-sanitizer: each case runs once and checks that its outputs
hold no NaN, so that memcheck, racecheck, initcheck and synccheck see every kernel on awkward shapes (lengths
off the tiles, GQA, masks, modifiers, packed batches, pages).

    PYTHONPATH=. compute-sanitizer --tool memcheck --error-exitcode 2 python3 tools/sanitize.py [--only S ...]
    PYTHONPATH=. compute-sanitizer --tool racecheck python3 tools/sanitize.py --only hopper --lineinfo

``--list`` prints the cases; ``--numpy`` runs them on the NumPy path (a check of this script, no kernels).
Exit status 1 if a case raises or returns NaN (the sanitizer's findings are in its report and, with
``--error-exitcode``, its exit status).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

#: (name, call keywords): the families each case reaches on an H100/H200 (on other GPUs the mma.sync ones)
CASES = {
    "hopper-fwd-64-causal": dict(shape=(1, 130, 130, 4, 2, 64), causal=True),
    "hopper-fwd-128-window-softcap": dict(shape=(1, 200, 150, 2, 1, 128), window_size=(40, 7), softcap=20.0),
    "hopper-fwd-256-alibi-sinks": dict(shape=(2, 70, 300, 2, 2, 256), alibi=True, sinks=True),
    "hopper-bwd-64": dict(shape=(1, 150, 260, 4, 2, 64), backward=True),
    "hopper-bwd-128-causal": dict(shape=(1, 77, 300, 2, 2, 128), causal=True, backward=True),
    "hopper-bwd-256-window": dict(shape=(1, 300, 129, 2, 1, 232), window_size=(40, 7), backward=True),
    # the ordered dQ adds, a pair's key blocks side by side (_config.ordered_side_by_side): GQA, the causal
    # mask's upward walk, a window's first key blocks above 0, without a mask more key blocks than query tiles
    # (all start at tile 0) and fewer (each at its own, wrapping); at 256 from the staged Q and dO
    "hopper-bwd-64-ordered-causal": dict(shape=(2, 150, 300, 4, 2, 64), causal=True, backward=True,
                                         deterministic=True),
    "hopper-bwd-128-ordered-window": dict(shape=(1, 300, 400, 4, 2, 128), window_size=(100, 7), backward=True,
                                          deterministic=True),
    "hopper-bwd-256-ordered-causal": dict(shape=(2, 150, 300, 4, 2, 256), causal=True, backward=True,
                                          deterministic=True),
    "hopper-bwd-128-ordered-full": dict(shape=(2, 150, 700, 4, 2, 128), backward=True, deterministic=True),
    "hopper-bwd-256-ordered-full": dict(shape=(1, 400, 200, 2, 1, 256), backward=True, deterministic=True),
    # past the side-by-side limit (_config.pair_major_tiles: 16 key blocks at 128, 32 at 256), on the wave-sized
    # bands
    "hopper-bwd-256-ordered-causal-bands": dict(shape=(1, 2100, 2100, 2, 2, 256), causal=True, backward=True,
                                                deterministic=True),
    "hopper-bwd-128-ordered-window-bands": dict(shape=(2, 2200, 2200, 4, 2, 128), window_size=(300, 0),
                                                backward=True, deterministic=True),
    # the split grid, forced (the ordered form serves on sm_90, and these shapes are too small to choose it): 2
    # splits, a last pass with one idle
    "hopper-bwd-256-deterministic": dict(shape=(2, 150, 300, 4, 2, 256), backward=True, deterministic=True,
                                         dq_splits=2),
    # the float8 forward (its V^T transpose first), factors per (batch, kv head): key lengths off the transpose's
    # and the tiles' multiples
    "float8-fwd-64-causal": dict(shape=(2, 130, 200, 4, 2, 64), causal=True, float8=True),
    "float8-fwd-256-window-softcap-sinks": dict(shape=(1, 150, 260, 2, 1, 256), window_size=(40, 7), softcap=20.0,
                                                sinks=True, float8=True),
    "hopper-dropout-128-window": dict(shape=(1, 150, 260, 4, 2, 128), window_size=(50, 20), dropout=True,
                                      backward=True),
    "mma-dropout-32": dict(shape=(1, 100, 120, 2, 2, 32), causal=True, dropout=True, backward=True),
    "simt-float32-40": dict(shape=(1, 50, 70, 2, 1, 40), dtype="float32", backward=True),
    "varlen-128-causal": dict(shape=(0, 0, 0, 4, 2, 128), varlen=([17, 0, 40, 33], [23, 11, 40, 70]), causal=True),
    "kvcache-paged-128": dict(shape=(3, 1, 0, 8, 2, 128), kvcache=(500, 256)),
    # float8 e4m3 caches (uint8 bit patterns on CuPy), one factor per tensor: 16-byte copies, tiles converted to
    # float16 on chip
    "kvcache-float8-paged-128": dict(shape=(3, 2, 0, 8, 2, 128), kvcache=(500, 256), causal=True, float8=True),
    # a contiguous cache: 3 keys appended per sequence, rotated (half-split) with the queries, 5 key splits
    "kvcache-append-rotary-72": dict(shape=(3, 2, 0, 6, 3, 72), kvcache=(300, 0), causal=True, append=3, rotary=32,
                                     num_splits=5),
    # a left-padded contiguous cache: each sequence's keys from its own first row, rotary positions from there
    "kvcache-leftpad-rotary-64": dict(shape=(3, 2, 0, 8, 2, 64), kvcache=(300, 0), causal=True, append=2, rotary=64,
                                      leftpad=True),
    # ring attention on a local group of 3 (threads, one GPU): block calls at global offsets, the float32 merge
    # (merge_into) of parts into rows of the state and of the sinks, the backward's dk/dv sums around the ring
    "ring-3-zigzag-window-alibi-sinks": dict(shape=(2, 90, 90, 4, 2, 64), ring=3, causal=True, window_size=(40, -1),
                                             alibi=True, sinks=True, backward=True),
}


def run_case(xp, rng, spec: dict) -> list:
    import ml_dtypes

    import cuflash
    from cuflash import _config

    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = spec["shape"]
    dtype = np.dtype(ml_dtypes.bfloat16) if spec.get("dtype", "bfloat16") == "bfloat16" else np.dtype(np.float32)

    def draw(*shape):
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    options = dict(causal=spec.get("causal", False))
    if "window_size" in spec:
        options["window_size"] = spec["window_size"]
    if "softcap" in spec:
        options["softcap"] = spec["softcap"]
    if spec.get("alibi"):
        options["alibi_slopes"] = xp.asarray(rng.uniform(0.01, 0.3, heads).astype(np.float32))
    if spec.get("sinks"):
        options["sinks"] = xp.asarray(rng.standard_normal(heads).astype(np.float32))
    if "varlen" in spec:
        lengths_q, lengths_k = spec["varlen"]
        cu_q, cu_k = (xp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
        q, dout = draw(sum(lengths_q), heads, head_dim), draw(sum(lengths_q), heads, head_dim)
        k, v = draw(sum(lengths_k), heads_kv, head_dim), draw(sum(lengths_k), heads_kv, head_dim)
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
        return [out, lse, *cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)]
    if "kvcache" in spec:
        keys, page_size = spec["kvcache"]  # page_size 0: a contiguous cache
        appended = spec.get("append", 0)
        q = draw(batch, seqlen_q, heads, head_dim)
        new = dict(k=draw(batch, appended, heads_kv, head_dim), v=draw(batch, appended, heads_kv, head_dim)) \
            if appended else {}
        if "rotary" in spec:
            angles = np.arange(keys + appended)[:, None] * 0.01 * np.arange(1, spec["rotary"] // 2 + 1)[None, :]
            new.update(rotary_cos=xp.asarray(np.cos(angles).astype(np.float32)),
                       rotary_sin=xp.asarray(np.sin(angles).astype(np.float32)), rotary_interleaved=False)
        lengths = xp.asarray(np.array([keys, 1, keys // 2], np.int32)[:batch])
        if spec.get("leftpad"):
            new["cache_leftpad"] = xp.asarray(np.array([keys // 3, 0, keys // 2], np.int32)[:batch])
        if page_size:
            pages = -(-(keys + appended) // page_size)
            k_cache, v_cache = (draw(batch * pages + 1, page_size, heads_kv, head_dim) for _ in range(2))
            new["block_table"] = xp.asarray(
                rng.permutation(batch * pages + 1)[:batch * pages].reshape(batch, pages).astype(np.int32))
        else:
            k_cache, v_cache = (draw(batch, keys + appended, heads_kv, head_dim) for _ in range(2))
        if spec.get("float8"):  # one factor per tensor (a page holds no one sequence's keys)
            (q, q_descale), (k_cache, k_descale), (v_cache, v_descale) = (
                cuflash.quantize_fp8(x, "tensor") for x in (q, k_cache, v_cache))
            new.update(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return list(cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_lse=True,
                                                   num_splits=spec.get("num_splits", 0), **new, **options))
    q, dout = draw(batch, seqlen_q, heads, head_dim), draw(batch, seqlen_q, heads, head_dim)
    k, v = draw(batch, seqlen_k, heads_kv, head_dim), draw(batch, seqlen_k, heads_kv, head_dim)
    if "ring" in spec:
        from cuflash import distributed

        def rank_main(comm):
            shards = [distributed.shard_sequence(x, comm.rank, spec["ring"]) for x in (q, k, v, dout)]
            out, lse = distributed.ring_attention(*shards[:3], comm, return_lse=True, **options)
            return [out, lse, *distributed.ring_attention_backward(shards[3], *shards[:3], out, lse, comm, **options)]

        return [x for outputs in distributed.run_local(spec["ring"], rank_main) for x in outputs]
    if spec.get("float8"):  # forward only
        q8, k8, v8, q_descale, k_descale, v_descale = cuflash.quantize_qkv(q, k, v)
        return list(cuflash.attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                      return_lse=True, **options))
    if spec.get("dropout"):
        options.update(dropout_p=0.2, seed=7, offset=3)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    if not spec.get("backward"):
        return [out, lse]
    chosen, ordered = _config.deterministic_dq_splits, _config.ordered_dq_kernel
    if "dq_splits" in spec:
        _config.deterministic_dq_splits = lambda cfg, *_: spec["dq_splits"] if _config.split_grid_serves(cfg) else 0
        _config.ordered_dq_kernel = lambda cfg: None
        cuflash.clear_plans()
    try:
        return [out, lse, *cuflash.attention_backward(dout, q, k, v, out, lse,
                                                      deterministic=spec.get("deterministic", False), **options)]
    finally:
        _config.deterministic_dq_splits, _config.ordered_dq_kernel = chosen, ordered
        cuflash.clear_plans()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], metavar="SUBSTRING", help="cases whose name holds one")
    parser.add_argument("--list", action="store_true", help="print the case names and stop")
    parser.add_argument("--numpy", action="store_true", help="run the cases on the NumPy path (no GPU)")
    parser.add_argument("--lineinfo", action="store_true",
                        help="compile with -lineinfo: the reports name lines of _compile.kernel_source(file)")
    args = parser.parse_args(argv)
    if args.lineinfo:
        from cuflash import _compile

        _compile.COMMON_OPTIONS += ("-lineinfo",)
    names = [n for n in CASES if not args.only or any(s in n for s in args.only)]
    if args.list:
        print("\n".join(names))
        return 0
    if args.numpy:
        xp = np
    else:
        import cupy as xp

    failed = 0
    for name in names:
        try:
            outputs = run_case(xp, np.random.default_rng(0), CASES[name])
            # lse is -inf in rows that see no key; nothing may be NaN
            status = "NaN" if any(bool(xp.isnan(x.astype(np.float32)).any()) for x in outputs) else "ok"
        except Exception as exc:  # report and go on: the sanitizer's report says more
            status = f"raised {type(exc).__name__}: {exc}"
        failed += status != "ok"
        print(f"{name}: {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
