"""Measurement on the GPU: CUDA-event timing with an L2 flush, host wall time, peak memory.

Everything runs on CuPy's current stream. PyTorch work is put on the same stream by the torch
implementations (see ``bench.impls``), so events recorded here bracket it too. CuPy and PyTorch are
imported lazily, inside the functions.
"""

from __future__ import annotations

import statistics
import time

#: Bytes written between timed repeats to evict the inputs from L2 (H100/H200 L2: 50 MB; B200: 126 MB).
L2_FLUSH_BYTES = 256 * 2**20
#: Warm-up stops early once this much wall time went into it, after at least one call: a second of
#: warm-up on a half-second call buys nothing, and the grid must fit in minutes.
WARMUP_BUDGET_S = 0.5
#: A measurement whose median time is over this multiple of its fastest repeat was disturbed (another process on
#: the GPU, a clock drop): undisturbed cells of the grid keep their median within 1-3% of the minimum, disturbed
#: ones were seen at 1.25-3x (bench/NOTES.md). Such a cell is measured again, up to DISTURBED_RETRIES more times,
#: and keeps its least disturbed measurement (the lowest median): a disturbance only ever slows a call down.
DISTURBED_RATIO = 1.10
DISTURBED_RETRIES = 2


def disturbed(median_ms: float, fastest_ms: float) -> bool:
    """Was a measurement of this median and fastest repeat disturbed (DISTURBED_RATIO)?"""
    return median_ms > DISTURBED_RATIO * fastest_ms


def least_disturbed(timer, fn) -> tuple[list[float], str | None]:
    """``timer(fn)``'s times (ms), measured again while disturbed (DISTURBED_RATIO), the run with the lowest
    median kept; and a note saying so where it took more than one run (None otherwise)."""
    times, runs = timer(fn), 1
    while disturbed(statistics.median(times), min(times)) and runs <= DISTURBED_RETRIES:
        again, runs = timer(fn), runs + 1
        times = min(times, again, key=statistics.median)
    if runs == 1:
        return times, None
    return times, (f"measured {runs} times (disturbed: median over {DISTURBED_RATIO}x the minimum); "
                   "the lowest median kept")


class EventTimer:
    """Times a zero-argument callable with CUDA events, flushing L2 before every repeat.

    Parameters
    ----------
    warmup : int
        Untimed calls first (fewer when they exceed WARMUP_BUDGET_S).
    repeats : int
        Timed calls; each is bracketed by its own pair of events, the flush outside them.
    """

    def __init__(self, warmup: int, repeats: int):
        import cupy

        self.warmup, self.repeats = warmup, repeats
        self._flush_buffer = cupy.empty(L2_FLUSH_BYTES, cupy.uint8)

    def flush_l2(self):
        self._flush_buffer.fill(0)

    def __call__(self, fn) -> list[float]:
        """Milliseconds of each timed call of ``fn``."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        started = time.perf_counter()
        for _ in range(self.warmup):
            fn()
            stream.synchronize()
            if time.perf_counter() - started > WARMUP_BUDGET_S:
                break
        events = []
        for _ in range(self.repeats):
            self.flush_l2()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            events.append((start, end))
        stream.synchronize()
        return [cupy.cuda.get_elapsed_time(start, end) for start, end in events]


def host_ms_per_call(fn, calls: int, measurements: int) -> list[float]:
    """Host wall milliseconds per call of ``fn``, averaged over ``calls`` back-to-back calls, per measurement.

    The device is synchronized before the clock starts; the clock stops when the last call returns, before
    the device is synchronized again, so the number is the time the calling thread spends in a call
    (argument checks, allocation, launches), not the device's time to run the work: at these shapes the
    kernels can take longer than their launch (cuflash's forward at seqlen 16 runs about 8 us on the
    H200), which the calls only queue. A call that blocks on the device shows its wait.
    """
    import cupy

    stream = cupy.cuda.get_current_stream()
    fn()  # warm-up: compile, allocate the pool
    results = []
    for _ in range(measurements):
        stream.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter() - started) * 1e3 / calls)
        stream.synchronize()
    return results


def cupy_peak_bytes(fn):
    """``(result, peak)``: the peak of CuPy pool bytes in use during ``fn()``, above those in use before."""
    import cupy

    class PeakHook(cupy.cuda.MemoryHook):
        name = "bench-peak"

        def __init__(self):
            super().__init__()
            self.in_use = self.peak = 0

        def malloc_postprocess(self, **kwargs):
            self.in_use += kwargs["mem_size"]
            self.peak = max(self.peak, self.in_use)

        def free_postprocess(self, **kwargs):
            self.in_use -= kwargs["mem_size"]

    cupy.get_default_memory_pool().free_all_blocks()
    hook = PeakHook()
    with hook:
        result = fn()
        cupy.cuda.get_current_stream().synchronize()
    return result, hook.peak


def torch_peak_bytes(fn):
    """``(result, peak)``: PyTorch's peak allocated bytes during ``fn()``, above those allocated before.

    The inputs are CuPy memory shared through DLPack, so they are not in PyTorch's count at all.
    """
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before
