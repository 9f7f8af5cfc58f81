"""Long context: scored positions as a recorded choice (qeval.storage.scoring), format v1 still read, and the
by-depth block (qeval.compare.depth) checked against plain float64 recomputations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_cli_error, make_pair, perturb, run_cli, synth_logits, write_store

from qeval import api
from qeval.compare import depth
from qeval.errors import QevalError
from qeval.storage.codec import SqrtLogCode
from qeval.storage.scoring import Scoring
from qeval.storage.store import StoreReader

N_CTX = 64


def test_scoring_rules_give_the_documented_positions():
    assert Scoring.parse(None).positions(8).tolist() == [4, 5, 6]  # llama-perplexity: n_ctx/2 .. n_ctx-2
    assert Scoring.parse("all").positions(8).tolist() == list(range(7))
    assert Scoring.parse("every:3").positions(8).tolist() == [2, 5]
    assert Scoring.parse("every:1").positions(8).tolist() == list(range(7))
    for bad in ("every:0", "every:", "every:x", "some", "half:2"):
        with pytest.raises(QevalError, match="--score"):
            Scoring.parse(bad)
    with pytest.raises(QevalError, match="scores no position"):
        Scoring.parse("every:9").check(8)


def test_bands_and_depth_specs():
    assert depth.parse_bands(None, 512) == [(0, 512)]
    assert depth.parse_bands(None, 32768) == [(0, 512), (512, 2048), (2048, 8192), (8192, 32768)]
    assert depth.parse_bands("16,32", N_CTX) == [(0, 16), (16, 32), (32, 64)]
    assert depth.parse_bands("16,32,4096", N_CTX) == [(0, 16), (16, 32), (32, 64)]  # edges beyond n_ctx dropped
    for bad in ("32,16", "0,16", "a,b", ""):
        with pytest.raises(QevalError, match="--bands"):
            depth.parse_bands(bad, N_CTX)
    assert depth.parse_depth("8192:") == (8192, 1 << 40) and depth.parse_depth(":512") == (0, 512)
    for bad in ("8192", "10:5", "a:b", "-1:5"):
        with pytest.raises(QevalError, match="--depth"):
            depth.parse_depth(bad)


def cluster_se64(values: np.ndarray, chunk: np.ndarray, position: np.ndarray) -> float:
    """The cluster-robust SE written out with a dict of blocks (independent of depth.cluster_se)."""
    blocks: dict = {}
    for v, c, p in zip(values, chunk, position):
        blocks.setdefault((int(c), int(p) // depth.BLOCK_POSITIONS), []).append(float(v))
    n = len(values)
    mean = math.fsum(values.tolist()) / n
    g = len(blocks)
    ss = math.fsum((math.fsum(b) - mean * len(b)) ** 2 for b in blocks.values())
    return math.sqrt(g / (g - 1) * ss / (n * n))


def test_by_depth_matches_float64_on_every_band(tmp_path):
    pair = make_pair(tmp_path / "runs", n_chunks=4, n_ctx=N_CTX, scoring="all", sigma=0.6)
    out = tmp_path / "tokens.npz"
    result, text = api.kld_report("REF", "CAND", runs_dir=pair.directory, threads=1, per_token=out, bands="16,40")
    t = dict(np.load(out))
    assert sorted(set(t["position"].tolist())) == list(range(N_CTX - 1))  # every position, recorded as such
    bands = result["by_depth"]
    assert [(b["lo"], b["hi"]) for b in bands] == [(0, 16), (16, 40), (40, 64)]
    assert sum(b["n"] for b in bands) == result["scored_tokens"] == 4 * (N_CTX - 1)
    for b in bands:
        keep = (t["position"] >= b["lo"]) & (t["position"] < b["hi"])
        kld = t["kld"][keep].astype(np.float64)
        assert b["n"] == int(keep.sum())
        assert b["kld"]["mean"] == pytest.approx(math.fsum(kld.tolist()) / len(kld), rel=1e-12)
        assert b["kld"]["ladder"]["99.0%"] == pytest.approx(np.percentile(kld, 99.0), rel=1e-12)
        assert b["same_top1"]["fraction"] == pytest.approx(t["same_top1"][keep].mean(), rel=1e-12)
        assert b["perplexity"]["ppl_ref"] == pytest.approx(math.exp(t["nll_ref"][keep].mean()), rel=1e-12)
        assert b["perplexity"]["ppl_cand"] == pytest.approx(math.exp(t["nll_cand"][keep].mean()), rel=1e-12)
        dp = (t["p_cand"] - t["p_ref"])[keep]
        assert b["delta_p"]["mean"] == pytest.approx(dp.mean(), rel=1e-12)
        # SEs are cluster-robust over 256-position blocks of one window: here one block per window and band
        assert b["kld"]["se"] == pytest.approx(cluster_se64(kld, t["chunk"][keep], t["position"][keep]), rel=1e-9)
        assert b["delta_p"]["se"] == pytest.approx(cluster_se64(dp, t["chunk"][keep], t["position"][keep]), rel=1e-9)
        assert set(b) >= {"lo", "hi", "n", "kld", "perplexity", "same_top1", "delta_p", "metrics", "se_method"}
    assert "====== By depth" in text and "     16-40" in text


def test_second_half_band_of_all_equals_half_scoring(tmp_path):
    """The sanity check of issue 10 in miniature: a store scoring every position, cut to [n_ctx/2, n_ctx),
    gives exactly the numbers of stores that score llama-perplexity's half."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 500, size=(3, N_CTX)).astype(np.int32)
    ref_all = synth_logits(rng, tokens, 500, scoring="all")
    cand_all = {c: perturb(rng, x, 0.5) for c, x in ref_all.items()}
    half = Scoring.parse("half").positions(N_CTX)
    runs = tmp_path / "runs"
    runs.mkdir()
    for label, logits, scoring in (("RA", ref_all, "all"), ("CA", cand_all, "all"),
                                   ("RH", {c: x[half] for c, x in ref_all.items()}, "half"),
                                   ("CH", {c: x[half] for c, x in cand_all.items()}, "half")):
        write_store(runs / f"{label}.qeval", tokens, logits, 500, label=label, scoring=scoring)
    whole, _ = api.kld_report("RA", "CA", runs_dir=runs, threads=1, bands=str(N_CTX // 2))
    halved, _ = api.kld_report("RH", "CH", runs_dir=runs, threads=1)
    second = whole["by_depth"][1]
    assert (second["lo"], second["n"]) == (N_CTX // 2, halved["scored_tokens"])
    for key in ("mean",):
        assert second["kld"][key] == halved["kld"][key]
    assert second["kld"]["ladder"] == halved["kld"]["ladder"]
    assert second["perplexity"]["ppl_cand"] == halved["perplexity"]["ppl_cand"]
    assert second["same_top1"]["fraction"] == halved["same_top1"]["fraction"]
    # and --depth on compare/check cuts to the same tokens
    res = run_cli("check", "--ref", "RA", "--cand", "CA", "--depth", f"{N_CTX // 2}:", "--max-kld", "10",
                  "--runs-dir", runs, "--json")
    assert res.returncode == 0, res.stderr
    checked = json.loads(res.stdout)
    assert checked["depth"] == {"lo": N_CTX // 2, "hi": 1 << 40}
    assert checked["scored_tokens"] == halved["scored_tokens"]


def test_different_scoring_is_refused_and_depth_outside_is_an_error(tmp_path):
    pair = make_pair(tmp_path / "a", scoring="all", n_ctx=N_CTX)
    other = make_pair(tmp_path / "b", scoring="half", n_ctx=N_CTX, seed=0)
    assert_cli_error(run_cli("kld", "--ref", pair.ref.path, "--cand", other.cand.path),
                     "scored positions differ: reference --score all, candidate --score half")
    assert_cli_error(run_cli("check", "--ref", "REF", "--cand", "CAND", "--depth", "5000:", "--max-kld", "1",
                             "--runs-dir", pair.directory), "no scored token at depth 5000")
    assert_cli_error(run_cli("kld", "--ref", "REF", "--cand", "CAND", "--bands", "9,3", "--runs-dir", pair.directory),
                     "--bands")


def test_format_version_1_reads_as_half(tmp_path):
    """A store written before scoring was recorded (format 1) reads as llama-perplexity's half, and compares
    with a version-2 store of the same capture (KLD exactly 0)."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 300, size=(2, 16)).astype(np.int32)
    logits = synth_logits(rng, tokens, 300)
    old = write_store(tmp_path / "OLD.qeval", tokens, logits, 300, label="OLD", format_version=1,
                      code=SqrtLogCode(error=None))
    write_store(tmp_path / "NEW.qeval", tokens, logits, 300, label="NEW")
    raw = old.path.read_bytes()
    assert raw[8:12] == (1).to_bytes(4, "little") and b'"scoring"' not in raw[:4096]
    with StoreReader(old.path) as r:
        assert (r.header.format_version, r.header.scoring, r.header.first_scored) == (1, "half", 8)
    result, _ = api.kld_report(str(old.path), str(tmp_path / "NEW.qeval"), threads=1)
    assert result["kld"]["mean"] == 0.0 and result["same_top1"]["fraction"] == 1.0


def test_leaderboard_shows_the_deepest_band_and_draws_kld_by_depth(tmp_path):
    from qeval.present import leaderboard  # noqa: PLC0415 - matplotlib

    pair = make_pair(tmp_path / "runs", n_chunks=3, n_ctx=N_CTX, scoring="every:3")
    result, _ = api.kld_report("REF", "CAND", runs_dir=pair.directory, threads=1, save_result=True)
    board = leaderboard.leaderboard([str(pair.directory / "results")], out=tmp_path / "board")
    row = board.rows[0]
    deepest = result["by_depth"][-1]
    assert (row.deepest.name, row.deepest.kld["mean"]) == (f"{deepest['lo']}-{deepest['hi']}", deepest["kld"]["mean"])
    assert "KLD deepest band" in board.markdown()
    assert (tmp_path / "board" / "kld_by_depth.png").stat().st_size > 0
    # prose: no segment columns, and the plot by segment and category says why it is empty
    assert board.segments == () and not any(k.startswith(("kld_thinking", "kld_answer", "kld_tool_call"))
                                            for k in board.columns)
    assert "KLD answer" not in board.markdown() and "KLD <segment>" not in board.markdown()
    assert [t.get_text() for ax in board.figures()["kld_by_group"].axes for t in ax.texts] == \
        [f"no result holds {g} (conversations scored with --score assistant)" for g in ("segments", "categories")]
    assert "<svg" in (tmp_path / "board" / "kld_by_depth.svg").read_text()
