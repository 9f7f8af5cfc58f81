"""qeval.compare.sampler: parsing, the selection kernel, and llama.cpp's chain (top-k -> top-p -> min-p ->
temperature) on stored rows, each against a plain float64 numpy implementation written here; then
compare(), the JSON/text/results outputs and `qeval kld --sampler` end to end.

The reference works on decoded rows only (e = exp(lut[code]), l = lut[code]): it sorts by l, never by
code, so a selection by code that disagreed with the order of log-probabilities would fail here.
Its total mass Z of a row (used by top-p without top-k) is a running sum in token-id order, as
llama.cpp's softmax and kernels.pair_sums compute it, so cut decisions compare bit for bit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_cli_error, make_pair, run_cli

from qeval import api
from qeval.compare import metric_registry, metrics, sampler
from qeval.compare.sampler import PRESETS, Sampler
from qeval.compare.summary import ComparisonSummary, summarize
from qeval.engine.engine import EngineSettings
from qeval.errors import QevalError
from qeval.present import report, results
from qeval.storage.codec import SqrtLogCode
from qeval.storage.store import StoreReader

LUT = SqrtLogCode().lut()


# --------------------------------------------------------------------------------------------------
# the float64 reference
# --------------------------------------------------------------------------------------------------
def chain64(codes: np.ndarray, lut: np.ndarray, s: Sampler, argmax: int) -> dict[int, float]:
    """llama.cpp's chain on one decoded row: {token id: probability of being drawn}."""
    if s.temperature <= 0:
        return {int(argmax): 1.0}
    l = np.asarray(lut, np.float64)[np.asarray(codes)]
    e = np.exp(l)
    n_vocab = len(l)
    order = np.lexsort((np.arange(n_vocab), -l))  # descending log p, ties to the lower id
    keep = order[:s.top_k] if s.top_k > 0 else order
    if s.top_p < 1.0:
        z = np.cumsum(e[keep])[-1] if s.top_k > 0 else np.cumsum(e)[-1]  # after top-k: over its survivors
        crossed = np.flatnonzero(np.cumsum(e[keep] / z) >= s.top_p)
        if len(crossed):
            keep = keep[:crossed[0] + 1]  # the token that reaches p stays
    if s.min_p > 0.0:
        ok = l[keep] >= l[keep[0]] + math.log(s.min_p)
        ok[0] = True
        keep = keep[:np.argmin(ok)] if not ok.all() else keep
    w = np.exp(l[keep] / s.temperature)
    return dict(zip(keep.tolist(), (w / w.sum()).tolist()))


def figures64(a: dict[int, float], b: dict[int, float]) -> tuple[float, bool, int, int]:
    """(TVD over the union, supports differ, |support a|, |support b|)."""
    tvd = 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))
    return tvd, set(a) != set(b), len(a), len(b)


def planes_of(codes: np.ndarray) -> np.ndarray:
    codes = np.atleast_2d(np.asarray(codes, np.uint16))
    planes = np.empty((codes.shape[0], 2, codes.shape[1]), np.uint8)
    planes[:, 0], planes[:, 1] = codes >> 8, codes & 0xFF
    return planes


def run_rows(samplers, codes_p, codes_q, lut_p=LUT, lut_q=LUT) -> list[tuple[np.ndarray, ...]]:
    """The kernel on rows of codes: per sampler, in order, (tvd, differs, n_p, n_q) per row."""
    codes_p, codes_q = np.atleast_2d(codes_p), np.atleast_2d(codes_q)
    n, n_vocab = codes_p.shape
    prep = sampler.prepare(samplers, lut_p, lut_q, n_vocab)
    sums = np.zeros((n, 6))
    sums[:, 0] = np.cumsum(np.exp(np.asarray(lut_p, np.float64)[codes_p]), axis=1)[:, -1]
    sums[:, 1] = np.cumsum(np.exp(np.asarray(lut_q, np.float64)[codes_q]), axis=1)[:, -1]
    out = prep.new_output(n)
    sampler.run_block(prep, planes_of(codes_p), planes_of(codes_q), sums, out)
    # the stored argmax stands for the float logits' one: here the first highest code (lowest id)
    cols = sampler.chunk_columns(prep, out, np.argmax(codes_p, axis=1), np.argmax(codes_q, axis=1))
    return [tuple(cols[sampler.column(k, s.name)] for k in sampler.COLUMN_KINDS) for s in prep.samplers]


# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
def test_presets():
    assert sampler.parse("greedy") == Sampler("greedy", 0.0) and sampler.parse("greedy").greedy
    t = sampler.parse("qwen3.5-thinking")
    assert (t.temperature, t.top_k, t.top_p, t.min_p) == (0.6, 20, 0.95, 0.0)
    i = sampler.parse("Qwen3.5-Instruct")
    assert (i.name, i.temperature, i.top_k, i.top_p, i.min_p) == ("qwen3.5-instruct", 0.7, 20, 0.8, 0.0)
    d = sampler.parse("llama.cpp-default")  # common/common.h common_params_sampling
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (0.8, 40, 0.95, 0.05)
    assert set(PRESETS) == {"greedy", "qwen3.5-thinking", "qwen3.5-instruct", "llama.cpp-default"}


def test_settings_strings_name_themselves_canonically():
    s = sampler.parse("temp=0.6,top_k=20,top_p=0.95,min_p=0")
    assert s.name == "temp=0.6,top_k=20,top_p=0.95,min_p=0"
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.6, 20, 0.95, 0.0)
    # keys left out are off; order, spaces and aliases do not matter; the name parses back to the same sampler
    s = sampler.parse(" top-p = 0.9 , temperature=1.5 ")
    assert s.name == "temp=1.5,top_k=0,top_p=0.9,min_p=0"
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (1.5, 0, 0.9, 0.0)
    assert sampler.parse(s.name) == s
    assert sampler.parse("temp=0").greedy
    assert not sampler.parse("temp=1").truncates and sampler.parse("min_p=0.1").truncates
    assert [x.name for x in sampler.parse_all(["greedy", "greedy", s, s.name])] == ["greedy", s.name]
    # a Sampler value is named by what it computes; odd values read back exactly
    odd = sampler.parse_all([Sampler("mine", 0.7, top_k=3, top_p=0.123456789)])[0]
    assert odd.name == "temp=0.7,top_k=3,top_p=0.123456789,min_p=0" and sampler.parse(odd.name) == odd
    with pytest.raises(QevalError, match="top_p must be between 0 and 1"):
        sampler.parse_all([Sampler("bad", 1.0, top_p=2.0)])


@pytest.mark.parametrize("text, fragment", [
    ("", "unknown preset"), ("qwen9", "unknown preset"), ("temp", "unknown preset"),
    ("temp=", "not key=value"), ("=1", "not key=value"), ("temp=1,", "not key=value"),
    ("tmp=1", "unknown setting 'tmp'"), ("temp=1,temp=2", "given twice"), ("temp=hot", "not a number"),
    ("temp=nan", "not a finite number"), ("top_p=inf", "not a finite number"), ("temp=-0.5", "temp must be >= 0"),
    ("top_k=2.5", "top_k must be an integer"), ("top_k=-1", "top_k must be an integer"),
    ("top_p=1.5", "top_p must be between 0 and 1"), ("min_p=-0.1", "min_p must be between 0 and 1"),
])
def test_bad_sampler_strings(text, fragment):
    with pytest.raises(QevalError) as err:
        sampler.parse(text)
    msg = str(err.value)
    assert fragment in msg and msg.startswith(f"--sampler {text!r}") and "qwen3.5-thinking" in msg
    assert "\n" not in msg


# --------------------------------------------------------------------------------------------------
# selection: the n best (code desc, id asc), block skipping included
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_vocab", [7, 64, 300, 5000])
def test_select_top_is_a_stable_sort_by_code(n_vocab):
    rng = np.random.default_rng(n_vocab)
    for trial in range(6):
        if trial % 2:  # heavy ties: few distinct codes, a few high ones
            codes = rng.integers(0, 40, n_vocab)
            codes[rng.choice(n_vocab, min(5, n_vocab), replace=False)] = rng.integers(60000, 65536, min(5, n_vocab))
        else:
            codes = rng.integers(0, 65536, n_vocab)
        codes = codes.astype(np.uint16)
        planes = planes_of(codes)[0]
        want = np.lexsort((np.arange(n_vocab), -codes.astype(np.int64)))
        n_blocks = (n_vocab + sampler.BLOCK - 1) // sampler.BLOCK
        bor = np.empty(n_blocks, np.uint8)
        order = np.empty(n_blocks, np.int32)
        sampler._block_or(planes[0], bor)
        sampler._block_order(bor, order)
        hi_or = [np.bitwise_or.reduce(planes[0][j * sampler.BLOCK:(j + 1) * sampler.BLOCK]) for j in range(n_blocks)]
        np.testing.assert_array_equal(bor, hi_or)
        for n in sorted({1, 3, 20, 64, 257, n_vocab} & set(range(1, n_vocab + 1))):
            hc, hid, oc, oi = (np.empty(n, np.int32) for _ in range(4))
            got = sampler._select_top(planes[0], planes[1], bor, order, n, hc, hid, oc, oi)
            assert got == n
            np.testing.assert_array_equal(oi, want[:n])
            np.testing.assert_array_equal(oc, codes[want[:n]])


# --------------------------------------------------------------------------------------------------
# llama.cpp's cut rules, on rows made to sit on each boundary
# --------------------------------------------------------------------------------------------------
def crafted_row(n_vocab: int = 200, seed: int = 0) -> np.ndarray:
    """A tail of low codes, then: id 5 the argmax, ids 2 and 9 tied second, id 1 fourth, id 40 fifth."""
    codes = np.random.default_rng(seed).integers(0, 3000, n_vocab).astype(np.uint16)
    codes[5], codes[2], codes[9], codes[1], codes[40] = 65535, 64000, 64000, 63000, 62000
    return codes


def kernel_support(codes: np.ndarray, s: Sampler) -> int:
    """The kernel's support size for a row (against a row that is all tail but the same argmax), after
    checking its TVD and support sizes against the reference's."""
    other = np.zeros_like(codes)
    other[int(np.argmax(codes))] = 65535
    tvd, differs, n_p, n_q = (v[0] for v in run_rows([s], codes, other)[0])
    want = figures64(chain64(codes, LUT, s, int(np.argmax(codes))), chain64(other, LUT, s, int(np.argmax(codes))))
    assert tvd == pytest.approx(want[0], abs=1e-12) and (bool(differs), n_p, n_q) == want[1:]
    return int(n_p)


def test_top_k_ties_at_the_boundary_go_to_the_lower_id():
    codes = crafted_row()
    for k, ids in ((1, [5]), (2, [5, 2]), (3, [5, 2, 9]), (4, [5, 2, 9, 1])):
        s = Sampler(f"k{k}", 1.0, top_k=k)
        assert sorted(chain64(codes, LUT, s, 5)) == sorted(ids)
        assert kernel_support(codes, s) == len(ids)
    # which of the tied pair survives shows in the TVD against a row that holds only id 9 beside the argmax
    s = Sampler("k2", 1.0, top_k=2)
    other = np.zeros_like(codes)
    other[5], other[9] = 65535, 64000
    got = run_rows([s], codes, other)[0]
    want = figures64(chain64(codes, LUT, s, 5), chain64(other, LUT, s, 5))
    assert want[1] and bool(got[1][0]) and want[0] > 0.01
    assert got[0][0] == pytest.approx(want[0], abs=1e-12)


def test_top_p_keeps_the_token_that_reaches_p_exactly():
    codes = crafted_row()
    e = np.exp(LUT.astype(np.float64)[codes])
    for top_k in (5, 0):
        order = np.lexsort((np.arange(len(codes)), -codes.astype(np.int64)))
        keep = order[:top_k] if top_k else order
        z = np.cumsum(e[keep])[-1] if top_k else np.cumsum(e)[-1]
        cum = np.cumsum(e[keep] / z)
        for j in (0, 1, 2, 3):
            at = float(cum[j])  # p exactly equal to the cumulative mass of the first j+1 tokens
            for p, n_keep in ((at, j + 1), (float(np.nextafter(at, 2.0)), j + 2), (float(np.nextafter(at, -1.0)), j + 1)):
                s = Sampler("p", 0.7, top_k=top_k, top_p=p)
                assert len(chain64(codes, LUT, s, 5)) == n_keep
                assert kernel_support(codes, s) == n_keep, (top_k, j, p)
    # the tie at 2/9: a cut that takes one of them takes id 2
    s = Sampler("p", 1.0, top_k=5, top_p=float(np.cumsum(e[[5, 2, 9, 1, 40]] / e[[5, 2, 9, 1, 40]].sum())[1]))
    assert sorted(chain64(codes, LUT, s, 5)) == [2, 5]
    # p = 0 keeps the top token; p = 1 is off
    assert kernel_support(codes, Sampler("p0", 1.0, top_p=0.0)) == 1
    assert kernel_support(codes, Sampler("p1", 1.0, top_k=7, top_p=1.0)) == 7


def test_min_p_keeps_tokens_exactly_at_the_floor():
    codes = crafted_row()
    l = LUT.astype(np.float64)

    def exact_min_p(d: float) -> float | None:
        """A min_p whose log is exactly d (log skips some doubles: not every level has one)."""
        x = math.exp(d)
        for _ in range(16):
            if math.log(x) == d:
                return x
            x = float(np.nextafter(x, 0.0 if math.log(x) > d else 1.0))
        return None

    # id 1 (fourth) on a code between id 40's and the tied pair's whose level some min_p hits exactly
    code = next(c for c in range(63000, 63999) if exact_min_p(float(l[c] - l[65535])) is not None)
    codes[1] = code
    d = float(l[code] - l[65535])
    min_p = exact_min_p(d)
    assert math.log(min_p) == d
    above = min_p
    while math.log(above) == d:  # the next min_p whose log is above id 1's level
        above = float(np.nextafter(above, 1.0))
    for mp, n_keep in ((min_p, 4), (above, 3)):
        s = Sampler("m", 1.0, min_p=mp)
        assert len(chain64(codes, LUT, s, 5)) == n_keep
        assert kernel_support(codes, s) == n_keep
    s = Sampler("m", 1.0, min_p=min_p)
    assert sorted(chain64(codes, LUT, s, 5)) == [1, 2, 5, 9] and kernel_support(codes, s) == 4
    assert kernel_support(codes, Sampler("m1", 1.0, min_p=1.0)) == 1  # only the top token reaches p_max


def test_temperature_reshapes_only_what_survives():
    codes = crafted_row()
    s = Sampler("t", 0.5, top_k=3)
    probs = chain64(codes, LUT, s, 5)
    l = LUT.astype(np.float64)[codes]
    w = np.exp(l[[5, 2, 9]] / 0.5)
    assert [probs[i] for i in (5, 2, 9)] == pytest.approx(list(w / w.sum()), rel=1e-12)
    assert kernel_support(codes, s) == 3


def test_greedy_uses_the_stored_argmax():
    codes_p = crafted_row(seed=1)
    g = PRESETS["greedy"]
    prep = sampler.prepare([g], LUT, LUT, len(codes_p))
    assert prep.kernel == []  # no kernel work at all
    cols = sampler.chunk_columns(prep, prep.new_output(3), np.array([5, 5, 7]), np.array([5, 6, 7]))
    np.testing.assert_array_equal(cols["tvd@greedy"], [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(cols["support_differs@greedy"], [False, True, False])
    np.testing.assert_array_equal(cols["support_ref@greedy"], [1, 1, 1])


def test_a_sampler_that_truncates_nothing_compares_whole_rows():
    rng = np.random.default_rng(4)
    codes_p = rng.integers(0, 65536, (3, 500)).astype(np.uint16)
    codes_q = rng.integers(0, 65536, (3, 500)).astype(np.uint16)
    s = sampler.parse("temp=1.3")
    got = run_rows([s], codes_p, codes_q)[0]
    for t in range(3):
        want = figures64(chain64(codes_p[t], LUT, s, 0), chain64(codes_q[t], LUT, s, 0))
        assert got[0][t] == pytest.approx(want[0], rel=1e-9, abs=1e-14)
        assert not got[1][t] and got[2][t] == got[3][t] == 500


# --------------------------------------------------------------------------------------------------
# every chain on stored rows: compare() against the reference, token by token
# --------------------------------------------------------------------------------------------------
SAMPLERS = ["greedy", "qwen3.5-thinking", "qwen3.5-instruct", "llama.cpp-default", "temp=0.9,top_p=0.999",
            "temp=1,min_p=0.001", "temp=0.5,top_k=1500,top_p=0.9999", "temp=1.2,top_k=3", "top_p=0.9,min_p=0.02",
            "temp=2"]


@pytest.mark.parametrize("sigma, n_vocab", [(0.5, 2000), (3.0, 700)])
def test_compare_matches_the_float64_chain(tmp_path, sigma, n_vocab):
    """Realistic rows (a few dominant tokens over a heavy tail; the flat ones at sigma 3 make top-p reach deep
    into code ties and grow the candidate set), every kind of sampler, one pass."""
    pair = make_pair(tmp_path, seed=3, n_chunks=3, n_ctx=32, n_vocab=n_vocab, sigma=sigma)
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        cmp = metrics.compare(ref, cand, threads=2, samplers=SAMPLERS)
        plain = metrics.compare(ref, cand, threads=1)
    t = cmp.per_token
    for k in metrics.PER_TOKEN_FIELDS:  # the samplers change nothing else
        np.testing.assert_array_equal(t[k], plain.per_token[k])
    samplers = sampler.parse_all(SAMPLERS)
    row = 0
    deep = 0
    for c in sorted(pair.ref.chunks):
        cp, cq = pair.ref.chunks[c].codes(n_vocab), pair.cand.chunks[c].codes(n_vocab)
        ap, aq = pair.ref.chunks[c].top_ids[:, 0], pair.cand.chunks[c].top_ids[:, 0]
        for i in range(len(cp)):
            for s in samplers:
                want = figures64(chain64(cp[i], pair.ref.lut, s, ap[i]), chain64(cq[i], pair.cand.lut, s, aq[i]))
                got = [t[sampler.column(k, s.name)][row] for k in sampler.COLUMN_KINDS]
                tol = 1e-9 if not s.truncates and not s.greedy else 1e-12
                assert got[0] == pytest.approx(want[0], rel=tol, abs=1e-13), (c, i, s.name)
                assert (bool(got[1]), int(got[2]), int(got[3])) == want[1:], (c, i, s.name)
                deep += s.top_k == 0 and s.truncates and max(want[2:]) > sampler.OPEN_START
            row += 1
    assert row == cmp.scored_tokens
    np.testing.assert_array_equal(t["tvd@greedy"], 1.0 - t["same_top1"])
    if sigma > 1:
        assert deep > 0  # some top-p supports outgrew the first candidate set


def test_summary_block_and_registry_metrics(tmp_path):
    pair = make_pair(tmp_path, seed=6, n_chunks=2, n_ctx=32, n_vocab=1000)
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        cmp = metrics.compare(ref, cand, threads=1, samplers=["greedy", "qwen3.5-thinking"])
        summary = summarize(cmp)
        result = summary.to_json()
    t = cmp.per_token
    block = result["samplers"]
    assert list(block) == ["greedy", "qwen3.5-thinking"]
    b = block["qwen3.5-thinking"]
    tvd = t["tvd@qwen3.5-thinking"]
    n = len(tvd)
    assert b["settings"] == {"temp": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
    assert b["tvd"]["mean"] == pytest.approx(tvd.mean(), rel=1e-12)
    assert b["tvd"]["se"] == pytest.approx(np.std(tvd) / math.sqrt(n - 1), rel=1e-9)
    assert b["tvd"]["ladder"]["Maximum"] == tvd.max() and b["tvd"]["ladder"]["Median"] == pytest.approx(np.median(tvd))
    assert b["agreement"]["mean"] == pytest.approx(1 - tvd.mean(), rel=1e-12)
    assert b["support_differs"]["fraction"] == pytest.approx(t["support_differs@qwen3.5-thinking"].mean())
    assert b["greedy_agreement"]["fraction"] == pytest.approx(t["same_top1"].mean())
    assert b["support"]["ref_mean"] == pytest.approx(t["support_ref@qwen3.5-thinking"].mean())
    assert 0 < b["tvd"]["mean"] < 1 and 1 <= b["support"]["ref_mean"] <= 20
    m = result["metrics"]
    assert m["tvd_pct@qwen3.5-thinking"]["value"] == pytest.approx(100 * tvd.mean(), rel=1e-12)
    assert m["agreement_pct@qwen3.5-thinking"]["value"] == pytest.approx(100 * (1 - tvd.mean()), rel=1e-12)
    assert m["support_differs_pct@qwen3.5-thinking"]["value"] == pytest.approx(
        100 * b["support_differs"]["fraction"], rel=1e-12)
    held = summary.measured()
    assert held["tvd_pct@greedy"].value == pytest.approx(100 * (1 - t["same_top1"].mean()))
    assert metric_registry.lookup("tvd_pct@qwen3.5-thinking").better == "lower"
    assert metric_registry.lookup("tvd_pct@no-such-preset") is None
    text = report.comparison_text(summary)
    block_text = text[text.index("====== Sampler qwen3.5-thinking: temp 0.6, top_k 20, top_p 0.95 ======"):]
    assert f"Mean    TVD     : {100 * b['tvd']['mean']:7.3f} ± {100 * b['tvd']['se']:6.3f} %" in block_text
    assert f"Greedy agreement: {100 * b['greedy_agreement']['fraction']:7.3f}" in block_text
    assert "====== Sampler greedy: temperature 0 (greedy: argmax) ======" in text


def test_saved_results_keep_the_samplers(tmp_path):
    pair = make_pair(tmp_path / "runs", seed=2, n_chunks=3, n_ctx=16, n_vocab=800)
    result, _ = api.kld_report("REF", "CAND", runs_dir=pair.directory, threads=1, save_result=True,
                               samplers=["qwen3.5-instruct", "temp=0.8,top_p=0.9"])
    name = "temp=0.8,top_k=0,top_p=0.9,min_p=0"
    assert set(result["samplers"]) == {"qwen3.5-instruct", name}
    saved = results.load_result(pair.directory / "results" / "CAND.vs.REF.json")
    assert saved.summary.samplers == json.loads(json.dumps(result["samplers"]))
    assert f"tvd@{name}" in saved.per_token and "support_cand@qwen3.5-instruct" in saved.per_token
    part = saved.restricted([0, 1])  # recomputed from the per-token values: the sampler block too
    keep = saved.per_token["chunk"] < 2
    assert part.summary.samplers[name]["tvd"]["mean"] == pytest.approx(saved.per_token[f"tvd@{name}"][keep].mean())
    assert f"tvd_pct@{name}" in part.summary.measured()


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def test_cli_kld_with_samplers(tmp_path):
    pair = make_pair(tmp_path / "runs", seed=4, n_chunks=1, n_ctx=48, n_vocab=2000)
    csv_path = tmp_path / "t.csv"
    res = run_cli("kld", "--ref", "REF", "--cand", "CAND", "--json", "--runs-dir", pair.directory,
                  "--sampler", "greedy", "--sampler", "qwen3.5-thinking", "--sampler", "temp=0.7, top_p=0.8",
                  "--per-token", csv_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    names = ["greedy", "qwen3.5-thinking", "temp=0.7,top_k=0,top_p=0.8,min_p=0"]
    assert list(out["samplers"]) == names
    samplers = sampler.parse_all(names)
    cp, cq = pair.ref.chunks[0].codes(2000), pair.cand.chunks[0].codes(2000)
    ap, aq = pair.ref.chunks[0].top_ids[:, 0], pair.cand.chunks[0].top_ids[:, 0]
    for s in samplers:
        want = [figures64(chain64(cp[i], pair.ref.lut, s, ap[i]), chain64(cq[i], pair.cand.lut, s, aq[i]))
                for i in range(len(cp))]
        b = out["samplers"][s.name]
        assert b["tvd"]["mean"] == pytest.approx(np.mean([w[0] for w in want]), rel=1e-11, abs=1e-15)
        assert b["support_differs"]["fraction"] == pytest.approx(np.mean([w[1] for w in want]))
        assert b["support"]["cand_mean"] == pytest.approx(np.mean([w[3] for w in want]))
        assert b["greedy_agreement"]["fraction"] == out["same_top1"]["fraction"]
    header = csv_path.read_text().splitlines()[0].split(",")
    assert header[:len(metrics.PER_TOKEN_FIELDS)] == list(metrics.PER_TOKEN_FIELDS)
    assert "tvd@qwen3.5-thinking" in header and "support_differs@greedy" in header
    text = run_cli("kld", "--ref", "REF", "--cand", "CAND", "--runs-dir", pair.directory, "--sampler",
                   "qwen3.5-thinking")
    assert text.returncode == 0, text.stderr
    assert "====== Sampler qwen3.5-thinking: temp 0.6, top_k 20, top_p 0.95 ======" in text.stdout
    assert "Agreement       :" in text.stdout and "Support differs :" in text.stdout


def test_cli_refuses_a_bad_sampler_before_any_work(tmp_path):
    res = run_cli("kld", "--ref", "nowhere", "--cand", "nothing", "--runs-dir", tmp_path, "--sampler", "top_p=2")
    assert res.returncode == 2
    assert_cli_error(res, "--sampler 'top_p=2'", "top_p must be between 0 and 1")


# --------------------------------------------------------------------------------------------------
# the release gate: --max-tvd per sampler
# --------------------------------------------------------------------------------------------------
def test_cli_check_max_tvd_per_sampler(tmp_path):
    pair = make_pair(tmp_path / "runs", seed=1, n_chunks=6, n_ctx=32, n_vocab=1000, sigma=0.8)
    runs = pair.directory
    result, _ = api.kld_report("REF", "CAND", runs_dir=runs, threads=1, save_result=True,
                               samplers=["greedy", "qwen3.5-thinking"])
    tvd = {name: b["tvd"] for name, b in result["samplers"].items()}
    assert 0.05 < tvd["qwen3.5-thinking"]["mean"] < 0.95
    # computed now, one check per --sampler, judged like every threshold (its 95 % interval: t over 6 chunks, 2.57 SEs)
    loose = 100 * (tvd["qwen3.5-thinking"]["mean"] + 3 * tvd["qwen3.5-thinking"]["se"])
    res = run_cli("check", "--ref", "REF", "--cand", "CAND", "--runs-dir", runs, "--sampler", "qwen3.5-thinking",
                  "--max-tvd", f"{loose:.6f}", "--json")
    assert res.returncode == 0, res.stderr
    two = run_cli("check", "--ref", "REF", "--cand", "CAND", "--runs-dir", runs, "--sampler", "qwen3.5-thinking",
                  "--max-tvd", f"{loose:.6f}", "--chunks", "2")
    assert two.returncode == 3 and "UNDECIDED  max-tvd@qwen3.5-thinking" in two.stdout, two.stdout + two.stderr
    checks = json.loads(res.stdout)["checks"]
    assert [c["name"] for c in checks] == ["max-tvd@qwen3.5-thinking"]
    assert checks[0]["value"] == pytest.approx(100 * tvd["qwen3.5-thinking"]["mean"], rel=1e-12)
    assert checks[0]["se"] == pytest.approx(100 * tvd["qwen3.5-thinking"]["se"], rel=1e-9)
    tight = 100 * (tvd["qwen3.5-thinking"]["mean"] - 3 * tvd["qwen3.5-thinking"]["se"])
    res = run_cli("check", "--ref", "REF", "--cand", "CAND", "--runs-dir", runs, "--sampler", "qwen3.5-thinking",
                  "--max-tvd", f"{tight:.6f}")
    assert res.returncode == 1, res.stderr
    assert "FAIL  max-tvd@qwen3.5-thinking" in res.stdout
    # a saved result: every sampler it holds, or those named; one it lacks is refused
    saved = runs / "results" / "CAND.vs.REF.json"
    res = run_cli("check", "--ref", "REF", "--cand", saved, "--runs-dir", runs, "--max-tvd", "100", "--json")
    assert res.returncode == 0, res.stderr
    assert [c["name"] for c in json.loads(res.stdout)["checks"]] == ["max-tvd@greedy", "max-tvd@qwen3.5-thinking"]
    res = run_cli("check", "--ref", "REF", "--cand", saved, "--runs-dir", runs, "--max-tvd", "100", "--sampler",
                  "qwen3.5-instruct")
    assert_cli_error(res, "holds no figures for sampler qwen3.5-instruct", "--sampler qwen3.5-instruct --save-result")
    # without any sampler figures: refused before any work
    res = run_cli("check", "--ref", "REF", "--cand", "CAND", "--runs-dir", runs, "--max-tvd", "5")
    assert_cli_error(res, "--max-tvd needs --sampler")


def test_sampler_figures_survive_a_baseline_round_trip(tmp_path):
    from qeval.storage.baselines import load_baseline  # noqa: PLC0415

    pair = make_pair(tmp_path / "runs", seed=2, n_chunks=2, n_ctx=32, n_vocab=1000, sigma=0.8)
    runs = pair.directory
    result, _ = api.kld_report("REF", "CAND", runs_dir=runs, threads=1, save_result=True, samplers=["greedy"])
    base = tmp_path / "mine.json"
    res = run_cli("baseline", "from-result", runs / "results" / "CAND.vs.REF.json", "-o", base)
    assert res.returncode == 0, res.stderr
    entry = load_baseline(base, metric_registry).entries[0]
    assert entry.metrics["tvd_pct@greedy"].value == result["metrics"]["tvd_pct@greedy"]["value"]
    shown = run_cli("baseline", "show", base)
    assert shown.returncode == 0 and "tvd_pct@greedy" in shown.stdout, shown.stderr
    # the run is its own baseline: every metric, sampler figures included, is judged and passes
    res = run_cli("check", "--ref", "REF", "--cand", runs / "results" / "CAND.vs.REF.json", "--runs-dir", runs,
                  "--baseline", base, "--json")
    assert res.returncode == 0, res.stderr
    judged = [c["metric"] for c in json.loads(res.stdout)["checks"]]
    assert "tvd_pct@greedy" in judged and "kld_mean" in judged
    doc = json.loads(base.read_text())
    doc["entries"][0]["metrics"]["tvd_pct@nonsense"] = {"value": 1.0}
    base.write_text(json.dumps(doc))
    assert_cli_error(run_cli("baseline", "show", base), "metric 'tvd_pct@nonsense'", "tvd_pct@NAME")


# --------------------------------------------------------------------------------------------------
# paired comparisons: the TVD after a sampler pairs chunk by chunk like KLD
# --------------------------------------------------------------------------------------------------
def test_cli_compare_pairs_the_tvd(tmp_path):
    from synth_runs import make_runs  # noqa: PLC0415

    from qeval.compare.paired_stats import chunk_means  # noqa: PLC0415

    runs = make_runs(tmp_path / "runs")
    res = run_cli("compare", "--ref", "REF", "--cand", "A", "--cand", "B", "--runs-dir", runs, "--sampler",
                  "qwen3.5-thinking", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    d = out["differences"]["tvd_pct@qwen3.5-thinking"]
    with StoreReader(runs / "REF.qeval") as ref, StoreReader(runs / "A.qeval") as a, \
            StoreReader(runs / "B.qeval") as b:
        ta = metrics.compare(ref, a, threads=1, samplers=["qwen3.5-thinking"]).per_token
        tb = metrics.compare(ref, b, threads=1, samplers=["qwen3.5-thinking"]).per_token
    per_chunk = chunk_means(ta["tvd@qwen3.5-thinking"] - tb["tvd@qwen3.5-thinking"], ta["chunk"]) * 100
    assert d["diff"] == pytest.approx(per_chunk.mean(), rel=1e-9)
    assert d["se"] == pytest.approx(np.std(per_chunk, ddof=1) / math.sqrt(len(per_chunk)), rel=1e-9)
    assert d["mean_a"] == pytest.approx(100 * ta["tvd@qwen3.5-thinking"].mean(), rel=1e-9)
    assert d["significant"] and d["diff"] < 0  # A is the lighter perturbation
    assert any("lower TVD @qwen3.5-thinking" in v for v in out["verdicts"])
    text = run_cli("compare", "--ref", "REF", "--cand", "A", "--cand", "B", "--runs-dir", runs, "--sampler", "greedy")
    assert text.returncode == 0, text.stderr
    assert "mean TVD % @greedy" in text.stdout


def test_cli_compare_refuses_saved_results_without_the_sampler(tmp_path):
    from synth_runs import make_runs  # noqa: PLC0415

    runs = make_runs(tmp_path / "runs")
    for label in ("A", "B"):
        api.kld_report("REF", label, runs_dir=runs, threads=1, save_result=True, samplers=["qwen3.5-thinking"])
    saved = [runs / "results" / f"{label}.vs.REF.json" for label in ("A", "B")]
    res = run_cli("compare", "--ref", "REF", "--cand", saved[0], "--cand", saved[1], "--runs-dir", runs, "--sampler",
                  "greedy")
    assert_cli_error(res, "holds no figures for sampler greedy", "--sampler greedy --save-result")
    res = run_cli("compare", "--ref", "REF", "--cand", saved[0], "--cand", saved[1], "--runs-dir", runs, "--json")
    assert res.returncode == 0, res.stderr
    assert "tvd_pct@qwen3.5-thinking" in json.loads(res.stdout)["differences"]


# --------------------------------------------------------------------------------------------------
# matrices: the samplers are part of what a pair measured
# --------------------------------------------------------------------------------------------------
def test_a_matrix_pair_is_measured_with_its_samplers_and_reused_only_for_them(tmp_path, monkeypatch):
    from qeval import identity  # noqa: PLC0415
    from qeval.orchestrate import distributed, matrix  # noqa: PLC0415

    pair = make_pair(tmp_path / "runs", seed=5, n_chunks=2, n_ctx=16, n_vocab=800)
    runs, saved = pair.directory, pair.directory / "results" / "CAND.vs.REF.json"
    api.kld_report("REF", "CAND", runs_dir=runs, threads=1, save_result=True)  # without samplers
    # the candidate's model is the one its store was captured from (planning reads no GGUF here)
    monkeypatch.setattr(matrix, "model_facts", lambda path: {})
    monkeypatch.setattr(identity, "planned_producer", lambda *a, **k: identity.producer(pair.cand.header))

    def plan(*samplers) -> tuple[matrix.MatrixPlan, matrix.PairPlan]:
        p = matrix.plan_matrix(matrix.MatrixRequest(ref_label="REF", ref_path="ref.gguf", pairs=(("CAND", "cand.gguf", "f16"),),
                                                    directory=runs, n_ctx=16,
                                                    engine=EngineSettings(n_threads=1), samplers=samplers))
        with StoreReader(runs / "REF.qeval") as ref:
            return p, matrix.plan_pair(ref, 2, "CAND", "cand.gguf", p.pairs[0].settings, runs, p.samplers)

    assert plan()[1].action == matrix.SKIP  # the request a result saved without samplers answers
    chosen, todo = plan("qwen3.5-thinking", "greedy")
    assert (todo.action, todo.samplers) == (matrix.COMPARE_STORED, ("qwen3.5-thinking", "greedy"))
    assert todo.note == ("CAND: recomputed: its saved result answers another request (samplers: none vs "
                         "{temp=0,top_k=0,top_p=1,min_p=0; temp=0.6,top_k=20,top_p=0.95,min_p=0}, saved vs now)")
    # the Ray executor runs the same plan, samplers kept, and its task the same pair plan (in its CompareSpec)
    assert distributed.on_cluster(chosen, 1).samplers == ("qwen3.5-thinking", "greedy")
    distributed.run_compare(distributed.CompareSpec(ref="REF", pair=todo, runs_dir=str(runs), chunks=2, threads=1))
    summary = json.loads(saved.read_text())
    direct, _ = api.kld_report("REF", "CAND", runs_dir=runs, threads=1, samplers=["qwen3.5-thinking", "greedy"])
    assert summary["samplers"] == json.loads(json.dumps(direct["samplers"]))
    assert summary["request"] == direct["request"]
    assert summary["request"]["samplers"] == ["temp=0,top_k=0,top_p=1,min_p=0",
                                              "temp=0.6,top_k=20,top_p=0.95,min_p=0"]
    # reused for the same samplers, in any order and under any name of their settings; not for fewer
    assert plan("greedy", "temp=0.6,top_k=20,top_p=0.95")[1].action == matrix.SKIP
    assert plan("greedy")[1].action == matrix.COMPARE_STORED
    # the matrix shows one mean TVD per sampler and pair, under the names asked for
    again, _ = plan("greedy", "temp=0.6,top_k=20,top_p=0.95")
    result, text = matrix.matrix_result(again, matrix.MatrixRun("", [], [ComparisonSummary.from_json(summary)]))
    row = result["rows"][0]
    for name, held in (("greedy", "greedy"), ("temp=0.6,top_k=20,top_p=0.95,min_p=0", "qwen3.5-thinking")):
        tvd = summary["samplers"][held]["tvd"]
        assert (row[f"tvd_pct@{name}"], row[f"tvd_pct@{name}_se"]) == pytest.approx((100 * tvd["mean"],
                                                                                    100 * tvd["se"]), rel=1e-12)
        assert f"mean TVD % @{name} ± SE" in text
        assert f"{100 * tvd['mean']:.3f} ± {100 * tvd['se']:.3f}" in text
    _, plain = matrix.matrix_result(plan()[0], matrix.MatrixRun("", [], [ComparisonSummary.from_json(summary)]))
    assert "TVD" not in plain


def test_a_matrix_refuses_a_bad_sampler_before_any_work(tmp_path):
    res = run_cli("matrix", "--ref", "R=nowhere.gguf", "-m", "nothing.gguf", "--runs-dir", tmp_path / "runs",
                  "--sampler", "top_k=-1")
    assert_cli_error(res, "--sampler 'top_k=-1'", "top_k must be an integer >= 0")
    assert not (tmp_path / "runs").exists()
