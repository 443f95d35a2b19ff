"""The agreement rule between implementations (pure; works on NumPy or CuPy arrays).

Rule: for each output tensor, ``max|got - want| <= tolerance * max|want|``. Scaling by the largest
reference value makes one rule fit outputs and gradients of any magnitude; the tolerance is a few
times the rounding of one low-precision store (bfloat16 keeps 8 significant bits, float16 11), loose
enough for a different summation order, far below what a wrong mask or a wrong scale gives.
"""

from __future__ import annotations

import numpy as np

#: Relative tolerance per dtype name. float8 e4m3 keeps 3 fraction bits (bfloat16 7): on the grid's
#: standard-normal inputs quantized per (batch, kv head) the float8 forward's output differs from the 16-bit
#: forward's by up to 0.113 of its largest value (H200, head_dim 64, seqlen 1k, float16 inputs).
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4, "float8_e4m3fn": 2e-1}
#: Denominator floor so an all-zero reference does not divide by zero.
TINY = 1e-30


class Mismatch(ValueError):
    """Two implementations disagree beyond TOLERANCE."""


def relative_error(got, want) -> float:
    """``max|got - want| / max|want|``, in float32 (float64 for a float64 reference).

    Arrays of different kinds (CuPy against NumPy) are compared on the host.
    """
    if type(got).__module__ != type(want).__module__:
        got, want = (x.get() if hasattr(x, "get") else x for x in (got, want))
    compute = np.float64 if want.dtype == np.float64 else np.float32
    got, want = got.astype(compute), want.astype(compute)
    return float(abs(got - want).max()) / max(float(abs(want).max()), TINY)


def check_outputs(got: tuple, want: tuple, names: tuple[str, ...], dtype: str,
                  tolerance_factor: float = 1.0) -> dict[str, float]:
    """Relative error of every output; raises :class:`Mismatch` naming the ones beyond the tolerance
    (``TOLERANCE[dtype]`` times ``tolerance_factor``, an implementation's own rounding beyond the fused
    kernels': ``NaiveCupy.tolerance_factor``).

    NaN compares as a mismatch.
    """
    tolerance = TOLERANCE[dtype] * tolerance_factor
    errors = {name: relative_error(g, w) for name, g, w in zip(names, got, want, strict=True)}
    bad = {name: err for name, err in errors.items() if not err <= tolerance}
    if bad:
        detail = ", ".join(f"{name}: {err:.3g}" for name, err in bad.items())
        raise Mismatch(f"relative error above {tolerance:g} ({detail})")
    return errors
