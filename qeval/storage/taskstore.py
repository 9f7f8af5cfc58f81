"""Task stores: one model's per-choice log-likelihoods over a task set, as JSON lines.

    line 1      header: {"qeval_tasks": 1, "identity": {...}, "label", "task", "model", "settings", ...}
    lines 2…    one record per task: {"i": task index, "labels": [...], "sums": [...], "counts": [...],
                "llama": [...], "pred": answer}, in the order they were scored
    last line   {"complete": true, "n_items": N} once every selected task is stored

Every line carries "x", the XXH3-64 (hex) of its canonical JSON without "x" (sorted keys, no spaces),
and ends in a newline. Records are appended a batch at a time, so an interrupted capture resumes where
it stopped; an unterminated or unreadable last line (a torn write) is dropped when resuming, anywhere
else it is an error naming the line.

The identity (qeval.identity's way: content, not names) is the task set (format, sha256 of its bytes,
item count), the selection (llama-perplexity's --*-tasks limit), the model's content fingerprint, its
tokenizer and vocab size, the settings that can change a logit and the scoring version. A store is
resumed or reused only when its identity equals the request's; otherwise qeval names what differs and
stops, or with `replace` writes `<name>.replacing` and renames it over the old file once complete.

The answer to a task is decided on the "llama" scores (llama-perplexity's arithmetic, see
qeval.capture.taskscore): the first highest score, except Winogrande: choice 1 when its score is
greater than choice 2's, else choice 2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

from qeval import __version__
from qeval.errors import QevalError, StoreFormatError
from qeval.identity import changes

MAGIC_KEY = "qeval_tasks"
FORMAT_VERSION = 1
REPLACEMENT_SUFFIX = ".replacing"
STORE_SUFFIX = ".tasks.jsonl"
TASKS_SUBDIR = "tasks"  # RUNS_DIR/tasks/<task set>/<label>.tasks.jsonl
_MAX_CHOICES = 100
_MAX_ITEMS = 1 << 24


def choose(kind: str, scores) -> int:
    """The answer llama-perplexity gives for these per-choice scores."""
    if kind == "winogrande":
        return 0 if scores[0] > scores[1] else 1
    best = 0
    for j in range(1, len(scores)):
        if scores[j] > scores[best]:
            best = j
    return best


def margin(scores, pred: int) -> float:
    """Score of the answer minus the best other score (>= 0, but for a Winogrande tie)."""
    return float(scores[pred] - max(s for j, s in enumerate(scores) if j != pred))


def _canonical(d: dict) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _line(d: dict) -> bytes:
    body = _canonical(d)
    x = xxhash.xxh3_64_hexdigest(body.encode())
    return (_canonical({**d, "x": x}) + "\n").encode()


def make_record(kind: str, index: int, sums, counts, llama, labels) -> dict:
    llama = [float(v) for v in llama]
    return {"i": int(index), "labels": [int(v) for v in labels], "sums": [float(v) for v in sums],
            "counts": [int(v) for v in counts], "llama": llama, "pred": choose(kind, llama)}


class TaskStoreComplete(Exception):
    """The store at that path already holds the requested capture, complete."""


@dataclass
class TaskStore:
    path: Path
    header: dict
    records: dict  # task index -> record
    complete: bool
    good_bytes: int  # bytes up to the end of the last good line

    @property
    def identity(self) -> dict:
        return self.header["identity"]

    @property
    def kind(self) -> str:
        return self.identity["task"]["format"]

    @property
    def label(self) -> str:
        return self.header.get("label", "")

    @property
    def n_selected(self) -> int:
        return int(self.header["n_selected"])

    @classmethod
    def open(cls, path: str | os.PathLike, tolerate_torn_tail: bool = False) -> TaskStore:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise QevalError(f"cannot read task store {path}: {exc.strerror}") from None
        lines = data.split(b"\n")
        ends_clean = data.endswith(b"\n")
        if ends_clean:
            lines.pop()
        if not lines or not lines[0]:
            raise StoreFormatError(f"{path} line 1: empty; not a qeval task store")
        if len(lines) == 1 and not ends_clean:
            raise StoreFormatError(f"{path} line 1: the header is cut short; not a complete qeval task store")
        header = _parse(path, 1, lines[0], "header")
        _check_header(path, header)
        kind = header["identity"]["task"]["format"]
        n_items = header["identity"]["task"]["n_items"]
        records: dict[int, dict] = {}
        complete = False
        good = len(lines[0]) + 1
        for n, raw in enumerate(lines[1:], start=2):
            last = n == len(lines)
            torn = last and not ends_clean
            try:
                if torn:
                    raise StoreFormatError(f"{path} line {n}: the last record is cut short (an interrupted write)")
                if complete:
                    raise StoreFormatError(f"{path} line {n}: records follow the completion line")
                rec = _parse(path, n, raw, "record")
                if "complete" in rec:
                    if rec.get("complete") is not True or rec.get("n_items") != len(records) \
                            or len(records) != header["n_selected"]:
                        raise StoreFormatError(f"{path} line {n}: the completion line says {rec.get('n_items')} "
                                               f"tasks; {len(records)} are stored, {header['n_selected']} selected")
                    complete = True
                else:
                    _check_record(path, n, rec, kind, n_items)
                    if rec["i"] in records:
                        raise StoreFormatError(f"{path} line {n}: task {rec['i']} is stored twice")
                    records[rec["i"]] = rec
            except StoreFormatError:
                if last and tolerate_torn_tail and not complete:
                    break  # a torn or garbled last line: dropped, the capture resumes before it
                raise
            good += len(raw) + 1
        if len(records) > header["n_selected"]:
            raise StoreFormatError(f"{path}: {len(records)} tasks stored, only {header['n_selected']} selected")
        return cls(path, header, records, complete, good)


def _parse(path: Path, n: int, raw: bytes, what: str) -> dict:
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreFormatError(f"{path} line {n}: the {what} is not JSON ({exc})") from None
    if not isinstance(d, dict) or not isinstance(d.get("x"), str):
        raise StoreFormatError(f"{path} line {n}: the {what} is not a checksummed JSON object")
    x = d.pop("x")
    try:
        body = _canonical(d)
    except ValueError:
        raise StoreFormatError(f"{path} line {n}: the {what} holds a value JSON does not allow") from None
    if xxhash.xxh3_64_hexdigest(body.encode()) != x:
        raise StoreFormatError(f"{path} line {n}: checksum mismatch (the {what} was altered or damaged)")
    return d


def _check_header(path: Path, h: dict) -> None:
    where = f"{path} line 1"
    if h.get(MAGIC_KEY) != FORMAT_VERSION:
        raise StoreFormatError(f"{where}: not a qeval task store of format {FORMAT_VERSION} "
                               f"({MAGIC_KEY}={h.get(MAGIC_KEY)!r})")
    ident = h.get("identity")
    task = ident.get("task") if isinstance(ident, dict) else None
    if not isinstance(task, dict) or task.get("format") not in ("hellaswag", "winogrande", "mc"):
        raise StoreFormatError(f"{where}: the header's identity names no task format")
    n_items, n_sel = task.get("n_items"), h.get("n_selected")
    if not (isinstance(n_items, int) and 0 < n_items <= _MAX_ITEMS and isinstance(n_sel, int)
            and 0 < n_sel <= n_items):
        raise StoreFormatError(f"{where}: bad task counts (n_items {n_items!r}, n_selected {n_sel!r})")


def _check_record(path: Path, n: int, r: dict, kind: str, n_items: int) -> None:
    def bad(what: str) -> StoreFormatError:
        return StoreFormatError(f"{path} line {n}: {what}")

    i = r.get("i")
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_items:
        raise bad(f"task index {i!r} is not in 0..{n_items - 1}")
    labels, sums, counts, llama = (r.get(k) for k in ("labels", "sums", "counts", "llama"))
    if not isinstance(labels, list) or not 2 <= len(labels) <= _MAX_CHOICES:
        raise bad(f"task {i}: labels must be a list of 2 to {_MAX_CHOICES} values")
    k = len(labels)
    if kind == "winogrande" and k != 2 or kind == "hellaswag" and k != 4:
        raise bad(f"task {i}: {k} choices for a {kind} task")
    if any(v not in (0, 1) or isinstance(v, bool) for v in labels) or 1 not in labels:
        raise bad(f"task {i}: labels must be 0 or 1 with at least one 1")
    for name, values in (("sums", sums), ("llama", llama)):
        if not isinstance(values, list) or len(values) != k or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= 0
                for v in values):
            raise bad(f"task {i}: {name} must be {k} finite log-likelihoods (<= 0)")
    if not isinstance(counts, list) or len(counts) != k or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in counts):
        raise bad(f"task {i}: counts must be {k} token counts >= 1")
    if r.get("pred") != choose(kind, llama):
        raise bad(f"task {i}: the stored answer {r.get('pred')!r} is not the one its scores give")


def store_path(directory: Path, task_name: str, label: str) -> Path:
    """Where a runs directory keeps the task store of model `label` on task set `task_name`."""
    return directory / TASKS_SUBDIR / task_name / f"{label}{STORE_SUFFIX}"


def conflicts(old: dict, new: dict) -> list[str]:
    """What differs between two task-store identities ([] when they are the same capture)."""
    return changes(old, new)


class TaskStoreWriter:
    """Appends records to a task store; open() creates, resumes or (replace=True) replaces one."""

    def __init__(self, path: Path, final: Path, fh, done: set[int], header: dict):
        self.path, self.final, self._fh, self.done, self.header = path, final, fh, done, header
        self.n_written = 0

    @classmethod
    def open(cls, path: str | os.PathLike, header: dict, replace: bool = False) -> TaskStoreWriter:
        """header: identity, n_selected, and what else describes the capture; raises TaskStoreComplete
        when the store holds this capture complete already."""
        final = Path(path)
        header = {MAGIC_KEY: FORMAT_VERSION, "qeval_version": __version__, **header}
        target = final
        if final.exists():
            try:
                old = TaskStore.open(final, tolerate_torn_tail=True)
                why = conflicts(old.identity, header["identity"])
            except QevalError as exc:
                old, why = None, [f"it is not a readable task store ({exc})"]
            if not why:
                if old.complete:
                    raise TaskStoreComplete(str(final))
                return cls._resume(final, final, old, header)
            if not replace:
                raise QevalError(f"{final} holds another capture: {'; '.join(why)}. Use --force to replace it "
                                 "(the old file is kept until the new one is complete)")
            target = final.with_name(final.name + REPLACEMENT_SUFFIX)
            if target.exists():
                try:
                    part = TaskStore.open(target, tolerate_torn_tail=True)
                    if not conflicts(part.identity, header["identity"]) and not part.complete:
                        return cls._resume(target, final, part, header)
                except QevalError:
                    pass
        target.parent.mkdir(parents=True, exist_ok=True)
        fh = open(target, "wb")
        fh.write(_line(header))
        _sync(fh)
        return cls(target, final, fh, set(), header)

    @classmethod
    def _resume(cls, target: Path, final: Path, old: TaskStore, header: dict) -> TaskStoreWriter:
        fh = open(target, "r+b")
        fh.truncate(old.good_bytes)  # drop a torn tail
        fh.seek(old.good_bytes)
        return cls(target, final, fh, set(old.records), old.header)

    def write(self, records: list[dict]) -> None:
        """Append records (one batch) in one write, then flush them to disk."""
        fresh = [r for r in records if r["i"] not in self.done]
        if not fresh:
            return
        self._fh.write(b"".join(_line(r) for r in fresh))
        _sync(self._fh)
        self.done.update(r["i"] for r in fresh)
        self.n_written += len(fresh)

    def finish(self) -> Path:
        n = len(self.done)
        if n != self.header["n_selected"]:
            raise QevalError(f"{self.path}: {n} of {self.header['n_selected']} tasks stored; cannot finish")
        self._fh.write(_line({"complete": True, "n_items": n}))
        _sync(self._fh)
        self._fh.close()
        if self.path != self.final:
            os.replace(self.path, self.final)
        return self.final

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _sync(fh) -> None:
    fh.flush()
    os.fsync(fh.fileno())
