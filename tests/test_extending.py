"""Worked examples of docs/layout.md's "where does a new … go" table: a new metric is one registry entry, a new board
output one function and one entry; each reaches every output without touching another module. (A new
backend: tests/test_backends.py with tests/replay_backend.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from synth_runs import make_runs

from qeval import api
from qeval.compare import metric_registry
from qeval.compare.metric_registry import Metric, Percentile
from qeval.present import leaderboard

KLD_P95 = Metric(key="kld_p95", title="95% KLD", unit="nats", better="lower", aggregate=Percentile("kld", 0.95), description="95th percentile of per-token KLD",
                 board=True, gate="max-kld-p95")


@pytest.fixture()
def runs(tmp_path):
    return make_runs(tmp_path / "runs")


def test_a_new_metric_is_one_registry_entry(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(metric_registry.METRICS, KLD_P95.key, KLD_P95)
    per_token = tmp_path / "a.npz"
    result, _ = api.kld_report("REF", "A", runs_dir=runs, threads=1, per_token=per_token, save_result=True)
    kld = np.load(per_token)["kld"].astype(np.float64)
    assert result["metrics"]["kld_p95"]["value"] == pytest.approx(np.percentile(kld, 95), rel=1e-12)
    assert result["metrics"]["kld_p95"]["se"] is None

    assert ("max_kld_p95", "--max-kld-p95") in [(k, o) for k, o, _ in api.threshold_options()]
    limit = result["metrics"]["kld_p95"]["value"]
    _, text, passed = api.check_report("REF", "A", runs_dir=runs, threads=1, max_kld_p95=limit * 2)
    assert passed and "95% KLD" in text
    _, _, passed = api.check_report("REF", "A", runs_dir=runs, threads=1, max_kld_p95=limit / 10)
    assert not passed

    board = api.leaderboard_report([runs / "results"], out=tmp_path / "board")
    assert "kld_p95" in board.columns and "95% KLD" in board.markdown()


def test_a_new_board_output_is_one_function_and_one_entry(runs, tmp_path, monkeypatch):
    def tsv_text(board: leaderboard.Leaderboard) -> str:
        return "\n".join("\t".join(str(v) for v in r.values()) for r in board.records()) + "\n"

    monkeypatch.setitem(leaderboard.TEXT_OUTPUTS, "leaderboard.tsv", tsv_text)
    api.kld_report("REF", "A", runs_dir=runs, threads=1, save_result=True)
    api.kld_report("REF", "B", runs_dir=runs, threads=1, save_result=True)
    board = api.leaderboard_report([runs / "results"], out=tmp_path / "board")
    written = (tmp_path / "board" / "leaderboard.tsv").read_text().splitlines()
    assert board.paths["leaderboard.tsv"] == tmp_path / "board" / "leaderboard.tsv"
    assert [line.split("\t")[1] for line in written] == [r["label"] for r in
                                                         json.loads((tmp_path / "board" / "leaderboard.json")
                                                                    .read_text())["rows"]]
