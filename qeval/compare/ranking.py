"""A board's order and its Pareto fronts, on plain values: the one definition behind the boards qeval.present
draws (board.rank_key, leaderboard.mark_pareto_fronts) and behind the early stopping rule (qeval.compare.early),
which must know when they can no longer change.

Order: the control first (the noise floor the rest is read against), then the numerics floor (the reference on another
kernel path), then lowest mean KLD first, then label. Fronts: like with like (board.PARETO_NOTE): weight quants (KV
cache as the reference's) on file size, KV-cache quants on memory at the context (file plus KV cache at n_ctx); the
control and the floor (`control` below: any row that is the reference itself) are on neither.
"""

from __future__ import annotations

import math
from typing import Sequence


def order_key(control: bool, kld_mean: float, label: str, floor: bool = False) -> tuple:
    """The sort key of a row on a board: the control, then the numerics floor, then by mean KLD."""
    return not control, not floor, kld_mean, label


def pareto_front(sizes: list, values: list) -> list[bool]:
    """True where no other point is at least as good in both (size, value) and better in one; lower is better.

    Points without a size (None or NaN) are never on the front; identical points are both on it.
    """
    def ok(v) -> bool:
        return v is not None and not (isinstance(v, float) and math.isnan(v))

    pts = [(float(s), float(v)) if ok(s) and ok(v) else None for s, v in zip(sizes, values)]
    out = []
    for i, p in enumerate(pts):
        if p is None:
            out.append(False)
            continue
        dominated = any(q is not None and j != i and q[0] <= p[0] and q[1] <= p[1] and q != p
                        for j, q in enumerate(pts))
        out.append(not dominated)
    return out


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
