"""The Python API behind every CLI command (notebooks and tests use it too).

Each *_report function returns (result dict, text) so the CLI only chooses how to print.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import identity, metrics, report, results, runs
from .capture import CaptureSpec, capture, open_live
from .codec import SqrtLogCode
from .engine import EngineSettings, available_cores
from .errors import QevalError
from .llamacpp import import_llamacpp
from .store import StoreReader


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True) -> Iterator:
    """Yield advance(n) for a rich progress bar on stderr (no-op when disabled)."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn  # noqa: PLC0415

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
            progress: bool = False, on_chunk=None, force: bool = False) -> metrics.Comparison:
    """Compare a candidate (store, label, llama.cpp file, or a GGUF model run live) with a reference.

    save: keep a live candidate's store under this label; a store there that holds another capture is
    refused, or replaced with `force`."""
    directory = runs.runs_dir(runs_dir)
    with contextlib.ExitStack() as stack:
        ref_src = stack.enter_context(contextlib.closing(runs.open_source(ref, directory)))
        if is_model_file(cand):
            save_path = None
            if save:
                directory.mkdir(parents=True, exist_ok=True)
                save_path = runs.store_path(save, directory)
            engine, cand_src = open_live(cand, ref_src, chunks, settings, save or Path(cand).stem, save_path,
                                         replace=force)
            stack.callback(engine.close)
            stack.callback(cand_src.close)
        else:
            if save:
                raise QevalError("--save only applies when the candidate is a GGUF model run live")
            cand_src = stack.enter_context(contextlib.closing(runs.open_source(cand, directory)))
        n = len(metrics.select_chunks(ref_src, cand_src, chunks))
        with progress_bar("comparing chunks", n, progress and on_chunk is None) as advance:
            result = metrics.compare(ref_src, cand_src, chunks, threads=threads or available_cores(),
                                     on_chunk=on_chunk or advance)
        if getattr(cand_src, "writer", None) is not None:
            cand_src.writer.finish()
        return result


def kld_report(ref: str, cand: str, chunks: int | None = None, runs_dir=None, threads: int | None = None,
               per_token: Path | None = None, progress: bool = False,
               settings: EngineSettings = EngineSettings(), save: str | None = None,
               save_result: bool = False, on_chunk=None, force: bool = False) -> tuple[dict, str]:
    cmp = compare(ref, cand, chunks, runs_dir, threads, settings, save, progress, on_chunk, force)
    if save_result:
        results.save_result(cmp, runs.runs_dir(runs_dir) / results.RESULTS_SUBDIR)
    if per_token is not None:
        try:
            report.write_per_token(cmp, Path(per_token))
        except OSError as exc:
            raise QevalError(f"cannot write --per-token file {per_token}: {exc.strerror}") from None
    result = report.comparison_json(cmp)
    return result, report.comparison_text(result)


def ppl_report(spec: str, chunks: int | None = None, runs_dir=None) -> tuple[dict, str]:
    import numpy as np  # noqa: PLC0415

    from . import stats  # noqa: PLC0415

    with contextlib.closing(open_source(spec, runs_dir)) as src:
        available = metrics.usable_chunks(src, "the")
        if chunks is not None and not 1 <= chunks <= len(available):
            raise QevalError(f"--chunks {chunks} is outside the {len(available)} chunks of {src.path}")
        selected = list(available)[:chunks] if chunks else list(available)
        nll = np.concatenate([-src.read_chunk(i).logprob_target for i in selected])
        ppl = stats.perplexity(nll)
        result = {"store": report.describe(src), "chunks": len(selected), "scored_tokens": int(len(nll)), **ppl}
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
    from .llamacpp import LlamaCppBaseFile  # noqa: PLC0415

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
                  progress: bool = False, on_chunk=None, force: bool = False) -> tuple[dict, str]:
    """Capture `model` into a store, resume an interrupted capture, or reuse one that holds it already.
    A store there that holds another capture is refused (naming what differs), or replaced with `force`."""
    directory = runs.runs_dir(runs_dir)
    runs.check_label(label)
    if out is None:
        directory.mkdir(parents=True, exist_ok=True)
        out = str(runs.store_path(label, directory))
    spec = CaptureSpec(model=model, out=out, label=label, corpus=corpus, n_ctx=n_ctx, chunks=chunks,
                       chunk_range=chunk_range, settings=settings, replace=force)
    with contextlib.ExitStack() as stack:
        state = {}

        def on_plan(total: int, done: int) -> None:
            if on_chunk is not None:
                state["advance"] = on_chunk
            else:
                state["advance"] = stack.enter_context(progress_bar(f"capturing {label}", total, progress))
            state["advance"](done)

        result = capture(spec, on_chunk=lambda n: state["advance"](n), on_plan=on_plan)
    if result.status == "already complete":
        text = f"{result.path} is already complete ({result.chunks_total} chunks): nothing to do"
    else:
        text = (f"wrote {result.path}: {result.chunks_total} chunks ({result.chunks_written} captured now) "
                f"in {result.seconds:.1f} s")
    return {"path": str(result.path), "status": result.status, "chunks": result.chunks_total,
            "chunks_written": result.chunks_written, "seconds": result.seconds}, text


def parse_model_arg(arg: str) -> tuple[str, str]:
    """`PATH` or `LABEL=PATH` -> (label, path); the default label is the file name without .gguf."""
    label, sep, path = arg.partition("=")
    if not sep:
        path, label = arg, Path(arg).name.removesuffix(".gguf")
    return runs.check_label(label), path


def pair_label(model_label: str, kv: str) -> str:
    return model_label if kv == "f16" else f"{model_label}+kv-{kv}"


def matrix_report(ref: str, models: list[str], kv_types: list[str], chunks: int | None = None, n_ctx: int = 512,
                  corpus: str | None = None, runs_dir=None, threads: int | None = None, n_gpu_layers: int = 0,
                  progress: bool = True, executor=None, n_batch: int | None = None,
                  n_ubatch: int | None = None, force: bool = False) -> tuple[dict, str]:
    """Capture `ref` once, then every model x KV pair (live, or reusing finished stores and results).

    A saved result or store is reused only when it answers the pair's request (qeval.identity); else
    the pair is recomputed and its result and store overwritten, and the text says so. A reference store
    that holds another capture is refused, or replaced with `force`.

    executor: None or "local" runs here; "ray" or a qeval.distributed.RayExecutor runs every capture
    and pair as a Ray task (the runs directory must then be on a shared filesystem)."""
    directory = runs.runs_dir(runs_dir)
    ref_label, ref_path = parse_model_arg(ref)
    pairs = []
    for model in models:
        label, path = parse_model_arg(model)
        for kv in kv_types:
            if not (path == ref_path and kv == "f16"):
                pairs.append((pair_label(label, kv), path, kv))
    return run_pairs(ref_label, ref_path, pairs, chunks, n_ctx, corpus, directory, threads, n_gpu_layers, progress,
                     executor, n_batch, n_ubatch, force)


def run_pairs(ref_label: str, ref_path: str, pairs: list[tuple[str, str, str]], chunks, n_ctx, corpus,
              directory: Path, threads, n_gpu_layers, progress, executor=None, n_batch: int | None = None,
              n_ubatch: int | None = None, force: bool = False) -> tuple[dict, str]:
    for _, path, kv in pairs:  # every bad setting is reported before hours of work start
        pair_settings(kv, n_gpu_layers, threads, n_batch, n_ubatch).validate()
    labels = [p[0] for p in pairs]
    if len(set(labels)) != len(labels) or ref_label in labels:
        raise QevalError(f"labels must be unique (reference {ref_label}, candidates {', '.join(labels)}); "
                         "name models with LABEL=PATH")
    directory.mkdir(parents=True, exist_ok=True)
    if executor not in (None, "local"):
        from .distributed import as_executor  # noqa: PLC0415 - Ray is optional

        ref_text, done_lines, rows_json = as_executor(executor).run_pairs(
            ref_label, ref_path, pairs, chunks, n_ctx, corpus, directory, threads, n_gpu_layers, progress,
            pair_settings, n_batch, n_ubatch, force)
        return _matrix_result(ref_label, pairs, n_ctx, ref_text, done_lines, rows_json)
    result_dir = directory / results.RESULTS_SUBDIR
    # The reference decides how many chunks every pair has.
    ref_settings = pair_settings("f16", n_gpu_layers, threads, n_batch, n_ubatch)
    total = chunks * (1 + len(pairs)) if chunks else None
    with progress_bar(f"matrix: reference + {len(pairs)} pairs", total, progress) as advance:
        _, ref_text = capture_store(ref_path, ref_label, runs_dir=directory, n_ctx=n_ctx, chunks=chunks,
                                    corpus=corpus, settings=ref_settings, on_chunk=advance, force=force)
        with StoreReader(runs.store_path(ref_label, directory)) as ref_store:
            n_chunks = ref_store.header.n_chunks if chunks is None else chunks
            plans = [plan_pair(ref_store, n_chunks, label, path, pair_settings(kv, n_gpu_layers, threads, n_batch,
                                                                                n_ubatch), directory)
                     for label, path, kv in pairs]
        done_lines, rows_json = [], []
        for plan in plans:
            if plan.result_current:
                done_lines.append(f"{plan.label}: done earlier, skipped")
                advance(n_chunks)
            else:
                if plan.note:
                    done_lines.append(plan.note)
                cand, save = (plan.label, None) if plan.store_usable else (plan.model, plan.label)
                kld_report(ref_label, cand, chunks=n_chunks, runs_dir=directory, settings=plan.settings, save=save,
                           save_result=True, on_chunk=advance, force=True)
            rows_json.append(results.load_result(results.result_path(result_dir, plan.label, ref_label),
                                                 with_per_token=False).summary)
    return _matrix_result(ref_label, pairs, n_ctx, ref_text, done_lines, rows_json)


@dataclass(frozen=True)
class PairPlan:
    """What a matrix does with one model x KV pair: nothing (its saved result answers the request), compare
    its stored candidate, or run the model live; `note` says why something saved is not reused."""

    label: str
    model: str
    settings: EngineSettings
    result_current: bool
    store_usable: bool  # its store holds this candidate over the compared windows
    note: str = ""


def plan_pair(ref_store, n_chunks: int, label: str, model: str, settings: EngineSettings,
              directory: Path) -> PairPlan:
    """The plan for candidate `label` (GGUF `model` run with `settings`) against the open reference store
    over its first n_chunks chunks, from what `directory` holds: its result, and its store."""
    try:
        planned = identity.planned_producer(model, settings, ref_store.header.n_ctx, SqrtLogCode().params())
    except (QevalError, OSError):
        return PairPlan(label, model, settings, False, False)  # running it says what is wrong with the model
    request = identity.ComparisonRequest(identity.reference_identity(ref_store, n_chunks), planned, n_chunks)
    result_path = results.result_path(directory / results.RESULTS_SUBDIR, label, ref_store.header.label)
    saved = results.saved_request(result_path)
    usable, store_changes = _stored_candidate(runs.store_path(label, directory), planned, ref_store, n_chunks)
    if saved is not None and saved.key == request.key:
        return PairPlan(label, model, settings, True, usable)
    if saved is not None:
        note = f"{label}: recomputed: its saved result answers another request ({_listed(request.changes_from(saved))})"
    elif result_path.is_file():
        note = f"{label}: recomputed: its saved result records no request (saved by an older qeval)"
    elif store_changes:
        note = f"{label}: its store held another capture ({_listed(store_changes)}): replaced"
    else:
        note = ""
    return PairPlan(label, model, settings, False, usable, note)


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
                                                              ref_store.tokens[:n_chunks])
            return holds and not differences, differences
    except QevalError:
        return False, ["it is not a readable store"]


def _matrix_result(ref_label, pairs, n_ctx, ref_text, done_lines, rows_json) -> tuple[dict, str]:
    rows = [report.leaderboard_row(r) for r in rows_json]
    text = "\n".join([ref_text, *done_lines, "", f"reference {ref_label}: {rows_json[0]['chunks']} chunks of {n_ctx}, "
                      f"{rows_json[0]['scored_tokens']} scored tokens" if rows_json else "",
                      "", "PPL matrix (rows: model, columns: KV cache)", report.ppl_matrix_markdown(pairs, rows_json),
                      "", "Leaderboard (sorted by mean KLD)", report.leaderboard_markdown(rows)])
    return {"reference": ref_label, "rows": rows, "results": rows_json}, text


def _fa_for(kv: str) -> str:
    return "on" if kv not in ("f16", "f32", "bf16") else "auto"


def pair_settings(kv: str, n_gpu_layers: int, threads: int | None, n_batch: int | None = None,
                  n_ubatch: int | None = None) -> EngineSettings:
    """How a matrix runs a model with KV cache type `kv` (a quantized V cache needs flash attention)."""
    return EngineSettings(kv, kv, _fa_for(kv), n_gpu_layers, threads, n_batch, n_ubatch)


def demo_report(chunks: int = 80, runs_dir=None, models_dir=None, n_ctx: int = 512, progress: bool = True,
                threads: int | None = None) -> tuple[dict, str]:
    """Gemma-3-270M end to end: derive quants, capture the Q8_0 reference, compare every candidate."""
    from . import demo  # noqa: PLC0415

    paths = demo.prepare_models(demo.models_dir(models_dir))
    pairs = [(run.label, str(paths[run.quant]), run.type_k) for run in demo.demo_runs()]
    result, text = run_pairs(demo.REFERENCE, str(paths[demo.REFERENCE]), pairs, chunks, n_ctx, None,
                             runs.runs_dir(runs_dir), threads, 0, progress)
    return result, demo.DERIVATION_NOTE + "\n" + text


def _is_complete(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with StoreReader(path) as store:
            return store.complete
    except QevalError:
        return False
