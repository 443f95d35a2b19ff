"""The NumPy path's walk over key blocks: under the causal mask it skips what no query row sees."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cuflash import _numpy_path, reference
from cuflash._validate import Problem


def _problem(seqlen_q, seqlen_k, causal):
    return Problem(1, seqlen_q, seqlen_k, 1, 1, 64, np.dtype(np.float32), causal, 0.125)


@given(seqlen_q=st.integers(1, 700), seqlen_k=st.integers(1, 700), causal=st.booleans())
def test_key_blocks_cover_exactly_the_visible_pairs(seqlen_q, seqlen_k, causal):
    visible = reference.causal_mask(seqlen_q, seqlen_k) if causal else np.ones((seqlen_q, seqlen_k), bool)
    computed = np.zeros_like(visible)
    for n0, n1, r0, band in _numpy_path._key_blocks(_problem(seqlen_q, seqlen_k, causal)):
        block = visible[:, n0:n1]
        assert block.any(), (n0, n1)  # no block that no row sees
        assert not block[:r0].any()  # the rows skipped see none of its keys
        assert block[r0:].any(axis=1)[0]  # row r0 sees one
        assert block[r0 + max(band, 0):].all()  # past the band the rows see every key: no mask needed
        computed[r0:, n0:n1] = True
    assert not (visible & ~computed).any()  # every visible pair is computed


def test_causal_computes_about_half_of_full_at_seqlen_1024():
    def work(causal):
        return sum((1024 - r0) * (n1 - n0) for n0, n1, r0, _ in _numpy_path._key_blocks(_problem(1024, 1024, causal)))

    assert work(True) / work(False) <= 0.57  # 0.5 and one block's diagonal
