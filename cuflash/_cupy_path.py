"""The GPU path: plan the kernels of a problem once, then launch them on CuPy's current stream per call.

A plan holds everything a call of one (shapes, strides, dtypes, device, options) needs: the launches
``_plan`` chose (kernels, grids, bands, dQ splits), compiled, and every by-value launch argument,
converted once. ``run`` only
allocates the outputs, checks the arrays' 16-byte alignment (a pointer property, not part of the key)
and launches. Nothing in ``run`` synchronizes the host or touches the null stream, so a call can be
captured into a CUDA graph (``cupy.cuda.Stream.begin_capture``) once its kernels are compiled.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _config, _params, _philox, _plan, _tma
from ._compile import get_kernel
from ._validate import CacheProblem, Problem

LOG2E = float(np.log2(np.e))

try:  # the module imports without CuPy (tests, tools); its plans need it
    import cupy
except ImportError:
    cupy = None
try:  # CuPy hands a CPointer to the driver as it is; a numpy scalar it converts on every launch
    from cupy.cuda.function import CNumpyArray as _CNumpyArray
except ImportError:  # CuPy without the class (or none): numpy scalars, converted per launch
    _CNumpyArray = None


def _by_value(value, dtype):
    """A kernel argument passed by value, converted to its C type once."""
    if _CNumpyArray is None:
        return np.dtype(dtype).type(value)
    return _CNumpyArray(np.array(value, dtype))


def _int32(value):
    return _by_value(value, np.int32)


#: the kernels' ``int vec_ok`` argument: may rows be read as 16-byte chunks (cp.async)?
_VECTOR_OK = (_int32(0), _int32(1))
#: a null ``float*`` (no lse to store; the dQ accumulator where dQ has its own kernel)
_NULL = _by_value(0, np.uint64)


#: the oldest NVRTC seen to take the Hopper kernels' -arch=sm_90a beside the -arch CuPy adds (12.4 refuses the
#: second one)
SM90A_NVRTC = (12, 9)


@functools.lru_cache(maxsize=1)
def _sm90a_compiles() -> bool:
    """Does CuPy's NVRTC compile the Hopper kernels (SM90A_NVRTC or newer)?"""
    try:
        return tuple(cupy.cuda.nvrtc.getVersion()) >= SM90A_NVRTC
    except Exception:  # no NVRTC loadable: no kernel compiles, and the first call says why
        return False


@functools.lru_cache(maxsize=None)
def device_props(device_id: int) -> _config.DeviceProps:
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    compute_capability = 10 * props["major"] + props["minor"]
    return _config.DeviceProps(compute_capability=compute_capability,
                               max_smem_per_block=props["sharedMemPerBlockOptin"],
                               sm_count=props["multiProcessorCount"], l2_bytes=props["l2CacheSize"],
                               tensor_maps=compute_capability == 90 and _tma.available() and _sm90a_compiles())


def _needs_copy(x) -> bool:
    """Must ``x`` be copied before a kernel reads it? Yes unless its last axis is contiguous and its strides
    are whole elements."""
    itemsize = x.dtype.itemsize
    return bool(x.size) and (x.strides[-1] != itemsize and x.shape[-1] > 1 or any(s % itemsize for s in x.strides))


def _readable(x, copy: bool):
    return cupy.ascontiguousarray(x) if copy else x


def _contiguous_strides(shape) -> tuple[int, int, int]:
    """(batch, seq, head) element strides of a C-contiguous array of ``shape`` (the outputs, the copies)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))[:3]


def _strides_of(x, copy: bool) -> tuple[int, int, int]:
    """(batch, seq, head) element strides of ``x`` as a kernel reads it (after the copy, if any)."""
    return _contiguous_strides(x.shape) if copy else tuple(s // x.dtype.itemsize for s in x.strides[:3])


def _strides_vector_ok(head_dim: int, itemsize: int, *strides) -> bool:
    """The shape half of the 16-byte-chunk test: head_dim and every stride are whole chunks."""
    elems = 16 // itemsize
    return head_dim % elems == 0 and all(s % elems == 0 for triple in strides for s in triple)


def _problem_fields(p: Problem) -> dict:
    """The kernel fields every attention kernel of a problem shares (kernels/common.cuh): sizes, the
    Window (diagonal, left, right: ``Problem.kernel_window``), ScoreMod's and Dropout's values: ALiBi's batch
    stride (0 for slopes of shape (heads,)), softcap_in = scale / softcap, softcap_out = softcap * log2(e),
    dropout's threshold (_philox.keep_threshold) and scale 1 / (1 - dropout_p), and the base-2 softmax scale."""
    window_left, window_right = p.kernel_window
    return dict(
        batch=p.batch, heads=p.heads, group=p.group, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
        head_dim=p.head_dim, diagonal=p.diagonal, window_left=window_left, window_right=window_right,
        alibi_batch_stride=p.heads if p.alibi_shape is not None and len(p.alibi_shape) == 2 else 0,
        softcap_in=p.softmax_scale / p.softcap if p.softcap else 0.0, softcap_out=p.softcap * LOG2E,
        dropout_threshold=_philox.keep_threshold(p.dropout_p), dropout_scale=1.0 / (1.0 - p.dropout_p),
        scale_log2=p.softmax_scale * LOG2E)


def _stride_fields(**strides) -> dict:
    """{name}_sb, {name}_ss, {name}_sh of each (batch, seq, head) element-stride triple."""
    return {f"{name}_{axis}": s for name, triple in strides.items() for axis, s in zip(("sb", "ss", "sh"), triple)}


def _tail_fields(field_list, tail: tuple[int, ...]) -> dict:
    """A plan launch's tail (_plan.Launch: the int32 arguments that end the parameter list) by field name."""
    return dict(zip([f.name for f in field_list[len(field_list) - len(tail):]], tail))


#: the forward's arguments that change from call to call, in the order ForwardPlan passes them
FORWARD_PER_CALL = ("q", "k", "v", "out", "lse", "alibi_slopes", "sinks", "dropout_seed", "dropout_offset",
                    "vec_ok")
#: the same for the backward's attention kernels (BackwardPlan)
BACKWARD_PER_CALL = ("q", "k", "v", "dout", "lse", "delta", "dq", "dk", "dv", "dq_accum", "dq_order",
                     "alibi_slopes", "dropout_seed", "dropout_offset", "vec_ok")


#: the KV-cache fields (CUFLASH_FWD_FIELDS, kernels/common.cuh) of a forward that reads no cache
NO_CACHE_FIELDS = dict(cache_seqlens=_NULL, block_table=_NULL, cache_leftpad=_NULL, out_partial=_NULL,
                       lse_partial=_NULL, split_counters=_NULL, block_table_stride=0, seqlen_k_new=0, pack=1,
                       num_splits=1, page_size=0)
#: the float8 fields (q_descale, k_descale, v_descale and their strides per batch and kv head) of a forward of
#: another dtype
NO_FLOAT8_FIELDS = dict(q_descale=_NULL, k_descale=_NULL, v_descale=_NULL, descale_sb=0, descale_sh=0)
#: a float8 forward's descale factors, its per-call arguments after the others'
FLOAT8_PER_CALL = ("q_descale", "k_descale", "v_descale")


def _float8_strides(p: Problem) -> dict:
    """A float8 forward's descale strides per batch and kv head: (heads_kv, 1) for factors of shape (batch,
    heads_kv), (0, 0) for one per tensor (a factor not given is a null pointer: 1)."""
    per_head = {len(shape) == 2 for shape in p.descale_shapes if shape is not None}
    if len(per_head) > 1:
        raise NotImplementedError("the float8 kernel takes its factors all per tensor or all per (batch, kv head); "
                                  "broadcast the per-tensor ones to (batch, heads_kv)")
    return dict(descale_sb=p.heads_kv, descale_sh=1) if True in per_head else dict(descale_sb=0, descale_sh=0)


#: a packed batch's prefix sums, the per-call arguments of the packed plans after the others'
PACKED_PER_CALL = ("cu_seqlens_q", "cu_seqlens_k")
#: the same fields of a dense batch
DENSE_FIELDS = dict(cu_seqlens_q=_NULL, cu_seqlens_k=_NULL)


def _packed_strides(x, copy: bool) -> tuple[int, int, int]:
    """(batch, seq, head) element strides of a packed (total, heads, head_dim) array as the packed kernels read
    it (after the copy, if any): batch stride 0 (a sequence's rows come from cu_seqlens), then row and head."""
    rows, heads = _contiguous_strides(x.shape)[:2] if copy else (s // x.dtype.itemsize for s in x.strides[:2])
    return 0, rows, heads


#: the dropout seed and offset arguments of a call without dropout (the kernels do not read them)
_NO_DROPOUT = (_by_value(0, np.uint64), _by_value(0, np.uint32))


def _dropout_args(p: Problem, seed: int, offset: int) -> tuple:
    """The kernels' dropout_seed and dropout_offset, per call (they change from call to call)."""
    if not p.dropout_p:
        return _NO_DROPOUT
    return _by_value(seed, np.uint64), _by_value(offset, np.uint32)


def _vector(x):
    """A vector argument (ALiBi slopes, sinks, a packed batch's prefix sums) as the kernels read it: contiguous,
    or null."""
    return _NULL if x is None else cupy.ascontiguousarray(x)


def _run_on(device_id: int, run, *args):
    """``run(*args)`` with ``device_id`` current: directly where it already is (the common case; entering a
    device's context costs half a microsecond)."""
    if cupy.cuda.runtime.getDevice() == device_id:
        return run(*args)
    with cupy.cuda.Device(device_id):
        return run(*args)


def _tensor_maps(arrays, planned) -> tuple[tuple, list]:
    """The tensor maps of ``arrays`` (q, k, v[, dout]) as a plan planned them (``planned``: each one's shape,
    strides, box rows and box row bytes), and the copies they describe. A view whose address TMA cannot take is copied
    (new memory is aligned); the caller holds the copies until the kernel is queued, so that no allocation
    in between (a work counter, say) takes their memory back from CuPy's pool before the kernel reads it."""
    maps, copies = [], []
    for x, (shape, strides, box_rows, row_bytes) in zip(arrays, planned):
        if x.data.ptr % _tma.ALIGNMENT:
            x, strides = x.copy(), _tma.map_strides(x.dtype.itemsize, shape, _contiguous_strides(shape))
            copies.append(x)
        maps.append(_tma.tensor_map(x, shape, strides, box_rows, row_bytes))
    return tuple(maps), copies


class ForwardPlan:
    """The forward of one problem on one device: one kernel launch. ``packed``: q, k and v are a packed batch
    (attention_varlen; ``p`` its batch of the longest lengths), whose prefix sums each call passes. The Hopper
    kernel (fwd_wgmma) reads q, k and v through tensor maps made per call (_tma, cached), and on a persistent
    grid (``_plan.Launch.work_counter``; ``persistent`` overrides the table) its work items from counters kept
    per stream (split_counters), which the kernel leaves zeroed; on a packed batch, in the order that
    varlen_order writes before it into a buffer of each call's (``_plan.Launch.order``)."""

    def __init__(self, p: Problem, device_id: int, q, k, v, spec: _config.KernelSpec | None = None,
                 packed: bool = False, persistent: bool | None = None):
        self.problem = p
        self.device_id = device_id
        self.copies = tuple(_needs_copy(x) for x in (q, k, v))
        if p.dtype == _config.FLOAT8_E4M3 and not v.flags.c_contiguous:   # the V^T transpose reads v contiguous
            self.copies = self.copies[:2] + (True,)
        itemsize = q.dtype.itemsize
        strides_of = _packed_strides if packed else _strides_of
        strides = [strides_of(x, c) for x, c in zip((q, k, v), self.copies)]
        # the (batch, rows, heads, head_dim) a tensor map sees: a packed batch is one sequence of its rows
        map_shapes = [(1, *x.shape) if packed else tuple(x.shape) for x in (q, k, v)]
        tensor_maps = all(_tma.strides_ok(itemsize, shape, s) for shape, s in zip(map_shapes, strides))
        launch = _plan.forward(p, device_props(device_id), spec, packed, tensor_maps, persistent,
                               total_q=q.shape[0] if packed else None, total_k=k.shape[0] if packed else None)
        with cupy.cuda.Device(device_id):
            self.kernel = get_kernel(launch.spec, device_id)
            # the packed Hopper forward's item order, written into a buffer of order_ints by its own launch
            self.order = None if launch.order is None else _Launch(launch.order, device_id)
            # the float8 forward's V^T, written into a buffer of transpose_shape by its own launch from v (16-byte
            # rows, aligned: copied where not)
            self.transpose = None
            if launch.transpose is not None:
                self.transpose = _Launch(launch.transpose, device_id, (
                    *(_by_value(s, np.int64) for s in strides[2]),
                    *(_int32(n) for n in (p.seqlen_k, launch.transpose_shape[3], p.heads_kv))))
        self.transpose_shape = launch.transpose_shape
        self.order_ints = launch.order_ints
        self.grid = launch.grid
        self.block = (launch.spec.threads,)
        self.smem = launch.spec.smem_bytes
        # fwd_wgmma's maps: (shape, strides, box rows, box row bytes) of q (a block's rows), k and v (a key tile's)
        self.maps = None
        self.work_counter = launch.work_counter
        if launch.spec.kernel == "fwd_wgmma":
            box_rows = (launch.spec.block_m, launch.spec.block_n, launch.spec.block_n)
            map_strides = [_tma.map_strides(itemsize, shape, s) for shape, s in zip(map_shapes, strides)]
            if launch.transpose is not None:   # v's map is V^T's: (batch, head_dim rows, kv heads, keys) in boxes
                # of every head_dim row (fwd_wgmma's float8 V stage)
                batch, heads_kv, head_dim, keys = launch.transpose_shape
                map_shapes[2], map_strides[2] = (batch, head_dim, heads_kv, keys), (heads_kv * head_dim * keys, keys,
                                                                                       head_dim * keys)
                box_rows = box_rows[:2] + (launch.spec.head_dim,)
            self.maps = tuple(zip(map_shapes, map_strides, box_rows, _config.wgmma_row_bytes(launch.spec)))
        # float8: the kernel writes bfloat16 (Output<T>), converted where out_dtype asks for float16
        self.out_shape, self.dtype = tuple(q.shape), _config.BFLOAT16 if launch.transpose is not None else q.dtype
        self.output_dtype = p.output_dtype
        self.lse_shape = (p.heads, q.shape[0]) if packed else (p.batch, p.heads, p.seqlen_q)
        strides.append(strides_of(q, True))  # out, contiguous
        self.strides_vector_ok = _strides_vector_ok(p.head_dim, itemsize, *strides)
        fields = _params.forward_fields()
        float8 = launch.transpose is not None
        fixed = {**_stride_fields(q=strides[0], k=strides[1], v=strides[2], o=strides[3]), **_problem_fields(p),
                 **_tail_fields(fields, launch.tail), **NO_CACHE_FIELDS,
                 **(_float8_strides(p) if float8 else NO_FLOAT8_FIELDS), **({} if packed else DENSE_FIELDS)}
        per_call = FORWARD_PER_CALL + (PACKED_PER_CALL if packed else ()) + (FLOAT8_PER_CALL if float8 else ())
        self.arguments = _params.Arguments(fields, fixed, per_call, _by_value)

    def run(self, q, k, v, alibi_slopes=None, sinks=None, seed=0, offset=0, with_lse: bool = True,
            cu_seqlens=(), descales=(None, None, None)):
        """out, and lse where ``with_lse`` (else None: the kernel stores none), on CuPy's current stream.
        ``alibi_slopes``, ``sinks``, ``seed`` and ``offset`` are read where the problem has them;
        ``cu_seqlens`` is a packed plan's (cu_seqlens_q, cu_seqlens_k), int32; ``descales`` a float8 plan's
        (q_descale, k_descale, v_descale), each float32 or None (1)."""
        return _run_on(self.device_id, self._launch, q, k, v, alibi_slopes, sinks,
                       _dropout_args(self.problem, seed, offset), with_lse, tuple(map(_vector, cu_seqlens)),
                       tuple(map(_vector, descales)) if self.transpose is not None else ())

    def _launch(self, q, k, v, alibi_slopes, sinks, dropout, with_lse, cu_seqlens, descales):
        copy_q, copy_k, copy_v = self.copies
        if copy_q or copy_k or copy_v:
            q, k, v = _readable(q, copy_q), _readable(k, copy_k), _readable(v, copy_v)
        # cupy.ndarray: uninitialized, from the current device's pool (cupy.empty without its wrapper)
        out = cupy.ndarray(self.out_shape, self.dtype)
        lse = cupy.ndarray(self.lse_shape, np.float32) if with_lse else None
        vector_ok = self.strides_vector_ok and not (q.data.ptr | k.data.ptr | v.data.ptr) & 15
        if self.transpose is not None:   # float8: V^T first; fwd_wgmma reads it through v's map, not v
            if v.data.ptr % _tma.ALIGNMENT:
                v = v.copy()
            vt = cupy.ndarray(self.transpose_shape, np.uint8)
            self.transpose((v, vt))
            v = vt
        maps, copies = _tensor_maps((q, k, v), self.maps) if self.maps else ((), ())
        if self.maps:   # fwd_wgmma's work counter follows its maps (the stream's zeroed ints on a persistent
            # grid), then the item order
            counter = split_counters(self.device_id, _config.WGMMA_WORK_COUNTER_INTS) if self.work_counter else _NULL
            order = _NULL
            if self.order is not None:
                order = cupy.ndarray((self.order_ints,), np.int32)
                self.order((order,) + cu_seqlens)
            maps += (counter, order)
        self.kernel(self.grid, self.block,
                    maps + self.arguments((q, k, v, out, _NULL if lse is None else lse, _vector(alibi_slopes),
                                           _vector(sinks)) + dropout + (_VECTOR_OK[vector_ok],) + cu_seqlens
                                          + descales),
                    shared_mem=self.smem)
        del copies   # queued: their memory may go back to the pool (stream order protects it)
        if out.dtype != self.output_dtype:
            out = out.astype(self.output_dtype)
        return out, lse


class _Launch:
    """One kernel launch of a plan (``_plan.Launch``), compiled: the kernel, its grid and block, shared
    memory, trailing arguments (the plan's int32 tail, then ``extra``). For the helper kernels, whose
    short parameter lists are positional."""

    __slots__ = ("kernel", "grid", "block", "smem", "tail")

    def __init__(self, launch: _plan.Launch, device_id: int, extra: tuple = ()):
        spec = launch.spec
        self.kernel = get_kernel(spec, device_id)
        self.grid, self.block, self.smem = launch.grid, (spec.threads,), spec.smem_bytes
        self.tail = tuple(_int32(n) for n in launch.tail) + extra

    def __call__(self, args: tuple):
        self.kernel(self.grid, self.block, args + self.tail, shared_mem=self.smem)


class _AttentionLaunch:
    """One launch of a backward attention kernel, compiled: its arguments by field name (``_params``), the
    plan's fixed ones with its tail (dq_splits, dq_pass), the per-call ones (BACKWARD_PER_CALL) given to
    ``__call__`` in that order. A Hopper kernel (bwd_dkdv_wgmma) takes the tensor maps of q, k, v and dout
    first: ``maps`` holds each one's planned (shape, strides, box rows) (_tensor_maps)."""

    __slots__ = ("kernel", "grid", "block", "smem", "arguments", "maps")

    def __init__(self, launch: _plan.Launch, device_id: int, fixed: dict, packed: bool = False, maps=None):
        spec = launch.spec
        self.kernel = get_kernel(spec, device_id)
        self.grid, self.block, self.smem = launch.grid, (spec.threads,), spec.smem_bytes
        fields = _params.backward_fields()
        self.arguments = _params.Arguments(fields, {**fixed, **_tail_fields(fields, launch.tail)},
                                           BACKWARD_PER_CALL + (PACKED_PER_CALL if packed else ()), _by_value)
        self.maps = None
        if spec.kernel == "bwd_dkdv_wgmma":   # q and dout in query tiles, k and v in the block's keys
            box_rows = (spec.block_m, spec.block_n, spec.block_n, spec.block_m)
            self.maps = tuple((shape, strides, rows, _config.SWIZZLE_BYTES)
                              for (shape, strides), rows in zip(maps, box_rows))

    def __call__(self, values: tuple):
        # BACKWARD_PER_CALL starts with q, k, v, dout
        maps, copies = _tensor_maps(values, self.maps) if self.maps else ((), ())
        self.kernel(self.grid, self.block, maps + self.arguments(values), shared_mem=self.smem)
        del copies   # queued: their memory may go back to the pool (stream order protects it)


class BackwardPlan:
    """The backward of one problem on one device: the launches of ``_plan.backward`` (bwd_preprocess, the
    dK/dV launches, then bwd_dq_convert or the dQ kernel), compiled, with their arguments. ``packed`` as in
    ForwardPlan: bwd_preprocess then sees the packed rows as one sequence, and delta is (heads, total_q)."""

    def __init__(self, p: Problem, device_id: int, deterministic: bool, dout, q, k, v, out, lse,
                 cfg: _config.AttentionConfig | None = None, packed: bool = False):
        self.problem = p
        self.device_id = device_id
        self.copies = tuple(_needs_copy(x) for x in (dout, q, k, v, out))
        self.copy_lse = not lse.flags.c_contiguous
        strides_of = _packed_strides if packed else _strides_of
        # the Hopper dK/dV kernel's tensor maps of q, k, v, dout: (batch, rows, heads, head_dim) and strides
        maps = [((1, *x.shape) if packed else tuple(x.shape), strides_of(x, c))
                for x, c in zip((q, k, v, dout), self.copies[1:4] + self.copies[:1])]
        tensor_maps = all(_tma.strides_ok(q.dtype.itemsize, shape, s) for shape, s in maps)
        maps = [(shape, _tma.map_strides(q.dtype.itemsize, shape, s)) for shape, s in maps]
        plan = _plan.backward(p, device_props(device_id), deterministic, cfg, q.shape[0] if packed else None,
                              tensor_maps)
        self.adds_dq = plan.adds_dq
        self.dtype, self.q_shape, self.kv_shape = q.dtype, tuple(q.shape), tuple(k.shape)
        # (batch, heads, rows): a packed batch's lse and delta (heads, total_q) as one sequence of the rows
        self.delta_shape = (1, p.heads, q.shape[0]) if packed else (p.batch, p.heads, p.seqlen_q)
        # float32, per copy (one per split of the deterministic split grid, else one) and (batch, head):
        # dq_accum_rows(seqlen_q) x specialized head dim in mma-fragment order (DqAccum in
        # kernels/common.cuh); O(seqlen) per (batch, head); in a packed batch per head, O(total_q + 128 * batch)
        self.accum_shape = plan.accum_shape
        # the ordered dQ adds' int32 counts (plan.order_ints) follow the buffer, zeroed with it
        self.accum_floats = math.prod(plan.accum_shape) if plan.adds_dq else 0
        self.order_ints = plan.order_ints
        itemsize = q.dtype.itemsize
        dout_s, q_s, k_s, v_s, out_s = (strides_of(x, c) for x, c in zip((dout, q, k, v, out), self.copies))
        dq_s, dk_s = strides_of(q, True), strides_of(k, True)
        batch, rows = (1, q.shape[0]) if packed else (p.batch, p.seqlen_q)   # bwd_preprocess's

        def int64s(*triples):
            return tuple(_by_value(s, np.int64) for triple in triples for s in triple)

        with cupy.cuda.Device(device_id):
            self.preprocess = _Launch(plan.preprocess, device_id)
            self.preprocess_head = int64s(dout_s, out_s) + tuple(
                _int32(n) for n in (batch, p.heads, rows, p.head_dim, plan.preprocess_lanes))
            self.preprocess_strides_ok = _strides_vector_ok(p.head_dim, itemsize, dout_s, out_s)

            fixed = {**_stride_fields(q=q_s, k=k_s, v=v_s, do=dout_s, dq=dq_s, dk=dk_s), **_problem_fields(p),
                     "scale": p.softmax_scale, **({} if packed else DENSE_FIELDS)}
            self.strides_vector_ok = _strides_vector_ok(p.head_dim, itemsize, q_s, k_s, v_s, dout_s)
            self.dkdv = [_AttentionLaunch(launch, device_id, fixed, packed, maps) for launch in plan.dkdv]
            if plan.adds_dq:  # bwd_dq_convert; its last argument is the dQ buffer's copies
                convert_args = int64s(dq_s) + tuple(_int32(n) for n in (p.batch, p.heads, p.seqlen_q, p.head_dim)) + (
                    _by_value(p.softmax_scale, np.float32), _int32(plan.accum_shape[0]))
                self.dq = _Launch(plan.dq, device_id, convert_args)
            else:
                self.dq = _AttentionLaunch(plan.dq, device_id, fixed, packed)

    def run(self, dout, q, k, v, out, lse, alibi_slopes=None, sinks=None, seed=0, offset=0, cu_seqlens=()):
        """dq, dk, dv (and dsinks, float32 (heads,), with sinks) on CuPy's current stream; ``cu_seqlens`` as in
        ForwardPlan.run."""
        return _run_on(self.device_id, self._launch, dout, q, k, v, out, lse, alibi_slopes, sinks,
                       _dropout_args(self.problem, seed, offset), tuple(map(_vector, cu_seqlens)))

    def _launch(self, dout, q, k, v, out, lse, alibi_slopes, sinks, dropout, cu_seqlens):
        if any(self.copies):
            dout, q, k, v, out = (_readable(x, c) for x, c in zip((dout, q, k, v, out), self.copies))
        if self.copy_lse:
            lse = cupy.ascontiguousarray(lse)
        dq = cupy.ndarray(self.q_shape, self.dtype)
        dk = cupy.ndarray(self.kv_shape, self.dtype)
        dv = cupy.ndarray(self.kv_shape, self.dtype)
        delta = cupy.ndarray(self.delta_shape, np.float32)
        dq_accum = dq_order = _NULL
        if self.adds_dq:
            dq_accum = cupy.zeros(self.accum_floats + self.order_ints, np.float32)
            if self.order_ints:
                dq_order = dq_accum[self.accum_floats:].view(np.int32)

        vector_ok = self.preprocess_strides_ok and not (dout.data.ptr | out.data.ptr) & 15
        self.preprocess((dout, out, delta) + self.preprocess_head + (_VECTOR_OK[vector_ok],))
        vector_ok = self.strides_vector_ok and not (q.data.ptr | k.data.ptr | v.data.ptr | dout.data.ptr) & 15
        args = (q, k, v, dout, lse, delta, dq, dk, dv, dq_accum, dq_order, _vector(alibi_slopes), *dropout,
                _VECTOR_OK[vector_ok]) + cu_seqlens  # BACKWARD_PER_CALL (+ PACKED_PER_CALL)
        for launch in self.dkdv:
            launch(args)
        self.dq((dq_accum, dq, cu_seqlens[0] if cu_seqlens else _NULL) if self.adds_dq else args)
        if sinks is None:
            return dq, dk, dv
        lse = lse.reshape(self.delta_shape)
        # d loss / d sink = -sum over (batch, row) of exp(sink - lse) * delta: the sink's probability times
        # rowsum(dout * out) (CuPy's reductions sum in a fixed order: deterministic)
        # (a row with lse -inf saw nothing and has a sink of -inf: its sink probability is 0)
        sink_p = cupy.where(cupy.isneginf(lse), 0, cupy.exp(sinks[None, :, None] - lse))
        return dq, dk, dv, -(sink_p * delta).sum(axis=(0, 2))


def forward(q, k, v, p: Problem, spec: _config.KernelSpec | None = None):
    """out, lse through a plan made for this call; ``spec`` overrides the tile table's forward kernel (for
    tuning tools)."""
    return ForwardPlan(p, q.data.device_id, q, k, v, spec).run(q, k, v, with_lse=True)


def backward(dout, q, k, v, out, lse, p: Problem, deterministic: bool = False,
             cfg: _config.AttentionConfig | None = None):
    """dq, dk, dv through a plan made for this call; ``cfg`` overrides the tile table's backward kernels (for
    tuning tools)."""
    return BackwardPlan(p, q.data.device_id, deterministic, dout, q, k, v, out, lse, cfg).run(dout, q, k, v, out, lse)


#: the KV-cache forward's arguments that change from call to call, in the order KVCachePlan passes them
KVCACHE_PER_CALL = ("q", "k", "v", "out", "lse", "alibi_slopes", "sinks", "cache_seqlens", "block_table",
                    "cache_leftpad", "out_partial", "lse_partial", "split_counters", "seqlen_k", "vec_ok")

#: The counters of the KV-cache forward's key splits and of fwd_wgmma's persistent grid per (device, stream):
#: int32, one per row group of the KV-cache forward, _config.WGMMA_WORK_COUNTER_INTS for fwd_wgmma; zero between
#: calls (the last block of each row group resets its own; fwd_wgmma's last block all), so a call launches no
#: memset. Calls on one stream run in order and calls on different streams count in different buffers. A
#: buffer dropped (grown, or all of them past MAX_COUNTER_STREAMS, as a program that makes a stream per request
#: would otherwise collect one per stream) goes back to CuPy's pool, which hands it out again only on its own
#: stream, after the kernels already queued there.
_SPLIT_COUNTERS: dict[tuple[int, int], cupy.ndarray] = {}
MAX_COUNTER_STREAMS = 64


def split_counters(device_id: int, count: int):
    """At least ``count`` zeroed int32 counters for a launch on the current stream of device ``device_id``
    (the device current), kept for the stream's later calls."""
    key = (device_id, cupy.cuda.get_current_stream().ptr)
    counters = _SPLIT_COUNTERS.get(key)
    if counters is None or counters.size < count:
        if counters is None and len(_SPLIT_COUNTERS) >= MAX_COUNTER_STREAMS:
            _SPLIT_COUNTERS.clear()
        counters = _SPLIT_COUNTERS[key] = cupy.zeros(count, np.int32)
    return counters


def _int32_vector(x, copy: bool):
    """An int32 vector or table argument (cache_seqlens, block_table) as the kernel reads it: rows contiguous."""
    return _NULL if x is None else cupy.ascontiguousarray(x) if copy else x


def kvcache_fixed_fields(p: CacheProblem, plan: _plan.CacheLaunches, strides, table_stride: int) -> dict:
    """The KV-cache forward's fields that are the same for each call of a plan (KVCACHE_PER_CALL the rest, and
    FLOAT8_PER_CALL of float8 caches): ``strides`` the (batch or page, seq, head) element strides of q, k_cache,
    v_cache and out."""
    fields = _params.forward_fields()
    float8 = p.attn.dtype == _config.FLOAT8_E4M3
    fixed = {**_stride_fields(q=strides[0], k=strides[1], v=strides[2], o=strides[3]), **_problem_fields(p.attn),
             **_tail_fields(fields, plan.forward.tail), **DENSE_FIELDS,
             **(_float8_strides(p.attn) if float8 else NO_FLOAT8_FIELDS), "dropout_seed": 0,
             "dropout_offset": 0,
             "block_table_stride": table_stride, "seqlen_k_new": p.seqlen_new, "pack": plan.pack,
             "num_splits": plan.splits, "page_size": p.page_size}
    del fixed["seqlen_k"]  # per call: an int cache_seqlens changes from step to step
    return fixed


class KVCachePlan:
    """attention_with_kvcache of one problem on one device: at most two launches, append_rotary (the new keys
    and values into the cache, rotated with the queries where rotary tables are given) and the KV-cache
    forward (fwd_mma with KVCACHE, which also merges its key splits): _plan.kvcache. Float8 caches (uint8 e4m3
    bit patterns) are read in 16-byte copies: their strides must be whole 16 bytes (q is copied where its are
    not), and the output is bfloat16, converted where out_dtype asks for float16."""

    def __init__(self, p: CacheProblem, device_id: int, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                 rotary_cos, rotary_sin, num_splits: int, rotary_interleaved: bool = True, cache_leftpad=None):
        a = p.attn
        self.problem = p
        self.device_id = device_id
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _needs_copy(cache):
                raise ValueError(f"{name} must have a contiguous last axis and strides of whole elements: the "
                                 f"kernels read and write the cache in place, got strides {cache.strides}")
        float8 = a.dtype == _config.FLOAT8_E4M3
        if float8 and not _strides_vector_ok(a.head_dim, 1, *(_strides_of(c, False) for c in (k_cache, v_cache))):
            raise ValueError(f"float8 caches are read in 16-byte copies: their strides must be multiples of 16 "
                             f"bytes, got {k_cache.strides} (k_cache) and {v_cache.strides} (v_cache)")
        plan = _plan.kvcache(p, device_props(device_id), num_splits)
        self.splits, self.row_groups = plan.splits, plan.row_groups
        # float8 q is read as the caches are, in 16-byte copies: contiguous (then copied where misaligned too)
        self.copy_q = _needs_copy(q) or float8 and not q.flags.c_contiguous
        self.copy_new = k is not None and (_needs_copy(k) or _needs_copy(v))
        self.copy_tables = rotary_cos is not None and not (rotary_cos.flags.c_contiguous and
                                                           rotary_sin.flags.c_contiguous)
        self.copy_lengths = cache_seqlens is not None and hasattr(cache_seqlens, "dtype") and \
            not cache_seqlens.flags.c_contiguous
        self.copy_leftpad = cache_leftpad is not None and not cache_leftpad.flags.c_contiguous
        self.copy_table = block_table is not None and block_table.strides[1] != block_table.itemsize
        table_stride = 0 if block_table is None else block_table.shape[1] if self.copy_table else \
            block_table.strides[0] // block_table.itemsize
        cache_strides = [_strides_of(k_cache, False), _strides_of(v_cache, False)]
        with cupy.cuda.Device(device_id):
            self.kernel = get_kernel(plan.forward.spec, device_id)
            self.append = None
            if plan.append is not None:
                new_strides = [(0, 0, 0)] * 2 if k is None else [_strides_of(x, self.copy_new) for x in (k, v)]
                strides = [_strides_of(q, self.copy_q), *new_strides, *cache_strides]
                tail = tuple(_by_value(s, np.int64) for triple in strides for s in triple) + (
                    _by_value(table_stride, np.int64),) + tuple(_int32(n) for n in (
                        a.batch, a.seqlen_q, a.heads, p.seqlen_new, a.heads_kv, a.head_dim, p.rotary_dim,
                        p.page_size, bool(rotary_interleaved), a.masked,
                        rotary_cos is not None and rotary_cos.dtype == np.float32,
                        rotary_sin is not None and rotary_sin.dtype == np.float32))
                self.append = _Launch(plan.append, device_id, tail)
        self.grid, self.block = plan.forward.grid, (plan.forward.spec.threads,)
        self.smem = plan.forward.spec.smem_bytes
        self.out_shape, self.dtype = tuple(q.shape), _config.BFLOAT16 if float8 else q.dtype
        self.output_dtype = a.output_dtype
        self.lse_shape = (a.batch, a.heads, a.seqlen_q)
        self.partial_shapes = ((plan.splits, *q.shape), (plan.splits, *self.lse_shape))
        strides = [_contiguous_strides(q.shape) if p.rotary_dim else _strides_of(q, self.copy_q), *cache_strides,
                   _contiguous_strides(q.shape)]
        self.strides_vector_ok = _strides_vector_ok(a.head_dim, q.dtype.itemsize, *strides)
        fixed = kvcache_fixed_fields(p, plan, strides, table_stride)
        self.float8 = float8
        self.arguments = _params.Arguments(_params.forward_fields(), fixed,
                                           KVCACHE_PER_CALL + (FLOAT8_PER_CALL if float8 else ()), _by_value)

    def run(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
            rotary_cos, rotary_sin, with_lse: bool, descales=(None, None, None)):
        """out, and lse where ``with_lse`` (else None), on CuPy's current stream, after rotating q and k (with
        rotary_cos) and appending k and v. ``descales``: a float8 plan's (q_descale, k_descale, v_descale),
        each float32 or None (1)."""
        return _run_on(self.device_id, self._launch, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                       cache_leftpad, alibi_slopes, sinks, rotary_cos, rotary_sin, with_lse,
                       tuple(map(_vector, descales)) if self.float8 else ())

    def _launch(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                rotary_cos, rotary_sin, with_lse, descales):
        p = self.problem
        if p.lengths == "int":
            seqlen_k, lengths = cache_seqlens + p.seqlen_new, _NULL
        else:
            seqlen_k = p.attn.seqlen_k
            lengths = _int32_vector(cache_seqlens, self.copy_lengths) if p.lengths == "array" else _NULL
        table = _int32_vector(block_table, self.copy_table)
        leftpad = _int32_vector(cache_leftpad, self.copy_leftpad)
        if self.copy_q:
            q = cupy.ascontiguousarray(q)
        if self.append is not None:
            q_out = cupy.ndarray(self.out_shape, self.dtype) if p.rotary_dim else None
            if self.copy_new:
                k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)
            if self.copy_tables:
                rotary_cos, rotary_sin = cupy.ascontiguousarray(rotary_cos), cupy.ascontiguousarray(rotary_sin)
            self.append((q, _NULL if q_out is None else q_out, _NULL if k is None else k, _NULL if v is None else v,
                         k_cache, v_cache, _NULL if rotary_cos is None else rotary_cos,
                         _NULL if rotary_sin is None else rotary_sin, lengths, table, leftpad,
                         _int32(cache_seqlens if p.lengths == "int" else 0)))
            if q_out is not None:
                q = q_out
        out = cupy.ndarray(self.out_shape, self.dtype)
        lse = cupy.ndarray(self.lse_shape, np.float32) if with_lse else None
        if self.splits == 1:
            out_partial = lse_partial = counters = _NULL
        else:
            out_partial = cupy.ndarray(self.partial_shapes[0], np.float32)
            lse_partial = cupy.ndarray(self.partial_shapes[1], np.float32)
            counters = split_counters(self.device_id, self.row_groups)
        vector_ok = self.strides_vector_ok and not (q.data.ptr | k_cache.data.ptr | v_cache.data.ptr) & 15
        if self.float8 and not vector_ok:   # the 16-byte copies need aligned rows: q can be copied, a cache not
            if (k_cache.data.ptr | v_cache.data.ptr) & 15:
                raise ValueError("float8 caches are read in 16-byte copies: k_cache and v_cache must start on a "
                                 "16-byte boundary")
            q = q.copy()   # contiguous as planned, aligned
        self.kernel(self.grid, self.block, self.arguments(
            (q, k_cache, v_cache, out, _NULL if lse is None else lse, _vector(alibi_slopes), _vector(sinks), lengths,
             table, leftpad, out_partial, lse_partial, counters, _int32(seqlen_k),
             _VECTOR_OK[vector_ok]) + descales), shared_mem=self.smem)
        if out.dtype != self.output_dtype:
            out = out.astype(self.output_dtype)
        return out, lse


def _merge_args(out_shape: tuple, parts: int) -> tuple:
    """merge_parts's trailing arguments (kernels/merge.cu) for a C-contiguous out of ``out_shape`` (batch,
    seqlen_q, heads, head_dim): its element strides, then parts, batch, seqlen_q, heads, head_dim."""
    return tuple(_by_value(s, np.int64) for s in _contiguous_strides(out_shape)) + tuple(
        _int32(n) for n in (parts, *out_shape))


def merge_states(outs, lses):
    """merge_states on the GPU: ``outs`` and ``lses`` stacked (as given, or from lists of parts) into
    contiguous float32 arrays (a copy only where they are not), then merge_parts."""
    out_dtype = outs.dtype if hasattr(outs, "dtype") else outs[0].dtype
    device_id = (outs if hasattr(outs, "data") else outs[0]).data.device_id

    def stacked(x):
        return cupy.ascontiguousarray(x if hasattr(x, "ndim") else cupy.stack(x), dtype=np.float32)

    def launch():
        parts_out, parts_lse = stacked(outs), stacked(lses)
        parts, batch, seqlen_q, heads, _ = parts_out.shape
        out = cupy.ndarray(parts_out.shape[1:], out_dtype)
        lse = cupy.ndarray((batch, heads, seqlen_q), np.float32)
        kernel = _Launch(_plan.merge(batch, seqlen_q, heads, out_dtype), device_id)
        kernel((parts_out, parts_lse, out, lse, _NULL) + _merge_args(out.shape, parts))
        return out, lse
    return _run_on(device_id, launch)


def merge_into(acc, acc_lse, row0: int, part, part_lse, sinks=None):
    """Ring attention's merge on the GPU (kernels/merge.cu, merge_into), on CuPy's current stream: ``part``
    (batch, rows, heads, head_dim; the last axis contiguous) with its lse (batch, heads, rows) into rows
    ``row0 ..`` of the contiguous float32 state ``acc`` (batch, acc_rows, heads, head_dim) and ``acc_lse``
    (batch, heads, acc_rows), in place; ``part`` None: the sinks (heads,) join every row as parts of output 0."""
    batch, acc_rows, heads, head_dim = acc.shape
    if part is None:
        rows, dtype, strides, part_lse = acc_rows, np.dtype(np.float32), (0, 0, 0), _NULL
    else:
        rows, dtype = part.shape[1], part.dtype
        if _needs_copy(part):
            part = cupy.ascontiguousarray(part)
        strides = _strides_of(part, False)
        part_lse = cupy.ascontiguousarray(part_lse)
    kernel = _Launch(_plan.merge_into(batch, rows, heads, dtype), acc.data.device_id)
    kernel((acc, acc_lse, _NULL if part is None else part, part_lse, _vector(sinks))
           + tuple(_by_value(s, np.int64) for s in strides)
           + tuple(_int32(n) for n in (row0, acc_rows, batch, rows, heads, head_dim)))
