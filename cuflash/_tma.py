"""TMA tensor maps for the Hopper kernels (``TmaMap`` in kernels/hopper.cuh), encoded on the host by the CUDA
driver's ``cuTensorMapEncodeTiled`` through cuda-bindings.

A map describes one (batch, seqlen, heads, head_dim) array as it lies in memory, as a 4-D tensor (column, head,
row, batch) whose boxes are [rows][128 bytes of columns] with the 128-byte swizzle (or [rows][64 bytes] with the
64-byte swizzle: the float8 forward's rows of 64 bytes); columns past head_dim and rows past the sequence read
as zeros. TMA needs the array's address and its batch, row and head strides to be multiples of
16 bytes (``strides_ok``; the plan runs the mma.sync kernels where they are not, and copies an array whose
address is not).

Encoding costs microseconds of host time: maps are cached by everything they are made of (the pointer
included), so a call on the same buffers as an earlier one reuses them.
"""

from __future__ import annotations

import functools

import numpy as np

from ._config import BFLOAT16, SWIZZLE_BYTES

#: the bytes TMA wants the address and each stride to be a multiple of
ALIGNMENT = 16
#: maps kept (three per forward call: q, k, v)
CACHED_MAPS = 192


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Can this process encode tensor maps (cuda-bindings' driver module importable)?"""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def strides_ok(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Can a tensor map describe an array of ``shape`` (batch, rows, heads, head_dim) with element ``strides``
    (batch, row, head)? Its rows must be whole multiples of ALIGNMENT bytes and so must every stride of an axis
    longer than one (an axis of one element never moves: map_strides gives it a stride TMA accepts)."""
    *outer, head_dim = shape
    return head_dim * itemsize % ALIGNMENT == 0 and all(
        n == 1 or (s > 0 and s * itemsize % ALIGNMENT == 0) for n, s in zip(outer, strides))


@functools.lru_cache(maxsize=1)
def _map_dtype() -> np.dtype:
    """A CUtensorMap as a by-value kernel argument: a structured scalar of 16 words, 64-byte aligned (CuPy
    passes structured NumPy scalars by value)."""
    import cupy

    return cupy.make_aligned_dtype(np.dtype([(f"w{i}", np.uint64) for i in range(16)]), alignment=64)


def _data_type(dtype: np.dtype):
    """bfloat16, float16, or bytes (uint8: float8 e4m3 bit patterns)."""
    from cuda.bindings import driver

    kinds = driver.CUtensorMapDataType
    return {BFLOAT16: kinds.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            np.dtype(np.float16): kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            np.dtype(np.uint8): kinds.CU_TENSOR_MAP_DATA_TYPE_UINT8}[np.dtype(dtype)]


@functools.lru_cache(maxsize=CACHED_MAPS)
def _encode(pointer: int, dtype: np.dtype, shape: tuple[int, int, int, int], strides: tuple[int, int, int],
            box_rows: int, row_bytes: int):
    from cuda.bindings import driver

    swizzles = {SWIZZLE_BYTES: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                SWIZZLE_BYTES // 2: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}

    batch, rows, heads, head_dim = shape
    itemsize = dtype.itemsize
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        _data_type(dtype), 4, pointer,
        [driver.cuuint64_t(n) for n in (head_dim, heads, rows, batch)],
        [driver.cuuint64_t(s * itemsize) for s in reversed(strides)],          # head, row, batch (bytes)
        [driver.cuuint32_t(n) for n in (row_bytes // itemsize, 1, box_rows, 1)],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzles[row_bytes],
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for shape {shape}, element strides {strides}")
    return np.array(tuple(int(w) for w in tensor_map.opaque), dtype=_map_dtype())[()]


def map_strides(itemsize: int, shape: tuple[int, ...], strides: tuple[int, int, int]) -> tuple[int, int, int]:
    """Element ``strides`` (batch, row, head) of an array of ``shape`` as a tensor map takes them, where strides_ok
    holds: an axis of one element never moves, and gets the array's span as its stride, a multiple of ALIGNMENT
    that TMA accepts. A plan computes them once (tensor_map runs per call)."""
    span = -(-max(n * s for n, s in zip(shape, strides)) * itemsize // ALIGNMENT) * ALIGNMENT // itemsize
    return tuple(span if n == 1 else s for n, s in zip(shape, strides))


def tensor_map(x, shape: tuple[int, int, int, int], strides: tuple[int, int, int], box_rows: int,
               row_bytes: int = SWIZZLE_BYTES):
    """The tensor map of ``x`` (a CuPy array, float16, bfloat16 or uint8, its address ALIGNMENT-aligned) seen as
    ``shape`` (batch, rows, heads, head_dim; a packed (total, heads, head_dim) array is (1, total, heads,
    head_dim)) with element strides ``strides`` from map_strides (batch, row, head; the last axis contiguous).
    Boxes of ``box_rows`` rows of ``row_bytes`` (128 or 64), with the swizzle of that width."""
    return _encode(x.data.ptr, x.dtype, shape, strides, box_rows, row_bytes)
