"""The statistics of paired comparisons (qeval.orchestrate.paired explains the choice): per-chunk means, a
one-sample t-interval over them, and a block bootstrap over chunks."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps


CONFIDENCE = 0.95
N_BOOT = 10_000
BOOT_SEED = 0


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
    return float(sps.t.ppf(0.5 + confidence / 2.0, df))


def interval_t(d: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float, float, float]:
    """(mean, se, low, high, p) of a one-sample t-interval / two-sided t-test of mean(d) = 0."""
    n = len(d)
    mean = float(np.mean(d))
    sd = float(np.std(d, ddof=1))
    se = sd / math.sqrt(n)
    if se == 0.0:  # every chunk differs by exactly the same amount (often: not at all)
        return mean, 0.0, mean, mean, (1.0 if mean == 0.0 else 0.0)
    q = t_quantile(confidence, n - 1)
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
