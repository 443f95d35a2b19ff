"""ptxas's report for every kernel the dispatcher can choose, compiled offline with the installed NVRTC.

``python tools/compile_report.py [--arch sm_80 sm_90] [--jobs N]`` needs no GPU (cuda-bindings, the NVRTC
wheel and the CUDA runtime headers: ``pip install -e ".[test]"``). It prints the NVRTC version, then per
architecture the kernel count, the most registers any kernel uses and every kernel that spills; it exits
1 when a float16/bfloat16 kernel spills (the guarantee ``tests/test_compile.py`` checks).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import multiprocessing
import os
import sys

import numpy as np

from cuflash import _compile, _config

TARGETS = {"sm_80": _config.A100, "sm_89": _config.RTX_4090, "sm_90": _config.H100}


def reports(arch: str, jobs: int) -> list[_compile.CompileReport]:
    """One NVRTC program per (source file, dtype), compiled in parallel processes."""
    groups = collections.defaultdict(list)
    for spec in _config.all_specs(TARGETS[arch]):
        groups[spec.source_file, spec.dtype.name].append(spec)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        results = pool.map(_compile.compile_offline, groups.values(), [arch] * len(groups))
        return [r for group in results for r in group]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], choices=sorted(TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    print(f"NVRTC {'.'.join(map(str, _compile.nvrtc_version()))}")
    half_spills = False
    for arch in args.arch:
        found = reports(arch, args.jobs)
        most = max(found, key=lambda r: r.registers)
        print(f"{arch}: {len(found)} kernels, at most {most.registers} registers ({most.spec.name})")
        for r in found:
            if r.spill_store_bytes or r.spill_load_bytes:
                half = np.dtype(r.spec.dtype) != np.float32
                half_spills |= half
                print(f"  spills {r.spill_store_bytes} bytes stored / {r.spill_load_bytes} loaded, "
                      f"{r.registers} registers: {r.spec.name}")
    return 1 if half_spills else 0


if __name__ == "__main__":
    sys.exit(main())
