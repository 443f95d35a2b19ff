"""The launch plan (cuflash._plan): every grid, band, split and buffer of a call, chosen on the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuflash import _config, _plan
from cuflash._config import BFLOAT16
from cuflash._validate import Problem

H100 = _config.H100


def problem(batch=2, seqlen_q=1000, seqlen_k=1000, heads=8, heads_kv=8, head_dim=128, dtype=BFLOAT16,
            causal=True, **options) -> Problem:
    right = 0 if causal else -1
    return Problem(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, np.dtype(dtype), causal,
                   head_dim**-0.5, window_right=right, diagonal=seqlen_k - seqlen_q, **options)


def test_forward_launch_covers_every_query_block_of_every_head():
    p = problem(seqlen_q=1000)
    launch = _plan.forward(p, H100)
    assert launch.spec == _config.choose_config(128, BFLOAT16, _config.MASK_CAUSAL, H100).forward
    assert launch.grid == (-(-1000 // launch.spec.block_m) * 2 * 8,)
    assert launch.tail == (_config.forward_section_heads(launch.spec, 2 * 8, 1000, p.group, H100),)
    # a spec given by a tuning tool is the one launched, on its own tiles
    other = _config.mma_spec("fwd_mma", BFLOAT16, 128, _config.MASK_CAUSAL, 64, 32, 4)
    assert _plan.forward(p, H100, other).grid == (16 * 16,)


def test_the_hopper_forward_runs_on_a_persistent_grid_where_keys_are_few():
    # where a query block visits up to WGMMA_PERSISTENT_MAX_KEYS keys, a block per SM (or per item, where fewer)
    # taking work items from a counter; past it a block per item; the mma.sync forward never
    limit = _config.WGMMA_PERSISTENT_MAX_KEYS
    short = _plan.forward(problem(batch=8, seqlen_q=limit, seqlen_k=limit), H100)
    assert short.spec.kernel == "fwd_wgmma" and short.work_counter and short.grid == (H100.sm_count,)
    long = problem(batch=8, seqlen_q=limit, seqlen_k=limit + 1)
    launch = _plan.forward(long, H100)
    assert not launch.work_counter and launch.grid == (-(-limit // launch.spec.block_m) * 8 * 8,)
    assert _plan.forward(long, H100, persistent=True).grid == (H100.sm_count,)
    # a packed batch of unequal sequences up to limit + 1 keys, in varlen_order's walk, by its mean sequence's
    # keys (total_k over batch); in QueryBlock's walk (head_dim 256) by its longest's
    rows = 8 * limit - 1
    assert _plan.forward(long, H100, packed=True, total_q=rows, total_k=8 * limit).work_counter
    assert not _plan.forward(long, H100, packed=True, total_q=rows, total_k=8 * limit + 1).work_counter
    wide = dataclasses.replace(long, head_dim=256)
    assert _plan.forward(wide, H100, packed=True, total_q=rows, total_k=rows).order is None
    assert not _plan.forward(wide, H100, packed=True, total_q=rows, total_k=rows).work_counter
    few = _plan.forward(problem(batch=1, seqlen_q=100, seqlen_k=100, heads=2, heads_kv=2), H100)
    assert few.work_counter and few.grid == (2,)
    assert not _plan.forward(problem(), _config.A100).work_counter
    # a window bounded on both sides keeps the items short at any length: left + block_m + right keys
    block_m = launch.spec.block_m
    windowed = dataclasses.replace(long, seqlen_q=8 * limit, seqlen_k=8 * limit, window_left=limit - block_m)
    assert _plan.keys_per_query_block(windowed, block_m) == limit
    assert _plan.forward(windowed, H100).work_counter
    wider = dataclasses.replace(windowed, window_left=limit - block_m + 1)
    assert not _plan.forward(wider, H100).work_counter
    # one side unbounded: a block may see every key
    assert _plan.keys_per_query_block(dataclasses.replace(windowed, window_right=-1), block_m) == 8 * limit


def test_short_causal_query_blocks_at_head_dim_64_take_128_rows():
    # the table's 192 x 128 at head_dim 64, 128 x 128 for causal query blocks visiting up to
    # WGMMA_SHORT_CAUSAL_MAX_KEYS keys (a packed batch's longest sequence's): plain, 16-bit only
    limit = _config.WGMMA_SHORT_CAUSAL_MAX_KEYS

    def tile(**options):
        spec = _plan.forward(problem(head_dim=64, **options), H100).spec
        return spec.block_m, spec.block_n, spec.threads

    assert tile(seqlen_q=limit, seqlen_k=limit) == (128, 128, 3 * 128)
    assert tile(seqlen_q=1, seqlen_k=limit, dtype=np.float16) == (128, 128, 3 * 128)
    assert tile(seqlen_q=limit, seqlen_k=limit + 1)[0] == 192
    assert tile(seqlen_q=limit, seqlen_k=limit, causal=False)[0] == 192
    assert tile(seqlen_q=limit, seqlen_k=limit, softcap=30.0)[0] == 192
    assert _plan.forward(problem(head_dim=128, seqlen_q=limit, seqlen_k=limit), H100).spec.block_m == 128
    packed = _plan.forward(problem(head_dim=64, seqlen_q=limit, seqlen_k=limit), H100, packed=True, total_q=limit)
    assert (packed.spec.block_m, packed.spec.block_n) == (128, 128) and packed.spec.varlen
    longer = _plan.forward(problem(head_dim=64, seqlen_q=limit, seqlen_k=limit + 1), H100, packed=True)
    assert longer.spec.block_m == 192 and longer.spec.varlen
    # the specializations are ones the compile check and the warm-up hold
    short = _plan.forward(problem(head_dim=64, seqlen_q=limit, seqlen_k=limit), H100).spec
    specs = {s.cache_key for s in _config.all_specs(H100)}
    assert short.cache_key in specs and packed.spec.cache_key in specs


def test_the_hopper_forward_falls_back_where_no_tensor_map_serves():
    # arrays whose strides no tensor map describes run the mma.sync forward on the same device
    p = problem()
    assert _plan.forward(p, H100).spec.kernel == "fwd_wgmma"
    fallback = _plan.forward(p, H100, tensor_maps=False)
    assert fallback.spec == _config.choose_config(128, BFLOAT16, True, dataclasses.replace(H100, tensor_maps=False)).forward
    assert fallback.spec.kernel == "fwd_mma" and fallback.grid == (-(-1000 // fallback.spec.block_m) * 16,)
    assert _plan.forward(p, _config.A100, tensor_maps=True).spec.kernel == "fwd_mma"


def test_the_hopper_kernels_take_alibi_from_their_smallest_scale():
    # fwd_wgmma and bwd_dkdv_wgmma keep ALiBi's bias in units of the scale (kAlibiInS): below WGMMA_ALIBI_MIN_SCALE
    # the portable kernels serve; beside the softcap or dropout (and the forward's sinks) the bias is added to
    # finished scores, at every scale. The backward's kernels never see the sinks.
    smallest = _config.WGMMA_ALIBI_MIN_SCALE
    alibi, softcap, dropout, sinks = _config.MOD_ALIBI, _config.MOD_SOFTCAP, _config.MOD_DROPOUT, _config.MOD_SINKS
    for mods, scale, hopper_fwd, hopper_bwd in [(alibi, smallest, True, True), (alibi, smallest / 2, False, False),
                                                (alibi | sinks, smallest / 2, True, False),
                                                (alibi | softcap, smallest / 2, True, True),
                                                (alibi | dropout, smallest / 2, True, True),
                                                (0, smallest / 2, True, True)]:
        p = dataclasses.replace(problem(alibi_shape=(8,) if mods & alibi else None,
                                        softcap=30.0 if mods & softcap else 0.0,
                                        dropout_p=0.1 if mods & dropout else 0.0,
                                        sinks=bool(mods & sinks)), softmax_scale=scale)
        assert p.mods == mods
        assert _plan.forward(p, H100).spec.kernel == ("fwd_wgmma" if hopper_fwd else "fwd_mma"), (mods, scale)
        kernels = {launch.spec.kernel for launch in _plan.backward(p, H100, deterministic=False).dkdv}
        assert kernels == ({"bwd_dkdv_wgmma"} if hopper_bwd else {"bwd_dkdv_mma"}), (mods, scale, kernels)


def test_tensor_map_strides():
    from cuflash import _tma

    # (batch, rows, heads, head_dim) with element strides (batch, row, head): 16-byte multiples, rows too
    assert _tma.strides_ok(2, (2, 100, 8, 64), (100 * 8 * 64, 8 * 64, 64))
    assert not _tma.strides_ok(2, (2, 100, 8, 60), (100 * 8 * 60, 8 * 60, 60))      # 120-byte rows
    assert not _tma.strides_ok(2, (2, 100, 8, 64), (100 * 8 * 64, 8 * 64 + 4, 64))  # an 8-byte row step
    assert not _tma.strides_ok(2, (2, 100, 8, 64), (0, 8 * 64, 64))                 # a broadcast batch
    # an axis of one element never moves: its stride does not matter (tensor_map gives it a legal one)
    assert _tma.strides_ok(2, (1, 100, 1, 64), (0, 72, 3))
    assert _tma.strides_ok(2, (1, 5000, 8, 128), (0, 8 * 128, 128))                 # a packed batch
    # the strides a map gets: a one-element axis takes the array's span (16-byte multiple), the others stay
    assert _tma.map_strides(2, (1, 5000, 8, 128), (0, 8 * 128, 128)) == (5000 * 8 * 128, 8 * 128, 128)
    assert _tma.map_strides(2, (1, 100, 1, 64), (0, 72, 3)) == (7200, 72, 7200)
    assert _tma.map_strides(2, (2, 100, 8, 64), (51200, 512, 64)) == (51200, 512, 64)


def test_forward_takes_the_modifiers_kernels():
    p = problem(head_dim=64, dropout_p=0.1)
    assert _plan.forward(p, H100).spec.mods == _config.MOD_DROPOUT


def test_default_backward_adds_dq_in_the_banded_dkdv_launch():
    p = problem(heads=8, heads_kv=2)  # GQA: 4 (batch, kv head) pairs
    plan = _plan.backward(p, H100, deterministic=False)
    cfg = _config.choose_config(128, BFLOAT16, _config.MASK_CAUSAL, H100)
    assert plan.adds_dq
    (dkdv,) = plan.dkdv
    # on sm_90 with tensor maps the Hopper dK/dV kernel (the deterministic split grid keeps the mma.sync one)
    assert dkdv.spec == cfg.bwd_dkdv_wgmma and dkdv.tail == (0, 0)
    assert _plan.backward(p, H100, False, tensor_maps=False).dkdv[0].spec.kernel == "bwd_dkdv_mma"
    key_blocks = -(-1000 // dkdv.spec.block_n)
    tiles, bands = dkdv.grid
    assert tiles * bands == key_blocks * 4 and tiles % key_blocks == 0  # whole heads per band
    assert plan.accum_shape == (1, 2, 8, _config.dq_accum_rows(1000), 128)
    assert plan.dq.spec == cfg.bwd_dq_convert and plan.dq.tail == ()
    # one thread per row of every 16 x 8 tile of a (batch, head) pair's rows, a grid row per pair
    assert plan.dq.grid[0] * plan.dq.spec.threads >= _config.dq_accum_rows(1000) * 128 // 8
    assert (plan.dq.grid[0] - 1) * plan.dq.spec.threads < _config.dq_accum_rows(1000) * 128 // 8
    assert plan.dq.grid[1] == 2 * 8
    lanes = _config.preprocess_lanes(128, 2)
    assert plan.preprocess_lanes == lanes and plan.preprocess.grid == (-(-2 * 8 * 1000 * lanes // 256),)


def test_deterministic_backward_keeps_the_banded_grid_in_the_ordered_form():
    # on sm_90 at head_dim 64, 128 and 256: one launch of the Hopper kernel's ordered form on the default's
    # grid (batch 2 x 2 kv heads, a pair's key blocks side by side), the default's buffer, and one int32 count
    # per 16 x 64 share of the buffer
    for head_dim in _config.ORDERED_DQ_HEAD_DIMS:
        p = problem(seqlen_k=1000, heads=4, heads_kv=2, head_dim=head_dim)
        default, plan = (_plan.backward(p, H100, deterministic) for deterministic in (False, True))
        (launch,) = plan.dkdv
        # the default's tiles: under the causal mask 128-row steps at head_dim 64, else 64
        assert default.dkdv[0].spec.block_m == (128 if head_dim == 64 else 64)
        assert launch.spec == dataclasses.replace(default.dkdv[0].spec, ordered_dq=True)
        assert launch.spec.name.endswith(", true, false>")
        key_blocks = -(-1000 // launch.spec.block_n)
        assert launch.grid == (key_blocks, 2 * 2) == default.dkdv[0].grid
        assert launch.tail == (0, 1) and default.dkdv[0].tail == (0, 0)
        assert plan.accum_shape == default.accum_shape and plan.accum_shape[0] == 1
        assert plan.order_ints == np.prod(plan.accum_shape) // (16 * 64) and default.order_ints == 0
        # without a mask at head_dim 64 both forms take 128-row steps
        full = problem(seqlen_k=1000, heads=4, heads_kv=2, head_dim=head_dim, causal=False)
        default, plan = (_plan.backward(full, H100, deterministic) for deterministic in (False, True))
        rows = (default.dkdv[0].spec.block_m, plan.dkdv[0].spec.block_m)
        assert rows == ((128, 128) if head_dim == 64 else (64, 64))
        assert plan.dkdv[0].spec == dataclasses.replace(default.dkdv[0].spec, ordered_dq=True)
        assert plan.dkdv[0].spec.smem_bytes == _config.wgmma_dkdv_smem_bytes(head_dim, 2, rows[1])
        assert plan.dkdv[0].grid == default.dkdv[0].grid and plan.dkdv[0].tail == (0, 1)
    # elsewhere the split grid or the dQ kernel: on the mma.sync kernels
    portable = _plan.backward(problem(), H100, deterministic=True, tensor_maps=False)
    assert portable.order_ints == 0 and {launch.spec.kernel for launch in portable.dkdv} == {"bwd_dkdv_mma"}


def test_deterministic_backward_on_the_split_grid_launches_each_pass_in_order(monkeypatch):
    monkeypatch.setattr(_config, "ordered_dq_kernel", lambda cfg: None)
    monkeypatch.setattr(_config, "deterministic_dq_splits", lambda *_: 3)
    p = problem(seqlen_k=1000, heads=4, heads_kv=4)
    plan = _plan.backward(p, H100, deterministic=True)
    key_blocks = -(-1000 // plan.dkdv[0].spec.block_n)
    assert [launch.tail for launch in plan.dkdv] == [(3, dq_pass) for dq_pass in range(-(-key_blocks // 3))]
    assert all(launch.grid == (2 * 4 * 3,) for launch in plan.dkdv)
    assert plan.adds_dq and plan.accum_shape[0] == 3
    # on the Hopper kernel (the default's form) where one thread adds each dQ element of a launch: at head_dim 64
    # its 128-row steps (under every mask) split dQ by queries, so one consumer adds each element there too
    hopper = _config.choose_config(128, BFLOAT16, True, H100).bwd_dkdv_wgmma
    assert [launch.spec for launch in plan.dkdv] == [hopper] * 3
    full = problem(seqlen_k=1000, heads=4, heads_kv=4, head_dim=64, causal=False)
    causal = dataclasses.replace(full, causal=True, window_right=0)
    windowed = dataclasses.replace(full, window_left=256, window_right=0)
    for p64 in (full, causal, windowed):
        plan = _plan.backward(p64, H100, deterministic=True)
        assert {(launch.spec.kernel, launch.spec.block_m) for launch in plan.dkdv} == {("bwd_dkdv_wgmma", 128)}
    assert _plan.backward(windowed, H100, deterministic=True).dkdv[0].spec.mask == _config.MASK_WINDOW


def test_deterministic_backward_with_the_dq_kernel():
    p = problem(batch=1, heads=2, heads_kv=2)  # 2 pairs cannot fill the SMs: the dQ kernel serves
    plan = _plan.backward(p, _config.A100, deterministic=True)
    cfg = _config.choose_config(128, BFLOAT16, _config.MASK_CAUSAL, _config.A100)
    assert not plan.adds_dq and plan.accum_shape is None
    assert [launch.spec for launch in plan.dkdv] == list(cfg.bwd_dkdv)
    assert plan.dq.spec == cfg.bwd_dq and plan.dq.tail == (0, 0)
    assert plan.dq.grid == (-(-1000 // cfg.bwd_dq.block_m) * 2,)


def test_float32_backward_runs_the_simt_pair():
    plan = _plan.backward(problem(dtype=np.float32), H100, deterministic=False)
    assert not plan.adds_dq
    assert [launch.spec.kernel for launch in plan.dkdv] == ["bwd_dkdv_simt"] and plan.dq.spec.kernel == "bwd_dq_simt"


@given(batch=st.integers(1, 64), heads_kv=st.integers(1, 16), group=st.integers(1, 4),
       seqlen_k=st.integers(1, 40_000), deterministic=st.booleans(), head_dim=st.sampled_from([64, 128, 256]))
def test_backward_launches_cover_every_key_block_once_per_pass(batch, heads_kv, group, seqlen_k, deterministic,
                                                               head_dim):
    p = problem(batch=batch, seqlen_q=seqlen_k, seqlen_k=seqlen_k, heads=heads_kv * group, heads_kv=heads_kv,
                head_dim=head_dim)
    plan = _plan.backward(p, H100, deterministic)
    pairs = batch * heads_kv
    for launch in plan.dkdv:
        key_blocks = -(-seqlen_k // launch.spec.block_n)
        splits, dq_pass = launch.tail
        if splits:  # block `split` of a pass takes key block split + dq_pass * splits (KeyBlock)
            assert launch.grid == (pairs * splits,) and dq_pass * splits < key_blocks
        else:  # banded: the bands hold every (pair, key block) once
            tiles, bands = launch.grid
            assert tiles * bands == key_blocks * pairs and bands <= _config.MAX_GRID_Y
    assert all(len(launch.grid) in (1, 2) and min(launch.grid) >= 1 for launch in (plan.preprocess, plan.dq))


@pytest.mark.parametrize("seqlen, pair_major", [(512, True), (2048, True), (4096, False), (16384, False)])
def test_the_hopper_backward_runs_a_pairs_key_blocks_side_by_side_up_to_the_limit(seqlen, pair_major):
    # FlashAttention's grid at head_dim 128 (16k tokens, 16 heads): a band per pair while a pair has at most
    # PAIR_MAJOR_MAX_TILES key blocks; past it the wave-sized bands, as the mma.sync kernels always have
    p = problem(batch=16384 // seqlen, seqlen_q=seqlen, seqlen_k=seqlen, heads=16, heads_kv=16)
    (launch,) = _plan.backward(p, H100, deterministic=False).dkdv
    assert launch.spec.kernel == "bwd_dkdv_wgmma"
    key_blocks, pairs = -(-seqlen // launch.spec.block_n), 16384 // seqlen * 16
    assert (key_blocks <= _config.PAIR_MAJOR_MAX_TILES) == pair_major
    bands = pairs if pair_major else pairs // _config.block_band(key_blocks, pairs, H100.sm_count)
    assert launch.grid == (key_blocks * pairs // bands, bands)
    portable = _plan.backward(p, H100, deterministic=False, tensor_maps=False)
    assert all(launch.grid == _plan.banded_grid(-(-seqlen // launch.spec.block_n), pairs, H100.sm_count)
               for launch in portable.dkdv)
    # the ordered form on the same grid, adding dQ in the order in which the key blocks reach a tile where a
    # pair's run side by side, else in key-block order; under the mask on bands of at least 8 pairs
    (ordered,) = _plan.backward(p, H100, deterministic=True).dkdv
    assert ordered.spec.ordered_dq and ordered.tail == (0, int(pair_major))
    least = H100.sm_count // _config.ORDERED_WAVE_KEY_BLOCKS
    ordered_bands = pairs if pair_major else pairs // _config.block_band(key_blocks, pairs, H100.sm_count, 0, least)
    assert ordered.grid == (key_blocks * pairs // ordered_bands, ordered_bands)
    assert (ordered.grid == launch.grid) == (seqlen < 16384)   # at 16k the wave-sized bands hold 4 of 16 pairs
    assert launch.tail == (0, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_the_ordered_backward_runs_2048_keys_side_by_side_at_head_dim_256(causal):
    # 32 key blocks a pair: the default form on the wave-sized bands, the ordered form one pair per band, its key
    # blocks side by side (ORDERED_PAIR_MAJOR_MAX_KEYS); from 4096 keys both on the wave-sized bands, under the
    # mask the ordered form's of at least 8 pairs: at 8192 keys 8 of 16 pairs a band (the wave's 4 would put 33
    # of a pair's key blocks in one wave)
    for seqlen, side_by_side in [(2048, True), (4096, False), (8192, False)]:
        p = problem(batch=16384 // seqlen, seqlen_q=seqlen, seqlen_k=seqlen, heads=8, heads_kv=8, head_dim=256,
                    causal=causal)
        (default,) = _plan.backward(p, H100, deterministic=False).dkdv
        (ordered,) = _plan.backward(p, H100, deterministic=True).dkdv
        key_blocks, pairs = -(-seqlen // default.spec.block_n), p.batch * p.heads_kv
        wave_bands = _plan.banded_grid(key_blocks, pairs, H100.sm_count)
        assert default.grid == wave_bands and default.tail == (0, 0)
        assert ordered.spec.ordered_dq and ordered.tail == (0, int(side_by_side))
        ordered_bands = wave_bands if not causal or seqlen == 4096 else (key_blocks * 8, pairs // 8)
        assert ordered.grid == ((key_blocks, pairs) if side_by_side else ordered_bands)
        assert (ordered.grid == default.grid) == (not side_by_side and (not causal or seqlen == 4096))


@pytest.mark.parametrize("seqlen, sm_count", [(32768, H100.sm_count), (2048, 8)])
def test_the_ordered_backward_adds_in_key_block_order_where_a_pair_outnumbers_the_sms(seqlen, sm_count):
    # one pair: one band whatever its key blocks, but the order in which they reach a tile waits on higher key
    # blocks too, and more key blocks than SMs could not all be resident; so also on a GPU of 8 SMs
    device = dataclasses.replace(H100, sm_count=sm_count)
    p = problem(batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads=1, heads_kv=1)
    (launch,) = _plan.backward(p, device, deterministic=True).dkdv
    key_blocks = -(-seqlen // launch.spec.block_n)
    assert launch.spec.ordered_dq and launch.grid == (key_blocks, 1) and key_blocks > sm_count
    assert launch.tail == (0, 0)
    assert _plan.backward(dataclasses.replace(p, seqlen_q=512, seqlen_k=512), device, True).dkdv[0].tail == (0, 1)


def test_a_grid_past_cudas_limit_is_a_value_error():
    with pytest.raises(ValueError, match="problem too large"):
        _plan.grid(2**31)
    assert _plan.grid(0) == (1,) and _plan.grid(2**31 - 1) == (2**31 - 1,)


def cache_problem(batch=1, seqlen_q=1, capacity=4096, heads=32, heads_kv=8, head_dim=128, **options):
    from cuflash._validate import CacheProblem

    return CacheProblem(problem(batch, seqlen_q, capacity, heads, heads_kv, head_dim, causal=False, **options),
                        page_size=0, num_pages=0, seqlen_new=0, lengths="array")


def test_kvcache_packs_the_query_heads_of_a_kv_head():
    # 32 query heads on 8 kv heads, one query: 4 rows per block, one block (x splits) per kv head
    plan = _plan.kvcache(cache_problem(), H100)
    assert plan.pack == 4 and plan.forward.spec.kvcache and plan.forward.spec.block_m == 16
    assert plan.forward.grid == (8 * plan.splits,)
    # four queries of 8 query heads per kv head: 32 rows, two blocks per kv head
    plan = _plan.kvcache(cache_problem(seqlen_q=4, heads=64), H100)
    assert plan.pack == 8 and plan.forward.grid == (2 * 8 * plan.splits,)
    # ALiBi's slope is per block: no packing, a block per query head
    plan = _plan.kvcache(cache_problem(alibi_shape=(32,)), H100)
    assert plan.pack == 1 and plan.forward.grid == (32 * plan.splits,)


def test_kvcache_splits_fill_the_gpu_and_count_per_row_group():
    # one sequence of 4096 keys: 8 blocks would leave most SMs idle, so the keys are split; the splits of
    # each of the 8 row groups count in one counter, and the last merges them in the same launch
    small = _plan.kvcache(cache_problem(), H100)
    assert small.splits == 8 and small.row_groups == 8 and small.forward.grid == (8 * 8,)
    # a batch that fills the GPU by itself takes no splits
    big = _plan.kvcache(cache_problem(batch=64, capacity=1024), H100)
    assert big.splits == 1 and big.row_groups == 64 * 8
    # the caller's count, at most one split per key tile
    assert _plan.kvcache(cache_problem(), H100, num_splits=1).splits == 1
    assert _plan.kvcache(cache_problem(capacity=300), H100, num_splits=64).splits == 3  # 128-key tiles


@pytest.mark.parametrize("blocks,key_tiles,splits", [(8, 32, 8), (8, 1024, 16), (64, 8, 1), (8, 128, 8), (512, 128, 1),
                                                    (1, 1, 1), (3000, 16, 1), (2, 8, 4), (8, 64, 8)])
def test_kvcache_splits_rule(blocks, key_tiles, splits):
    # one block per SM on 132 SMs: half the slots, doubled while each split keeps LONG_SPLIT_TILES tiles
    assert _config.kvcache_splits(blocks, key_tiles, 1, 132) == splits


def test_dq_conversion_walks_pairs_past_the_grid_limit():
    """bwd_dq_convert takes a grid row per (batch, head) pair and walks the pairs past CUDA's 65535 rows."""
    p = problem(batch=70_000, seqlen_q=3, seqlen_k=3, heads=2, heads_kv=2, head_dim=64)
    plan = _plan.backward(p, H100, deterministic=False)
    assert plan.adds_dq and plan.accum_shape[1:3] == (70_000, 2)
    assert plan.dq.grid == (-(-_config.dq_accum_rows(3) * 64 // 8 // plan.dq.spec.threads), _config.MAX_GRID_Y)


def test_packed_backward_walks_the_packed_rows():
    """A packed batch (attention_varlen): the packed kernels on the dense tiles, bwd_preprocess over the packed
    rows, and the dQ buffer per head of DqAccum's packed rows, each sequence's from a multiple of 128."""
    p = problem(batch=3, seqlen_q=1000, seqlen_k=900, heads=8, heads_kv=2)  # the longest lengths
    total_q = 1700
    plan = _plan.backward(p, H100, deterministic=False, total_q=total_q)
    dense = _plan.backward(p, H100, deterministic=False)
    assert all(launch.spec.varlen for launch in (*plan.dkdv, plan.dq))
    assert [launch.grid for launch in plan.dkdv] == [launch.grid for launch in dense.dkdv]
    rows = _config.dq_accum_packed_rows(3, total_q)
    assert rows == (1700 // 128 + 3) * 128 and plan.accum_shape == (1, 8, rows, 128)
    assert plan.dq.grid[0] * plan.dq.spec.threads >= rows * 128 // 8 and plan.dq.grid[1] == 8   # a row per head
    lanes = plan.preprocess_lanes
    assert not plan.preprocess.spec.varlen and plan.preprocess.grid == (-(-8 * total_q * lanes // 256),)
    assert _plan.forward(p, H100, packed=True).spec == dataclasses.replace(_plan.forward(p, H100).spec, varlen=True)


@given(lengths=st.lists(st.integers(0, 600), min_size=1, max_size=12))
def test_packed_dq_rows_never_overlap(lengths):
    """Sequence b's dQ rows start at packed_row(b) = 128 * (cu_q[b] // 128 + b) (DqAccum::packed_row) and take
    dq_accum_rows(its length), before the next sequence's and within the buffer."""
    cu = np.concatenate([[0], np.cumsum(lengths)])
    starts = [128 * (int(cu[b]) // 128 + b) for b in range(len(lengths))]
    ends = [start + _config.dq_accum_rows(n) for start, n in zip(starts, lengths)]
    assert all(start % 16 == 0 for start in starts)
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:]))
    assert ends[-1] <= _config.dq_accum_packed_rows(len(lengths), int(cu[-1]))


def test_packed_hopper_forward_walks_an_ordered_list_of_its_items():
    """On a packed batch the Hopper forward's launch comes with varlen_order's (one block), which writes the
    item order into a buffer of 1 + capacity ints; the forward's grid holds capacity entries of every head (or
    a block per SM on the persistent grid). No order without the packed rows, off the Hopper forward, past
    VARLEN_ORDER_MAX_BATCH sequences, or where it does not pay (varlen_forward_ordered)."""
    p = problem(batch=3, seqlen_q=1000, seqlen_k=900, heads=8, heads_kv=2, head_dim=64)
    launch = _plan.forward(p, H100, packed=True, total_q=1700)
    m = launch.spec.block_m
    order = launch.order
    assert order.spec == _config.varlen_order_spec(_config.MASK_CAUSAL) and order.grid == (1,)
    assert order.spec.name == "cuflash::varlen_order<1>" and order.spec.threads == _config.VARLEN_ORDER_THREADS
    capacity = -(-1700 // m) + 3
    assert order.tail == (3, 1000, m, launch.spec.block_n, *p.kernel_window, capacity)
    assert launch.order_ints == 1 + capacity
    assert launch.grid == ((min(capacity * 8, H100.sm_count) if launch.work_counter else capacity * 8),)
    # in sections of heads whose K and V of every sequence (total_k keys; batch * seqlen_k where not given) fit a
    # share of the L2: here all 8 heads, or 2 of 2 * 1500 * 64 * 2 / 4 bytes each in a small L2
    assert launch.tail == (_config.forward_section_heads(launch.spec, 8, 900, p.group, H100, 3 * 900),) == (8,)
    head_bytes = 2 * 1500 * 64 * 2 / 4
    small = dataclasses.replace(H100, l2_bytes=int(2.5 * head_bytes / _config.FORWARD_SECTION_L2_SHARE))
    assert _plan.forward(p, small, packed=True, total_q=1700, total_k=1500).tail == (2,)
    long = problem(batch=3, seqlen_q=4000, seqlen_k=4000, heads=8, heads_kv=2, head_dim=64, causal=False)
    launch = _plan.forward(long, H100, packed=True, total_q=5000)
    assert not launch.work_counter and launch.grid == ((-(-5000 // launch.spec.block_m) + 3) * 8,)
    # capacity never past the dense grid's query blocks
    assert _plan.forward(long, H100, packed=True, total_q=12000).order.tail[-1] == 3 * -(-4000 // launch.spec.block_m)
    assert _plan.forward(p, H100, packed=True).order is None
    assert _plan.forward(p, H100).order is None and _plan.forward(p, H100).order_ints == 0
    assert _plan.forward(p, _config.A100, packed=True, total_q=1700).order is None
    many = problem(batch=_config.VARLEN_ORDER_MAX_BATCH + 1, seqlen_q=10, seqlen_k=10, head_dim=64)
    assert _plan.forward(many, H100, packed=True, total_q=100).order is None
    # at 128 only sequences of unequal lengths (total_q below batch x seqlen_q), past 128 none
    assert _config.varlen_forward_ordered(64) and _config.varlen_forward_ordered(64, equal_lengths=True)
    assert _config.varlen_forward_ordered(128) and not _config.varlen_forward_ordered(128, equal_lengths=True)
    assert not _config.varlen_forward_ordered(256)
    wide = problem(batch=3, seqlen_q=1000, seqlen_k=900, heads=8, heads_kv=2, head_dim=128)
    assert _plan.forward(wide, H100, packed=True, total_q=1700).order is not None
    launch = _plan.forward(wide, H100, packed=True, total_q=3000)
    assert launch.order is None
    # QueryBlock's walk over the longest sequences' grid, in sections of (sequence, head) pairs as a dense batch
    assert launch.tail == (_config.forward_section_heads(launch.spec, 3 * 8, 900, wide.group, H100),)
    widest = problem(batch=3, seqlen_q=1000, seqlen_k=900, heads=8, heads_kv=2, head_dim=256)
    assert _plan.forward(widest, H100, packed=True, total_q=1700).order is None


@given(lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=40), block_m=st.sampled_from([64, 128, 192]))
def test_varlen_order_capacity_holds_every_query_block_with_rows(lengths, block_m):
    """varlen_order's entries, the query blocks with rows (sum of ceil(n_b / block_m)), fit the capacity the plan
    gives it: ceil(total_q / block_m) + batch, and the dense grid's query blocks."""
    entries = sum(-(-n // block_m) for n in lengths)
    assert entries <= -(-sum(lengths) // block_m) + len(lengths)
    assert entries <= -(-max(lengths) // block_m) * len(lengths)
