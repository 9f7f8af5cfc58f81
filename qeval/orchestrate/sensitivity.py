"""Tensor sensitivity: where the bytes buy the least damage, and the best recipe under a budget.

A sweep takes a base recipe and moves each tensor group (found from the source GGUF's own tensor names:
qeval.engine.recipe.tensor_groups) alone to each target type, everything else kept: each move is a variant
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
import json
from dataclasses import dataclass
from pathlib import Path

from qeval.engine import recipe as recipes
from qeval.compare import recipe_choice
from qeval.compare.paired_stats import PairedDifference
from qeval.errors import QevalError
from qeval.orchestrate import matrix
from qeval.orchestrate.recipes import (
    RecipeRequest,
    Variant,
    board_rows,
    deployment,
    early_figures,
    is_stock,
    kld_cost,
    measure_recipes,
)
from qeval.present import board, recipes_text
from qeval.present.progress import say


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
        group = self.move.group
        return {"group": group.name, "pattern": group.pattern, "tensors": len(group.tensors),
                "target": self.move.target, "types": self.move.types_text(), "label": self.variant.label,
                "bytes": self.variant.bytes, "bytes_saved": self.bytes_saved, "kld_cost": self.cost.diff,
                "kld_cost_se": self.cost.se, "kld_per_mb": self.kld_per_mb,
                **({"chunks": self.cost.n_chunks, "stopped": self.variant.stopped} if self.variant.stopped else {})}


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


def _announce(progress: bool):
    def said(v: Variant) -> None:
        kld = v.summary.measured()["kld_mean"]
        early = f" (decided early: {v.summary.chunks} chunks, {v.stopped})" if v.stopped else ""
        say(f"recipe {v.label} ({v.recipe.text()}): {v.status}: {v.bytes / 1e6:.1f} MB, mean KLD {kld.value:.5f}"
            f"{early}", progress)
    return said


def measure_report(request: RecipeRequest, progress: bool = False) -> tuple[dict, str]:
    """Every recipe of the request measured (or reused): its board, stock types beside recipes."""
    variants = measure_recipes(request, _announce(progress))
    rows, early = board_rows(variants), early_figures(request, variants)
    result, text = {"rows": rows, **early}, "\n".join([recipes_text.recipes_markdown(rows), *_early_text(early)])
    return _with_deployment(request, variants, result, text)


def _with_deployment(request: RecipeRequest, variants: list[Variant], result: dict, text: str) -> tuple[dict, str]:
    """A recipe board with its variants' speed and memory (--deploy): their records' JSON and tables."""
    measured = deployment(request, variants)
    if measured is None:
        return result, text
    return {**result, "deployment": measured.to_json()}, text + "\n\n" + measured.text()


def _early_text(early: dict) -> list[str]:
    """The note and cost line of a board decided early (the matrix's), none otherwise."""
    return ["", board.EARLY_NOTE, matrix.early_line(early["early"])] if early else []


def sweep_report(request: RecipeRequest, targets: tuple[str, ...], only: tuple[str, ...] = (),
                 out: Path | None = None, progress: bool = False) -> tuple[dict, str]:
    """The sensitivity table of a sweep; with `out`, written there too (sensitivity.md, .json, and the plot)."""
    swept = sweep(request, targets, only, _announce(progress))
    rows = [r.to_json() for r in swept.rows]
    kld = swept.base.summary.measured()["kld_mean"]
    head = (f"base {swept.base.recipe.text()}: {swept.base.bytes / 1e6:.1f} MB, mean KLD "
            f"{recipes_text.plus_minus(kld.value, kld.se, '.5f')} over {swept.base.summary.chunks} chunks")
    early = early_figures(request, [swept.base, *(r.variant for r in swept.rows)])
    text = "\n".join([head, *swept.skipped, "", recipes_text.sensitivity_markdown(rows), *_early_text(early)])
    result = {"base": swept.base.to_json(), "rows": rows, "skipped": list(swept.skipped), **early}
    if out is not None:
        _write(out, "sensitivity", result, text, recipes_text.plot_sensitivity(rows, f"Tensor sensitivity: base "
                                                                                     f"{swept.base.recipe.text()}"))
    return result, text


def fit_report(request: RecipeRequest, targets: tuple[str, ...], max_bytes=(), max_kld=(), stock=(),
               only: tuple[str, ...] = (), out: Path | None = None, progress: bool = False) -> tuple[dict, str]:
    """A sweep (reused when done), then the recipe the chooser picks under each budget, built and measured beside the
    stock types `stock` (base type names) and the request's other recipes; with `out`, written there too."""
    if not max_bytes and not max_kld:
        raise QevalError("give a budget: --max-mb or --max-kld")
    base, *others = request.recipes
    # the sweep's single-group variants are analysis, not candidates: only the chosen ones are deployed
    swept = sweep(dataclasses.replace(request, recipes=(base,), deploy=None), targets, only, _announce(progress))
    fits = [(f"≤ {b / 1e6:.1f} MB", "bytes", b, *fitted_recipe(swept, max_bytes=b)) for b in max_bytes]
    fits += [(f"KLD ≤ {k:g}", "kld", k, *fitted_recipe(swept, max_kld=k)) for k in max_kld]
    chosen = tuple(dict.fromkeys([*(f[3] for f in fits), *others, *(recipes.Recipe(s) for s in stock)]))
    variants = measure_recipes(dataclasses.replace(request, recipes=chosen), _announce(progress))
    by_recipe = {v.recipe: v for v in variants}
    budgets = [_budget_row(name, kind, value, by_recipe[r], choice, variants)
               for name, kind, value, r, choice in fits]
    rows = board_rows(variants)
    # decided early: the sweep's board and the budgets' board, their chunks together
    early = early_figures(request, [swept.base, *(r.variant for r in swept.rows), *variants])
    text = "\n".join(["Budgeted recipes (predicted from the sweep, then measured), each beside the stock type nearest "
                      "its budget (in size for a size budget, in mean KLD for a KLD budget)", "",
                      recipes_text.budgets_markdown(budgets), "", recipes_text.recipes_markdown(rows),
                      *_early_text(early)])
    result, text = _with_deployment(request, variants, {"budgets": budgets, "rows": rows, **early}, text)
    if out is not None:
        _write(out, "recipes", result, text, recipes_text.plot_recipe_front(rows))
    return result, text


def _budget_row(name: str, kind: str, value: float, fitted: Variant, choice: recipe_choice.Choice,
                variants: list[Variant]) -> dict:
    """A budget's line: the recipe chosen, predicted and measured, and the measured stock type nearest the budget with
    the paired difference of mean KLD (recipe minus stock) on the same tokens."""
    def kld(v: Variant) -> float:
        return v.summary.measured()["kld_mean"].value

    def figures(v: Variant) -> dict:
        m = v.summary.measured()
        return {"label": v.label, "bytes": v.bytes, "kld_mean": m["kld_mean"].value, "kld_mean_se": m["kld_mean"].se,
                "same_top1_pct": m["same_top1_pct"].value}

    stock = [v for v in variants if is_stock(v.recipe)]
    row = {"budget": name, "recipe": fitted.recipe.text(), "predicted_bytes": choice.bytes,
           "predicted_kld": choice.kld, "measured": figures(fitted)}
    if stock:
        near = min(stock, key=lambda v: abs(v.bytes - value) if kind == "bytes" else abs(kld(v) - value))
        cost = kld_cost(fitted, near) if near is not fitted else None
        row["stock"] = {**figures(near), "diff": cost.diff if cost else 0.0, "se": cost.se if cost else 0.0}
    return row


def _write(out: Path, name: str, result: dict, text: str, fig) -> None:
    from qeval.present.plots import save_figure  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    save_figure(fig, out, name)
