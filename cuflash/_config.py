"""Kernel specializations and the tile table.

One frozen dataclass, :class:`KernelSpec`, names a compiled kernel: its template instance name (the
string NVRTC needs, identical for ``name_expressions`` and ``get_function``), its cache key and its
shared-memory size all come from it. One pure function, :func:`choose_config`, maps a problem to the
specs of the forward and backward kernels; it needs no GPU and is unit-tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_dtypes
import numpy as np

#: Head dims the kernels are specialized for; a smaller head dim runs on the next one up, its
#: missing columns zero-filled on load and never stored.
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIMS[-1]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: numpy dtype -> CUDA element type
CUDA_TYPES = {np.dtype(np.float16): "__half", BFLOAT16: "__nv_bfloat16", np.dtype(np.float32): "float"}
SUPPORTED_DTYPES = tuple(CUDA_TYPES)
#: float8 e4m3 (FlashAttention-3's FP8 forward): ``attention``'s q, k and v may have it, with descale factors;
#: its output is one of FLOAT8_OUTPUT_DTYPES (bfloat16 by default). Forward only.
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_OUTPUT_DTYPES = (BFLOAT16, np.dtype(np.float16))
#: every kernel element type: the supported dtypes' and the float8 forward's
KERNEL_TYPES = {**CUDA_TYPES, FLOAT8_E4M3: "__nv_fp8_e4m3"}

#: threads of every SIMT (CUDA-core) kernel; mirrors ``kSimtThreads`` in kernels/simt.cu
SIMT_THREADS = 256
#: The mask kinds a kernel is specialized for (``MaskKind`` in kernels/common.cuh, whose Window applies
#: them): none; causal (keys up to a right side past the diagonal: causal masks, windows (-1, right));
#: a sliding window (both sides). Causal kernels carry no left side: as a runtime bound it cost the causal
#: forwards 2-3% (bench/NOTES.md, masks w1).
MASK_NONE, MASK_CAUSAL, MASK_WINDOW = 0, 1, 2
MASK_KINDS = (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
#: Score modifiers, bits of a kernel's MODS template argument (``ModBits`` in kernels/common.cuh, applied by
#: its ScoreMod and Dropout): softcap, ALiBi, attention sinks (the forward's epilogue only: the backward
#: reads them through the lse), dropout (P's mask, forward and backward).
MOD_SOFTCAP, MOD_ALIBI, MOD_SINKS, MOD_DROPOUT = 1, 2, 4, 8
ALL_MODS = MOD_SOFTCAP | MOD_ALIBI | MOD_SINKS | MOD_DROPOUT
#: the modifiers that change the scores (the sinks change only the forward's epilogue)
SCORE_MODS = MOD_SOFTCAP | MOD_ALIBI
#: kernels whose template has MASK and MODS (every one but the row reductions)
_MASKED_KERNELS = frozenset({"fwd_mma", "fwd_wgmma", "bwd_dkdv_wgmma", "fwd_simt", "bwd_dkdv_simt", "bwd_dq_simt",
                             "bwd_dkdv_mma", "bwd_dkdv_rows_mma", "bwd_dq_mma"})
#: rows of one warp's mma tile in the tensor-core forward
MMA_ROWS_PER_WARP = 16

#: kernel name -> source file in cuflash/kernels/
KERNEL_FILES = {
    "fwd_mma": "fwd_mma.cu",
    "fwd_simt": "simt.cu",
    "bwd_preprocess": "simt.cu",
    "bwd_dkdv_simt": "simt.cu",
    "bwd_dq_simt": "simt.cu",
    "bwd_dkdv_mma": "bwd_mma.cu",
    "bwd_dkdv_rows_mma": "bwd_mma.cu",
    "bwd_dq_mma": "bwd_mma.cu",
    "bwd_dq_convert": "bwd_mma.cu",
    "merge_parts": "merge.cu",
    "merge_into": "merge.cu",
    "append_rotary": "cache.cu",
    "fwd_wgmma": "fwd_wgmma.cu",
    "transpose_v_float8": "fwd_wgmma.cu",
    "bwd_dkdv_wgmma": "bwd_wgmma.cu",
    "varlen_order": "varlen.cu",
}
#: kernels with a packed-batch specialization (their VARLEN template argument, the last)
VARLEN_KERNELS = _MASKED_KERNELS | {"bwd_dq_convert"}
#: tensor-core kernels: shared memory derived from the tile shape
MMA_KERNELS = frozenset({"fwd_mma", "bwd_dkdv_mma", "bwd_dkdv_rows_mma", "bwd_dq_mma"})
#: Hopper kernels (wgmma, TMA, setmaxnreg): compiled for sm_90a, which runs on compute capability 9.0 only
SM90A_KERNELS = frozenset({"fwd_wgmma", "transpose_v_float8", "bwd_dkdv_wgmma"})
#: fwd_wgmma's rows per consumer warpgroup (a block of block_m rows has block_m / 64 consumers and a producer)
WGMMA_ROWS_PER_CONSUMER = 64
#: its K and V stages (``kWgmmaStages`` in kernels/fwd_wgmma.cu)
WGMMA_STAGES = 2
#: int32 of its persistent grid's work counter (``kWorkCounterInts``): the items taken, the blocks done taking
WGMMA_WORK_COUNTER_INTS = 2
#: columns of a TMA box row: 128 bytes of 16-bit elements, the 128-byte swizzle's row (``kSwizzleElems``)
SWIZZLE_ELEMS = 64
#: the bytes of that row (``kSwizzleRowBytes``)
SWIZZLE_BYTES = 2 * SWIZZLE_ELEMS
#: bwd_dkdv_mma: 8 warps in 2 x 4 and 4 x 2 grids of warp tiles (``kDkdvTiledThreads`` in kernels/bwd_mma.cu)
DKDV_TILED_THREADS = 256
#: bwd_dkdv_rows_mma keeps 16 x head_dim accumulators of dK and of dV per warp in registers; past this
#: head dim only one of them fits, and dK and dV are computed by two launches. (bwd_dkdv_mma, 8 warps
#: sharing them, serves every head dim where its tiles fit in shared memory.)
MMA_BACKWARD_FUSED_HEAD_DIM = 128
DKDV_BOTH, DKDV_DV_ONLY, DKDV_DK_ONLY = 0, 1, 2
#: the float32 dQ buffer of the backwards that add dQ with atomics pads each head's rows to a multiple of
#: this (mirrors ``DqAccum::kRowMultiple`` in kernels/common.cuh; at least the block_m of every dK/dV kernel)
DQ_ACCUM_ROWS = 128


def dq_accum_rows(seqlen_q: int) -> int:
    """Rows per (batch, head) of the atomic-dQ backward's float32 dQ buffer (``DqAccum::rows``)."""
    return -(-seqlen_q // DQ_ACCUM_ROWS) * DQ_ACCUM_ROWS


def dq_accum_packed_rows(batch: int, total_q: int) -> int:
    """Rows per head of that buffer in a packed batch of ``total_q`` query rows (``DqAccum::packed_rows``):
    each sequence's from a multiple of DQ_ACCUM_ROWS, at least dq_accum_rows(its length) apart."""
    return (total_q // DQ_ACCUM_ROWS + batch) * DQ_ACCUM_ROWS


def preprocess_lanes(head_dim: int, itemsize: int) -> int:
    """Lanes of bwd_preprocess per row: one per 16-byte chunk of a row, rounded up to a power of two, at
    most a warp's 32 (kernels/simt.cu)."""
    chunks = -(-head_dim * itemsize // 16)
    return min(32, 1 << max(chunks - 1, 0).bit_length())


def rows_dkdv_launches(head_dim: int, atomic_dq: bool) -> tuple[tuple[int, bool], ...]:
    """(part, adds dQ) of each bwd_dkdv_rows_mma launch: one for both gradients up to
    MMA_BACKWARD_FUSED_HEAD_DIM, else dV then dK. The atomic default adds dQ in the launch that computes
    dS (the one with dK), and only there."""
    parts = (DKDV_BOTH,) if head_dim <= MMA_BACKWARD_FUSED_HEAD_DIM else (DKDV_DV_ONLY, DKDV_DK_ONLY)
    return tuple((part, atomic_dq and part != DKDV_DV_ONLY) for part in parts)


@dataclasses.dataclass(frozen=True)
class DeviceProps:
    """What the tile table needs to know about a GPU."""

    compute_capability: int  # 80, 86, 89, 90, ...
    max_smem_per_block: int  # opt-in maximum of dynamic shared memory per block, bytes
    sm_count: int
    #: can the Hopper kernels (SM90A_KERNELS) run here: compute capability 9.0, TMA tensor maps encodable on the
    #: host (cuda-bindings importable) and an NVRTC that compiles for sm_90a through CuPy (_cupy_path.device_props)?
    tensor_maps: bool = False
    #: the L2 cache, bytes (0: unknown)
    l2_bytes: int = 0

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability}"


#: Reference devices, used when compiling without a GPU (values from the CUDA programming guide).
A100 = DeviceProps(80, 166912, 108, l2_bytes=40 << 20)
H100 = DeviceProps(90, 232448, 132, tensor_maps=True, l2_bytes=50 << 20)
RTX_4090 = DeviceProps(89, 101376, 128, l2_bytes=72 << 20)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization: everything that goes into its template arguments."""

    kernel: str
    dtype: np.dtype
    head_dim: int = 0  # padded head dim of the specialization (0: not a template argument)
    mask: int = 0  # MASK_NONE, MASK_CAUSAL or MASK_WINDOW (the kernels' MASK, MaskKind in kernels/common.cuh)
    block_m: int = 0
    block_n: int = 0
    threads: int = SIMT_THREADS
    smem_bytes: int = 0
    part: int = 0  # bwd_dkdv_rows_mma only: 0 dK and dV, 1 dV only, 2 dK only (DkdvPart in bwd_mma.cu)
    atomic_dq: bool = False  # the dK/dV kernels only: also add dQ into a float32 buffer with atomics
    key_split: int = 1  # fwd_mma only: warps that share each group of query rows (KEY_SPLIT in fwd_mma.cu)
    mods: int = 0  # MOD_* bits (the kernels' MODS)
    kvcache: bool = False  # fwd_mma only: the KV-cache forward (KVCACHE in fwd_mma.cu; _plan.kvcache)
    varlen: bool = False  # VARLEN_KERNELS only: a packed batch (VARLEN; Sequence in kernels/common.cuh)
    #: bwd_dkdv_wgmma only: the deterministic backward's ordered form (ORDERED_DQ in bwd_wgmma.cu;
    #: ordered_dq_kernel)
    ordered_dq: bool = False
    stages: int = 2  # bwd_dkdv_mma only: cp.async stages of the query tiles (STAGES in bwd_mma.cu)

    @property
    def source_file(self) -> str:
        return KERNEL_FILES[self.kernel]

    @property
    def arch_specific(self) -> bool:
        """Compiled for the architecture-specific target (sm_90a: wgmma, setmaxnreg), not the plain sm_XX."""
        return self.kernel in SM90A_KERNELS

    @property
    def name(self) -> str:
        """The C++ template instance, e.g. ``cuflash::fwd_mma<__half, 128, true, 128, 64, 4, 1>``."""
        if self.kernel == "varlen_order":   # int32 throughout: its template argument is the mask kind alone
            return f"cuflash::varlen_order<{int(self.mask)}>"
        if self.kernel == "transpose_v_float8":   # bytes: its template argument is the head dim alone
            return f"cuflash::transpose_v_float8<{self.head_dim}>"
        ctype = KERNEL_TYPES[np.dtype(self.dtype)]
        if self.kernel in ("bwd_preprocess", "merge_parts", "merge_into", "append_rotary"):
            args = [ctype]
        elif self.kernel == "bwd_dq_convert":
            args = [ctype, str(self.head_dim), "true" if self.varlen else "false"]
        else:
            args = [ctype, str(self.head_dim), str(int(self.mask)), str(self.mods), str(self.block_m), str(self.block_n)]
            if self.kernel not in MMA_KERNELS | SM90A_KERNELS:
                args.append(str(self.smem_bytes))
            if self.kernel in ("fwd_mma", "bwd_dq_mma"):
                args.append(str(self.threads // 32))
            if self.kernel == "fwd_mma":
                args += [str(self.key_split), "true" if self.kvcache else "false"]
            if self.kernel == "bwd_dkdv_rows_mma":
                args.append(str(self.part))
            if self.kernel == "bwd_dkdv_mma":
                args.append(str(self.stages))
            if self.kernel in ("bwd_dkdv_mma", "bwd_dkdv_rows_mma"):
                args.append("true" if self.atomic_dq else "false")
            if self.kernel == "bwd_dkdv_wgmma":
                args.append("true" if self.ordered_dq else "false")
            args.append("true" if self.varlen else "false")
        return f"cuflash::{self.kernel}<{', '.join(args)}>"

    @property
    def cache_key(self) -> tuple:
        """Every field, the dtype by name: two specs share a cache entry only where they are equal."""
        return tuple(np.dtype(value).name if field.name == "dtype" else value
                     for field, value in ((f, getattr(self, f.name)) for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The kernels of one (head dim, dtype, mask kind, device) problem.

    The backward runs ``bwd_preprocess``, then either the deterministic pair (``bwd_dkdv``, then
    ``bwd_dq``) or, where ``bwd_dkdv_atomic`` is not empty (float16/bfloat16), the default: the dK/dV
    kernels that also add dQ into a zeroed float32 buffer with atomics, then ``bwd_dq_convert``.
    """

    forward: KernelSpec
    bwd_preprocess: KernelSpec
    bwd_dkdv: tuple[KernelSpec, ...]  # one launch, or one per gradient past MMA_BACKWARD_FUSED_HEAD_DIM
    bwd_dq: KernelSpec
    bwd_dkdv_atomic: tuple[KernelSpec, ...] = ()
    bwd_dq_convert: KernelSpec | None = None
    #: the backward's dK/dV on Hopper in place of bwd_dkdv_atomic, where it serves (wgmma_dkdv_spec); the
    #: deterministic backward runs its ordered form (ordered_dq_kernel) or it on the split grid (split_grid_kernel)
    bwd_dkdv_wgmma: KernelSpec | None = None

    @property
    def specs(self) -> tuple[KernelSpec, ...]:
        hopper = (self.bwd_dkdv_wgmma,) if self.bwd_dkdv_wgmma else ()
        convert = (self.bwd_dq_convert,) if self.bwd_dkdv_atomic or hopper else ()
        return (self.forward, self.bwd_preprocess, *self.bwd_dkdv, self.bwd_dq, *self.bwd_dkdv_atomic, *convert,
                *hopper)


def padded_head_dim(head_dim: int) -> int:
    """The specialized head dim that serves ``head_dim`` (the smallest in HEAD_DIMS not below it)."""
    for d in HEAD_DIMS:
        if 1 <= head_dim <= d:
            return d
    raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")


def forward_row_elems(head_dim: int) -> int:
    """Elements per shared-memory tile row of the tensor-core forward (``ForwardRow`` in kernels/mma.cuh):
    XOR-swizzled rows of exactly head_dim elements where head_dim is a multiple of 64, else rows padded by
    8 elements."""
    return head_dim if head_dim % 64 == 0 else head_dim + 8


def mma_smem_bytes(kernel: str, head_dim: int, block_m: int, block_n: int, itemsize: int,
                   atomic_dq: bool = False, key_split: int = 1, stages: int = 2) -> int:
    """Shared memory of a tensor-core kernel; the backward's tile rows padded by 8 elements, the forward's
    per forward_row_elems (kernels/mma.cuh). Each kernel's own layout (FwdSmem, DkdvTiledSmem, DkdvRowsSmem,
    DqSmem in its source) must have this size: tests/test_compile.py checks it for every spec of the
    compile check."""
    row = (head_dim + 8) * itemsize
    if kernel == "fwd_mma" and itemsize == 1:   # float8 (KV cache): float16 Q, K, V, then the bytes as loaded: Q,
        # two stages of K and V
        return (block_m + 2 * block_n) * forward_row_elems(head_dim) * 2 + (block_m + 4 * block_n) * head_dim
    if kernel == "fwd_mma":  # Q, two stages of K and V; where warps share rows, their row maxima and P
        tiles = (block_m + 4 * block_n) * forward_row_elems(head_dim) * itemsize
        if key_split == 1:
            return tiles
        # a float per (row, warp of the row's group), 16-byte rows of per-lane slots; P as one itemsize tile
        return tiles + block_m * key_split * 16 + block_m * block_n * itemsize
    if kernel == "bwd_dkdv_mma":  # K, V, the stages of Q and dO, P and dS, the stages of lse and delta
        return ((2 * block_n + 2 * stages * block_m) * row + 2 * block_m * (block_n + 8) * itemsize
                + 2 * stages * block_m * 4)
    if kernel == "bwd_dkdv_rows_mma":  # K, V, two stages of Q and dO, two stages of lse and delta
        ds_transposed = block_n * (block_m + 8) * itemsize if atomic_dq else 0  # dS^T for the dQ product
        return (2 * block_n + 4 * block_m) * row + 4 * block_m * 4 + ds_transposed
    if kernel == "bwd_dq_mma":  # Q, dO, two stages of K and V
        return (2 * block_m + 4 * block_n) * row
    raise ValueError(f"not a tensor-core kernel: {kernel}")


def simt_smem_bytes(kernel: str, head_dim: int, block_m: int, block_n: int) -> int:
    """float32 tiles with rows padded by one word (``SimtTiles`` in kernels/simt.cu)."""
    row, score_row = head_dim + 1, block_n + 1
    if kernel == "fwd_simt":
        floats = (block_m + 2 * block_n) * row + block_m * score_row + 3 * block_m
    else:
        floats = (2 * block_m + 2 * block_n) * row + 2 * block_m * score_row + 2 * block_m
    return 4 * floats


def _mma_backward_tiles(kernel: str, head_dim: int, mask: int = MASK_NONE, mods: int = 0) -> tuple[int, int]:
    """(block_m, block_n) of the tensor-core backward kernels, before fitting shared memory.

    bwd_dkdv_mma: block_n keys, 8 warps tiling each product in 2-D (kernels/bwd_mma.cu); its tiles are
    fixed (no fitting): where they do not fit, bwd_dkdv_rows_mma serves. TFLOP/s of the atomic-dQ
    backward measured on the H200, bfloat16, FlashAttention's grid at seqlen 1k / 4k / 16k, non-causal;
    causal (tools/tune.py bwd, bench/NOTES.md backward v4; past head_dim 128 the only tile that fits,
    64 x 64, measured against the rows kernel's two launches and FlashAttention-2 in bench/NOTES.md b11):
      head_dim 64:  128 x 128 182 / 224 / 244, causal 132 / 208 / 246;  64 x 128 169 / 206 / 219;
                    128 x 64 138 / 162 / 171;  64 x 64 125 / 145 / 151;  rows kernel 64 x 64 161 / 197 / 207
      head_dim 128: 64 x 128 201 / 251 / 267, causal 154 / 236 / 268;  128 x 64 157 / 181 / 189;
                    64 x 64 145 / 166 / 173;  rows kernel 32 x 64 174 / 204 / 210
    bwd_dkdv_rows_mma (head dims past 128; GPUs with less shared memory): 16 keys per warp (block_n / 16
    warps) hold dK and dV, head_dim / 2 float32 registers each per thread, plus the 16 x block_m tiles
    P^T and dS^T. Measured before bwd_dkdv_mma existed, with one 16-row atom per warp in bwd_dq_mma
    (tools/tune.py, bench/NOTES.md backward v3):
    Atomic-dQ default (dkdv block_m x block_n), non-causal; causal:
      head_dim 64:  64 x 64 137 / 177, causal 115 / 173;  64 x 128 139 / 161;  32 x 64 119 / 146
      head_dim 128: 32 x 64 150 / 194, causal 127 / 190;  32 x 128 150 / 177;  64 x 64 spills 48 bytes
    Deterministic (dkdv block_m x block_n, dq block_m x block_n), non-causal (head_dim 64 moved to the
    atomic kernel's 64 x 64 dkdv tile with the 64 x 64 dq tile after the table above; bench grid):
      head_dim 64:  (32 x 64, 64 x 64) 125 / 149;  (64 x 64, 128 x 32) 125 / 148;  (64 x 128, 128 x 64) 120 / 140
      head_dim 128: (32 x 64, 64 x 64) 138 / 158;  (32 x 128, 128 x 32) 127 / 146;  (16 x 64, 64 x 32) 116 / 132
      head_dim 256 (dK and dV in two launches): (16 x 64, 64 x 32) 86 / 95;  (32 x 64, 64 x 16) 80 / 91
    """
    if kernel == "bwd_dkdv_mma":
        # dropout at head_dim 32 spilled 8-28 bytes at 128 x 128 under the masks (sm_90, NVRTC 13.0; at
        # head_dim 64 it fits): 64 x 128 there, not measured
        if head_dim <= 32 and mods & MOD_DROPOUT:
            return 64, 128
        # past head_dim 128 FlashAttention-2's 64 x 64 tile (222 KB of shared memory at 256: sm_90 only)
        return (128, 128) if head_dim <= 64 else (64, 128) if head_dim <= 128 else (64, 64)
    if kernel == "bwd_dkdv_rows_mma":
        if head_dim > MMA_BACKWARD_FUSED_HEAD_DIM:
            return 16, 64
        # both modes: 64 query rows per step reuse each K/V fragment twice as often; at head_dim 128
        # they spill (the atomic kernel's dS^T store adds nothing to the tile choice). A sliding window's
        # left side takes one more register: with it the atomic kernel spills 4 bytes at 32 x 64 (sm_80,
        # NVRTC 13.0) and 16 x 64 fits; so does dropout (32 x 64 spilled 8-64 bytes, the most with a
        # softcap). Not measured (no sm_8x GPU to hand).
        if head_dim <= 64:
            return 64, 64
        return (16, 64) if mask == MASK_WINDOW or mods & MOD_DROPOUT else (32, 64)
    raise ValueError(f"not a dK/dV kernel: {kernel}")


def _mma_dq_tiles(head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, warps) of bwd_dq_mma (the deterministic backward's dQ where its split grid does not
    serve: deterministic_dq_splits), before fitting shared memory. A warp owns block_m / warps query rows,
    16 per mma atom, and holds their dQ, S and dP.
    TFLOP/s of the deterministic backward (with bwd_dkdv_mma) measured on the H200, bfloat16,
    FlashAttention's grid at seqlen 1k / 4k / 16k, non-causal; causal (tools/tune.py --deterministic):
      head_dim 64:  128 x 64, 4 warps 168 / 204 / 217, causal 126 / 192 / 220;
                    128 x 32, 4 warps 162 / 194 / 205;  64 x 64, 2 warps 156 / 193 / 208;
                    64 x 64, 4 warps (one atom per warp) 155 / 186 / 197
      head_dim 128: 64 x 64, 4 warps 173 / 211 / 222, causal 129 / 200 / 224;  128 x 16, 4 warps 172 / 208 / 219;
                    64 x 32, 4 warps 164 / 198 / 207;  two atoms per warp at 32 or more keys spill
    After backward v6, one 16-row atom per warp on 8 warps (half the K/V tile loads per query row) against
    the entries kept, medians of two rounds (bench/NOTES.md):
      head_dim 64:  128 x 32, 4 warps 163 / 197 / 209, causal 121 / 185 / 214;
                    128 x 128, 8 warps 161 / 187 / 196, causal 120 / 173 / 197
      head_dim 128: 64 x 64, 4 warps 185 / 217 / 226, causal 148 / 204 / 226;
                    128 x 64, 8 warps 172 / 206 / 214, causal 144 / 195 / 216
    """
    if head_dim <= 64:
        return 128, 32, 4  # 128 x 64 spills 8 bytes (sm_80; sm_90 under the causal mask)
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 4)


def mma_spec(kernel: str, dtype, head_dim: int, mask: int, block_m: int, block_n: int, warps: int, part: int = 0,
             atomic_dq: bool = False, key_split: int = 1, mods: int = 0, stages: int = 2) -> KernelSpec:
    """A tensor-core kernel's spec at the given tile, its shared memory derived (mma_smem_bytes): the
    table's choices and tools/tune.py's candidates both come from here."""
    dtype = np.dtype(dtype)
    smem = mma_smem_bytes(kernel, head_dim, block_m, block_n, dtype.itemsize, atomic_dq, key_split, stages)
    return KernelSpec(kernel, dtype, head_dim, mask, block_m, block_n, warps * 32, smem, part, atomic_dq,
                      key_split, mods, stages=stages)


def dkdv_specs(kernel: str, dtype, head_dim: int, mask: int, block_m: int, block_n: int, atomic_dq: bool,
               mods: int = 0, stages: int = 2) -> tuple[KernelSpec, ...]:
    """The dK/dV launches at the given tile: bwd_dkdv_mma's one (DKDV_TILED_THREADS; ``stages`` of the query
    tiles), or bwd_dkdv_rows_mma's (a warp per 16 keys; dK and dV in two launches past
    MMA_BACKWARD_FUSED_HEAD_DIM, rows_dkdv_launches)."""
    if kernel == "bwd_dkdv_mma":
        return (mma_spec(kernel, dtype, head_dim, mask, block_m, block_n, DKDV_TILED_THREADS // 32,
                         atomic_dq=atomic_dq, mods=mods, stages=stages),)
    return tuple(mma_spec(kernel, dtype, head_dim, mask, block_m, block_n, block_n // MMA_ROWS_PER_WARP, part, adds_dq,
                          mods=mods) for part, adds_dq in rows_dkdv_launches(head_dim, atomic_dq))


def one_stage_dkdv_fits(head_dim: int, mask: int, mods: int) -> bool:
    """Does bwd_dkdv_mma with one query-tile stage compile without a spill on sm_80 (where an A100 needs it)? At
    head_dim 192; at 256 without a window or score modifiers (its dQ in slices of 16 columns, kernels/bwd_mma.cu).
    Compiled for every mask and modifier, dense and packed, dQ added or not (NVRTC 13.0): 256 spilled 4-40 bytes
    under a window or with any modifier, 224 4-48 bytes with either stage count (its 4 x 2 warp grid)."""
    return head_dim == 192 or head_dim == 256 and mask != MASK_WINDOW and not mods


def _tiled_dkdv_spec(dtype, head_dim: int, mask: int, device: DeviceProps,
                     atomic_dq: bool, mods: int = 0) -> KernelSpec | None:
    """bwd_dkdv_mma's spec, or None where it does not serve (too little shared memory for its tiles: A100
    and RTX 4090 at head_dim 128, RTX 4090 past it). Two query-tile stages where they fit; one where two do
    not and one_stage_dkdv_fits (an A100 at 192 and 256, FlashAttention-2's answer there), rather than the rows
    kernel's two launches. Up to the fused head dim the rows kernel's one launch stays (not measured
    against)."""
    block_m, block_n = _mma_backward_tiles("bwd_dkdv_mma", head_dim, mask, mods)
    one_stage = one_stage_dkdv_fits(head_dim, mask, mods)
    for stages in (2, 1) if one_stage else (2,):
        spec, = dkdv_specs("bwd_dkdv_mma", dtype, head_dim, mask, block_m, block_n, atomic_dq, mods, stages)
        if spec.smem_bytes <= device.max_smem_per_block:
            return spec
    return None


def _mma_spec(kernel: str, dtype, head_dim: int, mask: int, device: DeviceProps, part: int = 0,
              atomic_dq: bool = False, mods: int = 0) -> KernelSpec:
    key_split = 1
    if kernel == "fwd_mma":
        block_m, block_n, table_warps, key_split = _mma_forward_tiles(head_dim, mask != MASK_NONE, device, mods)
    elif kernel == "bwd_dq_mma":
        block_m, block_n, table_warps = _mma_dq_tiles(head_dim)
    else:
        block_m, block_n = _mma_backward_tiles(kernel, head_dim, mask, mods)
    # Halve the streamed tile, then the resident one, until everything fits (head_dim 256 forward on
    # sm_80: 64 x 32). Tiles stay multiples of the 16 x 16 mma block.
    def fits(bm, bn):
        return mma_smem_bytes(kernel, head_dim, bm, bn, dtype.itemsize, atomic_dq, key_split) <= device.max_smem_per_block

    streamed_is_m = kernel == "bwd_dkdv_rows_mma"
    while not fits(block_m, block_n):
        streamed, resident = (block_m, block_n) if streamed_is_m else (block_n, block_m)
        if streamed > MMA_ROWS_PER_WARP:
            streamed //= 2
        elif resident > MMA_ROWS_PER_WARP:
            resident //= 2
        else:
            raise ValueError(f"no {kernel} tile for head_dim {head_dim} fits in {device.max_smem_per_block} "
                             "bytes of shared memory")
        block_m, block_n = (streamed, resident) if streamed_is_m else (resident, streamed)
    # Warps follow the fitted tile: the forward and dQ kernels keep their table's count while whole 16-row
    # atoms remain; bwd_dkdv_rows_mma has one warp per 16 keys.
    if kernel in ("fwd_mma", "bwd_dq_mma"):
        warps = min(table_warps, block_m * key_split // MMA_ROWS_PER_WARP)
    else:
        warps = block_n // MMA_ROWS_PER_WARP
    return mma_spec(kernel, dtype, head_dim, mask, block_m, block_n, warps, part, atomic_dq, key_split, mods)


def _mma_forward_tiles(head_dim: int, causal: bool, device: DeviceProps, mods: int = 0) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, key_split) of the tensor-core forward, before fitting shared memory.

    A warp owns block_m / warps query rows (16 per mma atom); with key_split 2, a pair of warps owns
    2 * block_m / warps rows, each computing S for half the keys and P.V for half the head dim
    (KEY_SPLIT in kernels/fwd_mma.cu). TFLOP/s measured on the H200,
    bfloat16, FlashAttention's grid at seqlen 1k / 4k, non-causal (tools/tune.py, bench/NOTES.md):
      head_dim 64:  128 x 64, 4 warps 211 / 238;  128 x 32, 4 warps 199 / 232;  64 x 64, 4 warps 179 / 202
      head_dim 128: 128 x 32, 4 warps 216 / 252;  64 x 32, 4 warps 203 / 226;  128 x 64, 8 warps 175 / 212
      head_dim 256: 128 x 32, 8 warps 191 / 219;  64 x 32, 4 warps 184 / 208;  64 x 64, 4 warps 146 / 162
    After the cheaper tile loader (forward v3), seqlen 512 / 1k / 4k, non-causal; causal:
      head_dim 64:  128 x 64, 4 warps 201 / 234 / 271, causal 130 / 156 / 212;  64 x 64, 2 warps 178 / 207 / 252
      head_dim 128: 128 x 64, 4 warps 190 / 234 / 294, causal 153 / 211 / 297;
                    128 x 32, 4 warps 207 / 242 / 278, causal 122 / 169 / 252
      head_dim 256: 128 x 32, 8 warps 166 / 197 / 229, causal 115 / 157 / 218;  64 x 32, 4 warps 164 / 189 / 236
    After forward v5 (cheaper loader, rescale skipped), seqlen 1k / 4k / 16k, non-causal; causal:
      head_dim 64:  128 x 64, 4 warps 284 / 324 / 314, causal 220 / 302 / 313;
                    128 x 128, 4 warps 293 / 320 / 315, causal 231 / 307 / 333 (spills 8 bytes on sm_90
                    under the causal mask: not taken)
      head_dim 256: 128 x 64, 8 warps (FlashAttention-2's tile) 227 / 272 / 288, causal 197 / 257 / 283;
                    128 x 32, 8 warps 219 / 237 / 251, causal 182 / 233 / 254
                    (medians of four rounds in two device calls, bench/NOTES.md forward v6)
    After forward v7 (swizzled tiles; head_dim 128 in 32-key sub-tiles), the same tiles, medians of four
    rounds: head_dim 64 289 / 320 / 330, causal 226 / 297 / 329; head_dim 128 317 / 357 / 369, causal
    266 / 338 / 374; head_dim 256 286 / 316 / 326, causal 241 / 308 / 333. K and V single-buffered
    (FlashAttention-2's pipeline; at head_dim 256, 64 x 64 tiles of 4 warps, two blocks per SM) were 8-25%
    slower at every head dim (bench/NOTES.md forward v7).
    Forward v8, head_dim 256 without the mask, 128 x 64, 8 warps as pairs (key_split 2) against one warp
    per 16 rows, bfloat16, seqlen 512 / 1k / 2k / 4k / 8k / 16k, medians of six interleaved rounds (FA2
    in the same rounds 284 / 307 / 318 / 324 / 328 / 326): 275 / 309 / 328 / 339 / 342 / 343 against
    269 / 299 / 317 / 326 / 330 / 333 (float16 2k-16k 328 / 337 / 337 / 343 against 317 / 326 / 328 /
    330). Pairs only on sm_90 without the mask and without score modifiers: under the mask ptxas spills 28
    bytes, with a softcap and ALiBi 20 (NVRTC 13.0); on sm_8x (where head_dim 256 fits 32 keys per tile) it
    is not measured. Modifiers share the plain kernels' tiles, dropout included (no pairs at head_dim 256),
    except on sm_8x at head_dim 64 and less, where dropout takes 128 x 32 (128 x 64 spilled 4-52 bytes there;
    unmeasured, no sm_8x GPU). On sm_90 the dropout forward's 128 x 64 spills 4-76 bytes at head_dim 64 and
    128 under some masks and modifiers (NVRTC 13.0; tests/test_compile.py bounds it), and still measured
    faster than the narrower tiles that fit (bench/NOTES.md dropout d2, dropout 0.1, causal, (2, 8192, 2048 /
    head_dim, head_dim) bfloat16, time over plain causal: head_dim 64 1.47x against 1.60x at 128 x 32;
    head_dim 128 1.28x against 1.33x at 64 x 64).
    """
    dropout = bool(mods & MOD_DROPOUT)
    if head_dim <= 64:
        return (128, 32, 4, 1) if dropout and device.compute_capability < 90 else (128, 64, 4, 1)
    if head_dim <= 128:
        # sm_80's ptxas spills on 128-row tiles at head_dim 128 (20 bytes at 128 x 32): 64 x 32 there;
        # head_dim 96 spills 16 bytes at 128 x 64 under the causal mask: 128 x 32
        if device.compute_capability < 90:
            return 64, 32, 4, 1
        if head_dim == 128:
            return 128, 64, 4, 1
        return 128, 32, 4, 1
    if head_dim == 256 and not causal and not mods & (SCORE_MODS | MOD_DROPOUT) and device.compute_capability >= 90:
        return 128, 64, 8, 2
    return 128, 64, 8, 1


def wgmma_smem_bytes(head_dim: int, block_m: int, block_n: int, itemsize: int = 2) -> int:
    """fwd_wgmma's shared memory (``WgmmaFwdSmem`` in kernels/fwd_wgmma.cu): the Q tile, WGMMA_STAGES stages of
    K and of V, 6 + 4 * WGMMA_STAGES mbarriers of 8 bytes and two work-item slots (4 bytes each)."""
    return (block_m + 2 * WGMMA_STAGES * block_n) * head_dim * itemsize + 8 * (6 + 4 * WGMMA_STAGES) + 2 * 4


def wgmma_threads(block_m: int) -> int:
    """fwd_wgmma's threads: a producer warpgroup and block_m / 64 consumers (``WgmmaRoles::kThreads``)."""
    return 128 * (1 + block_m // WGMMA_ROWS_PER_CONSUMER)


#: the modifiers whose state, together, does not fit three fwd_wgmma consumers of 160 registers at head_dim 64
#: (NVRTC 13.0, sm_90a, 192 x 128: softcap with dropout spills 16-616 bytes); every other combination of the
#: modifiers fits under every mask, dense and packed
WGMMA_SPILLING_MODS = MOD_SOFTCAP | MOD_DROPOUT


def _wgmma_forward_tiles(head_dim: int, mods: int = 0) -> tuple[int, int]:
    """(block_m, block_n) of fwd_wgmma at a (64-multiple) head dim. Key tiles: the widest whose S, P and O fit
    the consumers' registers beside each other (64 x (block_n + block_n / 2 + head_dim) / 128 per thread, 240 for
    two consumers, 160 for three) and whose stages fit in shared memory, unless a narrower one measured faster.
    TFLOP/s on the H200, bfloat16, FlashAttention's grid at seqlen 1k / 4k / 16k, non-causal; causal; with the
    kernel's ping-pong choice (on up to head_dim 128), medians of 20 calls in one process (bench/NOTES.md h2):
      head_dim 64:  192 x 128 (three consumers) 382 / 444 / 514, causal 240 / 405 / 498;
                    128 x 128 344 / 378 / 413, causal 252 / 370 / 413
      head_dim 128: 128 x 128 540 / 664 / 639, causal 335 / 541 / 600;  128 x 176 512 / 588 / 635
      head_dim 192: 128 x 96 429 / 670 / 703, causal 313 / 603 / 714;  128 x 112 423 / 624 / 688
      head_dim 256: 128 x 64 597 / 762 / 767, causal 335 / 629 / 709;  128 x 80 593 / 736 / 711
    At head_dim 64 the modifiers that fit three consumers keep 192 x 128 (features suite, causal, seqlen 2k / 4k /
    8k / 16k, 192 x 128 against 128 x 128: sinks 396 / 431 / 511 / 553 against 358 / 371 / 421 / 455, ALiBi
    336 / 362 / 429 / 459 against 330 / 343 / 383 / 408; bench/NOTES.md, session 12), and so do the softcap and
    dropout (causal, seqlen 2k / 8k / 16k, forward ms, 192 x 128 against 128 x 128 in one process: softcap 0.483 /
    1.657 / 3.208 against 0.470 / 1.722 / 3.343, dropout 0.483 / 1.655 / 3.230 against 0.469 / 1.738 / 3.423;
    bench/NOTES.md, session 16); the softcap with dropout, which would spill there, takes 128 x 128.
    """
    if head_dim == 64 and mods & WGMMA_SPILLING_MODS == WGMMA_SPILLING_MODS:   # three consumers would spill
        return 128, 128
    return {64: (192, 128), 128: (128, 128), 192: (128, 96), 256: (128, 64)}[head_dim]


def wgmma_forward_spec(head_dim: int, dtype, mask: int, device: DeviceProps, mods: int = 0) -> KernelSpec | None:
    """The Hopper forward (fwd_wgmma) for one problem, or None where it does not serve: a GPU other than
    compute capability 9.0 or no tensor maps (DeviceProps.tensor_maps), float32, a head dim of 32 or
    less (fwd_mma's 128 x 64 tiles waste no columns there; the 64-column TMA boxes would waste half) or not a
    multiple of 8 (TMA's rows are multiples of 16 bytes). Its head dim is the user's rounded up to a multiple
    of 64: the missing columns read as zeros (TMA) and are never stored."""
    dtype = np.dtype(dtype)
    if (device.compute_capability != 90 or not device.tensor_maps or dtype == np.float32 or head_dim <= 32
            or head_dim % 8):
        return None
    d = -(-head_dim // SWIZZLE_ELEMS) * SWIZZLE_ELEMS
    block_m, block_n = _wgmma_forward_tiles(d, mods)
    return wgmma_spec(dtype, d, mask, block_m, block_n, mods, device)


#: the float8 forward's tiles (fwd_wgmma of e4m3) per head dim, (block_m, block_n): a key tile is a row of V^T in
#: boxes of 128 or 64 bytes with that swizzle (wgmma_row_bytes), and at head_dim 64 Q's and K's rows are 64 bytes
#: too. Its S, P (a quarter of S's registers) and O must fit the consumers' registers beside each other: 64 x
#: (block_n + block_n / 4 + head_dim) / 128 per thread, 232 for two consumers, 160 for three. head_dim 64: three
#: consumers, as the 16-bit forward (112 registers); 128: two on 192-key tiles (184; 256 keys, 224, spill 160-276
#: bytes and serialize the wgmma); 256: two on 64-key tiles (168; the 128-key tile's 208 spills and serializes the
#: wgmma). ptxas (NVRTC 13, sm_90a): no spill under every mask and modifier.
FLOAT8_TILES = {64: (192, 128), 128: (128, 192), 256: (128, 64)}
#: the float8 tiles under a window where they differ: head_dim 128's 192-key tile with every modifier spilled 164
#: bytes there
FLOAT8_WINDOW_TILES = {128: (128, 128)}
FLOAT8_HEAD_DIMS = tuple(FLOAT8_TILES)
#: transpose_v_float8's threads (its __launch_bounds__) and the keys of its blocks (``kTransposeKeys``): V^T's
#: keys are padded to a multiple of them
FLOAT8_TRANSPOSE_THREADS = 256
FLOAT8_TRANSPOSE_KEYS = 128


def float8_forward_spec(head_dim: int, mask: int, device: DeviceProps, mods: int = 0,
                        varlen: bool = False) -> KernelSpec | None:
    """The float8 forward (fwd_wgmma of e4m3) for one problem, or None where it does not serve: a GPU other than
    compute capability 9.0 or no tensor maps, a head dim other than FLOAT8_HEAD_DIMS, dropout, a packed batch."""
    if (device.compute_capability != 90 or not device.tensor_maps or head_dim not in FLOAT8_HEAD_DIMS
            or mods & MOD_DROPOUT or varlen):
        return None
    tiles = FLOAT8_WINDOW_TILES.get(head_dim) if mask == MASK_WINDOW else None
    return wgmma_spec(FLOAT8_E4M3, head_dim, mask, *(tiles or FLOAT8_TILES[head_dim]), mods, device)


def wgmma_row_bytes(spec: KernelSpec) -> tuple[int, int, int]:
    """The bytes of a box row of fwd_wgmma's maps of q, k and v, each its swizzle's (128 or 64): q's and k's
    ``WgmmaFwdSmem::kRowBytes``, the 128-byte swizzle's row or a shorter row's whole (float8 at head_dim 64); v's
    the 128-byte row of 16-bit V, or a box of float8's V^T (``kVRowBytes`` keys of a head_dim row: 128 where they
    divide the key tile, else 64; a key tile takes block_n / that boxes)."""
    qk = min(SWIZZLE_BYTES, spec.head_dim * np.dtype(spec.dtype).itemsize)
    if np.dtype(spec.dtype) != FLOAT8_E4M3:
        return qk, qk, SWIZZLE_BYTES
    return qk, qk, SWIZZLE_BYTES if spec.block_n % SWIZZLE_BYTES == 0 else SWIZZLE_BYTES // 2


def float8_transpose_spec(head_dim: int) -> KernelSpec:
    """transpose_v_float8 (kernels/fwd_wgmma.cu), which writes the float8 forward's V^T."""
    return KernelSpec("transpose_v_float8", FLOAT8_E4M3, head_dim, threads=FLOAT8_TRANSPOSE_THREADS)


#: fwd_wgmma runs on a persistent grid (a block per SM, taking work items from a counter) where a query block
#: visits at most this many keys
WGMMA_PERSISTENT_MAX_KEYS = 2048


def wgmma_forward_persistent(item_keys: int, mean_keys: int | None = None) -> bool:
    """Does fwd_wgmma run on a persistent grid, its query blocks visiting at most ``item_keys`` keys each
    (``_plan.keys_per_query_block``: seqlen_k, or fewer under a window bounded on both sides)? Where items are
    short: the next item's loads then overlap this one's last products and epilogue. A packed batch in
    varlen_order's walk (_plan.forward), its longest sequence of ``item_keys`` keys and its sequences of
    ``mean_keys`` on average, is judged by the mean: most of its items are shorter than the longest's.

    TFLOP/s on the H200, bfloat16, FlashAttention's grid, one block per item / persistent, at seqlen 512 / 1k /
    4k / 16k (bench/NOTES.md h4):
      head_dim 64:  255 / 324, 330 / 379, 477 / 453, 506 / 514;  causal 147 / 188, 220 / 270, 418 / 443, 489 / 501
      head_dim 128: 414 / 485, 541 / 594, 687 / 682, 665 / 659;  causal 238 / 259, 334 / 361, 559 / 577, 635 / 628
      head_dim 256: 405 / 438, 543 / 573, 731 / 734, 772 / 751;  causal 234 / 229, 333 / 329, 641 / 662, 800 / 741
    Packed batches of the varlen suite (bench/varlen.py: 16384 tokens, means 1365-2048 keys, longest 3072-8192),
    bfloat16, forward ms on an H100, one block per item / persistent (bench/NOTES.md, session 34):
      head_dim 64:  long-tail 1.484 / 1.406, mixed 0.589 / 0.509, random 1.131 / 1.044;
                    causal 0.965 / 0.938, 0.419 / 0.363, 0.782 / 0.726
      head_dim 128: long-tail 1.066 / 1.069, mixed 0.452 / 0.446, random 0.858 / 0.838;
                    causal 0.689 / 0.702, 0.300 / 0.270, 0.537 / 0.519
    """
    keys = item_keys if mean_keys is None else min(item_keys, mean_keys)
    return keys <= WGMMA_PERSISTENT_MAX_KEYS


#: fwd_wgmma's query blocks of head_dim 64 under the causal mask, without modifiers, that visit at most this many
#: keys take 128 x 128 tiles (wgmma_forward_for_keys)
WGMMA_SHORT_CAUSAL_MAX_KEYS = 1024


#: The smallest softmax_scale at which the Hopper kernels take ALiBi without the softcap or dropout (and, in the
#: forward, the sinks): wgmma_takes_scale. There the forward, and the backward at head_dim 64, keep the bias in
#: S's units, slope / scale, clamped to float's range (kernels/fwd_wgmma.cu and bwd_wgmma.cu, kAlibiInS; the
#: rule holds at every head dim, so that it does not depend on the tile table): from 2^-60 up, a clamped unit
#: still gives every pair 1 or more apart a bias past 2^68, beyond any score (MAX_BASE2_SCORE), so the clamp
#: changes no probability.
WGMMA_ALIBI_MIN_SCALE = 2.0**-60


def wgmma_takes_scale(kernel_mods: int, softmax_scale: float) -> bool:
    """Does a Hopper kernel whose specialization has ``kernel_mods`` (the forward's: the problem's mods; the
    backward's: without MOD_SINKS) serve a 16-bit problem at ``softmax_scale``? With ALiBi alone only from
    WGMMA_ALIBI_MIN_SCALE up; below it the portable kernels do (they add the bias to finished scores, as the
    Hopper kernels do beside the softcap, the forward's sinks or dropout)."""
    bias_in_s = kernel_mods == MOD_ALIBI
    return not bias_in_s or softmax_scale >= WGMMA_ALIBI_MIN_SCALE


def wgmma_forward_for_keys(spec: KernelSpec, item_keys: int, device: DeviceProps) -> KernelSpec:
    """The tile table's fwd_wgmma ``spec`` for query blocks that visit at most ``item_keys`` keys
    (``_plan.keys_per_query_block``; a packed batch's longest sequence's): at head_dim 64 under the causal mask
    without modifiers, 128 x 128 (two consumers) up to WGMMA_SHORT_CAUSAL_MAX_KEYS keys, where the 192-row
    blocks' diagonal tiles and ragged last block (1024 = 5 x 192 + 64) weigh most; else ``spec``. TFLOP/s on the
    H200, FlashAttention's grid, causal, 192 x 128 / 128 x 128 in one process (tools/ab_probe.py, 3 rounds;
    bench/NOTES.md session 31): bfloat16 at seqlen 512 / 1k / 2k / 4k 211.8 / 227.9, 282.2 / 303.0, 393.4 /
    364.3, 419.1 / 374.6; float16 at 512 / 1k 205.7 / 227.4, 273.8 / 295.0. Packed, 16 sequences of 1k causal
    (the varlen suite's equal batch, an H100, forward ms): 0.262 / 0.239 (bench/NOTES.md session 33)."""
    if (spec.kernel == "fwd_wgmma" and spec.head_dim == 64 and spec.mask == MASK_CAUSAL and not spec.mods
            and spec.dtype != FLOAT8_E4M3 and item_keys <= WGMMA_SHORT_CAUSAL_MAX_KEYS):
        short = wgmma_spec(spec.dtype, spec.head_dim, spec.mask, 128, 128, spec.mods, device)
        return spec if short is None else dataclasses.replace(short, varlen=spec.varlen)
    return spec


def wgmma_spec(dtype, head_dim: int, mask: int, block_m: int, block_n: int, mods: int = 0,
               device: DeviceProps | None = None) -> KernelSpec | None:
    """fwd_wgmma's spec at the given tile, its threads and shared memory derived; None where the tile does not
    fit ``device``'s shared memory. The table's choice and the probes' candidates both come from here."""
    dtype = np.dtype(dtype)
    smem = wgmma_smem_bytes(head_dim, block_m, block_n, dtype.itemsize)
    if device is not None and smem > device.max_smem_per_block:
        return None
    return KernelSpec("fwd_wgmma", dtype, head_dim, int(mask), block_m, block_n, wgmma_threads(block_m), smem,
                      mods=mods)


#: bwd_dkdv_wgmma's tile (kernels/bwd_wgmma.cu): per head dim, the keys of a block, which its two consumers split
#: (64 keys each) up to head_dim 128; at 256 they split the columns of 64 keys (dK and dV of 64 keys by 256 columns
#: would take 256 registers a thread)
WGMMA_DKDV_BLOCK_N = {64: 128, 128: 128, 256: 64}
WGMMA_DKDV_HEAD_DIMS = tuple(WGMMA_DKDV_BLOCK_N)
#: its query rows per step: WGMMA_DKDV_TALL_BLOCK_M at head_dim 64 (kTallSteps; wgmma_dkdv_block_m), else 64
WGMMA_DKDV_BLOCK_M, WGMMA_DKDV_TALL_BLOCK_M = 64, 128


def wgmma_dkdv_block_m(head_dim: int) -> int:
    """bwd_dkdv_wgmma's query rows per step at the padded ``head_dim``, under every mask, in the default form and
    the ordered (deterministic) one.

    At head_dim 64 without a mask both forms take 128 rows a step (FlashAttention-3's tile there): each
    consumer's S^T and dP^T are 64 keys by 128 queries and the consumers meet to split dQ by queries. Backward ms
    on the H200 (bfloat16, FlashAttention's grid, 64 / 128 rows; bench/NOTES.md b18): 1.192 / 1.035 at 1k,
    3.847 / 3.318 at 4k, 14.479 / 13.086 at 16k. The ordered form's steps issue S^T and dP^T as one group (as
    two they spill 20-36 bytes, ptxas of NVRTC 13.0 for sm_90a); its backward ms with 64 / 128 rows on an H100
    (the same grid; bench/NOTES.md session 31): 0.883 / 0.783 at 512, 1.414 / 1.128 at 1k, 4.319 / 3.432 at 4k,
    15.375 / 12.778 at 16k.

    Under the causal mask the default form takes 128 rows too: backward ms on an H100, 64 / 128 rows in one
    process (tools/backward_ab.py, 2 rounds, the pair-major bands; bench/NOTES.md session 37): 0.574 / 0.524 at
    512, 0.760 / 0.694 at 1k (another call), 1.164 / 1.051 at 2k, 1.989 / 1.708 at 4k, 3.827 / 3.098 at 8k,
    7.113 / 6.132 at 16k. (On the H200 in b18, before the kernel's later steps, 64 rows had led at 4k: 1.963 /
    2.102.) The ordered form's backward ms, 64 / 128 rows (an H100, one process, its key blocks side by side to
    2k; bench/NOTES.md session 38): 0.831 / 0.790 at 1k, 1.309 / 1.155 at 2k, 2.270 / 1.948 at 4k, 4.292 / 3.617
    at 8k, 8.087 / 6.769 at 16k.

    Under a window too: forward+backward ms of a causal 1024-key window on an H100, 64 / 128 rows in one process
    (tools/feature_ab.py, 2 rounds; bench/NOTES.md session 42): 1.329 / 1.229 at 2k, 1.592 / 1.469 at 8k, 1.663 /
    1.494 at 16k; the deterministic backward's ordered form 1.422 / 1.321 at 2k, 1.677 / 1.579 at 8k. With dropout
    the 128-row steps spill 4-20 bytes (NVRTC 13.0, sm_90a) and still lead (same tool and session, dropout 0.1, 64 /
    128 rows): causal 2.091 / 1.841 at 2k, 6.786 / 5.946 at 8k; under the window 1.783 / 1.591 at 2k, 2.128 / 1.896
    at 8k."""
    return WGMMA_DKDV_TALL_BLOCK_M if head_dim == 64 else WGMMA_DKDV_BLOCK_M


def wgmma_dkdv_smem_bytes(head_dim: int, itemsize: int = 2, block_m: int = WGMMA_DKDV_BLOCK_M) -> int:
    """bwd_dkdv_wgmma's shared memory (``BwdWgmmaSmem``): K and V, two stages of Q and dO, two of dS^T, up to
    head_dim 128 each consumer warp's dQ share (16 x 64 float32, 8 warps), two stages of lse and delta
    (float32) and of the first query row (int32), and 5 mbarriers."""
    m, n, d = block_m, WGMMA_DKDV_BLOCK_N[head_dim], head_dim
    dq_shares = 8 * 16 * 64 * 4 if head_dim <= 128 else 0
    return (2 * n * d + 2 * 2 * m * d + 2 * n * m) * itemsize + dq_shares + 2 * (2 * m + 1) * 4 + 8 * 5


def wgmma_dkdv_spec(head_dim: int, dtype, mask: int, device: DeviceProps, mods: int = 0) -> KernelSpec | None:
    """The Hopper dK/dV kernel with atomic dQ (bwd_dkdv_wgmma), or None where it does not serve: as the Hopper
    forward (wgmma_forward_spec), and only at the padded head dims 64, 128 and 256 (33..64, 97..128 and 225..256,
    multiples of 8). The deterministic backward runs its ordered form (ordered_dq_kernel)."""
    dtype = np.dtype(dtype)
    d = padded_head_dim(head_dim)
    if (device.compute_capability != 90 or not device.tensor_maps or dtype == np.float32
            or d not in WGMMA_DKDV_HEAD_DIMS or head_dim % 8):
        return None
    block_m = wgmma_dkdv_block_m(d)
    smem = wgmma_dkdv_smem_bytes(d, dtype.itemsize, block_m)
    if smem > device.max_smem_per_block:
        return None
    return KernelSpec("bwd_dkdv_wgmma", dtype, d, int(mask), block_m, WGMMA_DKDV_BLOCK_N[d],
                      wgmma_threads(2 * WGMMA_ROWS_PER_CONSUMER), smem, mods=mods, atomic_dq=True)


#: The share of the L2 cache that the K and V of one section of the masked Hopper forward's walk may take
#: (forward_section_heads): of the budgets tried (2, 4, 8 and 16 MiB of an H100's 50; bench/NOTES.md session 32),
#: 16 MiB measured best or within the spread at head_dim 64, 128 and 256, seqlen 512-16k
FORWARD_SECTION_L2_SHARE = 1 / 3
#: ... where its query blocks visit at most this many keys: at 16k sections measured within the spread (head_dim
#: 64 -8% and -2% in two runs, 128 -1% and +5%, 256 +1% and +2%), so one section is kept there
FORWARD_SECTION_MAX_KEYS = 8192
#: fwd_wgmma at head_dim 64 without a mask walks a pair's query blocks together (forward_section_heads) where
#: they visit at most this many keys: on an H100, TFLOP/s one section / a pair's together, 531 / 545 at 8k,
#: 550 / 511 at 16k (bench/NOTES.md session 37)
PAIR_ORDER_64_MAX_KEYS = 8192


def forward_section_heads(spec: KernelSpec, pairs: int, item_keys: int, group: int, device: DeviceProps,
                          pair_keys: int | None = None) -> int:
    """The (batch, head) pairs per section of the forward's grid order (``QueryBlock``, kernels/common.cuh:
    section after section, the highest query blocks of a section first, its pairs fastest). ``pairs``: batch *
    heads; ``item_keys``: the most keys a query block visits (_plan.keys_per_query_block); ``group``: the query
    heads per kv head; ``spec``: the forward's kernel; ``pair_keys``: the keys of a pair that its section reads,
    ``item_keys`` where not given. A packed batch walked in varlen_order's order has a pair per head (``pairs``
    = heads), each section walking every sequence's query blocks: its ``pair_keys`` are total_k.

    fwd_wgmma under a mask (causal or a window), its query blocks visiting up to FORWARD_SECTION_MAX_KEYS keys: as
    many pairs as fit their K and V (``pair_keys`` keys of each kv head, shared by ``group`` pairs) in
    FORWARD_SECTION_L2_SHARE of the L2, at least one. The blocks resident at once then read the K and V of one
    section, which stay in L2
    from a section's longest query blocks to its shortest; in one section of every pair (the longest blocks of
    all heads first) each lower query block read its head's K and V from DRAM again. Causal TFLOP/s on an H100,
    bfloat16, FlashAttention's grid, one section / sections (tools/ab_probe.py, 3 rounds; bench/NOTES.md session
    32): head_dim 64 at 512 / 1k / 2k / 4k 198 / 224, 256 / 316, 375 / 403, 412 / 440; head_dim 128 at 512 / 1k /
    2k / 4k / 8k 207 / 276, 272 / 426, 335 / 556, 524 / 606, 634 / 672; head_dim 256 at 512 / 1k / 2k / 4k 198 /
    277, 274 / 429, 465 / 549, 640 / 694; float8 at 128, 1k / 4k 337 / 373, 602 / 627. Under a causal window of
    1024 keys (a query block's 1152 keys at 128 rows), forward ms on an H100, one section / sections
    (tools/feature_ab.py, 3 rounds; bench/NOTES.md session 42): head_dim 128 at 2k / 4k / 8k 0.333 / 0.214, 0.258
    / 0.236, 0.246 / 0.249; head_dim 64 at 2k / 4k 0.319 / 0.298, 0.350 / 0.342 (session 32 had measured 8k-16k
    alone: 0-2% slower, within the spread). Packed, the varlen suite's causal batches on an H100 (16384 tokens,
    forward ms, one section / sections, two runs; bench/NOTES.md session 33): head_dim 128 equal (16 x 1k) 0.254
    / 0.169 twice, mixed 0.342 / 0.320 and 0.337 / 0.312, long-tail and random within the spread; head_dim 64
    (sections of heads) 1-5% faster in most runs, within the spread.

    Elsewhere the order measured before: 1 (a head's query blocks together, FlashAttention-2's order) without a
    mask at head_dim 128 and 256, where the blocks resident at once share a few heads' K and V (forward v6 on the
    H200, float16, seqlen 1k / 4k / 16k, one section / 1: 128 258 / 314 / 327 against 254 / 325 / 348; 256 221 /
    263 / 287 against 213 / 262 / 283, and after v7 ahead at 1k-2k in every round); 1 for fwd_wgmma at head_dim 64
    without a mask up to PAIR_ORDER_64_MAX_KEYS keys (an H100, bfloat16, one section / 1, tools/ab_probe.py, 3
    rounds, session 37: 332 / 355 at 512, 386 / 423 at 1k, 459 / 497 at 2k, 457 / 500 at 4k, 531 / 545 at 8k,
    550 / 511 at 16k; v7 had lost 5% at 4k with 1); one section at head_dim 64 past it and on the mma.sync
    kernels, and under a mask on the other kernels.
    """
    if (spec.kernel == "fwd_wgmma" and spec.mask != MASK_NONE and item_keys <= FORWARD_SECTION_MAX_KEYS
            and device.l2_bytes):
        keys = item_keys if pair_keys is None else pair_keys
        pair_bytes = 2 * keys * spec.head_dim * spec.dtype.itemsize / group   # its share of K and V
        return max(1, min(pairs, int(device.l2_bytes * FORWARD_SECTION_L2_SHARE // max(pair_bytes, 1))))
    if spec.mask == MASK_NONE and spec.head_dim in (128, 256):
        return 1
    if (spec.kernel == "fwd_wgmma" and spec.mask == MASK_NONE and spec.head_dim == 64
            and item_keys <= PAIR_ORDER_64_MAX_KEYS):
        return 1
    return pairs


#: varlen_order (kernels/varlen.cu), one block of VARLEN_ORDER_THREADS (``kOrderThreads``), orders the work items
#: of fwd_wgmma's packed batches of at most VARLEN_ORDER_MAX_BATCH sequences (``kOrderMaxBatch``); a larger batch
#: runs in QueryBlock's order
VARLEN_ORDER_THREADS = 1024
VARLEN_ORDER_MAX_BATCH = 4096


def varlen_forward_ordered(head_dim: int, equal_lengths: bool = False) -> bool:
    """Does fwd_wgmma walk a packed batch in varlen_order's order (``head_dim`` the padded one)?
    ``equal_lengths``: every sequence has the longest one's rows (total_q = batch x max_seqlen_q), so that
    QueryBlock's walk has no idle items and nothing to sort. The order costs a launch before the forward, about
    8 us, and saves the idle items and the long items at the walk's end. Forward ms on the H200, bfloat16, the
    varlen suite's batches (16384 tokens, heads x head_dim = 2048), QueryBlock's order / varlen_order's,
    non-causal and causal (bench/NOTES.md, "Packed batches: the item order"):
      head_dim 64:  long-tail 1.456 / 1.364, 0.847 / 0.801;  mixed 0.577 / 0.562, 0.409 / 0.398;
                    random 1.166 / 1.126, 0.689 / 0.664;  equal 0.342 / 0.343, 0.254 / 0.261
      head_dim 128: long-tail 1.071 / 1.076, 0.631 / 0.615;  mixed 0.431 / 0.433, 0.303 / 0.307;
                    random 0.879 / 0.874, 0.535 / 0.531;  equal 0.237 / 0.250, 0.192 / 0.200
    At 64 the items are short beside their scheduling and the order gains 2.5-7% on mixed lengths (and on an
    H100 with the causal walk's L2 sections 3-11%, both masks). At 128, with the sections (an H100, session 33):
    long-tail 1.090 / 1.078, 0.727 / 0.684; mixed 0.473 / 0.466, 0.311 / 0.291; random 0.866 / 0.845, 0.543 /
    0.525; equal 0.250 / 0.261, 0.165 / 0.173: the order gains on mixed lengths and loses its launch on equal
    ones, so it walks there only batches of unequal lengths (past 128 not measured: QueryBlock's walk)."""
    return head_dim <= 64 or (head_dim <= 128 and not equal_lengths)


def varlen_order_spec(mask: int) -> KernelSpec:
    """varlen_order's specialization for fwd_wgmma's packed batches under ``mask``."""
    return KernelSpec("varlen_order", np.dtype(np.int32), mask=int(mask), threads=VARLEN_ORDER_THREADS)


#: rows merged per block of merge_parts and merge_into, one warp each (``kMergeWarps`` in kernels/merge.cu)
MERGE_WARPS = 4
#: rows rotated or appended per block of append_rotary, one warp each (``kAppendWarps`` in kernels/cache.cu)
APPEND_WARPS = 4
#: A paged KV cache's pages hold a multiple of this many keys: the KV-cache forward's key tiles (as wide as
#: divides the page size, at least this many keys) then never straddle a page.
PAGE_SIZE_MULTIPLE = 64
#: The dtypes of attention_with_kvcache on the GPU (the KV-cache forward and append_rotary): float8 e4m3 caches
#: too, at the float8 head dims (FLOAT8_HEAD_DIMS), converted to float16 on chip
KVCACHE_DTYPES = (np.dtype(np.float16), BFLOAT16, FLOAT8_E4M3)
#: The KV-cache forward's key tile up to head_dim KV_TILE_HEAD_DIM, in keys (half that past it; kvcache_forward_spec)
KV_TILE_KEYS, KV_TILE_HEAD_DIM = 128, 128
#: The most key splits of the KV-cache forward: each writes a float32 partial output that the merge reads.
MAX_KV_SPLITS = 128
#: The fewest key tiles a split of the KV-cache forward walks (its prologue and epilogue cost about a tile).
MIN_SPLIT_TILES = 2
#: Splits that would still walk this many key tiles each are worth more SMs (kvcache_splits).
LONG_SPLIT_TILES = 32


def kvcache_forward_spec(head_dim: int, dtype, mask: int, device: DeviceProps, mods: int,
                         page_size: int = 0, row_groups: int = 0) -> KernelSpec:
    """fwd_mma's KV-cache specialization (``_plan.kvcache``): blocks of 16 packed query rows (seqlen_q x the
    query heads of a group, ``CacheBlock`` in kernels/common.cuh) on 4 warps that split each key tile among
    them (kKeyWarps in kernels/fwd_mma.cu); key tiles of 128 keys up to head_dim 128 (64 past it), halved
    until the tile fits in shared memory and divides ``page_size`` (a paged cache's; 0: contiguous). Where
    a 128-key block takes a whole SM (head_dim 128 on the H100) and the call's ``row_groups`` blocks give
    every SM one by themselves (so the keys take no splits), 64-key tiles: two blocks per SM (registers
    allow no more) keep more loads in flight and leave a shorter tail.

    Decoding reads the cache once and computes little on it: the block that keeps the most bytes in flight
    and the least latency per tile wins. Measured on the H200, bfloat16, head_dim 128, 32 query / 8 kv heads,
    seqlen_q 1, ms with the plan's splits, batch x cache 1 x 4k / 8 x 8k / 1 x 128k / 64 x 16k / 64 x 1k
    (bench/NOTES.md, decode d1, d2): 16 rows, 4 warps splitting 128-key tiles 0.018 / 0.079 / 0.140 / 0.963 /
    0.084; 64 rows, a warp per 16 (the others idle under one query) on 128-key tiles 0.021 / 0.080 / 0.144 /
    0.958 / 0.088, on 64-key tiles 0.022 / 0.082 / 0.149 / 0.972 / 0.079; 16 rows on one warp, 64-key tiles
    0.023 / 0.082 / 0.156 / 0.995 / 0.086. The 16-row block on 64- against 128-key tiles (decode d3, ms):
    where the blocks fill the slots, 64 x 1k 0.0787 / 0.0826, 64 x 1k with four queries 0.0809 / 0.0876, 64 x
    4k 0.2516 / 0.2535, 64 x 16k 0.9492 / 0.9504; where they do not, 1 x 4k 0.0198 / 0.0173, 8 x 1k 0.0220 /
    0.0196, 8 x 4k with four queries on 64 / 8 heads 0.0546 / 0.0489. float16, bfloat16 and float8 e4m3 (its
    tiles converted to float16 in shared memory); no dropout (``attention_with_kvcache`` takes none).
    """
    dtype = np.dtype(dtype)
    if dtype not in KVCACHE_DTYPES:
        raise TypeError(f"the KV-cache forward runs float16, bfloat16 and float8 e4m3 on the GPU, got {dtype}")
    if dtype == FLOAT8_E4M3 and head_dim not in FLOAT8_HEAD_DIMS:   # whole 16-byte copies of whole rows
        raise TypeError(f"float8 caches run on the GPU at head_dim in {FLOAT8_HEAD_DIMS}, got {head_dim}")
    if mods & MOD_DROPOUT:
        raise ValueError("the KV-cache forward takes no dropout")
    d = padded_head_dim(head_dim)
    block_m, warps = MMA_ROWS_PER_WARP, 4  # one atom; the warps split the keys
    block_n = KV_TILE_KEYS if d <= KV_TILE_HEAD_DIM else KV_TILE_KEYS // 2
    while True:
        spec = mma_spec("fwd_mma", dtype, d, int(mask), block_m, block_n, warps, mods=mods)
        if spec.smem_bytes <= device.max_smem_per_block and page_size % block_n == 0:
            break
        if block_n == MMA_ROWS_PER_WARP:
            raise ValueError(f"no KV-cache forward tile for head_dim {head_dim} fits in {device.max_smem_per_block} "
                             "bytes of shared memory")
        block_n //= 2
    if block_n == KV_TILE_KEYS and resident_blocks(spec, device) == 1 and row_groups >= device.sm_count:
        spec = mma_spec("fwd_mma", dtype, d, int(mask), block_m, block_n // 2, warps, mods=mods)
    return dataclasses.replace(spec, kvcache=True)


def resident_blocks(spec: KernelSpec, device: DeviceProps) -> int:
    """Blocks of ``spec`` an SM holds at once, by shared memory (each block also takes 1 KB the runtime
    reserves) and threads (2048 per SM)."""
    by_smem = (device.max_smem_per_block + 1024) // (spec.smem_bytes + 1024)
    return max(1, min(by_smem, 2048 // spec.threads))


def kvcache_splits(blocks: int, key_tiles: int, resident: int, sm_count: int) -> int:
    """Key splits of the KV-cache forward: each of its ``blocks`` (query blocks x head groups x batch) walks
    1 / splits of its ``key_tiles``, and the last block of each row group to finish merges them (Flash-Decoding
    in one launch).

    A block streams the cache at what one SM pulls, so few blocks leave the bandwidth unused; but each split
    adds a partial output and its merge, which cost more than they save once the blocks occupy about half
    of the ``resident`` x ``sm_count`` slots. So: the most splits whose blocks fill at most half the slots
    (at least 1, at most MAX_KV_SPLITS, each split at least MIN_SPLIT_TILES tiles), doubled while the blocks
    still fit in the slots and each split keeps LONG_SPLIT_TILES tiles. Measured on the H200 (bfloat16,
    head_dim 128, 32 / 8 heads, one query, ms at 1 / 2 / 4 / 8 / 16 / 32 splits, bench/NOTES.md decode d2):
    batch 1 x 4k keys 0.036 / 0.025 / 0.020 / 0.018 / 0.021 / 0.027; 1 x 128k 0.90 / 0.46 / 0.24 / 0.146 /
    0.140 / 0.154; 8 x 1k 0.021 / 0.022 / 0.027 / 0.033 / 0.034 / 0.034; 8 x 8k 0.079 / 0.080 / 0.084 /
    0.089 / 0.096 / 0.118. Again with the merge in the same launch (decode d3), ms at 2 / 4 / 8 / 16 / 32
    splits and the rule's choice: 1 x 4k 0.0239 / 0.0181 / 0.0166 / 0.0176 / 0.0245, 0.0166; 1 x 64k 0.231 /
    0.124 / 0.0804 / 0.0789 / 0.0863, 0.0790; 8 x 1k 0.0210 / 0.0257 / 0.0353 / 0.0352 / 0.0351, 0.0198; 8 x 8k
    0.0773 / 0.0821 / 0.0866 / 0.0946 / 0.123, 0.0771: the rule still picks the fastest or within 1% of it.
    """
    slots = resident * sm_count
    most = max(1, min(MAX_KV_SPLITS, key_tiles // MIN_SPLIT_TILES))
    splits = min(most, max(1, slots // (2 * blocks)))
    while 2 * splits <= most and 2 * splits * blocks <= slots and key_tiles // (2 * splits) >= LONG_SPLIT_TILES:
        splits *= 2
    return splits


#: Resident blocks per SM that a band of the dK/dV grid is sized for: two, bwd_dkdv_rows_mma's occupancy
#: (255 registers x 128 threads), with which the bands were measured. bwd_dkdv_mma holds one block of
#: 256 threads per SM, so its bands span two waves; the bench grid was measured that way.
BAND_BLOCKS_PER_SM = 2
#: CUDA's limit on gridDim.y, which counts the bands
MAX_GRID_Y = 65535
#: The most key blocks per (batch, kv head) pair for which the Hopper dK/dV kernel's default form (one resident
#: block per SM) runs one pair per band. Measured on an H100, bfloat16, FlashAttention's grid (tools/band_ab.py,
#: bench/NOTES.md), wave-sized bands' backward time over one pair per band: head_dim 128 1.53 / 1.33 / 1.04 / 0.98
#: at 4 / 8 / 16 / 32 key blocks without a mask, 1.25 / 1.13 / 0.99 / 0.93 under the causal mask; head_dim 256
#: 1.63 / 1.50 / 1.02 / 1.11 and 1.20 / 1.11 / 1.01 / 0.95.
PAIR_MAJOR_MAX_TILES = 16
#: The most keys per pair for which its ordered form (deterministic) runs one pair per band, a pair's key blocks
#: side by side (ordered_side_by_side): 32 key blocks at head_dim 256, 16 at 64 and 128. The same measure for
#: the ordered form (bench/NOTES.md sessions 38-39) at 32 / 64 / 128 key blocks: head_dim 256 1.10 / 1.04 / 0.92
#: without a mask, 1.09 / 0.99 / 0.81 causal (at 2k keys, backward_ab: 2.440 -> 2.179 ms and 1.424 -> 1.311);
#: head_dim 128 and 64 0.97-1.01 at 32 and 64.
ORDERED_PAIR_MAJOR_MAX_KEYS = 2048
#: The ordered form under a mask, on the wave-sized bands: about the most key blocks of one pair that a wave of
#: its blocks (one per SM) holds (ordered_band_least_pairs). Each tile's adds wait on one another in key-block
#: order, and all of a pair's key blocks in a wave reach the top tile together, so the last of them waits for
#: the adds of all the others. Measured on an H100 (bfloat16, FlashAttention's grid, deterministic backward ms by
#: pairs per band, the wave-sized rule's first; bench/NOTES.md session 40): head_dim 256 causal 4k 8 / 16 / 32
#: pairs 2.433 / 2.448 / 3.056, 8k 4 / 8 / 16 pairs 4.716 / 4.412 / 4.594, 16k 2 / 4 / 8 pairs 9.069 / 8.453 /
#: 8.496; head_dim 128 causal 8k 8 / 16 / 32 pairs 2.941 / 2.987 / 3.206; head_dim 64 causal 8k 8 / 16 / 32 / 64
#: pairs 3.563 / 3.471 / 3.482 / 3.933. Without a mask wider bands lose (head_dim 256 4k 8 / 16 / 32 pairs 4.272 /
#: 5.080 / 7.821), so the rule takes the masks only.
ORDERED_WAVE_KEY_BLOCKS = 16


def pair_major_tiles(spec: KernelSpec) -> int:
    """The most key blocks per (batch, kv head) pair for which the dK/dV kernel ``spec`` runs one pair per band
    (``block_band``): 0 (never) but for the Hopper kernel, bwd_dkdv_wgmma."""
    if spec.kernel != "bwd_dkdv_wgmma":
        return 0
    return ORDERED_PAIR_MAJOR_MAX_KEYS // spec.block_n if spec.ordered_dq else PAIR_MAJOR_MAX_TILES


def ordered_band_least_pairs(spec: KernelSpec, sm_count: int) -> int:
    """The fewest pairs per band of the dK/dV kernel ``spec``'s wave-sized bands (``block_band``): for the
    Hopper kernel's ordered form under a mask, sm_count // ORDERED_WAVE_KEY_BLOCKS, so that a wave holds about
    ORDERED_WAVE_KEY_BLOCKS key blocks of each pair; else 1 (no bound beyond the wave's)."""
    if spec.kernel != "bwd_dkdv_wgmma" or not spec.ordered_dq or spec.mask == MASK_NONE:
        return 1
    return max(1, sm_count // ORDERED_WAVE_KEY_BLOCKS)


@functools.lru_cache(maxsize=1024)
def block_band(tiles_per_head: int, pairs: int, sm_count: int, pair_major_tiles: int = 0,
               least_pairs: int = 1) -> int:
    """(batch, kv head) pairs per band of the dK/dV kernels' banded grid (``KeyBlock``, kernels/common.cuh).

    The smallest divisor of ``pairs`` whose band holds at least one wave of resident blocks, so the
    blocks resident at once read the Q and dO of a few heads, which stay in L2, and no band is left
    partial; ``pairs`` itself (one band: the pairs-fastest order) when none is smaller. Measured on the
    H200 against pairs fastest and against one pair per band (bench/NOTES.md): the backward gains 5-24%
    at seqlen 1k-4k, nothing at 16k, and one-pair bands are up to 10% slower under the causal mask.

    One pair per band where a pair has at most ``pair_major_tiles`` key blocks (the kernel's
    ``pair_major_tiles(spec)``: nonzero for the Hopper dK/dV kernel only), so a wave holds the key blocks of a few
    pairs, whose Q and dO stay in L2, not one key block of each of a wave of pairs. Otherwise at least
    ``least_pairs`` pairs (where a divisor reaches it; the kernel's ``ordered_band_least_pairs``).
    """
    if tiles_per_head <= pair_major_tiles and pairs <= MAX_GRID_Y:
        return 1
    wave = BAND_BLOCKS_PER_SM * sm_count
    least = max(-(-wave // max(tiles_per_head, 1)), -(-pairs // MAX_GRID_Y), least_pairs, 1)
    divisors = set()
    for i in range(1, math.isqrt(pairs) + 1):
        if pairs % i == 0:
            divisors.update((i, pairs // i))
    return min((d for d in divisors if d >= least), default=max(pairs, 1))


def ordered_side_by_side(tiles_per_head: int, band: int, sm_count: int) -> bool:
    """Does bwd_dkdv_wgmma's ordered form run a pair's key blocks side by side (KeyBlock's dq_pass 1), adding
    each dQ share in the order in which they reach its query tile (bwd_wgmma.cu)? Where a band holds one pair
    and the pair has no more key blocks than SMs (the kernel holds one block per SM): that order waits on
    higher key blocks too, so all of a pair's must be resident together, which they are once the pairs before
    theirs have ended. Its backward on an H100 (bfloat16, FlashAttention's grid, in one process with the key-block
    order on the wave-sized bands; bench/NOTES.md session 38): head_dim 128 0.867 -> 0.639 ms at 512, 1.152 ->
    0.943 at 1k, 1.751 -> 1.550 at 2k without a mask, 0.631 -> 0.525, 0.748 -> 0.677, 1.023 -> 0.977 causal;
    head_dim 256 1.164 -> 0.783 and 1.676 -> 1.245 at 512 and 1k, 0.705 -> 0.586 and 0.940 -> 0.826 causal.
    The key-block order on the same grid took 0.647, 0.989 and 1.710 ms at head_dim 128 without a mask, 0.538,
    0.744 and 1.151 causal."""
    return band == 1 and tiles_per_head <= sm_count


#: the split-grid kernels' resident blocks per SM: bwd_dkdv_mma's 256 threads at up to 255 registers with
#: 175-182 KB of shared memory, bwd_dkdv_wgmma's 384 threads with 99-214 KB
TILED_DKDV_BLOCKS_PER_SM = 1
#: The deterministic backward's split grid gives each split its own float32 dQ buffer, each the size of the
#: default's; at most this many, so its extra memory stays within this multiple of the default's.
MAX_DQ_SPLITS = 8
#: The least fraction of the SM slots of its waves that the split grid must fill (its blocks are few and
#: long, so an idle slot stays idle); where no split count fills as many, the dQ kernel serves.
MIN_SPLIT_GRID_FILL = 0.9


#: floats of the float32 dQ buffer per int32 count of the ordered form (DqAccum::kShare: 16 rows by 64 columns)
DQ_ACCUM_SHARE = 16 * 64
#: the head dims at which the deterministic backward runs bwd_dkdv_wgmma's ordered form (ordered_dq_kernel):
#: all of the kernel's (at 256 its dQ shares are staged in the step's Q and dO: kStagedDq in bwd_wgmma.cu)
ORDERED_DQ_HEAD_DIMS = WGMMA_DKDV_HEAD_DIMS


def ordered_dq_kernel(cfg: AttentionConfig) -> KernelSpec | None:
    """The dK/dV kernel of the deterministic backward where it keeps the default's grid: bwd_dkdv_wgmma's
    ordered form, which adds each 16 x 64 share of dQ in a fixed order of the key blocks, counting the adds in
    one int32 per share (bwd_wgmma.cu); None where it does not serve (then ``deterministic_dq_splits``). It
    takes the default's tiles.

    On the H200 its forward plus backward ran at 0.88-0.98x the default's at head_dim 64, 0.92-1.02x at 128
    and 0.85-1.00x at 256, where the split grid ran at 0.80-0.95x, 0.75-0.95x and 0.43-0.79x (FlashAttention's
    grid, seqlen 512-16k, causal and not, bfloat16 and float16; bench/NOTES.md b10, b16), before the default
    ran a pair's key blocks side by side; on an H100 with both side by side (ordered_side_by_side) at
    0.79-1.02x at head_dim 64 (0.79-0.88x causal, on the 64-row steps it took there then), 0.88-1.03x at 128 and
    0.82-1.01x at 256 (the grid, bench/NOTES.md session 38)."""
    hopper = cfg.bwd_dkdv_wgmma
    return None if hopper is None else dataclasses.replace(hopper, ordered_dq=True)


def split_grid_kernel(cfg: AttentionConfig) -> KernelSpec | None:
    """The dK/dV kernel of the deterministic backward's split grid (``deterministic_dq_splits``), where the
    ordered form does not serve: the Hopper kernel (one thread adds each element of a dQ copy in a launch), else
    the tiled mma.sync kernel's atomic-dQ form (the rows kernel walks one key block per thread block); None where
    neither serves."""
    hopper = cfg.bwd_dkdv_wgmma
    if hopper is not None:
        return hopper
    if cfg.bwd_dkdv_atomic and cfg.bwd_dkdv_atomic[0].kernel == "bwd_dkdv_mma":
        return cfg.bwd_dkdv_atomic[0]
    return None


def split_grid_serves(cfg: AttentionConfig) -> bool:
    """Can the deterministic backward run on the split grid (``deterministic_dq_splits``)?"""
    return split_grid_kernel(cfg) is not None


def deterministic_dq_splits(cfg: AttentionConfig, pairs: int, seqlen_k: int, sm_count: int) -> int:
    """The split count of the deterministic backward's split grid, or 0 where the dQ kernel serves.

    The split grid runs the atomic-dQ dK/dV kernel (``split_grid_kernel``) with one thread block per
    ((batch, kv head) pair, split); block ``split`` walks the key blocks split, split + splits, ... in
    order and adds dQ into its own copy of the float32 buffer, which bwd_dq_convert sums in copy order
    (``KeyBlock``, kernels/common.cuh). Five matrix products per tile, like the default, against the dQ
    kernel's seven. Returns the fewest splits (at most MAX_DQ_SPLITS and the key blocks per head) whose
    ``pairs * splits`` blocks fill MIN_SPLIT_GRID_FILL of their waves; 0 if none does, or where no
    split-grid kernel serves.
    """
    if not split_grid_serves(cfg):
        return 0
    key_blocks = -(-seqlen_k // split_grid_kernel(cfg).block_n)
    wave = TILED_DKDV_BLOCKS_PER_SM * sm_count
    for splits in range(1, min(MAX_DQ_SPLITS, key_blocks) + 1):
        blocks = pairs * splits
        if blocks / (-(-blocks // wave) * wave) >= MIN_SPLIT_GRID_FILL:
            return splits
    return 0


def _simt_spec(kernel: str, dtype, head_dim: int, mask: int, device: DeviceProps, mods: int = 0) -> KernelSpec:
    # 32 x 32 tiles keep 256 threads busy with 4 scores each; halve them where shared memory is short
    # (sm_86/89 allow 99 KB per block, too little for head_dim 256 at 32 x 32).
    for tile in (32, 16):
        smem = simt_smem_bytes(kernel, head_dim, tile, tile)
        if smem <= device.max_smem_per_block:
            return KernelSpec(kernel, np.dtype(dtype), head_dim, mask, tile, tile, SIMT_THREADS, smem, mods=mods)
    raise ValueError(f"no {kernel} tile fits in {device.max_smem_per_block} bytes of shared memory")


@functools.lru_cache(maxsize=1024)
def choose_config(head_dim: int, dtype, mask: int, device: DeviceProps, mods: int = 0,
                  varlen: bool = False) -> AttentionConfig:
    """Pick the kernels for one problem. Pure: no GPU, no state (so its results are cached: a call's
    host time matters at small shapes, bench's overhead suite).

    Parameters
    ----------
    head_dim : int
        The user's head dim, 1..256.
    dtype : numpy dtype
        float16, bfloat16 or float32.
    mask : int
        MASK_NONE, MASK_CAUSAL or MASK_WINDOW (``Problem.mask_kind``; a bool reads as none or causal). The
        table's "causal" measurements are of the causal kernels; windows share their tiles.
    device : DeviceProps
        On compute capability 9.0 with tensor maps the forward is the Hopper kernel where it serves
        (wgmma_forward_spec), else fwd_mma; a caller whose arrays no tensor map can describe asks with
        ``tensor_maps=False``.
    mods : int
        MOD_* bits (``Problem.mods``): the forward takes them all, the backward all but MOD_SINKS. The
        modifiers share the plain kernels' tiles, except where dropout's registers needed narrower ones
        (_mma_forward_tiles, _mma_backward_tiles).
    varlen : bool
        A packed batch (attention_varlen): the same tiles, in the kernels' packed specializations (whose grid
        and work per block are a dense batch's of the longest sequences: bench/NOTES.md, packed batches).

    Returns
    -------
    AttentionConfig
    """
    dtype = np.dtype(dtype)
    if dtype not in CUDA_TYPES:
        raise TypeError(f"dtype must be one of {[d.name for d in SUPPORTED_DTYPES]}, got {dtype}")
    if device.compute_capability < 80:
        raise ValueError(f"cuflash needs compute capability 8.0 or newer, got {device.arch}")
    d = padded_head_dim(head_dim)
    mask = int(mask)
    if mask not in MASK_KINDS:
        raise ValueError(f"mask must be one of {MASK_KINDS}, got {mask}")
    if mods & ~ALL_MODS:
        raise ValueError(f"mods must be a combination of the MOD_* bits ({ALL_MODS:#x}), got {mods:#x}")
    bwd_mods = mods & ~MOD_SINKS
    half = dtype != np.float32  # float32 stays exact: CUDA cores, no tf32
    forward = (wgmma_forward_spec(head_dim, dtype, mask, device, mods) or
               _mma_spec("fwd_mma", dtype, d, mask, device, mods=mods) if half else
               _simt_spec("fwd_simt", dtype, d, mask, device, mods))
    if half:
        # Up to the fused head dim, a softcap's atomic-dQ dK/dV kernels spill (the tiled one 4-16 bytes on
        # sm_90, the rows one 40 on sm_80 at head_dim 128: P * (1 - tanh^2) beside the dQ products; NVRTC
        # 13.0): there the softcap's backward runs the deterministic pair (dK/dV, then the dQ kernel) in
        # both modes. Past it (dK and dV in two launches) the atomic kernels fit.
        atomic_fits = not (bwd_mods & MOD_SOFTCAP and d <= MMA_BACKWARD_FUSED_HEAD_DIM)
        tiled = _tiled_dkdv_spec(dtype, d, mask, device, atomic_dq=False, mods=bwd_mods)
        if tiled is not None:
            bwd_dkdv = (tiled,)
            bwd_dkdv_atomic = (dataclasses.replace(tiled, atomic_dq=True),) if atomic_fits else ()
        else:
            bwd_dkdv = tuple(_mma_spec("bwd_dkdv_rows_mma", dtype, d, mask, device, part, adds_dq, bwd_mods)
                             for part, adds_dq in rows_dkdv_launches(d, atomic_dq=False))
            bwd_dkdv_atomic = tuple(_mma_spec("bwd_dkdv_rows_mma", dtype, d, mask, device, part, adds_dq, bwd_mods)
                                    for part, adds_dq in rows_dkdv_launches(d, atomic_dq=True)) if atomic_fits else ()
        bwd_dq = _mma_spec("bwd_dq_mma", dtype, d, mask, device, mods=bwd_mods)
        bwd_dq_convert = KernelSpec("bwd_dq_convert", dtype, d)
        bwd_dkdv_wgmma = wgmma_dkdv_spec(head_dim, dtype, mask, device, bwd_mods)
    else:  # float32: CUDA cores, always the deterministic pair
        bwd_dkdv = (_simt_spec("bwd_dkdv_simt", dtype, d, mask, device, bwd_mods),)
        bwd_dq = _simt_spec("bwd_dq_simt", dtype, d, mask, device, bwd_mods)
        bwd_dkdv_atomic, bwd_dq_convert, bwd_dkdv_wgmma = (), None, None
    if varlen:
        def packed(spec):
            return dataclasses.replace(spec, varlen=True)
        forward, bwd_dq = packed(forward), packed(bwd_dq)
        bwd_dkdv, bwd_dkdv_atomic = tuple(map(packed, bwd_dkdv)), tuple(map(packed, bwd_dkdv_atomic))
        bwd_dq_convert = bwd_dq_convert and packed(bwd_dq_convert)
        bwd_dkdv_wgmma = bwd_dkdv_wgmma and packed(bwd_dkdv_wgmma)
    return AttentionConfig(forward=forward, bwd_preprocess=KernelSpec("bwd_preprocess", dtype),
                           bwd_dkdv=bwd_dkdv, bwd_dq=bwd_dq, bwd_dkdv_atomic=bwd_dkdv_atomic,
                           bwd_dq_convert=bwd_dq_convert, bwd_dkdv_wgmma=bwd_dkdv_wgmma)


def all_specs(device: DeviceProps) -> list[KernelSpec]:
    """The kernels the compile check compiles for ``device``: every plain kernel the dispatcher can choose (each
    dtype, head dim and mask kind), and a covering set of the modifier kernels: all modifiers at once (the most
    registers), with and without dropout (which changes the forward's tiles), without a mask and under a window,
    at every head dim, for bfloat16 (float16 is the same code) and float32. On a device with tensor maps, both
    forwards: the Hopper kernel and its mma.sync fallback, and the Hopper forward's three-consumer head_dim 64
    tile with dropout (WGMMA_SPILLING_MODS; the covering set's modifiers without dropout take it already) and
    its tile for short query blocks (wgmma_forward_for_keys), and beside each backward the deterministic
    backward's own form where it has one (bwd_dkdv_wgmma's ordered form), and the Hopper backward with every
    modifier but the softcap under each mask (without the softcap it takes another path), and the Hopper forward
    with ALiBi alone (its bias starts the scores). Not the cross product of the modifiers: 16 combinations per
    kernel. The KV-cache forward likewise (contiguous and on the smallest pages,
    plain and under a window with every modifier), the packed-batch kernels (below) with the Hopper forward's
    varlen_order per mask kind, merge_parts and merge_into for each dtype and append_rotary for each dtype of
    the KV-cache forward."""
    specs = {}
    # where the Hopper forward serves, the mma.sync forward is its fallback (arrays no tensor map describes)
    devices = {device, dataclasses.replace(device, tensor_maps=False)}

    def add(dtype, d, mask, mods, varlen=False):
        for dev in devices:
            cfg = choose_config(d, dtype, mask, dev, mods, varlen)
            ordered = ordered_dq_kernel(cfg)   # the deterministic backward's own form, where it has one
            short = wgmma_forward_for_keys(cfg.forward, 1, dev)   # the forward's tile for short query blocks
            for spec in cfg.specs + (short,) + ((ordered,) if ordered is not None else ()):
                specs[spec.cache_key] = spec

    for d in HEAD_DIMS:
        for dtype in SUPPORTED_DTYPES:
            for mask in MASK_KINDS:
                add(dtype, d, mask, 0)
        for dtype in (BFLOAT16, np.dtype(np.float32)):
            for mask in (MASK_NONE, MASK_WINDOW):
                add(dtype, d, mask, ALL_MODS)
                add(dtype, d, mask, ALL_MODS & ~MOD_DROPOUT)
        # the KV-cache forward, contiguous and on pages of PAGE_SIZE_MULTIPLE keys (its narrowest tile), plain
        # and with every modifier it takes; of float8 caches at the largest head dim of each key tile
        for dtype in (BFLOAT16, FLOAT8_E4M3) if d in (KV_TILE_HEAD_DIM, MAX_HEAD_DIM) else (BFLOAT16,):
            for page_size in (0, PAGE_SIZE_MULTIPLE):
                for mask, mods in ((MASK_NONE, 0), (MASK_WINDOW, ALL_MODS & ~MOD_DROPOUT)):
                    spec = kvcache_forward_spec(d, dtype, mask, device, mods, page_size)
                    specs[spec.cache_key] = spec
    # the packed-batch kernels, plain and under a window with every modifier, with and without dropout (which
    # changes the mma.sync forward's tiles): bfloat16 at every head dim, float32 at the smallest and largest
    for dtype, dims in ((BFLOAT16, HEAD_DIMS), (np.dtype(np.float32), (HEAD_DIMS[0], MAX_HEAD_DIM))):
        for d in dims:
            for mask, mods in ((MASK_NONE, 0), (MASK_WINDOW, ALL_MODS & ~MOD_DROPOUT), (MASK_WINDOW, ALL_MODS)):
                add(dtype, d, mask, mods, varlen=True)
    # the Hopper forward's three-consumer tile at head_dim 64 with dropout: every modifier but the softcap (the
    # covering set above holds all of them, on two consumers, and all but dropout, on three), dense without a
    # mask and under a window, and packed
    if device.tensor_maps:
        fitting = ALL_MODS & ~MOD_SOFTCAP
        for mask, varlen in ((MASK_NONE, False), (MASK_WINDOW, False), (MASK_WINDOW, True)):
            spec = wgmma_forward_spec(SWIZZLE_ELEMS, BFLOAT16, mask, device, fitting)
            if spec is not None:
                spec = dataclasses.replace(spec, varlen=varlen)
                specs[spec.cache_key] = spec
    # the Hopper backward with every modifier but the softcap, with and without dropout, under each mask: without
    # the softcap its steps take S^T and dP^T as two groups of products (kSplitScores, kernels/bwd_wgmma.cu), a
    # path that the covering set's all-modifier kernels do not take (at head_dim 64 with 128-row steps it spilled
    # 128-136 bytes under ALiBi unseen: bench/NOTES.md session 41)
    if device.tensor_maps:
        for d in HEAD_DIMS:
            for mask in MASK_KINDS:
                for mods in (ALL_MODS & ~MOD_SOFTCAP, ALL_MODS & ~MOD_SOFTCAP & ~MOD_DROPOUT):
                    cfg = choose_config(d, BFLOAT16, mask, device, mods)
                    for spec in (cfg.bwd_dkdv_wgmma, ordered_dq_kernel(cfg)):
                        if spec is not None:
                            specs[spec.cache_key] = spec
    # the Hopper forward with ALiBi alone, under each mask, dense and packed: its bias starts S (kAlibiInS,
    # kernels/fwd_wgmma.cu), a path that the covering set's kernels with more modifiers do not take
    if device.tensor_maps:
        for d in HEAD_DIMS:
            for mask in MASK_KINDS:
                spec = wgmma_forward_spec(d, BFLOAT16, mask, device, MOD_ALIBI)
                if spec is not None:
                    for form in (spec, dataclasses.replace(spec, varlen=True)):
                        specs[form.cache_key] = form
    if device.tensor_maps:   # the packed Hopper forward's tile for short causal query blocks (bfloat16)
        spec = wgmma_forward_spec(SWIZZLE_ELEMS, BFLOAT16, MASK_CAUSAL, device)
        if spec is not None:
            spec = wgmma_forward_for_keys(dataclasses.replace(spec, varlen=True), 1, device)
            specs[spec.cache_key] = spec
    if device.tensor_maps:   # the order of the Hopper forward's packed batches
        for mask in MASK_KINDS:
            spec = varlen_order_spec(mask)
            specs[spec.cache_key] = spec
    if device.tensor_maps:   # the float8 forward, plain and with every modifier it takes, and its V^T transpose
        for d in FLOAT8_HEAD_DIMS:
            for mask in MASK_KINDS:
                for mods in (0, ALL_MODS & ~MOD_DROPOUT):
                    spec = float8_forward_spec(d, mask, device, mods)
                    specs[spec.cache_key] = spec
            spec = float8_transpose_spec(d)
            specs[spec.cache_key] = spec
    for dtype in SUPPORTED_DTYPES:
        for kernel in ("merge_parts", "merge_into"):
            spec = KernelSpec(kernel, dtype, threads=MERGE_WARPS * 32)
            specs[spec.cache_key] = spec
    for dtype in KVCACHE_DTYPES:
        spec = KernelSpec("append_rotary", dtype, threads=APPEND_WARPS * 32)
        specs[spec.cache_key] = spec
    return list(specs.values())
