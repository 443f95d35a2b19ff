"""The sweeps: which cells each suite runs (pure) and how it measures them (GPU, lazy imports).

A cell is one (shape, dtype, causal, pass). Every implementation runs every cell of its suite on the
same input arrays; before it is measured its result is checked against cuflash's on those inputs,
and cuflash itself is checked against the float64 ``cuflash.reference`` once per (dtype, head_dim,
causal) at the start. A disagreement stops the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from .decode import DECODE_DTYPE, decode_shapes
from .varlen import BATCHES as BATCHES_OF_VARLEN
from .varlen import VARLEN_DTYPE, padded_shape, varlen_cells
from .features import BY_NAME, FEATURES
from .records import COMPILE_PASSES, Shape, make_record
from .scaling import SCALING_DTYPE, SCALING_GPUS, scaling_cells, shape_of

SUITES = ("grid", "memory", "overhead", "compile", "features", "decode", "varlen", "scaling")
#: the suites that check cuflash against the reference themselves, or leave it to the tests (their cells are
#: not the dense call's)
SELF_CHECKED = ("compile", "decode", "varlen", "scaling")
#: the suites that run only when named (a run without suites runs the others): scaling takes every GPU of
#: the host for many minutes
ON_REQUEST = ("scaling",)

# grid: FlashAttention's benchmark grid, a fixed token count and model width for every seqlen/head_dim
TOKENS = 16384  # batch * seqlen
MODEL_DIM = 2048  # heads * head_dim
GRID_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
GRID_HEAD_DIMS = (64, 128, 256)
QUICK_GRID_SEQLENS = (1024, 4096)
QUICK_GRID_HEAD_DIMS = (128,)
DTYPES = ("bfloat16", "float16")
MASKS = (False, True)
PASSES = ("fwd", "bwd", "fwd+bwd")

# memory: one long sequence; batch 1 so the longest shapes isolate the seqlen^2 term of a naive kernel
MEMORY_HEADS, MEMORY_HEAD_DIM = 16, 128
MEMORY_SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_MEMORY_SEQLENS = (1024, 8192)
MEMORY_PASSES = ("fwd", "fwd+bwd")

# overhead: shapes so small that the device work is negligible next to the host's
OVERHEAD_HEADS, OVERHEAD_HEAD_DIM = 8, 64
OVERHEAD_SEQLENS = (1, 16, 64, 128)
QUICK_OVERHEAD_SEQLENS = (1, 128)
OVERHEAD_PASSES = ("fwd", "bwd")

# compile: the first forward of a new specialization, at an unremarkable shape
COMPILE_SEQLEN, COMPILE_HEADS = 1024, 16
COMPILE_HEAD_DIMS = GRID_HEAD_DIMS
QUICK_COMPILE_HEAD_DIMS = (128,)
#: The grid times these implementations' forward only: the materialized baseline runs at 5-10 TFLOP/s,
#: and its backward passes over the whole grid would take longer than the 8 minutes the suite may use
#: (the memory suite measures it); float8 has no backward.
GRID_FORWARD_ONLY = ("naive-cupy", "cuflash-fp8")
#: ... and these implementations' backward passes only: their forward is cuflash's own.
GRID_BACKWARD_ONLY = ("cuflash-deterministic",)
# features: masks and score modifiers (bench.features), causal, bfloat16, on FlashAttention's grid
FEATURE_SEQLENS = (2048, 4096, 8192, 16384)
QUICK_FEATURE_SEQLENS = (8192,)
FEATURE_HEAD_DIMS = (64, 128)
QUICK_FEATURE_HEAD_DIMS = (128,)
FEATURE_PASSES = ("fwd", "fwd+bwd")
#: The implementations the features suite runs (FlexAttention takes every feature but sinks and dropout;
#: SDPA flash plain causal only), and the ones that run in it alone (FlexAttention compiles per shape and mask).
FEATURE_IMPLS = ("cuflash", "torch-flex", "torch-flash")
FEATURES_ONLY = ("torch-flex",)
#: Only these implementations compile kernels at run time (CuPy JIT); PyTorch ships prebuilt kernels.
JIT_IMPLS = ("cuflash", "naive-cupy")

#: The float64 reference check: a ragged length (not a multiple of any tile) to cover the tails.
REFERENCE_SEQLEN, REFERENCE_HEADS = 200, 2
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Characters kept of an error message in a record's note, and of a failed probe's stderr.
NOTE_CHARS, PROBE_STDERR_CHARS = 200, 4000


@dataclasses.dataclass(frozen=True)
class Cell:
    shape: Shape
    dtype: str
    causal: bool
    pass_: str
    feature: str = ""  # the features suite's mask or modifier (bench.features.BY_NAME); varlen's batch; scaling's GPUs

    def describe(self) -> str:
        s = self.shape
        return (f"{self.pass_} {self.dtype} b={s.batch} s={s.seqlen_q} h={s.heads} d={s.head_dim}"
                f"{' causal' if self.causal else ''}{' ' + self.feature if self.feature else ''}")

    @property
    def visible(self) -> float | None:
        """Visible score entries per (batch, head) where the suite counts FLOPs on those (features)."""
        return BY_NAME[self.feature].visible_entries(self.shape.seqlen_q) if self.feature else None


@dataclasses.dataclass(frozen=True)
class Settings:
    """How hard to measure: event timing (warmup, repeats) and host timing (calls, measurements)."""

    warmup: int
    repeats: int
    calls: int
    measurements: int


FULL = Settings(warmup=3, repeats=10, calls=500, measurements=15)
QUICK = Settings(warmup=1, repeats=5, calls=50, measurements=3)


def suite_cells(suite: str, quick: bool = False, head_dims: tuple[int, ...] = ()) -> list[Cell]:
    """The cells of ``suite``, ordered so that cells sharing input arrays are adjacent; where ``head_dims``
    is given, only those of these head dims."""
    cells = _all_suite_cells(suite, quick)
    return [cell for cell in cells if cell.shape.head_dim in head_dims] if head_dims else cells


def _all_suite_cells(suite: str, quick: bool) -> list[Cell]:
    bf16 = DTYPES[0]
    if suite == "grid":
        seqlens = QUICK_GRID_SEQLENS if quick else GRID_SEQLENS
        head_dims = QUICK_GRID_HEAD_DIMS if quick else GRID_HEAD_DIMS
        dtypes = (bf16,) if quick else DTYPES
        return [Cell(Shape.square(TOKENS // s, s, MODEL_DIM // d, d), dtype, causal, pass_)
                for dtype in dtypes for d in head_dims for s in seqlens for causal in MASKS for pass_ in PASSES]
    if suite == "memory":
        seqlens = QUICK_MEMORY_SEQLENS if quick else MEMORY_SEQLENS
        return [Cell(Shape.square(1, s, MEMORY_HEADS, MEMORY_HEAD_DIM), bf16, False, pass_)
                for s in seqlens for pass_ in MEMORY_PASSES]
    if suite == "overhead":
        seqlens = QUICK_OVERHEAD_SEQLENS if quick else OVERHEAD_SEQLENS
        # no backward at seqlen 1: with one key the softmax is constant, dq and dk are exactly zero, and the
        # agreement check, relative to the largest value, has nothing to measure against
        return [Cell(Shape.square(1, s, OVERHEAD_HEADS, OVERHEAD_HEAD_DIM), bf16, False, pass_)
                for s in seqlens for pass_ in OVERHEAD_PASSES if pass_ == "fwd" or s > 1]
    if suite == "features":
        seqlens = QUICK_FEATURE_SEQLENS if quick else FEATURE_SEQLENS
        head_dims = QUICK_FEATURE_HEAD_DIMS if quick else FEATURE_HEAD_DIMS
        return [Cell(Shape.square(TOKENS // s, s, MODEL_DIM // d, d), bf16, True, pass_, feature.name)
                for d in head_dims for s in seqlens for feature in FEATURES for pass_ in FEATURE_PASSES]
    if suite == "compile":
        head_dims = QUICK_COMPILE_HEAD_DIMS if quick else COMPILE_HEAD_DIMS
        dtypes = (bf16,) if quick else DTYPES
        return [Cell(Shape.square(1, COMPILE_SEQLEN, COMPILE_HEADS, d), dtype, False, "fwd")
                for dtype in dtypes for d in head_dims]
    if suite == "decode":  # bench.decode: one step against a KV cache of seqlen_k keys per sequence
        return [Cell(shape, DECODE_DTYPE, False, "fwd") for shape in decode_shapes(quick)]
    if suite == "varlen":  # bench.varlen: packed batches of mixed lengths; the shape is the padded batch's
        return [Cell(padded_shape(BATCHES_OF_VARLEN[name], d), VARLEN_DTYPE, causal, pass_, name)
                for name, d, causal, pass_ in varlen_cells(quick)]
    if suite == "scaling":  # bench.scaling: ring attention over 1-8 GPUs (those the host has)
        return [Cell(shape_of(tokens), SCALING_DTYPE, causal, pass_, f"{gpus} GPUs")
                for gpus, tokens, causal, pass_ in scaling_cells(quick, max(SCALING_GPUS))]
    raise ValueError(f"unknown suite {suite!r}; choose from {SUITES}")


def check_reference(cells: list[Cell]):
    """cuflash against the float64 reference, forward (out, lse) and backward, per (dtype, head_dim, causal)."""
    import cuflash
    from cuflash import reference

    from .accuracy import Mismatch, check_outputs
    from .impls import make_inputs

    for dtype, head_dim, causal, feature in sorted({(c.dtype, c.shape.head_dim, c.causal, c.feature) for c in cells}):
        x = make_inputs(Shape.square(1, REFERENCE_SEQLEN, REFERENCE_HEADS, head_dim), dtype)
        options = BY_NAME[feature].cuflash_options(REFERENCE_HEADS) if feature else {}
        want_options = BY_NAME[feature].reference_options(REFERENCE_HEADS, 1, REFERENCE_SEQLEN) if feature else {}
        out, lse = cuflash.attention(x.q, x.k, x.v, causal=causal, return_lse=True, **options)
        grads = cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, causal=causal, **options)
        want_out, want_lse = reference.attention(x.q, x.k, x.v, causal, **want_options)
        want_grads = reference.attention_backward(x.dout, x.q, x.k, x.v, causal, **want_options)
        names = ("out", "lse", "dq", "dk", "dv", "dsinks")[:2 + len(grads)]
        try:
            check_outputs((out, lse, *grads), (want_out, want_lse, *want_grads), names, dtype)
        except Mismatch as exc:
            raise SystemExit(f"bench: cuflash disagrees with cuflash.reference ({dtype}, head_dim {head_dim}, "
                             f"causal={causal}{', ' + feature if feature else ''}, seqlen {REFERENCE_SEQLEN}): "
                             f"{exc}") from None


def _measure_timed(impl, fn, record, settings: Settings, timer):
    from .timing import least_disturbed

    times, note = least_disturbed(timer, fn)
    return record(times_ms=times, note=note)


def _measure_memory(impl, fn, record, settings: Settings, timer):
    from .timing import cupy_peak_bytes, torch_peak_bytes

    result, peak = (torch_peak_bytes if impl.framework == "torch" else cupy_peak_bytes)(fn)
    outputs = sum(a.nbytes for a in impl.as_cupy(result))
    return record(peak_bytes=peak - outputs, note="peak allocated during the call minus the returned tensors")


def _measure_overhead(impl, fn, record, settings: Settings, timer):
    from .timing import host_ms_per_call

    times = host_ms_per_call(fn, settings.calls, settings.measurements)
    return record(times_ms=times, with_tflops=False, note=f"host wall ms per call, mean of {settings.calls} calls")


MEASURES = {"grid": _measure_timed, "memory": _measure_memory, "overhead": _measure_overhead,
            "features": _measure_timed}


def _run_one(impl, cell: Cell, inputs, expected: tuple, measure, settings: Settings, timer) -> dict:
    """Check one implementation on one cell, then measure it; a record either way."""
    from .accuracy import Mismatch, check_outputs
    from .impls import OUTPUT_NAMES, Unfit, classify_error, release_memory

    record = functools.partial(make_record, impl.name, cell.pass_, cell.dtype, cell.shape, cell.causal,
                               feature=cell.feature, visible=cell.visible)
    try:
        with impl.context():
            impl.check_fits(cell.shape, cell.pass_)
            fn = impl.make_call(cell.pass_, inputs, cell.causal, BY_NAME.get(cell.feature))
            if impl.name != "cuflash":  # ``expected`` is cuflash's own result on these inputs
                try:
                    check_outputs(impl.as_cupy(fn()), expected, OUTPUT_NAMES[cell.pass_],
                                  impl.tolerance_dtype or cell.dtype, impl.tolerance_factor)
                except Mismatch as exc:
                    raise SystemExit(f"bench: {impl.name} disagrees with cuflash on {cell.describe()}: {exc}") from None
            return measure(impl, fn, record, settings, timer)
    except Unfit as exc:
        return record(status=exc.status, note=exc.note)
    except Exception as exc:
        status = classify_error(impl, exc)
        if status is None:
            raise
        release_memory()
        message = str(exc).strip()
        return record(status=status, note=message.splitlines()[0][:NOTE_CHARS] if message else type(exc).__name__)


def run_suite(suite: str, impl_names: list[str], quick: bool = False, repeats: int | None = None,
              head_dims: tuple[int, ...] = ()) -> list[dict]:
    """Run one suite on the GPU (only its cells of ``head_dims`` where given); returns its records (without
    the header)."""
    from tqdm import tqdm

    cells = suite_cells(suite, quick, head_dims)
    settings = QUICK if quick else FULL
    if repeats is not None:
        settings = dataclasses.replace(settings, repeats=repeats)
    if suite == "compile":
        return _run_compile(cells, [name for name in impl_names if name in JIT_IMPLS])
    if suite == "decode":
        from . import decode

        return decode.run(impl_names, quick, settings.warmup, settings.repeats)
    if suite == "varlen":
        from . import varlen

        return varlen.run(impl_names, quick, settings.warmup, settings.repeats, head_dims)
    if suite == "scaling":
        from . import scaling

        return scaling.run(quick, settings.warmup, settings.repeats)

    from .impls import Cuflash, make_impls, make_inputs, release_memory
    from .timing import EventTimer

    names = ([name for name in impl_names if name in FEATURE_IMPLS] if suite == "features" else
             [name for name in impl_names if name not in FEATURES_ONLY])
    oracle, impls = Cuflash(), make_impls(names)
    timer = EventTimer(settings.warmup, settings.repeats) if suite in ("grid", "features") else None
    records, inputs = [], None
    with tqdm(total=len(cells) * len(impls), desc=suite, unit="run") as bar:
        for cell in cells:
            if inputs is None or (inputs.shape, inputs.dtype) != (cell.shape, cell.dtype):
                inputs = None  # drop the previous arrays before allocating the next ones
                release_memory()
                inputs = make_inputs(cell.shape, cell.dtype)
            expected = oracle.make_call(cell.pass_, inputs, cell.causal, BY_NAME.get(cell.feature))()
            for impl in impls:
                bar.set_postfix_str(f"{impl.name} {cell.describe()}")
                if suite == "grid" and impl.name in GRID_FORWARD_ONLY and cell.pass_ != "fwd":
                    records.append(make_record(impl.name, cell.pass_, cell.dtype, cell.shape, cell.causal,
                                               status="skipped", note="grid times this baseline's forward only"))
                elif suite == "grid" and impl.name in GRID_BACKWARD_ONLY and cell.pass_ == "fwd":
                    records.append(make_record(impl.name, cell.pass_, cell.dtype, cell.shape, cell.causal,
                                               status="skipped", note="the forward is cuflash's own"))
                else:
                    records.append(_run_one(impl, cell, inputs, expected, MEASURES[suite], settings, timer))
                bar.update()
    return records


def _probe(impl: str, cell: Cell, cache_dir: str) -> float:
    """Milliseconds of the first call in a fresh process whose CuPy kernel cache is ``cache_dir``."""
    env = {key: value for key, value in os.environ.items() if key != "CUPY_CACHE_IN_MEMORY"}
    env["CUPY_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    spec = {"impl": impl, "shape": dataclasses.asdict(cell.shape), "dtype": cell.dtype, "causal": cell.causal}
    done = subprocess.run([sys.executable, "-m", "bench.probe", json.dumps(spec)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compile probe failed for {impl} {cell.describe()}:\n{done.stderr[-PROBE_STDERR_CHARS:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def _run_compile(cells: list[Cell], impl_names: list[str]) -> list[dict]:
    """Per cell and JIT implementation: a cold run on an empty cache, then a warm one on what it left."""
    from tqdm import tqdm

    records = []
    with tqdm(total=len(cells) * len(impl_names), desc="compile", unit="run") as bar:
        for cell in cells:
            for impl in impl_names:
                bar.set_postfix_str(f"{impl} {cell.describe()}")
                with tempfile.TemporaryDirectory(prefix="cuflash-bench-cache-") as cache_dir:
                    for pass_ in COMPILE_PASSES:
                        ms = _probe(impl, cell, cache_dir)
                        records.append(make_record(impl, pass_, cell.dtype, cell.shape, cell.causal, times_ms=[ms],
                                                   with_tflops=False, note="first forward call in a new process"))
                bar.update()
    return records
