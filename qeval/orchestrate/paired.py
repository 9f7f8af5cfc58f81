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
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as sps

from qeval.compare import metric_registry, sampler
from qeval.compare.depth import parse_depth
from qeval.compare.metric_registry import METRICS, Metric
from qeval.errors import MismatchError, QevalError
from qeval.orchestrate.measured import Measured, measure

CONFIDENCE = 0.95
N_BOOT = 10_000
BOOT_SEED = 0
METHODS = ("t", "bootstrap")

PAIRED_METRICS = {key: m for key, m in METRICS.items() if m.paired}


@dataclass
class PairedDifference:
    metric: str  # its qeval.compare.metric_registry key
    unit: str  # of the difference
    better: str  # "lower" or "higher"
    mean_a: float  # per-token means, in the metric's unit
    mean_b: float
    diff: float  # mean over chunks of the per-chunk mean difference A - B
    se: float  # of diff: sd(chunk differences) / sqrt(n_chunks) (t) or bootstrap sd
    ci_low: float
    ci_high: float
    p_value: float
    n_chunks: int
    n_tokens: int
    method: str
    confidence: float
    token_se: float  # the naive per-token SE, for comparison (too small when tokens are correlated)
    significant: bool
    verdict: str


def chunk_means(values: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """Mean of `values` within each chunk, in chunk-id order."""
    ids, inverse, counts = np.unique(np.asarray(chunk), return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=np.asarray(values, dtype=np.float64), minlength=len(ids))
    return sums / counts


def interval_t(d: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float, float, float]:
    """(mean, se, low, high, p) of a one-sample t-interval / two-sided t-test of mean(d) = 0."""
    n = len(d)
    mean = float(np.mean(d))
    sd = float(np.std(d, ddof=1))
    se = sd / math.sqrt(n)
    if se == 0.0:  # every chunk differs by exactly the same amount (often: not at all)
        return mean, 0.0, mean, mean, (1.0 if mean == 0.0 else 0.0)
    q = float(sps.t.ppf(0.5 + confidence / 2.0, n - 1))
    p = float(2.0 * sps.t.sf(abs(mean) / se, n - 1))
    return mean, se, mean - q * se, mean + q * se, p


def interval_bootstrap(d: np.ndarray, confidence: float = CONFIDENCE, n_boot: int = N_BOOT,
                       seed: int = BOOT_SEED) -> tuple[float, float, float, float, float]:
    """(mean, se, low, high, p) from resampling whole chunks with replacement (percentile interval)."""
    n = len(d)
    mean = float(np.mean(d))
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(boot, [alpha / 2.0, 1.0 - alpha / 2.0])
    if np.all(boot == boot[0]):
        return mean, 0.0, mean, mean, (1.0 if mean == 0.0 else 0.0)
    below, above = np.count_nonzero(boot <= 0.0), np.count_nonzero(boot >= 0.0)
    p = min(1.0, 2.0 * (min(below, above) + 1) / (n_boot + 1))
    return mean, float(np.std(boot, ddof=1)), float(low), float(high), p


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
        raise QevalError(f"{metric!r} is not a metric paired comparisons apply to ({', '.join(PAIRED_METRICS)}, "
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


def _decimals(x: float) -> int:
    """Decimals that show about two significant digits of `x` (a CI half-width)."""
    if not math.isfinite(x) or x <= 0.0:
        return 4
    return int(min(8, max(1, 1 - math.floor(math.log10(x)))))


def _signed(x: float, dec: int) -> str:
    s = f"{x:+.{dec}f}"
    return ("−" + s[1:]) if s.startswith("-") else s


def format_p(p: float) -> str:
    if p < 0.001:
        return "p < 0.001"
    return f"p = {p:.2g}" if p < 0.1 else f"p = {p:.2f}"


def verdict(r: PairedDifference, name_a: str = "A", name_b: str = "B") -> str:
    """One plain sentence: which candidate is better on this metric, or that the data can't tell."""
    what = metric_registry.lookup(r.metric).title.removeprefix("mean ")  # the per-token values: "A has lower KLD than B"
    dec = _decimals((r.ci_high - r.ci_low) / 2.0 if r.ci_high > r.ci_low else abs(r.diff))
    numbers = (f"difference {_signed(r.diff, dec)} {r.unit}, {100 * r.confidence:g} % CI "
               f"[{_signed(r.ci_low, dec)}, {_signed(r.ci_high, dec)}], {format_p(r.p_value)} over {r.n_chunks} chunks")
    if r.metric == "nll_mean":
        numbers += f"; PPL ratio {name_a}/{name_b} {math.exp(r.diff):.4f}"
    if r.diff == 0.0 and r.se == 0.0:
        return f"no significant difference in {what} between {name_a} and {name_b}: identical on all " \
               f"{r.n_tokens} tokens"
    if not r.significant:
        return f"no significant difference in {what} between {name_a} and {name_b}: {numbers}"
    if r.metric == "same_top1_pct":
        claim = f"{name_a} keeps the reference's top-1 token {'more' if r.diff > 0 else 'less'} often than {name_b}"
    else:
        claim = f"{name_a} has {'lower' if r.diff < 0 else 'higher'} {what} than {name_b}"
    return f"{claim}: {numbers}"


def compare_measured(a: Measured, b: Measured, method: str = "t", confidence: float = CONFIDENCE,
                     samplers: list[str] | None = None) -> dict:
    """Paired differences of two measurements of the same reference tokens (A - B, per metric), then the TVD of
    each of `samplers` (names; default: every sampler both measurements hold)."""
    for m in (a, b):
        if m.per_token is None:
            raise QevalError(f"{m.origin}: a paired comparison needs per-token values")
    ra, rb = a.summary["reference"], b.summary["reference"]
    if ra.get("label") != rb.get("label") or ra.get("n_ctx") != rb.get("n_ctx"):
        raise MismatchError(f"A and B were measured against different references: {ra.get('label')!r} "
                            f"(n_ctx {ra.get('n_ctx')}) and {rb.get('label')!r} (n_ctx {rb.get('n_ctx')})")
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
    for m in PAIRED_METRICS.values():
        diffs[m.key] = paired_difference(m.column_values(ta), m.column_values(tb), ta["chunk"], m.key, method,
                                         confidence, names)
    for name in samplers or [n for n in sampler.names_in(ta) if n in sampler.names_in(tb)]:
        m = metric_registry.lookup(f"tvd_pct@{name}")
        diffs[m.key] = paired_difference(m.column_values(ta), m.column_values(tb), ta["chunk"], m.key, method,
                                         confidence, names)
    first = next(iter(diffs.values()))
    return {
        "reference": a.summary["reference"],
        "a": a.summary["candidate"], "b": b.summary["candidate"],
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
                  depth: str | None = None, samplers=()) -> tuple[dict, str]:
    """`qeval compare`: measure A and B against `ref` (or read saved results) and pair them.
    depth: "LO:HI", only scored tokens at those logit positions (is A worse than B beyond 8K? "8192:").
    samplers: presets or settings strings (qeval.compare.sampler): their TVDs are paired too."""
    chosen = [s.name for s in sampler.parse_all(samplers)]
    if method not in METHODS:
        raise QevalError(f"--method must be one of {', '.join(METHODS)}, not {method!r}")
    band = parse_depth(depth)
    measured = []
    for role, cand in (("A", cand_a), ("B", cand_b)):
        try:
            measured.append(measure(ref, cand, chunks, runs_dir, threads, progress, depth=band, samplers=chosen))
        except QevalError as exc:
            raise type(exc)(f"candidate {role} ({cand}): {exc}") from None
    result = compare_measured(*measured, method=method, confidence=confidence, samplers=chosen)
    if band is not None:
        result["depth"] = {"lo": band[0], "hi": band[1]}
    return result, paired_text(result)


def paired_text(result: dict) -> str:
    ref, a, b = result["reference"], result["a"], result["b"]
    how = ("a t-interval over per-chunk mean differences" if result["method"] == "t"
           else f"a block bootstrap over chunks ({N_BOOT} draws, seed {BOOT_SEED})")
    lines = [f"reference : {ref['label']} ({ref['path']})",
             f"A         : {a['label']} ({a['path']})",
             f"B         : {b['label']} ({b['path']})",
             f"paired    : {result['chunks']} chunks of n_ctx {ref['n_ctx']}, {result['scored_tokens']} scored tokens, "
             f"the same tokens for A and B",
             *([f"depth     : only scored tokens at logit positions {result['depth']['lo']}:{result['depth']['hi']}"]
               if "depth" in result else []),
             f"intervals : {100 * result['confidence']:g} % from {how}", *[f"note      : {n}" for n in result["notes"]],
             "",
             f"{'metric':<14} {'A':>12} {'B':>12} {'A − B':>12}   {'CI':<27} p"]
    for key, d in result["differences"].items():
        dec = _decimals((d["ci_high"] - d["ci_low"]) / 2.0 if d["ci_high"] > d["ci_low"] else abs(d["diff"]))
        m = metric_registry.lookup(key)
        ci = f"[{_signed(d['ci_low'], dec)}, {_signed(d['ci_high'], dec)}]"
        means = f"{d['mean_a']:>12{m.fmt}} {d['mean_b']:>12{m.fmt}}"
        lines.append(f"{m.heading:<14} {means} {_signed(d['diff'], dec):>12}   "
                     f"{ci:<27} {format_p(d['p_value'])[2:]}")
    lines += ["", *[f"- {v}" for v in result["verdicts"]]]
    return "\n".join(lines)
