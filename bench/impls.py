"""The implementations under test, all on the same CuPy input arrays (GPU; lazy imports).

Each implementation turns (pass, inputs, causal, feature) into a zero-argument callable that returns a
tuple: ``(out,)`` for fwd, ``(dq, dk, dv)`` for bwd, ``(out, dq, dk, dv)`` for fwd+bwd. Work the pass does
not include (the forward before a timed backward) is done when the callable is made. ``feature`` (the
features suite's ``bench.features.Feature``, else None) is a mask or score modifier; an implementation
without it raises :class:`Unfit` ("refused").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import subprocess

from . import naive
from .records import Shape
from .report import fmt_bytes

IMPL_NAMES = ("cuflash", "cuflash-deterministic", "cuflash-fp8", "naive-cupy", "torch-flash", "torch-cudnn",
              "torch-efficient", "torch-flex")
#: torch implementation -> member of torch.nn.attention.SDPBackend
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION"}
OUTPUT_NAMES = {"fwd": ("out",), "bwd": ("dq", "dk", "dv"), "fwd+bwd": ("out", "dq", "dk", "dv")}


class Unfit(Exception):
    """An implementation declines a cell before trying it; ``status`` is "refused" or "oom"."""

    def __init__(self, status: str, note: str):
        super().__init__(note)
        self.status, self.note = status, note


@functools.lru_cache(maxsize=None)
def torch_available() -> bool:
    """PyTorch importable and seeing a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def environment() -> dict:
    """Versions for the header record."""
    import cupy

    import cuflash

    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    try:  # the kernel driver's version string is only known to nvidia-smi (or NVML)
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        version = runtime.driverGetVersion()
        driver = f"CUDA driver API {version // 1000}.{version % 1000 // 10}"
    cuda = runtime.runtimeGetVersion()
    torch_version = None
    if torch_available():
        import torch

        torch_version = torch.__version__
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"gpu": name, "compute_capability": f"{props['major']}.{props['minor']}",
            "driver": driver, "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}", "cupy": cupy.__version__,
            "torch": torch_version, "cuflash": cuflash.__version__}


def release_memory():
    """Return cached blocks of both allocators to the driver (before an estimate or after an OOM)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if torch_available():
        import torch

        torch.cuda.empty_cache()


def classify_error(impl, exc: BaseException) -> str | None:
    """"oom" or "refused" for an error meaning ``impl`` cannot run the cell; None for a real failure."""
    import cupy

    if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return "oom"
    if impl.framework == "torch":
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return "oom"
        # SDPA backends refuse unsupported shapes, dtypes and layouts with a RuntimeError
        # ("No available kernel. Aborting execution.", cuDNN's "... is not supported").
        if isinstance(exc, RuntimeError):
            return "refused"
        # FlexAttention's compiled backward with a score_mod that reads a tensor (ALiBi's slopes) fails inside
        # PyTorch in the suite ("all unwrapped values must be FakeTensor, ..."): recorded, the suite goes on
        if impl.name == "torch-flex" and isinstance(exc, AssertionError):
            return "refused"
    return None


@dataclasses.dataclass
class Inputs:
    """q, k, v and the output gradient as CuPy arrays, (batch, seqlen, heads, head_dim)."""

    shape: Shape
    dtype: str
    q: object
    k: object
    v: object
    dout: object

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.shape.head_dim)


def make_inputs(shape: Shape, dtype: str, seed: int = 0) -> Inputs:
    """Standard normal inputs (as FlashAttention's benchmarks use), generated on the device."""
    import cupy

    rng = cupy.random.default_rng(seed)
    q_shape = (shape.batch, shape.seqlen_q, shape.heads, shape.head_dim)
    kv_shape = (shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim)
    q, k, v, dout = (rng.standard_normal(s, dtype=cupy.float32).astype(dtype)
                     for s in (q_shape, kv_shape, kv_shape, q_shape))
    return Inputs(shape, dtype, q, k, v, dout)


class CupyImpl:
    """Shared parts of the CuPy implementations: they run on CuPy's stream and return CuPy arrays."""

    name = ""
    framework = "cupy"
    #: multiplies accuracy.TOLERANCE when this implementation is checked against cuflash
    tolerance_factor = 1.0
    #: the accuracy.TOLERANCE entry that rule takes: None, the cell's dtype
    tolerance_dtype = None

    def context(self):
        return contextlib.nullcontext()

    def check_fits(self, shape: Shape, pass_: str):
        """Raise :class:`Unfit` for a cell not worth trying."""

    def as_cupy(self, result: tuple) -> tuple:
        return result


def _plain(feature) -> bool:
    """Is ``feature`` absent or plain causal attention (no window, modifier, sink or dropout)?"""
    return feature is None or feature == type(feature)(feature.name)


class Cuflash(CupyImpl):
    """cuflash; it allocates only its outputs, lse, delta (and the float32 dQ buffer of the atomic
    backward), so it tries every cell, every feature included. With sinks its backward's dsinks is
    computed and dropped (the passes' outputs are the other implementations')."""

    name = "cuflash"
    deterministic = False

    def make_call(self, pass_: str, x: Inputs, causal: bool, feature=None):
        import cuflash

        options = feature.cuflash_options(x.shape.heads) if feature is not None else {}

        def backward(out, lse):
            return cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, causal=causal,
                                              deterministic=self.deterministic, **options)[:3]

        if pass_ == "fwd":
            return lambda: (cuflash.attention(x.q, x.k, x.v, causal=causal, **options),)
        if pass_ == "bwd":
            out, lse = cuflash.attention(x.q, x.k, x.v, causal=causal, return_lse=True, **options)
            return lambda: backward(out, lse)

        def forward_backward():
            out, lse = cuflash.attention(x.q, x.k, x.v, causal=causal, return_lse=True, **options)
            return (out, *backward(out, lse))

        return forward_backward


class CuflashDeterministic(Cuflash):
    """cuflash's backward with ``deterministic=True`` (bitwise-reproducible dq: no atomics)."""

    name = "cuflash-deterministic"
    deterministic = True


class CuflashFloat8(Cuflash):
    """cuflash's float8 forward: the inputs quantized to e4m3 per (batch, kv head) before the timed calls
    (``cuflash.quantize_qkv``), bfloat16 out. Forward only, at the head dims the float8 kernel takes. Checked
    against cuflash's own result within e4m3's tolerance whatever the cell's dtype (accuracy.TOLERANCE):
    the quantized inputs alone move the output by ~0.1 of its largest value on standard-normal inputs
    (tests/test_fp8.py holds the exact check, against the reference of the quantized values)."""

    name = "cuflash-fp8"
    tolerance_dtype = "float8_e4m3fn"

    def check_fits(self, shape: Shape, pass_: str):
        from cuflash import _config

        if pass_ != "fwd":
            raise Unfit("refused", "float8 is forward only")
        if shape.head_dim not in _config.FLOAT8_HEAD_DIMS:
            raise Unfit("refused", f"the float8 kernel takes head_dim {_config.FLOAT8_HEAD_DIMS}")

    def make_call(self, pass_: str, x: Inputs, causal: bool, feature=None):
        import cuflash

        options = feature.cuflash_options(x.shape.heads) if feature is not None else {}
        if options.get("dropout_p"):
            raise Unfit("refused", "the float8 kernel takes no dropout")
        q8, k8, v8, *descales = cuflash.quantize_qkv(x.q, x.k, x.v, "head")
        factors = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
        return lambda: (cuflash.attention(q8, k8, v8, causal=causal, **factors, **options),)


class NaiveCupy(CupyImpl):
    """``bench.naive`` on CuPy: materialized scores, with a materialized manual backward."""

    name = "naive-cupy"
    # It rounds the scores to the input dtype before the softmax (its matmul's output, as an eager CuPy
    # user gets), an error of up to 2^-8 |s| in every exponent; the fused kernels keep the scores in
    # float32. Against float64 its bfloat16 forward errs about twice as much as theirs, and its difference
    # from cuflash reached 0.023 at seqlen 4k, d=128, when cuflash's rounding changed without its own
    # error changing (bench/NOTES.md, forward v5).
    tolerance_factor = 2.0

    def check_fits(self, shape: Shape, pass_: str):
        import cupy

        release_memory()
        scores = shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k
        need = scores * naive.BYTES_PER_SCORE[pass_]
        free = cupy.cuda.runtime.memGetInfo()[0]
        if need > free:
            raise Unfit("oom", f"needs ~{fmt_bytes(need)} for the score matrices, {fmt_bytes(free)} free")

    def make_call(self, pass_: str, x: Inputs, causal: bool, feature=None):
        if not _plain(feature):
            raise Unfit("refused", f"no {feature.name} in the naive baseline")
        if pass_ == "fwd":
            return lambda: (naive.forward(x.q, x.k, x.v, causal, x.scale)[0],)
        if pass_ == "bwd":
            out, probs = naive.forward(x.q, x.k, x.v, causal, x.scale, keep_probs=True)
            return lambda: naive.backward(x.dout, x.q, x.k, x.v, out, probs, x.scale)

        def forward_backward():
            out, probs = naive.forward(x.q, x.k, x.v, causal, x.scale, keep_probs=True)
            return (out, *naive.backward(x.dout, x.q, x.k, x.v, out, probs, x.scale))

        return forward_backward


class TorchSdpa:
    """``torch.nn.functional.scaled_dot_product_attention`` restricted to one backend, on DLPack views of
    the CuPy inputs (``_autograd_calls``)."""

    framework = "torch"
    tolerance_factor = 1.0
    tolerance_dtype = None

    def __init__(self, name: str):
        self.name = name

    def context(self):
        """Pin the SDPA backend and put PyTorch on CuPy's current stream for a whole cell."""
        from torch.nn.attention import sdpa_kernel

        stack = _on_cupy_stream()
        stack.enter_context(sdpa_kernel(_sdpa_backend(self.name)))
        return stack

    def check_fits(self, shape: Shape, pass_: str):
        """The backend decides on the first call. Square shapes only: SDPA's ``is_causal`` mask is
        top-left aligned, cuflash's bottom-right, and the two agree only when seqlen_q == seqlen_k."""
        if shape.seqlen_q != shape.seqlen_k:
            raise Unfit("refused", "non-square shape: SDPA's causal mask is aligned differently")

    def make_call(self, pass_: str, x: Inputs, causal: bool, feature=None):
        import torch.nn.functional as F

        if not _plain(feature):
            raise Unfit("refused", f"no {feature.name} in scaled_dot_product_attention")

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=x.scale)

        return _autograd_calls(pass_, x, attend)

    def as_cupy(self, result: tuple) -> tuple:
        return _as_cupy(result)


class TorchFlex:
    """PyTorch's FlexAttention (``torch.nn.attention.flex_attention``) under ``torch.compile``: the
    feature's mask as a block mask (causal, or causal within a window) and its modifiers as a score_mod
    (softcap, ALiBi). It has no attention sinks or dropout. Square shapes only, as for SDPA (its causal mask is
    written top-left here, which agrees with cuflash's bottom-right there)."""

    name = "torch-flex"
    framework = "torch"
    tolerance_factor = 1.0
    tolerance_dtype = None

    def context(self):
        return _on_cupy_stream()

    def check_fits(self, shape: Shape, pass_: str):
        if shape.seqlen_q != shape.seqlen_k:
            raise Unfit("refused", "non-square shape: the mask here is written for seqlen_q == seqlen_k")

    def make_call(self, pass_: str, x: Inputs, causal: bool, feature=None):
        import cupy
        import torch
        from torch.nn.attention.flex_attention import create_block_mask

        from .features import alibi_slopes

        if feature is not None and feature.sinks:
            raise Unfit("refused", "FlexAttention has no attention sinks")
        if feature is not None and feature.dropout_p:
            raise Unfit("refused", "FlexAttention has no dropout")
        window = feature.window_left if feature is not None else -1
        softcap = feature.softcap if feature is not None else 0.0
        slopes = (torch.from_dlpack(cupy.asarray(alibi_slopes(x.shape.heads)))
                  if feature is not None and feature.alibi else None)

        def mask_mod(b, h, q_idx, kv_idx):
            visible = q_idx >= kv_idx
            return visible & (q_idx - kv_idx <= window) if window >= 0 else visible

        def score_mod(score, b, h, q_idx, kv_idx):
            if softcap:
                score = softcap * torch.tanh(score / softcap)
            if slopes is not None:
                score = score - slopes[h] * (q_idx - kv_idx).abs()
            return score

        block_mask = (create_block_mask(mask_mod, None, None, x.shape.seqlen_q, x.shape.seqlen_k) if causal
                      else None)
        modified = softcap or slopes is not None

        compiled = _compiled_flex(feature.name if feature is not None else "")

        def attend(q, k, v):
            return compiled(q, k, v, block_mask=block_mask, score_mod=score_mod if modified else None, scale=x.scale)

        # contiguous inputs: on the transposed views the compiled backward fell back to tracing
        # flex_attention's autograd function, which fails (torch 2.x: "all unwrapped values must be FakeTensor")
        return _autograd_calls(pass_, x, attend, contiguous=True)

    def as_cupy(self, result: tuple) -> tuple:
        return _as_cupy(result)


#: torch.compile recompiles flex_attention per (score_mod, block mask, shape): the features suite makes
#: 2 head dims x 4 seqlens x 2 passes of them per feature, past dynamo's default of 8 cached graphs, after
#: which it would fall back to eager FlexAttention (materialized scores).
FLEX_RECOMPILES = 128


@functools.lru_cache(maxsize=None)
def _compiled_flex(feature: str):
    """flex_attention under torch.compile, one compiled function per feature, each shape its own static
    graph (``dynamic=False``): after a function has seen a second shape, dynamo's automatic dynamic shapes
    recompile it with symbolic sizes, and on those the ALiBi and softcap backward (and the softcap forward)
    failed inside PyTorch ("all unwrapped values must be FakeTensor", "unbacked_bindings") and the ALiBi
    forward ran 30% slower, while the same calls on a fresh compiled function ran."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, FLEX_RECOMPILES)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                            FLEX_RECOMPILES)
    return torch.compile(flex_attention, dynamic=False)


def _on_cupy_stream() -> contextlib.ExitStack:
    """A context that puts PyTorch on CuPy's current stream (events recorded by bench.timing bracket it)."""
    import cupy
    import torch

    stack = contextlib.ExitStack()
    stream = cupy.cuda.get_current_stream().ptr
    if torch.cuda.current_stream().cuda_stream != stream:
        stack.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream)))
    return stack


def _autograd_calls(pass_: str, x: Inputs, attend, contiguous: bool = False):
    """The pass's callable for a PyTorch ``attend(q, k, v)`` on (batch, heads, seq, dim) tensors: DLPack
    views of the CuPy inputs, transposed without a copy (``contiguous``: copied once, when the callable is
    made, into contiguous tensors of that layout). Backward through autograd:
    ``torch.autograd.grad`` returns fresh gradients, so nothing accumulates across repeats; the timed
    bwd reuses the forward's graph (``retain_graph``)."""
    import torch

    def heads_first(a):
        t = torch.from_dlpack(a).transpose(1, 2)
        return t.contiguous() if contiguous else t

    q, k, v, dout = (heads_first(a) for a in (x.q, x.k, x.v, x.dout))
    if pass_ == "fwd":
        return lambda: (attend(q, k, v).transpose(1, 2),)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if pass_ == "bwd":
        out = attend(*leaves)
        return lambda: tuple(g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, dout, retain_graph=True))

    def forward_backward():
        out = attend(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
        return tuple(t.detach().transpose(1, 2) for t in (out, *grads))

    return forward_backward


def _as_cupy(result: tuple) -> tuple:
    import cupy

    return tuple(cupy.from_dlpack(t.detach()) for t in result)


def _sdpa_backend(name: str):
    """The SDPBackend member of a torch implementation, or None where this PyTorch lacks it."""
    if not torch_available():
        return None
    try:
        from torch.nn.attention import SDPBackend  # PyTorch >= 2.3
    except ImportError:
        return None
    return getattr(SDPBackend, TORCH_BACKENDS[name], None)


@functools.lru_cache(maxsize=None)
def flex_available() -> bool:
    """PyTorch with CUDA and FlexAttention (PyTorch >= 2.5)."""
    if not torch_available():
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def default_impl_names() -> list[str]:
    """Every implementation this machine can run: the torch ones need PyTorch with CUDA and the backend
    (FlexAttention runs in the features suite only, bench.suites.FEATURES_ONLY)."""
    return (["cuflash", "cuflash-deterministic", "naive-cupy"]
            + [name for name in TORCH_BACKENDS if _sdpa_backend(name) is not None]
            + (["torch-flex"] if flex_available() else []))


def make_impls(names: list[str]) -> list:
    """Implementation objects for ``names``; raises RuntimeError for one this machine cannot run."""
    impls = []
    for name in names:
        if name == "torch-flex":
            if not flex_available():
                raise RuntimeError("torch-flex needs PyTorch >= 2.5 with CUDA (torch.nn.attention.flex_attention)")
            impls.append(TorchFlex())
        elif name in TORCH_BACKENDS:
            if _sdpa_backend(name) is None:
                raise RuntimeError(f"{name} needs PyTorch >= 2.3 with CUDA and SDPBackend.{TORCH_BACKENDS[name]}")
            impls.append(TorchSdpa(name))
        else:
            impls.append({"cuflash": Cuflash, "cuflash-deterministic": CuflashDeterministic,
                          "cuflash-fp8": CuflashFloat8, "naive-cupy": NaiveCupy}[name]())
    return impls
