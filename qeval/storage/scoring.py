"""Which logit positions of a window are scored: the one rule that capture, stores and metrics iterate.

Logit position p of a window is the model's distribution after tokens 0..p, scored against token p+1,
so p runs over 0..n_ctx-2. A store records its rule (header field `scoring`, format version 2; a
version-1 store is `half`), and its scored positions are `Scoring.parse(rule).positions(n_ctx)`.

    half       positions n_ctx/2 .. n_ctx-2: llama-perplexity's rule, every published number's (default)
    all        positions 0 .. n_ctx-2
    every:S    positions S-1, 2S-1, ... up to n_ctx-2: a sparse sample spread evenly over the depth
    assistant  the positions whose next token the assistant wrote, in conversation windows: they differ from
               window to window and come from the store's per-token labels (WindowLabels, header field
               `windows`, format version 3); a label names the token's segment (thinking, answer, ...)

Every rule but `assistant` scores the same positions in every window. `positions_of(labels, c)` below is
the one definition for both kinds: what capture, stores and metrics iterate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qeval.errors import QevalError

ASSISTANT = "assistant"
RULES = ("half", "all", "every:S", ASSISTANT)


@dataclass(frozen=True)
class Scoring:
    rule: str = "half"

    @classmethod
    def parse(cls, spec: str | None) -> "Scoring":
        spec = (spec or "half").strip()
        if spec in ("half", "all", ASSISTANT):
            return cls(spec)
        kind, _, stride = spec.partition(":")
        if kind == "every" and stride.isdigit() and int(stride) >= 1:
            return cls(f"every:{int(stride)}")
        raise QevalError(f"--score {spec!r}: expected one of {', '.join(RULES)} (S a positive integer)")

    @property
    def stride(self) -> int:
        return int(self.rule.partition(":")[2]) if self.rule.startswith("every:") else 1

    @property
    def per_window(self) -> bool:
        """Whether the scored positions differ from window to window (they come from per-token labels)."""
        return self.rule == ASSISTANT

    def positions(self, n_ctx: int) -> np.ndarray:
        """The scored logit positions of every window of n_ctx tokens, ascending (int64); a per-window rule has
        none common to all windows (see positions_of)."""
        if self.per_window:
            raise ValueError(f"--score {self.rule} scores other positions in every window: use positions_of")
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
        if self.per_window:
            return "the tokens the assistant wrote in each conversation"
        return f"every {self.stride}th position of each window"

    def check(self, n_ctx: int) -> None:
        if not self.per_window and not len(self.positions(n_ctx)):
            raise QevalError(f"--score {self.rule} scores no position of a {n_ctx}-token window "
                             f"(the last scored position is n_ctx-2 = {n_ctx - 2})")


HALF = Scoring("half")


def half_span(n_ctx: int) -> tuple[int, int]:
    """(first, count) of the half rule's contiguous positions: the layout of llama-perplexity's files."""
    positions = HALF.positions(n_ctx)
    return int(positions[0]), len(positions)


@dataclass(frozen=True)
class WindowLabels:
    """The per-token labels of a capture's windows, and each window's category (a conversation capture).

    Token t of window c has label 0 (not scored) or k, naming segments[k-1] (thinking, answer, tool_call):
    the logit position t-1 is then scored, and its scored token is in that segment. Token 0 is never
    scored (no position precedes it). Stored in the header as JSON, compactly (field `windows`):

        {"segments": [names], "categories": [names],
         "chunks": [[category, start, stop, k, start, stop, k, ...], ...]}   one list per window

    each (start, stop, k) a run of tokens [start, stop) labelled k, runs ascending and apart.
    """

    segments: tuple[str, ...]
    categories: tuple[str, ...]
    category_of: tuple[int, ...]  # per window: an index into categories
    runs: tuple[tuple[tuple[int, int, int], ...], ...]  # per window: (start, stop, label) token runs

    @classmethod
    def from_arrays(cls, labels: np.ndarray, segments, categories, category_of) -> "WindowLabels":
        """From uint8 labels [n_windows, n_ctx]."""
        runs = []
        for row in np.asarray(labels, dtype=np.uint8):
            row = np.concatenate([[0], row[1:]])  # token 0 is never scored
            edges = np.flatnonzero(np.diff(row, prepend=0, append=0)) if row.any() else np.empty(0, np.int64)
            runs.append(tuple((int(a), int(b), int(row[a])) for a, b in zip(edges, edges[1:]) if row[a]))
        return cls(tuple(segments), tuple(categories), tuple(int(c) for c in category_of), tuple(runs))

    def labels(self, window: int, n_ctx: int) -> np.ndarray:
        """uint8 [n_ctx]: the label of every token of a window."""
        out = np.zeros(n_ctx, dtype=np.uint8)
        for start, stop, label in self.runs[window]:
            out[start:stop] = label
        return out

    def positions(self, window: int, n_ctx: int) -> np.ndarray:
        """The scored logit positions of a window: those whose next token is labelled, ascending (int64)."""
        return np.flatnonzero(self.labels(window, n_ctx)[1:]).astype(np.int64)

    def segment_codes(self, window: int, positions: np.ndarray, n_ctx: int) -> np.ndarray:
        """The label (1..len(segments)) of the scored token of each of `positions`."""
        return self.labels(window, n_ctx)[np.asarray(positions) + 1]

    def names(self) -> dict:
        """{"segments": [...], "categories": [...]}: what the codes of per-token columns index."""
        return {"segments": list(self.segments), "categories": list(self.categories)}

    def head(self, n_windows: int) -> "WindowLabels":
        """The labels of the first n windows (what a comparison over n chunks measured)."""
        return WindowLabels(self.segments, self.categories, self.category_of[:n_windows], self.runs[:n_windows])

    def to_json(self) -> dict:
        return {"segments": list(self.segments), "categories": list(self.categories),
                "chunks": [[c, *(v for run in runs for v in run)] for c, runs in zip(self.category_of, self.runs)]}

    @classmethod
    def from_json(cls, d: object, n_ctx: int, n_windows: int) -> "WindowLabels":
        """Checked: ValueError naming what is wrong (a reader that trusts nothing)."""
        if not isinstance(d, dict):
            raise ValueError("it is not an object")
        segments, categories, chunks = d.get("segments"), d.get("categories"), d.get("chunks")
        for name, names in (("segments", segments), ("categories", categories)):
            if not isinstance(names, list) or not names or len(names) > 255 or \
                    not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
                raise ValueError(f"{name} must be a list of 1..255 distinct names")
        if not isinstance(chunks, list) or len(chunks) != n_windows:
            raise ValueError(f"chunks must list all {n_windows} windows")
        category_of, runs = [], []
        for w, entry in enumerate(chunks):
            if not isinstance(entry, list) or not entry or (len(entry) - 1) % 3 or \
                    not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
                raise ValueError(f"window {w}: expected [category, start, stop, label, ...] integers")
            if not 0 <= entry[0] < len(categories):
                raise ValueError(f"window {w}: category {entry[0]} is not one of {len(categories)}")
            window_runs = tuple(tuple(entry[i:i + 3]) for i in range(1, len(entry), 3))
            last = 1  # token 0 is never scored
            for start, stop, label in window_runs:
                if not last <= start < stop <= n_ctx or not 1 <= label <= len(segments):
                    raise ValueError(f"window {w}: run {start}:{stop} label {label} is out of order or range")
                last = stop
            if not window_runs:
                raise ValueError(f"window {w}: no token is scored")
            category_of.append(entry[0])
            runs.append(window_runs)
        return cls(tuple(segments), tuple(categories), tuple(category_of), tuple(runs))


def positions_of(scoring: Scoring, labels: WindowLabels | None, window: int, n_ctx: int) -> np.ndarray:
    """The scored logit positions of window `window`: the rule's, or for a per-window rule its labels'."""
    if not scoring.per_window:
        return scoring.positions(n_ctx)
    return labels.positions(window, n_ctx)
