"""Variants from recipes, measured: each recipe (qeval.engine.recipe) built from a source GGUF with llama.cpp's own
quantizer, run live against a reference store as `qeval kld --ref STORE --cand VARIANT.gguf`, its result saved
in RUNS_DIR/recipes/results.

One variant is on disk at a time: it is deleted once measured, unless kept. A ledger (RUNS_DIR/recipes/variants.json:
qeval.storage.variants) maps each variant's identity (qeval.engine.recipe.variant_identity: source, each tensor's
planned type, imatrix, quantizer build) to the facts of the file it built and the label of the recipe that built it, under which its
result is saved; with them the request a measurement answers is known without the file
(qeval.orchestrate.matrix.planned_request), so a variant whose saved result answers it is neither rebuilt nor
measured again — under any spelling: recipes that plan the same types are one variant, measured once (a dry run
per recipe, about a second, tells).

Decided early (RecipeRequest.early, `--early`): the variants are one board, run in the matrix's rounds
(qeval.orchestrate.matrix.decide_in_rounds, the rule of qeval.compare.early): each visits the chunks in the seeded
order and stops once its mean KLD is known to the stated precision or its place (order against its neighbours, size
/ KLD front) is settled. The board needs its running variants at hand between rounds, so with --early a variant stays
on disk while it runs and is deleted once a round stops it (rebuilt if a later round asks it to run on): more than
one variant on disk at a time, up to every variant of the board in the first round. Its result is an early one (the
chunks it holds, why it stopped), which a later run without --early extends from its checkpoint; a variant whose
saved early result already holds the chunks a round asks for is not built.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qeval.engine import recipe as recipes
from qeval.engine.engine import EngineSettings, available_cores
from qeval.engine.modelinfo import model_facts
from qeval.engine.probe import build_id
from qeval.compare.chunk_split import ChunkSubset
from qeval.compare.early import EarlySettings, held_prefix
from qeval.compare.paired_stats import PairedDifference, on_common_chunks, paired_difference
from qeval.compare.summary import ComparisonSummary
from qeval.errors import QevalError
from qeval.identity import digest
from qeval.orchestrate import deploy, matrix
from qeval.orchestrate.deploy import DeployRow, DeploySpec
from qeval.present import results
from qeval.storage import runs
from qeval.storage.results import result_path, saved_request
from qeval.storage.variants import Ledger

RECIPES_SUBDIR = "recipes"
MEASURED, REUSED = "built and measured", "reused"


@dataclass(frozen=True, kw_only=True)
class RecipeRequest:
    """Recipes to measure: built from `source`, each compared with the reference store `ref` over its first
    `chunks` chunks (all when None), in the runs directory `directory`."""

    ref: str  # a store label or path
    source: str  # the GGUF every variant is built from
    recipes: tuple[recipes.Recipe, ...]
    directory: Path
    chunks: int | None = None
    engine: EngineSettings = EngineSettings()
    keep: bool = False  # keep each variant's GGUF in RUNS_DIR/recipes (else deleted once measured)
    early: EarlySettings | None = None  # the board decided early (the module's docstring); None: every chunk
    deploy: DeploySpec | None = None  # also every variant's speed and memory (--deploy; the module's docstring)

    @property
    def recipes_dir(self) -> Path:
        return self.directory / RECIPES_SUBDIR


@dataclass(frozen=True)
class Variant:
    """A recipe measured: its label, file size, comparison summary and per-token columns, and whether it was
    built now or its saved result reused."""

    recipe: recipes.Recipe
    label: str
    bytes: int
    summary: ComparisonSummary
    per_token: dict
    result: Path
    status: str
    stopped: str | None = None  # on a board decided early: why it stopped (qeval.compare.early); None: not early

    def to_json(self) -> dict:
        kld = self.summary.measured().get("kld_mean")
        early = ({"chunks": self.summary.chunks, "scored_tokens": self.summary.scored_tokens, "stopped": self.stopped}
                 if self.stopped is not None else {})
        return {"label": self.label, "recipe": self.recipe.text(), "canonical": self.recipe.canonical(),
                "bytes": self.bytes, "kld_mean": kld.value if kld else None, "kld_mean_se": kld.se if kld else None,
                "result": str(self.result), "status": self.status, **early}


@dataclass(frozen=True)
class Keyed:
    """A recipe of a request, its variant's identity (a digest of qeval.engine.recipe.variant_identity) and the label
    the variant's result is saved under: the label of the recipe that first built it (the ledger's), else its own."""

    recipe: recipes.Recipe
    key: str
    result_label: str


def measure_recipes(request: RecipeRequest, on_variant: Callable[[Variant], None] | None = None,
                    on_chunk: Callable[[int], None] | None = None) -> list[Variant]:
    """Every recipe of the request, measured (or its saved result reused), in order; recipes that are one variant
    (the module's docstring) measured once. Decided early with request.early (on_variant then called once the board
    has stopped, on_chunk not at all)."""
    source = Path(request.source)
    if not source.is_file():
        raise QevalError(f"source model {source} does not exist")
    source_facts = model_facts(source)
    quantizer = build_id()
    ledger = Ledger(request.recipes_dir)
    keyed = [_keyed(source, source_facts, recipe, quantizer, ledger) for recipe in request.recipes]
    with contextlib.closing(runs.open_source(request.ref, request.directory)) as ref:
        n = chunks_compared(request, ref)
        if request.early is not None:
            first: dict[str, Keyed] = {}  # each variant's first spelling
            for k in keyed:
                first.setdefault(k.key, k)
            board = dict(zip(first, _measure_early(request, ref, n, list(first.values()), ledger)))
            out = [board[k.key] if first[k.key] is k else _as_spelled(board[k.key], k.recipe) for k in keyed]
            for variant in out if on_variant else ():
                on_variant(variant)
        else:
            out, done = [], {}
            for k in keyed:
                if k.key in done:
                    variant = _as_spelled(done[k.key], k.recipe)
                else:
                    variant = done[k.key] = (_reused(request, ref, n, k, ledger.get(k.key))
                                             or _built(request, ref, n, k, ledger, on_chunk))
                out.append(variant)
                if on_variant:
                    on_variant(variant)
    _deploy_missing(request, keyed, ledger)
    return out


def _deploy(request: RecipeRequest, keyed: Keyed, gguf: Path) -> None:
    """The variant's speed and memory (request.deploy), measured while its GGUF is on disk; saved as its record."""
    if request.deploy is not None:
        deploy.measure_rows([DeployRow(keyed.result_label, str(gguf), request.engine)], request.deploy,
                            request.directory)


def _deploy_missing(request: RecipeRequest, keyed: list[Keyed], ledger: Ledger) -> None:
    """With request.deploy: every variant whose record on this machine lacks figures (its result reused, its GGUF
    deleted long ago) built again, measured, and deleted unless kept."""
    if request.deploy is None:
        return
    threads = request.engine.n_threads or available_cores()
    for k in {k.key: k for k in keyed}.values():
        row = DeployRow(k.result_label, "", request.engine)
        if deploy.answered(row, request.deploy, request.directory, ledger.get(k.key)):
            continue
        gguf = request.recipes_dir / f"{k.result_label}.gguf"
        kept = gguf.is_file() and model_facts(gguf)["fingerprint"] == ledger.get(k.key)["fingerprint"]
        gguf = gguf if kept else _build(request, k, ledger, threads)
        try:
            _deploy(request, k, gguf)
        finally:
            if not request.keep:
                gguf.unlink(missing_ok=True)


def deployment(request: RecipeRequest, variants: list[Variant]) -> deploy.DeployRun | None:
    """The records of the variants' speed and memory on this machine (request.deploy), None without --deploy."""
    if request.deploy is None:
        return None
    return deploy.saved_run([v.summary.candidate.label for v in variants], request.directory)


def _keyed(source: Path, source_facts: dict, recipe: recipes.Recipe, quantizer: str, ledger: Ledger) -> Keyed:
    """The recipe's variant identity, from llama.cpp's dry run of it, and the label its result is saved under."""
    key = digest(recipes.variant_identity(source_facts, recipe, recipes.plan(source, recipe), quantizer))
    return Keyed(recipe, key, ledger.label(key) or recipe.label())


def _as_spelled(variant: Variant, recipe: recipes.Recipe) -> Variant:
    """`variant` shown as `recipe`, given again (in that spelling or another): its measurement reused."""
    return dataclasses.replace(variant, recipe=recipe, label=recipe.label(), status=REUSED)


def chunks_compared(request: RecipeRequest, ref) -> int:
    """The chunks of the open reference store every variant is compared over: its first request.chunks, or all."""
    return ref.header.chunk_stop if request.chunks is None else min(request.chunks, ref.header.chunk_stop)


def _measure_early(request: RecipeRequest, ref, n: int, keyed: list[Keyed], ledger: Ledger) -> list[Variant]:
    """The variants (one recipe each) as one board decided early (the module's docstring): a variant whose saved full
    result answers the request is reused as it is; the others run in the matrix's rounds, each built when a round needs
    chunks its saved result does not hold, kept while it runs and deleted (unless kept) once the board stops it."""
    settings = request.early
    order = [int(c) for c in settings.order(n)]
    record = settings.record(order)
    threads = request.engine.n_threads or available_cores()
    full = [_reused(request, ref, n, k, ledger.get(k.key)) for k in keyed]
    on_disk: dict[int, Path] = {}
    built: set[int] = set()

    def run(i: int, target: int) -> None:
        k = keyed[i]
        if _held(request, ref, n, k, ledger.get(k.key), order) >= target:
            return  # its saved early result (an earlier run's) holds them already: nothing to build
        if i not in on_disk:
            on_disk[i] = _build(request, k, ledger, threads)
            built.add(i)
        pair = matrix.PairPlan(label=k.result_label, model=str(on_disk[i]), settings=request.engine,
                               action=matrix.RUN_LIVE)
        matrix.run_pair(pair, ref, n, request.recipes_dir, threads, order=order, early=record,
                        stop=lambda parts: len(held_prefix(order, parts)) >= target)

    def drop(i: int) -> None:
        gguf = on_disk.pop(i, None)
        if gguf is not None and not request.keep:
            gguf.unlink(missing_ok=True)

    def stopped(i: int) -> None:  # the board stopped it: its speed and memory measured before its GGUF goes
        if i in on_disk:
            _deploy(request, keyed[i], on_disk[i])
        drop(i)

    def decisions():
        return matrix.decisions_of([(k.recipe.label(), _result_path(request, k.result_label, ref)) for k in keyed], n,
                                   settings)

    try:
        matrix.decide_in_rounds(settings, [i for i, v in enumerate(full) if v is None], matrix.one_by_one(run),
                                decisions, stopped)
    finally:
        for i in list(on_disk):
            drop(i)
    out = []
    for i, (k, decision) in enumerate(zip(keyed, decisions())):
        status = MEASURED if i in built else REUSED
        variant = full[i] or _variant(k.recipe, ledger.get(k.key), _result_path(request, k.result_label, ref), status)
        out.append(dataclasses.replace(variant, stopped=decision.reason))
    return out


def _held(request: RecipeRequest, ref, n: int, keyed: Keyed, facts: dict | None, order: list[int]) -> int:
    """The chunks of `order` the variant's saved result holds, when (early or full) it answers what measuring the
    variant now would; else 0."""
    if facts is None:
        return 0
    saved = saved_request(_result_path(request, keyed.result_label, ref))
    if saved is None or dataclasses.replace(saved, early=None).key != matrix.planned_request(ref, n, facts,
                                                                                            request.engine).key:
        return 0
    if saved.early is None:
        return n
    return int(saved.early["visited"]) if saved.early.get("order") == order else 0


def early_figures(request: RecipeRequest, variants: list[Variant]) -> dict:
    """What the request's board decided early records and cost (matrix.early_figures); {} when not decided early."""
    if request.early is None:
        return {}
    return matrix.early_figures(request.early, n_compared(request), [v.summary.chunks for v in variants])


def n_compared(request: RecipeRequest) -> int:
    """The chunks every variant of the request is compared over (chunks_compared), its reference opened to tell."""
    with contextlib.closing(runs.open_source(request.ref, request.directory)) as ref:
        return chunks_compared(request, ref)


def _result_path(request: RecipeRequest, label: str, ref) -> Path:
    return result_path(request.recipes_dir / runs.RESULTS_SUBDIR, label, ref.header.label)


def _reused(request: RecipeRequest, ref, n: int, keyed: Keyed, facts: dict | None) -> Variant | None:
    """The variant whose saved result answers what measuring it now would (its facts from the ledger), else None."""
    if facts is None:
        return None
    path = _result_path(request, keyed.result_label, ref)
    saved = saved_request(path)
    if saved is None or saved.key != matrix.planned_request(ref, n, facts, request.engine).key:
        return None
    return _variant(keyed.recipe, facts, path, REUSED)


def _built(request: RecipeRequest, ref, n: int, keyed: Keyed, ledger: Ledger, on_chunk) -> Variant:
    """Build the variant, measure it live over every chunk, save its result; its GGUF deleted unless kept."""
    threads = request.engine.n_threads or available_cores()
    gguf = _build(request, keyed, ledger, threads)
    try:
        pair = matrix.PairPlan(label=keyed.result_label, model=str(gguf), settings=request.engine,
                               action=matrix.RUN_LIVE)
        run = matrix.run_pair(pair, ref, n, request.recipes_dir, threads, on_chunk)
        _deploy(request, keyed, gguf)
    finally:
        if not request.keep:
            gguf.unlink(missing_ok=True)
    return _variant(keyed.recipe, ledger.get(keyed.key), run.result, MEASURED)


def _build(request: RecipeRequest, keyed: Keyed, ledger: Ledger, threads: int) -> Path:
    """The variant's GGUF, built in RUNS_DIR/recipes under its result label; its facts in the ledger."""
    request.recipes_dir.mkdir(parents=True, exist_ok=True)
    gguf = request.recipes_dir / f"{keyed.result_label}.gguf"
    recipes.build(request.source, keyed.recipe, gguf, threads)
    try:
        ledger.put(keyed.key, keyed.recipe.text(), keyed.result_label, model_facts(gguf))
    except BaseException:
        gguf.unlink(missing_ok=True)
        raise
    return gguf


def _variant(recipe: recipes.Recipe, facts: dict, path: Path, status: str) -> Variant:
    res = results.load_result(path, with_per_token=True)
    return Variant(recipe=recipe, label=recipe.label(), bytes=int(facts["file_size"]), summary=res.summary,
                   per_token=res.per_token, result=path, status=status)


@dataclass(frozen=True)
class Seen:
    """A measured variant as a decision sees it (sensitivity costs, the chooser, the refinement): its recipe, label,
    file size and the per-token columns of one chunk subset only, the tuning chunks where the chunks are split
    (qeval.compare.chunk_split): it holds no summary and no other chunk, so nothing that reads it can read a
    held-out chunk."""

    recipe: recipes.Recipe
    label: str
    bytes: int
    per_token: dict

    @property
    def kld_mean(self) -> float:
        """The mean KLD over its tokens (every chunk holds the same number of scored tokens)."""
        return float(np.mean(self.per_token["kld"], dtype=np.float64))


def seen_on(variant: Variant, subset: ChunkSubset | None) -> Seen:
    """`variant` on the chunks of `subset` alone; None: on every chunk it holds."""
    per_token = variant.per_token if subset is None else subset.columns(variant.per_token)
    return Seen(variant.recipe, variant.label, variant.bytes, per_token)


def kld_cost(variant: Variant | Seen, base: Variant | Seen) -> PairedDifference:
    """The variant's mean KLD minus the base's on the same tokens, chunks as the unit: the chunks both hold (on a board
    decided early, each holds a prefix of one chunk order)."""
    a, b = on_common_chunks(variant.per_token, base.per_token), on_common_chunks(base.per_token, variant.per_token)
    return paired_difference(a["kld"], b["kld"], b["chunk"], "kld_mean")


def is_stock(recipe: recipes.Recipe) -> bool:
    """A llama.cpp stock type: a base type alone."""
    return not recipe.overrides and recipe.imatrix is None


def board_rows(variants: list[Variant]) -> list[dict]:
    """Each variant's row (Variant.to_json, its same top-1, stock or recipe), a recipe's with `vs`: its paired
    difference of mean KLD against the measured stock type nearest in size."""
    stock = [v for v in variants if is_stock(v.recipe)]
    rows = []
    for v in variants:
        top1 = v.summary.measured().get("same_top1_pct")
        row = {**v.to_json(), "same_top1_pct": top1.value if top1 else None,
               "kind": "stock" if is_stock(v.recipe) else "recipe"}
        if stock and not is_stock(v.recipe):
            nearest = min(stock, key=lambda s: abs(s.bytes - v.bytes))
            cost = kld_cost(v, nearest)
            row["vs"] = {"label": nearest.label, "bytes": nearest.bytes, "diff": cost.diff, "se": cost.se,
                         "p_value": cost.p_value}
        rows.append(row)
    return rows
