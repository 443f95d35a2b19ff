"""cuflash's main job in one run: compute attention, check it against the reference, report speed and memory.

``python -m cuflash.demo`` runs on the GPU with CuPy when one is present, else on the NumPy path (and
says why the GPU was not used). It ends with a verdict, PASS or FAIL, from FlashAttention's tolerance rule
(``cuflash.reference``): each of out, dq, dk, dv against the float64 reference, allowed twice (forward) or
three times (gradients) the error of the same math done in the input dtype, plus the reference's rounding.
The exit status is 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cuflash
from cuflash import reference


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cuflash.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=None, help="default: 4096 on a GPU, 512 on the CPU")
    parser.add_argument("--cpu", action="store_true", help="use the NumPy path even where a GPU is present")
    args = parser.parse_args(argv)

    from ._env import gpu_unavailable_reason

    why_cpu = "--cpu was given" if args.cpu else gpu_unavailable_reason()
    cupy = None
    if why_cpu is None:
        import cupy

        xp, dtype, batch, heads, head_dim = cupy, cupy.dtype("bfloat16"), 4, 16, 128
        seqlen = args.seqlen or 4096
        where = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        import ml_dtypes

        xp, dtype, batch, heads, head_dim = np, np.dtype(ml_dtypes.bfloat16), 1, 4, 64
        seqlen = args.seqlen or 512
        where = f"the CPU (NumPy path; no GPU: {why_cpu})"
    causal = True
    print(f"cuflash {cuflash.__version__} on {where}")
    print(f"q, k, v: batch {batch}, seqlen {seqlen}, heads {heads}, head_dim {head_dim}, {dtype.name}, causal")

    rng = np.random.default_rng(0)
    q, k, v, dout = (xp.asarray(rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32).astype(dtype))
                     for _ in range(4))

    # correctness: the first (batch, 2 heads) against the float64 reference
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    part = (slice(0, 1), slice(None), slice(0, 2))
    ref_out, ref_lse = reference.attention(q[part], k[part], v[part], causal=causal)
    ref_grads = reference.attention_backward(dout[part], q[part], k[part], v[part], causal=causal)

    def host(x):
        return np.asarray(x.get() if hasattr(x, "get") else x, np.float64)

    # FlashAttention's rule: the error against float64 within factor x the same math's error in the dtype
    in_dtype_out, _ = reference.attention_in_dtype(q[part], k[part], v[part], causal, None, dtype)
    in_dtype_grads = reference.attention_backward_in_dtype(dout[part], q[part], k[part], v[part], out[part],
                                                           causal, None, dtype)
    checks = [("out", out[part], ref_out, in_dtype_out, 2)] + [
        (name, g[part], r, lp, 3) for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, in_dtype_grads)]
    passed = True
    for name, got, ref, in_dtype, factor in checks:
        err = float(np.abs(host(got) - ref).max())
        bound = reference.tolerance(ref, in_dtype, dtype, factor)
        ok = err <= bound  # False for NaN
        passed &= ok
        print(f"{name:>3}: max |error| {err:.2e}, allowed {bound:.2e} ({factor} x the {dtype.name} math's "
              f"{float(np.abs(in_dtype - ref).max()):.2e} + rounding){'' if ok else '  <-- too large'}")
    print(f"lse: max |error| {np.abs(host(lse[0, :2]) - ref_lse[0]).max():.2e}")

    # speed, FlashAttention's FLOP convention
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    fwd_ms = _time_ms(xp, lambda: cuflash.attention(q, k, v, causal=causal))
    bwd_ms = _time_ms(xp, lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
    print(f"forward  {fwd_ms:9.3f} ms  {_rate(flops, fwd_ms)}")
    print(f"backward {bwd_ms:9.3f} ms  {_rate(2.5 * flops, bwd_ms)}")

    # memory: what the pass allocates beyond its outputs, against one materialized score matrix
    scores_bytes = batch * heads * seqlen * seqlen * 4
    if cupy is not None:
        pool = cupy.get_default_memory_pool()
        del out, lse, dq, dk, dv
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        before = pool.total_bytes()
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        cupy.cuda.Device().synchronize()
        used = pool.total_bytes() - before
        outputs = out.nbytes + lse.nbytes + sum(g.nbytes for g in grads)
        print(f"device memory for forward + backward: {used / 2**20:.1f} MiB, of which outputs "
              f"{outputs / 2**20:.1f} MiB; one float32 seqlen x seqlen score matrix per head would be "
              f"{scores_bytes / 2**20:.0f} MiB")
    else:
        print(f"memory: no seqlen x seqlen buffer (one per head would be {scores_bytes / 2**20:.0f} MiB); "
              "the NumPy path holds one key block of scores at a time")
    print("PASS: out, dq, dk and dv within FlashAttention's tolerance of the float64 reference" if passed else
          "FAIL: a result is beyond FlashAttention's tolerance of the float64 reference (above)")
    return 0 if passed else 1


def _rate(flops: float, ms: float) -> str:
    per_second = flops / ms * 1e3
    return f"{per_second / 1e12:8.1f} TFLOP/s" if per_second >= 1e12 else f"{per_second / 1e9:8.1f} GFLOP/s"


def _time_ms(xp, fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if xp is np:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        else:
            begin, end = xp.cuda.Event(), xp.cuda.Event()
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(begin, end))
    return float(np.median(times))


if __name__ == "__main__":
    sys.exit(main())
