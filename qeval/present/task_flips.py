"""Task flips beside a KLD comparison: the columns the matrix and the leaderboard show per task set.

A saved comparison (qeval.present.results) names its candidate and reference by label; their task stores
live in the same runs directory (RUNS_DIR/tasks/<task set>/<label>.tasks.jsonl, qeval.storage.taskstore).
For every task set that holds a store of both labels, the flips between them (qeval.compare.flips) become
row figures `<key>@<task set>`. A store is used only when it holds the same model (content fingerprint)
with the same KV cache settings as the comparison measured; a store under that label with anything else
is refused with a message, never shown beside a KLD it does not belong to.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from qeval.compare import flips as flipmath
from qeval.compare.summary import ComparisonSummary
from qeval.engine.engine import recorded_kv
from qeval.errors import MismatchError
from qeval.identity import changes
from qeval.storage.results import runs_dir_of
from qeval.storage.taskstore import STORE_SUFFIX, TASKS_SUBDIR, TaskStore


@dataclass(frozen=True)
class FlipFigures:
    """What a board row shows of one task set: compare.flips.between's figures and both accuracies."""

    flips_pct: float
    flips: int
    correct_to_wrong: int
    wrong_to_correct: int
    mcnemar_p: float
    n_tasks: int
    accuracy_pct: float  # the candidate's
    ref_accuracy_pct: float  # the reference's

    @classmethod
    def of(cls, between: dict) -> "FlipFigures":
        """From compare.flips.between(reference's store, candidate's store)."""
        own = {f.name: between[f.name] for f in fields(cls) if f.name in between}
        return cls(**own, accuracy_pct=between["candidate"]["accuracy_pct"],
                   ref_accuracy_pct=between["reference"]["accuracy_pct"])

    def to_json(self) -> dict:
        return asdict(self)

    def cell(self) -> str:
        return f"{self.flips_pct:.2f} ({self.correct_to_wrong}↓ {self.wrong_to_correct}↑, p {self.mcnemar_p:.2g})"


ROW_KEYS = tuple(f.name for f in fields(FlipFigures))


def row_key(key: str, task: str) -> str:
    """A written column (CSV, JSON) of one figure of one task set."""
    return f"{key}@{task}"


def tasks_root(result_path: Path) -> Path:
    """The task folder of the runs directory a saved result lies in (RUNS_DIR/results/X.vs.Y.json)."""
    return runs_dir_of(result_path) / TASKS_SUBDIR


def _check_measured(store: TaskStore, measured: dict, role: str, origin: str) -> None:
    """Refuse a task store whose model or KV settings are not those of the comparison's `role` side."""
    # a task store keeps the rotation llama.cpp applied beside its settings (identity "numerics"), as a store's kv
    rotation = (store.identity.get("numerics") or {}).get("kv_rotation")
    held = {"model": store.identity.get("model"),
            "kv": recorded_kv(store.identity["settings"].get("kv") or {}, rotation)}
    wanted = {"model": measured.get("model"), "kv": measured.get("kv")}
    diffs = changes(held, wanted)
    if diffs:
        raise MismatchError(
            f"task store {store.path} has the {role}'s label {store.label!r} but not what {origin} measured "
            f"({'; '.join(diffs)}, task store vs comparison): recapture it with the same model and -ctk/-ctv/-fa "
            "(qeval tasks capture ... --force, or qeval matrix --task), or move it out of the runs directory")


def _read(path: Path) -> TaskStore:
    """A task store, parsed once per content (every row of a board shares the reference's)."""
    stat = path.stat()
    return _read_version(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _read_version(path: str, mtime_ns: int, size: int) -> TaskStore:
    return TaskStore.open(path)


def task_flips(summary: ComparisonSummary, root: Path, origin: str = "the comparison", bins: int = 4,
               names: set[str] | None = None) -> dict[str, dict]:
    """task set -> compare.flips.between(reference's store, candidate's store), for every task set under `root`
    (of `names` only, when given) holding a store of both labels of comparison `summary` (with its request)."""
    request = summary.request or {}
    ref_label, cand_label = summary.reference.label, summary.candidate.label
    out = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (names is None or p.name in names)) \
            if root.is_dir() else []:
        ref_path, cand_path = (folder / f"{label}{STORE_SUFFIX}" for label in (ref_label, cand_label))
        if not (ref_path.is_file() and cand_path.is_file()):
            continue
        ref, cand = _read(ref_path), _read(cand_path)
        _check_measured(ref, request.get("reference") or {}, "reference", origin)
        _check_measured(cand, request.get("candidate") or {}, "candidate", origin)
        out[folder.name] = flipmath.between(ref, cand, bins)
    return out


def flip_figures(summary: ComparisonSummary, root: Path, origin: str = "the comparison",
                 names: set[str] | None = None) -> dict[str, FlipFigures]:
    """task set -> FlipFigures of task_flips(summary, root, origin, names=names)."""
    return {task: FlipFigures.of(r) for task, r in task_flips(summary, root, origin, names=names).items()}


def columns(tasks: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(heading, row key) of the flips columns."""
    return tuple((f"flips % ({task}), McNemar p", row_key("flips_pct", task)) for task in tasks)


def keys(tasks: tuple[str, ...]) -> tuple[str, ...]:
    """Every row key of the flips of `tasks` (CSV and JSON columns)."""
    return tuple(row_key(k, t) for t in tasks for k in ROW_KEYS)


NOTE = ("flips % (task): share of the task set's items whose answer went correct→wrong (↓) or wrong→correct (↑) "
        "against the reference's answer, scored as llama-perplexity scores tasks; p: exact two-sided McNemar test "
        "of ↓ vs ↑ (is the accuracy change more than chance?).")
