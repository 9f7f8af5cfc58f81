"""The Python API behind every CLI command (notebooks and tests use it too): the one facade between
the command line and the stages below it (qeval.orchestrate and what it drives).

Each *_report function returns (result dict, text) so the CLI only chooses how to print. The names the
command line needs beyond them (settings types, the gate's metric options) are re-exported here, so that
qeval.cli imports nothing but this module (an import contract, tests/test_layers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from qeval.capture.capture import CaptureSpec, capture
from qeval.capture.taskscore import TaskSettings  # noqa: F401 - re-exported for the CLI
from qeval.compare import depth, metrics
from qeval.compare.gate_checks import GATE_VERDICTS  # noqa: F401 - re-exported for the CLI: check's exit codes
from qeval.compare.summary import Side, summarize
from qeval.engine.engine import EngineSettings, fixed_mmap_threshold  # noqa: F401 - re-exported for the CLI
from qeval.errors import QevalError
from qeval.inputs.hub import is_hub_spec, resolve_model
from qeval.inputs.needles import parse_depths
from qeval.orchestrate import budget, matrix, sweep
from qeval.orchestrate import deploy as deploy_run
from qeval.orchestrate.deploy import DeploySpec
from qeval.orchestrate.matrix import (  # noqa: F401 - public
    EarlySettings,
    TaskRequest,
    early_settings,
    pair_label,
    pair_settings,
    parse_model_arg,
)
from qeval.orchestrate.needles import NeedleRequest, Run, run_needles
from qeval.orchestrate.sources import compare, is_model_file, measure, open_source  # noqa: F401 - public here as before
from qeval.present import report, results
from qeval.present.needles_text import needles_text
from qeval.present.progress import PlannedProgress, progress_bar, say
from qeval.storage import runs
from qeval.storage.hidden_form import DEFAULT_FORM
from qeval.storage.llamacpp import import_llamacpp
from qeval.storage.scoring import Scoring
from qeval.storage.store import StoreReader


def kld_report(ref: str, cand: str, *, chunks: int | None = None, runs_dir=None, threads: int | None = None,
               per_token: Path | None = None, progress: bool = False,
               settings: EngineSettings = EngineSettings(), save: str | None = None,
               save_result: bool = False, on_chunk=None, force: bool = False,
               bands: str | None = None, samplers=(), deploy=None,
               confidence_buckets: str | None = None) -> tuple[dict, str]:
    """bands: inner edges of the by-depth block, e.g. "512,2048,8192" (default: powers of 4 from 512).
    confidence_buckets: inner edges of the by-confidence block (the reference's top-1 probability), e.g.
    "0.5,0.9,0.99" (default: qeval.compare.depth.DEFAULT_CONFIDENCE_EDGES).
    samplers: see compare(); their figures are the result's "samplers" block (and sampler metrics).
    deploy (a DeploySpec or its text): then also the live candidate's speed and memory as deployed with `settings`
    (qeval.orchestrate.deploy), saved as the record of its label (`save`, else the file's stem) on this machine."""
    depth.parse_bands(bands, 1 << 40)  # a bad --bands or --confidence-buckets is refused before any work
    buckets = depth.parse_confidence_buckets(confidence_buckets)
    rows = _kld_deploy_rows(cand, save, settings, deploy)
    res = measure(ref, cand, chunks, runs_dir, threads, settings, save, progress, on_chunk, force, samplers,
                  save_result)
    if save_result and res.comparison is not None:
        results.save_result(res.comparison, runs.runs_dir(runs_dir) / runs.RESULTS_SUBDIR)
    if per_token is not None:
        try:
            report.write_per_token(res.per_token, res.summary.labels, Path(per_token))
        except OSError as exc:
            raise QevalError(f"cannot write --per-token file {per_token}: {exc.strerror}") from None
    bounds = depth.parse_bands(bands, res.summary.reference.n_ctx)
    summary = summarize(res.comparison, bounds, buckets) if res.comparison is not None else \
        results.recomputed(res.summary, res.per_token, bounds, buckets) if bands or confidence_buckets else res.summary
    out = summary.to_json()
    if res.note:  # how the figures were obtained, when a saved result stood in (qeval.orchestrate.candidates)
        out["obtained"] = [res.note]
    text = "\n".join(filter(None, [res.note, report.comparison_text(summary)]))
    if is_hub_spec(ref) and res.comparison is not None:  # a reference published from elsewhere: what ran where
        from qeval.orchestrate import publish  # noqa: PLC0415 - only a published reference has a manifest to read
        out["ran_where"] = publish.ran_where(ref, res.comparison.ref.header, res.comparison.cand.header)
        text += "\n" + report.ran_where_text(out["ran_where"])
    if not rows:
        return out, text
    measured = deploy_run.measure_rows(rows, deploy_spec(deploy), runs.runs_dir(runs_dir),
                                       say=lambda line: say(line, progress))
    return {**out, "deployment": measured.to_json()}, text + "\n\n" + measured.text()


def deploy_spec(spec) -> DeploySpec:
    """A DeploySpec from its text (qeval.orchestrate.deploy.parse_deploy_spec), or as it is."""
    return deploy_run.parse_deploy_spec(spec) if isinstance(spec, str) else spec


def _kld_deploy_rows(cand: str, save: str | None, settings: EngineSettings, deploy) -> list:
    """The row `kld --deploy` measures: the live candidate, checked against the spec before the comparison runs."""
    if deploy is None:
        return []
    spec = deploy_spec(deploy)
    path = resolve_model(cand)
    if not is_model_file(path):
        raise QevalError(f"--deploy measures a GGUF candidate as it is deployed; {cand} is a store: give its GGUF "
                         "(or use `qeval deploy MODEL`)")
    rows = [deploy_run.DeployRow(runs.check_label(save or Path(path).stem), str(path), settings)]
    deploy_run.plan_rows(rows, spec)
    return rows


def deploy_report(models: list[str], kv_types: list[str] = ("f16",), *, spec=None, runs_dir=None,
                  engine: EngineSettings = EngineSettings(), force: bool = False,
                  progress: bool = False) -> tuple[dict, str]:
    """Speed and memory alone (`qeval deploy`): every model (MODEL or LABEL=MODEL, a path or an hf: spec) under
    every KV spec of `kv_types` (as matrix's --kv), labelled as a matrix labels its pairs, run with `engine` (its KV
    cache set by each spec), measured as `spec` (a DeploySpec or its text; default: llama-bench's pp512 and tg128 at
    depth 0, memory at 4096) says, on this machine, one row after another; saved as deployment records in
    RUNS_DIR/deployment, reused where they answer.
    result["errors"]: every figure that could not be measured (the CLI exits non-zero after printing)."""
    spec = deploy_run.parse_deploy_spec(spec, "--spec") if isinstance(spec, str) else spec or DeploySpec()
    engine.validate()
    for kv in kv_types:
        matrix.parse_kv_spec(kv)
    rows = []
    for model in models:
        label, path = parse_model_arg(model)
        rows += [deploy_run.DeployRow(pair_label(label, kv), str(path), pair_settings(kv, engine).validate())
                 for kv in kv_types]
    labels = [r.label for r in rows]
    if len(set(labels)) != len(labels):
        raise QevalError(f"labels must be unique ({', '.join(labels)}); name models with LABEL=PATH")
    deploy_run.plan_rows(rows, spec)
    measured = deploy_run.measure_rows(rows, spec, runs.runs_dir(runs_dir), force,
                                       say=lambda line: say(line, progress))
    return {"spec": spec.to_json(), "deployment": measured.to_json()}, measured.text()


def deployment_errors(result: dict) -> list[str]:
    """The figures a command's --deploy (or `qeval deploy`) could not measure, one message each."""
    return list((result.get("deployment") or {}).get("errors") or ())


def ppl_report(spec: str, chunks: int | None = None, runs_dir=None) -> tuple[dict, str]:
    import numpy as np  # noqa: PLC0415

    from qeval.compare import stats  # noqa: PLC0415

    with contextlib.closing(open_source(spec, runs_dir)) as src:
        available = metrics.usable_chunks(src, "the")
        if chunks is not None and not 1 <= chunks <= len(available):
            raise QevalError(f"--chunks {chunks} is outside the {len(available)} chunks of {src.path}")
        selected = list(available)[:chunks] if chunks else list(available)
        nll = np.concatenate([-src.read_chunk(i).logprob_target for i in selected])
        ppl = stats.perplexity(nll)
        result = {"store": Side.of_source(src).to_json(), "chunks": len(selected), "scored_tokens": int(len(nll)), **ppl}
        return result, report.ppl_text(src.header.label, str(src.path), ppl, len(selected), len(nll))


def info_report(spec: str, runs_dir=None) -> tuple[dict, str]:
    path = runs.resolve_path(spec, runs.runs_dir(runs_dir))
    # an interrupted capture may end in a torn record: report its whole chunks, not an error
    opener = (lambda: StoreReader(path, tolerate_torn_tail=True)) if runs.is_store_file(path) else \
        (lambda: open_source(spec, runs_dir))
    with contextlib.closing(opener()) as src:
        d = report.info(src)
    return d, report.info_text(d)


def import_llamacpp_report(file: Path, out: Path, force: bool = False) -> str:
    from qeval.storage.llamacpp import LlamaCppBaseFile  # noqa: PLC0415

    with LlamaCppBaseFile(file) as base:
        total = base.header.n_chunks
    with progress_bar("importing chunks", total) as advance:
        import_llamacpp(file, out, on_chunk=advance, replace=force)
    with StoreReader(out) as store:
        d = report.info(store)
    return (f"wrote {out}: {d['chunks_present']} chunks, {d['size_bytes']:,} bytes "
            f"({d['bytes_per_scored_token']:,.0f} per scored token; {file} is {Path(file).stat().st_size:,} bytes, "
            f"{Path(file).stat().st_size / d['size_bytes']:.1f}x larger)")


def capture_store(model: str, label: str, *, runs_dir=None, out: str | None = None, corpus: str | None = None,
                  n_ctx: int = 512, chunks: int | None = None, settings: EngineSettings = EngineSettings(),
                  chunk_range: tuple[int, int] | None = None,
                  progress: bool = False, on_chunk=None, force: bool = False, scoring: str = "half",
                  concat: bool = False, chat_template: str | None = None, chat_template_kwargs: str | None = None,
                  reference_form: str = DEFAULT_FORM, conversation_depths: str | None = None) -> tuple[dict, str]:
    """Capture `model` (a GGUF path or an hf: spec) into a store, resume an interrupted capture, or reuse one that
    holds it already. A store there that holds another capture is refused (naming what differs), or replaced with
    `force`. A conversation corpus is scored with scoring "assistant", rendered with the model's chat template or
    `chat_template` (a file, or "plain"), `chat_template_kwargs` a JSON object of template variables;
    `conversation_depths` ("0,4096,..."): each conversation placed after a history of that many tokens, its segments
    labelled segment@depth (qeval.inputs.conversation_windows)."""
    directory = runs.runs_dir(runs_dir)
    runs.check_label(label)
    if out is None:
        directory.mkdir(parents=True, exist_ok=True)
        out = str(runs.store_path(label, directory))
    spec = CaptureSpec(model=resolve_model(model), out=out, label=label, corpus=corpus, n_ctx=n_ctx,
                       chunks=chunks, chunk_range=chunk_range, settings=settings, replace=force,
                       scoring=Scoring.parse(scoring).rule, concat=concat, chat_template=chat_template,
                       chat_template_kwargs=chat_template_kwargs, reference_form=reference_form,
                       conversation_depths=conversation_depths)
    with contextlib.ExitStack() as stack:
        bar = PlannedProgress(stack, f"capturing {label}", progress, on_chunk)
        result = capture(spec, on_chunk=bar.advance, on_plan=bar.on_plan,
                         on_start=lambda start: budget.check_capture(start, progress))
    return {"path": str(result.path), "status": result.status, "chunks": result.chunks_total,
            "chunks_written": result.chunks_written, "seconds": result.seconds}, result.summary_line()


def matrix_report(ref: str, models: list[str], kv_types: list[str], *, chunks: int | None = None, n_ctx: int = 512,
                  corpus: str | None = None, runs_dir=None, engine: EngineSettings = EngineSettings(),
                  progress: bool = True, executor=None, force: bool = False, scoring: str = "half",
                  concat: bool = False, samplers=(), tasks=(), repos=(), include=(), exclude=(),
                  control: bool = False, chat_template: str | None = None,
                  chat_template_kwargs: str | None = None, floor: str = "none", keep_logits: bool = False,
                  early: EarlySettings | None = None, deploy=None,
                  conversation_depths: str | None = None) -> tuple[dict, str]:
    """Capture `ref` once, then every model x KV pair (live, or reusing finished stores and results).
    models: GGUF paths or hf: specs (LABEL=… to name one); hf:USER/REPO:* and each of `repos` (hf:USER/REPO) stand
    for every model of the repository, filtered by `include`/`exclude` globs on its file paths and labelled
    USER.TAG (qeval.orchestrate.matrix.expand_models).
    samplers: presets or settings strings (qeval.compare.sampler) every pair is measured with too; a TVD
    column each in the matrix's leaderboard. tasks: task files (or matrix.TaskRequest) the reference and every
    pair are scored on too, as llama-perplexity scores tasks; a flips column each. engine: how the reference and
    every pair run (EngineSettings: threads, -ngl, batch sizes, RoPE scaling as llama.cpp's --rope-scaling/--rope-scale
    for n_ctx beyond the models' trained context, ...), but each pair's KV cache, which its KV spec sets: its
    kv_rotation holds for KV specs without a `:rot`/`:norot` suffix, its decode (prompt: batches, as
    llama-perplexity; generate: one token per call after the prompt, as llama-server generates) for the reference
    and every pair.
    control: run the reference model once more under another batch layout, as the pair `control`: the noise
    floor every other row is read against (qeval.orchestrate.matrix.control_settings); `qeval matrix` asks for it
    unless --no-control. chat_template, chat_template_kwargs, conversation_depths: a conversation corpus's (see
    capture_store). floor: a row for the reference model on another of llama.cpp's kernel paths, each
    KV row's cost read against it (qeval.orchestrate.matrix.FLOORS; `qeval matrix` asks for `auto`).

    A pair run live keeps no candidate logits: each chunk's per-token results go to its checkpoint
    (RUNS_DIR/results/<label>.vs.<ref>.partial), from which a killed or failed run continues to the numbers an
    uninterrupted one gives. keep_logits: keep its logits in a store RUNS_DIR/<label>.qeval instead (~110 kB per
    scored token at a 262K vocab), for later store-vs-store analysis.

    early (early_settings(...)): decide the board early: every pair visits the chunks in a seeded random order and
    stops once its mean KLD is known to the stated precision, or its order against its board neighbours and its
    Pareto status are settled (qeval.compare.early; matrix.run_early); each row says how many tokens it holds and
    why it stopped. None (the default): every pair over every chunk. A later run without it extends each pair from
    its checkpoint; an early result never stands for a full one.

    A saved result or store is reused only when it answers the pair's request (qeval.identity); else
    the pair is recomputed and its result and store overwritten, and the text says so. A reference store
    that holds another capture is refused, or replaced with `force`.

    executor: None or "local" runs here; "ray" or a qeval.orchestrate.distributed.RayExecutor runs every capture
    and pair as a Ray task (the runs directory must then be on a shared filesystem).

    deploy (a DeploySpec or its text, qeval.orchestrate.deploy): after every pair, the speed and memory of the
    reference and every pair as deployed, here, one at a time (under Ray too), saved as this machine's records."""
    ref_label, ref_path = parse_model_arg(ref)
    models = matrix.expand_models(models, repos, tuple(include), tuple(exclude))
    requests = tuple(t if isinstance(t, matrix.TaskRequest) else matrix.TaskRequest(task=str(t)) for t in tasks)
    request = matrix.MatrixRequest(
        ref_label=ref_label, ref_path=ref_path, pairs=tuple(matrix.model_kv_pairs(models, kv_types, ref_path)),
        directory=runs.runs_dir(runs_dir), chunks=chunks, n_ctx=n_ctx, corpus=corpus, engine=engine, force=force,
        scoring=scoring, concat=concat, samplers=tuple(samplers), tasks=requests, control=control, floor=floor,
        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, keep_logits=keep_logits, early=early,
        deploy=None if deploy is None else deploy_spec(deploy), conversation_depths=conversation_depths)
    return sweep.run_matrix(request, progress, executor)


def demo_report(*, chunks: int | None = 80, runs_dir=None, models_dir=None, n_ctx: int = 512, progress: bool = True,
                threads: int | None = None, conversations: bool = False,
                early: EarlySettings | None = None) -> tuple[dict, str]:
    """Gemma-3-270M end to end: derive quants, capture the Q8_0 reference, compare every candidate and the control
    (the reference recomputed under another batch layout: the board's noise floor). conversations:
    over the shipped conversation suite instead, the assistant's tokens by segment and category (in
    RUNS_DIR/conversations; every conversation unless `chunks`). early: the board decided early (as matrix_report's)."""
    from qeval.orchestrate import demo  # noqa: PLC0415

    directory = demo.models_dir(models_dir)
    missing = demo.missing_model_bytes(directory)
    if missing:
        say(f"qeval: demo: assembling and quantizing Gemma-3-270M: ~{budget.size_text(missing)} to {directory}",
            progress)
        budget.require_space(directory, missing, "the demo's Gemma-3-270M GGUFs", "the demo needs all five",
                             "--models-dir")
    paths = demo.prepare_models(directory)
    pairs = [(run.label, str(paths[run.quant]), run.type_k) for run in demo.demo_runs()]
    request = matrix.MatrixRequest(ref_label=demo.REFERENCE, ref_path=str(paths[demo.REFERENCE]), pairs=tuple(pairs),
                                   directory=runs.runs_dir(runs_dir), chunks=chunks, n_ctx=n_ctx,
                                   engine=EngineSettings(n_threads=threads), control=True, floor="auto", early=early)
    if conversations:
        c = demo.CONVERSATIONS
        request = dataclasses.replace(request, directory=request.directory / c["subdir"], corpus=c["corpus"],
                                      scoring=c["scoring"], n_ctx=c["n_ctx"], chat_template=demo.conversation_template())
    result, text = sweep.run_matrix(request, progress)
    return result, demo.DERIVATION_NOTE + "\n" + text


# --- task accuracy and answer flips (qeval.orchestrate.tasks) -------------------------------------------------
def task_capture_report(model: str, task: str, *, kind: str | None = None, limit: int | None = None,
                        label: str | None = None, runs_dir=None, out: str | None = None, settings=None,
                        force: bool = False, progress: bool = False, hf_loader=None) -> tuple[dict, str]:
    """Score every choice of a task set (HellaSwag, Winogrande, multiple-choice file or hf: dataset) with a GGUF
    model as llama-perplexity does, into RUNS_DIR/tasks/<task>/<label>.tasks.jsonl; resumes, reuses, or refuses
    a store of another capture (`force` replaces it). model: a GGUF path or an hf: spec."""
    from qeval.orchestrate import tasks  # noqa: PLC0415

    model = resolve_model(model)
    with contextlib.ExitStack() as stack:
        bar = PlannedProgress(stack, f"scoring tasks ({label or Path(model).stem})", progress)
        return tasks.capture_tasks(model, task, kind=kind, limit=limit, label=label, runs_dir=runs_dir, out=out,
                                   settings=settings or TaskSettings(), force=force, on_plan=bar.on_plan,
                                   on_tasks=bar.advance, hf_loader=hf_loader)


def task_show_report(store: str, runs_dir=None, task: str | None = None) -> tuple[dict, str]:
    """Accuracy of one task store (path or label)."""
    from qeval.orchestrate import tasks  # noqa: PLC0415

    return tasks.show_tasks(store, runs_dir, task)


def flips_report(ref: str, cand: str, runs_dir=None, task: str | None = None, bins: int = 4,
                 max_listed: int = 20) -> tuple[dict, str]:
    """Accuracy of both, answer flips, exact McNemar p and flips by the reference's margin, from two task stores."""
    from qeval.orchestrate import tasks  # noqa: PLC0415

    return tasks.flips_report(ref, cand, runs_dir, task, bins, max_listed)


# --- recipes: variants built by llama.cpp's quantizer, their sensitivity, the best under a budget --------------
def recipe_request(*, ref: str, source: str, recipes=(), chunks: int | None = None, runs_dir=None,
                   threads: int | None = None, keep: bool = False, early: EarlySettings | None = None,
                   deploy=None):
    """The RecipeRequest of these arguments: `recipes` as texts (qeval.engine.recipe.parse) or Recipe values. A bad
    recipe (unknown type, bad regex, missing imatrix) is refused here, before anything is built. early
    (early_settings(...)): the variants are one board decided early, as a matrix's (qeval.orchestrate.recipes).
    deploy (a DeploySpec or its text): also every variant's speed and memory (`recipe measure` and `recipe fit`),
    measured while its GGUF is on disk, refused here when it reaches beyond the source's trained context."""
    from qeval.engine.recipe import Recipe, parse  # noqa: PLC0415
    from qeval.orchestrate.recipes import RecipeRequest  # noqa: PLC0415

    parsed = tuple(r if isinstance(r, Recipe) else parse(r) for r in recipes)
    source = str(resolve_model(source))
    engine = EngineSettings(n_threads=threads)
    spec = None if deploy is None else deploy_spec(deploy)
    if spec is not None:  # a variant has its source's trained context
        deploy_run.plan_rows([deploy_run.DeployRow("source", source, engine)], spec)
    return RecipeRequest(ref=ref, source=source, recipes=parsed, directory=runs.runs_dir(runs_dir), chunks=chunks,
                         engine=engine, keep=keep, early=early, deploy=spec)


def recipe_measure_report(request, progress: bool = False) -> tuple[dict, str]:
    """Build and measure every recipe of a RecipeRequest (reusing what was measured under the same identity)."""
    from qeval.orchestrate import sensitivity  # noqa: PLC0415

    return sensitivity.measure_report(request, progress)


def recipe_search(*, holdout: int | None = None, split_seed: int | None = None, refine_builds: int | None = None,
                  split_edges: int | None = None):
    """How `recipe sweep` and `recipe fit` choose (qeval.orchestrate.sensitivity.SearchSettings): chunks held out of
    every decision, the seed that draws them, the refinement's build budget, tensor groups split by layer range."""
    from qeval.orchestrate.sensitivity import SearchSettings  # noqa: PLC0415

    return SearchSettings(holdout=holdout, split_seed=split_seed, refine_builds=refine_builds,
                          split_edges=split_edges or 0)


def recipe_sweep_report(request, targets, only=(), out: Path | None = None, progress: bool = False,
                        search=None) -> tuple[dict, str]:
    """Each tensor group of the request's base recipe alone moved to each of `targets`: KLD cost, bytes saved (ranked
    on the tuning chunks, with the held-out cost beside, where `search` (recipe_search) holds chunks out)."""
    from qeval.orchestrate import sensitivity  # noqa: PLC0415

    return sensitivity.sweep_report(request, tuple(targets), tuple(only), out, progress, search or recipe_search())


def recipe_fit_report(request, targets, max_mb=(), max_kld=(), stock=(), only=(), out: Path | None = None,
                      progress: bool = False, search=None) -> tuple[dict, str]:
    """The recipe the sweep's sensitivities choose under each budget (MB = 10^6 bytes, or mean KLD), refined and
    reported on held-out chunks as `search` (recipe_search) says, measured beside the stock types `stock`."""
    from qeval.orchestrate import sensitivity  # noqa: PLC0415

    return sensitivity.fit_report(request, tuple(targets), tuple(int(mb * 1e6) for mb in max_mb), tuple(max_kld),
                                  tuple(stock), tuple(only), out, progress, search or recipe_search())


# --- stores from shards, leaderboards, paired comparison, release gate, baselines ------------------------------
def merge_report(parts: list[Path], out: Path, label: str | None = None, progress: bool = False) -> tuple[dict, str]:
    """Assemble one complete store from shards of a capture (qeval.orchestrate.merge)."""
    from qeval.orchestrate.merge import merge_report as merge  # noqa: PLC0415

    return merge(parts, out, label=label, progress=progress)


def certify_report(store: str, runs_dir=None, progress: bool = False) -> tuple[dict, str]:
    """Make a store's lean pieces full ones, readable on any machine (qeval.orchestrate.certify)."""
    from qeval.orchestrate.certify import certify_report as certify  # noqa: PLC0415

    return certify(store, runs_dir, progress)


def leaderboard_report(runs: list[Path], out: Path, title: str | None = None, machine: str | None = None):
    """The leaderboard of saved results, written under `out` (markdown, CSV, JSON, HTML, plots), with the speed and
    memory measured beside them: this machine's, or `machine`'s (a machine id or its first digits)."""
    from qeval.orchestrate import boards  # noqa: PLC0415 - matplotlib loads only for boards

    return boards.leaderboard(runs, out=out, title=title, machine=machine)


def cache_board_report(runs: list[Path], *, needles=(), out: Path | None = None, title: str | None = None,
                       machine: str | None = None) -> tuple[dict, str]:
    """One board for the cache decision (docs/cache-board.md): saved results of several runs (a prose matrix, a
    conversation matrix: one source per reference store), needle results (`qeval needle --json` files) and the speed
    and memory records beside the results, joined by label; written under `out` (markdown, JSON, HTML) when given."""
    from qeval.orchestrate import boards  # noqa: PLC0415
    from qeval.present import cache_board  # noqa: PLC0415

    board = boards.cache_board(runs, needles, out=out, title=title, machine=machine)
    text = cache_board.markdown_page(board)
    if board.paths:
        text += "\nwrote " + ", ".join(str(p) for p in board.paths.values())
    return {**cache_board.board_json(board), "paths": {k: str(p) for k, p in board.paths.items()}}, text


def card_report(runs: list[Path], out: Path = Path("card"), merge: Path | None = None,
                title: str | None = None, machine: str | None = None) -> tuple[dict, str]:
    """A model-card block of saved results (table, Pareto plot, provenance, JSON sidecar) written under `out`;
    with `merge`, also put between the card markers of that markdown file (qeval.present.card); speed and memory
    as leaderboard_report."""
    from qeval.orchestrate import boards  # noqa: PLC0415 - matplotlib loads only for cards and boards

    return boards.card(runs, out=out, merge=merge, title=title, machine=machine)


def choose_report(runs: list[Path], memory: str | float | None = None, context: str | int | None = None,
                  min_tg: str | float | None = None, depth: str | int | None = None, by: str = "kld_mean",
                  machine: str | None = None) -> tuple[dict, str]:
    """The deployment question over the board of saved results: the best quality (`by`, a board metric; mean KLD)
    that fits `memory` (GiB, or a size with a unit: "8GiB") at deployment context `context` and generates at least
    `min_tg` tokens/s at depth `depth` (0 when not given, llama-bench's default), on this machine or `machine`, from measured figures only; every other row
    named with why it is ruled out (qeval.compare.deployment_choice)."""
    from qeval.orchestrate import boards  # noqa: PLC0415

    return boards.choose(runs, boards.read_question(memory, context, min_tg, depth, by), machine=machine)


def paired_report(ref: str, cand_a: str, cand_b: str, *, chunks: int | None = None, runs_dir=None, method: str = "t",
                  progress: bool = False, depth: str | None = None, samplers=(), segment: str | None = None,
                  category: str | None = None, control: str | None = None) -> tuple[dict, str]:
    """Is A really better than B? Paired differences on the same reference tokens (qeval.orchestrate.paired);
    control: also each candidate's mean KLD over a control."""
    from qeval.orchestrate import paired  # noqa: PLC0415

    return paired.paired_report(ref, cand_a, cand_b, chunks=chunks, runs_dir=runs_dir, method=method,
                                progress=progress, depth=depth, samplers=samplers, segment=segment,
                                category=category, control=control)


def check_report(ref: str, cand: str, *, chunks: int | None = None, runs_dir=None, baseline: str | None = None,
                 baseline_entry: str | None = None, baseline_metrics=None, progress: bool = False,
                 depth: str | None = None, samplers=(), control: str | None = None, segment: str | None = None,
                 category: str | None = None, confidence_buckets: str | None = None,
                 **limits) -> tuple[dict, str, bool]:
    """Release gate (qeval.orchestrate.gate): (result, text, passed); control: report the KLD over a control;
    confidence_buckets: the buckets of the reference's top-1 probability (max_kld_confident judges the last)."""
    from qeval.orchestrate import gate  # noqa: PLC0415

    return gate.check_report(ref, cand, chunks=chunks, runs_dir=runs_dir, baseline=baseline,
                             baseline_entry=baseline_entry, baseline_metrics=baseline_metrics, progress=progress,
                             depth=depth, samplers=samplers, control=control, segment=segment, category=category,
                             confidence_buckets=confidence_buckets, **limits)


def threshold_options() -> list[tuple[str, str, str]]:
    """(keyword, option, help) of each --max-…/--min-… threshold `check` takes, one per gated metric."""
    from qeval.orchestrate import gate  # noqa: PLC0415

    return [(gate.keyword(m), gate.option(m), gate.option_help(m)) for m in gate.gated()]


def baseline_show_report(name: str | None = None, run: str | None = None, entry: str | None = None
                         ) -> tuple[dict, str]:
    """A baseline's table (or the list of baselines), optionally with a saved result beside it."""
    from qeval.orchestrate import baselines  # noqa: PLC0415

    return baselines.show_report(name, run, entry)


def baseline_from_result(result: Path, out: Path, title: str | None = None, entry: str | None = None) -> str:
    """Turn a saved result into a baseline file for `check --baseline`; returns what was written."""
    from qeval.orchestrate import baselines  # noqa: PLC0415

    return baselines.result_to_baseline_file(result, out, title, entry)


def ray_executor(*, address: str | None = None, gpus_per_task: float = 0, cpus_per_task: float = 1,
                 shard_chunks: int = 1):
    """The Ray executor `matrix_report(executor=...)` takes (Ray is optional: imported only here)."""
    from qeval.orchestrate.distributed import RayExecutor  # noqa: PLC0415

    return RayExecutor(address=address, gpus_per_task=gpus_per_task, cpus_per_task=cpus_per_task,
                       shard_chunks=shard_chunks)


# --- chat templates (qeval.orchestrate.templates) ---------------------------------------------------------------
def template_report(reference: str, candidates: list[str], corpus: str = "conversations",
                    template_kwargs: str | None = None, vocab: str | None = None) -> tuple[dict, str, bool]:
    """Does each candidate's chat template render the sample conversations as the reference's does?
    (result, text, passed). template_kwargs: JSON of extra template variables (--chat-template-kwargs)."""
    from qeval.inputs.chat import parse_template_kwargs  # noqa: PLC0415
    from qeval.orchestrate import templates  # noqa: PLC0415

    reference, *candidates = (resolve_model(spec) for spec in (reference, *candidates))  # GGUFs as hf: specs too
    vocab = vocab and resolve_model(vocab)
    return templates.template_report(reference, candidates, corpus, parse_template_kwargs(template_kwargs), vocab)


def publish_report(store: str, target: str, *, results_dir: Path | None = None, card: Path | None = None, runs_dir=None,
                   private: bool = False) -> tuple[dict, str]:
    """Upload a complete reference store, its manifest and optionally its results and card to a Hub repository
    (qeval.orchestrate.publish); `--ref hf:USER/REPO:LABEL` then pulls it wherever a reference store is taken."""
    from qeval.orchestrate import publish  # noqa: PLC0415 - only this command uploads

    return publish.publish_report(store, target, results_dir=results_dir, card=card, runs_dir=runs_dir, private=private)


def needle_report(ref: str, *, models=(), kv_types=("f16",), contexts=(4096,), depths: str | None = None,
                  trials: int = 10, needles: str | None = None, corpus: str | None = None, seed: int = 0,
                  engine: EngineSettings = EngineSettings(), runs_dir=None, early: EarlySettings | None = None,
                  progress: bool = False) -> tuple[dict, str]:
    """Needles at depth (docs/needles.md): `ref` (MODEL or LABEL=MODEL) with an f16 cache is the reference; every
    model of `models` (default: the reference's) under every KV spec of `kv_types` (as matrix's --kv) a candidate,
    labelled as matrix's pairs; `needles` a JSONL needle file (None: the shipped suite). Each row's trials are kept
    in the runs directory: a rerun resumes, or extends to more trials. `early` (early_settings(...)): decide the rows
    early, trials as the chunks (qeval.orchestrate.needles)."""
    depth_list = parse_depths(depths)
    ref_label, ref_path = parse_model_arg(ref)
    pairs = matrix.model_kv_pairs(list(models) or [ref], list(kv_types), ref_path)
    request = NeedleRequest(
        reference=Run(label=ref_label, model=str(ref_path), settings=pair_settings("f16", engine).validate()),
        candidates=tuple(Run(label=label, model=str(path), settings=pair_settings(kv, engine).validate())
                         for label, path, kv in pairs),
        contexts=tuple(contexts), depths=depth_list, trials=trials, directory=runs.runs_dir(runs_dir),
        needles=needles, corpus=corpus, seed=seed, early=early)
    result = run_needles(request, say=lambda line: say(line, progress))
    return result, needles_text(result)


def publish_results_report(runs: list[Path], target: str, *, private: bool = False) -> tuple[dict, str]:
    """Contribute saved results (files or directories of them) and their rows' speed and memory records to a Hub
    dataset, at paths their identities give, with a manifest of their sha256 (qeval.orchestrate.contributions)."""
    from qeval.orchestrate import contributions  # noqa: PLC0415 - only this command uploads results

    return contributions.publish_results(runs, target, private=private)


def board_report(datasets: list[str], *, ref: str | None = None, out: Path = Path("board"), title: str | None = None,
                 machine: str | None = None):
    """The leaderboard of every result in Hub datasets measured against one reference (its label or identity's
    first digits), written under `out`; rows measured on another machine or backend marked, results of other
    references listed apart, files that are not what their manifest lists refused (qeval.orchestrate.contributions)."""
    from qeval.orchestrate import contributions  # noqa: PLC0415 - matplotlib loads only for boards

    return contributions.board(datasets, ref=ref, out=out, title=title, machine=machine)
