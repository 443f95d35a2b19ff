"""Compile the kernels for the current GPU ahead of time, in parallel: every head dim, dtype and mask, the
modifier kernels with all modifiers at once, with and without dropout, and the KV-cache forward and its merge
(``_config.all_specs``).

``python -m cuflash warmup [--jobs N]`` (or ``python -m cuflash.warmup``) fills CuPy's on-disk kernel
cache (``CUPY_CACHE_DIR``) so that no later process pays NVRTC time on a first call. Without it each new
specialization compiles on its first use.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time


def _compile_one(spec) -> tuple[str, float]:
    from . import _cupy_path
    from ._compile import get_kernel

    start = time.perf_counter()
    get_kernel(spec, 0)
    _cupy_path.device_props(0)
    return spec.name, time.perf_counter() - start


def warmup(jobs: int | None = None, verbose: bool = True) -> int:
    """Compile ``_config.all_specs`` for device 0; returns how many."""
    from . import _config, _cupy_path

    specs = _config.all_specs(_cupy_path.device_props(0))
    jobs = jobs or os.cpu_count() or 1
    context = multiprocessing.get_context("spawn")  # CUDA contexts do not survive fork
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for name, seconds in pool.map(_compile_one, specs):
            if verbose:
                print(f"{seconds:6.1f} s  {name}")
    if verbose:
        print(f"{len(specs)} kernels ready in {time.perf_counter() - start:.1f} s with {jobs} processes")
    return len(specs)


def run(jobs: int | None = None) -> int:
    """The command: warm up, or say in one line why there is no GPU to warm up for. Returns the exit code."""
    from ._env import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"cuflash warmup: nothing to compile for: no GPU: {reason}", file=sys.stderr)
        return 1
    warmup(jobs)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash.warmup", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="compiler processes (default: CPU count)")
    args = parser.parse_args(argv)
    return run(args.jobs)


if __name__ == "__main__":
    sys.exit(main())
