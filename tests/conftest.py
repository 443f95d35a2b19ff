"""Shared fixtures: the array module under test (NumPy always, CuPy where a GPU is present).

``CUFLASH_TEST_PLAN`` chooses the kernels the GPU tests plan with: ``native`` (default, the GPU's own plan),
``portable`` (as on a GPU without tensor maps: the ``mma.sync`` kernels, not the Hopper ones) or ``a100``
(portable with an A100's shared memory a block: on an H100 or H200, the kernels and tiles an A100 gets
wherever the table follows shared memory; it still compiles for the GPU at hand).
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from cuflash import _config


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no cupy, no driver, or no device: all mean "no GPU here"
        return 0


def _nccl_available() -> bool:
    try:
        from cupy.cuda import nccl

        return bool(nccl.available)
    except Exception:  # no cupy, or a CuPy built without NCCL
        return False


GPU_COUNT = _gpu_count()
GPU = GPU_COUNT > 0
#: CuPy's NCCL bindings load (the NCCL library is found)
NCCL = _nccl_available()
requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")

#: CUFLASH_TEST_PLAN's plans: what each makes of the GPU's own properties before cuflash plans a call
TEST_PLANS = {
    "native": lambda props: props,
    "portable": lambda props: dataclasses.replace(props, tensor_maps=False),
    "a100": lambda props: dataclasses.replace(props, tensor_maps=False,
                                              max_smem_per_block=_config.A100.max_smem_per_block),
}


def _plan_as(plan: str) -> None:
    """Make cuflash plan its GPU calls on TEST_PLANS[plan] of the device's properties."""
    if plan not in TEST_PLANS:
        raise pytest.UsageError(f"CUFLASH_TEST_PLAN: expected one of {sorted(TEST_PLANS)}, got {plan!r}")
    if plan == "native" or not GPU:
        return
    from cuflash import _cupy_path

    own_props = _cupy_path.device_props
    _cupy_path.device_props = lambda device_id: TEST_PLANS[plan](own_props(device_id))


_plan_as(os.environ.get("CUFLASH_TEST_PLAN", "native"))

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
