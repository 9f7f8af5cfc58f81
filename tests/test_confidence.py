"""KLD by the reference's confidence (qeval.compare.depth.by_confidence): the per-token reference top-1 probability
against float64, the buckets against a plain implementation, `qeval kld` and `qeval check` through the CLI, bad
edges, and a result saved before qeval kept the column."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_cli_error, log_softmax64, make_pair, run_cli
from synth_runs import make_runs
from test_depth import cluster_se64

from qeval.compare import depth, metrics
from qeval.compare.summary import ComparisonSummary
from qeval.present import board, report, results
from qeval.storage.store import StoreReader

EDGES = "0.6,0.9,0.99"  # each bucket holds tokens of tests/synth_runs.py
EDGE_LIST = [0.6, 0.9, 0.99]


def test_p_ref_top1_is_the_reference_softmax_maximum_in_float64(pair):
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        t = metrics.compare(ref, cand, threads=1).per_token
    want = np.concatenate([np.exp(log_softmax64(pair.ref.logits[c]).max(axis=1)) for c in sorted(pair.ref.logits)])
    np.testing.assert_allclose(t["p_ref_top1"], want, rtol=1e-9, atol=0)
    assert np.all(t["p_ref_top1"] >= t["p_ref"])  # no token is more probable than the argmax


def plain_buckets(t: dict, edges: list[float]) -> list[dict]:
    """The buckets written out with Python floats: membership, n, mean, cluster SE, same-top-1 and KLD share."""
    bounds = [0.0, *edges, 1.0]
    total = math.fsum(t["kld"].tolist())
    out = []
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        last = k == len(bounds) - 2
        keep = np.array([lo <= p and (p <= hi if last else p < hi) for p in t["p_ref_top1"].tolist()])
        if not keep.any():
            continue
        kld = t["kld"][keep]
        out.append({"lo": lo, "hi": hi, "n": int(keep.sum()), "mean": math.fsum(kld.tolist()) / len(kld),
                    "se": cluster_se64(kld, t["chunk"][keep], t["position"][keep]),
                    "top1": float(np.mean(t["same_top1"][keep])), "share": math.fsum(kld.tolist()) / total})
    return out


def test_buckets_match_a_plain_implementation(tmp_path):
    p = make_pair(tmp_path, seed=3, n_chunks=4, n_ctx=64, scoring="all", sigma=0.6)
    with StoreReader(p.ref.path) as ref, StoreReader(p.cand.path) as cand:
        t = dict(metrics.compare(ref, cand, threads=1).per_token)
    rng = np.random.default_rng(0)
    t["p_ref_top1"] = rng.uniform(0.0, 1.0, len(t["kld"]))
    t["p_ref_top1"][:4] = [0.6, 0.9, 0.99, 1.0]  # an edge goes to the bucket above it; 1 to the last one
    buckets = depth.parse_confidence_buckets(EDGES)
    got = depth.by_confidence(t, buckets, metrics.summarize_tokens)
    want = plain_buckets(t, EDGE_LIST)
    assert [(g["lo"], g["hi"], g["n"]) for g in got] == [(w["lo"], w["hi"], w["n"]) for w in want]
    assert sum(g["n"] for g in got) == len(t["kld"])
    for g, w in zip(got, want):
        assert g["kld"]["mean"] == pytest.approx(w["mean"], rel=1e-12)
        assert g["kld"]["se"] == pytest.approx(w["se"], rel=1e-9)
        assert g["same_top1"]["fraction"] == pytest.approx(w["top1"], rel=1e-12)
        assert g["kld_share"] == pytest.approx(w["share"], rel=1e-12)
    assert math.fsum(g["kld_share"] for g in got) == pytest.approx(1.0, rel=1e-12)
    del t["p_ref_top1"]  # rows without the column: not recorded, never empty buckets
    assert depth.by_confidence(t, buckets, metrics.summarize_tokens) is None


def test_kld_text_and_json_show_the_buckets(tmp_path):
    runs = make_runs(tmp_path / "runs")
    npz = tmp_path / "tokens.npz"
    res = run_cli("kld", "--ref", "REF", "--cand", "B", "--confidence-buckets", EDGES, "--json", "--per-token", npz,
                  "--runs-dir", runs)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    t = dict(np.load(npz))
    want = plain_buckets(t, EDGE_LIST)
    got = out["by_confidence"]
    assert len(got) >= 2 and [(g["lo"], g["hi"], g["n"]) for g in got] == [(w["lo"], w["hi"], w["n"]) for w in want]
    for g, w in zip(got, want):
        assert g["kld"]["mean"] == pytest.approx(w["mean"], rel=1e-9)
        assert g["kld_share"] == pytest.approx(w["share"], rel=1e-9)
    text = run_cli("kld", "--ref", "REF", "--cand", "B", "--confidence-buckets", EDGES, "--runs-dir", runs)
    block = text.stdout[text.stdout.index("By the reference's confidence"):]
    for g in got:
        row = next(line for line in block.splitlines() if line.split()[:2] == [f"{g['lo']:g}-{g['hi']:g}", str(g["n"])])
        assert f"{g['kld']['mean']:9.6f}" in row and row.endswith(f"{100 * g['kld_share']:.2f}")
    default = json.loads(run_cli("kld", "--ref", "REF", "--cand", "B", "--json", "--runs-dir", runs).stdout)
    assert [(g["lo"], g["hi"]) for g in default["by_confidence"]] == \
        [b for b in depth.parse_confidence_buckets(None) if any(g["lo"] == b[0] for g in default["by_confidence"])]


@pytest.mark.parametrize("edges", ["0.9,0.5", "0.5,0.5", "0.5,1.2", "0,0.5", "1", "-0.1", "a,b", ","])
def test_bad_edges_are_refused_with_one_message(tmp_path, edges):
    runs = make_runs(tmp_path / "runs")
    for command in (["kld"], ["check", "--max-kld", "1"]):
        res = run_cli(*command, "--ref", "REF", "--cand", "A", "--confidence-buckets", edges, "--runs-dir", runs)
        assert_cli_error(res, "--confidence-buckets", "between 0 and 1")


def test_check_gates_the_most_confident_bucket(tmp_path):
    runs = make_runs(tmp_path / "runs")
    out = json.loads(run_cli("kld", "--ref", "REF", "--cand", "B", "--confidence-buckets", EDGES, "--json",
                             "--runs-dir", runs).stdout)
    top = out["by_confidence"][-1]
    assert top["hi"] == 1.0
    mean, se = top["kld"]["mean"], top["kld"]["se"]
    args = ("check", "--ref", "REF", "--cand", "B", "--confidence-buckets", EDGES, "--json", "--runs-dir", runs)
    passed = run_cli(*args, "--max-kld-confident", mean + 3 * se)
    assert passed.returncode == 0, passed.stderr
    check = json.loads(passed.stdout)["checks"][0]
    assert (check["name"], check["value"], check["se"]) == ("max-kld-confident", mean, se)
    failed = run_cli(*args, "--max-kld-confident", mean - 3 * se)
    assert failed.returncode == 1
    text = run_cli("check", "--ref", "REF", "--cand", "B", "--confidence-buckets", EDGES, "--runs-dir", runs,
                   "--max-kld-confident", mean - 3 * se).stdout
    assert f"FAIL  max-kld-confident  mean KLD at reference top-1 p ≥ 0.99 ({top['n']} tokens)" in text
    # the default buckets: the gate judges their last one, whatever --confidence-buckets says elsewhere
    default = json.loads(run_cli("kld", "--ref", "REF", "--cand", "B", "--json", "--runs-dir", runs).stdout)
    res = run_cli("check", "--ref", "REF", "--cand", "B", "--json", "--runs-dir", runs, "--max-kld-confident", 10)
    last = default["by_confidence"][-1]
    if last["hi"] == 1.0:
        assert json.loads(res.stdout)["checks"][0]["value"] == last["kld"]["mean"]
    else:  # no token reached the last default edge on these synthetic logits: one message, exit 2
        assert_cli_error(res, "--max-kld-confident", "holds no scored token")


def saved_before_the_column(runs) -> tuple:
    """B's result saved, then made as qeval saved it before it kept the reference's top-1 probability."""
    assert run_cli("kld", "--ref", "REF", "--cand", "B", "--save-result", "--runs-dir", runs).returncode == 0
    path = runs / "results" / "B.vs.REF.json"
    return path, made_old(path)


def made_old(path) -> dict:
    """The saved result at `path` made as qeval saved it before it kept the reference's top-1 probability; its JSON
    as it was."""
    fresh = json.loads(path.read_text())
    old = {k: v for k, v in fresh.items() if k != "by_confidence"}
    for group in old["by_depth"]:
        del group["kld_share"]
    path.write_text(json.dumps(old))
    npz = path.with_suffix(".npz")
    with np.load(npz) as data:
        columns = {k: data[k] for k in data.files if k != "p_ref_top1"}
    with open(npz, "wb") as fh:
        np.savez_compressed(fh, **columns)
    return fresh


def test_a_result_saved_before_the_column(tmp_path):
    runs = make_runs(tmp_path / "runs")
    path, fresh = saved_before_the_column(runs)
    res = results.load_result(path)
    # shown as it is: not recorded, never empty buckets
    assert res.summary.by_confidence is None
    assert report.CONFIDENCE_NOT_RECORDED in report.comparison_text(res.summary)
    assert board.board_row(res.summary).to_json()["by_confidence"] is None
    assert "  ?" in report.comparison_text(res.summary).split("By depth")[1].splitlines()[2]  # no share saved
    # not reused for a comparison that keeps every column
    with StoreReader(runs / "REF.qeval") as ref:
        assert results.reusable_chunks(res, ref, None, ())[1] == "it was saved before qeval kept per-token p_ref_top1"
        filled = results.with_reference_top1(res, ref)
        assert results.reusable_chunks(filled, ref, None, ())[1] != ""  # (a store's candidate: never reused)
    # read from the reference store: the figures of a fresh comparison
    got = [g.to_json() for g in filled.summary.by_confidence]
    assert json.dumps(got) == json.dumps(fresh["by_confidence"])
    assert "computed from the reference's stored top-1 probabilities" in filled.note
    # qeval check on the file does the same, and says so
    check = run_cli("check", "--ref", "REF", "--cand", path, "--max-kld-confident", 10, "--confidence-buckets", "0.5",
                    "--json", "--runs-dir", runs)
    assert check.returncode == 0, check.stderr
    out = json.loads(check.stdout)
    assert any("stored top-1 probabilities" in line for line in out["obtained"])
    want = plain_buckets(dict(np.load(fresh_npz(runs, tmp_path))), [0.5])[-1]
    assert out["checks"][0]["value"] == pytest.approx(want["mean"], rel=1e-12)
    # a summary of it without the reference at hand: not recorded, the gate says so
    summary = ComparisonSummary.from_json(json.loads(path.read_text()))
    from qeval.orchestrate import gate  # noqa: PLC0415

    with pytest.raises(Exception, match="holds no figures by the reference's confidence"):
        gate.run_checks(summary, max_kld_confident=1.0)


def fresh_npz(runs, tmp_path):
    """B's per-token values as computed now."""
    out = tmp_path / "fresh.npz"
    assert run_cli("kld", "--ref", "REF", "--cand", "B", "--per-token", out, "--runs-dir", runs).returncode == 0
    return out


def test_chunks_of_an_older_checkpoint_get_the_column_from_the_reference(pair):
    """A matrix pair resumed from chunks compared before qeval kept p_ref_top1 (its checkpoint, its saved result):
    the column is read from the reference, whichever chunk comes first."""
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        fresh = metrics.compare(ref, cand, threads=1)
        parts = [{k: v[fresh.per_token["chunk"] == c] for k, v in fresh.per_token.items()} for c in fresh.chunks]
        for old in (0, 1):  # an old chunk first, and a new one first
            mixed = [{k: v for k, v in p.items() if k != "p_ref_top1" or i != old} for i, p in enumerate(parts)]
            joined = metrics.comparison_of(ref, cand, fresh.chunks, mixed)
            np.testing.assert_array_equal(joined.per_token["p_ref_top1"], fresh.per_token["p_ref_top1"])


def test_board_and_card_show_each_rows_buckets(tmp_path):
    import test_leaderboard  # noqa: PLC0415

    from qeval import api  # noqa: PLC0415

    runs = test_leaderboard.build_results(tmp_path / "runs")
    made_old(runs / "results" / "Q2_K.vs.REF.json")
    summaries = {p.name.split(".vs.")[0]: json.loads(p.read_text()) for p in (runs / "results").glob("*.json")}
    api.leaderboard_report([runs], out=tmp_path / "board")
    board_json = json.loads((tmp_path / "board" / "leaderboard.json").read_text())
    card_json = api.card_report([runs], out=tmp_path / "card")[0]
    block = (tmp_path / "card" / "card.md").read_text()
    old = summaries.pop("Q2_K")
    assert "by_confidence" not in old and board_json["by_confidence"]["Q2_K"] is None
    assert next(r for r in card_json["rows"] if r["label"] == "Q2_K")["by_confidence"] is None
    assert "- **Q2_K:** not recorded" in block.splitlines()
    for label, s in summaries.items():
        want = [(g["lo"], g["hi"], g["n"], g["kld"]["mean"], g["kld_share"]) for g in s["by_confidence"]]
        for held in (board_json["by_confidence"][label], next(r for r in card_json["rows"]
                                                              if r["label"] == label)["by_confidence"]):
            assert [(b["lo"], b["hi"], b["n"], b["kld_mean"], b["kld_share"]) for b in held] == want
        line = next(x for x in block.splitlines() if x.startswith(f"- **{label}:**"))
        assert line.count(" · ") == len(want) - 1
        for g in s["by_confidence"]:
            assert f"{g['lo']:g}-{g['hi']:g}: {g['kld']['mean']:.6f} ± " in line and f"({100 * g['kld_share']:.1f} %)" in line
