"""The GPU path: choose the kernels for a problem, get them compiled, launch them on CuPy's stream."""

from __future__ import annotations

import functools

import numpy as np

from . import _config
from ._compile import get_kernel
from ._validate import Problem

LOG2E = float(np.log2(np.e))


@functools.lru_cache(maxsize=None)
def device_props(device_id: int) -> _config.DeviceProps:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return _config.DeviceProps(compute_capability=10 * props["major"] + props["minor"],
                               max_smem_per_block=props["sharedMemPerBlockOptin"],
                               sm_count=props["multiProcessorCount"])


def _readable(x):
    """``x`` itself when its last axis is contiguous and its strides are whole elements, else one copy."""
    import cupy

    itemsize = x.dtype.itemsize
    if x.size and (x.strides[-1] != itemsize and x.shape[-1] > 1 or any(s % itemsize for s in x.strides)):
        return cupy.ascontiguousarray(x)
    return x


def _strides(x) -> list[np.int64]:
    """(batch, seq, head) strides in elements."""
    return [np.int64(s // x.dtype.itemsize) for s in x.strides[:3]]


def _vector_aligned(head_dim: int, *arrays) -> bool:
    """Can every row be read as 16-byte chunks (cp.async)?"""
    elems = 16 // arrays[0].dtype.itemsize
    return head_dim % elems == 0 and all(
        x.data.ptr % 16 == 0 and all(int(s) % elems == 0 for s in _strides(x)) for x in arrays)


def _grid(blocks: int) -> tuple[int]:
    if blocks >= 2**31:
        raise ValueError(f"problem too large: {blocks} thread blocks (at most 2**31 - 1)")
    return (max(blocks, 1),)


def _banded_grid(tiles_per_head: int, pairs: int, device_id: int) -> tuple[int, int]:
    """(tiles of one band, bands): the grid of the kernels that decode KeyBlock (kernels/common.cuh)."""
    band = _config.block_band(tiles_per_head, pairs, device_props(device_id).sm_count)
    return _grid(tiles_per_head * band)[0], pairs // band


def forward(q, k, v, p: Problem, spec: _config.KernelSpec | None = None):
    """out, lse; ``spec`` overrides the tile table's forward kernel (for tuning tools)."""
    import cupy

    device_id = q.device.id
    with q.device:
        q, k, v = _readable(q), _readable(k), _readable(v)
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((p.batch, p.heads, p.seqlen_q), np.float32)
        if spec is None:
            spec = _config.choose_config(p.head_dim, p.dtype, p.causal, device_props(device_id)).forward
        kernel = get_kernel(spec, device_id)
        m_blocks = -(-p.seqlen_q // spec.block_m)
        args = (q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
                np.int32(p.batch), np.int32(p.heads), np.int32(p.group), np.int32(p.seqlen_q),
                np.int32(p.seqlen_k), np.int32(p.head_dim), np.float32(p.softmax_scale * LOG2E),
                np.int32(_vector_aligned(p.head_dim, q, k, v)),
                np.int32(_config.forward_query_blocks_fastest(spec.head_dim, p.causal)))
        kernel(_grid(m_blocks * p.batch * p.heads), (spec.threads,), args, shared_mem=spec.smem_bytes)
    return out, lse


def backward(dout, q, k, v, out, lse, p: Problem, deterministic: bool = False,
             cfg: _config.AttentionConfig | None = None):
    """dq, dk, dv; ``cfg`` overrides the tile table's backward kernels (for tuning tools).

    The default adds dQ with float32 atomics inside the dK/dV kernels (where the config has them:
    float16/bfloat16). ``deterministic`` runs the same kernel on the split grid, one float32 dQ buffer per
    split, or, where that grid would leave SMs idle, the separate dQ kernel
    (``_config.deterministic_dq_splits``).
    """
    import cupy

    device_id = q.device.id
    with q.device:
        dout, q, k, v, out = (_readable(x) for x in (dout, q, k, v, out))
        lse = cupy.ascontiguousarray(lse)
        props = device_props(device_id)
        if cfg is None:
            cfg = _config.choose_config(p.head_dim, p.dtype, p.causal, props)
        pairs = p.batch * p.heads_kv
        dq_splits = _config.deterministic_dq_splits(cfg, pairs, p.seqlen_k, props.sm_count) if deterministic else 0
        adds_dq = bool(cfg.bwd_dkdv_atomic) and (not deterministic or dq_splits > 0)
        dq = cupy.empty(q.shape, q.dtype)
        dk = cupy.empty(k.shape, k.dtype)
        dv = cupy.empty(v.shape, v.dtype)
        delta = cupy.empty((p.batch, p.heads, p.seqlen_q), np.float32)
        # float32, per copy (one per split of the deterministic split grid, else one) and (batch, head):
        # dq_accum_rows(seqlen_q) x specialized head dim in mma-fragment order (DqAccum in
        # kernels/common.cuh); O(seqlen) per (batch, head)
        copies = max(dq_splits, 1)
        dq_accum = (cupy.zeros((copies, p.batch, p.heads, _config.dq_accum_rows(p.seqlen_q),
                                cfg.bwd_dq_convert.head_dim), np.float32) if adds_dq else None)

        rows = p.batch * p.heads * p.seqlen_q
        lanes = _config.preprocess_lanes(p.head_dim, q.dtype.itemsize)
        get_kernel(cfg.bwd_preprocess, device_id)(
            _grid(-(-rows * lanes // cfg.bwd_preprocess.threads)), (cfg.bwd_preprocess.threads,),
            (dout, out, delta, *_strides(dout), *_strides(out), np.int32(p.batch), np.int32(p.heads),
             np.int32(p.seqlen_q), np.int32(p.head_dim), np.int32(lanes),
             np.int32(_vector_aligned(p.head_dim, dout, out))))

        args = (q, k, v, dout, lse, delta, dq, dk, dv,
                dq_accum if adds_dq else np.uint64(0),  # a null float* where dQ has its own kernel
                *_strides(q), *_strides(k), *_strides(v),
                *_strides(dout), *_strides(dq), *_strides(dk), np.int32(p.batch), np.int32(p.heads),
                np.int32(p.group), np.int32(p.seqlen_q), np.int32(p.seqlen_k), np.int32(p.head_dim),
                np.float32(p.softmax_scale), np.float32(p.softmax_scale * LOG2E),
                np.int32(_vector_aligned(p.head_dim, q, k, v, dout)), np.int32(dq_splits))
        for spec in cfg.bwd_dkdv_atomic if adds_dq else cfg.bwd_dkdv:
            kernel = get_kernel(spec, device_id)
            key_blocks = -(-p.seqlen_k // spec.block_n)
            if dq_splits:  # the split grid: one launch per pass, in order (KeyBlock in kernels/common.cuh)
                for dq_pass in range(-(-key_blocks // dq_splits)):
                    kernel(_grid(pairs * dq_splits), (spec.threads,), (*args, np.int32(dq_pass)),
                           shared_mem=spec.smem_bytes)
            else:
                kernel(_banded_grid(key_blocks, pairs, device_id), (spec.threads,), (*args, np.int32(0)),
                       shared_mem=spec.smem_bytes)
        if adds_dq:
            spec = cfg.bwd_dq_convert
            tile_rows = dq_accum.size // copies // 8  # one thread per row of a 16 x 8 tile
            get_kernel(spec, device_id)(
                _grid(-(-tile_rows // spec.threads)), (spec.threads,),
                (dq_accum, dq, *_strides(dq), np.int32(p.batch), np.int32(p.heads), np.int32(p.seqlen_q),
                 np.int32(p.head_dim), np.float32(p.softmax_scale), np.int32(copies)))
        else:
            spec = cfg.bwd_dq
            m_blocks = -(-p.seqlen_q // spec.block_m)
            get_kernel(spec, device_id)(_grid(m_blocks * p.batch * p.heads), (spec.threads,),
                                        (*args, np.int32(0)), shared_mem=spec.smem_bytes)
    return dq, dk, dv
