"""qeval next to llama-perplexity on the same model, corpus, n_ctx 512, chunks and threads.

    LLAMA_PERPLEXITY=/path/to/llama-perplexity python bench/bench_vs_llamacpp.py [--chunks 16]
        [--batch 2048 --ubatch 512 --out bench/results/vs_llamacpp-b2048.json]
        [--ngl 99 --out bench/results/vs_llamacpp-gpu.json]    # GPU builds of both tools

Build llama-perplexity from the llama.cpp that llama-cpp-python 0.3.36 vendors (see docs/benchmarks.md,
the bench_vs_llamacpp.py item); this script only runs it. Reports wall time and peak RSS of
  1. writing the reference: llama-perplexity --kl-divergence-base vs `qeval capture`,
  2. a live candidate: llama-perplexity --kl-divergence vs `qeval kld --cand MODEL.gguf`,
and the agreement of Final PPL, Mean KLD and Same top p, for Q8_0 vs Q2_K and Q8_0 vs Q8_0 with
KV q4_0 (-fa on). Each tool runs --repeat times per task (default 3), the two alternating which goes
first; wall times are medians, ratios are qeval's median over llama-perplexity's. Also the peak RSS
of `qeval capture` at 4 and 80 chunks (--no-rss skips it). --batch/--ubatch pass
-b/-ub to both tools (default: each tool's own; llama-perplexity's is -b 2048 -ub 512). --ngl N
offloads N layers in both (then qeval's default is llama-perplexity's -b 2048 -ub 512); it measures
only where both builds see a GPU, and says so and writes nothing otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import cpu_name, llama_numbers, llamacpp_setup, timed


def missing_gpu(llama_perplexity: str) -> str | None:
    """Why a GPU comparison cannot run here (None when both tools can offload)."""
    import llama_cpp  # noqa: PLC0415

    if not llama_cpp.llama_supports_gpu_offload():
        return "qeval's llama-cpp-python is a CPU build (./install.sh --gpu cuda builds one that offloads)"
    devices = subprocess.run([llama_perplexity, "--list-devices"], capture_output=True, text=True).stdout
    if "(none)" in devices or "Available devices" not in devices:
        return f"{llama_perplexity} sees no GPU (build it with -DGGML_CUDA=ON)"
    return None


def median_of(runs: list[dict]) -> dict:
    """The runs of one tool on one task: every run's wall time, their median, and the last run's figures."""
    walls = [r["wall_s"] for r in runs]
    return {**runs[-1], "wall_s": statistics.median(walls), "wall_s_runs": walls,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs)}


def alternate(repeat: int, first, second) -> tuple[dict, dict]:
    """Run first() and second() `repeat` times each, alternating which goes first (a machine whose load
    drifts then hurts both alike); their medians."""
    a, b = [], []
    for k in range(repeat):
        if k % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return median_of(a), median_of(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, help="-b for both tools")
    ap.add_argument("--ubatch", type=int, help="-ub for both tools")
    ap.add_argument("--ngl", type=int, default=0, help="-ngl for both tools (needs GPU builds of both)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tool per task, alternating; medians")
    ap.add_argument("--no-rss", action="store_true", help="skip the capture peak-RSS runs at 4 and 80 chunks")
    ap.add_argument("--no-live", action="store_true", help="measure the reference capture only")
    ap.add_argument("--out", default="bench/results/vs_llamacpp.json")
    args = ap.parse_args()
    lp, paths, work, corpus = llamacpp_setup("qeval-bench-")
    if args.ngl and (missing := missing_gpu(lp)):
        sys.exit(f"--ngl {args.ngl}: {missing}; nothing measured")
    runs = work / "runs"
    batching = [*(["-b", str(args.batch)] if args.batch else []), *(["-ub", str(args.ubatch)] if args.ubatch else [])]
    batching += ["-ngl", str(args.ngl)] if args.ngl else []
    common = ["-f", str(corpus), "-c", "512", "--chunks", str(args.chunks), "-t", str(args.threads), *batching]
    qeval = [sys.executable, "-m", "qeval"]
    out: dict = {"cpu": cpu_name(), "chunks": args.chunks, "threads": args.threads, "batch": args.batch,
                 "ubatch": args.ubatch, "ngl": args.ngl, "repeat": args.repeat, "pairs": {}}

    base = work / "q8.kld"

    def llamacpp_reference() -> dict:
        w, r, text = timed([lp, "-m", str(paths["Q8_0"]), *common, "--kl-divergence-base", str(base)])
        return {"wall_s": w, "peak_rss_bytes": r, "file_bytes": base.stat().st_size, **llama_numbers(text)}

    def qeval_reference() -> dict:
        (runs / "Q8_0.qeval").unlink(missing_ok=True)  # a complete store of the same capture would be reused
        w, r, _ = timed([*qeval, "capture", str(paths["Q8_0"]), "--label", "Q8_0", "--corpus", str(corpus), "-c",
                         "512", "--chunks", str(args.chunks), "-t", str(args.threads), *batching,
                         "--runs-dir", str(runs)])
        ppl = json.loads(subprocess.run([*qeval, "ppl", "Q8_0", "--json", "--runs-dir", str(runs)],
                                        capture_output=True, text=True, check=True).stdout)
        return {"wall_s": w, "peak_rss_bytes": r, "file_bytes": (runs / "Q8_0.qeval").stat().st_size,
                "final_ppl": ppl["ppl"]}

    ll, q = alternate(args.repeat, llamacpp_reference, qeval_reference)
    out["reference"] = {"llamacpp": ll, "qeval": q, "time_ratio": q["wall_s"] / ll["wall_s"]}

    pairs = () if args.no_live else (("Q2_K", paths["Q2_K"], None), ("Q8_0+kv-q4_0", paths["Q8_0"], "q4_0"))
    for name, model, kv in pairs:
        kv_args = ["-ctk", kv, "-ctv", kv, "-fa", "on"] if kv else []

        def llamacpp_live() -> dict:
            w, r, text = timed([lp, "-m", str(model), *common, *kv_args, "--kl-divergence-base", str(base),
                                "--kl-divergence"])
            return {"wall_s": w, "peak_rss_bytes": r, **llama_numbers(text)}

        def qeval_live() -> dict:
            w, r, stdout = timed([*qeval, "kld", "--ref", "Q8_0", "--cand", str(model), *kv_args, "-t",
                                  str(args.threads), *batching, "--json", "--runs-dir", str(runs)])
            res = json.loads(stdout[:stdout.rindex("}") + 1])
            return {"wall_s": w, "peak_rss_bytes": r, "ppl_cand": res["perplexity"]["ppl_cand"],
                    "ppl_ref": res["perplexity"]["ppl_ref"], "mean_kld": res["kld"]["mean"],
                    "same_top_pct": 100 * res["same_top1"]["fraction"]}

        ll, q = alternate(args.repeat, llamacpp_live, qeval_live)
        out["pairs"][name] = {"llamacpp": ll, "qeval": q, "time_ratio": q["wall_s"] / ll["wall_s"],
                              "ppl_rel_diff": abs(q["ppl_cand"] / ll["ppl_cand"] - 1),
                              "kld_rel_diff": abs(q["mean_kld"] / ll["mean_kld"] - 1),
                              "same_top_diff_points": abs(q["same_top_pct"] - ll["same_top_pct"])}
    out["capture_rss"] = {}
    for n in () if args.no_rss else (4, 80):
        w, r, _ = timed([*qeval, "capture", str(paths["Q8_0"]), "--label", f"rss{n}", "--corpus", str(corpus),
                         "-c", "512", "--chunks", str(n), "-t", str(args.threads), *batching, "--runs-dir", str(runs)])
        out["capture_rss"][str(n)] = {"wall_s": w, "peak_rss_bytes": r, "peak_rss_gib": r / 2**30}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
