"""Sweep tile candidates of the tensor-core kernels on the GPU (the tile table's measurements).

``python tools/tune.py fwd|bwd [--seqlens 1024 4096] [--dims 64 128 256] [--deterministic]``: for each
head dim, mask and candidate, the kernel's registers and local memory (spills) as loaded, and its TFLOP/s
on FlashAttention's grid (bfloat16). ``bwd`` sweeps the dK/dV kernel and tile of the atomic-dQ default,
or with ``--deterministic`` the (dK/dV, dQ) tile pair of the deterministic backward's dQ-kernel way (its
split grid runs the atomic default's dK/dV tiles). The chosen entries and their numbers go into
cuflash/_config.py and bench/NOTES.md.
"""

from __future__ import annotations

import argparse
import dataclasses

import cupy as cp

from cuflash import _config, _cupy_path
from cuflash._compile import get_kernel
from cuflash._validate import check_forward
from speed_probe import time_ms  # tools/ is on sys.path when run as tools/tune.py

TOKENS, WIDTH = 16384, 2048

FWD_CANDIDATES = {  # head_dim: (block_m, block_n, warps, key_split)
    64: [(128, 64, 4, 1), (64, 64, 4, 1), (128, 64, 8, 1), (64, 64, 2, 1), (128, 32, 4, 1), (64, 128, 4, 1)],
    128: [(128, 32, 4, 1), (128, 64, 4, 1), (64, 64, 4, 1), (128, 64, 8, 1), (64, 32, 2, 1), (128, 32, 8, 1)],
    256: [(128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 1), (64, 32, 4, 1), (128, 32, 8, 1)],
}
TILED, ROWS = "bwd_dkdv_mma", "bwd_dkdv_rows_mma"
ATOMIC_BWD_CANDIDATES = {  # head_dim: (dkdv kernel, block_m, block_n) of the atomic-dQ default
    64: [(TILED, 128, 128), (TILED, 64, 128), (TILED, 128, 64), (TILED, 64, 64), (ROWS, 64, 64)],
    128: [(TILED, 64, 128), (TILED, 128, 64), (TILED, 64, 64), (ROWS, 32, 64)],
    256: [(ROWS, 16, 64), (ROWS, 16, 32), (ROWS, 32, 64)],
}
DETERMINISTIC_BWD_CANDIDATES = {  # head_dim: ((dkdv kernel, block_m, block_n), (dq block_m, block_n, warps))
    64: [((TILED, 128, 128), (128, 64, 4)), ((TILED, 128, 128), (128, 32, 4)), ((TILED, 128, 128), (64, 64, 2)),
         ((TILED, 128, 128), (64, 64, 4))],
    128: [((TILED, 64, 128), (64, 64, 4)), ((TILED, 64, 128), (128, 16, 4)), ((TILED, 64, 128), (64, 32, 4))],
    256: [((ROWS, 16, 64), (64, 32, 4)), ((ROWS, 16, 32), (32, 32, 2)), ((ROWS, 32, 64), (64, 16, 4))],
}


def mask_of(causal: bool) -> int:
    return _config.MASK_CAUSAL if causal else _config.MASK_NONE


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pass_", choices=["fwd", "bwd"])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--deterministic", action="store_true", help="bwd: the deterministic backward's tiles")
    args = parser.parse_args()
    bf16 = cp.dtype("bfloat16")
    limit = _cupy_path.device_props(0).max_smem_per_block
    for d in args.dims:
        for causal in (False, True):
            base = _config.choose_config(d, bf16, causal, _cupy_path.device_props(0))
            candidates = (FWD_CANDIDATES if args.pass_ == "fwd" else DETERMINISTIC_BWD_CANDIDATES
                          if args.deterministic else ATOMIC_BWD_CANDIDATES)[d]
            for cand in candidates:
                if args.pass_ == "fwd":
                    block_m, block_n, warps, key_split = cand
                    spec = _config.mma_spec("fwd_mma", bf16, d, mask_of(causal), block_m, block_n, warps,
                                            key_split=key_split)
                    specs = [spec]
                elif args.deterministic:
                    dkdv_cand, (dq_m, dq_n, dq_warps) = cand
                    kernel, dkdv_m, dkdv_n = dkdv_cand
                    dkdv = _config.dkdv_specs(kernel, bf16, d, mask_of(causal), dkdv_m, dkdv_n, atomic_dq=False)
                    dq = _config.mma_spec("bwd_dq_mma", bf16, d, mask_of(causal), dq_m, dq_n, dq_warps)
                    # no atomic kernels: the backward then takes the dQ-kernel way, the one these
                    # candidates tile (the split grid would run the atomic default's tiles instead)
                    cfg = dataclasses.replace(base, bwd_dkdv=dkdv, bwd_dq=dq, bwd_dkdv_atomic=())
                    specs = [*dkdv, dq]
                else:
                    kernel, dkdv_m, dkdv_n = cand
                    dkdv = _config.dkdv_specs(kernel, bf16, d, mask_of(causal), dkdv_m, dkdv_n, atomic_dq=True)
                    cfg = dataclasses.replace(base, bwd_dkdv_atomic=dkdv)
                    specs = list(dkdv)
                if any(s.smem_bytes > limit for s in specs):
                    continue
                kernels = [get_kernel(s, 0) for s in specs]
                regs = "/".join(str(kr.num_regs) for kr in kernels)
                spill = sum(kr.local_size_bytes for kr in kernels)
                cells = []
                for n in args.seqlens:
                    b, h = TOKENS // n, WIDTH // d
                    q, k, v, do = (cp.random.standard_normal((b, n, h, d), dtype=cp.float32).astype(bf16)
                                   for _ in range(4))
                    p = check_forward(q, k, v, causal, None)
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    if args.pass_ == "fwd":
                        ms = time_ms(lambda: _cupy_path.forward(q, k, v, p, spec))
                    else:
                        out, lse = _cupy_path.forward(q, k, v, p)
                        ms = time_ms(lambda: _cupy_path.backward(do, q, k, v, out, lse, p, args.deterministic, cfg))
                        flops *= 2.5
                    cells.append(f"{flops / ms / 1e9:6.1f}")
                print(f"{args.pass_} d={d:3d} causal={causal!s:5} {str(cand).replace('bwd_dkdv_', ''):36s} regs {regs:>9} local {spill:4d}  "
                      + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
