"""qeval.metric_registry: the table is consistent, computes every metric from the per-token columns, and the
documentation lists every metric."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from qeval.compare import metric_registry, metrics
from qeval.compare.metric_registry import KLD_BLOCK, METRICS, PPL_BLOCK, TOKEN_BLOCK, Mean, Proportion
from qeval.compare.summary import ComparisonSummary
from qeval.errors import QevalError


def per_token(n: int = 500, seed: int = 0) -> dict[str, np.ndarray]:
    """Plausible values for every per-token column."""
    rng = np.random.default_rng(seed)
    nll_ref = rng.gamma(2.0, 1.0, n)
    nll_cand = nll_ref + rng.normal(0.02, 0.2, n)
    return {"chunk": np.repeat(np.arange(n // 50), 50), "position": np.arange(n), "token": np.arange(n),
            "kld": rng.gamma(0.5, 0.05, n), "kld_reverse": rng.gamma(0.5, 0.05, n), "nll_ref": nll_ref,
            "nll_cand": nll_cand, "p_ref": np.exp(-nll_ref), "p_cand": np.exp(-nll_cand),
            "same_top1": rng.random(n) < 0.9, "top5_agreement": rng.integers(0, 6, n) / 5,
            "top10_agreement": rng.integers(0, 11, n) / 10, "kld_bound": rng.gamma(0.5, 1e-4, n),
            "kld_reverse_bound": rng.gamma(0.5, 1e-4, n), "p_ref_top1": np.maximum(np.exp(-nll_ref), rng.random(n))}


def test_every_metric_computes_from_the_per_token_columns():
    t = per_token()
    assert set(t) == set(metrics.PER_TOKEN_FIELDS)
    block = metric_registry.compute(t)
    assert list(block) == list(METRICS)
    for key, v in block.items():
        assert np.isfinite(v["value"]), key
        assert (v["se"] is not None) == METRICS[key].has_se, key


@pytest.mark.parametrize("seed", range(5))
def test_every_bound_holds_for_any_exact_values_it_allows(seed):
    """Exact per-token values anywhere within their bounds (here: the extremes and random points): every
    metric's value on them stays within its bound of the value computed."""
    t = per_token(seed=seed)
    computed = metric_registry.compute(t)
    rng = np.random.default_rng(seed)
    for draw in ("low", "high", "random"):
        exact = dict(t)
        for column, bound in metric_registry.BOUND_COLUMNS.items():
            shift = {"low": -1.0, "high": 1.0, "random": rng.uniform(-1, 1, len(t[column]))}[draw]
            exact[column] = np.maximum(t[column] + shift * t[bound], 0.0)
        for key, v in metric_registry.compute(exact).items():
            bound = computed[key]["bound"]
            if key == "kld_mean_bound":  # the bound itself, a figure of its own: no bound of it
                assert bound is None and v["value"] == computed["kld_mean"]["bound"] == t["kld_bound"].mean()
                continue
            assert isinstance(bound, float), key
            assert abs(v["value"] - computed[key]["value"]) <= bound * (1 + 1e-12) + 1e-15, (key, draw)
    assert computed["kld_mean"]["bound"] > 0 and computed["kld_999"]["bound"] > 0
    assert computed["ppl"]["bound"] == 0 and computed["same_top1_pct"]["bound"] == 0  # exact scalars and ids


def test_bounds_not_recorded_and_not_bounded():
    t = per_token()
    t["kld_bound"] = t["kld_reverse_bound"] = np.full(len(t["kld"]), np.nan)  # a store without an error record
    held = metric_registry.compute(t)
    assert {v["bound"] for k, v in held.items() if k != "kld_mean_bound"} == {metric_registry.NOT_RECORDED}
    assert np.isnan(held["kld_mean_bound"]["value"])
    t = {**per_token(), "tvd@greedy": np.full(500, 0.1), "support_differs@greedy": np.zeros(500, bool)}
    for m in metric_registry.sampler_metrics("greedy"):
        assert m.measure(t)["bound"] == metric_registry.NOT_BOUNDED


def test_the_table_is_consistent():
    for m in METRICS.values():
        assert m.better in ("lower", "higher", None), m.key
        assert m.unit in ("nats", "nats/token", "PPL", "ratio", "%"), m.key
        if m.gate:
            assert m.better is not None and m.gate.startswith("max-" if m.better == "lower" else "min-"), m.key
        if m.paired:
            assert isinstance(m.aggregate, (Mean, Proportion)), m.key
        if m.restates:
            assert m.restates in METRICS, m.key
        if m.report:
            assert m.report[0] in (PPL_BLOCK, KLD_BLOCK, TOKEN_BLOCK), m.key
    gates = [m.gate for m in metric_registry.gated()]
    assert len(set(gates)) == len(gates)


def test_read_refuses_a_summary_without_metrics():
    sides = {"reference": {"label": "R"}, "candidate": {"label": "C"}}
    with pytest.raises(QevalError, match="older qeval"):
        ComparisonSummary.from_json({**sides, "kld": {"mean": 0.1}}).measured()
    held = ComparisonSummary.from_json({**sides, "metrics": {"kld_mean": {"value": 0.1, "se": 0.01},
                                                             "gone": {"value": 1}}}).measured()
    assert list(held) == ["kld_mean"] and held["kld_mean"].se == 0.01


def test_schema_lists_every_metric_with_its_unit_and_direction():
    text = (REPO / "baselines" / "SCHEMA.md").read_text()
    for m in METRICS.values():
        assert f"| `{m.key}` | {m.unit} | {m.better or '—'} |" in text, m.key
