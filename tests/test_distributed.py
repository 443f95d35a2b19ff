"""Ring attention (cuflash.distributed): the ring's schedule proved pair by pair against the global mask; the
ring run by a local group of ranks (threads), gathered, against the float64 reference on the whole sequence
for world sizes 1-8, both layouts and every feature the forward takes; world size 1 bitwise equal to
attention; sharding helpers; bad arguments refused with the argument named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import cuflash
from cuflash import _ring, distributed, reference

from ._checks import (BF16, DTYPES, assert_fa_close, assert_forward_close, lowp_attention, lowp_attention_backward,
                      make_qkv, max_abs_finite, to_numpy)
from .conftest import GPU, GPU_COUNT, NCCL

# name -> ring_attention's options (alibi: "heads" or "batch_heads" slopes; sinks: one logit per head)
RING_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(9, 4)),
    "causal_window": dict(causal=True, window_size=(13, -1)),
    "window_right_only": dict(window_size=(-1, 3)),
    "softcap": dict(softcap=2.5, causal=True),
    "alibi": dict(alibi="heads"),
    "alibi_per_batch_causal": dict(alibi="batch_heads", causal=True),
    "sinks": dict(sinks=True),
    "everything": dict(causal=True, window_size=(11, -1), softcap=3.0, alibi="heads", sinks=True),
}


def ring_options(xp, rng, batch, heads, spec: dict) -> dict:
    options = {name: value for name, value in spec.items() if name not in ("alibi", "sinks")}
    if spec.get("alibi"):
        shape = (heads,) if spec["alibi"] == "heads" else (batch, heads)
        options["alibi_slopes"] = xp.asarray(rng.uniform(0.05, 0.5, shape).astype(np.float32))
    if spec.get("sinks"):
        options["sinks"] = xp.asarray((2 * rng.standard_normal(heads)).astype(np.float32))
    return options


def visible_pairs(calls, q_positions, k_positions, seqlen: int) -> np.ndarray:
    """(local rows, global keys) counts of the pairs the calls let through (``k_positions``: the global position
    of each local key row); asserts that every call lets some pair through."""
    counts = np.zeros((len(q_positions), seqlen), int)
    for c in calls:
        i = np.arange(c.q_end - c.q_begin)[:, None]
        j = np.arange(c.k_end - c.k_begin)[None, :]
        rel = j - i - c.diagonal
        seen = np.ones(rel.shape, bool)
        if c.window_left >= 0:
            seen &= rel >= -c.window_left
        if c.window_right >= 0:
            seen &= rel <= c.window_right
        assert seen.any(), f"{c} sees nothing"
        rows = np.broadcast_to(np.arange(c.q_begin, c.q_end)[:, None], seen.shape)
        keys = np.broadcast_to(k_positions[c.k_begin:c.k_end][None, :], seen.shape)
        np.add.at(counts, (rows[seen], keys[seen]), 1)
    return counts


def positions(layout, rank, world_size, seqlen_local) -> np.ndarray:
    return np.concatenate([np.arange(c.start, c.start + c.length)
                           for c in _ring.chunks(layout, rank, world_size, seqlen_local)])


@given(layout=st.sampled_from(_ring.LAYOUTS), world_size=st.integers(1, 8), half=st.integers(1, 6),
       left=st.integers(-1, 20), right=st.integers(-1, 20), causal=st.booleans(), alibi=st.booleans())
@example(layout="zigzag", world_size=4, half=3, left=-1, right=-1, causal=True, alibi=False)
@example(layout="zigzag", world_size=3, half=2, left=2, right=0, causal=False, alibi=True)
def test_the_schedule_covers_each_visible_pair_once(layout, world_size, half, left, right, causal, alibi):
    """Over the ring's steps, each rank's calls let through exactly the pairs of the global mask, each once;
    with ALiBi every call's local distance |i + diagonal - j| is the global one."""
    seqlen_local, right = 2 * half, 0 if causal else right
    seqlen = world_size * seqlen_local
    wanted = reference.mask(seqlen, seqlen, window_size=(left, right))
    for rank in range(world_size):
        mine = positions(layout, rank, world_size, seqlen_local)
        counts = np.zeros((seqlen_local, seqlen), int)
        schedule = _ring.ring_schedule(layout, rank, world_size, seqlen_local, left, right, alibi)
        assert [source for source, _ in schedule] == [(rank - s) % world_size for s in range(world_size)]
        for source, calls in schedule:
            theirs = positions(layout, source, world_size, seqlen_local)
            counts += visible_pairs(calls, mine, theirs, seqlen)
            if alibi:
                for c in calls:
                    i = np.arange(c.q_end - c.q_begin)[:, None]
                    j = np.arange(c.k_end - c.k_begin)[None, :]
                    np.testing.assert_array_equal(np.abs(i + c.diagonal - j),
                                                  np.abs(mine[c.q_begin:c.q_end][:, None] - theirs[c.k_begin:c.k_end]))
        np.testing.assert_array_equal(counts, wanted[mine].astype(int), err_msg=f"rank {rank}")


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_balances_the_causal_mask_in_one_call_a_step(world_size):
    """Under a causal mask each zigzag rank sees the same number of pairs, in one call per step."""
    seqlen_local = 6
    work = []
    for rank in range(world_size):
        schedule = _ring.ring_schedule("zigzag", rank, world_size, seqlen_local, -1, 0, False)
        assert all(len(calls) == 1 for _, calls in schedule)
        mine = positions("zigzag", rank, world_size, seqlen_local)
        work.append(int(reference.causal_mask(world_size * seqlen_local, world_size * seqlen_local)[mine].sum()))
    assert len(set(work)) == 1, work


def run_ring(world_size, layout, q, k, v, dout, options, deterministic=False):
    """The ring's forward and backward on ``world_size`` local ranks; (out, lse, grads) gathered."""
    def rank_main(comm):
        def shard(x, axis=1):
            return distributed.shard_sequence(x, comm.rank, world_size, layout, axis)

        qs, ks, vs = shard(q), shard(k), shard(v)
        out, lse = distributed.ring_attention(qs, ks, vs, comm, return_lse=True, layout=layout, **options)
        grads = distributed.ring_attention_backward(shard(dout), qs, ks, vs, out, lse, comm, layout=layout,
                                                    deterministic=deterministic, **options)
        return out, lse, grads

    results = distributed.run_local(world_size, rank_main)
    out = distributed.unshard_sequence([r[0] for r in results], layout)
    lse = distributed.unshard_sequence([r[1] for r in results], layout, axis=2)
    grads = [distributed.unshard_sequence([r[2][i] for r in results], layout) for i in range(3)]
    if options.get("sinks") is not None:
        grads.append(sum(r[2][3] for r in results))   # every rank's share of the sinks' gradient
    return out, lse, grads


def check_ring(xp, rng, world_size, layout, shape, dtype, spec):
    batch, seqlen_local, heads, heads_kv, head_dim = shape
    seqlen = world_size * seqlen_local
    q, k, v = make_qkv(xp, rng, batch, seqlen, seqlen, heads, heads_kv, head_dim, dtype)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(dtype))
    options = ring_options(xp, rng, batch, heads, spec)
    out, lse, grads = run_ring(world_size, layout, q, k, v, dout, options)
    causal = options.pop("causal", False)
    assert out.dtype == q.dtype and type(out) is type(q)
    max_score = assert_forward_close(out, lse, q, k, v, causal, options, dtype)
    refs = reference.attention_backward(dout, q, k, v, causal, **options)
    lowps = lowp_attention_backward(dout, q, k, v, out, causal, None, dtype, **options)
    given_out = reference.attention_backward(dout, q, k, v, causal, **options, out=out)
    assert len(grads) == len(refs)
    for name, grad, ref, lowp, given_ in zip(("dq", "dk", "dv", "dsinks"), grads, refs, lowps, given_out):
        assert grad.dtype == (np.float32 if name == "dsinks" else q.dtype), name
        assert_fa_close(grad, ref, lowp, dtype, 3, name, max_score, float(np.abs(given_ - ref).max()))


@pytest.mark.parametrize("spec", RING_FEATURES.values(), ids=RING_FEATURES.keys())
@pytest.mark.parametrize("layout", distributed.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_ring_is_attention_over_the_whole_sequence(xp, rng, world_size, layout, spec):
    """Gathered, every rank's forward and backward is attention on the whole sequence (GQA, an odd head
    dim) within FlashAttention's rule; the sinks' gradient is the sum of the ranks' shares."""
    check_ring(xp, rng, world_size, layout, (2, 6, 4, 2, 24), np.dtype(np.float32), spec)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
@pytest.mark.parametrize("spec", [RING_FEATURES["causal"], RING_FEATURES["everything"]], ids=["causal", "everything"])
def test_ring_in_half_precision(xp, rng, dtype, spec):
    """float16 and bfloat16 shards: the float32 merges keep the ring within the rule at world size 4."""
    check_ring(xp, rng, 4, "zigzag", (1, 16, 2, 1, 64), dtype, spec)


@given(world_size=st.integers(1, 8), layout=st.sampled_from(distributed.LAYOUTS), half=st.integers(1, 5),
       heads_kv=st.sampled_from([1, 2]), head_dim=st.integers(1, 40), spec=st.sampled_from(list(RING_FEATURES)))
def test_ring_on_drawn_shapes(world_size, layout, half, heads_kv, head_dim, spec):
    """Drawn world sizes, shard lengths, head dims and features on the NumPy path."""
    rng = np.random.default_rng([world_size, half, heads_kv, head_dim])
    check_ring(np, rng, world_size, layout, (1, 2 * half, 2, heads_kv, head_dim), np.dtype(np.float32),
               RING_FEATURES[spec])


@pytest.mark.parametrize("spec", [RING_FEATURES["causal"], RING_FEATURES["everything"]], ids=["causal", "everything"])
@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_world_size_one_is_attention_bitwise(xp, rng, layout, spec):
    """One rank runs exactly attention and attention_backward: the same bits (deterministic: the default
    backward's float32 atomics may order dq's sums differently on two runs)."""
    q, k, v = make_qkv(xp, rng, 2, 12, 12, 4, 2, 32, np.float32)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32))
    options = ring_options(xp, rng, 2, 4, spec)
    out, lse, grads = run_ring(1, layout, q, k, v, dout, options, deterministic=True)
    want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, deterministic=True, **options)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads),
                                   (want_out, want_lse, *want)):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(expected), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_one_call_rank_returns_that_call(rng, monkeypatch, dtype):
    """At world size 1 the schedule is one call over every row: its result and its gradients come back as
    attention and attention_backward give them, with no float32 state merged (the merge would raise here)."""
    def no_merge(*args, **kwargs):
        raise AssertionError("a one-call rank merged")

    monkeypatch.setattr(distributed, "_merge_into", no_merge)
    q, k, v = make_qkv(np, rng, 1, 10, 10, 4, 2, 16, dtype)
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = distributed.run_local(1, lambda comm: distributed.ring_attention(
        q, k, v, comm, causal=True, return_lse=True, sinks=sinks))[0]
    want_out, want_lse = cuflash.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    assert out.dtype == want_out.dtype
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = distributed.run_local(1, lambda comm: distributed.ring_attention_backward(
        dout, q, k, v, out, lse, comm, causal=True, sinks=sinks))[0]
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, causal=True, sinks=sinks)
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_rows_that_see_no_key_get_zero_and_their_sink(rng):
    """A window that lets row i see only keys after i + 2 leaves the last rows with no key: out 0 and lse
    -inf (the sink with sinks), zero gradients there, as attention gives them."""
    q, k, v = make_qkv(np, rng, 1, 16, 16, 2, 2, 8, np.float32)
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    sinks = rng.standard_normal(2).astype(np.float32)
    for options in (dict(window_size=(-1, 3)), dict(window_size=(0, 0), sinks=sinks)):
        out, lse, grads = run_ring(4, "zigzag", q, k, v, dout, options)
        want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
        want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, **options)
        for got, expected in zip(grads, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seqlen, heads", [(0, 2), (8, 0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_empty_shards_give_what_attention_gives(rng, seqlen, heads, with_sinks):
    """Shards with no rows or no heads: each rank returns at once (nothing moves), with the output, lse and
    gradients that attention and attention_backward give for the whole sequence."""
    q, k, v = make_qkv(np, rng, 1, seqlen, seqlen, heads, heads, 16, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    options = dict(causal=True, sinks=rng.standard_normal(heads).astype(np.float32) if with_sinks else None)
    out, lse, grads = run_ring(2, "zigzag", q, k, v, dout, options)
    want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, **options)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads),
                                   (want_out, want_lse, *want)):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_shard_and_unshard_are_inverses(xp, layout, world_size):
    x = xp.arange(2 * 24 * 3).reshape(2, 24, 3)
    shards = [distributed.shard_sequence(x, r, world_size, layout) for r in range(world_size)]
    assert all(s.shape == (2, 24 // world_size, 3) for s in shards)
    np.testing.assert_array_equal(to_numpy(distributed.unshard_sequence(shards, layout)), to_numpy(x))
    if layout == "zigzag" and world_size == 4:   # chunks of 3: rank 1 holds chunks 1 and 6
        np.testing.assert_array_equal(to_numpy(shards[1][0, :, 0]), [9, 12, 15, 54, 57, 60])


def test_bad_arguments_are_refused_by_name(rng):
    q, k, v = make_qkv(np, rng, 1, 8, 8, 2, 2, 16, np.float32)
    comm = distributed.local_communicators(1)[0]
    with pytest.raises(ValueError, match="layout"):
        distributed.ring_attention(q, k, v, comm, layout="striped")
    with pytest.raises(ValueError, match="seqlen"):
        distributed.ring_attention(q, k[:, :6], v[:, :6], comm)
    with pytest.raises(ValueError, match="even"):
        distributed.ring_attention(q[:, :7], k[:, :7], v[:, :7], comm)
    with pytest.raises(TypeError, match="comm must be"):
        distributed.ring_attention(q, k, v, object())
    with pytest.raises(ValueError, match="window_size"):
        distributed.ring_attention(q, k, v, comm, window_size=(-2, 0))
    with pytest.raises(TypeError, match="deterministic"):
        distributed.ring_attention_backward(q, q, k, v, q, np.zeros((1, 2, 8), np.float32), comm, deterministic=1)
    with pytest.raises(ValueError, match="divide"):
        distributed.shard_sequence(q, 0, 3, "zigzag")
    with pytest.raises(ValueError, match="rank"):
        distributed.shard_sequence(q, 2, 2)
    with pytest.raises(TypeError, match="world_size"):
        distributed.shard_sequence(q, 0, 2.0)
    with pytest.raises(ValueError, match=r"shards\[1\]"):
        distributed.unshard_sequence([q, q[:, :4]])
    with pytest.raises(ValueError, match="shards must hold one array per rank, got none"):
        distributed.unshard_sequence([])
    with pytest.raises(ValueError, match="its sequence axis must be even, got 7"):
        distributed.unshard_sequence([q[:, :7], q[:, :7]], "zigzag")
    with pytest.raises(ValueError, match="axis"):
        distributed.shard_sequence(q, 0, 2, axis=4)
    with pytest.raises(TypeError, match="numpy.ndarray or cupy.ndarray"):
        distributed.shard_sequence([[1, 2]], 0, 2)


def test_ranks_that_disagree_on_shapes_fail_without_hanging(rng):
    """A rank whose shard differs is an error in the ranks that receive from it; the others stop too."""
    def rank_main(comm):
        q, k, v = make_qkv(np, rng, 1, 8 if comm.rank else 6, 8 if comm.rank else 6, 2, 2, 16, np.float32)
        return distributed.ring_attention(q, k, v, comm)

    with pytest.raises(ValueError, match="same shapes"):
        distributed.run_local(3, rank_main)


@pytest.mark.parametrize("error", [KeyError, RuntimeError])
def test_a_failing_rank_stops_the_group(error):
    """The failing rank's own exception comes out, not the other ranks' PeerFailed."""
    def rank_main(comm):
        if comm.rank == 1:
            raise error("rank 1 failed")
        q = np.zeros((1, 4, 1, 8), np.float32)
        return distributed.ring_attention(q, q, q, comm)

    with pytest.raises(error, match="rank 1 failed"):
        distributed.run_local(4, rank_main)


def _nccl_rank_main(rank: int, world_size: int, nccl_id, spec: dict, folder: str):
    """One rank of the NCCL test (a process of its own, on GPU ``rank``): the ring's forward and backward
    (twice, deterministic) on its shards of a sequence drawn from a fixed seed, saved to ``folder``."""
    import cupy
    from cupy.cuda import nccl

    cupy.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(world_size, nccl_id, rank)
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(np, rng, *NCCL_SHAPE, BF16)
    dout = rng.standard_normal(q.shape, dtype=np.float32).astype(BF16)
    options = ring_options(np, rng, NCCL_SHAPE[0], NCCL_SHAPE[3], spec)
    shards = [cupy.asarray(distributed.shard_sequence(x, rank, world_size)) for x in (q, k, v, dout)]
    options = {n: cupy.asarray(a) if isinstance(a, np.ndarray) else a for n, a in options.items()}
    out, lse = distributed.ring_attention(*shards[:3], comm, return_lse=True, **options)
    grads = [distributed.ring_attention_backward(shards[3], *shards[:3], out, lse, comm, deterministic=True,
                                                 **options) for _ in range(2)]
    for first, second in zip(*grads):
        assert bool((first == second).all()), "deterministic backward differs between two runs"
    np.savez(f"{folder}/rank{rank}.npz", out=cupy.asnumpy(out), lse=cupy.asnumpy(lse),
             **{f"g{i}": cupy.asnumpy(g) for i, g in enumerate(grads[0])})


#: (batch, seqlen, seqlen, heads, heads_kv, head_dim) of the NCCL test's whole sequence
NCCL_SHAPE = (1, 2048, 2048, 4, 2, 128)


@pytest.mark.parametrize("spec", [RING_FEATURES["causal"], RING_FEATURES["everything"]], ids=["causal", "everything"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ring_on_nccl_across_gpus(tmp_path, world_size, spec):
    """One process per GPU with a NCCL communicator: gathered, the ring is attention on the whole sequence
    within FlashAttention's rule, and its deterministic backward repeats bitwise."""
    if GPU_COUNT < world_size or not NCCL:
        pytest.skip(f"needs {world_size} GPUs and CuPy's NCCL")
    import multiprocessing

    from cupy.cuda import nccl

    context = multiprocessing.get_context("spawn")
    nccl_id = nccl.get_unique_id()
    ranks = [context.Process(target=_nccl_rank_main, args=(r, world_size, nccl_id, spec, str(tmp_path)))
             for r in range(world_size)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=600)
    for p in ranks:   # a rank stuck in NCCL after another failed: stop it, the exit codes say what happened
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in ranks] == [0] * world_size
    saved = [np.load(tmp_path / f"rank{r}.npz") for r in range(world_size)]
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(np, rng, *NCCL_SHAPE, BF16)
    dout = rng.standard_normal(q.shape, dtype=np.float32).astype(BF16)
    options = ring_options(np, rng, NCCL_SHAPE[0], NCCL_SHAPE[3], spec)
    out = distributed.unshard_sequence([s["out"] for s in saved])
    lse = distributed.unshard_sequence([s["lse"] for s in saved], axis=2)
    grads = [distributed.unshard_sequence([s[f"g{i}"] for s in saved]) for i in range(3)]
    if options.get("sinks") is not None:
        grads.append(sum(s["g3"] for s in saved))
    causal = options.pop("causal", False)
    ref_out, ref_lse = reference.attention(q, k, v, causal, **options)
    max_score = max_abs_finite(ref_lse)
    assert_fa_close(out, ref_out, lowp_attention(q, k, v, causal, None, BF16, **options)[0], BF16, 2, "out",
                    max_score)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    refs = reference.attention_backward(dout, q, k, v, causal, **options)
    lowps = lowp_attention_backward(dout, q, k, v, out, causal, None, BF16, **options)
    given_out = reference.attention_backward(dout, q, k, v, causal, **options, out=out)
    for name, grad, ref, lowp, given_ in zip(("dq", "dk", "dv", "dsinks"), grads, refs, lowps, given_out):
        assert_fa_close(grad, ref, lowp, BF16, 3, name, max_score, float(np.abs(given_ - ref).max()))


@pytest.mark.parametrize("spec", [RING_FEATURES["causal"], RING_FEATURES["everything"]], ids=["causal", "everything"])
def test_world_size_one_on_nccl_is_attention_bitwise(rng, spec):
    """A NCCL communicator of one rank: ring_attention and its backward are attention's bits."""
    if not GPU or not NCCL:
        pytest.skip("needs a GPU and CuPy's NCCL")
    import cupy
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    q, k, v = make_qkv(cupy, rng, 2, 256, 256, 4, 2, 128, BF16)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(BF16))
    options = ring_options(cupy, rng, 2, 4, spec)
    out, lse = distributed.ring_attention(q, k, v, comm, return_lse=True, **options)
    grads = distributed.ring_attention_backward(dout, q, k, v, out, lse, comm, deterministic=True, **options)
    want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, deterministic=True, **options)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads),
                                   (want_out, want_lse, *want)):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(expected), err_msg=name)


def test_deterministic_ring_backward_repeats_bitwise(xp, rng):
    """Four ranks, deterministic=True: two runs give the same bits (the ring's sums in a fixed order)."""
    q, k, v = make_qkv(xp, rng, 1, 32, 32, 4, 2, 64, BF16)
    dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(BF16))
    options = ring_options(xp, rng, 1, 4, RING_FEATURES["everything"])
    first, second = (run_ring(4, "zigzag", q, k, v, dout, options, deterministic=True) for _ in range(2))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (first[0], first[1], *first[2]),
                          (second[0], second[1], *second[2])):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_ring_merge_is_merge_states(xp, rng, dtype):
    """The ring's in-place merge of a part into rows of its float32 state (the state and the part each with rows
    that saw no key; the part a strided view) is the float64 merge of the two; then the sinks join every row."""
    batch, rows, heads, head_dim, r0, r1 = 2, 40, 3, 72, 11, 33
    state = rng.standard_normal((batch, rows, heads, head_dim)).astype(np.float32)
    state_lse = (3 * rng.standard_normal((batch, heads, rows))).astype(np.float32)
    state_lse[0, 1, 5:20] = -np.inf
    state[0, 5:20, 1] = 0   # a row no key reached holds 0, as the ring starts it
    wide = rng.standard_normal((batch, r1 - r0, heads + 2, head_dim)).astype(dtype)
    part = wide[:, :, 1:heads + 1]   # a view: the head axis strided past its extent
    part_lse = (3 * rng.standard_normal((batch, heads, r1 - r0))).astype(np.float32)
    part_lse[1, 2, :4] = -np.inf
    part_lse[0, 1, 8 - r0:12 - r0] = -np.inf   # rows where neither saw a key
    acc, acc_lse = xp.array(state), xp.array(state_lse)   # copies: the merge writes them
    distributed._merge_into(xp, acc, acc_lse, slice(r0, r1), xp.asarray(part), xp.asarray(part_lse))
    want, want_lse = reference.merge_states([state[:, r0:r1], part.astype(np.float64)],
                                            [state_lse[:, :, r0:r1], part_lse])
    np.testing.assert_allclose(to_numpy(acc)[:, r0:r1], want, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(to_numpy(acc_lse)[:, :, r0:r1], want_lse, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(to_numpy(acc)[:, :r0], state[:, :r0])   # other rows untouched
    np.testing.assert_array_equal(to_numpy(acc_lse)[:, :, r1:], state_lse[:, :, r1:])
    merged, merged_lse = to_numpy(acc).copy(), to_numpy(acc_lse).copy()
    sinks = rng.standard_normal(heads).astype(np.float32)
    distributed._merge_into(xp, acc, acc_lse, slice(None), None, None, xp.asarray(sinks))
    sink_lse = np.broadcast_to(sinks[None, :, None], merged_lse.shape)
    want, want_lse = reference.merge_states([merged, np.zeros_like(merged)], [merged_lse, sink_lse])
    np.testing.assert_allclose(to_numpy(acc), want, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(to_numpy(acc_lse), want_lse, rtol=2e-6, atol=2e-6)


def test_ranks_that_disagree_on_options_are_told_so(rng):
    """A local group checks what NCCL cannot: a rank whose call differs from its neighbour's (here causal on one
    rank only) fails with both calls named, and the others stop."""
    q, k, v = make_qkv(np, rng, 1, 16, 16, 2, 2, 16, np.float32)

    def rank_main(comm):
        shard = [distributed.shard_sequence(x, comm.rank, 2) for x in (q, k, v)]
        return distributed.ring_attention(*shard, comm, causal=comm.rank == 1)

    with pytest.raises(ValueError, match="same calls with the same shapes and options"):
        distributed.run_local(2, rank_main)


def test_a_rank_without_its_peers_times_out():
    """One rank of a group of two, run alone, does not hang: TimeoutError after the group's timeout."""
    comm = distributed.local_communicators(2, timeout_s=0.2)[0]
    q = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(TimeoutError, match="rank 0 waited for rank 1"):
        distributed.ring_attention(q, q, q, comm)
    with pytest.raises(ValueError, match="timeout_s"):
        distributed.local_communicators(2, timeout_s=0)
