"""merge_states: attention over disjoint sets of keys, combined into attention over their union."""

from __future__ import annotations

import numpy as np

from ._validate import _check_dtype, array_module, check_same_device

_OUT_LAYOUT = "(batch, seqlen_q, heads, head_dim)"
_LSE_LAYOUT = "(batch, heads, seqlen_q)"


def _split_parts(name: str, x, layout: str) -> list:
    """The parts of ``x``: a stacked array with a leading part axis, or a list or tuple of arrays of ``layout``."""
    ndim = layout.count(",") + 1
    if isinstance(x, (list, tuple)):
        parts = list(x)
        for i, part in enumerate(parts):
            if not hasattr(part, "ndim"):
                raise TypeError(f"{name}[{i}] must be an array {layout}, got {type(part).__name__}")
            if part.ndim != ndim:
                raise ValueError(f"{name}[{i}] must have {ndim} dimensions {layout}, got {part.ndim} "
                                 f"(shape {tuple(part.shape)})")
    elif hasattr(x, "ndim"):
        if x.ndim != ndim + 1:
            raise ValueError(f"{name} must have {ndim + 1} dimensions (parts, {layout[1:]} or be a list of arrays "
                             f"{layout}, got {x.ndim} (shape {tuple(x.shape)})")
        parts = [x[i] for i in range(x.shape[0])]
    else:
        raise TypeError(f"{name} must be an array (parts, {layout[1:]} or a list of arrays {layout}, "
                        f"got {type(x).__name__}")
    if not parts:
        raise ValueError(f"{name} must hold at least one part, got none")
    return parts


def check_merge(outs, lses):
    """Validate merge_states' arguments; returns (array module, the out parts, the lse parts)."""
    out_parts = _split_parts("outs", outs, _OUT_LAYOUT)
    lse_parts = _split_parts("lses", lses, _LSE_LAYOUT)
    arrays = {f"outs[{i}]": part for i, part in enumerate(out_parts)}
    arrays.update({f"lses[{i}]": part for i, part in enumerate(lse_parts)})
    xp = array_module(**arrays)
    check_same_device(**arrays)
    if len(out_parts) != len(lse_parts):
        raise ValueError(f"outs and lses must hold the same number of parts, got {len(out_parts)} and "
                         f"{len(lse_parts)}")
    batch, seqlen_q, heads, _ = out_shape = tuple(out_parts[0].shape)
    _check_dtype("outs", out_parts[0])
    dtype = np.dtype(out_parts[0].dtype)
    for i, (out, lse) in enumerate(zip(out_parts, lse_parts)):
        if tuple(out.shape) != out_shape:
            raise ValueError(f"outs[{i}] must have the shape of outs[0] {out_shape}, got {tuple(out.shape)}")
        if out.dtype != dtype:
            raise TypeError(f"outs[{i}] must have the dtype of outs[0] ({dtype}), got {out.dtype}")
        if lse.dtype != np.float32:
            raise TypeError(f"lses[{i}] must be float32, got {lse.dtype}")
        if tuple(lse.shape) != (batch, heads, seqlen_q):
            raise ValueError(f"lses[{i}] must have shape {_LSE_LAYOUT} = {(batch, heads, seqlen_q)} to match outs, "
                             f"got {tuple(lse.shape)}")
    return xp, out_parts, lse_parts


def merge_states(outs, lses):
    """Combine attention computed over disjoint sets of keys into attention over their union.

    Part ``i`` is attention over its own keys, normalized over them, with its logsumexp (what
    ``attention(..., return_lse=True)`` returns for those keys). Over the union,

        lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i,

    computed in float32 with the largest ``lse_i`` of each row subtracted first. This is how split-key
    (Flash-Decoding), cascade, prefix-shared and context-parallel attention combine their partial results.
    On CuPy one kernel merges them, the one that merges :func:`attention_with_kvcache`'s key splits (on
    contiguous float32 stacks of the parts: lists, other dtypes and strided arrays are copied into them
    first); on NumPy, array operations.

    Parameters
    ----------
    outs : array (parts, batch, seqlen_q, heads, head_dim), or a list of arrays (batch, seqlen_q, heads, head_dim)
        float16, bfloat16 or float32, all of one dtype; NumPy or CuPy (the kind of every argument).
    lses : float32 array (parts, batch, heads, seqlen_q), or a list of arrays (batch, heads, seqlen_q)
        The parts' logsumexps, finite or ``-inf``: a part whose lse is ``-inf`` for a row (it saw no key there)
        contributes nothing to that row, whatever its output holds. NaN and ``+inf`` are not checked (that
        would read device memory) and propagate.

    Returns
    -------
    out : array (batch, seqlen_q, heads, head_dim), the dtype of ``outs``
    lse : float32 array (batch, heads, seqlen_q)
        A row where every part has ``-inf`` gets output 0 and lse ``-inf``.

    Notes
    -----
    Attention sinks join the union as one more part: compute the parts without ``sinks`` and add a part
    with output 0 and lse the sink (broadcast to ``(batch, heads, seqlen_q)``).

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 2, 16), dtype=np.float32) for _ in range(3))
    >>> halves = [cuflash.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 2), slice(2, 4))]
    >>> out, lse = cuflash.merge_states([o for o, _ in halves], [l for _, l in halves])
    >>> full, full_lse = cuflash.attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full, atol=1e-6) and np.allclose(lse, full_lse, atol=1e-6))
    True
    """
    xp, out_parts, lse_parts = check_merge(outs, lses)
    if xp is not np:
        from . import _cupy_path

        return _cupy_path.merge_states(outs if hasattr(outs, "ndim") else out_parts,
                                       lses if hasattr(lses, "ndim") else lse_parts)
    lse_all = xp.stack(lse_parts)  # (parts, batch, heads, seqlen_q)
    shift = lse_all.max(axis=0)
    shift = xp.where(shift == -xp.inf, xp.float32(0), shift)  # rows no part saw: every weight below is 0
    weights = xp.exp(lse_all - shift)  # exp(lse_i - shift) <= 1; 0 for a part with lse -inf
    total = weights.sum(axis=0)
    seen = total > 0
    lse = xp.where(seen, xp.log(xp.where(seen, total, xp.float32(1))) + shift, xp.float32(-xp.inf))
    inverse = xp.where(seen, xp.float32(1) / xp.where(seen, total, xp.float32(1)), xp.float32(0))
    acc = xp.zeros(out_parts[0].shape, xp.float32)
    for weight, part in zip(weights, out_parts):
        row_weight = (weight * inverse).transpose(0, 2, 1)[..., None]  # (batch, seqlen_q, heads, 1)
        # A part with weight 0 is skipped elementwise: its output (garbage where it saw no key) never counts.
        acc += xp.where(row_weight > 0, row_weight * part.astype(xp.float32, copy=False), xp.float32(0))
    return acc.astype(out_parts[0].dtype, copy=False), lse.astype(xp.float32, copy=False)
