"""The tile table: pure, GPU-free, and every entry launchable."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuflash import _config
from cuflash._config import BFLOAT16, choose_config, padded_head_dim

#: H100-mma: the sm_90 table where no tensor map serves (the mma.sync forward, the Hopper kernel's fallback)
H100_MMA = dataclasses.replace(_config.H100, tensor_maps=False)
DEVICES = {"A100": _config.A100, "H100": _config.H100, "H100-mma": H100_MMA, "RTX4090": _config.RTX_4090}


@pytest.mark.parametrize("head_dim,expected", [(1, 32), (32, 32), (33, 64), (64, 64), (65, 96), (111, 128),
                                               (129, 160), (200, 224), (256, 256)])
def test_padded_head_dim(head_dim, expected):
    assert padded_head_dim(head_dim) == expected


@pytest.mark.parametrize("head_dim", [0, 257])
def test_padded_head_dim_rejects_out_of_range(head_dim):
    with pytest.raises(ValueError, match=r"head_dim must be in 1\.\.256"):
        padded_head_dim(head_dim)


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
@pytest.mark.parametrize("dtype", _config.SUPPORTED_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", range(1, 257, 7))
@pytest.mark.parametrize("mask", _config.MASK_KINDS)
def test_every_config_fits_the_device(device, dtype, head_dim, mask):
    cfg = choose_config(head_dim, dtype, mask, device)
    hopper = cfg.forward.kernel == "fwd_wgmma"
    for spec in (cfg.forward, *cfg.bwd_dkdv, cfg.bwd_dq, *cfg.bwd_dkdv_atomic):
        assert spec.head_dim >= head_dim
        assert spec.head_dim == padded_head_dim(head_dim) or spec is cfg.forward and hopper
        assert spec.smem_bytes <= device.max_smem_per_block
        assert spec.mask == mask and np.dtype(spec.dtype) == dtype
        assert spec.threads % 32 == 0 and spec.threads <= 1024
    if hopper:  # 64-column TMA boxes, two consumer warpgroups of 64 rows and a producer
        fwd = cfg.forward
        assert device.tensor_maps and fwd.head_dim % 64 == 0 and fwd.head_dim - head_dim < 64
        assert fwd.block_m in (128, 192) and fwd.threads == 128 + 2 * fwd.block_m and fwd.block_n % 16 == 0
        assert fwd.smem_bytes == _config.wgmma_smem_bytes(fwd.head_dim, fwd.block_m, fwd.block_n)
        assert fwd == _config.wgmma_spec(dtype, fwd.head_dim, mask, fwd.block_m, fwd.block_n, 0, device)
        cfg = choose_config(head_dim, dtype, mask, dataclasses.replace(device, tensor_maps=False))
    if dtype == np.float32:  # float32 stays exact: no tensor cores, no tf32
        assert {s.kernel for s in cfg.specs} == {"fwd_simt", "bwd_preprocess", "bwd_dkdv_simt", "bwd_dq_simt"}
        assert cfg.bwd_dkdv_atomic == () and cfg.bwd_dq_convert is None  # always the deterministic pair
    else:
        dkdv_kernel = cfg.bwd_dkdv[0].kernel
        assert {s.kernel for s in cfg.specs} == {"fwd_mma", "bwd_preprocess", dkdv_kernel, "bwd_dq_mma",
                                                 "bwd_dq_convert"}  # (the Hopper forward's fallback)
        assert cfg.bwd_dq_convert.head_dim == padded_head_dim(head_dim)
        # whole 16-row mma atoms per warp (per pair of warps where key_split is 2; each of the pair then
        # takes whole 16-key steps and whole 64-column swizzle groups)
        fwd = cfg.forward
        assert fwd.key_split in (1, 2)
        assert fwd.block_n % (16 * fwd.key_split) == 0
        assert fwd.block_m * fwd.key_split % (16 * (fwd.threads // 32)) == 0
        assert fwd.key_split == 1 or fwd.head_dim // fwd.key_split % 64 == 0
        assert all(s.key_split == 1 for s in cfg.specs if s is not fwd)
        dq = cfg.bwd_dq
        assert dq.block_n % 16 == 0 and dq.block_m % (16 * (dq.threads // 32)) == 0
        assert not any(s.atomic_dq for s in cfg.bwd_dkdv)
        if dkdv_kernel == "bwd_dkdv_mma":  # 8 warps, 2-D warp tiles of whole 16 x 16 blocks, at any head dim
            spec, = cfg.bwd_dkdv
            assert cfg.bwd_dkdv_atomic == (dataclasses.replace(spec, atomic_dq=True),)
            assert spec.threads == _config.DKDV_TILED_THREADS
            assert spec.block_m % 64 == 0 and spec.block_n % 64 == 0 and spec.head_dim % 32 == 0
            return
        assert dkdv_kernel == "bwd_dkdv_rows_mma"
        for spec in (*cfg.bwd_dkdv, *cfg.bwd_dkdv_atomic):  # 16 keys per warp
            assert spec.threads == spec.block_n // 16 * 32 and spec.block_m % 16 == 0
        # one launch computes both gradients, or two launches one each; the atomic default adds dQ in
        # the launch that computes dS (the one with dK), and only there
        for launches in (cfg.bwd_dkdv, cfg.bwd_dkdv_atomic):
            assert sorted(s.part for s in launches) in ([_config.DKDV_BOTH],
                                                        [_config.DKDV_DV_ONLY, _config.DKDV_DK_ONLY])
        assert all(s.atomic_dq == (s.part != _config.DKDV_DV_ONLY) for s in cfg.bwd_dkdv_atomic)
        assert (len(cfg.bwd_dkdv) == 1) == (padded_head_dim(head_dim) <= _config.MMA_BACKWARD_FUSED_HEAD_DIM)


def test_smem_bytes_of_the_mma_forward():
    # Q tile + 2 stages of K and V: swizzled rows of exactly head_dim halves where head_dim is a multiple
    # of 64 (ForwardRow in kernels/mma.cuh), else rows padded by 8 halves; where warp pairs share rows
    # (key_split 2), each warp's row-maxima slots (atoms x 2 rows x 32 lanes, float) and P (block_m x
    # block_n halves) after them (kernels/fwd_mma.cu)
    for head_dim, row in ((128, 128), (256, 256), (64, 64), (96, 104), (160, 168), (32, 40)):
        for causal in (False, True):
            fwd = choose_config(head_dim, np.float16, causal, H100_MMA).forward
            warps = fwd.threads // 32
            atoms = fwd.block_m * fwd.key_split // (16 * warps)
            pairs = 0 if fwd.key_split == 1 else warps * atoms * 2 * 32 * 4 + fwd.block_m * fwd.block_n * 2
            assert fwd.smem_bytes == (fwd.block_m + 4 * fwd.block_n) * row * 2 + pairs
    assert choose_config(256, np.float16, False, H100_MMA).forward.smem_bytes == 217088


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
def test_the_hopper_forward_serves_where_it_can(device):
    # compute capability 9.0 with tensor maps, float16/bfloat16, head dims past 32 in whole 16-byte rows (every
    # modifier, dropout included), rounded up to 64-column blocks; everywhere else the mma.sync (or float32 SIMT)
    # forward
    for head_dim, expected in ((40, 64), (64, 64), (96, 128), (128, 128), (136, 192), (192, 192), (200, 256),
                               (256, 256), (32, None), (100, None), (129, None)):
        for dtype in (np.float16, BFLOAT16, np.float32):
            for mods in (0, _config.SCORE_MODS | _config.MOD_SINKS, _config.MOD_DROPOUT):
                serves = device.tensor_maps and dtype != np.float32
                fwd = choose_config(head_dim, dtype, _config.MASK_WINDOW, device, mods).forward
                assert (fwd.kernel == "fwd_wgmma") == (serves and expected is not None), (head_dim, dtype, mods)
                if fwd.kernel == "fwd_wgmma":
                    assert (fwd.head_dim, fwd.mods, fwd.mask) == (expected, mods, _config.MASK_WINDOW)
    # key tiles: S, P and O within the consumers' registers, the stages within shared memory
    tiles = {d: choose_config(d, BFLOAT16, False, _config.H100).forward for d in (64, 128, 192, 256)}
    assert {d: (s.block_m, s.block_n) for d, s in tiles.items()} == {64: (192, 128), 128: (128, 128), 192: (128, 96),
                                                                    256: (128, 64)}
    assert all(s.smem_bytes <= _config.H100.max_smem_per_block for s in tiles.values())
    assert tiles[64].threads == 512 and tiles[128].threads == 384   # a producer and three or two consumers
    # at head_dim 64 three consumers take every combination of modifiers but the softcap with dropout
    for mods in range(_config.ALL_MODS + 1):
        fwd = choose_config(64, BFLOAT16, _config.MASK_WINDOW, _config.H100, mods).forward
        softcap_with_dropout = bool(mods & _config.MOD_SOFTCAP) and bool(mods & _config.MOD_DROPOUT)
        assert fwd.block_m == (128 if softcap_with_dropout else 192), mods
    assert tiles[128].smem_bytes == (128 + 4 * 128) * 128 * 2 + 8 * 14 + 8
    # sm_90a code runs on compute capability 9.0 only
    assert _config.wgmma_forward_spec(128, BFLOAT16, 0, dataclasses.replace(_config.H100, compute_capability=100)) is None
    assert tiles[128].arch_specific and not choose_config(128, BFLOAT16, False, _config.H100).bwd_dq.arch_specific


def test_warp_pairs_serve_only_where_measured():
    # head_dim 256 without the mask on sm_90 (bench/NOTES.md forward v8); under the mask ptxas spills
    for device in (_config.A100, H100_MMA, _config.RTX_4090):
        for head_dim in (64, 128, 192, 200, 256):
            for causal in (False, True):
                fwd = choose_config(head_dim, BFLOAT16, causal, device).forward
                measured = head_dim == 256 and not causal and device.compute_capability >= 90
                assert fwd.key_split == (2 if measured else 1), (device, head_dim, causal)


def test_tiles_shrink_to_fit_shared_memory():
    # head_dim 256, dK/dV: the tiled kernel's 64 x 64 needs 222208 bytes with two query-tile stages (an H100's
    # 227 KB, not an A100's 163) and 154112 with one (an A100 takes it); the rows kernel's 16 x 64 101632, 2 KB
    # past an RTX 4090's 99 KB
    h100 = choose_config(256, BFLOAT16, True, _config.H100).bwd_dkdv[0]
    assert (h100.kernel, h100.stages, h100.block_m, h100.block_n, h100.smem_bytes) == ("bwd_dkdv_mma", 2, 64, 64,
                                                                                         222208)
    a100 = choose_config(256, BFLOAT16, True, _config.A100).bwd_dkdv[0]
    assert (a100.kernel, a100.stages, a100.block_m, a100.block_n, a100.smem_bytes) == ("bwd_dkdv_mma", 1, 64, 64,
                                                                                         154112)
    rtx = choose_config(256, BFLOAT16, True, _config.RTX_4090).bwd_dkdv[0]
    assert rtx.kernel == "bwd_dkdv_rows_mma" and rtx.block_m == 16
    assert rtx.smem_bytes <= _config.RTX_4090.max_smem_per_block
    # where one stage spilled on sm_80 an A100 keeps the rows kernel (_config.one_stage_dkdv_fits): 224, and 256
    # under a window or with a score modifier
    for head_dim, mask, mods in ((224, True, 0), (256, _config.MASK_WINDOW, 0), (256, True, _config.MOD_ALIBI),
                                 (256, False, _config.MOD_DROPOUT)):
        assert choose_config(head_dim, BFLOAT16, mask, _config.A100, mods).bwd_dkdv[0].kernel == "bwd_dkdv_rows_mma"
    assert choose_config(192, BFLOAT16, _config.MASK_WINDOW, _config.A100,
                         _config.MOD_SOFTCAP | _config.MOD_DROPOUT).bwd_dkdv[0].stages == 1


def test_small_smem_devices_get_smaller_simt_tiles():
    assert choose_config(256, np.float32, False, _config.RTX_4090).bwd_dkdv[0].block_m == 16
    assert choose_config(256, np.float32, False, _config.H100).bwd_dkdv[0].block_m == 32


def test_choose_config_is_pure():
    # the cached table equals a fresh evaluation of the uncached function, for every mask kind
    for mask in _config.MASK_KINDS:
        cached = choose_config(100, np.float16, mask, _config.H100)
        fresh = choose_config.__wrapped__(100, np.float16, mask, _config.H100)
        assert cached is not fresh and cached == fresh and hash(cached) == hash(fresh)
    assert choose_config(100, np.float16, True, _config.H100) == choose_config(100, np.float16, _config.MASK_CAUSAL,
                                                                               _config.H100)
    with pytest.raises(ValueError, match="mask must be one of"):
        choose_config(100, np.float16, 3, _config.H100)


def test_rejects_old_gpus_and_bad_dtypes():
    with pytest.raises(ValueError, match="compute capability 8.0"):
        choose_config(64, np.float16, False, dataclasses.replace(_config.A100, compute_capability=75))
    with pytest.raises(TypeError, match="dtype must be one of"):
        choose_config(64, np.float64, False, _config.A100)


def test_spec_names_are_template_instances():
    hopper = choose_config(64, np.float16, True, _config.H100).forward
    assert hopper.name == "cuflash::fwd_wgmma<__half, 64, 1, 0, 192, 128, false>"
    cfg = choose_config(64, np.float16, True, H100_MMA)
    assert cfg.forward.name == "cuflash::fwd_mma<__half, 64, 1, 0, 128, 64, 4, 1, false, false>"
    pairs = choose_config(256, np.float16, False, H100_MMA).forward
    assert pairs.name == "cuflash::fwd_mma<__half, 256, 0, 0, 128, 64, 8, 2, false, false>"
    window = choose_config(64, np.float16, _config.MASK_WINDOW, H100_MMA).forward
    assert window.name == "cuflash::fwd_mma<__half, 64, 2, 0, 128, 64, 4, 1, false, false>"
    decode = _config.kvcache_forward_spec(128, np.float16, _config.MASK_CAUSAL, _config.H100, _config.MOD_SINKS)
    assert decode.name == "cuflash::fwd_mma<__half, 128, 1, 4, 16, 128, 4, 1, true, false>"
    assert decode.cache_key != dataclasses.replace(decode, kvcache=False).cache_key
    assert _config.KernelSpec("merge_parts", BFLOAT16, threads=128).name == "cuflash::merge_parts<__nv_bfloat16>"
    assert _config.KernelSpec("merge_into", np.float16, threads=128).name == "cuflash::merge_into<__half>"
    assert cfg.bwd_preprocess.name == "cuflash::bwd_preprocess<__half>"
    assert cfg.bwd_dkdv[0].name == "cuflash::bwd_dkdv_mma<__half, 64, 1, 0, 128, 128, 2, false, false>"
    assert cfg.bwd_dkdv_atomic[0].name.endswith(", 128, 128, 2, true, false>")
    rows = choose_config(224, np.float16, True, _config.A100).bwd_dkdv_atomic
    assert [s.name for s in rows] == ["cuflash::bwd_dkdv_rows_mma<__half, 224, 1, 0, 16, 64, 1, false, false>",
                                      "cuflash::bwd_dkdv_rows_mma<__half, 224, 1, 0, 16, 64, 2, true, false>"]
    assert cfg.bwd_dq_convert.name == "cuflash::bwd_dq_convert<__half, 64, false>"
    # the forward takes every modifier; the backward kernels all but the sinks (they read them through lse)
    mods = choose_config(64, np.float16, _config.MASK_WINDOW, H100_MMA, _config.SCORE_MODS | _config.MOD_SINKS)
    assert mods.forward.name == "cuflash::fwd_mma<__half, 64, 2, 7, 128, 64, 4, 1, false, false>"
    assert mods.bwd_dq.name == "cuflash::bwd_dq_mma<__half, 64, 2, 3, 128, 32, 4, false>"
    # dropout (bit 8) shares the plain forward tiles on sm_90 (the mma.sync ones where no tensor map serves); on
    # sm_8x it takes 32-key tiles at head_dim 64 (registers)
    mods = choose_config(64, np.float16, _config.MASK_WINDOW, H100_MMA, _config.ALL_MODS)
    assert mods.forward.name == "cuflash::fwd_mma<__half, 64, 2, 15, 128, 64, 4, 1, false, false>"
    hopper = choose_config(64, np.float16, _config.MASK_WINDOW, _config.H100, _config.ALL_MODS)
    assert hopper.forward.name == "cuflash::fwd_wgmma<__half, 64, 2, 15, 128, 128, false>"
    assert hopper.bwd_dkdv_wgmma.name == "cuflash::bwd_dkdv_wgmma<__half, 64, 2, 11, 128, 128, false, false>"
    assert mods.bwd_dq.name == "cuflash::bwd_dq_mma<__half, 64, 2, 11, 128, 32, 4, false>"
    mods = choose_config(64, np.float16, _config.MASK_WINDOW, _config.A100, _config.ALL_MODS)
    assert mods.forward.name == "cuflash::fwd_mma<__half, 64, 2, 15, 128, 32, 4, 1, false, false>"
    simt = choose_config(64, np.float32, True, _config.H100).bwd_dq
    assert simt.name == f"cuflash::bwd_dq_simt<float, 64, 1, 0, 32, 32, {simt.smem_bytes}, false>"
    # a packed batch: the same tiles, each kernel's packed specialization (its last template argument)
    packed = choose_config(64, np.float16, True, H100_MMA, varlen=True)
    assert packed.forward.name == "cuflash::fwd_mma<__half, 64, 1, 0, 128, 64, 4, 1, false, true>"
    assert choose_config(64, np.float16, True, _config.H100, varlen=True).forward.name == (
        "cuflash::fwd_wgmma<__half, 64, 1, 0, 192, 128, true>")
    assert packed.bwd_dq_convert.name == "cuflash::bwd_dq_convert<__half, 64, true>"
    assert packed.bwd_preprocess == cfg.bwd_preprocess  # it walks the packed rows as one sequence
    assert [dataclasses.replace(s, varlen=False) for s in packed.specs] == list(cfg.specs)
    assert packed.forward.cache_key != cfg.forward.cache_key


def test_all_specs_are_distinct_and_cover_the_table():
    specs = _config.all_specs(_config.H100)
    assert len({s.cache_key for s in specs}) == len(specs)
    # per dtype and mask: a forward and a dq kernel per head dim, the tiled dkdv kernel per head dim (its
    # tiles fit an H100's shared memory at every head dim), and its atomic-dQ form (the default); one
    # preprocess kernel per dtype and one dq_convert kernel per head dim (not per mask).
    fused = sum(d <= _config.MMA_BACKWARD_FUSED_HEAD_DIM for d in _config.HEAD_DIMS)
    split = len(_config.HEAD_DIMS) - fused
    masks = len(_config.MASK_KINDS)
    half = masks * 4 * len(_config.HEAD_DIMS) + 1 + len(_config.HEAD_DIMS)
    single = masks * 3 * len(_config.HEAD_DIMS) + 1
    # The covering set of the modifiers (all at once, with and without dropout; no mask and a window;
    # bfloat16 and float32): per head dim a forward, a dq kernel and the tiled dkdv kernel, its atomic form
    # past the fused limit only (up to it the softcap's backward is the deterministic pair); float32's three
    # kernels.
    modified = 2 * 2 * ((3 * len(_config.HEAD_DIMS) + split) + 3 * len(_config.HEAD_DIMS))
    # the KV-cache forward: contiguous and on 64-key pages (a narrower tile up to head_dim 128), plain and windowed
    # with its modifiers, per head dim; merge_parts and merge_into per dtype, append_rotary per dtype the KV-cache
    # forward takes
    # of float8 caches at head_dim 128 (contiguous and paged: two tiles) and 256 (one)
    kvcache = 2 * (fused + len(_config.HEAD_DIMS)) + 2 * 3
    assert sum(s.kvcache for s in specs) == kvcache
    assert sum(s.kvcache and s.dtype == _config.FLOAT8_E4M3 for s in specs) == 2 * 3
    # the packed-batch kernels: each the packed form of a kernel the set holds, on its tiles
    packed = [s for s in specs if s.varlen]
    assert packed and {dataclasses.replace(s, varlen=False).cache_key for s in packed} <= {s.cache_key for s in specs}
    # the Hopper forward beside its fallback: 4 head dims (64-column blocks) for each plain (dtype, mask), the
    # covering set's modifiers with and without dropout (bfloat16, 2 masks), and the packed batches' (3 per head
    # dim: plain, and windowed with every modifier with and without dropout); its head_dim 64 three-consumer
    # tile with dropout (every modifier but the softcap: no mask and a window, and packed under a window), where
    # all modifiers take two consumers and all but dropout three; the causal head_dim 64 tile for short query blocks
    # (two consumers, each 16-bit dtype, and packed in bfloat16); ALiBi alone (its bias in S) per head dim and mask,
    # dense and packed
    hopper = [s for s in specs if s.kernel == "fwd_wgmma" and s.dtype != _config.FLOAT8_E4M3]
    assert sum(not s.varlen for s in hopper) == 2 * masks * 4 + 2 * 2 * 4 + 2 + 2 + masks * 4
    # its float8 form per float8 head dim and mask, plain and with every modifier but dropout, and the V^T transpose
    float8 = [s for s in specs if s.dtype == _config.FLOAT8_E4M3 and s.kernel != "append_rotary" and not s.kvcache]
    assert collections.Counter(s.kernel for s in float8) == {"fwd_wgmma": 2 * masks * len(_config.FLOAT8_HEAD_DIMS),
                                                            "transpose_v_float8": len(_config.FLOAT8_HEAD_DIMS)}
    assert sum(s.varlen for s in hopper) == 3 * 4 + 1 + 1 + masks * 4
    assert sum(s.mods == _config.MOD_ALIBI for s in hopper) == 2 * masks * 4
    fitting = _config.ALL_MODS & ~_config.MOD_SOFTCAP
    tiles_64 = {s.mods: s.block_m for s in hopper if s.head_dim == 64 and not s.varlen}
    assert (tiles_64[fitting], tiles_64[_config.ALL_MODS & ~_config.MOD_DROPOUT], tiles_64[_config.ALL_MODS]) == (
        192, 192, 128)
    # and the Hopper dK/dV kernel at head dims 64, 128 and 256: each dtype and mask, the covering set's modifiers
    # with and without dropout (bfloat16, 2 masks), every modifier but the softcap (whose steps take one group of
    # products) with and without dropout (bfloat16, each mask); packed: bfloat16, as the forward
    hopper_dkdv = [s for s in specs if s.kernel == "bwd_dkdv_wgmma"]
    assert {s.head_dim for s in hopper_dkdv} == {64, 128, 256}
    # each also in the deterministic backward's ordered form
    forms = 2 * len(_config.WGMMA_DKDV_HEAD_DIMS)
    assert sum(not s.varlen for s in hopper_dkdv) == forms * (2 * masks + 2 * 2 + 2 * masks)
    assert sum(s.varlen for s in hopper_dkdv) == forms * 3
    assert {s.head_dim for s in hopper_dkdv if s.ordered_dq} == set(_config.ORDERED_DQ_HEAD_DIMS)
    # the Hopper forward's item order of packed batches (varlen_order), one per mask kind
    assert sorted(s.mask for s in specs if s.kernel == "varlen_order") == sorted(_config.MASK_KINDS)
    assert len(specs) == (2 * half + single + modified + kvcache + len(packed) + 2 * len(_config.SUPPORTED_DTYPES)
                          + len(_config.KVCACHE_DTYPES) + sum(not s.varlen for s in hopper)
                          + sum(not s.varlen for s in hopper_dkdv) + len(_config.MASK_KINDS) + len(float8))
    no_dropout = _config.ALL_MODS & ~_config.MOD_DROPOUT
    # the Hopper backward's every modifier but the softcap (its specs drop the sinks, which only the forward takes)
    backward_no_softcap = fitting & ~_config.MOD_SINKS
    assert {s.mods for s in specs} == {0, _config.ALL_MODS, _config.ALL_MODS & ~_config.MOD_SINKS, no_dropout,
                                       no_dropout & ~_config.MOD_SINKS, fitting, backward_no_softcap,
                                       backward_no_softcap & ~_config.MOD_DROPOUT}


@given(tiles_per_head=st.integers(1, 4096), pairs=st.integers(1, 20_000), sm_count=st.sampled_from([108, 128, 132]),
       least_pairs=st.sampled_from([1, 6, 8, 9]))
def test_block_band_is_the_smallest_divisor_holding_a_wave(tiles_per_head, pairs, sm_count, least_pairs):
    band = _config.block_band(tiles_per_head, pairs, sm_count, least_pairs=least_pairs)
    wave = _config.BAND_BLOCKS_PER_SM * sm_count
    assert pairs % band == 0, "a band is never partial"
    assert pairs // band <= _config.MAX_GRID_Y
    assert (band * tiles_per_head >= wave and band >= least_pairs) or band == pairs
    smaller = [d for d in range(1, band) if pairs % d == 0]
    assert all(d * tiles_per_head < wave or d < least_pairs or pairs // d > _config.MAX_GRID_Y for d in smaller)


@pytest.mark.parametrize("tiles_per_head, pairs, expected", [
    (32, 64, 16),     # seqlen 4k, 64-key blocks, batch 4 x 16 heads: 9 pairs fill a wave, 16 divides 64
    (256, 16, 2),     # seqlen 16k: 2 pairs hold 512 blocks
    (1, 7, 7),        # a prime count of pairs: one band, the pairs-fastest order
    (1, 200_000, 320),  # gridDim.y stays within 65535
])
def test_block_band_examples(tiles_per_head, pairs, expected):
    assert _config.block_band(tiles_per_head, pairs, 132) == expected


@given(tiles_per_head=st.integers(1, 4096), pairs=st.integers(1, 100_000), sm_count=st.sampled_from([108, 132]),
       pair_major_tiles=st.sampled_from([0, 16, 32]))
def test_block_band_pair_major(tiles_per_head, pairs, sm_count, pair_major_tiles):
    # one pair per band up to pair_major_tiles key blocks (within gridDim.y), the wave-sized bands past it
    band = _config.block_band(tiles_per_head, pairs, sm_count, pair_major_tiles)
    if tiles_per_head <= pair_major_tiles and pairs <= _config.MAX_GRID_Y:
        assert band == 1
    else:
        assert band == _config.block_band(tiles_per_head, pairs, sm_count)


def test_pair_major_tiles_by_form():
    # the Hopper dK/dV kernel only; its ordered form up to ORDERED_PAIR_MAJOR_MAX_KEYS keys (32 key blocks at
    # head_dim 256, 16 at 64 and 128), its default form up to PAIR_MAJOR_MAX_TILES key blocks
    for head_dim, ordered_tiles in [(64, 16), (128, 16), (256, 32)]:
        cfg = _config.choose_config(head_dim, np.dtype(BFLOAT16), _config.MASK_CAUSAL, _config.H100)
        assert _config.pair_major_tiles(cfg.bwd_dkdv_wgmma) == _config.PAIR_MAJOR_MAX_TILES
        assert _config.pair_major_tiles(_config.ordered_dq_kernel(cfg)) == ordered_tiles
        a100 = _config.choose_config(head_dim, np.dtype(BFLOAT16), _config.MASK_CAUSAL, _config.A100)
        assert all(_config.pair_major_tiles(spec) == 0 for spec in a100.bwd_dkdv + a100.bwd_dkdv_atomic)


def test_ordered_band_least_pairs_by_form():
    # the Hopper kernel's ordered form under a mask (causal or a window): bands of at least sm_count //
    # ORDERED_WAVE_KEY_BLOCKS pairs (8 on an H100); every other form and kernel: no bound beyond the wave's
    sm_count = _config.H100.sm_count
    for head_dim in _config.ORDERED_DQ_HEAD_DIMS:
        for mask in _config.MASK_KINDS:
            cfg = _config.choose_config(head_dim, np.dtype(BFLOAT16), mask, _config.H100)
            ordered = _config.ordered_dq_kernel(cfg)
            expected = 1 if mask == _config.MASK_NONE else sm_count // _config.ORDERED_WAVE_KEY_BLOCKS
            assert _config.ordered_band_least_pairs(ordered, sm_count) == expected
            assert _config.ordered_band_least_pairs(cfg.bwd_dkdv_wgmma, sm_count) == 1
            a100 = _config.choose_config(head_dim, np.dtype(BFLOAT16), mask, _config.A100)
            assert all(_config.ordered_band_least_pairs(spec, _config.A100.sm_count) == 1
                       for spec in a100.bwd_dkdv + a100.bwd_dkdv_atomic)
    assert _config.ordered_band_least_pairs(ordered, 8) == 1   # a GPU of few SMs: no bound


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
def test_dq_accum_rows_cover_every_query_tile(device):
    # The atomic-dQ kernels add whole query tiles into the padded float32 buffer (DqAccum in
    # kernels/common.cuh): its row count must be a multiple of every such kernel's block_m, so the last
    # tile of a head stays inside that head.
    block_ms = {spec.block_m for spec in _config.all_specs(device) if spec.atomic_dq}
    assert block_ms and all(_config.DQ_ACCUM_ROWS % m == 0 for m in block_ms), block_ms
    for seqlen_q in (1, 15, 16, 127, 128, 129, 1000, 4096):
        rows = _config.dq_accum_rows(seqlen_q)
        assert rows >= seqlen_q and rows % _config.DQ_ACCUM_ROWS == 0 and rows - seqlen_q < _config.DQ_ACCUM_ROWS


@given(pairs=st.integers(1, 5000), seqlen_k=st.integers(1, 70_000), sm_count=st.sampled_from([108, 128, 132]),
       head_dim=st.sampled_from([64, 128]))
def test_deterministic_dq_splits_fill_the_waves_with_the_fewest_copies(pairs, seqlen_k, sm_count, head_dim):
    cfg = choose_config(head_dim, BFLOAT16, False, _config.H100)
    splits = _config.deterministic_dq_splits(cfg, pairs, seqlen_k, sm_count)
    key_blocks = -(-seqlen_k // cfg.bwd_dkdv_atomic[0].block_n)
    wave = _config.TILED_DKDV_BLOCKS_PER_SM * sm_count

    def fill(s):
        return pairs * s / (-(-pairs * s // wave) * wave)

    candidates = range(1, min(_config.MAX_DQ_SPLITS, key_blocks) + 1)
    if splits == 0:  # the dQ kernel serves: no split count fills the waves
        assert all(fill(s) < _config.MIN_SPLIT_GRID_FILL for s in candidates)
    else:
        assert splits in candidates and fill(splits) >= _config.MIN_SPLIT_GRID_FILL
        assert all(fill(s) < _config.MIN_SPLIT_GRID_FILL for s in range(1, splits))


@pytest.mark.parametrize("head_dim, seqlen, expected", [
    (128, 1024, 1),    # 256 pairs: two full waves of 132 SMs (97%)
    (128, 4096, 2),    # 64 pairs, two splits: 128 blocks
    (128, 16384, 8),   # 16 pairs: the most copies
    (64, 16384, 4),    # 32 pairs
    (256, 4096, 4),    # 32 pairs on the Hopper kernel
    (256, 16384, 0),   # 8 pairs: even 8 splits fill under half the SMs, so the dQ kernel serves
])
def test_deterministic_dq_splits_on_the_bench_grid(head_dim, seqlen, expected):
    # FlashAttention's grid (batch * seqlen = 16k, heads * head_dim = 2048) on the H100/H200's 132 SMs
    pairs = 16384 // seqlen * (2048 // head_dim)
    cfg = choose_config(head_dim, BFLOAT16, True, _config.H100)
    assert _config.deterministic_dq_splits(cfg, pairs, seqlen, 132) == expected


def test_deterministic_dq_splits_leave_too_few_pairs_to_the_dq_kernel():
    cfg = choose_config(128, BFLOAT16, False, _config.H100)
    assert _config.deterministic_dq_splits(cfg, 1, 32768, 132) == 0   # 8 blocks for 132 SMs
    assert _config.deterministic_dq_splits(cfg, 200, 128, 132) == 0   # one key block: no split to add


@pytest.mark.parametrize("head_dim, device", [(224, _config.A100), (128, _config.A100)])
def test_split_grid_needs_the_tiled_dkdv_kernel(head_dim, device):
    # the rows kernel (where the tiled one's shared memory does not fit) has one key block per thread block
    cfg = choose_config(head_dim, BFLOAT16, False, device)
    assert not _config.split_grid_serves(cfg)
    assert _config.deterministic_dq_splits(cfg, 16, 16384, device.sm_count) == 0
    # on an H100 without the Hopper kernels the tiled kernel serves at every head dim
    portable = choose_config(head_dim, BFLOAT16, False, dataclasses.replace(_config.H100, tensor_maps=False))
    assert _config.split_grid_kernel(portable).kernel == "bwd_dkdv_mma"
    assert _config.deterministic_dq_splits(portable, 16, 16384, _config.H100.sm_count) > 0


@pytest.mark.parametrize("head_dim, mask, expected", [
    (128, _config.MASK_NONE, 1),   # a head's query blocks together: 3-8% faster from seqlen 4k on the H200
    (256, _config.MASK_NONE, 1),   # since the swizzled tiles (forward v7): 1-2% faster at seqlen 1k-2k
    (64, _config.MASK_NONE, 96),   # mma.sync: one section (fwd_wgmma takes a pair's together up to 8k keys)
    (128, _config.MASK_CAUSAL, 96),   # masked, on the mma.sync kernels: one section, the longest blocks first
])
def test_forward_grid_order_where_no_sections_were_measured(head_dim, mask, expected):
    spec = _config.mma_spec("fwd_mma", BFLOAT16, head_dim, mask, 128, 64, 4)
    assert _config.forward_section_heads(spec, 96, 4096, 1, _config.H100) == expected


def test_the_hopper_forward_at_head_dim_64_walks_a_pairs_blocks_together_up_to_the_limit():
    # without a mask, up to PAIR_ORDER_64_MAX_KEYS keys (7-10% faster at 512-4k on an H100, 7% slower at 16k)
    spec = _config.wgmma_forward_spec(64, BFLOAT16, _config.MASK_NONE, _config.H100)
    limit = _config.PAIR_ORDER_64_MAX_KEYS
    assert [_config.forward_section_heads(spec, 96, keys, 1, _config.H100) for keys in (512, limit, limit + 1)] == [
        1, 1, 96]
    window = _config.wgmma_forward_spec(64, BFLOAT16, _config.MASK_WINDOW, _config.H100)
    assert _config.forward_section_heads(window, 96, 512, 1, _config.H100) == 96


def test_the_masked_hopper_forward_walks_sections_whose_keys_fit_a_share_of_l2():
    # K and V of a section's pairs fill at most FORWARD_SECTION_L2_SHARE of the L2: 2 * keys * head_dim * itemsize
    # bytes a kv head, shared by the group's query heads; at least one pair, at most all of them
    device = _config.H100
    budget = device.l2_bytes * _config.FORWARD_SECTION_L2_SHARE
    for head_dim, keys, group in ((64, 512, 1), (128, 1024, 1), (128, 1024, 4), (256, 2048, 1), (128, 4096, 8),
                                  (64, _config.FORWARD_SECTION_MAX_KEYS, 1)):
        spec = _config.wgmma_spec(BFLOAT16, head_dim, _config.MASK_CAUSAL, 128, 128)
        pair_bytes = 2 * keys * head_dim * 2 / group
        sections = _config.forward_section_heads(spec, 100_000, keys, group, device)
        assert sections * pair_bytes <= budget < (sections + 1) * pair_bytes
        assert _config.forward_section_heads(spec, 3, keys, group, device) == min(sections, 3)
        # a packed batch in varlen_order's walk: heads as pairs, each reading every sequence's keys (pair_keys)
        assert (_config.forward_section_heads(spec, 100_000, keys, group, device, 3 * keys)
                == max(1, int(budget // (3 * pair_bytes))))
        # a GPU of unknown L2 keeps one section
        assert _config.forward_section_heads(spec, 96, keys, group, dataclasses.replace(device, l2_bytes=0)) == 96
    # a pair whose K and V alone outgrow the share still makes a section
    spec = _config.wgmma_spec(BFLOAT16, 256, _config.MASK_CAUSAL, 128, 64)
    assert _config.forward_section_heads(spec, 96, 8192, 1, dataclasses.replace(device, l2_bytes=1 << 20)) == 1
    # past FORWARD_SECTION_MAX_KEYS one section
    assert _config.forward_section_heads(spec, 96, _config.FORWARD_SECTION_MAX_KEYS + 1, 1, device) == 96
    # under a window the keys of a query block's span: a 1024-key window's 1152 at 128 rows
    window = _config.wgmma_spec(BFLOAT16, 128, _config.MASK_WINDOW, 128, 128)
    assert _config.forward_section_heads(window, 96, 1152, 1, device) == int(budget // (2 * 1152 * 128 * 2))
    # without a mask (fwd_wgmma at head_dim 128 and 256) a head's query blocks together
    full = _config.wgmma_spec(BFLOAT16, 128, _config.MASK_NONE, 128, 128)
    assert _config.forward_section_heads(full, 96, 1024, 1, device) == 1
    # float8: a byte an element
    spec = _config.float8_forward_spec(128, _config.MASK_CAUSAL, device)
    assert _config.forward_section_heads(spec, 100_000, 4096, 1, device) == int(budget // (2 * 4096 * 128))


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
@pytest.mark.parametrize("head_dim", _config.HEAD_DIMS)
def test_tuning_builds_the_tables_specs_from_their_tiles(device, head_dim):
    # tools/tune.py makes its candidates with mma_spec and dkdv_specs: at the table's own tiles they are
    # the table's specs (shared memory, warps and parts derived the same way)
    for mask in _config.MASK_KINDS:
        cfg = choose_config(head_dim, BFLOAT16, mask, dataclasses.replace(device, tensor_maps=False))
        fwd = cfg.forward
        assert _config.mma_spec("fwd_mma", BFLOAT16, head_dim, mask, fwd.block_m, fwd.block_n, fwd.threads // 32,
                                key_split=fwd.key_split) == fwd
        for atomic, launches in ((False, cfg.bwd_dkdv), (True, cfg.bwd_dkdv_atomic)):
            first = launches[0]
            if first.kernel == "bwd_dkdv_rows_mma" and len({s.block_m for s in launches}) > 1:
                continue  # the rows kernel's parts fitted apart (shared memory differs with the dS^T tile)
            assert _config.dkdv_specs(first.kernel, BFLOAT16, head_dim, mask, first.block_m, first.block_n,
                                      atomic, stages=first.stages) == launches


def test_kvcache_tiles_fit_the_pages_and_the_gpu():
    for device in (_config.H100, _config.A100, _config.RTX_4090):
        for d in _config.HEAD_DIMS:
            for page_size in (0, 64, 128, 192, 256):
                spec = _config.kvcache_forward_spec(d, BFLOAT16, _config.MASK_NONE, device, 0, page_size)
                assert spec.kvcache and spec.block_m == 16 and spec.threads == 128
                assert spec.smem_bytes <= device.max_smem_per_block and page_size % spec.block_n == 0
                assert spec.block_n >= _config.PAGE_SIZE_MULTIPLE or device is _config.RTX_4090
    assert _config.kvcache_forward_spec(128, BFLOAT16, 0, _config.H100, 0).block_n == 128
    assert _config.kvcache_forward_spec(128, BFLOAT16, 0, _config.H100, 0, page_size=192).block_n == 64
    with pytest.raises(TypeError, match="float16, bfloat16 and float8 e4m3 on the GPU, got float32"):
        _config.kvcache_forward_spec(64, np.float32, 0, _config.H100, 0)
    # float8 caches: the same tiles where they fit (their staged bytes beside float16 tiles of one stage)
    for device in (_config.H100, _config.A100, _config.RTX_4090):
        for d in _config.FLOAT8_HEAD_DIMS:
            for page_size in (0, 64, 256):
                spec = _config.kvcache_forward_spec(d, _config.FLOAT8_E4M3, _config.MASK_NONE, device, 0, page_size)
                assert spec.kvcache and spec.smem_bytes <= device.max_smem_per_block and page_size % spec.block_n == 0
    assert _config.kvcache_forward_spec(128, _config.FLOAT8_E4M3, 0, _config.H100, 0).block_n == 128


def test_kvcache_tiles_halve_where_the_blocks_fill_the_gpu():
    # one 128-key block per SM at head_dim 128 (132 SMs): 131 row groups leave room for key splits, 132 fill
    # every slot by themselves and take 64-key tiles, three to an SM
    def block_n(d, row_groups, page_size=0):
        return _config.kvcache_forward_spec(d, BFLOAT16, 0, _config.H100, 0, page_size, row_groups).block_n

    wide = _config.kvcache_forward_spec(128, BFLOAT16, 0, _config.H100, 0)
    assert _config.resident_blocks(wide, _config.H100) * _config.H100.sm_count == 132
    assert block_n(128, 131) == 128 and block_n(128, 132) == 64 and block_n(128, 512, page_size=256) == 64
    assert block_n(96, 10**4) == 128  # two 128-key blocks fit an SM at head_dim 96
    assert block_n(64, 10**4) == 128  # three 128-key blocks fit an SM at head_dim 64
    assert block_n(256, 10**4) == 64  # past head_dim 128 the tile is 64 keys either way


def test_the_test_plans_replace_what_they_name():
    from tests.conftest import TEST_PLANS, _plan_as

    hopper = _config.H100
    assert TEST_PLANS["native"](hopper) == hopper
    assert TEST_PLANS["portable"](hopper) == dataclasses.replace(hopper, tensor_maps=False)
    a100 = TEST_PLANS["a100"](hopper)
    assert (a100.tensor_maps, a100.max_smem_per_block, a100.compute_capability) == (
        False, _config.A100.max_smem_per_block, hopper.compute_capability)
    # the A100 plan on an H100 picks the A100's backward kernels wherever they follow shared memory
    for head_dim in (128, 192, 224):
        assert choose_config(head_dim, BFLOAT16, True, a100).bwd_dkdv == \
            choose_config(head_dim, BFLOAT16, True, _config.A100).bwd_dkdv
    with pytest.raises(pytest.UsageError, match="CUFLASH_TEST_PLAN"):
        _plan_as("a10")
