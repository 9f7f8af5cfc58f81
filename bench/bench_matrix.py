"""The embedded default as a matrix: 5 weight quants x KV f16/q8_0/q4_0 against Q8_0, next to the
same pairs run with llama-perplexity (issue: matrix runs and leaderboards).

    LLAMA_PERPLEXITY=/path/to/llama-perplexity python bench/bench_matrix.py [--chunks 16]

qeval: one `qeval matrix` command (reference captured once, 14 live pairs, results saved), then
`qeval leaderboard`. llama-perplexity: one --kl-divergence-base run, then one --kl-divergence run
per pair. Reports both wall times and the largest PPL/KLD disagreement over the pairs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import llama_numbers, llamacpp_setup

from qeval.orchestrate import baselines

QUANTS = ("Q8_0", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
KV_TYPES = ("f16", "q8_0", "q4_0")


def run(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:3]} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t, proc.stdout + proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--out", default="bench/results/matrix.json")
    ap.add_argument("--baseline", default="baselines/qeval-gemma-3-270m-default.json")
    args = ap.parse_args()
    lp, paths, work, corpus = llamacpp_setup("qeval-matrix-")
    runs = work / "runs"
    models = [f"--model={q}={paths[q]}" for q in QUANTS]
    qeval_s, text = run([sys.executable, "-m", "qeval", "matrix", f"--ref=Q8_0={paths['Q8_0']}", *models,
                         "--kv", ",".join(KV_TYPES), "--chunks", str(args.chunks), "--corpus", str(corpus),
                         "-t", "2", "--runs-dir", str(runs), "--json"])
    rows = json.loads(text[text.index("{"):text.rindex("}") + 1])["results"]
    board_s, _ = run([sys.executable, "-m", "qeval", "leaderboard", str(runs), "--out", str(work / "board")])

    common = ["-f", str(corpus), "-c", "512", "--chunks", str(args.chunks), "-t", "2"]
    base = work / "base.kld"
    llama_s, _ = run([lp, "-m", str(paths["Q8_0"]), *common, "--kl-divergence-base", str(base)])
    worst = {"ppl_rel": 0.0, "kld_rel": 0.0}
    for row in rows:
        cand = row["candidate"]
        quant, kv = cand["label"].split("+kv-") if "+kv-" in cand["label"] else (cand["label"], "f16")
        kv_args = ["-ctk", kv, "-ctv", kv, "-fa", "on"] if kv != "f16" else []
        s, out = run([lp, "-m", str(paths[quant]), *common, *kv_args, "--kl-divergence-base", str(base),
                      "--kl-divergence"])
        llama_s += s
        numbers = llama_numbers(out)
        ppl, kld = numbers["ppl_cand"], numbers["mean_kld"]
        worst["ppl_rel"] = max(worst["ppl_rel"], abs(row["perplexity"]["ppl_cand"] / ppl - 1))
        worst["kld_rel"] = max(worst["kld_rel"], abs(row["kld"]["mean"] / kld - 1))
    result = {"chunks": args.chunks, "pairs": len(rows), "qeval_matrix_s": qeval_s, "qeval_leaderboard_s": board_s,
              "llamacpp_s": llama_s, "time_ratio": qeval_s / llama_s, "worst_disagreement": worst,
              "leaderboard_dir": str(work / "board")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    # qeval's own numbers for the embedded default, as a baseline others can hold runs against
    doc = baselines.baseline_from_results(
        rows, title=f"qeval embedded default: Gemma-3-270M quants (derived from the published Q4_K_M) and KV types "
                    f"vs Q8_0, {args.chunks} chunks of 512", source_file="bench/bench_matrix.py")
    Path(args.baseline).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
