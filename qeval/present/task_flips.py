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
from pathlib import Path

from qeval.compare import flips as flipmath
from qeval.errors import MismatchError
from qeval.identity import changes
from qeval.storage.taskstore import STORE_SUFFIX, TASKS_SUBDIR, TaskStore

# the figures of compare.flips.flips that a row carries, per task set, as `<key>@<task set>`
FLIP_FIGURES = ("flips_pct", "flips", "correct_to_wrong", "wrong_to_correct", "mcnemar_p", "n_tasks")
ROW_KEYS = (*FLIP_FIGURES, "accuracy_pct", "ref_accuracy_pct")  # accuracies: the candidate's, the reference's


def row_key(key: str, task: str) -> str:
    return f"{key}@{task}"


def tasks_root(result_path: Path) -> Path:
    """The task folder of the runs directory a saved result lies in (RUNS_DIR/results/X.vs.Y.json)."""
    folder = result_path.parent
    return (folder.parent if folder.name == "results" else folder) / TASKS_SUBDIR


def _check_measured(store: TaskStore, measured: dict, role: str, origin: str) -> None:
    """Refuse a task store whose model or KV settings are not those of the comparison's `role` side."""
    held = {"model": store.identity.get("model"), "kv": store.identity["settings"].get("kv")}
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


def task_flips(summary: dict, root: Path, origin: str = "the comparison", bins: int = 4,
               names: set[str] | None = None) -> dict[str, dict]:
    """task set -> compare.flips.between(reference's store, candidate's store), for every task set under `root`
    (of `names` only, when given) holding a store of both labels of comparison `summary` (its JSON, with its
    request)."""
    request = summary.get("request") or {}
    ref_label, cand_label = summary["reference"]["label"], summary["candidate"]["label"]
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


def row_figures(by_task: dict[str, dict]) -> dict:
    """The row entries `<key>@<task set>` of task_flips' results."""
    row = {}
    for task, r in by_task.items():
        figures = {**{k: r[k] for k in FLIP_FIGURES}, "accuracy_pct": r["candidate"]["accuracy_pct"],
                   "ref_accuracy_pct": r["reference"]["accuracy_pct"]}
        row.update((row_key(k, task), v) for k, v in figures.items())
    return row


def common_tasks(rows: list[dict]) -> tuple[str, ...]:
    """Task sets any row has flips for, in name order: a flips column each."""
    prefix = ROW_KEYS[0] + "@"
    return tuple(sorted({k[len(prefix):] for r in rows for k in r if k.startswith(prefix)}))


def columns(tasks: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(heading, row key) of the flips columns."""
    return tuple((f"flips % ({task}), McNemar p", row_key("flips_pct", task)) for task in tasks)


def cell(row: dict, task: str) -> str:
    pct = row.get(row_key("flips_pct", task))
    if pct is None:
        return ""
    return (f"{pct:.2f} ({row[row_key('correct_to_wrong', task)]}↓ {row[row_key('wrong_to_correct', task)]}↑, "
            f"p {row[row_key('mcnemar_p', task)]:.2g})")


def keys(tasks: tuple[str, ...]) -> tuple[str, ...]:
    """Every row key of the flips of `tasks` (CSV and JSON columns)."""
    return tuple(row_key(k, t) for t in tasks for k in ROW_KEYS)


NOTE = ("flips % (task): share of the task set's items whose answer went correct→wrong (↓) or wrong→correct (↑) "
        "against the reference's answer, scored as llama-perplexity scores tasks; p: exact two-sided McNemar test "
        "of ↓ vs ↑ (is the accuracy change more than chance?).")
