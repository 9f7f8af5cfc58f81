"""Shared by the benchmarks that run llama-perplexity next to qeval."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qeval.inputs.corpus import load_corpus
from qeval.orchestrate import demo

TIME = ["/usr/bin/time", "-f", "WALL=%e RSS_KB=%M"]


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout + stderr) of `cmd`, which must succeed."""
    proc = subprocess.run(TIME + cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    m = re.search(r"WALL=([\d.]+) RSS_KB=(\d+)", proc.stderr)
    return float(m.group(1)), int(m.group(2)) * 1024, proc.stdout + proc.stderr


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def llamacpp_setup(prefix: str) -> tuple[str, dict[str, Path], Path, Path]:
    """(llama-perplexity binary, demo model paths, a fresh work dir, the shipped corpus copied into it)."""
    lp = os.environ.get("LLAMA_PERPLEXITY")
    if not lp or not Path(lp).is_file():
        sys.exit("set LLAMA_PERPLEXITY to a llama-perplexity binary")
    paths = demo.prepare_models(demo.models_dir())
    work = Path(tempfile.mkdtemp(prefix=prefix))
    corpus = work / "corpus.txt"
    corpus.write_text(load_corpus().text)
    return lp, paths, work, corpus


def llama_numbers(text: str) -> dict:
    """The numbers llama-perplexity prints (None where a line is absent)."""
    def grab(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None
    return {"ppl_cand": grab(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), "ppl_ref": grab(r"Mean PPL\(base\)\s*:\s*([\d.]+)"),
            "mean_kld": grab(r"Mean\s+KLD:\s*([-\d.]+)"), "same_top_pct": grab(r"Same top p:\s*([\d.]+)"),
            "final_ppl": grab(r"Final estimate: PPL = ([\d.]+)")}


def best(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn (seconds): the least disturbed one on a shared machine."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
