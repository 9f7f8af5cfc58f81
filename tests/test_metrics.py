"""metrics.compare on synthetic stores, and the kld / ppl / info commands end to end.

test_concurrent_chunk_reads_on_one_reader guards the fix of a real race: StoreReader once read with
seek()+read() on one handle shared by the metrics workers (now os.pread)."""

from __future__ import annotations

import csv
import json
import math
import re

import numpy as np
import pytest
from conftest import SlowSeekFile, decoded_logprobs, kld64, log_softmax64, make_pair, percentile64, run_cli, stable_topk

from qeval import api
from qeval.compare import metrics
from qeval.compare.summary import ComparisonSummary, summarize
from qeval.errors import QevalError
from qeval.present import report
from qeval.storage.store import StoreReader


def reference_per_token(pair, chunks=None):
    """Per-token metrics in float64 from the codes as written (decoded through each side's table)
    and, for the scalars, from the original logits."""
    chunks = sorted(pair.ref.logits) if chunks is None else chunks
    out = {k: [] for k in ("kld", "kld_reverse", "nll_ref", "nll_cand", "same_top1", "top5", "top10",
                           "exact_kld", "chunk", "position", "token")}
    n_vocab = pair.ref.header.n_vocab
    for c in chunks:
        lp = decoded_logprobs(pair.ref.chunks[c].codes(n_vocab), pair.ref.lut)
        lq = decoded_logprobs(pair.cand.chunks[c].codes(n_vocab), pair.cand.lut)
        out["kld"].append(kld64(lp, lq))
        out["kld_reverse"].append(kld64(lq, lp))
        xr, xc = pair.ref.logits[c], pair.cand.logits[c]
        sr, sc = log_softmax64(xr), log_softmax64(xc)
        out["exact_kld"].append(kld64(sr, sc))
        tgt = pair.ref.targets(c)
        rows = np.arange(len(tgt))
        out["nll_ref"].append(-sr[rows, tgt])
        out["nll_cand"].append(-sc[rows, tgt])
        tr, tc = stable_topk(xr, 10), stable_topk(xc, 10)
        out["same_top1"].append(tr[:, 0] == tc[:, 0])
        for k in (5, 10):
            out[f"top{k}"].append(np.array([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(tr, tc)]))
        n_ctx = pair.ref.header.n_ctx
        out["chunk"].append(np.full(len(tgt), c))
        out["position"].append(np.arange(n_ctx // 2, n_ctx - 1))  # logit positions
        out["token"].append(tgt)
    return {k: np.concatenate(v) for k, v in out.items()}


def test_compare_per_token_matches_reference(pair):
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        cmp = metrics.compare(ref, cand, threads=1)
    want = reference_per_token(pair)
    t = cmp.per_token
    assert cmp.chunks == [0, 1, 2] and cmp.scored_tokens == 3 * 7
    np.testing.assert_allclose(t["kld"], want["kld"], rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(t["kld_reverse"], want["kld_reverse"], rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(t["nll_ref"], want["nll_ref"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(t["nll_cand"], want["nll_cand"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(t["p_ref"], np.exp(-want["nll_ref"]), atol=1e-6, rtol=0)
    np.testing.assert_allclose(t["p_cand"], np.exp(-want["nll_cand"]), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(t["same_top1"], want["same_top1"])
    np.testing.assert_allclose(t["top5_agreement"], want["top5"])
    np.testing.assert_allclose(t["top10_agreement"], want["top10"])
    np.testing.assert_array_equal(t["chunk"], want["chunk"])
    np.testing.assert_array_equal(t["position"], want["position"])
    np.testing.assert_array_equal(t["token"], want["token"])
    assert list(t) == list(metrics.PER_TOKEN_FIELDS)


def test_compare_tracks_the_exact_kld_of_the_logits(tmp_path):
    p = make_pair(tmp_path, seed=5, n_chunks=2, n_ctx=32, n_vocab=5000, sigma=0.6)
    with StoreReader(p.ref.path) as ref, StoreReader(p.cand.path) as cand:
        kld = metrics.compare(ref, cand, threads=1).per_token["kld"]
    exact = reference_per_token(p)["exact_kld"]
    assert exact.mean() > 0.05
    assert abs(kld.mean() / exact.mean() - 1) < 1e-3
    np.testing.assert_allclose(kld, exact, rtol=1e-2, atol=1e-5)


def test_summary_uses_the_per_token_values(pair):
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        s = metrics.compare(ref, cand, threads=1).summary()
    want = reference_per_token(pair)
    n = len(want["kld"])
    assert s["scored_tokens"] == n and s["chunks"] == 3
    assert s["kld"]["mean"] == pytest.approx(want["kld"].mean(), rel=1e-9)
    assert s["kld"]["se"] == pytest.approx(np.std(want["kld"]) / math.sqrt(n - 1), rel=1e-6)
    assert s["kld"]["ladder"]["Maximum"] == pytest.approx(want["kld"].max(), rel=1e-9)
    assert s["kld"]["ladder"]["Median"] == pytest.approx(np.median(want["kld"]), rel=1e-9)
    assert s["kld_reverse"]["mean"] == pytest.approx(want["kld_reverse"].mean(), rel=1e-9)
    assert s["perplexity"]["ppl_ref"] == pytest.approx(math.exp(want["nll_ref"].mean()), rel=1e-6)
    assert s["perplexity"]["ppl_cand"] == pytest.approx(math.exp(want["nll_cand"].mean()), rel=1e-6)
    dp = np.exp(-want["nll_cand"]) - np.exp(-want["nll_ref"])
    assert s["delta_p"]["mean"] == pytest.approx(dp.mean(), abs=1e-6)
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt(np.mean(dp ** 2)), rel=1e-5)
    assert s["same_top1"]["fraction"] == pytest.approx(want["same_top1"].mean())
    assert s["top10_agreement"]["mean"] == pytest.approx(want["top10"].mean())


def test_abs_dp_p95_in_json_and_text(pair):
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        cmp = metrics.compare(ref, cand, threads=1)
        result = summarize(cmp).to_json()
    got = result["metrics"]["abs_dp_p95_pct"]
    t = cmp.per_token
    abs_dp = np.abs(t["p_cand"].astype(np.float64) - t["p_ref"].astype(np.float64))
    assert got["value"] == pytest.approx(100 * percentile64(abs_dp, 0.95), rel=1e-12)
    assert got["se"] is None  # a percentile has none
    # against the original logits: p is stored to within 1e-6, so |Δp| in % to within 2e-4
    want = reference_per_token(pair)
    exact = np.abs(np.exp(-want["nll_cand"]) - np.exp(-want["nll_ref"]))
    assert got["value"] == pytest.approx(100 * percentile64(exact, 0.95), abs=2e-4)
    text = report.comparison_text(ComparisonSummary.from_json(result))
    token_block = text[text.index("====== Token probability statistics ======"):]
    assert f"95.0% |Δp|: {got['value']:6.3f} %" in token_block


@pytest.mark.parametrize("n", [1, 2])
def test_chunks_option_uses_the_first_chunks(pair, n):
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        full = metrics.compare(ref, cand, threads=1)
        part = metrics.compare(ref, cand, n_chunks=n, threads=1)
    assert part.chunks == list(range(n))
    assert set(part.per_token["chunk"]) == set(range(n))
    k = n * 7
    for field in metrics.PER_TOKEN_FIELDS:
        np.testing.assert_array_equal(part.per_token[field], full.per_token[field][:k])
    want = reference_per_token(pair, chunks=list(range(n)))
    np.testing.assert_allclose(part.per_token["kld"], want["kld"], rtol=1e-9, atol=1e-13)


def test_concurrent_chunk_reads_on_one_reader(tmp_path):
    p = make_pair(tmp_path, seed=8, n_chunks=8, n_ctx=16, n_vocab=1500)
    with StoreReader(p.ref.path) as ref, StoreReader(p.cand.path) as cand:
        serial = metrics.compare(ref, cand, threads=1).per_token["kld"]
        ref._fh, cand._fh = SlowSeekFile(ref._fh), SlowSeekFile(cand._fh)
        parallel = metrics.compare(ref, cand, threads=4).per_token["kld"]
    np.testing.assert_array_equal(parallel, serial)


def test_api_compare_by_label(pair):
    cmp = api.compare("REF", "CAND", runs_dir=pair.directory, chunks=2, threads=1)
    want = reference_per_token(pair, chunks=[0, 1])
    np.testing.assert_allclose(cmp.per_token["kld"], want["kld"], rtol=1e-9, atol=1e-13)


# ------------------------------------------------------------------------------------------------
# CLI end to end
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def pair1(tmp_path):
    """One chunk of n_ctx 48 (23 scored tokens): the CLI compares it without concurrent reads."""
    return make_pair(tmp_path / "runs1", seed=4, n_chunks=1, n_ctx=48, n_vocab=2000)


def test_cli_kld_json(pair1):
    pair = pair1
    res = run_cli("kld", "--ref", "REF", "--cand", "CAND", "--json", "--runs-dir", pair.directory)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    want = reference_per_token(pair)
    assert out["scored_tokens"] == len(want["kld"]) == 23 and out["chunks"] == 1
    assert out["kld"]["mean"] == pytest.approx(want["kld"].mean(), rel=1e-9)
    assert out["kld_reverse"]["mean"] == pytest.approx(want["kld_reverse"].mean(), rel=1e-9)
    assert out["perplexity"]["ppl_ref"] == pytest.approx(math.exp(want["nll_ref"].mean()), rel=1e-6)
    assert out["perplexity"]["ppl_cand"] == pytest.approx(math.exp(want["nll_cand"].mean()), rel=1e-6)
    assert out["same_top1"]["fraction"] == pytest.approx(want["same_top1"].mean())
    assert out["reference"]["label"] == "REF" and out["candidate"]["label"] == "CAND"
    assert out["reference"]["complete"] is True and out["reference"]["n_vocab"] == 2000


def test_cli_kld_chunks_and_text_and_per_token(pair, pair1, tmp_path):
    csv_path, npz_path = tmp_path / "t.csv", tmp_path / "t.npz"
    res = run_cli("kld", "--ref", pair.ref.path, "--cand", pair.cand.path, "--chunks", "1", "--per-token",
                  csv_path, "--runs-dir", tmp_path / "nowhere")
    assert res.returncode == 0, res.stderr
    want = reference_per_token(pair, chunks=[0])
    assert "chunks    : 1 of n_ctx 16, 7 scored tokens" in res.stdout
    assert "====== KL divergence statistics ======" in res.stdout
    assert f"Mean    KLD: {want['kld'].mean():10.6f}" in res.stdout
    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 7
    np.testing.assert_allclose([float(r["kld"]) for r in rows], want["kld"], rtol=1e-8, atol=1e-15)
    assert [int(r["token"]) for r in rows] == list(want["token"])
    res = run_cli("kld", "--ref", pair1.ref.path, "--cand", pair1.cand.path, "--per-token", npz_path)
    assert res.returncode == 0, res.stderr
    with np.load(npz_path) as z:
        np.testing.assert_allclose(z["kld"], reference_per_token(pair1)["kld"], rtol=1e-9, atol=1e-13)
        np.testing.assert_array_equal(z["token"], reference_per_token(pair1)["token"])


def test_cli_ppl(pair):
    res = run_cli("ppl", "REF", "--json", "--runs-dir", pair.directory)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    nll = reference_per_token(pair)["nll_ref"]
    assert out["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    assert out["ppl_se"] == pytest.approx(math.exp(nll.mean()) * np.std(nll) / math.sqrt(len(nll) - 1), rel=1e-5)
    assert out["scored_tokens"] == len(nll) and out["chunks"] == 3
    res = run_cli("ppl", pair.cand.path, "--chunks", "1")
    assert res.returncode == 0, res.stderr
    nll1 = reference_per_token(pair, chunks=[0])["nll_cand"]
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) == pytest.approx(math.exp(nll1.mean()), rel=1e-6)


def test_cli_info(pair):
    res = run_cli("info", "REF", "--runs-dir", pair.directory)
    assert res.returncode == 0, res.stderr
    assert "bytes per scored token" in res.stdout
    assert "complete" in res.stdout and "n_vocab 2000" in res.stdout
    res = run_cli("info", pair.ref.path, "--json")
    d = json.loads(res.stdout)
    size = pair.ref.path.stat().st_size
    assert d["size_bytes"] == size and d["scored_tokens"] == 21
    assert d["bytes_per_scored_token"] == pytest.approx(size / 21)
    assert d["complete"] is True and d["chunks_present"] == 3


def test_cli_info_on_an_incomplete_store(tmp_path):
    from conftest import make_tokens, synth_logits, write_store

    rng = np.random.default_rng(3)
    tokens = make_tokens(rng, 3, 16, 1000)
    store = write_store(tmp_path / "w.qeval", tokens, synth_logits(rng, tokens, 1000), 1000, finish=False,
                        order=[0])
    res = run_cli("info", store.path)
    assert res.returncode == 0, res.stderr
    assert "INCOMPLETE" in res.stdout and "1 of 3 chunks" in res.stdout


class RowsChunk:
    """A live candidate's chunk as LiveLogitsChunk hands it over: float32 rows in decode calls of `per_call`."""

    def __init__(self, index: int, logits: np.ndarray, per_call: int):
        self.index, self.logits, self.per_call, self.n_tokens = index, logits, per_call, len(logits)

    def iter_logits(self):
        for start in range(0, self.n_tokens, self.per_call):
            rows = self.logits[start:start + self.per_call]
            yield start, rows[:2], len(rows) <= 2  # a call's rows may come in more than one piece
            if len(rows) > 2:
                yield start + 2, rows[2:], True


class RowsSource:
    """Read like LiveSource with coding off: every chunk's rows from `logits`."""

    live = complete = True

    def __init__(self, store: StoreReader, logits: dict, per_call: int = 3):
        self.header, self.tokens, self.lut, self.path = store.header, store.tokens, store.lut, "(rows)"
        self.chunk_indices, self.logits, self.per_call = store.chunk_indices, logits, per_call

    def read_chunk(self, index: int) -> RowsChunk:
        return RowsChunk(index, self.logits[index].astype(np.float32), self.per_call)


def test_uncoded_candidate_rows_match_float64(tmp_path):
    """The reference's codes against a live candidate's float32 rows (never coded), streamed in decode calls
    on a kernel pool: KLD as float64 computes it from the decoded reference and the candidate's own rows."""
    pair = make_pair(tmp_path, seed=31, n_chunks=3, n_ctx=16, n_vocab=3000)
    with StoreReader(pair.ref.path) as ref:
        cmp = metrics.compare(ref, RowsSource(ref, pair.cand.logits), threads=2)
    t = cmp.per_token
    floor = float(ref.lut[0])
    for c in sorted(pair.ref.logits):
        rows = t["chunk"] == c
        lp = decoded_logprobs(pair.ref.chunks[c].codes(3000), pair.ref.lut)
        x = pair.cand.logits[c].astype(np.float32).astype(np.float64)
        lq = log_softmax64(np.maximum(x - x.max(axis=1, keepdims=True), floor))
        np.testing.assert_allclose(t["kld"][rows], kld64(lp, lq), rtol=1e-9, atol=1e-13)
        tgt = pair.ref.targets(c)
        np.testing.assert_allclose(t["nll_cand"][rows], -log_softmax64(x)[np.arange(len(tgt)), tgt], atol=1e-12)
        np.testing.assert_array_equal(t["same_top1"][rows], lp.argmax(axis=1) == x.argmax(axis=1))
    assert t["kld"].mean() > 1e-3


def test_uncoded_candidate_with_nan_logits_is_one_message(tmp_path):
    pair = make_pair(tmp_path, seed=32, n_chunks=2, n_ctx=16, n_vocab=500)
    bad = {c: x.copy() for c, x in pair.cand.logits.items()}
    bad[1][3, 7] = np.nan
    with StoreReader(pair.ref.path) as ref:
        with pytest.raises(QevalError, match="chunk 1: the candidate model produced invalid logits"):
            metrics.compare(ref, RowsSource(ref, bad), threads=2)
