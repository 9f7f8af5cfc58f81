"""Which logit positions of a window are scored: the one rule that capture, stores and metrics iterate.

Logit position p of a window is the model's distribution after tokens 0..p, scored against token p+1,
so p runs over 0..n_ctx-2. A store records its rule (header field `scoring`, format version 2; a
version-1 store is `half`), and its scored positions are `Scoring.parse(rule).positions(n_ctx)`.

    half      positions n_ctx/2 .. n_ctx-2: llama-perplexity's rule, every published number's (default)
    all       positions 0 .. n_ctx-2
    every:S   positions S-1, 2S-1, ... up to n_ctx-2: a sparse sample spread evenly over the depth
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qeval.errors import QevalError

RULES = ("half", "all", "every:S")


@dataclass(frozen=True)
class Scoring:
    rule: str = "half"

    @classmethod
    def parse(cls, spec: str | None) -> "Scoring":
        spec = (spec or "half").strip()
        if spec in ("half", "all"):
            return cls(spec)
        kind, _, stride = spec.partition(":")
        if kind == "every" and stride.isdigit() and int(stride) >= 1:
            return cls(f"every:{int(stride)}")
        raise QevalError(f"--score {spec!r}: expected one of {', '.join(RULES)} (S a positive integer)")

    @property
    def stride(self) -> int:
        return int(self.rule.partition(":")[2]) if self.rule.startswith("every:") else 1

    def positions(self, n_ctx: int) -> np.ndarray:
        """The scored logit positions of a window of n_ctx tokens, ascending (int64)."""
        if self.rule == "half":
            return np.arange(n_ctx // 2, n_ctx - 1, dtype=np.int64)
        if self.rule == "all":
            return np.arange(0, n_ctx - 1, dtype=np.int64)
        return np.arange(self.stride - 1, n_ctx - 1, self.stride, dtype=np.int64)

    def describe(self) -> str:
        if self.rule == "half":
            return "the second half of each window, as llama-perplexity scores"
        if self.rule == "all":
            return "every position of each window"
        return f"every {self.stride}th position of each window"

    def check(self, n_ctx: int) -> None:
        if not len(self.positions(n_ctx)):
            raise QevalError(f"--score {self.rule} scores no position of a {n_ctx}-token window "
                             f"(the last scored position is n_ctx-2 = {n_ctx - 2})")


HALF = Scoring("half")


def half_span(n_ctx: int) -> tuple[int, int]:
    """(first, count) of the half rule's contiguous positions: the layout of llama-perplexity's files."""
    positions = HALF.positions(n_ctx)
    return int(positions[0]), len(positions)
