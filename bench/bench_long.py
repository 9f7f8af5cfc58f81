"""Long context (issue 10): peak RSS and wall time of a capture at several n_ctx with one scoring density,
the cost of scoring next to the forward pass alone, and what llama-perplexity does at the largest n_ctx.

    python bench/bench_long.py --ctx 4096,16384,32768 --score every:16 --chunks 1 [--repeat N] \
        [--llama-perplexity PATH] --out bench/results/long-<cpu>.json

Each capture is a fresh `qeval capture` process (Q8_0 of Gemma-3-270M, shipped corpus, -t = every core);
peak RSS is the child's ru_maxrss. "Forward alone" is the same capture scoring every 4096th position
(8 rows of a 32K window): the decode is the same, almost nothing is asked of the output layer or coded.
With --repeat N the scored and the forward-only capture at the largest n_ctx alternate N times each and the
ratio is of the medians (a slow spell of the machine then hits both alike).
Run it on a quiet machine: the ratios are only meaningful when both runs see the same CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qeval.inputs.corpus import load_corpus
from qeval.orchestrate import demo

FORWARD_ONLY = "every:4096"


def run_measured(argv: list[str], env: dict | None = None) -> dict:
    """Wall seconds, peak RSS (GiB), exit code and the last stderr line of one child process."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        wall = time.perf_counter() - t0
        err.seek(0)
        tail = (err.read().decode(errors="replace").replace("\r", "\n").strip().splitlines() or [""])[-1]
    return {"argv": argv, "rc": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 2),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3), "last_line": tail[-300:]}


def capture(model: Path, n_ctx: int, score: str, chunks: int, runs: Path) -> dict:
    label = f"c{n_ctx}-{score.replace(':', '')}"
    argv = [sys.executable, "-m", "qeval", "capture", str(model), "-l", label, "-c", str(n_ctx), "--score", score,
            "--chunks", str(chunks), "--runs-dir", str(runs)]
    out = run_measured(argv)
    out.update(n_ctx=n_ctx, score=score, chunks=chunks)
    print(json.dumps({k: out[k] for k in ("n_ctx", "score", "wall_s", "peak_rss_gib", "rc")}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="4096,16384,32768")
    ap.add_argument("--score", default="every:16")
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="alternate scored and forward-only runs N times each")
    ap.add_argument("--llama-perplexity", help="also run llama-perplexity --kl-divergence-base at the largest n_ctx")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = demo.prepare_models(demo.models_dir())["Q8_0"]
    contexts = [int(c) for c in args.ctx.split(",")]
    work = Path(tempfile.mkdtemp(prefix="qeval-long-"))
    result = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "model": model.name,
              "rss_by_ctx": [], "overhead": None, "llama_perplexity": None}
    for n_ctx in contexts:
        result["rss_by_ctx"].append(capture(model, n_ctx, args.score, args.chunks, work / f"rss{n_ctx}"))
    largest = max(contexts)
    scored = [next(r for r in result["rss_by_ctx"] if r["n_ctx"] == largest)["wall_s"]]
    forward = []
    for k in range(args.repeat):
        forward.append(capture(model, largest, FORWARD_ONLY, args.chunks, work / f"forward{k}")["wall_s"])
        if k + 1 < args.repeat:
            scored.append(capture(model, largest, args.score, args.chunks, work / f"scored{k}")["wall_s"])
    result["overhead"] = {"n_ctx": largest, "score": args.score, "scored_wall_s": scored,
                          "forward_only_wall_s": forward, "forward_only_score": FORWARD_ONLY,
                          "ratio": round(statistics.median(scored) / statistics.median(forward), 3)}
    if args.llama_perplexity:
        corpus = work / "corpus.txt"
        corpus.write_text(load_corpus().text)
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(args.llama_perplexity).parent)}
        lp = run_measured([args.llama_perplexity, "-m", str(model), "-f", str(corpus), "-c", str(largest),
                           "--chunks", "1", "--kl-divergence-base", str(work / "base.kld"),
                           "-t", str(os.cpu_count())], env)
        lp["kld_base_bytes"] = (work / "base.kld").stat().st_size if (work / "base.kld").exists() else 0
        result["llama_perplexity"] = lp
        print(json.dumps({k: lp[k] for k in ("rc", "wall_s", "peak_rss_gib", "last_line")}), flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
