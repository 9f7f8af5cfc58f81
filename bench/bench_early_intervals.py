"""Which interval holds at the early rule's minimum (issue 35): candidate intervals for the mean of a corpus of N
chunks from n of them sampled without replacement, on lognormal per-chunk sums (skewed, as per-chunk KLD is).

    python bench/bench_early_intervals.py            # the table of docs/release.md, "Intervals that hold"

For each chunk log-sd, corpus length N and candidate: the coverage of the corpus's mean over `--draws` random
samples of each of `--corpora` seeded corpora, averaged over the corpora. Candidates: Student's t (the rule before
issue 35), the same on the log scale, Johnson's skewness-corrected t, a larger minimum, a wider level: the
formulas of qeval.compare.early.ratio_estimate (with and without log_scale), vectorized over the draws (tokens
equal per chunk: the ratio estimator is the mean of the chunk means); tests/test_early.py checks the product's.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from qeval.compare.paired_stats import t_quantile

# (name, n, confidence, how): how = "t", "log" or "johnson"
CANDIDATES = (("t at 95 % (before)", 8, 0.95, "t"), ("log scale at 95 %", 8, 0.95, "log"),
              ("skewness-corrected t (Johnson) at 95 %", 8, 0.95, "johnson"),
              ("t at 95 %, minimum 12 chunks", 12, 0.95, "t"), ("t at 97.5 %", 8, 0.975, "t"),
              ("log scale at 97.5 % (the rule at its minimum)", 8, 0.975, "log"))


def coverage(corpus: np.ndarray, n: int, confidence: float, how: str, draws: int, rng) -> float:
    big_n = len(corpus)
    x = corpus[np.argsort(rng.random((draws, big_n)), axis=1)[:, :n]]
    mean, sd = x.mean(axis=1), x.std(axis=1, ddof=1)
    fpc = math.sqrt(1 - n / big_n)
    se = sd / math.sqrt(n) * fpc
    q = t_quantile(confidence, n - 1)
    if how == "log":
        low, high = mean * np.exp(-q * se / mean), mean * np.exp(q * se / mean)
    else:
        centre = mean
        if how == "johnson":  # Johnson (1978): the centre moved by the sample's third moment
            mu3 = n / ((n - 1) * (n - 2)) * ((x - mean[:, None]) ** 3).sum(axis=1)
            centre = mean + mu3 / (6 * sd ** 2 * n) * fpc
        low, high = centre - q * se, centre + q * se
    target = corpus.mean()
    return float(np.mean((low <= target) & (target <= high)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 0.3], help="log-sd of the chunk sums")
    ap.add_argument("--lengths", type=int, nargs="+", default=[20, 40, 80])
    ap.add_argument("--corpora", type=int, default=8)
    ap.add_argument("--draws", type=int, default=20_000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(1)
    sigmas = " / ".join(map(str, args.sigmas))
    print(f"| interval | {' | '.join(f'{n} chunks' for n in args.lengths)} |  (log-sd {sigmas})")
    print("|---|" + "---|" * len(args.lengths))
    for name, n, confidence, how in CANDIDATES:
        cells = []
        for big_n in args.lengths:
            shares = [np.mean([coverage(np.exp(s * np.random.default_rng(k).normal(size=big_n)), n, confidence, how,
                                        args.draws, rng) for k in range(args.corpora)]) for s in args.sigmas]
            cells.append(" / ".join(f"{100 * x:.1f}" for x in shares) + " %")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
