"""Release gate: `qeval check` passes (exit 0), fails (exit 1) or cannot yet tell (undecided, exit 3) a candidate
on thresholds and baselines.

Every metric of qeval.compare.metric_registry with a `gate` option is a threshold: `--max-…` for lower-is-better
metrics, `--min-…` for higher-is-better ones (keyword `max_kld` etc. in Python). A sampler threshold
(`--max-tvd`, metric_registry.SAMPLER_GATES) gives one check per `--sampler` (for a saved result without
--sampler: per sampler it holds).
A threshold is judged by qeval.compare.verdict's rule on the figure's 95 % interval, value ± q·SE with q the t
multiplier of the chunks it stands on (chunks − 1 degrees of freedom): it passes only when the whole interval is on
the right side of the limit (mean + q·SE ≤ limit for lower-is-better metrics, value − q·SE ≥ limit for
same-top-1), fails when the whole interval is past it, and is undecided when the interval straddles the limit
(more chunks narrow it). Percentiles (99.9 % KLD) and bounds have no standard error and are compared directly.
Against a baseline the error bars of both sides add up: worse-by − q·sqrt(SE_run² + SE_baseline²) > 0 fails; a
baseline value without SE counts as exact. A baseline check is a regression test with no margin to be "as good"
within: its pass says "not shown worse", never "as good as" (a threshold says that).
The gate fails where a check fails, else is undecided where one is (exit 3: not a pass), else passes.

`--max-kld-confident` (CONFIDENT_GATE) judges the mean KLD of the most confident bucket of the reference's top-1
probability (qeval.compare.depth.by_confidence: the tokens the reference was surest of, above the last edge of
--confidence-buckets), its SE cluster-robust as every group's: a quant that "now misses tokens the reference was
certain of" fails it even where its mean KLD over every token passes.

Bad input (unknown store, malformed baseline, nonsense limit) raises QevalError: exit 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from qeval.compare import metric_registry, sampler
from qeval.compare.depth import Selection, parse_confidence_buckets
from qeval.compare.gate_checks import FAIL, PASS, UNDECIDED, Check, GateResult
from qeval.compare.metric_registry import METRICS, Metric, MetricValue
from qeval.compare.summary import ComparisonSummary, Side
from qeval.compare.verdict import ABOVE, WITHIN, judge, multiplier
from qeval.errors import QevalError
from qeval.orchestrate import baselines
from qeval.orchestrate.measured import Measured, is_result_spec, measure, over_control
from qeval.present import results
from qeval.present.gate_text import control_text, gate_text
from qeval.storage.baselines import Baseline, Entry, Published, load_baseline

CONFIDENT_GATE = dataclasses.replace(
    METRICS["kld_mean"], key="kld_mean_confident", title="mean KLD where the reference is most confident",
    description="mean KLD over the scored tokens of the most confident bucket of the reference's top-1 probability "
                "(qeval check --confidence-buckets: above its last edge)", gate="max-kld-confident", board=False,
    paired=False)


def gated() -> list[Metric]:
    """Every threshold `qeval check` takes, in option order: metric_registry.gated(), then CONFIDENT_GATE."""
    return [*metric_registry.gated(), CONFIDENT_GATE]


def _fmt(m: Metric, x: float) -> str:
    return m.number(x) + m.percent


def option(m: Metric) -> str:
    return f"--{m.gate}"


def keyword(m: Metric) -> str:
    """The keyword of run_checks and check_report that carries its limit: --max-kld-999 -> max_kld_999."""
    return m.gate.replace("-", "_")


def option_help(m: Metric) -> str:
    side = "above" if m.better == "lower" else "below"
    unit = (" (percent, e.g. 90)" if m.better == "higher" else " (percent)") if m.unit == "%" else ""
    how = "beyond its error bars" if m.has_se else "(no SE: compared directly)"
    return f"Fail if {m.title} is {side} the limit{unit} {how}."


def limit_check(m: Metric, measured: MetricValue, limit: float, chunks: int) -> Check:
    """Pass only when the whole interval value ± q·SE (q: verdict.multiplier(chunks)) is on the right side of the
    limit, fail when the whole of it is past the limit, else undecided (qeval.compare.verdict.judge on how far the
    figure is past the limit, margin 0); a figure without SE is compared directly."""
    value, se, better = measured.value, measured.se, m.better
    if value is None or not math.isfinite(value):  # a bound the stores do not record (docs/error-bound.md)
        raise QevalError(f"{option(m)}: the comparison has no {m.title}: a store it reads records no error of its "
                         "stored form (made before qeval measured it); capture it again with this qeval")
    cmp_ok, cmp_bad = ("≤", ">") if better == "lower" else ("≥", "<")
    shown = f"{m.title} {m.text(value, se if _has_se(se) else None)}"
    lim = f"{limit:g}{m.percent}"
    if not _has_se(se):
        worse = value > limit if better == "lower" else value < limit
        reason = (f"{shown} {cmp_bad if worse else cmp_ok} limit {lim} "
                  f"(a percentile or a bound has no standard error: compared directly)")
        return Check(name=m.gate, metric=m.key, verdict=FAIL if worse else PASS, value=value, se=None, limit=limit,
                     bound=None, reason=reason)
    sign = 1.0 if better == "lower" else -1.0  # past the limit is above it for lower-is-better figures
    v = judge(sign * (value - limit), se, chunks)
    bound, worst = limit + sign * v.low, limit + sign * v.high
    side, far = ("lower", "upper") if better == "lower" else ("upper", "lower")
    if not math.isfinite(bound):  # fewer than 2 chunks
        bound = worst = None
        reason = f"{shown}: a single chunk gives no interval (chunks are the unit): {v.words()}"
    elif v.state == ABOVE:
        reason = f"{shown}: even the {side} 95 % bound {_fmt(m, bound)} is {cmp_bad} limit {lim}"
    elif v.state == WITHIN:
        reason = (f"{shown}: its whole 95 % interval is within the limit (the {far} bound {_fmt(m, worst)} "
                  f"{cmp_ok} {lim})")
    else:
        reason = (f"{shown}: its 95 % interval {_fmt(m, min(bound, worst))} to {_fmt(m, max(bound, worst))} "
                  f"straddles limit {lim}: {v.words()}, measure more chunks to decide")
    verdict = {ABOVE: FAIL, WITHIN: PASS}.get(v.state, UNDECIDED)
    return Check(name=m.gate, metric=m.key, verdict=verdict, value=value, se=se, limit=limit, bound=bound,
                 reason=reason, worst=worst)


def _has_se(se: float | None) -> bool:
    return se is not None and math.isfinite(se)


def baseline_check(key: str, run: MetricValue, base: Published, entry_id: str, chunks: int,
                   judge_direct: bool = False) -> Check:
    """Worse than the baseline beyond q·sqrt(SE_run² + SE_base²) fails (q: verdict.multiplier(chunks)); else the
    check passes as "not shown worse" (a regression test has no margin to be as good within). Without any SE
    (percentiles on both sides) there is no error bar: the line is informative unless `judge_direct` (asked for by
    name)."""
    m = metric_registry.lookup(key)
    se_run = run.se if _has_se(run.se) else None
    se_base = base.se
    worse_by = run.value - base.value if m.better == "lower" else base.value - run.value
    direct = se_run is None and se_base is None
    half = None if direct else multiplier(chunks) * math.hypot(se_run or 0.0, se_base or 0.0)
    fails = worse_by - (half or 0.0) > 0.0
    shown = (f"{key} {m.text(run.value, se_run)} vs baseline {entry_id} "
             f"{'~' if base.approx else ''}{m.text(base.value, se_base)}")
    if direct and not judge_direct:
        reason = (f"{shown}: {'worse' if worse_by > 0 else 'not worse'} (no standard error on either side: shown, "
                  f"not judged; judge it with --baseline-metric {key})")
        return Check(name=f"baseline:{key}", metric=key, verdict=PASS, value=run.value, se=None, limit=base.value,
                     bound=None, reason=reason, judged=False)
    if direct:
        reason = f"{shown}: {'worse' if fails else 'not worse'} (no standard errors: compared directly)"
    elif fails:
        reason = f"{shown}: worse by {_fmt(m, worse_by)}, beyond the combined 95 % error bar ±{_fmt(m, half)}"
    elif worse_by > 0:
        reason = (f"{shown}: worse by {_fmt(m, worse_by)}, within the combined 95 % error bar ±{_fmt(m, half)}: "
                  f"not shown worse ({chunks} chunks)")
    else:
        reason = f"{shown}: not worse"
    if se_base is None and not direct:
        reason += " (the baseline gives no SE)"
    bound = None if direct or not math.isfinite(half) else worse_by - half  # none under 2 chunks
    return Check(name=f"baseline:{key}", metric=key, verdict=FAIL if fails else PASS, value=run.value, se=se_run,
                 limit=base.value, bound=bound, reason=reason)


def validate_limits(limits: dict[str, float | None]) -> dict[str, float]:
    """The limits given, by metric key, from keyword -> limit (None: not given); nonsense is refused."""
    known = [keyword(m) for m in gated()]
    unknown = sorted(set(limits) - set(known))
    if unknown:
        raise QevalError(f"unknown threshold(s) {', '.join(unknown)} (known: {', '.join(known)})")
    given = {}
    for m in gated():  # checks in table order, whatever the order of the options
        v = limits.get(keyword(m))
        if v is None:
            continue
        if not math.isfinite(v) or v <= 0:
            raise QevalError(f"{option(m)} must be a positive number, not {v}")
        if m.unit == "%" and v > 100.0:
            raise QevalError(f"{option(m)} is a percentage, at most 100, not {v}")
        # a limit below 1 % on a higher-is-better percentage is a fraction typed for a percentage
        if m.unit == "%" and m.better == "higher" and v < 1.0:
            raise QevalError(f"{option(m)} is a percentage between 1 and 100 (e.g. 90 for 90 %), not {v}")
        given[m.key] = v
    return given


def _nothing_to_check() -> QevalError:
    options = ", ".join(option(m) for m in gated())
    return QevalError(f"nothing to check: give at least one of {options}, --baseline")


def run_checks(summary: ComparisonSummary, baseline: Baseline | None = None, baseline_entry: str | None = None,
               baseline_metrics: list[str] | None = None, samplers: list[str] | None = None,
               **limits: float | None) -> GateResult:
    """Judge one comparison summary; `limits` by keyword (max_kld=0.05).
    A sampler threshold (max_tvd) applies to each of `samplers` (names; default: every sampler the summary holds)."""
    given = validate_limits(limits)
    measured = summary.measured()
    chunks = int(summary.chunks or 0)  # none known: every interval undecided
    checks = []
    for key, limit in given.items():
        if key == CONFIDENT_GATE.key:
            checks.append(confident_check(summary, limit, chunks))
            continue
        if not metric_registry.is_sampler_template(key):
            checks.append(limit_check(METRICS[key], _held(measured, key, summary), limit, chunks))
            continue
        template = next(m for m in metric_registry.SAMPLER_GATES if m.key == key)
        names = list(samplers) if samplers else list(summary.samplers)
        if not names:
            raise QevalError(f"{option(template)} needs sampler figures: give --sampler NAME (or check a result "
                             "saved by `qeval kld --sampler NAME --save-result`)")
        for name in names:
            m = metric_registry.for_sampler(template, name)
            checks.append(limit_check(m, _held(measured, m.key, summary), limit, chunks))
    notes, base_info = [], None
    if baseline is not None:
        entry = baselines.pick_entry(baseline, summary.candidate, summary.reference, baseline_entry)
        keys = [k for k in entry.metrics if metric_registry.lookup(k).better is not None]
        if baseline_metrics:
            unknown = [k for k in baseline_metrics if k not in entry.metrics]
            if unknown:
                raise QevalError(f"baseline entry {entry.id} has no metric {', '.join(unknown)} "
                                 f"(it has {', '.join(entry.metrics)})")
            keys = [k for k in keys if k in baseline_metrics]
        else:  # a metric that restates another one the entry holds is judged once
            keys = [k for k in keys if metric_registry.lookup(k).restates not in keys]
        if not keys:
            raise QevalError(f"baseline entry {entry.id} has no metric a run can be judged on")
        for key in keys:
            checks.append(baseline_check(key, _held(measured, key, summary), entry.metrics[key], entry.id, chunks,
                                         judge_direct=bool(baseline_metrics)))
        notes += _setting_notes(entry, summary)
        base_info = {"name": baseline.name, "path": str(baseline.path) if baseline.path else None, "entry": entry.id}
    if not checks:
        raise _nothing_to_check()
    if not any(c.judged for c in checks):
        raise QevalError("nothing to judge: the baseline's metrics have no standard error on either side; name "
                         "them with --baseline-metric to compare them directly, or give a threshold")
    z = multiplier(chunks)
    return GateResult(candidate=summary.candidate.label, reference=summary.reference.label, chunks=chunks,
                      scored_tokens=int(summary.scored_tokens),
                      z=z if math.isfinite(z) else None, checks=checks, notes=notes, baseline=base_info)


def confident_check(summary: ComparisonSummary, limit: float, chunks: int) -> Check:
    """CONFIDENT_GATE on the summary's most confident bucket (its last by_confidence group), judged as every
    threshold over the `chunks` it stands on."""
    buckets = summary.by_confidence
    if buckets is None:
        raise QevalError(f"{option(CONFIDENT_GATE)}: the comparison of {summary.candidate.label!r} holds no figures "
                         "by the reference's confidence (a result saved before qeval kept the reference's top-1 "
                         "probability): check it with the reference store it was measured against at hand, or "
                         "recompute it")
    top = buckets[-1]
    if top.hi < 1.0:  # by_confidence leaves out a bucket without tokens
        raise QevalError(f"{option(CONFIDENT_GATE)}: the most confident bucket holds no scored token (the "
                         f"reference's top-1 probability never reaches {top.hi:g}): lower the last edge of "
                         "--confidence-buckets")
    m = dataclasses.replace(CONFIDENT_GATE, title=f"mean KLD at reference top-1 p ≥ {top.lo:g} ({top.n} tokens)")
    return limit_check(m, MetricValue(value=top.kld["mean"], se=top.kld["se"]), limit, chunks)


def _held(measured: dict[str, MetricValue], key: str, summary: ComparisonSummary) -> MetricValue:
    if key not in measured:
        raise QevalError(f"the comparison of {summary.candidate.label!r} holds no {key} (computed before qeval "
                         "measured it): recompute it")
    return measured[key]


def _setting_notes(entry: Entry, summary: ComparisonSummary) -> list[str]:
    """Where the baseline was measured differently from this run (its numbers may not transfer)."""
    ref = summary.reference
    notes = []
    run = {"n_ctx": ref.n_ctx, "chunks": summary.chunks, "corpus": (ref.corpus or {}).get("name")}
    for key, what in (("n_ctx", "n_ctx"), ("chunks", "chunks"), ("corpus", "corpus")):
        b = entry.settings.get(key)
        if b is None:
            notes.append(f"baseline {entry.id} does not state its {what}")
        elif run[key] is not None and b != run[key]:
            notes.append(f"baseline {entry.id} used {what} {b}, this run {run[key]}")
    run_model = summary.candidate.facts.get("name")
    if entry.model and run_model and entry.model.lower() != run_model.lower():
        notes.append(f"baseline model {entry.model}, this run {run_model}")
    return notes


def _pick_early(base: Baseline, ref: str, cand: str, runs_dir) -> None:
    """Refuse an ambiguous or unmatched baseline from the stores' headers, before a long comparison."""
    from qeval.orchestrate import sources  # noqa: PLC0415 - sources imports the capture engine

    if is_result_spec(cand) or sources.is_model_file(cand):
        return  # a saved result is read at once; a live model's quant is known only once loaded
    try:
        with contextlib.closing(sources.open_source(ref, runs_dir)) as r, \
                contextlib.closing(sources.open_source(cand, runs_dir)) as c:
            reference, candidate = Side.of_source(r), Side.of_source(c)
    except QevalError:
        return  # the comparison itself reports bad stores
    baselines.pick_entry(base, candidate, reference)


def check_report(ref: str, cand: str, chunks: int | None = None, runs_dir: str | os.PathLike | None = None,
                 threads: int = 2, baseline: str | None = None, baseline_entry: str | None = None,
                 baseline_metrics: list[str] | None = None, progress: bool = False, depth: str | None = None,
                 samplers=(), control: str | None = None, segment: str | None = None, category: str | None = None,
                 confidence_buckets: str | None = None, **limits: float | None) -> tuple[dict, str, bool]:
    """`qeval check`: (JSON, text, passed); the JSON's "verdict" says passed, failed or undecided (exit code:
    gate_checks.GATE_VERDICTS). Inputs are checked before any long comparison starts.
    depth: "LO:HI", gate only the scored tokens at those logit positions (e.g. "8192:" for beyond 8K).
    segment, category: gate only the assistant's tokens of one segment or category (conversations).
    samplers: presets or settings strings (qeval.compare.sampler) whose figures --max-tvd judges.
    control: a control against the same reference (a saved result or store of the reference model recomputed
    under another batch layout, as `matrix` makes it): the candidate's mean KLD over it is reported with its noise
    verdict (measured.over_control); limits still judge the candidate's own figures, and the gate's verdict.
    confidence_buckets: inner edges of the buckets of the reference's top-1 probability, e.g. "0.5,0.9,0.99"
    (default: qeval.compare.depth.DEFAULT_CONFIDENCE_EDGES); max_kld_confident judges the last."""
    given = validate_limits(limits)
    buckets = parse_confidence_buckets(confidence_buckets)
    chosen = [s.name for s in sampler.parse_all(samplers)]
    per_sampler = [option(m) for m in metric_registry.SAMPLER_GATES if m.key in given]
    if per_sampler and not chosen and not is_result_spec(cand):
        raise QevalError(f"{', '.join(per_sampler)} needs --sampler NAME (the samplers whose figures it judges)")
    selection = Selection.parse(depth, segment, category)
    base = load_baseline(baseline, metric_registry) if baseline else None
    if base is not None and baseline_entry:
        base.entry(baseline_entry)
    if base is None and (baseline_entry or baseline_metrics):
        raise QevalError("--baseline-entry and --baseline-metric need --baseline")
    if not (base or given):
        raise _nothing_to_check()
    if base is not None and not baseline_entry and len(base.entries) > 1:
        _pick_early(base, ref, cand, runs_dir)
    by_confidence = confidence_buckets is not None or CONFIDENT_GATE.key in given
    measured: Measured = measure(ref, cand, chunks, runs_dir, threads, progress, need_per_token=by_confidence,
                                 selection=selection, samplers=chosen)
    summary = measured.summary
    if confidence_buckets is not None:  # the summary holds the default buckets
        summary = dataclasses.replace(summary, by_confidence=results.recomputed(summary, measured.per_token,
                                                                                buckets=buckets).by_confidence)
    result = run_checks(summary, base, baseline_entry, baseline_metrics, chosen, **limits)
    out = result.to_json()
    text = gate_text(result)
    notes = [measured.note]
    if control is not None:
        floor = measure(ref, control, chunks, runs_dir, threads, progress, need_per_token=False, selection=selection)
        out["control"] = over_control(measured.summary, floor, control)
        text += "\n" + control_text(out["control"])
        notes.append(floor.note)
    if any(notes):  # how each figure was obtained, when a saved result stood in (qeval.orchestrate.candidates)
        out["obtained"] = [n for n in notes if n]
        text = "\n".join([*out["obtained"], text])
    if selection.depth is not None:
        out["depth"] = {"lo": selection.depth[0], "hi": selection.depth[1]}
    if selection.labels():
        out["selection"] = selection.labels()
    if selection:
        text = f"{selection.describe()}\n{text}"
    return out, text, result.passed
