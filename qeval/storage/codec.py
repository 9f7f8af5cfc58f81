"""The uint16 code for one row of log-probabilities, and the exact per-token scalars.

Why this code. For small errors, KLD(P||P_hat) ~ sum_i p_i * delta_i^2 / 2 where delta_i is the error
in log p_i. A quantizer with step D(d) at depth d = log p_i - log p_max adds p_i * D^2 / 24 per entry
and costs about -log2 D bits after entropy coding. Minimising bits for a given KLD gives
D proportional to exp(-d/2): uniform steps in sqrt(p) (the Hellinger geometry). Near the top of the
row that law would spend 40 % of the 65,536 codes on the top nat, where a row has one or two entries,
so the code switches to uniform steps in log p above a knee d0:

    u(d) = 2B * exp((d - d0)/2)        d <  d0   (sqrt-probability zone: the tail)
    u(d) = 2B + B * (d - d0)           d >= d0   (log-linear zone: the head)
    code = round(u), clipped to 0..65535

u and its slope are continuous at d0. With B = 65535 / (2 + |d0|) the argmax entry (d = 0) gets code
65535. Lower d0 buys precision everywhere (and bits); see bench/codec_frontier.py for the measured
frontier. Entries far below the head round to code 0.

The decoder never evaluates this formula: every store carries its 65,536-entry table
lut[code] = d of the code's representative, so a reader only needs lut[] (docs/store-format.md).
Representatives preserve probability mass for entries spread evenly in u within the bin:
u_rep^2 = k^2 + 1/12 in the sqrt zone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator

import numba
import numpy as np

from qeval.errors import StoreFormatError
from qeval.storage.error_record import ErrorBands, ErrorMeter, ErrorRecord
from qeval.storage.hidden_form import OutputHead, StoredActivations, activation_bytes
from qeval.storage.planes import N_CODES, TOP_K, codes_to_planes, planes_to_codes


@dataclass(frozen=True)
class SqrtLogCode:
    """The default code; `knee` is d0 (<= 0, in nats below the row's maximum). `error`: the bands of the error
    record each coded row gets (qeval.storage.error_record), None for none (a llama.cpp file re-coded: its exact
    logits are gone)."""

    knee: float = -4.0
    error: ErrorBands | None = field(default_factory=ErrorBands)

    @property
    def slope(self) -> float:
        return (N_CODES - 1) / (2.0 + abs(self.knee))

    def params(self) -> dict:
        return {"name": "sqrt-log", "knee": self.knee, "slope": self.slope}

    def error_spec(self) -> dict:
        """The header's `error` object: what the error record of its rows holds ({}: none)."""
        return self.error.to_json() if self.error is not None else {}

    def form(self) -> dict:
        """The stored form, as a store's identity holds it (qeval.identity.form): the code and its error record."""
        return {**self.params(), **({"error": self.error_spec()} if self.error is not None else {})}

    def lut(self) -> np.ndarray:
        """float32[65536]: code -> d (log p - log p_max) of the code's representative."""
        return _lut(self.knee).copy()

    def error_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lut and exp(lut) in float64, the band of each code) for measuring the error record."""
        return _error_tables(self.knee, self.error)

    def encode_block(self, logits: np.ndarray, targets: np.ndarray) -> "EncodedBlock":
        return encode_block(logits, targets, self)


@lru_cache(maxsize=8)
def _lut(knee: float) -> np.ndarray:
    """SqrtLogCode(knee).lut(), made once (read only)."""
    b, d0 = SqrtLogCode(knee, None).slope, knee
    k = np.arange(N_CODES, dtype=np.float64)
    sqrt_zone = k < 2.0 * b
    d = np.empty(N_CODES, dtype=np.float64)
    d[sqrt_zone] = d0 + np.log((k[sqrt_zone] ** 2 + 1.0 / 12.0) / (2.0 * b) ** 2)
    d[~sqrt_zone] = (k[~sqrt_zone] - (N_CODES - 1)) / b  # = d0 + (k - 2B)/B, exact 0 at the top
    lut = np.minimum(d, 0.0).astype(np.float32)
    lut.flags.writeable = False
    return lut


@lru_cache(maxsize=8)
def _error_tables(knee: float, bands: ErrorBands) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lut = _lut(knee).astype(np.float64)
    return lut, np.exp(lut), bands.band_of(lut)


@dataclass
class EncodedBlock:
    planes: np.ndarray  # uint8 [b, 2, V]: high bytes then low bytes of the uint16 codes
    logprob_target: np.ndarray  # float64 [b]
    logprob_max: np.ndarray  # float64 [b]
    top_ids: np.ndarray  # int32 [b, min(TOP_K, V)]
    error: ErrorRecord | None = None  # how far the coded rows are from the logits (SqrtLogCode.error)
    hidden: bytes | None = None  # the hidden form: the rows' stored activations (planes: the replayed rows')
    uncoded: tuple["UncodedRows", ...] = ()  # the hidden form: its rows as each replay engine gives them, uncoded

    def __len__(self) -> int:
        return len(self.logprob_target)

    @property
    def codes(self) -> np.ndarray:
        return planes_to_codes(self.planes)


class BadLogits(ValueError):
    """A logits row holds NaN or no finite value: the model produced garbage."""


def encode_block(logits: np.ndarray, targets: np.ndarray, code: SqrtLogCode) -> EncodedBlock:
    """Code a block of float32 logit rows [b, V]; `targets` are the correct next-token ids [b]."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    b, n_vocab = logits.shape
    top_k = min(TOP_K, n_vocab)
    top_vals = np.empty((b, top_k), dtype=np.float32)
    top_ids = np.empty((b, top_k), dtype=np.int32)
    _top_k(logits, top_vals, top_ids)
    row_max = top_vals[:, 0:1]
    if not np.all(np.isfinite(row_max)) or np.isnan(logits).any():
        raise BadLogits("logits contain NaN or a row with no finite value")
    codes, mass = _codes(logits, row_max, code)
    planes = codes_to_planes(codes)  # two vectorised passes: faster than two byte stores per entry in the loop
    if code.error is None:  # as before error records: the log-normaliser from float32 sqrt(p/p_max) (~1e-7 nats)
        error, log_norm = None, np.log(mass)
    else:  # the scalars and the record from the exact row, in float64 (the scalars are then exact)
        lut, lut_exp, band = code.error_tables()
        (error,), log_norm = ErrorMeter.of(n_vocab).measure(logits, row_max[:, 0], [
            (code.error, lambda t: (codes[t], lut, lut_exp, band))])
    rows = np.arange(b)
    logprob_target = (logits[rows, targets].astype(np.float64) - row_max[:, 0]) - log_norm
    return EncodedBlock(planes=planes, logprob_target=logprob_target, logprob_max=-log_norm, top_ids=top_ids,
                        error=error)


def _codes(logits: np.ndarray, row_max: np.ndarray, code: SqrtLogCode) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 codes [b, V], sum(p/p_max) in float64 [b]) of float32 rows with maxima row_max [b, 1]."""
    b, n_vocab = logits.shape
    # exp in numpy, in place: it is vectorised (SIMD), unlike a scalar exp inside a compiled loop.
    half = np.subtract(logits, row_max)
    half *= 0.5
    np.exp(half, out=half)  # sqrt(p / p_max), float32, in [0, 1]
    codes = np.empty((b, n_vocab), dtype=np.uint16)
    mass = np.empty(b, dtype=np.float64)
    _codes_and_mass(logits, row_max[:, 0], half, np.float32(code.slope), np.float32(code.knee),
                    np.float32(2.0 * code.slope * math.exp(-0.5 * code.knee)), codes, mass)
    return codes, mass


# --- the hidden form: rows replayed through the output head, read as float32 rows or coded by the store's code -----
REPLAY_ROWS = 128  # rows replayed at once: the kernel walks the head once per block (float64 [128, V]: 268 MB at 262K)


def replayed_rows(head: OutputHead, rows: StoredActivations) -> Iterator[np.ndarray]:
    """float32 logits [b, V] of stored hidden rows replayed through the head (float64, post-head ops applied, then
    rounded to float32 as llama.cpp's logits are), REPLAY_ROWS at a time: what a reader of the hidden form reads,
    uncoded (a live comparison) or coded (replayed_planes)."""
    for start in range(0, len(rows), REPLAY_ROWS):
        replayed = head.replay(rows.rows(start, start + REPLAY_ROWS)).astype(np.float32)
        if not np.all(np.isfinite(replayed.max(axis=1))):
            raise BadLogits("replayed logits contain NaN or a row with no finite value")
        yield replayed


def code_replayed(replayed: np.ndarray, code: SqrtLogCode) -> np.ndarray:
    """uint16 codes of float32 replayed logits."""
    return _codes(replayed, replayed.max(axis=1, keepdims=True), code)[0]


def replayed_planes(head: OutputHead, rows: StoredActivations, code: SqrtLogCode) -> Iterator[np.ndarray]:
    """The replayed rows coded, as planes (uint8 [b, 2, V]), as a store's chunk yields them."""
    for replayed in replayed_rows(head, rows):
        yield codes_to_planes(code_replayed(replayed, code))


# The engines that replay a hidden piece's rows for an uncoded read, in the order a reader prefers them: llama.cpp's
# own kernel (ggml_replay: its rows hash the same only where ggml sums in the capture's order) and qeval's portable
# one (the same rows everywhere). A store names them by their index + 1.
REPLAY_ENGINES = ("ggml", "portable")
# A replay's error is uniform over the vocabulary (float32 rounding of the logits, ~1e-6 nats, or none): one band.
REPLAY_BANDS = ErrorBands(1, 1.0)


@dataclass
class UncodedRows:
    """A block's rows as one replay engine gives them (float32 [b, V]) and their error against the exact logits."""

    engine: str
    rows: np.ndarray
    record: ErrorRecord


def coded_engine(engines) -> str:
    """The engine whose rows a hidden piece's codes, checksum and error record are of: the portable replay's where
    the piece records it, else ggml's (a lean piece: ggml's rows were llama.cpp's logits on the capturing machine)."""
    return "portable" if "portable" in engines else "ggml"


def encode_hidden_block(logits: np.ndarray, hidden: np.ndarray, targets: np.ndarray, code: SqrtLogCode,
                        head: OutputHead, ggml_head=None, first_row: int = 0, lean: bool = False) -> "EncodedBlock":
    """A block in the hidden form: hidden float32 [b, n_embd] rows (the head's input) with their exact float32
    logits [b, V]. The scalars and top ids exact (from `logits`, as encode_block's); the rest as certified_block
    makes them, with ggml's rows (`ggml_head`, a ggml_replay.GgmlHead, where there is one: GgmlHead.rows_of,
    llama.cpp's logits themselves once a replay here gave them bit for bit). `lean`: where ggml reproduces, no
    portable replay (a lean piece: store.LEAN_VERSION). `first_row`: the block's first row in its chunk."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    b, n_vocab = logits.shape
    top_vals = np.empty((b, min(TOP_K, n_vocab)), dtype=np.float32)
    top_ids = np.empty((b, top_vals.shape[1]), dtype=np.int32)
    _top_k(logits, top_vals, top_ids)
    if not np.all(np.isfinite(top_vals[:, 0])) or np.isnan(logits).any():
        raise BadLogits("logits contain NaN or a row with no finite value")
    stored = activation_bytes(hidden, head.activation)
    rows = StoredActivations.parse(stored, b, head.n_embd, head.activation, "hidden rows")
    ggml = None if ggml_head is None else ggml_head.rows_of(rows, first_row, logits)
    portable = not (lean and ggml_head is not None and ggml_head.reproduces)
    block, log_norm = certified_block(logits, top_vals[:, 0], stored, rows, code, head, ggml, portable)
    block.logprob_target = (logits[np.arange(b), targets].astype(np.float64) - top_vals[:, 0]) - log_norm
    block.logprob_max, block.top_ids = -log_norm, top_ids
    return block


def certified_block(logits: np.ndarray, row_max: np.ndarray, stored: bytes, rows: StoredActivations,
                    code: SqrtLogCode, head: OutputHead, ggml: np.ndarray | None,
                    portable: bool = True) -> tuple["EncodedBlock", np.ndarray]:
    """A hidden block's stored rows (`stored`, parsed as `rows`) against their exact float32 logits (`row_max`: each
    row's max) without its scalars, and each row's log-normaliser: the rows replayed by ggml (`ggml`, as given) and,
    where `portable`, by the portable kernel, each with its error record measured from the exact rows (what a live
    comparison reads, uncoded); the planes are the coded rows of coded_engine (what a coded comparison reads), `error`
    measured from the exact rows against them. A capture's blocks and `qeval certify`'s are made here alike."""
    replayed = {} if ggml is None else {"ggml": ggml}
    if portable:
        replayed["portable"] = np.concatenate(list(replayed_rows(head, rows)))
    codes = code_replayed(replayed[coded_engine(replayed)], code)
    lut, lut_exp, band = code.error_tables()
    meter = ErrorMeter.of(logits.shape[1])
    engines = [engine for engine in REPLAY_ENGINES if engine in replayed]
    (error, *records), log_norm = meter.measure(logits, row_max, [
        (code.error, lambda t: (codes[t], lut, lut_exp, band)),
        *((REPLAY_BANDS, meter.uncoded(logits, replayed[engine], REPLAY_BANDS)) for engine in engines)])
    uncoded = tuple(UncodedRows(engine, replayed[engine], record) for engine, record in zip(engines, records))
    return EncodedBlock(planes=codes_to_planes(codes), logprob_target=None, logprob_max=None, top_ids=None,
                        error=error, hidden=stored, uncoded=uncoded), log_norm


def code_of(codec: dict, lut: np.ndarray, where: str) -> SqrtLogCode:
    """The code a store's header names (its `codec`), checked against its LUT_: what its replayed rows are coded
    with (StoreFormatError when it names a code this qeval does not make)."""
    knee = codec.get("knee")
    if (codec.get("name") != "sqrt-log" or not isinstance(knee, (int, float)) or isinstance(knee, bool)
            or not math.isfinite(knee) or knee > 0):
        raise StoreFormatError(f"{where}: the store's hidden pieces are coded with {codec!r}, a code qeval does not "
                               "make")
    code = SqrtLogCode(float(knee))
    if not np.array_equal(code.lut(), lut):
        raise StoreFormatError(f"{where}: the code table (LUT_) is not that of the header's codec")
    return code


def top_k_ids(logits_row: np.ndarray) -> np.ndarray:
    """The TOP_K best token ids of one float32 row, as a store keeps them (ties: lower id first)."""
    top_k = min(TOP_K, len(logits_row))
    top_vals = np.empty((1, top_k), dtype=np.float32)
    top_ids = np.empty((1, top_k), dtype=np.int32)
    _top_k(logits_row[None], top_vals, top_ids)
    return top_ids[0]


@numba.njit(nogil=True, cache=True)
def _top_k(logits, top_vals, top_ids):  # pragma: no cover - compiled
    """Top-K per row, best first; ties go to the lower token id (stable, like a first-max argmax)."""
    b, n = logits.shape
    k = top_vals.shape[1]
    for t in range(b):
        vals = top_vals[t]
        ids = top_ids[t]
        for j in range(k):
            vals[j] = -np.inf
            ids[j] = -1
        row = logits[t]
        for i in range(n):
            x = row[i]
            if x > vals[k - 1] or ids[k - 1] < 0:
                j = k - 1
                while j > 0 and (x > vals[j - 1] or ids[j - 1] < 0):
                    vals[j] = vals[j - 1]
                    ids[j] = ids[j - 1]
                    j -= 1
                vals[j] = x
                ids[j] = i


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _codes_and_mass(logits, row_max, half, slope, knee, sqrt_gain, codes, mass):  # pragma: no cover
    """The uint16 codes, and sum(p/p_max) in float64 from the float32 half = sqrt(p/p_max) (reassociated:
    vectorises)."""
    b, n = logits.shape
    head_base = np.float32(2.0) * slope
    for t in range(b):
        m = row_max[t]
        row = logits[t]
        h_row = half[t]
        out = codes[t]
        total = 0.0
        for i in range(n):
            h = h_row[i]
            total += np.float64(h) * np.float64(h)
            d = row[i] - m
            u = sqrt_gain * h if d < knee else head_base + slope * (d - knee)
            u = min(max(u + np.float32(0.5), np.float32(0.0)), np.float32(65535.0))
            out[i] = np.uint16(np.int32(u))
        mass[t] = total
