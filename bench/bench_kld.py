"""`qeval kld` store-vs-store: throughput, peak RSS, and time next to the zstd decompression floor.

    python bench/bench_kld.py [--runs-dir bench/runs] [--chunks 4 80] [--floor-chunks 20] [--repeat 3]
                              [--sampler qwen3.5-thinking] [--out bench/results/kld.json]

Captures Q8_0 and Q2_K stores of Gemma-3-270M (80 chunks of 512 on the shipped corpus) if they are
not there yet, then

1. runs `qeval kld` in a child process for each --chunks count: scored tokens per second (wall time of
   the whole command, start-up included) and the child's peak RSS;
2. the floor, in this process, over the first --floor-chunks chunks, alternating --repeat times:
   reading and decompressing every code block of both stores and nothing else (the least any
   comparison of the two must do: same thread count, chunk pairs spread over threads as `compare`
   spreads them), next to `qeval.api.compare` on the same chunks, plain and with each --sampler.
   Reports the medians and their ratios to the floor.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import cpu_name

from qeval import api
from qeval.compare.metrics import BLOCK_TOKENS
from qeval.engine.engine import available_cores
from qeval.orchestrate import demo
from qeval.storage import runs
from qeval.storage.store import StoreReader


def run_child(args: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of `python -m qeval ARGS`, measured by GNU time."""
    proc = subprocess.run(["/usr/bin/time", "-f", "WALL=%e RSS_KB=%M", sys.executable, "-m", "qeval", *args],
                          capture_output=True, text=True, check=True)
    m = re.search(r"WALL=([\d.]+) RSS_KB=(\d+)", proc.stderr)
    return float(m.group(1)), int(m.group(2)) * 1024, proc.stdout


def decompress_both(ref: Path, cand: Path, chunks: int, threads: int) -> float:
    """Seconds to read and decompress every code block of both stores' first `chunks` chunks."""
    with StoreReader(ref) as r, StoreReader(cand) as c:
        n_vocab = r.header.n_vocab

        def one(i: int) -> None:
            for store in (r, c):
                for _ in store.read_chunk(i).iter_planes(n_vocab, BLOCK_TOKENS):
                    pass

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, range(chunks)))
        return time.perf_counter() - t0


def timed_compare(runs_dir: str, chunks: int, threads: int, samplers: list[str]) -> float:
    t0 = time.perf_counter()
    api.compare("Q8_0", "Q2_K", chunks=chunks, runs_dir=runs_dir, threads=threads, samplers=samplers)
    return time.perf_counter() - t0


def floor_runs(runs_dir: str, chunks: int, repeat: int, samplers: list[str]) -> dict:
    threads = available_cores()
    directory = runs.runs_dir(runs_dir)
    ref, cand = runs.store_path("Q8_0", directory), runs.store_path("Q2_K", directory)
    variants = {"plain": [], **{f"sampler {s}": [s] for s in samplers}}
    times: dict[str, list[float]] = {"floor": [], **{v: [] for v in variants}}
    timed_compare(runs_dir, 1, threads, [])  # compile the kernels outside the measurement
    for _ in range(repeat):
        times["floor"].append(decompress_both(ref, cand, chunks, threads))
        for name, chosen in variants.items():
            times[name].append(timed_compare(runs_dir, chunks, threads, chosen))
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"chunks": chunks, "threads": threads, "repeat": repeat, "seconds": times, "median_s": medians,
            "ratio_to_floor": {k: medians[k] / medians["floor"] for k in variants}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs-dir", default="bench/runs")
    ap.add_argument("--out", default="bench/results/kld.json")
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 80])
    ap.add_argument("--floor-chunks", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sampler", action="append", default=[], help="also time compare with this sampler")
    args = ap.parse_args()
    paths = demo.prepare_models(demo.models_dir())
    n_max = max(*args.chunks, args.floor_chunks)
    for label in ("Q8_0", "Q2_K"):
        api.capture_store(str(paths[label]), label, runs_dir=args.runs_dir, chunks=n_max, progress=True)
    out = {"cpu": cpu_name(), "n_vocab": 262144, "runs": []}
    for n in sorted(args.chunks):
        wall, rss, stdout = run_child(["kld", "--ref", "Q8_0", "--cand", "Q2_K", "--chunks", str(n), "--json",
                                       "--runs-dir", args.runs_dir])
        result = json.loads(stdout)
        out["runs"].append({"chunks": n, "scored_tokens": result["scored_tokens"], "wall_s": wall,
                            "tokens_per_s": result["scored_tokens"] / wall, "peak_rss_bytes": rss,
                            "peak_rss_gib": rss / 2**30, "mean_kld": result["kld"]["mean"]})
    out["floor"] = floor_runs(args.runs_dir, args.floor_chunks, args.repeat, args.sampler)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
