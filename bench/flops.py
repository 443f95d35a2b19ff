"""FLOP counts of attention, in the convention of the FlashAttention papers (pure, no GPU)."""

from __future__ import annotations

#: The passes a timed record can have.
PASSES = ("fwd", "bwd", "fwd+bwd")

#: Work of each pass relative to the forward: the backward does five matmuls against the forward's
#: two, so 2.5 times the forward (FlashAttention-2, section 4.1); fwd+bwd is the sum.
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

#: Two matmuls (q k^T and p v), each 2 FLOPs per multiply-add.
FORWARD_FLOPS_PER_SCORE_PER_DIM = 4


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
                    pass_: str, visible: float | None = None) -> float:
    """FLOPs of one attention call.

    Parameters
    ----------
    batch, heads, seqlen_q, seqlen_k, head_dim : int
        The problem; ``heads`` counts query heads (grouped kv heads do the same work).
    causal : bool
        Halves the count, as the papers do for square causal problems (the masked half of the score
        matrix is skipped).
    pass_ : {"fwd", "bwd", "fwd+bwd"}
    visible : float, optional
        Score entries per (batch, head) that the mask leaves visible (the features suite counts those
        only); replaces ``seqlen_q * seqlen_k`` and the causal halving.

    Returns
    -------
    float
        ``4 * batch * heads * seqlen_q * seqlen_k * head_dim`` times the pass factor (1, 2.5, 3.5),
        halved when causal.
    """
    if pass_ not in PASS_FACTOR:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    entries = seqlen_q * seqlen_k / (2 if causal else 1) if visible is None else visible
    forward = FORWARD_FLOPS_PER_SCORE_PER_DIM * batch * heads * entries * head_dim
    return forward * PASS_FACTOR[pass_]


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12
