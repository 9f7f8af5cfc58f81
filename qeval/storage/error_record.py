"""The per-token error record: how far a store's distribution is from the one llama.cpp computed, measured at capture.

A capture holds the exact float32 logits of every scored token while it writes the stored form of them (today the
uint16 code of qeval.storage.codec; any other form writes the same record), so it can say exactly how far that form
is. For each scored token it records, in float64 from the exact row (docs/error-bound.md derives what is done with
it):

  kl              KL(exact ‖ stored) = Σ_i p_i (log p_i − log p̃_i), where p is the exact distribution (log-softmax
                  of the float32 logits, computed in float64) and p̃ the stored one (what a reader decodes).
  log_norm        log Σ_i exp(l_i) of the stored row (l_i below): a reader normalises p̃ as it walks the row.
  lo[k], hi[k]    the smallest and largest δ_i = log p_i − log p̃_i over the entries i of band k (float32, rounded
                  outward: lo down, hi up), bands of the STORED relative log-probability
                  l_i = log p̃_i − max_j log p̃_j: entry i is in band min(K − 1, floor(−l_i / width)). An empty band
                  holds (0, 0).

The bands are what makes the record useful for a code whose error grows with depth: with the sqrt-log code
|δ| is ~5e-5 within 4 nats of the top but tens of nats for the deepest entries (code 0), which carry ~1e-7 of
mass; one maximum over the vocabulary would be useless (max |δ| over the whole row is still recorded: it is the
largest |lo|, |hi|). A form whose error is uniform (a replay of the hidden state) may use one band.

On disk (docs/store-format.md): the header's `error` object {"bands": K, "band_width": w} says that every CHNK
record is followed by an ERRS record of its rows: u32 chunk, u32 n, u32 K, u32 first_row, f64[n] kl,
f64[n] log_norm, f32[n, K] lo, f32[n, K] hi.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import numba
import numpy as np

from qeval.errors import StoreFormatError

DEFAULT_BANDS, DEFAULT_BAND_WIDTH = 32, 1.0  # 1-nat bands to 31 nats below the top (the code's deepest entry: 26.5)
MAX_BANDS = 255  # band indices are uint8
# What float64 evaluation can get wrong in these figures (the log-normalisers, the sums over a 262K row: ~1e-15
# nats), and more: every recorded figure is widened by it, so the record bounds the exact values, not only the
# float64 ones.
FLOAT64_SLACK = 1e-12
ERRS_HEAD = struct.Struct("<IIII")  # chunk, n rows, K, first_row


@dataclass(frozen=True)
class ErrorBands:
    """How a store's error record groups entries: `count` bands of `width` nats of stored relative log-probability."""

    count: int = DEFAULT_BANDS
    width: float = DEFAULT_BAND_WIDTH

    def to_json(self) -> dict:
        return {"bands": self.count, "band_width": self.width}

    @classmethod
    def from_json(cls, d: dict, where: str) -> "ErrorBands":
        count, width = d.get("bands"), d.get("band_width")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_BANDS:
            raise StoreFormatError(f"{where}: header field 'error': 'bands' must be an integer 1..{MAX_BANDS} "
                                   f"({count!r})")
        if not isinstance(width, (int, float)) or isinstance(width, bool) or not (math.isfinite(width) and width > 0):
            raise StoreFormatError(f"{where}: header field 'error': 'band_width' must be a positive number ({width!r})")
        return cls(count, float(width))

    def band_of(self, relative_logprob: np.ndarray) -> np.ndarray:
        """uint8 band of each stored relative log-probability (≤ 0; -inf goes to the last band): the one rule."""
        if self.count == 1:  # one band holds everything (a replay's record): no arithmetic over the row
            return np.zeros(np.shape(relative_logprob), dtype=np.uint8)
        depth = -np.asarray(relative_logprob, dtype=np.float64) / self.width
        with np.errstate(invalid="ignore"):
            return np.where(depth >= self.count - 1, self.count - 1,
                            np.floor(np.maximum(depth, 0.0))).astype(np.uint8)


@dataclass
class ErrorRecord:
    """The error record of n scored tokens (see the module's docstring)."""

    kl: np.ndarray  # float64 [n]
    log_norm: np.ndarray  # float64 [n]
    lo: np.ndarray  # float32 [n, K]
    hi: np.ndarray  # float32 [n, K]

    def __len__(self) -> int:
        return len(self.kl)

    @classmethod
    def concat(cls, parts: list["ErrorRecord"]) -> "ErrorRecord":
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("kl", "log_norm", "lo", "hi")))

    def rows(self, start: int, stop: int) -> "ErrorRecord":
        return ErrorRecord(self.kl[start:stop], self.log_norm[start:stop], self.lo[start:stop], self.hi[start:stop])

    def max_abs_dlogp(self) -> np.ndarray:
        """max |log p − log p̃| over the whole vocabulary, per token."""
        return np.maximum(-self.lo.min(axis=1), self.hi.max(axis=1)).astype(np.float64)

    def payload(self, index: int, first_row: int) -> bytes:
        n, k = self.lo.shape
        return b"".join([ERRS_HEAD.pack(index, n, k, first_row), np.ascontiguousarray(self.kl, "<f8").tobytes(),
                         np.ascontiguousarray(self.log_norm, "<f8").tobytes(),
                         np.ascontiguousarray(self.lo, "<f4").tobytes(),
                         np.ascontiguousarray(self.hi, "<f4").tobytes()])

    @classmethod
    def from_payload(cls, payload, index: int, first_row: int, n: int, bands: int, where: str) -> "ErrorRecord":
        """The record of an ERRS payload, checked against its chunk record and the header (StoreFormatError)."""
        if len(payload) != record_bytes(n, bands):
            raise StoreFormatError(f"{where}: chunk {index} error record has {len(payload)} bytes, expected "
                                   f"{record_bytes(n, bands)}")
        got = ERRS_HEAD.unpack_from(payload)
        if got != (index, n, bands, first_row):
            raise StoreFormatError(f"{where}: chunk {index} error record disagrees with its chunk record (chunk, "
                                   f"rows, bands, first row {got}, expected {(index, n, bands, first_row)})")
        pos = ERRS_HEAD.size
        kl, log_norm = (np.frombuffer(payload, "<f8", n, pos + 8 * n * k).astype(np.float64) for k in (0, 1))
        lo, hi = (np.frombuffer(payload, "<f4", n * bands, pos + 16 * n + 4 * n * bands * k).reshape(n, bands)
                  .astype(np.float32) for k in (0, 1))
        # kl is a finite KL divergence; log_norm of a row whose top entry is exp(0): at least 0; a band's bounds are
        # ordered, not NaN, hi < +inf (lo may be -inf: an entry the exact row gives probability 0)
        if not (np.all(np.isfinite(kl)) and np.all(kl >= 0) and np.all(np.isfinite(log_norm))
                and np.all(log_norm >= 0) and np.all(lo <= hi) and np.all(hi < np.inf)):
            raise StoreFormatError(f"{where}: chunk {index} error record holds invalid values")
        return cls(kl, log_norm, lo, hi)


def summarize(records) -> dict:
    """What a store's records say over all its tokens (`qeval info`): KL(exact ‖ stored) per token, mean and max;
    the largest |Δ log p| within the top band (the entries that carry the mass) and over the whole vocabulary."""
    parts = list(records)
    if not parts:
        return {"tokens": 0}
    kl = np.concatenate([r.kl for r in parts])
    top = np.concatenate([np.maximum(-r.lo[:, 0], r.hi[:, 0]) for r in parts])
    whole = np.concatenate([r.max_abs_dlogp() for r in parts])
    return {"tokens": int(len(kl)), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "max_abs_dlogp_top_band": float(top.max()), "max_abs_dlogp": float(whole.max())}


def recorded(source) -> dict:
    """What a store (StoreReader) says of the error of its stored form (`qeval info`, a published reference's
    manifest): its record's bands and summarize() over every token; {"recorded": False} for a store without one."""
    if source.header.error_bands is None:
        return {"recorded": False}
    return {"recorded": True, "bands": source.header.error, **summarize(e for _, e in source.iter_errors())}


def replayed(source) -> dict:
    """The same of a hidden-form store's uncoded replays, by the engine that replayed them ({} for none)."""
    by_engine: dict[str, list] = {}
    for _, replay in source.iter_replays() if source.header.replay_record else ():
        by_engine.setdefault(replay.engine, []).append(replay.record)
    return {engine: summarize(records) for engine, records in by_engine.items()}


def record_bytes(n: int, bands: int) -> int:
    """The ERRS payload of n rows with `bands` bands."""
    return ERRS_HEAD.size + 16 * n + 8 * n * bands


def rows_of(parts: list[tuple[int, ErrorRecord]], start: int, stop: int) -> ErrorRecord | None:
    """Rows [start, stop) of a chunk whose records come in parts (first row, record), in row order; None when
    the chunk has none."""
    if not parts or parts[0][1] is None:
        return None
    got = [r.rows(max(start - first, 0), stop - first) for first, r in parts if first < stop and start < first + len(r)]
    if sum(map(len, got)) != stop - start:
        raise ValueError(f"rows {start}:{stop} of the error record are not at hand")
    return got[0] if len(got) == 1 else ErrorRecord.concat(got)


def outward(values: np.ndarray, direction: float) -> np.ndarray:
    """float64 values as float32, rounded toward `direction` (-inf: down, +inf: up) so a bound stays a bound."""
    f = values.astype(np.float32)
    moved = f.astype(np.float64) > values if direction < 0 else f.astype(np.float64) < values
    return np.where(moved, np.nextafter(f, np.float32(direction)), f)


@numba.njit(nogil=True, cache=True)
def subtract_max(row, row_max, d):  # pragma: no cover - compiled
    """d = x − max of a float32 row, in float64 (exact: both are float32)."""
    m = np.float64(row_max)
    for i in range(len(row)):
        d[i] = np.float64(row[i]) - m


@numba.njit(nogil=True, cache=True)
def _measure_row(d, e, index, stored, stored_exp, band, lo, hi):  # pragma: no cover - compiled
    """One row: (Σ exp(l_i), Σ e_i·r_i) with r_i = d_i − l_i, and each band's min and max r into lo, hi.

    d: float64 exact log p − log p_max (-inf allowed); e = exp(d). Entry i is stored as the index[i]-th entry of
    the tables stored (l, its stored relative log-prob, ≤ 0), stored_exp (exp(l), float64) and band (uint8): a
    code and its tables, or index 0..V-1 and the row itself."""
    z_stored = 0.0
    s = 0.0
    for i in range(len(d)):
        j = index[i]
        r = d[i] - np.float64(stored[j])
        b = band[j]
        if r < lo[b]:
            lo[b] = r
        if r > hi[b]:
            hi[b] = r
        z_stored += stored_exp[j]
        if e[i] > 0.0:  # an entry of probability 0 adds nothing (and its r is -inf)
            s += e[i] * r
    return z_stored, s


@numba.njit(nogil=True, cache=True)
def _sum_in_order(e):  # pragma: no cover - compiled
    """Σ e_i, i in order (as _measure_row sums a row stored as the exact row itself)."""
    total = 0.0
    for i in range(len(e)):
        total += e[i]
    return total


class ErrorMeter:
    """Measures rows as they are stored: the error record of each stored form of them, and their exact
    log-normaliser. Each exact row is computed once for all the forms a capture stores of it (the logits code, each
    replay engine's rows). Its row buffers are reused from row to row (a fresh 2 MB buffer per block costs a page
    fault per 4 KB): ErrorMeter.of gives each thread its own."""

    _mine = threading.local()

    def __init__(self, n_vocab: int):
        self._d = np.empty(n_vocab, dtype=np.float64)
        self._e = np.empty(n_vocab, dtype=np.float64)
        self._l, self._exp_l = np.empty_like(self._d), np.empty_like(self._e)
        self._index = np.arange(n_vocab)

    @classmethod
    def of(cls, n_vocab: int) -> "ErrorMeter":
        """This thread's meter for rows of n_vocab entries."""
        meter = getattr(cls._mine, "meter", None)
        if meter is None or len(meter._d) != n_vocab:
            meter = cls._mine.meter = cls(n_vocab)
        return meter

    def uncoded(self, logits: np.ndarray, stored: np.ndarray, bands: ErrorBands):
        """The stored_rows of float32 rows [b, V] stored as themselves (a replay's rows, read uncoded), for measure():
        row t is its own table (index 0..V-1, l = x − max in float64 (exact), exp(l), the band of l), the entries a
        kernel reading it uncoded computes (kernels.pair_sums_replayed). Rows that are `logits` themselves (a replay
        that gave llama.cpp's rows, GgmlHead.rows_of) in one band: None, which measure() takes as the exact row
        itself, with no pass of its own over the vocabulary."""
        if stored is logits and bands.count == 1:
            return None

        def tables(t: int):
            subtract_max(stored[t], stored[t].max(), self._l)
            np.exp(self._l, out=self._exp_l)
            return self._index, self._l, self._exp_l, bands.band_of(self._l)

        return tables

    def _exact_row(self, row: np.ndarray, row_max: float) -> float:
        """Fill d = x − max and e = exp(d) of a float32 row, in float64; return Σ e."""
        subtract_max(row, row_max, self._d)
        np.exp(self._d, out=self._e)  # numpy's exp is vectorised (SIMD), a scalar exp in a compiled loop is not
        return float(self._e.sum())  # pairwise summation: relative error ~1e-16 * log2(V)

    def measure(self, logits: np.ndarray, row_max: np.ndarray, forms) -> tuple[list[ErrorRecord], np.ndarray]:
        """([the record of each form], exact log Σ_j exp(x_j − max) in float64) of float32 logit rows [b, V] with
        maxima `row_max`. forms: (bands, stored_rows) of each stored form, stored_rows(t) → (index, l, exp(l), band)
        of row t (see _measure_row): its stored relative log-probs (≤ 0, 0 at the top), their exponentials in
        float64, their bands (ErrorBands.band_of); called once per row, after the exact row is at hand. None: the
        exact rows themselves, in one band (uncoded())."""
        b = len(logits)
        records = [ErrorRecord(np.empty(b), np.empty(b), np.empty((b, bands.count)), np.empty((b, bands.count)))
                   for bands, _ in forms]
        log_norm = np.empty(b)
        for t in range(b):
            z = self._exact_row(logits[t], row_max[t])
            log_norm[t] = math.log(z)
            for record, (_, stored_rows) in zip(records, forms):
                self._measure_row(t, z, None if stored_rows is None else stored_rows(t), record)
        rounded = [ErrorRecord(r.kl, r.log_norm, outward(r.lo, -np.inf), outward(r.hi, np.inf)) for r in records]
        return rounded, log_norm

    def _measure_row(self, t: int, z: float, tables, record: ErrorRecord) -> None:
        """Row t of `record` (float64 lo and hi until measure() rounds them outward) from the exact row at hand (its
        Σ exp(x − max): z)."""
        lo, hi = record.lo[t], record.hi[t]
        lo[:], hi[:] = np.inf, -np.inf
        if tables is None:  # the exact row as its own one band: every r is 0 (NaN where p = 0, which counts nowhere)
            z_stored, s = _sum_in_order(self._e), 0.0
            lo[0] = hi[0] = 0.0
        else:
            z_stored, s = _measure_row(self._d, self._e, *tables, lo, hi)
        record.log_norm[t] = math.log(z_stored)
        zeta = math.log(z) - record.log_norm[t]  # log p_i − log p̃_i = r_i − zeta
        record.kl[t] = max(0.0, s / z - zeta) + FLOAT64_SLACK
        empty = lo > hi
        lo[:] = np.where(empty, 0.0, lo - zeta - FLOAT64_SLACK)
        hi[:] = np.where(empty, 0.0, hi - zeta + FLOAT64_SLACK)


@dataclass
class BandWeights:
    """What the comparison kernels need from a side's record (docs/error-bound.md): per token and band
    w ≥ |exp(δ) − 1|, grow ≥ exp(δ), err ≥ |δ| for every δ of the band (`bands`, float64 [3, n, K]); per token
    its KL(exact ‖ stored) and 1 / Σ exp(l_i), the stored row's normaliser (`tokens`, float64 [2, n])."""

    bands: np.ndarray
    tokens: np.ndarray

    @classmethod
    def of(cls, record: ErrorRecord) -> "BandWeights":
        lo, hi = record.lo.astype(np.float64), record.hi.astype(np.float64)
        with np.errstate(over="ignore"):
            w = np.maximum(np.expm1(hi), -np.expm1(lo))
            bands = np.stack([w, np.exp(hi), np.maximum(-lo, hi)])
        return cls(np.nextafter(bands, np.inf), np.stack([record.kl, np.exp(-record.log_norm)]))
