"""The statistics of paired comparisons: is candidate A really better than candidate B? Paired differences on the
same reference tokens, the same rule for a recipe's KLD cost and a KV row's KLD over a board's floor.

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

import functools
import math
from dataclasses import dataclass

import numpy as np
# scipy.special's Student t functions, the ones scipy.stats.t calls (bit-equal: tests/test_paired.py); scipy.stats
# itself costs every process that imports this module ~1 s
from scipy.special import stdtr, stdtrit

from qeval.compare import metric_registry
from qeval.compare.metric_registry import Metric
from qeval.errors import MismatchError, QevalError


CONFIDENCE = 0.95
N_BOOT = 10_000
BOOT_SEED = 0
METHODS = ("t", "bootstrap")


@dataclass(kw_only=True)
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
    verdict: str = ""  # in words (qeval.present.paired_text.verdict); empty until it is judged


def chunk_means(values: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """Mean of `values` within each chunk, in chunk-id order."""
    ids, inverse, counts = np.unique(np.asarray(chunk), return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=np.asarray(values, dtype=np.float64), minlength=len(ids))
    return sums / counts


def on_common_chunks(per_token: dict, other: dict, columns=("chunk", "position", "kld")) -> dict:
    """`columns` of the per-token columns `per_token` at the chunks `other` holds too, ordered by chunk and position:
    two results over one reference then pair token for token even when one was decided early (it keeps a prefix of
    a chunk order, in visit order) and the other ran every chunk."""
    at = np.flatnonzero(np.isin(per_token["chunk"], other["chunk"]))
    at = at[np.lexsort((per_token["position"][at], per_token["chunk"][at]))]
    return {name: np.asarray(per_token[name])[at] for name in columns}


@functools.lru_cache(maxsize=4096)
def t_quantile(confidence: float, df: int) -> float:
    """The multiplier of a two-sided t-interval at `confidence` with df degrees of freedom (cached: a board decided
    early asks for the same few, round after round)."""
    return float(stdtrit(df, 0.5 + confidence / 2.0))


def interval_t(d: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float, float, float]:
    """(mean, se, low, high, p) of a one-sample t-interval / two-sided t-test of mean(d) = 0."""
    n = len(d)
    mean = float(np.mean(d))
    sd = float(np.std(d, ddof=1))
    se = sd / math.sqrt(n)
    if se == 0.0:  # every chunk differs by exactly the same amount (often: not at all)
        return mean, 0.0, mean, mean, (1.0 if mean == 0.0 else 0.0)
    q = t_quantile(confidence, n - 1)
    p = float(2.0 * stdtr(n - 1, -abs(mean) / se))  # twice the upper tail
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
                      method: str = "t", confidence: float = CONFIDENCE, n_boot: int = N_BOOT,
                      seed: int = BOOT_SEED) -> PairedDifference:
    """Difference of the means of `a` and `b` (per-token values of `metric` on the same tokens, before its
    percent scale), chunk-blocked; its verdict left to the caller's words."""
    if method not in METHODS:
        raise QevalError(f"--method must be one of {', '.join(METHODS)}, not {method!r}")
    if not 0.0 < confidence < 1.0:
        raise QevalError(f"confidence must be between 0 and 1, not {confidence}")
    m = metric_registry.lookup(metric)  # a sampler's TVD (tvd_pct@NAME) pairs too
    if m is None or not m.paired:
        paired = ", ".join(m.key for m in metric_registry.paired())
        raise QevalError(f"{metric!r} is not a metric paired comparisons apply to ({paired}, tvd_pct@SAMPLER)")
    scale = m.scale
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.shape != np.shape(chunk):
        raise MismatchError("A and B must have one value per token on the same tokens")
    d = chunk_means(a - b, chunk) * scale
    if len(d) < 2:
        raise QevalError(f"a paired comparison needs at least 2 chunks (the chunk is the unit of the error bar); "
                         f"got {len(d)}")
    diff, se, low, high, p = interval_t(d, confidence) if method == "t" else interval_bootstrap(d, confidence,
                                                                                              n_boot, seed)
    token_sd = float(np.std((a - b) * scale, ddof=1)) if len(a) > 1 else float("nan")
    return PairedDifference(metric=metric, unit=difference_unit(m), better=m.better, mean_a=float(np.mean(a)) * scale,
                            mean_b=float(np.mean(b)) * scale, diff=diff, se=se, ci_low=low, ci_high=high, p_value=p,
                            n_chunks=len(d), n_tokens=len(a), method=method, confidence=confidence,
                            token_se=token_sd / math.sqrt(len(a)),
                            significant=(low > 0.0 or high < 0.0) if se > 0 else diff != 0.0)


def kld_excess(values: dict, base: dict) -> tuple[float, float, int] | None:
    """(mean, SE, chunks) of the per-token KLD of `values` minus `base`'s on the same tokens (per-token columns
    {"kld", "chunk", "position"}; the chunks both hold: an early row holds fewer), chunks as the unit (interval_t
    over chunk means); None when they are not on the same tokens or share fewer than 2 chunks."""
    mine, theirs = on_common_chunks(values, base), on_common_chunks(base, values)
    if not all(np.array_equal(mine[k], theirs[k]) for k in ("chunk", "position")):
        return None
    d = chunk_means(mine["kld"].astype(np.float64) - theirs["kld"].astype(np.float64), theirs["chunk"])
    if len(d) < 2:
        return None
    mean, se, _, _, _ = interval_t(d)
    return mean, se, len(d)
