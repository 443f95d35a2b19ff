"""The launches of one call: every shape-dependent choice (kernels, grids, bands, dQ splits, buffers), made
from the problem and the device's properties alone. Pure: no GPU, no CuPy, so it is tested on the CPU and
probes and tuning tools go through it. The GPU path (``_cupy_path``) only compiles the kernels it names,
allocates, fills in the arguments and launches.
"""

from __future__ import annotations

import dataclasses
import math

from . import _config
from ._validate import CacheProblem, Problem

#: CUDA's limit on gridDim.x
MAX_GRID_X = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: its specialization, grid, and the int32 arguments that end its parameter list
    (after the ones every launch of its pass shares)."""

    spec: _config.KernelSpec
    grid: tuple[int, ...]
    tail: tuple[int, ...] = ()
    work_counter: bool = False   # a persistent grid: the kernel takes its work items from the stream's counters
    #: fwd_wgmma on a packed batch: varlen_order's launch, which orders the items into an int32 buffer of
    #: ``order_ints`` before it (kernels/varlen.cu)
    order: Launch | None = None
    order_ints: int = 0
    #: the float8 forward: transpose_v_float8's launch, which writes V^T before it into a uint8 buffer of
    #: ``transpose_shape`` (batch, heads_kv, head_dim, keys rounded up to _config.FLOAT8_TRANSPOSE_KEYS)
    transpose: Launch | None = None
    transpose_shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class BackwardLaunches:
    """The backward's launches, in order: ``preprocess`` (delta = rowsum(dout * out), ``preprocess_lanes``
    lanes per row), the ``dkdv`` launches, then ``dq`` (bwd_dq_convert where the dK/dV launches add dQ into
    the float32 buffer of ``accum_shape``, whose copies it sums in order; else the dQ kernel). ``order_ints``:
    the int32 counts of the ordered dQ adds (_config.ordered_dq_kernel), one per DQ_ACCUM_SHARE floats of the
    buffer, zeroed with it; 0 where the dK/dV kernel counts none."""

    preprocess: Launch
    preprocess_lanes: int
    dkdv: tuple[Launch, ...]
    dq: Launch
    adds_dq: bool
    #: (copies, batch, heads, rows, head dim) of the float32 dQ buffer (DqAccum, kernels/common.cuh), (copies,
    #: heads, rows, head dim) in a packed batch; None where dQ has its own kernel
    accum_shape: tuple[int, ...] | None
    order_ints: int = 0


def grid(blocks: int) -> tuple[int]:
    """A one-dimensional grid of ``blocks`` (at least one); ValueError past CUDA's limit."""
    if blocks > MAX_GRID_X:
        raise ValueError(f"problem too large: {blocks} thread blocks (at most {MAX_GRID_X})")
    return (max(blocks, 1),)


def banded_grid(tiles_per_head: int, pairs: int, sm_count: int, pair_major_tiles: int = 0,
                least_pairs: int = 1) -> tuple[int, int]:
    """(tiles of one band, bands): the grid of the dK/dV kernels that decode KeyBlock (kernels/common.cuh)."""
    band = _config.block_band(tiles_per_head, pairs, sm_count, pair_major_tiles, least_pairs)
    return grid(tiles_per_head * band)[0], pairs // band


def keys_per_query_block(p: Problem, block_m: int) -> int:
    """The most keys one query block of ``block_m`` rows visits: seqlen_k, or under a window bounded on both
    sides its span, left + block_m + right keys (rounded out to the key tiles by the kernel)."""
    if p.window_left < 0 or p.window_right < 0:
        return p.seqlen_k
    return min(p.seqlen_k, p.window_left + block_m + p.window_right)


def forward(p: Problem, device: _config.DeviceProps, spec: _config.KernelSpec | None = None,
            packed: bool = False, tensor_maps: bool = True, persistent: bool | None = None,
            total_q: int | None = None, total_k: int | None = None) -> Launch:
    """The forward's launch; ``spec`` overrides the tile table's (for tuning tools). Its tail is QueryBlock's
    grid order, its pairs per section (kernels/common.cuh; _config.forward_section_heads). ``packed``: a packed
    batch (attention_varlen), ``p`` its batch of the longest sequences' lengths, each sequence's blocks past its
    own end idle. ``tensor_maps``: can tensor maps describe the arrays (_tma.strides_ok)? Where not, the Hopper
    kernel does not serve. ``persistent`` overrides the table's choice of a persistent grid for fwd_wgmma (for
    probes).

    ``total_q``, ``total_k``: the packed batch's rows and keys. Where _config.varlen_forward_ordered, the Hopper
    forward then walks only the items with rows, those with the most key tiles first, in the order varlen_order
    writes before it (``Launch.order``), on a grid sized by the most items that ``total_q`` rows can fill (up to
    VARLEN_ORDER_MAX_BATCH sequences), in sections of heads whose K and V of every sequence (``total_k`` keys,
    at most batch * seqlen_k where not given) share the L2, on the persistent grid where the mean sequence's keys
    (``total_k`` over the batch) are few (_config.wgmma_forward_persistent)."""
    if spec is None:
        if not tensor_maps:
            device = dataclasses.replace(device, tensor_maps=False)
        if p.dtype == _config.FLOAT8_E4M3:
            return float8_forward(p, device, packed)
        if not _config.wgmma_takes_scale(p.mods, p.softmax_scale):
            device = dataclasses.replace(device, tensor_maps=False)   # the portable forward
        spec = _config.choose_config(p.head_dim, p.dtype, p.mask_kind, device, p.mods, packed).forward
        spec = _config.wgmma_forward_for_keys(spec, keys_per_query_block(p, spec.block_m), device)
    item_keys = keys_per_query_block(p, spec.block_m)
    sections = _config.forward_section_heads(spec, p.batch * p.heads, item_keys, p.group, device)
    items = -(-p.seqlen_q // spec.block_m) * p.batch * p.heads
    if spec.kernel != "fwd_wgmma":
        return Launch(spec, grid(items), (sections,))
    ordered, order_ints, mean_keys = None, 0, None
    if (packed and total_q is not None and p.batch <= _config.VARLEN_ORDER_MAX_BATCH
            and _config.varlen_forward_ordered(spec.head_dim, total_q == p.batch * p.seqlen_q)):
        # sections of heads, each walking every sequence's entries: its K and V are every sequence's keys
        sections = _config.forward_section_heads(spec, p.heads, item_keys, p.group, device,
                                                 p.batch * p.seqlen_k if total_k is None else total_k)
        # entries (sequence, query block) of valid prefix sums: sum of ceil(rows_b / block_m) over b
        capacity = min(-(-total_q // spec.block_m) + p.batch, -(-p.seqlen_q // spec.block_m) * p.batch)
        items = capacity * p.heads
        ordered = Launch(_config.varlen_order_spec(spec.mask), (1,),
                         (p.batch, p.seqlen_q, spec.block_m, spec.block_n, *p.kernel_window, capacity))
        order_ints = 1 + capacity   # the count, then the entries
        mean_keys = None if total_k is None else -(-total_k // p.batch)
    if persistent is None:
        persistent = _config.wgmma_forward_persistent(item_keys, mean_keys)
    return Launch(spec, grid(min(items, device.sm_count) if persistent else items), (sections,), persistent,
                  ordered, order_ints)


def float8_forward(p: Problem, device: _config.DeviceProps, packed: bool = False) -> Launch:
    """The float8 forward's launch, with its V^T transpose's (``Launch.transpose``), on the grid the 16-bit
    fwd_wgmma would take (persistent where the query blocks visit few keys); TypeError where the float8 kernel
    does not serve (_config.float8_forward_spec): float8 inputs have no other GPU kernel."""
    spec = _config.float8_forward_spec(p.head_dim, p.mask_kind, device, p.mods, packed)
    if spec is None:
        raise TypeError(
            f"float8 inputs run on the GPU in the Hopper float8 forward: compute capability 9.0 with tensor maps "
            f"(this GPU: {device.compute_capability / 10:.1f}{'' if device.tensor_maps else ', no tensor maps'}), "
            f"head_dim in {_config.FLOAT8_HEAD_DIMS} (got {p.head_dim}), dense batches, no dropout"
            f"{' (got dropout)' if p.dropout_p else ''}; elsewhere pass bfloat16 (their values times their factors)")
    keys = -(-p.seqlen_k // _config.FLOAT8_TRANSPOSE_KEYS) * _config.FLOAT8_TRANSPOSE_KEYS   # key tiles divide it
    transpose = Launch(_config.float8_transpose_spec(spec.head_dim),
                       (keys // _config.FLOAT8_TRANSPOSE_KEYS, p.heads_kv, p.batch))
    launch = forward(p, device, spec)
    return dataclasses.replace(launch, transpose=transpose, transpose_shape=(p.batch, p.heads_kv, p.head_dim, keys))


def backward(p: Problem, device: _config.DeviceProps, deterministic: bool,
             cfg: _config.AttentionConfig | None = None, total_q: int | None = None,
             tensor_maps: bool = True) -> BackwardLaunches:
    """The backward's launches; ``cfg`` overrides the tile table's kernels (for tuning tools). ``total_q``:
    a packed batch of that many query rows (attention_varlen), ``p`` its batch of the longest sequences'
    lengths; bwd_preprocess then walks the packed rows and the dQ buffer has DqAccum's packed layout.

    The default adds dQ with float32 atomics inside the dK/dV kernels (where the config has them:
    float16/bfloat16). ``deterministic`` runs the Hopper kernel's ordered form on the same grid where it serves
    (``_config.ordered_dq_kernel``), else the same kernel on the split grid, one float32 dQ buffer per split,
    one launch per pass (KeyBlock), or, where that grid would leave SMs idle, the separate dQ kernel
    (``_config.deterministic_dq_splits``). The dK/dV and dQ kernels' tail is (dq_splits, dq_pass); on the
    banded grid dq_pass is 1 where the ordered form runs a pair's key blocks side by side
    (``_config.ordered_side_by_side``), else 0.
    """
    packed = total_q is not None
    if cfg is None:
        if not tensor_maps or not _config.wgmma_takes_scale(p.mods & ~_config.MOD_SINKS, p.softmax_scale):
            device = dataclasses.replace(device, tensor_maps=False)   # the portable kernels
        cfg = _config.choose_config(p.head_dim, p.dtype, p.mask_kind, device, p.mods, packed)
    pairs = p.batch * p.heads_kv
    ordered = _config.ordered_dq_kernel(cfg) if deterministic else None
    dq_splits = 0
    if ordered is not None:
        adds_dq, dkdv_specs = True, (ordered,)
    elif deterministic:   # the split grid's kernel, or the pair (dK/dV, then the dQ kernel)
        dq_splits = _config.deterministic_dq_splits(cfg, pairs, p.seqlen_k, device.sm_count)
        adds_dq = dq_splits > 0
        dkdv_specs = (_config.split_grid_kernel(cfg),) if adds_dq else cfg.bwd_dkdv
    elif cfg.bwd_dkdv_wgmma is not None:
        adds_dq, dkdv_specs = True, (cfg.bwd_dkdv_wgmma,)
    else:
        adds_dq = bool(cfg.bwd_dkdv_atomic)
        dkdv_specs = cfg.bwd_dkdv_atomic if adds_dq else cfg.bwd_dkdv
    lanes = _config.preprocess_lanes(p.head_dim, p.dtype.itemsize)
    pre = cfg.bwd_preprocess
    rows = p.heads * total_q if packed else p.batch * p.heads * p.seqlen_q
    preprocess = Launch(pre, grid(-(-rows * lanes // pre.threads)))
    dkdv = []
    for spec in dkdv_specs:
        key_blocks = -(-p.seqlen_k // spec.block_n)
        if dq_splits:  # one launch per pass, in order
            dkdv += [Launch(spec, grid(pairs * dq_splits), (dq_splits, dq_pass))
                     for dq_pass in range(-(-key_blocks // dq_splits))]
        else:
            band_rule = (_config.pair_major_tiles(spec), _config.ordered_band_least_pairs(spec, device.sm_count))
            band = _config.block_band(key_blocks, pairs, device.sm_count, *band_rule)
            side_by_side = ordered is not None and _config.ordered_side_by_side(key_blocks, band, device.sm_count)
            dkdv.append(Launch(spec, banded_grid(key_blocks, pairs, device.sm_count, *band_rule),
                               (0, int(side_by_side))))
    if adds_dq:
        copies = max(dq_splits, 1)  # one buffer per split of the split grid
        if packed:
            accum_shape = (copies, p.heads, _config.dq_accum_packed_rows(p.batch, total_q), cfg.bwd_dq_convert.head_dim)
        else:
            accum_shape = (copies, p.batch, p.heads, _config.dq_accum_rows(p.seqlen_q), cfg.bwd_dq_convert.head_dim)
        spec = cfg.bwd_dq_convert
        pairs_per_copy = math.prod(accum_shape[1:-2])   # (batch, head) pairs, or a packed batch's heads
        tile_rows = math.prod(accum_shape[-2:]) // 8  # of one pair: a thread per row of a 16 x 8 tile
        dq = Launch(spec, (grid(-(-tile_rows // spec.threads))[0], min(pairs_per_copy, _config.MAX_GRID_Y)))
        order_ints = math.prod(accum_shape) // _config.DQ_ACCUM_SHARE if ordered is not None else 0
    else:
        accum_shape, order_ints = None, 0
        spec = cfg.bwd_dq
        dq = Launch(spec, grid(-(-p.seqlen_q // spec.block_m) * p.batch * p.heads), (0, 0))
    return BackwardLaunches(preprocess, lanes, tuple(dkdv), dq, adds_dq, accum_shape, order_ints)


@dataclasses.dataclass(frozen=True)
class CacheLaunches:
    """The launches of one attention_with_kvcache call: ``append`` (append_rotary: the new keys and values
    into the cache, rotated with the queries where rotary tables are given; None where neither), then the
    KV-cache forward (fwd_mma with KVCACHE, its query heads packed ``pack`` to a row, its keys in ``splits``
    splits). Where splits > 1 the blocks of each of the ``row_groups`` row groups (CacheBlock in
    kernels/common.cuh) write float32 partials and the last of them merges them, counting in one int32 per
    row group."""

    append: Launch | None
    forward: Launch
    pack: int
    splits: int
    row_groups: int


def kvcache(p: CacheProblem, device: _config.DeviceProps, num_splits: int = 0,
            spec: _config.KernelSpec | None = None) -> CacheLaunches:
    """The KV-cache call's launches. The query heads of a kv head share its blocks (pack = the GQA group),
    except under ALiBi, whose slope the kernel takes per block (pack 1). ``num_splits`` 0 lets
    ``_config.kvcache_splits`` choose from the cache's capacity; otherwise that many, at most one per key
    tile. ``spec`` overrides the forward's (tuning tools). The forward's tail is QueryBlock's order (unread
    here: CacheBlock has its own)."""
    a = p.attn
    pack = 1 if a.alibi_shape is not None else a.group
    rows = a.seqlen_q * pack
    if spec is None:
        row_groups = -(-rows // _config.MMA_ROWS_PER_WARP) * (a.heads // pack) * a.batch   # its blocks per split
        spec = _config.kvcache_forward_spec(a.head_dim, a.dtype, a.mask_kind, device, a.mods, p.page_size,
                                            row_groups)
    blocks = -(-rows // spec.block_m) * (a.heads // pack) * a.batch
    key_tiles = max(1, -(-a.seqlen_k // spec.block_n))
    if num_splits == 0:
        splits = _config.kvcache_splits(blocks, key_tiles, _config.resident_blocks(spec, device), device.sm_count)
    else:
        splits = min(num_splits, key_tiles)
    return CacheLaunches(append_rotary(p), Launch(spec, grid(blocks * splits), (0,)), pack, splits, blocks)


def append_rotary(p: CacheProblem) -> Launch | None:
    """append_rotary (kernels/cache.cu), one warp per row: the rotated queries' rows (with rotary tables),
    then the appended keys' and values' (batch x seqlen_new x heads_kv); None where there are neither."""
    a = p.attn
    rows = (a.batch * a.seqlen_q * a.heads if p.rotary_dim else 0) + a.batch * p.seqlen_new * a.heads_kv
    if rows == 0:
        return None
    spec = _config.KernelSpec("append_rotary", a.dtype, threads=_config.APPEND_WARPS * 32)
    return Launch(spec, grid(-(-rows // _config.APPEND_WARPS)))


def merge(batch: int, seqlen_q: int, heads: int, dtype) -> Launch:
    """merge_parts (kernels/merge.cu), one warp per (batch, row, head), writing ``dtype``."""
    spec = _config.KernelSpec("merge_parts", dtype, threads=_config.MERGE_WARPS * 32)
    return Launch(spec, grid(-(-batch * seqlen_q * heads // _config.MERGE_WARPS)))


def merge_into(batch: int, rows: int, heads: int, dtype) -> Launch:
    """merge_into (kernels/merge.cu): ring attention's merge of a part of ``dtype`` into its float32 state, one
    warp per (batch, row, head) of the part."""
    spec = _config.KernelSpec("merge_into", dtype, threads=_config.MERGE_WARPS * 32)
    return Launch(spec, grid(-(-batch * rows * heads // _config.MERGE_WARPS)))
