"""A quick speed probe for kernel work: cuflash against PyTorch SDPA (flash, cuDNN) at a few grid points.

``python tools/speed_probe.py [--seqlens 1024 4096] [--dims 64 128] [--no-peers]``. The numbers that count
come from ``python -m bench``; this answers "did that change help" in a few seconds of device time. To
compare two versions in one device call, time a copy of the old package against the working tree,
alternating, without the peers: ``git archive HEAD~1 cuflash | tar x -C old`` here, then on the device
``PYTHONPATH=old python3 tools/speed_probe.py --no-peers`` and ``PYTHONPATH=. ...``, twice each; or
``tools/ab_probe.py``, which interleaves the versions and FlashAttention-2 in one process.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

import cuflash

TOKENS, WIDTH = 16384, 2048  # FlashAttention's grid: batch * seqlen, heads * head_dim


def time_ms(fn, repeats=10):
    flush = cp.empty(256 << 20, cp.uint8)
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        flush.fill(0)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (no peers for float32)")
    parser.add_argument("--no-peers", action="store_true", help="time cuflash only (comparing two versions)")
    args = parser.parse_args()
    dtype = cp.dtype(args.dtype)
    torch = None  # the peers; SDPA's flash and cuDNN backends take half precision only
    if not args.no_peers and dtype != cp.float32:
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            torch = None
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | {'fwd':>7} {'fa2':>7} {'cudnn':>7} | {'bwd':>7} {'bwd-det':>7} "
          f"{'fa2':>7} {'cudnn':>7}  TFLOP/s")
    for d in args.dims:
        for causal in (False, True):
            for n in args.seqlens:
                b, h = TOKENS // n, WIDTH // d
                q, k, v, do = (cp.random.standard_normal((b, n, h, d), dtype=cp.float32).astype(dtype) for _ in range(4))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                row = [time_ms(lambda: cuflash.attention(q, k, v, causal=causal))]
                peers_f, peers_b = [], []
                if torch is not None:
                    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, do))
                    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                        with sdpa_kernel(backend):
                            f = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                            peers_f.append(time_ms(f))
                            lq, lk, lv = (x.detach().requires_grad_() for x in (tq, tk, tv))
                            o = torch.nn.functional.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
                            peers_b.append(time_ms(lambda: torch.autograd.grad(o, (lq, lk, lv), tdo, retain_graph=True)))
                bwd = [time_ms(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                                  deterministic=det)) for det in (False, True)]
                fmt = lambda ms, f: f"{f / ms / 1e9:7.1f}"
                print(f"{d:4d} {str(causal):>6} {n:6d} | {fmt(row[0], flops)} "
                      + " ".join(fmt(t, flops) for t in peers_f)
                      + " | " + " ".join(fmt(t, 2.5 * flops) for t in bwd + peers_b), flush=True)


if __name__ == "__main__":
    main()
