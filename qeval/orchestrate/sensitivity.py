"""Tensor sensitivity: where the bytes buy the least damage, and the best recipe under a budget.

A sweep takes a base recipe and moves each tensor group (found from the source GGUF's own tensor names:
qeval.capture.recipe.tensor_groups) alone to each target type, everything else kept: each move is a variant
(qeval.orchestrate.recipes), measured against the reference like the base. A move's KLD cost is the paired
difference of its per-token KLD and the base's on the same tokens, chunks as the unit (a t-interval over chunk
means: qeval.orchestrate.paired.paired_difference); the bytes it saves are the base file's size minus its own. A
move llama.cpp's dry run shows to change no tensor (the group is there already, or a fallback lands it there) is
not built; two targets that land on the same types are built once.

fit() chooses from a sweep's moves the recipe with the lowest predicted KLD under a size budget (or the fewest
bytes under a KLD budget: qeval.compare.recipe_choice), then builds and measures it to confirm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from qeval.capture import recipe as recipes
from qeval.compare import recipe_choice
from qeval.compare.paired_stats import PairedDifference
from qeval.errors import QevalError
from qeval.orchestrate.paired import paired_difference
from qeval.orchestrate.recipes import RecipeRequest, Variant, measure_recipes


@dataclass(frozen=True)
class Move:
    """One group moved to one type: the recipe that does it, and what llama.cpp's dry run says it changes."""

    group: recipes.TensorGroup
    target: str
    recipe: recipes.Recipe
    changed: dict  # tensor -> [base type, moved type], the tensors whose type it changes
    bytes: int  # the moved variant's planned size

    def types_text(self) -> str:
        """`q5_0 -> q3_k` (each distinct change, `x18` when several tensors make it)."""
        counts: dict[tuple[str, str], int] = {}
        for old, new in self.changed.values():
            counts[(old, new)] = counts.get((old, new), 0) + 1
        return ", ".join(f"{old}→{new}" + (f" ×{n}" if n > 1 else "") for (old, new), n in sorted(counts.items()))


@dataclass(frozen=True)
class Sensitivity:
    """A measured move: its KLD cost over the base (± SE), the bytes it saves, and their ratio."""

    move: Move
    variant: Variant
    cost: PairedDifference  # moved minus base, mean KLD
    bytes_saved: int

    @property
    def kld_per_mb(self) -> float | None:
        """Mean KLD added per MB (10^6 bytes) saved: the lower, the cheaper the bytes."""
        return self.cost.diff / (self.bytes_saved / 1e6) if self.bytes_saved else None

    def to_json(self) -> dict:
        return {"group": self.move.group.name, "pattern": self.move.group.pattern, "tensors": len(self.move.group.tensors),
                "target": self.move.target, "types": self.move.types_text(), "label": self.variant.label,
                "bytes": self.variant.bytes, "bytes_saved": self.bytes_saved, "kld_cost": self.cost.diff,
                "kld_cost_se": self.cost.se, "kld_per_mb": self.kld_per_mb}


@dataclass(frozen=True)
class Sweep:
    base: Variant
    rows: tuple[Sensitivity, ...]
    skipped: tuple[str, ...]  # a line for each move not built, and why

    def options(self) -> list[recipe_choice.Option]:
        """Every group's options for the chooser: its base place and each of its measured moves."""
        base = [recipe_choice.Option(g, "", 0, 0.0) for g in dict.fromkeys(r.move.group.name for r in self.rows)]
        return base + [recipe_choice.Option(r.move.group.name, r.move.target, -r.bytes_saved, r.cost.diff)
                       for r in self.rows]


def plan_moves(source: str | Path, base: recipes.Recipe, targets: tuple[str, ...], only: tuple[str, ...] = (),
               nthread: int = 1) -> tuple[list[Move], list[str]]:
    """The moves of a sweep, from llama.cpp's dry runs of the base and of each move, and a line per move left out."""
    base_plan = recipes.plan(source, base, nthread)
    groups = recipes.tensor_groups(base_plan)
    unknown = set(only) - {g.name for g in groups}
    if unknown:
        raise QevalError(f"no tensor group {', '.join(sorted(unknown))} in {Path(source).name} (its groups: "
                         f"{', '.join(g.name for g in groups)})")
    size = Path(source).stat().st_size
    moves, skipped, seen = [], [], {}
    for group in (g for g in groups if not only or g.name in only):
        for target in targets:
            moved = base.with_overrides((group.pattern, target))
            planned = recipes.plan(source, moved, nthread)
            changed = {t: [base_plan[t].type, planned[t].type] for t in planned
                       if planned[t].type != base_plan[t].type}
            key = tuple(sorted((t, new) for t, (_, new) in changed.items()))
            if not changed:
                skipped.append(f"{group.name} → {target}: changes no tensor (already there, or llama.cpp falls back "
                               "to the types it has)")
            elif key in seen:
                skipped.append(f"{group.name} → {target}: the same types as → {seen[key]}")
            else:
                seen[key] = target
                moves.append(Move(group, target, moved, changed, recipes.planned_bytes(planned, size)))
    return moves, skipped


def kld_cost(variant: Variant, base: Variant) -> PairedDifference:
    """The variant's mean KLD minus the base's on the same tokens, chunks as the unit."""
    a, b = variant.per_token, base.per_token
    return paired_difference(a["kld"], b["kld"], b["chunk"], "kld_mean", names=(variant.label, base.label))


def sweep(request: RecipeRequest, targets: tuple[str, ...], only: tuple[str, ...] = (), on_variant=None,
          on_chunk=None) -> Sweep:
    """The sensitivity of every group of the request's one recipe (the base) to each target type."""
    if len(request.recipes) != 1:
        raise QevalError("a sweep starts from one base recipe")
    targets = tuple(recipes.type_name(t, "--to") for t in targets)
    moves, skipped = plan_moves(request.source, request.recipes[0], targets, only)
    measured = measure_recipes(dataclasses.replace(request, recipes=(request.recipes[0], *(m.recipe for m in moves))),
                               on_variant, on_chunk)
    base, *variants = measured
    rows = tuple(Sensitivity(m, v, kld_cost(v, base), base.bytes - v.bytes) for m, v in zip(moves, variants))
    return Sweep(base, rows, tuple(skipped))


def fitted_recipe(swept: Sweep, max_bytes: int | None = None, max_kld: float | None = None):
    """(the recipe the chooser picks under the budget, its Choice)."""
    kld = swept.base.summary.measured()["kld_mean"].value
    choice = recipe_choice.choose(swept.options(), swept.base.bytes, kld, max_bytes, max_kld)
    patterns = {r.move.group.name: r.move.group.pattern for r in swept.rows}
    recipe = swept.base.recipe.with_overrides(*((patterns[o.group], o.type) for o in choice.moves()))
    return recipe, choice
