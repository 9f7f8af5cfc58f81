"""A board decided early against the full board, on real models (issue 25, item 2: `qeval matrix --early`).

    python bench/bench_early_matrix.py [--chunks 20] [--ctx 512] [--seed 0] [--q4-k-s] [--out bench/results/...json]

Gemma-3-270M (the demo's quants: Q4_K_M, Q3_K_M, Q2_K, Q4_0 against Q8_0, KV f16, no control or floor row), in one
fresh runs directory, in-process through qeval.api:
  1. the reference captured (a matrix of no pairs);
  2. the matrix with --early (the issue's rule: at least 8 chunks, ±5 % or neighbours 3 SE apart, step 4): each
     pair's early estimate (chunk-level, with the finite-population correction) read from its saved early result;
  3. the same matrix without --early, which extends every pair from its checkpoint to every chunk: the full board.
Forward passes: chunks each pair ran (a chunk is decoded once: the full run decodes only the chunks the early one
did not). Wall and CPU seconds of steps 2 and 3; the full board's time is theirs together (the same chunks, each
decoded once), and the time per pair-chunk of each step is recorded too. Compared: order, Pareto fronts,
|early - full| in early SEs, whether each full mean lies inside its early interval. Then bench/bench_early.py
replays the same per-token results over many seeds (coverage, same order over seeds).

--q4-k-s adds Q4_K_S requantized from Q4_K_M (into the runs directory's models/), meant as Q4_K_M's close neighbour
(where the rule must run longer rather than guess). Requantized from a Q4_K_M it is not close: 5x Q4_K_M's mean
KLD on this board (a Q4_K_S made from F16 weights would be; the demo ships none).
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

from qeval import api
from qeval.compare import early, ranking
from qeval.orchestrate import demo
from qeval.present import results
from qeval.storage.results import result_path
from qeval.storage.runs import RESULTS_SUBDIR

CANDIDATES = ("Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0")
CLOSE = ("Q4_K_S", 14)  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_S
OUT_DIR = Path(__file__).resolve().parent / "results"


def timed(call) -> tuple[dict, str, float, float]:
    """(JSON, text, wall seconds, CPU seconds of this process, every thread) of a call."""
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    result, text = call()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return result, text, time.perf_counter() - t0, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def ranked(rows: list[dict]) -> list[str]:
    return [r["label"] for r in sorted(rows, key=lambda r: ranking.order_key(r["control"], r["kld_mean"], r["label"]))]


def fronts(rows: list[dict]) -> dict[str, bool]:
    on = ranking.on_fronts([r["kv_quant"] if "kv_quant" in r else r["type_k"] != "f16" for r in rows],
                           [r["control"] for r in rows], [r["size_gib"] for r in rows],
                           [r["memory_estimate_gib"] for r in rows], [r["kld_mean"] for r in rows])
    return {r["label"]: f for r, f in zip(rows, on)}


def early_estimates(runs: Path, ref: str, labels, n_chunks: int, rule: early.StopRule) -> dict[str, dict]:
    """Each pair's chunk-level estimate, with the rule's interval, from its saved early result (before the full run
    replaces it)."""
    out = {}
    for label in labels:
        res = results.load_result(result_path(runs / RESULTS_SUBDIR, label, ref))
        _, sums, tokens = early.chunk_sums(res.per_token)
        out[label] = early.pair_estimate(sums, tokens, n_chunks, rule).to_json()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", help="runs directory to use and keep (default: a temporary one)")
    ap.add_argument("--q4-k-s", action="store_true", help="add Q4_K_S, requantized from Q4_K_M")
    ap.add_argument("--out", default=str(OUT_DIR / "early-matrix-gemma3-270m-amd-epyc.json"))
    args = ap.parse_args(argv)
    paths = demo.prepare_models(demo.models_dir())
    runs = Path(args.runs) if args.runs else Path(tempfile.mkdtemp(prefix="qeval-early-"))
    candidates = CANDIDATES
    if args.q4_k_s:
        (runs / "models").mkdir(parents=True, exist_ok=True)
        paths[CLOSE[0]] = demo.quantize(paths["Q4_K_M"], demo.model_path(CLOSE[0], runs / "models"), CLOSE[1])
        candidates += (CLOSE[0],)
    ref = f"Q8_0={paths['Q8_0']}"
    models = [f"{q}={paths[q]}" for q in candidates]
    common = dict(chunks=args.chunks, n_ctx=args.ctx, runs_dir=runs, progress=False, control=False, floor="none")
    _, _, ref_wall, ref_cpu = timed(lambda: api.matrix_report(ref, [], ["f16"], **common))
    settings = api.early_settings(seed=args.seed)
    early_json, early_text, early_wall, early_cpu = timed(
        lambda: api.matrix_report(ref, models, ["f16"], early=settings, **common))
    estimates = early_estimates(runs, "Q8_0", candidates, args.chunks, settings.rule)
    full_json, full_text, ext_wall, ext_cpu = timed(lambda: api.matrix_report(ref, models, ["f16"], **common))

    early_rows, full_rows = {r["label"]: r for r in early_json["rows"]}, {r["label"]: r for r in full_json["rows"]}
    ran = {label: r["chunks"] for label, r in early_rows.items()}
    n_full = args.chunks * len(candidates)
    pairs = {}
    for label in candidates:
        est, full_mean = estimates[label], full_rows[label]["kld_mean"]
        error = abs(est["mean"] - full_mean)
        pairs[label] = {"chunks": ran[label], "scored_tokens": early_rows[label]["scored_tokens"],
                        "stopped": early_rows[label]["stopped"], "early": est, "full_mean": full_mean,
                        "full_token_se": full_rows[label]["kld_mean_se"],
                        "error_se": error / est["se"] if est["se"] else None,
                        # a pair that ran every chunk is the full one (no interval: SE 0)
                        "full_inside_interval": None if ran[label] == args.chunks else
                        bool(est["low"] <= full_mean <= est["high"])}
    early_cpu_per = early_cpu / sum(ran.values())
    doc = {
        "bench": "bench/bench_early_matrix.py", "argv": sys.argv[1:],
        "machine": f"{cpu_name()}, 2 cores, shared with other jobs (wall times inflated by their load)",
        "models": "Gemma-3-270M quants requantized from the published Q4_K_M (qeval demo's"
                  + (", and Q4_K_S from it" if args.q4_k_s else "") + ")",
        "reference": "Q8_0", "candidates": list(candidates), "n_ctx": args.ctx, "chunks": args.chunks,
        "rule": settings.rule.to_json(), "seed": settings.seed,
        "order": early_json["early"]["order"],
        "reference_capture": {"wall_s": round(ref_wall, 1), "cpu_s": round(ref_cpu, 1), "forward_passes": args.chunks},
        "early": {"wall_s": round(early_wall, 1), "cpu_s": round(early_cpu, 1), "forward_passes": sum(ran.values()),
                  "cpu_s_per_pair_chunk": round(early_cpu_per, 2)},
        "extension_to_full": {"wall_s": round(ext_wall, 1), "cpu_s": round(ext_cpu, 1),
                              "forward_passes": n_full - sum(ran.values())},
        "full": {"wall_s": round(early_wall + ext_wall, 1), "cpu_s": round(early_cpu + ext_cpu, 1),
                 "forward_passes": n_full},
        "forward_fraction": sum(ran.values()) / n_full,
        "same_order": ranked(early_json["rows"]) == ranked(full_json["rows"]),
        "early_order": ranked(early_json["rows"]), "full_order": ranked(full_json["rows"]),
        "same_fronts": fronts(early_json["rows"]) == fronts(full_json["rows"]),
        "fronts": fronts(full_json["rows"]),
        "max_error_se": max((p["error_se"] for p in pairs.values() if p["error_se"] is not None), default=None),
        "pairs": pairs,
    }
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    board = early_text[early_text.index("Leaderboard"):]
    out.with_suffix(".md").write_text(markdown(doc, board))
    sim = out.with_name(out.stem.replace("early-matrix", "early-simulation") + ".json")
    subprocess.run([sys.executable, str(Path(__file__).with_name("bench_early.py")), "--results", str(runs),
                    "--out", str(sim)], check=True)
    print(out.with_suffix(".md").read_text())
    if not args.runs:
        shutil.rmtree(runs)


def markdown(d: dict, board: str) -> str:
    e, f, x = d["early"], d["full"], d["extension_to_full"]
    lines = [
        "# A board decided early vs the full board: Gemma-3-270M", "",
        f"Written by `bench/bench_early_matrix.py` on {d['machine']}. {d['models']}; reference {d['reference']}, "
        f"candidates {', '.join(d['candidates'])} (KV f16, no control or floor row), n_ctx {d['n_ctx']}, "
        f"{d['chunks']} chunks. Rule: at least {d['rule']['min_chunks']} chunks, ±{d['rule']['rel_precision']:.0%} "
        f"at {d['rule']['confidence']:.0%} or neighbours {d['rule']['neighbour_sigmas']:g} SE apart, "
        f"{d['rule']['step']} chunks a round, seed {d['seed']}. The full board is the early one extended from its "
        "checkpoints (each chunk decoded once): its time is the two runs' together.", "",
        "| | forward passes (pair-chunks) | wall s | CPU s |", "|---|---|---|---|",
        f"| reference capture (both) | {d['reference_capture']['forward_passes']} | "
        f"{d['reference_capture']['wall_s']} | {d['reference_capture']['cpu_s']} |",
        f"| --early | {e['forward_passes']} ({d['forward_fraction']:.2f}×) | {e['wall_s']} | {e['cpu_s']} |",
        f"| extension to every chunk | {x['forward_passes']} | {x['wall_s']} | {x['cpu_s']} |",
        f"| full board | {f['forward_passes']} | {f['wall_s']} | {f['cpu_s']} |", "",
        f"Same order: {'yes' if d['same_order'] else 'no'} ({' < '.join(d['early_order'])}; full: "
        f"{' < '.join(d['full_order'])}). Same Pareto fronts: {'yes' if d['same_fronts'] else 'no'}. "
        f"Max |early − full|: {_se(d['max_error_se'])} early SEs (chunk-level, with the finite-population "
        "correction; none when every pair ran every chunk).",
        "", "| pair | chunks | stopped | early mean ± SE (chunks) | full mean | full inside the early 95 % interval |",
        "|---|---|---|---|---|---|"]
    for label, p in d["pairs"].items():
        lines.append(f"| {label} | {p['chunks']} | {p['stopped']} | {p['early']['mean']:.6f} ± {p['early']['se']:.6f} "
                     f"| {p['full_mean']:.6f} | {_inside(p['full_inside_interval'])} |")
    return "\n".join(lines + ["", "The early board as `qeval matrix --early` printed it:", "", board]) + "\n"


def _inside(x: bool | None) -> str:
    return "– (every chunk)" if x is None else "yes" if x else "no"


def _se(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
