"""A board's order and its Pareto fronts, on plain values: the one definition behind the boards qeval.present
draws (board.rank_key, leaderboard.mark_pareto_fronts) and behind the early stopping rule (qeval.compare.early),
which must know when they can no longer change.

Order: the control first (the noise floor the rest is read against), then the numerics floor (the reference on another
kernel path), then lowest mean KLD first, then label. Fronts: like with like (board.PARETO_NOTE): weight quants (KV
cache as the reference's) on file size, KV-cache quants on memory at the context (file plus KV cache at n_ctx); the
control and the floor (`control` below: any row that is the reference itself) are on neither. The deployment
front (qeval.present.deployment_board) is the same dominance over three axes: quality, measured memory at a context
and generation speed at a depth (higher is better).
"""

from __future__ import annotations

import math
from typing import Sequence


def order_key(control: bool, kld_mean: float, label: str, floor: bool = False) -> tuple:
    """The sort key of a row on a board: the control, then the numerics floor, then by mean KLD."""
    return not control, not floor, kld_mean, label


LOWER, HIGHER = -1, 1  # an axis's better direction


def _known(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def dominates(a: Sequence[float], b: Sequence[float], better: Sequence[int]) -> bool:
    """Whether point a dominates point b: at least as good on every axis and better on one; better[k] is LOWER or
    HIGHER for axis k. The one definition of dominance behind every front qeval draws."""
    signed = [(sense * x, sense * y) for x, y, sense in zip(a, b, better)]  # larger is better on every axis
    return all(x >= y for x, y in signed) and any(x > y for x, y in signed)


def front(points: Sequence[Sequence | None], better: Sequence[int]) -> list[bool]:
    """True where no other point dominates it (dominates). A point that is None or holds a None or NaN coordinate
    is on no front and dominates nothing; identical points are both on it."""
    pts = [tuple(float(x) for x in p) if p is not None and all(map(_known, p)) else None for p in points]
    return [p is not None and not any(q is not None and dominates(q, p, better) for q in pts) for p in pts]


def pareto_front(sizes: list, values: list) -> list[bool]:
    """True where no other point is at least as good in both (size, value) and better in one; lower is better.

    Points without a size (None or NaN) are never on the front; identical points are both on it.
    """
    return front(list(zip(sizes, values)), (LOWER, LOWER))


def on_fronts(kv_quant: Sequence[bool], control: Sequence[bool], size_gib: Sequence, memory_gib: Sequence,
              values: Sequence) -> list[bool]:
    """Whether each row is on its kind's Pareto front: weight quants by (size_gib, value), KV-cache quants by
    (memory_gib, value); a control on none. `values` are the rows' mean KLDs (or any stand-ins ordered like them)."""
    out = [False] * len(values)
    for kind, axis in ((False, size_gib), (True, memory_gib)):
        rows = [i for i in range(len(values)) if bool(kv_quant[i]) == kind and not control[i]]
        for i, front in zip(rows, pareto_front([axis[i] for i in rows], [values[i] for i in rows])):
            out[i] = front
    return out
