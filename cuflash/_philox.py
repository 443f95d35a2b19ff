"""The dropout mask: Philox4x32-7 (Salmon et al., SC'11; FlashAttention-2's generator and rounds),
counter-based, so every element's bit is a pure function of (seed, offset, batch, head, row, column).
Seven rounds pass BigCrush in Salmon et al.'s tests; ten (cuRAND's) add a margin that cost 5-8% of the
dropout forward's time on the H200.

One Philox call gives four 32-bit words, read as sixteen 8-bit draws (FlashAttention-2 draws 8 bits too).
The draws of a call go to the sixteen elements that one thread holds of a 16 x 32 block of an mma
accumulator: rows ``r`` and ``r + 8``, columns ``2c``, ``2c + 1``, ``2c + 8``, ``2c + 9`` and each ``+ 16``.
Element (b, h, i, j) of a call with ``heads`` query heads reads

    counter = ((j >> 5) * 4 + ((j >> 1) & 3), (i >> 4) * 8 + (i & 7), b * heads + h, offset)
    key     = (seed & 0xffffffff, seed >> 32)
    word    = 2 * ((j >> 3) & 1) + ((i >> 3) & 1),  its byte 2 * ((j >> 4) & 1) + (j & 1)

and is kept when that draw is at least ``keep_threshold(dropout_p)``, ``dropout_p * 2**8`` rounded (halves
up, at most 255): the dropped share is ``dropout_p`` rounded to a multiple of 2**-8, within 2**-9 of it below
255.5 / 256. Eight bits keep the Philox work at one call per sixteen elements, half of what 16-bit draws cost,
in kernels whose dropout is bound by the generator. The CUDA kernels compute the same function (``Dropout``
in kernels/common.cuh), so the mask does not depend on tiles, launch order or the GPU, and the NumPy path draws
it bit for bit.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)
#: Philox rounds per call (the kernels' kPhiloxRounds)
ROUNDS = 7
MAX_SEED = 2**64
MAX_OFFSET = 2**32


def philox4x32(counter: tuple, key: tuple[int, int], rounds: int = ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32 with ``rounds`` rounds of ``counter`` (four uint32 arrays or ints, broadcast together)
    under ``key`` (two uint32 ints): four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _LOW32 for c in counter)
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        p0, p1 = _M0 * c0, _M1 * c2  # full 64-bit products of 32-bit factors
        c0, c1, c2, c3 = ((p1 >> _SHIFT) ^ c1 ^ np.uint64(k0), p1 & _LOW32,
                          (p0 >> _SHIFT) ^ c3 ^ np.uint64(k1), p0 & _LOW32)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


#: bits of one draw
DRAW_BITS = 8


def keep_threshold(dropout_p: float) -> int:
    """The least 8-bit draw that keeps an element: round(dropout_p * 2**8), halves up, at most 255."""
    return min(int(dropout_p * 2**DRAW_BITS + 0.5), 2**DRAW_BITS - 1)


def keep(seed: int, offset: int, bh, rows, cols, dropout_p: float) -> np.ndarray:
    """Bool, broadcast of ``bh`` (b * heads + h), ``rows`` and ``cols``: True where the element is kept."""
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    counter = ((cols >> 5) * 4 + ((cols >> 1) & 3), (rows >> 4) * 8 + (rows & 7), np.asarray(bh, np.int64), offset)
    words = philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))
    which = 2 * ((cols >> 3) & 1) + ((rows >> 3) & 1)
    word = np.choose(np.broadcast_to(which, np.broadcast_shapes(which.shape, words[0].shape)), words)
    byte = 2 * ((cols >> 4) & 1) + (cols & 1)
    draw = (word >> (DRAW_BITS * byte).astype(np.uint32)) & np.uint32(2**DRAW_BITS - 1)
    return draw >= np.uint32(keep_threshold(dropout_p))


def dropout_mask(batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
                 offset: int = 0) -> np.ndarray:
    """The dropout mask that :func:`cuflash.attention` applies with these arguments: a NumPy bool array
    ``(batch, heads, seqlen_q, seqlen_k)``, True where the probability is kept (and scaled by
    ``1 / (1 - dropout_p)``). The same on every GPU and on the NumPy path, whatever the tiles.

    Examples
    --------
    >>> import cuflash
    >>> m = cuflash.dropout_mask(1, 2, 3, 4, dropout_p=0.5, seed=7)
    >>> m.shape, m.dtype
    ((1, 2, 3, 4), dtype('bool'))
    """
    from ._validate import check_dropout

    dropout_p, seed, offset = check_dropout(dropout_p, seed, offset)
    bh = np.arange(batch * heads).reshape(batch, heads, 1, 1)
    rows = np.arange(seqlen_q).reshape(1, 1, seqlen_q, 1)
    cols = np.arange(seqlen_k).reshape(1, 1, 1, seqlen_k)
    return keep(seed, offset, bh, rows, cols, dropout_p)
