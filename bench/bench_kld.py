"""`qeval kld` store-vs-store throughput and peak RSS at 4 and 80 chunks (issue: the qeval spine).

    python bench/bench_kld.py [--runs-dir bench/runs] [--out bench/results/kld.json]

Captures Q8_0 and Q2_K stores of Gemma-3-270M (80 chunks of 512 on the shipped corpus) if they are
not there yet, then runs `qeval kld` in a child process for 4 and 80 chunks and reports scored
tokens per second (wall time of the whole command, start-up included) and the child's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from qeval import api
from qeval.orchestrate import demo


def run_child(args: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of `python -m qeval ARGS`, measured by GNU time."""
    proc = subprocess.run(["/usr/bin/time", "-f", "WALL=%e RSS_KB=%M", sys.executable, "-m", "qeval", *args],
                          capture_output=True, text=True, check=True)
    m = re.search(r"WALL=([\d.]+) RSS_KB=(\d+)", proc.stderr)
    return float(m.group(1)), int(m.group(2)) * 1024, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs-dir", default="bench/runs")
    ap.add_argument("--out", default="bench/results/kld.json")
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 80])
    args = ap.parse_args()
    paths = demo.prepare_models(demo.models_dir())
    n_max = max(args.chunks)
    for label in ("Q8_0", "Q2_K"):
        api.capture_store(str(paths[label]), label, runs_dir=args.runs_dir, chunks=n_max, progress=True)
    out = {"n_vocab": 262144, "runs": []}
    for n in sorted(args.chunks):
        wall, rss, stdout = run_child(["kld", "--ref", "Q8_0", "--cand", "Q2_K", "--chunks", str(n), "--json",
                                       "--runs-dir", args.runs_dir])
        result = json.loads(stdout)
        out["runs"].append({"chunks": n, "scored_tokens": result["scored_tokens"], "wall_s": wall,
                            "tokens_per_s": result["scored_tokens"] / wall, "peak_rss_bytes": rss,
                            "peak_rss_gib": rss / 2**30, "mean_kld": result["kld"]["mean"]})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
