"""A reference and a candidate, whichever way they arrive: a store, a label, a llama.cpp base file, or a
GGUF model run live over exactly the reference's tokens. `compare` is every comparison's one entry
(`qeval kld`, and `compare`/`check` through qeval.orchestrate.measured)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from qeval.capture.capture import open_live
from qeval.capture.engine import EngineSettings, available_cores
from qeval.capture.hub import resolve_model
from qeval.capture.modelinfo import is_model_file
from qeval.compare import metrics, sampler
from qeval.errors import QevalError
from qeval.present.progress import progress_bar
from qeval.storage import runs


def open_source(spec: str, runs_dir: str | os.PathLike | None = None):
    """A store, label or llama.cpp base file, opened for reading."""
    return runs.open_source(spec, runs.runs_dir(runs_dir))


def compare(ref: str, cand: str, chunks: int | None = None, runs_dir=None, threads: int | None = None,
            settings: EngineSettings = EngineSettings(), save: str | None = None,
            progress: bool = False, on_chunk=None, force: bool = False, samplers=()) -> metrics.Comparison:
    """Compare a candidate (store, label, llama.cpp file, or a GGUF model run live: a path or an hf: spec) with
    a reference.

    save: keep a live candidate's store under this label; a store there that holds another capture is
    refused, or replaced with `force`. samplers: presets or settings strings (qeval.compare.sampler, e.g.
    "qwen3.5-thinking", "temp=0.6,top_k=20,top_p=0.95,min_p=0"): divergence after each sampler, same pass."""
    samplers = sampler.parse_all(samplers)  # a bad sampler is refused before any work
    directory = runs.runs_dir(runs_dir)
    with contextlib.ExitStack() as stack:
        ref_src = stack.enter_context(contextlib.closing(runs.open_source(ref, directory)))
        cand = resolve_model(cand)
        if is_model_file(cand):
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
