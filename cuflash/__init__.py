"""cuflash: exact FlashAttention for CuPy (and NumPy).

``attention`` computes softmax attention tile by tile with an online softmax, so the
seqlen_q x seqlen_k score and probability matrices never touch device memory; ``attention_backward``
recomputes them tile by tile from the stored logsumexp. CuPy arrays run the CUDA kernels on their
device and CuPy's current stream; NumPy arrays run the same blocked algorithm on the CPU.
"""

from __future__ import annotations

import numpy as np

from . import _kvcache, _numpy_path, _varlen, distributed, reference
from ._config import FLOAT8_E4M3, HEAD_DIMS, MAX_HEAD_DIM, SUPPORTED_DTYPES
from ._fp8 import hadamard_rotation, quantize_qkv
from ._fp8 import quantize as quantize_fp8
from ._merge import merge_states
from ._philox import dropout_mask
from ._validate import (array_module, check_backward, check_cache_indices, check_cache_length, check_dropout,
                        check_flag, check_forward, check_kvcache, check_same_device)
from ._validate import optional_arrays as _optional_arrays

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "distributed", "dropout_mask", "hadamard_rotation", "merge_states", "quantize_fp8", "quantize_qkv",
           "reference", "FLOAT8_E4M3", "HEAD_DIMS", "MAX_HEAD_DIM", "SUPPORTED_DTYPES", "__version__"]

#: Plans of the calls seen, keyed on everything validation and the kernel choice read: each array's class,
#: shape, strides, dtype and device, and the options with their types (``causal=1`` is refused where
#: ``causal=True`` is not, though the two are equal keys). A call whose key is here skips validation and
#: planning; only keys that passed validation get in. Emptied when full: a process sweeping shapes
#: replans, one that repeats a few never does.
_plans: dict = {}
MAX_PLANS = 4096
_FORWARD, _BACKWARD, _KVCACHE = "forward", "backward", "kvcache"
_VARLEN_FORWARD, _VARLEN_BACKWARD = "varlen forward", "varlen backward"


def _array_key(x) -> tuple:
    cls = x.__class__
    return cls, x.shape, x.strides, x.dtype, None if cls is np.ndarray else x.data.device_id


def _remember(key, plan):
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def clear_plans():
    """Forget every cached call plan, ring attention's block plans too (the next call of each shape validates
    and plans again)."""
    _plans.clear()
    distributed._block_plans.clear()


def _plan_forward(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p, alignment,
                  descales=(None, None, None), out_dtype=None):
    """Validate a forward call and return the function that runs it:
    ``(q, k, v, alibi_slopes, sinks, seed, offset, with_lse[, descales]) -> (out, lse)`` (lse may be None where
    ``with_lse`` is False; ``descales``, a float8 call's (q_descale, k_descale, v_descale))."""
    xp = array_module(q=q, k=k, v=v, **_optional_arrays(alibi_slopes=alibi_slopes, sinks=sinks, q_descale=descales[0],
                                                         k_descale=descales[1], v_descale=descales[2]))
    problem = check_forward(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p,
                            alignment, descales, out_dtype)
    if xp is np or problem.is_empty or problem.seqlen_k == 0:
        return _array_forward(xp, problem)
    from . import _cupy_path

    return _cupy_path.ForwardPlan(problem, q.data.device_id, q, k, v).run


def _array_forward(xp, problem, batch_index: int = 0):
    """The forward of a validated problem that runs no kernel, as _plan_forward returns it: a problem in which
    no row sees a key (on either array module), else the NumPy path; ``batch_index`` picks the dropout streams
    (a packed sequence's, computed on its own: _numpy_path.forward)."""
    if problem.is_empty or problem.seqlen_k == 0:
        return lambda q, k, v, alibi_slopes, sinks, seed, offset, with_lse, descales=None: _no_keys(
            xp, q, (problem.batch, problem.heads, problem.seqlen_q), sinks, problem.output_dtype)
    return lambda q, k, v, alibi_slopes, sinks, seed, offset, with_lse, descales=(None, None, None): (
        _numpy_path.forward(q, k, v, problem, alibi_slopes, sinks, seed, offset, batch_index, descales))


def _plan_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_size, softcap,
                   alibi_slopes, sinks, dropout_p, alignment):
    """Validate a backward call and return the function that runs it:
    ``(dout, q, k, v, out, lse, alibi_slopes, sinks, seed, offset) -> (dq, dk, dv[, dsinks])``."""
    xp = array_module(dout=dout, q=q, k=k, v=v, out=out, lse=lse,
                      **_optional_arrays(alibi_slopes=alibi_slopes, sinks=sinks))
    problem = check_backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             sinks, dropout_p, alignment)
    check_flag("deterministic", deterministic)
    if xp is np or problem.is_empty or problem.seqlen_k == 0:
        return _array_backward(xp, problem)
    from . import _cupy_path

    return _cupy_path.BackwardPlan(problem, q.data.device_id, bool(deterministic), dout, q, k, v, out, lse).run


def _array_backward(xp, problem, batch_index: int = 0):
    """The backward of a validated problem that runs no kernel, as _plan_backward returns it: zero gradients
    where no row sees a key (on either array module), else the NumPy path; ``batch_index`` as in
    _array_forward."""
    if problem.is_empty or problem.seqlen_k == 0:
        return lambda dout, q, k, v, out, lse, alibi_slopes, sinks, seed, offset: _zero_gradients(xp, q, k, v, sinks)
    return lambda dout, q, k, v, out, lse, alibi_slopes, sinks, seed, offset: _numpy_path.backward(
        dout, q, k, v, out, lse, problem, alibi_slopes, sinks, seed, offset, batch_index=batch_index)


def _no_keys(xp, q, lse_shape, sinks, dtype=None):
    """out (of ``dtype``, default q's) and lse of a call in which no row sees a key: out 0, lse -inf, or with sinks
    the sink alone (lse_shape's last two axes are heads and rows)."""
    lse = (xp.full(lse_shape, -xp.inf, xp.float32) if sinks is None else
           xp.ascontiguousarray(xp.broadcast_to(sinks[:, None], lse_shape)))
    return xp.zeros(q.shape, q.dtype if dtype is None else dtype), lse


def _zero_gradients(xp, q, k, v, sinks):
    """The gradients of a call in which no row sees a key: all 0 (dsinks too: float32 (heads,), with sinks)."""
    grads = xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    return grads if sinks is None else (*grads, xp.zeros(sinks.shape, xp.float32))


def _optional_key(x):
    return None if x is None else _array_key(x)


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False, *,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
              dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, alignment: str = "bottom_right",
              q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Exact softmax attention, ``softmax(scale * q k^T) v``, per (batch, head).

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, (batch, seqlen_q, heads, head_dim)
    k : same kind and dtype as q, (batch, seqlen_k, heads_kv, head_dim)
    v : same kind and dtype as q, (batch, seqlen_k, heads_kv, head_dim)
        ``heads`` must be a multiple of ``heads_kv``: query head ``h`` reads kv head
        ``h // (heads // heads_kv)`` (multi-query and grouped-query attention). seqlen_q and seqlen_k
        may differ. dtype float16, bfloat16 or float32; head_dim 1..256. Any strides; the arrays are
        never written.
    causal : bool
        Query ``i`` sees key ``j`` when ``j <= i + diagonal``: ``diagonal`` is ``seqlen_k - seqlen_q``
        (aligned to the bottom-right corner, as FlashAttention >= 2.1) or 0 (``alignment="top_left"``).
        A query row that sees no key gets output 0 and lse -inf.
    softmax_scale : float, optional
        Positive and finite; defaults to ``1 / sqrt(head_dim)``.
    return_lse : bool
        Also return the logsumexp needed by :func:`attention_backward`.
    window_size : (int, int)
        Sliding window ``(left, right)``: query ``i`` sees key ``j`` when ``i + diagonal - left <= j <= i +
        diagonal + right``; -1 leaves a side unbounded. With ``causal``, right is 0. Default ``(-1, -1)``.
    softcap : float
        When positive, each score ``x = scale * q.k`` becomes ``softcap * tanh(x / softcap)`` (Gemma 2, Grok),
        before ALiBi and the softmax. Default 0 (off).
    alibi_slopes : array of the kind of q, float32, (heads,) or (batch, heads), optional
        Adds ``-slope * |i + diagonal - j|`` to the scores (ALiBi).
    sinks : array of the kind of q, float32, (heads,), optional
        One logit per query head that joins every row's softmax denominator with no value (gpt-oss):
        ``lse = log(exp(sink) + sum_j exp(score_j))``; a row that sees no key gets output 0 and lse = sink.
    dropout_p : float
        Probability in [0, 1) of dropping each attention probability; kept ones are scaled by ``1 / (1 -
        dropout_p)``. The mask is Philox's, keyed on (seed, offset, batch, head, row, column):
        :func:`dropout_mask` gives it, bit for bit what the kernels and the NumPy path apply. The lse does
        not see dropout.
    seed : int, needed where dropout_p > 0
        In [0, 2**64).
    offset : int
        In [0, 2**32): a stream within the seed; use a new (seed, offset) per forward call and the same
        ones in its backward.
    alignment : "bottom_right" or "top_left"
        Where the diagonal of ``causal``, the window and ALiBi lies (PyTorch's ``is_causal`` is top_left).
    q_descale, k_descale, v_descale : arrays of the kind of q, float32, (1,) or () or (batch, heads_kv), optional
        For float8 e4m3 q, k and v (FlashAttention-3's FP8 interface): ``float8_e4m3fn`` arrays, or ``uint8``
        arrays of e4m3 bit patterns (the form on CuPy, which has no float8 dtype). Each array stands for its
        values times its factor, one per tensor or one per (batch, kv head) (query head ``h`` takes kv head
        ``h // (heads // heads_kv)``'s); None is 1. :func:`quantize_fp8` and :func:`quantize_qkv` make them. On
        the GPU the Hopper float8 forward runs them (compute capability 9.0, head_dim 128, no dropout; else a
        TypeError). No backward takes float8 inputs.
    out_dtype : bfloat16 or float16, optional
        The output dtype of float8 inputs (default bfloat16); other inputs give their own dtype.

    Returns
    -------
    out : array, (batch, seqlen_q, heads, head_dim), dtype of q (float8 inputs: ``out_dtype``)
    lse : array, float32, (batch, heads, seqlen_q), only with ``return_lse``
        Natural log of sum_j exp(score_j) over the keys row i sees (and exp(sink) with sinks).

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> q = np.random.default_rng(0).standard_normal((1, 5, 2, 16), dtype=np.float32)
    >>> out, lse = cuflash.attention(q, q, q, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 16), (1, 2, 5))
    >>> out = cuflash.attention(q, q, q, window_size=(2, 0), softcap=30.0)
    """
    if dropout_p:  # seed and offset change per call (they are not in the plan key): checked on every call
        _, seed, offset = check_dropout(dropout_p, seed, offset)
    try:
        key = (_FORWARD, _array_key(q), _array_key(k), _array_key(v), causal, causal.__class__, softmax_scale,
               softmax_scale.__class__, window_size, softcap, softcap.__class__, _optional_key(alibi_slopes),
               _optional_key(sinks), dropout_p, dropout_p.__class__, alignment, _optional_key(q_descale),
               _optional_key(k_descale), _optional_key(v_descale), out_dtype)
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not an array, an unhashable option: validation says what is wrong
        key = plan = None
    descales = (q_descale, k_descale, v_descale)
    if plan is None:
        plan = _remember(key, _plan_forward(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes,
                                            sinks, dropout_p, alignment, descales, out_dtype))
    if return_lse.__class__ is not bool:
        check_flag("return_lse", return_lse)
    if q_descale is None and k_descale is None and v_descale is None:
        out, lse = plan(q, k, v, alibi_slopes, sinks, seed, offset, return_lse)
    else:   # a float8 call's factors
        out, lse = plan(q, k, v, alibi_slopes, sinks, seed, offset, return_lse, descales=descales)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, *, window_size: tuple[int, int] = (-1, -1),
                       softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                       seed: int | None = None, offset: int = 0, alignment: str = "bottom_right"):
    """Gradients of :func:`attention` with respect to q, k and v (and the sinks).

    Recomputes the attention probabilities tile by tile from ``lse`` (FlashAttention-2's backward): no
    seqlen_q x seqlen_k buffer is allocated.

    Parameters
    ----------
    dout : array, (batch, seqlen_q, heads, head_dim)
        Gradient of the loss with respect to ``out``.
    q, k, v : arrays as given to :func:`attention`
    out : array, (batch, seqlen_q, heads, head_dim)
        The forward's output.
    lse : array, float32, (batch, heads, seqlen_q)
        The forward's logsumexp (``attention(..., return_lse=True)``).
    causal, softmax_scale
        As given to the forward.
    deterministic : bool
        False (the default): for float16/bfloat16 on the GPU, dq is accumulated in float32 with
        atomics inside the dk/dv kernel (FlashAttention-2's way, fewer matrix products), so its last
        bits may differ from run to run. True: every dq element is summed in a fixed order, and dq, dk,
        dv are bitwise identical on every run. Where batch * heads_kv fills the GPU, the same kernel runs
        on a grid in which each thread block adds into its own float32 dq buffer (up to 8 buffers, each
        the default's size); otherwise dq comes from its own kernel. dk and dv are bitwise reproducible
        in both settings; float32 and the NumPy path are deterministic in both.
    window_size, softcap, alibi_slopes, sinks, dropout_p, seed, offset, alignment
        As given to the forward (the same seed and offset reproduce its dropout mask).

    Returns
    -------
    dq : array, (batch, seqlen_q, heads, head_dim), dtype of q
    dk, dv : arrays, (batch, seqlen_k, heads_kv, head_dim), dtype of q
        Summed over the query heads that share a kv head.
    dsinks : array, float32, (heads,), only with ``sinks``
        Summed over the batch and the rows.
    """
    if dropout_p:
        _, seed, offset = check_dropout(dropout_p, seed, offset)
    try:
        key = (_BACKWARD, _array_key(dout), _array_key(q), _array_key(k), _array_key(v), _array_key(out),
               _array_key(lse), causal, causal.__class__, softmax_scale, softmax_scale.__class__, deterministic,
               deterministic.__class__, window_size, softcap, softcap.__class__, _optional_key(alibi_slopes),
               _optional_key(sinks), dropout_p, dropout_p.__class__, alignment)
        plan = _plans.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is None:
        plan = _remember(key, _plan_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                                             window_size, softcap, alibi_slopes, sinks, dropout_p, alignment))
    return plan(dout, q, k, v, out, lse, alibi_slopes, sinks, seed, offset)


def _plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window_size, softcap,
                  alibi_slopes, sinks, num_splits, rotary_cos, rotary_sin, rotary_interleaved, check_indices,
                  descales=(None, None, None), out_dtype=None, cache_leftpad=None):
    """Validate an attention_with_kvcache call and return the function that runs it: ``(q, k_cache, v_cache, k,
    v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks, rotary_cos, rotary_sin, with_lse[,
    descales]) -> (out, lse)``, which checks an int ``cache_seqlens`` (its value is not part of the plan), and
    with ``check_indices`` the values of a cache_seqlens array, of block_table and of cache_leftpad, before
    anything is written. ``descales``: a float8 call's (q_descale, k_descale, v_descale), arrays of q's kind."""
    arrays = _optional_arrays(k=k, v=v, block_table=block_table, cache_leftpad=cache_leftpad,
                              alibi_slopes=alibi_slopes, sinks=sinks,
                              cache_seqlens=cache_seqlens if hasattr(cache_seqlens, "dtype") else None,
                              rotary_cos=rotary_cos, rotary_sin=rotary_sin, q_descale=descales[0],
                              k_descale=descales[1], v_descale=descales[2])
    xp = array_module(q=q, k_cache=k_cache, v_cache=v_cache, **arrays)
    problem = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
                            window_size, softcap, alibi_slopes, sinks, num_splits, rotary_cos, rotary_sin,
                            rotary_interleaved, descales, out_dtype, cache_leftpad)
    a = problem.attn
    interleaved = bool(rotary_interleaved)
    check_flag("check_indices", check_indices)
    checks_per_call = problem.lengths == "int" or check_indices

    def check_call(cache_seqlens, block_table, cache_leftpad):
        # what the plan cannot hold: an int cache_seqlens's value, and with check_indices the device's values
        if problem.lengths == "int":
            check_cache_length(cache_seqlens, problem)
        if check_indices:
            check_cache_indices(problem, cache_seqlens, block_table, cache_leftpad)

    if xp is np or a.is_empty:
        def run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks, rotary_cos,
                rotary_sin, with_lse, descales=(None, None, None)):
            check_call(cache_seqlens, block_table, cache_leftpad)
            q = _kvcache.rotate_and_append(xp, q, k, v, k_cache, v_cache, cache_seqlens, block_table, rotary_cos,
                                           rotary_sin, interleaved, a.masked, cache_leftpad)
            if a.is_empty:
                return _no_keys(xp, q, (a.batch, a.heads, a.seqlen_q), sinks, a.output_dtype)
            keys = _kvcache.lengths_of(cache_seqlens, a.batch, a.seqlen_k) + problem.seqlen_new
            starts = None if cache_leftpad is None else _kvcache.to_host(cache_leftpad)

            def attend(b, q_b, k_b, v_b):
                q_d, k_d, v_d = (_kvcache.sequence_descale(d, b) for d in descales)
                return attention(q_b, k_b, v_b, a.causal, a.softmax_scale, True,
                                 window_size=(a.window_left, a.window_right), softcap=a.softcap,
                                 alibi_slopes=_kvcache.sequence_slopes(alibi_slopes, b), sinks=sinks, q_descale=q_d,
                                 k_descale=k_d, v_descale=v_d, out_dtype=out_dtype)

            return _kvcache.per_sequence(attend, q, k_cache, v_cache, keys, block_table, starts)
        return run
    from . import _cupy_path

    plan = _cupy_path.KVCachePlan(problem, q.data.device_id, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                  rotary_cos, rotary_sin, num_splits, interleaved, cache_leftpad)
    if not checks_per_call:
        return plan.run

    def run_checked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                    rotary_cos, rotary_sin, with_lse, descales=(None, None, None)):
        check_call(cache_seqlens, block_table, cache_leftpad)
        return plan.run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                        rotary_cos, rotary_sin, with_lse, descales)
    return run_checked


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved: bool = True,
                           causal: bool = False,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes=None, sinks=None, num_splits: int = 0,
                           return_lse: bool = False, check_indices: bool = False, q_descale=None, k_descale=None,
                           v_descale=None, out_dtype=None):
    """Attention of new queries against a KV cache (decoding), optionally appending new keys and values to it
    first: FlashAttention's ``flash_attn_with_kvcache``. Forward only.

    Parameters
    ----------
    q : array, (batch, seqlen_q, heads, head_dim)
        The queries of each sequence's newest positions. float16, bfloat16 or float8 e4m3 (uint8 bit patterns)
        on the GPU; float32 and float8_e4m3fn too on NumPy.
    k_cache, v_cache : arrays of the kind and dtype of q
        Contiguous: (batch, seqlen_cache, heads_kv, head_dim). Paged (with ``block_table``): (num_blocks,
        page_size, heads_kv, head_dim), page_size a multiple of 64. Read in place (the last axis contiguous);
        written where ``k`` and ``v`` are given. ``heads`` is a multiple of ``heads_kv`` (GQA, MQA).
    k, v : arrays (batch, seqlen_new, heads_kv, head_dim), optional
        Written into the caches at positions ``cache_seqlens[b]``, ``cache_seqlens[b] + 1``, ... of each
        sequence before the attention, which then covers them: the one write into a caller's array. Need
        ``cache_seqlens``. On CuPy one kernel (append_rotary) writes them, rotating k first where rotary tables
        are given; on NumPy, array operations.
    cache_seqlens : int, int32 array (batch,), or None
        Keys already in each sequence's cache; None: every sequence fills the cache. An int is checked against
        the cache's room; the values of an array are checked only with ``check_indices`` (reading them costs a
        synchronization on the GPU): unchecked, an array value past the cache's room, or a ``block_table``
        entry outside ``num_blocks``, is undefined behaviour.
    block_table : int32 array (batch, max_blocks_per_sequence), optional
        Key ``n`` of sequence ``b`` is row ``n % page_size`` of page ``block_table[b, n // page_size]``.
    cache_leftpad : int32 array (batch,), optional
        The cache row of each sequence's first key, in a contiguous cache (FlashAttention's ``cache_leftpad``,
        for left-padded batches): sequence ``b``'s keys are rows ``cache_leftpad[b] .. cache_seqlens[b] - 1``
        and then the appended ones (still written at row ``cache_seqlens[b]``), and positions (the diagonal,
        windows, ALiBi, rotary) count from its first key. Its values are checked only with ``check_indices``
        (within [0, cache_seqlens[b]]); an int ``cache_seqlens`` is checked against the rotary tables as though
        it were 0.
    rotary_cos, rotary_sin : arrays (seqlen_ro, rotary_dim / 2) of q's dtype or float32, optional
        Rotary embeddings, as FlashAttention applies them: the first rotary_dim channels of ``k`` are turned at
        positions ``cache_seqlens[b] + i`` before they are written into the cache, those of ``q`` at the same
        positions where causal or windowed, else all at ``cache_seqlens[b]``; the caller's q and k are not
        written. Need ``cache_seqlens``; an int is checked against seqlen_ro, an array's values are not.
        Computed in float32, then rounded to q's dtype (on CuPy in the kernel that appends k and v).
    rotary_interleaved : bool
        Channel pairs (2i, 2i + 1) (GPT-J) where True, (i, i + rotary_dim / 2) (GPT-NeoX) where False.
    causal, softmax_scale, window_size, softcap, alibi_slopes, sinks
        As in :func:`attention`; sequence ``b`` has ``cache_seqlens[b] + seqlen_new`` keys and its diagonal
        at the bottom-right corner (query ``i`` is position ``cache_seqlens[b] + seqlen_new - seqlen_q + i``).
    num_splits : int
        Key splits per sequence (Flash-Decoding: each split is a block of its own, the splits merged by their
        logsumexp, :func:`merge_states`' rule, by the last block of each group to finish, in the same launch).
        0 (default) lets the plan choose from the shape and the GPU; 1 disables splitting. Ignored on the
        NumPy path. With splits the blocks count themselves in a small int32 buffer that cuflash keeps per
        device and stream (zero between calls, no memset per call): calls that may run at the same time need
        different streams, and so does a CUDA graph of this call replayed while calls run on the stream it was
        captured on.
    return_lse : bool
        Also return the logsumexp, float32 (batch, heads, seqlen_q).
    check_indices : bool
        Check the values of a ``cache_seqlens`` array (within the cache's room and the rotary tables) and the
        ``block_table`` entries each sequence uses (within ``num_blocks``) before anything is written:
        ``ValueError`` naming the first bad one. On CuPy this copies them to the host, which synchronizes the
        device. Default False.

    q_descale, k_descale, v_descale, out_dtype
        Of float8 e4m3 q, caches (and k, v), as in :func:`attention`: ``k_descale`` and ``v_descale`` are
        the factors of the cache and of the new keys and values alike (they join it unchanged); factors per
        (batch, kv head) are sequence b's at row b, also in a paged cache. No rotary embeddings with float8
        (rotate before quantizing). On the GPU the KV-cache forward reads the e4m3 bytes (half the bfloat16
        cache's) and converts each tile to float16 on chip (exact); head_dim 64, 128 or 256, and the caches'
        rows and strides in whole 16 bytes (q is copied where its are not).

    Returns
    -------
    out : array (batch, seqlen_q, heads, head_dim), dtype of q (of float8 inputs: bfloat16, or ``out_dtype``);
    and lse with ``return_lse``.

    On the GPU the query heads that share a kv head are rows of one tile, so each kv head's cache is read once
    per step (except under ALiBi, whose slope the kernel takes per query head).
    """
    try:
        lengths_key = cache_seqlens.__class__ if not hasattr(cache_seqlens, "dtype") else _array_key(cache_seqlens)
        key = (_KVCACHE, _array_key(q), _array_key(k_cache), _array_key(v_cache), _optional_key(k), _optional_key(v),
               lengths_key, _optional_key(block_table), _optional_key(cache_leftpad), _optional_key(rotary_cos),
               _optional_key(rotary_sin),
               rotary_interleaved, rotary_interleaved.__class__, causal, causal.__class__, softmax_scale,
               softmax_scale.__class__, window_size, softcap, softcap.__class__, _optional_key(alibi_slopes),
               _optional_key(sinks), num_splits, num_splits.__class__, check_indices, check_indices.__class__,
               _optional_key(q_descale), _optional_key(k_descale), _optional_key(v_descale), out_dtype)
        plan = _plans.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    descales = (q_descale, k_descale, v_descale)
    if plan is None:
        plan = _remember(key, _plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                                            softmax_scale, window_size, softcap, alibi_slopes, sinks, num_splits,
                                            rotary_cos, rotary_sin, rotary_interleaved, check_indices, descales,
                                            out_dtype, cache_leftpad))
    if return_lse.__class__ is not bool:
        check_flag("return_lse", return_lse)
    if q_descale is None and k_descale is None and v_descale is None:
        out, lse = plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                        rotary_cos, rotary_sin, return_lse)
    else:   # a float8 call's factors
        out, lse = plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                        rotary_cos, rotary_sin, return_lse, descales)
    return (out, lse) if return_lse else out


def _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                  window_size, softcap, alibi_slopes, sinks, dropout_p, check_indices, **arrays):
    """A packed call's checks: (array module, PackedBatch, Problem)."""
    xp = array_module(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **arrays,
                      **_optional_arrays(alibi_slopes=alibi_slopes, sinks=sinks))
    check_flag("check_indices", check_indices)
    packed = _varlen.check_packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   read=xp is np or check_indices)
    problem = _varlen.problem(q, k, packed, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                              dropout_p)
    return xp, packed, problem


def _varlen_key(kind, arrays, max_seqlen_q, max_seqlen_k, check_indices, *options):
    """The plan key of a packed call that reads nothing from the device (CuPy, both max lengths given, no
    check_indices), else None: a call that reads the prefix sums is planned from their values."""
    if max_seqlen_q is None or max_seqlen_k is None or check_indices is not False:
        return None
    try:
        if any(a.__class__ is np.ndarray for a in arrays):
            return None
        key = (kind, *map(_array_key, arrays), max_seqlen_q, max_seqlen_k,
               *((value, value.__class__) if not hasattr(value, "shape") else _array_key(value) for value in options))
        hash(key)
        return key
    except (AttributeError, TypeError):  # not an array, an unhashable option: validation says what is wrong
        return None


def _plan_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                         window_size, softcap, alibi_slopes, sinks, dropout_p, check_indices):
    """Validate a packed forward and return the function that runs it:
    ``(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset, with_lse) -> (out, lse)``."""
    xp, packed, problem = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                        softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p,
                                        check_indices)
    if xp is np:  # one attention per sequence, on this call's prefix sums (NumPy plans are never cached)
        options = _varlen_options(causal, softmax_scale, window_size, softcap, dropout_p)

        def per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset, with_lse):
            def attend(b, q_b, k_b, v_b, slopes_b):
                p = check_forward(q_b, k_b, v_b, alibi_slopes=slopes_b, sinks=sinks, **options)
                return _array_forward(np, p, b)(q_b, k_b, v_b, slopes_b, sinks, seed, offset, True)
            return _varlen.per_sequence_forward(np, attend, packed.packing, q, k, v, alibi_slopes)
        return per_sequence
    if q.shape[0] == 0 or problem.heads == 0 or problem.seqlen_k == 0:
        return lambda q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset, with_lse: _no_keys(
            xp, q, (q.shape[1], q.shape[0]), sinks)
    from . import _cupy_path

    run = _cupy_path.ForwardPlan(problem, q.data.device_id, q, k, v, packed=True).run

    def packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset, with_lse):
        return run(q, k, v, alibi_slopes, sinks, seed, offset, with_lse, (cu_seqlens_q, cu_seqlens_k))
    return packed_forward


def _plan_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, deterministic, window_size, softcap, alibi_slopes, sinks, dropout_p,
                          check_indices):
    """Validate a packed backward and return the function that runs it:
    ``(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset) -> (dq, dk, dv[,
    dsinks])``."""
    xp, packed, problem = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                        softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p,
                                        check_indices, dout=dout, out=out, lse=lse)
    check_flag("deterministic", deterministic)
    for name, a in (("dout", dout), ("out", out)):
        if a.dtype != q.dtype or tuple(a.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have the shape and dtype of q {tuple(q.shape)} {q.dtype}, got "
                             f"{tuple(a.shape)} {a.dtype}")
    if lse.dtype != np.float32 or tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must be float32 (heads, total_q) = {(q.shape[1], q.shape[0])}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    check_same_device(q=q, dout=dout, out=out, lse=lse)
    if xp is np:  # as in the forward
        options = _varlen_options(causal, softmax_scale, window_size, softcap, dropout_p)

        def per_sequence(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset):
            def attend_backward(b, dout_b, q_b, k_b, v_b, out_b, lse_b, slopes_b):
                p = check_backward(dout_b, q_b, k_b, v_b, out_b, lse_b, alibi_slopes=slopes_b, sinks=sinks, **options)
                return _array_backward(np, p, b)(dout_b, q_b, k_b, v_b, out_b, lse_b, slopes_b, sinks, seed, offset)
            return _varlen.per_sequence_backward(np, attend_backward, packed.packing, dout, q, k, v, out, lse,
                                                 alibi_slopes, sinks)
        return per_sequence
    if q.shape[0] == 0 or problem.heads == 0 or problem.seqlen_k == 0:
        return lambda dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset: (
            _zero_gradients(xp, q, k, v, sinks))
    from . import _cupy_path

    run = _cupy_path.BackwardPlan(problem, q.data.device_id, bool(deterministic), dout, q, k, v, out, lse,
                                  packed=True).run

    def packed_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset):
        return run(dout, q, k, v, out, lse, alibi_slopes, sinks, seed, offset, (cu_seqlens_q, cu_seqlens_k))
    return packed_backward


def _varlen_options(causal, softmax_scale, window_size, softcap, dropout_p) -> dict:
    """The options of the NumPy path's per-sequence problems."""
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                dropout_p=dropout_p)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     causal: bool = False, softmax_scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
                     dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, return_lse: bool = False,
                     check_indices: bool = False, block_table=None):
    """Attention over a batch of sequences of different lengths packed along one axis: FlashAttention's
    ``flash_attn_varlen_func``.

    Parameters
    ----------
    q : array (total_q, heads, head_dim)
    k, v : arrays (total_k, heads_kv, head_dim)
        Sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] :
        cu_seqlens_k[b + 1]`` of k and v; sequences of length 0 are allowed.
    cu_seqlens_q, cu_seqlens_k : int32 arrays (batch + 1,)
        Prefix sums of the lengths, from 0 to the packed length.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest lengths (the kernels' grid is sized by them). When both are given, a CuPy call reads
        nothing from the device: the prefix sums are trusted, and values that do not start at 0, decrease,
        end past the packed length or exceed the max lengths are undefined behaviour (wrong results or
        memory faults). When either is missing, the prefix sums are read to the host (a copy that
        synchronizes the device), checked, and the missing max computed from them.
    causal, softmax_scale, window_size, softcap, alibi_slopes, sinks
        As in :func:`attention`, per sequence (the diagonal at each sequence's bottom-right corner; ALiBi
        slopes ``(heads,)`` or ``(batch, heads)``).
    dropout_p, seed, offset
        As in :func:`attention`. Sequence ``b`` draws the mask of batch entry ``b`` of a dense call, its rows and
        keys counted from the sequence's start: ``cuflash.dropout_mask(batch, heads, max_seqlen_q,
        max_seqlen_k, ...)[b, :, :seqlen_q_b, :seqlen_k_b]``.
    return_lse : bool
        Also return the logsumexp, float32 ``(heads, total_q)``.
    check_indices : bool
        Read the prefix sums to the host and check them even where both max lengths are given (a
        synchronizing copy on CuPy). NumPy arrays are always checked.
    block_table : int32 array (batch, max_blocks_per_sequence), optional
        Paged keys (FlashAttention's ``block_table``): k and v are then caches (num_blocks, page_size, heads_kv,
        head_dim), and key ``n`` of sequence ``b`` (n < cu_seqlens_k[b + 1] - cu_seqlens_k[b]) is row ``n %
        page_size`` of page ``block_table[b, n // page_size]``. They are gathered into a packed copy first,
        which reads the total ``cu_seqlens_k[-1]`` to the host (on CuPy a synchronizing copy) and costs a copy
        of the keys and values; with ``check_indices`` (always on NumPy) the block_table entries used are
        checked too. Forward only.

    Returns
    -------
    out : array (total_q, heads, head_dim), dtype of q; and lse with ``return_lse``.

    On CuPy one launch walks every sequence (its blocks past a sequence's end do no work); on NumPy, one
    :func:`attention` call per sequence.
    """
    if dropout_p:  # seed and offset change per call (they are not in the plan key): checked on every call
        _, seed, offset = check_dropout(dropout_p, seed, offset)
    if block_table is not None:
        xp = array_module(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
        check_flag("check_indices", check_indices)
        _varlen.check_pages(k, v, cu_seqlens_k, block_table)
        k, v = _varlen.gather_pages(xp, k, v, cu_seqlens_k, block_table, check=xp is np or check_indices)
    key = _varlen_key(_VARLEN_FORWARD, (q, k, v, cu_seqlens_q, cu_seqlens_k), max_seqlen_q, max_seqlen_k,
                      check_indices, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p)
    plan = None if key is None else _plans.get(key)
    if plan is None:
        plan = _remember(key, _plan_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                                                   dropout_p, check_indices))
    if return_lse.__class__ is not bool:
        check_flag("return_lse", return_lse)
    out, lse = plan(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset, return_lse)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, causal: bool = False, softmax_scale: float | None = None,
                              deterministic: bool = False, window_size: tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                              seed: int | None = None, offset: int = 0, check_indices: bool = False):
    """Gradients of :func:`attention_varlen`: ``(dq, dk, dv)``, packed as q, k and v (and ``dsinks``, float32
    ``(heads,)`` summed over every sequence and row, with ``sinks``). ``dout`` and ``out`` are ``(total_q,
    heads, head_dim)``, ``lse`` float32 ``(heads, total_q)`` as the forward returned it; the other arguments as
    given to the forward (the max lengths and ``check_indices`` as there; the same ``seed`` and ``offset``
    reproduce its dropout mask). ``deterministic`` as in
    :func:`attention_backward`. On CuPy the packed kernels; on NumPy one :func:`attention_backward` call per
    sequence."""
    if dropout_p:
        _, seed, offset = check_dropout(dropout_p, seed, offset)
    key = _varlen_key(_VARLEN_BACKWARD, (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), max_seqlen_q,
                      max_seqlen_k, check_indices, causal, softmax_scale, deterministic, window_size, softcap,
                      alibi_slopes, sinks, dropout_p)
    plan = None if key is None else _plans.get(key)
    if plan is None:
        plan = _remember(key, _plan_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                    max_seqlen_k, causal, softmax_scale, deterministic, window_size,
                                                    softcap, alibi_slopes, sinks, dropout_p, check_indices))
    return plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, offset)
