"""The Python API behind every CLI command (notebooks and tests use it too).

Each *_report function returns (result dict, text) so the CLI only chooses how to print.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from qeval.capture.capture import CaptureSpec, capture, open_live
from qeval.capture.engine import EngineSettings, available_cores
from qeval.compare import depth, metrics, sampler
from qeval.compare.summary import Side, summarize
from qeval.errors import QevalError
from qeval.orchestrate import matrix
from qeval.orchestrate.distributed import as_executor
from qeval.orchestrate.matrix import pair_label, pair_settings, parse_model_arg  # noqa: F401 - public here as before
from qeval.present import report, results
from qeval.storage import runs
from qeval.storage.llamacpp import import_llamacpp
from qeval.storage.scoring import Scoring
from qeval.storage.store import StoreReader


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True) -> Iterator:
    """Yield advance(n) for a rich progress bar on stderr (no-op when disabled)."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,  # noqa: PLC0415
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def open_source(spec: str, runs_dir: str | os.PathLike | None = None):
    return runs.open_source(spec, runs.runs_dir(runs_dir))


def is_model_file(spec: str) -> bool:
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def compare(ref: str, cand: str, chunks: int | None = None, runs_dir=None, threads: int | None = None,
            settings: EngineSettings = EngineSettings(), save: str | None = None,
            progress: bool = False, on_chunk=None, force: bool = False, samplers=()) -> metrics.Comparison:
    """Compare a candidate (store, label, llama.cpp file, or a GGUF model run live) with a reference.

    save: keep a live candidate's store under this label; a store there that holds another capture is
    refused, or replaced with `force`. samplers: presets or settings strings (qeval.compare.sampler, e.g.
    "qwen3.5-thinking", "temp=0.6,top_k=20,top_p=0.95,min_p=0"): divergence after each sampler, same pass."""
    samplers = sampler.parse_all(samplers)  # a bad sampler is refused before any work
    directory = runs.runs_dir(runs_dir)
    with contextlib.ExitStack() as stack:
        ref_src = stack.enter_context(contextlib.closing(runs.open_source(ref, directory)))
        if is_model_file(cand):
            save_path = None
            if save:
                directory.mkdir(parents=True, exist_ok=True)
                save_path = runs.store_path(save, directory)
            engine, cand_src = open_live(cand, ref_src, chunks, settings, save or Path(cand).stem, save_path,
                                         replace=force, coded=any(not s.greedy for s in samplers))
            stack.callback(engine.close)
            stack.callback(cand_src.close)
        else:
            if save:
                raise QevalError("--save only applies when the candidate is a GGUF model run live")
            cand_src = stack.enter_context(contextlib.closing(runs.open_source(cand, directory)))
        n = len(metrics.select_chunks(ref_src, cand_src, chunks))
        with progress_bar("comparing chunks", n, progress and on_chunk is None) as advance:
            result = metrics.compare(ref_src, cand_src, chunks, threads=threads or available_cores(),
                                     on_chunk=on_chunk or advance, samplers=samplers)
        if getattr(cand_src, "writer", None) is not None:
            cand_src.writer.finish()
        return result


def kld_report(ref: str, cand: str, chunks: int | None = None, runs_dir=None, threads: int | None = None,
               per_token: Path | None = None, progress: bool = False,
               settings: EngineSettings = EngineSettings(), save: str | None = None,
               save_result: bool = False, on_chunk=None, force: bool = False,
               bands: str | None = None, samplers=()) -> tuple[dict, str]:
    """bands: inner edges of the by-depth block, e.g. "512,2048,8192" (default: powers of 4 from 512).
    samplers: see compare(); their figures are the result's "samplers" block (and sampler metrics)."""
    depth.parse_bands(bands, 1 << 40)  # a bad --bands is refused before any work
    cmp = compare(ref, cand, chunks, runs_dir, threads, settings, save, progress, on_chunk, force, samplers)
    if save_result:
        results.save_result(cmp, runs.runs_dir(runs_dir) / results.RESULTS_SUBDIR)
    if per_token is not None:
        try:
            report.write_per_token(cmp, Path(per_token))
        except OSError as exc:
            raise QevalError(f"cannot write --per-token file {per_token}: {exc.strerror}") from None
    summary = summarize(cmp, depth.parse_bands(bands, cmp.ref.header.n_ctx))
    return summary.to_json(), report.comparison_text(summary)


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


def capture_store(model: str, label: str, runs_dir=None, out: str | None = None, corpus: str | None = None,
                  n_ctx: int = 512, chunks: int | None = None, settings: EngineSettings = EngineSettings(),
                  chunk_range: tuple[int, int] | None = None,
                  progress: bool = False, on_chunk=None, force: bool = False, scoring: str = "half",
                  concat: bool = False) -> tuple[dict, str]:
    """Capture `model` into a store, resume an interrupted capture, or reuse one that holds it already.
    A store there that holds another capture is refused (naming what differs), or replaced with `force`."""
    directory = runs.runs_dir(runs_dir)
    runs.check_label(label)
    if out is None:
        directory.mkdir(parents=True, exist_ok=True)
        out = str(runs.store_path(label, directory))
    spec = CaptureSpec(model=model, out=out, label=label, corpus=corpus, n_ctx=n_ctx, chunks=chunks,
                       chunk_range=chunk_range, settings=settings, replace=force, scoring=Scoring.parse(scoring).rule,
                       concat=concat)
    with contextlib.ExitStack() as stack:
        state = {}

        def on_plan(total: int, done: int) -> None:
            if on_chunk is not None:
                state["advance"] = on_chunk
            else:
                state["advance"] = stack.enter_context(progress_bar(f"capturing {label}", total, progress))
            state["advance"](done)

        result = capture(spec, on_chunk=lambda n: state["advance"](n), on_plan=on_plan)
    return {"path": str(result.path), "status": result.status, "chunks": result.chunks_total,
            "chunks_written": result.chunks_written, "seconds": result.seconds}, result.summary_line()


def matrix_report(ref: str, models: list[str], kv_types: list[str], chunks: int | None = None, n_ctx: int = 512,
                  corpus: str | None = None, runs_dir=None, threads: int | None = None, n_gpu_layers: int = 0,
                  progress: bool = True, executor=None, n_batch: int | None = None,
                  n_ubatch: int | None = None, force: bool = False, scoring: str = "half",
                  concat: bool = False, samplers=(), tasks=(), rope_scaling: str | None = None,
                  rope_scale: float | None = None) -> tuple[dict, str]:
    """Capture `ref` once, then every model x KV pair (live, or reusing finished stores and results).
    samplers: presets or settings strings (qeval.compare.sampler) every pair is measured with too; a TVD
    column each in the matrix's leaderboard. tasks: task files (or matrix.TaskRequest) the reference and every
    pair are scored on too, as llama-perplexity scores tasks; a flips column each. rope_scaling, rope_scale:
    as llama.cpp's --rope-scaling/--rope-scale, needed for n_ctx beyond the models' trained context.

    A saved result or store is reused only when it answers the pair's request (qeval.identity); else
    the pair is recomputed and its result and store overwritten, and the text says so. A reference store
    that holds another capture is refused, or replaced with `force`.

    executor: None or "local" runs here; "ray" or a qeval.orchestrate.distributed.RayExecutor runs every capture
    and pair as a Ray task (the runs directory must then be on a shared filesystem)."""
    directory = runs.runs_dir(runs_dir)
    ref_label, ref_path = parse_model_arg(ref)
    pairs = []
    for model in models:
        label, path = parse_model_arg(model)
        for kv in kv_types:
            if not (path == ref_path and kv == "f16"):
                pairs.append((pair_label(label, kv), path, kv))
    engine = EngineSettings(n_gpu_layers=n_gpu_layers, n_threads=threads, n_batch=n_batch, n_ubatch=n_ubatch,
                            rope_scaling=rope_scaling, rope_scale=rope_scale)
    requests = tuple(t if isinstance(t, matrix.TaskRequest) else matrix.TaskRequest(str(t)) for t in tasks)
    return run_pairs(ref_label, ref_path, pairs, chunks, n_ctx, corpus, directory, engine, progress, executor, force,
                     scoring, concat, samplers, requests)


def run_pairs(ref_label: str, ref_path: str, pairs: list[tuple[str, str, str]], chunks, n_ctx, corpus,
              directory: Path, engine: EngineSettings, progress: bool = True, executor=None, force: bool = False,
              scoring: str = "half", concat: bool = False, samplers=(), tasks=()) -> tuple[dict, str]:
    """The matrix of reference `ref_path` and (label, model, kv) `pairs` (see matrix_report)."""
    plan = matrix.plan_matrix(ref_label, ref_path, pairs, chunks, n_ctx, corpus, directory, engine, force, scoring,
                              concat, samplers, tasks)
    directory.mkdir(parents=True, exist_ok=True)
    if executor not in (None, "local"):
        run = as_executor(executor).run(plan, progress)
    else:
        with progress_bar(f"matrix: reference + {len(pairs)} pairs", plan.total_chunks, progress) as advance:
            run = matrix.run_local(plan, advance)
    with progress_bar(f"matrix: {len(plan.tasks)} task sets x {1 + len(pairs)} models", None,
                      progress and bool(plan.tasks)) as advance:
        task_lines = matrix.run_tasks(plan, on_tasks=advance)
    return matrix.matrix_result(plan, run, task_lines)


def demo_report(chunks: int = 80, runs_dir=None, models_dir=None, n_ctx: int = 512, progress: bool = True,
                threads: int | None = None) -> tuple[dict, str]:
    """Gemma-3-270M end to end: derive quants, capture the Q8_0 reference, compare every candidate."""
    from qeval.orchestrate import demo  # noqa: PLC0415

    paths = demo.prepare_models(demo.models_dir(models_dir))
    pairs = [(run.label, str(paths[run.quant]), run.type_k) for run in demo.demo_runs()]
    result, text = run_pairs(demo.REFERENCE, str(paths[demo.REFERENCE]), pairs, chunks, n_ctx, None,
                             runs.runs_dir(runs_dir), EngineSettings(n_threads=threads), progress)
    return result, demo.DERIVATION_NOTE + "\n" + text


# --- task accuracy and answer flips (qeval.orchestrate.tasks) -------------------------------------------------
def task_capture_report(model: str, task: str, kind: str | None = None, limit: int | None = None,
                        label: str | None = None, runs_dir=None, out: str | None = None, settings=None,
                        force: bool = False, progress: bool = False, hf_loader=None) -> tuple[dict, str]:
    """Score every choice of a task set (HellaSwag, Winogrande, multiple-choice file or hf: dataset) with a GGUF
    model as llama-perplexity does, into RUNS_DIR/tasks/<task>/<label>.tasks.jsonl; resumes, reuses, or refuses
    a store of another capture (`force` replaces it)."""
    from qeval.capture.taskscore import TaskSettings  # noqa: PLC0415
    from qeval.orchestrate import tasks  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        state = {}

        def on_plan(total: int, done: int) -> None:
            state["advance"] = stack.enter_context(progress_bar(f"scoring tasks ({label or Path(model).stem})",
                                                                total, progress))
            state["advance"](done)

        return tasks.capture_tasks(model, task, kind=kind, limit=limit, label=label, runs_dir=runs_dir, out=out,
                                   settings=settings or TaskSettings(), force=force, on_plan=on_plan,
                                   on_tasks=lambda n: state["advance"](n), hf_loader=hf_loader)


def task_show_report(store: str, runs_dir=None, task: str | None = None) -> tuple[dict, str]:
    """Accuracy of one task store (path or label)."""
    from qeval.orchestrate import tasks  # noqa: PLC0415

    return tasks.show_tasks(store, runs_dir, task)


def flips_report(ref: str, cand: str, runs_dir=None, task: str | None = None, bins: int = 4,
                 max_listed: int = 20) -> tuple[dict, str]:
    """Accuracy of both, answer flips, exact McNemar p and flips by the reference's margin, from two task stores."""
    from qeval.orchestrate import tasks  # noqa: PLC0415

    return tasks.flips_report(ref, cand, runs_dir, task, bins, max_listed)
