"""Per-token sums over the full vocab, fused so a 262K-entry row is walked once per store pair.

A stored row decodes through its store's code table: log p_i = lut[code_i] + const. Both rows are
renormalised, so only e = exp(lut) and l = lut are needed, and
    KLD(P||Q) = (S_pp - S_pq)/Z_p - ln Z_p + ln Z_q,
with Z_p = sum e_p, S_pp = sum e_p l_p, S_pq = sum e_p l_q (and the mirror terms for KLD(Q||P)).

A live candidate's rows need no code at all: l_q = x - max(x) straight from llama.cpp's float32
logits (in float64: exact) and e_q = exp(l_q) (pair_sums_logits), the same six sums, so the figures differ from
coding the candidate first only by the code's rounding.

In the same pass, where the stores record their error (qeval.storage.error_record), the kernels add up the
certified bound on |ΔKLD| of docs/error-bound.md, both directions (columns BOUND_FWD, BOUND_REV), from each side's
record (error_record.BandWeights).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from qeval.storage.codec import BadLogits
from qeval.storage.error_record import subtract_max

# Columns of the per-token sums array: the six sums of the KLDs; the certified bounds on |ΔKLD|, forward and reverse
# (NaN where none is computed); a live candidate's exact normaliser sum_i exp(x_i - max), unclamped.
Z_P, Z_Q, S_PP, S_PQ, S_QQ, S_QP, BOUND_FWD, BOUND_REV, Z_Q_EXACT = range(9)
N_SUMS = 9


@numba.njit(nogil=True, cache=True, fastmath=False)
def pair_sums(planes_p, planes_q, e_p, l_p, e_q, l_q, out, bands_p=None, bands_q=None, weights_p=None,
              weights_q=None, tokens_p=None, tokens_q=None):  # pragma: no cover - compiled
    """planes_*: uint8 [b, 2, V] (high then low byte of each code); tables: float64 [65536].

    Writes float64 [b, N_SUMS] sums into `out`: the first six, and with bands_p (not None) the bound in BOUND_FWD
    and BOUND_REV (docs/error-bound.md, both stores coded). bands_*: uint8 [65536], each code's band; weights_*:
    float64 [3, b, K] and tokens_*: float64 [2, b], each side's error_record.BandWeights. Accumulates in float64.
    """
    n_tokens, _, n_vocab = planes_p.shape
    for t in range(n_tokens):
        hp = planes_p[t, 0]
        lo_p = planes_p[t, 1]
        hq = planes_q[t, 0]
        lo_q = planes_q[t, 1]
        zp = 0.0
        zq = 0.0
        spp = 0.0
        spq = 0.0
        sqq = 0.0
        sqp = 0.0
        f1 = 0.0  # sum p~ w_p |a|: the reference's error against the rows' differences a = l_p - l_q
        r1 = 0.0  # sum q~ w_q |a|
        fb = 0.0  # sum s err_q, s = |p~ - q~| + p~ w_p + q~ w_q >= |p - q|: the candidate's error where they differ
        rb = 0.0  # sum s err_p
        if bands_p is not None:  # (a None argument compiles this away: numba prunes the branch)
            ip = tokens_p[1, t]
            iq = tokens_q[1, t]
            w_p = weights_p[0, t]
            w_q = weights_q[0, t]
            err_p = weights_p[2, t]
            err_q = weights_q[2, t]
        for i in range(n_vocab):
            cp = (np.int32(hp[i]) << 8) | np.int32(lo_p[i])
            cq = (np.int32(hq[i]) << 8) | np.int32(lo_q[i])
            ep = e_p[cp]
            eq = e_q[cq]
            lp = l_p[cp]
            lq = l_q[cq]
            zp += ep
            zq += eq
            spp += ep * lp
            spq += ep * lq
            sqq += eq * lq
            sqp += eq * lp
            if bands_p is not None:
                bp = bands_p[cp]
                bq = bands_q[cq]
                pn = ep * ip
                qn = eq * iq
                a = abs(lp - lq)
                pw = pn * w_p[bp]
                qw = qn * w_q[bq]
                f1 += pw * a
                r1 += qw * a
                s = abs(pn - qn) + pw + qw
                fb += s * err_q[bq]
                rb += s * err_p[bp]
        out[t, 0] = zp
        out[t, 1] = zq
        out[t, 2] = spp
        out[t, 3] = spq
        out[t, 4] = sqq
        out[t, 5] = sqp
        if bands_p is not None:
            kp = tokens_p[0, t]
            kq = tokens_q[0, t]
            out[t, 6] = kp + f1 + kq + fb
            out[t, 7] = kq + r1 + kp + rb


@numba.njit(nogil=True, cache=True, inline="always")
def _write_sums(out, zp, zq, spp, spq, sqq, sqp):  # pragma: no cover - compiled
    """A row's six sums of the KLDs into its columns Z_P .. S_QP."""
    out[0] = zp
    out[1] = zq
    out[2] = spp
    out[3] = spq
    out[4] = sqq
    out[5] = sqp


@numba.njit(nogil=True, cache=True, fastmath=False)
def _pair_sums_row(hp, lo_p, raw, e_raw, inv_exact, floor, e_floor, e_p, l_p, bands_p, weights_p, tokens_p,
                   out):  # pragma: no cover - compiled
    """One row of pair_sums_logits: the reference's code bytes against the candidate's raw = x - max and
    e_raw = exp(raw) (float64; inv_exact = 1 / sum e_raw), counted at the floor below it; the bound against the
    candidate's exact row."""
    zp = 0.0
    zq = 0.0
    spp = 0.0
    spq = 0.0
    sqq = 0.0
    sqp = 0.0
    ip = 0.0
    if bands_p is not None:  # (a None argument compiles the bound away: numba prunes the branch)
        ip = tokens_p[0, 1]
    a1 = 0.0  # sum p~ w |a|: the reference's error against the rows' differences
    a2 = 0.0  # sum p~ grow g: the floor's lift g of the candidate, under the reference's mass
    b1 = 0.0  # sum e_q' |a| (the candidate as compared, unnormalised)
    b2 = 0.0  # sum e_q' min(1, g) |a|
    rb = 0.0  # sum (|q - p~| + p~ w) err, q the exact candidate: the reference's error where the rows differ
    for i in range(len(raw)):
        cp = (np.int32(hp[i]) << 8) | np.int32(lo_p[i])
        ep = e_p[cp]
        lp = l_p[cp]
        x = raw[i]
        if x < floor:
            lq = floor
            eq = e_floor
            g = floor - x
        else:
            lq = x
            eq = e_raw[i]
            g = 0.0
        zp += ep
        zq += eq
        spp += ep * lp
        spq += ep * lq
        sqq += eq * lq
        sqp += eq * lp
        if bands_p is not None:
            b = bands_p[cp]
            pn = ep * ip
            pw = pn * weights_p[0, b]
            a = abs(lp - lq)
            a1 += pw * a
            a2 += pn * weights_p[1, b] * g
            b1 += eq * a
            b2 += eq * min(1.0, g) * a
            rb += (abs(e_raw[i] * inv_exact - pn) + pw) * weights_p[2, b]
    _write_sums(out, zp, zq, spp, spq, sqq, sqp)
    out[8] = 1.0 / inv_exact
    if bands_p is not None:
        # the candidate as compared (q') against its exact row q: log q_i - log q'_i = c - g_i, c = log(zq/z_exact)
        c = max(0.0, math.log(zq * inv_exact))
        kp = tokens_p[0, 0]
        out[6] = kp + a1 + max(c, a2)
        out[7] = c + math.expm1(c) * b1 / zq + b2 / zq + kp + rb


def relative_row(row: np.ndarray, raw: np.ndarray, e: np.ndarray) -> None:
    """raw = x − max (float64: exact) and e = exp(raw) of a float32 row read as it is, into the buffers given (exp in
    numpy, vectorised, unlike a scalar exp in a compiled loop); BadLogits for a row with NaN or no finite value."""
    row_max = row.max()  # NaN if any entry is
    if not np.isfinite(row_max):
        raise BadLogits("logits contain NaN or a row with no finite value")
    subtract_max(row, row_max, raw)
    np.exp(raw, out=e)


def pair_sums_logits(planes_ref: np.ndarray, logits: np.ndarray, e_p: np.ndarray, l_p: np.ndarray,
                     out: np.ndarray, scratch: np.ndarray, bands_p: np.ndarray | None = None,
                     weights_p: np.ndarray | None = None, tokens_p: np.ndarray | None = None) -> None:
    """pair_sums of a stored reference row (uint8 [2, V]) against a live float32 logits row [V].

    Entries further below the row's maximum than the lowest code (l_p[0], ~-26 nats) count at that
    floor, as they would in a store: coded or not, a candidate gives the same figures, and a -inf
    logit gives no 0 * -inf. The bound (BOUND_FWD, BOUND_REV) is against the candidate's exact row: the floor's
    lift is part of it; Z_Q_EXACT is that row's normaliser. bands_p: each code's band; weights_p: float64 [3, K]
    and tokens_p: float64 [1, 2], the reference row's BandWeights (None: no bound, the columns stay as they are).
    `scratch` is float64 [2, V], reused across calls (a fresh 4 MB array per row would cost a page fault per
    4 KB). exp runs in numpy, vectorised, unlike a scalar exp in a compiled loop."""
    raw, e_raw = scratch
    relative_row(logits, raw, e_raw)
    floor = float(l_p[0])
    _pair_sums_row(planes_ref[0], planes_ref[1], raw, e_raw, 1.0 / e_raw.sum(), floor, math.exp(floor), e_p, l_p,
                   bands_p, weights_p, tokens_p, out)


@numba.njit(nogil=True, cache=True, inline="always")
def _add_entry(zp, zq, spp, spq, sqq, sqp, ep, lp, eq, lq):  # pragma: no cover - compiled
    """A row's six sums with one entry more, read as it is on both sides (e = exp(l)); an entry of probability 0
    adds nothing on its side (its log is -inf)."""
    zp += ep
    zq += eq
    if ep > 0.0:
        spp += ep * lp
        spq += ep * lq
    if eq > 0.0:
        sqq += eq * lq
        sqp += eq * lp
    return zp, zq, spp, spq, sqq, sqp


@numba.njit(nogil=True, cache=True, fastmath=False)
def _pair_sums_replayed_row(raw_p, e_p, raw_q, e_q, inv_exact, weights_p, tokens_p, out):  # pragma: no cover
    """One row of pair_sums_replayed: the reference's raw_p = x − max and e_p = exp(raw_p) against the candidate's
    (float64; inv_exact = 1 / Σ e_q), both read as they are; the bound from the reference's record alone, whose one
    band (codec.REPLAY_BANDS) holds every entry."""
    zp = zq = spp = spq = sqq = sqp = ip = 0.0
    if weights_p is not None:  # (a None argument compiles the bound away: numba prunes the branch)
        ip = tokens_p[0, 1]
    a1 = 0.0  # sum p~ w |a|: the reference's error against the rows' differences
    rb = 0.0  # sum (|q - p~| + p~ w) err: the reference's error where the rows differ
    for i in range(len(raw_p)):
        ep, eq, lp, lq = e_p[i], e_q[i], raw_p[i], raw_q[i]
        zp, zq, spp, spq, sqq, sqp = _add_entry(zp, zq, spp, spq, sqq, sqp, ep, lp, eq, lq)
        if weights_p is not None:
            pn = ep * ip
            pw = pn * weights_p[0, 0]
            if ep > 0.0:
                a1 += pw * abs(lp - lq)
            rb += (abs(eq * inv_exact - pn) + pw) * weights_p[2, 0]
    _write_sums(out, zp, zq, spp, spq, sqq, sqp)
    out[8] = 1.0 / inv_exact
    if weights_p is not None:
        kp = tokens_p[0, 0]
        out[6] = kp + a1
        out[7] = kp + rb


def pair_sums_replayed(ref_row: np.ndarray, logits: np.ndarray, out: np.ndarray, scratch: np.ndarray,
                       weights_p: np.ndarray | None = None, tokens_p: np.ndarray | None = None) -> None:
    """The sums of a reference row read uncoded (float32 [V]: a hidden-form row replayed, qeval.storage.codec
    .replayed_rows) against a live float32 logits row [V]: no code, no floor on either side, so the only error is
    the replay's, which the reference's record (weights_p [3, 1], tokens_p [1, 2]: BandWeights of the replayed
    rows, one band) bounds, docs/error-bound.md ("A reference read uncoded"). `scratch` is float64
    [4, V], reused across calls."""
    raw_p, e_p, raw_q, e_q = scratch
    relative_row(ref_row, raw_p, e_p)
    relative_row(logits, raw_q, e_q)
    _pair_sums_replayed_row(raw_p, e_p, raw_q, e_q, 1.0 / e_q.sum(), weights_p, tokens_p, out)


@numba.njit(nogil=True, cache=True, fastmath=False)
def _pair_sums_replayed_coded_row(raw_p, e_p, hq, lo_q, e_q, l_q, out, bands_q, kp, ip, w_p, err_p, w_q, err_q,
                                  kq, iq):  # pragma: no cover - compiled
    """One row of pair_sums_replayed_coded: the reference's raw_p = x − max and e_p = exp(raw_p) (float64, read as
    they are) against a stored candidate's code bytes and tables. The bound is pair_sums's with the reference's
    code the identity and its one band (codec.REPLAY_BANDS): its record's kp = KL(exact ‖ row), ip = 1 / Σ e_p,
    w_p and err_p; the candidate's kq, iq and per band w_q, err_q (bands_q None: no bound)."""
    zp = zq = spp = spq = sqq = sqp = 0.0
    f1 = r1 = fb = rb = 0.0  # as pair_sums: p~ w_p |a|, q~ w_q |a|, s err_q, s err_p
    for i in range(len(raw_p)):
        cq = (np.int32(hq[i]) << 8) | np.int32(lo_q[i])
        ep, lp, eq, lq = e_p[i], raw_p[i], e_q[cq], l_q[cq]
        zp, zq, spp, spq, sqq, sqp = _add_entry(zp, zq, spp, spq, sqq, sqp, ep, lp, eq, lq)
        if bands_q is not None:  # (a None argument compiles the bound away: numba prunes the branch)
            bq = bands_q[cq]
            pn = ep * ip
            qn = eq * iq
            pw = pn * w_p
            qw = qn * w_q[bq]
            a = abs(lp - lq)
            if ep > 0.0:
                f1 += pw * a
            r1 += qw * a
            s = abs(pn - qn) + pw + qw
            fb += s * err_q[bq]
            rb += s * err_p
    _write_sums(out, zp, zq, spp, spq, sqq, sqp)
    if bands_q is not None:
        out[6] = kp + f1 + kq + fb
        out[7] = kq + r1 + kp + rb


def pair_sums_replayed_coded(ref_row: np.ndarray, planes_q: np.ndarray, e_q: np.ndarray, l_q: np.ndarray,
                             out: np.ndarray, scratch: np.ndarray, bands_q: np.ndarray | None = None,
                             weights_p: np.ndarray | None = None, tokens_p: np.ndarray | None = None,
                             weights_q: np.ndarray | None = None, tokens_q: np.ndarray | None = None) -> None:
    """The sums of a reference row read uncoded (float32 [V]: a hidden-form row replayed) against a stored
    candidate's row (planes uint8 [2, V] of its code, tables e_q, l_q): a store-against-store comparison that reads
    the reference at the replay's speed, not coded again. With bands_q (the candidate's band of each code), the
    bound from both records (docs/error-bound.md): weights_p [3, 1], tokens_p [2] (BandWeights of the replayed row,
    one band), weights_q [3, K], tokens_q [2] (the candidate's row). `scratch` is float64 [2, V], reused."""
    raw_p, e_p = scratch
    relative_row(ref_row, raw_p, e_p)
    if bands_q is None:
        zero = np.zeros(1)
        _pair_sums_replayed_coded_row(raw_p, e_p, planes_q[0], planes_q[1], e_q, l_q, out, None, 0.0, 0.0, 0.0, 0.0,
                                      zero, zero, 0.0, 0.0)
        return
    _pair_sums_replayed_coded_row(raw_p, e_p, planes_q[0], planes_q[1], e_q, l_q, out, bands_q, tokens_p[0],
                                  tokens_p[1], weights_p[0, 0], weights_p[2, 0], weights_q[0], weights_q[2],
                                  tokens_q[0], tokens_q[1])


def decode_tables(lut: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e, l) float64 tables for a store's code table."""
    lut64 = np.asarray(lut, dtype=np.float64)
    return np.exp(lut64), lut64


def evaluation_error(sums: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward, reverse) per token: how far float64 evaluation can move a KLD computed from the fused sums
    (docs/error-bound.md, "The float64 evaluation"). Each of the sums adds n_vocab terms of one sign (every l ≤ 0,
    every e ≥ 0) one after the other, each term within a few units in the last place (u = 2^-53) of its value, so a
    sum is within (n_vocab + 8)·u of its own magnitude, which the sums hold; the quotient and the logs add a few u."""
    u = 2.0 ** -53
    eps = (n_vocab + 8) * u
    log_z = np.abs(np.log(sums[:, Z_P])) + np.abs(np.log(sums[:, Z_Q]))

    def one(s_self: int, s_cross: int, z: int) -> np.ndarray:
        ratio = (np.abs(sums[:, s_self]) + np.abs(sums[:, s_cross])) / sums[:, z]
        return eps * (2 * ratio + 2) + 16 * u * (ratio + log_z)

    return one(S_PP, S_PQ, Z_P), one(S_QQ, S_QP, Z_Q)


def kld_from_sums(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KLD(P||Q), KLD(Q||P)) per token from the fused sums."""
    zp, zq = sums[:, Z_P], sums[:, Z_Q]
    log_ratio = np.log(zq) - np.log(zp)
    forward = (sums[:, S_PP] - sums[:, S_PQ]) / zp + log_ratio
    reverse = (sums[:, S_QQ] - sums[:, S_QP]) / zq - log_ratio
    return forward, reverse
