"""Variants from recipes, measured: each recipe (qeval.engine.recipe) built from a source GGUF with llama.cpp's own
quantizer, run live against a reference store as `qeval kld --ref STORE --cand VARIANT.gguf`, its result saved
in RUNS_DIR/recipes/results.

One variant is on disk at a time: it is deleted once measured, unless kept. A ledger (RUNS_DIR/recipes/variants.json)
maps each variant's identity (qeval.engine.recipe.variant_identity: source, recipe, quantizer build) to the facts
of the file it built; with them the request a measurement answers is known without the file
(qeval.orchestrate.matrix.planned_request), so a variant whose saved result answers it is neither rebuilt nor
measured again.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qeval.engine import recipe as recipes
from qeval.engine.engine import EngineSettings, available_cores
from qeval.engine.modelinfo import model_facts
from qeval.engine.probe import build_id
from qeval.compare.paired_stats import PairedDifference
from qeval.compare.summary import ComparisonSummary
from qeval.errors import QevalError
from qeval.identity import digest
from qeval.orchestrate import matrix
from qeval.orchestrate.paired import paired_difference
from qeval.present import results
from qeval.storage import runs

RECIPES_SUBDIR = "recipes"
LEDGER = "variants.json"
MEASURED, REUSED = "built and measured", "reused"


@dataclass(frozen=True)
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

    def to_json(self) -> dict:
        kld = self.summary.measured().get("kld_mean")
        return {"label": self.label, "recipe": self.recipe.text(), "canonical": self.recipe.canonical(),
                "bytes": self.bytes, "kld_mean": kld.value if kld else None, "kld_mean_se": kld.se if kld else None,
                "result": str(self.result), "status": self.status}


class Ledger:
    """Variant identity -> the facts of the GGUF it built (qeval.engine.modelinfo.model_facts), in a JSON file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries = json.loads(path.read_text())
        except FileNotFoundError:
            self.entries = {}
        except (OSError, ValueError) as exc:
            raise QevalError(f"cannot read the recipes' ledger {path} ({exc}): remove it to measure every "
                             "recipe again") from None

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return entry["facts"] if entry else None

    def put(self, key: str, recipe: recipes.Recipe, facts: dict) -> None:
        self.entries[key] = {"recipe": recipe.text(), "facts": facts}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.part")
        tmp.write_text(json.dumps(self.entries, indent=1))
        tmp.replace(self.path)


def measure_recipes(request: RecipeRequest, on_variant: Callable[[Variant], None] | None = None,
                    on_chunk: Callable[[int], None] | None = None) -> list[Variant]:
    """Every recipe of the request, measured (or its saved result reused), in order."""
    source = Path(request.source)
    if not source.is_file():
        raise QevalError(f"source model {source} does not exist")
    source_facts = model_facts(source)
    quantizer = build_id()
    ledger = Ledger(request.recipes_dir / LEDGER)
    out = []
    with contextlib.closing(runs.open_source(request.ref, request.directory)) as ref:
        n = ref.header.chunk_stop if request.chunks is None else min(request.chunks, ref.header.chunk_stop)
        for recipe in request.recipes:
            key = digest(recipes.variant_identity(source_facts, recipe, quantizer))
            variant = _reused(request, ref, n, recipe, ledger.get(key)) or _built(request, ref, n, recipe, key,
                                                                                  ledger, on_chunk)
            out.append(variant)
            if on_variant:
                on_variant(variant)
    return out


def _result_path(request: RecipeRequest, label: str, ref) -> Path:
    return results.result_path(request.recipes_dir / results.RESULTS_SUBDIR, label, ref.header.label)


def _reused(request: RecipeRequest, ref, n: int, recipe: recipes.Recipe, facts: dict | None) -> Variant | None:
    """The variant whose saved result answers what measuring it now would (its facts from the ledger), else None."""
    if facts is None:
        return None
    path = _result_path(request, recipe.label(), ref)
    saved = results.saved_request(path)
    if saved is None or saved.key != matrix.planned_request(ref, n, facts, request.engine).key:
        return None
    return _variant(recipe, facts, path, REUSED)


def _built(request: RecipeRequest, ref, n: int, recipe: recipes.Recipe, key: str, ledger: Ledger,
           on_chunk) -> Variant:
    """Build the variant, measure it live, save its result; its GGUF deleted unless kept."""
    label = recipe.label()
    request.recipes_dir.mkdir(parents=True, exist_ok=True)
    gguf = request.recipes_dir / f"{label}.gguf"
    threads = request.engine.n_threads or available_cores()
    recipes.build(request.source, recipe, gguf, threads)
    try:
        facts = model_facts(gguf)
        pair = matrix.PairPlan(label, str(gguf), request.engine, matrix.RUN_LIVE)
        run = matrix.run_pair(pair, ref, n, request.recipes_dir, threads, on_chunk)
        ledger.put(key, recipe, facts)
    finally:
        if not request.keep:
            gguf.unlink(missing_ok=True)
    return _variant(recipe, facts, run.result, MEASURED)


def _variant(recipe: recipes.Recipe, facts: dict, path: Path, status: str) -> Variant:
    res = results.load_result(path, with_per_token=True)
    return Variant(recipe, recipe.label(), int(facts["file_size"]), res.summary, res.per_token, path, status)


def kld_cost(variant: Variant, base: Variant) -> PairedDifference:
    """The variant's mean KLD minus the base's on the same tokens, chunks as the unit."""
    a, b = variant.per_token, base.per_token
    return paired_difference(a["kld"], b["kld"], b["chunk"], "kld_mean", names=(variant.label, base.label))


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
