"""qeval's metrics, each defined once: its name, unit, better direction, how it is computed from the per-token
columns, how it prints, and whether `qeval check` and `qeval compare` use it.

A metric's key is its one name in every output: the "metrics" block of a comparison's JSON (and so of saved
results), leaderboard columns, baseline files (baselines/SCHEMA.md), `qeval check` lines and `qeval compare`
differences. qeval.present (report, board, text of gates, baselines and paired comparisons) and qeval.orchestrate iterate METRICS
and spell no metric out. Beside "metrics", a comparison's JSON keeps llama-perplexity's statistics blocks
(perplexity, kld, kld_reverse, delta_p, same_top1, topK_agreement: ladders, correlation) that its text
layout prints.

Adding a metric is one entry in METRICS (and a row in the table of baselines/SCHEMA.md). Results saved
before it existed lack it: they show no value for it, and a check on it asks for a recomputation.

Every metric also carries its certified bound (docs/error-bound.md): how far its value can be from the same figure
computed on the exact logits, given the stores' error records. Its aggregate derives it from the per-token bounds
(column_bound): the KLD columns carry theirs (kld_bound, kld_reverse_bound), every other per-token column is exact
where the stores record their error (their scalars and top ids are the exact logits'), a sampler's columns are not
bounded (its truncation set may change with the error). The bound is a number, NOT_RECORDED (a store without an
error record: never shown as 0) or NOT_BOUNDED.

Sampler metrics (qeval.compare.sampler) are a family per sampler, made by sampler_metrics(NAME) and keyed
"<metric>@<sampler name>" (tvd_pct@qwen3.5-thinking): a comparison computed with `--sampler` holds them in
its "metrics" block, lookup() finds them, `qeval compare` pairs the TVD, and SAMPLER_GATES holds the `qeval check`
thresholds that apply to every sampler (--max-tvd); a leaderboard shows the board ones (the mean TVD) of every
sampler all its results hold (qeval.present.board.common_samplers). They are not in METRICS: baseline files
do not know them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, ClassVar, Union

import numpy as np

from qeval.compare import sampler, stats
from qeval.errors import QevalError
from qeval.identity import NOT_RECORDED

PerToken = dict[str, np.ndarray]
Column = Union[str, Callable[[PerToken], np.ndarray]]  # a per-token field (metrics.PER_TOKEN_FIELDS), or derived

# The blocks of the text report (llama-perplexity's "====== <block> statistics ======").
PPL_BLOCK, KLD_BLOCK, TOKEN_BLOCK = "Perplexity", "KL divergence", "Token probability"


def delta_p(t: PerToken) -> np.ndarray:
    """p_candidate(correct token) − p_reference(correct token), per scored token."""
    return t["p_cand"] - t["p_ref"]


def abs_delta_p(t: PerToken) -> np.ndarray:
    return np.abs(delta_p(t))


def values_of(t: PerToken, column: Column) -> np.ndarray:
    return column(t) if callable(column) else t[column]


# --------------------------------------------------------------------------------------------------
# bounds: how far a per-token column can be from its value on the exact logits (docs/error-bound.md)
# --------------------------------------------------------------------------------------------------
NOT_BOUNDED = "not bounded"  # a figure no record bounds (a sampler's: its truncation set may change)
Bound = Union[float, str]  # a number, NOT_RECORDED or NOT_BOUNDED
# The per-token columns with a bound of their own, and those exact wherever the stores record their error: the
# scalars (log-probs of the correct token) and the top ids are the exact logits', computed at capture.
BOUND_COLUMNS = {"kld": "kld_bound", "kld_reverse": "kld_reverse_bound"}
EXACT_COLUMNS = ("nll_ref", "nll_cand", "p_ref", "p_cand", "same_top1", "top5_agreement", "top10_agreement",
                 delta_p, abs_delta_p)


def recorded(t: PerToken) -> bool:
    """Whether the comparison's stores record their error: every token has its KLD bound."""
    return "kld_bound" in t and len(t["kld_bound"]) > 0 and bool(np.all(np.isfinite(t["kld_bound"])))


def column_bound(t: PerToken, column: Column) -> np.ndarray | str:
    """Each token's bound on |value − value on the exact logits| of a column: an array, or NOT_RECORDED /
    NOT_BOUNDED."""
    if column not in EXACT_COLUMNS and column not in BOUND_COLUMNS:
        return NOT_BOUNDED
    if not recorded(t):
        return NOT_RECORDED
    return t[BOUND_COLUMNS[column]] if column in BOUND_COLUMNS else np.zeros(len(t["kld_bound"]))


# --------------------------------------------------------------------------------------------------
# how a metric aggregates its per-token column(s): (value, SE or None), with llama-perplexity's formulas
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mean:
    """Mean ± SE of a column."""

    column: Column
    has_se: ClassVar[bool] = True

    def __call__(self, t: PerToken) -> tuple[float, float]:
        return stats.mean_se(values_of(t, self.column))

    def bound(self, t: PerToken) -> Bound:
        """|mean of x − mean of x exact| ≤ mean of the per-token bounds."""
        b = column_bound(t, self.column)
        return b if isinstance(b, str) else float(np.mean(b))


@dataclass(frozen=True)
class Proportion:
    """Share of true values ± its binomial SE."""

    column: Column
    has_se: ClassVar[bool] = True

    def __call__(self, t: PerToken) -> tuple[float, float]:
        return stats.proportion_se(values_of(t, self.column))

    def bound(self, t: PerToken) -> Bound:
        """The share of tokens whose verdict may differ on the exact logits."""
        b = column_bound(t, self.column)
        return b if isinstance(b, str) else float(np.mean(b > 0))


@dataclass(frozen=True)
class Rms:
    """Root mean square ± llama-perplexity's SE."""

    column: Column
    has_se: ClassVar[bool] = True

    def __call__(self, t: PerToken) -> tuple[float, float]:
        return stats.rms_se(values_of(t, self.column))

    def bound(self, t: PerToken) -> Bound:
        """|RMS(x) − RMS(x exact)| ≤ RMS(x − x exact) ≤ RMS of the per-token bounds (Minkowski)."""
        b = column_bound(t, self.column)
        return b if isinstance(b, str) else float(np.sqrt(np.mean(np.square(b))))


@dataclass(frozen=True)
class Percentile:
    """A percentile (linear interpolation, as the ladders); it has no SE."""

    column: Column
    fraction: float
    has_se: ClassVar[bool] = False

    def __call__(self, t: PerToken) -> tuple[float, None]:
        return stats.percentile(values_of(t, self.column), self.fraction), None

    def bound(self, t: PerToken) -> Bound:
        """Each exact value lies in [x − b, x + b] and a percentile is non-decreasing in every value, so the exact
        percentile lies between the percentiles of the interval's ends."""
        b = column_bound(t, self.column)
        if isinstance(b, str):
            return b
        x = values_of(t, self.column)
        mid = stats.percentile(x, self.fraction)
        return float(max(stats.percentile(x + b, self.fraction) - mid, mid - stats.percentile(x - b, self.fraction)))


@dataclass(frozen=True)
class Perplexity:
    """A number of the paired perplexity block (stats.paired_perplexity), plus `shift`, with its SE."""

    field: str  # ppl_cand, ppl_ref, ratio, diff
    shift: float = 0.0
    has_se: ClassVar[bool] = True

    def __call__(self, t: PerToken) -> tuple[float, float]:
        p = stats.paired_perplexity(t["nll_cand"], t["nll_ref"])
        return p[self.field] + self.shift, p[f"{self.field}_se"]

    def bound(self, t: PerToken) -> Bound:
        """From the mean NLL bounds β: exp(mean NLL) moves by at most a factor exp(β), a ratio by exp(β_c + β_r)."""
        bounds = [column_bound(t, c) for c in ("nll_cand", "nll_ref")]
        if any(isinstance(b, str) for b in bounds):
            return next(b for b in bounds if isinstance(b, str))
        beta_c, beta_r = (float(np.mean(b)) for b in bounds)
        p = stats.paired_perplexity(t["nll_cand"], t["nll_ref"])
        return {"ppl_cand": p["ppl_cand"] * math.expm1(beta_c), "ppl_ref": p["ppl_ref"] * math.expm1(beta_r),
                "ratio": p["ratio"] * math.expm1(beta_c + beta_r),
                "diff": p["ppl_cand"] * math.expm1(beta_c) + p["ppl_ref"] * math.expm1(beta_r)}[self.field]


@dataclass(frozen=True)
class BoundOf:
    """The certified bound of another aggregate (Mean("kld").bound: the mean KLD's) as a figure of its own, so that
    `qeval check` can hold it to a limit; NaN where it is not recorded. A bound is no estimate: it has no SE, and
    no bound of its own (None)."""

    of: Mean
    has_se: ClassVar[bool] = False

    def __call__(self, t: PerToken) -> tuple[float, None]:
        b = self.of.bound(t)
        return (math.nan if isinstance(b, str) else b), None

    def bound(self, t: PerToken) -> None:
        return None


Aggregate = Union[Mean, Proportion, Rms, Percentile, Perplexity, BoundOf]


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Metric:
    key: str  # the one name, in every output
    title: str  # how tables and lines name it ("mean KLD")
    unit: str  # nats, nats/token, PPL, ratio, % (a % value is 100 × the aggregated fraction)
    better: str | None  # "lower", "higher", or None: shown, never judged
    aggregate: Aggregate
    description: str  # what it is, for readers of leaderboards and baselines/SCHEMA.md
    fmt: str = ".4f"  # a value in a table (leaderboard, `qeval compare`); its SE prints without the sign
    relative: bool = True  # measured against the reference: a baseline entry holding it must name one
    board: bool = False  # a column of the leaderboard (md, csv, json, html)
    report: tuple[str, str] | None = None  # (block, label) of its line in the text report
    gate: str | None = None  # `qeval check --<gate> LIMIT`: max- for lower-is-better, min- for higher
    paired: bool = False  # `qeval compare` pairs its per-token column chunk by chunk (Mean or Proportion)
    restates: str | None = None  # the key of a metric it restates in other units: a baseline judges it once

    @property
    def has_se(self) -> bool:
        return self.aggregate.has_se

    @property
    def se_key(self) -> str:
        return f"{self.key}_se"

    @property
    def scale(self) -> float:
        return 100.0 if self.unit == "%" else 1.0

    @property
    def heading(self) -> str:
        """Its name with a percent sign where the numbers are percentages ("same top-1 %"), before the sampler
        a sampler metric is of ("mean TVD % @greedy")."""
        if self.unit != "%":
            return self.title
        name, at, of = self.title.partition(" @")
        return f"{name} %{at}{of}"

    def column_values(self, t: PerToken) -> np.ndarray:
        """The per-token values it aggregates (before `scale`): what `qeval compare` pairs."""
        return values_of(t, self.aggregate.column)

    def measure(self, t: PerToken) -> dict:
        """{"value", "se", "bound"} (docs/error-bound.md: the bound is a number or NOT_RECORDED / NOT_BOUNDED)."""
        value, se = self.aggregate(t)
        bound = self.aggregate.bound(t)
        return {"value": self.scale * value, "se": None if se is None else self.scale * se,
                "bound": bound if bound is None or isinstance(bound, str) else self.scale * bound}

    def decimals(self, value: float) -> int:
        """Decimals of a value in running text (gate lines, baseline tables): about three significant digits
        in nats, fixed otherwise."""
        if not self.unit.startswith("nats"):
            return 2 if self.unit == "%" else 4
        v = abs(value)
        return 4 if v >= 0.1 else 6 if v >= 0.001 or v == 0 else 8

    def number(self, value: float) -> str:
        return f"{value:.{self.decimals(value)}f}"

    @property
    def percent(self) -> str:
        """What follows its numbers in running text."""
        return " %" if self.unit == "%" else ""

    def cell(self, value: float | None, se: float | None) -> str:
        """Its value in a table (leaderboard), with its SE where it has one; "?" for a value not held."""
        if value is None:
            return "?"
        if not self.has_se:
            return f"{value:{self.fmt}}"
        return plus_minus(value, se, self.fmt, self.fmt.lstrip("+"))

    def text(self, value: float, se: float | None) -> str:
        """Its value in running text (`qeval check` lines), with its SE where there is one."""
        shown = self.number(value) if se is None else plus_minus(value, se, f".{self.decimals(value)}f",
                                                                  f".{self.decimals(se)}f")
        return shown + self.percent


def plus_minus(value: float | None, se: float | None, fmt: str, se_fmt: str | None = None) -> str:
    """"value ± SE", the one way qeval writes a number with its standard error; se_fmt: the SE's format (default
    fmt); "?" for a number not held."""
    def shown(x: float | None, f: str) -> str:
        return "?" if x is None else f"{x:{f}}"

    return f"{shown(value, fmt)} ± {shown(se, se_fmt or fmt)}"


_METRICS = (
    Metric(key="ppl", title="PPL", unit="PPL", better="lower", aggregate=Perplexity("ppl_cand"),
           description="perplexity of the candidate", relative=False, board=True),
    Metric(key="ppl_ref", title="reference PPL", unit="PPL", better=None, aggregate=Perplexity("ppl_ref"),
           description="perplexity of the reference", relative=False),
    Metric(key="ppl_ratio", title="PPL ratio", unit="ratio", better="lower", aggregate=Perplexity("ratio"),
           description="PPL(candidate) / PPL(reference)", gate="max-ppl-ratio"),
    Metric(key="delta_ppl_pct", title="ΔPPL", unit="%", better="lower", aggregate=Perplexity("ratio", shift=-1.0),
           description="PPL change against the reference on the same tokens, 100·(PPL ratio − 1)", fmt="+.2f",
           board=True, restates="ppl_ratio"),
    Metric(key="kld_mean", title="mean KLD", unit="nats", better="lower", aggregate=Mean("kld"),
           description="mean KL divergence KL(reference ‖ candidate) per scored token, over the full vocabulary",
           fmt=".6f", board=True, gate="max-kld", paired=True),
    Metric(key="kld_mean_bound", title="mean KLD bound", unit="nats", better="lower", aggregate=BoundOf(Mean("kld")),
           description="certified bound on |mean KLD − mean KLD of the exact logits|, from the error the stores measured at "
           "capture (docs/error-bound.md); not recorded (NaN) for a store made before qeval measured it", fmt=".2g",
           gate="max-kld-bound"),
    Metric(key="kld_median", title="median KLD", unit="nats", better="lower", aggregate=Percentile("kld", 0.5),
           description="median per-token KLD", fmt=".6f"),
    Metric(key="kld_99", title="99.0% KLD", unit="nats", better="lower", aggregate=Percentile("kld", 0.99),
           description="99.0 % percentile of per-token KLD"),
    Metric(key="kld_999", title="99.9% KLD", unit="nats", better="lower", aggregate=Percentile("kld", 0.999),
           description="99.9 % percentile of per-token KLD", board=True, gate="max-kld-999"),
    Metric(key="kld_max", title="max KLD", unit="nats", better="lower", aggregate=Percentile("kld", 1.0),
           description="maximum per-token KLD", board=True),
    Metric(key="kld_reverse_mean", title="mean reverse KLD", unit="nats", better="lower", aggregate=Mean("kld_reverse"),
           description="mean KL(candidate ‖ reference) per scored token", fmt=".6f",
           report=(KLD_BLOCK, "Mean reverse KLD(Q||base)")),
    # after the KLD metrics: `qeval compare` states its verdicts in this order, mean KLD's first
    Metric(key="nll_mean", title="mean NLL", unit="nats/token", better="lower", aggregate=Mean("nll_cand"),
           description="mean negative log-likelihood of the correct token under the candidate (ln PPL)", relative=False,
           paired=True, restates="ppl"),
    Metric(key="same_top1_pct", title="same top-1", unit="%", better="higher", aggregate=Proportion("same_top1"),
           description="share of tokens where both models' most likely token is the same (not about the correct token)",
           fmt=".2f", board=True, gate="min-top1", paired=True),
    Metric(key="top5_agreement_pct", title="top-5 agreement", unit="%", better="higher",
           aggregate=Mean("top5_agreement"), description="mean overlap of the two models' 5 most likely tokens",
           fmt=".2f", report=(TOKEN_BLOCK, "Top-5  agreement")),
    Metric(key="top10_agreement_pct", title="top-10 agreement", unit="%", better="higher",
           aggregate=Mean("top10_agreement"), description="mean overlap of the two models' 10 most likely tokens",
           fmt=".2f", report=(TOKEN_BLOCK, "Top-10 agreement")),
    Metric(key="dp_mean_pct", title="mean Δp", unit="%", better=None, aggregate=Mean(delta_p),
           description="mean change in the correct token's probability, p(candidate) − p(reference)", fmt=".3f"),
    Metric(key="rms_dp_pct", title="RMS Δp", unit="%", better="lower", aggregate=Rms(delta_p),
           description="RMS of the change in the correct token's probability", fmt=".3f", board=True),
    Metric(key="abs_dp_p95_pct", title="95% |Δp|", unit="%", better="lower", aggregate=Percentile(abs_delta_p, 0.95),
           description="95th percentile of the absolute change in the correct token's probability", fmt=".3f",
           board=True, report=(TOKEN_BLOCK, "95.0% |Δp|"), gate="max-abs-dp-p95"),
)
METRICS: dict[str, Metric] = {m.key: m for m in _METRICS}


# --------------------------------------------------------------------------------------------------
# sampler metrics: one family per sampler (qeval.compare.sampler), keyed "<metric>@<sampler name>"
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _OneMinus:
    """1 − a per-token column (agreement = 1 − TVD)."""

    column: str

    def __call__(self, t: PerToken) -> np.ndarray:
        return 1.0 - np.asarray(t[self.column], dtype=np.float64)


def sampler_metrics(name: str) -> tuple[Metric, ...]:
    """The metrics of one sampler, present in a comparison computed with it (`qeval kld --sampler NAME`):
    tvd_pct@NAME, agreement_pct@NAME, support_differs_pct@NAME."""
    tvd, differs = sampler.column("tvd", name), sampler.column("support_differs", name)
    return (
        Metric(key=f"tvd_pct@{name}", title=f"mean TVD @{name}", unit="%", better="lower", aggregate=Mean(tvd),
               description=f"mean total variation distance between the two distributions after the sampler {name} "
               "(llama.cpp's chain: top-k, top-p, min-p, temperature): the probability mass that moves", fmt=".3f",
               board=True, paired=True),
        Metric(key=f"agreement_pct@{name}", title=f"agreement @{name}", unit="%", better="higher",
               aggregate=Mean(_OneMinus(tvd)),
               description=f"mean 1 − TVD after the sampler {name}: the chance a maximal coupling draws the same token from both "
               "(speculative-decoding acceptance with the candidate as draft)", fmt=".3f", restates=f"tvd_pct@{name}"),
        Metric(key=f"support_differs_pct@{name}", title=f"support differs @{name}", unit="%", better="lower",
               aggregate=Proportion(differs),
               description=f"share of tokens whose candidate sets after the sampler {name}'s truncation differ",
               fmt=".2f"),
    )


# `qeval check` thresholds that apply to every sampler of a comparison: the template's key holds "*" where a
# sampler's name goes, its gate is the option (--max-tvd 5: mean TVD at most 5 % under each --sampler).
SAMPLER_GATES = (
    Metric(key="tvd_pct@*", title="mean TVD (each sampler)", unit="%", better="lower", aggregate=Mean("tvd@*"),
           description="mean TVD after each sampler of the comparison (qeval kld/check --sampler)", fmt=".3f",
           gate="max-tvd"),
)


def is_sampler_template(key: str) -> bool:
    return key.endswith("@*")


def for_sampler(template: Metric, name: str) -> Metric:
    """A SAMPLER_GATES template made concrete for one sampler; its gate (the check's name) says which."""
    m = lookup(template.key.replace("*", name))
    if m is None:
        raise QevalError(f"{name!r} is not a sampler name (a preset or a canonical settings string)")
    return replace(m, gate=f"{template.gate}@{name}")


def lookup(key: str) -> Metric | None:
    """The metric under `key`: one of METRICS, or a sampler metric ("tvd_pct@qwen3.5-thinking"); None if
    neither."""
    if key in METRICS:
        return METRICS[key]
    _, sep, name = key.partition("@")
    if not sep:
        return None
    try:
        family = sampler_metrics(sampler.parse(name).name)
    except QevalError:
        return None
    return next((m for m in family if m.key == key), None)


def compute(t: PerToken) -> dict[str, dict]:
    """The "metrics" block of a comparison's JSON: {key: {"value", "se"}} for every metric (se None where a
    metric has none), then the metrics of every sampler whose per-token columns `t` holds."""
    out = {m.key: m.measure(t) for m in METRICS.values()}
    for name in sampler.names_in(t):
        out.update({m.key: m.measure(t) for m in sampler_metrics(name)})
    return out


@dataclass
class MetricValue:
    """A metric's value as measured (from a comparison) or published (in a baseline file)."""

    value: float
    se: float | None = None
    approx: bool = False  # a published "~" value
    note: str | None = None
    bound: Bound | None = None  # its certified bound (Metric.measure); None: a result saved before bounds existed

    @property
    def bound_value(self) -> float | None:
        """The bound as a number; None where there is none (not recorded, not bounded)."""
        return self.bound if isinstance(self.bound, (int, float)) else None

    def bound_text(self, fmt: str = ".2g") -> str:
        """The bound in a table cell: "≤ 1.1e-04" (its value: |figure − figure on the exact logits|), "exact" for 0,
        else why there is none."""
        if self.bound is None:
            return NOT_RECORDED
        if isinstance(self.bound, str):
            return self.bound
        return "exact" if self.bound == 0 else f"≤ {self.bound:{fmt}}"


def known(held: dict[str, MetricValue]) -> dict[str, MetricValue]:
    """The metrics of `held` this qeval knows (a result saved by another qeval may hold others)."""
    return {key: v for key, v in held.items() if lookup(key) is not None}


def board() -> list[Metric]:
    """The metrics on every leaderboard, in table order; each is a column `key` and, where it has an SE, `key_se`."""
    return [m for m in METRICS.values() if m.board]


def paired() -> list[Metric]:
    """The metrics `qeval compare` pairs chunk by chunk, in table order (a sampler's TVD pairs too: lookup())."""
    return [m for m in METRICS.values() if m.paired]


def gated() -> list[Metric]:
    """The metrics `qeval check` can hold to a limit, in table order, then the sampler templates (SAMPLER_GATES)."""
    return [m for m in METRICS.values() if m.gate] + list(SAMPLER_GATES)
