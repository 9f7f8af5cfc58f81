"""What a quantized KV cache costs on Gemma-3-270M, by cache type x llama.cpp's KV rotation x decode mode, next to
the numerics floor (the same f16 cache decoded one token per call): issue 24's table.

The reference is Q8_0 with an f16 cache in prompt batches (flash attention auto), captured once; every other row
is the same Q8_0 weights run live over its tokens. Each row's KLD over the floor is paired on the same tokens,
chunks as the unit (qeval.present.board.compare_with_floor). Wall times are measured side by side in this run.

    python bench/bench_numerics.py [--chunks 16] [--out bench/results/numerics-gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_name

from qeval import api
from qeval.compare.summary import summarize
from qeval.compare.verdict import written
from qeval.engine.engine import EngineSettings
from qeval.orchestrate import demo
from qeval.present import board

KV_TYPES = ("f16", "q8_0", "q5_1", "q4_0")
ROTATIONS = ("on", "off")
MODES = ("prompt", "generate")


def settings_grid(modes=MODES):
    """(name, EngineSettings) of every row in `modes`: f16 has no rotation; its prompt-batch row is the reference
    itself and its one-token row, the floor, is always run."""
    for kv in KV_TYPES:
        for rotation in (ROTATIONS if kv != "f16" else ("auto",)):
            for mode in (MODES if kv == "f16" else modes):
                if (kv, mode) == ("f16", "prompt"):
                    continue
                fa = "on" if kv != "f16" else "auto"
                yield (f"{kv} {'' if kv == 'f16' else 'rot ' + rotation + ' '}{mode}",
                       EngineSettings(type_k=kv, type_v=kv, flash_attn=fa, n_threads=2, kv_rotation=rotation,
                                      decode=mode))


# Other switches of llama.cpp, each alone against the same reference (f16 KV): (name, extra flags, environment).
# The environment variables are read once per process, so each runs in a process of its own.
NARROW = os.environ.get("QEVAL_NARROW_LIB")  # a narrower llama.cpp build (e.g. AVX2 only) for LLAMA_CPP_LIB_PATH
OTHER_PATHS = [
    ("the reference again (same path)", [], {}),
    ("flash attention off", ["-fa", "off"], {}),
    ("-b 32 (32-token pieces)", ["-b", "32"], {}),
    ("GGML_CPU_DISABLE_FUSION=1", [], {"GGML_CPU_DISABLE_FUSION": "1"}),
    ("GGML_CPU_TILED_MM=0", [], {"GGML_CPU_TILED_MM": "0"}),
    *([("AVX2-only build (LLAMA_CPP_LIB_PATH)", [], {"LLAMA_CPP_LIB_PATH": NARROW})] if NARROW else []),
]


def other_paths(runs: Path, model: str, chunks: int) -> list[dict]:
    """Each of OTHER_PATHS as `qeval kld --ref ref --cand MODEL` in its own process: mean KLD ± SE, same top-1."""
    out = []
    for name, flags, env in OTHER_PATHS:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "qeval", "kld", "--ref", "ref", "--cand", model, "--chunks",
                               str(chunks), "-t", "2", "--json", "--runs-dir", str(runs), *flags],
                              capture_output=True, text=True, env={**os.environ, **env})
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: {proc.stderr[-2000:]}")
        metrics = json.loads(proc.stdout)["metrics"]
        out.append({"path": name, "kld_mean": metrics["kld_mean"]["value"], "kld_mean_se": metrics["kld_mean"]["se"],
                    "same_top1_pct": metrics["same_top1_pct"]["value"], "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name}: KLD {out[-1]['kld_mean']:.6f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "numerics-gemma3-270m"))
    ap.add_argument("--runs", help="runs directory (default: a new temporary one); its reference is reused")
    ap.add_argument("--paths-only", action="store_true", help="only the table of other switches")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="decode modes of the quantized rows (the f16 floor always runs one token per call); "
                         "'prompt' alone where one-token rows are known to equal them")
    args = ap.parse_args()
    q8 = str(demo.prepare_models(demo.models_dir())["Q8_0"])
    runs = Path(args.runs or tempfile.mkdtemp(prefix="qeval-numerics-"))
    t0 = time.perf_counter()
    api.capture_store(q8, "ref", runs_dir=runs, n_ctx=512, chunks=args.chunks, settings=EngineSettings(n_threads=2))
    seconds = {"reference capture (f16 prompt)": time.perf_counter() - t0}
    if args.paths_only:
        paths = other_paths(runs, q8, args.chunks)
        Path(args.out + "-paths.json").write_text(json.dumps({"machine": cpu_name(), "chunks": args.chunks,
                                                              "rows": paths}, indent=2) + "\n")
        return
    rows, per_token = [], {}
    for name, settings in settings_grid(tuple(args.modes.split(","))):
        t0 = time.perf_counter()
        cmp = api.compare("ref", q8, args.chunks, runs, threads=2, settings=settings)
        seconds[name] = time.perf_counter() - t0
        row = board.board_row(summarize(cmp))
        row.label = name
        rows.append(row)
        per_token[name] = cmp.per_token
        print(f"{name}: KLD {row.kld_mean:.6f} in {seconds[name]:.1f} s", flush=True)
    board.compare_with_floor(rows, lambda r: per_token[r.label])
    table = [{"row": r.label, "floor": r.floor, "kld_mean": r.metrics["kld_mean"].value,
              "kld_mean_se": r.metrics["kld_mean"].se, "same_top1_pct": r.metrics["same_top1_pct"].value,
              "kld_over_floor": r.kld_over_floor, "kld_over_floor_se": r.kld_over_floor_se,
              **written(r.over_floor, "floor_verdict"),
              "seconds": round(seconds[r.label], 2)} for r in rows]
    out = {"machine": cpu_name(), "model": "Gemma-3-270M Q8_0 (requantized from the PyPI Q4_K_M)", "n_ctx": 512,
           "chunks": args.chunks, "scored_tokens": int(len(per_token[rows[0].label]["kld"])),
           "reference": "Q8_0, f16 KV, prompt batches of 128, flash attention auto", "rows": table,
           "seconds": {k: round(v, 2) for k, v in seconds.items()}}
    Path(args.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# KV cache cost by type, rotation and decode mode: Gemma-3-270M, {out['machine']}", "",
             f"Reference {out['reference']}; {args.chunks} chunks of 512 ({out['scored_tokens']} scored tokens); "
             "`python bench/bench_numerics.py`.", "",
             "| KV, rotation, decode | mean KLD ± SE | same top-1 % | KLD over floor ± SE (paired) | wall s |",
             "|---|---|---|---|---|"]
    for row, r in zip(rows, table):
        over = board.floor_cell(row)  # "floor" on the floor's row, else its excess and verdict as boards show them
        lines.append(f"| {r['row']} | {r['kld_mean']:.6f} ± {r['kld_mean_se']:.6f} | {r['same_top1_pct']:.2f} | {over} "
                     f"| {r['seconds']:.1f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
