"""A reference and a candidate, whichever way they arrive: a store, a label, a llama.cpp base file, a GGUF model
run live over exactly the reference's tokens, or a label the runs directory knows only by its saved result
(qeval.orchestrate.candidates). `measure` is every comparison's one entry (`qeval kld`, and `compare`/`check`
through qeval.orchestrate.measured); `compare` the comparison of two sources read like stores."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from qeval.capture.capture import open_live
from qeval.compare import metrics, sampler
from qeval.compare.summary import summarize
from qeval.engine.engine import EngineSettings, available_cores
from qeval.engine.modelinfo import is_model_file
from qeval.errors import QevalError
from qeval.inputs.hub import hub_label, is_hub_spec, resolve_model
from qeval.orchestrate import budget, candidates
from qeval.present.progress import progress_bar
from qeval.present.results import Result
from qeval.storage import reference_pack, runs


def open_source(spec: str, runs_dir: str | os.PathLike | None = None):
    """A store, label or llama.cpp base file, opened for reading."""
    return runs.open_source(spec, runs.runs_dir(runs_dir))


def measure(ref: str, cand: str, chunks: int | None = None, runs_dir=None, threads: int | None = None,
            settings: EngineSettings = EngineSettings(), save: str | None = None, progress: bool = False,
            on_chunk=None, force: bool = False, samplers=(), save_result: bool = False) -> Result:
    """`cand` measured against `ref` (compare()'s arguments), a candidate label that the runs directory knows only by
    its saved result included: that result reused, or extended by running its GGUF live (qeval.orchestrate.candidates;
    Result.note says which). Result.comparison is the Comparison when one was computed now (what save_result writes)."""
    sampler.parse_all(samplers)  # a bad sampler is refused before any work
    directory = runs.runs_dir(runs_dir)
    refuse_model_reference(ref, cand, chunks, settings)
    with contextlib.closing(runs.open_source(ref, directory)) as ref_src:
        saved = candidates.saved_candidate(cand, ref_src.header.label, directory)
        if saved is not None:
            if save:
                raise QevalError(f"--save keeps a live GGUF candidate's store; {cand!r} is known by its saved result "
                                 f"{saved.path}: name its GGUF as --cand to keep its logits")
            return candidates.measure_saved(saved, ref_src, chunks, settings, samplers, threads, progress, on_chunk)
    cmp = compare(ref, cand, chunks, runs_dir, threads, settings, save, progress, on_chunk, force, samplers, save_result)
    return Result(summary=summarize(cmp), per_token=cmp.per_token, path=None, comparison=cmp)


def compare(ref: str, cand: str, chunks: int | None = None, runs_dir=None, threads: int | None = None,
            settings: EngineSettings = EngineSettings(), save: str | None = None,
            progress: bool = False, on_chunk=None, force: bool = False, samplers=(),
            save_result: bool = False) -> metrics.Comparison:
    """Compare a candidate (store, label, llama.cpp file, or a GGUF model run live: a path or an hf: spec) with
    a reference.

    save: keep a live candidate's store under this label; a store there that holds another capture is
    refused, or replaced with `force`. samplers: presets or settings strings (qeval.compare.sampler, e.g.
    "qwen3.5-thinking", "temp=0.6,top_k=20,top_p=0.95,min_p=0"): divergence after each sampler, same pass.
    A live candidate's run is said up front (with `progress`) and checked against the free disk (what `save` and
    `save_result`, the caller's, write: qeval.orchestrate.budget). A GGUF as the reference is refused with the
    command that captures it (refuse_model_reference)."""
    samplers = sampler.parse_all(samplers)  # a bad sampler is refused before any work
    directory = runs.runs_dir(runs_dir)
    refuse_model_reference(ref, cand, chunks, settings)
    with contextlib.ExitStack() as stack:
        ref_src = stack.enter_context(contextlib.closing(runs.open_source(ref, directory)))
        cand = resolve_model(cand)
        if is_model_file(cand):
            n = ref_src.header.chunk_stop if chunks is None else min(chunks, ref_src.header.chunk_stop)
            budget.check_live(ref_src.header, n, save or Path(cand).stem, cand, settings, save is not None,
                              save_result, len(samplers), directory, progress)
            cand_src = _open_live_candidate(stack, cand, ref_src, chunks, settings, save, directory, force, samplers)
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


def _open_live_candidate(stack: contextlib.ExitStack, model: str, ref_src, chunks, settings, save, directory: Path,
                         force: bool, samplers):
    """The live source of GGUF `model` over the reference's tokens; closed with `stack`. Its rows are coded
    only when they are kept (`save`) or a sampler reads the coded distribution."""
    save_path = None
    if save:
        directory.mkdir(parents=True, exist_ok=True)
        save_path = runs.store_path(save, directory)
    engine, cand_src = open_live(model, ref_src, chunks, settings, save or Path(model).stem, save_path,
                                 replace=force, coded=sampler.reads_distribution(samplers))
    stack.callback(engine.close)
    stack.callback(cand_src.close)
    return cand_src


def refuse_model_reference(ref: str, cand: str, chunks: int | None, settings: EngineSettings) -> None:
    """A GGUF named as the reference (a path, or an hf: spec that is no published reference: the repository is
    listed, nothing is downloaded) is refused with the commands that capture it once and then compare against it,
    with the flags given here. Capturing it implicitly would hide an
    hours-long run and a store of gigabytes behind a comparison, and choose its label, corpus and window size (what
    every later comparison against it means) without the user."""
    if not (is_hub_spec(ref) or (is_model_file(ref) and Path(ref).is_file())) or \
            (is_hub_spec(ref) and reference_pack.is_published(ref)):  # a store published on the Hub: pulled
        return
    label = hub_label(ref, ref) if is_hub_spec(ref) else Path(ref).name.removesuffix(".gguf")
    if not runs.is_label(label):
        label = "REF"
    flags = "".join(f" {flag} {value}" for flag, value in (("--chunks", chunks), ("-ngl", settings.n_gpu_layers),
                                                           ("-t", settings.n_threads)) if value)
    raise QevalError(f"--ref {ref} is a GGUF model, not a store: a reference's logits are captured once (hours for a "
                     f"large model, ~130 KB per scored token at a 262K vocab), then every candidate is compared "
                     f"against them. Capture it: `qeval capture {ref} --label {label}{flags}` (-c and --corpus choose "
                     f"the windows: 512 tokens of the shipped corpus by default), then: `qeval kld --ref {label} "
                     f"--cand {cand}{flags}`")
