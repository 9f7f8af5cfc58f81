"""A candidate named by a label the runs directory knows only by its saved result: what `kld`, `compare` and
`check` make of it. A matrix keeps no candidate logits, only each pair's result, so after `qeval demo` or
`qeval matrix` a label such as `Q4_K_M` names a result, not a store.

A candidate label resolves, in this order, to
  1. its store (RUNS_DIR/<label>.qeval), compared as a store (qeval.orchestrate.sources);
  2. its saved result (RUNS_DIR/results/<label>.vs.<ref>.json) where that answers the request: measured against
     this reference over the chunks asked for, with this qeval's formulas and every sampler asked for. It is shown
     as a reused result, and the text says so;
  3. the GGUF that result recorded, run live with the settings the result recorded: over the chunks the result
     lacks when the model, settings and llama.cpp build are still those it was measured with (the numbers are then
     an uninterrupted run's, as a matrix pair resumed from its checkpoint), else over every chunk, saying why;
  4. otherwise one message naming what is missing and the command that would produce it.
Engine flags that choose what is computed (KV types, batch sizes, …) name another candidate than the label's:
they are refused with the command that measures that one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from qeval.capture.capture import open_live
from qeval.compare import metrics, sampler
from qeval.compare.summary import summarize
from qeval.engine.engine import EngineSettings, available_cores
from qeval.engine.modelinfo import model_facts
from qeval.errors import QevalError
from qeval.orchestrate import budget
from qeval.orchestrate.matrix import planned_request
from qeval.present import results
from qeval.present.progress import progress_bar
from qeval.storage import runs
from qeval.storage.results import result_path


@dataclass(frozen=True)
class SavedCandidate:
    """A label known by its saved result against the reference (`path`: the result's JSON)."""

    label: str
    path: Path


def saved_candidate(cand: str, ref_label: str, directory: Path) -> SavedCandidate | None:
    """The saved result that label `cand` stands for against reference `ref_label`: None when `cand` is a file, a
    store's label, or no result's."""
    if Path(cand).exists() or not runs.is_label(cand) or runs.store_path(cand, directory).is_file():
        return None
    path = result_path(directory / runs.RESULTS_SUBDIR, cand, ref_label)
    return SavedCandidate(cand, path) if path.is_file() else None


def measure_saved(saved: SavedCandidate, ref, chunks: int | None, settings: EngineSettings, samplers=(),
                  threads: int | None = None, progress: bool = False, on_chunk=None) -> results.Result:
    """The saved candidate against the open reference store `ref` over its first `chunks` chunks (default: every
    chunk the reference holds): its result reused, cut to fewer chunks, or extended (or recomputed) by running the
    GGUF it recorded live (the module's rules). Result.note says which."""
    res = results.with_reference_top1(results.load_result(saved.path), ref)
    wanted = range(wanted_chunks(ref, chunks))
    requested = sampler.parse_all(samplers)
    run_settings = _recorded_settings(saved, res, settings)
    held, why_not = results.reusable_chunks(res, ref, None, sampler.settings_names(requested))
    if set(wanted) <= held:
        return _reused(res, saved, wanted)
    gguf = _model_of(saved, res, ref, wanted, held, why_not)
    facts = model_facts(gguf)
    measured_with = sampler.parse_all([*(s.name for s in requested), *(res.summary.samplers or {})]) if held \
        else requested
    plan = planned_request(ref, len(wanted), facts, run_settings, tuple(s.name for s in measured_with))
    if held:
        held, why_not = results.reusable_chunks(res, ref, plan.candidate, plan.samplers)
        measured_with = measured_with if held else requested
    return _run_rest(saved, res, ref, gguf, run_settings, wanted, held, why_not, measured_with, threads, progress,
                     on_chunk)


def wanted_chunks(ref, chunks: int | None) -> int:
    """How many chunks a comparison against the reference store `ref` covers: `chunks`, at most what it holds."""
    have = metrics.usable_chunks(ref, "reference").stop
    if chunks is None:
        return have
    if chunks < 1:
        raise QevalError("--chunks must be at least 1")
    if chunks > have:
        h = ref.header
        model = h.model.get("file_name") or "MODEL.gguf"
        raise QevalError(f"--chunks {chunks} asks for more than the reference {h.label} holds ({have} chunks of "
                         f"{h.n_ctx} tokens): capture it over more windows first, e.g. `qeval capture {model} --label "
                         f"{h.label} -c {h.n_ctx} --chunks {chunks}` with the corpus and settings "
                         f"`qeval info {h.label}` shows (it keeps the {have} chunks and adds the rest) (for the demo: `qeval demo --chunks {chunks}`), or ask for "
                         f"--chunks {have} or fewer")
    return chunks


def _recorded_settings(saved: SavedCandidate, res: results.Result, settings: EngineSettings) -> EngineSettings:
    """The settings the saved candidate was computed with (threads and offload the caller's). A flag that would
    compute another candidate is refused: a label stands for what it measured."""
    request = res.summary.comparison_request() or results.require_current(res)  # None: refused, saying why
    recorded = settings.of_producer(request.candidate)
    default = EngineSettings()
    asked = [name for name in EngineSettings.DEFINING
             if getattr(settings, name) != getattr(default, name) and getattr(settings, name) != getattr(recorded, name)]
    if asked:
        model = runs.live_model_path(res.summary.candidate.path) or res.summary.candidate.facts.get("file_name", "MODEL.gguf")
        differences = "; ".join(f"{name}: {getattr(recorded, name)} vs {getattr(settings, name)}" for name in asked)
        raise QevalError(f"{saved.label!r} stands for the candidate its result {saved.path} measured; the flags given "
                         f"would compute another ({differences}, recorded vs given). Measure that one from its GGUF: "
                         f"`qeval kld --ref {res.ref_label} --cand {model} {settings.flags(asked)} --save-result`")
    return recorded


def _reused(res: results.Result, saved: SavedCandidate, wanted: range) -> results.Result:
    chunks = len(wanted)
    exact = res.summary.comparison_request().early is None and res.summary.chunks == chunks
    out = res if exact else res.restricted(np.arange(chunks))
    cut = "" if exact else f" (its first {chunks} of {int(np.unique(res.per_token['chunk']).size)} chunks)"
    reused = f"{saved.label}: reused its saved result {saved.path}{cut}: nothing run"
    return replace(out, note="\n".join(filter(None, [reused, res.note])))


def _model_of(saved: SavedCandidate, res: results.Result, ref, wanted: range, held: set[int], why_not: str) -> str:
    """The GGUF the saved result measured, when it is still there with the fingerprint it had; else one message
    naming what is missing and the commands that would measure the candidate."""
    side = res.summary.candidate
    gguf = runs.live_model_path(side.path)
    recorded = side.facts.get("fingerprint")
    if gguf is not None and Path(gguf).is_file() and recorded:
        try:
            if model_facts(gguf).get("fingerprint") == recorded:
                return gguf
        except QevalError:
            pass
        problem = f"{gguf} holds another model now (fingerprint {recorded[:12]}… was recorded)"
    elif gguf is not None:
        problem = f"its model {gguf} is gone"
    else:
        problem = f"it was measured from a store ({side.path}) that is gone, and its model file is not recorded"
    lacking = [c for c in wanted if c not in held]
    need = (f"it lacks {len(lacking)} of the {len(wanted)} chunks asked for" if held
            else f"it does not answer this request ({why_not})")
    name = side.facts.get("file_name") or "MODEL.gguf"
    prefix = next(i for i in range(len(wanted) + 1) if i not in held)  # the chunks 0..prefix-1 it holds
    fewer = f", or ask for --chunks {prefix} or fewer" if prefix else ""
    raise QevalError(f"{saved.label!r} is known only by its saved result {saved.path}: {need}, and {problem}. Run the "
                     f"candidate from its GGUF: `qeval kld --ref {res.ref_label} --cand PATH/TO/{name} --chunks "
                     f"{len(wanted)} --save-result`{fewer}")


def _run_rest(saved: SavedCandidate, res: results.Result, ref, gguf: str, settings: EngineSettings, wanted: range,
              held: set[int], why_not: str, samplers, threads: int | None, progress: bool, on_chunk
              ) -> results.Result:
    """The saved candidate's GGUF run live over the wanted chunks it does not hold, joined with the ones it holds."""
    todo = [c for c in wanted if c not in held]
    directory = saved.path.parent.parent
    budget.check_live(ref.header, len(todo), saved.label, gguf, settings, False, False, len(samplers), directory,
                      progress)
    parts = res.chunk_columns(held & set(wanted))
    with contextlib.ExitStack() as stack:
        engine, cand = open_live(gguf, ref, len(wanted), settings, saved.label, None,
                                 coded=sampler.reads_distribution(samplers))
        stack.callback(engine.close)
        stack.callback(cand.close)
        cand.produce(todo)
        with progress_bar("comparing chunks", len(todo), progress and on_chunk is None) as advance:
            metrics.compare(ref, cand, len(wanted), threads=threads or available_cores(), on_chunk=on_chunk or advance,
                            samplers=samplers, order=todo, after_chunk=lambda index, columns: parts.update({index: columns}))
        cmp = metrics.comparison_of(ref, cand, list(wanted), [parts[c] for c in wanted])
    if held:
        note = (f"{saved.label}: {len(wanted) - len(todo)} chunks reused from its saved result {saved.path}, "
                f"{len(todo)} run live from {gguf}")
    else:
        note = f"{saved.label}: its saved result {saved.path} does not answer ({why_not}): every chunk run live from {gguf}"
    return results.Result(summary=summarize(cmp), per_token=cmp.per_token, path=None, note=note, comparison=cmp)
