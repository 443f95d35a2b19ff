"""FlashAttention-2's own test grid (tests/fa_grid.py): how much of it cuflash runs, pinned, and samples of its
cases run against the float64 reference: small ones on the NumPy path here, more on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from . import fa_grid
from .conftest import requires_gpu

#: What cuflash cannot run of FlashAttention-2's grid, and how many cases each gap holds
GAPS = {"num_splits of the packed forward (FlashAttention's internal _flash_attn_varlen_forward)": 2,
        "a torch.Generator argument (PyTorch's API)": 1}


def test_cuflash_runs_all_of_flashattentions_grid_but_its_known_gaps():
    table = fa_grid.counts()
    total = sum(row[0] for row in table.values())
    skipped = sum(row[1] for row in table.values())
    ran = sum(row[2] for row in table.values())
    gaps: dict = {}
    for _, _, _, reasons in table.values():
        for reason, n in reasons.items():
            gaps[reason] = gaps.get(reason, 0) + n
    assert (total, skipped) == (508777, 196416)   # the grid as transcribed (FlashAttention 2.8)
    assert gaps == GAPS and ran + sum(gaps.values()) == total - skipped
    assert ran / (total - skipped) > 0.9999


def _small(test: str, case: dict, entries: int) -> bool:
    """Is the reference's score matrix of the case at most ``entries`` (the float64 reference materializes it)?"""
    batch, seqlen_q, seqlen_k, heads, _ = fa_grid._dims(test, case)
    if fa_grid.GRID[test][1] == "kvcache":
        batch = 1   # one sequence at a time
    return batch * heads * seqlen_q * seqlen_k <= entries


def _sample(count: int, entries: int, seed: int) -> list[tuple[str, dict]]:
    """``count`` runnable cases of at most ``entries`` reference scores, drawn with ``seed``, every test function
    that has such cases in turn."""
    rng = np.random.default_rng(seed)
    pools = [[c for c in fa_grid.runnable(test) if _small(*c, entries)] for test in fa_grid.GRID]
    pools = [pool for pool in pools if pool]
    return [pools[i % len(pools)][int(rng.integers(len(pools[i % len(pools)])))] for i in range(count)]


NUMPY_SAMPLE = _sample(28, 1 << 20, seed=1)


@pytest.mark.parametrize("test, case", NUMPY_SAMPLE, ids=[f"{t[16:]}-{i}" for i, (t, _) in enumerate(NUMPY_SAMPLE)])
def test_flashattention_cases_on_the_numpy_path(test, case):
    fa_grid.run_case(test, case, np, np.random.default_rng(7))


GPU_SAMPLE = _sample(60, 1 << 22, seed=2)


@requires_gpu
@pytest.mark.parametrize("test, case", GPU_SAMPLE, ids=[f"{t[16:]}-{i}" for i, (t, _) in enumerate(GPU_SAMPLE)])
def test_flashattention_cases_on_the_gpu(test, case):
    import cupy

    fa_grid.run_case(test, case, cupy, np.random.default_rng(7))
