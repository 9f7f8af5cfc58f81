"""qeval.orchestrate.gate and `qeval check`: thresholds judged beyond their error bars; exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
import math

import pytest
from conftest import assert_cli_error, run_cli
from synth_runs import make_runs

from qeval import api
from qeval.compare.summary import ComparisonSummary
from qeval.errors import QevalError
from qeval.orchestrate import baselines, gate
from qeval.present import results


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


def test_max_kld_fails_only_beyond_error_bars():
    s = summary(kld=0.05, kld_se=0.002)
    assert by_name(gate.run_checks(s, max_kld=0.06))["max-kld"].passed  # below the limit
    within = by_name(gate.run_checks(s, max_kld=0.047))["max-kld"]  # 0.05 - 1.96*0.002 = 0.04608 <= 0.047
    assert within.passed and within.bound == pytest.approx(0.05 - 1.96 * 0.002)
    assert "within its error bars" in within.reason
    beyond = gate.run_checks(s, max_kld=0.046)  # 0.04608 > 0.046
    assert not beyond.passed and not by_name(beyond)["max-kld"].passed
    assert "lower 95 % bound 0.046080" in by_name(beyond)["max-kld"].reason


def test_min_top1_uses_upper_bound_in_percent():
    s = summary(top1=0.90, top1_se=0.005)  # 90 % ± 0.5 %: upper bound 90.98 %
    assert gate.run_checks(s, min_top1=90.9).passed
    r = gate.run_checks(s, min_top1=91.0)
    assert not r.passed and by_name(r)["min-top1"].bound == pytest.approx(90.0 + 1.96 * 0.5)
    with pytest.raises(QevalError, match="percentage"):
        gate.run_checks(s, min_top1=0.9)


def test_ppl_ratio_uses_ratio_se_and_kld999_is_direct():
    s = summary(ratio=1.02, ratio_se=0.004, k999=1.5)
    assert gate.run_checks(s, max_ppl_ratio=1.013).passed  # 1.02 - 0.00784 = 1.01216
    assert not gate.run_checks(s, max_ppl_ratio=1.012).passed
    ok = by_name(gate.run_checks(s, max_kld_999=1.5))["max-kld-999"]
    bad = by_name(gate.run_checks(s, max_kld_999=1.49))["max-kld-999"]
    assert ok.passed and not bad.passed and bad.se is None and "no standard error" in bad.reason


def test_nothing_to_check_and_bad_limits():
    with pytest.raises(QevalError, match="nothing to check"):
        gate.run_checks(summary())
    with pytest.raises(QevalError, match="--max-kld must be a positive"):
        gate.run_checks(summary(), max_kld=-1)
    with pytest.raises(QevalError, match="--max-ppl-ratio"):
        gate.run_checks(summary(), max_ppl_ratio=math.nan)


def test_baseline_combined_error_bars():
    base = baselines.validate({
        "schema": baselines.SCHEMA, "title": "t", "source": {"title": "s"}, "model": "m",
        "entries": [{"id": "q4", "candidate": {"quant": "Q4_K_M"}, "reference": {"quant": "Q8_0"},
                     "metrics": {"kld_mean": {"value": 0.045, "se": 0.002}, "same_top1_pct": 91.0, "kld_max": 4.0}}]})
    # worse by 0.005; combined SE sqrt(0.002²+0.002²)=0.00283, 1.96*SE = 0.00554 -> within
    r = gate.run_checks(summary(kld=0.05, kld_se=0.002), baseline=base)
    checks = by_name(r)
    assert checks["baseline:kld_mean"].passed and "within the combined" in checks["baseline:kld_mean"].reason
    # top-1: 90 % ± 0.5 % vs 91.0 (no SE): worse by 1.0 > 1.96*0.5 = 0.98 -> fails
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
    base = baselines.validate(baselines.baseline_from_result(res.summary))
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
