"""`qeval compare`: is candidate A really better than candidate B? Both measured against one reference (or read
from saved results), paired on the same reference tokens, each difference worded. The statistics, and why chunks
are the unit, are qeval.compare.paired_stats's."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict

import numpy as np

from qeval.compare import metric_registry, paired_stats, sampler
from qeval.compare.depth import Selection
from qeval.compare.paired_stats import BOOT_SEED, CONFIDENCE, METHODS, N_BOOT, PairedDifference
from qeval.errors import MismatchError, QevalError
from qeval.orchestrate.measured import Measured, measure, over_control
from qeval.present.paired_text import paired_text, verdict


def paired_difference(a: np.ndarray, b: np.ndarray, chunk: np.ndarray, metric: str = "kld_mean",
                      method: str = "t", confidence: float = CONFIDENCE, names: tuple[str, str] = ("A", "B"),
                      n_boot: int = N_BOOT, seed: int = BOOT_SEED) -> PairedDifference:
    """qeval.compare.paired_stats.paired_difference of `a` and `b` with its verdict in words, naming A and B
    `names`."""
    out = paired_stats.paired_difference(a, b, chunk, metric, method, confidence, n_boot, seed)
    return dataclasses.replace(out, verdict=verdict(out, *names))


def compare_measured(a: Measured, b: Measured, method: str = "t", confidence: float = CONFIDENCE,
                     samplers: list[str] | None = None) -> dict:
    """Paired differences of two measurements of the same reference tokens (A - B, per metric), then the TVD of
    each of `samplers` (names; default: every sampler both measurements hold)."""
    for m in (a, b):
        if m.per_token is None:
            raise QevalError(f"{m.origin}: a paired comparison needs per-token values")
    ra, rb = a.summary.reference, b.summary.reference
    if ra.label != rb.label or ra.n_ctx != rb.n_ctx:
        raise MismatchError(f"A and B were measured against different references: {ra.label!r} "
                            f"(n_ctx {ra.n_ctx}) and {rb.label!r} (n_ctx {rb.n_ctx})")
    notes = []
    common = np.intersect1d(a.chunk_ids, b.chunk_ids)
    if len(common) == 0:
        raise MismatchError("A and B share no chunk of the reference")
    if len(common) < max(len(a.chunk_ids), len(b.chunk_ids)):
        notes.append(f"A covers {len(a.chunk_ids)} chunks and B {len(b.chunk_ids)}: paired over the "
                     f"{len(common)} chunks both hold")
        a, b = a.restricted(common), b.restricted(common)
    ta, tb = a.per_token, b.per_token
    for key in ("chunk", "position", "token"):
        if not np.array_equal(ta[key], tb[key]):
            bad = int(np.flatnonzero(ta[key] != tb[key])[0]) if len(ta[key]) == len(tb[key]) else 0
            raise MismatchError(f"A and B do not share the reference tokens: {key} differs at scored token {bad} "
                                f"(chunk {int(ta['chunk'][bad])}); they cannot be paired")
    names = _names(a.label, b.label)
    diffs = {}
    for m in metric_registry.paired():
        diffs[m.key] = paired_difference(m.column_values(ta), m.column_values(tb), ta["chunk"], m.key, method,
                                         confidence, names)
    for name in samplers or [n for n in sampler.names_in(ta) if n in sampler.names_in(tb)]:
        m = metric_registry.lookup(f"tvd_pct@{name}")
        diffs[m.key] = paired_difference(m.column_values(ta), m.column_values(tb), ta["chunk"], m.key, method,
                                         confidence, names)
    first = next(iter(diffs.values()))
    return {
        "reference": a.summary.reference.to_json(),
        "a": a.summary.candidate.to_json(), "b": b.summary.candidate.to_json(),
        "a_origin": a.origin, "b_origin": b.origin,
        "chunks": first.n_chunks, "scored_tokens": first.n_tokens,
        "method": method, "confidence": confidence,
        "differences": {k: asdict(v) for k, v in diffs.items()},
        "verdicts": [v.verdict for v in diffs.values()],
        "notes": notes,
    }


def _names(a: str, b: str) -> tuple[str, str]:
    return (f"A ({a})", f"B ({b})") if a == b or not a or not b else (a, b)


def paired_report(ref: str, cand_a: str, cand_b: str, chunks: int | None = None,
                  runs_dir: str | os.PathLike | None = None, threads: int = 2, method: str = "t",
                  confidence: float = CONFIDENCE, progress: bool = False,
                  depth: str | None = None, samplers=(), segment: str | None = None,
                  category: str | None = None, control: str | None = None) -> tuple[dict, str]:
    """`qeval compare`: measure A and B against `ref` (or read saved results) and pair them.
    depth: "LO:HI", only scored tokens at those logit positions (is A worse than B beyond 8K? "8192:").
    segment, category: only the assistant's tokens of one segment (thinking, answer, tool_call) or of one
    category's conversations (--score assistant comparisons).
    samplers: presets or settings strings (qeval.compare.sampler): their TVDs are paired too.
    control: a control against the same reference (as `check --control`): each candidate's mean KLD over it."""
    chosen = [s.name for s in sampler.parse_all(samplers)]
    if method not in METHODS:
        raise QevalError(f"--method must be one of {', '.join(METHODS)}, not {method!r}")
    selection = Selection.parse(depth, segment, category)
    measured = []
    for role, cand in (("A", cand_a), ("B", cand_b)):
        try:
            measured.append(measure(ref, cand, chunks, runs_dir, threads, progress, selection=selection,
                                    samplers=chosen))
        except QevalError as exc:
            raise type(exc)(f"candidate {role} ({cand}): {exc}") from None
    result = compare_measured(*measured, method=method, confidence=confidence, samplers=chosen)
    if selection.depth is not None:
        result["depth"] = {"lo": selection.depth[0], "hi": selection.depth[1]}
    if selection.labels():
        result["selection"] = selection.labels()
    notes = [m.note for m in measured]
    if control is not None:
        floor = measure(ref, control, chunks, runs_dir, threads, progress, need_per_token=False, selection=selection)
        result["control"] = {role: over_control(m.summary, floor, control) for role, m in zip("AB", measured)}
        notes.append(floor.note)
    if any(notes):  # how each figure was obtained, when a saved result stood in (qeval.orchestrate.candidates)
        result["obtained"] = [n for n in notes if n]
    return result, "\n".join([*result.get("obtained", ()), paired_text(result)])


