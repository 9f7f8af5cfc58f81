"""What reading the output head's input costs a decode (issue 42): one model's windows decoded with no hidden rows,
with the rows read in llama.cpp's graph (qeval.engine.hidden_tap), and from an embeddings context (llama.cpp then
outputs, so multiplies by its head, every token of a call), each in a fresh process, alternated round by round.

    python bench/bench_hidden_tap.py MODEL [-c 8192] [--score every:64] [-b 128] [--rounds 3] [-t THREADS] \
        [--out bench/results/hidden-tap-<cpu>.json]

Every window is random token ids (seeded), scored as --score says; a child times Engine.iter_calls over them (the
model's load is not timed) and checks that its logits hash as the plain run's, so the three decodes are known to
compute the same thing. The JSON keeps every run, the CPU and the load average before each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_name

MODES = ("plain", "graph", "embeddings")


def child(args: argparse.Namespace) -> dict:
    import numpy as np  # noqa: PLC0415 - the child's own imports

    from qeval.engine.engine import Engine, EngineSettings  # noqa: PLC0415
    from qeval.storage.scoring import Scoring  # noqa: PLC0415

    windows = np.random.default_rng(1).integers(100, 20_000, size=(args.windows, args.ctx)).astype(np.int32)
    settings = EngineSettings(flash_attn="on", n_threads=args.threads, n_batch=args.batch)
    with Engine(args.model, args.ctx, settings, scoring=Scoring.parse(args.score)) as engine:
        if args.child != "plain":
            engine.output_hidden(in_graph=args.child == "graph")
        digest, rows = hashlib.sha256(), 0
        started = time.perf_counter()
        for call in engine.iter_calls(windows):
            for scored in call:
                digest.update(np.ascontiguousarray(scored.logits).tobytes())
                rows += len(scored.logits)
        seconds = time.perf_counter() - started
        return {"mode": args.child, "route": engine.hidden_source, "decode_s": round(seconds, 3), "rows": rows,
                "logits_sha256": digest.hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-c", "--ctx", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--score", default="every:64")
    ap.add_argument("-b", "--batch", type=int, default=None)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    argv = [sys.executable, __file__, args.model, "-c", str(args.ctx), "--windows", str(args.windows), "--score",
            args.score, "-t", str(args.threads), *(["-b", str(args.batch)] if args.batch else [])]
    runs = []
    for round_ in range(args.rounds):
        for mode in MODES[round_ % 3:] + MODES[:round_ % 3]:  # each mode first in turn
            load = os.getloadavg()
            proc = subprocess.run([*argv, "--child", mode], capture_output=True, text=True, check=True)
            run = {**json.loads(proc.stdout.strip().splitlines()[-1]), "round": round_, "load_average_before": load}
            runs.append(run)
            print(json.dumps(run), flush=True)
    plain = {r["logits_sha256"] for r in runs if r["mode"] == "plain"}
    same = {mode: {r["logits_sha256"] for r in runs if r["mode"] == mode} == plain for mode in MODES}
    median = {mode: sorted(r["decode_s"] for r in runs if r["mode"] == mode)[args.rounds // 2] for mode in MODES}
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "model": Path(args.model).name, "n_ctx": args.ctx,
              "windows": args.windows, "score": args.score, "n_batch": args.batch, "threads": args.threads,
              "runs": runs, "logits_as_plain": same, "median_decode_s": median,
              "median_ratio_to_plain": {m: round(median[m] / median["plain"], 3) for m in MODES}}
    print(json.dumps({k: result[k] for k in ("logits_as_plain", "median_decode_s", "median_ratio_to_plain")}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
