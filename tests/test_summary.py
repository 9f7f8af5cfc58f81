"""ComparisonSummary (qeval.compare.summary): its JSON is the JSON qeval wrote before it existed, key for key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synth_runs import make_runs

from qeval import api
from qeval.compare.summary import ComparisonSummary, kv_text
from qeval.errors import QevalError
from qeval.present import results

DATA = Path(__file__).parent / "data"
# saved by qeval before ComparisonSummary (`qeval kld --ref REF --cand B --sampler greedy --sampler
# qwen3.5-thinking --save-result` on tests/synth_runs.py)
OLD_RESULT = DATA / "result-before-typed-summary.json"


def test_round_trip_of_a_computed_comparison(tmp_path):
    runs = make_runs(tmp_path / "runs")
    result, _ = api.kld_report("REF", "A", runs_dir=runs, threads=1, save_result=True, samplers=["greedy"])
    summary = ComparisonSummary.from_json(result)
    assert json.dumps(summary.to_json()) == json.dumps(result)
    saved = (runs / "results" / "A.vs.REF.json").read_text()
    assert json.dumps(ComparisonSummary.from_json(json.loads(saved)).to_json(), indent=2) == saved
    assert summary.candidate.label == "A" and summary.by_depth[-1].kld == result["by_depth"][-1]["kld"]
    assert summary.measured()["kld_mean"].value == result["metrics"]["kld_mean"]["value"]


def test_reads_a_result_file_of_the_code_before_it():
    text = OLD_RESULT.read_text()
    res = results.load_result(OLD_RESULT, with_per_token=False)
    assert json.dumps(res.summary.to_json(), indent=2) == text
    assert (res.label, res.ref_label, res.summary.chunks) == ("B", "REF", 12)
    assert set(res.summary.samplers) == {"greedy", "qwen3.5-thinking"}
    assert res.summary.comparison_request().key == json.loads(text)["request"]["key"]
    with pytest.raises(QevalError, match="metrics version 3"):  # before bounds (METRICS_VERSION 4): recomputed
        results.require_current(res)


def test_reads_a_summary_of_an_older_qeval():
    """Before the "metrics" block, by-depth figures and the recorded request: read, written back the same, and
    refused where those are needed."""
    old = {"reference": {"label": "REF", "path": "REF.qeval", "n_ctx": 512},
           "candidate": {"label": "C", "path": "C.qeval", "n_ctx": 512},
           "chunks": 4, "scored_tokens": 1020, "perplexity": {"ppl_cand": 6.1, "ppl_ref": 6.0},
           "kld": {"mean": 0.05, "se": 0.002}, "per_token_file": "C.vs.REF.npz"}
    summary = ComparisonSummary.from_json(old)
    assert summary.to_json() == old and list(summary.to_json()) == list(old)
    assert summary.by_depth is None and summary.deepest is None and summary.comparison_request() is None
    with pytest.raises(QevalError, match="older qeval"):
        summary.measured()
    with pytest.raises(QevalError, match="older qeval"):
        results.require_current(results.Result(summary, None, Path("C.vs.REF.json")))


def test_kv_text():
    both = {"rotation": {"k": True, "v": True}}
    assert kv_text({"type_k": "q8_0", "type_v": "q4_0", **both}) == "q8_0/q4_0 rot"
    assert kv_text({}) == "?/?" and kv_text({"type_k": "f16", "type_v": "f16"}) == "f16/f16"
    assert kv_text({"type_k": "q8_0", "type_v": "q8_0", **both}, same_once=True) == "q8_0 rot"
    assert kv_text({"type_k": "q8_0", "rotation": {"k": True}}) == "q8_0/? rot K"
    assert kv_text({"type_k": "q8_0"}, same_once=True) == "q8_0 rot?"  # made before the rotation was recorded
    assert kv_text({"type_k": "q4_0", "type_v": "q4_0", "rotation": {"k": False, "v": False}}) == "q4_0/q4_0 norot"
    assert kv_text({"type_k": "f16", "type_v": "q8_0", "rotation": {"k": False, "v": True}}) == "f16/q8_0 rot V"
    assert kv_text({"type_k": "f16", "type_v": "f16", "decode": "generate"}) == "f16/f16 gen"
