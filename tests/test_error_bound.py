"""The certified bound on |ΔKLD| (docs/error-bound.md) against float64 KLD of the exact logits, token by token:
it holds for every token, stored or live candidate, both directions, on realistic rows and on rows built so that
the deep tail (code 0) and the worst alignment of the code's rounding decide the error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import kld64, log_softmax64, make_pair, make_tokens, perturb, realistic_logits, write_store
from test_metrics import RowsSource

from qeval import api
from qeval.compare import metrics
from qeval.compare.paired_stats import CONFIDENCE, t_quantile
from qeval.identity import NOT_RECORDED
from qeval.storage.codec import SqrtLogCode
from qeval.storage.store import StoreReader


def true_klds(ref_logits: np.ndarray, cand_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(p || q) and KL(q || p) of the exact rows: float64 log-softmax of the float32 logits."""
    lp = log_softmax64(ref_logits.astype(np.float32))
    lq = log_softmax64(cand_logits.astype(np.float32))
    return kld64(lp, lq), kld64(lq, lp)


def assert_bound_holds(cmp: metrics.Comparison, ref_logits: dict, cand_logits: dict) -> tuple[np.ndarray, ...]:
    """Every token's |KLD − exact KLD| is within its bound, both directions; returns (error, bound) of each."""
    t = cmp.per_token
    forward, reverse = (np.concatenate([true_klds(ref_logits[c], cand_logits[c])[k] for c in cmp.chunks])
                        for k in (0, 1))
    err_f, err_r = np.abs(t["kld"] - forward), np.abs(t["kld_reverse"] - reverse)
    assert np.all(np.isfinite(t["kld_bound"])) and np.all(np.isfinite(t["kld_reverse_bound"]))
    assert np.all(err_f <= t["kld_bound"]), np.max(err_f - t["kld_bound"])
    assert np.all(err_r <= t["kld_reverse_bound"]), np.max(err_r - t["kld_reverse_bound"])
    return err_f, t["kld_bound"], err_r, t["kld_reverse_bound"]


@pytest.mark.parametrize("sigma", [0.0, 0.05, 0.7])
def test_bound_holds_stored_and_live(tmp_path, sigma):
    """Stored candidate (its own record counts too) and live float32 rows, from identical to far apart."""
    pair = make_pair(tmp_path / f"s{sigma}", seed=5, n_chunks=3, n_ctx=24, n_vocab=3000, sigma=sigma)
    with StoreReader(pair.ref.path) as ref, StoreReader(pair.cand.path) as cand:
        stored = assert_bound_holds(metrics.compare(ref, cand, threads=2), pair.ref.logits, pair.cand.logits)
        live = assert_bound_holds(metrics.compare(ref, RowsSource(ref, pair.cand.logits), threads=2),
                                  pair.ref.logits, pair.cand.logits)
    # a live candidate has no code error of its own: its bound is the reference's share alone, below the stored one's
    assert np.mean(live[1]) < np.mean(stored[1])
    if sigma == 0.0:  # the same logits: the figures are the stores' own error, and the bound is that small
        assert np.max(stored[1]) < 2e-6 and np.max(live[1]) < 2e-6


def test_without_a_record_the_bound_is_nan(tmp_path):
    """A store that records no error (an older one) gives no bound: NaN, never 0."""
    rng = np.random.default_rng(9)
    tokens = make_tokens(rng, 2, 16, 500)
    logits = {c: realistic_logits(rng, 7, 500) for c in range(2)}
    old = write_store(tmp_path / "OLD.qeval", tokens, logits, 500, code=SqrtLogCode(error=None), label="OLD")
    new = write_store(tmp_path / "NEW.qeval", tokens, {c: perturb(rng, x, 0.3) for c, x in logits.items()}, 500,
                      label="NEW")
    with StoreReader(old.path) as a, StoreReader(new.path) as b:
        assert a.header.format_version == 2 and b.header.format_version == 4
        for ref, cand in ((a, b), (b, a)):
            t = metrics.compare(ref, cand).per_token
            assert np.all(np.isnan(t["kld_bound"])) and np.all(np.isnan(t["kld_reverse_bound"]))
        t = metrics.compare(a, RowsSource(a, new.logits)).per_token
        assert np.all(np.isnan(t["kld_bound"]))


def deep_tail_rows(rng: np.random.Generator, n: int, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows where the code's floor decides: the reference puts most of its vocabulary 30-80 nats below its top
    (all code 0, stored at -26.5 nats), and the candidate lifts a few hundred of those entries to within a few nats
    of its own top (reverse KLD: mass where the stored reference over-states p by up to 50 nats) or sinks entries
    the reference holds near its top (forward)."""
    p = realistic_logits(rng, n, n_vocab).astype(np.float64)
    deep = rng.random((n, n_vocab)) < 0.8
    p = np.where(deep, p.max(axis=1, keepdims=True) - rng.uniform(30, 80, (n, n_vocab)), p)
    q = p + rng.normal(0, 0.3, p.shape)
    for t in range(n):
        lifted = rng.choice(np.flatnonzero(deep[t]), 300, replace=False)
        q[t, lifted] = q[t].max() - rng.uniform(2, 6, len(lifted))
        sunk = rng.choice(np.flatnonzero(~deep[t]), 50, replace=False)
        q[t, sunk] -= 40
    return p.astype(np.float32), q.astype(np.float32)


def adversarial_rows(rng: np.random.Generator, n: int, n_vocab: int, code: SqrtLogCode) -> tuple[np.ndarray, ...]:
    """A candidate aligned with the reference's own rounding: each entry moved by 2 nats in the direction of its
    coding error, the worst alignment a certified bound must allow for (its linear term is then nearly the bound)."""
    p = realistic_logits(rng, n, n_vocab)
    enc = code.encode_block(p, np.zeros(n, dtype=np.int64))
    lut = code.lut().astype(np.float64)
    stored = lut[enc.codes] - np.log(np.exp(lut[enc.codes]).sum(axis=1, keepdims=True))
    delta = log_softmax64(p) - stored
    q = p.astype(np.float64) - 2.0 * np.sign(delta)
    return p, q.astype(np.float32)


@pytest.mark.parametrize("rows", ["deep_tail", "adversarial"])
def test_bound_holds_where_the_tail_and_the_rounding_decide(tmp_path, rows):
    rng = np.random.default_rng(17)
    code, n_chunks, n_ctx, v = SqrtLogCode(), 2, 18, 4000
    tokens = make_tokens(rng, n_chunks, n_ctx, v)
    made = [deep_tail_rows(rng, 8, v) if rows == "deep_tail" else adversarial_rows(rng, 8, v, code)
            for _ in range(n_chunks)]
    ref_logits, cand_logits = ({c: m[k] for c, m in enumerate(made)} for k in (0, 1))
    ref = write_store(tmp_path / "R.qeval", tokens, ref_logits, v, label="R")
    cand = write_store(tmp_path / "C.qeval", tokens, cand_logits, v, label="C")
    with StoreReader(ref.path) as r, StoreReader(cand.path) as c:
        err_f, bound_f, err_r, bound_r = assert_bound_holds(metrics.compare(r, c), ref_logits, cand_logits)
        live = assert_bound_holds(metrics.compare(r, RowsSource(r, cand_logits)), ref_logits, cand_logits)
    if rows == "deep_tail":  # the floor over-states p by tens of nats where the candidate has mass: a real error
        assert np.median(err_r) > 1e-4 and np.median(live[2]) > 1e-4
    else:  # aligned with the rounding: the error is a sizeable part of the bound (it is not loose by much here)
        assert np.median(live[0] / live[1]) > 0.2


def exact_rows(model, windows: np.ndarray) -> dict[int, np.ndarray]:
    """llama.cpp's float32 scored rows of each window, as the capture decodes them (the same engine settings)."""
    from qeval.engine.engine import Engine  # noqa: PLC0415 - the engine loads llama.cpp

    out = {}
    with Engine(model, windows.shape[1]) as engine:
        for c, window in enumerate(windows):
            out[c] = np.concatenate([rows.copy() for _, rows in engine.iter_scored_logits(window)])
    return out


def test_bound_holds_on_real_rows(models, tmp_path):
    """Gemma-3-270M: a Q8_0 reference and a Q4_0 candidate captured by qeval (records measured at capture), 2
    windows of 512; against the float64 KLDs of llama.cpp's float32 rows, token by token: the bound holds for every
    token, stored or live candidate, both directions; NLL and PPL are exact, as the bound says."""
    runs = tmp_path / "runs"
    for quant in ("Q8_0", "Q4_0"):
        api.capture_store(str(models[quant]), quant, runs_dir=runs, chunks=2)
    with StoreReader(runs / "Q8_0.qeval") as ref, StoreReader(runs / "Q4_0.qeval") as cand:
        ref_rows, cand_rows = exact_rows(models["Q8_0"], ref.tokens), exact_rows(models["Q4_0"], ref.tokens)
        for c in range(2):  # the same logits as the capture's, and its scalars exact in float64
            targets = ref.tokens[c, ref.header.positions + 1]
            exact = log_softmax64(ref_rows[c])[np.arange(len(targets)), targets]
            np.testing.assert_allclose(ref.read_chunk(c).logprob_target, exact, rtol=0, atol=1e-12)
        for source in (cand, RowsSource(ref, cand_rows)):
            cmp = metrics.compare(ref, source)
            err_f, bound_f, err_r, bound_r = assert_bound_holds(cmp, ref_rows, cand_rows)
            assert 0.2 < cmp.per_token["kld"].mean() < 0.6 and np.median(bound_f) < 1e-3
            nll = np.concatenate([-log_softmax64(cand_rows[c])[np.arange(255), ref.tokens[c, ref.header.positions + 1]]
                                  for c in range(2)])
            np.testing.assert_allclose(cmp.per_token["nll_cand"], nll, rtol=0, atol=1e-12)


def test_board_rows_show_their_bound_and_the_control_reads_its_own():
    """The board's KLD bound column: a number, "exact"-free; "not recorded" for a row against an older store; the
    control row shows its bound instead of a bare 0, and a row's "(noise)" verdict against the control allows for
    both bounds."""
    from qeval.compare.metric_registry import MetricValue  # noqa: PLC0415
    from qeval.present import board  # noqa: PLC0415

    def row(label, kld, se, bound, control=False):
        return board.BoardRow(label=label, quant="?", kv="?", size_gib=0.5,
                              metrics={"kld_mean": MetricValue(kld, se, bound=bound)}, control=control, chunks=4)

    control = row("control", 4e-7, 1e-8, 3.2e-6, control=True)
    # 3.6e-6 over the control: far beyond its SEs (above, without the bounds), but within the bounds, which reach
    # past the control's own KLD as well: undecided
    near = row("near", 4e-6, 1e-7, 1.3e-5)
    twin = row("twin", 4.1e-7, 1e-8, 2e-8)  # with a control whose bound is small beside its KLD: noise
    far = row("far", 0.35, 0.01, 1.1e-4)
    old = row("old", 0.35, 0.01, NOT_RECORDED)
    rows = [control, near, far, old]
    board.compare_with_control(rows)
    assert near.noise.state == "undecided" and far.noise.state == "above"
    assert near.noise.low < 0 < 3.6e-6 - t_quantile(CONFIDENCE, 3) * math.hypot(1e-7, 1e-8)
    assert board.control_cell(near) == "+0.000004 undecided (4 chunks)"
    tight = row("control", 4e-7, 1e-8, 1e-8, control=True)
    board.compare_with_control([tight, twin])
    assert twin.noise.state == "within" and board.control_cell(twin) == "+0.000000 (noise)"
    cells = {r.label: board.leaderboard_cells(r, control=True) for r in rows}
    column = [name for name, _ in board.leaderboard_columns(control=True)].index("KLD bound") + 1
    assert [cells[k][column] for k in ("control", "near", "far", "old")] == ["≤ 3.2e-06", "≤ 1.3e-05", "≤ 0.00011",
                                                                             "not recorded"]
    assert control.to_json()["kld_mean_bound"] == 3.2e-6 and old.to_json()["kld_mean_bound"] == NOT_RECORDED
    assert "KLD bound:" in board.notes()


def test_kld_text_and_json_show_each_figures_bound_or_why_there_is_none(tmp_path):
    pair = make_pair(tmp_path / "new", seed=3, n_chunks=2, n_ctx=16, n_vocab=800, sigma=0.4)
    result, text = api.kld_report(str(pair.ref.path), str(pair.cand.path), threads=1, samplers=["greedy"])
    block = text.split("====== Error bound of the stored form", 1)[1].split("======", 2)[1]
    assert "mean KLD" in block and "within" in block and "exact" in block and "not bounded" in block
    held = result["metrics"]
    assert 0 < held["kld_mean"]["bound"] == held["kld_mean_bound"]["value"] < 1e-3
    assert held["ppl"]["bound"] == 0 and held["same_top1_pct"]["bound"] == 0
    assert held["tvd_pct@greedy"]["bound"] == "not bounded"
    assert result["reference"]["form"]["error"] == {"bands": 32, "band_width": 1.0}
    rng = np.random.default_rng(4)
    tokens = make_tokens(rng, 1, 16, 300)
    logits = {0: realistic_logits(rng, 7, 300)}
    old = write_store(tmp_path / "OLD.qeval", tokens, logits, 300, code=SqrtLogCode(error=None), label="OLD")
    new = write_store(tmp_path / "NEW.qeval", tokens, {0: perturb(rng, logits[0], 0.3)}, 300, label="NEW")
    result, text = api.kld_report(str(old.path), str(new.path), threads=1)
    assert "not recorded: the reference store OLD records no error" in text and "--force" in text
    assert {v["bound"] for k, v in result["metrics"].items() if k != "kld_mean_bound"} == {NOT_RECORDED}
