"""Variable-length batches (attention_varlen): validation of the packed layout and, for now, the call as one
dense attention per sequence on either path.

Sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q`` (total_q, heads, head_dim) and rows
``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of ``k`` and ``v`` (total_k, heads_kv, head_dim); ``lse`` is
(heads, total_q). The per-sequence loop costs a launch (or a few) per sequence: fused kernels that walk the
packed rows directly are the next step (issue 16).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ._kvcache import sequence_slopes, to_host
from ._validate import _check_dtype, _is_number, check_same_device


@dataclasses.dataclass(frozen=True)
class Packing:
    """The sequences of a packed batch, on the host: ``starts_q[b]``, ``starts_k[b]`` and their ends."""

    cu_q: np.ndarray  # int64 (batch + 1,)
    cu_k: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.cu_q) - 1

    def rows(self, b: int) -> tuple[slice, slice]:
        return slice(int(self.cu_q[b]), int(self.cu_q[b + 1])), slice(int(self.cu_k[b]), int(self.cu_k[b + 1]))


def check_packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packing:
    """Validate the packed layout; reads the cu_seqlens to the host (on CuPy a synchronizing copy)."""
    for name, a, layout in (("q", q, "(total_q, heads, head_dim)"), ("k", k, "(total_k, heads_kv, head_dim)"),
                            ("v", v, "(total_k, heads_kv, head_dim)")):
        if a.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions {layout}, got {a.ndim} (shape {tuple(a.shape)})")
        _check_dtype(name, a)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim must match: q {q.shape[2]}, k and v {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of heads_kv of k and v ({k.shape[1]}), which "
                         "must be positive")
    cus = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not hasattr(cu, "dtype") or cu.dtype != np.int32 or cu.ndim != 1 or cu.shape[0] < 1:
            raise TypeError(f"{name} must be an int32 array (batch + 1,) of prefix sums, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}")
        check_same_device(q=q, **{name: cu})
        host = to_host(cu).astype(np.int64)
        if host[0] != 0 or (np.diff(host) < 0).any() or host[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}, got "
                             f"{host.tolist() if host.size <= 16 else host}")
        cus.append(host)
    if cus[0].shape != cus[1].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got {cus[0].shape[0]} and "
                         f"{cus[1].shape[0]}")
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cus[0]), ("max_seqlen_k", max_seqlen_k, cus[1])):
        longest = int(np.diff(cu).max(initial=0))
        if given is not None and (not _is_number(given, numbers.Integral) or given < longest):
            raise ValueError(f"{name} must be an int of at least the longest sequence ({longest}), got {given!r}")
    return Packing(*cus)


def per_sequence_forward(xp, attention, packing: Packing, q, k, v, alibi_slopes, options: dict):
    """out (total_q, heads, head_dim) and lse (heads, total_q) from one dense ``attention`` per sequence."""
    out = xp.zeros(q.shape, q.dtype)
    lse = xp.empty((q.shape[1], q.shape[0]), np.float32)
    for b in range(packing.batch):
        rows_q, rows_k = packing.rows(b)
        if rows_q.start == rows_q.stop:
            continue
        out_b, lse_b = attention(q[rows_q][None], k[rows_k][None], v[rows_k][None], return_lse=True,
                                 alibi_slopes=sequence_slopes(alibi_slopes, b), **options)
        out[rows_q] = out_b[0]
        lse[:, rows_q] = lse_b[0]
    return out, lse


def per_sequence_backward(xp, attention_backward, packing: Packing, dout, q, k, v, out, lse, alibi_slopes, sinks,
                          options: dict):
    """(dq, dk, dv[, dsinks summed over the sequences]) from one dense ``attention_backward`` per sequence."""
    grads = [xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)]
    dsinks = None if sinks is None else xp.zeros(sinks.shape, np.float32)
    for b in range(packing.batch):
        rows_q, rows_k = packing.rows(b)
        if rows_q.start == rows_q.stop and rows_k.start == rows_k.stop:
            continue
        parts = attention_backward(dout[rows_q][None], q[rows_q][None], k[rows_k][None], v[rows_k][None],
                                   out[rows_q][None], xp.ascontiguousarray(lse[:, rows_q][None]),
                                   alibi_slopes=sequence_slopes(alibi_slopes, b), sinks=sinks, **options)
        for grad, part, rows in zip(grads, parts[:3], (rows_q, rows_k, rows_k)):
            grad[rows] = part[0]
        if sinks is not None:
            dsinks += parts[3]
    return (*grads, dsinks) if sinks is not None else tuple(grads)
