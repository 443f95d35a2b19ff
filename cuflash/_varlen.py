"""Variable-length batches (attention_varlen): validation of the packed layout, the problem the packed kernels
run (a batch of the longest sequences' lengths), and the per-sequence loop of the NumPy path and the reference.
Dropout draws sequence b's mask from batch entry b's stream, its rows and keys counted from the sequence's start:
the mask of a dense batch of the longest lengths (``cuflash.dropout_mask``), cut to each sequence.

Sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q`` (total_q, heads, head_dim) and rows
``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of ``k`` and ``v`` (total_k, heads_kv, head_dim); ``lse`` is
(heads, total_q).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ._kvcache import sequence_slopes, to_host
from ._validate import (_INT32_MAX, Problem, _check_4d, _check_dtype, _is_number, check_block_table_entries,
                        check_block_table_type, check_dropout, check_flag, check_head_vectors, check_heads,
                        check_same_device, check_softcap, check_window, resolve_scale)


@dataclasses.dataclass(frozen=True)
class Packing:
    """The sequences of a packed batch, on the host: the prefix sums, sequence ``b`` from ``cu_q[b]`` and
    ``cu_k[b]`` to the next entries."""

    cu_q: np.ndarray  # int64 (batch + 1,)
    cu_k: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.cu_q) - 1

    def rows(self, b: int) -> tuple[slice, slice]:
        return slice(int(self.cu_q[b]), int(self.cu_q[b + 1])), slice(int(self.cu_k[b]), int(self.cu_k[b + 1]))


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """What a packed call's plan needs: the number of sequences and the longest lengths; ``packing``, the
    prefix sums on the host, where they were read (None where the call trusted them)."""

    batch: int
    max_q: int
    max_k: int
    packing: Packing | None


def check_prefix_sums(name: str, cu):
    """``cu`` is an int32 array (batch + 1,) (its values are checked where they are read)."""
    if not hasattr(cu, "dtype") or cu.dtype != np.int32 or cu.ndim != 1 or cu.shape[0] < 1:
        raise TypeError(f"{name} must be an int32 array (batch + 1,) of prefix sums, got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}")


def check_packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, read: bool) -> PackedBatch:
    """Validate the packed layout. With ``read`` (or where a max length is missing), the prefix sums are read to
    the host (on CuPy a synchronizing copy) and checked there: 0 first, never decreasing, ending at the packed
    length, within the given max lengths. Otherwise only what needs no device read (their dtype, shape and
    device, and the max lengths' types)."""
    for name, a, layout in (("q", q, "(total_q, heads, head_dim)"), ("k", k, "(total_k, heads_kv, head_dim)"),
                            ("v", v, "(total_k, heads_kv, head_dim)")):
        if a.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions {layout}, got {a.ndim} (shape {tuple(a.shape)})")
        _check_dtype(name, a)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    check_heads(q.shape[1], k.shape[1], q.shape[2], k.shape[2], "k and v")
    check_same_device(q=q, k=k, v=v)
    for name, total in (("q", q.shape[0]), ("k", k.shape[0])):
        if total > _INT32_MAX:
            raise ValueError(f"{name} packs {total} rows, past int32: the int32 prefix sums cannot reach them")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_prefix_sums(name, cu)
        check_same_device(q=q, **{name: cu})
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got {cu_seqlens_q.shape[0]} "
                         f"and {cu_seqlens_k.shape[0]}")
    for name, given, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if given is not None and (not _is_number(given, numbers.Integral) or not 0 <= given <= total):
            raise ValueError(f"{name} must be an int of at least the longest sequence and at most the packed "
                             f"length {total}, got {given!r}")
    batch = cu_seqlens_q.shape[0] - 1
    if not read and max_seqlen_q is not None and max_seqlen_k is not None:
        return PackedBatch(batch, int(max_seqlen_q), int(max_seqlen_k), None)
    cus = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        host = to_host(cu).astype(np.int64)
        if host[0] != 0 or (np.diff(host) < 0).any() or host[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}, got "
                             f"{host.tolist() if host.size <= 16 else host}")
        cus.append(host)
    longest = []
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cus[0]), ("max_seqlen_k", max_seqlen_k, cus[1])):
        longest.append(int(np.diff(cu).max(initial=0)))
        if given is not None and given < longest[-1]:
            raise ValueError(f"{name} must be an int of at least the longest sequence ({longest[-1]}), got {given!r}")
    return PackedBatch(batch, max_seqlen_q if max_seqlen_q is not None else longest[0],
                       max_seqlen_k if max_seqlen_k is not None else longest[1], Packing(*cus))


def problem(q, k, packed: PackedBatch, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
            dropout_p) -> Problem:
    """The packed kernels' problem: a batch of ``packed.batch`` sequences of the longest lengths, each
    sequence's diagonal at its own bottom-right corner (the kernels place it; ``diagonal`` here is the
    longest's). Checks the options once for the whole batch (an empty one included)."""
    check_flag("causal", causal)
    left, right = check_window(window_size, causal)
    alibi_shape = check_head_vectors(q, alibi_slopes, sinks, packed.batch, q.shape[1])
    dropout_p, _, _ = check_dropout(dropout_p, 0, 0)
    return Problem(packed.batch, packed.max_q, packed.max_k, q.shape[1], k.shape[1], q.shape[2], np.dtype(q.dtype),
                   bool(causal), resolve_scale(softmax_scale, q.shape[2]), left, right, packed.max_k - packed.max_q,
                   check_softcap(softcap), alibi_shape, sinks is not None, dropout_p)


def per_sequence_forward(xp, attend, packing: Packing, q, k, v, alibi_slopes):
    """out (total_q, heads, head_dim) and lse (heads, total_q) from one dense forward per sequence:
    ``attend(b, q_b, k_b, v_b, slopes_b) -> (out_b, lse_b)`` on sequence b as a batch of one (its ALiBi slopes
    ``(heads,)``); b also names the dropout stream (the packed kernels' batch entry b)."""
    out = xp.zeros(q.shape, q.dtype)
    lse = xp.empty((q.shape[1], q.shape[0]), np.float32)
    for b in range(packing.batch):
        rows_q, rows_k = packing.rows(b)
        if rows_q.start == rows_q.stop:
            continue
        out_b, lse_b = attend(b, q[rows_q][None], k[rows_k][None], v[rows_k][None],
                              sequence_slopes(alibi_slopes, b))
        out[rows_q] = out_b[0]
        lse[:, rows_q] = lse_b[0]
    return out, lse


def per_sequence_backward(xp, attend_backward, packing: Packing, dout, q, k, v, out, lse, alibi_slopes, sinks):
    """(dq, dk, dv[, dsinks summed over the sequences]) from one dense backward per sequence:
    ``attend_backward(b, dout_b, q_b, k_b, v_b, out_b, lse_b, slopes_b) -> (dq_b, dk_b, dv_b[, dsinks_b])``, as
    in :func:`per_sequence_forward`."""
    grads = [xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)]
    dsinks = None if sinks is None else xp.zeros(sinks.shape, np.float32)
    for b in range(packing.batch):
        rows_q, rows_k = packing.rows(b)
        if rows_q.start == rows_q.stop and rows_k.start == rows_k.stop:
            continue
        parts = attend_backward(b, dout[rows_q][None], q[rows_q][None], k[rows_k][None], v[rows_k][None],
                                out[rows_q][None], xp.ascontiguousarray(lse[:, rows_q][None]),
                                sequence_slopes(alibi_slopes, b))
        for grad, part, rows in zip(grads, parts[:3], (rows_q, rows_k, rows_k)):
            grad[rows] = part[0]
        if sinks is not None:
            dsinks += parts[3]
    return (*grads, dsinks) if sinks is not None else tuple(grads)


def check_pages(k, v, cu_seqlens_k, block_table):
    """Validate a packed call's paged keys (attention_varlen with ``block_table``): k and v caches (num_blocks,
    page_size, heads_kv, head_dim) of one shape, block_table int32 (batch, max_blocks_per_sequence) for the batch
    of cu_seqlens_k, on k's device. Their values are not read here (gather_pages reads the total)."""
    for name, a in (("k", k), ("v", v)):
        _check_4d(name, a, "(num_blocks, page_size, heads_kv, head_dim) with block_table")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_block_table_type(block_table)
    check_prefix_sums("cu_seqlens_k", cu_seqlens_k)
    if block_table.shape[0] != cu_seqlens_k.shape[0] - 1:
        raise ValueError(f"block_table must have a row per sequence (batch = len(cu_seqlens_k) - 1 = "
                         f"{cu_seqlens_k.shape[0] - 1}), got {block_table.shape[0]}")
    if k.shape[1] == 0:
        raise ValueError("the paged caches' page_size (k.shape[1]) must be positive, got 0")
    check_same_device(k=k, block_table=block_table)


def gather_pages(xp, k, v, cu_seqlens_k, block_table, check: bool):
    """The packed (total_k, heads_kv, head_dim) keys and values of paged caches: sequence b's key n is row
    n % page_size of page block_table[b, n // page_size]. Reads the total cu_seqlens_k[-1] to the host (on CuPy
    a synchronizing copy); with ``check`` the prefix sums and the block_table entries used too (ValueError)."""
    page_size, num_pages = k.shape[1], k.shape[0]
    if check:
        cu = to_host(cu_seqlens_k).astype(np.int64)
        lengths = np.diff(cu)
        if cu[0] != 0 or (lengths < 0).any():
            raise ValueError(f"cu_seqlens_k must be prefix sums from 0, never decreasing, got {cu.tolist()}")
        room = block_table.shape[1] * page_size
        if (lengths > room).any():
            b = int(np.flatnonzero(lengths > room)[0])
            raise ValueError(f"sequence {b} has {lengths[b]} keys, past its block_table's {room}")
        check_block_table_entries(to_host(block_table), lengths, page_size, num_pages)
    total = int(to_host(cu_seqlens_k[-1:])[0])
    starts = cu_seqlens_k.astype(np.int64)
    at = xp.arange(total, dtype=np.int64)
    sequence = xp.searchsorted(starts, at, side="right") - 1
    n = at - starts[sequence]
    pages = block_table[sequence, n // page_size]
    rows = n % page_size
    return k[pages, rows], v[pages, rows]
