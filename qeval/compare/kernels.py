"""Per-token sums over the full vocab, fused so a 262K-entry row is walked once per store pair.

A stored row decodes through its store's code table: log p_i = lut[code_i] + const. Both rows are
renormalised, so only e = exp(lut) and l = lut are needed, and
    KLD(P||Q) = (S_pp - S_pq)/Z_p - ln Z_p + ln Z_q,
with Z_p = sum e_p, S_pp = sum e_p l_p, S_pq = sum e_p l_q (and the mirror terms for KLD(Q||P)).

A live candidate's rows need no code at all: l_q = x - max(x) straight from llama.cpp's float32
logits and e_q = exp(l_q) (pair_sums_logits), the same six sums, so the figures differ from coding the
candidate first only by the code's rounding (its fidelity floor, ~4e-7 nats of KLD).
"""

from __future__ import annotations

import numba
import numpy as np

from qeval.storage.codec import BadLogits

# Columns of the per-token sums array.
Z_P, Z_Q, S_PP, S_PQ, S_QQ, S_QP = range(6)
N_SUMS = 6


@numba.njit(nogil=True, cache=True, fastmath=False)
def pair_sums(planes_p, planes_q, e_p, l_p, e_q, l_q, out):  # pragma: no cover - compiled
    """planes_*: uint8 [b, 2, V] (high then low byte of each code); tables: float64 [65536].

    Writes float64 [b, 6] sums into `out`. Accumulates in float64 in two lanes for throughput.
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
        out[t, 0] = zp
        out[t, 1] = zq
        out[t, 2] = spp
        out[t, 3] = spq
        out[t, 4] = sqq
        out[t, 5] = sqp


@numba.njit(nogil=True, cache=True, fastmath=False)
def _pair_sums_row(hp, lo_p, l_q, e_q, e_p, l_p, out):  # pragma: no cover - compiled
    """One row of pair_sums_logits: the reference's code bytes against the candidate's l_q, e_q (float32)."""
    zp = 0.0
    zq = 0.0
    spp = 0.0
    spq = 0.0
    sqq = 0.0
    sqp = 0.0
    for i in range(len(l_q)):
        cp = (np.int32(hp[i]) << 8) | np.int32(lo_p[i])
        ep = e_p[cp]
        lp = l_p[cp]
        lq = np.float64(l_q[i])
        eq = np.float64(e_q[i])
        zp += ep
        zq += eq
        spp += ep * lp
        spq += ep * lq
        sqq += eq * lq
        sqp += eq * lp
    out[0] = zp
    out[1] = zq
    out[2] = spp
    out[3] = spq
    out[4] = sqq
    out[5] = sqp


def pair_sums_logits(planes_ref: np.ndarray, logits: np.ndarray, e_p: np.ndarray, l_p: np.ndarray,
                     out: np.ndarray, scratch: np.ndarray) -> None:
    """pair_sums of a stored reference row (uint8 [2, V]) against a live float32 logits row [V].

    Entries further below the row's maximum than the lowest code (l_p[0], ~-26 nats) count at that
    floor, as they would in a store: coded or not, a candidate gives the same figures, and a -inf
    logit gives no 0 * -inf. `scratch` is float32 [2, V], reused across calls (a fresh 2 MB array per
    row would cost a page fault per 4 KB). exp runs in numpy, vectorised, unlike a scalar exp in a
    compiled loop."""
    l_q, e_q = scratch
    row_max = logits.max()  # NaN if any entry is
    if not np.isfinite(row_max):
        raise BadLogits("logits contain NaN or a row with no finite value")
    np.subtract(logits, row_max, out=l_q)
    np.maximum(l_q, np.float32(l_p[0]), out=l_q)
    np.exp(l_q, out=e_q)
    _pair_sums_row(planes_ref[0], planes_ref[1], l_q, e_q, e_p, l_p, out)


def decode_tables(lut: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e, l) float64 tables for a store's code table."""
    lut64 = np.asarray(lut, dtype=np.float64)
    return np.exp(lut64), lut64


def kld_from_sums(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KLD(P||Q), KLD(Q||P)) per token from the fused sums."""
    zp, zq = sums[:, Z_P], sums[:, Z_Q]
    log_ratio = np.log(zq) - np.log(zp)
    forward = (sums[:, S_PP] - sums[:, S_PQ]) / zp + log_ratio
    reverse = (sums[:, S_QQ] - sums[:, S_QP]) / zq - log_ratio
    return forward, reverse
