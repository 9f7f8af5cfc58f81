"""Measured refinement of a chosen recipe: a bounded local search over measured variants.

The chooser (qeval.compare.recipe_choice) adds per-group costs measured one group at a time, and where several
groups move together their errors compound. The refinement starts from its choice, measured, and measures the
choices next to it (qeval.compare.recipe_choice.neighbours: one move added, dropped or retargeted, or two groups
swapped), the most promising first: each neighbour's size and KLD predicted from the current recipe's *measured*
ones plus the sweep's costs of the options it changes only, a neighbour whose size breaks a size budget never
tried. A measured neighbour better than the current recipe on the tuning chunks (qeval.compare.recipe_choice.Budget:
lower KLD within a size budget, fewer bytes within a KLD budget) becomes the current one, and the search goes on from
there. It stops when `builds` variants were built, or no untried neighbour is left.

Every variant comes from the recipes' cache (qeval.orchestrate.recipes: by variant identity), so none is built or
measured twice, and only a variant built now counts against the budget. Every decision reads a variant through
qeval.orchestrate.recipes.seen_on(variant, tuning): the held-out chunks are never in what it compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from qeval.compare.chunk_split import ChunkSubset
from qeval.compare.recipe_choice import Budget, Option, neighbours, predicted
from qeval.engine.recipe import Recipe
from qeval.orchestrate.recipes import MEASURED, Variant, seen_on


@dataclass(frozen=True)
class Tried:
    """A neighbour measured: its variant, its predicted and its measured (tuning) mean KLD, and whether it became the
    current recipe."""

    variant: Variant
    predicted_kld: float
    kld: float
    accepted: bool

    def to_json(self) -> dict:
        return {"label": self.variant.label, "recipe": self.variant.recipe.text(), "bytes": self.variant.bytes,
                "status": self.variant.status, "predicted_kld": self.predicted_kld, "tuning_kld": self.kld,
                "accepted": self.accepted}


@dataclass(frozen=True)
class Refinement:
    """Where the search started (the additive choice, measured), where it ended, what it tried and built."""

    start: Variant
    best: Variant
    tried: tuple[Tried, ...]
    builds: int


def refine(start: tuple[Option, ...], options: list[Option], budget: Budget, builds: int,
           recipe_of: Callable[[tuple[Option, ...]], Recipe], measure: Callable[[Recipe], Variant],
           tuning: ChunkSubset | None) -> Refinement:
    """The search from the choice `start` (one option per group, the sweep's `options`), measuring each recipe
    (recipe_of) through `measure` (the cache); decisions on the `tuning` chunks (None: every chunk)."""
    first = measure(recipe_of(start))
    current, best = start, first
    seen = seen_on(first, tuning)
    tried_choices, tried, built = {start}, [], 0
    while built < builds:
        candidates = []
        for other in neighbours(current, options):
            if other in tried_choices:
                continue
            size, kld = predicted(current, seen.bytes, seen.kld_mean, other)
            if budget.may_keep(size):
                candidates.append((budget.key(size, kld), kld, other))
        if not candidates:
            break
        _, predicted_kld, choice = min(candidates, key=lambda c: c[0])
        tried_choices.add(choice)
        variant = measure(recipe_of(choice))
        built += variant.status == MEASURED
        measured = seen_on(variant, tuning)
        accepted = budget.key(measured.bytes, measured.kld_mean) < budget.key(seen.bytes, seen.kld_mean)
        tried.append(Tried(variant, predicted_kld, measured.kld_mean, accepted))
        if accepted:
            current, best, seen = choice, variant, measured
    return Refinement(first, best, tuple(tried), built)
