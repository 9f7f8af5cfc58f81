"""When a measured difference may be labelled: the one rule behind every verdict qeval prints (docs/metrics.md,
"Verdicts") — a KV row "(above)"/"(within)" its floor, a row "(noise)" against the control, a `qeval check` pass.

A label makes a claim about an excess (a row over the floor or the control, a figure past a gate's limit): that it
is there ("above"), or that it is no larger than a margin ("within": the floor's or the control's own mean KLD; 0
for a gate, whose margin is its limit). The claim is made only where the interval of the excess rules out the
opposite:

- ABOVE: the interval lies clear of 0, upward — the excess is there (also when it is smaller than the margin);
- WITHIN: the interval's upper end is at most the margin — whatever excess there is, it is no larger than that;
- UNDECIDED otherwise: the interval is too wide to tell. An interval that merely reaches 0 is no evidence that
  the excess is absent, so it is never read as "within".

The interval is excess ± (q·SE + certified bounds), q the two-sided t multiplier at CONFIDENCE with chunks − 1
degrees of freedom (chunks are the sampling unit: with 2 chunks q is 12.7); fewer than 2 chunks decide nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qeval.compare.metric_registry import MetricValue
from qeval.compare.paired_stats import CONFIDENCE, t_quantile

ABOVE, WITHIN, UNDECIDED = "above", "within", "undecided"


@dataclass(frozen=True)
class Verdict:
    state: str  # ABOVE, WITHIN or UNDECIDED
    chunks: int  # the chunks its interval stands on
    low: float  # the interval of the excess (-inf, inf with fewer than 2 chunks)
    high: float

    def words(self, above: str = ABOVE, within: str = WITHIN) -> str:
        """The verdict in a label's own words; "undecided (N chunks)" when the interval is too wide to tell."""
        chunks = f"{self.chunks} chunk" + ("" if self.chunks == 1 else "s")
        return {ABOVE: above, WITHIN: within}.get(self.state, f"{UNDECIDED} ({chunks})")


def multiplier(chunks: int) -> float:
    """The half-width of the interval in SEs: the t quantile at CONFIDENCE with chunks − 1 degrees of freedom."""
    return t_quantile(CONFIDENCE, chunks - 1) if chunks >= 2 else math.inf


def judge(excess: float, se: float, chunks: int, margin: float = 0.0, bounds: float = 0.0) -> Verdict:
    """The verdict on `excess` ± (multiplier(chunks)·se + bounds) against `margin` (the module's rule); `bounds`:
    the certified error of the values compared (docs/error-bound.md), added to either side."""
    half = multiplier(chunks) * se + bounds if chunks >= 2 else math.inf  # not multiplier's inf: inf·0 is nan
    low, high = excess - half, excess + half
    state = ABOVE if low > 0.0 else WITHIN if high <= margin else UNDECIDED
    return Verdict(state, int(chunks), low, high)


def written(verdict: Verdict | None, key: str) -> dict:
    """A verdict's written columns (board JSON and CSV, check JSON): {key: its state, key_chunks: its chunks}, both
    None where there is no verdict."""
    if verdict is None:
        return {key: None, f"{key}_chunks": None}
    return {key: verdict.state, f"{key}_chunks": verdict.chunks}


def fewer_chunks(*chunks: int | None) -> int | None:
    """What a verdict on two measurements stands on: the fewer of their chunks (an early one holds fewer); None when
    one is not known."""
    return None if any(c is None for c in chunks) else int(min(chunks))


def excess_over(kld: MetricValue | None, control: MetricValue | None,
                chunks: int | None) -> tuple[float | None, Verdict | None]:
    """(kld − kld_control, its verdict against the control): "within" numerical noise when the interval of the
    excess lies below the control's own mean KLD (what the row adds is no larger than the noise itself), its SE
    that of two independent means, sqrt(SE² + SE_control²), widened by both values' certified bounds where recorded
    (docs/error-bound.md); `chunks`: what the fewer-chunked of the two stands on. None where a value is missing,
    no verdict where an SE or the chunks are."""
    if kld is None or control is None:
        return None, None
    excess = kld.value - control.value
    ses = (kld.se, control.se)
    if chunks is None or not all(se is not None and math.isfinite(se) for se in ses):
        return excess, None
    bounds = sum(v.bound_value or 0.0 for v in (kld, control))
    return excess, judge(excess, math.hypot(*ses), chunks, margin=control.value, bounds=bounds)
