"""One candidate measured against a reference, whichever way it arrives: computed now from stores
(through `sources.compare`) or loaded from a saved result (`RUNS_DIR/results/<cand>.vs.<ref>.json`).

Paired comparisons (`qeval compare`) and release gates (`qeval check`) both start here.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from qeval.compare.depth import Selection
from qeval.compare.verdict import excess_over, fewer_chunks, written
from qeval.errors import MismatchError, QevalError
from qeval.identity import changes, is_control, reference_identity
from qeval.present import results
from qeval.storage import runs

Measured = results.Result  # the name paired comparisons and gates use for a candidate's measurement


def is_result_spec(spec: str) -> bool:
    return str(spec).endswith(".json")


def measure(ref: str, cand: str, chunks: int | None = None, runs_dir: str | os.PathLike | None = None,
            threads: int = 2, progress: bool = False, need_per_token: bool = True,
            selection: Selection = Selection(), samplers=()) -> Measured:
    """`cand` against `ref`: a saved result file (`*.json`) is read, anything else measured by
    qeval.orchestrate.sources.measure (a label known only by its saved result: that result, reused or extended).
    selection: only the scored tokens of a depth band, a segment, a category count (qeval.compare.depth).
    samplers: sampler names (qeval.compare.sampler) computed too; a saved result must hold them."""
    if is_result_spec(cand):
        need = need_per_token or chunks is not None or bool(selection)
        res = _from_result(ref, Path(cand), chunks, runs_dir, need).selected(selection)
        missing = [s for s in samplers if s not in res.summary.samplers]
        if missing:
            raise QevalError(f"{cand} holds no figures for sampler {', '.join(missing)}: recompute it (qeval kld "
                             f"--ref {res.ref_label} --cand {res.label} "
                             f"{' '.join('--sampler ' + s for s in samplers)} --save-result)")
        return res
    from qeval.orchestrate import sources  # noqa: PLC0415 - sources imports the capture engine

    return sources.measure(ref, cand, chunks, runs_dir, threads=threads, progress=progress,
                           samplers=samplers).selected(selection)


def _from_result(ref: str, path: Path, chunks: int | None, runs_dir, need_per_token: bool) -> Measured:
    if not path.is_file():
        raise QevalError(f"result file {path} does not exist")
    res = results.load_result(path, with_per_token=need_per_token)
    if need_per_token and res.per_token is None:
        raise QevalError(f"{path} has no per-token file (save results with `qeval kld --save-result` or "
                         "`qeval matrix`)")
    res = check_reference(ref, res, runs_dir)
    if chunks is not None:
        have = int(res.summary.chunks)
        if not 1 <= chunks <= have:
            raise QevalError(f"--chunks {chunks} is outside the {have} chunks of {path}")
        res = res.restricted(np.arange(chunks))
    return res


def check_reference(ref: str, res: results.Result, runs_dir) -> results.Result:
    """A saved result answers only for the reference it was measured against: the same model, settings
    and tokens (not merely the same label), with this qeval's formulas. Returned with the reference's top-1
    probabilities where it was saved before qeval kept them (results.with_reference_top1)."""
    saved = results.require_current(res)
    with contextlib.closing(runs.open_source(ref, runs.runs_dir(runs_dir))) as source:
        differences = changes(saved.reference, reference_identity(source, saved.chunks), "reference")
        if differences:
            rd = res.summary.reference
            raise MismatchError(f"{res.path} was measured against reference {rd.label!r} ({rd.path}), "
                                f"not {ref!r}: {'; '.join(differences)} (saved vs named)")
        return results.with_reference_top1(res, source)


def over_control(summary, control: Measured, spec: str) -> dict:
    """The candidate's mean KLD over a control's and its verdict (qeval.compare.verdict.excess_over: "within"
    numerical noise, "above" it or "undecided", with the chunks it stands on); a control must be the reference model
    recomputed (qeval.identity.is_control), else it is no floor."""
    if not is_control(control.summary.comparison_request()):
        raise QevalError(f"--control {spec} is not a control: its candidate is not the reference's model and settings "
                         "under another batch layout (qeval matrix makes one: the 'control' pair)")
    kld, floor = summary.measured().get("kld_mean"), control.summary.measured().get("kld_mean")
    excess, verdict = excess_over(kld, floor, fewer_chunks(summary.chunks, control.summary.chunks))
    return {"label": control.label, "kld_mean": floor.value if floor else None, "kld_mean_se": floor.se if floor else None,
            "kld_excess": excess, **written(verdict, "noise_verdict")}
