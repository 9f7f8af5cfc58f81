"""Merge partial stores (shards of one capture) into one complete store.

Each part must be complete for its own chunk range (`qeval capture --chunk-range A:B`); together
the parts must cover every chunk of the token list exactly once, and all of them must come from
the same capture: same model, KV settings, tokens, tokenizer, code. CHNK records are copied as
they are (the zstd frames are never decoded or re-encoded), so a merged store reads exactly like
a store captured in one piece.

The merged store is written under a temporary name (`OUT.merging`, which is not a `*.qeval` label)
and renamed only once it is finished and re-read: a failed or interrupted merge never leaves a file
that looks complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from qeval.errors import QevalError, StoreFormatError
from qeval.identity import capture_identity, short
from qeval.present import report
from qeval.present.progress import progress_bar
from qeval.storage.store import StoreReader, StoreWriter, sync_dir

TMP_SUFFIX = ".merging"


@dataclass
class MergeResult:
    path: Path
    n_chunks: int
    parts: list[tuple[Path, int, int]]  # (path, chunk_start, chunk_stop), in chunk order
    size_bytes: int


def _range(a: int, b: int) -> str:
    return f"{a}:{b}"


def check_parts(readers: Sequence[StoreReader]) -> list[StoreReader]:
    """Refuse incomplete, mismatched, overlapping or gapped parts; return them in chunk order."""
    if not readers:
        raise QevalError("nothing to merge: give at least one part")
    for r in readers:
        if not r.complete:
            h = r.header
            raise QevalError(f"cannot merge: part {r.path} is incomplete (it holds {len(r.chunk_indices)} of the "
                             f"{h.chunk_stop - h.chunk_start} chunks of its range {_range(h.chunk_start, h.chunk_stop)}"
                             "; re-run its capture to resume it, then merge)")
    first = readers[0]
    ours = capture_identity(first.header)  # what parts of one capture share (their chunk ranges differ)
    for r in readers[1:]:
        theirs = capture_identity(r.header)
        diffs = [name for name in ours if ours[name] != theirs[name]]
        if diffs:
            detail = "; ".join(f"{name}: {short(ours[name])} vs {short(theirs[name])}" for name in diffs)
            raise QevalError(f"cannot merge: parts {first.path} and {r.path} come from different captures "
                             f"({', '.join(diffs)} differ: {detail})")
        if not np.array_equal(r.lut, first.lut):
            raise QevalError(f"cannot merge: parts {first.path} and {r.path} use different code tables (LUT_)")
    ordered = sorted(readers, key=lambda r: (r.header.chunk_start, r.header.chunk_stop))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.header.chunk_start < prev.header.chunk_stop:
            both = _range(cur.header.chunk_start, min(prev.header.chunk_stop, cur.header.chunk_stop))
            raise QevalError(f"cannot merge: parts overlap: {prev.path} holds chunks "
                             f"{_range(prev.header.chunk_start, prev.header.chunk_stop)} and {cur.path} holds "
                             f"{_range(cur.header.chunk_start, cur.header.chunk_stop)} (chunks {both} are in both)")
    gaps, expected = [], 0
    for r in ordered:
        if r.header.chunk_start > expected:
            gaps.append(_range(expected, r.header.chunk_start))
        expected = r.header.chunk_stop
    n_chunks = first.header.n_chunks
    if expected < n_chunks:
        gaps.append(_range(expected, n_chunks))
    if gaps:
        have = ", ".join(f"{r.path} {_range(r.header.chunk_start, r.header.chunk_stop)}" for r in ordered)
        raise QevalError(f"cannot merge: chunks {', '.join(gaps)} of the {n_chunks} are in no part "
                         f"(parts hold: {have}); capture the missing range with --chunk-range and merge again")
    return ordered


def merge_stores(parts: Sequence[str | os.PathLike], out: str | os.PathLike, label: str | None = None,
                 on_chunk: Callable[[int], None] | None = None) -> MergeResult:
    """Write `out`, a complete store of every chunk of `parts`. `label`: the merged store's label
    (default: the parts' label when they agree, else the name of `out` without its suffix)."""
    out = Path(out)
    part_paths = [Path(p) for p in parts]
    if len(set(p.resolve() for p in part_paths)) != len(part_paths):
        raise QevalError("cannot merge: the same part is named twice")
    if out.resolve() in {p.resolve() for p in part_paths}:
        raise QevalError(f"cannot merge: the output {out} is one of the parts")
    if out.exists():
        raise QevalError(f"cannot merge: {out} already exists (merge never overwrites; remove it or choose "
                         "another output)")
    tmp = out.with_name(out.name + TMP_SUFFIX)
    with contextlib.ExitStack() as stack:
        readers = []
        for p in part_paths:
            # a torn tail is what an interrupted part looks like: report it as incomplete, not corrupt
            readers.append(stack.enter_context(StoreReader(p, tolerate_torn_tail=True)))
        ordered = check_parts(readers)
        first = ordered[0].header
        if label is None:
            labels = {r.header.label for r in ordered}
            label = labels.pop() if len(labels) == 1 else out.name.split(".")[0]
        header = dataclasses.replace(
            first, chunk_start=0, chunk_stop=first.n_chunks, label=label,
            capture={**first.capture, "merged_from": [
                {"file": r.path.name, "chunk_range": [r.header.chunk_start, r.header.chunk_stop]} for r in ordered]})
        tmp.unlink(missing_ok=True)  # a leftover of an interrupted merge: never resumed, always rewritten
        try:
            _copy(ordered, tmp, header, on_chunk)
            with StoreReader(tmp) as check:
                if not check.complete or check.chunk_indices != list(range(first.n_chunks)):
                    raise StoreFormatError(f"{tmp}: merged store did not read back complete")
                size = check.size_bytes
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    sync_dir(out.parent)
    return MergeResult(out, first.n_chunks, [(r.path, r.header.chunk_start, r.header.chunk_stop) for r in ordered],
                       size)


def _copy(ordered: list[StoreReader], tmp: Path, header, on_chunk) -> None:
    first = ordered[0]
    head = first.output_head if header.hidden else None  # shards of one capture share it (its identity's form)
    with StoreWriter.open(tmp, header, first.tokens, first.lut, head=head) as writer:
        for r in ordered:
            for index in r.chunk_indices:
                # iter_pieces checks each record's checksum and fields; write_chunk writes back the same
                # payload bytes (scalars, ids and the zstd frame untouched), i.e. a verbatim copy.
                for piece in r.iter_pieces(index):
                    writer.write_chunk(piece)
                if on_chunk:
                    on_chunk(1)
        writer.finish()


def merge_report(parts: Sequence[str | os.PathLike], out: str | os.PathLike, label: str | None = None,
                 progress: bool = False) -> tuple[dict, str]:
    total = 0
    for p in parts:
        with contextlib.suppress(QevalError):
            with StoreReader(p, tolerate_torn_tail=True) as r:
                total += len(r.chunk_indices)
    with progress_bar("merging chunks", total or None, progress) as advance:
        res = merge_stores(parts, out, label, on_chunk=advance)
    d = {"path": str(res.path), "chunks": res.n_chunks, "size_bytes": res.size_bytes,
         "parts": [{"path": str(p), "chunk_range": [a, b]} for p, a, b in res.parts]}
    return d, report.merge_text(d)
