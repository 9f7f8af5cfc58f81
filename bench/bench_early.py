"""Boards decided early, replayed (issues 25 and 35): whether the intervals of qeval.compare.early hold the full
run's means at the stated confidence, how many forward passes the stop rule saves, and whether the decided board
has the full board's order, for today's rule and the rule before issue 35, side by side.

    python bench/bench_early.py                                   # synthetic skewed boards like the demo's
    python bench/bench_early.py --results /work/runs/demo80       # the per-token results a `qeval matrix` saved

Every pair's per-chunk KLD sums over the whole corpus are known up front (the saved `.npz` per-token results, or
generated). A corpus of L chunks is the first L chunks (by id) of that board (--lengths: 20, 40, 80). Each seed
draws a chunk order (early.chunk_order) and replays the matrix's rounds (qeval.orchestrate.matrix
.decide_in_rounds): every pair visits min_chunks chunks, then early.decide() (the product's rule, not a copy)
reads the whole board and every pair it does not stop visits the next `step` chunks. The full run's means are the
same sums over all L chunks.

Reported per corpus length and rule, over the seeds:
- coverage: the share of (pair, seed) cases, pairs stopped short of the whole corpus, whose full-run mean lies
  inside the early interval the pair stopped on; its Monte Carlo error as the binomial SE sqrt(p (1 - p) / cases)
  and, since the pairs of one seed share its chunks, the SE clustered by seed (the larger, honest one); per pair too;
- forward passes: chunks visited / (pairs x L), mean and max over seeds, and as a share of the full board of the
  longest corpus (the issue's goal: <= 0.15x of the 80-chunk demo board);
- same order / same Pareto fronts as the full board, and the same order up to declared ties (rows the early board
  orders otherwise only where the rule stopped them as a tie; any other swap is a guess), why pairs stopped.

Writes JSON and a markdown table next to it. 1,000 seeds x 3 lengths x 2 rules of a 9-pair board take a few
minutes on one core (decide() is cheap: a few hundred small numpy sums per round).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from qeval.compare.depth import cluster_se_of_sums
from qeval.compare.early import PairChunks, StopRule

OUT_DIR = Path(__file__).resolve().parent / "results"
LENGTHS = (20, 40, 80)
RULES = (early.FIXED_T, early.SPENT)
RULE_NAMES = {early.FIXED_T: "before (t, fixed 95 %)", early.SPENT: "now (log-scale, error spent over looks)"}

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
# the close pair of issue 35: KV q8_0 with its rotation off against on (docs/numerics.md: 0.0039 vs 0.0032; the
# demo80 board ~0.0041 vs 0.0033), the same memory, most of their chunk and token noise shared
CLOSE = ("Q8_0+kv-q8_0-norot", 0.0041, 0.2715, 0.2762, True)
CLOSE_OF = "Q8_0+kv-q8_0"
CLOSE_SHARED = 0.9

N_CHUNKS, TOKENS_PER_CHUNK = 80, 255  # the demo's: n_ctx 512, the second half of each window scored
# log-sd of a chunk's difficulty (0.35: per-chunk sums with skewness ~1, on which the rule before issue 35 covered
# ~92-94 % at 8 chunks, as on the real boards) and of a token's KLD (heavy right tail)
CHUNK_SIGMA, TOKEN_SIGMA = 0.35, 1.0
CHUNK_SHARED, TOKEN_SHARED = 0.8, 0.6  # how much of that difficulty all pairs share (the same hard text)


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
    source: str

    @property
    def n_chunks(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> "Board":
        """The board over its first n chunks (by id): a shorter corpus of the same text."""
        return dataclasses.replace(self, sums=self.sums[:, :n], tokens=self.tokens[:n])

    def pairs(self, order: np.ndarray, visited: list[int]) -> list[PairChunks]:
        return [PairChunks(lab, order[:n], self.sums[i, order[:n]], self.tokens[order[:n]], self.size_gib[i],
                           self.memory_gib[i], self.kv_quant[i], self.control[i])
                for i, (lab, n) in enumerate(zip(self.labels, visited))]

    def full_means(self) -> np.ndarray:
        return self.sums.sum(axis=1) / self.tokens.sum()


def synthetic_board(seed: int, close: bool = True, chunk_sigma: float = CHUNK_SIGMA) -> Board:
    """Per-token KLD: mean x chunk difficulty x token noise, both lognormal, each part shared by all pairs and part
    the pair's own; the control is the reference itself (exactly 0, as on the demo at -c 512). close: add the KV
    q8_0 pair with its rotation off, most of its noise shared with the one with rotation on."""
    rng = np.random.default_rng(seed)
    shape = (N_CHUNKS, TOKENS_PER_CHUNK)
    chunk_common, token_common = rng.normal(size=N_CHUNKS), rng.normal(size=shape)
    rows = [DEMO[0], CLOSE, *DEMO[1:]] if close else list(DEMO)
    own: dict[str, tuple] = {}
    sums = [np.zeros(N_CHUNKS)]
    for label, mu, *_ in rows:
        a_own, b_own = rng.normal(size=N_CHUNKS), rng.normal(size=shape)
        if label == CLOSE[0]:
            a_m, b_m = own[CLOSE_OF]
            a_own = CLOSE_SHARED * a_m + math.sqrt(1 - CLOSE_SHARED ** 2) * a_own
            b_own = CLOSE_SHARED * b_m + math.sqrt(1 - CLOSE_SHARED ** 2) * b_own
        own[label] = (a_own, b_own)
        a = CHUNK_SHARED * chunk_common + math.sqrt(1 - CHUNK_SHARED ** 2) * a_own
        b = TOKEN_SHARED * token_common + math.sqrt(1 - TOKEN_SHARED ** 2) * b_own
        chunk_factor = np.exp(chunk_sigma * a - chunk_sigma ** 2 / 2)[:, None]
        sums.append((mu * chunk_factor * np.exp(TOKEN_SIGMA * b - TOKEN_SIGMA ** 2 / 2)).sum(axis=1))
    facts = [CONTROL, *rows]
    return Board([f[0] for f in facts], np.array(sums), np.full(N_CHUNKS, TOKENS_PER_CHUNK),
                 [f[2] for f in facts], [f[3] for f in facts], [f[4] for f in facts], [True] + [False] * len(rows),
                 f"synthetic demo{' + ' + CLOSE[0] if close else ''}, chunk log-sd {chunk_sigma:g}, data seed {seed}")


def results_board(directory: str) -> Board:
    """The board of the saved results in `directory` (a runs dir or its results/), read with the leaderboard's
    own loader and checks (one reference, one token set); the control and the floor pinned, as on a matrix's board."""
    from qeval.present import board as boardrows
    from qeval.present import leaderboard

    board = leaderboard.build([directory])
    ids = counts = None
    sums = []
    for res in board.results:
        if res.per_token is None:
            sys.exit(f"{res.origin} has no per-token values (.npz): cannot replay it")
        got_ids, s, m = early.chunk_sums(res.per_token)
        if ids is None:
            ids, counts = got_ids, m
        elif not (np.array_equal(ids, got_ids) and np.array_equal(counts, m)):
            sys.exit(f"{res.origin} holds other chunks or tokens than {board.results[0].origin}: finish every pair "
                     "over the same chunks first")
        sums.append(s)
    rows = board.rows
    return Board([r.label for r in rows], np.array(sums), counts, [r.size_gib for r in rows],
                 [r.memory_estimate_gib for r in rows], [r.kv_quant for r in rows],
                 [boardrows.is_baseline(r) for r in rows],  # the control and the floor, as matrix.decisions_of
                 f"results in {directory}")


def replay(board: Board, seed: int, rule: StopRule) -> tuple[list[early.Decision], int]:
    """One decided-early matrix over the chunk order of `seed`, in the rounds of matrix.decide_in_rounds: (the last
    round's decisions, the rounds)."""
    n_total, n_pairs = board.n_chunks, len(board.labels)
    order = early.chunk_order(n_total, seed)
    visited = [min(rule.min_chunks, n_total)] * n_pairs
    rounds = 1
    while True:
        decisions = early.decide(board.pairs(order, visited), n_total, rule)
        running = [i for i, d in enumerate(decisions) if not d.stop]
        if not running:
            return decisions, rounds
        for i in running:
            visited[i] = min(decisions[i].n_chunks + rule.step, n_total)
        rounds += 1


def simulate(board: Board, seeds: int, rule: StopRule) -> dict:
    """Every seed's replay, as arrays over (seed, pair): chunks visited, the early interval, why it stopped; and
    per seed whether the early board has the full board's order (up to declared ties) and fronts."""
    n_pairs = len(board.labels)
    full = board.full_means()
    contenders = [i for i in range(n_pairs) if not board.control[i]]
    full_order = _ordered(board, full)
    full_fronts = _fronts(board, full)
    chunks = np.zeros((seeds, n_pairs), dtype=np.int64)
    mean, low, high, se = (np.zeros((seeds, n_pairs)) for _ in range(4))
    reasons, rounds = Counter(), []
    same_order, same_fronts, up_to_ties, with_ties = 0, 0, 0, 0
    first = []
    for seed in range(seeds):
        decisions, n_rounds = replay(board, seed, rule)
        rounds.append(n_rounds)
        if seed == 0:  # the board `qeval matrix --early` (seed 0) decides on these results
            first = [{"label": d.label, "chunks": d.n_chunks, "stopped": d.reason, "early": d.estimate.mean,
                      "low": d.estimate.low, "high": d.estimate.high, "full": float(full[i])}
                     for i, d in enumerate(decisions) if i in contenders]
        for i, d in enumerate(decisions):
            e = d.estimate
            chunks[seed, i], mean[seed, i], low[seed, i], high[seed, i], se[seed, i] = (
                e.n_chunks, e.mean, e.low, e.high, e.se)
        reasons.update(decisions[i].reason for i in contenders)
        got = _ordered(board, mean[seed])
        ties = {frozenset((d.label, t)) for d in decisions for t in d.ties}
        rank = {lab: k for k, lab in enumerate(full_order)}
        guesses = [(a, b) for k, a in enumerate(got) for b in got[k + 1:]
                   if rank[a] > rank[b] and frozenset((a, b)) not in ties]
        same_order += got == full_order
        up_to_ties += not guesses
        with_ties += bool(ties)
        same_fronts += _fronts(board, mean[seed]) == full_fronts
    return {"chunks": chunks, "mean": mean, "low": low, "high": high, "se": se, "full": full,
            "contenders": contenders, "seed_0": first, "reasons": reasons, "rounds": rounds, "same_order": same_order,
            "same_order_up_to_ties": up_to_ties, "seeds_with_ties": with_ties, "same_fronts": same_fronts}


def _ordered(board: Board, means) -> list[str]:
    return [board.labels[i] for i in sorted(range(len(board.labels)), key=lambda i: ranking.order_key(
        board.control[i], means[i], board.labels[i]))]


def _fronts(board: Board, means) -> list[bool]:
    return ranking.on_fronts(board.kv_quant, board.control, board.size_gib, board.memory_gib, list(means))


def coverage(covered: np.ndarray, short: np.ndarray) -> dict:
    """Coverage over the (seed, pair) cases stopped short of every chunk, with its Monte Carlo errors: binomial,
    and clustered by seed (the pairs of one seed share its chunks: the cases are not independent)."""
    cases = int(short.sum())
    hits = int((covered & short).sum())
    if not cases:
        return {"cases": 0, "covered": 0, "share": None, "binomial_se": None, "seed_se": None}
    p = hits / cases
    per_seed = short.sum(axis=1) > 0
    seed_se = cluster_se_of_sums((covered & short).sum(axis=1)[per_seed], short.sum(axis=1)[per_seed])
    return {"cases": cases, "covered": hits, "share": p, "binomial_se": math.sqrt(p * (1 - p) / cases),
            "seed_se": seed_se if math.isfinite(seed_se) else None}


def summarize(board: Board, sim: dict, rule: StopRule, full_board_chunks: int, seconds: float) -> dict:
    n_total, seeds = board.n_chunks, len(sim["rounds"])
    cols = sim["contenders"]
    chunks, full = sim["chunks"], sim["full"]
    covered = (sim["low"] <= full) & (full <= sim["high"])
    short = chunks < n_total
    fraction = chunks.sum(axis=1) / (len(board.labels) * n_total)
    short_cases = short[:, cols] & (sim["se"][:, cols] > 0)
    errors = (np.abs(sim["mean"] - full)[:, cols][short_cases] / sim["se"][:, cols][short_cases])
    per_chunk = board.sums / board.tokens
    centred = per_chunk - per_chunk.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):  # a control of exact zeros has no skew
        skew = (centred ** 3).mean(axis=1) / (centred ** 2).mean(axis=1) ** 1.5
    per_pair = {board.labels[i]: {"full_mean": float(full[i]), "chunk_skewness": float(skew[i]),
                                  "mean_chunks": float(chunks[:, i].mean()),
                                  "max_chunks": int(chunks[:, i].max()),
                                  "coverage": coverage(covered[:, [i]], short[:, [i]])} for i in cols}
    return {
        "source": board.source, "pairs": board.labels, "chunks": n_total, "tokens": int(board.tokens.sum()),
        "rule": rule.to_json(), "seeds": seeds,
        "coverage": {**coverage(covered[:, cols], short[:, cols]), "nominal": rule.confidence,
                     "all_chunk_cases": int((~short[:, cols]).sum())},
        "forward_fraction": {"mean": float(fraction.mean()), "max": float(fraction.max()),
                             "min": float(fraction.min())},
        "of_longest_board": {"mean": float(chunks.sum(axis=1).mean() / (len(board.labels) * full_board_chunks)),
                             "max": float(chunks.sum(axis=1).max() / (len(board.labels) * full_board_chunks)),
                             "chunks": full_board_chunks},
        "rounds": {"mean": float(np.mean(sim["rounds"])), "max": int(max(sim["rounds"]))},
        "same_order": sim["same_order"], "same_order_up_to_ties": sim["same_order_up_to_ties"],
        "seeds_with_ties": sim["seeds_with_ties"], "same_fronts": sim["same_fronts"],
        "max_error_se": float(errors.max()) if len(errors) else None,
        "reasons": dict(sim["reasons"]), "per_pair": per_pair, "seed_0": sim["seed_0"], "seconds": round(seconds, 2),
    }


def _pct(c: dict) -> str:
    if c["share"] is None:
        return "–"
    seed = f", by seed ±{c['seed_se']:.1%}" if c.get("seed_se") is not None else ""
    return f"{c['share']:.1%} ± {c['binomial_se']:.1%}{seed} ({c['covered']}/{c['cases']})"


def markdown(results: list[dict], close: str | None) -> str:
    rule = results[0]["rule"]
    lines = ["# Boards decided early: replayed coverage, before and after issue 35", "",
             f"Written by `bench/bench_early.py` from {results[0]['source']}: each seed visits the chunks in a "
             "seeded random order in the matrix's rounds (every pair "
             f"{rule['min_chunks']} chunks, then {rule['step']} more for each pair `early.decide()` does not stop; "
             f"±{rule['rel_precision']:.0%} or neighbours {rule['neighbour_sigmas']:g} SE apart, "
             f"{rule['confidence']:.0%} stated), compared with the full run over every chunk of a corpus of the "
             "board's first L chunks. Coverage: (pair, seed) cases stopped short of the whole corpus whose full-run "
             "mean lies inside the interval the pair stopped on, ± its Monte Carlo error (binomial SE; clustered by "
             "seed, the pairs of one seed sharing its chunks). Forward passes: chunks visited / (pairs × L), mean "
             f"(max) over seeds, and as a share of the {results[0]['of_longest_board']['chunks']}-chunk board.", "",
             "| chunks | rule | seeds | coverage ± MC error | " + (f"{close} coverage | " if close else "")
             + "forward passes, mean (max) | of the full longest board | same order (up to declared ties) | "
               "same fronts | stopped because |",
             "|---|---|---|---|" + ("---|" if close else "") + "---|---|---|---|---|"]
    for r in results:
        c = r["coverage"]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
        close_cell = f"{_pct(r['per_pair'][close]['coverage'])} | " if close else ""
        lines.append(
            f"| {r['chunks']} | {RULE_NAMES[r['rule']['interval']]} | {r['seeds']} | {_pct(c)} | {close_cell}"
            f"{r['forward_fraction']['mean']:.3f}× ({r['forward_fraction']['max']:.3f}×) | "
            f"{r['of_longest_board']['mean']:.3f}× ({r['of_longest_board']['max']:.3f}×) | "
            f"{r['same_order']}/{r['seeds']} ({r['same_order_up_to_ties']}) | {r['same_fronts']}/{r['seeds']} | "
            f"{reasons} |")
    last = results[-1]
    lines += ["", f"The board decided early with seed 0 (what `qeval matrix --early` decides on these results), "
                  f"{last['chunks']} chunks, {RULE_NAMES[last['rule']['interval']]}, against the full run:", "",
              "| pair | chunks | stopped | early mean [interval] | full mean | inside |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['label']} | {p['chunks']} | {p['stopped']} | {p['early']:.6f} [{p['low']:.6f}, {p['high']:.6f}] | "
              f"{p['full']:.6f} | {'yes' if p['low'] <= p['full'] <= p['high'] else 'no'} |" for p in last["seed_0"]]
    lines += ["", "Chunks visited per pair (mean over seeds):", ""]
    for r in results:
        lines.append(f"- {r['chunks']} chunks, {RULE_NAMES[r['rule']['interval']]}: " + ", ".join(
            f"{k} {v['mean_chunks']:.1f}" for k, v in r["per_pair"].items()))
    lines += ["", f"Skewness of the per-chunk mean KLD over the {last['chunks']} chunks: " + ", ".join(
        f"{k} {v['chunk_skewness']:.2f}" for k, v in last["per_pair"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", help="a runs dir (or its results/) of `qeval matrix`: replay its saved results")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                    help="corpus lengths in chunks (the board's first L chunks each)")
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--rules", nargs="+", choices=early.INTERVALS, default=list(RULES),
                    help="the intervals to compare (fixed-t: the rule before issue 35)")
    ap.add_argument("--step", type=int, default=early.STEP, help="chunks a pair runs on per round past the minimum")
    ap.add_argument("--min-chunks", type=int, default=early.MIN_CHUNKS)
    ap.add_argument("--rel-precision", type=float, default=early.REL_PRECISION)
    ap.add_argument("--neighbour-sigmas", type=float, default=early.NEIGHBOUR_SIGMAS)
    ap.add_argument("--confidence", type=float, default=early.CONFIDENCE)
    ap.add_argument("--precision-alone", action="store_true", help="StopRule(precision_alone=True)")
    ap.add_argument("--close", default=CLOSE[0], help="the close pair whose coverage is shown apart ('' for none)")
    ap.add_argument("--data-seed", type=int, default=0, help="synthetic data: the corpus drawn")
    ap.add_argument("--chunk-sigma", type=float, default=CHUNK_SIGMA, help="synthetic data: chunk difficulty log-sd")
    ap.add_argument("--out", help="JSON path (default bench/results/early-simulation-{synthetic,results}.json)")
    args = ap.parse_args(argv)
    board = (results_board(args.results) if args.results
             else synthetic_board(args.data_seed, bool(args.close), args.chunk_sigma))
    lengths = [n for n in args.lengths if n <= board.n_chunks]
    if not lengths:
        sys.exit(f"the board holds {board.n_chunks} chunks: no corpus of {args.lengths} chunks in it")
    close = args.close if args.close in board.labels else None
    name = "results" if args.results else "synthetic"
    out = Path(args.out) if args.out else OUT_DIR / f"early-simulation-{name}.json"
    results = []
    for n in lengths:
        for interval in args.rules:
            rule = StopRule(min_chunks=args.min_chunks, rel_precision=args.rel_precision,
                            neighbour_sigmas=args.neighbour_sigmas, confidence=args.confidence,
                            precision_alone=args.precision_alone, step=args.step, interval=interval)
            t = time.perf_counter()
            sim = simulate(board.first(n), args.seeds, rule)
            s = summarize(board.first(n), sim, rule, max(lengths), time.perf_counter() - t)
            results.append(s)
            c = s["coverage"]
            print(f"{n} chunks, {interval}: coverage {_pct(c)}, forward passes {s['forward_fraction']['mean']:.3f}x "
                  f"(max {s['forward_fraction']['max']:.3f}x), same order {s['same_order']}/{s['seeds']} "
                  f"({s['same_order_up_to_ties']} up to ties), {s['reasons']}, {s['seconds']:.0f} s", flush=True)
    doc = {"bench": "bench/bench_early.py", "python": platform.python_version(), "argv": sys.argv[1:] if argv is None
           else list(argv), "numpy": np.__version__, "machine": platform.processor() or platform.machine(),
           "close": close, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results, close))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
