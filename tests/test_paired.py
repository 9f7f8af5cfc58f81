"""qeval.paired: chunk-blocked paired differences, checked against scipy on chunk means computed here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli
from scipy import stats as sps
from synth_runs import N_CHUNKS, SHORT_CHUNKS, make_runs

from qeval import api
from qeval.errors import QevalError
from qeval.orchestrate import paired
from qeval.storage.runs import RESULTS_SUBDIR


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return make_runs(tmp_path_factory.mktemp("paired") / "runs")


def chunk_means_loop(values, chunk):
    """Independent of qeval: a plain loop over chunk ids."""
    return np.array([np.mean(values[chunk == c]) for c in sorted(set(chunk.tolist()))])


def synthetic(seed=0, n_chunks=40, per_chunk=25, true_diff=0.05, chunk_sd=0.05, token_sd=0.2):
    """Per-token A and B with a known mean difference and strong within-chunk correlation."""
    rng = np.random.default_rng(seed)
    chunk = np.repeat(np.arange(n_chunks), per_chunk)
    b = rng.gamma(2.0, 0.05, size=len(chunk))
    chunk_effect = rng.normal(true_diff, chunk_sd, size=n_chunks)[chunk]
    a = b + chunk_effect + rng.normal(0.0, token_sd, size=len(chunk))
    return a, b, chunk


def test_t_interval_equals_scipy_on_chunk_means():
    a, b, chunk = synthetic()
    r = paired.paired_difference(a, b, chunk, "kld_mean")
    d = chunk_means_loop(a - b, chunk)
    test = sps.ttest_1samp(d, 0.0)
    low, high = sps.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=sps.sem(d))
    assert r.n_chunks == 40 and r.n_tokens == 1000 and r.method == "t"
    assert r.diff == pytest.approx(d.mean(), rel=1e-12)
    assert r.diff == pytest.approx(np.mean(a - b), rel=1e-12)  # equal chunks: mean of means = token mean
    assert r.se == pytest.approx(sps.sem(d), rel=1e-12)
    assert (r.ci_low, r.ci_high) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
    assert r.p_value == pytest.approx(test.pvalue, rel=1e-9)
    assert r.ci_low < 0.05 < r.ci_high  # the known difference is inside
    assert r.significant and r.verdict.startswith("A has higher KLD than B: difference +0.0")
    # correlated tokens: the naive per-token SE is far too small; the chunk SE is not
    assert r.token_se < 0.8 * r.se


def test_confidence_level_and_top1_scale():
    a, b, chunk = synthetic(seed=3, true_diff=0.0)
    r = paired.paired_difference(a, b, chunk, "kld_mean", confidence=0.9)
    d = chunk_means_loop(a - b, chunk)
    low, high = sps.t.interval(0.9, len(d) - 1, loc=d.mean(), scale=sps.sem(d))
    assert (r.ci_low, r.ci_high) == (pytest.approx(low), pytest.approx(high))
    hits_a = np.random.default_rng(1).random(len(chunk)) < 0.9
    hits_b = np.random.default_rng(2).random(len(chunk)) < 0.8
    t = paired.paired_difference(hits_a, hits_b, chunk, "same_top1_pct")
    assert t.diff == pytest.approx(100 * chunk_means_loop(hits_a.astype(float) - hits_b, chunk).mean())
    assert t.unit == "percentage points" and t.mean_a == pytest.approx(100 * hits_a.mean())
    assert t.verdict.startswith("A keeps the reference's top-1 token more often than B")


def test_bootstrap_is_seeded_and_close_to_t():
    a, b, chunk = synthetic(seed=5)
    r1 = paired.paired_difference(a, b, chunk, "kld_mean", method="bootstrap")
    r2 = paired.paired_difference(a, b, chunk, "kld_mean", method="bootstrap")
    t = paired.paired_difference(a, b, chunk, "kld_mean")
    assert (r1.ci_low, r1.ci_high, r1.p_value) == (r2.ci_low, r2.ci_high, r2.p_value)
    assert r1.diff == t.diff
    assert abs(r1.ci_low - t.ci_low) < 0.2 * (t.ci_high - t.ci_low)
    assert abs(r1.ci_high - t.ci_high) < 0.2 * (t.ci_high - t.ci_low)
    assert r1.p_value == pytest.approx(1 / (paired.N_BOOT + 1) * 2)  # no resample reaches 0


def test_no_difference_and_identical():
    a, b, chunk = synthetic(seed=11, true_diff=0.0, chunk_sd=0.0)
    r = paired.paired_difference(a, b, chunk, "nll_mean")
    assert not r.significant and r.p_value > 0.05
    assert r.verdict.startswith("no significant difference in NLL between A and B: difference")
    same = paired.paired_difference(b, b, chunk, "kld_mean")
    assert (same.diff, same.ci_low, same.ci_high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert same.verdict.startswith("no significant difference in KLD")


def test_refuses_single_chunk_and_bad_method():
    with pytest.raises(QevalError, match="at least 2 chunks"):
        paired.paired_difference(np.ones(5), np.zeros(5), np.zeros(5, int))
    with pytest.raises(QevalError, match="--method"):
        paired.paired_difference(np.ones(4), np.zeros(4), np.arange(4), method="jackknife")


def test_stores_a_clearly_better_matches_independent_computation(runs):
    result, text = paired.paired_report("REF", "A", "B", runs_dir=runs, threads=1)
    ca = api.compare("REF", "A", runs_dir=runs, threads=1)
    cb = api.compare("REF", "B", runs_dir=runs, threads=1)
    chunk = ca.per_token["chunk"]
    for metric, field, scale in (("kld_mean", "kld", 1.0), ("nll_mean", "nll_cand", 1.0),
                                 ("same_top1_pct", "same_top1", 100.0)):
        d = scale * chunk_means_loop(ca.per_token[field].astype(float) - cb.per_token[field], chunk)
        got = result["differences"][metric]
        assert got["diff"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-12)
        if np.std(d) > 0:
            assert got["p_value"] == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue, rel=1e-6)
    kld = result["differences"]["kld_mean"]
    assert result["chunks"] == N_CHUNKS and kld["n_chunks"] == N_CHUNKS and kld["ci_high"] < 0
    assert result["verdicts"][0].startswith("A has lower KLD than B: difference −")
    assert f"over {N_CHUNKS} chunks" in result["verdicts"][0]
    assert "A has lower KLD than B" in text and "95 % CI" in text


def test_stores_identical_candidates(runs):
    result, _ = paired.paired_report("REF", "A", "A_COPY", runs_dir=runs, threads=1)
    assert all(v.startswith("no significant difference") for v in result["verdicts"])
    assert result["differences"]["kld_mean"]["diff"] == 0.0


def test_refuses_candidates_on_other_tokens(runs):
    with pytest.raises(QevalError, match=r"candidate B \(OTHER_TOKENS\).*token ids differ"):
        paired.paired_report("REF", "A", "OTHER_TOKENS", runs_dir=runs, threads=1)


def test_shorter_candidate_is_paired_on_common_chunks(runs):
    result, text = paired.paired_report("REF", "A", "SHORT", runs_dir=runs, threads=1)
    assert result["chunks"] == SHORT_CHUNKS
    assert result["notes"] and f"{SHORT_CHUNKS} chunks both hold" in result["notes"][0]
    first, _ = paired.paired_report("REF", "A", "SHORT", chunks=SHORT_CHUNKS, runs_dir=runs, threads=1)
    assert first["differences"]["kld_mean"]["diff"] == pytest.approx(result["differences"]["kld_mean"]["diff"])


def test_saved_results_give_the_same_answer(runs, tmp_path):
    for cand in ("A", "B"):
        api.kld_report("REF", cand, runs_dir=runs, threads=1, save_result=True)
    rdir = runs / RESULTS_SUBDIR
    from_results, _ = paired.paired_report("REF", str(rdir / "A.vs.REF.json"), str(rdir / "B.vs.REF.json"), runs_dir=runs)
    from_stores, _ = paired.paired_report("REF", "A", "B", runs_dir=runs, threads=1)
    for k in ("kld_mean", "nll_mean", "same_top1_pct"):
        assert from_results["differences"][k]["diff"] == pytest.approx(from_stores["differences"][k]["diff"])
        assert from_results["differences"][k]["p_value"] == pytest.approx(from_stores["differences"][k]["p_value"])
    cut, _ = paired.paired_report("REF", str(rdir / "A.vs.REF.json"), str(rdir / "B.vs.REF.json"), chunks=5,
                                  runs_dir=runs)
    assert cut["chunks"] == 5
    with pytest.raises(QevalError, match="measured against reference 'REF'"):
        paired.paired_report("A", str(rdir / "A.vs.REF.json"), str(rdir / "B.vs.REF.json"), runs_dir=runs)


def test_cli_compare(runs):
    res = run_cli("compare", "--ref", "REF", "--cand", "A", "--cand", "B", "--runs-dir", runs, "--json")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    out = json.loads(res.stdout)
    assert out["verdicts"][0].startswith("A has lower KLD than B")
    assert math.isfinite(out["differences"]["nll_mean"]["ci_low"])
    assert_cli_error(run_cli("compare", "--ref", "REF", "--cand", "A", "--runs-dir", runs), "exactly two candidates")
    assert_cli_error(run_cli("compare", "--ref", "REF", "--cand", "A", "--cand", "OTHER_TOKENS", "--runs-dir", runs),
                     "candidate B", "token ids differ")
