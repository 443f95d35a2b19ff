"""The ring's schedule: which blocks of attention each rank computes at each step of ring attention.

Pure and host-only, so it is proved on the CPU. A sequence of ``seqlen`` positions is sharded over
``world_size`` ranks in one of ``LAYOUTS``; each rank's shard is a few chunks of consecutive positions, held
one after the other in its local arrays. At step ``s`` rank ``r`` holds the keys and values of rank
``(r - s) % world_size``, and attends its queries to them in ``BlockCall``s: rectangles of (local query rows,
local key rows), each an ordinary attention call whose ``diagonal`` places the two chunks' global positions
against each other. Over all steps, each (query, key) pair that the mask lets through is in exactly one call.
"""

from __future__ import annotations

import dataclasses

ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"
#: zigzag: the sequence cut into 2 * world_size chunks, rank r holding chunks r and 2 * world_size - 1 - r, so
#: that under a causal mask every rank has the same work; contiguous: rank r holds the r-th of world_size runs
LAYOUTS = (ZIGZAG, CONTIGUOUS)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Consecutive positions ``start .. start + length - 1`` of the sequence, held at local rows ``local ..``."""

    start: int
    local: int
    length: int


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One attention call of a ring step: local query rows ``q_begin .. q_end - 1`` against local key rows
    ``k_begin .. k_end - 1``. Query row i of the call sees key row j when ``i + diagonal - left <= j <= i +
    diagonal + right`` (a side of -1 unbounded), as :func:`cuflash.attention` takes a window. Where scores
    depend on positions (ALiBi) the rectangle lies within one query chunk and one key chunk, and ``diagonal``
    is their offset, so ALiBi's distance ``|i + diagonal - j|`` is the global one."""

    q_begin: int
    q_end: int
    k_begin: int
    k_end: int
    diagonal: int
    window_left: int
    window_right: int


def chunks(layout: str, rank: int, world_size: int, seqlen_local: int) -> tuple[Chunk, ...]:
    """The chunks of ``rank``'s shard in local order (increasing global positions); chunks that meet in the
    sequence (zigzag at world size 1) are one chunk."""
    if layout == CONTIGUOUS:
        return (Chunk(rank * seqlen_local, 0, seqlen_local),)
    half = seqlen_local // 2
    first, second = Chunk(rank * half, 0, half), Chunk((2 * world_size - 1 - rank) * half, half, half)
    if first.start + half == second.start:
        return (Chunk(first.start, 0, seqlen_local),)
    return first, second


def shard_slices(layout: str, rank: int, world_size: int, seqlen: int) -> tuple[slice, ...]:
    """The global slices of ``rank``'s shard of a sequence of ``seqlen`` positions, in local order."""
    return tuple(slice(c.start, c.start + c.length) for c in chunks(layout, rank, world_size, seqlen // world_size))


def _classify(q: Chunk, k: Chunk, left: int, right: int) -> tuple[str, int]:
    """("none" | "full" | "partial", diagonal) of the rectangle of chunk ``q``'s rows and chunk ``k``'s keys."""
    diagonal = q.start - k.start
    lowest, highest = -(q.length - 1) - diagonal, (k.length - 1) - diagonal   # of key - (row + diagonal)
    if (right >= 0 and lowest > right) or (left >= 0 and highest < -left):
        return "none", diagonal
    if (right < 0 or highest <= right) and (left < 0 or lowest >= -left):
        return "full", diagonal
    return "partial", diagonal


def block_calls(q_chunks: tuple[Chunk, ...], k_chunks: tuple[Chunk, ...], left: int, right: int,
                alibi: bool) -> tuple[BlockCall, ...]:
    """The calls that attend the rows of ``q_chunks`` to the keys of ``k_chunks`` under the window (left,
    right) (causal: right 0; -1 unbounded): every visible (row, key) pair in exactly one call, none that sees
    nothing.

    Where no score depends on positions (no ALiBi), rectangles that are entirely visible are joined: all of
    them into one call, else each query chunk's row of them, else each key chunk's column. Where the two
    shards are the same positions (a rank's own keys) under a causal mask without a left side, one causal
    call on the local rows is exact (local order is global order). Otherwise each chunk pair is its own call,
    masked only on the sides its rectangle crosses."""
    q_chunks = tuple(c for c in q_chunks if c.length)
    k_chunks = tuple(c for c in k_chunks if c.length)
    if not q_chunks or not k_chunks:
        return ()
    kind = {(a, b): _classify(qc, kc, left, right) for a, qc in enumerate(q_chunks) for b, kc in enumerate(k_chunks)}
    q_all = (q_chunks[0].local, q_chunks[-1].local + q_chunks[-1].length)
    k_all = (k_chunks[0].local, k_chunks[-1].local + k_chunks[-1].length)

    def call(q_rows, k_rows, diagonal=0, window=(-1, -1)):
        return BlockCall(*q_rows, *k_rows, diagonal, *window)

    def rows(c: Chunk):
        return c.local, c.local + c.length

    if not alibi:
        if q_chunks == k_chunks and left < 0 and right == 0:
            return (call(q_all, k_all, 0, (-1, 0)),)
        if all(state == "full" for state, _ in kind.values()):
            return (call(q_all, k_all),)
    calls, done = [], set()
    if not alibi:
        for a, qc in enumerate(q_chunks):
            if all(kind[a, b][0] == "full" for b in range(len(k_chunks))):
                calls.append(call(rows(qc), k_all))
                done.update((a, b) for b in range(len(k_chunks)))
        for b, kc in enumerate(k_chunks):
            open_rows = [a for a in range(len(q_chunks)) if (a, b) not in done]
            if len(open_rows) > 1 and all(kind[a, b][0] == "full" for a in open_rows) and open_rows == list(
                    range(open_rows[0], open_rows[-1] + 1)):
                first, last = q_chunks[open_rows[0]], q_chunks[open_rows[-1]]
                calls.append(call((first.local, last.local + last.length), rows(kc)))
                done.update((a, b) for a in open_rows)
    for (a, b), (state, diagonal) in kind.items():
        if state == "none" or (a, b) in done:
            continue
        qc, kc = q_chunks[a], k_chunks[b]
        window = (-1, -1)
        if state == "partial":  # keep only the sides the rectangle crosses
            lowest, highest = -(qc.length - 1) - diagonal, (kc.length - 1) - diagonal
            window = (left if left >= 0 and lowest < -left else -1, right if right >= 0 and highest > right else -1)
        calls.append(call(rows(qc), rows(kc), diagonal, window))
    return tuple(calls)


def ring_schedule(layout: str, rank: int, world_size: int, seqlen_local: int, left: int, right: int,
                  alibi: bool) -> tuple[tuple[int, tuple[BlockCall, ...]], ...]:
    """Per step of the ring: (the rank whose keys ``rank`` holds then, the calls it runs on them)."""
    mine = chunks(layout, rank, world_size, seqlen_local)
    steps = []
    for step in range(world_size):
        source = (rank - step) % world_size
        steps.append((source, block_calls(mine, chunks(layout, source, world_size, seqlen_local), left, right,
                                          alibi)))
    return tuple(steps)
