"""Boards decided early (opt-in): the statistics that let a pair stop before the whole corpus, and the rule.

Chunks are the sampling unit. A pair visits the corpus's N chunks in a seeded random order (chunk_order; the
seed and the order are recorded), so the chunks it has visited are a simple random sample without replacement,
and a later run extends that prefix instead of starting again. After n chunks, with S_c the sum of the per-token
KLD of chunk c and m_c its scored tokens:

    mean  R = sum(S_c) / sum(m_c)                                  (token-weighted: the full run's mean at n = N)
    SE^2  = (1 - n/N) * n/(n-1) * sum((S_c - R m_c)^2) / sum(m_c)^2  (ratio estimator over chunks, with the
                                                                    finite-population correction: 0 at n = N)
    q     = t_{1 - alpha_k/2, n-1}                                  (the look's quantile, below)
    a pair's mean:        R * exp(-q SE / R) .. R * exp(+q SE / R)  (log scale: KLD sums are skewed right)
    a paired difference:  D - q SE .. D + q SE                      (either sign: linear)

(qeval.compare.depth.cluster_se_of_sums is the SE without the correction). Tokens of one chunk are correlated:
the per-token SE llama-perplexity prints is too small for deciding. Two pairs compared on the same chunks (the
same tokens) take the same estimator over the per-chunk differences S_a,c - S_b,c: a paired difference, far
tighter than two separate intervals when both follow the same hard and easy chunks.

The error alpha = 1 - confidence is spent over the looks the rule plans (StopRule.look_confidence): look 0 at
min_chunks, look k at min_chunks + k*step (the rounds), K = ceil((N - min_chunks) / step) looks short of every
chunk (at N the mean is exact); a count between two looks (a result extended in another order) reads the
later look's: k = ceil((n - min_chunks) / step). alpha_0 = alpha/2 (FIRST_LOOK_SHARE) at the minimum, where
most pairs stop; alpha_k = (alpha/2) * (1/k) / sum_{j=1}^{K-1} (1/j) at look k >= 1 (a pair that runs on
mostly stops within a few looks). The alpha_k add up to alpha, so by Bonferroni every interval of a pair, the
one it stops on included, holds its full-run mean (every neighbour test its full-run sign) with probability
>= confidence whichever look the data chose: optional stopping is paid for. At the minimum the interval is at
97.5 % for a stated 95 %; that, with the log scale, is what covers skewed chunk sums at 8 chunks, where the
t-interval at the stated 95 % covered 92.5-94.4 % of replayed real results (bench/bench_early.py,
bench/bench_early_intervals.py, docs/release.md). bench/bench_early.py keeps the rule before (FixedTRule: the
t-interval at the stated confidence at every look) to compare.

The rule (StopRule, decide): every pair runs at least min_chunks chunks; then a pair stops when
  "settled"    its order against both of its board neighbours (paired |diff| >= neighbour_sigmas * SE, and its
               interval at the look's confidence clear of 0) and its
               Pareto status (qeval.compare.ranking: its kind's size/KLD front) can no longer change, and no
               other pair's Pareto status waits on a comparison with it;
  "precision"  its interval's half-width (its longer side: the upper one) is <= rel_precision * mean, and
               every comparison still open is a tie at that precision (the paired interval lies within
               +/- rel_precision * the smaller mean): close neighbours (Q4_K_M vs Q4_K_S) keep running until
               their order is settled or shown to be a tie, never guessed;
  "all chunks" it has visited every chunk.
The control (the reference recomputed) is pinned first and on no front: it stops after min_chunks.
decide() is a pure function of every pair's visited chunks: as estimates move, a stopped pair may be asked to
run again (its neighbours changed); comparisons with a pair that visited fewer chunks use the common prefix, and
settle only once the two rows' own means (each over its visited chunks, as the board shows them) agree with the
settled sign: otherwise the board could show an order its comparison settled the other way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Sequence

import numpy as np

from qeval.compare import ranking
from qeval.compare.depth import cluster_se_of_sums
from qeval.compare.paired_stats import CONFIDENCE, t_quantile

MIN_CHUNKS = 8
REL_PRECISION = 0.05
NEIGHBOUR_SIGMAS = 3.0
STEP = 4  # chunks a pair runs on per round once past the minimum (bench/bench_early.py's simulation: --step)
# the intervals, as a rule's record names them: the error spent over the planned looks, a mean on the log scale
SPENT = "spent"
# what a rule's record says of the choices rules before issue 35 offered (a precision stop without the tie
# condition, the t-interval at the stated confidence at every look): the rule is fixed now, and the record keeps
# saying so, so that results saved since keep their identity
RECORDED = {"precision_alone": False, "interval": SPENT}
FIRST_LOOK_SHARE = 0.5  # of the error, spent at the minimum: most pairs stop there

# why a pair stops, or runs on
MIN_NOT_REACHED = "min chunks not reached"
ALL_CHUNKS = "all chunks"
PRECISION = "precision"
SETTLED = "settled"
OPEN = "open"  # past the minimum, neither settled nor precise: runs on (Decision.unsettled names the comparisons)


def chunk_order(n_chunks: int, seed: int) -> np.ndarray:
    """The order a decided-early run visits chunks 0..n_chunks-1 in: a seeded random permutation. Record the order
    itself with the seed (order_record): a later run extends the recorded order, whatever numpy's generator does."""
    if n_chunks < 0:
        raise ValueError(f"n_chunks must be >= 0, not {n_chunks}")
    return np.random.default_rng(seed).permutation(n_chunks).astype(np.int64)


def order_record(seed: int, order: Sequence[int], rule: "StopRule") -> dict:
    """What a result records about its early run: the seed, the chunk order and the rule."""
    return {"seed": int(seed), "order": [int(c) for c in order], "rule": rule.to_json()}


def chunk_sums(per_token: dict[str, np.ndarray], column: str = "kld",
               order: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk ids, sum of `column` per chunk, scored tokens per chunk) of per-token arrays (a saved result's npz,
    qeval.present.results), in the order of `order` (the chunks held, in the order they appear there) or by id."""
    ids, inverse, counts = np.unique(np.asarray(per_token["chunk"]), return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=np.asarray(per_token[column], dtype=np.float64), minlength=len(ids))
    if order is None:
        return ids.astype(np.int64), sums, counts.astype(np.int64)
    order = np.asarray(order)
    missing = np.setdiff1d(ids, order)
    if len(missing):
        raise ValueError(f"chunks {missing[:5].tolist()} are not in the order")
    held = order[np.isin(order, ids)]
    at = np.searchsorted(ids, held)
    return held.astype(np.int64), sums[at], counts[at].astype(np.int64)


# --------------------------------------------------------------------------------------------------
# estimates
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A mean over a sample of n of N chunks: token-weighted ratio estimator, chunk-level SE with the
    finite-population correction, and its interval at `confidence` (the look's: module docstring)."""

    mean: float
    se: float  # NaN below 2 chunks; 0 when all N chunks are in
    low: float
    high: float
    n_chunks: int
    n_total: int  # N: the chunks of the whole corpus
    n_tokens: int
    confidence: float  # of this interval (a look's share of the rule's error: StopRule.look_confidence)

    @property
    def half_width(self) -> float:
        """The interval's longer side from the mean (the upper one on the log scale)."""
        return max(self.high - self.mean, self.mean - self.low)

    @property
    def df(self) -> int:
        return self.n_chunks - 1

    def to_json(self) -> dict:
        return {**asdict(self), "half_width": self.half_width}


def ratio_estimate(sums: Sequence[float], tokens: Sequence[int], n_total: int,
                   confidence: float = CONFIDENCE, log_scale: bool = False) -> Estimate:
    """The mean of a per-token value over n visited chunks of n_total (sums: its sum per chunk; tokens: the
    scored tokens per chunk), as the module docstring defines it. log_scale: the interval of a positive mean
    on the log scale, mean * exp(+/- q SE / mean) (a pair's mean KLD); else mean +/- q SE (a difference)."""
    sums, tokens = np.asarray(sums, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    n = len(sums)
    if len(tokens) != n:
        raise ValueError(f"{n} chunk sums but {len(tokens)} token counts")
    if n > n_total:
        raise ValueError(f"{n} chunks visited of a corpus of {n_total}")
    n_tokens = float(tokens.sum())
    nan = float("nan")
    if n == 0 or n_tokens <= 0:
        return Estimate(mean=nan, se=nan, low=nan, high=nan, n_chunks=n, n_total=n_total, n_tokens=int(n_tokens),
                        confidence=confidence)
    mean = float(sums.sum()) / n_tokens
    if n < 2:
        return Estimate(mean=mean, se=nan, low=nan, high=nan, n_chunks=n, n_total=n_total, n_tokens=int(n_tokens),
                        confidence=confidence)
    se = cluster_se_of_sums(sums, tokens) * math.sqrt(max(1.0 - n / n_total, 0.0))
    low, high = interval(mean, se, t_quantile(confidence, n - 1), log_scale)
    return Estimate(mean=mean, se=se, low=low, high=high, n_chunks=n, n_total=n_total, n_tokens=int(n_tokens),
                    confidence=confidence)


def interval(mean: float, se: float, q: float, log_scale: bool) -> tuple[float, float]:
    """(low, high) of mean +/- q SE, or on the log scale (a positive mean: its delta-method SE there is SE / mean)
    mean * exp(+/- q SE / mean); a mean of 0 (every value 0, SE 0) stays [0, 0]."""
    if log_scale and mean > 0.0:
        spread = math.exp(q * se / mean)
        return mean / spread, mean * spread
    return mean - q * se, mean + q * se


def paired_estimate(sums_a: Sequence[float], sums_b: Sequence[float], tokens: Sequence[int], n_total: int,
                    confidence: float = CONFIDENCE) -> Estimate:
    """Mean of A minus mean of B over the same chunks (the same tokens: one token count per chunk), with the SE
    of the per-chunk differences (paired); a linear interval (a difference may have either sign)."""
    sums_a, sums_b = np.asarray(sums_a, dtype=np.float64), np.asarray(sums_b, dtype=np.float64)
    if sums_a.shape != sums_b.shape:
        raise ValueError(f"A has {len(sums_a)} chunks, B {len(sums_b)}: a paired difference needs the same chunks")
    return ratio_estimate(sums_a - sums_b, tokens, n_total, confidence)


def precise(est: Estimate, rel_precision: float) -> bool:
    """Whether the interval's half-width is at most rel_precision times the mean."""
    return bool(est.half_width <= rel_precision * abs(est.mean))  # False for NaN


# --------------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StopRule:
    """When a pair of a decided-early board stops, and the intervals it reads at each look (module docstring)."""

    min_chunks: int = MIN_CHUNKS
    rel_precision: float = REL_PRECISION  # stop when the half-width is <= this share of the mean ...
    neighbour_sigmas: float = NEIGHBOUR_SIGMAS  # ... or when every comparison that matters is this many SEs apart
    confidence: float = CONFIDENCE  # of the intervals (precision, ties, the reported interval), over all looks
    step: int = STEP  # chunks a pair still running adds per round: the looks are min_chunks, +step, +2 step, ...
    log_scale: ClassVar[bool] = True  # a pair's mean takes its interval on the log scale (KLD sums are skewed)

    def __post_init__(self):
        if self.min_chunks < 2:
            raise ValueError(f"min_chunks must be >= 2 (an SE needs 2 chunks), not {self.min_chunks}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), not {self.confidence}")
        if not self.rel_precision > 0.0 or not self.neighbour_sigmas > 0.0:
            raise ValueError("rel_precision and neighbour_sigmas must be > 0")
        if self.step < 1:
            raise ValueError(f"step must be >= 1, not {self.step}")

    def looks(self, n_total: int) -> int:
        """The looks the rule plans short of the whole corpus: min_chunks, min_chunks + step, ... below n_total
        (at n_total the mean is exact: nothing to spend there)."""
        return max(math.ceil((n_total - self.min_chunks) / self.step), 1)

    def look_confidence(self, n: int, n_total: int) -> float:
        """The confidence of the intervals read after n of n_total chunks: 1 - alpha_k at look k (the one n falls
        in: k = ceil((n - min_chunks) / step)). alpha_0 = FIRST_LOOK_SHARE * alpha at the minimum; the rest of
        alpha = 1 - confidence goes to the later looks k = 1 .. K-1 in proportion to 1/k (most pairs that run on
        stop within a few looks). Over every look they add up to alpha (Bonferroni: the interval a pair stops on
        holds with confidence >= `confidence`, whichever look the data chose)."""
        looks = self.looks(n_total)
        if looks == 1:
            return self.confidence
        alpha = 1.0 - self.confidence
        k = min(max(math.ceil((n - self.min_chunks) / self.step), 0), looks - 1)
        if k == 0:
            return 1.0 - alpha * FIRST_LOOK_SHARE
        return 1.0 - alpha * (1.0 - FIRST_LOOK_SHARE) / k / sum(1.0 / j for j in range(1, looks))

    def to_json(self) -> dict:
        return {**asdict(self), **RECORDED}


@dataclass(frozen=True)
class PairChunks:
    """What decide() needs of one pair on the board: its visited chunks in visit order (a prefix of the board's
    chunk order) with the KLD sum and scored tokens of each, and its place on the Pareto fronts (as BoardRow)."""

    label: str
    chunks: np.ndarray  # chunk ids, in visit order
    sums: np.ndarray  # sum of the per-token KLD over each chunk
    tokens: np.ndarray  # scored tokens of each chunk
    size_gib: float | None = None  # the weight quants' front axis
    memory_gib: float | None = None  # the KV-cache quants' front axis
    kv_quant: bool = False
    control: bool = False

    def __post_init__(self):
        for name in ("chunks", "sums", "tokens"):
            object.__setattr__(self, name, np.asarray(getattr(self, name)))
        if not len(self.chunks) == len(self.sums) == len(self.tokens):
            raise ValueError(f"{self.label}: {len(self.chunks)} chunks, {len(self.sums)} sums, "
                             f"{len(self.tokens)} token counts")

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def prefix(self, n: int) -> "PairChunks":
        """The same pair after only its first n chunks."""
        return PairChunks(label=self.label, chunks=self.chunks[:n], sums=self.sums[:n], tokens=self.tokens[:n],
                          size_gib=self.size_gib,
                          memory_gib=self.memory_gib, kv_quant=self.kv_quant, control=self.control)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Two pairs on the chunks both have visited (the common prefix)."""

    diff: Estimate  # mean(a) - mean(b)
    mean_a: float
    mean_b: float
    sign: int | None  # -1: a below b, +1: above, 0: equal on every chunk; None: not settled
    tie: bool  # the difference's interval lies within +/- rel_precision * the smaller mean


def compare(a: PairChunks, b: PairChunks, n_total: int, rule: StopRule) -> Comparison:
    n = min(a.n_chunks, b.n_chunks)
    if not np.array_equal(a.chunks[:n], b.chunks[:n]):
        raise ValueError(f"{a.label} and {b.label} did not visit the chunks in one order")
    if not np.array_equal(a.tokens[:n], b.tokens[:n]):
        raise ValueError(f"{a.label} and {b.label} scored different tokens in the same chunks")
    diff = paired_estimate(a.sums[:n], b.sums[:n], a.tokens[:n], n_total, rule.look_confidence(n, n_total))
    n_tokens = float(a.tokens[:n].sum())
    mean_a = float(a.sums[:n].sum()) / n_tokens if n_tokens else float("nan")
    mean_b = float(b.sums[:n].sum()) / n_tokens if n_tokens else float("nan")
    # neighbour_sigmas SEs apart, and the interval at the rule's confidence clear of 0: over few chunks (min_chunks
    # below ~5) the t quantile exceeds 3 SE, and a noisy SE settled close neighbours in the wrong order
    settled = n >= 2 and abs(diff.mean) >= max(rule.neighbour_sigmas * diff.se, diff.half_width)  # False for NaN
    sign = (int(np.sign(diff.mean)) if settled else None)
    if sign and a.n_chunks != b.n_chunks and np.sign(_own_mean(a) - _own_mean(b)) != sign:
        sign = None  # the board shows each mean over its own chunks: until they agree, the shorter one runs on
    tie = bool(abs(diff.mean) + diff.half_width <= rule.rel_precision * min(abs(mean_a), abs(mean_b)))
    return Comparison(diff=diff, mean_a=mean_a, mean_b=mean_b, sign=sign, tie=tie)


def _own_mean(p: PairChunks) -> float:
    """A pair's mean over every chunk it visited: the one its board row shows."""
    return float(p.sums.sum()) / float(p.tokens.sum())


@dataclass
class Decision:
    """Whether one pair stops now, and why."""

    label: str
    stop: bool
    reason: str  # MIN_NOT_REACHED, ALL_CHUNKS, PRECISION, SETTLED or OPEN
    estimate: Estimate
    neighbours: tuple[str, ...]  # its neighbours on the board now (by the current means)
    unsettled: tuple[str, ...] = ()  # the pairs it is still compared against (neighbours, Pareto)
    ties: tuple[str, ...] = ()  # of those, the ones within rel_precision (a PRECISION stop's ties)
    on_front: bool = False  # on its Pareto front by the current means
    front_settled: bool = False  # that cannot change any more

    @property
    def n_chunks(self) -> int:
        return self.estimate.n_chunks

    @property
    def n_tokens(self) -> int:
        return self.estimate.n_tokens

    def to_json(self) -> dict:
        return {"label": self.label, "stop": self.stop, "reason": self.reason, "n_chunks": self.n_chunks,
                "n_tokens": self.n_tokens, "estimate": self.estimate.to_json(), "neighbours": list(self.neighbours),
                "unsettled": list(self.unsettled), "ties": list(self.ties), "on_front": self.on_front,
                "front_settled": self.front_settled}


@dataclass
class _Board:
    pairs: Sequence[PairChunks]
    n_total: int
    rule: StopRule
    cache: dict = field(default_factory=dict)

    def cmp(self, i: int, j: int) -> Comparison:
        """i against j (cached; j against i is its mirror)."""
        if (i, j) not in self.cache:
            c = compare(self.pairs[i], self.pairs[j], self.n_total, self.rule)
            self.cache[(i, j)] = c
            self.cache[(j, i)] = Comparison(diff=c.diff, mean_a=c.mean_b, mean_b=c.mean_a,
                                            sign=None if c.sign is None else -c.sign, tie=c.tie)
        return self.cache[(i, j)]

    def front_of(self, i: int, placed: dict[int, float]) -> bool:
        """i's Pareto status with every other pair placed at stand-in values relative to i (i at 0): -1 below,
        +1 above, 0 level; the board's own rule (ranking.on_fronts) decides."""
        p = self.pairs
        values = [placed.get(j, 0.0) for j in range(len(p))]  # i (and a control: on no front) at 0
        return ranking.on_fronts([q.kv_quant for q in p], [q.control for q in p], [q.size_gib for q in p],
                                 [q.memory_gib for q in p], values)[i]

    def front_waits_on(self, i: int) -> tuple[bool, set[int]]:
        """(whether i's Pareto status is settled, the open comparisons it depends on). A comparison matters when
        placing that pair below i, every other open one above, changes i's status."""
        others = [j for j in range(len(self.pairs)) if j != i and not self.pairs[j].control]
        if self.pairs[i].control:
            return True, set()
        settled = {j: self.cmp(j, i).sign for j in others}
        best = {j: (float(s) if s is not None else 1.0) for j, s in settled.items()}
        worst = {j: (float(s) if s is not None else -1.0) for j, s in settled.items()}
        if self.front_of(i, best) == self.front_of(i, worst):
            return True, set()
        return False, {j for j, s in settled.items() if s is None and not self.front_of(i, {**best, j: -1.0})}


def pair_estimate(sums: Sequence[float], tokens: Sequence[int], n_total: int, rule: StopRule) -> Estimate:
    """A pair's mean over its visited chunks (their KLD sums and scored tokens), with the interval the rule reads
    at that look: the one an early row reports."""
    return ratio_estimate(sums, tokens, n_total, rule.look_confidence(len(sums), n_total), rule.log_scale)


def decide(pairs: Sequence[PairChunks], n_total: int, rule: StopRule = StopRule()) -> list[Decision]:
    """For every pair on the board (in the order given): stop now, or run on, and why (module docstring).
    n_total: the corpus's chunks, N. Every pair's chunks must be a prefix of one chunk order."""
    labels = [p.label for p in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError("two pairs share a label")
    board = _Board(pairs, n_total, rule)
    est = [pair_estimate(p.sums, p.tokens, n_total, rule) for p in pairs]
    ranked = sorted(range(len(pairs)), key=lambda i: ranking.order_key(pairs[i].control, _sortable(est[i].mean),
                                                                       labels[i]))
    contenders = [i for i in ranked if not pairs[i].control]
    neighbours = {i: [contenders[k] for k in (at - 1, at + 1) if 0 <= k < len(contenders)]
                  for at, i in enumerate(contenders)}
    fronts = {i: board.front_waits_on(i) for i in contenders}
    waited_on = {i: {j for j in contenders if i in fronts[j][1]} for i in contenders}
    now = ranking.on_fronts([p.kv_quant for p in pairs], [p.control for p in pairs], [p.size_gib for p in pairs],
                            [p.memory_gib for p in pairs], [_sortable(e.mean) for e in est])
    out = []
    for i, p in enumerate(pairs):
        e = est[i]
        near = tuple(labels[j] for j in neighbours.get(i, ()))
        front_settled = fronts[i][0] if i in fronts else True
        d = Decision(label=p.label, stop=False, reason=OPEN, estimate=e, neighbours=near, on_front=now[i],
                     front_settled=front_settled)
        if p.n_chunks >= n_total:
            d.stop, d.reason = True, ALL_CHUNKS
        elif p.n_chunks < rule.min_chunks:
            d.reason = MIN_NOT_REACHED
        elif p.control:  # pinned first, on no front: nothing to settle
            d.stop, d.reason = True, SETTLED
        else:
            open_ = [j for j in neighbours[i] if board.cmp(i, j).sign is None]
            open_ += sorted((fronts[i][1] | waited_on[i]) - set(open_), key=lambda j: ranked.index(j))
            d.unsettled = tuple(labels[j] for j in open_)
            d.ties = tuple(labels[j] for j in open_ if board.cmp(i, j).tie)
            if not open_:
                d.stop, d.reason = True, SETTLED
            elif precise(e, rule.rel_precision) and len(d.ties) == len(open_):
                d.stop, d.reason = True, PRECISION
        out.append(d)
    return out


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


# --------------------------------------------------------------------------------------------------
# a matrix decided early (qeval.orchestrate.matrix)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EarlySettings:
    """How a matrix decides its board early (`qeval matrix --early`): the seed of the chunk order and the stop rule
    (whose `step` is the chunks a pair still running adds per round)."""

    seed: int = 0
    rule: StopRule = StopRule()

    def order(self, n_chunks: int) -> np.ndarray:
        return chunk_order(n_chunks, self.seed)

    def record(self, order: Sequence[int]) -> dict:
        """What an early result records (its request's `early`, with `visited`: how many chunks of the order it
        holds): the seed, the whole order, the rule. A full run of the same pair records none: the two are never
        one result."""
        return order_record(self.seed, order, self.rule)


def held_prefix(order: Sequence[int], held) -> list[int]:
    """The longest prefix of `order` whose chunks are all in `held` (a checkpoint's chunks): the sample an early
    run stands on. Chunks held beyond it (an earlier run's, in another order) wait until the order reaches them."""
    out = []
    for c in order:
        if int(c) not in held:
            break
        out.append(int(c))
    return out
