"""Certify a store for every machine: each lean hidden piece (store.LEAN_VERSION) made a full one.

A capture keeps a hidden piece lean where llama.cpp's own kernel (ggml) gives its logits again on the capturing
machine: its activations, ggml's replay record and codes of ggml's rows, with no portable replay, which is most of
what a hidden capture would otherwise cost. Such a piece reads only where ggml sums as the capture's did (that CPU
kind and llama.cpp build). Certifying replays it there once more through ggml (its rows hashed as recorded: they are
the exact logits), then through the portable kernel, and writes the piece as a capture that replayed both would have
(codec.certified_block): readable on any machine. An auto store codes as logits any piece whose portable replay
misses AUTO_REPLAY_KL, as its capture would have; the codes are of the exact rows, so the piece's own error record
stays theirs.

Run where the store was captured; `publish` certifies before it uploads. The store is rewritten under a temporary
name (`STORE.certifying`) and replaces the original only once it reads back whole: an interrupted certify leaves the
original as it was. The measurement is not touched: scalars, ids and activations are copied, so the store's identity
and every result made against it stay what they were.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qeval.errors import QevalError, StoreFormatError
from qeval.present import report
from qeval.present.progress import progress_bar
from qeval.storage import runs
from qeval.storage.codec import certified_block, code_replayed
from qeval.storage.hidden_form import AUTO, AUTO_REPLAY_KL, StoredActivations
from qeval.storage.hub_files import is_hub_spec
from qeval.storage.planes import codes_to_planes
from qeval.storage.store import ChunkBuilder, ChunkData, HiddenChunk, StoreReader, StoreWriter, sync_dir

TMP_SUFFIX = ".certifying"
BLOCK_ROWS = 16  # rows replayed and coded at once, as a capture's blocks


@dataclass
class CertifyResult:
    path: Path
    lean_pieces: int  # the lean pieces it found (0: nothing to do)
    kept_hidden: int  # of them, certified in the hidden form
    coded: int  # of them, coded as logits (an auto store's pieces whose portable replay missed AUTO_REPLAY_KL)
    size_bytes: int


def certify_store(path: str | os.PathLike, on_piece: Callable[[int], None] | None = None) -> CertifyResult:
    """Make every lean piece of the store at `path` a full one, in place (the module's docstring)."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with StoreReader(path) as reader:
        if not reader.complete:
            raise QevalError(f"cannot certify {path}: it is an incomplete capture; finish it first (run the capture "
                             "again: it resumes)")
        found = reader.lean_pieces()
        if not found:
            return CertifyResult(path, 0, 0, 0, reader.size_bytes)
        tmp.unlink(missing_ok=True)  # a leftover of an interrupted certify: never resumed, always rewritten
        try:
            counts = _rewrite(reader, tmp, on_piece)
            with StoreReader(tmp) as check:
                if not check.complete or check.chunk_indices != reader.chunk_indices or check.lean_pieces():
                    raise StoreFormatError(f"{tmp}: the certified store did not read back complete")
                size = check.size_bytes
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, path)
    sync_dir(path.parent)
    return CertifyResult(path, found, counts["hidden"], counts["logits"], size)


def _rewrite(reader: StoreReader, tmp: Path, on_piece) -> dict[str, int]:
    counts = {"hidden": 0, "logits": 0}
    auto = reader.header.head.get("form") == AUTO
    with StoreWriter.open(tmp, reader.header, reader.tokens, reader.lut, head=reader.output_head) as writer:
        for index in reader.chunk_indices:
            for piece in reader.iter_pieces(index):
                if isinstance(piece, HiddenChunk) and piece.lean:
                    piece = certified_piece(piece, reader, auto)
                    counts["hidden" if isinstance(piece, HiddenChunk) else "logits"] += 1
                    if on_piece:
                        on_piece(1)
                writer.write_chunk(piece)
        writer.finish()
    return counts


def certified_piece(piece: HiddenChunk, reader: StoreReader, auto: bool) -> ChunkData:
    """The full piece of a lean one: its rows as ggml gives them here (hashed as the capture's, else the lean
    piece's message), replayed portably; an auto store's piece whose portable replay misses, coded as logits."""
    exact, _ = piece.uncoded_rows()
    head, code = reader.output_head, reader.code
    raw, row_bytes = piece.stored_bytes(), head.activation.row_bytes(head.n_embd)
    rows = StoredActivations.parse(raw, piece.n_tokens, head.n_embd, head.activation, f"{reader.path}: chunk "
                                   f"{piece.index}")
    builder = ChunkBuilder(piece.index, first_row=piece.first_row, hidden=True)
    worst = 0.0
    for start in range(0, piece.n_tokens, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, piece.n_tokens)
        logits = exact[start:stop]
        block, _ = certified_block(logits, logits.max(axis=1), bytes(raw[start * row_bytes:stop * row_bytes]),
                                   rows.rows(start, stop), code, head, ggml=logits)
        worst = max(worst, *(float(u.record.kl.max()) for u in block.uncoded if u.engine == "portable"))
        builder.add(block.planes, *_scalars(piece, start, stop), block.error, block.hidden, block.uncoded)
    if not (auto and worst > AUTO_REPLAY_KL):
        return builder.finish()
    coded = ChunkBuilder(piece.index, first_row=piece.first_row)
    for start in range(0, piece.n_tokens, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, piece.n_tokens)
        planes = codes_to_planes(code_replayed(exact[start:stop], code))
        coded.add(planes, *_scalars(piece, start, stop), piece.error.rows(start, stop))  # a lean piece's: of these
    return coded.finish()


def _scalars(piece: ChunkData, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return piece.logprob_target[start:stop], piece.logprob_max[start:stop], piece.top_ids[start:stop]


def certify_report(store: str, runs_dir=None, progress: bool = False) -> tuple[dict, str]:
    """`qeval certify STORE` (a path or a label): the store certified in place, and the line that says so."""
    if is_hub_spec(store):
        raise QevalError(f"{store} is published, and so certified already; certify a local store (a path or a label)")
    path = runs.resolve_path(store, runs.runs_dir(runs_dir))
    with StoreReader(path) as reader:
        total = reader.lean_pieces()
    with progress_bar("certifying pieces", total or None, progress) as advance:
        res = certify_store(path, on_piece=advance)
    d = {"path": str(res.path), "lean_pieces": res.lean_pieces, "kept_hidden": res.kept_hidden, "coded": res.coded,
         "size_bytes": res.size_bytes}
    return d, report.certify_text(d)
