"""The features suite's masks and score modifiers: what each one asks of cuflash and of FlexAttention, and
how many score entries it leaves visible (pure, but for the arrays and callables built on the GPU).

Every feature is causal, on square shapes (seqlen_q == seqlen_k, where bottom-right and top-left causal
alignment agree), as the issue's comparison with FlexAttention is.
"""

from __future__ import annotations

import dataclasses

#: a window's left side, in keys
WINDOW = 1024
SOFTCAP = 30.0
DROPOUT = 0.1
#: the dropout feature's Philox seed and offset (any fixed pair: the mask's cost does not depend on them)
DROPOUT_SEED, DROPOUT_OFFSET = 2024, 7


@dataclasses.dataclass(frozen=True)
class Feature:
    """One column of the suite: causal attention with at most these options."""

    name: str
    window_left: int = -1  # -1: no left side (plain causal)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    dropout_p: float = 0.0

    def visible_entries(self, seqlen: int) -> float:
        """Score entries a (batch, head) sees at ``seqlen``: row i sees min(i + 1, window_left + 1) keys."""
        if self.window_left < 0:
            return seqlen * (seqlen + 1) / 2
        w = self.window_left + 1
        full = max(seqlen - w, 0)  # rows past the window's first w see w keys each
        ramp = min(seqlen, w)
        return ramp * (ramp + 1) / 2 + full * w

    def options(self, heads: int) -> dict:
        """Keywords of cuflash.attention on NumPy arrays."""
        options = {}
        if self.window_left >= 0:
            options["window_size"] = (self.window_left, 0)
        if self.softcap:
            options["softcap"] = self.softcap
        if self.alibi:
            options["alibi_slopes"] = alibi_slopes(heads)
        if self.sinks:
            options["sinks"] = sink_logits(heads)
        if self.dropout_p:
            options.update(dropout_p=self.dropout_p, seed=DROPOUT_SEED, offset=DROPOUT_OFFSET)
        return options

    def cuflash_options(self, heads: int) -> dict:
        """Keywords of cuflash.attention on CuPy arrays: the same, the arrays on the device."""
        import cupy

        return {name: cupy.asarray(value) if name in ("alibi_slopes", "sinks") else value
                for name, value in self.options(heads).items()}

    def reference_options(self, heads: int, batch: int, seqlen: int) -> dict:
        """Keywords of cuflash.reference.attention for (batch, seqlen, heads) inputs: the same, dropout's
        seed and offset materialized as its mask."""
        options = self.options(heads)
        if self.dropout_p:
            import cuflash

            del options["seed"], options["offset"]
            options["dropout_mask"] = cuflash.dropout_mask(batch, heads, seqlen, seqlen, self.dropout_p,
                                                           DROPOUT_SEED, DROPOUT_OFFSET)
        return options


def alibi_slopes(heads: int):
    """ALiBi's geometric slopes 2^(-8 i / heads), i = 1..heads (float32, NumPy)."""
    import numpy as np

    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def sink_logits(heads: int):
    """One fixed logit per head, spread over [-2, 2] (float32, NumPy)."""
    import numpy as np

    return np.linspace(-2.0, 2.0, heads, dtype=np.float32)


FEATURES = (Feature("causal"), Feature(f"window{WINDOW}", window_left=WINDOW),
            Feature(f"softcap{SOFTCAP:g}", softcap=SOFTCAP), Feature("alibi", alibi=True),
            Feature("sinks", sinks=True), Feature(f"dropout{DROPOUT:g}", dropout_p=DROPOUT))
BY_NAME = {f.name: f for f in FEATURES}
