"""The decode suite: one decoding step against a bfloat16 KV cache, ``cuflash.attention_with_kvcache`` on a
contiguous and on a paged cache, and on the cache quantized to float8 e4m3 (``cuflash-fp8``: q and the caches
by ``cuflash.quantize_qkv`` per (batch, kv head), half the bytes), against PyTorch SDPA's flash and cuDNN
backends (``enable_gqa``) on the same cache, and a device-to-device copy of the cache (the bandwidth ceiling),
all in one run.

Every sequence fills its cache (SDPA has no per-sequence lengths) and attention is non-causal (SDPA's causal
mask is aligned top-left; one query sees every key either way). Time is GPU time: each call is enqueued
behind a spin kernel, so the events bracket the kernels and not the host's launch work (the overhead suite
measures that); L2 is flushed before each call, as a real step finds the cache in device memory.
"""

from __future__ import annotations

import functools

from .records import Shape

DECODE_HEAD_DIM, DECODE_DTYPE = 128, "bfloat16"
#: (query heads, kv heads): GQA 4:1 (Llama 3 8B-like), MHA, and GQA 8:1
DECODE_HEADS = ((32, 8), (8, 8), (64, 8))
DECODE_SEQLENS_Q = (1, 4)
DECODE_BATCHES = (1, 8, 64)
DECODE_CACHES = (1024, 4096, 16384, 65536, 131072)
#: the largest cache (keys per sequence) at batch 64: its cache, a paged copy and the copy's destination
#: take 3 x 17 GiB at 64k
BATCH_64_MAX_CACHE = 65536
#: heads other than the first of DECODE_HEADS run on these caches only
OTHER_HEADS_CACHES = (4096, 65536)
QUICK_DECODE = ((1, 4096), (8, 8192))  # (batch, cache) of --quick, 32/8 heads, seqlen_q 1
PAGE_SIZE = 256
DECODE_IMPLS = ("cuflash", "cuflash-paged", "cuflash-fp8", "torch-flash", "torch-cudnn", "copy")
#: cycles of the spin kernel each timed call waits behind (0.2 ms at the H200's 1.98 GHz): longer than
#: any implementation's host work per call, so the call is queued before the GPU reaches it
SPIN_CYCLES = 400_000
#: The host cost per call, recorded with feature "host": batch 1, one query, this many keys (a step whose
#: kernels take about as long as their launch), CALLS back-to-back calls per measurement
HOST_SHAPE = Shape(1, 1, 1024, 32, 8, DECODE_HEAD_DIM)
HOST_CALLS, HOST_MEASUREMENTS = 200, 15


def decode_shapes(quick: bool) -> list[Shape]:
    if quick:
        return [Shape(batch, 1, cache, 32, 8, DECODE_HEAD_DIM) for batch, cache in QUICK_DECODE]
    shapes = []
    for index, (heads, heads_kv) in enumerate(DECODE_HEADS):
        for seqlen_q in DECODE_SEQLENS_Q:
            for batch in DECODE_BATCHES:
                for cache in DECODE_CACHES if index == 0 else OTHER_HEADS_CACHES:
                    if batch < 64 or cache <= BATCH_64_MAX_CACHE:
                        shapes.append(Shape(batch, seqlen_q, cache, heads, heads_kv, DECODE_HEAD_DIM))
    return shapes


def cache_bytes(shape: Shape, itemsize: int = 2) -> int:
    """Bytes of the k and v caches a step reads."""
    return 2 * shape.batch * shape.seqlen_k * shape.heads_kv * shape.head_dim * itemsize


def cache_itemsize(impl: str) -> int:
    """Bytes per cache element of an implementation's cache: 1 for the float8 one, else bfloat16's 2."""
    return 1 if impl == "cuflash-fp8" else 2


@functools.lru_cache(maxsize=1)
def _spin_kernel():
    import cupy

    return cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        const long long start = clock64();
        while (clock64() - start < cycles) {}
    }''', "spin")


def gpu_ms(fn, warmup: int, repeats: int, flush) -> list[float]:
    """GPU milliseconds of each timed call of ``fn``: L2 flushed, then a spin kernel, then the call between
    two events (its host work done while the GPU spins)."""
    import cupy
    import numpy as np

    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(repeats):
        flush()
        _spin_kernel()((1,), (1,), (np.int64(SPIN_CYCLES),))
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return times


class DecodeInputs:
    """q, the contiguous caches, their paged copy (PAGE_SIZE keys per page, pages shuffled) and the lengths."""

    def __init__(self, shape: Shape, seed: int = 0):
        import cupy
        import numpy as np

        rng = cupy.random.default_rng(seed)
        self.shape = shape
        kv_shape = (shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim)
        self.q = rng.standard_normal((shape.batch, shape.seqlen_q, shape.heads, shape.head_dim),
                                     dtype=cupy.float32).astype(DECODE_DTYPE)
        self.k_cache, self.v_cache = (rng.standard_normal(kv_shape, dtype=cupy.float32).astype(DECODE_DTYPE)
                                      for _ in range(2))
        pages = shape.batch * shape.seqlen_k // PAGE_SIZE
        order = np.random.default_rng(seed).permutation(pages).astype(np.int32)
        self.block_table = cupy.asarray(order.reshape(shape.batch, -1))
        self.k_pages, self.v_pages = (cupy.empty((pages, PAGE_SIZE, shape.heads_kv, shape.head_dim), DECODE_DTYPE)
                                      for _ in range(2))
        for pool, cache in ((self.k_pages, self.k_cache), (self.v_pages, self.v_cache)):
            pool[self.block_table.reshape(-1)] = cache.reshape(pages, PAGE_SIZE, shape.heads_kv, shape.head_dim)
        self.lengths = cupy.full((shape.batch,), shape.seqlen_k, cupy.int32)

    @functools.cached_property
    def float8(self):
        """((q8, k8_cache, v8_cache, descales), bf16): q and the caches quantized per (batch, kv head) by
        cuflash.quantize_qkv (uint8 e4m3 bit patterns on CuPy), and the bfloat16 (q, k_cache, v_cache) of the
        first sequence's values (times their factors, rounded to bfloat16), on which cuflash's bfloat16 decoding
        is what the float8 one's first sequence is checked against (one sequence: the largest caches leave no
        room for the whole batch's). Quantized once, on first use, for the timed call and its check alike."""
        import cupy
        import numpy as np

        import cuflash

        q8, k8, v8, *descales = cuflash.quantize_qkv(self.q, self.k_cache, self.v_cache, "head")
        values = cupy.asarray(np.arange(256, dtype=np.uint8).view(cuflash.FLOAT8_E4M3).astype(np.float32))
        group = self.shape.heads // self.shape.heads_kv

        def dequantized(x8, descale, group):
            factors = cupy.repeat(descale[:1], group, axis=1)[:, None, :, None]   # (1, 1, heads, 1)
            return (values[x8[:1]] * factors).astype(DECODE_DTYPE)

        bf16 = (dequantized(q8, descales[0], group), dequantized(k8, descales[1], 1), dequantized(v8, descales[2], 1))
        return (q8, k8, v8, tuple(descales)), bf16


def make_call(impl: str, x: DecodeInputs):
    """The zero-argument call of ``impl`` on ``x``, returning (out,) ((copy of k, copy of v) for the copy)."""
    import cupy

    import cuflash

    if impl == "cuflash":
        return lambda: (cuflash.attention_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.lengths),)
    if impl == "cuflash-paged":
        return lambda: (cuflash.attention_with_kvcache(x.q, x.k_pages, x.v_pages, cache_seqlens=x.lengths,
                                                       block_table=x.block_table),)
    if impl == "cuflash-fp8":
        (q8, k8, v8, (q_descale, k_descale, v_descale)), _ = x.float8
        return lambda: (cuflash.attention_with_kvcache(q8, k8, v8, cache_seqlens=x.lengths, q_descale=q_descale,
                                                       k_descale=k_descale, v_descale=v_descale),)
    if impl == "copy":
        k_dst, v_dst = cupy.empty_like(x.k_cache), cupy.empty_like(x.v_cache)

        def copy():
            cupy.copyto(k_dst, x.k_cache)
            cupy.copyto(v_dst, x.v_cache)
            return k_dst, v_dst
        return copy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from .impls import _sdpa_backend

    q, k, v = (torch.from_dlpack(a).transpose(1, 2) for a in (x.q, x.k_cache, x.v_cache))
    backend = _sdpa_backend(impl)

    def sdpa():
        with sdpa_kernel(backend):
            return (F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2),)
    return sdpa


def check_reference():
    """cuflash's decoding against the float64 reference on a small cache, contiguous and paged."""
    import cupy
    import numpy as np

    import cuflash
    from cuflash import reference

    from .accuracy import Mismatch, check_outputs

    x = DecodeInputs(Shape(2, 1, 2 * PAGE_SIZE, 8, 2, DECODE_HEAD_DIM))
    want = reference.attention_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.lengths)
    for impl in ("cuflash", "cuflash-paged"):
        out, = make_call(impl, x)()
        lse = cuflash.attention_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.lengths, return_lse=True)[1]
        try:
            check_outputs((out, lse), tuple(np.asarray(w) for w in want), ("out", "lse"), DECODE_DTYPE)
        except Mismatch as exc:
            raise SystemExit(f"bench: {impl}'s decoding disagrees with cuflash.reference: {exc}") from None
    cupy.get_default_memory_pool().free_all_blocks()


def run(impl_names: list[str], quick: bool, warmup: int, repeats: int) -> list[dict]:
    """The decode suite's records: every shape, every implementation of DECODE_IMPLS this machine runs (GPU
    ms); then the host ms per call of the attention implementations at HOST_SHAPE (feature "host")."""
    import cupy
    from tqdm import tqdm

    import cuflash

    from .accuracy import Mismatch, check_outputs
    from .impls import _sdpa_backend, classify_error, release_memory
    from .records import make_record
    from .timing import L2_FLUSH_BYTES

    names = [n for n in DECODE_IMPLS if (n in impl_names or n in ("cuflash-paged", "cuflash-fp8", "copy"))
             and (not n.startswith("torch") or _sdpa_backend(n) is not None)]
    check_reference()
    flush_buffer = cupy.empty(L2_FLUSH_BYTES, cupy.uint8)
    records = []
    shapes = decode_shapes(quick)
    with tqdm(total=len(shapes) * len(names), desc="decode", unit="run") as bar:
        for shape in shapes:
            release_memory()
            x = DecodeInputs(shape)
            expected = make_call("cuflash", x)()
            for impl in names:
                bar.set_postfix_str(f"{impl} b={shape.batch} sq={shape.seqlen_q} cache={shape.seqlen_k} "
                                    f"h={shape.heads}/{shape.heads_kv}")
                record = functools.partial(make_record, impl, "fwd", DECODE_DTYPE, shape, False, with_tflops=False)
                try:
                    fn = make_call(impl, x)
                    if impl != "copy":
                        got, want = fn(), expected
                        if impl == "cuflash-fp8":   # its first sequence against bfloat16 decoding of its values
                            _, values = x.float8
                            got = (got[0][:1],)
                            want = (cuflash.attention_with_kvcache(*values, cache_seqlens=x.lengths[:1]),)
                        try:
                            check_outputs(tuple(cupy.from_dlpack(t) if not isinstance(t, cupy.ndarray) else t
                                                for t in got), want, ("out",), DECODE_DTYPE)
                        except Mismatch as exc:
                            raise SystemExit(f"bench: {impl} disagrees with cuflash on decode {shape}: {exc}") from None
                    times = gpu_ms(fn, warmup, repeats, lambda: flush_buffer.fill(0))
                    note = ("device-to-device copy of both caches" if impl == "copy" else
                            f"pages of {PAGE_SIZE} keys" if impl == "cuflash-paged" else
                            "float8 e4m3 caches, factors per (batch, kv head)" if impl == "cuflash-fp8" else None)
                    records.append(record(times_ms=times, note=note))
                except Exception as exc:
                    status = classify_error(_Named(impl), exc)
                    if status is None:
                        raise
                    release_memory()
                    records.append(record(status=status, note=str(exc).strip().splitlines()[0][:200]))
                bar.update()
            del x, expected
    from .timing import host_ms_per_call

    x = DecodeInputs(HOST_SHAPE)
    for impl in names:
        if impl != "copy":
            times = host_ms_per_call(make_call(impl, x), HOST_CALLS, HOST_MEASUREMENTS)
            records.append(make_record(impl, "fwd", DECODE_DTYPE, HOST_SHAPE, False, times_ms=times, with_tflops=False,
                                       feature="host", note=f"host wall ms per call, mean of {HOST_CALLS} calls"))
    return records


class _Named:
    """What classify_error reads of an implementation: its name and framework."""

    def __init__(self, name: str):
        self.name = name
        self.framework = "torch" if name.startswith("torch") else "cupy"
