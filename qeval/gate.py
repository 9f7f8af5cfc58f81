"""Release gate: `qeval check` passes (exit 0) or fails (exit 1) a candidate on thresholds and baselines.

A check fails only when the candidate is worse than the limit *beyond its error bars*: the mean must
be over the limit even at the favourable end of its 95 % interval (mean − 1.96·SE for lower-is-better
metrics, value + 1.96·SE for same-top-1). A measurement that is over the limit but within noise of
it passes, and its line says so. Percentiles (99.9 % KLD) have no standard error in qeval's output and
are compared directly. Against a baseline the error bars of both sides add up:
worse-by − 1.96·sqrt(SE_run² + SE_baseline²) > 0 fails; a baseline value without SE counts as exact.

Bad input (unknown store, malformed baseline, nonsense limit) raises QevalError: exit 2.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass, field

from . import baselines
from .errors import QevalError
from .measured import Measured, is_result_spec, measure

Z = 1.96  # two-sided 95 %; each check is one-sided at 97.5 %


@dataclass
class Check:
    name: str  # the option or "baseline:<metric>"
    metric: str
    passed: bool
    value: float
    se: float | None
    limit: float
    bound: float | None  # the favourable end of the interval that was compared with the limit
    reason: str
    judged: bool = True  # False: shown for information only (no error bar on either side)


@dataclass
class GateResult:
    passed: bool
    candidate: str
    reference: str
    chunks: int
    scored_tokens: int
    z: float
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    baseline: dict | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks]
        return d


def _fmt(x: float, unit: str) -> str:
    if unit == "%":
        return f"{x:.2f} %"
    if unit in ("PPL", "ratio"):
        return f"{x:.4f}"
    return f"{x:.4f}" if abs(x) >= 0.1 else f"{x:.6f}"


def _pm(value: float, se: float | None, unit: str) -> str:
    s = _fmt(value, unit)
    return s if se is None else f"{s} ± {_fmt(se, unit).removesuffix(' %')}{' %' if unit == '%' else ''}"


def limit_check(name: str, metric: str, what: str, value: float, se: float | None, limit: float,
                better: str, unit: str) -> Check:
    """Fail only when even the favourable end of value ± Z·SE is on the wrong side of the limit."""
    has_se = se is not None and math.isfinite(se)
    bound = (value - Z * se if better == "lower" else value + Z * se) if has_se else value
    worse = bound > limit if better == "lower" else bound < limit
    over = value > limit if better == "lower" else value < limit
    cmp_ok, cmp_bad = ("≤", ">") if better == "lower" else ("≥", "<")
    side = "lower" if better == "lower" else "upper"
    shown = f"{what} {_pm(value, se if has_se else None, unit)}"
    lim = f"{limit:g}{' %' if unit == '%' else ''}"
    if not has_se:
        reason = (f"{shown} {cmp_bad if worse else cmp_ok} limit {lim} "
                  f"(a percentile has no standard error: compared directly)")
    elif worse:
        reason = f"{shown}: even the {side} 95 % bound {_fmt(bound, unit)} is {cmp_bad} limit {lim}"
    elif over:
        reason = (f"{shown} is past limit {lim}, but within its error bars ({side} 95 % bound "
                  f"{_fmt(bound, unit)} {cmp_ok} {lim}): not a significant failure")
    else:
        reason = f"{shown} {cmp_ok} limit {lim}"
    return Check(name, metric, not worse, value, se if has_se else None, limit, bound if has_se else None, reason)


def baseline_check(key: str, run: baselines.MetricValue, base: baselines.MetricValue, entry_id: str,
                   judge_direct: bool = False) -> Check:
    """Worse than the baseline beyond sqrt(SE_run² + SE_base²)·Z fails. Without any SE (percentiles on
    both sides) there is no error bar: the line is informative unless `judge_direct` (asked for by name)."""
    spec = baselines.METRICS[key]
    se_run = run.se if run.se is not None and math.isfinite(run.se) else None
    se_base = base.se
    worse_by = run.value - base.value if spec.better == "lower" else base.value - run.value
    direct = se_run is None and se_base is None
    se = None if direct else math.sqrt((se_run or 0.0) ** 2 + (se_base or 0.0) ** 2)
    margin = worse_by - (0.0 if direct else Z * se)
    fails = margin > 0.0
    unit = spec.unit
    shown = (f"{key} {_pm(run.value, se_run, unit)} vs baseline {entry_id} "
             f"{'~' if base.approx else ''}{_pm(base.value, se_base, unit)}")
    if direct and not judge_direct:
        reason = (f"{shown}: {'worse' if worse_by > 0 else 'not worse'} (no standard error on either side: shown, "
                  f"not judged; judge it with --baseline-metric {key})")
        return Check(f"baseline:{key}", key, True, run.value, None, base.value, None, reason, judged=False)
    if direct:
        reason = f"{shown}: {'worse' if fails else 'not worse'} (no standard errors: compared directly)"
    elif fails:
        reason = f"{shown}: worse by {_fmt(worse_by, unit)}, beyond the combined 95 % error bar ±{_fmt(Z * se, unit)}"
    elif worse_by > 0:
        reason = f"{shown}: worse by {_fmt(worse_by, unit)}, within the combined 95 % error bar ±{_fmt(Z * se, unit)}"
    else:
        reason = f"{shown}: not worse"
    if se_base is None and not direct:
        reason += " (the baseline gives no SE)"
    return Check(f"baseline:{key}", key, not fails, run.value, se_run, base.value,
                 None if direct else worse_by - Z * se, reason)


def validate_limits(max_kld=None, max_kld_999=None, min_top1=None, max_ppl_ratio=None) -> None:
    for name, v in (("--max-kld", max_kld), ("--max-kld-999", max_kld_999), ("--max-ppl-ratio", max_ppl_ratio)):
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise QevalError(f"{name} must be a positive number, not {v}")
    if min_top1 is not None and not (1.0 <= min_top1 <= 100.0):
        raise QevalError(f"--min-top1 is a percentage between 1 and 100 (e.g. 90 for 90 %), not {min_top1}")


def run_checks(summary: dict, max_kld: float | None = None, max_kld_999: float | None = None,
               min_top1: float | None = None, max_ppl_ratio: float | None = None,
               baseline: baselines.Baseline | None = None, baseline_entry: str | None = None,
               baseline_metrics: list[str] | None = None) -> GateResult:
    """Judge one comparison summary (the JSON of `qeval kld --json`)."""
    validate_limits(max_kld, max_kld_999, min_top1, max_ppl_ratio)
    m = baselines.result_metrics(summary)
    checks = []
    if max_kld is not None:
        checks.append(limit_check("max-kld", "kld_mean", "mean KLD", m["kld_mean"].value, m["kld_mean"].se, max_kld,
                                  "lower", "nats"))
    if max_kld_999 is not None:
        checks.append(limit_check("max-kld-999", "kld_999", "99.9 % KLD", m["kld_999"].value, None, max_kld_999,
                                  "lower", "nats"))
    if min_top1 is not None:
        checks.append(limit_check("min-top1", "same_top1_pct", "same top-1", m["same_top1_pct"].value,
                                  m["same_top1_pct"].se, min_top1, "higher", "%"))
    if max_ppl_ratio is not None:
        checks.append(limit_check("max-ppl-ratio", "ppl_ratio", "PPL ratio", m["ppl_ratio"].value, m["ppl_ratio"].se,
                                  max_ppl_ratio, "lower", "ratio"))
    notes, base_info = [], None
    if baseline is not None:
        entry = baselines.pick_entry(baseline, summary, baseline_entry)
        keys = [k for k in entry.metrics if baselines.METRICS[k].better is not None]
        if "ppl_ratio" in keys and "delta_ppl_pct" in keys and not baseline_metrics:
            keys.remove("delta_ppl_pct")  # the same quantity as the ratio: judged once
        if baseline_metrics:
            unknown = [k for k in baseline_metrics if k not in entry.metrics]
            if unknown:
                raise QevalError(f"baseline entry {entry.id} has no metric {', '.join(unknown)} "
                                 f"(it has {', '.join(entry.metrics)})")
            keys = [k for k in keys if k in baseline_metrics]
        if not keys:
            raise QevalError(f"baseline entry {entry.id} has no metric a run can be judged on")
        for key in keys:
            checks.append(baseline_check(key, m[key], entry.metrics[key], entry.id,
                                         judge_direct=bool(baseline_metrics)))
        notes += _setting_notes(entry, summary)
        base_info = {"name": baseline.name, "path": str(baseline.path) if baseline.path else None, "entry": entry.id}
    if not checks:
        raise QevalError("nothing to check: give at least one of --max-kld, --max-kld-999, --min-top1, "
                         "--max-ppl-ratio, --baseline")
    if not any(c.judged for c in checks):
        raise QevalError("nothing to judge: the baseline's metrics have no standard error on either side; name "
                         "them with --baseline-metric to compare them directly, or give a threshold")
    return GateResult(all(c.passed for c in checks), summary["candidate"]["label"], summary["reference"]["label"],
                      int(summary["chunks"]), int(summary["scored_tokens"]), Z, checks, notes, base_info)


def _setting_notes(entry: baselines.Entry, summary: dict) -> list[str]:
    """Where the baseline was measured differently from this run (its numbers may not transfer)."""
    ref = summary["reference"]
    notes = []
    run = {"n_ctx": ref.get("n_ctx"), "chunks": summary.get("chunks"), "corpus": (ref.get("corpus") or {}).get("name")}
    for key, what in (("n_ctx", "n_ctx"), ("chunks", "chunks"), ("corpus", "corpus")):
        b = entry.settings.get(key)
        if b is None:
            notes.append(f"baseline {entry.id} does not state its {what}")
        elif run[key] is not None and b != run[key]:
            notes.append(f"baseline {entry.id} used {what} {b}, this run {run[key]}")
    run_model = (summary["candidate"].get("model") or {}).get("name")
    if entry.model and run_model and entry.model.lower() != run_model.lower():
        notes.append(f"baseline model {entry.model}, this run {run_model}")
    return notes


def _pick_early(base: baselines.Baseline, ref: str, cand: str, runs_dir) -> None:
    """Refuse an ambiguous or unmatched baseline from the stores' headers, before a long comparison."""
    from . import api, report  # noqa: PLC0415

    if is_result_spec(cand) or api.is_model_file(cand):
        return  # a saved result is read at once; a live model's quant is known only once loaded
    try:
        with contextlib.closing(api.open_source(ref, runs_dir)) as r, \
                contextlib.closing(api.open_source(cand, runs_dir)) as c:
            head = {"reference": report.describe(r), "candidate": report.describe(c)}
    except QevalError:
        return  # the comparison itself reports bad stores
    baselines.pick_entry(base, head)


def gate_text(r: GateResult) -> str:
    lines = [f"{r.candidate} against {r.reference}: {r.chunks} chunks, {r.scored_tokens} scored tokens"]
    if r.baseline:
        lines.append(f"baseline {r.baseline['name']}, entry {r.baseline['entry']}")
    width = max(len(c.name) for c in r.checks)
    for c in r.checks:
        lines.append(f"{'INFO' if not c.judged else 'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.reason}")
    lines += [f"note: {n}" for n in r.notes]
    failed = sum(not c.passed for c in r.checks)
    n = sum(c.judged for c in r.checks)
    lines.append((f"PASSED: all {n} checks" if n > 1 else "PASSED: 1 check") if r.passed else
                 f"FAILED: {failed} of {n} check{'s' if n > 1 else ''}")
    return "\n".join(lines)


def check_report(ref: str, cand: str, chunks: int | None = None, runs_dir: str | os.PathLike | None = None,
                 threads: int = 2, max_kld: float | None = None, max_kld_999: float | None = None,
                 min_top1: float | None = None, max_ppl_ratio: float | None = None, baseline: str | None = None,
                 baseline_entry: str | None = None, baseline_metrics: list[str] | None = None,
                 progress: bool = False) -> tuple[dict, str, bool]:
    """`qeval check`: (JSON, text, passed). Inputs are checked before any long comparison starts."""
    validate_limits(max_kld, max_kld_999, min_top1, max_ppl_ratio)
    base = baselines.load_baseline(baseline) if baseline else None
    if base is not None and baseline_entry:
        base.entry(baseline_entry)
    if base is None and (baseline_entry or baseline_metrics):
        raise QevalError("--baseline-entry and --baseline-metric need --baseline")
    if not (base or any(v is not None for v in (max_kld, max_kld_999, min_top1, max_ppl_ratio))):
        raise QevalError("nothing to check: give at least one of --max-kld, --max-kld-999, --min-top1, "
                         "--max-ppl-ratio, --baseline")
    if base is not None and not baseline_entry and len(base.entries) > 1:
        _pick_early(base, ref, cand, runs_dir)
    measured: Measured = measure(ref, cand, chunks, runs_dir, threads, progress, need_per_token=False)
    result = run_checks(measured.summary, max_kld, max_kld_999, min_top1, max_ppl_ratio, base, baseline_entry,
                        baseline_metrics)
    out = result.to_json()
    return out, gate_text(result), result.passed
