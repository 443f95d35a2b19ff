"""cuflash's main job in one run: compute attention, check it against the reference, report speed and memory.

``python -m cuflash.demo`` runs on the GPU with CuPy when one is present, else on the NumPy path.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cuflash
from cuflash import reference


def _gpu():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # no CuPy, no driver or no device: run the NumPy path
        pass
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cuflash.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=None, help="default: 4096 on a GPU, 512 on the CPU")
    parser.add_argument("--cpu", action="store_true", help="use the NumPy path even where a GPU is present")
    args = parser.parse_args(argv)

    cupy = None if args.cpu else _gpu()
    if cupy is not None:
        xp, dtype, batch, heads, head_dim = cupy, cupy.dtype("bfloat16"), 4, 16, 128
        seqlen = args.seqlen or 4096
        where = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        import ml_dtypes

        xp, dtype, batch, heads, head_dim = np, np.dtype(ml_dtypes.bfloat16), 1, 4, 64
        seqlen = args.seqlen or 512
        where = "CPU (NumPy path)"
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

    def rel(a, b):
        return np.linalg.norm(host(a) - b) / np.linalg.norm(b)

    print(f"max |out - ref| = {np.abs(host(out[part]) - ref_out).max():.2e}   "
          f"|out - ref| / |ref| = {rel(out[part], ref_out):.2e}   "
          f"max |lse - ref| = {np.abs(host(lse[0, :2]) - ref_lse[0]).max():.2e}")
    print("|grad - ref| / |ref|: " + ", ".join(
        f"{name} {rel(g[part], r):.2e}" for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads)))

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
    main()
