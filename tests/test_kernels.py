"""The fused pair_sums kernel + kld_from_sums against float64 numpy KLD of the decoded rows."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import decoded_logprobs, kld64, log_softmax64, perturb, realistic_logits

from qeval.compare.kernels import (BOUND_FWD, BOUND_REV, N_SUMS, Z_Q_EXACT, decode_tables, evaluation_error,
                                   kld_from_sums, pair_sums, pair_sums_logits, pair_sums_replayed,
                                   pair_sums_replayed_coded)
from qeval.storage.codec import BadLogits, SqrtLogCode
from qeval.storage.store import codes_to_planes, planes_to_codes


def kernel_kld(codes_p, codes_q, lut_p, lut_q):
    planes_p, planes_q = codes_to_planes(codes_p), codes_to_planes(codes_q)
    out = np.full((len(codes_p), N_SUMS), np.nan)
    pair_sums(planes_p, planes_q, *decode_tables(lut_p), *decode_tables(lut_q), out)
    return kld_from_sums(out)


def reference_kld(codes_p, codes_q, lut_p, lut_q):
    lp, lq = decoded_logprobs(codes_p, lut_p), decoded_logprobs(codes_q, lut_q)
    return kld64(lp, lq), kld64(lq, lp)


def logits_with_masks(rng, n, n_vocab, sigma):
    p = realistic_logits(rng, n, n_vocab, n_dominant=min(3, n_vocab))
    q = perturb(rng, p, sigma)
    if n_vocab > 4:
        for t in range(n):  # mask some entries (not the row max) on either side
            masked = rng.choice(n_vocab, n_vocab // 5, replace=False)
            masked = masked[masked != np.argmax(p[t])]
            masked = masked[masked != np.argmax(q[t])]
            half = len(masked) // 2
            p[t, masked[:half]] = -np.inf
            q[t, masked[half:]] = -np.inf
    return p, q


@pytest.mark.parametrize("n_vocab", [2, 3, 17, 1000, 4099])
def test_pair_sums_match_float64_reference(n_vocab):
    rng = np.random.default_rng(100 + n_vocab)
    code = SqrtLogCode()
    p, q = logits_with_masks(rng, 9, n_vocab, sigma=0.7)
    cp = code.encode_block(p, np.zeros(9, dtype=np.int64)).codes
    cq = code.encode_block(q, np.zeros(9, dtype=np.int64)).codes
    fwd, rev = kernel_kld(cp, cq, code.lut(), code.lut())
    ref_fwd, ref_rev = reference_kld(cp, cq, code.lut(), code.lut())
    np.testing.assert_allclose(fwd, ref_fwd, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev, ref_rev, rtol=1e-9, atol=1e-13)
    assert np.all(fwd > -1e-13) and np.all(rev > -1e-13)


@pytest.mark.parametrize("n_vocab", [2, 17, 4099])
def test_pair_sums_logits_match_float64_reference(n_vocab):
    """A stored reference row against a live candidate's float32 logits (never coded): float64 KLD of the
    decoded reference row and the float32 row (entries below the code's floor, -inf included, at the floor),
    both ways."""
    rng = np.random.default_rng(200 + n_vocab)
    code = SqrtLogCode()
    p, q = logits_with_masks(rng, 6, n_vocab, sigma=0.7)
    q = q.astype(np.float32)
    cp = code.encode_block(p, np.zeros(6, dtype=np.int64)).codes
    lp = decoded_logprobs(cp, code.lut())
    floor = float(code.lut()[0])
    lq = log_softmax64(np.maximum(q.astype(np.float64) - q.max(axis=1, keepdims=True), floor))
    assert (lq.min(axis=1) > -np.inf).all() and (n_vocab < 5 or np.isinf(q).any())  # masks need 5+ entries
    out = np.full((6, N_SUMS), np.nan)
    scratch = np.empty((2, n_vocab), dtype=np.float64)
    for t in range(6):
        pair_sums_logits(codes_to_planes(cp[t:t + 1])[0], q[t], *decode_tables(code.lut()), out[t], scratch)
    fwd, rev = kld_from_sums(out)
    # l_q and exp(l_q) in float64, as the truth: KLD to float64 rounding
    np.testing.assert_allclose(fwd, kld64(lp, lq), rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev, kld64(lq, lp), rtol=1e-9, atol=1e-13)
    assert fwd.mean() > 1e-3  # the rows really differ


@pytest.mark.parametrize("n_vocab", [2, 17, 4099])
def test_pair_sums_replayed_match_float64_reference(n_vocab):
    """A reference read uncoded (a replayed hidden-form row, float32) against a live candidate's float32 row: the
    float64 KLD of the two rows as they are, no code, no floor, both ways; a reference entry of probability 0 adds
    nothing forward and makes the reverse KLD infinite where the candidate has mass there."""
    rng = np.random.default_rng(300 + n_vocab)
    p, q = (x.astype(np.float32) for x in logits_with_masks(rng, 6, n_vocab, sigma=0.7))
    q = np.where(np.isinf(q), np.float32(-40), q)  # mask the reference only: a finite forward KLD
    out = np.full((6, N_SUMS), np.nan)
    scratch = np.empty((4, n_vocab), dtype=np.float64)
    for t in range(6):
        pair_sums_replayed(p[t], q[t], out[t], scratch)
    fwd, rev = kld_from_sums(out)
    lp, lq = log_softmax64(p), log_softmax64(q)
    np.testing.assert_allclose(fwd, kld64(lp, lq), rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(out[:, Z_Q_EXACT], np.exp(lq - lq.max(axis=1, keepdims=True)).sum(axis=1), rtol=1e-12)
    masked = np.isinf(p).any(axis=1)
    assert np.all(np.isinf(rev[masked])) and (n_vocab < 5 or masked.any())
    np.testing.assert_allclose(rev[~masked], kld64(lq, lp)[~masked], rtol=1e-9, atol=1e-13)
    assert fwd.mean() > 1e-3  # the rows really differ
    with pytest.raises(BadLogits):
        pair_sums_replayed(np.full(n_vocab, np.nan, np.float32), q[0], out[0], scratch)


@pytest.mark.parametrize("n_vocab", [2, 17, 4099])
def test_pair_sums_replayed_coded_match_float64_reference(n_vocab):
    """A reference read uncoded (float32, a replayed hidden-form row) against a stored candidate's codes: the
    float64 KLD of the reference row as it is and the decoded candidate row, both ways; with both records, the bound
    holds against the exact rows (the reference row is its own exact row here: its record is the float64 slack)."""
    from qeval.storage.codec import REPLAY_BANDS
    from qeval.storage.error_record import BandWeights, ErrorMeter

    rng = np.random.default_rng(400 + n_vocab)
    code = SqrtLogCode()
    p, q = logits_with_masks(rng, 6, n_vocab, sigma=0.7)
    p = np.where(np.isinf(p), -40.0, p).astype(np.float32)  # the replayed reference: finite float32
    q = np.where(np.isinf(q), -30.0, q)  # a finite exact candidate: a masked entry's code error is unbounded
    cand = code.encode_block(q, np.zeros(6, dtype=np.int64))
    meter = ErrorMeter.of(n_vocab)
    ref_record = meter.measure(p, p.max(axis=1), [(REPLAY_BANDS, meter.uncoded(p, p.copy(), REPLAY_BANDS))])[0][0]
    ref_w, cand_w = BandWeights.of(ref_record), BandWeights.of(cand.error)
    e_q, l_q = decode_tables(code.lut())
    bands_q = code.error.band_of(code.lut())
    out, bounded = np.full((6, N_SUMS), np.nan), np.full((6, N_SUMS), np.nan)
    scratch = np.empty((2, n_vocab), dtype=np.float64)
    planes = codes_to_planes(cand.codes)
    for t in range(6):
        pair_sums_replayed_coded(p[t], planes[t], e_q, l_q, out[t], scratch)
        pair_sums_replayed_coded(p[t], planes[t], e_q, l_q, bounded[t], scratch, bands_q, ref_w.bands[:, t],
                                 ref_w.tokens[:, t], cand_w.bands[:, t], cand_w.tokens[:, t])
    fwd, rev = kld_from_sums(out)
    lp, lq = log_softmax64(p.astype(np.float64)), decoded_logprobs(cand.codes, code.lut())
    np.testing.assert_allclose(fwd, kld64(lp, lq), rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev, kld64(lq, lp), rtol=1e-9, atol=1e-13)
    assert fwd.mean() > 1e-3 and np.isnan(out[:, BOUND_FWD]).all()  # the rows differ; no records, no bound
    np.testing.assert_array_equal(bounded[:, :6], out[:, :6])
    exact_q = log_softmax64(q)  # the candidate's exact row: the code's error is what the bound must cover
    for col, truth in ((BOUND_FWD, kld64(lp, exact_q)), (BOUND_REV, kld64(exact_q, lp))):
        fin = np.isfinite(truth)
        got = (fwd, rev)[col - BOUND_FWD]
        assert np.all(np.abs(got[fin] - truth[fin]) <= bounded[fin, col] + 1e-12)
        assert np.all(bounded[:, col] > 0) and np.all(np.isfinite(bounded[:, col]))
    with pytest.raises(BadLogits):
        pair_sums_replayed_coded(np.full(n_vocab, np.nan, np.float32), planes[0], e_q, l_q, out[0], scratch)


def test_the_float64_evaluation_of_a_kld_is_within_its_evaluation_error():
    """Two float32 rows of a 262K vocabulary read as they are (no code: the stored form's error is 0), their KLDs
    from the fused float64 sums against the same KLDs in 80-bit long double: the difference is not 0, and within
    evaluation_error, which stays far below any stored form's error."""
    rng = np.random.default_rng(17)
    n_vocab = 262_144
    p = realistic_logits(rng, 3, n_vocab)
    p, q = p.astype(np.float32), perturb(rng, p, 0.5).astype(np.float32)
    out = np.full((3, N_SUMS), np.nan)
    scratch = np.empty((4, n_vocab), dtype=np.float64)
    for t in range(3):
        pair_sums_replayed(p[t], q[t], out[t], scratch)
    got = np.stack(kld_from_sums(out))
    bound = np.stack(evaluation_error(out, n_vocab))

    def log_softmax_ld(x):
        x = x.astype(np.longdouble)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    lp, lq = log_softmax_ld(p), log_softmax_ld(q)
    exact = np.stack([(np.exp(lp) * (lp - lq)).sum(axis=1), (np.exp(lq) * (lq - lp)).sum(axis=1)])
    error = np.abs(got - exact).astype(np.float64)
    assert np.all(error > 0) and np.all(error <= bound), (error, bound)
    assert np.all(bound < 1e-8)


def test_pair_sums_logits_refuse_nan_rows():
    code = SqrtLogCode()
    planes = codes_to_planes(np.zeros((1, 8), dtype=np.uint16))[0]
    for bad in ([np.nan, 0, 1, 2, 3, 4, 5, 6], [-np.inf] * 8):
        with pytest.raises(BadLogits):
            pair_sums_logits(planes, np.array(bad, dtype=np.float32), *decode_tables(code.lut()), np.empty(N_SUMS),
                             np.empty((2, 8), dtype=np.float64))


def test_pair_sums_with_two_different_code_tables():
    """Reference and candidate may use different codes: each side must decode through its own table."""
    rng = np.random.default_rng(101)
    code_p, code_q = SqrtLogCode(knee=-4.0), SqrtLogCode(knee=-6.0)
    p, q = logits_with_masks(rng, 7, 3000, sigma=0.4)
    cp = code_p.encode_block(p, np.zeros(7, dtype=np.int64)).codes
    cq = code_q.encode_block(q, np.zeros(7, dtype=np.int64)).codes
    fwd, rev = kernel_kld(cp, cq, code_p.lut(), code_q.lut())
    ref_fwd, ref_rev = reference_kld(cp, cq, code_p.lut(), code_q.lut())
    np.testing.assert_allclose(fwd, ref_fwd, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev, ref_rev, rtol=1e-9, atol=1e-13)
    # swapping the roles swaps forward and reverse
    fwd2, rev2 = kernel_kld(cq, cp, code_q.lut(), code_p.lut())
    np.testing.assert_allclose(fwd2, rev, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev2, fwd, rtol=1e-9, atol=1e-13)


def test_pair_sums_on_arbitrary_codes():
    """Uniformly random codes (not made by the encoder) and an arbitrary non-decreasing table."""
    rng = np.random.default_rng(102)
    lut = np.sort(rng.uniform(-30, 0, 65536)).astype(np.float32)
    lut[-1] = 0.0
    cp = rng.integers(0, 65536, (5, 777)).astype(np.uint16)
    cq = rng.integers(0, 65536, (5, 777)).astype(np.uint16)
    fwd, rev = kernel_kld(cp, cq, lut, lut)
    ref_fwd, ref_rev = reference_kld(cp, cq, lut, lut)
    np.testing.assert_allclose(fwd, ref_fwd, rtol=1e-9)
    np.testing.assert_allclose(rev, ref_rev, rtol=1e-9)


def test_identical_rows_have_zero_kld():
    rng = np.random.default_rng(103)
    code = SqrtLogCode()
    p = realistic_logits(rng, 6, 2500)
    cp = code.encode_block(p, np.zeros(6, dtype=np.int64)).codes
    fwd, rev = kernel_kld(cp, cp.copy(), code.lut(), code.lut())
    assert np.all(np.abs(fwd) < 1e-12) and np.all(np.abs(rev) < 1e-12)


def test_pair_sums_columns_are_the_documented_sums():
    rng = np.random.default_rng(104)
    lut = SqrtLogCode().lut().astype(np.float64)
    cp = rng.integers(0, 65536, (3, 50)).astype(np.uint16)
    cq = rng.integers(0, 65536, (3, 50)).astype(np.uint16)
    out = np.empty((3, N_SUMS))
    pair_sums(codes_to_planes(cp), codes_to_planes(cq), *decode_tables(lut), *decode_tables(lut), out)
    lp, lq = lut[cp], lut[cq]
    ep, eq = np.exp(lp), np.exp(lq)
    expected = np.stack([ep.sum(1), eq.sum(1), (ep * lp).sum(1), (ep * lq).sum(1), (eq * lq).sum(1),
                         (eq * lp).sum(1)], axis=1)
    np.testing.assert_allclose(out[:, :6], expected, rtol=1e-12)


def test_planes_round_trip():
    rng = np.random.default_rng(105)
    codes = rng.integers(0, 65536, (4, 333)).astype(np.uint16)
    codes[0, :3] = [0, 255, 65535]
    planes = codes_to_planes(codes)
    assert planes.dtype == np.uint8 and planes.shape == (4, 2, 333)
    np.testing.assert_array_equal(planes[:, 0], codes >> 8)
    np.testing.assert_array_equal(planes[:, 1], codes & 0xFF)
    np.testing.assert_array_equal(planes_to_codes(planes), codes)


def test_decoded_kld_tracks_exact_kld_of_the_logits():
    """KLD between two coded rows is close to the exact float64 KLD between the original logits."""
    rng = np.random.default_rng(106)
    code = SqrtLogCode()
    p = realistic_logits(rng, 32, 5000)
    q = perturb(rng, p, 0.6)
    cp = code.encode_block(p, np.zeros(32, dtype=np.int64)).codes
    cq = code.encode_block(q, np.zeros(32, dtype=np.int64)).codes
    fwd, rev = kernel_kld(cp, cq, code.lut(), code.lut())
    exact_fwd = kld64(log_softmax64(p), log_softmax64(q))
    exact_rev = kld64(log_softmax64(q), log_softmax64(p))
    assert exact_fwd.mean() > 0.05  # a case with real damage, so that 1e-3 is a meaningful bound
    assert abs(fwd.mean() / exact_fwd.mean() - 1) < 1e-3
    assert abs(rev.mean() / exact_rev.mean() - 1) < 1e-3
    np.testing.assert_allclose(fwd, exact_fwd, rtol=1e-2, atol=1e-5)


def test_tiny_vocab_with_minus_inf_entries():
    code = SqrtLogCode()
    p = np.array([[0.0, -np.inf, 1.0], [2.0, 2.0, -np.inf], [-np.inf, 5.0, -np.inf], [0.0, 30.0, 0.0]],
                 dtype=np.float32)
    q = np.array([[0.5, 0.1, 1.0], [-np.inf, 2.0, 1.0], [-1.0, 5.0, -np.inf], [0.0, 1.0, 30.0]],
                 dtype=np.float32)
    cp = code.encode_block(p, np.array([0, 0, 1, 1])).codes
    cq = code.encode_block(q, np.array([0, 1, 1, 1])).codes
    fwd, rev = kernel_kld(cp, cq, code.lut(), code.lut())
    ref_fwd, ref_rev = reference_kld(cp, cq, code.lut(), code.lut())
    np.testing.assert_allclose(fwd, ref_fwd, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev, ref_rev, rtol=1e-9, atol=1e-13)
    assert fwd[3] > 20 and rev[3] > 20  # a swapped 30-nat argmax is a huge divergence, not clipped


def test_two_entry_vocab():
    code = SqrtLogCode()
    p = np.array([[0.0, 0.0], [0.0, -3.0], [-np.inf, 0.0]], dtype=np.float32)
    q = np.array([[0.0, -1.0], [0.0, -3.0], [0.0, -2.0]], dtype=np.float32)
    cp = code.encode_block(p, np.zeros(3, dtype=np.int64)).codes
    cq = code.encode_block(q, np.zeros(3, dtype=np.int64)).codes
    fwd, rev = kernel_kld(cp, cq, code.lut(), code.lut())
    ref_fwd, ref_rev = reference_kld(cp, cq, code.lut(), code.lut())
    np.testing.assert_allclose(fwd, ref_fwd, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(rev, ref_rev, rtol=1e-9, atol=1e-13)
    # exact Bernoulli KLD for row 0: P = (1/2, 1/2), Q = softmax(0, -1); the code is close to it
    lq = log_softmax64(q[:1])[0]
    exact = 0.5 * (np.log(0.5) - lq[0]) + 0.5 * (np.log(0.5) - lq[1])
    assert abs(fwd[0] - exact) < 1e-4 * exact
    assert abs(fwd[1]) < 1e-12
