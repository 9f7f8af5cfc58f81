"""A pair's partial result, chunk by chunk: what lets a killed matrix pair continue where it stopped without
keeping its candidate's logits.

A matrix pair (qeval.orchestrate.matrix.run_pair) appends each chunk's per-token columns (what the result's
`.npz` saves anyway, ~60 bytes per scored token) to `RUNS_DIR/results/<cand>.vs.<ref>.partial` as soon as the
chunk is compared; a rerun reads them back instead of running those chunks again, and the file is removed once
the result is saved. Columns are stored bit for bit, so a resumed pair ends with exactly the numbers of an
uninterrupted one.

The file (spec: docs/checkpoint-format.md) is append-only: a preamble, a HEAD record (what the pair measures), then
one CHNK record per chunk, each checksummed. A torn last record (a crash mid-write) is dropped on reading; a
checkpoint whose identity differs from the request is never resumed: the pair starts over and says why.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import zstandard

from qeval.errors import WriteFailed
from qeval.identity import changes, digest
from qeval.storage.store import append_durably, checksum

MAGIC = b"QEVALCKP"
VERSION = 1
SUFFIX = ".partial"  # not *.json: a checkpoint is never taken for a result (qeval.storage.results.find_results)

_PREAMBLE = struct.Struct("<8sI")
_RECORD = struct.Struct("<4sQ")
_CHECKSUM = struct.Struct("<Q")
_CHUNK_HEAD = struct.Struct("<II")
_MAX_PAYLOAD = 1 << 34  # a length beyond this is a torn or foreign file, not a chunk's columns


def checkpoint_path(results_dir: Path, cand_label: str, ref_label: str) -> Path:
    """Where the checkpoint of `cand_label` against `ref_label` lives: beside the result it becomes."""
    return Path(results_dir) / f"{cand_label}.vs.{ref_label}{SUFFIX}"


def _record(tag: bytes, payload: bytes) -> bytes:
    return _RECORD.pack(tag, len(payload)) + payload + _CHECKSUM.pack(checksum(payload))


def _chunk_payload(index: int, columns: dict[str, np.ndarray]) -> bytes:
    arrays = [np.ascontiguousarray(v) for v in columns.values()]
    n = len(arrays[0]) if arrays else 0
    if any(a.ndim != 1 or len(a) != n for a in arrays):
        raise ValueError(f"chunk {index}: per-token columns must be 1-D and of one length")
    head = json.dumps({"n": n, "columns": [[k, a.dtype.str] for k, a in zip(columns, arrays)]}).encode()
    raw = b"".join([_CHUNK_HEAD.pack(index, len(head)), head, *(a.tobytes() for a in arrays)])
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _chunk_columns(payload: bytes) -> tuple[int, dict[str, np.ndarray]]:
    raw = zstandard.ZstdDecompressor().decompress(payload)
    index, head_len = _CHUNK_HEAD.unpack_from(raw)
    head = json.loads(raw[_CHUNK_HEAD.size:_CHUNK_HEAD.size + head_len])
    offset, columns = _CHUNK_HEAD.size + head_len, {}
    for name, dtype in head["columns"]:
        dt = np.dtype(dtype)
        columns[name] = np.frombuffer(raw, dtype=dt, count=head["n"], offset=offset).copy()
        offset += dt.itemsize * head["n"]
    return index, columns


class _Held:
    """What a checkpoint file holds: its identity, its chunks' records (payloads, not decoded), where its header
    ends and where its valid data ends."""

    def __init__(self, identity: dict, chunks: list[bytes], head_end: int, end: int):
        self.identity, self.chunks, self.head_end, self.end = identity, chunks, head_end, end


def _read(path: Path) -> _Held | None:
    """The valid records of a checkpoint file, up to the first torn or corrupt one; None when there is no
    file, or it is not a checkpoint (no valid preamble and HEAD)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _PREAMBLE.size or _PREAMBLE.unpack_from(data) != (MAGIC, VERSION):
        return None
    offset, identity, chunks, head_end = _PREAMBLE.size, None, [], 0
    while offset + _RECORD.size <= len(data):
        tag, n = _RECORD.unpack_from(data, offset)
        start, stop = offset + _RECORD.size, offset + _RECORD.size + n
        if n > _MAX_PAYLOAD or stop + _CHECKSUM.size > len(data):
            break
        payload = data[start:stop]
        if _CHECKSUM.unpack_from(data, stop)[0] != checksum(payload):
            break
        if identity is None:
            if tag != b"HEAD":
                return None
            try:
                identity = json.loads(payload)["identity"]
            except (ValueError, KeyError, TypeError):
                return None
            head_end = stop + _CHECKSUM.size
        elif tag == b"CHNK":
            chunks.append(payload)
        else:
            break
        offset = stop + _CHECKSUM.size
    return None if identity is None else _Held(identity, chunks, head_end, offset)


def chunks_in(path: Path) -> int:
    """Chunks a checkpoint holds (0 when there is none): progress of a pair being run elsewhere (Ray)."""
    held = _read(Path(path))
    return len(held.chunks) if held is not None else 0


class Checkpoint:
    """The checkpoint of one pair, open for appending. `parts`: chunk index -> its per-token columns, in the
    order they were compared (resumed ones first); `resumed`: how many were read back; `note`: why a checkpoint
    found there was not resumed ("" when there was none, or it was)."""

    def __init__(self, path: Path, identity: dict):
        self.path, self.identity = Path(path), identity
        self.parts: dict[int, dict[str, np.ndarray]] = {}
        self.note = ""
        held = _read(self.path)
        if held is not None and digest(held.identity) == digest(identity):
            for payload in held.chunks:
                index, columns = _chunk_columns(payload)
                self.parts[index] = columns
            self._fh = self._open("r+b", 0)
            self._fh.truncate(held.end)  # drop a torn record after the last whole one
            self._fh.seek(held.end)
            self.head_bytes = held.head_end
        else:
            if held is not None:
                self.note = (f"its checkpoint answers another request ({'; '.join(changes(held.identity, identity))}, "
                             "saved vs now): started over")
            elif self.path.exists():
                self.note = "its checkpoint is unreadable: started over"
            head = _PREAMBLE.pack(MAGIC, VERSION) + _record(b"HEAD", json.dumps(
                {"identity": identity, "key": digest(identity)}, sort_keys=True).encode())
            self._fh = self._open("wb", len(head))
            try:
                self._write(head)
            except WriteFailed:
                self.close()
                raise
            self.head_bytes = len(head)
        self.resumed = len(self.parts)

    def _open(self, mode: str, size: int):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return open(self.path, mode)
        except OSError as exc:
            raise WriteFailed(f"cannot open {self.path} for writing ({exc.strerror or exc})", self.path, exc.errno,
                              size) from None

    @property
    def size(self) -> int:
        """Bytes the file holds: its header and every whole chunk."""
        return self._fh.tell()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of its chunks' records (without its header): what a pair writes per scored token, measured."""
        return self.size - self.head_bytes

    def append(self, index: int, columns: dict[str, np.ndarray]) -> None:
        """Add one chunk's per-token columns, durably (fsync'd) before returning. On a failed write (a full disk)
        the file is cut back to its last whole record and WriteFailed raised: every chunk before stays."""
        self._write(_record(b"CHNK", _chunk_payload(index, columns)))
        self.parts[index] = columns

    def _write(self, data: bytes) -> None:
        append_durably(self._fh, self.path, data, "it is intact up to its last whole chunk: free space and re-run the "
                       "same command to continue")

    def remove(self) -> None:
        """The pair's result is saved: its checkpoint is no longer needed."""
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
