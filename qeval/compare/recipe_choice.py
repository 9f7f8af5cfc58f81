"""The best recipe under a budget, chosen from measured sensitivities.

Each tensor group has options: its place in the base recipe (no change) and every measured move of it alone to
another type, each with the bytes it adds to the base file (negative: saved) and the mean KLD it adds (a paired
difference against the base, chunks as the unit). A recipe takes one option per group; its size is exactly the
base's plus its options' bytes (tensors are stored independently), its KLD is predicted as the base's plus its
options' costs: additive, which the confirming measurement checks.

The choice is the greedy of the multiple-choice knapsack: every group starts at its smallest option; each group's
options are reduced to its lower convex hull in (bytes, KLD) (an option above the hull is never worth its bytes
at any budget); the hull's steps, across groups, are taken in order of KLD removed per byte added, best first,
while they fit the size budget (a group whose step does not fit takes none of its later ones), or until the
predicted KLD is within a KLD budget. Where the base recipe itself keeps the budget and beats that, it is the choice
(a large step that no longer fits once smaller ones were taken is where the greedy falls short).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One way to store one group: `bytes` added to the base file (negative: saved), `kld` added to its mean KLD."""

    group: str
    type: str  # the type asked for ("" for the base's own)
    bytes: int
    kld: float


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One option per group, and the size and mean KLD they predict."""

    options: tuple[Option, ...]
    bytes: int
    kld: float

    def moves(self) -> tuple[Option, ...]:
        """The options that change the base recipe."""
        return tuple(o for o in self.options if o.type)


def hull(options: list[Option]) -> list[Option]:
    """The lower convex hull of one group's options in (bytes, KLD), by bytes ascending: from the smallest option,
    each next one removes KLD at a falling rate per added byte."""
    best: dict[int, Option] = {}
    for o in options:  # per size, the lowest KLD
        if o.bytes not in best or o.kld < best[o.bytes].kld:
            best[o.bytes] = o
    points = [best[b] for b in sorted(best)]
    out: list[Option] = []
    for p in points:
        if out and p.kld >= out[-1].kld:
            continue  # more bytes and no less KLD: dominated
        while len(out) >= 2 and _slope(out[-2], out[-1]) >= _slope(out[-1], p):
            out.pop()  # out[-1] lies on or above the segment out[-2] -> p
        out.append(p)
    return out


def _slope(a: Option, b: Option) -> float:
    return (b.kld - a.kld) / (b.bytes - a.bytes)


def choose(options: list[Option], base_bytes: int, base_kld: float, max_bytes: int | None = None,
           max_kld: float | None = None) -> Choice:
    """The greedy choice under one budget: the lowest predicted KLD within max_bytes, or the fewest bytes whose
    predicted KLD is within max_kld. Every group must hold its base option (type "", 0 bytes, 0 KLD)."""
    if (max_bytes is None) == (max_kld is None):
        raise ValueError("give exactly one budget: max_bytes or max_kld")
    groups: dict[str, list[Option]] = {}
    for o in options:
        groups.setdefault(o.group, []).append(o)
    hulls = {g: hull(opts) for g, opts in groups.items()}
    current = {g: h[0] for g, h in hulls.items()}
    steps = sorted(((_slope(h[i], h[i + 1]), g, i + 1) for g, h in hulls.items() for i in range(len(h) - 1)),
                   key=lambda s: (s[0], s[1]))
    size = base_bytes + sum(o.bytes for o in current.values())
    kld = base_kld + sum(o.kld for o in current.values())
    blocked: set[str] = set()  # groups with a step that did not fit: their later steps build on it
    for _, g, i in steps:
        if max_kld is not None and kld <= max_kld:
            break
        step = hulls[g][i]
        added = step.bytes - current[g].bytes
        if g in blocked or (max_bytes is not None and size + added > max_bytes):
            blocked.add(g)  # another group's smaller step may still fit
            continue
        size, kld = size + added, kld + step.kld - current[g].kld
        current[g] = step
    greedy = Choice(options=tuple(current[g] for g in groups), bytes=size, kld=kld)
    base = Choice(options=tuple(next(o for o in opts if not o.type) for opts in groups.values()), bytes=base_bytes,
                  kld=base_kld)
    return base if _better(base, greedy, max_bytes, max_kld) else greedy


def _better(a: Choice, b: Choice, max_bytes: int | None, max_kld: float | None) -> bool:
    """Whether `a` keeps the budget and beats `b`: the greedy walks past a large step that no longer fits once smaller
    ones were taken (the embedding's last step up, say), so the base recipe itself can beat what it reaches."""
    if max_bytes is not None:
        return a.bytes <= max_bytes and a.kld < b.kld
    return a.kld <= max_kld and (b.kld > max_kld or a.bytes < b.bytes)


# --------------------------------------------------------------------------------------------------
# refinement: the neighbours of a choice and what a search minimises (qeval.orchestrate.refine)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Budget:
    """One budget: a size (max_bytes) or a mean KLD (max_kld)."""

    max_bytes: int | None = None
    max_kld: float | None = None

    def key(self, size: int, kld: float) -> tuple:
        """What a search minimises, lowest best: a recipe within the budget before any over it; then, within it, the
        KLD under a size budget and the bytes under a KLD budget; over it, how far over."""
        if self.max_bytes is not None:
            return (size > self.max_bytes, kld if size <= self.max_bytes else size)
        over = kld > self.max_kld
        return (over, kld if over else size)

    def may_keep(self, size: int) -> bool:
        """Whether a recipe of this size can keep the budget (a size is known before building, a KLD is not)."""
        return self.max_bytes is None or size <= self.max_bytes


def neighbours(current: tuple[Option, ...], options: list[Option]) -> list[tuple[Option, ...]]:
    """Every choice (one option per group, in current's group order) that differs from `current` in one group (a
    move added, dropped or retargeted) or in two (a swap: one group's bytes traded for another's)."""
    by_group: dict[str, list[Option]] = {}
    for o in options:
        by_group.setdefault(o.group, []).append(o)
    others = [[o for o in by_group[c.group] if o != c] for c in current]
    out = []
    for i, alternatives in enumerate(others):
        for o in alternatives:
            one = (*current[:i], o, *current[i + 1:])
            out.append(one)
            for j in range(i + 1, len(current)):
                out += [(*one[:j], p, *one[j + 1:]) for p in others[j]]
    return out


def predicted(current: tuple[Option, ...], size: int, kld: float, other: tuple[Option, ...]) -> tuple[int, float]:
    """`other`'s size and mean KLD predicted from `current`'s measured ones: plus the options it changes, minus the
    options it replaces (the additive model, applied only to the difference)."""
    changed = [(a, b) for a, b in zip(current, other) if a != b]
    return (size + sum(b.bytes - a.bytes for a, b in changed), kld + sum(b.kld - a.kld for a, b in changed))
