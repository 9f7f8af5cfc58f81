"""The model x KV matrix: one plan, run by either executor.

A MatrixPlan says what a matrix computes: the reference capture (a CaptureSpec) and every model x KV
pair. Once the reference store exists, plan_pairs decides for each pair what to do (skip it, compare
its stored candidate, or run its model live) and why; run_pair does it. The local executor
(run_local, here) and the Ray executor (qeval.orchestrate.distributed) both execute that plan, so they reuse and
recompute exactly the same pairs and write the same results.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qeval import identity
from qeval.capture.capture import CaptureSpec, capture, open_live
from qeval.capture.engine import (
    GENERATE,
    PROMPT,
    UNQUANTIZED_KV,
    EngineSettings,
    available_cores,
    planned_fields,
)
from qeval.capture.hub import hub_label, is_hub_spec, is_whole_repo, repo_models, resolve_model, uploader_labels
from qeval.capture.modelinfo import model_facts
from qeval.capture.taskfiles import load_tasks
from qeval.capture.taskscore import TaskSettings
from qeval.compare import metrics, sampler
from qeval.compare.summary import ComparisonSummary
from qeval.errors import QevalError
from qeval.orchestrate import budget
from qeval.orchestrate import tasks as taskrun
from qeval.present import board, report, results
from qeval.storage import runs
from qeval.storage.codec import SqrtLogCode
from qeval.storage.scoring import Scoring
from qeval.storage.store import StoreReader
from qeval.storage.taskstore import TASKS_SUBDIR

# what a matrix does with a pair (PairPlan.action)
SKIP = "skip"  # its saved result answers the request
COMPARE_STORED = "compare stored"  # its store holds the candidate: compare it, no model run
RUN_LIVE = "run live"  # run the model against the reference, saving (or resuming) its store


def parse_model_arg(arg: str) -> tuple[str, str]:
    """`MODEL` or `LABEL=MODEL` -> (label, local path), MODEL a path or an hf: spec (downloaded now); the default
    label is the file name without .gguf, or an hf: spec's quant tag."""
    label, sep, spec = arg.partition("=")
    spec = spec if sep else arg
    path = resolve_model(spec)
    if not sep:
        label = hub_label(spec, path) if is_hub_spec(spec) else Path(spec).name.removesuffix(".gguf")
    return runs.check_label(label), path


def expand_models(models: list[str], repos: list[str] = (), include: tuple[str, ...] = (),
                  exclude: tuple[str, ...] = ()) -> list[str]:
    """The model arguments of a matrix: `models` as given, except that a whole repository (hf:USER/REPO:* among
    them, or each of `repos`) stands for every model in it, filtered by `include`/`exclude` globs on the file
    paths, each labelled by its uploader (hub.uploader_labels)."""
    whole = [m for m in models if is_whole_repo(m)] + list(repos)
    if (include or exclude) and not whole:
        raise QevalError("--include and --exclude filter whole repositories: give --repo hf:USER/REPO")
    specs = [spec for repo in whole for spec in repo_models(repo, include, exclude)]
    return [m for m in models if not is_whole_repo(m)] + [f"{label}={spec}" for label, spec in
                                                          zip(uploader_labels(specs), specs)]


# A KV spec of `--kv`: a cache type, with `:rot` or `:norot` for llama.cpp's KV rotation on or off (else the matrix's
# --kv-rotation): `q4_0,q4_0:norot` puts both on one board.
ROTATION_SUFFIXES = {"rot": "on", "norot": "off"}


def parse_kv_spec(spec: str) -> tuple[str, str | None]:
    """(cache type, rotation mode or None for the matrix's) of a --kv entry."""
    kv, sep, suffix = spec.partition(":")
    if sep and suffix not in ROTATION_SUFFIXES:
        raise QevalError(f"--kv {spec}: the suffix after ':' must be one of {', '.join(ROTATION_SUFFIXES)} "
                         f"(llama.cpp's KV rotation on or off), not {suffix!r}")
    return kv, ROTATION_SUFFIXES.get(suffix)


def pair_label(model_label: str, kv: str) -> str:
    """`Q4_K_M`, `Q4_K_M+kv-q4_0`, `Q4_K_M+kv-q4_0-norot`."""
    return model_label if kv == "f16" else f"{model_label}+kv-{kv.replace(':', '-')}"


def model_kv_pairs(models: list[str], kv_types: list[str], ref_path: str) -> list[tuple[str, str, str]]:
    """(label, model path, KV spec) of every model (PATH or LABEL=PATH) under every KV spec; the reference
    model under f16 is the reference itself, not a pair."""
    for kv in kv_types:
        parse_kv_spec(kv)  # refused before any model is downloaded
    pairs = []
    for model in models:
        label, path = parse_model_arg(model)
        pairs += [(pair_label(label, kv), path, kv) for kv in kv_types if not (path == ref_path and kv == "f16")]
    return pairs


def _fa_for(kv: str) -> str:
    return "on" if kv not in UNQUANTIZED_KV else "auto"


CONTROL = "control"  # the control pair's label
FLOOR = "floor"  # the numerics-floor pair's label
# --floor: which other kernel path of llama.cpp the floor row runs the reference on. `decode`: the other decode mode
# (prompt batches <-> one token per call); `flash-attn`: flash attention flipped; `auto`: `decode` when the board
# holds a quantized KV cache, none otherwise.
FLOORS = ("auto", "decode", "flash-attn", "none")


def control_settings(base: EngineSettings, n_ctx: int) -> EngineSettings:
    """The reference's settings (`base`) under another batch layout, for the control: where the reference sends a
    window in pieces of n_batch < n_ctx tokens, the control sends pieces twice as long (at most a window, so at most
    twice the logits memory); where it decodes whole windows per call, the control sends half windows. n_ubatch is
    the control's n_batch: one physical batch per call."""
    n_batch, _ = base.batch_sizes(n_ctx)
    control = min(2 * n_batch, n_ctx) if n_batch < n_ctx else max(1, n_ctx // 2)
    return dataclasses.replace(base, n_batch=control, n_ubatch=control)


def floor_settings(reference: EngineSettings, floor: str) -> EngineSettings:
    """The reference's settings on another of llama.cpp's kernel paths, for the floor row (FLOORS)."""
    if floor == "decode":
        return dataclasses.replace(reference, decode=GENERATE if reference.decode == PROMPT else PROMPT)
    return dataclasses.replace(reference, flash_attn="off" if reference.flash_attn in ("auto", "on") else "on")


def pair_settings(kv: str, base: EngineSettings = EngineSettings()) -> EngineSettings:
    """How a matrix runs a model with KV spec `kv` (parse_kv_spec; a quantized V cache needs flash attention); the
    rest (where it runs, batch sizes, RoPE scaling, decode mode, the rotation when the spec names none) from `base`."""
    cache, rotation = parse_kv_spec(kv)
    if rotation is None:  # the matrix's --kv-rotation is for its quantized caches; an f16 one has none to set
        rotation = base.kv_rotation if cache not in UNQUANTIZED_KV else "auto"
    return dataclasses.replace(base, type_k=cache, type_v=cache, flash_attn=_fa_for(cache), kv_rotation=rotation)


@dataclass(frozen=True)
class TaskRequest:
    """A task set the reference and every pair are scored on (as llama-perplexity scores tasks), for flips."""

    task: str  # a task file or hf:DATASET[/CONFIG][:SPLIT] (qeval.capture.taskfiles)
    kind: str | None = None  # hellaswag, winogrande or mc; None: guessed from the file
    limit: int | None = None  # llama-perplexity's --*-tasks N selection; None: every task
    name: str | None = None  # the task set's name (its folder in RUNS_DIR/tasks), set by plan_matrix


@dataclass(frozen=True)
class Pair:
    """One model x KV cell of the matrix, as asked for."""

    label: str
    model: str  # GGUF path
    kv: str
    settings: EngineSettings


@dataclass(frozen=True)
class MatrixPlan:
    """What a matrix computes: `reference` is captured into its store (reused or resumed when it is
    there), then every pair is compared against its first `reference.chunks` chunks (all when None)."""

    reference: CaptureSpec
    pairs: tuple[Pair, ...]
    directory: Path  # the runs directory: every store and result
    samplers: tuple[str, ...] = ()  # computed for every pair too (qeval.compare.sampler names)
    tasks: tuple[TaskRequest, ...] = ()  # scored with the reference and every pair too: flips columns

    @property
    def total_chunks(self) -> int | None:
        """Chunks the whole matrix goes through (for progress), when known before the reference is."""
        n = self.reference.chunks
        return n * (1 + len(self.pairs)) if n else None

    def cells(self) -> list[tuple[str, str, str]]:
        """(label, model, kv) of every pair, as the PPL matrix lays them out."""
        return [(p.label, p.model, p.kv) for p in self.pairs]

    def grid(self, summaries: list[ComparisonSummary]) -> tuple[list[tuple[str, str, str]], list[ComparisonSummary]]:
        """The cells of the PPL matrix and their summaries: every pair but the control and the floor, whose cell (the
        reference model, KV f16) is the reference's own."""
        kept = [(cell, s) for cell, s in zip(self.cells(), summaries) if cell[0] not in (CONTROL, FLOOR)]
        return [cell for cell, _ in kept], [s for _, s in kept]


@dataclass(frozen=True)
class MatrixRequest:
    """Everything a matrix is asked for, as one value (`qeval matrix`, `qeval demo` and the API build one)."""

    ref_label: str
    ref_path: str  # a local GGUF
    pairs: tuple[tuple[str, str, str], ...]  # (label, local GGUF, KV spec) of every pair (model_kv_pairs)
    directory: Path  # the runs directory
    chunks: int | None = None  # of the reference; None: every window of the corpus
    n_ctx: int = 512
    corpus: str | None = None
    engine: EngineSettings = EngineSettings()  # every run's, but each pair's KV cache
    force: bool = False  # a reference store of another capture is replaced
    scoring: str = "half"
    concat: bool = False
    samplers: tuple[str, ...] = ()  # presets or settings strings (qeval.compare.sampler) every pair is measured with
    tasks: tuple[TaskRequest, ...] = ()  # task sets every model is scored on too
    control: bool = False  # one more pair, CONTROL: the reference model under control_settings (the noise floor)
    floor: str = "none"  # one more pair, FLOOR: the reference model on another kernel path (FLOORS)
    chat_template: str | None = None  # of a conversation corpus (qeval.capture.capture.CaptureSpec)
    chat_template_kwargs: str | None = None

    def floor_kind(self) -> str | None:
        """Which floor row the board carries (FLOORS), None for none."""
        if self.floor not in FLOORS:
            raise QevalError(f"--floor must be one of {', '.join(FLOORS)}, not {self.floor!r}")
        if self.floor == "auto":
            quantized = any(parse_kv_spec(kv)[0] not in UNQUANTIZED_KV for _, _, kv in self.pairs)
            return "decode" if quantized else None
        return None if self.floor == "none" else self.floor


def plan_matrix(request: MatrixRequest) -> MatrixPlan:
    """The plan of a matrix request: the reference and every pair, each run with the request's engine settings but
    its KV cache. Every bad setting, label, sampler or task file is refused here, before hours of work start."""
    r, engine = request, request.engine
    chosen = tuple(s.name for s in sampler.parse_all(r.samplers))
    named = []
    for task in r.tasks:
        if task.limit is not None and task.limit < 1:
            raise QevalError("--task-limit must be at least 1")
        # a missing or malformed task file is refused now
        named.append(dataclasses.replace(task, name=load_tasks(task.task, task.kind).name))
    planned = tuple(Pair(label, path, kv, pair_settings(kv, engine).validate()) for label, path, kv in r.pairs)
    ref_settings = pair_settings("f16", engine).validate()
    if r.control:
        planned += (Pair(CONTROL, r.ref_path, "f16", pair_settings("f16", control_settings(engine, r.n_ctx)).validate()),)
    floor = r.floor_kind()
    if floor:
        planned += (Pair(FLOOR, r.ref_path, "f16", floor_settings(ref_settings, floor).validate()),)
    labels = [p.label for p in planned]
    if len(set(labels)) != len(labels) or r.ref_label in labels:
        raise QevalError(f"labels must be unique (reference {r.ref_label}, candidates {', '.join(labels)}); "
                         "name models with LABEL=PATH")
    reference = CaptureSpec(model=r.ref_path, out=str(runs.store_path(runs.check_label(r.ref_label), r.directory)),
                            label=r.ref_label, corpus=r.corpus, n_ctx=r.n_ctx, chunks=r.chunks,
                            settings=ref_settings, replace=r.force, scoring=Scoring.parse(r.scoring).rule,
                            concat=r.concat, chat_template=r.chat_template,
                            chat_template_kwargs=r.chat_template_kwargs)
    return MatrixPlan(reference, planned, r.directory, chosen, tuple(named))


@dataclass(frozen=True)
class PairPlan:
    """What a matrix does with one pair (`action`: SKIP, COMPARE_STORED or RUN_LIVE); `note`, the line
    the matrix prints for it: why it is skipped, or why something saved is not reused."""

    label: str
    model: str
    settings: EngineSettings
    action: str
    note: str = ""
    samplers: tuple[str, ...] = ()  # computed too (qeval.compare.sampler names)


def plan_pairs(plan: MatrixPlan) -> tuple[int, list[PairPlan]]:
    """(chunks compared, the plan of every pair), from the reference store, which must exist: the
    reference decides how many chunks every pair has."""
    with StoreReader(plan.reference.out) as ref_store:
        n_chunks = ref_store.header.n_chunks if plan.reference.chunks is None else plan.reference.chunks
        return n_chunks, [plan_pair(ref_store, n_chunks, p.label, p.model, p.settings, plan.directory, plan.samplers)
                          for p in plan.pairs]


def plan_pair(ref_store, n_chunks: int, label: str, model: str, settings: EngineSettings,
              directory: Path, samplers: tuple[str, ...] = ()) -> PairPlan:
    """The plan for candidate `label` (GGUF `model` run with `settings`, measured with `samplers` too) against
    the open reference store over its first n_chunks chunks, from what `directory` holds: its result, and its
    store."""
    try:
        facts = model_facts(model)
        planned = identity.planned_producer(facts, planned_fields(facts, settings, ref_store.header.n_ctx),
                                            ref_store.header.n_ctx, SqrtLogCode().params(), ref_store.header.scoring)
    except (QevalError, OSError):
        return PairPlan(label, model, settings, RUN_LIVE, samplers=samplers)  # running it says what is wrong
    request = identity.ComparisonRequest(identity.reference_identity(ref_store, n_chunks), planned, n_chunks,
                                         samplers=tuple(sampler.settings_names(samplers)))
    result_path = results.result_path(directory / results.RESULTS_SUBDIR, label, ref_store.header.label)
    saved = results.saved_request(result_path)
    usable, store_changes = _stored_candidate(runs.store_path(label, directory), planned, ref_store, n_chunks)
    if saved is not None and saved.key == request.key:
        return PairPlan(label, model, settings, SKIP, f"{label}: done earlier, skipped", samplers)
    action = COMPARE_STORED if usable else RUN_LIVE
    if saved is not None:
        note = f"{label}: recomputed: its saved result answers another request ({_listed(request.changes_from(saved))})"
    elif result_path.is_file():
        note = f"{label}: recomputed: its saved result records no request (saved by an older qeval)"
    elif store_changes:
        note = f"{label}: its store held another capture ({_listed(store_changes)}): replaced"
    else:
        note = ""
    return PairPlan(label, model, settings, action, note, samplers)


def _listed(changes: list[str]) -> str:
    return "; ".join(changes) + ", saved vs now"


def _stored_candidate(path: Path, planned: dict, ref_store, n_chunks: int) -> tuple[bool, list[str]]:
    """(whether the store at `path` is a complete capture of the planned candidate over the reference's
    first n_chunks windows, how its producer differs from the planned one)."""
    if not path.is_file():
        return False, []
    try:
        with StoreReader(path, tolerate_torn_tail=True) as store:
            differences = identity.changes(identity.producer(store.header), planned)
            holds = store.complete and identity.holds_windows(store.header, store.tokens, range(n_chunks),
                                                              ref_store.tokens[:n_chunks], ref_store.header)
            return holds and not differences, differences
    except QevalError:
        return False, ["it is not a readable store"]


@dataclass(frozen=True)
class PairRun:
    """What run_pair did: where it saved the result, over how many chunks."""

    result: Path  # the saved result
    chunks: int
    resumed_chunks: int  # read back from the store an earlier, interrupted run left


def run_pair(pair: PairPlan, ref, n_chunks: int, directory: Path, threads: int,
             on_chunk: Callable[[int], None] | None = None) -> PairRun:
    """Compare a pair that is not skipped against the open reference `ref` over n_chunks chunks, with its
    samplers, and save its result (`qeval kld --save LABEL --save-result --force --sampler ...`): its stored
    candidate, or its model run live into its store, which continues where an interrupted run (a killed Ray
    task) left it."""
    store = runs.store_path(pair.label, directory)
    resumed = 0
    with contextlib.ExitStack() as stack:
        writer = None
        if pair.action == COMPARE_STORED:
            cand = stack.enter_context(contextlib.closing(StoreReader(store)))
        else:
            engine, cand = open_live(pair.model, ref, n_chunks, pair.settings, pair.label, store, replace=True)
            stack.callback(engine.close)
            stack.callback(cand.close)
            writer, resumed = cand.writer, len(cand.resumed)
        cmp = metrics.compare(ref, cand, n_chunks, threads=threads, on_chunk=on_chunk, samplers=pair.samplers)
        if writer is not None:
            writer.finish()
        path = results.save_result(cmp, directory / results.RESULTS_SUBDIR)
    return PairRun(path, len(cmp.chunks), resumed)


@dataclass(frozen=True)
class MatrixRun:
    """What an executor reports: the reference's line, one line per pair worth a mention, and every
    pair's result summary in plan order."""

    reference_text: str
    lines: list[str]
    summaries: list[ComparisonSummary]


def saved_summaries(plan: MatrixPlan) -> list[ComparisonSummary]:
    result_dir = plan.directory / results.RESULTS_SUBDIR
    return [results.load_result(results.result_path(result_dir, p.label, plan.reference.label),
                                with_per_token=False).summary for p in plan.pairs]


def run_local(plan: MatrixPlan, advance: Callable[[int], None], announce: bool = False) -> MatrixRun:
    """Execute the plan here, one capture or pair after another; advance(n) counts chunks gone through. Before the
    first window is decoded, what the whole matrix writes and roughly how long it takes is said (`announce`) and
    checked against the free disk (qeval.orchestrate.budget): every pair counted as run live when the reference
    is still to capture, the pairs that run when it is there."""
    def check_all(start) -> None:
        n = plan.reference.chunks or start.header.chunk_stop
        budget.matrix_budget(f"matrix: reference {plan.reference.label} + {len(plan.pairs)} pairs", plan.directory,
                             start.header, n, [(p.label, p.model, p.settings) for p in plan.pairs], start,
                             len(plan.samplers)).check(announce)

    captured = capture(plan.reference, on_chunk=advance, on_plan=lambda total, done: advance(done),
                       on_start=check_all)
    n_chunks, pairs = plan_pairs(plan)
    with StoreReader(plan.reference.out) as ref:
        running = [(p.label, p.model, p.settings) for p in pairs if p.action == RUN_LIVE]
        if captured.status == "already complete" and running:
            budget.matrix_budget(f"matrix: {len(running)} of {len(pairs)} pairs to run", plan.directory,
                                 ref.header, n_chunks, running, samplers=len(plan.samplers)).check(announce)
        for pair in pairs:
            if pair.action == SKIP:
                advance(n_chunks)
            else:
                run_pair(pair, ref, n_chunks, plan.directory, available_cores(), advance)
    return MatrixRun(captured.summary_line(), [p.note for p in pairs if p.note], saved_summaries(plan))


def run_tasks(plan: MatrixPlan, on_plan: Callable[[int, int], None] | None = None,
              on_tasks: Callable[[int], None] | None = None) -> list[str]:
    """Score every task set of the plan with the reference and with every pair (its own KV cache settings), into
    task stores in the runs directory: a complete store of the same capture is reused, an interrupted one resumed,
    one of another capture replaced. Runs here, whichever executor ran the pairs. One line per store."""
    lines = []
    models = [(plan.reference.label, plan.reference.model, plan.reference.settings),
              *((p.label, p.model, p.settings) for p in plan.pairs)]
    for request in plan.tasks:
        for label, model, settings in models:
            result, _ = taskrun.capture_tasks(model, request.task, request.kind, request.limit, label, plan.directory,
                                              settings=TaskSettings(engine=settings), force=True, on_plan=on_plan,
                                              on_tasks=on_tasks)
            lines.append(f"{result['task'].get('name')}: {label} accuracy {result['accuracy_pct']:.3f} % "
                         f"({result['correct']}/{result['n']}), {result['status']}")
    return lines


def _per_token(plan: MatrixPlan, label: str) -> dict | None:
    """The per-token columns of a pair's saved result (its paired difference with the floor reads them)."""
    path = results.result_path(plan.directory / results.RESULTS_SUBDIR, label, plan.reference.label)
    return results.load_result(path, with_per_token=True).per_token


def matrix_result(plan: MatrixPlan, run: MatrixRun, task_lines: list[str] = ()) -> tuple[dict, str]:
    """(JSON, text) of a finished matrix: the PPL matrix and the board of every pair, with the task flips of the
    plan's task sets."""
    summaries = run.summaries
    names = {t.name for t in plan.tasks}
    rows = [board.row_with_flips(s, plan.samplers, plan.directory / TASKS_SUBDIR, names=names) for s in summaries]
    board.compare_with_control(rows)
    board.compare_with_floor(rows, lambda row: _per_token(plan, row.label))
    ref_label = plan.reference.label
    text = "\n".join([run.reference_text, *run.lines, *task_lines, "",
                      f"reference {ref_label}: {summaries[0].chunks} chunks of {plan.reference.n_ctx}, "
                      f"{summaries[0].scored_tokens} scored tokens" if summaries else "",
                      "", "PPL matrix (rows: model, columns: KV cache)",
                      report.ppl_matrix_markdown(*plan.grid(summaries)),
                      "", "Leaderboard (sorted by mean KLD)",
                      board.leaderboard_markdown(rows, plan.samplers, board.common_tasks(rows)),
                      *(["", board.CONTROL_NOTE] if board.has_control(rows) else []),
                      *(["", board.FLOOR_NOTE] if board.has_floor(rows) else [])])
    return {"reference": ref_label, "rows": [r.to_json() for r in rows],
            "results": [s.to_json() for s in summaries]}, text
