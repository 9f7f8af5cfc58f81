"""The qeval logits store: one append-only file per capture, written chunk by chunk.

Layout (docs/store-format.md is the normative spec):

    preamble   8-byte magic "QEVALLOG", u32 format version, u32 zero
    record     HEAD  JSON header
    record     TOKS  int32 token ids, n_chunks x n_ctx
    record     LUT_  float32[65536]: code -> log p - log p_max
    record     CHNK  one per chunk (scalars + one zstd frame of byte planes), any number
    record     ERRS  after each CHNK, in version 4: the per-token error record of its rows (qeval.storage.error_record)
    record     INDX  chunk index -> offset (only once the capture is complete)
    trailer    8-byte magic "QEVALEND", u64 offset of the INDX record

Every record is tag(4) u32 zero u64 payload_len, payload, u64 xxh3_64(payload).
Everything is little-endian. A file without a valid trailer is "still being written"
(or was interrupted) and can be resumed: chunks are only ever appended. A store that replaces
another is written to `<name>.replacing` and renamed over it once complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import xxhash
import zstandard

from qeval import __version__
from qeval.errors import MismatchError, QevalError, StoreFormatError, WriteFailed
from qeval.identity import capture_conflicts, extends, tokens_sha256
from qeval.storage.codec import (
    REPLAY_BANDS,
    REPLAY_ENGINES,
    REPLAY_ROWS,
    EncodedBlock,
    code_of,
    code_replayed,
    coded_engine,
    replayed_planes,
    replayed_rows,
)
from qeval.storage.error_record import ErrorBands, ErrorRecord, record_bytes, rows_of
from qeval.storage.hidden_form import AUTO, LOGITS, OutputHead, StoredActivations, check_head_entry
from qeval.storage.planes import N_CODES, TOP_K, codes_to_planes, planes_to_codes  # noqa: F401 - re-exported
from qeval.storage.scoring import HALF, Scoring, WindowLabels, positions_of

MAGIC = b"QEVALLOG"
TRAILER_MAGIC = b"QEVALEND"
FORMAT_VERSION = 2  # 2: the header records its scoring rule (version 1: always half)
LABELLED_VERSION = 3  # 3: the header holds per-token labels (`windows`): a conversation capture, --score assistant
# 4: each CHNK record is followed by an ERRS record, the per-token error of the stored form (header `error`), with
# or without labels. Older readers refuse it by its version.
ERROR_VERSION = 4
# 5: a store that may hold the hidden form (header `head`): its output head once (OUTW, after LUT_), and each piece
# either a CHNK (logits codes) or a HIDN record (the head's input, replayed by the reader), each followed by ERRS.
HIDDEN_VERSION = 5
# 6: a HIDN record also holds, per replay engine (codec.REPLAY_ENGINES), the checksum of the float32 rows it replays
# and their own error record (one band): what a live comparison reads uncoded. Version 5 pieces are read coded only.
REPLAY_RECORD_VERSION = 6
# 7: a HIDN record may be lean: ggml's replay only (its rows were llama.cpp's logits where it was captured), its
# codes, checksum and error record of ggml's rows (codec.coded_engine). Read where ggml gives those rows again (the
# capturing CPU kind and build); `qeval certify` adds the portable replay for every other machine. In version 6
# every HIDN record holds the portable replay.
LEAN_VERSION = 7
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
PIECE_TAGS = (b"CHNK", b"HIDN")  # the two forms of a piece
# A chunk (window) of more scored rows is written as pieces of this many rows (one CHNK record each), so
# writer and reader hold one piece, not a window: a 32K window scored everywhere is ~4 GB compressed.
# Piece borders sit at multiples of PIECE_ROWS in every store, so two stores' token blocks stay aligned.
PIECE_ROWS = 256

_PREAMBLE = struct.Struct("<8sII")
_RECORD = struct.Struct("<4sIQ")
_CHECKSUM = struct.Struct("<Q")  # XXH3-64: 16 GB/s here, CRC-32 (zlib) only 1.8 GB/s
_TRAILER = struct.Struct("<8sQ")
_CHUNK_HEAD = struct.Struct("<IIII")
_REPLAY_CHECKSUM = struct.Struct("<Q")  # a HIDN record's checksum of its replayed rows (HiddenChunk)
_UNCODED_HEAD = struct.Struct("<II")  # version 6: how many uncoded replays a HIDN record holds, 0
_UNCODED_ENTRY = struct.Struct("<IIQ")  # each: its engine (index in REPLAY_ENGINES + 1), 0, its rows' checksum
_INDEX_ENTRY = np.dtype([("chunk", "<u4"), ("first_row", "<u4"), ("offset", "<u8")])  # one per CHNK record

# Sanity bounds for values read from a file, so a corrupt header cannot make us allocate wildly.
_MAX_VOCAB = 1 << 24
_MAX_CTX = 1 << 22
_MAX_CHUNKS = 1 << 24
_MAX_HEADER_BYTES = 64 << 20
ZSTD_LEVEL = 1
REPLACEMENT_SUFFIX = ".replacing"  # not "*.qeval": a replacement being written is never taken for a label


def checksum(*parts) -> int:
    """XXH3-64 of the payload b"".join(parts), without joining them."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


@dataclass(frozen=True)
class StoreHeader:
    """What a store must say about itself so that a wrong comparison can be refused."""

    n_vocab: int
    n_ctx: int
    n_chunks: int  # chunks in the token list (the whole capture)
    chunk_start: int  # this file holds chunks [chunk_start, chunk_stop)
    chunk_stop: int
    tokens_sha256: str
    label: str = ""
    top_k: int = 0  # 0: min(TOP_K, n_vocab)
    codec: dict = field(default_factory=dict)
    tokenizer_sha256: str = ""
    model: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)
    corpus: dict = field(default_factory=dict)
    capture: dict = field(default_factory=dict)
    source: str = "qeval"
    qeval_version: str = __version__
    format_version: int = FORMAT_VERSION
    scoring: str = HALF.rule  # which logit positions are scored (qeval.storage.scoring)
    windows: dict = field(default_factory=dict)  # per-token labels of a conversation capture (WindowLabels JSON)
    error: dict = field(default_factory=dict)  # the error record's bands (ErrorBands JSON); {}: no record
    head: dict = field(default_factory=dict)  # the embedded output head (hidden_form.head_entry); {}: logits only

    def __post_init__(self):
        if self.top_k == 0:
            object.__setattr__(self, "top_k", min(TOP_K, self.n_vocab))
        if self.windows and self.format_version < LABELLED_VERSION:
            object.__setattr__(self, "format_version", LABELLED_VERSION)
        if self.error and self.format_version < ERROR_VERSION:
            object.__setattr__(self, "format_version", ERROR_VERSION)
        if self.head and self.format_version < HIDDEN_VERSION:  # (a version 5 or 6 asked for by name stays)
            object.__setattr__(self, "format_version", LEAN_VERSION)

    @property
    def replay_record(self) -> bool:
        """Whether its hidden pieces carry the replay record (version 6): a live comparison reads them uncoded."""
        return bool(self.head) and self.format_version >= REPLAY_RECORD_VERSION

    @cached_property
    def error_bands(self) -> ErrorBands | None:
        """The bands of its per-token error record; None for a store that records none (made before qeval
        measured it, or from a llama.cpp file)."""
        return ErrorBands.from_json(self.error, "header") if self.error else None

    @cached_property
    def positions(self) -> np.ndarray:
        """The scored logit positions of every window, for a rule that scores the same ones in each (one
        definition: qeval.storage.scoring); see positions_of."""
        return Scoring.parse(self.scoring).positions(self.n_ctx)

    @cached_property
    def window_labels(self) -> WindowLabels | None:
        """The per-token labels of a conversation capture (None for text windows)."""
        return WindowLabels.from_json(self.windows, self.n_ctx, self.n_chunks) if self.windows else None

    def positions_of(self, chunk: int) -> np.ndarray:
        """The scored logit positions of window `chunk`, ascending."""
        if self.window_labels is None:
            return self.positions
        return positions_of(Scoring.parse(self.scoring), self.window_labels, chunk, self.n_ctx)

    def n_scored_of(self, chunk: int) -> int:
        """Scored tokens (rows) of window `chunk`."""
        return self.n_scored if self.window_labels is None else self._labelled_counts[chunk]

    @cached_property
    def _labelled_counts(self) -> list[int]:
        return [len(self.positions_of(c)) for c in range(self.n_chunks)]

    @property
    def hidden(self) -> bool:
        """Whether its pieces may hold the hidden form (it embeds an output head)."""
        return bool(self.head)

    @property
    def per_window(self) -> bool:
        return self.window_labels is not None

    @property
    def first_scored(self) -> int:
        return int(self.positions[0])

    @property
    def n_scored(self) -> int:
        """Scored tokens per chunk (255 at n_ctx 512, half)."""
        return len(self.positions)

    @property
    def chunk_range(self) -> range:
        return range(self.chunk_start, self.chunk_stop)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if self.format_version == 1:
            del d["scoring"]  # version 1 has no such field: it is half
        for name in ("windows", "error", "head"):
            if not d[name]:  # a version 2 header has none, a later one what it holds
                del d[name]
        if not self.per_window:
            d["n_scored"] = self.n_scored
            d["first_scored"] = self.first_scored
        return d

    @classmethod
    def from_json(cls, d: object, where: str) -> "StoreHeader":
        if not isinstance(d, dict):
            raise StoreFormatError(f"{where}: header is not a JSON object")
        ints = {"n_vocab": (2, _MAX_VOCAB), "n_ctx": (4, _MAX_CTX), "n_chunks": (1, _MAX_CHUNKS),
                "chunk_start": (0, _MAX_CHUNKS), "chunk_stop": (1, _MAX_CHUNKS),
                "top_k": (1, 64), "format_version": (1, 1 << 16)}
        kwargs = {}
        for name, (lo, hi) in ints.items():
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise StoreFormatError(f"{where}: header field {name!r} is missing or out of range ({v!r})")
            kwargs[name] = v
        for name in ("tokens_sha256", "label", "tokenizer_sha256", "source", "qeval_version", "scoring"):
            v = d.get(name, HALF.rule if name == "scoring" else "")
            if not isinstance(v, str):
                raise StoreFormatError(f"{where}: header field {name!r} must be a string")
            kwargs[name] = v
        for name in ("codec", "model", "kv", "corpus", "capture", "windows", "error", "head"):
            v = d.get(name, {})
            if not isinstance(v, dict):
                raise StoreFormatError(f"{where}: header field {name!r} must be an object")
            kwargs[name] = v
        if kwargs["format_version"] not in READABLE_VERSIONS:
            raise StoreFormatError(f"{where}: store format version {kwargs['format_version']} is not supported "
                                   f"(this qeval reads versions {', '.join(map(str, READABLE_VERSIONS))})")
        if kwargs["format_version"] == 1 and "scoring" in d:
            raise StoreFormatError(f"{where}: a version-1 header has no scoring field")
        try:
            scoring = Scoring.parse(kwargs["scoring"])
            scoring.check(kwargs["n_ctx"])
        except QevalError as exc:
            raise StoreFormatError(f"{where}: header field 'scoring': {exc}") from None
        version, labelled = kwargs["format_version"], bool(kwargs["windows"])
        if scoring.per_window != labelled or (version < ERROR_VERSION and labelled != (version >= LABELLED_VERSION)):
            raise StoreFormatError(f"{where}: --score {scoring.rule} in format version {version} "
                                   f"{'with' if labelled else 'without'} per-token labels")
        if bool(kwargs["error"]) != (version >= ERROR_VERSION):
            raise StoreFormatError(f"{where}: format version {version} {'with' if kwargs['error'] else 'without'} an "
                                   "error record (header field 'error')")
        if kwargs["error"]:
            ErrorBands.from_json(kwargs["error"], where)
        if bool(kwargs["head"]) != (version >= HIDDEN_VERSION):
            raise StoreFormatError(f"{where}: format version {version} {'with' if kwargs['head'] else 'without'} an "
                                   "output head (header field 'head')")
        if kwargs["head"]:
            check_head_entry(kwargs["head"], kwargs["n_vocab"], where)
        h = cls(**kwargs)
        try:
            h.window_labels
        except ValueError as exc:
            raise StoreFormatError(f"{where}: header field 'windows': {exc}") from None
        if h.top_k > h.n_vocab:
            raise StoreFormatError(f"{where}: top_k {h.top_k} exceeds the vocab of {h.n_vocab}")
        if not h.chunk_start < h.chunk_stop <= h.n_chunks:
            raise StoreFormatError(f"{where}: chunk range {h.chunk_start}:{h.chunk_stop} does not fit "
                                   f"{h.n_chunks} chunks")
        if not h.per_window and d.get("n_scored", h.n_scored) != h.n_scored:
            raise StoreFormatError(f"{where}: header n_scored disagrees with n_ctx {h.n_ctx}")
        return h


@dataclass
class ChunkData:
    """One chunk as stored: exact per-token scalars plus the compressed code planes."""

    index: int
    logprob_target: np.ndarray  # float64 [n]: log p(correct next token), exact from float32 logits
    logprob_max: np.ndarray  # float64 [n]: log p of the argmax token
    top_ids: np.ndarray  # int32 [n, top_k]: most probable ids, best first (top_ids[:, 0] = argmax)
    codes_zst: bytes | memoryview  # one zstd frame: per token, the high-byte plane then the low-byte plane
    first_row: int = 0  # a piece of its chunk: rows first_row .. first_row + n_tokens - 1
    error: ErrorRecord | None = None  # how far the stored rows are from the exact ones (a version 4 store)

    @property
    def n_tokens(self) -> int:
        return len(self.logprob_target)

    def iter_planes(self, n_vocab: int, block_tokens: int = 16, buffers: int = 1) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (first_token, planes) with planes uint8 [b, 2, n_vocab], b <= block_tokens.

        Streams the frame into a ring of `buffers` reused block buffers, so memory stays at a few
        blocks whatever the chunk size: a yielded block is overwritten `buffers` blocks later.
        """
        token_bytes = 2 * n_vocab
        ring = [np.empty(block_tokens * token_bytes, dtype=np.uint8) for _ in range(max(1, buffers))]
        reader = zstandard.ZstdDecompressor().stream_reader(self.codes_zst, read_across_frames=False)
        with reader:
            for k, start in enumerate(range(0, self.n_tokens, block_tokens)):
                b = min(block_tokens, self.n_tokens - start)
                buf = ring[k % len(ring)][:b * token_bytes]
                _read_exact(reader, memoryview(buf), f"chunk {self.index}")
                yield start, buf.reshape(b, 2, n_vocab)
            if reader.read(1):
                raise StoreFormatError(f"chunk {self.index}: code frame holds more data than its token count")

    @property
    def reads_uncoded(self) -> bool:
        """Whether iter_rows gives rows uncoded (a version 6 hidden piece's replayed rows), which a comparison reads
        as they are: a live candidate's, and a coded candidate's (metrics.row_plane_sums)."""
        return False

    def iter_rows(self, n_vocab: int, buffers: int = 1) -> Iterator[tuple[int, np.ndarray, ErrorRecord | None]]:
        """(row, the row as read, its error record) one row at a time, as a comparison against a live candidate reads
        a reference: planes uint8 [2, V] (coded), or float32 [V] replayed rows (a version 6 hidden piece, read
        uncoded). A row stays valid while `buffers` − 1 more are read."""
        for start, planes in self.iter_planes(n_vocab, 1, buffers):
            yield start, planes[0], self.error_rows(start, start + 1)

    def error_rows(self, start: int, stop: int) -> ErrorRecord | None:
        """The error record of rows [start, stop) (None for a store without one). A chunk read as it streams (a
        PiecedChunk, a live one) has those of the rows iter_planes has yielded."""
        return rows_of([(0, self.error)], start, stop)

    def codes(self, n_vocab: int) -> np.ndarray:
        """All codes of the chunk as uint16 [n, n_vocab] (tests and small tools; metrics stream)."""
        out = np.empty((self.n_tokens, n_vocab), dtype=np.uint16)
        for start, planes in self.iter_planes(n_vocab):  # each block is copied out before the next
            out[start:start + len(planes)] = planes_to_codes(planes)
        return out


@dataclass(frozen=True)
class UncodedReplay:
    """What a version 6 HIDN record says of its rows as one engine replays them: their checksum (XXH3-64 of the
    float32 rows in row order) and their error record against the exact logits (one band)."""

    engine: str
    checksum: int
    record: ErrorRecord


@dataclass
class HiddenChunk(ChunkData):
    """A piece stored in the hidden form (a HIDN record): its scalars and error record as a CHNK's, and instead of
    codes one zstd frame of the output head's input (codes_zst holds it). Read like any chunk: iter_planes replays
    the rows through the store's head and codes them with its code, exactly as the capture did, and checks the
    rows against the capture's checksum of them (replay_checksum), so the error record is that of these rows.
    A version 6 piece can also be read uncoded (iter_rows): the float32 rows of the first replay engine whose rows
    hash as the capture's did on this machine, with that engine's error record (`replays`)."""

    replay_checksum: int = 0  # XXH3-64 of the coded replayed rows' planes, in row order
    reader: "StoreReader | None" = None  # where its head and code come from (None: a piece being written)
    replays: tuple[UncodedReplay, ...] = ()  # version 6, in the order a reader prefers the engines; (): version 5

    def stored_bytes(self) -> bytearray:
        """The piece's stored activations, row after row (head.activation.row_bytes each)."""
        head = self.reader.output_head
        raw = bytearray(self.n_tokens * head.activation.row_bytes(head.n_embd))
        with zstandard.ZstdDecompressor().stream_reader(self.codes_zst, read_across_frames=False) as stream:
            _read_exact(stream, memoryview(raw), f"chunk {self.index} (hidden rows)")
            if stream.read(1):
                raise StoreFormatError(f"chunk {self.index}: hidden frame holds more data than its token count")
        return raw

    def _stored_rows(self) -> StoredActivations:
        head = self.reader.output_head
        return StoredActivations.parse(self.stored_bytes(), self.n_tokens, head.n_embd, head.activation,
                                       f"{self.reader.path}: chunk {self.index}")

    def _differs(self) -> StoreFormatError:
        if self.lean:
            return StoreFormatError(
                f"{self.reader.path}: chunk {self.index} is lean: certified only where llama.cpp's own kernel gives "
                "the capture's rows again, and this machine's does not (another CPU kind or llama.cpp build). Run "
                f"`qeval certify {self.reader.path}` on a machine like the capturing one (publish does it), then "
                "compare here")
        return StoreFormatError(f"{self.reader.path}: chunk {self.index}: the hidden rows replayed on this machine "
                                "differ from the capture's (its error record is not theirs); compare on a machine "
                                "like the capturing one, or capture the reference in the logits form")

    @property
    def lean(self) -> bool:
        """A lean piece (LEAN_VERSION): ggml's replay only, its codes of ggml's rows."""
        return bool(self.replays) and coded_engine([r.engine for r in self.replays]) == "ggml"

    def iter_planes(self, n_vocab: int, block_tokens: int = 16, buffers: int = 1) -> Iterator[tuple[int, np.ndarray]]:
        """Replayed blocks are fresh arrays, so `buffers` (a ring size for stored codes) is not needed."""
        digest = xxhash.xxh3_64()

        def coded() -> Iterator[np.ndarray]:
            if not self.lean:
                yield from replayed_planes(self.reader.output_head, self._stored_rows(), self.reader.code)
                return
            rows = self.uncoded_rows()[0]  # ggml's, hashed as the capture's
            for start in range(0, len(rows), REPLAY_ROWS):
                yield codes_to_planes(code_replayed(rows[start:start + REPLAY_ROWS], self.reader.code))

        def checked() -> Iterator[np.ndarray]:
            for planes in coded():
                digest.update(planes)
                yield planes
            if digest.intdigest() != self.replay_checksum:
                raise self._differs()

        yield from reblock(checked(), block_tokens)

    @property
    def reads_uncoded(self) -> bool:
        return bool(self.replays)

    def iter_rows(self, n_vocab: int, buffers: int = 1) -> Iterator[tuple[int, np.ndarray, ErrorRecord | None]]:
        if not self.replays:  # version 5: its record is of the coded rows only
            yield from super().iter_rows(n_vocab, buffers)
            return
        rows, replay = self.uncoded_rows()
        for k in range(len(rows)):
            yield k, rows[k], replay.record.rows(k, k + 1)

    def uncoded_rows(self) -> tuple[np.ndarray, UncodedReplay]:
        """float32 rows [n, V] of the first engine (of those the capture recorded) whose rows hash as the capture's
        did, checked before any is read, and what the capture recorded of them."""
        stored = self._stored_rows()
        for replay in self.replays:
            rows = self.reader.replayed_by(replay.engine, stored, self.first_row)
            if rows is None:  # the engine is not at hand, or did not reproduce the capture's rows before
                continue
            matches = xxhash.xxh3_64_intdigest(rows.data) == replay.checksum
            self.reader.replay_matched(replay.engine, matches)
            if matches:
                return rows, replay
        raise self._differs()


def reblock(blocks: Iterable[np.ndarray], size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) in blocks of `size` rows; blocks that already fit are passed without a copy."""
    start, pending = 0, []
    for block in blocks:
        pending.append(block)
        while sum(len(b) for b in pending) >= size:
            joined = pending[0] if len(pending) == 1 else np.concatenate(pending)
            yield start, joined[:size]
            start += size
            pending = [joined[size:]] if len(joined) > size else []
    if pending and sum(len(b) for b in pending):
        yield start, pending[0] if len(pending) == 1 else np.concatenate(pending)


def _read_exact(reader, view: memoryview, what: str) -> None:
    got = 0
    try:
        while got < len(view):
            n = reader.readinto(view[got:])
            if not n:
                raise StoreFormatError(f"{what}: code frame ends early ({got} of {len(view)} bytes)")
            got += n
    except zstandard.ZstdError as exc:
        raise StoreFormatError(f"{what}: code frame is corrupt ({exc})") from None


def zstd_compressor(threads: int = 0) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=threads)


class ChunkBuilder:
    """Accumulates one chunk token-block by token-block, compressing as it goes.

    A compressor may be shared by consecutive chunks (not by concurrent ones)."""

    def __init__(self, index: int, compressor: zstandard.ZstdCompressor | None = None, first_row: int = 0,
                 hidden: bool = False):
        """hidden: build a HiddenChunk: each block comes with its hidden rows (compressed) and its planes are those
        of the replayed rows (only checksummed)."""
        self.index, self.first_row, self.hidden = index, first_row, hidden
        self._digest = xxhash.xxh3_64()
        self._z = (compressor or zstd_compressor()).compressobj()
        self._parts: list = []
        self._scalars: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._errors: list[ErrorRecord | None] = []
        self._uncoded: dict[str, tuple] = {}  # a hidden chunk's: per engine, its rows' digest and records

    def add(self, planes: np.ndarray, logprob_target: np.ndarray, logprob_max: np.ndarray,
            top_ids: np.ndarray, error: ErrorRecord | None = None, hidden_rows: bytes | None = None,
            uncoded: tuple = ()) -> None:
        """planes: uint8 [b, 2, V] (see codes_to_planes); error: the rows' error record (all blocks or none);
        hidden_rows: the rows' stored hidden form (a hidden builder's blocks, whose planes are the replayed rows'),
        with `uncoded`, those rows as each replay engine gives them (codec.UncodedRows; the same engines in every
        block)."""
        if planes.dtype != np.uint8 or planes.ndim != 3 or planes.shape[1] != 2:
            raise ValueError(f"planes must be uint8 [b, 2, V], got {planes.dtype} {planes.shape}")
        if self._errors and (error is None) != (self._errors[0] is None):
            raise ValueError("a chunk's blocks all carry an error record or none does")
        planes = np.ascontiguousarray(planes)
        if (hidden_rows is not None) != self.hidden:
            raise ValueError("a hidden chunk's blocks come with their hidden rows, a logits chunk's without")
        if self.hidden:
            if self._scalars and [u.engine for u in uncoded] != list(self._uncoded):
                raise ValueError("a hidden chunk's blocks come with the rows of the same replay engines")
            for u in uncoded:
                digest, records = self._uncoded.setdefault(u.engine, (xxhash.xxh3_64(), []))
                digest.update(np.ascontiguousarray(u.rows, dtype=np.float32).data)
                records.append(u.record)
            self._digest.update(planes.data)
            self._parts.append(self._z.compress(hidden_rows))
        else:
            self._parts.append(self._z.compress(planes.data))
        self._scalars.append((np.asarray(logprob_target, np.float64), np.asarray(logprob_max, np.float64),
                              np.asarray(top_ids, np.int32)))
        self._errors.append(error)

    def add_block(self, block: EncodedBlock) -> None:
        """A block as the codec made it (codec.encode_block, encode_hidden_block)."""
        self.add(block.planes, block.logprob_target, block.logprob_max, block.top_ids, block.error, block.hidden,
                 block.uncoded)

    def finish(self) -> ChunkData:
        lt, lm, top = (np.concatenate(cols) for cols in zip(*self._scalars))
        self._parts.append(self._z.flush())
        error = None if self._errors[0] is None else ErrorRecord.concat(self._errors)
        if self.hidden:
            replays = tuple(UncodedReplay(engine, digest.intdigest(), ErrorRecord.concat(records))
                            for engine, (digest, records) in self._uncoded.items())
            return HiddenChunk(self.index, lt, lm, top, b"".join(self._parts), self.first_row, error,
                               self._digest.intdigest(), replays=replays)
        return ChunkData(index=self.index, logprob_target=lt, logprob_max=lm, top_ids=top,
                         codes_zst=b"".join(self._parts), first_row=self.first_row, error=error)

    @property
    def n_rows(self) -> int:
        return sum(len(cols[0]) for cols in self._scalars)


def _record_parts(tag: bytes, parts: list) -> list:
    """A record of the payload b"".join(parts), as the parts to write one after the other."""
    size = sum(memoryview(part).nbytes for part in parts)
    return [_RECORD.pack(tag, 0, size), *parts, _CHECKSUM.pack(checksum(*parts))]


def _encode_record(tag: bytes, payload: bytes) -> bytes:
    return b"".join(_record_parts(tag, [payload]))


def _write_record(fh, tag: bytes, parts: list) -> None:
    """A record written part by part: a head's weights (540 MB at the seeds' width) go to the file from where they
    are, never copied into one payload and again into one record."""
    for part in _record_parts(tag, parts):
        fh.write(part)


def _chunk_payload(chunk: ChunkData, header: StoreHeader) -> bytes:
    n, top_k = chunk.n_tokens, header.top_k
    if chunk.top_ids.shape != (n, top_k):
        raise ValueError(f"top_ids must be [{n}, {top_k}], got {chunk.top_ids.shape}")
    return b"".join([
        _CHUNK_HEAD.pack(chunk.index, n, top_k, chunk.first_row),
        np.ascontiguousarray(chunk.logprob_target, "<f8").tobytes(),
        np.ascontiguousarray(chunk.logprob_max, "<f8").tobytes(),
        np.ascontiguousarray(chunk.top_ids, "<i4").tobytes(),
        _hidden_fields(chunk, header) if isinstance(chunk, HiddenChunk) else b"",
        chunk.codes_zst,
    ])


def _hidden_fields(chunk: HiddenChunk, header: StoreHeader) -> bytes:
    """What a HIDN record holds before its frame: the coded rows' checksum; from version 6 the uncoded replays (per
    engine: its index + 1, its rows' checksum, their error record as an ERRS payload of one band)."""
    if header.format_version < REPLAY_RECORD_VERSION:
        return _REPLAY_CHECKSUM.pack(chunk.replay_checksum)
    if not chunk.replays:
        raise ValueError(f"chunk {chunk.index}: a hidden piece without its uncoded replays")
    parts = [_REPLAY_CHECKSUM.pack(chunk.replay_checksum), _UNCODED_HEAD.pack(len(chunk.replays), 0)]
    for replay in chunk.replays:
        parts += [_UNCODED_ENTRY.pack(REPLAY_ENGINES.index(replay.engine) + 1, 0, replay.checksum),
                  replay.record.payload(chunk.index, chunk.first_row)]
    return b"".join(parts)


class OpenFile:
    """A reader or writer over one open file `_fh`: closed by close() or at the end of a `with` block."""

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StoreWriter(OpenFile):
    """Appends chunks to a store; `open()` creates a new file or resumes an interrupted one."""

    def __init__(self, path: Path, header: StoreHeader, fh, pieces: dict[int, list[tuple[int, int]]],
                 replaces: Path | None = None):  # noqa: D107
        self.path, self.header, self._fh = path, header, fh
        self._pieces = pieces  # chunk -> [(first_row, offset)] of its CHNK records, in row order
        self._rows = {c: header.n_scored_of(c) for c in pieces}  # rows written per chunk (resumed chunks are complete)
        self.replaces = replaces  # the store finish() renames this one over
        self.finished = False
        self.created = False  # this writer made the file (not a resumed one)

    @classmethod
    def open(cls, path: str | os.PathLike, header: StoreHeader, tokens: np.ndarray,
             lut: np.ndarray, replace: bool = False, head: OutputHead | None = None) -> "StoreWriter":
        """Create `path`, or resume it if it is an interrupted capture of exactly the same inputs.

        Raises StoreComplete if `path` is a complete store that holds this capture (it may hold more
        chunks of the same windows). A complete store of this capture over fewer windows grows: the new capture is
        written beside it with its chunks copied (_extension). A store there that holds anything else is refused
        (StoreConflict, naming what differs); with `replace`, the new capture is written to replacement_path(path)
        instead (resumed there after an interruption) and renamed over `path` by finish(), so the old
        store stays until the new one is complete. `head`: the output head a store that may hold the hidden form
        embeds (its header's `head` describes it).
        """
        path = Path(path)
        if (head is None) != (not header.head) or (head is not None and head.fingerprint != header.head["fingerprint"]):
            raise ValueError("a store embeds the output head its header describes, and only that one")
        tokens = np.ascontiguousarray(tokens, dtype="<i4")
        if tokens.shape != (header.n_chunks, header.n_ctx):
            raise ValueError(f"tokens must be [{header.n_chunks}, {header.n_ctx}], got {tokens.shape}")
        if header.tokens_sha256 != tokens_sha256(tokens):
            raise ValueError("header.tokens_sha256 does not match the tokens")
        if not has_data(path):
            return cls._create(path, header, tokens, lut, head)
        try:
            conflicts, complete = _conflicts_with(path, header, tokens, lut)
        except StoreFormatError:
            if not replace:
                raise
            conflicts, complete = ["it is not a readable store"], False
        if not conflicts:
            if complete:
                raise StoreComplete(path)
            return cls._resume(path)
        if complete and _extended_by(path, header, tokens):
            return cls._extension(path, header, tokens, lut, head)
        if (complete and not replace and header.error and not header.head
                and not _conflicts_with(path, replace_error(header), tokens, lut)[0]):
            raise StoreComplete(path, older_form=True)
        if complete and not replace and header.head.get("form") == AUTO:
            stored = _header_of(path)
            if not _conflicts_with(path, in_form_of(header, stored), tokens, lut)[0]:
                raise StoreComplete(path, stored_form=form_name(stored))
        if not replace:
            raise StoreConflict(path, conflicts)
        return cls._replacement(path, header, tokens, lut, head)

    @classmethod
    def _create(cls, path: Path, header: StoreHeader, tokens: np.ndarray, lut: np.ndarray,
                head: OutputHead | None) -> "StoreWriter":
        try:
            fh = open(path, "wb")
        except OSError as exc:
            raise QevalError(f"cannot create store {path}: {exc.strerror}") from None
        try:
            fh.write(_PREAMBLE.pack(MAGIC, header.format_version, 0))
            fh.write(_encode_record(b"HEAD", json.dumps(header.to_json(), sort_keys=True).encode()))
            fh.write(_encode_record(b"TOKS", tokens.tobytes()))
            fh.write(_encode_record(b"LUT_", np.ascontiguousarray(lut, "<f4").tobytes()))
            if head is not None:  # the head (178 MB for Gemma-3-270M's) may be what fills the disk
                _write_record(fh, b"OUTW", head.payload_parts())
            _sync(fh)
        except OSError as exc:
            fh.close()
            path.unlink(missing_ok=True)
            raise WriteFailed(f"cannot create store {path} ({exc.strerror or exc}): nothing was kept", path,
                              exc.errno) from None
        writer = cls(path, header, fh, {})
        writer.created = True
        return writer

    @classmethod
    def _resume(cls, path: Path) -> "StoreWriter":
        with StoreReader(path, verify_chunks=True, tolerate_torn_tail=True) as old:
            good_end, pieces, header = old.end_of_valid_data, dict(old.chunk_pieces), old.header
        fh = open(path, "r+b")
        fh.truncate(good_end)  # drop a torn last record and the pieces of an unfinished chunk after it
        fh.seek(good_end)
        return cls(path, header, fh, pieces)

    @classmethod
    def _replacement(cls, path: Path, header: StoreHeader, tokens: np.ndarray, lut: np.ndarray,
                     head: OutputHead | None) -> "StoreWriter":
        """A writer of the capture that will replace `path`: an interrupted one is resumed, anything
        else at the replacement path (another capture, a torn file) is started over."""
        tmp = replacement_path(path)
        writer = (cls._resume(tmp) if _is_resumable(tmp, header, tokens, lut) else
                  cls._create(tmp, header, tokens, lut, head))
        writer.replaces = path
        return writer

    @classmethod
    def _extension(cls, path: Path, header: StoreHeader, tokens: np.ndarray, lut: np.ndarray,
                   head: OutputHead | None) -> "StoreWriter":
        """The writer of a capture that grows the complete store at `path` (identity.extends): written at
        replacement_path(path), as a replacement, which starts with the old chunks' records copied byte for byte
        (resumed, when an interrupted extension is there) and is renamed over `path` once complete. Only chunks that
        whole decode calls produced are copied: llama.cpp's logits of a window can move with the windows decoded
        beside it, and the new capture's calls group its windows from the start (kept_chunks)."""
        writer = cls._replacement(path, header, tokens, lut, head)
        if writer.created:
            with StoreReader(path) as old:
                for chunk in range(kept_chunks(old.header)):
                    for first_row, offset in old.chunk_pieces[chunk]:
                        record = old.raw_record(offset)
                        writer._append(record)
                        writer._pieces.setdefault(chunk, []).append((first_row, writer._fh.tell() - len(record)))
                    writer._rows[chunk] = header.n_scored_of(chunk)
        return writer

    @property
    def done_chunks(self) -> set[int]:
        """Chunks with every scored row written."""
        return {c for c, rows in self._rows.items() if rows == self.header.n_scored_of(c)}

    def write_chunk(self, chunk: ChunkData) -> None:
        """Append a chunk, or the next piece of one: pieces of a chunk come in row order, one chunk at a time."""
        if chunk.index not in self.header.chunk_range:
            raise ValueError(f"chunk {chunk.index} is outside {self.header.chunk_start}:{self.header.chunk_stop}")
        rows, n_scored = self._rows.get(chunk.index, 0), self.header.n_scored_of(chunk.index)
        if rows == n_scored:
            raise ValueError(f"chunk {chunk.index} is already stored")
        open_chunks = [c for c, r in self._rows.items() if r != self.header.n_scored_of(c) and c != chunk.index]
        if open_chunks:
            raise ValueError(f"chunk {open_chunks[0]} is unfinished: its pieces must all come before chunk {chunk.index}")
        if chunk.first_row != rows or chunk.first_row % PIECE_ROWS:
            raise ValueError(f"chunk {chunk.index}: a piece at row {chunk.first_row}, expected row {rows} "
                             f"(pieces start at multiples of {PIECE_ROWS})")
        if isinstance(chunk, HiddenChunk) and chunk.lean and self.header.format_version < LEAN_VERSION:
            raise ValueError(f"chunk {chunk.index}: a lean piece in a version {self.header.format_version} store")
        end = rows + chunk.n_tokens
        if chunk.n_tokens < 1 or end > n_scored or (end < n_scored and end % PIECE_ROWS):
            raise ValueError(f"chunk {chunk.index}: a piece of rows {rows}:{end} does not fit {n_scored} "
                             f"scored rows in pieces of {PIECE_ROWS}")
        hidden = isinstance(chunk, HiddenChunk)
        if hidden and not self.header.hidden:
            raise ValueError(f"chunk {chunk.index}: a hidden piece for a store without an output head")
        record = _encode_record(PIECE_TAGS[hidden], _chunk_payload(chunk, self.header))
        offset = self._fh.tell()
        self._append(record + self._error_record(chunk))  # one write: a piece is never stored without its record
        self._pieces.setdefault(chunk.index, []).append((chunk.first_row, offset))
        self._rows[chunk.index] = end

    def _error_record(self, chunk: ChunkData) -> bytes:
        """The ERRS record that follows the chunk's CHNK in a version 4 store (b"" in a store without one)."""
        bands = self.header.error_bands
        if (bands is None) != (chunk.error is None):
            raise ValueError(f"chunk {chunk.index}: {'an' if chunk.error is not None else 'no'} error record for a "
                             f"store that {'records' if bands is not None else 'records no'} error")
        if bands is None:
            return b""
        if chunk.error.lo.shape != (chunk.n_tokens, bands.count):
            raise ValueError(f"chunk {chunk.index}: error record of shape {chunk.error.lo.shape}, expected "
                             f"{(chunk.n_tokens, bands.count)}")
        return _encode_record(b"ERRS", chunk.error.payload(chunk.index, chunk.first_row))

    def _append(self, record: bytes) -> None:
        append_durably(self._fh, self.path, record, "the store is intact up to its last complete chunk: free space "
                       "and re-run the same command to resume")

    def finish(self) -> None:
        """Write the chunk index and the trailer: from now on the store reads as complete."""
        if self.finished:
            return
        missing = set(self.header.chunk_range) - self.done_chunks
        if missing:
            raise ValueError(f"cannot finish: {len(missing)} chunks missing (first {min(missing)})")
        pieces = [(chunk, first_row, offset) for chunk in sorted(self._pieces)
                  for first_row, offset in self._pieces[chunk]]
        entries = np.zeros(len(pieces), dtype=_INDEX_ENTRY)
        for row, piece in enumerate(pieces):
            entries[row] = piece
        index_offset = self._fh.tell()
        self._append(_encode_record(b"INDX", entries.tobytes()) + _TRAILER.pack(TRAILER_MAGIC, index_offset))
        if self.replaces is not None:
            os.replace(self.path, self.replaces)  # atomic: readers see the old store or the new, complete one
            sync_dir(self.replaces.parent)
            self.path, self.replaces = self.replaces, None
        self.finished = True

    def discard(self) -> None:
        """Give up before writing a chunk: the file goes if this writer created it (a resumed store stays)."""
        self._fh.close()
        if self.created and not self._pieces:
            self.path.unlink(missing_ok=True)


class StoreComplete(Exception):
    """Raised by StoreWriter.open when the store is already complete (resume is a no-op). older_form: it holds the
    capture but was made before stores recorded their error (format version 3 or less): it still reads, its bounds
    read "not recorded", and only a replacement (--force) records them."""

    def __init__(self, path: Path, older_form: bool = False, stored_form: str = ""):
        super().__init__(f"{path} is already complete")
        self.path, self.older_form = path, older_form
        self.stored_form = stored_form  # an auto capture's store made in another form (form_name), taken as it is


class StoreConflict(MismatchError):
    """Raised by StoreWriter.open when the store holds another capture than the one asked for."""

    def __init__(self, path: Path, conflicts: list[str]):
        super().__init__(f"{path} already holds a different capture ({'; '.join(conflicts)}); remove it, choose "
                         "another label, or replace it (--force)")
        self.path, self.conflicts = path, conflicts


def kept_chunks(header: StoreHeader) -> int:
    """How many of a complete store's chunks a capture of more windows keeps: those of whole decode calls. A call
    decodes n_batch // n_ctx windows side by side when n_batch >= n_ctx (as llama-perplexity), else one window."""
    per_call = max(1, int(header.capture.get("n_batch") or 0) // header.n_ctx)
    return header.n_chunks - header.n_chunks % per_call


def _extended_by(path: Path, header: StoreHeader, tokens: np.ndarray) -> bool:
    """Whether the capture `header` of windows `tokens` grows the complete store at `path` (identity.extends)."""
    with StoreReader(path) as old:
        return extends(old.header, old.tokens, header, tokens)


def replace_error(header: StoreHeader) -> StoreHeader:
    """The header of the same capture in the form made before error records (none): what an older store holds."""
    return dataclasses.replace(header, error={}, format_version=LABELLED_VERSION if header.windows else FORMAT_VERSION)


def in_form_of(header: StoreHeader, stored: StoreHeader) -> StoreHeader:
    """The header of the same capture as `header` in the form of `stored` (its code, error bands and head): what a
    store of this capture made in that form holds. An auto capture takes a complete store of it in any form."""
    return dataclasses.replace(header, codec=stored.codec, error=stored.error, head=stored.head,
                               format_version=stored.format_version)


def form_name(header: StoreHeader) -> str:
    """The form a store was captured in: logits, hidden or auto (hidden where its replay holds)."""
    return header.head.get("form", LOGITS) if header.head else LOGITS


def _header_of(path: Path) -> StoreHeader:
    with StoreReader(path, tolerate_torn_tail=True) as old:
        return old.header


def replacement_path(path: Path) -> Path:
    """Where a store that replaces `path` is written until it is complete."""
    return path.with_name(path.name + REPLACEMENT_SUFFIX)


def has_data(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def _is_resumable(path: Path, header: StoreHeader, tokens: np.ndarray, lut: np.ndarray) -> bool:
    """Whether `path` holds an interrupted capture of exactly these inputs."""
    if not has_data(path):
        return False
    try:
        conflicts, complete = _conflicts_with(path, header, tokens, lut)
    except StoreFormatError:
        return False
    return not conflicts and not complete


def _conflicts_with(path: Path, header: StoreHeader, tokens: np.ndarray, lut: np.ndarray) -> tuple[list[str], bool]:
    """(why the store at `path` cannot stand for this capture, whether it is complete)."""
    with StoreReader(path, tolerate_torn_tail=True) as old:
        conflicts = capture_conflicts(old.header, old.tokens, old.complete, header, tokens)
        if not np.array_equal(old.lut, np.asarray(lut, np.float32)):
            conflicts.append("code table (LUT_) differs")
        return conflicts, old.complete


def append_durably(fh, path: Path, data: bytes, kept: str) -> None:
    """Write `data` at the position of `fh` (a file of `path` open for writing) and fsync it. When that fails (a
    full disk) the file is cut back to exactly what it was before, so that it stays resumable, and WriteFailed says
    so: `kept` tells what is intact and what to do."""
    start = fh.tell()
    try:
        fh.write(data)
        _sync(fh)
    except OSError as exc:
        try:
            fh.truncate(start)
            fh.seek(start)
        except OSError:
            pass
        raise WriteFailed(f"writing {path} failed ({exc.strerror or exc}); {kept}", path, exc.errno,
                          len(data)) from None


def _sync(fh) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def sync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (where the filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StoreReader(OpenFile):
    """Reads a store, checking everything it reads; chunks are read (and checksummed) on demand."""

    def __init__(self, path: str | os.PathLike, verify_chunks: bool = False, tolerate_torn_tail: bool = False):
        self.path = Path(path)
        self._replay_matches: dict[str, bool] = {}  # per replay engine: whether its rows hashed as a capture's
        try:
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise StoreFormatError(f"cannot open store {self.path}: {exc.strerror}") from None
        try:
            self.size_bytes = os.fstat(self._fh.fileno()).st_size
            self._read_prologue()
            self.chunk_pieces: dict[int, list[tuple[int, int]]] = {}  # complete chunks: [(first_row, offset)]
            self.complete = self._read_index()
            if not self.complete:
                self._scan_chunks(verify_chunks, tolerate_torn_tail)
            elif verify_chunks:
                for i in self.chunk_pieces:
                    for _ in self.iter_pieces(i):
                        pass
        except BaseException:
            self._fh.close()
            raise

    # -- structure -------------------------------------------------------------------------------
    def _where(self, offset: int) -> str:
        return f"{self.path} (offset {offset})"

    def _read_at(self, offset: int, n: int) -> bytes:
        # pread: metrics workers read chunks from several threads through one descriptor.
        data = os.pread(self._fh.fileno(), n, offset)
        if len(data) != n:
            raise StoreFormatError(f"{self.path}: truncated file (wanted {n} bytes at offset {offset}, "
                                   f"file is {self.size_bytes} bytes)")
        return data

    def _read_into(self, buf: bytearray, offset: int, n: int) -> memoryview:
        if len(buf) < n:
            buf.extend(bytes(n - len(buf)))
        view = memoryview(buf)[:n]
        if os.preadv(self._fh.fileno(), [view], offset) != n:
            raise StoreFormatError(f"{self.path}: truncated file (wanted {n} bytes at offset {offset})")
        return view

    def _record_at(self, offset: int, want_tag: bytes, max_len: int | None = None,
                   into: bytearray | None = None) -> tuple[bytes | memoryview, int]:
        """Return (payload, offset after the record), checking tag, length and checksum. want_tag b"CHNK" takes
        either form of a piece where the store may hold both (PIECE_TAGS).

        With `into`, the payload is read into that (grown as needed) buffer and returned as a view.
        """
        tag, zero, n = _RECORD.unpack(self._read_at(offset, _RECORD.size))
        if not self._tag_is(tag, want_tag) or zero != 0:
            raise StoreFormatError(f"{self._where(offset)}: expected a {want_tag.decode()} record, "
                                   f"found {tag!r}")
        end = offset + _RECORD.size + n + _CHECKSUM.size
        if end > self.size_bytes or (max_len is not None and n > max_len):
            raise StoreFormatError(f"{self._where(offset)}: truncated file ({want_tag.decode()} record of "
                                   f"{n} bytes does not fit in {self.size_bytes} bytes)")
        payload = self._read_at(offset + _RECORD.size, n) if into is None else self._read_into(into,
                                                                                               offset + _RECORD.size, n)
        (stored,) = _CHECKSUM.unpack(self._read_at(offset + _RECORD.size + n, _CHECKSUM.size))
        if checksum(payload) != stored:
            raise StoreFormatError(f"{self._where(offset)}: checksum mismatch in {want_tag.decode()} "
                                   "record (the file is corrupted)")
        return payload, end

    def _tag_is(self, tag: bytes, want_tag: bytes) -> bool:
        return tag == want_tag or (want_tag == b"CHNK" and self.header.hidden and tag in PIECE_TAGS)

    def _read_prologue(self) -> None:
        magic, version, _ = _PREAMBLE.unpack(self._read_at(0, _PREAMBLE.size))
        if magic != MAGIC:
            raise StoreFormatError(f"{self.path} is not a qeval store (bad magic {magic[:8]!r})")
        if version not in READABLE_VERSIONS:
            raise StoreFormatError(f"{self.path}: store format version {version} is not supported "
                                   f"(this qeval reads versions {', '.join(map(str, READABLE_VERSIONS))})")
        payload, pos = self._record_at(_PREAMBLE.size, b"HEAD", _MAX_HEADER_BYTES)
        try:
            raw = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreFormatError(f"{self.path}: header is not valid JSON ({exc})") from None
        self.header = StoreHeader.from_json(raw, str(self.path))
        h = self.header
        if h.format_version != version:
            raise StoreFormatError(f"{self.path}: preamble says format version {version}, header {h.format_version}")
        payload, pos = self._record_at(pos, b"TOKS", 4 * h.n_chunks * h.n_ctx)
        if len(payload) != 4 * h.n_chunks * h.n_ctx:
            raise StoreFormatError(f"{self.path}: token block has {len(payload)} bytes, expected "
                                   f"{4 * h.n_chunks * h.n_ctx}")
        self.tokens = np.frombuffer(payload, dtype="<i4").reshape(h.n_chunks, h.n_ctx)
        if tokens_sha256(self.tokens) != h.tokens_sha256:
            raise StoreFormatError(f"{self.path}: token ids do not match the header's tokens_sha256")
        if self.tokens.min() < 0 or self.tokens.max() >= h.n_vocab:
            raise StoreFormatError(f"{self.path}: token ids outside the vocab of {h.n_vocab}")
        payload, pos = self._record_at(pos, b"LUT_", 4 * N_CODES)
        if len(payload) != 4 * N_CODES:
            raise StoreFormatError(f"{self.path}: code table has {len(payload)} bytes, expected {4 * N_CODES}")
        self.lut = np.frombuffer(payload, dtype="<f4").astype(np.float32)
        if not (np.all(np.isfinite(self.lut)) and np.all(np.diff(self.lut) >= 0)):
            raise StoreFormatError(f"{self.path}: code table must be finite and non-decreasing")
        self._head_offset = None
        if h.hidden:  # its output head: framing checked now, its bytes read (and checked) when a HIDN piece is
            self._head_offset, pos = pos, self._record_end(pos, b"OUTW")
        self.first_chunk_offset = pos

    @cached_property
    def output_head(self) -> OutputHead:
        """The output head the store embeds, checksummed and checked against the header's fingerprint."""
        if self._head_offset is None:
            raise StoreFormatError(f"{self.path}: the store holds no output head")
        payload, _ = self._record_at(self._head_offset, b"OUTW")
        head = OutputHead.from_payload(payload, str(self.path))
        if {**head.describe(), "form": self.header.head["form"]} != self.header.head:
            raise StoreFormatError(f"{self.path}: the embedded output head does not match the header's description "
                                   f"and fingerprint (header {self.header.head.get('fingerprint')!r}, head "
                                   f"{head.fingerprint!r})")
        return head

    @cached_property
    def code(self):
        """The code its replayed rows are coded with (SqrtLogCode of the header's codec), checked against LUT_."""
        return code_of(self.header.codec, self.lut, str(self.path))

    def _read_index(self) -> bool:
        if self.size_bytes < self.first_chunk_offset + _TRAILER.size:
            return False
        magic, index_offset = _TRAILER.unpack(self._read_at(self.size_bytes - _TRAILER.size, _TRAILER.size))
        if magic != TRAILER_MAGIC:
            return False
        if not self.first_chunk_offset <= index_offset < self.size_bytes - _TRAILER.size:
            raise StoreFormatError(f"{self.path}: trailer points outside the file")
        payload, end = self._record_at(index_offset, b"INDX")
        if end != self.size_bytes - _TRAILER.size or len(payload) % _INDEX_ENTRY.itemsize:
            raise StoreFormatError(f"{self.path}: chunk index is malformed")
        for chunk, first_row, offset in np.frombuffer(payload, dtype=_INDEX_ENTRY):
            if not self.first_chunk_offset <= int(offset) < index_offset:
                raise StoreFormatError(f"{self.path}: chunk index entry points outside the file")
            pieces = self.chunk_pieces.setdefault(int(chunk), [])
            follows = int(first_row) > pieces[-1][0] if pieces else first_row == 0
            if not follows or first_row % PIECE_ROWS or first_row >= self.header.n_scored_of(int(chunk)):
                raise StoreFormatError(f"{self.path}: chunk index lists chunk {int(chunk)} at row {int(first_row)}, "
                                       "out of order")
            pieces.append((int(first_row), int(offset)))
        if sorted(self.chunk_pieces) != list(self.header.chunk_range):
            raise StoreFormatError(f"{self.path}: chunk index does not cover chunks "
                                   f"{self.header.chunk_start}:{self.header.chunk_stop}")
        self.end_of_valid_data = index_offset
        return True

    def _scan_chunks(self, verify: bool, tolerate_torn_tail: bool) -> None:
        """Walk CHNK records of a store without a trailer (being written, or interrupted). Only chunks with
        every piece count; data after the last complete chunk (an unfinished window) is not valid data."""
        pos = self.end_of_valid_data = self.first_chunk_offset
        open_chunk, open_pieces, rows = None, [], 0
        while pos < self.size_bytes:
            try:
                index, n, first_row, end = self._chunk_at(pos, verify)
                if open_chunk is not None and (index != open_chunk or first_row != rows):
                    raise StoreFormatError(f"{self._where(pos)}: chunk {open_chunk} is unfinished where chunk "
                                           f"{index} row {first_row} starts")
                if open_chunk is None and first_row != 0:
                    raise StoreFormatError(f"{self._where(pos)}: chunk {index} starts at row {first_row}")
            except StoreFormatError:
                if tolerate_torn_tail:
                    break
                raise
            open_chunk, rows = index, first_row + n
            open_pieces.append((first_row, pos))
            pos = end
            if rows == self.header.n_scored_of(index):
                self.chunk_pieces[index] = open_pieces
                open_chunk, open_pieces, rows = None, [], 0
                self.end_of_valid_data = pos

    def raw_record(self, offset: int) -> bytes:
        """The CHNK record at `offset` as it is in the file (framing, payload and checksum), its checksum verified;
        in a version-4 store with the ERRS record that follows it (verified too): a piece as a writer appends it."""
        _, end = self._record_at(offset, b"CHNK")
        if self.header.error_bands is not None:
            index, rows, _, first_row = _CHUNK_HEAD.unpack(self._read_at(offset + _RECORD.size, _CHUNK_HEAD.size))
            end = self._error_at(end, index, rows, first_row)[1]
        return self._read_at(offset, end - offset)

    def _chunk_at(self, offset: int, verify: bool) -> tuple[int, int, int, int]:
        """(chunk index, rows, first row, end offset) of the CHNK record at offset; full checksum check only if verify."""
        head = self._read_at(offset, _RECORD.size + _CHUNK_HEAD.size)
        tag, zero, n = _RECORD.unpack(head[:_RECORD.size])
        if not self._tag_is(tag, b"CHNK") or zero != 0:
            raise StoreFormatError(f"{self._where(offset)}: expected a CHNK record, found {tag!r}")
        end = offset + _RECORD.size + n + _CHECKSUM.size
        if end > self.size_bytes:
            raise StoreFormatError(f"{self.path}: truncated file (last chunk record is incomplete)")
        index, rows, _, first_row = _CHUNK_HEAD.unpack(head[_RECORD.size:])
        if index not in self.header.chunk_range or index in self.chunk_pieces:
            raise StoreFormatError(f"{self._where(offset)}: unexpected chunk number {index}")
        n_scored = self.header.n_scored_of(index)
        if first_row % PIECE_ROWS or not 0 < rows <= n_scored - first_row:
            raise StoreFormatError(f"{self._where(offset)}: chunk {index} piece of rows {first_row}:{first_row + rows} "
                                   f"does not fit {n_scored} scored rows")
        if verify:
            self._record_at(offset, b"CHNK")
        if self.header.error_bands is not None:  # its ERRS record follows
            if verify:
                end = self._error_at(end, index, rows, first_row)[1]
            else:
                end = self._record_end(end, b"ERRS")
        return index, rows, first_row, end

    def _record_end(self, offset: int, want_tag: bytes) -> int:
        """Where the record at `offset` (tag `want_tag`) ends, from its frame alone (the payload is not read)."""
        tag, zero, n = _RECORD.unpack(self._read_at(offset, _RECORD.size))
        if not self._tag_is(tag, want_tag) or zero != 0:
            raise StoreFormatError(f"{self._where(offset)}: expected a {want_tag.decode()} record, found {tag!r}")
        end = offset + _RECORD.size + n + _CHECKSUM.size
        if end > self.size_bytes:
            raise StoreFormatError(f"{self.path}: truncated file ({want_tag.decode()} record of {n} bytes does not fit "
                                   f"in {self.size_bytes} bytes)")
        return end

    def _error_at(self, offset: int, index: int, rows: int, first_row: int) -> tuple[ErrorRecord, int]:
        """(the error record of the piece whose CHNK ends at `offset`, where its ERRS record ends), checked."""
        bands = self.header.error_bands
        payload, end = self._record_at(offset, b"ERRS", record_bytes(rows, bands.count))
        return ErrorRecord.from_payload(payload, index, first_row, rows, bands.count, str(self.path)), end

    def iter_errors(self) -> Iterator[tuple[int, ErrorRecord]]:
        """(chunk, error record of its rows) of every chunk, piece by piece in row order, reading only the ERRS
        records (each checksummed): what `qeval info` summarises without decompressing a row. Nothing for a store
        that records no error."""
        if self.header.error_bands is None:
            return
        for index in self.chunk_indices:
            for first_row, offset in self._pieces_of(index):
                _, _, n = _RECORD.unpack(self._read_at(offset, _RECORD.size))
                head = self._read_at(offset + _RECORD.size, _CHUNK_HEAD.size)
                yield index, self._error_at(offset + _RECORD.size + n + _CHECKSUM.size, index,
                                            _CHUNK_HEAD.unpack(head)[1], first_row)[0]

    # -- chunks ----------------------------------------------------------------------------------
    @property
    def chunk_indices(self) -> list[int]:
        return sorted(self.chunk_pieces)

    @property
    def chunk_offsets(self) -> dict[int, int]:
        """Chunk -> offset of its first CHNK record."""
        return {c: pieces[0][1] for c, pieces in self.chunk_pieces.items()}

    def _pieces_of(self, index: int) -> list[tuple[int, int]]:
        if index not in self.chunk_pieces:
            state = "complete" if self.complete else "still being written or interrupted"
            raise StoreFormatError(f"{self.path}: chunk {index} is not in this store ({state}; it holds "
                                   f"{len(self.chunk_pieces)} chunks)")
        return self.chunk_pieces[index]

    def read_chunk(self, index: int, buffer: bytearray | None = None) -> ChunkData:
        """Chunk `index`, checksummed. With `buffer` (one per thread), the chunk's bytes live in it and
        stay valid only until the next read into the same buffer: no fresh 35 MB per chunk. A chunk
        stored in pieces is read piece by piece as its planes are iterated (PiecedChunk)."""
        pieces = self._pieces_of(index)
        if len(pieces) > 1:
            return PiecedChunk(self, index, buffer)
        return self._read_piece(index, *pieces[0], buffer, whole=True)

    def iter_pieces(self, index: int, buffer: bytearray | None = None) -> Iterator[ChunkData]:
        """The pieces of chunk `index` in row order, each checksummed (each valid until the next, with `buffer`)."""
        pieces, row, n_scored = self._pieces_of(index), 0, self.header.n_scored_of(index)
        for k, (first_row, offset) in enumerate(pieces):
            piece = self._read_piece(index, first_row, offset, buffer)
            row, last = first_row + piece.n_tokens, k == len(pieces) - 1
            next_row = n_scored if last else pieces[k + 1][0]
            if row != next_row:
                raise StoreFormatError(f"{self.path}: chunk {index} pieces do not cover its {n_scored} rows")
            yield piece
            del piece  # its bytes live in `buffer`, which the next read may have to grow

    def _read_piece(self, index: int, first_row: int, offset: int, buffer: bytearray | None,
                    whole: bool = False) -> ChunkData:
        payload, end = self._record_at(offset, b"CHNK", into=buffer)
        h = self.header
        if len(payload) < _CHUNK_HEAD.size:
            raise StoreFormatError(f"{self.path}: chunk {index} record is too short")
        got_index, n, top_k, got_first = _CHUNK_HEAD.unpack_from(payload)
        n_scored = h.n_scored_of(index)
        expected_n = n_scored if whole else min(n_scored - first_row, n)
        if got_index != index or got_first != first_row or n != expected_n or n < 1 or top_k != h.top_k:
            raise StoreFormatError(f"{self.path}: chunk {index} record disagrees with the header "
                                   f"(index {got_index}, rows {got_first}:{got_first + n}, top_k {top_k})")
        pos = _CHUNK_HEAD.size
        hidden = self._read_at(offset, 4) == b"HIDN"
        sizes = (8 * n, 8 * n, 4 * n * top_k)
        if len(payload) < pos + sum(sizes) + hidden * _REPLAY_CHECKSUM.size:
            raise StoreFormatError(f"{self.path}: chunk {index} record is too short")
        cols = []
        for size, dtype in zip(sizes, ("<f8", "<f8", "<i4")):
            cols.append(np.frombuffer(payload, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=pos).copy())
            pos += size
        top_ids = cols[2].reshape(n, top_k)
        if top_ids.min() < 0 or top_ids.max() >= h.n_vocab:
            raise StoreFormatError(f"{self.path}: chunk {index} holds token ids outside the vocab")
        error = self._error_at(end, index, n, first_row)[0] if h.error_bands is not None else None
        if hidden:
            return self._hidden_piece(payload, pos, index, first_row, n, (*cols[:2], top_ids, error))
        return ChunkData(index=index, logprob_target=cols[0], logprob_max=cols[1], top_ids=top_ids,
                         codes_zst=memoryview(payload)[pos:], first_row=first_row, error=error)  # no 35 MB copy

    def _hidden_piece(self, payload, pos: int, index: int, first_row: int, n: int, scalars: tuple) -> HiddenChunk:
        """The HiddenChunk of a HIDN payload whose fields (_hidden_fields) start at `pos`, the scalars (and error
        record) read; each field checked (StoreFormatError)."""
        (replayed,) = _REPLAY_CHECKSUM.unpack_from(payload, pos)
        pos += _REPLAY_CHECKSUM.size
        replays = []
        if self.header.format_version >= REPLAY_RECORD_VERSION:
            short = StoreFormatError(f"{self.path}: chunk {index} record is too short for its uncoded replays")
            if len(payload) < pos + _UNCODED_HEAD.size:
                raise short
            count, zero = _UNCODED_HEAD.unpack_from(payload, pos)
            pos += _UNCODED_HEAD.size
            if not 1 <= count <= len(REPLAY_ENGINES) or zero:
                raise StoreFormatError(f"{self.path}: chunk {index} names {count} uncoded replays")
            size = record_bytes(n, REPLAY_BANDS.count)
            for _ in range(count):
                if len(payload) < pos + _UNCODED_ENTRY.size + size:
                    raise short
                engine, zero, checksum_ = _UNCODED_ENTRY.unpack_from(payload, pos)
                pos += _UNCODED_ENTRY.size
                if not 1 <= engine <= len(REPLAY_ENGINES) or zero or REPLAY_ENGINES[engine - 1] in (
                        r.engine for r in replays):
                    raise StoreFormatError(f"{self.path}: chunk {index} names an unknown or repeated replay engine "
                                           f"({engine})")
                record = ErrorRecord.from_payload(memoryview(payload)[pos:pos + size], index, first_row, n,
                                                  REPLAY_BANDS.count, f"{self.path} (uncoded replay)")
                replays.append(UncodedReplay(REPLAY_ENGINES[engine - 1], checksum_, record))
                pos += size
        replays.sort(key=lambda r: REPLAY_ENGINES.index(r.engine))  # the order a reader prefers them in
        if replays and self.header.format_version < LEAN_VERSION and "portable" not in (r.engine for r in replays):
            raise StoreFormatError(f"{self.path}: chunk {index} has no portable replay, which every hidden piece of a "
                                   f"version {self.header.format_version} store holds")
        return HiddenChunk(index, *scalars[:3], memoryview(payload)[pos:], first_row, scalars[3], replayed, self,
                           tuple(replays))

    @cached_property
    def _ggml_head(self):
        """The store's head in llama.cpp's own kernel (ggml_replay.GgmlHead), or None where there is no ggml."""
        from qeval.storage.ggml_replay import GgmlHead  # noqa: PLC0415 - loads ggml only for a hidden store

        return GgmlHead.of(self.output_head)

    def replayed_by(self, engine: str, rows: StoredActivations, first_row: int) -> np.ndarray | None:
        """float32 rows [n, V] of stored hidden rows (the first one row `first_row` of its chunk) as `engine`
        replays them here; None where the engine is not at hand, or where its rows differed from a capture's before
        (a CPU whose ggml sums in another order)."""
        if self._replay_matches.get(engine) is False:
            return None
        if engine == "ggml":
            return None if self._ggml_head is None else self._ggml_head.replay(rows, first_row)
        return np.concatenate(list(replayed_rows(self.output_head, rows)))

    @property
    def replay_matches(self) -> dict[str, bool]:
        """Per replay engine tried so far: whether its rows hashed as the capture's did."""
        return dict(self._replay_matches)

    def replay_matched(self, engine: str, matches: bool) -> None:
        """Whether `engine`'s rows hashed as the capture's: an engine that did not is not tried again."""
        self._replay_matches[engine] = matches

    def hidden_pieces(self) -> Iterator[HiddenChunk]:
        """Every hidden piece, row order (a logits piece is not read)."""
        for index, first_row, piece_form in self.piece_forms():
            if piece_form == "hidden":
                yield self._read_piece(index, first_row, dict(self._pieces_of(index))[first_row], None)

    def iter_replays(self) -> Iterator[tuple[int, UncodedReplay]]:
        """(chunk, uncoded replay) of every engine of every hidden piece that records them (version 6), row order."""
        for piece in self.hidden_pieces() if self.header.replay_record else ():
            for replay in piece.replays:
                yield piece.index, replay

    def lean_pieces(self) -> int:
        """How many of its pieces are lean (LEAN_VERSION): read only where ggml gives the capture's rows again."""
        return sum(piece.lean for piece in self.hidden_pieces())

    def piece_forms(self) -> Iterator[tuple[int, int, str]]:
        """(chunk, first row, "logits" or "hidden") of every piece, from the records' tags alone."""
        for index in self.chunk_indices:
            for first_row, offset in self._pieces_of(index):
                yield index, first_row, "hidden" if self._read_at(offset, 4) == b"HIDN" else "logits"


class PiecedChunk(ChunkData):
    """A chunk stored in pieces, read like a ChunkData: iter_planes() reads one piece at a time, so a
    long window is never held whole; the scalars are read (all pieces, checksummed) on first use."""

    def __init__(self, reader: StoreReader, index: int, buffer: bytearray | None = None):
        self._reader, self.index, self.first_row = reader, index, 0
        self._buffer = buffer if buffer is not None else bytearray()
        self._scalars: tuple | None = None
        self._errors: list[tuple[int, ErrorRecord | None]] = []  # the pieces' records, as iter_planes reads them

    @property
    def n_tokens(self) -> int:
        return self._reader.header.n_scored_of(self.index)

    def iter_planes(self, n_vocab: int, block_tokens: int = 16, buffers: int = 1) -> Iterator[tuple[int, np.ndarray]]:
        return self._walk(lambda piece: piece.iter_planes(n_vocab, block_tokens, buffers))

    @property
    def reads_uncoded(self) -> bool:
        return self._reader.header.replay_record  # its hidden pieces do; its logits pieces, if any, read coded

    def iter_rows(self, n_vocab: int, buffers: int = 1) -> Iterator[tuple[int, np.ndarray, ErrorRecord | None]]:
        return self._walk(lambda piece: piece.iter_rows(n_vocab, buffers))

    def _walk(self, read: Callable[[ChunkData], Iterator[tuple]]) -> Iterator[tuple]:
        """What `read` yields of each piece in turn, its first item (a row) counted from the chunk's first row."""
        scalars = []
        for piece in self._reader.iter_pieces(self.index, self._buffer):
            self._errors.append((piece.first_row, piece.error))
            for start, *rest in read(piece):
                yield piece.first_row + start, *rest
            scalars.append(_scalars_of(piece))
            del piece  # (see iter_pieces)
        self._scalars = _joined_scalars(scalars)

    def _scalar(self, k: int):
        if self._scalars is None:
            self._scalars = _joined_scalars([_scalars_of(p) for p in self._reader.iter_pieces(self.index)])
        return self._scalars[k]

    def error_rows(self, start: int, stop: int) -> ErrorRecord | None:
        return rows_of(self._errors, start, stop) if self._scalars is None else super().error_rows(start, stop)

    logprob_target = property(lambda self: self._scalar(0))
    logprob_max = property(lambda self: self._scalar(1))
    top_ids = property(lambda self: self._scalar(2))
    error = property(lambda self: self._scalar(3))
    codes_zst = property(lambda self: b"")


def _scalars_of(piece: ChunkData) -> tuple:
    """What a chunk keeps of a piece once its codes are read: (logprob_target, logprob_max, top_ids, error)."""
    return piece.logprob_target, piece.logprob_max, piece.top_ids, piece.error


def _joined_scalars(pieces: list[tuple]) -> tuple:
    """_scalars_of a chunk's pieces, joined."""
    *arrays, errors = zip(*pieces)
    return (*map(np.concatenate, arrays), None if errors[0] is None else ErrorRecord.concat(list(errors)))
