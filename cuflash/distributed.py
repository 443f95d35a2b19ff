"""Context parallelism: exact attention over a sequence sharded across ranks (ring attention).

Each rank holds a shard of the sequence's queries, keys and values. The keys and values travel around a ring
of ranks; at each step a rank attends its queries to the shard it holds while the next one is in flight, and
combines the partial results by their log-sum-exp (:func:`cuflash.merge_states`'s rule) in float32. The
backward sends the key/value gradients around the ring with the shards they belong to; dq stays local.

Communicators: on the GPU, a NCCL communicator from CuPy (``cupy.cuda.nccl.NcclCommunicator``, or the
communicator that ``cupyx.distributed.init_process_group`` returns), one rank per GPU, the shards moving with
NCCL send/recv on a stream of their own; for NumPy arrays, or several ranks in one process (tests, a try-out
on one GPU), :func:`local_communicators` and :func:`run_local`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time

import numpy as np

from . import _numpy_path, _ring
from ._ring import LAYOUTS, ZIGZAG
from ._validate import array_module, check_backward, check_flag, check_forward, optional_arrays

__all__ = ["LAYOUTS", "LocalCommunicator", "PeerFailed", "local_communicators", "ring_attention",
           "ring_attention_backward", "run_local", "shard_sequence", "unshard_sequence"]

#: seconds between a waiting local rank's looks at whether another rank failed
_POLL_S = 0.05
#: seconds a rank of a local group waits for another before it gives up (TimeoutError)
DEFAULT_TIMEOUT_S = 600.0


# --- sharding -------------------------------------------------------------------------------------------------

def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_rank(rank, world_size):
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..world_size - 1 and world_size at least 1, got rank {rank}, "
                         f"world_size {world_size}")


def _check_axis(axis, ndim: int):
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, (bool, np.bool_)) or not -ndim <= axis < ndim:
        raise ValueError(f"axis must be an int in {-ndim}..{ndim - 1} (the sequence axis), got {axis!r}")


def _parts(layout: str, world_size: int) -> int:
    """How many equal chunks a sequence is cut into."""
    return 2 * world_size if layout == ZIGZAG else world_size


def shard_sequence(x, rank: int, world_size: int, layout: str = ZIGZAG, axis: int = 1):
    """Rank ``rank``'s shard of ``x`` along its sequence ``axis``, as :func:`ring_attention` takes it.

    ``zigzag`` (the default) cuts the sequence into ``2 * world_size`` equal chunks and gives rank r chunks r
    and ``2 * world_size - 1 - r``, one after the other: under a causal mask every rank then has the same work.
    ``contiguous`` gives rank r the r-th of ``world_size`` equal runs. The length along ``axis`` must divide
    into those chunks. Returns a new array (a copy) of ``x``'s kind (NumPy or CuPy)."""
    xp = array_module(x=x)
    _check_layout(layout)
    _check_rank(rank, world_size)
    _check_axis(axis, x.ndim)
    seqlen = x.shape[axis]
    if seqlen % _parts(layout, world_size):
        raise ValueError(f"the sequence axis ({seqlen}) must divide into {_parts(layout, world_size)} equal chunks "
                         f"for layout {layout!r} at world_size {world_size}")
    index = [slice(None)] * x.ndim
    pieces = []
    for s in _ring.shard_slices(layout, rank, world_size, seqlen):
        index[axis] = s
        pieces.append(x[tuple(index)])
    return xp.concatenate(pieces, axis=axis)


def unshard_sequence(shards, layout: str = ZIGZAG, axis: int = 1):
    """The whole sequence from every rank's shard (``shards[r]`` rank r's, as :func:`shard_sequence` made it):
    the inverse of :func:`shard_sequence`. Every shard has one shape; returns a new array."""
    _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold one array per rank, got none")
    xp = array_module(**{f"shards[{r}]": s for r, s in enumerate(shards)})
    shape = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape:
            raise ValueError(f"shards[{r}] must have the shape of shards[0] {shape}, got {tuple(s.shape)}")
    _check_axis(axis, len(shape))
    world_size, local = len(shards), shape[axis]
    if layout == ZIGZAG and local % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: its sequence axis must be even, got {local}")
    out = xp.empty(shape[:axis] + (local * world_size,) + shape[axis + 1:], shards[0].dtype)
    index, local_index = [slice(None)] * out.ndim, [slice(None)] * out.ndim
    for rank, shard in enumerate(shards):
        for c in _ring.chunks(layout, rank, world_size, local):
            index[axis], local_index[axis] = slice(c.start, c.start + c.length), slice(c.local, c.local + c.length)
            out[tuple(index)] = shard[tuple(local_index)]
    return out


# --- communicators --------------------------------------------------------------------------------------------

class PeerFailed(RuntimeError):
    """Raised in a rank of a local group that waits on a rank that has failed."""


class _Group:
    """What the communicators of one local group share: an inbox per rank, whether a rank has failed, and how
    long a rank waits for another."""

    def __init__(self, world_size: int, timeout_s: float):
        self.inboxes = [queue.Queue() for _ in range(world_size)]
        self.failed = threading.Event()
        self.timeout_s = timeout_s

    def wait(self, ready, what: str):
        """``ready()``'s value once it is not None, polling; PeerFailed once another rank has failed,
        TimeoutError (saying ``what`` was awaited) after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = ready()
            if value is not None:
                return value
            if self.failed.is_set():
                raise PeerFailed("another rank of the local group failed")
            if time.monotonic() > deadline:
                self.failed.set()
                raise TimeoutError(f"{what} for {self.timeout_s:g} s: does every rank run the same calls, each in a "
                                   "thread of its own (run_local)?")


class LocalCommunicator:
    """One rank of a group of ranks in one process (threads), from :func:`local_communicators`.

    It moves NumPy arrays, or CuPy arrays between ranks that share a device, by copying: a stand-in for a NCCL
    communicator where there is none (tests, CPUs, a try-out on one GPU), with the same results. Unlike NCCL it
    also checks that the ranks agree: each move carries what its call is (the problem, the step), and a rank
    whose neighbour is elsewhere raises ValueError; a rank that waits longer than the group's timeout raises
    TimeoutError, and once one rank failed the others raise PeerFailed."""

    def __init__(self, group: _Group, rank: int, world_size: int):
        self._group = group
        self.rank = rank
        self.world_size = world_size

    def __repr__(self):
        return f"LocalCommunicator(rank={self.rank}, world_size={self.world_size})"

    def _fail(self, error: Exception):
        self._group.failed.set()
        raise error

    def shift(self, sends, recvs, tag=None):
        """Send ``sends`` to the next rank and receive the previous rank's into ``recvs`` (same shapes and
        dtypes); returns once both are done. ``tag``: what this move is; the previous rank's must be equal.
        ValueError where the ranks' arrays or tags disagree."""
        xp = array_module(**{f"a{i}": a for i, a in enumerate(list(sends) + list(recvs))})
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()   # the arrays are complete before another rank reads them
        received = threading.Event()
        previous = (self.rank - 1) % self.world_size
        self._group.inboxes[(self.rank + 1) % self.world_size].put((tuple(sends), tag, received))

        def take():
            try:
                return self._group.inboxes[self.rank].get(timeout=_POLL_S)
            except queue.Empty:
                return None

        arrays, their_tag, sent = self._group.wait(take, f"rank {self.rank} waited for rank {previous}'s move")
        try:
            if their_tag != tag:
                self._fail(ValueError(f"rank {self.rank} is at {tag}, but rank {previous} sent {their_tag}: every "
                                      "rank must make the same calls with the same shapes and options"))
            shapes = [(tuple(a.shape), a.dtype) for a in arrays]
            wanted = [(tuple(b.shape), b.dtype) for b in recvs]
            if shapes != wanted:
                self._fail(ValueError(f"rank {self.rank} expects arrays {wanted} from rank {previous}, which sent "
                                      f"{shapes}: every rank must pass the same shapes and dtypes"))
            for dst, src in zip(recvs, arrays):
                dst[...] = src
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
        finally:
            sent.set()   # the sender may go on (on an error, the failure flag stops the others)
        self._group.wait(lambda: True if received.wait(_POLL_S) else None,
                         f"rank {self.rank} waited for rank {(self.rank + 1) % self.world_size} to take its move")


def local_communicators(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[LocalCommunicator]:
    """``world_size`` communicators of one local group, rank r's at index r; run each rank in its own thread
    (:func:`run_local` does). A rank that waits ``timeout_s`` seconds for another raises TimeoutError."""
    _check_rank(0, world_size)
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    group = _Group(world_size, float(timeout_s))
    return [LocalCommunicator(group, r, world_size) for r in range(world_size)]


def run_local(world_size: int, fn, timeout_s: float = DEFAULT_TIMEOUT_S):
    """``[fn(comm) for each rank]``, each rank in its own thread with its :class:`LocalCommunicator`; the
    results in rank order. An exception in one rank stops the others (their waits raise PeerFailed) and is
    raised here (the lowest failing rank's). ``timeout_s`` as in :func:`local_communicators`."""
    comms = local_communicators(world_size, timeout_s)
    results, errors = [None] * world_size, [None] * world_size

    def rank_main(comm):
        try:
            results[comm.rank] = fn(comm)
        except BaseException as error:   # noqa: BLE001 - re-raised below, in the caller's thread
            errors[comm.rank] = error
            comm._group.failed.set()

    threads = [threading.Thread(target=rank_main, args=(c,), name=f"cuflash-rank-{c.rank}") for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, PeerFailed)), None)
    if first is not None:
        raise first
    return results


#: device id -> the stream the ring's NCCL moves run on (one per device, made at its first ring call)
_move_streams: dict = {}


class _NcclRing:
    """The ring's moves on a NCCL communicator: each shift one NCCL group of sends to the next rank and
    receives from the previous, as bytes, on a stream of its own that first waits for the current stream's
    work; ``wait`` makes the current stream wait for the moves."""

    def __init__(self, comm):
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl, self._comm = cupy, nccl, comm
        self.rank, self.world_size = comm.rank_id(), comm.size()
        self.device_id = comm.device_id()
        self._stream = _move_streams.get(self.device_id)
        if self._stream is None:
            with cupy.cuda.Device(self.device_id):
                self._stream = _move_streams[self.device_id] = cupy.cuda.Stream(non_blocking=True)

    def start(self, sends, recvs, tag=None):
        """Start the move; ``tag`` (what the move is, for a local group's check) is not sent."""
        cupy, nccl = self._cupy, self._nccl
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        peer_next, peer_prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        nccl.groupStart()
        try:
            for a in sends:
                self._comm.send(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, peer_next, self._stream.ptr)
            for b in recvs:
                self._comm.recv(b.data.ptr, b.nbytes, nccl.NCCL_UINT8, peer_prev, self._stream.ptr)
        finally:
            nccl.groupEnd()
        return self._stream.record()

    def wait(self, moved):
        self._cupy.cuda.get_current_stream().wait_event(moved)


class _LocalRing:
    """The ring's moves on a :class:`LocalCommunicator`: each shift done when ``start`` returns."""

    def __init__(self, comm: LocalCommunicator):
        self._comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size

    def start(self, sends, recvs, tag=None):
        self._comm.shift(sends, recvs, tag)

    def wait(self, moved):
        pass


def _ring_of(comm, xp, device_id):
    """The ring over ``comm`` for arrays of ``xp`` (on ``device_id``); TypeError for a communicator it cannot
    use, ValueError for one on another device."""
    if isinstance(comm, LocalCommunicator):
        return _LocalRing(comm)
    nccl_comm = comm if hasattr(comm, "rank_id") else getattr(comm, "_comm", None)   # cupyx.distributed's holds one
    if nccl_comm is None or not all(hasattr(nccl_comm, m) for m in ("rank_id", "size", "send", "recv", "device_id")):
        raise TypeError("comm must be a cupy.cuda.nccl.NcclCommunicator, the communicator of "
                        "cupyx.distributed.init_process_group, or a cuflash.distributed.LocalCommunicator, got "
                        f"{type(comm).__module__}.{type(comm).__name__}")
    if xp is np:
        raise TypeError("a NCCL communicator moves CuPy arrays; NumPy arrays take a LocalCommunicator "
                        "(cuflash.distributed.local_communicators)")
    if nccl_comm.device_id() != device_id:
        raise ValueError(f"the communicator is on device {nccl_comm.device_id()}, the arrays on device {device_id}")
    return _NcclRing(nccl_comm)


# --- the block calls --------------------------------------------------------------------------------------------

def _block_problem(p, call: _ring.BlockCall, sinks: bool):
    """The problem of one block call (the shard's, narrowed to the call's rows and keys)."""
    return dataclasses.replace(p, seqlen_q=call.q_end - call.q_begin, seqlen_k=call.k_end - call.k_begin,
                               causal=False, diagonal=call.diagonal, window_left=call.window_left,
                               window_right=call.window_right, sinks=sinks)


#: CuPy plans of block calls, kept across ring calls (a training loop repeats its shapes): (pass, problem, device,
#: deterministic, the arrays' shapes and strides) -> the plan's run; emptied when full, as cuflash's own plans
_block_plans: dict = {}
MAX_BLOCK_PLANS = 1024


class _Blocks:
    """Runs block calls on the NumPy path or the CuPy kernels, with the CuPy plans made once per geometry."""

    def __init__(self, xp, device_id, deterministic: bool = False):
        self.xp, self.device_id, self.deterministic = xp, device_id, deterministic

    def _plan(self, kind, p, *arrays):
        from . import _cupy_path

        key = (kind, p, self.device_id, self.deterministic) + tuple((a.shape, a.strides) for a in arrays)
        plan = _block_plans.get(key)
        if plan is None:
            if kind == "forward":
                plan = _cupy_path.ForwardPlan(p, self.device_id, *arrays).run
            else:
                plan = _cupy_path.BackwardPlan(p, self.device_id, self.deterministic, *arrays).run
            if len(_block_plans) >= MAX_BLOCK_PLANS:
                _block_plans.clear()
            _block_plans[key] = plan
        return plan

    def forward(self, p, q, k, v, alibi_slopes, sinks):
        """(out, lse) of attention of ``q`` to ``k``, ``v`` under ``p``."""
        if self.xp is np:
            return _numpy_path.forward(q, k, v, p, alibi_slopes, sinks)
        return self._plan("forward", p, q, k, v)(q, k, v, alibi_slopes, sinks)

    def backward(self, p, dout, q, k, v, out, lse, alibi_slopes, sinks):
        """(dq, dk, dv[, dsinks]) of one block, its probabilities from the whole row's ``lse``."""
        if self.xp is np:
            return _numpy_path.backward(dout, q, k, v, out, lse, p, alibi_slopes, sinks)
        return self._plan("backward", p, dout, q, k, v, out, lse)(dout, q, k, v, out, lse, alibi_slopes, sinks)


def _merge_into(xp, acc, acc_lse, rows: slice, part, part_lse, sinks=None):
    """Merge a part over more keys into the float32 state (acc (batch, rows, heads, head_dim), acc_lse (batch,
    heads, rows)) of ``rows``, in place: lse = log(exp(acc_lse) + exp(part_lse)), acc weighted by the two
    shares; ``part`` None: the sinks (heads,) join every row as parts of output 0. A part whose lse is -inf adds
    nothing. On CuPy one kernel (kernels/merge.cu, merge_into); on NumPy, array operations."""
    if xp is not np:
        from . import _cupy_path

        _cupy_path.merge_into(acc, acc_lse, rows.start or 0, part, part_lse, sinks)
        return
    if part is None:
        part_lse = np.broadcast_to(sinks[None, :, None], acc_lse.shape)
    old = acc_lse[:, :, rows]
    new = np.logaddexp(old, part_lse)
    seen = new != -np.inf
    base = np.where(seen, new, np.float32(0))
    keep = np.where(seen, np.exp(old - base), np.float32(0)).transpose(0, 2, 1)[..., None]
    block = acc[:, rows] * keep
    if part is not None:
        share = np.where(seen, np.exp(part_lse - base), np.float32(0)).transpose(0, 2, 1)[..., None]
        block += np.where(share > 0, share * part.astype(np.float32, copy=False), np.float32(0))
    acc[:, rows] = block
    acc_lse[:, :, rows] = new


def _sink_call(schedule, seqlen_local: int):
    """(step, index) of the first call that covers every local query row (it takes the sinks, so that a rank
    whose whole schedule is one call runs exactly :func:`cuflash.attention`), or None."""
    for step, (_, calls) in enumerate(schedule):
        for i, c in enumerate(calls):
            if c.q_begin == 0 and c.q_end == seqlen_local:
                return step, i
    return None


def _single_call(schedule, seqlen_local: int):
    """The schedule's only call when it has one and that call covers every local query row, else None."""
    calls = [c for _, step_calls in schedule for c in step_calls]
    if len(calls) == 1 and calls[0].q_begin == 0 and calls[0].q_end == seqlen_local:
        return calls[0]
    return None


class _MergedOutput:
    """This rank's output built from the ring's parts: float32 state (batch, rows, heads, head_dim) and its lse
    (batch, heads, rows), each part merged in by its lse, rounded to q's dtype once at the end."""

    def __init__(self, xp, q, lse_shape):
        self.xp, self.dtype = xp, q.dtype
        self.acc = xp.zeros(q.shape, xp.float32)
        self.lse = xp.full(lse_shape, -xp.inf, xp.float32)

    def add(self, rows: slice, part, part_lse):
        _merge_into(self.xp, self.acc, self.lse, rows, part, part_lse)

    def add_sinks(self, sinks):
        """The sinks (heads,) join each row once, as parts of output 0."""
        _merge_into(self.xp, self.acc, self.lse, slice(None), None, None, sinks)

    def result(self):
        return self.acc.astype(self.dtype), self.lse


class _OneCallOutput:
    """The output of a rank whose schedule is one call over all its rows (world size 1, for one): that call's
    result as it comes, with no float32 state, no merge and no rounding beyond attention's own. The call takes
    the sinks (``_sink_call``), so none join afterwards."""

    def add(self, rows: slice, part, part_lse):
        self.out, self.lse = part, part_lse

    def result(self):
        return self.out, self.lse


def _setup(xp, q, comm, layout, p):
    """The ring and the schedule of this rank."""
    _check_layout(layout)
    if p.seqlen_q != p.seqlen_k:
        raise ValueError(f"ring attention attends a sequence to itself: q and k must be shards of one length, got "
                         f"seqlen {p.seqlen_q} (q) and {p.seqlen_k} (k, v)")
    if layout == ZIGZAG and p.seqlen_q % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: seqlen of q must be even, got {p.seqlen_q}")
    device_id = None if xp is np else q.data.device_id
    ring = _ring_of(comm, xp, device_id)
    schedule = _ring.ring_schedule(layout, ring.rank, ring.world_size, p.seqlen_q, p.window_left, p.window_right,
                                   p.alibi_shape is not None)
    return ring, schedule, device_id


def _receive_buffers(xp, ring, arrays) -> list:
    """Two sets of buffers like ``arrays`` that the ring's moves alternate between (none at world size 1)."""
    if ring.world_size == 1:
        return []
    return [tuple(xp.empty(a.shape, a.dtype) for a in arrays) for _ in range(2)]


def ring_attention(q, k, v, comm, causal: bool = False, softmax_scale: float | None = None,
                   return_lse: bool = False, *, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   alibi_slopes=None, sinks=None, layout: str = ZIGZAG):
    """This rank's shard of exact attention over a sequence sharded across the ranks of ``comm``.

    Every rank calls it at once with its shards and the same options. The keys and values go around the ring
    (``world_size - 1`` moves, each overlapped with the attention to the shard before it); the result equals
    :func:`cuflash.attention` on the whole sequence, sharded (to float32 rounding of the merges).

    Parameters
    ----------
    q : array (batch, seqlen_local, heads, head_dim)
        This rank's queries, as :func:`shard_sequence` cuts them with ``layout``.
    k, v : arrays (batch, seqlen_local, heads_kv, head_dim)
        This rank's keys and values (GQA: only the kv heads travel).
    comm
        A ``cupy.cuda.nccl.NcclCommunicator`` or ``cupyx.distributed.init_process_group``'s communicator
        (CuPy arrays on its device), or a :class:`LocalCommunicator` (NumPy arrays, or CuPy arrays on one
        device). Its rank and size give this rank's place in the ring.
    causal, softmax_scale, window_size, softcap, alibi_slopes, sinks
        As in :func:`cuflash.attention`, over the whole sequence (whose query and key lengths are equal, so
        both alignments are one). ``alibi_slopes`` and ``sinks`` are the same on every rank.
    return_lse : bool
        Also return this rank's rows of the logsumexp, float32 (batch, heads, seqlen_local).
    layout : "zigzag" or "contiguous"
        How the sequence is sharded (:func:`shard_sequence`); zigzag balances a causal mask.

    Returns
    -------
    out : array (batch, seqlen_local, heads, head_dim), dtype of q; and lse with ``return_lse``.

    Notes
    -----
    Each block of the ring is a :func:`cuflash.attention` call (the chunks' global positions set its mask
    and ALiBi); the partial results are merged in float32 and rounded once. Memory beyond the output: a
    float32 accumulator of the output's shape (none where this rank's schedule is one call over all its rows, as
    at world size 1: that call's result is returned as it comes), and two receive buffers of k's and v's
    shapes. Dropout is not offered. With a NCCL communicator the moves run on a stream of their own, ordered
    against CuPy's current stream; the call does not synchronize the host.
    """
    xp = array_module(q=q, k=k, v=v, **optional_arrays(alibi_slopes=alibi_slopes, sinks=sinks))
    p = check_forward(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks)
    check_flag("return_lse", return_lse)
    ring, schedule, device_id = _setup(xp, q, comm, layout, p)
    blocks = _Blocks(xp, device_id)
    with _on_device(xp, device_id):
        if p.is_empty:   # no rows or no heads: nothing moves
            from . import _no_keys

            out, lse = _no_keys(xp, q, (p.batch, p.heads, p.seqlen_q), sinks)
            return (out, lse) if return_lse else out
        sink_at = _sink_call(schedule, p.seqlen_q) if sinks is not None else None
        output = (_OneCallOutput() if _single_call(schedule, p.seqlen_q) is not None
                  else _MergedOutput(xp, q, (p.batch, p.heads, p.seqlen_q)))
        held = (k, v)
        receive = _receive_buffers(xp, ring, (k, v))
        for step, (_, calls) in enumerate(schedule):
            moving = step + 1 < ring.world_size
            if moving:   # ``sending`` stays referenced until the move is waited for (a copy's memory must live)
                sending = tuple(xp.ascontiguousarray(x) for x in held)
                moved = ring.start(sending, receive[step % 2], ("ring_attention", layout, p, step, "k, v"))
            for i, call in enumerate(calls):
                with_sinks = sink_at == (step, i)
                rows, keys = slice(call.q_begin, call.q_end), slice(call.k_begin, call.k_end)
                part, part_lse = blocks.forward(_block_problem(p, call, with_sinks), q[:, rows], held[0][:, keys],
                                                held[1][:, keys], alibi_slopes, sinks if with_sinks else None)
                output.add(rows, part, part_lse)
            if moving:
                ring.wait(moved)
                held = receive[step % 2]
                del sending
        if sinks is not None and sink_at is None:
            output.add_sinks(sinks)
        out, lse = output.result()
    return (out, lse) if return_lse else out


def ring_attention_backward(dout, q, k, v, out, lse, comm, causal: bool = False, softmax_scale: float | None = None,
                            deterministic: bool = False, *, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, alibi_slopes=None, sinks=None, layout: str = ZIGZAG):
    """Gradients of :func:`ring_attention` with respect to this rank's q, k and v shards (and the sinks).

    Every rank calls it at once. The keys and values go around the ring again, each shard's dk and dv
    accumulators (float32) travelling with it and arriving back at its owner after ``world_size`` moves; dq
    is summed locally. Each block's gradients come from :func:`cuflash.attention_backward` with the whole
    row's ``out`` and ``lse``.

    Parameters
    ----------
    dout, out : arrays (batch, seqlen_local, heads, head_dim)
        This rank's rows of the gradient of the loss and of the forward's output.
    q, k, v, comm, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, layout
        As given to :func:`ring_attention`.
    lse : float32 array (batch, heads, seqlen_local)
        This rank's logsumexp from ``ring_attention(..., return_lse=True)``.
    deterministic : bool
        As in :func:`cuflash.attention_backward`; for a fixed world size the sums around the ring are in a
        fixed order too, so the gradients are bitwise reproducible.

    Returns
    -------
    dq : array (batch, seqlen_local, heads, head_dim); dk, dv : arrays (batch, seqlen_local, heads_kv,
    head_dim), dtype of q: this rank's shards of the gradients.
    dsinks : float32 (heads,), only with ``sinks``: this rank's rows' share; the gradient of the sinks is
    the sum of every rank's (reduce it with the other replicated parameters' gradients).
    """
    xp = array_module(dout=dout, q=q, k=k, v=v, out=out, lse=lse,
                      **optional_arrays(alibi_slopes=alibi_slopes, sinks=sinks))
    p = check_backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks)
    check_flag("deterministic", deterministic)
    ring, schedule, device_id = _setup(xp, q, comm, layout, p)
    blocks = _Blocks(xp, device_id, bool(deterministic))
    with _on_device(xp, device_id):
        if p.is_empty:
            from . import _zero_gradients

            return _zero_gradients(xp, q, k, v, sinks)
        whole = _single_call(schedule, p.seqlen_q)
        if ring.world_size == 1 and whole is not None and (whole.k_begin, whole.k_end) == (0, p.seqlen_k):
            # one call over the whole shard and nothing to send: its gradients, as attention_backward's
            return blocks.backward(_block_problem(p, whole, sinks is not None), dout, q, k, v, out, lse,
                                   alibi_slopes, sinks)
        dq = xp.zeros(q.shape, xp.float32)
        # float32 dk, dv of the shard held: this step's sums (two pairs, the other one perhaps still on its
        # way to the next rank), and the previous ranks' sums for it, received during this step's work
        step_dkv = [tuple(xp.empty(x.shape, xp.float32) for x in (k, v)) for _ in range(min(ring.world_size, 2))]
        arrived = tuple(xp.empty(x.shape, xp.float32) for x in (k, v)) if ring.world_size > 1 else ()
        sink_at = _sink_call(schedule, p.seqlen_q) if sinks is not None else None
        dsinks = None
        held = (k, v)
        receive = _receive_buffers(xp, ring, (k, v))
        dkv_moved = None
        for step, (_, calls) in enumerate(schedule):
            moving = step + 1 < ring.world_size
            if moving:
                sending = tuple(xp.ascontiguousarray(x) for x in held)
                moved = ring.start(sending, receive[step % 2], ("ring_attention_backward", layout, p, step, "k, v"))
            dk, dv = step_dkv[step % 2]
            dk.fill(0)
            dv.fill(0)
            for i, call in enumerate(calls):
                with_sinks = sink_at == (step, i)
                rows, keys = slice(call.q_begin, call.q_end), slice(call.k_begin, call.k_end)
                grads = blocks.backward(_block_problem(p, call, with_sinks), dout[:, rows], q[:, rows],
                                        held[0][:, keys], held[1][:, keys], out[:, rows], lse[:, :, rows],
                                        alibi_slopes, sinks if with_sinks else None)
                dq[:, rows] += grads[0]
                dk[:, keys] += grads[1]
                dv[:, keys] += grads[2]
                if with_sinks:
                    dsinks = grads[3]
            if ring.world_size > 1:   # add the previous ranks' sums; send them on (after the last step: home)
                if step:
                    ring.wait(dkv_moved)
                    dk += arrived[0]
                    dv += arrived[1]
                dkv_moved = ring.start((dk, dv), arrived, ("ring_attention_backward", layout, p, step, "dk, dv"))
            if moving:
                ring.wait(moved)
                held = receive[step % 2]
                del sending
        if ring.world_size > 1:
            ring.wait(dkv_moved)
            dk, dv = arrived
        grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
        if sinks is None:
            return grads
        if dsinks is None:   # d lse / d sink = exp(sink - lse) per row: dsinks = -sum exp(sink - lse) * delta
            delta = (dout.astype(xp.float32) * out.astype(xp.float32)).sum(axis=-1).transpose(0, 2, 1)
            dsinks = -(xp.exp(sinks[None, :, None] - lse) * delta).sum(axis=(0, 2)).astype(xp.float32)
    return (*grads, dsinks)


def _on_device(xp, device_id):
    """The context a call's CuPy work runs in: its arrays' device (nothing for NumPy)."""
    return contextlib.nullcontext() if xp is np else xp.cuda.Device(device_id)
