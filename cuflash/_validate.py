"""Input checks shared by the NumPy and CuPy paths.

Every failure is a TypeError or ValueError that names the argument, what was expected and what came.
Nothing here writes to the caller's arrays.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from ._config import (FLOAT8_E4M3, FLOAT8_OUTPUT_DTYPES, MASK_CAUSAL, MASK_NONE, MASK_WINDOW, MAX_HEAD_DIM,
                      MOD_ALIBI, MOD_DROPOUT, MOD_SINKS, MOD_SOFTCAP, SUPPORTED_DTYPES)
from ._philox import MAX_OFFSET, MAX_SEED

BOTTOM_RIGHT, TOP_LEFT = "bottom_right", "top_left"
#: where the diagonal of the causal mask, the window and ALiBi lies: query i's diagonal key is
#: i + seqlen_k - seqlen_q (bottom_right, FlashAttention's) or i (top_left, PyTorch's is_causal)
ALIGNMENTS = (BOTTOM_RIGHT, TOP_LEFT)
_DTYPE_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)
#: the dtypes attention reads as float8 e4m3: ml_dtypes' float8_e4m3fn (NumPy), and uint8 holding its bit patterns
#: (CuPy has no float8 dtype)
FLOAT8_CARRIERS = (FLOAT8_E4M3, np.dtype(np.uint8))
LOG2E = math.log2(math.e)
#: The largest base-2 score (scale * log2(e) * q . k) the kernels take exactly enough: they subtract a row's
#: maximum from its scores in one FMA against the maximum's rounded product, exact to half an ulp of it,
#: and up to 2**13 that is 2**-11 in the exponent, within float16's rounding of P. Past 2**24 it is a
#: whole unit and rows turn to garbage or NaN.
MAX_BASE2_SCORE = 2.0**13
#: ndarray subclasses whose values mean something the kernels would ignore
_REFUSED_SUBCLASSES = {np.ma.MaskedArray: "its mask would be ignored; pass x.filled(value) or x.data"}


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def optional_arrays(**arrays) -> dict:
    """``arrays`` without the ones that are None (optional arguments, for array_module and check_same_device)."""
    return {name: a for name, a in arrays.items() if a is not None}


def array_module(**arrays):
    """numpy or cupy, whichever all of ``arrays`` belong to; TypeError for anything else or a mix."""
    cupy = _cupy()
    kinds = {}
    for name, a in arrays.items():
        if isinstance(a, np.ndarray):
            for cls, why in _REFUSED_SUBCLASSES.items():
                if isinstance(a, cls):
                    raise TypeError(f"{name} must be a plain numpy.ndarray, got {cls.__module__}.{cls.__name__}: {why}")
            kinds[name] = "numpy"
        elif cupy is not None and isinstance(a, cupy.ndarray):
            kinds[name] = "cupy"
        else:
            raise TypeError(
                f"{name} must be a numpy.ndarray or cupy.ndarray, got {type(a).__module__}.{type(a).__name__}"
                " (arrays of other GPU libraries convert without a copy: cupy.from_dlpack(x))")
    if len(set(kinds.values())) > 1:
        listing = ", ".join(f"{n} is {k}" for n, k in kinds.items())
        raise TypeError(f"the arrays of one call must all be NumPy or all be CuPy arrays; {listing}")
    return cupy if "cupy" in kinds.values() else np


@dataclasses.dataclass(frozen=True)
class Problem:
    """The validated shape of one attention call."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype
    causal: bool
    softmax_scale: float
    #: window sides in keys, -1 unbounded; causal sets the right one to 0 (query i sees key j when
    #: i + diagonal - left <= j <= i + diagonal + right)
    window_left: int = -1
    window_right: int = -1
    #: the key on query i's diagonal is i + diagonal: seqlen_k - seqlen_q (bottom-right) or 0 (top-left)
    diagonal: int = 0
    softcap: float = 0.0
    #: None, or the shape of alibi_slopes: (heads,) or (batch, heads)
    alibi_shape: tuple | None = None
    sinks: bool = False
    dropout_p: float = 0.0
    #: a float8 call's output dtype (FLOAT8_OUTPUT_DTYPES); None: the output has the inputs' dtype
    out_dtype: np.dtype | None = None
    #: a float8 call's descale factors' shapes (q, k, v): (1,), () or (batch, heads_kv), None where not given
    descale_shapes: tuple = ()

    @property
    def output_dtype(self) -> np.dtype:
        return self.dtype if self.out_dtype is None else self.out_dtype

    @property
    def masked(self) -> bool:
        """Does some (row, key) pair within the sequences fall outside the window?"""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def kernel_window(self) -> tuple[int, int]:
        """(left, right) as the kernels' Window takes them: an unbounded side as seqlen_q + seqlen_k + |diagonal|,
        which no |key - row - diagonal| reaches."""
        unbounded = self.seqlen_q + self.seqlen_k + abs(self.diagonal)
        return tuple(unbounded if side < 0 else min(side, unbounded) for side in (self.window_left, self.window_right))

    @property
    def mask_kind(self) -> int:
        """The kernels' mask specialization: none, causal (a right side only) or window (a left side)."""
        if not self.masked:
            return MASK_NONE
        return MASK_CAUSAL if self.window_left < 0 else MASK_WINDOW

    @property
    def mods(self) -> int:
        """The kernels' score-modifier bits (_config.MOD_*)."""
        return ((MOD_SOFTCAP if self.softcap else 0) | (MOD_ALIBI if self.alibi_shape is not None else 0)
                | (MOD_SINKS if self.sinks else 0) | (MOD_DROPOUT if self.dropout_p else 0))

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.heads_kv if self.heads_kv else 1

    @property
    def is_empty(self) -> bool:
        return 0 in (self.batch, self.seqlen_q, self.heads)


def _check_4d(name: str, a, layout: str):
    if a.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}, got {a.ndim} (shape {tuple(a.shape)})")


def _check_dtype(name: str, a, float8: tuple = ()):
    """``float8``: the float8 e4m3 dtypes the call takes too (the forwards attention and attention_with_kvcache:
    FLOAT8_CARRIERS)."""
    dtype = np.dtype(a.dtype)
    if dtype in SUPPORTED_DTYPES or dtype in float8:
        return
    if dtype in FLOAT8_CARRIERS:
        raise TypeError(f"{name} is {a.dtype} (float8 e4m3), which only the forwards attention() and "
                        f"attention_with_kvcache() take (as float8_e4m3fn or uint8 bit patterns); this call takes "
                        f"{_DTYPE_NAMES}")
    extra = "".join(f", {d.name}" + (" (e4m3 bit patterns)" if d == np.uint8 else "") for d in float8)
    raise TypeError(f"{name} must have dtype {_DTYPE_NAMES}{extra}, got {a.dtype}")


def check_float8(q, descales, out_dtype, batch: int, heads_kv: int) -> tuple:
    """(the output dtype or None, the descales' shapes) of a forward that may take float8_e4m3fn (``descales``:
    its (q_descale, k_descale, v_descale)): float8 inputs take descales None (1) or float32 of shape (1,), ()
    or (batch, heads_kv) on q's device, and give out_dtype None (bfloat16) or one of FLOAT8_OUTPUT_DTYPES;
    other inputs take neither."""
    names = ("q_descale", "k_descale", "v_descale")
    if np.dtype(q.dtype) not in FLOAT8_CARRIERS:
        for name, descale in zip(names, descales):
            if descale is not None:
                raise ValueError(f"{name} applies to float8_e4m3fn inputs only; q, k and v are {q.dtype}")
        if out_dtype is not None and _as_dtype("out_dtype", out_dtype) != q.dtype:
            raise ValueError(f"out_dtype is for float8_e4m3fn inputs, whose output is bfloat16 or float16; "
                             f"with {q.dtype} inputs the output is {q.dtype}, got out_dtype {out_dtype!r}")
        return None, ()
    output = FLOAT8_OUTPUT_DTYPES[0] if out_dtype is None else _as_dtype("out_dtype", out_dtype)
    if output not in FLOAT8_OUTPUT_DTYPES:
        raise TypeError(f"out_dtype of float8_e4m3fn inputs must be one of "
                        f"{', '.join(d.name for d in FLOAT8_OUTPUT_DTYPES)}, got {output}")
    shapes = []
    for name, descale in zip(names, descales):
        if descale is None:
            shapes.append(None)
            continue
        shapes.append(check_float32_vector(name, descale, ((1,), (), (batch, heads_kv)),
                                           "(1,) or () (per tensor) or (batch, heads_kv)"))
        check_same_device(q=q, **{name: descale})
    return output, tuple(shapes)


def _as_dtype(name: str, value) -> np.dtype:
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must name a dtype, got {value!r}") from None


def check_heads(heads: int, heads_kv: int, head_dim: int, kv_head_dim: int, kv_name: str, empty_ok: bool = False):
    """The head layout every call shares: q's head_dim that of ``kv_name`` (k and v, or the cache) and within
    1..MAX_HEAD_DIM, q's heads a multiple of a positive heads_kv (GQA); ``empty_ok``: or no heads at all."""
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim must match: q {head_dim}, {kv_name} {kv_head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if empty_ok and heads == heads_kv == 0:
        return
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"heads of q ({heads}) must be a multiple of heads_kv of {kv_name} ({heads_kv}), which "
                         "must be positive")


def check_forward(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  sinks=None, dropout_p=0.0, alignment=BOTTOM_RIGHT, descales=None, out_dtype=None) -> Problem:
    """Validate the forward's inputs and options and resolve the defaults (seed and offset, which change per
    call, are checked by check_dropout). ``descales``: (q_descale, k_descale, v_descale) of a call that takes
    float8_e4m3fn inputs (attention's; check_float8), None for a call that does not."""
    for name, a, layout in (("q", q, "(batch, seqlen_q, heads, head_dim)"),
                            ("k", k, "(batch, seqlen_k, heads_kv, head_dim)"),
                            ("v", v, "(batch, seqlen_k, heads_kv, head_dim)")):
        _check_4d(name, a, layout)
        _check_dtype(name, a, float8=() if descales is None else FLOAT8_CARRIERS)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch size must match: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if v.shape[1] != seqlen_k:
        raise ValueError(f"k and v must have the same seqlen_k: k {seqlen_k}, v {v.shape[1]}")
    if v.shape[2] != heads_kv:
        raise ValueError(f"k and v must have the same number of heads: k {heads_kv}, v {v.shape[2]}")
    if k.shape[3] != v.shape[3]:
        raise ValueError(f"head_dim must match: q {head_dim}, k {k.shape[3]}, v {v.shape[3]}")
    check_heads(heads, heads_kv, head_dim, k.shape[3], "k and v", empty_ok=True)  # no heads: an empty problem
    check_flag("causal", causal)
    check_same_device(q=q, k=k, v=v)
    left, right = check_window(window_size, causal)
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    alibi_shape = check_head_vectors(q, alibi_slopes, sinks, batch, heads)
    dropout_p, _, _ = check_dropout(dropout_p, 0, 0)
    output, descale_shapes = (None, ()) if descales is None else check_float8(q, descales, out_dtype, batch, heads_kv)
    dtype = FLOAT8_E4M3 if np.dtype(q.dtype) in FLOAT8_CARRIERS else np.dtype(q.dtype)
    return Problem(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, bool(causal),
                   resolve_scale(softmax_scale, head_dim), left, right,
                   seqlen_k - seqlen_q if alignment == BOTTOM_RIGHT else 0, check_softcap(softcap), alibi_shape,
                   sinks is not None, dropout_p, output, descale_shapes)


def check_head_vectors(q, alibi_slopes, sinks, batch: int, heads: int) -> tuple | None:
    """Check the per-head float32 vectors (ALiBi slopes (heads,) or (batch, heads), sinks (heads,)), on q's
    device; returns the slopes' shape, None without them."""
    alibi_shape = None
    if alibi_slopes is not None:
        alibi_shape = check_float32_vector("alibi_slopes", alibi_slopes, ((heads,), (batch, heads)),
                                           "(heads,) or (batch, heads)")
        check_same_device(q=q, alibi_slopes=alibi_slopes)
    if sinks is not None:
        check_float32_vector("sinks", sinks, ((heads,),), "(heads,)")
        check_same_device(q=q, sinks=sinks)
    return alibi_shape


def check_backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, sinks=None, dropout_p=0.0, alignment=BOTTOM_RIGHT) -> Problem:
    """Validate the backward's inputs (the forward's, plus dout, out and lse)."""
    problem = check_forward(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p,
                            alignment)
    for name, a in (("dout", dout), ("out", out)):
        _check_4d(name, a, "(batch, seqlen_q, heads, head_dim)")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {a.dtype}")
        if a.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(a.shape)}")
    expected = (problem.batch, problem.heads, problem.seqlen_q)
    if lse.ndim != 3 or tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {expected}, got {tuple(lse.shape)}")
    if lse.dtype != np.float32:
        raise TypeError(f"lse must be float32 (as returned by attention(..., return_lse=True)), got {lse.dtype}")
    check_same_device(q=q, dout=dout, out=out, lse=lse)
    return problem


def _is_number(value, kind) -> bool:
    """Is ``value`` a ``kind`` (numbers.Integral, numbers.Real) and not a bool (Python's or NumPy's)?"""
    return isinstance(value, kind) and not isinstance(value, (bool, np.bool_))


def check_window(window_size, causal) -> tuple[int, int]:
    """(left, right) of ``window_size``, each -1 (unbounded) or a count of keys; causal makes right 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
    for side, value in (("left", left), ("right", right)):
        if not _is_number(value, numbers.Integral):
            raise TypeError(f"window_size's {side} side must be an int, got {type(value).__name__}")
        if value < -1:
            raise ValueError(f"window_size's {side} side must be -1 (unbounded) or at least 0, got {value}")
    return int(left), 0 if causal else int(right)


def check_softcap(softcap) -> float:
    """``softcap`` as a float: 0 (off) or positive and finite."""
    if not _is_number(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not (value == 0 or (math.isfinite(value) and value > 0)):
        raise ValueError(f"softcap must be 0 (off) or positive and finite, got {softcap}")
    return value


def check_float32_vector(name: str, a, shapes, layout: str) -> tuple:
    """The shape of ``a``, a float32 array of one of ``shapes``; TypeError or ValueError otherwise."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a float32 array {layout}, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if tuple(a.shape) not in shapes:
        raise ValueError(f"{name} must have shape {layout} = {' or '.join(map(str, shapes))}, got {tuple(a.shape)}")
    return tuple(a.shape)


def _check_int(name: str, value, limit: int) -> int:
    if not _is_number(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < limit:
        raise ValueError(f"{name} must be in [0, 2**{limit.bit_length() - 1}), got {value}")
    return int(value)


def check_dropout(dropout_p, seed, offset) -> tuple[float, int, int]:
    """(dropout_p, seed, offset): dropout_p a float in [0, 1), seed in [0, 2**64), offset in [0, 2**32);
    seed must be given (not None) where dropout_p > 0."""
    if not _is_number(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if p == 0:
        return p, 0, 0
    if seed is None:
        raise ValueError("seed must be given with dropout_p > 0 (an int; the same seed and offset in the backward "
                         "reproduce the forward's mask)")
    return p, _check_int("seed", seed, MAX_SEED), _check_int("offset", offset, MAX_OFFSET)


def check_flag(name: str, value):
    """TypeError unless ``value`` is a bool (Python's or NumPy's)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def max_softmax_scale(head_dim: int) -> float:
    """The largest softmax_scale accepted at ``head_dim``: 2**13 / (log2(e) * head_dim), 44 at head_dim 128
    (whose default is 0.088).

    Up to it, inputs whose elements lie within [-1, 1] give base-2 scores within MAX_BASE2_SCORE, which the
    kernels take to float16 precision; a scale past it turns such rows to NaN (1e37 did). Inputs of
    larger magnitude reach that limit at a smaller scale: keep |scale * q . k| well under 5000.
    """
    return MAX_BASE2_SCORE / (LOG2E * head_dim)


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` or its default ``1/sqrt(head_dim)``; ValueError unless positive, finite and at most
    ``max_softmax_scale(head_dim)``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_number(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    if scale > max_softmax_scale(head_dim):
        raise ValueError(f"softmax_scale must be at most {max_softmax_scale(head_dim):.4g} at head_dim {head_dim} "
                         f"(2**13 / (log2(e) * head_dim): past it the kernels' float32 scores lose the precision "
                         f"of the softmax), got {softmax_scale}")
    return scale


def check_same_device(**arrays):
    """ValueError when CuPy arrays live on different devices (NumPy arrays pass)."""
    devices = {name: a.device.id for name, a in arrays.items() if hasattr(a, "device") and hasattr(a.device, "id")}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on device {d}" for n, d in devices.items())
        raise ValueError(f"all arrays must be on one device; {listing}")


#: the largest num_splits accepted (the plan's own choice stays within _config.MAX_KV_SPLITS too)
MAX_NUM_SPLITS = 128
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class CacheProblem:
    """The validated shape of one attention_with_kvcache call.

    ``attn`` is the attention of one step: its seqlen_k is the keys a sequence can hold (the cache's length,
    or pages per sequence x page_size), its diagonal unused (each sequence's own length sets it)."""

    attn: Problem
    page_size: int  # keys per page of a paged cache; 0 where the cache is contiguous
    num_pages: int  # pages of a paged cache (its first axis); 0 where contiguous
    seqlen_new: int  # keys appended by the call (k, v); 0 without
    #: how the sequences' lengths come: "array" (cache_seqlens an int32 array), "int" (one int for every
    #: sequence, read per call), "full" (None: every sequence fills the cache)
    lengths: str
    rotary_dim: int = 0  # channels the rotary embedding turns (2 * rotary_cos.shape[1]); 0 without it
    rotary_positions: int = 0  # rows of rotary_cos and rotary_sin: the positions they cover
    leftpad: bool = False  # cache_leftpad given: each sequence's keys start at its own cache row


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window_size,
                  softcap, alibi_slopes, sinks, num_splits, rotary_cos=None, rotary_sin=None,
                  rotary_interleaved=True, descales=(None, None, None), out_dtype=None,
                  cache_leftpad=None) -> CacheProblem:
    """Validate attention_with_kvcache's arguments, all but an int ``cache_seqlens``'s value (which changes per
    call: ``check_cache_length``) and what only device memory holds (the values of a cache_seqlens array and
    of block_table). ``descales``: (q_descale, k_descale, v_descale) of float8_e4m3fn inputs (check_float8;
    k_descale and v_descale apply to the cache and the new keys and values alike)."""
    _check_4d("q", q, "(batch, seqlen_q, heads, head_dim)")
    paged = block_table is not None
    layout = "(num_blocks, page_size, heads_kv, head_dim)" if paged else "(batch, seqlen_cache, heads_kv, head_dim)"
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if name != "q":
            _check_4d(name, a, layout)
        _check_dtype(name, a, float8=FLOAT8_CARRIERS)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got q {q.dtype}, k_cache {k_cache.dtype}, "
                        f"v_cache {v_cache.dtype}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, seqlen_q, heads, head_dim = q.shape
    cache_rows, cache_len, heads_kv, cache_dim = k_cache.shape
    check_heads(heads, heads_kv, head_dim, cache_dim, "the cache")
    check_flag("causal", causal)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache)
    page_size = num_pages = 0
    if paged:
        from ._config import PAGE_SIZE_MULTIPLE

        check_block_table_type(block_table)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have batch = {batch} rows, got {block_table.shape[0]}")
        page_size, num_pages = cache_len, cache_rows
        if page_size == 0 or page_size % PAGE_SIZE_MULTIPLE:
            raise ValueError(f"the paged cache's page_size (k_cache.shape[1]) must be a positive multiple of "
                             f"{PAGE_SIZE_MULTIPLE}, got {page_size}")
        capacity = block_table.shape[1] * page_size
        check_same_device(q=q, block_table=block_table)
    else:
        if cache_rows != batch:
            raise ValueError(f"k_cache must hold batch = {batch} sequences (without block_table), got {cache_rows}")
        capacity = cache_len
    if capacity > _INT32_MAX:
        raise ValueError(f"the cache holds {capacity} keys per sequence, past int32")
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the keys and values to append), or neither")
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("k and v need cache_seqlens: they are written into the cache from position "
                             "cache_seqlens[b]")
        for name, a in (("k", k), ("v", v)):
            _check_4d(name, a, "(batch, seqlen_new, heads_kv, head_dim)")
            if a.dtype != q.dtype:
                raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {a.dtype}")
        if tuple(k.shape) != tuple(v.shape) or k.shape[0] != batch or tuple(k.shape[2:]) != (heads_kv, head_dim):
            raise ValueError(f"k and v must have shape (batch, seqlen_new, heads_kv, head_dim) = ({batch}, "
                             f"seqlen_new, {heads_kv}, {head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
        check_same_device(q=q, k=k, v=v)
    if cache_seqlens is None:
        lengths = "full"
    elif _is_number(cache_seqlens, numbers.Integral):
        lengths = "int"
    elif hasattr(cache_seqlens, "dtype"):
        if cache_seqlens.dtype != np.int32 or tuple(cache_seqlens.shape) != (batch,):
            raise TypeError(f"cache_seqlens must be an int or an int32 array (batch,) = ({batch},), got "
                            f"{cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}")
        check_same_device(q=q, cache_seqlens=cache_seqlens)
        lengths = "array"
    else:
        raise TypeError(f"cache_seqlens must be an int, an int32 array (batch,) or None, got "
                        f"{type(cache_seqlens).__name__}")
    if not _is_number(num_splits, numbers.Integral) or not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_NUM_SPLITS}] (0: the plan chooses), got "
                         f"{num_splits!r}")
    left, right = check_window(window_size, causal)
    alibi_shape = check_head_vectors(q, alibi_slopes, sinks, batch, heads)
    output, descale_shapes = check_float8(q, descales, out_dtype, batch, heads_kv)
    if output is not None and rotary_cos is not None:
        raise TypeError("rotary embeddings take float16, bfloat16 or float32 q and k; float8_e4m3fn ones would be "
                        "rounded to e4m3 again after the rotation: rotate before quantizing")
    dtype = FLOAT8_E4M3 if output is not None else np.dtype(q.dtype)
    attn = Problem(batch, seqlen_q, capacity, heads, heads_kv, head_dim, dtype, bool(causal),
                   resolve_scale(softmax_scale, head_dim), left, right, 0, check_softcap(softcap), alibi_shape,
                   sinks is not None, out_dtype=output, descale_shapes=descale_shapes)
    rotary_dim, rotary_positions = _check_rotary(q, rotary_cos, rotary_sin, rotary_interleaved, cache_seqlens)
    if cache_leftpad is not None:
        if not hasattr(cache_leftpad, "dtype") or cache_leftpad.dtype != np.int32 or \
                tuple(cache_leftpad.shape) != (batch,):
            raise TypeError(f"cache_leftpad must be an int32 array (batch,) = ({batch},), got "
                            f"{getattr(cache_leftpad, 'dtype', type(cache_leftpad).__name__)} of shape "
                            f"{tuple(getattr(cache_leftpad, 'shape', ()))}")
        if paged:
            raise ValueError("cache_leftpad takes a contiguous cache; a paged one starts each sequence where its "
                             "block_table says")
        check_same_device(q=q, cache_leftpad=cache_leftpad)
    return CacheProblem(attn, page_size, num_pages, seqlen_new, lengths, rotary_dim, rotary_positions,
                        cache_leftpad is not None)


def _check_rotary(q, rotary_cos, rotary_sin, interleaved, cache_seqlens) -> tuple[int, int]:
    """(rotary_dim, the positions covered) of rotary_cos and rotary_sin, (0, 0) without them."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    if rotary_cos is None:
        return 0, 0
    if cache_seqlens is None:
        raise ValueError("rotary_cos and rotary_sin need cache_seqlens: they rotate at positions "
                         "cache_seqlens[b] + i")
    check_flag("rotary_interleaved", interleaved)
    for name, a in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not hasattr(a, "dtype") or a.dtype not in (q.dtype, np.float32):
            raise TypeError(f"{name} must be an array of q's dtype ({q.dtype}) or float32, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
        if a.ndim != 2:
            raise ValueError(f"{name} must have 2 dimensions (seqlen_ro, rotary_dim / 2), got shape "
                             f"{tuple(a.shape)}")
    if tuple(rotary_cos.shape) != tuple(rotary_sin.shape):
        raise ValueError(f"rotary_cos and rotary_sin must have one shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= q.shape[3]:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] must be in [2, head_dim = {q.shape[3]}], "
                         f"got {rotary_dim}")
    check_same_device(q=q, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    return rotary_dim, rotary_cos.shape[0]


def _rotary_reach(p: CacheProblem) -> int:
    """Positions past cache_seqlens[b] that the rotary tables must cover: the appended keys', and the queries'
    where they advance (causal or windowed; else they all sit at cache_seqlens[b])."""
    return max(p.seqlen_new, p.attn.seqlen_q if p.attn.masked else 1)


def check_cache_length(cache_seqlens: int, p: CacheProblem) -> int:
    """An int ``cache_seqlens``: the keys of every sequence before the call, room left for the appended ones
    (and positions in rotary_cos for the rotated queries and keys)."""
    room = p.attn.seqlen_k - p.seqlen_new
    if not 0 <= cache_seqlens <= room:
        raise ValueError(f"cache_seqlens must be in [0, {room}] (the cache holds {p.attn.seqlen_k} keys per sequence"
                         f"{f', {p.seqlen_new} of them appended by k and v' if p.seqlen_new else ''}), "
                         f"got {cache_seqlens}")
    if p.rotary_dim:
        needed = cache_seqlens + _rotary_reach(p)
        if needed > p.rotary_positions:
            raise ValueError(f"rotary_cos and rotary_sin cover positions [0, {p.rotary_positions}); the call rotates "
                             f"up to position {needed - 1} (cache_seqlens {cache_seqlens})")
    return int(cache_seqlens)


def check_block_table_type(block_table):
    """``block_table`` is an int32 array (batch, max_blocks_per_sequence) (its values are checked where they are
    read: check_block_table_entries)."""
    if not hasattr(block_table, "dtype") or block_table.dtype != np.int32 or block_table.ndim != 2:
        raise TypeError(f"block_table must be an int32 array (batch, max_blocks_per_sequence), got "
                        f"{getattr(block_table, 'dtype', type(block_table).__name__)} of shape "
                        f"{tuple(getattr(block_table, 'shape', ()))}")


def check_block_table_entries(table: np.ndarray, keys: np.ndarray, page_size: int, num_pages: int):
    """Every entry of the host block table ``table`` that a sequence of ``keys[b]`` keys uses (its first
    ceil(keys[b] / page_size) pages) within [0, num_pages); entries past a sequence's last page are not read, so
    not checked."""
    used = np.arange(table.shape[1])[None, :] < (-(-keys // page_size))[:, None]
    bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, i = bad[0]
        raise ValueError(f"block_table[{b}, {i}] = {table[b, i]} is outside [0, {num_pages}) (num_blocks of the "
                         "paged cache)")


def check_cache_indices(p: CacheProblem, cache_seqlens, block_table, cache_leftpad=None):
    """The checks that read device memory (``attention_with_kvcache(..., check_indices=True)``; on CuPy a
    synchronizing copy of cache_seqlens, block_table and cache_leftpad to the host): every length within the
    cache's room and the rotary tables, every block_table entry a sequence uses within ``num_pages`` (entries
    past a sequence's last page are not read, so not checked), every cache_leftpad within [0, its length]."""
    from ._kvcache import lengths_of, to_host

    lengths = lengths_of(cache_seqlens, p.attn.batch, p.attn.seqlen_k - p.seqlen_new)
    room = p.attn.seqlen_k - p.seqlen_new
    bad = np.flatnonzero((lengths < 0) | (lengths > room))
    if bad.size:
        raise ValueError(f"cache_seqlens[{bad[0]}] = {lengths[bad[0]]} is outside [0, {room}] (the cache holds "
                         f"{p.attn.seqlen_k} keys per sequence, {p.seqlen_new} of them appended by k and v)")
    if cache_leftpad is not None:
        lead = to_host(cache_leftpad).astype(np.int64)
        bad = np.flatnonzero((lead < 0) | (lead > lengths))
        if bad.size:
            raise ValueError(f"cache_leftpad[{bad[0]}] = {lead[bad[0]]} is outside [0, {lengths[bad[0]]}] (the "
                             f"sequence's keys before the call)")
    if p.rotary_dim:
        needed = lengths + _rotary_reach(p)
        bad = np.flatnonzero(needed > p.rotary_positions)
        if bad.size:
            raise ValueError(f"rotary_cos and rotary_sin cover positions [0, {p.rotary_positions}); sequence {bad[0]} "
                             f"rotates up to position {needed[bad[0]] - 1}")
    if block_table is not None:
        check_block_table_entries(to_host(block_table), lengths + p.seqlen_new, p.page_size, p.num_pages)
