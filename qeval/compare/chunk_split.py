"""Tuning and held-out chunks: two disjoint sets of a reference's chunks, drawn by a recorded seed.

A choice made among many measured variants (a recipe fit, a sweep's ranking, a refinement) is optimistic on the
chunks it was made on: the winner is partly the one whose noise fell its way. So the choice is made on the tuning
chunks and every chosen variant is reported again on held-out chunks no decision read.

What keeps the held-out chunks out of every decision is structural: a decision gets per-token columns only through
`ChunkSubset.columns` of the tuning subset, which returns the rows of its own chunks and nothing else; the held-out
subset's columns are read once the choices are fixed, to report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qeval.errors import QevalError

MIN_CHUNKS = 8  # each set: a paired difference over fewer chunks has too few degrees of freedom to report


@dataclass(frozen=True)
class ChunkSubset:
    """Some chunks of a reference, by id, and the name of their role ("tuning", "held-out")."""

    name: str
    chunks: tuple[int, ...]

    def columns(self, per_token: dict) -> dict:
        """The per-token columns (each one value a token, `chunk` among them) of this subset's chunks only."""
        at = np.isin(np.asarray(per_token["chunk"]), np.asarray(self.chunks))
        return {name: np.asarray(values)[at] for name, values in per_token.items()}

    def __len__(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class ChunkSplit:
    """A reference's first n chunks split into tuning and held-out chunks by a seeded permutation."""

    seed: int
    tuning: ChunkSubset
    held_out: ChunkSubset

    def to_json(self) -> dict:
        return {"seed": self.seed, "tuning": list(self.tuning.chunks), "held_out": list(self.held_out.chunks)}


def draw_split(n_chunks: int, held_out: int, seed: int) -> ChunkSplit:
    """`held_out` of the chunks 0..n_chunks-1 held out, the rest tuning: the first `held_out` of numpy's seeded
    permutation (default_rng(seed)), each set sorted. Refused unless both hold at least MIN_CHUNKS."""
    tuning = n_chunks - held_out
    if held_out < MIN_CHUNKS or tuning < MIN_CHUNKS:
        raise QevalError(f"a held-out split needs at least {MIN_CHUNKS} tuning and {MIN_CHUNKS} held-out chunks: "
                         f"{n_chunks} chunks with --holdout {held_out} leave {max(tuning, 0)} for tuning and "
                         f"{held_out} held out (compare at least {2 * MIN_CHUNKS} chunks, and hold out between "
                         f"{MIN_CHUNKS} and {n_chunks - MIN_CHUNKS})")
    order = np.random.default_rng(seed).permutation(n_chunks)
    return ChunkSplit(seed, ChunkSubset("tuning", tuple(sorted(int(c) for c in order[held_out:]))),
                      ChunkSubset("held-out", tuple(sorted(int(c) for c in order[:held_out]))))
