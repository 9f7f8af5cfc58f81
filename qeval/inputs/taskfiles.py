"""Task sets for accuracy and answer flips: llama-perplexity's three task-file formats, or 🤗 datasets.

Formats, read the way llama.cpp's tools/perplexity/perplexity.cpp reads them (its `-f` option drops
one trailing newline of the file first):

  hellaswag   text, 6 lines per task (hellaswag_score): the context ("activity label: context"), the
              index of the gold ending (0-3), then the 4 endings. A choice is context + " " + ending.
  winogrande  CSV (load_winogrande_from_csv): index,sentence,option1,option2,answer with answer 1 or 2
              and one "_" in the sentence; commas inside double quotes do not separate fields, a quoted
              sentence loses its first and last character (nothing is unescaped), options are taken as
              they stand. A choice is the text before "_" + option + the text after it.
  mc          llama.cpp's binary multiple-choice format (multiple_choice_task::deserialize): u32 task
              count, u32 byte offset of every task, then per task a string (the question) and two answer
              sets mc1, mc2; a string is u32 length + bytes, an answer set is u32 n (at most 100), n
              strings and n int32 labels (1 = correct). Only mc1 is scored, as llama-perplexity does.
              A choice is question + " " + answer.

Where llama-perplexity skips a line it cannot read (and prints an error), qeval stops with one
QevalError naming the file, the line (or byte offset) and what is wrong; blank lines and a CSV header
line are the only lines skipped. One difference on purpose: llama-perplexity's CSV loop ends at the
end-of-file of the last line, so it never scores the last row of a Winogrande file (its `-f` strips
the file's final newline, which leaves that row unterminated); qeval scores every row.

`hf:DATASET[/CONFIG][:SPLIT]` (DATASET: a name or owner/name) loads a task set with the `datasets` library (split default
`validation`): HellaSwag rows (activity_label, ctx_a, ctx_b, endings, label) preprocessed as the
lm-evaluation-harness does (what llama.cpp's HellaSwag file was made with), Winogrande rows (sentence,
option1, option2, answer), and multiple-choice rows (question with choices + answer index or
answerKey, as ARC; or mc1_targets, as TruthfulQA).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from qeval.errors import QevalError

FORMATS = ("hellaswag", "winogrande", "mc")
HELLASWAG_ENDINGS = 4
MC_MAX_ANSWERS = 100  # multiple_choice_answers::deserialize refuses more
_MAX_TASKS = 1 << 24  # sanity bound for a count read from a binary file


class TaskFileError(QevalError):
    """A task file or task dataset is malformed."""


@dataclass(frozen=True)
class TaskItem:
    """One task: a context and its choices, of which those labelled 1 are correct.

    hellaswag: context is the context line, choices the endings. mc: context is the question.
    winogrande: context is the text before the blank, suffix the text after it, choices the options.
    """

    index: int  # position in the task set, 0-based, in file order
    context: str
    choices: tuple[str, ...]
    labels: tuple[int, ...]  # 1 = correct
    suffix: str = ""
    where: str = ""  # "line 7" or "byte 1234": where the task starts, for messages

    @property
    def gold(self) -> int:
        """The first correct choice."""
        return self.labels.index(1)

    def texts(self, kind: str) -> list[str]:
        """The text llama-perplexity tokenizes for every choice."""
        if kind == "winogrande":
            return [self.context + c + self.suffix for c in self.choices]
        return [self.context + " " + c for c in self.choices]

    def to_json(self) -> dict:
        return {"context": self.context, "choices": list(self.choices), "labels": list(self.labels),
                "suffix": self.suffix}


@dataclass(frozen=True)
class TaskSet:
    name: str  # short name (the file stem or the dataset), used for the store's folder
    source: str  # the path or hf: spec it was read from
    kind: str  # one of FORMATS
    sha256: str  # of the file's bytes, or of the items' canonical JSON for a dataset
    items: tuple[TaskItem, ...]

    def identity(self) -> dict:
        """What the task set is, whatever its file is called."""
        return {"format": self.kind, "sha256": self.sha256, "n_items": len(self.items)}

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, **self.identity()}


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------
def load_tasks(spec: str, kind: str | None = None, hf_loader: Callable | None = None) -> TaskSet:
    """A task file (format from `kind`, else guessed from its name and bytes) or hf:DATASET[/CONFIG][:SPLIT]."""
    if kind is not None and kind not in FORMATS:
        raise QevalError(f"--format must be one of {', '.join(FORMATS)}, not {kind!r}")
    if spec.startswith("hf:"):
        return load_hf_tasks(spec, kind, loader=hf_loader)
    path = Path(spec)
    if not path.is_file():
        raise QevalError(f"task file {spec} does not exist (give a file or hf:DATASET[/CONFIG][:SPLIT])")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QevalError(f"cannot read task file {path}: {exc.strerror}") from None
    kind = kind or guess_format(path, data)
    reader = {"hellaswag": parse_hellaswag, "winogrande": parse_winogrande, "mc": parse_mc}[kind]
    items = reader(data, str(path))
    return TaskSet(name=_name(path.stem), source=str(path), kind=kind, sha256=hashlib.sha256(data).hexdigest(),
                   items=tuple(items))


def guess_format(path: Path, data: bytes) -> str:
    if path.suffix.lower() == ".csv":
        return "winogrande"
    if b"\0" in data[:4096] or path.suffix.lower() == ".bin":
        return "mc"
    return "hellaswag"


def _name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.") or "tasks"
    return name if name[0].isalnum() else "t" + name


def _text(data: bytes, path: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise TaskFileError(f"{path} line {line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return text.removesuffix("\n")  # llama.cpp's -f drops one final newline


def _lines(text: str) -> list[str]:
    """std::getline over the text: split at '\\n', no empty line after a final newline."""
    if not text:
        return []
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines


# --------------------------------------------------------------------------------------------------
# HellaSwag text
# --------------------------------------------------------------------------------------------------
def parse_hellaswag(data: bytes, path: str = "<hellaswag>") -> list[TaskItem]:
    lines = _lines(_text(data, path))
    per = 2 + HELLASWAG_ENDINGS
    if not lines:
        raise TaskFileError(f"{path}: no tasks (a HellaSwag file has {per} lines per task: context, gold "
                            "ending index, 4 endings)")
    if len(lines) % per:
        last = len(lines) - len(lines) % per
        raise TaskFileError(f"{path}: {len(lines)} lines is not a multiple of {per} (context, gold ending index, "
                            f"4 endings per task): the task at line {last + 1} has only {len(lines) % per} lines")
    items = []
    for k in range(len(lines) // per):
        at = k * per
        context, gold, endings = lines[at], lines[at + 1], lines[at + 2:at + per]
        if not context.strip():
            raise TaskFileError(f"{path} line {at + 1}: the context of task {k} is empty")
        g = gold.strip()
        if not g.isdigit() or not 0 <= int(g) < HELLASWAG_ENDINGS:
            raise TaskFileError(f"{path} line {at + 2}: the gold ending index of task {k} must be 0, 1, 2 or 3, "
                                f"not {gold!r} (are lines missing or extra above it?)")
        for j, ending in enumerate(endings):
            if not ending.strip():
                raise TaskFileError(f"{path} line {at + 3 + j}: ending {j} of task {k} is empty")
        labels = tuple(int(j == int(g)) for j in range(HELLASWAG_ENDINGS))
        items.append(TaskItem(index=k, context=context, choices=tuple(endings), labels=labels, where=f"line {at + 1}"))
    return items


# --------------------------------------------------------------------------------------------------
# Winogrande CSV
# --------------------------------------------------------------------------------------------------
_CSV_HEADER = re.compile(r"[A-Za-z]")
_INT_PREFIX = re.compile(r"\s*([+-]?\d+)")


def _comma_positions(line: str) -> list[int]:
    """The first 4 commas outside double quotes, as load_winogrande_from_csv finds them."""
    out, quoted = [], False
    for i, ch in enumerate(line):
        if quoted:
            quoted = ch != '"'
        elif ch == ",":
            out.append(i)
            if len(out) == 4:
                break
        elif ch == '"':
            quoted = True
    return out


def parse_winogrande(data: bytes, path: str = "<winogrande>") -> list[TaskItem]:
    items = []
    for n, line in enumerate(_lines(_text(data, path)), start=1):
        if not line.strip():
            continue
        commas = _comma_positions(line)
        if len(commas) != 4:
            raise TaskFileError(f"{path} line {n}: expected 5 comma-separated fields (index,sentence,option1,"
                                f"option2,answer), found {len(commas) + 1}")
        c0, c1, c2, c3 = commas
        sentence = line[c0 + 2:c1 - 1] if line[c0 + 1:c0 + 2] == '"' else line[c0 + 1:c1]
        choices = (line[c1 + 1:c2], line[c2 + 1:c3])
        answer = line[c3 + 1:]
        m = _INT_PREFIX.match(answer)  # as `istringstream >> int`: leading blanks, digits, anything after
        if m is None or int(m.group(1)) not in (1, 2):
            if not items and n == 1 and _CSV_HEADER.search(answer):
                continue  # a header line (llama-perplexity skips it too)
            raise TaskFileError(f"{path} line {n}: the answer must be 1 or 2, not {answer!r}")
        where = sentence.find("_")
        if where < 0:
            raise TaskFileError(f"{path} line {n}: the sentence has no '_' to put the options in: {sentence!r}")
        for j, choice in enumerate(choices):
            if not choice.strip():
                raise TaskFileError(f"{path} line {n}: option{j + 1} is empty")
        labels = (1, 0) if int(m.group(1)) == 1 else (0, 1)
        items.append(TaskItem(index=len(items), context=sentence[:where], choices=choices, labels=labels,
                              suffix=sentence[where + 1:],
                              where=f"line {n}"))
    if not items:
        raise TaskFileError(f"{path}: no tasks (a Winogrande CSV has rows index,sentence,option1,option2,answer)")
    return items


# --------------------------------------------------------------------------------------------------
# llama.cpp's binary multiple-choice format
# --------------------------------------------------------------------------------------------------
class _Cursor:
    def __init__(self, data: bytes, path: str):
        self.data, self.path, self.at = data, path, 0

    def fail(self, what: str, at: int | None = None) -> TaskFileError:
        return TaskFileError(f"{self.path} byte {self.at if at is None else at}: {what}")

    def u32(self, what: str) -> int:
        if self.at + 4 > len(self.data):
            raise self.fail(f"file ends inside {what} ({len(self.data)} bytes in all)")
        (value,) = struct.unpack_from("<I", self.data, self.at)
        self.at += 4
        return value

    def string(self, what: str) -> str:
        start = self.at
        size = self.u32(f"the length of {what}")
        if self.at + size > len(self.data):
            raise self.fail(f"{what} is {size} bytes long but the file ends {len(self.data) - self.at} bytes "
                            "later", start)
        raw = self.data[self.at:self.at + size]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 ({exc.reason})", self.at + exc.start) from None
        self.at += size
        return text

    def answers(self, what: str) -> tuple[list[str], list[int]]:
        start = self.at
        n = self.u32(f"the answer count of {what}")
        if n > MC_MAX_ANSWERS:
            raise self.fail(f"{what} has {n} answers; llama.cpp reads at most {MC_MAX_ANSWERS}", start)
        answers = [self.string(f"answer {j} of {what}") for j in range(n)]
        if self.at + 4 * n > len(self.data):
            raise self.fail(f"file ends inside the {n} labels of {what}")
        labels = list(struct.unpack_from(f"<{n}i", self.data, self.at))
        self.at += 4 * n
        return answers, labels


def parse_mc(data: bytes, path: str = "<mc>") -> list[TaskItem]:
    cur = _Cursor(data, path)
    n_task = cur.u32("the task count")
    if n_task == 0:
        raise cur.fail("the task count is 0", 0)
    if n_task > _MAX_TASKS or 4 + 4 * n_task > len(data):
        raise cur.fail(f"the task count {n_task} needs a {4 * n_task}-byte offset table; the file has "
                       f"{len(data)} bytes (not llama.cpp's multiple-choice format?)", 0)
    offsets = [cur.u32(f"the offset of task {i}") for i in range(n_task)]
    items = []
    for i in range(n_task):
        start = cur.at
        if offsets[i] != start:
            raise cur.fail(f"the offset table says task {i} starts at byte {offsets[i]}, but it starts here "
                           "(llama-perplexity seeks there for --multiple-choice-tasks)")
        question = cur.string(f"the question of task {i}")
        answers, labels = cur.answers(f"task {i}'s mc1")
        cur.answers(f"task {i}'s mc2")  # read and checked, not scored (as llama-perplexity)
        if not question:
            raise cur.fail(f"task {i} has an empty question (llama-perplexity refuses it)", start)
        if not answers:
            raise cur.fail(f"task {i} has no mc1 answers", start)
        for j, a in enumerate(answers):
            if not a:
                raise cur.fail(f"answer {j} of task {i} is empty (llama-perplexity refuses it)", start)
        if any(v not in (0, 1) for v in labels) or 1 not in labels:
            raise cur.fail(f"task {i}'s mc1 labels must be 0 or 1 with at least one 1, not {labels}", start)
        items.append(TaskItem(index=i, context=question, choices=tuple(answers), labels=tuple(labels),
                              where=f"byte {start}"))
    if cur.at != len(data):
        raise cur.fail(f"{len(data) - cur.at} bytes follow the last of the {n_task} tasks")
    return items


def _pack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def _pack_answers(answers: Sequence[str], labels: Sequence[int]) -> bytes:
    return (struct.pack("<I", len(answers)) + b"".join(_pack_string(a) for a in answers)
            + struct.pack(f"<{len(labels)}i", *labels))


def mc_bytes(tasks: Sequence[tuple[str, Sequence[str], Sequence[int]]]) -> bytes:
    """llama.cpp's binary multiple-choice format for (question, answers, labels) tasks (mc2 left empty)."""
    bodies = [_pack_string(q) + _pack_answers(a, lab) + _pack_answers([], []) for q, a, lab in tasks]
    at = 4 + 4 * len(bodies)
    offsets = []
    for body in bodies:
        offsets.append(at)
        at += len(body)
    return struct.pack(f"<I{len(bodies)}I", len(bodies), *offsets) + b"".join(bodies)


# --------------------------------------------------------------------------------------------------
# 🤗 datasets
# --------------------------------------------------------------------------------------------------
def parse_task_spec(spec: str) -> tuple[str, str | None, str]:
    """hf:DATASET[:SPLIT] or hf:OWNER/NAME/CONFIG[:SPLIT] -> (dataset, config, split); DATASET is a name or
    OWNER/NAME (hf:Rowan/hellaswag, hf:allenai/winogrande/winogrande_xl:validation)."""
    body = spec[3:]
    if "#" in body:
        raise QevalError(f"bad task dataset spec {spec!r}: expected hf:DATASET[/CONFIG][:SPLIT] (no #column)")
    body, _, split = body.partition(":")
    parts = body.split("/")
    if not parts[0] or any(not p for p in parts) or len(parts) > 3:
        raise QevalError(f"bad task dataset spec {spec!r}: expected hf:DATASET[/CONFIG][:SPLIT] with DATASET "
                         "a name or owner/name")
    if len(parts) == 3:  # owner/name/config
        return "/".join(parts[:2]), parts[2], split or "validation"
    return body, None, split or "validation"  # name, or owner/name


def load_hf_tasks(spec: str, kind: str | None = None, loader: Callable | None = None) -> TaskSet:
    dataset, config, split = parse_task_spec(spec)
    lowered = dataset.lower()
    kind = kind or ("hellaswag" if "hellaswag" in lowered else "winogrande" if "winogrande" in lowered else None)
    if kind is None:
        raise QevalError(f"give --format hellaswag, winogrande or mc for {spec} (not guessed from its name)")
    if loader is None:
        from datasets import load_dataset as loader
    try:
        rows = loader(dataset, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (connection, missing config, ...)
        raise QevalError(f"could not load hub dataset {dataset}{'/' + config if config else ''} split {split}: "
                         f"{type(exc).__name__}: {exc}. Without network access, pass a local task file") from None
    convert = {"hellaswag": _hf_hellaswag, "winogrande": _hf_winogrande, "mc": _hf_mc}[kind]
    items = []
    for i, row in enumerate(rows):
        try:
            context, choices, labels, suffix = convert(row)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TaskFileError(f"{spec} row {i}: not a {kind} row ({type(exc).__name__}: {exc}); "
                                f"its columns: {', '.join(sorted(row)) if isinstance(row, dict) else type(row)}") from None
        if not choices or any(not str(c).strip() for c in choices) or 1 not in labels:
            raise TaskFileError(f"{spec} row {i}: a {kind} task needs non-empty choices and a correct one")
        items.append(TaskItem(index=i, context=context, choices=tuple(choices), labels=tuple(labels), suffix=suffix,
                              where=f"row {i}"))
    if not items:
        raise TaskFileError(f"{spec}: no rows")
    canonical = json.dumps([it.to_json() for it in items], sort_keys=True, ensure_ascii=False).encode()
    name = _name(dataset.split("/")[-1] + (f"-{config}" if config else "") + f"-{split}")
    return TaskSet(name=name, source=spec, kind=kind, sha256=hashlib.sha256(canonical).hexdigest(), items=tuple(items))


def _lm_eval_preprocess(text: str) -> str:
    """lm-evaluation-harness hellaswag.py preprocess (llama.cpp's HellaSwag file was made with it)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hf_hellaswag(row: dict):
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    endings = [_lm_eval_preprocess(e) for e in row["endings"]]
    if len(endings) != HELLASWAG_ENDINGS:
        raise ValueError(f"{len(endings)} endings, not {HELLASWAG_ENDINGS}")
    label = str(row["label"]).strip()
    if not label.isdigit() or int(label) >= len(endings):
        raise ValueError(f"label {row['label']!r} is not an ending index (an unlabelled test split?)")
    return (_lm_eval_preprocess(row["activity_label"] + ": " + ctx), endings,
            [int(j == int(label)) for j in range(len(endings))], "")


def _hf_winogrande(row: dict):
    sentence, answer = row["sentence"], str(row["answer"]).strip()
    if "_" not in sentence:
        raise ValueError("the sentence has no '_'")
    if answer not in ("1", "2"):
        raise ValueError(f"answer {row['answer']!r} is not 1 or 2 (an unlabelled test split?)")
    where = sentence.index("_")
    return sentence[:where], [row["option1"], row["option2"]], [1, 0] if answer == "1" else [0, 1], \
        sentence[where + 1:]


def _hf_mc(row: dict):
    if "mc1_targets" in row:  # TruthfulQA multiple_choice
        t = row["mc1_targets"]
        return row["question"], list(t["choices"]), [int(v) for v in t["labels"]], ""
    choices = row["choices"]
    if isinstance(choices, dict):  # ARC: {"text": [...], "label": ["A", ...]} + answerKey
        texts, keys = list(choices["text"]), [str(k) for k in choices["label"]]
        key = str(row["answerKey"])
        if key not in keys:
            raise ValueError(f"answerKey {key!r} is none of {keys}")
        return row["question"], texts, [int(k == key) for k in keys], ""
    answer = row["answer"] if "answer" in row else row["label"]
    answer = int(answer)
    if not 0 <= answer < len(choices):
        raise ValueError(f"answer {answer} is not a choice index")
    return row["question"], list(choices), [int(j == answer) for j in range(len(choices))], ""
