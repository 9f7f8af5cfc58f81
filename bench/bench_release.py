"""What a matrix writes per pair, with and without --keep-logits (issue 25), on a small matrix.

    python bench/bench_release.py [--chunks 4] [--ctx 512] [--out bench/results/release-disk.json]

Gemma-3-270M (the demo's quants): the Q8_0 reference is captured once, then the same matrix (Q4_0 and Q2_K at
KV f16, no control or floor row) runs from that reference in two fresh runs directories: by default (pairs live,
uncoded, checkpointed, results kept) and with --keep-logits (each candidate coded into its store). Each run is a
child process whose bytes passed to write() (/proc/self/io wchar, its own output excepted) are everything it
wrote: per pair and per scored token, that is the disk a release budget needs beyond the reference's store. Also
recorded: what stays on disk, wall and CPU time, and forward passes (windows decoded: one per chunk and model, both
ways).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_name

from qeval.orchestrate import demo

CANDIDATES = ("Q4_0", "Q2_K")
# Runs the CLI in this process, then records the bytes it wrote (wchar: every write() call, files and pipes).
CHILD = """
import json, sys
from qeval import cli
try:
    cli.main(sys.argv[2:])
finally:
    io = dict(line.split(": ") for line in open("/proc/self/io").read().split("\\n") if line)
    open(sys.argv[1], "w").write(json.dumps({k: int(v) for k, v in io.items()}))
"""


def matrix_cmd(paths: dict, runs: Path, chunks: int, ctx: int, *extra: str) -> list[str]:
    return ["matrix", "--ref", f"Q8_0={paths['Q8_0']}", *(a for q in CANDIDATES for a in ("-m", f"{q}={paths[q]}")),
            "--chunks", str(chunks), "-c", str(ctx), "--no-control", "--floor", "none", "--runs-dir", str(runs),
            "--json", *extra]


def run_child(args: list[str], io_file: Path) -> tuple[float, dict, dict]:
    """(wall seconds, the matrix's JSON, the child's /proc/self/io and CPU seconds) of `qeval ARGS` in a child
    process. CPU seconds as well as wall time: on a shared machine the wall time says more about the neighbours."""
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(io_file), *args], capture_output=True, text=True)
    wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"qeval {' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")
    io = json.loads(io_file.read_text())
    io["output_bytes"] = len(proc.stdout.encode()) + len(proc.stderr.encode())
    io["cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return wall, json.loads(proc.stdout), io


def files(runs: Path) -> dict[str, int]:
    return {str(p.relative_to(runs)): p.stat().st_size for p in sorted(runs.rglob("*")) if p.is_file()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--out", default="bench/results/release-disk.json")
    args = ap.parse_args()
    paths = demo.prepare_models(demo.models_dir())
    work = Path(tempfile.mkdtemp(prefix="qeval-release-"))
    base = work / "base"
    base_s, _, base_io = run_child(matrix_cmd(paths, base, args.chunks, args.ctx), work / "io-base.json")
    ref_store = base / "Q8_0.qeval"
    out = {"machine": cpu_name(), "chunks": args.chunks, "n_ctx": args.ctx, "pairs": len(CANDIDATES),
           "reference_store_bytes": ref_store.stat().st_size, "modes": {}}
    for mode, extra in (("default", ()), ("keep_logits", ("--keep-logits",))):
        runs = work / mode
        runs.mkdir()
        shutil.copy(ref_store, runs / "Q8_0.qeval")  # the reference captured: only the pairs run
        wall, result, io = run_child(matrix_cmd(paths, runs, args.chunks, args.ctx, *extra), work / f"io-{mode}.json")
        tokens = sum(r["scored_tokens"] for r in result["results"])
        written = io["wchar"] - io["output_bytes"]
        kept = {k: v for k, v in files(runs).items() if k != "Q8_0.qeval"}
        out["modes"][mode] = {
            "wall_s": round(wall, 1), "cpu_s": round(io["cpu_s"], 1), "forward_passes": args.chunks * len(CANDIDATES),
            "scored_tokens": tokens,
            "bytes_written": written, "bytes_written_per_pair_per_token": round(written / tokens, 1),
            "bytes_kept": sum(kept.values()), "bytes_kept_per_pair_per_token": round(sum(kept.values()) / tokens, 1),
            "files_kept": kept, "kld_mean": {r["candidate"]["label"]: r["kld"]["mean"] for r in result["results"]}}
    # the reference captured, then the pairs (default mode)
    out["first_run"] = {"wall_s": round(base_s, 1), "cpu_s": round(base_io["cpu_s"], 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
