"""GPU-only properties: reproducibility, memory growth, streams."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import _config, _cupy_path

from ._checks import BF16, make_qkv, to_numpy
from .conftest import GPU

pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=lambda d: np.dtype(d).name)
def test_forward_is_bitwise_reproducible(cp, rng, dtype):
    q, k, v = make_qkv(cp, rng, 4, 1000, 1000, 8, 2, 128, dtype)
    first = cuflash.attention(q, k, v, causal=True, return_lse=True)
    second = cuflash.attention(q, k, v, causal=True, return_lse=True)
    for a, b in zip(first, second):
        assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))


def _large_backward_inputs(cp, rng, head_dim=64, seqlen_k=1024, seqlen_q=1024, **options):
    # 8 x 4 kv heads x 8-16 key blocks: enough dK/dV blocks to fill every SM several times, so the order
    # in which blocks run (and add into dQ) varies between runs
    q, k, v = make_qkv(cp, rng, 8, seqlen_q, seqlen_k, 16, 4, head_dim, BF16)
    dout = cp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(BF16))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    return dout, q, k, v, out, lse


def _bitwise_equal(cp, a, b) -> bool:
    return bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)))


def _assert_reproducible(cp, args, runs, **options):
    first = cuflash.attention_backward(*args, deterministic=True, **options)
    for _ in range(runs):
        again = cuflash.attention_backward(*args, deterministic=True, **options)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert _bitwise_equal(cp, a, b), name


@pytest.mark.parametrize(("way", "head_dim"), [("ordered", d) for d in _config.ORDERED_DQ_HEAD_DIMS] +
                         [(way, d) for way in ("split_grid", "dq_kernel") for d in (64, 128, 256)])
def test_deterministic_backward_is_bitwise_reproducible(cp, rng, monkeypatch, request, way, head_dim):
    args = _large_backward_inputs(cp, rng, head_dim, causal=True)
    # the Hopper kernel's ordered form serves on sm_90; elsewhere these 32 (batch, kv head) pairs take the split
    # grid on GPUs of up to ~280 SMs (on sm_90, forced, the Hopper kernel's at 128 and 256); the dQ kernel serves
    # where too few pairs would leave SMs idle. Each way forced here.
    props = _cupy_path.device_props(cp.cuda.Device().id)
    cfg = _config.choose_config(head_dim, BF16, True, props)
    if way == "ordered" and _config.ordered_dq_kernel(cfg) is None:
        pytest.skip("the ordered form serves on sm_90")
    if way != "ordered":
        monkeypatch.setattr(_config, "ordered_dq_kernel", lambda cfg: None)
    chosen = _config.deterministic_dq_splits(cfg, 32, 1024, props.sm_count)
    if way == "split_grid":
        assert chosen > 0 or not _config.split_grid_serves(cfg), chosen
    if way == "dq_kernel":
        monkeypatch.setattr(_config, "deterministic_dq_splits", lambda *_: 0)
    cuflash.clear_plans()  # plans made before the patch hold the choice
    request.addfinalizer(cuflash.clear_plans)  # and none made under it may outlive it
    _assert_reproducible(cp, args, 50, causal=True)


@pytest.mark.parametrize("head_dim", _config.ORDERED_DQ_HEAD_DIMS)
def test_ordered_dq_is_bitwise_reproducible_under_a_window(cp, rng, head_dim):
    # a left window bound: a query tile's first key block is not block 0 (the ordered form counts from it), and
    # more keys than queries move the diagonal
    window = dict(window_size=(300, 40))
    args = _large_backward_inputs(cp, rng, head_dim, seqlen_k=1500, **window)
    _assert_reproducible(cp, args, 20, **window)


@pytest.mark.parametrize("head_dim", _config.ORDERED_DQ_HEAD_DIMS)
def test_ordered_dq_is_bitwise_reproducible_without_a_mask(cp, rng, head_dim):
    # without a mask at head_dim 64 the ordered form takes 128-row steps: each consumer's dQ shares are 64 of the
    # step's query rows, added by a writer lane of its own
    args = _large_backward_inputs(cp, rng, head_dim)
    _assert_reproducible(cp, args, 20)


@pytest.mark.parametrize("head_dim", _config.ORDERED_DQ_HEAD_DIMS)
def test_ordered_dq_is_bitwise_reproducible_with_more_key_blocks_than_query_tiles(cp, rng, head_dim):
    # a pair's 8-16 key blocks side by side over 1-2 query tiles: without a mask they all start at tile 0
    # (stride 0 in bwd_wgmma.cu), and a tile's adds come from the last key block downwards
    args = _large_backward_inputs(cp, rng, head_dim, seqlen_q=128)
    _assert_reproducible(cp, args, 20)


def test_default_backward_keeps_dk_dv_bitwise_and_dq_close(cp, rng):
    # dq's float32 atomic sums may round differently per run; dk and dv never use atomics
    args = _large_backward_inputs(cp, rng, causal=True)
    exact = cuflash.attention_backward(*args, causal=True, deterministic=True)
    first = cuflash.attention_backward(*args, causal=True)
    for _ in range(10):
        again = cuflash.attention_backward(*args, causal=True)
        assert _bitwise_equal(cp, first[1], again[1]) and _bitwise_equal(cp, first[2], again[2])
        reference = to_numpy(first[0]).astype(np.float32)
        for dq in (again[0], exact[0]):
            diff = np.abs(to_numpy(dq).astype(np.float32) - reference).max()
            # float32 sums in another order, then one bfloat16 rounding: a few bfloat16 ulps of max|dq|
            assert diff <= 2.0**-6 * np.abs(reference).max(), diff


def _pool_growth(cp, fn) -> int:
    """Bytes ``fn`` allocates (its peak footprint, inputs excluded): everything it asks for comes from a
    fresh memory pool, so blocks cached by earlier work cannot hide or inflate it."""
    pool = cp.cuda.MemoryPool()
    cp.cuda.Device().synchronize()
    with cp.cuda.using_allocator(pool.malloc):
        result = fn()
    cp.cuda.Device().synchronize()
    grown = pool.total_bytes()
    del result
    return grown


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True])
def test_memory_grows_linearly_in_seqlen(cp, rng, causal, deterministic):
    props = _cupy_path.device_props(cp.cuda.Device().id)
    # deterministic: a quarter as many heads as SMs, so the split grid runs four splits, four float32
    # dQ copies (where bwd_dkdv_mma serves)
    batch, heads, head_dim, dtype = 1, -(-props.sm_count // 4) if deterministic else 4, 64, np.float16
    cfg = _config.choose_config(head_dim, dtype, causal, props)
    extra = {}
    for seqlen in (4096, 16384):
        q, k, v = make_qkv(cp, rng, batch, seqlen, seqlen, heads, heads, head_dim, dtype)
        io_bytes = q.nbytes  # out (and each gradient) has the size of an input
        lse_bytes = batch * heads * seqlen * 4
        fwd = _pool_growth(cp, lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        bwd = _pool_growth(cp, lambda: cuflash.attention_backward(q, q, k, v, out, lse, causal=causal,
                                                                  deterministic=deterministic))
        extra[seqlen] = (fwd - io_bytes - lse_bytes, bwd - 3 * io_bytes)
        # a seqlen x seqlen float32 buffer per (batch, head) would be 4 GiB here; the backward's extra
        # is delta and the float32 dQ buffer (2 x an input at float16) of the atomic default, once per
        # split in the deterministic split grid
        copies = _config.deterministic_dq_splits(cfg, batch * heads, seqlen, props.sm_count) if deterministic else 1
        assert fwd < 2 * (io_bytes + lse_bytes) and bwd < (4 + 2 * max(copies, 1)) * io_bytes, (seqlen, fwd, bwd)
    for pass_index in (0, 1):
        small, large = extra[4096][pass_index], extra[16384][pass_index]
        assert large <= 4 * max(small, 1 << 20), extra   # linear: 4x the tokens, at most 4x the bytes


def test_runs_on_the_current_stream(cp, rng):
    q, k, v = make_qkv(cp, rng, 2, 500, 500, 4, 4, 64, np.float16)
    expected = cuflash.attention(q, k, v)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cuflash.attention(q, k, v)
    stream.synchronize()
    assert cp.array_equal(out, expected)


def test_arrays_on_different_devices_are_rejected(cp, rng):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = make_qkv(cp, rng, 1, 8, 8, 1, 1, 32, np.float16)
    with cp.cuda.Device(1):
        k1 = cp.asarray(k)
    with pytest.raises(ValueError, match="one device"):
        cuflash.attention(q, k1, v)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
def test_calls_replay_from_a_cuda_graph(cp, rng, dtype, deterministic):
    q, k, v = make_qkv(cp, rng, 2, 300, 300, 4, 2, 64, dtype)
    dout = cp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(dtype))

    def step():
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse, *cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                      deterministic=deterministic))

    step()  # compiles the kernels and makes the plans: capture records launches, not compilation
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()  # a host synchronization inside would raise here
        captured = step()
        graph = stream.end_capture()
    # New inputs in the captured buffers and poisoned outputs: only a replay of every kernel makes the
    # outputs right. A launch that went to the null stream ran once, eagerly, and is not in the graph.
    for x in (q, k, v, dout):
        x[...] = cp.asarray(rng.standard_normal(x.shape, dtype=np.float32).astype(dtype))
    for y in captured:
        y.fill(cp.nan)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    eager = step()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, eager):
        if name == "dq" and not deterministic and dtype != np.float32:  # float32 atomics: order varies
            diff = float(cp.abs(got.astype(cp.float32) - want.astype(cp.float32)).max())
            assert diff <= 2.0**-8 * float(cp.abs(want.astype(cp.float32)).max()), (name, diff)
        else:
            assert cp.array_equal(got, want), name


def test_repeated_calls_reuse_their_plan(cp, rng):
    q, k, v = make_qkv(cp, rng, 1, 64, 80, 2, 1, 96, BF16)
    cuflash.clear_plans()
    first = cuflash.attention(q, k, v, causal=True)
    plans = dict(cuflash._plans)
    assert len(plans) == 1
    # the same shapes at another address (and a view that is not 16-byte aligned) reuse the plan
    q2, k2, v2 = make_qkv(cp, rng, 1, 64, 80, 2, 1, 96, BF16)
    unaligned = cp.empty(k2.size + 1, k2.dtype)[1:].reshape(k2.shape)
    unaligned[...] = k2
    again = cuflash.attention(q2, unaligned, v2, causal=True)
    assert cuflash._plans == plans
    assert cp.array_equal(again, cuflash.attention(q2, k2, v2, causal=True))
    assert cp.array_equal(first, cuflash.attention(q, k, v, causal=True))


def _hopper_devices():
    """Device 0's properties, where the Hopper kernels run there (else the test skips), and the same device
    without tensor maps: the one whose config holds the mma.sync kernels they fall back to."""
    props = _cupy_path.device_props(0)
    if not props.tensor_maps:
        pytest.skip("the Hopper kernels run on compute capability 9.0 with cuda-bindings")
    return props, dataclasses.replace(props, tensor_maps=False)


def _hopper_inputs(cp, rng, shape, alibi: bool, sinks: bool):
    """bfloat16 q, k, v of ``shape`` (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim), and ALiBi slopes
    and sinks per head where asked (else None)."""
    heads = shape[3]
    q, k, v = make_qkv(cp, rng, *shape, BF16)
    slopes = cp.asarray(rng.uniform(0.01, 0.2, heads), cp.float32) if alibi else None
    sink = cp.asarray(rng.uniform(-2, 2, heads), cp.float32) if sinks else None
    return q, k, v, slopes, sink


def _hopper_and_fallback_forward(p, fallback_device, q, k, v, *run_args):
    """(out, lse) of the Hopper forward and of the mma.sync forward it falls back to, for checked parameters
    ``p``, as float32 NumPy; ``run_args``: the ALiBi slopes, sinks, seed and offset, as far as given."""
    hopper = _cupy_path.ForwardPlan(p, 0, q, k, v)
    assert hopper.maps is not None, q.shape
    fallback = _config.choose_config(p.head_dim, q.dtype, p.mask_kind, fallback_device, p.mods).forward
    got = hopper.run(q, k, v, *run_args)
    want = _cupy_path.ForwardPlan(p, 0, q, k, v, spec=fallback).run(q, k, v, *run_args)
    return [(to_numpy(out).astype(np.float32), to_numpy(lse)) for out, lse in (got, want)]


def test_the_hopper_forward_matches_its_fallback(cp, rng):
    # fwd_wgmma (TMA, wgmma) against the mma.sync forward it falls back to, on awkward shapes with every feature
    # it takes (dropout draws the same mask in both); and an array no tensor map can describe runs the fallback
    from cuflash import _validate

    _, fallback_device = _hopper_devices()
    cases = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim), causal, window, softcap, ALiBi, sinks, dropout
        ((2, 77, 300, 4, 2, 72), True, (-1, -1), 0.0, False, False, 0.0),
        ((1, 300, 129, 6, 1, 136), False, (40, 7), 20.0, True, True, 0.0),
        ((3, 129, 129, 2, 2, 256), True, (-1, -1), 0.0, True, False, 0.0),
        ((1, 513, 700, 2, 1, 64), False, (-1, -1), 0.0, False, True, 0.0),
        ((2, 130, 333, 4, 2, 64), True, (-1, -1), 0.0, False, False, 0.2),
        ((1, 300, 129, 6, 1, 128), False, (40, 7), 20.0, True, True, 0.5),
        ((2, 129, 200, 2, 1, 192), True, (-1, -1), 0.0, False, False, 0.1),
        ((1, 257, 300, 2, 2, 256), False, (70, 30), 10.0, True, True, 0.3),
        # ALiBi on the 192-row tile at head_dim 64 (with sinks, the diagonal 500 keys in; and without a mask,
        # keys on both sides of the diagonal), and the softcap alone (its factor taken after the row max)
        ((2, 400, 900, 4, 2, 64), True, (-1, -1), 0.0, True, True, 0.0),
        ((1, 700, 500, 2, 1, 48), False, (-1, -1), 0.0, True, False, 0.0),
        ((1, 300, 520, 2, 2, 64), True, (-1, -1), 30.0, False, False, 0.0),
        ((2, 333, 333, 2, 1, 128), False, (-1, -1), 5.0, False, False, 0.0),
    ]
    for shape, causal, window, softcap, alibi, sinks, dropout_p in cases:
        q, k, v, slopes, sink = _hopper_inputs(cp, rng, shape, alibi, sinks)
        p = _validate.check_forward(q, k, v, causal, None, window, softcap, slopes, sink, dropout_p)
        seed, offset = int(rng.integers(2**63)), int(rng.integers(2**31))
        (out, lse), (want, want_lse) = _hopper_and_fallback_forward(p, fallback_device, q, k, v, slopes, sink,
                                                                    seed, offset)
        assert np.abs(out - want).max() <= 2e-2 * np.abs(want).max(), shape
        assert np.allclose(lse, want_lse, atol=1e-3, equal_nan=False), shape
    # heads 68 elements apart: 136 bytes, no 16-byte multiple
    wide = cp.asarray(rng.standard_normal((1, 64, 2, 68), dtype=np.float32).astype(BF16))
    q = k = v = wide[..., :64]
    p = _validate.check_forward(q, k, v, False, None)
    assert _cupy_path.ForwardPlan(p, 0, q, k, v).maps is None
    out = cuflash.attention(q, k, v)
    assert cp.abs(out.astype(cp.float32) - cuflash.attention(*(cp.ascontiguousarray(x) for x in (q, k, v)))
                  .astype(cp.float32)).max() <= 2e-2


def test_the_hopper_forward_keeps_steep_alibi_slopes_exact(cp, rng):
    # fwd_wgmma starts S at ALiBi's bias in units of the scale, less each row's least bias (kAlibiInS), so that a
    # row's nearest key scores as in plain attention whatever the slope. Rows before the diagonal's start
    # (seqlen_q > seqlen_k) have no key at distance 0: at slope 1e8 their biases reach -4e10, and without that
    # shift the exponent's FMA (an exact product less a rounded max) was off by thousands. A row also walks tiles
    # far from its nearest key first, whose scores stay huge: with the reference max rounded to nearest, the first
    # case gave NaN (an infinite exponential, then inf * 0 in the rescale); it is rounded up there. Against the
    # mma.sync forward, which adds the bias to finished scores; the lse carries the shifted-out bias back.
    from cuflash import _validate

    _, fallback_device = _hopper_devices()
    slopes = cp.asarray([1e8, 3.0], cp.float32)   # a one-hot row per head, and a steep one
    cases = [((1, 700, 300, 2, 1, 64), False, (-1, -1)), ((1, 500, 200, 2, 2, 128), False, (-1, 40)),
             ((2, 300, 300, 2, 1, 64), True, (-1, -1))]
    for shape, causal, window in cases:
        q, k, v, _, _ = _hopper_inputs(cp, rng, shape, False, False)
        p = _validate.check_forward(q, k, v, causal, None, window, 0.0, slopes)
        (out, lse), (want, want_lse) = _hopper_and_fallback_forward(p, fallback_device, q, k, v, slopes)
        assert np.abs(out - want).max() <= 2e-2 * np.abs(want).max(), shape
        assert np.allclose(lse, want_lse, rtol=1e-6, atol=1e-3), shape


def test_the_persistent_grid_leaves_its_counters_zeroed(cp, rng):
    # fwd_wgmma's persistent grid takes its items from the stream's counters and leaves them zero: calls of
    # other grid sizes after it, on that stream and another, take every item again (a counter left past zero
    # would skip items and leave rows of `out` unwritten). An item's result does not depend on the block that
    # takes it, so the persistent grid's output is the one-block-per-item grid's, bit for bit.
    from cuflash import _validate

    _hopper_devices()
    shapes = [(1, 100, 100, 2, 1, 64), (2, 1000, 1000, 8, 2, 128), (1, 64, 64, 1, 1, 64), (3, 700, 900, 4, 4, 64)]
    other = cp.cuda.Stream(non_blocking=True)
    for index, shape in enumerate(shapes):
        q, k, v, _, _ = _hopper_inputs(cp, rng, shape, False, False)
        p = _validate.check_forward(q, k, v, index % 2 == 0, None)
        want, want_lse = _cupy_path.ForwardPlan(p, 0, q, k, v, persistent=False).run(q, k, v)
        persistent = _cupy_path.ForwardPlan(p, 0, q, k, v, persistent=True)
        assert persistent.work_counter, shape
        for stream in (cp.cuda.get_current_stream(), other, other):
            with stream:
                out, lse = persistent.run(q, k, v)
                counters = _cupy_path.split_counters(0, _config.WGMMA_WORK_COUNTER_INTS)
            stream.synchronize()
            assert cp.array_equal(out, want) and cp.array_equal(lse, want_lse), (shape, stream)
            assert not counters[:_config.WGMMA_WORK_COUNTER_INTS].any(), (shape, counters)


def test_the_persistent_forward_with_warpgroups_past_the_sequence_is_repeatable(cp, rng):
    # 1024 rows in fwd_wgmma's 192-row blocks at head_dim 64: the last block's upper two warpgroups hold no row of
    # the sequence and skip every key tile but one, freeing its stages as soon as they are loaded. Where one warp
    # of such a warpgroup had not yet seen a load when the stage was freed, the producer could load the stage
    # twice more and that warp waited for the old parity again: the grid hung, on this shape, within a few
    # calls of 512 (batch, head) pairs on a persistent grid. Every call must finish and give the one-block-per-item
    # grid's output, bit for bit.
    from cuflash import _validate

    _hopper_devices()
    q, k, v, _, _ = _hopper_inputs(cp, rng, (16, 1024, 1024, 32, 32, 64), False, False)
    p = _validate.check_forward(q, k, v, False, None)
    want, want_lse = _cupy_path.ForwardPlan(p, 0, q, k, v, persistent=False).run(q, k, v)
    persistent = _cupy_path.ForwardPlan(p, 0, q, k, v, persistent=True)
    assert persistent.work_counter
    for _ in range(50):
        out, lse = persistent.run(q, k, v)
        assert cp.array_equal(out, want) and cp.array_equal(lse, want_lse)


def test_the_sections_of_the_causal_hopper_forward_walk_every_item(cp, rng, monkeypatch):
    # Under the causal mask the Hopper forward walks its (batch, head) pairs in sections sized to the L2
    # (_config.forward_section_heads). An item's result does not depend on the order, so an L2 that makes sections
    # of 1 to 3 pairs (the last one partial) gives the one section's output (an L2 of unknown size), bit for bit, on
    # the persistent grid and the one-block-per-item grid.
    from cuflash import _plan, _validate

    _hopper_devices()
    real = _cupy_path.device_props
    cases = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim), causal, window
        ((2, 1000, 1000, 5, 5, 128), True, (-1, -1)),
        ((3, 700, 900, 4, 2, 64), True, (-1, -1)),
        ((1, 1500, 1500, 7, 7, 256), True, (-1, -1)),
    ]
    for shape, causal, window in cases:
        q, k, v, _, _ = _hopper_inputs(cp, rng, shape, False, False)
        p = _validate.check_forward(q, k, v, causal, None, window_size=window)
        pairs, spec = p.batch * p.heads, _plan.forward(p, real(0)).spec
        assert spec.kernel == "fwd_wgmma", shape
        pair_bytes = 2 * _plan.keys_per_query_block(p, spec.block_m) * spec.head_dim * 2 / p.group   # bfloat16
        for persistent in (True, False):
            monkeypatch.setattr(_cupy_path, "device_props", lambda i: dataclasses.replace(real(i), l2_bytes=0))
            assert _plan.forward(p, _cupy_path.device_props(0)).tail == (pairs,), shape
            want, want_lse = _cupy_path.ForwardPlan(p, 0, q, k, v, persistent=persistent).run(q, k, v)
            for sections in (1, 2, 3):
                l2_bytes = int((sections + 0.5) * pair_bytes / _config.FORWARD_SECTION_L2_SHARE)
                monkeypatch.setattr(_cupy_path, "device_props",
                                    lambda i, n=l2_bytes: dataclasses.replace(real(i), l2_bytes=n))
                assert _plan.forward(p, _cupy_path.device_props(0)).tail == (sections,), (shape, sections)
                out, lse = _cupy_path.ForwardPlan(p, 0, q, k, v, persistent=persistent).run(q, k, v)
                assert cp.array_equal(out, want) and cp.array_equal(lse, want_lse), (shape, persistent, sections)


def test_the_hopper_backward_matches_its_fallback(cp, rng):
    # bwd_dkdv_wgmma (the default backward's dK/dV and atomic dQ on sm_90) against the mma.sync kernels it falls
    # back to, on awkward shapes at the head dims it serves (33..64, 97..128 and 225..256), with the score
    # modifiers, sinks and dropout (the same mask drawn in both)
    from cuflash import _validate

    _, fallback_device = _hopper_devices()
    cases = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim), causal, window, softcap, ALiBi, sinks, dropout
        ((2, 77, 300, 4, 2, 128), True, (-1, -1), 0.0, False, False, 0.0),
        ((1, 300, 129, 6, 1, 104), False, (40, 7), 0.0, False, False, 0.0),
        ((3, 129, 129, 2, 2, 128), False, (-1, -1), 0.0, False, False, 0.0),
        ((1, 513, 700, 2, 1, 120), True, (-1, -1), 0.0, False, False, 0.0),
        ((2, 200, 333, 4, 4, 64), True, (-1, -1), 0.0, False, False, 0.0),
        ((1, 129, 70, 6, 2, 40), False, (-1, -1), 0.0, False, False, 0.0),
        ((2, 150, 260, 4, 2, 64), False, (50, 20), 30.0, True, True, 0.0),
        ((1, 257, 190, 2, 1, 128), True, (-1, -1), 15.0, False, False, 0.0),
        ((1, 300, 300, 4, 1, 112), False, (-1, -1), 0.0, True, False, 0.0),
        ((2, 77, 300, 4, 2, 256), True, (-1, -1), 0.0, False, False, 0.0),
        ((1, 300, 129, 6, 1, 232), False, (40, 7), 0.0, False, False, 0.0),
        ((1, 150, 260, 4, 2, 256), False, (50, 20), 30.0, True, True, 0.0),
        ((2, 64, 64, 2, 2, 248), False, (-1, -1), 0.0, False, False, 0.0),
        ((2, 130, 333, 4, 2, 64), True, (-1, -1), 0.0, False, False, 0.2),
        ((1, 300, 129, 6, 1, 128), False, (40, 7), 20.0, True, True, 0.5),
        ((1, 150, 260, 4, 2, 256), True, (-1, -1), 0.0, False, False, 0.1),
        ((2, 129, 200, 2, 1, 232), False, (50, 20), 30.0, True, True, 0.3),
    ]
    for shape, causal, window, softcap, alibi, sinks, dropout_p in cases:
        q, k, v, slopes, sink = _hopper_inputs(cp, rng, shape, alibi, sinks)
        seed, offset = int(rng.integers(2**63)), int(rng.integers(2**31))
        out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                                     sinks=sink, dropout_p=dropout_p, seed=seed, offset=offset, return_lse=True)
        dout = cp.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(BF16))
        p = _validate.check_backward(dout, q, k, v, out, lse, causal, None, window, softcap, slopes, sink, dropout_p)
        hopper = _cupy_path.BackwardPlan(p, 0, False, dout, q, k, v, out, lse)
        assert hopper.dkdv[0].maps is not None, shape
        mma_cfg = _config.choose_config(p.head_dim, q.dtype, p.mask_kind, fallback_device, p.mods)
        fallback = _cupy_path.BackwardPlan(p, 0, False, dout, q, k, v, out, lse, mma_cfg)
        args = (dout, q, k, v, out, lse, slopes, sink, seed, offset)
        for got, want in zip(hopper.run(*args), fallback.run(*args)):
            got, want = to_numpy(got).astype(np.float32), to_numpy(want).astype(np.float32)
            assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max() + 1e-3, shape


def test_the_hopper_backward_starts_its_scores_at_alibi(cp, rng):
    # bwd_dkdv_wgmma starts S^T at ALiBi's bias in units of the scale where ALiBi comes without the softcap or
    # dropout on 128-row steps (kAlibiInS, head_dim 64): one FMA an element on the tiles below the diagonal, per
    # element elsewhere. Against the mma.sync backward, which adds the bias to finished scores: ordinary slopes
    # and steep ones (1e8: rows of one key), every mask, GQA, the ordered form (deterministic), and the other head
    # dims, which add the bias to finished scores. seqlen_q <= seqlen_k: a row before the diagonal's start
    # carries a steep slope's least bias in its lse, which neither form recovers.
    from cuflash import _validate

    _, fallback_device = _hopper_devices()
    cases = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim), causal, window, deterministic
        ((2, 300, 300, 4, 2, 64), True, (-1, -1), False),
        ((1, 200, 333, 4, 1, 64), False, (-1, -1), True),
        ((1, 130, 260, 2, 2, 64), False, (50, 20), False),
        ((1, 257, 400, 2, 2, 128), False, (60, 10), False),
        ((2, 190, 190, 4, 2, 120), True, (-1, -1), True),
        ((1, 129, 300, 4, 4, 128), False, (-1, -1), False),
        ((1, 150, 260, 2, 1, 256), True, (-1, -1), False),
        ((1, 129, 300, 2, 2, 232), False, (40, 7), True),
    ]
    for shape, causal, window, deterministic in cases:
        q, k, v, _, _ = _hopper_inputs(cp, rng, shape, False, False)
        slopes = cp.asarray(([1e8, 3.0, 0.25, 2.0**-8] * 2)[:shape[3]], cp.float32)
        out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes, return_lse=True)
        dout = cp.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(BF16))
        p = _validate.check_backward(dout, q, k, v, out, lse, causal, None, window, 0.0, slopes)
        hopper = _cupy_path.BackwardPlan(p, 0, deterministic, dout, q, k, v, out, lse)
        assert {launch.maps is not None for launch in hopper.dkdv} == {True}, shape
        mma_cfg = _config.choose_config(p.head_dim, q.dtype, p.mask_kind, fallback_device, p.mods)
        fallback = _cupy_path.BackwardPlan(p, 0, False, dout, q, k, v, out, lse, mma_cfg)
        args = (dout, q, k, v, out, lse, slopes)
        for name, got, want in zip("dq dk dv".split(), hopper.run(*args), fallback.run(*args)):
            got, want = to_numpy(got).astype(np.float32), to_numpy(want).astype(np.float32)
            assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max() + 1e-3, (shape, name)


def test_pytorch_tensors_through_dlpack(cp, rng):
    """A PyTorch user's call: CUDA tensors viewed by cupy.from_dlpack without a copy, one of them a (batch, heads,
    seqlen, head_dim) tensor transposed to cuflash's layout (strided); forward and backward within
    FlashAttention's rule, the tensors not written, the results back through torch.from_dlpack."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    from cuflash import reference

    from ._checks import assert_fa_close, lowp_attention, lowp_attention_backward, max_abs_finite

    batch, seqlen, heads, head_dim = 2, 100, 4, 64
    draws = [torch.from_numpy(rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32))
             for _ in range(4)]
    q_t, v_t, dout_t = (x.to("cuda", torch.bfloat16) for x in (draws[0], draws[2], draws[3]))
    k_t = draws[1].transpose(1, 2).contiguous().to("cuda", torch.bfloat16).transpose(1, 2)   # heads-major memory
    torch.cuda.synchronize()
    q, k, v, dout = (cp.from_dlpack(t) for t in (q_t, k_t, v_t, dout_t))
    assert q.data.ptr == q_t.data_ptr() and k.data.ptr == k_t.data_ptr()   # views, not copies
    assert k.strides == tuple(2 * s for s in k_t.stride()) and not k.flags.c_contiguous
    before = [t.clone() for t in (q_t, k_t, v_t, dout_t)]
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    cp.cuda.get_current_stream().synchronize()
    for old, new in zip(before, (q_t, k_t, v_t, dout_t)):
        assert torch.equal(old, new)
    out_t = torch.from_dlpack(out)
    assert out_t.dtype == torch.bfloat16 and out_t.data_ptr() == out.data.ptr and out_t.shape == q_t.shape
    ref_out, ref_lse = reference.attention(q, k, v, causal=True)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, lowp_attention(q, k, v, True, None, BF16)[0], BF16, 2, "out", max_score)
    refs = reference.attention_backward(dout, q, k, v, causal=True)
    lowps = lowp_attention_backward(dout, q, k, v, out, True, None, BF16)
    for name, grad, ref, lowp, like in zip(("dq", "dk", "dv"), grads, refs, lowps, (q_t, k_t, v_t)):
        assert torch.from_dlpack(grad).shape == like.shape, name
        assert_fa_close(grad, ref, lowp, BF16, 3, name, max_score)
