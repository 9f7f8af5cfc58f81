"""Boards decided early, simulated (issue 25, item 2): how many forward passes the stopping rule of
qeval.compare.early saves, whether the decided board has the full board's order and Pareto fronts, and whether
its intervals hold the full-run means at the stated confidence.

    python bench/bench_early.py                          # synthetic boards like the demo's (no model runs)
    python bench/bench_early.py --results qeval-runs     # the per-token results a `qeval matrix` saved

Every pair's per-chunk KLD sums over the whole corpus are known up front (from the saved `.npz` per-token
results, or generated); each seed draws a chunk order (early.chunk_order) and replays the matrix in rounds:
every pair visits min_chunks chunks, then early.decide() looks at the whole board and every pair it does not
stop visits the next `--step` chunks of the order (a pair stopped earlier may be asked to run again when its
neighbours move: counted as a reactivation). The full run's numbers are the same sums over all chunks.

Reported over the seeds: forward passes (chunks visited / pairs x chunks), model loads (rounds a pair ran in),
same order / same fronts as the full board, coverage (the share of (pair, seed), pairs stopped short of the
whole corpus, whose full-run mean lies inside the early interval), max |early - full| in early SEs, and why
pairs stopped. Writes JSON and a short markdown next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.compare import early, ranking
from qeval.compare.early import PairChunks, StopRule
from qeval.compare.stats import mean_se

OUT_DIR = Path(__file__).resolve().parent / "results"

# The demo board (bench/results/card-gemma3-270m-demo/card.json: gemma-3-270m vs its Q8_0, n_ctx 512): label,
# mean KLD, size GiB, memory GiB at n_ctx, KV-cache quant; plus Q2_K with a q4_0 KV cache (the matrix board's
# worst, bench/results/matrix-leaderboard.md) so the means span 0.003-0.7.
DEMO = (("Q8_0+kv-q8_0", 0.003307, 0.2715, 0.2762, True),
        ("Q4_K_M", 0.006577, 0.2357, 0.2445, False),
        ("Q8_0+kv-q4_0", 0.143712, 0.2715, 0.2740, True),
        ("Q3_K_M", 0.210383, 0.2253, 0.2341, False),
        ("Q4_0", 0.376419, 0.2248, 0.2336, False),
        ("Q2_K", 0.529775, 0.2208, 0.2296, False),
        ("Q2_K+kv-q4_0", 0.687253, 0.2208, 0.2233, True))
CONTROL = ("control", 0.0, 0.2715, 0.2803, False)
# a close neighbour: Q4_K_S, a little smaller than Q4_K_M and a few % worse (--close), its chunk and token noise
# 90 % Q4_K_M's
CLOSE = ("Q4_K_S", 0.2318, 0.2406, False)
CLOSE_RATIOS = (1.03, 1.01)

N_CHUNKS, TOKENS_PER_CHUNK = 80, 255  # the demo's: n_ctx 512, the second half of each window scored
CHUNK_SIGMA, TOKEN_SIGMA = 0.10, 1.0  # log-sd of a chunk's difficulty and of a token's KLD (heavy right tail)
CHUNK_SHARED, TOKEN_SHARED = 0.8, 0.6  # how much of that difficulty all pairs share (the same hard text)
CLOSE_SHARED = 0.9


@dataclass
class Board:
    """Every pair's per-chunk sums over the whole corpus, and its place on the fronts."""

    labels: list[str]
    sums: np.ndarray  # (pairs, chunks): sum of per-token KLD of each chunk
    tokens: np.ndarray  # (chunks,): scored tokens of each chunk (the same for every pair)
    size_gib: list
    memory_gib: list
    kv_quant: list[bool]
    control: list[bool]
    token_se: list[float]  # the per-token (llama-perplexity) SE of each pair's full-run mean
    source: str

    @property
    def n_chunks(self) -> int:
        return len(self.tokens)

    def pairs(self, order: np.ndarray, visited: list[int]) -> list[PairChunks]:
        return [PairChunks(lab, order[:n], self.sums[i, order[:n]], self.tokens[order[:n]], self.size_gib[i],
                           self.memory_gib[i], self.kv_quant[i], self.control[i])
                for i, (lab, n) in enumerate(zip(self.labels, visited))]


def synthetic_board(seed: int, close: float | None = None) -> Board:
    """Per-token KLD: mean x chunk difficulty x token noise, both lognormal, each part shared by all pairs and part
    the pair's own; the control is the reference itself (exactly 0, as on the demo at -c 512). close: add Q4_K_S
    with this times Q4_K_M's mean."""
    rng = np.random.default_rng(seed)
    shape = (N_CHUNKS, TOKENS_PER_CHUNK)
    chunk_common, token_common = rng.normal(size=N_CHUNKS), rng.normal(size=shape)
    rows = [*DEMO[:2], (CLOSE[0], DEMO[1][1] * close, *CLOSE[1:]), *DEMO[2:]] if close else list(DEMO)
    own: dict[str, tuple] = {}
    labels, sums, token_se = [CONTROL[0]], [np.zeros(N_CHUNKS)], [0.0]
    for label, mu, *_ in rows:
        a_own, b_own = rng.normal(size=N_CHUNKS), rng.normal(size=shape)
        if label == CLOSE[0]:
            a_m, b_m = own["Q4_K_M"]
            a_own = CLOSE_SHARED * a_m + math.sqrt(1 - CLOSE_SHARED ** 2) * a_own
            b_own = CLOSE_SHARED * b_m + math.sqrt(1 - CLOSE_SHARED ** 2) * b_own
        own[label] = (a_own, b_own)
        a = CHUNK_SHARED * chunk_common + math.sqrt(1 - CHUNK_SHARED ** 2) * a_own
        b = TOKEN_SHARED * token_common + math.sqrt(1 - TOKEN_SHARED ** 2) * b_own
        chunk_factor = np.exp(CHUNK_SIGMA * a - CHUNK_SIGMA ** 2 / 2)[:, None]
        kld = mu * chunk_factor * np.exp(TOKEN_SIGMA * b - TOKEN_SIGMA ** 2 / 2)
        labels.append(label)
        sums.append(kld.sum(axis=1))
        token_se.append(mean_se(kld.ravel())[1])
    facts = [CONTROL, *rows]
    return Board(labels, np.array(sums), np.full(N_CHUNKS, TOKENS_PER_CHUNK), [f[2] for f in facts],
                 [f[3] for f in facts], [f[4] for f in facts], [True] + [False] * len(rows), token_se,
                 f"synthetic demo{f' + Q4_K_S at {close:g}x Q4_K_M' if close else ''}, data seed {seed}")


def results_board(directory: str) -> Board:
    """The board of the saved results in `directory` (a runs dir or its results/), read with the leaderboard's
    own loader and checks (one reference, one token set)."""
    from qeval.present import leaderboard

    board = leaderboard.build([directory])
    ids = counts = None
    sums, token_se = [], []
    for row, res in zip(board.rows, board.results):
        if res.per_token is None:
            sys.exit(f"{res.origin} has no per-token values (.npz): cannot simulate it")
        got_ids, s, m = early.chunk_sums(res.per_token)
        if ids is None:
            ids, counts = got_ids, m
        elif not (np.array_equal(ids, got_ids) and np.array_equal(counts, m)):
            sys.exit(f"{res.origin} holds other chunks or tokens than {board.results[0].origin}")
        sums.append(s)
        token_se.append(mean_se(res.per_token["kld"])[1])
    rows = board.rows
    return Board([r.label for r in rows], np.array(sums), counts, [r.size_gib for r in rows],
                 [r.memory_estimate_gib for r in rows], [r.kv_quant for r in rows], [r.control for r in rows], token_se,
                 f"results in {directory}")


def simulate(board: Board, seed: int, rule: StopRule, step: int) -> dict:
    """One decided-early matrix over the chunk order of `seed`, played in rounds."""
    n_total, n_pairs = board.n_chunks, len(board.labels)
    order = early.chunk_order(n_total, seed)
    visited = [min(rule.min_chunks, n_total)] * n_pairs
    loads, reactivations, stopped = [1] * n_pairs, 0, [False] * n_pairs
    rounds = 1
    while True:
        decisions = early.decide(board.pairs(order, visited), n_total, rule)
        running = [i for i, d in enumerate(decisions) if not d.stop]
        if not running:
            break
        for i in running:
            reactivations += stopped[i]
            visited[i] = min(visited[i] + step, n_total)
            loads[i] += 1
        stopped = [d.stop for d in decisions]
        rounds += 1
    full = [early.ratio_estimate(board.sums[i], board.tokens, n_total, rule.confidence) for i in range(n_pairs)]
    est = [d.estimate for d in decisions]
    contenders = [i for i in range(n_pairs) if not board.control[i]]

    def ordered(means):
        return [board.labels[i] for i in sorted(range(n_pairs), key=lambda i: ranking.order_key(
            board.control[i], means[i], board.labels[i]))]

    def fronts(means):
        return ranking.on_fronts(board.kv_quant, board.control, board.size_gib, board.memory_gib, means)

    early_order, full_order = ordered([e.mean for e in est]), ordered([f.mean for f in full])
    ties = {(board.labels[i], t) for i, d in enumerate(decisions) for t in d.ties}
    rank = {lab: k for k, lab in enumerate(full_order)}
    swapped = [(a, b) for k, a in enumerate(early_order) for b in early_order[k + 1:] if rank[a] > rank[b]]
    pairs = []
    for i in contenders:
        e, f = est[i], full[i]
        short = e.n_chunks < n_total
        pairs.append({"label": board.labels[i], "chunks": e.n_chunks, "reason": decisions[i].reason,
                      "loads": loads[i], "early": e.mean, "se": e.se, "low": e.low, "high": e.high, "full": f.mean,
                      "covered": bool(e.low <= f.mean <= e.high) if short else None,
                      "error_se": abs(e.mean - f.mean) / e.se if short and e.se > 0 else None,
                      "ties": list(decisions[i].ties)})
    return {"seed": seed, "order": order.tolist(), "forward_fraction": sum(visited) / (n_pairs * n_total),
            "rounds": rounds, "reactivations": reactivations,
            "same_order": early_order == full_order,
            "guesses": [[a, b] for a, b in swapped if (a, b) not in ties and (b, a) not in ties],
            "declared_ties": sorted({tuple(sorted(t)) for t in ties}),
            "same_fronts": fronts([e.mean for e in est]) == fronts([f.mean for f in full]), "early_order": early_order, "pairs": pairs,
            "reasons": dict(Counter(d.reason for d in decisions))}


def summarize(board: Board, runs: list[dict], rule: StopRule, step: int, seconds: float) -> dict:
    n_total = board.n_chunks
    cases = [p for r in runs for p in r["pairs"]]
    short = [p for p in cases if p["covered"] is not None]
    errors = [p["error_se"] for p in short if p["error_se"] is not None]
    fractions = [r["forward_fraction"] for r in runs]
    full = [early.ratio_estimate(board.sums[i], board.tokens, n_total) for i in range(len(board.labels))]
    chunk_se = [early.ratio_estimate(board.sums[i], board.tokens, 10 ** 12).se for i in range(len(board.labels))]
    per_pair = {}
    for i, label in enumerate(board.labels):
        mine = [p for p in cases if p["label"] == label]
        if mine:
            per_pair[label] = {"full_mean": full[i].mean, "chunk_se": chunk_se[i], "token_se": board.token_se[i],
                               "chunk_over_token_se": chunk_se[i] / board.token_se[i] if board.token_se[i] else None,
                               "mean_chunks": float(np.mean([p["chunks"] for p in mine])),
                               "max_chunks": max(p["chunks"] for p in mine),
                               "reasons": dict(Counter(p["reason"] for p in mine))}
    return {
        "source": board.source, "pairs": board.labels, "chunks": n_total, "tokens": int(board.tokens.sum()),
        "rule": rule.to_json(), "step": step, "seeds": len(runs),
        "forward_fraction": {"mean": float(np.mean(fractions)), "min": min(fractions), "max": max(fractions)},
        "model_loads_per_pair": float(np.mean([p["loads"] for p in cases])),
        "rounds": {"mean": float(np.mean([r["rounds"] for r in runs])), "max": max(r["rounds"] for r in runs)},
        "reactivations": sum(r["reactivations"] for r in runs),
        "same_order": sum(r["same_order"] for r in runs), "same_fronts": sum(r["same_fronts"] for r in runs),
        "order_differences": [{"seed": r["seed"], "early_order": r["early_order"], "guesses": r["guesses"],
                               "declared_ties": r["declared_ties"]} for r in runs if not r["same_order"]],
        "same_order_up_to_ties": sum(not r["guesses"] for r in runs),
        "seeds_with_ties": sum(bool(r["declared_ties"]) for r in runs),
        "coverage": {"cases": len(short), "covered": sum(p["covered"] for p in short),
                     "share": sum(p["covered"] for p in short) / len(short) if short else None,
                     "nominal": rule.confidence, "all_chunk_cases": len(cases) - len(short)},
        "max_error_se": max(errors) if errors else None,
        "reasons": dict(Counter(p["reason"] for p in cases)),
        "per_pair": per_pair, "seconds": round(seconds, 2), "runs": runs,
    }


def markdown(results: list[dict]) -> str:
    lines = ["# Boards decided early: simulation", "",
             "Written by `bench/bench_early.py` (qeval.compare.early): each seed visits the chunks in a seeded random "
             "order, in rounds (every pair min_chunks, then `step` more for each pair the rule does not stop); "
             "compared with the full run over every chunk. Forward passes: chunks visited / (pairs × chunks). "
             "Coverage: (pair, seed) cases stopped short of the whole corpus whose full-run mean lies inside the "
             "early t-interval. Error: |early − full| in early SEs (chunk-level, with the finite-population "
             "correction). Same order up to declared ties: every pair of rows the early board orders otherwise than "
             "the full one was stopped on precision as a tie (within ±rel_precision of each other); a difference "
             "outside a declared tie is a guess.", ""]
    lines += ["| board | rule | seeds | forward passes (mean, max) | loads / pair | same order | same fronts | "
              "same order up to declared ties | coverage | max error (SE) | stopped because |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rule = r["rule"]
        text = (f"min {rule['min_chunks']}, ±{rule['rel_precision']:.0%} or {rule['neighbour_sigmas']:g} SE, "
                f"step {r['step']}" + (", precision alone" if rule["precision_alone"] else ""))
        cov = r["coverage"]
        share = "–" if cov["share"] is None else f"{cov['share']:.1%} ({cov['covered']}/{cov['cases']})"
        err = "–" if r["max_error_se"] is None else f"{r['max_error_se']:.2f}"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
        lines.append(f"| {r['source']} | {text} | {r['seeds']} | {r['forward_fraction']['mean']:.3f}× "
                     f"({r['forward_fraction']['max']:.3f}×) | {r['model_loads_per_pair']:.2f} | "
                     f"{r['same_order']}/{r['seeds']} | {r['same_fronts']}/{r['seeds']} | "
                     f"{r['same_order_up_to_ties']}/{r['seeds']} | {share} | {err} | "
                     f"{reasons} |")
    cal = [r for r in results if "calibration" in r]
    if cal:
        lines += ["", f"Over more seeds ({cal[0]['calibration']['seeds']}): " + "; ".join(
            f"{r['source']}: coverage {r['calibration']['coverage']['share']:.1%}, max error "
            f"{r['calibration']['max_error_se']:.2f} SE, same order {r['calibration']['same_order']} "
            f"({r['calibration']['same_order_up_to_ties']} up to declared ties), forward passes "
            f"{r['calibration']['forward_fraction']['mean']:.3f}×" for r in cal) + "."]
    lines += ["", "Chunks visited per pair (mean over seeds, of the corpus's):", ""]
    for r in results:
        rule = r["rule"]
        lines.append(f"- {r['source']}{', precision alone' if rule['precision_alone'] else ''}: " + ", ".join(
            f"{k} {v['mean_chunks']:.1f}" for k, v in r["per_pair"].items()) + f" of {r['chunks']}")
    first = results[0]["per_pair"]
    ratio = [v["chunk_over_token_se"] for v in first.values() if v["chunk_over_token_se"]]
    if ratio:
        lines += ["", f"The data ({results[0]['source']}): chunk-level SE / per-token SE of the full-run means "
                      f"{min(ratio):.2f}–{max(ratio):.2f} (the demo board: ~1.5)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", help="a runs dir (or its results/) of `qeval matrix`: simulate its saved results")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--calibration-seeds", type=int, default=200,
                    help="seeds of a second, larger coverage count (0: none)")
    ap.add_argument("--step", type=int, default=4, help="chunks a pair runs on per round once past the minimum")
    ap.add_argument("--min-chunks", type=int, default=early.MIN_CHUNKS)
    ap.add_argument("--rel-precision", type=float, default=early.REL_PRECISION)
    ap.add_argument("--neighbour-sigmas", type=float, default=early.NEIGHBOUR_SIGMAS)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--data-seed", type=int, default=0, help="synthetic data: the corpus drawn")
    ap.add_argument("--close", type=float, nargs="*", default=list(CLOSE_RATIOS),
                    help="synthetic data: also boards with Q4_K_S at these multiples of Q4_K_M's mean KLD")
    ap.add_argument("--precision-alone", action="store_true", help="StopRule(precision_alone=True)")
    ap.add_argument("--out", help="JSON path (default bench/results/early-simulation-{synthetic,results}.json)")
    args = ap.parse_args(argv)
    rule = StopRule(args.min_chunks, args.rel_precision, args.neighbour_sigmas, args.confidence, args.precision_alone)
    if args.results:
        boards = [results_board(args.results)]
    else:
        boards = [synthetic_board(args.data_seed), *(synthetic_board(args.data_seed, c) for c in args.close)]
    name = "results" if args.results else "synthetic"
    out = Path(args.out) if args.out else OUT_DIR / f"early-simulation-{name}.json"
    results = []
    for board in boards:
        t = time.perf_counter()
        runs = [simulate(board, seed, rule, args.step) for seed in range(args.seeds)]
        results.append(summarize(board, runs, rule, args.step, time.perf_counter() - t))
        s = results[-1]
        if args.calibration_seeds:
            more = summarize(board, [simulate(board, seed, rule, args.step) for seed in range(args.calibration_seeds)],
                             rule, args.step, 0.0)
            s["calibration"] = {"seeds": args.calibration_seeds, "coverage": more["coverage"],
                                "max_error_se": more["max_error_se"], "same_order": more["same_order"],
                                "same_order_up_to_ties": more["same_order_up_to_ties"],
                                "forward_fraction": more["forward_fraction"]}
        print(f"{board.source}: forward passes {s['forward_fraction']['mean']:.3f}x, same order "
              f"{s['same_order']}/{s['seeds']} ({s['same_order_up_to_ties']} up to declared ties), same fronts "
              f"{s['same_fronts']}/{s['seeds']}, coverage {s['coverage']['share']}, max error "
              f"{s['max_error_se']} SE, reasons {s['reasons']}")
    doc = {"bench": "bench/bench_early.py", "python": platform.python_version(), "argv": sys.argv[1:],
           "numpy": np.__version__, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc) + "\n")  # compact: the per-seed runs (orders included) are most of it
    out.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
