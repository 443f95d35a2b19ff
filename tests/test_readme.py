"""The README's API examples run as written: the NumPy one everywhere, the CuPy one on a GPU."""

from __future__ import annotations

import pathlib
import re

import pytest

from .conftest import requires_gpu

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_a_numpy_and_a_cupy_example():
    first, second = _examples()
    assert "import numpy as np" in first and "cupy" not in first
    assert "import cupy as cp" in second


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=requires_gpu)], ids=["numpy", "cupy"])
def test_example_runs(index):
    scope: dict = {}
    exec(compile(_examples()[index], f"README.md example {index + 1}", "exec"), scope)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert name in scope
    assert scope["dq"].shape == scope["q"].shape and scope["dk"].shape == scope["k"].shape
