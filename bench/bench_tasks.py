"""`qeval tasks capture` next to `llama-perplexity --hellaswag` on the same model, task file and threads.

    LLAMA_PERPLEXITY=/path/to/llama-perplexity python bench/bench_tasks.py [--tasks 400] [--repeat 3]
        [--file-tasks 400] [--quant Q2_K] [--threads 2] [--out bench/results/tasks-<cpu>.json]

The task file is bench/make_cloze.py's cloze of the shipped novel (--file-tasks of them); both tools score
--tasks of them (the ones llama-perplexity's --hellaswag-tasks picks) with their default settings (-c 512,
-np 4, -b 2048, -ub 512, -fa auto). The tools run
alternately, qeval first, --repeat times each, every qeval run into a fresh runs dir. Writes per-run
wall times and peak RSS, the medians, their ratio (qeval / llama-perplexity), the CPU, and whether the
answers are the same task for task: llama-perplexity prints its running accuracy after every task,
from which each task's right/wrong follows; qeval's store holds each task's answer.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from common import cpu_name, llamacpp_setup, timed
from make_cloze import cloze_tasks

from qeval.capture.taskscore import task_order
from qeval.inputs.corpus import load_corpus
from qeval.storage.taskstore import TaskStore

RUNNING_ACCURACY = re.compile(r"^(\d+)\t([\d.]+)%\t\[", re.MULTILINE)  # hellaswag_score's line per task


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(.*?\)", "", text.lower())).strip("-")


def llama_correct(text: str) -> list[bool]:
    """Each task's right/wrong from llama-perplexity's running accuracy (printed with 8 decimals)."""
    right = [round(float(pct) / 100 * int(n)) for n, pct in RUNNING_ACCURACY.findall(text)]
    return [now > before for before, now in zip([0, *right], right)]


def qeval_correct(store_path: str, n_items: int, n_tasks: int) -> list[bool]:
    """Each task's right/wrong in llama-perplexity's task order."""
    records = TaskStore.open(store_path).records
    return [records[i]["labels"][records[i]["pred"]] == 1 for i in task_order("hellaswag", n_items, n_tasks)]


def summary(walls: list[float], rss: list[int]) -> dict:
    return {"wall_s": walls, "median_wall_s": statistics.median(walls), "peak_rss_bytes": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--file-tasks", type=int, default=400, help="tasks in the cloze file")
    ap.add_argument("--quant", default="Q2_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="default: bench/results/tasks-<cpu>.json")
    args = ap.parse_args()
    lp, paths, work, _ = llamacpp_setup("qeval-tasks-bench-")
    task_file = work / "cloze.txt"
    task_file.write_text("".join(f"{ctx}\n{gold}\n" + "".join(f"{e}\n" for e in ends)
                                 for ctx, gold, ends in cloze_tasks(load_corpus().text, args.file_tasks, 0)))
    model, threads = str(paths[args.quant]), str(args.threads)
    llama_cmd = [lp, "-m", model, "-f", str(task_file), "--hellaswag", "--hellaswag-tasks", str(args.tasks),
                 "-t", threads]
    runs: dict[str, dict[str, list]] = {"qeval": {"wall": [], "rss": []}, "llama-perplexity": {"wall": [], "rss": []}}
    answers: dict[str, list[bool]] = {}
    for k in range(args.repeat):
        qeval_cmd = [sys.executable, "-m", "qeval", "tasks", "capture", "-m", model, "-l", args.quant,
                     "-f", str(task_file), "--limit", str(args.tasks), "--runs-dir", str(work / f"runs-{k}"),
                     "-t", threads, "--json"]
        for tool, cmd in (("qeval", qeval_cmd), ("llama-perplexity", llama_cmd)):
            wall, rss, text = timed(cmd)
            runs[tool]["wall"].append(wall)
            runs[tool]["rss"].append(rss)
            print(f"run {k + 1}/{args.repeat} {tool}: {wall:.1f} s", file=sys.stderr)
            if tool == "qeval":
                store = json.loads(text[:text.rindex("}") + 1])["store"]["path"]
                answers[f"qeval-{k}"] = qeval_correct(store, args.file_tasks, args.tasks)
            else:
                answers[f"llama-{k}"] = llama_correct(text)
    tools = {tool: summary(r["wall"], r["rss"]) for tool, r in runs.items()}
    reference = answers["llama-0"]
    differing = sorted({t for a in answers.values() for t, (x, y) in enumerate(zip(a, reference)) if x != y})
    out = {
        "cpu": cpu_name(), "quant": args.quant, "tasks": args.tasks, "file_tasks": args.file_tasks,
        "threads": args.threads, "repeat": args.repeat,
        "commands": {"qeval": " ".join(qeval_cmd), "llama-perplexity": " ".join(llama_cmd)},
        **tools,
        "time_ratio": tools["qeval"]["median_wall_s"] / tools["llama-perplexity"]["median_wall_s"],
        "accuracy_pct": {name: 100 * sum(a) / len(a) for name, a in answers.items()},
        "answers_equal": not differing and all(len(a) == args.tasks for a in answers.values()),
        "tasks_differing": differing,  # positions in llama-perplexity's task order
    }
    path = Path(args.out or f"bench/results/tasks-{slug(out['cpu'])}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
