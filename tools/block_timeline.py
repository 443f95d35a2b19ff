"""Where the Hopper kernels spend their time: clock64 stamps per block (dK/dV) or per work item (forward), on the GPU.

``python tools/block_timeline.py [--pass bwd|fwd] [--head-dim 128] [--seqlens 512 1024 4096] [--causal]
[--window LEFT] [--dtype bfloat16] [--deterministic]`` copies the ``cuflash`` package into a temporary folder,
stamps the kernels there and runs one launch at FlashAttention's grid shape (batch * seqlen = 16384, heads *
head_dim = 2048), the last of three, L2 flushed before each. Times are in microseconds from the longest block's
cycle count over the launch's time; figures are medians with the 10th-90th percentiles.

- ``--pass bwd`` (default): ``bwd_dkdv_wgmma`` (kernels/bwd_wgmma.cu), the default backward's dK/dV launch,
  stamped at the block's entry, once its K and V have landed, after its last step and after its last dK/dV
  store. Per block: the prologue, the steps, the epilogue and the gap to the next block on the same SM
  (``%smid``); where the dQ writer runs (the ordered form, head_dim 256) its first warp's cycles waiting for the
  consumers' shares, on the ordered form's counts and for its adds to complete (the ordered form at 256 has two
  writer warps, one per stage: the figures are the even steps'; the consumers may run up to two steps ahead of
  the writer, so its waits are not all time lost to the block). The stamps travel in ``dq_order``, which the
  default form leaves null; ``--deterministic`` stamps the ordered form, whose counts come first in that buffer.
- ``--pass fwd``: ``fwd_wgmma`` (kernels/fwd_wgmma.cu), stamped by consumer warpgroup 0 when it takes an item,
  once the item's Q has landed, after its walk's last softmax (its last P V and epilogue run with the next
  item's first turn, or at the block's end). Per count of key tiles: the items' time from one take to the
  next take in the block, the wait for Q and the time from the walk's end to the next take; then a fit of
  the item's time to a fixed cost plus a cost per key tile. The stamps travel in ``out_partial``, which
  fwd_wgmma does not read.

Needs a GPU of compute capability 9.0. ``--check`` only stamps the sources and compiles one specialization of
each kernel with NVRTC (no GPU): tests/test_compile.py runs it, so that the stamps' places stay in the kernels.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKENS, WIDTH = 16384, 2048  # FlashAttention's grid: batch * seqlen, heads * head_dim
# int64 per block (bwd): smid, entry, K and V landed, last step done, consumer 0 and 1 done, steps; then the dQ
# writer's (lane 0 of producer warp 2) cycles waiting: for the consumers' shares, on the ordered form's counts, for
# its adds to complete before it counts (the ordered form; the writer serves the ordered form and head_dim 256)
STAMPS = 10
# int64 per item (fwd): smid, taken, Q landed, walk done, key tiles, block, the block's end (its last item's)
ITEM_STAMPS = 8
CHECK_SPECS = ("cuflash::bwd_dkdv_wgmma<__nv_bfloat16, 128, 0, 0, 64, 128, false, false>",
               "cuflash::bwd_dkdv_wgmma<__nv_bfloat16, 256, 1, 0, 64, 64, true, false>",   # the ordered form's writer
               "cuflash::fwd_wgmma<__nv_bfloat16, 128, 1, 0, 128, 128, false>")

# per kernel source, (text in the kernel, text that replaces it): each must occur exactly once
_BWD_STAMPS = [
    # the default form leaves dq_order null: the stamps take its place; the ordered form's counts come first,
    # as many as _plan.backward's order_ints, rounded up to a whole int64
    ("    const int warpgroup = threadIdx.x / 128, tid_wg = threadIdx.x % 128;\n",
     "    const long long counts = kOrdered ? static_cast<long long>(batch) * heads * DqAccum::rows(seqlen_q) *\n"
     "                                            HEAD_DIM / DqAccum::kShare : 0;\n"
     "    unsigned long long* const stamps = reinterpret_cast<unsigned long long*>(dq_order + (counts + 1) / 2 * 2) +\n"
     f"                                       {STAMPS} * (blockIdx.y * gridDim.x + blockIdx.x);\n"
     "    if (threadIdx.x == 0) {\n"
     "        unsigned smid;\n"
     "        asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "        stamps[0] = smid;\n"
     "        stamps[1] = clock64();\n"
     "        stamps[7] = steps;\n"
     "    }\n"
     "    const int warpgroup = threadIdx.x / 128, tid_wg = threadIdx.x % 128;\n"),
    ("    if (steps > 0) mbarrier_wait(kv_full, 0);\n",
     "    if (steps > 0) mbarrier_wait(kv_full, 0);\n"
     "    if (cw == 0 && tid_wg == 0) stamps[2] = clock64();\n"),
    ("    // Epilogue: dK times the softmax scale",
     "    if (cw == 0 && tid_wg == 0) stamps[3] = clock64();\n"
     "    // Epilogue: dK times the softmax scale"),
    ("\n}\n\n}  // namespace cuflash",
     "\n    if (tid_wg == 0) stamps[4 + cw] = clock64();\n}\n\n}  // namespace cuflash"),
    ("            const int lane = tid_wg % 32, consumer = kStagedDq ? lane / 4 % kConsumers : lane / 4;\n",
     "            const int lane = tid_wg % 32, consumer = kStagedDq ? lane / 4 % kConsumers : lane / 4;\n"
     "            long long shares_wait = 0, count_wait = 0, complete_wait = 0, t0 = 0;\n"),
    ("                for (int i = 0; i < kConsumers; ++i) named_barrier_sync(dq_full(i, s), kDqBarrierThreads);\n",
     "                t0 = clock64();\n"
     "                for (int i = 0; i < kConsumers; ++i) named_barrier_sync(dq_full(i, s), kDqBarrierThreads);\n"
     "                shares_wait += clock64() - t0;\n"),
    ("                        while (load_acquire_gpu(count) < before) {\n                        }\n",
     "                        t0 = clock64();\n"
     "                        while (load_acquire_gpu(count) < before) {\n                        }\n"
     "                        count_wait += clock64() - t0;\n"),
    ("                if (kOrdered && adds) {\n                    bulk_wait<0>();\n",
     "                if (kOrdered && adds) {\n"
     "                    t0 = clock64();\n"
     "                    bulk_wait<0>();\n"
     "                    complete_wait += clock64() - t0;\n"),
    ("            if (adds) bulk_wait<0>();   // the adds done before the block ends",
     "            if (tid_wg == 64) {   // lane 0 of warp 2, the first writer warp\n"
     "                stamps[6] = shares_wait;\n"
     "                stamps[8] = count_wait;\n"
     "                stamps[9] = complete_wait;\n"
     "            }\n"
     "            if (adds) bulk_wait<0>();   // the adds done before the block ends"),
]
_FWD_STAMPS = [
    ("    for (int handed = 0;; ++handed) {\n        const int slot = handed % 2;\n",
     "    unsigned long long* last_stamps = nullptr;   // the last item's\n"
     "    for (int handed = 0;; ++handed) {\n        const int slot = handed % 2;\n"),
    ("        const Item w = item(index);\n        if (w.idle()) continue;\n",
     "        const Item w = item(index);\n        if (w.idle()) continue;\n"
     "        unsigned long long* const stamps = reinterpret_cast<unsigned long long*>(out_partial) + 8 * index;\n"
     "        if (cw == 0 && tid_wg == 0) {\n"
     "            unsigned smid;\n"
     "            asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "            stamps[0] = smid;\n"
     "            stamps[1] = clock64();\n"
     "            stamps[4] = w.n_tiles;\n"
     "            stamps[5] = blockIdx.x;\n"
     "            last_stamps = stamps;\n"
     "        }\n"),
    ("        mbarrier_wait(q_full, q_uses & 1);\n",
     "        mbarrier_wait(q_full, q_uses & 1);\n"
     "        if (cw == 0 && tid_wg == 0) stamps[2] = clock64();\n"),
    ("        pending_rows = finish(w);\n",
     "        pending_rows = finish(w);\n"
     "        if (cw == 0 && tid_wg == 0) stamps[3] = clock64();\n"),
    ("    if (pending) flush();\n    if (kPingPong",
     "    if (pending) flush();\n"
     "    if (cw == 0 && tid_wg == 0 && last_stamps != nullptr) last_stamps[6] = clock64();\n    if (kPingPong"),
]
_STAMPS = {"bwd_wgmma.cu": _BWD_STAMPS, "fwd_wgmma.cu": _FWD_STAMPS}


def stamped_package(into: pathlib.Path, sources=tuple(_STAMPS)) -> pathlib.Path:
    """A copy of the cuflash package under ``into`` with the kernels of ``sources`` (names in _STAMPS) stamped;
    ValueError where a place moved. Stamp only the measured kernel: each writes its stamps through a pointer that
    only its own measurement fills, and a stamped kernel run by the other pass would write through null."""
    package = into / "cuflash"
    shutil.copytree(REPO / "cuflash", package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in sources:
        stamps = _STAMPS[name]
        source = package / "kernels" / name
        text = source.read_text()
        for place, stamped in stamps:
            if text.count(place) != 1:
                raise ValueError(f"{name} holds {text.count(place)} copies of the stamp's place {place!r}, not 1")
            text = text.replace(place, stamped)
        source.write_text(text)
    return into


def check() -> int:
    """Stamp and compile CHECK_SPECS with NVRTC; 0 where they compile."""
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, str(stamped_package(pathlib.Path(folder))))
        from cuflash import _compile, _config

        if not pathlib.Path(_compile.__file__).is_relative_to(folder):
            raise SystemExit(f"cuflash came from {_compile.__file__}, not the stamped copy")
        specs = [s for s in _config.all_specs(_config.H100) if s.name in CHECK_SPECS]
        if len(specs) != len(CHECK_SPECS):
            raise SystemExit(f"the H100 table lacks one of {CHECK_SPECS}")
        for report in (r for spec in specs for r in _compile.compile_offline([spec], "sm_90")):
            print(f"{report.spec.name}: stamped, {report.registers} registers, {report.spill_store_bytes} bytes "
                  "spilled")
        return 0


def percentiles(values) -> str:
    import numpy as np

    return f"{np.median(values):6.2f} [{np.percentile(values, 10):.2f}, {np.percentile(values, 90):.2f}]"


def stamped_launch(launch, stamps, flush, *buffers) -> tuple:
    """(microseconds, the stamps as int64) of the last of three calls of ``launch`` (no arguments), L2 flushed and
    ``stamps`` and ``buffers`` zeroed before each."""
    import cupy as cp
    import numpy as np

    for _ in range(3):
        flush.fill(0)
        for buffer in (stamps, *buffers):
            buffer.fill(0)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch()
        stop.record()
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1000, stamps.get().astype(np.int64)


def measure_backward(head_dim: int, seqlens: list[int], causal: bool, window_left: int, dtype: str,
                     deterministic: bool) -> None:
    import cupy as cp
    import numpy as np

    import cuflash
    from cuflash import _config, _cupy_path, _validate

    flush = cp.empty(256 << 20, cp.uint8)
    form = "the ordered form" if deterministic else "the default form"
    window = (window_left, 0 if causal else -1)
    print(f"head_dim {head_dim}, {'causal' if causal else 'full'}, window {window}, {dtype}, {form}; us per block, "
          "median [p10, p90]")
    for seqlen in seqlens:
        batch, heads = TOKENS // seqlen, WIDTH // head_dim
        q, k, v, dout = (cp.random.standard_normal((batch, seqlen, heads, head_dim), dtype=cp.float32)
                         .astype(cp.dtype(dtype)) for _ in range(4))
        out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, return_lse=True)
        problem = _validate.check_backward(dout, q, k, v, out, lse, causal, None, window)
        plan = _cupy_path.BackwardPlan(problem, q.data.device_id, deterministic, dout, q, k, v, out, lse)
        dkdv, = plan.dkdv
        if dkdv.maps is None:
            raise SystemExit("the plan does not run bwd_dkdv_wgmma here (a GPU of compute capability 9.0 runs it)")
        if deterministic and not plan.order_ints:
            raise SystemExit("the deterministic plan does not run the ordered form here")
        # the ordered form's counts, then the stamps (the stamped kernel derives the counts' length: check it)
        blocks = int(np.prod(dkdv.grid))
        counts = batch * heads * _config.dq_accum_rows(seqlen) * head_dim // _config.DQ_ACCUM_SHARE
        if plan.order_ints not in (0, counts):
            raise SystemExit(f"the plan counts {plan.order_ints} shares, the stamped kernel {counts}")
        offset = (plan.order_ints + 1) // 2 * 2
        order = cp.zeros(offset + 2 * STAMPS * blocks, cp.int32)
        stamps = order[offset:].view(cp.uint64).reshape(blocks, STAMPS)
        dq = cp.empty_like(q)
        dk, dv = cp.empty_like(k), cp.empty_like(v)
        delta = cp.empty(plan.delta_shape, cp.float32)
        plan.preprocess((dout, out, delta) + plan.preprocess_head + (_cupy_path._VECTOR_OK[1],))
        dq_accum = cp.zeros(plan.accum_floats, cp.float32)
        # BACKWARD_PER_CALL, the counts and stamps in dq_order's place
        args = (q, k, v, dout, lse, delta, dq, dk, dv, dq_accum, order, _cupy_path._NULL,
                *_cupy_path._dropout_args(problem, 0, 0), _cupy_path._VECTOR_OK[1])
        us, t = stamped_launch(lambda: dkdv(args), stamps, flush, dq_accum, order)
        t = t[t[:, 1] > 0]
        sm, entry, landed, stepped, steps = t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 7]
        done = np.maximum(t[:, 4], t[:, 5])
        spans, gaps = [], []
        for s in np.unique(sm):
            by_entry = np.argsort(entry[sm == s])
            starts, ends = entry[sm == s][by_entry], done[sm == s][by_entry]
            spans.append(ends.max() - starts.min())
            gaps.extend(starts[1:] - ends[:-1])
        cycles = max(spans) / us   # per microsecond
        print(f"seqlen {seqlen}: {len(t)} blocks, launch {us:.0f} us, {cycles:.0f} cycles/us; prologue "
              f"{percentiles((landed - entry) / cycles)}, steps {percentiles((stepped - landed) / cycles)} "
              f"({np.median(steps):.0f} of them), epilogue {percentiles((done - stepped) / cycles)}, "
              f"to the next block {percentiles(np.array(gaps) / cycles)}")
        if t[:, 6].any():   # the dQ writer ran (the ordered form, head_dim 256)
            print(f"  dQ writer waits per block: for the shares {percentiles(t[:, 6] / cycles)}, on the counts "
                  f"{percentiles(t[:, 8] / cycles)}, for its adds to complete {percentiles(t[:, 9] / cycles)}")


def measure_forward(head_dim: int, seqlens: list[int], causal: bool, window_left: int, dtype: str) -> None:
    import cupy as cp
    import numpy as np

    from cuflash import _cupy_path, _validate

    flush = cp.empty(256 << 20, cp.uint8)
    window = (window_left, 0 if causal else -1)
    print(f"head_dim {head_dim}, {'causal' if causal else 'full'}, window {window}, {dtype}; us per item, "
          "median [p10, p90]")
    plain_fields = _cupy_path.NO_CACHE_FIELDS
    for seqlen in seqlens:
        batch, heads = TOKENS // seqlen, WIDTH // head_dim
        q, k, v = (cp.random.standard_normal((batch, seqlen, heads, head_dim), dtype=cp.float32)
                   .astype(cp.dtype(dtype)) for _ in range(3))
        problem = _validate.check_forward(q, k, v, causal, None, window)
        # every item's stamps (at most one item per 64 query rows), in out_partial's place
        stamps = cp.zeros((-(-seqlen // 64) * batch * heads, ITEM_STAMPS), cp.uint64)
        _cupy_path.NO_CACHE_FIELDS = {**plain_fields, "out_partial": stamps}
        try:
            plan = _cupy_path.ForwardPlan(problem, q.data.device_id, q, k, v)
        finally:
            _cupy_path.NO_CACHE_FIELDS = plain_fields
        if plan.maps is None:
            raise SystemExit("the plan does not run fwd_wgmma here (a GPU of compute capability 9.0 runs it)")
        us, t = stamped_launch(lambda: plan.run(q, k, v, with_lse=False), stamps, flush)
        t = t[t[:, 1] > 0]
        taken, q_landed, walked, tiles, block = t[:, 1], t[:, 2], t[:, 3], t[:, 4], t[:, 5]
        duration, tail = np.zeros(len(t)), np.zeros(len(t))
        for b in np.unique(block):
            rows = np.flatnonzero(block == b)
            rows = rows[np.argsort(taken[rows])]
            ends = np.append(taken[rows[1:]], t[rows[-1], 6])   # the next take, or the block's end
            duration[rows], tail[rows] = ends - taken[rows], ends - walked[rows]
        # an SM's clock from its first take to its last block's end (a grid of one item per block has many
        # blocks per SM; clock64 is the SM's own, so spans are taken per SM)
        sm = t[:, 0]
        spans = [t[sm == s, 6].max() - taken[sm == s].min() for s in np.unique(sm)]
        cycles = max(spans) / us   # per microsecond
        walking = walked > 0   # items that walked keys (the rest saw none)
        print(f"seqlen {seqlen}: {len(t)} items in {len(np.unique(block))} blocks, launch {us:.0f} us, "
              f"{cycles:.0f} cycles/us")
        for n in np.unique(tiles[walking]):
            at = walking & (tiles == n)
            print(f"  {n:3d} key tiles, {at.sum():6d} items: item {percentiles(duration[at] / cycles)}, "
                  f"Q wait {percentiles((q_landed[at] - taken[at]) / cycles)}, walk end to next "
                  f"{percentiles(tail[at] / cycles)}")
        if len(np.unique(tiles[walking])) > 1:
            per_tile, fixed = np.polyfit(tiles[walking], duration[walking] / cycles, 1)
            print(f"  fit: {fixed:.2f} us per item + {per_tile:.3f} us per key tile")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/block_timeline.py", description=__doc__.splitlines()[0])
    parser.add_argument("--pass", dest="pass_", default="bwd", choices=("bwd", "fwd"))
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=-1, help="the window's left side (-1: none)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--deterministic", action="store_true", help="bwd: the deterministic plan's ordered form")
    parser.add_argument("--check", action="store_true", help="stamp and compile only (no GPU)")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    with tempfile.TemporaryDirectory() as folder:
        measured = "fwd_wgmma.cu" if args.pass_ == "fwd" else "bwd_wgmma.cu"
        sys.path.insert(0, str(stamped_package(pathlib.Path(folder), (measured,))))
        if args.pass_ == "fwd":
            measure_forward(args.head_dim, args.seqlens, args.causal, args.window, args.dtype)
        else:
            measure_backward(args.head_dim, args.seqlens, args.causal, args.window, args.dtype, args.deterministic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
