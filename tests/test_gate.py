"""qeval.orchestrate.gate and `qeval check`: thresholds judged on their 95 % interval; exit codes 0 / 1 / 3 / 2."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli
from synth_runs import make_runs

from qeval import api
from qeval.compare import metric_registry
from qeval.compare.paired_stats import CONFIDENCE, t_quantile
from qeval.compare.summary import ComparisonSummary
from qeval.errors import QevalError
from qeval.orchestrate import baselines, gate
from qeval.present import results
from qeval.present.gate_text import gate_text
from qeval.storage.baselines import SCHEMA, validate


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = make_runs(tmp_path_factory.mktemp("gate") / "runs")
    for cand in ("A", "B"):
        api.kld_report("REF", cand, runs_dir=d, threads=1, save_result=True)
    return d


def summary(kld=0.05, kld_se=0.002, top1=0.90, top1_se=0.005, ratio=1.02, ratio_se=0.004, k999=1.5):
    """A comparison with just the fields the gate reads (its "metrics" block, qeval.compare.metric_registry)."""
    return ComparisonSummary.from_json({
        "reference": {"label": "R", "n_ctx": 512, "corpus": {"name": "wikitext-2"}, "model": {}},
        "candidate": {"label": "C", "model": {"quant": "Q4_K_M"}, "kv": {"type_k": "f16", "type_v": "f16"}},
        "chunks": 80, "scored_tokens": 20400,
        "metrics": {"ppl": {"value": 6.0 * ratio, "se": 0.04}, "ppl_ref": {"value": 6.0, "se": 0.04},
                    "ppl_ratio": {"value": ratio, "se": ratio_se},
                    "kld_mean": {"value": kld, "se": kld_se}, "kld_max": {"value": 5.0, "se": None},
                    "kld_999": {"value": k999, "se": None}, "kld_99": {"value": 0.5, "se": None},
                    "kld_median": {"value": 0.01, "se": None},
                    "same_top1_pct": {"value": 100 * top1, "se": 100 * top1_se},
                    "rms_dp_pct": {"value": 5.0, "se": 0.1}},
    })


def by_name(r: gate.GateResult) -> dict:
    return {c.name: c for c in r.checks}


Q80 = t_quantile(CONFIDENCE, 79)  # the summary's 80 chunks: 1.990, the interval's half-width in SEs


def test_max_kld_passes_only_inside_and_fails_only_beyond_its_interval():
    """A threshold passes only when the whole 95 % interval is within the limit, fails only when the whole of it is
    past the limit, and is undecided when it straddles the limit (qeval.compare.verdict)."""
    s = summary(kld=0.05, kld_se=0.002)  # interval 0.05 ± 1.990·0.002 = [0.046019, 0.053981]
    ok = by_name(gate.run_checks(s, max_kld=0.054))["max-kld"]
    assert ok.verdict == "pass" and ok.passed and ok.worst == pytest.approx(0.05 + Q80 * 0.002)
    assert "whole 95 % interval is within the limit (the upper bound 0.053981 ≤ 0.054)" in ok.reason
    straddles = gate.run_checks(s, max_kld=0.047)  # below the mean but above the interval's lower end
    within = by_name(straddles)["max-kld"]
    assert within.verdict == "undecided" and not within.passed and within.bound == pytest.approx(0.05 - Q80 * 0.002)
    assert "straddles limit 0.047: undecided (80 chunks)" in within.reason
    assert straddles.verdict == "undecided" and not straddles.passed
    over_the_mean = by_name(gate.run_checks(s, max_kld=0.0539))["max-kld"]  # above the mean: still undecided
    assert over_the_mean.verdict == "undecided"
    beyond = gate.run_checks(s, max_kld=0.046)  # 0.046019 > 0.046
    assert beyond.verdict == "failed" and not by_name(beyond)["max-kld"].passed
    assert "lower 95 % bound 0.046019" in by_name(beyond)["max-kld"].reason


def test_the_interval_widens_with_fewer_chunks():
    """The same figure and SE over 2 chunks: t with 1 degree of freedom (12.7 SEs) cannot tell a limit it clears by
    5 SEs, which 80 chunks decide."""
    assert gate.run_checks(summary(kld=0.05, kld_se=0.002), max_kld=0.06).verdict == "passed"
    two = summary(kld=0.05, kld_se=0.002)
    two.chunks = 2
    r = gate.run_checks(two, max_kld=0.06)
    assert r.verdict == "undecided" and r.z == pytest.approx(12.7062, abs=1e-4)
    assert by_name(r)["max-kld"].worst == pytest.approx(0.05 + 12.7062 * 0.002, abs=1e-6)
    assert gate.run_checks(two, max_kld=0.02).verdict == "failed"  # 0.05 − 12.7·0.002 = 0.0246 > 0.02


def test_min_top1_uses_upper_bound_in_percent():
    s = summary(top1=0.90, top1_se=0.005)  # 90 % ± 1.990·0.5 %: [89.005, 90.995]
    assert gate.run_checks(s, min_top1=89.0).passed
    assert gate.run_checks(s, min_top1=90.9).verdict == "undecided"
    r = gate.run_checks(s, min_top1=91.0)
    assert r.verdict == "failed" and by_name(r)["min-top1"].bound == pytest.approx(90.0 + Q80 * 0.5)
    with pytest.raises(QevalError, match="percentage"):
        gate.run_checks(s, min_top1=0.9)


def test_ppl_ratio_uses_ratio_se_and_kld999_is_direct():
    s = summary(ratio=1.02, ratio_se=0.004)  # [1.012038, 1.027962]
    assert gate.run_checks(s, max_ppl_ratio=1.028).passed
    assert gate.run_checks(s, max_ppl_ratio=1.013).verdict == "undecided"
    assert gate.run_checks(s, max_ppl_ratio=1.012).verdict == "failed"
    s = summary(k999=1.5)
    ok = by_name(gate.run_checks(s, max_kld_999=1.5))["max-kld-999"]
    bad = by_name(gate.run_checks(s, max_kld_999=1.49))["max-kld-999"]
    assert ok.passed and not bad.passed and bad.se is None and "no standard error" in bad.reason


def test_a_failure_outweighs_an_undecided_check_and_the_text_says_both():
    r = gate.run_checks(summary(kld=0.05, kld_se=0.002, top1=0.90, top1_se=0.005), max_kld=0.047, min_top1=91.0)
    assert [c.verdict for c in r.checks] == ["undecided", "fail"] and r.verdict == "failed"
    text = gate_text(r)
    assert "UNDECIDED  max-kld" in text and "FAIL       min-top1" in text
    assert text.endswith("FAILED: 1 of 2 checks, 1 undecided")
    out = r.to_json()
    assert (out["passed"], out["verdict"]) == (False, "failed")
    assert [(c["verdict"], c["passed"]) for c in out["checks"]] == [("undecided", False), ("fail", False)]
    undecided = gate_text(gate.run_checks(summary(), max_kld=0.047))
    assert undecided.endswith("UNDECIDED: 1 of 1 check (80 chunks): an interval straddles its limit; measure more "
                              "chunks to decide")


def test_nothing_to_check_and_bad_limits():
    with pytest.raises(QevalError, match="nothing to check"):
        gate.run_checks(summary())
    with pytest.raises(QevalError, match="--max-kld must be a positive"):
        gate.run_checks(summary(), max_kld=-1)
    with pytest.raises(QevalError, match="--max-ppl-ratio"):
        gate.run_checks(summary(), max_ppl_ratio=math.nan)


def test_baseline_combined_error_bars():
    base = validate({
        "schema": SCHEMA, "title": "t", "source": {"title": "s"}, "model": "m",
        "entries": [{"id": "q4", "candidate": {"quant": "Q4_K_M"}, "reference": {"quant": "Q8_0"},
                     "metrics": {"kld_mean": {"value": 0.045, "se": 0.002}, "same_top1_pct": 91.0, "kld_max": 4.0}}]},
        metric_registry)
    # worse by 0.005; combined SE sqrt(0.002²+0.002²)=0.00283, 1.990*SE = 0.00563 -> within: not shown worse
    r = gate.run_checks(summary(kld=0.05, kld_se=0.002), baseline=base)
    checks = by_name(r)
    assert checks["baseline:kld_mean"].passed and "within the combined" in checks["baseline:kld_mean"].reason
    assert "not shown worse (80 chunks)" in checks["baseline:kld_mean"].reason
    # top-1: 90 % ± 0.5 % vs 91.0 (no SE): worse by 1.0 > 1.990*0.5 = 0.995 -> fails
    assert not checks["baseline:same_top1_pct"].passed and "baseline gives no SE" in checks["baseline:same_top1_pct"].reason
    # kld_max: no SE on either side -> shown, not judged
    assert checks["baseline:kld_max"].passed and not checks["baseline:kld_max"].judged
    assert not r.passed
    r2 = gate.run_checks(summary(kld=0.06, kld_se=0.002), baseline=base, baseline_metrics=["kld_mean", "kld_max"])
    assert [c.name for c in r2.checks] == ["baseline:kld_mean", "baseline:kld_max"]
    assert not r2.passed and by_name(r2)["baseline:kld_max"].judged  # named: compared directly
    assert not by_name(r2)["baseline:kld_max"].passed and "compared directly" in by_name(r2)["baseline:kld_max"].reason
    assert any("does not state its n_ctx" in n for n in r.notes)


def test_converted_result_is_its_own_passing_baseline(runs):
    res = results.load_result(runs / "results" / "A.vs.REF.json")
    base = validate(baselines.baseline_from_result(res.summary), metric_registry)
    assert gate.run_checks(res.summary, baseline=base).passed
    worse = results.load_result(runs / "results" / "B.vs.REF.json").summary
    r = gate.run_checks(worse, baseline=base)
    assert not r.passed and not by_name(r)["baseline:kld_mean"].passed


def test_cli_max_abs_dp_p95(runs):
    p95 = results.load_result(runs / "results" / "B.vs.REF.json").summary.metrics["abs_dp_p95_pct"].value
    ok = run_check(runs, "--cand", "B", "--max-abs-dp-p95", p95 * 1.01)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS  max-abs-dp-p95" in ok.stdout and "compared directly" in ok.stdout
    fail = run_check(runs, "--cand", "B", "--max-abs-dp-p95", p95 * 0.99)
    assert fail.returncode == 1 and "FAIL  max-abs-dp-p95" in fail.stdout


def test_max_kld_bound_is_compared_directly_and_needs_a_record(runs, tmp_path):
    """The certified bound of the mean KLD (docs/error-bound.md) held to a limit: a bound is no estimate, so it is
    compared directly; a store without an error record cannot be judged on it (exit 2, saying why)."""
    bound = results.load_result(runs / "results" / "B.vs.REF.json").summary.metrics["kld_mean_bound"].value
    assert 0 < bound < 1e-3
    ok = run_check(runs, "--cand", "B", "--max-kld-bound", bound * 1.01)
    assert ok.returncode == 0 and "PASS  max-kld-bound" in ok.stdout and "compared directly" in ok.stdout
    fail = run_check(runs, "--cand", "B", "--max-kld-bound", bound * 0.99)
    assert fail.returncode == 1 and "FAIL  max-kld-bound" in fail.stdout
    s = summary()
    s.metrics["kld_mean_bound"] = s.metrics["kld_mean"].__class__(math.nan)  # as a store without a record gives it
    with pytest.raises(QevalError, match="records no error"):
        gate.run_checks(s, max_kld_bound=1e-4)


def run_check(runs, *args):
    res = run_cli("check", "--ref", "REF", "--runs-dir", runs, *args)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def test_cli_exit_codes(runs, tmp_path):
    kld_b = results.load_result(runs / "results" / "B.vs.REF.json").summary.figures.kld
    hi, lo = kld_b["mean"] * 3, kld_b["mean"] / 3
    ok = run_check(runs, "--cand", "B", "--max-kld", hi, "--min-top1", 5, "--max-ppl-ratio", 10)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("PASS  ") == 3 and "PASSED: all 3 checks" in ok.stdout

    fail = run_check(runs, "--cand", "B", "--max-kld", lo, "--json")
    assert fail.returncode == 1, fail.stdout + fail.stderr
    out = json.loads(fail.stdout)
    assert out["passed"] is False and out["checks"][0]["name"] == "max-kld" and not out["checks"][0]["passed"]

    # a saved result is judged without recomputing, against a baseline made from a better candidate
    base = tmp_path / "a.json"
    conv = run_cli("baseline", "from-result", runs / "results" / "A.vs.REF.json", "-o", base)
    assert conv.returncode == 0, conv.stderr
    worse = run_check(runs, "--cand", runs / "results" / "B.vs.REF.json", "--baseline", base)
    assert worse.returncode == 1 and "FAIL  baseline:kld_mean" in worse.stdout
    same = run_check(runs, "--cand", "A", "--baseline", base)
    assert same.returncode == 0, same.stdout

    assert run_check(runs, "--cand", "NOPE", "--max-kld", 1).returncode == 2
    assert_cli_error(run_check(runs, "--cand", "B"), "nothing to check")
    assert_cli_error(run_check(runs, "--cand", "B", "--min-top1", 0.9), "percentage")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "qeval-baseline/1", "title": "x"}')
    res = run_check(runs, "--cand", "B", "--baseline", bad)
    assert res.returncode == 2
    assert_cli_error(res, "source")
    assert_cli_error(run_check(runs, "--cand", "B", "--baseline", "qwen3.5-35b-a3b-rtx5080-followup"),
                     "no entry", "--baseline-entry")


def test_cli_an_undecided_gate_is_no_pass_and_exits_3(runs):
    """Through `qeval check`: a limit inside B's 95 % interval is undecided (exit 3, not a pass); a limit it clears by
    3 SEs passes over all 12 chunks (t with 11 df: 2.20 SEs) and is undecided over the first 2 (12.7 SEs)."""
    res = results.load_result(runs / "results" / "B.vs.REF.json", with_per_token=True)
    kld = res.summary.metrics["kld_mean"]
    first2 = res.restricted(np.arange(2)).summary.metrics["kld_mean"]
    inside, clear = kld.value + 2.0 * kld.se, kld.value + 3.0 * kld.se
    assert t_quantile(CONFIDENCE, 11) > 2.0 and t_quantile(CONFIDENCE, 11) < 3.0
    q2 = t_quantile(CONFIDENCE, 1)
    assert first2.value + q2 * first2.se > clear > first2.value - q2 * first2.se

    undecided = run_check(runs, "--cand", "B", "--max-kld", inside, "--json")
    assert undecided.returncode == 3, undecided.stdout + undecided.stderr
    out = json.loads(undecided.stdout)
    assert (out["passed"], out["verdict"], out["chunks"]) == (False, "undecided", 12)
    assert out["checks"][0]["verdict"] == "undecided" and out["checks"][0]["passed"] is False
    text = run_check(runs, "--cand", "B", "--max-kld", inside).stdout
    assert "UNDECIDED  max-kld" in text and "undecided (12 chunks)" in text
    assert "UNDECIDED: 1 of 1 check (12 chunks)" in text

    decided = run_check(runs, "--cand", "B", "--max-kld", clear)
    assert decided.returncode == 0 and "PASSED: 1 check" in decided.stdout, decided.stdout
    two = run_check(runs, "--cand", "B", "--max-kld", clear, "--chunks", 2)
    assert two.returncode == 3 and "undecided (2 chunks)" in two.stdout, two.stdout
    one = run_check(runs, "--cand", "B", "--max-kld", 100, "--chunks", 1, "--json")  # no interval at all
    assert one.returncode == 3 and "Infinity" not in one.stdout
    check = json.loads(one.stdout)["checks"][0]
    assert (check["verdict"], check["bound"], check["worst"]) == ("undecided", None, None)
    assert "a single chunk gives no interval (chunks are the unit): undecided (1 chunk)" in check["reason"]
    # a failure outweighs it: exit 1
    both = run_check(runs, "--cand", "B", "--max-kld", inside, "--max-kld-999", 1e-6)
    assert both.returncode == 1 and "FAILED: 1 of 2 checks, 1 undecided" in both.stdout, both.stdout
