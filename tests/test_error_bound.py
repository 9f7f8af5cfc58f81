"""The certified bound on |ΔKLD| (docs/error-bound.md) against float64 KLD of the exact logits, token by token:
it holds for every token, stored or live candidate, both directions, on realistic rows and on rows built so that
the deep tail (code 0) and the worst alignment of the code's rounding decide the error."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import kld64, log_softmax64, make_pair, make_tokens, perturb, realistic_logits, write_store
from test_metrics import RowsSource

from qeval.compare import metrics
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
