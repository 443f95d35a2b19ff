"""cuflash: exact FlashAttention for CuPy (and NumPy).

``attention`` computes softmax attention tile by tile with an online softmax, so the
seqlen_q x seqlen_k score and probability matrices never touch device memory; ``attention_backward``
recomputes them tile by tile from the stored logsumexp. CuPy arrays run the CUDA kernels on their
device and CuPy's current stream; NumPy arrays run the same blocked algorithm on the CPU.
"""

from __future__ import annotations

import numpy as np

from . import _numpy_path, reference
from ._config import HEAD_DIMS, MAX_HEAD_DIM, SUPPORTED_DTYPES
from ._validate import array_module, check_backward, check_flag, check_forward

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "reference", "HEAD_DIMS", "MAX_HEAD_DIM", "SUPPORTED_DTYPES",
           "__version__"]

#: Plans of the calls seen, keyed on everything validation and the kernel choice read: each array's class,
#: shape, strides, dtype and device, and the options with their types (``causal=1`` is refused where
#: ``causal=True`` is not, though the two are equal keys). A call whose key is here skips validation and
#: planning; only keys that passed validation get in. Emptied when full: a process sweeping shapes
#: replans, one that repeats a few never does.
_plans: dict = {}
MAX_PLANS = 4096
_FORWARD, _BACKWARD = "forward", "backward"


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
    """Forget every cached call plan (the next call of each shape validates and plans again)."""
    _plans.clear()


def _plan_forward(q, k, v, causal, softmax_scale):
    """Validate a forward call and return the function that runs it: ``(q, k, v, with_lse) -> (out, lse)``
    (lse may be None where ``with_lse`` is False)."""
    xp = array_module(q=q, k=k, v=v)
    problem = check_forward(q, k, v, causal, softmax_scale)
    if problem.is_empty:
        def empty(q, k, v, with_lse):
            return (xp.zeros(q.shape, q.dtype),
                    xp.full((problem.batch, problem.heads, problem.seqlen_q), -xp.inf, xp.float32))
        return empty
    if xp is np:
        return lambda q, k, v, with_lse: _numpy_path.forward(q, k, v, problem)
    from . import _cupy_path

    return _cupy_path.ForwardPlan(problem, q.data.device_id, q, k, v).run


def _plan_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    """Validate a backward call and return the function that runs it: ``(dout, q, k, v, out, lse) -> (dq, dk, dv)``."""
    xp = array_module(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    problem = check_backward(dout, q, k, v, out, lse, causal, softmax_scale)
    check_flag("deterministic", deterministic)
    if problem.is_empty or problem.seqlen_k == 0:
        return lambda dout, q, k, v, out, lse: (xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype),
                                                xp.zeros(v.shape, v.dtype))
    if xp is np:
        return lambda dout, q, k, v, out, lse: _numpy_path.backward(dout, q, k, v, out, lse, problem)
    from . import _cupy_path

    return _cupy_path.BackwardPlan(problem, q.data.device_id, bool(deterministic), dout, q, k, v, out, lse).run


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
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
        Mask aligned to the bottom-right corner (as FlashAttention >= 2.1): query ``i`` sees key ``j``
        when ``j <= i + seqlen_k - seqlen_q``. A query row that sees no key gets output 0 and lse -inf.
    softmax_scale : float, optional
        Positive and finite; defaults to ``1 / sqrt(head_dim)``.
    return_lse : bool
        Also return the logsumexp needed by :func:`attention_backward`.

    Returns
    -------
    out : array, (batch, seqlen_q, heads, head_dim), dtype of q
    lse : array, float32, (batch, heads, seqlen_q), only with ``return_lse``
        Natural log of sum_j exp(scale * q_i . k_j) over the keys row i sees.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> q = np.random.default_rng(0).standard_normal((1, 5, 2, 16), dtype=np.float32)
    >>> out, lse = cuflash.attention(q, q, q, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 16), (1, 2, 5))
    """
    try:
        key = (_FORWARD, _array_key(q), _array_key(k), _array_key(v), causal, causal.__class__, softmax_scale,
               softmax_scale.__class__)
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not an array, an unhashable option: validation says what is wrong
        key = plan = None
    if plan is None:
        plan = _remember(key, _plan_forward(q, k, v, causal, softmax_scale))
    if return_lse.__class__ is not bool:
        check_flag("return_lse", return_lse)
    out, lse = plan(q, k, v, return_lse)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False):
    """Gradients of :func:`attention` with respect to q, k and v.

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

    Returns
    -------
    dq : array, (batch, seqlen_q, heads, head_dim), dtype of q
    dk, dv : arrays, (batch, seqlen_k, heads_kv, head_dim), dtype of q
        Summed over the query heads that share a kv head.
    """
    try:
        key = (_BACKWARD, _array_key(dout), _array_key(q), _array_key(k), _array_key(v), _array_key(out),
               _array_key(lse), causal, causal.__class__, softmax_scale, softmax_scale.__class__, deterministic,
               deterministic.__class__)
        plan = _plans.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is None:
        plan = _remember(key, _plan_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic))
    return plan(dout, q, k, v, out, lse)
