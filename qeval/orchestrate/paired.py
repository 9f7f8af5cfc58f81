"""Is candidate A really better than candidate B? Paired differences on the same reference tokens.

Both candidates are scored against one reference over the same tokens, so every token gives a
paired difference d = x_A - x_B of each metric qeval.compare.metric_registry marks `paired` (KLD, NLL,
same-top-1). The tokens of one window are not independent: they share a context, the model's state
and often a topic, so their differences are correlated and a per-token standard error
(sd/sqrt(n_tokens)) is too small. Windows (chunks) are evaluated with a cleared KV cache over
disjoint text, so they are close to independent; qeval therefore treats each chunk as one observation.

Primary method, `t`: the mean difference of every chunk (255 tokens at n_ctx 512) -> a one-sample
t-interval and a two-sided t-test over the chunk means (scipy.stats.t, n_chunks - 1 degrees of
freedom). Every chunk holds the same number of scored tokens, so the mean of the chunk means is the
per-token mean difference. Chosen over the bootstrap because it is exact and reproducible to the
last digit (no random draws, equal to `scipy.stats.ttest_1samp` on the chunk means), gives a p-value
of any size (a bootstrap p-value cannot go below 1/n_boot), and is accurate here: each chunk mean
averages hundreds of tokens, so the chunk means are close to normal even for heavy-tailed KLD.

Secondary method, `bootstrap`: a block bootstrap over chunks (resample whole chunks with
replacement, `n_boot` = 10,000 draws, seed 0), percentile interval and a two-sided p-value from the
share of resampled means on the other side of zero. Use it as a check when there are few chunks or
a few chunks dominate.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict

import numpy as np

from qeval.compare import metric_registry, sampler
from qeval.compare.depth import Selection
from qeval.compare.metric_registry import Metric
from qeval.compare.paired_stats import (
    BOOT_SEED,
    CONFIDENCE,
    N_BOOT,
    PairedDifference,
    chunk_means,
    interval_bootstrap,
    interval_t,
)
from qeval.errors import MismatchError, QevalError
from qeval.orchestrate.measured import Measured, measure, over_control
from qeval.present.paired_text import paired_text, verdict

METHODS = ("t", "bootstrap")

def difference_unit(m: Metric) -> str:
    return "percentage points" if m.unit == "%" else m.unit


def paired_difference(a: np.ndarray, b: np.ndarray, chunk: np.ndarray, metric: str = "kld_mean",
                      method: str = "t", confidence: float = CONFIDENCE, names: tuple[str, str] = ("A", "B"),
                      n_boot: int = N_BOOT, seed: int = BOOT_SEED) -> PairedDifference:
    """Difference of the means of `a` and `b` (per-token values of `metric` on the same tokens, before its
    percent scale), chunk-blocked."""
    if method not in METHODS:
        raise QevalError(f"--method must be one of {', '.join(METHODS)}, not {method!r}")
    if not 0.0 < confidence < 1.0:
        raise QevalError(f"confidence must be between 0 and 1, not {confidence}")
    m = metric_registry.lookup(metric)  # a sampler's TVD (tvd_pct@NAME) pairs too
    if m is None or not m.paired:
        raise QevalError(f"{metric!r} is not a metric paired comparisons apply to ({', '.join(m.key for m in metric_registry.paired())}, "
                         "tvd_pct@SAMPLER)")
    scale = m.scale
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.shape != np.shape(chunk):
        raise MismatchError("A and B must have one value per token on the same tokens")
    d = chunk_means(a - b, chunk) * scale
    if len(d) < 2:
        raise QevalError(f"a paired comparison needs at least 2 chunks (the chunk is the unit of the error bar); "
                         f"got {len(d)}")
    fn = interval_t if method == "t" else (lambda x, c: interval_bootstrap(x, c, n_boot, seed))
    diff, se, low, high, p = fn(d, confidence)
    token_sd = float(np.std((a - b) * scale, ddof=1)) if len(a) > 1 else float("nan")
    significant = (low > 0.0 or high < 0.0) if se > 0 else diff != 0.0
    out = PairedDifference(metric, difference_unit(m), m.better, float(np.mean(a)) * scale, float(np.mean(b)) * scale,
                           diff, se, low, high, p, len(d), len(a), method, confidence, token_sd / math.sqrt(len(a)),
                           significant, "")
    out.verdict = verdict(out, *names)
    return out


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


