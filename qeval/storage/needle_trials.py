"""The needle trials of one row, kept in a runs directory so that `qeval needle` resumes and extends (docs/needles.md).

A row is one model run (model, KV cache, batch sizes, build) scored against the f16 reference over one trial design
(needles, corpus, depths, seed, jitter, n_ctx); the reference's own row is the reference scored against itself.
Its identity (qeval.identity.needle_row_identity) names its file:

    <runs dir>/needles/<first 16 hex digits of the identity's digest>.jsonl

UTF-8 JSON lines, each ending in a newline:

    line 1     {"format": "qeval-needle-trials", "version": 1, "identity": {...}, "kv_allocated": {...}}
    then       {"trial": T, "seconds": S, "forward_tokens": N, "answers": [ANSWER, ...]}   one per trial, any order

ANSWER holds a planted needle's depth (percent) and its scores, the fields of qeval.compare.needle_scores.AnswerScore
(passed in as `answer_fields`, name -> float, int or bool): {"depth", "kld", "ref_logprob", "cand_logprob",
"same_top1", "tokens", "flip", "ref_correct", "cand_correct"}. `seconds` and
`forward_tokens` are this row's model's decode time and tokens in that trial. Trial T is the trial that
default_rng([seed, T]) plants (qeval.inputs.needles), whatever the number of trials asked for, so a run of more
trials reuses the ones recorded and decodes only the rest.

A line is appended, flushed and fsynced once its trial is scored. The reader trusts nothing: a header of another
identity, a line that is no such record, or a trial recorded twice is refused with the file's name; only a last
line without its newline (a run killed while writing it) is dropped, and its trial run again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qeval.errors import QevalError
from qeval.identity import digest
from qeval.storage.store import append_durably

FORMAT = "qeval-needle-trials"
VERSION = 1
SUBDIR = "needles"


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    trial: int
    seconds: float
    forward_tokens: int
    answers: tuple[dict, ...]  # per planted needle: {"depth", and its scores}

    def to_json(self) -> dict:
        return {"trial": self.trial, "seconds": self.seconds, "forward_tokens": self.forward_tokens,
                "answers": list(self.answers)}

    @classmethod
    def from_json(cls, row: object, answer_fields: dict[str, type]) -> TrialRecord:
        """A record read from disk: every field present and of its type, or ValueError."""
        if not isinstance(row, dict) or set(row) != {"trial", "seconds", "forward_tokens", "answers"}:
            raise ValueError("not a trial record")
        trial, seconds, tokens, answers = row["trial"], row["seconds"], row["forward_tokens"], row["answers"]
        if not (_is(trial, int) and trial >= 0 and _is(seconds, float) and _is(tokens, int)
                and isinstance(answers, list) and answers):
            raise ValueError("a trial record's trial, seconds, forward_tokens or answers is malformed")
        schema = {"depth": float, **answer_fields}
        for answer in answers:
            if not isinstance(answer, dict) or set(answer) != set(schema):
                raise ValueError("an answer lacks a field, or holds one too many")
            if not all(_is(answer[name], kind) for name, kind in schema.items()):
                raise ValueError("an answer's field has the wrong type")
        return cls(trial=trial, seconds=float(seconds), forward_tokens=tokens, answers=tuple(answers))


def _is(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def trials_path(directory: Path, identity: dict) -> Path:
    return directory / SUBDIR / f"{digest(identity)[:16]}.jsonl"


class NeedleTrials:
    """The recorded trials of one row (`recorded`: trial -> TrialRecord), its file open for appending."""

    def __init__(self, path: Path, identity: dict, answer_fields: dict[str, type]):
        self.path, self.identity = path, json.loads(json.dumps(identity))  # as read back: lists, not tuples
        self.answer_fields = answer_fields
        self.kv_allocated: dict | None = None
        self.recorded: dict[int, TrialRecord] = {}
        if path.exists():
            self._read()
        self.read_back = set(self.recorded)  # the trials an earlier run recorded

    def _read(self) -> None:
        raw = self.path.read_bytes()
        whole = raw[:raw.rfind(b"\n") + 1]  # a torn last line (a run killed while writing it) is dropped
        lines = whole.decode("utf-8", "replace").splitlines()
        if lines:
            self._check_header(lines[0])
        elif not _header_bytes({}).startswith(raw[:len(_header_bytes({})) - 2]):  # not even a torn header of ours
            raise QevalError(f"{self.path} is no qeval needle-trials file: move it away")
        for number, line in enumerate(lines[1:], 2):
            try:
                record = TrialRecord.from_json(json.loads(line), self.answer_fields)
            except (json.JSONDecodeError, ValueError) as exc:
                raise QevalError(f"{self.path} line {number} is no trial record ({exc}): move the file away to "
                                 "measure the row again") from None
            if record.trial in self.recorded:
                raise QevalError(f"{self.path} records trial {record.trial} twice (line {number})")
            self.recorded[record.trial] = record
        if len(whole) < len(raw):
            with self.path.open("r+b") as fh:
                fh.truncate(len(whole))

    def _check_header(self, line: str) -> None:
        try:
            head = json.loads(line)
        except json.JSONDecodeError:
            head = None
        if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
            raise QevalError(f"{self.path} is no qeval needle-trials file of version {VERSION}: move it away")
        if head.get("identity") != self.identity:
            raise QevalError(f"{self.path} records trials of another row than its name says (edited or copied "
                             "by hand?): move it away to measure the row again")
        self.kv_allocated = head.get("kv_allocated")

    def start(self, kv_allocated: dict) -> None:
        """Before a trial is appended: the header of a new file, or a check that the cache llama.cpp allocated now is
        the one the recorded trials ran with."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append_bytes(_header_bytes({"identity": self.identity, "kv_allocated": kv_allocated}))
            self.kv_allocated = kv_allocated
        elif kv_allocated != self.kv_allocated:
            raise QevalError(f"llama.cpp allocated the KV cache {kv_allocated} where the trials of {self.path} ran "
                             f"with {self.kv_allocated}: move the file away to measure the row again")

    def append(self, record: TrialRecord) -> None:
        self._append_bytes((json.dumps(record.to_json()) + "\n").encode())
        self.recorded[record.trial] = record

    def _append_bytes(self, line: bytes) -> None:
        with self.path.open("ab") as fh:
            append_durably(fh, self.path, line, "its trials before this one are kept: free space and run the same "
                           "command to continue")


def _header_bytes(fields: dict) -> bytes:
    """The first line: format and version first, so that even a torn one is known as this format's."""
    return (json.dumps({"format": FORMAT, "version": VERSION, **fields}) + "\n").encode()
