"""Summary statistics against the llama-perplexity formulas, transcribed in float64 from
/work/shared/reference/llama-perplexity.md ("--kl-divergence math" and "Chunking")."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import percentile64

from qeval.compare import stats


def se_doc(x):
    """SE = sqrt((mean(x^2) - mean(x)^2) / (n - 1))."""
    x = np.asarray(x, np.float64)
    return math.sqrt((np.mean(x ** 2) - np.mean(x) ** 2) / (len(x) - 1))


@pytest.fixture
def nll_pair():
    rng = np.random.default_rng(7)
    n = 1531
    base = rng.gamma(2.0, 1.3, n)
    cand = base + rng.normal(0.05, 0.4, n) + 0.1 * rng.gamma(1.0, 1.0, n)
    return np.abs(cand), base


@pytest.mark.parametrize("n", [2, 3, 10, 1000])
def test_mean_se(n):
    rng = np.random.default_rng(n)
    x = rng.exponential(0.3, n)
    m, se = stats.mean_se(x)
    assert m == pytest.approx(float(np.sum(x) / n), rel=1e-12)
    assert se == pytest.approx(se_doc(x), rel=1e-9)
    # the same thing written another way: population std / sqrt(n - 1)
    assert se == pytest.approx(np.std(x) / math.sqrt(n - 1), rel=1e-9)


def test_mean_se_of_a_single_value_has_no_se():
    m, se = stats.mean_se(np.array([0.25]))
    assert m == 0.25 and math.isnan(se)


def test_mean_se_of_constant_values_is_zero_not_nan():
    m, se = stats.mean_se(np.full(100, 0.1))
    assert m == pytest.approx(0.1)
    assert se == pytest.approx(0.0, abs=1e-8)  # mean(x^2) - mean^2 may round to a tiny value, never NaN


def test_ladders_have_the_documented_rungs():
    assert [n for n, _ in stats.KLD_LADDER] == ["Maximum", "99.9%", "99.0%", "95.0%", "90.0%", "Median",
                                                "10.0%", "5.0%", "1.0%", "0.1%", "Minimum"]
    assert [n for n, _ in stats.DP_LADDER] == ["Maximum", "99.9%", "99.0%", "95.0%", "90.0%", "75.0%", "Median",
                                               "25.0%", "10.0%", "5.0%", "1.0%", "0.1%", "Minimum"]
    for name, f in stats.KLD_LADDER + stats.DP_LADDER:
        expected = {"Maximum": 1.0, "Minimum": 0.0, "Median": 0.5}.get(name)
        if expected is None:
            expected = float(name.rstrip("%")) / 100
        assert f == pytest.approx(expected)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1531])
def test_ladder_is_linear_interpolation(n):
    rng = np.random.default_rng(n)
    x = rng.standard_cauchy(n)
    for rungs in (stats.KLD_LADDER, stats.DP_LADDER):
        got = stats.ladder(x, rungs)
        assert list(got) == [name for name, _ in rungs]
        for name, f in rungs:
            assert got[name] == pytest.approx(percentile64(x, f), rel=1e-12, abs=1e-15)
        assert got["Maximum"] == x.max() and got["Minimum"] == x.min()


def test_perplexity(nll_pair):
    nll = nll_pair[1]
    r = stats.perplexity(nll)
    ppl = math.exp(np.mean(nll))
    assert r["ppl"] == pytest.approx(ppl, rel=1e-12)
    assert r["ppl_se"] == pytest.approx(ppl * se_doc(nll), rel=1e-9)
    assert r["mean_nll"] == pytest.approx(np.mean(nll), rel=1e-12)
    assert r["mean_nll_se"] == pytest.approx(se_doc(nll), rel=1e-9)


def test_paired_perplexity(nll_pair):
    q, b = nll_pair
    n = len(q)
    r = stats.paired_perplexity(q, b)
    mq, mb = np.mean(q), np.mean(b)
    se_q, se_b = se_doc(q), se_doc(b)
    cov = (np.mean(q * b) - mq * mb) / (n - 1)  # covariance of the two means
    ppl_q, ppl_b = math.exp(mq), math.exp(mb)
    ln_ratio_se = math.sqrt(se_q ** 2 + se_b ** 2 - 2 * cov)
    u_q, u_b = ppl_q * se_q, ppl_b * se_b
    assert r["ppl_cand"] == pytest.approx(ppl_q, rel=1e-12)
    assert r["ppl_ref"] == pytest.approx(ppl_b, rel=1e-12)
    assert r["ppl_cand_se"] == pytest.approx(u_q, rel=1e-9)
    assert r["ppl_ref_se"] == pytest.approx(u_b, rel=1e-9)
    assert r["ln_ratio"] == pytest.approx(mq - mb, rel=1e-10)
    assert r["ln_ratio_se"] == pytest.approx(ln_ratio_se, rel=1e-8)
    assert r["ratio"] == pytest.approx(ppl_q / ppl_b, rel=1e-12)
    assert r["ratio_se"] == pytest.approx(ppl_q / ppl_b * ln_ratio_se, rel=1e-8)
    assert r["diff"] == pytest.approx(ppl_q - ppl_b, rel=1e-10)
    assert r["diff_se"] == pytest.approx(math.sqrt(u_q ** 2 + u_b ** 2 - 2 * ppl_q * ppl_b * cov), rel=1e-8)
    # Cor(ln PPL(Q), ln PPL(base)) = cov / (SE_Q SE_b): the Pearson correlation of the per-token NLLs
    assert r["cor_ln_ppl"] == pytest.approx(cov / (se_q * se_b), rel=1e-9)
    assert r["cor_ln_ppl"] == pytest.approx(np.corrcoef(q, b)[0, 1], rel=1e-9)
    assert 0.0 < r["cor_ln_ppl"] < 1.0


def test_paired_perplexity_of_identical_runs():
    rng = np.random.default_rng(8)
    b = rng.gamma(2.0, 1.0, 500)
    r = stats.paired_perplexity(b, b.copy())
    assert r["ratio"] == 1.0 and r["diff"] == 0.0 and r["ln_ratio"] == 0.0
    assert r["ln_ratio_se"] == pytest.approx(0.0, abs=1e-7)
    assert r["cor_ln_ppl"] == pytest.approx(1.0, rel=1e-9)


def test_rms_se():
    rng = np.random.default_rng(9)
    dp = rng.normal(-0.02, 0.1, 2000)
    rms, se = stats.rms_se(dp)
    expected_rms = math.sqrt(np.mean(dp ** 2))
    assert rms == pytest.approx(expected_rms, rel=1e-12)
    assert se == pytest.approx(0.5 / expected_rms * se_doc(dp ** 2), rel=1e-9)


def test_rms_se_of_zeros():
    rms, se = stats.rms_se(np.zeros(10))
    assert rms == 0.0 and math.isnan(se)


def test_proportion_se():
    rng = np.random.default_rng(10)
    hits = rng.random(777) < 0.83
    p, se = stats.proportion_se(hits)
    expected = hits.sum() / len(hits)
    assert p == pytest.approx(expected, rel=1e-12)
    assert se == pytest.approx(math.sqrt(expected * (1 - expected) / (len(hits) - 1)), rel=1e-12)
