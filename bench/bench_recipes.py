"""Recipes on Gemma-3-270M (issue 27): the tensor sensitivity sweep, then the best recipe under each stock type's size
and mean KLD, measured beside the stock types and the issue's hand-made recipes.

    python bench/bench_recipes.py --chunks 4 --out bench/results/recipes-gemma3-270m
    python bench/bench_recipes.py --chunks 16 --early --runs-dir /tmp/qeval-recipes-early --out /tmp/early

Held out and refined (issue 35), about ten builds on two groups and two target types:

    nice -n 10 python bench/bench_recipes.py --chunks 16 --holdout 8 --refine-builds 1 \
        --runs-dir /tmp/qeval-recipes-holdout --out bench/results/recipes-holdout-gemma3-270m

chooses on 8 tuning chunks under three budgets of docs/recipes.md (≤ 187.7 MB, ≤ 253.1 MB, KLD ≤ 0.210), refines
each choice with one build, and reports the chosen and the refined recipe against the stock type on the tuning and on
the 8 held-out chunks (split seed 0): recipes.md, recipes.json and run.json in --out.

With --early every board (the stock types, the sweep, the budgets) is decided early with the matrix's defaults, and
the record says how many variant-chunks (forward passes, at most) each board held of its full run's.

The source is the demo's Gemma-3-270M Q4_K_M (the only real file: every other type is its requantization), the
reference the demo's Q8_0 captured over the first --chunks windows of 512 tokens. Every variant is built from the
source by llama-cpp-python's quantizer and measured live (qeval.orchestrate.recipes); the wall time and the peak
disk of the runs directory (sampled every second) are recorded with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from common import cpu_name

from qeval import api
from qeval.orchestrate import demo

STOCK = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M")
HAND = ("Q3_K_M token_embd=q5_0 ffn_.*=q5_0", "Q4_K_M token_embd=q5_1")
TARGETS = ("q4_0", "q5_0", "q5_1", "q8_0")
# the held-out run: two groups of the sweep (the embedding, where the bytes are cheapest, and ffn_down, the dearest
# layer group), two targets, three budgets of docs/recipes.md (a hand recipe's size, Q4_K_M's, Q3_K_M's mean KLD):
# about ten builds, the most the shared machine measures over 16 chunks in an hour
HOLDOUT_GROUPS, HOLDOUT_TARGETS = ("token_embd", "ffn_down"), ("q4_0", "q8_0")
HOLDOUT_MB, HOLDOUT_KLD, HOLDOUT_STOCK = (187.7, 253.1), (0.210,), ("Q3_K_M", "Q4_K_M")


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class PeakDisk:
    """The largest size of a directory tree, sampled every second in a thread."""

    def __init__(self, root: Path):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.peak = max(self.peak, tree_bytes(self.root))
            except OSError:
                pass  # a file removed while listed

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs-dir", type=Path, default=Path("/tmp/qeval-recipes"))
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "recipes-gemma3-270m")
    ap.add_argument("--early", action="store_true", help="decide every board early (qeval recipe ... --early)")
    ap.add_argument("--holdout", type=int, help="the held-out run instead: this many chunks held out (--split-seed 0)")
    ap.add_argument("--refine-builds", type=int, help="with --holdout: the refinement's builds per budget")
    args = ap.parse_args()
    paths = demo.prepare_models(demo.models_dir())
    api.capture_store(str(paths["Q8_0"]), "Q8_0", runs_dir=args.runs_dir, chunks=args.chunks)
    source = str(paths[demo.SOURCE_QUANT])
    if args.holdout is not None:
        return held_out(args, source)

    def request(*recipes):
        return api.recipe_request(ref="Q8_0", source=source, recipes=recipes, chunks=args.chunks,
                                  runs_dir=args.runs_dir, early=api.early_settings() if args.early else None)

    start = time.monotonic()
    with PeakDisk(args.runs_dir / "recipes") as disk:
        stock, _ = api.recipe_measure_report(request(*STOCK), progress=True)
        sweep, sweep_text = api.recipe_sweep_report(request("Q4_K_M"), TARGETS, out=args.out, progress=True)
        sizes = sorted({r["bytes"] / 1e6 for r in stock["rows"]} | {187.7, 200.7})
        klds = sorted(r["kld_mean"] for r in stock["rows"])
        fit, fit_text = api.recipe_fit_report(request("Q4_K_M", *HAND), TARGETS, max_mb=sizes, max_kld=klds,
                                              stock=STOCK, out=args.out, progress=True)
    wall = time.monotonic() - start
    machine = f"{cpu_name()}, {os.cpu_count()} cores, shared with other jobs"
    record = {"machine": machine, "chunks": args.chunks, "wall_s": round(wall, 1), "peak_disk_bytes": disk.peak,
              "variants_built": len(json.loads((args.runs_dir / "recipes" / "variants.json").read_text())),
              "early_decisions": ({name: board["early"] for name, board in (("stock", stock), ("sweep", sweep),
                                                                               ("fit", fit))}
                                  if args.early else "none: boards are not decided early in this run (every variant "
                                                     "runs every chunk)")}
    (args.out / "run.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    print(sweep_text)
    print(fit_text)


def held_out(args, source: str) -> None:
    """The held-out run: a fit on the tuning chunks, refined, every choice reported on the held-out chunks too."""
    request = api.recipe_request(ref="Q8_0", source=source, recipes=["Q4_K_M"], chunks=args.chunks,
                                 runs_dir=args.runs_dir)
    search = api.recipe_search(holdout=args.holdout, split_seed=0, refine_builds=args.refine_builds)
    start = time.monotonic()
    fit, fit_text = api.recipe_fit_report(request, HOLDOUT_TARGETS, max_mb=HOLDOUT_MB, max_kld=HOLDOUT_KLD,
                                          stock=HOLDOUT_STOCK, only=HOLDOUT_GROUPS, out=args.out, progress=True,
                                          search=search)
    record = {"machine": f"{cpu_name()}, {os.cpu_count()} cores, shared with other jobs", "chunks": args.chunks,
              "holdout": args.holdout, "refine_builds": args.refine_builds, "wall_s": round(time.monotonic() - start, 1),
              "variants_built": len(json.loads((args.runs_dir / "recipes" / "variants.json").read_text()))}
    (args.out / "run.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    print(fit_text)


if __name__ == "__main__":
    main()
