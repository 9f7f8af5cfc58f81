"""Task capture: a GGUF over a task set (qeval.inputs.taskfiles), every choice scored as llama-perplexity scores it
(qeval.capture.taskscore), into a task store RUNS_DIR/tasks/<task>/<label>.tasks.jsonl; resumable.

What a store holds is qeval.identity.task_store_identity: a complete store of the same identity is reused, an
interrupted one resumed, one of another refused (or, with `force`, replaced).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qeval.capture.taskscore import SCORING_VERSION, TaskModel, TaskSettings, pack, plan_tasks, task_order
from qeval.identity import task_store_identity
from qeval.inputs.taskfiles import TaskSet, load_tasks
from qeval.storage import runs, taskstore
from qeval.storage.taskstore import TaskStoreComplete, TaskStoreWriter, make_record


@dataclass
class TaskCaptureResult:
    path: Path
    status: str  # "complete", "already complete"
    tasks_scored_now: int
    seconds: float

    def summary_line(self) -> str:
        if self.status == "complete":
            return f"{self.status}: {self.tasks_scored_now} tasks scored now in {self.seconds:.1f} s"
        return f"{self.path} already holds this capture, complete"


def store_path(directory: Path, task_name: str, label: str) -> Path:
    return taskstore.store_path(directory, task_name, runs.check_label(label))


def capture_tasks(model: str, task: str, kind: str | None = None, limit: int | None = None,
                  label: str | None = None, runs_dir=None, out: str | None = None,
                  settings: TaskSettings = TaskSettings(), force: bool = False,
                  on_plan: Callable[[int, int], None] | None = None, on_tasks: Callable[[int], None] | None = None,
                  hf_loader: Callable | None = None) -> TaskCaptureResult:
    """Score every choice of the task set with `model` into a task store (resuming an interrupted one,
    reusing a complete one). on_plan(total, done) once, on_tasks(n) after every batch."""
    t0 = time.perf_counter()
    settings = settings.validate()
    tasks = load_tasks(task, kind, hf_loader)
    label = runs.check_label(label or Path(model).stem)
    order = task_order(tasks.kind, len(tasks.items), limit)
    path = Path(out) if out else store_path(runs.runs_dir(runs_dir), tasks.name, label)
    with TaskModel(model, settings) as tm:
        header = {
            "identity": task_store_identity(tasks, limit, tm, tm.facts, label, settings, SCORING_VERSION),
            "n_selected": len(order), "label": label, "task": tasks.describe(), "model": tm.facts,
            "run": {"n_gpu_layers": settings.engine.n_gpu_layers, "n_threads": settings.engine.n_threads,
                    "llama_n_ctx": tm.n_ctx},
        }
        try:
            writer = TaskStoreWriter.open(path, header, replace=force)
        except TaskStoreComplete:
            return TaskCaptureResult(path, "already complete", 0, time.perf_counter() - t0)
        with writer:
            score_into(tm, tasks, order, writer, on_plan, on_tasks)
            path = writer.finish()
            return TaskCaptureResult(path, "complete", writer.n_written, time.perf_counter() - t0)


def score_into(tm: TaskModel, tasks: TaskSet, order: list[int], writer: TaskStoreWriter,
               on_plan: Callable[[int, int], None] | None, on_tasks: Callable[[int], None] | None) -> None:
    """Score the tasks `order` of `tasks` that `writer`'s store does not hold yet, batch by batch, into it."""
    plans = plan_tasks(tm, tasks, order)
    groups = pack(tasks.kind, plans, tm.n_ctx, tm.n_seq_max, tasks.source)
    todo = [g for g in groups if any(plans[i].item.index not in writer.done for i in g)]
    if on_plan:
        on_plan(len(order), len(writer.done))
    for group in todo:
        before = len(writer.done)
        scores = tm.decode_group(tasks.kind, plans, group)
        writer.write([make_record(tasks.kind, s.index, s.sums, s.counts, s.llama, s.labels) for s in scores])
        if on_tasks:
            on_tasks(len(writer.done) - before)
