"""Task accuracy and answer flips: capture a model's per-choice scores once, compare stores later.

    capture_tasks   task capture (qeval.capture.tasks), then the accuracy of the store it wrote
    show_tasks      accuracy of one task store
    flips_between   accuracy, flips, McNemar and flips by margin between two stores (qeval.compare.flips)
"""

from __future__ import annotations

from pathlib import Path

from qeval.capture import tasks as taskcapture
from qeval.compare import flips as flipmath
from qeval.errors import QevalError
from qeval.storage import runs
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
    raise QevalError(f"{spec!r} is neither a task store file nor a label with a task store{where} ({hint})")


def show_tasks(spec: str, runs_dir=None, task: str | None = None) -> tuple[dict, str]:
    store = open_task_store(spec, runs_dir, task)
    records = store.records
    if not records:
        raise QevalError(f"{store.path} holds no task yet")
    import numpy as np

    correct = np.array([r["labels"][r["pred"]] == 1 for r in records.values()])
    acc = flipmath.accuracy(correct)
    t = store.header.get("task", {})
    result = {"store": flipmath.describe(store), "task": t, "complete": store.complete, "n_selected": store.n_selected,
              **acc}
    state = "complete" if store.complete else f"incomplete: {len(records)} of {store.n_selected} tasks"
    text = (f"{store.label} on {t.get('name')} ({store.kind}, {len(records)} tasks{'' if store.complete else ', ' + state}): "
            f"accuracy {acc['accuracy_pct']:.4f} ± {acc['se_pct'] or 0:.4f} % ({acc['correct']}/{acc['n']})\n"
            f"  store {store.path}")
    return result, text


def flips_between(ref: str, cand: str, runs_dir=None, task: str | None = None, bins: int = 4) -> dict:
    return flipmath.between(open_task_store(ref, runs_dir, task), open_task_store(cand, runs_dir, task), bins)


def flips_text(r: dict, max_listed: int = 20) -> str:
    t, n = r["task"], r["n_tasks"]
    width = max(len(r["ref"]["label"]), len(r["cand"]["label"]))
    held = "" if r["ref_tasks"] == r["cand_tasks"] == n else \
        f" (the reference holds {r['ref_tasks']}, the candidate {r['cand_tasks']})"
    lines = [f"Task flips: {t.get('name')} ({t.get('format')}), {n} tasks in both stores{held}"]
    for side, key in (("reference", "ref"), ("candidate", "cand")):
        d = r[side]
        lines.append(f"  {side} {r[key]['label']:<{width}}  accuracy {d['accuracy_pct']:7.3f} ± "
                     f"{d['se_pct'] or 0:.3f} %  ({d['correct']}/{d['n']})")
    lines += [f"  Δ accuracy {r['delta_accuracy_pct']:+.3f} ± {r['delta_se_pct'] or 0:.3f} % (paired)",
              (f"  flips {r['flips']} ({r['flips_pct']:.2f} % of tasks): correct→wrong {r['correct_to_wrong']} "
               f"({r['correct_to_wrong_pct']:.2f} %), wrong→correct {r['wrong_to_correct']} "
               f"({r['wrong_to_correct_pct']:.2f} %); answers changed {r['answers_changed']} "
               f"({r['answers_changed_pct']:.2f} %)"),
              (f"  McNemar exact p = {r['mcnemar_p']:.4g} (two-sided, {r['correct_to_wrong']} vs "
               f"{r['wrong_to_correct']} discordant)")]
    if r["ref_margin_median_flipped"] is not None and r["ref_margin_median_kept"] is not None:
        lines.append(f"  median reference margin: flipped tasks {r['ref_margin_median_flipped']:.4f}, the others "
                     f"{r['ref_margin_median_kept']:.4f}")
    lines.append("  flips by reference margin (its answer's score minus the best other; equal-count bins):")
    lines.append(f"    {'margin':>19}  {'tasks':>5}  {'flips':>5}  {'c→w':>4}  {'w→c':>4}  {'flip rate':>9}  "
                 f"{'changed':>7}")
    for b in r["margin_bins"]:
        lines.append(f"    {b['margin_min']:8.4f} – {b['margin_max']:8.4f}  {b['n']:5d}  {b['flips']:5d}  "
                     f"{b['correct_to_wrong']:4d}  {b['wrong_to_correct']:4d}  {b['flip_rate_pct']:8.2f}%  "
                     f"{b['changed_rate_pct']:6.2f}%")
    flipped = r["flipped"]
    if flipped:
        shown = flipped[:max_listed]
        more = "" if len(shown) == len(flipped) else f", the first {len(shown)} of {len(flipped)} (--json lists all)"
        lines.append(f"  flipped tasks (choices counted from 0){more}:")
        for f in shown:
            lines.append(f"    task {f['index']:6d}  gold {f['gold']}  reference {f['ref_answer']} → candidate "
                         f"{f['cand_answer']}  {f['direction']:<13}  reference margin {f['ref_margin']:.4f}")
    return "\n".join(lines)


def flips_report(ref: str, cand: str, runs_dir=None, task: str | None = None, bins: int = 4,
                 max_listed: int = 20) -> tuple[dict, str]:
    r = flips_between(ref, cand, runs_dir, task, bins)
    return r, flips_text(r, max_listed)
