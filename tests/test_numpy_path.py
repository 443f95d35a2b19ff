"""The NumPy path's walk over key blocks: under a causal mask or a window it skips what no query row sees."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from cuflash import _numpy_path, reference
from cuflash._validate import Problem

windows = st.tuples(st.integers(-1, 300), st.integers(-1, 300))


def _problem(seqlen_q, seqlen_k, causal, window=(-1, -1), alignment="bottom_right"):
    left, right = window[0], 0 if causal else window[1]
    diagonal = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    return Problem(1, seqlen_q, seqlen_k, 1, 1, 64, np.dtype(np.float32), causal, 0.125, left, right, diagonal)


@given(seqlen_q=st.integers(1, 700), seqlen_k=st.integers(1, 700), causal=st.booleans(), window=windows,
       alignment=st.sampled_from(["bottom_right", "top_left"]))
@example(seqlen_q=300, seqlen_k=700, causal=False, window=(0, 0), alignment="top_left")  # blocks past the rows
def test_key_blocks_cover_exactly_the_visible_pairs(seqlen_q, seqlen_k, causal, window, alignment):
    visible = reference.mask(seqlen_q, seqlen_k, causal, window, alignment)
    computed = np.zeros_like(visible)
    for n0, n1, r0, r1, block_visible in _numpy_path._key_blocks(_problem(seqlen_q, seqlen_k, causal, window,
                                                                           alignment)):
        block = visible[:, n0:n1]
        assert block.any(), (n0, n1)  # no block that no row sees
        assert not block[:r0].any() and not block[r1:].any()  # the rows skipped see none of its keys
        assert block[r0].any() and block[r1 - 1].any()  # the first and last rows walked see some
        want = block[r0:r1]
        np.testing.assert_array_equal(want, np.ones_like(want) if block_visible is None else block_visible)
        computed[r0:r1, n0:n1] = True
    assert not (visible & ~computed).any()  # every visible pair is computed


def test_causal_computes_about_half_of_full_at_seqlen_1024():
    def work(causal):
        return sum((r1 - r0) * (n1 - n0) for n0, n1, r0, r1, _ in _numpy_path._key_blocks(_problem(1024, 1024, causal)))

    assert work(True) / work(False) <= 0.57  # 0.5 and one block's diagonal


def test_a_window_walks_blocks_near_the_diagonal_only():
    def work(window):
        p = _problem(4096, 4096, False, window)
        return sum((r1 - r0) * (n1 - n0) for n0, n1, r0, r1, _ in _numpy_path._key_blocks(p))

    assert work((256, 0)) / work((-1, -1)) <= (256 + 2 * _numpy_path.BLOCK_N) / 4096
