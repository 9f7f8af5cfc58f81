"""Summary statistics with llama-perplexity's formulas, so numbers are comparable with its tables.

SE of a mean: sqrt((mean(x^2) - mean(x)^2) / (n - 1)); percentiles: linear interpolation at
fraction * (n - 1) of the sorted values (numpy's default).
"""

from __future__ import annotations

import math

import numpy as np

KLD_LADDER = (("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90),
              ("Median", 0.5), ("10.0%", 0.10), ("5.0%", 0.05), ("1.0%", 0.01), ("0.1%", 0.001),
              ("Minimum", 0.0))
DP_LADDER = (("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90),
             ("75.0%", 0.75), ("Median", 0.5), ("25.0%", 0.25), ("10.0%", 0.10), ("5.0%", 0.05),
             ("1.0%", 0.01), ("0.1%", 0.001), ("Minimum", 0.0))


def mean_se(x: np.ndarray) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    mean = float(np.mean(x))
    if n < 2:
        return mean, float("nan")
    var = float(np.mean(x * x)) - mean * mean
    return mean, math.sqrt(max(var, 0.0) / (n - 1))


def percentile(x: np.ndarray, fraction: float) -> float:
    return float(np.percentile(np.asarray(x, dtype=np.float64), 100.0 * fraction))


def ladder(x: np.ndarray, rungs) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    return {name: percentile(x, f) for name, f in rungs}


def proportion_se(hits: np.ndarray) -> tuple[float, float]:
    n = len(hits)
    p = float(np.mean(hits))
    return p, math.sqrt(p * (1.0 - p) / (n - 1)) if n > 1 else float("nan")


def perplexity(nll: np.ndarray) -> dict:
    """PPL = exp(mean nll) +/- PPL * SE(nll), like llama-perplexity's final estimate."""
    m, se = mean_se(nll)
    ppl = math.exp(m)
    return {"ppl": ppl, "ppl_se": ppl * se, "mean_nll": m, "mean_nll_se": se}


def paired_perplexity(nll_cand: np.ndarray, nll_ref: np.ndarray) -> dict:
    """The 'Perplexity statistics' block: PPL(Q), PPL(base), their ratio, difference and correlation."""
    q, b = np.asarray(nll_cand, np.float64), np.asarray(nll_ref, np.float64)
    n = len(q)
    mq, seq = mean_se(q)
    mb, seb = mean_se(b)
    # covariance of the two means, as llama-perplexity computes it
    cov = (float(np.mean(q * b)) - mq * mb) / (n - 1) if n > 1 else float("nan")
    ppl_q, ppl_b = math.exp(mq), math.exp(mb)
    ln_ratio_se = math.sqrt(max(seq * seq + seb * seb - 2.0 * cov, 0.0))
    ratio = math.exp(mq - mb)
    uq, ub = ppl_q * seq, ppl_b * seb
    diff_se = math.sqrt(max(uq * uq + ub * ub - 2.0 * ppl_q * ppl_b * cov, 0.0))
    cor = cov / (seq * seb) if seq > 0 and seb > 0 else float("nan")
    return {
        "ppl_cand": ppl_q, "ppl_cand_se": uq,
        "ppl_ref": ppl_b, "ppl_ref_se": ub,
        "cor_ln_ppl": cor,
        "ln_ratio": mq - mb, "ln_ratio_se": ln_ratio_se,
        "ratio": ratio, "ratio_se": ratio * ln_ratio_se,
        "diff": ppl_q - ppl_b, "diff_se": diff_se,
    }


def rms_se(x: np.ndarray) -> tuple[float, float]:
    """RMS of x with llama-perplexity's uncertainty 0.5/RMS * SE(x^2)."""
    m2, se2 = mean_se(np.asarray(x, np.float64) ** 2)
    rms = math.sqrt(m2)
    return rms, (0.5 / rms * se2) if rms > 0 else float("nan")


WILSON_Z = 1.959963984540054  # the normal quantile of a two-sided 95 % interval


def wilson_interval(hits: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """Wilson's score interval of a proportion hits/n (95 % by default); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
