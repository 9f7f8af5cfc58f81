"""Tensor sensitivity: where the bytes buy the least damage, and the best recipe under a budget.

A sweep takes a base recipe and moves each tensor group (found from the source GGUF's own tensor names:
qeval.engine.recipe.tensor_groups) alone to each target type, everything else kept: each move is a variant
(qeval.orchestrate.recipes), measured against the reference like the base. A move's KLD cost is the paired
difference of its per-token KLD and the base's on the same tokens, chunks as the unit (a t-interval over chunk
means: qeval.compare.paired_stats.paired_difference); the bytes it saves are the base file's size minus its own. A
move llama.cpp's dry run shows to change no tensor (the group is there already, or a fallback lands it there) is
not built; two targets that land on the same types are built once.

fit() chooses from a sweep's moves the recipe with the lowest predicted KLD under a size budget (or the fewest
bytes under a KLD budget: qeval.compare.recipe_choice), then builds and measures it to confirm; with a build budget
(SearchSettings.refine_builds) it then refines that choice by measuring its neighbours (qeval.orchestrate.refine).

Held out (SearchSettings.holdout): the chunks compared are split into tuning and held-out chunks by a recorded seed
(qeval.compare.chunk_split). Every decision (the sweep's costs and ranking, the chooser, the refinement, which stock
type a KLD budget is set beside) reads the variants through recipes.seen_on(variant, tuning): the held-out chunks are
read only to report the choices made, each as a paired difference against the same stock type on the tuning chunks
and on the held-out ones; their difference is the choice's optimism.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from qeval.engine import recipe as recipes
from qeval.compare import recipe_choice
from qeval.compare.chunk_split import ChunkSplit, draw_split
from qeval.compare.paired_stats import PairedDifference
from qeval.errors import QevalError
from qeval.orchestrate import matrix, refine
from qeval.orchestrate.recipes import (
    RecipeRequest,
    Variant,
    board_rows,
    deployment,
    early_figures,
    is_stock,
    kld_cost,
    measure_recipes,
    n_compared,
    seen_on,
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
    cost: PairedDifference  # moved minus base, mean KLD, on the tuning chunks (every chunk without a split)
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
class SearchSettings:
    """How a sweep and a fit choose (the module's docstring): the chunks held out of every decision, drawn by
    split_seed (qeval.compare.chunk_split; None: every chunk tunes), the refinement's build budget per budget (None:
    no refinement) and the tensor groups split by layer range (qeval.engine.recipe.tensor_groups; 0: whole roles)."""

    holdout: int | None = None
    split_seed: int | None = None  # None: 0
    refine_builds: int | None = None
    split_edges: int = 0

    def __post_init__(self):
        if self.refine_builds is not None and self.refine_builds < 1:
            raise QevalError(f"--refine-builds {self.refine_builds}: a refinement needs a budget of at least 1 "
                             "build (leave the option out for no refinement)")
        if self.split_seed is not None and self.holdout is None:
            raise QevalError("--split-seed draws the held-out chunks: it needs --holdout N")
        if self.split_edges < 0:
            raise QevalError(f"--split-edges {self.split_edges}: give the number of first and last blocks kept "
                             "apart (at least 1), or leave it out")

    def split(self, request: RecipeRequest) -> ChunkSplit | None:
        """The tuning and held-out chunks of the request's reference, None without --holdout."""
        if self.holdout is None:
            return None
        if request.early is not None:
            raise QevalError("--holdout and --early cannot be combined: a board decided early holds a prefix of its "
                             "own chunk order, not the chunks a split holds out")
        return draw_split(n_compared(request), self.holdout, self.split_seed or 0)


@dataclass(frozen=True)
class Sweep:
    base: Variant
    rows: tuple[Sensitivity, ...]
    skipped: tuple[str, ...]  # a line for each move not built, and why
    base_kld: float  # the base's mean KLD on the tuning chunks
    split: ChunkSplit | None = None

    def options(self) -> list[recipe_choice.Option]:
        """Every group's options for the chooser: its base place and each of its measured moves."""
        base = [recipe_choice.Option(g, "", 0, 0.0) for g in dict.fromkeys(r.move.group.name for r in self.rows)]
        return base + [recipe_choice.Option(r.move.group.name, r.move.target, -r.bytes_saved, r.cost.diff)
                       for r in self.rows]

    def recipe_of(self, options: tuple[recipe_choice.Option, ...]) -> recipes.Recipe:
        """The base recipe with the moves of `options` (one per group), in the sweep's group order."""
        patterns = {r.move.group.name: r.move.group.pattern for r in self.rows}
        return self.base.recipe.with_overrides(*((patterns[o.group], o.type) for o in options if o.type))


def plan_moves(source: str | Path, base: recipes.Recipe, targets: tuple[str, ...], only: tuple[str, ...] = (),
               nthread: int = 1, split_edges: int = 0) -> tuple[list[Move], list[str]]:
    """The moves of a sweep, from llama.cpp's dry runs of the base and of each move, and a line per move left out.
    `only`: groups by name or by role (a role names each of its layer ranges)."""
    base_plan = recipes.plan(source, base, nthread)
    groups = recipes.tensor_groups(base_plan, split_edges)
    unknown = set(only) - {g.name for g in groups} - {g.role for g in groups}
    if unknown:
        raise QevalError(f"no tensor group {', '.join(sorted(unknown))} in {Path(source).name} (its groups: "
                         f"{', '.join(g.name for g in groups)})")
    size = Path(source).stat().st_size
    moves, skipped, seen = [], [], {}
    for group in (g for g in groups if not only or g.name in only or g.role in only):
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
                moves.append(Move(group=group, target=target, recipe=moved, changed=changed,
                                  bytes=recipes.planned_bytes(planned, size)))
    return moves, skipped


def sweep(request: RecipeRequest, targets: tuple[str, ...], only: tuple[str, ...] = (), on_variant=None,
          on_chunk=None, search: SearchSettings = SearchSettings()) -> Sweep:
    """The sensitivity of every group of the request's one recipe (the base) to each target type, its costs on the
    tuning chunks of search's split."""
    if len(request.recipes) != 1:
        raise QevalError("a sweep starts from one base recipe")
    targets = tuple(recipes.type_name(t, "--to") for t in targets)
    split = search.split(request)
    moves, skipped = plan_moves(request.source, request.recipes[0], targets, only, split_edges=search.split_edges)
    measured = measure_recipes(dataclasses.replace(request, recipes=(request.recipes[0], *(m.recipe for m in moves))),
                               on_variant, on_chunk)
    base, *variants = measured
    tuning = split.tuning if split else None
    base_seen = seen_on(base, tuning)
    rows = tuple(Sensitivity(m, v, kld_cost(seen_on(v, tuning), base_seen), base.bytes - v.bytes)
                 for m, v in zip(moves, variants))
    return Sweep(base=base, rows=rows, skipped=tuple(skipped), base_kld=base_seen.kld_mean, split=split)


def fitted_recipe(swept: Sweep, max_bytes: int | None = None, max_kld: float | None = None):
    """(the recipe the chooser picks under the budget, its Choice)."""
    choice = recipe_choice.choose(swept.options(), swept.base.bytes, swept.base_kld, max_bytes, max_kld)
    return swept.recipe_of(choice.options), choice


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


def _split_figures(split: ChunkSplit | None) -> tuple[dict, list[str]]:
    """The split's record (JSON) and its line (text); nothing without a split."""
    if split is None:
        return {}, []
    return {"split": split.to_json()}, [recipes_text.split_line(split.to_json())]


def _difference(cost: PairedDifference) -> dict:
    return {"diff": cost.diff, "se": cost.se, "chunks": cost.n_chunks}


def sweep_report(request: RecipeRequest, targets: tuple[str, ...], only: tuple[str, ...] = (),
                 out: Path | None = None, progress: bool = False,
                 search: SearchSettings = SearchSettings()) -> tuple[dict, str]:
    """The sensitivity table of a sweep, ranked on the tuning chunks and each move's cost on the held-out ones beside
    (with a split); with `out`, written there too (sensitivity.md, .json, and the plot)."""
    swept = sweep(request, targets, only, _announce(progress), search=search)
    rows = [r.to_json() for r in swept.rows]
    if swept.split is not None:  # reported once the ranking (on the tuning chunks) is fixed
        base_held = seen_on(swept.base, swept.split.held_out)
        for row, r in zip(rows, swept.rows):
            row["held_out"] = _difference(kld_cost(seen_on(r.variant, swept.split.held_out), base_held))
    kld = swept.base.summary.measured()["kld_mean"]
    head = (f"base {swept.base.recipe.text()}: {swept.base.bytes / 1e6:.1f} MB, mean KLD "
            f"{recipes_text.plus_minus(kld.value, kld.se, '.5f')} over {swept.base.summary.chunks} chunks")
    early = early_figures(request, [swept.base, *(r.variant for r in swept.rows)])
    split, split_text = _split_figures(swept.split)
    text = "\n".join([head, *split_text, *swept.skipped, "", recipes_text.sensitivity_markdown(rows),
                      *_early_text(early)])
    result = {"base": swept.base.to_json(), "rows": rows, "skipped": list(swept.skipped), **split, **early}
    if out is not None:
        _write(out, "sensitivity", result, text, recipes_text.plot_sensitivity(rows, f"Tensor sensitivity: base "
                                                                                     f"{swept.base.recipe.text()}"))
    return result, text


@dataclass(frozen=True)
class Fit:
    """A budget's choice: its name and Budget, the recipe the chooser picked and its Choice, and the refinement from
    it (None without a build budget)."""

    name: str
    budget: recipe_choice.Budget
    recipe: recipes.Recipe
    choice: recipe_choice.Choice
    refined: refine.Refinement | None = None


def fit_report(request: RecipeRequest, targets: tuple[str, ...], max_bytes=(), max_kld=(), stock=(),
               only: tuple[str, ...] = (), out: Path | None = None, progress: bool = False,
               search: SearchSettings = SearchSettings()) -> tuple[dict, str]:
    """A sweep (reused when done), then the recipe the chooser picks under each budget, refined with a build budget,
    built and measured beside the stock types `stock` (base type names) and the request's other recipes, each choice
    reported on the held-out chunks too with a split; with `out`, written there too."""
    if not max_bytes and not max_kld:
        raise QevalError("give a budget: --max-mb or --max-kld")
    base, *others = request.recipes
    # the sweep's single-group variants are analysis, not candidates: only the chosen ones are deployed
    analysis = dataclasses.replace(request, recipes=(base,), deploy=None)
    swept = sweep(analysis, targets, only, _announce(progress), search=search)
    budgets = [(f"≤ {b / 1e6:.1f} MB", recipe_choice.Budget(max_bytes=b)) for b in max_bytes]
    budgets += [(f"KLD ≤ {k:g}", recipe_choice.Budget(max_kld=k)) for k in max_kld]
    fits = [_fit(swept, name, budget, search.refine_builds, analysis, progress) for name, budget in budgets]
    refined = [f.refined.best.recipe for f in fits if f.refined]
    chosen = tuple(dict.fromkeys([*(f.recipe for f in fits), *refined, *others, *(recipes.Recipe(s) for s in stock)]))
    variants = measure_recipes(dataclasses.replace(request, recipes=chosen), _announce(progress))
    rows = [_budget_row(f, variants, swept.split) for f in fits]
    board_ = board_rows(variants)
    # decided early: the sweep's board and the budgets' board, their chunks together
    early = early_figures(request, [swept.base, *(r.variant for r in swept.rows), *variants])
    split, split_text = _split_figures(swept.split)
    choices = recipes_text.choices_markdown(rows) if swept.split or search.refine_builds else None
    text = "\n".join(["Budgeted recipes (predicted from the sweep, then measured), each beside the stock type nearest "
                      "its budget (in size for a size budget, in mean KLD for a KLD budget)", *split_text, "",
                      recipes_text.budgets_markdown(rows), *(["", choices] if choices else []), "",
                      recipes_text.recipes_markdown(board_), *_early_text(early)])
    result, text = _with_deployment(request, variants, {"budgets": rows, "rows": board_, **split, **early}, text)
    if out is not None:
        _write(out, "recipes", result, text, recipes_text.plot_recipe_front(board_))
    return result, text


def _fit(swept: Sweep, name: str, budget: recipe_choice.Budget, builds: int | None, request: RecipeRequest,
         progress: bool) -> Fit:
    """The chooser's recipe under one budget, and its refinement within `builds` (none when None)."""
    recipe, choice = fitted_recipe(swept, budget.max_bytes, budget.max_kld)
    if builds is None:
        return Fit(name=name, budget=budget, recipe=recipe, choice=choice)

    def measure(r: recipes.Recipe) -> Variant:
        return measure_recipes(dataclasses.replace(request, recipes=(r,)), _announce(progress))[0]

    tuning = swept.split.tuning if swept.split else None
    refined = refine.refine(choice.options, swept.options(), budget, builds, swept.recipe_of, measure, tuning)
    return Fit(name=name, budget=budget, recipe=recipe, choice=choice, refined=refined)


def _budget_row(fit: Fit, variants: list[Variant], split: ChunkSplit | None) -> dict:
    """A budget's line: the recipe chosen, predicted and measured, and the measured stock type nearest the budget with
    the paired difference of mean KLD (recipe minus stock) on the same tokens; with a split, that difference on the
    tuning and on the held-out chunks and the optimism; with a refinement, the same of the refined recipe and its
    gain over the chosen one."""
    by_recipe = {v.recipe: v for v in variants}
    fitted = by_recipe[fit.recipe]
    tuning = split.tuning if split else None

    def figures(v: Variant) -> dict:
        m = v.summary.measured()
        return {"label": v.label, "bytes": v.bytes, "kld_mean": m["kld_mean"].value, "kld_mean_se": m["kld_mean"].se,
                "same_top1_pct": m["same_top1_pct"].value}

    def distance(v: Variant) -> float:  # which stock type is nearest: a choice, so on the tuning chunks
        if fit.budget.max_bytes is not None:
            return abs(v.bytes - fit.budget.max_bytes)
        return abs(seen_on(v, tuning).kld_mean - fit.budget.max_kld)

    stock = [v for v in variants if is_stock(v.recipe)]
    near = min(stock, key=distance) if stock else None
    row = {"budget": fit.name, "recipe": fitted.recipe.text(), "predicted_bytes": fit.choice.bytes,
           "predicted_kld": fit.choice.kld, "measured": figures(fitted)}
    if near is not None:
        row["stock"] = {**figures(near), **_against(fitted, near, split)}
    if fit.refined is not None:
        best = by_recipe[fit.refined.best.recipe]
        row["refined"] = {"recipe": best.recipe.text(), "measured": figures(best), "builds": fit.refined.builds,
                          "tried": [t.to_json() for t in fit.refined.tried], "gain": _against(best, fitted, split),
                          **({"stock": _against(best, near, split)} if near is not None else {})}
    return row


def _against(v: Variant, other: Variant, split: ChunkSplit | None) -> dict:
    """v − other, paired on the same tokens: over every chunk, and with a split on the tuning chunks, on the held-out
    ones and the optimism (tuning − held-out)."""
    if v is other:
        out = {"diff": 0.0, "se": 0.0}
        parts = {"tuning": {**out, "chunks": len(split.tuning)}, "held_out": {**out, "chunks": len(split.held_out)},
                 "optimism": 0.0} if split else {}
        return {**out, **parts}
    every = kld_cost(v, other)
    if split is None:
        return {"diff": every.diff, "se": every.se}
    tuning = kld_cost(seen_on(v, split.tuning), seen_on(other, split.tuning))
    held = kld_cost(seen_on(v, split.held_out), seen_on(other, split.held_out))
    return {"diff": every.diff, "se": every.se, "tuning": _difference(tuning), "held_out": _difference(held),
            "optimism": tuning.diff - held.diff}


def _write(out: Path, name: str, result: dict, text: str, fig) -> None:
    from qeval.present.plots import save_figure  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    save_figure(fig, out, name)
