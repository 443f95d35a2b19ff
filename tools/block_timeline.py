"""Where a block of the Hopper dK/dV kernel spends its time: clock64 stamps per block, on the GPU.

``python tools/block_timeline.py [--head-dim 128] [--seqlens 512 1024 4096] [--causal] [--dtype bfloat16]``
copies the ``cuflash`` package into a temporary folder and stamps ``bwd_dkdv_wgmma`` there (kernels/bwd_wgmma.cu)
at four places: the block's entry, once its K and V have landed, after its last step, and after its last dK/dV
store. It runs the default backward's dK/dV launch at FlashAttention's grid shape (batch * seqlen = 16384,
heads * head_dim = 2048) and prints, per block, medians and the 10th-90th percentiles of the prologue, the steps,
the epilogue and the gap to the next block on the same SM (``%smid``), in microseconds from the longest SM's
cycle count over the launch's time. The stamps travel in ``dq_order``, which the default form leaves null.
Needs a GPU of compute capability 9.0. ``--check`` only stamps the source and compiles one specialization with
NVRTC (no GPU): tests/test_compile.py runs it, so that the stamps' places stay in the kernel.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKENS, WIDTH = 16384, 2048  # FlashAttention's grid: batch * seqlen, heads * head_dim
STAMPS = 8  # int64 per block: smid, entry, K and V landed, last step done, consumer 0 and 1 done, steps
CHECK_SPEC = "cuflash::bwd_dkdv_wgmma<__nv_bfloat16, 128, 0, 0, 64, 128, false, false>"

# (text in the kernel, text that replaces it): each must occur exactly once
_STAMPS = [
    ("    const int warpgroup = threadIdx.x / 128, tid_wg = threadIdx.x % 128;\n",
     "    unsigned long long* const stamps =\n"
     "        reinterpret_cast<unsigned long long*>(dq_order) + 8 * (blockIdx.y * gridDim.x + blockIdx.x);\n"
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
]


def stamped_package(into: pathlib.Path) -> pathlib.Path:
    """A copy of the cuflash package under ``into`` with bwd_wgmma.cu stamped; ValueError where a place moved."""
    package = into / "cuflash"
    shutil.copytree(REPO / "cuflash", package, ignore=shutil.ignore_patterns("__pycache__"))
    source = package / "kernels" / "bwd_wgmma.cu"
    text = source.read_text()
    for place, stamped in _STAMPS:
        if text.count(place) != 1:
            raise ValueError(f"bwd_wgmma.cu holds {text.count(place)} copies of the stamp's place {place!r}, not 1")
        text = text.replace(place, stamped)
    source.write_text(text)
    return into


def check() -> int:
    """Stamp and compile CHECK_SPEC with NVRTC; 0 where it compiles."""
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, str(stamped_package(pathlib.Path(folder))))
        from cuflash import _compile, _config

        if not pathlib.Path(_compile.__file__).is_relative_to(folder):
            raise SystemExit(f"cuflash came from {_compile.__file__}, not the stamped copy")
        spec = next(s for s in _config.all_specs(_config.H100) if s.name == CHECK_SPEC)
        report, = _compile.compile_offline([spec], "sm_90")
        print(f"{spec.name}: stamped, {report.registers} registers, {report.spill_store_bytes} bytes spilled")
        return 0


def percentiles(values) -> str:
    import numpy as np

    return f"{np.median(values):6.2f} [{np.percentile(values, 10):.2f}, {np.percentile(values, 90):.2f}]"


def measure(head_dim: int, seqlens: list[int], causal: bool, dtype: str) -> None:
    import cupy as cp
    import numpy as np

    import cuflash
    from cuflash import _cupy_path, _validate

    flush = cp.empty(256 << 20, cp.uint8)
    print(f"head_dim {head_dim}, {'causal' if causal else 'full'}, {dtype}; us per block, median [p10, p90]")
    for seqlen in seqlens:
        batch, heads = TOKENS // seqlen, WIDTH // head_dim
        q, k, v, dout = (cp.random.standard_normal((batch, seqlen, heads, head_dim), dtype=cp.float32)
                         .astype(cp.dtype(dtype)) for _ in range(4))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        problem = _validate.check_backward(dout, q, k, v, out, lse, causal, None)
        plan = _cupy_path.BackwardPlan(problem, q.data.device_id, False, dout, q, k, v, out, lse)
        dkdv, = plan.dkdv
        if dkdv.maps is None:
            raise SystemExit("the plan does not run bwd_dkdv_wgmma here (a GPU of compute capability 9.0 runs it)")
        stamps = cp.zeros((int(np.prod(dkdv.grid)), STAMPS), cp.uint64)
        dq = cp.empty_like(q)
        dk, dv = cp.empty_like(k), cp.empty_like(v)
        delta = cp.empty(plan.delta_shape, cp.float32)
        plan.preprocess((dout, out, delta) + plan.preprocess_head + (_cupy_path._VECTOR_OK[1],))
        dq_accum = cp.zeros(plan.accum_floats, cp.float32)
        # BACKWARD_PER_CALL, the stamps in dq_order's place
        args = (q, k, v, dout, lse, delta, dq, dk, dv, dq_accum, stamps, _cupy_path._NULL,
                *_cupy_path._dropout_args(problem, 0, 0), _cupy_path._VECTOR_OK[1])
        for _ in range(3):   # the last of three launches, L2 flushed before each
            flush.fill(0)
            dq_accum.fill(0)
            stamps.fill(0)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            dkdv(args)
            stop.record()
            stop.synchronize()
        us = cp.cuda.get_elapsed_time(start, stop) * 1000
        t = stamps.get().astype(np.int64)
        t = t[t[:, 1] > 0]
        sm, entry, landed, stepped, steps = t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 7]
        done = np.maximum(t[:, 4], t[:, 5])
        spans, gaps = [], []
        for s in np.unique(sm):
            order = np.argsort(entry[sm == s])
            starts, ends = entry[sm == s][order], done[sm == s][order]
            spans.append(ends.max() - starts.min())
            gaps.extend(starts[1:] - ends[:-1])
        cycles = max(spans) / us   # per microsecond
        print(f"seqlen {seqlen}: {len(t)} blocks, launch {us:.0f} us, {cycles:.0f} cycles/us; prologue "
              f"{percentiles((landed - entry) / cycles)}, steps {percentiles((stepped - landed) / cycles)} "
              f"({np.median(steps):.0f} of them), epilogue {percentiles((done - stepped) / cycles)}, "
              f"to the next block {percentiles(np.array(gaps) / cycles)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/block_timeline.py", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--check", action="store_true", help="stamp and compile only (no GPU)")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, str(stamped_package(pathlib.Path(folder))))
        measure(args.head_dim, args.seqlens, args.causal, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
