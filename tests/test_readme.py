"""The README's API examples run as written: the NumPy one everywhere, the CuPy and decoding ones on a GPU."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from .conftest import GPU_COUNT, NCCL, requires_gpu

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _examples() -> list[str]:
    """The README's Python blocks, dedented (a block inside a list item is indented with it)."""
    return [textwrap.dedent(block) for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)]


def test_the_readme_has_a_numpy_a_cupy_a_decoding_and_two_ring_examples():
    first, second, decoding, ring_local, ring_nccl = _examples()
    assert "import numpy as np" in first and "cupy" not in first
    assert "import cupy as cp" in second
    assert "import cupy as cp" in decoding and "attention_with_kvcache" in decoding
    assert "run_local" in ring_local and "cupy" not in ring_local
    assert "NcclCommunicator" in ring_nccl and "ring_attention" in ring_nccl


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=requires_gpu)], ids=["numpy", "cupy"])
def test_example_runs(index):
    scope: dict = {}
    exec(compile(_examples()[index], f"README.md example {index + 1}", "exec"), scope)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert name in scope
    assert scope["dq"].shape == scope["q"].shape and scope["dk"].shape == scope["k"].shape
    if index == 0:   # and the float8 forward's
        assert scope["out8"].shape == scope["q"].shape and scope["out8"].dtype.name == "bfloat16"


@requires_gpu
def test_decoding_example_runs():
    scope: dict = {}
    exec(compile(_examples()[2], "README.md example 3", "exec"), scope)
    assert scope["out"].shape == scope["q"].shape
    assert int(scope["lengths"].get().max()) == 1  # one step appended
    assert bool((scope["k_cache"][:, 0] == scope["k"][:, 0]).all())  # written at position 0


def test_ring_example_runs():
    """The local group's ring (NumPy, four ranks in threads) runs and asserts its own result."""
    scope: dict = {}
    exec(compile(_examples()[3], "README.md example 4", "exec"), scope)
    assert scope["out"].shape == scope["q"].shape


def test_ring_launcher_example_runs(tmp_path):
    """The one-process-per-GPU launcher compiles everywhere; it runs (to completion, every rank) where CuPy
    sees two GPUs or more and has NCCL."""
    source = _examples()[4]
    compile(source, "README.md example 5", "exec")
    if GPU_COUNT < 2 or not NCCL:
        pytest.skip("needs two GPUs and CuPy's NCCL")
    script = tmp_path / "ring_launcher.py"
    script.write_text(source + "\n    assert all(p.exitcode == 0 for p in ranks)\n")
    subprocess.run([sys.executable, str(script)], check=True, timeout=600)
