"""Overhead of `qeval matrix --executor ray` against the local runner, on one machine.

    python bench/bench_ray.py [--ctx 512] [--chunks 8] [--out bench/results/ray_overhead.json]

The same matrix (Gemma-3-270M: Q8_0 reference; Q2_K and Q4_0 at KV f16 and q8_0) in fresh runs
directories: locally; through Ray with 1 CPU per task (two tasks at once on two cores), with the
reference in 1 and in 4 shards; and through Ray with every CPU per task (one task at a time, the
local runner's concurrency: what is left is Ray's own cost per task). Ray is started once in this
process (its start is timed apart); `qeval matrix` on the command line pays it on every run.
Every configuration must give the local numbers exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from qeval import api
from qeval.orchestrate import demo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--out", default="bench/results/ray_overhead.json")
    args = ap.parse_args()

    import ray

    from qeval.orchestrate.distributed import RayExecutor

    m = demo.prepare_models(demo.models_dir())
    ref = f"Q8_0={m['Q8_0']}"
    models = [f"Q2_K={m['Q2_K']}", f"Q4_0={m['Q4_0']}"]
    kv = ["f16", "q8_0"]
    cpus = os.cpu_count() or 1
    root = Path(tempfile.mkdtemp(prefix="qeval-bench-ray-"))

    def run(name, executor=None):
        d = root / name
        t = time.perf_counter()
        result, _ = api.matrix_report(ref, models, kv, chunks=args.chunks, n_ctx=args.ctx, runs_dir=d,
                                      progress=False, executor=executor)
        wall = time.perf_counter() - t
        print(f"{name}: {wall:.1f} s", flush=True)
        return wall, result

    out = {"model": "gemma-3-270m", "n_ctx": args.ctx, "chunks": args.chunks, "pairs": len(models) * len(kv),
           "cpus": cpus, "ray": ray.__version__, "wall_s": {}}
    local_wall, local = run("local")
    out["wall_s"]["local"] = local_wall
    t = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False)
    out["ray_init_s"] = time.perf_counter() - t
    same = {}
    configs = {"ray_1cpu_per_task": RayExecutor(cpus_per_task=1, log=lambda line: None),
               "ray_1cpu_per_task_4_shards": RayExecutor(cpus_per_task=1, shard_chunks=4, log=lambda line: None),
               f"ray_{cpus}cpu_per_task": RayExecutor(cpus_per_task=cpus, log=lambda line: None)}
    for name, ex in configs.items():
        wall, result = run(name, ex)
        out["wall_s"][name] = wall
        same[name] = [r["kld"] for r in result["results"]] == [r["kld"] for r in local["results"]]
    ray.shutdown()
    out["same_numbers_as_local"] = same
    shutil.rmtree(root, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
