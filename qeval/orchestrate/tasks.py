"""Task accuracy and answer flips: capture a model's per-choice scores once, compare stores later.

    capture_tasks   task capture (qeval.capture.tasks), then the accuracy of the store it wrote
    show_tasks      accuracy of one task store
    flips_between   accuracy, flips, McNemar and flips by margin between two stores (qeval.compare.flips)

Their text is qeval.present.tasks_text's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeval.capture import tasks as taskcapture
from qeval.compare import flips as flipmath
from qeval.errors import QevalError
from qeval.present import results, tasks_text
from qeval.storage import runs
from qeval.storage.results import result_path
from qeval.storage.store import StoreReader
from qeval.storage.taskstore import STORE_SUFFIX, TASKS_SUBDIR, TaskStore


def capture_tasks(*args, **kwargs) -> tuple[dict, str]:
    """qeval.capture.tasks.capture_tasks (the same arguments), then show_tasks of the store it wrote, with the
    capture's status, tasks scored now and seconds."""
    done = taskcapture.capture_tasks(*args, **kwargs)
    result, text = show_tasks(str(done.path))
    result.update({"status": done.status, "tasks_scored_now": done.tasks_scored_now, "seconds": done.seconds})
    return result, f"{text}\n{done.summary_line()}"


def open_task_store(spec: str, runs_dir=None, task: str | None = None) -> TaskStore:
    """A task store by path, or by label in RUNS_DIR/tasks/<task>/ (task needed when the label is in several)."""
    path = Path(spec)
    if path.is_file():
        return TaskStore.open(path)
    root = runs.runs_dir(runs_dir) / TASKS_SUBDIR
    pattern = f"{task}/{spec}{STORE_SUFFIX}" if task else f"*/{spec}{STORE_SUFFIX}"
    found = sorted(root.glob(pattern)) if root.is_dir() and runs._LABEL.match(spec) else []
    if len(found) == 1:
        return TaskStore.open(found[0])
    if len(found) > 1:
        names = ", ".join(p.parent.name for p in found)
        raise QevalError(f"label {spec!r} has task stores for several task sets ({names}): pick one with --task")
    known = sorted(f"{p.parent.name}/{p.name[:-len(STORE_SUFFIX)]}" for p in root.glob(f"*/*{STORE_SUFFIX}")) \
        if root.is_dir() else []
    hint = f"task stores in {root}: {', '.join(known)}" if known else f"no task stores in {root}"
    where = f" for task set {task!r}" if task else ""
    raise QevalError(f"{spec!r} is neither a task store file nor a label with a task store{where} ({hint})"
                     f"{_measured_otherwise(spec, runs.runs_dir(runs_dir))}")


def _measured_otherwise(label: str, directory: Path) -> str:
    """What to do when `label` is known by a KLD result but has no task store: flips compare answers to tasks, which
    a KLD result does not hold; the model it recorded can be scored on the task set."""
    refs = [ref for cand, ref in runs.result_labels(directory) if cand == label]
    if refs:
        side = results.load_result(result_path(directory / runs.RESULTS_SUBDIR, label, refs[0]),
                                   with_per_token=False).summary.candidate
        what, model = f"a KLD result against {', '.join(refs)}", runs.live_model_path(side.path) or side.facts.get("file_name")
    elif runs.store_path(label, directory).is_file():
        with StoreReader(runs.store_path(label, directory), tolerate_torn_tail=True) as store:
            what, model = "a logits store", store.header.model.get("file_name")
    else:
        return ""
    return (f". {label} has {what}, but flips compare answers to a task set, which logits do not hold: score its model "
            f"first, `qeval tasks capture -m {model or 'MODEL.gguf'} --task TASKFILE --label {label}` (or give "
            "`qeval matrix` a --task)")


def show_tasks(spec: str, runs_dir=None, task: str | None = None) -> tuple[dict, str]:
    store = open_task_store(spec, runs_dir, task)
    records = store.records
    if not records:
        raise QevalError(f"{store.path} holds no task yet")
    correct = np.array([r["labels"][r["pred"]] == 1 for r in records.values()])
    acc = flipmath.accuracy(correct)
    t = store.header.get("task", {})
    result = {"store": flipmath.describe(store), "task": t, "complete": store.complete, "n_selected": store.n_selected,
              **acc}
    return result, tasks_text.accuracy_text(store, len(records), acc)


def flips_between(ref: str, cand: str, runs_dir=None, task: str | None = None, bins: int = 4) -> dict:
    return flipmath.between(open_task_store(ref, runs_dir, task), open_task_store(cand, runs_dir, task), bins)


def flips_report(ref: str, cand: str, runs_dir=None, task: str | None = None, bins: int = 4,
                 max_listed: int = 20) -> tuple[dict, str]:
    r = flips_between(ref, cand, runs_dir, task, bins)
    return r, tasks_text.flips_text(r, max_listed)
