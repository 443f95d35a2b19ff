"""``python -m cuflash`` (help, info, warmup) and the demo, as a user runs them."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from .conftest import GPU

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands():
    done = _run("cuflash", "--help")
    assert done.returncode == 0, done.stderr
    assert "info" in done.stdout and "warmup" in done.stdout


def test_no_command_prints_help_and_fails():
    done = _run("cuflash")
    assert done.returncode == 2 and "info" in done.stdout


def test_info_names_versions_gpu_and_cache():
    done = _run("cuflash", "info")
    assert done.returncode == 0, done.stderr
    fields = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip() and "  " in line)
    for field in ("cuflash", "numpy", "cupy", "GPU"):
        assert field in fields, done.stdout
    assert "kernel cache" in done.stdout
    if GPU:
        assert "compute capability" in fields["GPU"] and "NVRTC" in fields and "NCCL" in fields
    else:
        assert fields["GPU"].startswith("no GPU: ")


@pytest.mark.skipif(GPU, reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("module", [("cuflash", "warmup"), ("cuflash.warmup",)])
def test_warmup_without_a_gpu_says_why_in_one_line(module):
    done = _run(*module)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no GPU: " in done.stderr


def test_demo_on_the_cpu_ends_with_a_verdict():
    done = _run("cuflash.demo", "--cpu", "--seqlen", "96")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NumPy path; no GPU: --cpu was given" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("PASS")


class _FakeRuntime:
    def __init__(self, devices, driver):
        self.devices, self.driver = devices, driver

    def getDeviceCount(self):
        if isinstance(self.devices, Exception):
            raise self.devices
        return self.devices

    def driverGetVersion(self):
        return self.driver


@pytest.mark.parametrize("devices, driver, reason", [
    (RuntimeError("cudaErrorInsufficientDriver"), 0, "no CUDA driver is installed"),
    (RuntimeError("cudaErrorInsufficientDriver"), 12000, "CUDA is not usable (cudaErrorInsufficientDriver)"),
    (0, 13000, "no CUDA device is visible"),
    (1, 13000, None),
])
def test_the_reason_there_is_no_gpu(monkeypatch, devices, driver, reason):
    from types import SimpleNamespace

    from cuflash._env import gpu_unavailable_reason

    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=_FakeRuntime(devices, driver)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert gpu_unavailable_reason() == reason
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert gpu_unavailable_reason().startswith("CuPy is not installed")


def test_the_sanitizer_driver_runs_its_cases_on_the_numpy_path():
    # tools/sanitize.py is what compute-sanitizer runs on the GPU; --numpy runs the same calls without kernels, so a
    # change of the API it calls fails here rather than on the device
    done = subprocess.run([sys.executable, str(REPO / "tools" / "sanitize.py"), "--numpy"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) >= 10 and all(line.endswith(": ok") for line in lines), lines
