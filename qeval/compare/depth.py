"""Groups of scored tokens: the per-token figures of a comparison by context depth, by the reference's confidence,
by segment and by category.

One mechanism serves every grouping: a group is a set of per-token rows, summarised by the same function
as the whole comparison (its figures sit under the same keys), with cluster-robust standard errors, and its share
of the whole comparison's KLD.
  by_depth     a band [lo, hi) holds the scored tokens whose logit position p satisfies lo <= p < hi (the
               model had seen p + 1 tokens of its window)
  by_confidence  a bucket [lo, hi) holds the scored tokens whose reference top-1 probability (max_i p_ref(i),
               per-token column "p_ref_top1") satisfies lo <= p < hi; the last bucket holds p = 1 too. It tells
               "less sure where the reference was unsure anyway" from "now misses tokens the reference was
               certain of" (docs/metrics.md says how the default edges were chosen)
  by_segment   conversations (--score assistant): the tokens the assistant wrote in one segment (thinking,
               answer, tool_call), per-token column "segment"
  by_category  conversations: the tokens of one category's conversations (chat, code, ...), column "category"
`Selection` restricts a comparison or gate to one depth band, segment and/or category.

Only the standard errors of a group differ from the whole comparison's:

Standard errors within a band respect the correlation of neighbouring tokens of one window. Tokens
are grouped into blocks of BLOCK_POSITIONS consecutive positions of one window, and the SE of a mean
is the cluster-robust (sandwich) SE over those blocks:
    SE^2 = G/(G-1) * sum_g (S_g - mean * n_g)^2 / N^2
(G blocks, S_g and n_g the sum and count of block g, N tokens). llama-perplexity's i.i.d. formula,
kept for the top-level figures (parity), understates the SE of a band by the square root of the
design effect: at 32K, where a few long windows carry a band, that matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from qeval.errors import QevalError

BLOCK_POSITIONS = 256
FIRST_EDGE, EDGE_FACTOR = 512, 4
SE_METHOD = f"cluster-robust over blocks of {BLOCK_POSITIONS} positions of one window"
# summary blocks whose "se" is the SE of a per-token mean, and the per-token column it is the mean of
_MEAN_BLOCKS = {"kld": "kld", "kld_reverse": "kld_reverse", "same_top1": "same_top1",
                "top5_agreement": "top5_agreement", "top10_agreement": "top10_agreement"}


def default_edges(n_ctx: int) -> list[int]:
    """0, 512, 2048, 8192, ... (powers of 4 from 512), then n_ctx."""
    edges, edge = [0], FIRST_EDGE
    while edge < n_ctx:
        edges.append(edge)
        edge *= EDGE_FACTOR
    return edges + [n_ctx]


def parse_bands(spec: str | None, n_ctx: int) -> list[tuple[int, int]]:
    """`--bands 512,2048,8192` (inner edges, ascending) or None for the default; bands [lo, hi) covering
    0..n_ctx (edges at or beyond n_ctx are dropped, so one band list serves every context size)."""
    if spec is None:
        edges = default_edges(n_ctx)
    else:
        inner = inner_edges(spec, int, lambda e: e > 0, f"--bands {spec!r}: expected ascending positive integer "
                            "positions, e.g. 512,2048,8192")
        edges = [0, *(e for e in inner if e < n_ctx), n_ctx]  # edges beyond this context are not needed
    return list(zip(edges, edges[1:]))


def inner_edges(spec: str, kind: type, allowed: Callable, message: str) -> list:
    """The comma-separated inner edges of an option: each a `kind`, `allowed`, strictly ascending; else
    QevalError(message)."""
    try:
        inner = [kind(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        inner = []
    if not inner or not all(map(allowed, inner)) or any(b <= a for a, b in zip(inner, inner[1:])):
        raise QevalError(message)
    return inner


def parse_depth(spec: str | None, n_ctx: int | None = None) -> tuple[int, int] | None:
    """`--depth LO:HI` (either side may be empty): the logit positions a comparison or gate is restricted to."""
    if spec is None:
        return None
    lo, sep, hi = spec.partition(":")
    try:
        band = (int(lo) if lo.strip() else 0, int(hi) if hi.strip() else (n_ctx or 1 << 40))
    except ValueError:
        band = None
    if not sep or band is None or band[0] < 0 or band[1] <= band[0]:
        raise QevalError(f"--depth {spec!r}: expected LO:HI logit positions with LO < HI, e.g. 8192: or 512:2048")
    return band


# Inner edges of the confidence buckets: on a 2-chunk capture of the demo's reference (Gemma-3-270M Q8_0, median
# top-1 probability 0.35) they held 42, 36, 15 and 6 % of the scored tokens, so every bucket is populated at the demo's
# 80 chunks (about 1,300 tokens in the top one); docs/metrics.md says how they were chosen.
DEFAULT_CONFIDENCE_EDGES = (0.3, 0.6, 0.9)
CONFIDENCE_COLUMN = "p_ref_top1"


def parse_confidence_buckets(spec: str | None) -> list[tuple[float, float]]:
    """`--confidence-buckets 0.3,0.6,0.9` (inner edges: probabilities strictly between 0 and 1, ascending) or None
    for the default: buckets [lo, hi) covering 0..1 (the last one holds 1 too)."""
    inner = list(DEFAULT_CONFIDENCE_EDGES) if spec is None else inner_edges(
        spec, float, lambda e: 0.0 < e < 1.0, f"--confidence-buckets {spec!r}: expected ascending probabilities "
        "strictly between 0 and 1, each once, e.g. 0.5,0.9,0.99")
    edges = [0.0, *inner, 1.0]
    return list(zip(edges, edges[1:]))


def select_depth(per_token: dict[str, np.ndarray], band: tuple[int, int] | None, what: str = "") -> dict:
    """The per-token rows whose logit position lies in band [lo, hi) (all rows for None)."""
    if band is None:
        return per_token
    pos = per_token["position"]
    keep = (pos >= band[0]) & (pos < band[1])
    if not keep.any():
        raise QevalError(f"{what or 'the comparison'} has no scored token at depth {band[0]}:{band[1]} "
                         f"(its scored positions run {int(pos.min())}..{int(pos.max())})")
    return {k: v[keep] for k, v in per_token.items()}


def cluster_se(values: np.ndarray, clusters: np.ndarray) -> float:
    """Cluster-robust SE of the mean of `values` (see the module docstring); NaN with fewer than 2 clusters."""
    values = np.asarray(values, dtype=np.float64)
    ids, inverse = np.unique(clusters, return_inverse=True)
    g = len(ids)
    sums = np.bincount(inverse, weights=values, minlength=g)
    counts = np.bincount(inverse, minlength=g)
    return cluster_se_of_sums(sums, counts)


def cluster_se_of_sums(sums: np.ndarray, counts: np.ndarray) -> float:
    """cluster_se from each cluster's sum S_g and count n_g: the SE of the ratio estimator sum(S) / sum(n) with
    the clusters as the sampling unit; NaN with fewer than 2 clusters."""
    sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    g = len(sums)
    if g < 2:
        return float("nan")
    n_total = float(counts.sum())
    resid = sums - sums.sum() / n_total * counts
    return math.sqrt(g / (g - 1) * float(np.sum(resid * resid)) / (n_total * n_total))


def block_ids(per_token: dict[str, np.ndarray]) -> np.ndarray:
    """The block of each token: (window, position // BLOCK_POSITIONS)."""
    return per_token["chunk"].astype(np.int64) * (1 << 32) + per_token["position"].astype(np.int64) // BLOCK_POSITIONS


def band_summary(per_token: dict[str, np.ndarray], summarize: Callable[[dict], dict]) -> dict:
    """summarize(rows) with the SEs of means made cluster-robust."""
    out = summarize(per_token)
    blocks = block_ids(per_token)
    for block, column in _MEAN_BLOCKS.items():
        if block in out:
            out[block]["se"] = cluster_se(np.asarray(per_token[column], dtype=np.float64), blocks)
    out["delta_p"]["se"] = cluster_se(per_token["p_cand"] - per_token["p_ref"], blocks)
    out["se_method"] = SE_METHOD
    return out


def grouped(per_token: dict[str, np.ndarray], groups: list[tuple[dict, np.ndarray]],
            summarize: Callable[[dict], dict]) -> list[dict]:
    """One object per (key fields, row mask) group that holds scored tokens: its key fields, n, its share of the
    whole KLD (sum over the group / sum over every row; NaN where the whole sums to 0) and figures."""
    out = []
    kld = np.asarray(per_token["kld"], dtype=np.float64)
    total = float(kld.sum())
    for fields, keep in groups:
        if keep.any():
            rows = {k: v[keep] for k, v in per_token.items()}
            share = float(kld[keep].sum()) / total if total != 0 else math.nan
            out.append({**fields, "n": int(keep.sum()), "kld_share": share, **band_summary(rows, summarize)})
    return out


def by_depth(per_token: dict[str, np.ndarray], bands: list[tuple[int, int]],
             summarize: Callable[[dict], dict]) -> list[dict]:
    """One object per band that holds scored tokens: lo, hi, n and the band's figures."""
    pos = per_token["position"]
    return grouped(per_token, [({"lo": lo, "hi": hi}, (pos >= lo) & (pos < hi)) for lo, hi in bands], summarize)


def by_confidence(per_token: dict[str, np.ndarray], buckets: list[tuple[float, float]],
                  summarize: Callable[[dict], dict]) -> list[dict] | None:
    """One object per confidence bucket that holds scored tokens: lo, hi, n, kld_share and the bucket's figures;
    None where the rows lack the reference's top-1 probability (a result saved before qeval kept it)."""
    if CONFIDENCE_COLUMN not in per_token:
        return None
    p = per_token[CONFIDENCE_COLUMN]
    last = len(buckets) - 1
    return grouped(per_token, [({"lo": lo, "hi": hi}, (p >= lo) & ((p <= hi) if k == last else (p < hi)))
                               for k, (lo, hi) in enumerate(buckets)], summarize)


# The label groupings: (summary key, per-token column = key field of each group, names list in label_names).
LABEL_GROUPS = (("by_segment", "segment", "segments"), ("by_category", "category", "categories"))


def by_labels(per_token: dict[str, np.ndarray], label_names: dict | None, summarize: Callable[[dict], dict]) -> dict:
    """by_segment and by_category of a comparison of conversation windows; label_names: {"segments": [...],
    "categories": [...]} (WindowLabels.names()), the per-token columns' codes index them. {} for text windows."""
    if label_names is None:
        return {}
    return {key: grouped(per_token, [({column: name}, per_token[column] == k)
                                     for k, name in enumerate(label_names[names])], summarize)
            for key, column, names in LABEL_GROUPS}


@dataclass(frozen=True)
class Selection:
    """The scored tokens a comparison or gate is restricted to: a depth band [lo, hi), a segment, a category."""

    depth: tuple[int, int] | None = None
    segment: str | None = None
    category: str | None = None

    @classmethod
    def parse(cls, depth: str | None = None, segment: str | None = None, category: str | None = None) -> "Selection":
        return cls(parse_depth(depth), segment or None, category or None)

    def __bool__(self) -> bool:
        return self.depth is not None or self.segment is not None or self.category is not None

    def labels(self) -> dict:
        """{"segment": name} and/or {"category": name}."""
        return {k: v for k, v in (("segment", self.segment), ("category", self.category)) if v is not None}

    def describe(self) -> str:
        parts = [f"at logit positions {self.depth[0]}:{self.depth[1]}"] if self.depth else []
        parts += [f"in {k} {v!r}" for k, v in self.labels().items()]
        return "only scored tokens " + ", ".join(parts)

    def select(self, per_token: dict[str, np.ndarray], label_names: dict | None, what: str = "") -> dict:
        """The per-token rows selected (QevalError when a name is unknown or nothing is left)."""
        rows = select_depth(per_token, self.depth, what)
        for column, names in ((c, n) for _, c, n in LABEL_GROUPS):
            name = getattr(self, column)
            if name is None:
                continue
            known = (label_names or {}).get(names)
            if not known:
                raise QevalError(f"--{column} {name}: {what or 'the comparison'} is not of conversations (--score "
                                 "assistant): its tokens have no segments or categories")
            if name not in known:
                raise QevalError(f"--{column} {name!r}: {what or 'the comparison'} has {names} {', '.join(known)}")
            keep = rows[column] == known.index(name)
            if not keep.any():
                raise QevalError(f"{what or 'the comparison'} has no scored token in {column} {name!r}")
            rows = {k: v[keep] for k, v in rows.items()}
        return rows
