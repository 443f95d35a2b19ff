"""Shared fixtures: the array module under test (NumPy always, CuPy where a GPU is present)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or no device: all mean "no GPU here"
        return False


GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")

# Hypothesis: on the GPU the fuzzed tests together draw well over 300 examples per run.
settings.register_profile("cpu", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gpu", max_examples=120, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("CUFLASH_HYPOTHESIS_PROFILE", "gpu" if GPU else "cpu"))


@pytest.fixture(scope="session", params=["numpy", pytest.param("cupy", marks=requires_gpu)])
def xp(request):
    """The array module of the path under test: the same test body runs on the CPU and the GPU path."""
    if request.param == "numpy":
        return np
    import cupy

    return cupy


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
