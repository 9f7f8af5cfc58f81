"""The model x KV matrix: one plan, run by either executor.

A MatrixPlan says what a matrix computes: the reference capture (a CaptureSpec) and every model x KV
pair. Once the reference store exists, plan_pairs decides for each pair what to do (skip it, compare
its stored candidate, or run its model live) and why; run_pair does it. The local executor
(run_local, here) and the Ray executor (qeval.orchestrate.distributed) both execute that plan, so they reuse and
recompute exactly the same pairs and write the same results.

A pair run live keeps no candidate logits by default: llama.cpp's float32 rows meet the reference's codes
directly (as `qeval kld --cand MODEL`), and each chunk's per-token results go to the pair's checkpoint
(qeval.storage.checkpoint), from which a killed pair continues. With keep_logits (--keep-logits) its rows are
coded into a store RUNS_DIR/<label>.qeval for later store-vs-store analysis, as before; the store is then what a
killed pair continues from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qeval import identity
from qeval.capture.capture import CaptureSpec, capture, open_live
from qeval.capture.taskscore import TaskSettings
from qeval.compare import early as early_stop
from qeval.compare import metrics, sampler
from qeval.compare.early import EarlySettings, held_prefix
from qeval.compare.summary import ComparisonSummary
from qeval.engine.engine import (
    GENERATE,
    PROMPT,
    UNQUANTIZED_KV,
    EngineSettings,
    available_cores,
    planned_fields,
)
from qeval.engine.build_check import cache_type
from qeval.engine.modelinfo import model_facts
from qeval.errors import QevalError, WriteFailed
from qeval.inputs.hub import hub_label, is_hub_spec, is_whole_repo, repo_models, resolve_model, uploader_labels
from qeval.inputs.taskfiles import load_tasks
from qeval.orchestrate import budget
from qeval.orchestrate.deploy import DeployRow, DeploySpec
from qeval.orchestrate import tasks as taskrun
from qeval.present import board, report, results
from qeval.storage import checkpoint, runs
from qeval.storage.codec import SqrtLogCode
from qeval.storage.results import result_path, saved_request
from qeval.storage.scoring import Scoring
from qeval.storage.store import PIECE_ROWS, StoreReader
from qeval.storage.taskstore import TASKS_SUBDIR

# what a matrix does with a pair (PairPlan.action)
SKIP = "skip"  # its saved result answers the request
COMPARE_STORED = "compare stored"  # its store holds the candidate: compare it, no model run
RUN_LIVE = "run live"  # run the model against the reference, from its checkpoint (or store, keep_logits) on


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


# A KV spec of `--kv`: a cache type of the loaded build (qeval.engine.cache_types), or K and V types apart as
# `K/V` (q8_0/q4_0), with `:rot` or `:norot` for llama.cpp's KV rotation on or off (else the matrix's
# --kv-rotation): `q4_0,q4_0:norot` puts both on one board.
ROTATION_SUFFIXES = {"rot": "on", "norot": "off"}


def parse_kv_spec(spec: str) -> tuple[str, str | None]:
    """(cache types, rotation mode or None for the matrix's) of a --kv entry; a type the build lacks is refused."""
    kv, sep, suffix = spec.partition(":")
    if sep and suffix not in ROTATION_SUFFIXES:
        raise QevalError(f"--kv {spec}: the suffix after ':' must be one of {', '.join(ROTATION_SUFFIXES)} "
                         f"(llama.cpp's KV rotation on or off), not {suffix!r}")
    for cache in cache_pair(kv):
        cache_type(cache, "--kv")
    return kv, ROTATION_SUFFIXES.get(suffix)


def cache_pair(kv: str) -> tuple[str, str]:
    """(K type, V type) of a spec's cache types: `q8_0` is q8_0/q8_0."""
    k, sep, v = kv.partition("/")
    if sep and (not k or not v or "/" in v):
        raise QevalError(f"--kv {kv}: K and V types apart are written K/V (q8_0/q4_0)")
    return k, v if sep else k


def pair_label(model_label: str, kv: str) -> str:
    """`Q4_K_M`, `Q4_K_M+kv-q4_0`, `Q4_K_M+kv-q4_0-norot`; K and V apart, both, K first: `Q4_K_M+kv-q8_0-q4_0`."""
    return model_label if kv == "f16" else f"{model_label}+kv-{kv.replace(':', '-').replace('/', '-')}"


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


def early_settings(seed: int = 0, min_chunks: int = early_stop.MIN_CHUNKS,
                   precision: float = early_stop.REL_PRECISION, sigmas: float = early_stop.NEIGHBOUR_SIGMAS,
                   confidence: float = early_stop.CONFIDENCE) -> EarlySettings:
    """The settings of `--early` from its options, each bad value refused with the option's name."""
    checks = ((min_chunks >= 2, f"--early-min-chunks must be at least 2 (an SE needs two chunks), not {min_chunks}"),
              (0 < precision < 1, f"--early-precision is a share of the mean KLD, in (0, 1) (0.05: ±5 %), not "
                                  f"{precision}"),
              (sigmas > 0, f"--early-sigmas must be > 0, not {sigmas}"),
              (0 < confidence < 1, f"--early-confidence must lie in (0, 1) (0.95: 95 %), not {confidence}"),
              (seed >= 0, f"--early-seed must be >= 0, not {seed}"))
    for ok, message in checks:
        if not ok:
            raise QevalError(message)
    return EarlySettings(seed, early_stop.StopRule(min_chunks=min_chunks, rel_precision=precision,
                                                   neighbour_sigmas=sigmas, confidence=confidence))


def _fa_for(k: str, v: str) -> str:
    return "on" if k not in UNQUANTIZED_KV or v not in UNQUANTIZED_KV else "auto"


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
    k, v = cache_pair(cache)
    if rotation is None:  # the matrix's --kv-rotation is for its quantized caches; an f16 one has none to set
        rotation = base.kv_rotation if _fa_for(k, v) == "on" else "auto"
    return dataclasses.replace(base, type_k=k, type_v=v, flash_attn=_fa_for(k, v), kv_rotation=rotation)


@dataclass(frozen=True)
class TaskRequest:
    """A task set the reference and every pair are scored on (as llama-perplexity scores tasks), for flips."""

    task: str  # a task file or hf:DATASET[/CONFIG][:SPLIT] (qeval.inputs.taskfiles)
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
    keep_logits: bool = False  # pairs run live keep their candidate's store (--keep-logits)
    early: EarlySettings | None = None  # the board decided early (--early); None: every pair over every chunk

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


@dataclass(frozen=True, kw_only=True)
class MatrixRequest:
    """Everything a matrix is asked for, as one value (`qeval matrix`, `qeval demo` and the API build one), built
    with keywords only."""

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
    conversation_depths: str | None = None
    keep_logits: bool = False  # a pair run live keeps its candidate's logits in a store (the module's docstring)
    early: EarlySettings | None = None  # decide the board early (run_early); None: every pair over every chunk
    deploy: DeploySpec | None = None  # also the speed and memory of the reference and every pair (--deploy)

    def floor_kind(self) -> str | None:
        """Which floor row the board carries (FLOORS), None for none."""
        if self.floor not in FLOORS:
            raise QevalError(f"--floor must be one of {', '.join(FLOORS)}, not {self.floor!r}")
        if self.floor == "auto":
            quantized = any(_fa_for(*cache_pair(parse_kv_spec(kv)[0])) == "on" for _, _, kv in self.pairs)
            return "decode" if quantized else None
        return None if self.floor == "none" else self.floor


def deploy_rows(plan: MatrixPlan) -> list[DeployRow]:
    """The rows a matrix's --deploy measures: the reference and every pair as it was run, but the control and the
    floor (the reference again under other batch layouts or kernels: noise floors, not deployments)."""
    ref = plan.reference
    return [DeployRow(ref.label, ref.model, ref.settings),
            *(DeployRow(p.label, p.model, p.settings) for p in plan.pairs if p.label not in (CONTROL, FLOOR))]


def plan_matrix(request: MatrixRequest) -> MatrixPlan:
    """The plan of a matrix request: the reference and every pair, each run with the request's engine settings but
    its KV cache. Every bad setting, label, sampler or task file is refused here, before hours of work start."""
    r, engine = request, request.engine
    if r.early is not None and r.keep_logits:
        raise QevalError("--early and --keep-logits do not go together: a pair that keeps its logits runs every chunk "
                         "in order (run the full board to keep them)")
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
        planned += (Pair(CONTROL, r.ref_path, "f16", pair_settings("f16", control_settings(engine,
                                                                                           r.n_ctx)).validate()),)
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
                            chat_template_kwargs=r.chat_template_kwargs,
                            conversation_depths=r.conversation_depths)
    return MatrixPlan(reference=reference, pairs=planned, directory=r.directory, samplers=chosen, tasks=tuple(named),
                      keep_logits=r.keep_logits, early=r.early)


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
    keep_logits: bool = False  # run live: code its rows into its store (else: uncoded, checkpointed)
    # run live from a saved result of the same candidate over fewer chunks (or a sample of them): its chunks seed the
    # checkpoint instead of running again (extend_from_result)
    extends: Path | None = None


def plan_pairs(plan: MatrixPlan) -> tuple[int, list[PairPlan]]:
    """(chunks compared, the plan of every pair), from the reference store, which must exist: the
    reference decides how many chunks every pair has."""
    with StoreReader(plan.reference.out) as ref_store:
        n_chunks = ref_store.header.n_chunks if plan.reference.chunks is None else plan.reference.chunks
        return n_chunks, [plan_pair(ref_store, n_chunks, p.label, p.model, p.settings, plan.directory, plan.samplers,
                                    plan.keep_logits, plan.early is not None) for p in plan.pairs]


def plan_pair(ref_store, n_chunks: int, label: str, model: str, settings: EngineSettings,
              directory: Path, samplers: tuple[str, ...] = (), keep_logits: bool = False,
              early: bool = False) -> PairPlan:
    """The plan for candidate `label` (GGUF `model` run with `settings`, measured with `samplers` too) against
    the open reference store over its first n_chunks chunks, from what `directory` holds: its result, and its
    store. keep_logits: a pair run live keeps its store, and one whose result was saved without a store is run
    again to keep it. A saved early result (a board decided early) never stands for a full run: the pair runs on
    from its checkpoint; early: the board is decided early again (run_early), which reads it back."""
    try:
        request = planned_request(ref_store, n_chunks, model_facts(model), settings, samplers)
    except (QevalError, OSError):  # running it says what is wrong
        return PairPlan(label=label, model=model, settings=settings, action=RUN_LIVE, samplers=samplers,
                        keep_logits=keep_logits)
    planned = request.candidate
    saved_at = result_path(directory / runs.RESULTS_SUBDIR, label, ref_store.header.label)
    saved = saved_request(saved_at)
    store = runs.store_path(label, directory)
    usable, store_changes = _stored_candidate(store, planned, ref_store, n_chunks)
    if saved is not None and saved.key == request.key:
        if keep_logits and not usable:
            return PairPlan(label=label, model=model, settings=settings, action=RUN_LIVE,
                            note=f"{label}: run again to keep its logits "
                            "(--keep-logits): its result was saved without its store", samplers=samplers,
                            keep_logits=True)
        return PairPlan(label=label, model=model, settings=settings, action=SKIP,
                        note=f"{label}: done earlier, skipped", samplers=samplers)
    action = COMPARE_STORED if usable else RUN_LIVE
    if saved is not None and saved.early and dataclasses.replace(saved, early=None).key == request.key:
        note = "" if early else (f"{label}: decided early on {saved.early.get('visited')} of {n_chunks} chunks: runs "
                                 "on over every chunk, from its checkpoint")
    elif saved is not None and action == RUN_LIVE and not keep_logits and (held := _reusable(saved_at, ref_store,
                                                                                                  request, n_chunks)):
        return PairPlan(label=label, model=model, settings=settings, action=action,
                        note=f"{label}: {held} of {n_chunks} chunks reused from its saved "
                        f"result, the rest run live", samplers=samplers, extends=saved_at)
    elif saved is not None:
        note = f"{label}: recomputed: its saved result answers another request ({_listed(request.changes_from(saved))})"
    elif saved_at.is_file():
        note = f"{label}: recomputed: its saved result records no request (saved by an older qeval)"
    elif store_changes and keep_logits:
        note = f"{label}: its store held another capture ({_listed(store_changes)}): replaced"
    elif store.is_file() and not usable and not keep_logits:  # an older or interrupted --keep-logits run's
        why = f"holds another capture ({_listed(store_changes)})" if store_changes else "is incomplete"
        note = f"{label}: its store {store} {why}: left as it is, not used (--keep-logits replaces or resumes it)"
    else:
        note = ""
    return PairPlan(label=label, model=model, settings=settings, action=action, note=note, samplers=samplers,
                    keep_logits=keep_logits and action == RUN_LIVE)


def planned_request(ref_store, n_chunks: int, facts: dict, settings: EngineSettings,
                    samplers: tuple[str, ...] = ()) -> identity.ComparisonRequest:
    """What running the GGUF model with facts `facts` (qeval.engine.modelinfo.model_facts) live with `settings`
    against the open reference store over its first n_chunks chunks would measure: known before the model runs,
    so that a saved result answering it is reused."""
    n_ctx = ref_store.header.n_ctx
    planned = identity.planned_producer(facts, planned_fields(facts, settings, n_ctx), n_ctx, SqrtLogCode().form(),
                                        ref_store.header.scoring)
    return identity.ComparisonRequest(reference=identity.reference_identity(ref_store, n_chunks), candidate=planned,
                                      chunks=n_chunks, samplers=tuple(sampler.settings_names(samplers)))


def _reusable(result_path: Path, ref, request: identity.ComparisonRequest, n_chunks: int) -> int:
    """How many of the first n_chunks chunks the saved result at `result_path` holds for `request`'s candidate."""
    saved = results.with_reference_top1(results.load_result(result_path), ref)
    held, _ = results.reusable_chunks(saved, ref, request.candidate, request.samplers)
    return len(held & set(range(n_chunks)))


def extend_from_result(ckpt: "checkpoint.Checkpoint", result_path: Path, ref, request: identity.ComparisonRequest,
                       order: list[int]) -> None:
    """Append to a pair's checkpoint the chunks of `order` its saved result holds for `request` (and the checkpoint
    does not): the pair then runs only the others, to the numbers of an uninterrupted run, as from any checkpoint."""
    if not result_path.is_file():
        return
    saved = results.with_reference_top1(results.load_result(result_path), ref)
    held, _ = results.reusable_chunks(saved, ref, request.candidate, request.samplers)
    for chunk, columns in saved.chunk_columns((held & set(order)) - set(ckpt.parts)).items():
        ckpt.append(chunk, columns)


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

    result: Path | None  # the saved result; None when `stop` ended the pair early (its checkpoint holds it)
    chunks: int  # chunks compared: the result's, or the checkpoint's when stopped early
    resumed_chunks: int  # read back from what an earlier, interrupted run left (resumed_from)
    resumed_from: str = "checkpoint"  # "checkpoint", or "store" (keep_logits)
    note: str = ""  # a line for the matrix's text: why something found was not resumed


def progress_path(pair: PairPlan, directory: Path, ref_label: str) -> Path:
    """The file whose chunks count as a pair's progress while it runs (elsewhere: a Ray task): its store when it
    keeps its logits, else its checkpoint."""
    if pair.action == RUN_LIVE and pair.keep_logits:
        return runs.store_path(pair.label, directory)
    return checkpoint.checkpoint_path(directory / runs.RESULTS_SUBDIR, pair.label, ref_label)


def run_pair(pair: PairPlan, ref, n_chunks: int, directory: Path, threads: int,
             on_chunk: Callable[[int], None] | None = None, order: list[int] | None = None,
             stop: Callable[[dict], bool] | None = None, early: dict | None = None) -> PairRun:
    """Compare a pair that is not skipped against the open reference `ref` over n_chunks chunks, with its
    samplers, and save its result (`qeval kld --save-result --sampler ...`): its stored candidate, or its model run
    live, uncoded unless a sampler reads the coded distribution, each chunk's per-token results appended to its
    checkpoint, from which an interrupted run (killed, a full disk, a killed Ray task) continues: the result is
    the uninterrupted run's, bit for bit. With keep_logits, its model is run live into its store instead (`qeval kld
    --save LABEL --force`), which continues where an interrupted run left it.

    order: the chunks to compare, in this order (default: the first n_chunks in order); chunks its checkpoint
    holds are not run again. stop(parts), before the first chunk and after each once its checkpoint holds it
    (parts: chunk -> its per-token columns, every chunk done so far): True ends the pair there, its checkpoint
    kept (PairRun.result None): the seam for deciding a pair early. early: the record of a board decided early
    (qeval.compare.early.EarlySettings.record, less `visited`): a pair `stop` ends is saved as its early result
    over the longest prefix of `order` its checkpoint holds (PairRun.result that result). A pair that goes through
    every chunk is saved as a full result, by chunk (a full result whatever order its chunks were visited in). A
    write that fails (a full disk) raises PairWriteFailed, which names the pair
    and the bytes it still needs; everything written before is kept."""
    if pair.action == RUN_LIVE and pair.keep_logits:
        if order is not None or stop is not None:
            raise ValueError("a pair that keeps its logits runs every chunk, in order")
        return _run_into_store(pair, ref, n_chunks, directory, threads, on_chunk)
    order = list(range(n_chunks)) if order is None else list(order)
    with contextlib.ExitStack() as stack:
        live = pair.action != COMPARE_STORED
        if live:
            coded = sampler.reads_distribution(pair.samplers)
            engine, cand = open_live(pair.model, ref, n_chunks, pair.settings, pair.label, None, coded=coded)
            stack.callback(engine.close)
            stack.callback(cand.close)
        else:
            coded = True
            cand = stack.enter_context(contextlib.closing(StoreReader(runs.store_path(pair.label, directory))))
        request = identity.comparison_request(ref, cand, n_chunks, sampler.settings_names(pair.samplers))
        # how the candidate's rows were read is part of what a checkpoint holds: float32 rows and coded ones give
        # numbers that differ by the code's error, and a result must not mix them
        path = checkpoint.checkpoint_path(directory / runs.RESULTS_SUBDIR, pair.label, ref.header.label)
        try:
            ckpt = stack.enter_context(contextlib.closing(checkpoint.Checkpoint(
                path, {**request.identity(), "candidate_rows": "coded" if coded else "float32"})))
        except WriteFailed as exc:
            raise _write_failed(pair.label, exc, ref, order) from None
        if pair.extends is not None:
            extend_from_result(ckpt, pair.extends, ref, request, order)
        todo = [c for c in order if c not in ckpt.parts]
        if on_chunk and len(order) > len(todo):
            on_chunk(len(order) - len(todo))
        if live:
            cand.produce(todo)

        def stops() -> bool:
            return stop is not None and bool(stop(ckpt.parts))

        def after_chunk(index: int, columns: dict) -> bool:
            ckpt.append(index, columns)
            return stops()

        try:
            if todo and not stops():
                metrics.compare(ref, cand, n_chunks, threads=threads, on_chunk=on_chunk, samplers=pair.samplers,
                                order=todo, after_chunk=after_chunk)
            resumed = len(order) - len(todo)
            note = f"{pair.label}: {ckpt.note}" if ckpt.note else ""
            if any(c not in ckpt.parts for c in order):
                if early is None:
                    return PairRun(result=None, chunks=len(ckpt.parts), resumed_chunks=resumed, note=note)
                sample = held_prefix(order, ckpt.parts)
                cmp = metrics.comparison_of(ref, cand, sample, [ckpt.parts[c] for c in sample],
                                            {**early, "visited": len(sample)})
                result = results.save_result(cmp, directory / runs.RESULTS_SUBDIR)
                return PairRun(result=result, chunks=len(sample), resumed_chunks=resumed, note=note)
            done = sorted(order)  # by chunk: the same result, bit for bit, whatever order the chunks came in
            cmp = metrics.comparison_of(ref, cand, done, [ckpt.parts[c] for c in done])
            result = results.save_result(cmp, directory / runs.RESULTS_SUBDIR)
        except WriteFailed as exc:
            raise _write_failed(pair.label, exc, ref, order, ckpt) from None
        ckpt.remove()
    return PairRun(result=result, chunks=len(order), resumed_chunks=resumed, note=note)


def _run_into_store(pair: PairPlan, ref, n_chunks: int, directory: Path, threads: int,
                    on_chunk: Callable[[int], None] | None) -> PairRun:
    """run_pair of a pair that keeps its logits: its model run live into its store (resumed when an interrupted
    run left one), then compared."""
    store = runs.store_path(pair.label, directory)
    engine, cand = open_live(pair.model, ref, n_chunks, pair.settings, pair.label, store, replace=True)
    with contextlib.closing(engine), contextlib.closing(cand):
        resumed = len(cand.resumed)
        try:
            cmp = metrics.compare(ref, cand, n_chunks, threads=threads, on_chunk=on_chunk, samplers=pair.samplers)
            cand.writer.finish()
            path = results.save_result(cmp, directory / runs.RESULTS_SUBDIR)
        except WriteFailed as exc:
            raise _write_failed(pair.label, exc, ref, list(range(n_chunks)), writer=cand.writer) from None
    # the old store is removed only when its replacement is complete (StoreWriter.finish)
    return PairRun(result=path, chunks=len(cmp.chunks), resumed_chunks=resumed, resumed_from="store")


class PairWriteFailed(WriteFailed):
    """A pair's write failed: its message names the pair and the file, and for a full disk about how many more bytes
    the pair needs; `needed` and `pair_bytes` (what a whole pair like it writes) let a matrix add its other pairs'
    share (text)."""

    def __init__(self, message: str = "", path=None, errno: int | None = None, size: int | None = None, *,
                 head: str = "", kept: str = "", needed: int = 0, pair_bytes: int = 0):
        self.head, self.kept, self.needed, self.pair_bytes, self.errno = head, kept, needed, pair_bytes, errno
        super().__init__(message or self.text(), path, errno, size)

    def text(self, later_pairs: int = 0, finished: int | None = None) -> str:
        """The message; with the matrix's count of pairs still to run after this one and of pairs finished."""
        if finished is None:  # a pair alone (a Ray task): the matrix's other pairs are not its to count
            kept = f"every finished pair and {self.kept} are kept"
        elif finished:
            kept = f"the {finished} pair{'s' if finished > 1 else ''} finished before it and {self.kept} are kept"
        else:
            kept = f"{self.kept} is kept"
        if self.errno not in (errno.ENOSPC, errno.EDQUOT):  # another fault (permissions, I/O): no size to name
            return f"{self.head}; {kept}: fix that and re-run the same command to continue where it stopped"
        more = f"it needs about {_size(self.needed)} more to finish"
        if later_pairs:
            more += (f", and the {later_pairs} pair{'s' if later_pairs > 1 else ''} after it about "
                     f"{_size(later_pairs * self.pair_bytes)} ({_size(self.needed + later_pairs * self.pair_bytes)} "
                     "in all)")
        return f"{self.head}: {more}; {kept}: free space and re-run the same command to continue where it stopped"


# What a result holds beyond its per-token columns (its JSON summary: the figures, by depth and by the reference's
# confidence, the request ...: 15 kB measured on text, more with samplers and conversations' segments), and the per-token bytes of a checkpoint or result when a
# pair has written none yet to measure them by (~60-80 measured): the full-disk estimates.
_RESULT_JSON_BYTES = 40 << 10
_TOKEN_BYTES = 100


def _write_failed(label: str, exc: WriteFailed, ref, order: list[int], ckpt: "checkpoint.Checkpoint | None" = None,
                  writer=None) -> PairWriteFailed:
    """The message of a pair whose write failed, with about how many bytes it still needs: what it writes per
    scored token (measured from its checkpoint, or its store with keep_logits) times the tokens left, plus its
    result (about a checkpoint's bytes again, and a JSON)."""
    tokens = {c: ref.header.n_scored_of(c) for c in order}
    total = sum(tokens.values())
    if writer is not None:
        saved = [c for c in order if c in writer.done_chunks]
        kept = "its partial store"
        held = writer.path.stat().st_size if writer.path.exists() else 0
        first = (exc.size or 0) / min(PIECE_ROWS, tokens[order[0]])  # the failed write: a store's first piece
    else:
        saved = [c for c in order if ckpt is not None and c in ckpt.parts]
        kept = "its checkpoint"
        held = ckpt.chunk_bytes if ckpt is not None else 0
        first = _TOKEN_BYTES
    done = sum(tokens[c] for c in saved)
    per_token = held / done if done else first
    result = total * (per_token if writer is None else _TOKEN_BYTES) + _RESULT_JSON_BYTES
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        head = f"matrix pair {label}: no space left on device writing {exc.path}"
    else:
        head = f"matrix pair {label}: writing {exc.path} failed ({os.strerror(exc.errno) if exc.errno else exc})"
    return PairWriteFailed("", exc.path, exc.errno, exc.size, head=head, kept=f"{kept} ({len(saved)} of {len(order)} "
                           "chunks)", needed=int((total - done) * per_token + result),
                           pair_bytes=int(total * per_token + result))


def _size(n: float) -> str:
    """Bytes for a message: 3 significant digits and a decimal unit (as `df -H`)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError


@dataclass(frozen=True)
class MatrixRun:
    """What an executor reports: the reference's line, one line per pair worth a mention, and every
    pair's result summary in plan order."""

    reference_text: str
    lines: list[str]
    summaries: list[ComparisonSummary]
    n_chunks: int | None = None  # the chunks of the whole corpus every pair is compared over (local runs say)


def saved_summaries(plan: MatrixPlan) -> list[ComparisonSummary]:
    result_dir = plan.directory / runs.RESULTS_SUBDIR
    return [results.load_result(result_path(result_dir, p.label, plan.reference.label),
                                with_per_token=False).summary for p in plan.pairs]


def run_local(plan: MatrixPlan, advance: Callable[[int], None], announce: bool = False) -> MatrixRun:
    """Execute the plan here, one capture or pair after another; advance(n) counts chunks gone through. Before the
    first window is decoded, what the whole matrix writes and roughly how long it takes is said (`announce`; decided
    early: from every pair at the rule's minimum to every chunk) and checked against the free disk
    (qeval.orchestrate.budget): every pair counted as run live when the reference is still to capture, the pairs
    that run when it is there. A pair whose write fails (a full disk) ends the run
    with one message: that pair, the bytes it and the pairs after it need; every finished pair and its checkpoint
    are kept, and the same command continues."""
    least = plan.early.rule.min_chunks if plan.early is not None else None  # decided early: said as a range

    def check_all(start) -> None:
        n = plan.reference.chunks or start.header.chunk_stop
        budget.matrix_budget(f"matrix: reference {plan.reference.label} + {len(plan.pairs)} pairs", plan.directory,
                             start.header, n, [(p.label, p.model, p.settings) for p in plan.pairs], start,
                             len(plan.samplers), keeps_candidate_stores=plan.keep_logits,
                             early_min_chunks=least).check(announce)

    captured = capture(plan.reference, on_chunk=advance, on_plan=lambda total, done: advance(done),
                       on_start=check_all)
    n_chunks, pairs = plan_pairs(plan)
    lines = [p.note for p in pairs if p.note]
    with StoreReader(plan.reference.out) as ref:
        running = [(p.label, p.model, p.settings) for p in pairs if p.action == RUN_LIVE]
        if captured.status == "already complete" and running:
            budget.matrix_budget(f"matrix: {len(running)} of {len(pairs)} pairs to run", plan.directory,
                                 ref.header, n_chunks, running, samplers=len(plan.samplers),
                                 keeps_candidate_stores=plan.keep_logits, early_min_chunks=least).check(announce)
        if plan.early is not None:
            lines += run_early(plan, pairs, ref, n_chunks, advance)
        else:
            lines += run_full(plan, pairs, ref, n_chunks, advance)
    return MatrixRun(captured.summary_line(), lines, saved_summaries(plan), n_chunks)


def _run_pair_said(plan: MatrixPlan, pairs: list[PairPlan], k: int, ref, n_chunks: int, advance,
                   **options) -> PairRun:
    """run_pair of pairs[k] (with run_pair's `options`), a full disk said as the matrix's one message."""
    try:
        return run_pair(pairs[k], ref, n_chunks, plan.directory, available_cores(), advance, **options)
    except PairWriteFailed as exc:
        later = sum(p.action != SKIP for p in pairs[k + 1:])
        raise QevalError(exc.text(later, finished=k)) from None


def _resumed_line(label: str, done: PairRun) -> list[str]:
    return [f"{label}: resumed: {done.resumed_chunks} of {done.chunks} chunks read back from its "
            f"{done.resumed_from}"] if done.resumed_chunks else []


def run_full(plan: MatrixPlan, pairs: list[PairPlan], ref, n_chunks: int, advance) -> list[str]:
    """Every pair not skipped over every chunk, one after another; the lines worth a mention."""
    lines = []
    for k, pair in enumerate(pairs):
        if pair.action == SKIP:
            advance(n_chunks)
            continue
        done = _run_pair_said(plan, pairs, k, ref, n_chunks, advance)
        lines += ([done.note] if done.note else []) + _resumed_line(pair.label, done)
    return lines


def run_early(plan: MatrixPlan, pairs: list[PairPlan], ref, n_chunks: int, advance) -> list[str]:
    """The board decided early (plan.early, decide_in_rounds): every pair not skipped visits the chunks in the seeded
    order, in rounds. Each round leaves every pair's result saved (an early one, or a full one once it has every
    chunk) and its checkpoint kept, which a later round, a rerun, or a full run of the same pair extends. The lines
    worth a mention."""
    settings = plan.early
    order = [int(c) for c in settings.order(n_chunks)]
    record = settings.record(order)
    counted = {p.label: n_chunks if p.action == SKIP else 0 for p in pairs}  # chunks the progress bar has had
    advance(sum(counted.values()))
    lines, ran = [], set()

    def run(k: int, target: int) -> None:
        label = pairs[k].label

        def reached(parts: dict) -> bool:
            held = len(held_prefix(order, parts))
            advance(max(held - counted[label], 0))
            counted[label] = max(held, counted[label])
            return held >= target

        # progress is counted by `reached`, not by run_pair: each round reads its earlier chunks back
        done = _run_pair_said(plan, pairs, k, ref, n_chunks, None, order=order, stop=reached, early=record)
        if k not in ran:
            ran.add(k)
            lines.extend(([done.note] if done.note else []) + _resumed_line(label, done))

    decide_in_rounds(settings, [k for k, p in enumerate(pairs) if p.action != SKIP], one_by_one(run),
                     lambda: early_decisions(plan, n_chunks))
    advance(sum(n_chunks - n for n in counted.values()))  # the chunks the stopped pairs leave: the bar ends full
    return lines


def one_by_one(run: Callable[[int, int], None]) -> Callable[[dict[int, int]], None]:
    """A round of decide_in_rounds as run(k, target) for each running pair in turn."""
    return lambda targets: [run(k, target) for k, target in targets.items()]


def decide_in_rounds(settings: EarlySettings, running: list[int], run_round: Callable[[dict[int, int]], None],
                     decisions: Callable[[], list[early_stop.Decision]],
                     on_stop: Callable[[int], None] | None = None) -> None:
    """The rounds of a board decided early (a matrix's, a recipe board's, a needle board's): run_round({k: target})
    runs each running pair k on until it holds `target` chunks of the order (or every chunk; one_by_one: pair by
    pair): first min_chunks each, then decisions() reads the whole board (so a pair's neighbours are known; one
    Decision per pair, in the indices `running` uses) and every pair it does not stop runs `step` more, until every
    pair has stopped. on_stop(k): each pair that ran in a round and that round stopped (a stopped pair may be asked
    to run again in a later round: its neighbours moved)."""
    target = dict.fromkeys(running, settings.rule.min_chunks)
    while running:
        run_round({k: target[k] for k in running})
        decided = decisions()
        for k in running:
            if decided[k].stop and on_stop is not None:
                on_stop(k)
        running = [k for k, d in enumerate(decided) if not d.stop]
        for k in running:
            target[k] = decided[k].n_chunks + settings.rule.step


def early_decisions(plan: MatrixPlan, n_chunks: int) -> list[early_stop.Decision]:
    """early.decide() over every pair's saved result (early or full), in plan order: the board as decided now."""
    result_dir = plan.directory / runs.RESULTS_SUBDIR
    return decisions_of([(p.label, result_path(result_dir, p.label, plan.reference.label))
                         for p in plan.pairs], n_chunks, plan.early)


def decisions_of(saved: list[tuple[str, Path]], n_chunks: int, settings: EarlySettings) -> list[early_stop.Decision]:
    """early.decide() over saved results (label, path: early or full, each on its board row's Pareto axes), in the
    order given, visited in the order of `settings`."""
    order = settings.order(n_chunks)
    board_pairs = []
    for label, path in saved:
        result = results.load_result(path)
        row = board.board_row(result.summary)
        chunks, sums, tokens = early_stop.chunk_sums(result.per_token, "kld", order)
        board_pairs.append(early_stop.PairChunks(label=label, chunks=chunks, sums=sums, tokens=tokens,
                                                 size_gib=row.size_gib, memory_gib=row.memory_estimate_gib,
                                                 kv_quant=row.kv_quant, control=board.is_baseline(row)))
    return early_stop.decide(board_pairs, n_chunks, settings.rule)


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
    path = result_path(plan.directory / runs.RESULTS_SUBDIR, label, plan.reference.label)
    return results.load_result(path, with_per_token=True).per_token


def matrix_result(plan: MatrixPlan, run: MatrixRun, task_lines: list[str] = ()) -> tuple[dict, str]:
    """(JSON, text) of a finished matrix: the PPL matrix and the board of every pair, with the task flips of the
    plan's task sets."""
    summaries = run.summaries
    names = {t.name for t in plan.tasks}
    rows = [board.row_with_flips(s, plan.samplers, plan.directory / TASKS_SUBDIR, names=names) for s in summaries]
    board.compare_with_control(rows)
    board.compare_with_floor(rows, lambda row: _per_token(plan, row.label))
    early = {}
    if plan.early is not None and summaries:
        n_chunks = run.n_chunks
        for row, decision in zip(rows, early_decisions(plan, n_chunks)):
            row.stopped = decision.reason
        early = early_figures(plan.early, n_chunks, [r.chunks for r in rows])
    ref_label = plan.reference.label
    text = "\n".join([run.reference_text, *run.lines, *task_lines, "",
                      f"reference {ref_label}: {summaries[0].chunks} chunks of {plan.reference.n_ctx}, "
                      f"{summaries[0].scored_tokens} scored tokens" if summaries else "",
                      "", "PPL matrix (rows: model, columns: KV cache)",
                      report.ppl_matrix_markdown(*plan.grid(summaries)),
                      "", "Leaderboard (sorted by mean KLD)",
                      board.leaderboard_markdown(rows, plan.samplers, board.common_tasks(rows)),
                      *(line for note in board.baseline_notes(board.has_control(rows), board.has_floor(rows))
                        for line in ("", note)),
                      *(["", board.EARLY_NOTE, early_line(early["early"])] if early else [])])
    return {"reference": ref_label, "rows": [r.to_json() for r in rows], **early,
            "results": [s.to_json() for s in summaries]}, text


def early_figures(settings: EarlySettings, n_chunks: int, held: list[int]) -> dict:
    """What a board decided early records and cost, as its JSON's `early`: the seed, the order and the rule (its
    step included), and the chunks its rows hold (`held`, one count per row) of the chunks the full board runs."""
    return {"early": {**settings.record(settings.order(n_chunks)), "chunks_held": sum(held),
                      "chunks_full": n_chunks * len(held)}}


def early_line(early: dict) -> str:
    """What a board decided early cost, and by which rule."""
    rule = early["rule"]
    spent = (" (log scale for a mean, the error spent over the rounds: half at the minimum)"
             if rule.get("interval") == early_stop.SPENT else "")
    return (f"Early: seed {early['seed']}, at least {rule['min_chunks']} chunks, ±{rule['rel_precision']:.0%} at "
            f"{rule['confidence']:.0%}{spent} or neighbours {rule['neighbour_sigmas']:g} SE apart, "
            f"{rule.get('step', early_stop.STEP)} chunks a round; "
            f"{early['chunks_held']} of {early['chunks_full']} pair-chunks held "
            f"({early['chunks_held'] / early['chunks_full']:.2f}× the full board's forward passes)")
