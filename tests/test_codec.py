"""SqrtLogCode: exact scalars, top-k ids, monotone codes, the decode table and the noise floor."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import decoded_logprobs, kld64, log_softmax64, realistic_logits, stable_topk

from qeval.storage.codec import BadLogits, SqrtLogCode
from qeval.storage.store import N_CODES, TOP_K

CODE = SqrtLogCode()


def tricky_rows(rng: np.random.Generator, n_vocab: int = 1500) -> np.ndarray:
    """Rows with ties (also at the top), -inf entries, and rows with fewer finite entries than TOP_K."""
    rows = [realistic_logits(rng, 1, n_vocab)[0] for _ in range(3)]
    # coarse values: many ties everywhere, including the maximum
    rows.append(np.round(rng.normal(0, 3, n_vocab) * 2) / 2)
    tied_top = rng.normal(0, 2, n_vocab)
    tied_top[[7, 3, 900, 41]] = 12.5  # four-way tie for the max: ids 3, 7, 41, 900 in that order
    rows.append(tied_top)
    masked = realistic_logits(rng, 1, n_vocab)[0].astype(np.float64)
    masked[rng.choice(n_vocab, n_vocab // 3, replace=False)] = -np.inf  # a third masked out
    rows.append(masked)
    few = np.full(n_vocab, -np.inf)
    few[[5, 1000, 17]] = [1.0, 3.0, 1.0]  # only 3 finite values: top-10 continues with -inf ids 0,1,2,...
    rows.append(few)
    one = np.full(n_vocab, -np.inf)
    one[n_vocab - 1] = -7.25  # a single finite entry, at the last id
    rows.append(one)
    const = np.zeros(n_vocab)  # everything tied
    rows.append(const)
    return np.array(rows, dtype=np.float32)


def targets_for(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random targets, but only at finite logits (a target at -inf would have log p = -inf)."""
    out = []
    for row in logits:
        finite = np.flatnonzero(np.isfinite(row))
        out.append(rng.choice(finite))
    return np.array(out, dtype=np.int64)


def test_exact_scalars_match_float64_log_softmax():
    rng = np.random.default_rng(11)
    logits = np.concatenate([tricky_rows(rng), realistic_logits(rng, 20, 3000)[:, :1500]])
    targets = targets_for(logits, rng)
    enc = CODE.encode_block(logits, targets)
    ref = log_softmax64(logits)
    rows = np.arange(len(logits))
    assert enc.logprob_target.dtype == np.float64 and enc.logprob_max.dtype == np.float64
    np.testing.assert_allclose(enc.logprob_target, ref[rows, targets], rtol=0, atol=1e-6)
    np.testing.assert_allclose(enc.logprob_max, ref.max(axis=1), rtol=0, atol=1e-6)


def test_exact_scalars_for_very_confident_and_very_flat_rows():
    rng = np.random.default_rng(12)
    n_vocab = 4000
    logits = rng.normal(0, 1, (4, n_vocab))
    logits[0, 10] += 60.0  # p_max ~ 1 - 1e-23: log p_max ~ -1e-23
    logits[1] *= 1e-3  # nearly uniform: log p ~ -log V
    logits[2, :] = -50.0
    logits[2, 99] = 40.0  # 90-nat gap: everything but one entry underflows float32 exp
    logits[3] = logits[3] * 20.0  # very wide spread
    logits = logits.astype(np.float32)
    targets = np.array([10, 5, 0, 1234])
    enc = CODE.encode_block(logits, targets)
    ref = log_softmax64(logits)
    np.testing.assert_allclose(enc.logprob_target, ref[np.arange(4), targets], rtol=0, atol=1e-6)
    np.testing.assert_allclose(enc.logprob_max, ref.max(axis=1), rtol=0, atol=1e-6)


def test_top_ids_are_a_stable_argsort_with_ties_and_minus_inf():
    rng = np.random.default_rng(13)
    logits = tricky_rows(rng)
    enc = CODE.encode_block(logits, targets_for(logits, rng))
    assert enc.top_ids.shape == (len(logits), TOP_K) and enc.top_ids.dtype == np.int32
    np.testing.assert_array_equal(enc.top_ids, stable_topk(logits, TOP_K))
    # spelled out for the hand-made rows
    assert list(enc.top_ids[4, :4]) == [3, 7, 41, 900]
    assert list(enc.top_ids[6]) == [1000, 5, 17, 0, 1, 2, 3, 4, 6, 7]
    assert enc.top_ids[7, 0] == 1499 and list(enc.top_ids[7, 1:]) == list(range(9))
    assert list(enc.top_ids[8]) == list(range(10))


def test_top_ids_first_is_first_argmax():
    rng = np.random.default_rng(14)
    logits = np.round(rng.normal(0, 1, (50, 300)) * 2).astype(np.float32)  # heavy ties
    enc = CODE.encode_block(logits, np.zeros(50, dtype=np.int64))
    np.testing.assert_array_equal(enc.top_ids[:, 0], np.argmax(logits, axis=1))
    np.testing.assert_array_equal(enc.top_ids, stable_topk(logits, TOP_K))


def test_codes_are_monotone_in_logits():
    rng = np.random.default_rng(15)
    logits = np.concatenate([tricky_rows(rng), realistic_logits(rng, 10, 1500)])
    enc = CODE.encode_block(logits, targets_for(logits, rng))
    assert enc.codes.dtype == np.uint16 and enc.codes.shape == logits.shape
    for row, codes in zip(logits, enc.codes):
        order = np.argsort(row, kind="stable")
        assert np.all(np.diff(codes[order].astype(np.int64)) >= 0)
        # equal logits get equal codes
        for v in np.unique(row[np.isfinite(row)])[:20]:
            assert len(np.unique(codes[row == v])) == 1
        assert codes[np.argmax(row)] == N_CODES - 1  # the maximum is the top code
        assert np.all(codes[np.isneginf(row)] == 0)  # masked entries are the bottom code


def _u_float64(d: np.ndarray, knee: float) -> np.ndarray:
    """The documented code curve, independently in float64 (docs/store-format.md)."""
    b = 65535.0 / (2.0 + abs(knee))
    return np.where(d < knee, 2 * b * np.exp((d - knee) / 2), 2 * b + b * (d - knee))


@pytest.mark.parametrize("knee", [-4.0, -2.5, -6.0])
def test_codes_follow_the_documented_curve(knee):
    code = SqrtLogCode(knee=knee)
    rng = np.random.default_rng(16)
    logits = realistic_logits(rng, 8, 3000)
    enc = code.encode_block(logits, np.zeros(8, dtype=np.int64))
    d = logits.astype(np.float64) - logits.max(axis=1, keepdims=True).astype(np.float64)
    expected = np.clip(np.floor(_u_float64(d, knee) + 0.5), 0, 65535)
    diff = np.abs(enc.codes.astype(np.int64) - expected.astype(np.int64))
    assert diff.max() <= 1  # float32 exp in the tail may flip a rounding boundary
    assert np.mean(diff != 0) < 1e-3


@pytest.mark.parametrize("knee", [-4.0, -1.0, -6.0])
def test_lut_is_finite_monotone_and_matches_the_representatives(knee):
    code = SqrtLogCode(knee=knee)
    lut = code.lut()
    assert lut.dtype == np.float32 and lut.shape == (N_CODES,)
    assert np.all(np.isfinite(lut))
    assert np.all(np.diff(lut.astype(np.float64)) >= 0)
    assert lut[-1] == 0.0
    # representatives, in float64 from the module doc: sqrt zone u_rep^2 = k^2 + 1/12, head zone linear
    b = 65535.0 / (2.0 + abs(knee))
    k = np.arange(N_CODES, dtype=np.float64)
    rep = np.where(k < 2 * b, knee + np.log((k * k + 1 / 12) / (2 * b) ** 2), knee + (k - 2 * b) / b)
    np.testing.assert_allclose(lut, np.minimum(rep, 0.0), rtol=1e-6, atol=1e-6)
    # every representative lies inside its own code's bin: re-encoding it gives the code back
    u = _u_float64(np.minimum(rep, 0.0), knee)
    inner = (k > 0) & (k < N_CODES - 1)
    assert np.all(np.abs(u[inner] - k[inner]) <= 0.5 + 1e-6)


def test_lut_ends_exactly_at_zero_for_every_knee():
    bad = [float(k) for k in np.arange(-8.0, 0.01, 0.25) if SqrtLogCode(knee=float(k)).lut()[-1] != 0.0]
    assert bad == []


def test_decoded_distribution_noise_floor_is_tiny():
    rng = np.random.default_rng(17)
    logits = realistic_logits(rng, 24, 32000)
    enc = CODE.encode_block(logits, np.zeros(24, dtype=np.int64))
    p_exact = log_softmax64(logits)
    p_hat = decoded_logprobs(enc.codes, CODE.lut())
    kld = kld64(p_exact, p_hat)
    assert np.all(kld >= -1e-12)
    assert kld.mean() < 2e-6, kld.mean()
    # the probability of the argmax is preserved to a high precision
    top = enc.top_ids[:, 0]
    rows = np.arange(len(top))
    np.testing.assert_allclose(np.exp(p_hat[rows, top]), np.exp(p_exact[rows, top]), rtol=1e-3)


def test_quantization_error_in_the_head_is_below_half_a_step():
    """Entries near the top (log-linear zone) decode to within half a code step of their true d."""
    rng = np.random.default_rng(18)
    logits = rng.uniform(-3.9, 0.0, (4, 2000)).astype(np.float32)
    logits[:, 0] = 0.0
    enc = CODE.encode_block(logits, np.zeros(4, dtype=np.int64))
    d = logits.astype(np.float64)  # max is exactly 0
    step = (2.0 + abs(CODE.knee)) / 65535.0
    err = np.abs(CODE.lut().astype(np.float64)[enc.codes] - d)
    assert err.max() <= 0.5 * step + 1e-6


@pytest.mark.parametrize("bad", ["nan_one", "nan_row", "all_minus_inf", "plus_inf"])
def test_bad_logits_raise(bad):
    rng = np.random.default_rng(19)
    logits = rng.normal(0, 1, (3, 100)).astype(np.float32)
    if bad == "nan_one":
        logits[1, 50] = np.nan
    elif bad == "nan_row":
        logits[2, :] = np.nan
    elif bad == "all_minus_inf":
        logits[0, :] = -np.inf
    else:
        logits[1, 3] = np.inf
    with pytest.raises(BadLogits):
        CODE.encode_block(logits, np.zeros(3, dtype=np.int64))


def test_nan_as_the_first_entry_is_detected():
    """A NaN at id 0 must not hide behind the top-k scan (NaN compares false with everything)."""
    logits = np.zeros((2, 50), dtype=np.float32)
    logits[0, 0] = np.nan
    with pytest.raises(BadLogits):
        CODE.encode_block(logits, np.zeros(2, dtype=np.int64))


def test_codec_params_describe_the_code():
    p = SqrtLogCode(knee=-3.0).params()
    assert p["name"] == "sqrt-log" and p["knee"] == -3.0
    assert math.isclose(p["slope"], 65535 / 5.0)


def test_rows_stored_as_the_exact_rows_are_measured_as_a_copy_of_them_is():
    """A replay that gave llama.cpp's own rows (the same array) is measured without a pass of its own: its record
    equals, bit for bit, the record of an equal copy measured entry by entry, ties, -inf and single entries too;
    and it is the float64 slack: KL ~ 1e-12, every |δ| ~ 1e-12."""
    from qeval.storage.codec import REPLAY_BANDS
    from qeval.storage.error_record import FLOAT64_SLACK, ErrorMeter

    rows = tricky_rows(np.random.default_rng(77))
    meter = ErrorMeter.of(rows.shape[1])
    assert meter.uncoded(rows, rows, REPLAY_BANDS) is None  # no tables of its own
    (itself, copy), log_norm = meter.measure(rows, rows.max(axis=1), [
        (REPLAY_BANDS, meter.uncoded(rows, rows, REPLAY_BANDS)),
        (REPLAY_BANDS, meter.uncoded(rows, rows.copy(), REPLAY_BANDS))])
    for field in ("kl", "log_norm", "lo", "hi"):
        assert getattr(itself, field).tobytes() == getattr(copy, field).tobytes(), field
    np.testing.assert_allclose(log_norm, log_softmax64(rows.astype(np.float64)).max(axis=1) * -1, rtol=0, atol=1e-12)
    assert np.all(np.abs(itself.kl - FLOAT64_SLACK) < 1e-14)
    assert np.all(itself.max_abs_dlogp() < 2 * FLOAT64_SLACK)
