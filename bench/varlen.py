"""The varlen suite: packed batches of mixed lengths, 16k tokens each, ``cuflash.attention_varlen`` forward and
forward+backward, against cuflash's dense call and PyTorch SDPA's flash and cuDNN backends on the batch padded to
its longest sequence (what a caller without a packed kernel runs), all in one run.

A record's TFLOP/s count the real tokens' work for every implementation (``visible``: each sequence's own score
matrix, causal: its lower triangle), so rates compare as times do. The report adds cuflash's packed rate over
its dense kernels' rate on the padded batch counted on the padded work: what packing costs the kernels.
bfloat16, self-attention (each sequence's queries are its keys), heads x head_dim = 2048; GPU time with L2
flushed, as the grid suite. The padded peers are checked against cuflash's dense call on the same padded
inputs; cuflash's packed call against the float64 reference once, on a small batch, at the start.
"""

from __future__ import annotations

import functools

from .records import Shape

VARLEN_DTYPE = "bfloat16"
VARLEN_TOKENS, VARLEN_MODEL_DIM = 16384, 2048
VARLEN_HEAD_DIMS = (64, 128)
#: the batches, 16384 tokens each: a long tail (powers of two, 4x padding), a spread of mid lengths, lengths drawn
#: log-uniformly from 128-8192 (numpy default_rng(7), the last trimmed to the total: none a multiple of a tile),
#: and equal lengths (no padding: the packed call against the dense one on the same work)
BATCHES = {
    "long-tail": (8192, 4096, 2048, 1024, 512, 256, 128, 128),
    "mixed": (3072, 2560, 2048, 1792, 1536, 1280, 1024, 896, 768, 640, 512, 256),
    "random": (1722, 5342, 3222, 326, 446, 4841, 130, 355),
    "equal": (1024,) * 16,
}
QUICK_BATCHES = ("long-tail",)
VARLEN_PASSES = ("fwd", "fwd+bwd")
#: "cuflash" is the packed call; the others run on the padded batch
VARLEN_IMPLS = ("cuflash", "cuflash-padded", "torch-flash", "torch-cudnn")
#: the float64 reference check: lengths that cover an empty sequence and ragged tails
REFERENCE_LENGTHS, REFERENCE_HEADS = (200, 0, 77, 130), 2


def padded_shape(lengths: tuple[int, ...], head_dim: int) -> Shape:
    """The padded batch's shape (the records' shape): one row per sequence, the longest length."""
    longest = max(lengths)
    heads = VARLEN_MODEL_DIM // head_dim
    return Shape(len(lengths), longest, longest, heads, heads, head_dim)


def visible_entries(lengths: tuple[int, ...], causal: bool) -> float:
    """Score entries per (sequence, head) of the real tokens, averaged over the batch (make_record's
    ``visible``): n^2 per sequence of n, n (n + 1) / 2 causal."""
    return sum(n * (n + 1) / 2 if causal else n * n for n in lengths) / len(lengths)


def varlen_cells(quick: bool, head_dims: tuple[int, ...] = ()) -> list[tuple[str, int, bool, str]]:
    """(batch name, head_dim, causal, pass) of each cell."""
    names = QUICK_BATCHES if quick else tuple(BATCHES)
    dims = VARLEN_HEAD_DIMS[-1:] if quick else VARLEN_HEAD_DIMS
    return [(name, d, causal, pass_) for name in names for d in dims if not head_dims or d in head_dims
            for causal in (False, True) for pass_ in VARLEN_PASSES]


class PackedInputs:
    """A packed batch (total, heads, head_dim) of standard-normal q, k, v, dout, with its prefix sums."""

    def __init__(self, lengths: tuple[int, ...], heads: int, head_dim: int, seed: int = 0):
        import cupy
        import numpy as np

        rng = cupy.random.default_rng(seed)
        total = sum(lengths)
        self.lengths = lengths
        self.q, self.k, self.v, self.dout = (rng.standard_normal((total, heads, head_dim), dtype=cupy.float32)
                                             .astype(VARLEN_DTYPE) for _ in range(4))
        self.cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        self.longest = max(lengths)


def joined(note: str, disturbed: str | None) -> str:
    """A record's note with least_disturbed's, where it has one."""
    return note if disturbed is None else f"{note}; {disturbed}"


def packed_call(pass_: str, x: PackedInputs, causal: bool):
    """cuflash.attention_varlen on ``x`` (its max lengths given: no device read), returning its outputs."""
    import cuflash

    def forward(return_lse=False):
        return cuflash.attention_varlen(x.q, x.k, x.v, x.cu, x.cu, x.longest, x.longest, causal=causal,
                                        return_lse=return_lse)

    if pass_ == "fwd":
        return lambda: (forward(),)

    def forward_backward():
        out, lse = forward(return_lse=True)
        return (out, *cuflash.attention_varlen_backward(x.dout, x.q, x.k, x.v, out, lse, x.cu, x.cu, x.longest,
                                                        x.longest, causal=causal))
    return forward_backward


def check_reference():
    """cuflash's packed call, forward and backward, against the float64 reference on a small batch."""
    import cupy
    import numpy as np

    import cuflash
    from cuflash import reference

    from .accuracy import Mismatch, check_outputs

    for head_dim in VARLEN_HEAD_DIMS:
        for causal in (False, True):
            x = PackedInputs(REFERENCE_LENGTHS, REFERENCE_HEADS, head_dim)
            out, lse = cuflash.attention_varlen(x.q, x.k, x.v, x.cu, x.cu, causal=causal, return_lse=True)
            grads = cuflash.attention_varlen_backward(x.dout, x.q, x.k, x.v, out, lse, x.cu, x.cu, causal=causal)
            want = reference.attention_varlen(x.q, x.k, x.v, x.cu, x.cu, causal=causal)
            want_grads = reference.attention_varlen_backward(x.dout, x.q, x.k, x.v, x.cu, x.cu, causal=causal)
            try:
                check_outputs((out, lse, *grads), tuple(np.asarray(w) for w in (*want, *want_grads)),
                              ("out", "lse", "dq", "dk", "dv"), VARLEN_DTYPE)
            except Mismatch as exc:
                raise SystemExit(f"bench: cuflash's packed call disagrees with cuflash.reference (head_dim "
                                 f"{head_dim}, causal={causal}): {exc}") from None
    cupy.get_default_memory_pool().free_all_blocks()


def run(impl_names: list[str], quick: bool, warmup: int, repeats: int, head_dims: tuple[int, ...] = ()) -> list[dict]:
    """The varlen suite's records: every cell, every implementation of VARLEN_IMPLS this machine runs."""
    from tqdm import tqdm

    from .accuracy import Mismatch, check_outputs
    from .impls import OUTPUT_NAMES, Cuflash, TorchSdpa, _sdpa_backend, classify_error, make_inputs, release_memory
    from .records import make_record
    from .timing import EventTimer, least_disturbed

    names = [n for n in VARLEN_IMPLS if (n in impl_names or n.startswith("cuflash"))
             and (not n.startswith("torch") or _sdpa_backend(n) is not None)]
    padded_impls = {"cuflash-padded": Cuflash(), **{n: TorchSdpa(n) for n in names if n.startswith("torch")}}
    check_reference()
    timer = EventTimer(warmup, repeats)
    records = []
    cells = varlen_cells(quick, head_dims)
    with tqdm(total=len(cells) * len(names), desc="varlen", unit="run") as bar:
        for name, head_dim, causal, pass_ in cells:
            lengths = BATCHES[name]
            shape = padded_shape(lengths, head_dim)
            release_memory()
            packed, padded = PackedInputs(lengths, shape.heads, head_dim), make_inputs(shape, VARLEN_DTYPE)
            expected = Cuflash().make_call(pass_, padded, causal)()
            for impl in names:
                runner = Cuflash() if impl == "cuflash" else padded_impls[impl]
                bar.set_postfix_str(f"{impl} {name} d={head_dim} causal={causal} {pass_}")
                record = functools.partial(make_record, impl, pass_, VARLEN_DTYPE, shape, causal, feature=name,
                                           visible=visible_entries(lengths, causal))
                try:
                    if impl == "cuflash":
                        times, disturbed = least_disturbed(timer, packed_call(pass_, packed, causal))
                        records.append(record(times_ms=times, note=joined("packed: attention_varlen", disturbed)))
                        bar.update()
                        continue
                    with runner.context():
                        fn = runner.make_call(pass_, padded, causal)
                        if impl != "cuflash-padded":
                            try:
                                check_outputs(runner.as_cupy(fn()), expected, OUTPUT_NAMES[pass_], VARLEN_DTYPE)
                            except Mismatch as exc:
                                raise SystemExit(f"bench: {impl} disagrees with cuflash on the padded {name} batch "
                                                 f"(head_dim {head_dim}, causal={causal}, {pass_}): {exc}") from None
                        times, disturbed = least_disturbed(timer, fn)
                        records.append(record(times_ms=times,
                                              note=joined("on the batch padded to its longest sequence", disturbed)))
                except Exception as exc:
                    status = classify_error(runner, exc)
                    if status is None:
                        raise
                    release_memory()
                    records.append(record(status=status, note=str(exc).strip().splitlines()[0][:200]))
                bar.update()
            del packed, padded, expected
    return records
