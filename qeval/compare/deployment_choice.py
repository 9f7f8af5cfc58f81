"""The deployment question on plain values: the best quality that fits M GiB at context C and generates at least S
tokens/s at depth D, on one machine, with every other candidate named and why it is ruled out.

Only figures measured at exactly C and D count: a context or depth between two measured ones is not interpolated,
and a figure of another machine never stands for this one's. Quality is one board metric (mean KLD unless asked
otherwise); the reference is the best quality by definition (every figure is measured against it). Among the
candidates that pass, the best quality wins, then less memory, then faster generation, then the label. The winner
is always on the front over quality × memory at C × generation speed at D (ranking.front), which is computed here
too: qeval.present.deployment_board draws it on the board and the HTML page looks it up.

Values in, values out: the question is read from what a user typed at the edge
(qeval.orchestrate.boards.read_question), and the answer is worded, linked and written as JSON in
qeval.present.choose_text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from qeval.compare import ranking
from qeval.compare.metric_registry import METRICS
from qeval.errors import QevalError

GIB = 2**30


def quality_metric(key: str):
    """The board metric `key` with a better direction: the question's quality."""
    metric = METRICS.get(key)
    if metric is None or not metric.board or metric.better is None:
        known = ", ".join(m.key for m in METRICS.values() if m.board and m.better)
        raise QevalError(f"--by {key!r} is not a board metric with a better direction: choose one of {known}")
    return metric


def better(key: str) -> int:
    """The better direction (ranking.LOWER or HIGHER) of quality metric `key`."""
    return ranking.LOWER if quality_metric(key).better == "lower" else ranking.HIGHER


@dataclass(frozen=True)
class Question:
    """What the user asks: memory at a context and/or generation speed at a depth, and the quality to maximise; the
    constructor checks the values."""

    memory_gib: float | None = None  # the memory the deployment must fit in, in GiB
    n_ctx: int | None = None  # the deployment context the memory is measured at
    min_tg: float | None = None  # the generation speed it must reach, tokens/s
    depth: int | None = None  # the depth (tokens already in the context) the speed is measured at
    by: str = "kld_mean"  # the quality: a board metric's key

    def __post_init__(self):
        if (self.memory_gib is None) != (self.n_ctx is None):
            raise QevalError("a memory limit is asked at a context: give both --memory and --context")
        if (self.min_tg is None) != (self.depth is None):
            raise QevalError("a generation speed is asked at a depth: give both --min-tg and --depth")
        if self.memory_gib is None and self.min_tg is None:
            raise QevalError("ask for memory (--memory and --context), speed (--min-tg and --depth) or both")
        if self.memory_gib is not None and not (self.memory_gib > 0 and math.isfinite(self.memory_gib)):
            raise QevalError(f"--memory must be a positive size, not {self.memory_gib!r}")
        if self.n_ctx is not None and self.n_ctx <= 0:
            raise QevalError(f"--context must be a positive number of tokens, not {self.n_ctx}")
        if self.min_tg is not None and not (self.min_tg >= 0 and math.isfinite(self.min_tg)):
            raise QevalError(f"--min-tg must be a speed of 0 tokens/s or more, not {self.min_tg:g}")
        if self.depth is not None and self.depth < 0:
            raise QevalError(f"--depth must be 0 or more tokens, not {self.depth}")
        quality_metric(self.by)

    @property
    def better(self) -> int:
        return better(self.by)

    def to_json(self) -> dict:
        return {"memory_gib": self.memory_gib, "n_ctx": self.n_ctx, "min_tg": self.min_tg, "depth": self.depth,
                "by": self.by}


@dataclass(frozen=True)
class Candidate:
    """One row of the board as the question sees it on the asked machine."""

    label: str
    quality: float | None  # the question's quality metric; None: not held
    memory: Mapping[int, float | str] = field(default_factory=dict)  # n_ctx -> total bytes, or why it failed
    tg: Mapping[int, float | str] = field(default_factory=dict)  # depth -> generation tokens/s, or why it failed
    reference: bool = False  # the reference itself: the best quality by definition
    elsewhere: str | None = None  # no figure on the asked machine, but on these other machines
    excluded: str | None = None  # never a candidate, and why (the control, the numerics floor)
    recorded: bool = False  # it has a record on the asked machine (even one without these figures)

    @property
    def measured(self) -> bool:
        return self.recorded or bool(self.memory or self.tg)


@dataclass(frozen=True)
class Reason:
    """Why a candidate is ruled out: a kind (RULE_OUTS) and the figures it stands on (worded by
    qeval.present.choose_text.reason_text)."""

    kind: str
    axis: str | None = None  # "context" or "depth": the asked figure that is missing, failed or missed its limit
    at: int | None = None  # the asked context or depth
    figure: float | str | None = None  # what missed the limit (bytes; tokens/s), or why it could not be measured
    measured: tuple[int, ...] = ()  # "not measured" at the asked one: the contexts or depths that were
    note: str | None = None  # why it is not a candidate, or the other machines it was measured on


# every kind of reason, in the order they are checked
RULE_OUTS = ("not a candidate", "measured on another machine", "not measured", "no quality figure",
             "could not be measured", "does not fit", "too slow")


@dataclass(frozen=True, kw_only=True)
class Choice:
    question: Question
    best: Candidate | None
    passing: tuple[Candidate, ...]  # every candidate that passes, best first
    ruled_out: tuple[tuple[Candidate, tuple[Reason, ...]], ...]  # in the board's order
    front: tuple[str, ...]  # labels on the front over quality × memory at C × speed at D (the axes asked)


def _figure_reasons(figures: Mapping[int, float | str], axis: str, at: int, missed, kind: str) -> list[Reason]:
    """Not measured at `at`, measured there and failed, or measured and `missed` (a test of the figure): `kind`."""
    figure = figures.get(at)
    if figure is None:
        return [Reason(kind="not measured", axis=axis, at=at, measured=tuple(sorted(figures)))]
    if isinstance(figure, str):
        return [Reason(kind="could not be measured", axis=axis, at=at, figure=figure)]
    return [Reason(kind=kind, axis=axis, at=at, figure=figure)] if missed(figure) else []


def reasons(c: Candidate, q: Question) -> tuple[Reason, ...]:
    """Why `c` does not answer `q`; empty when it passes."""
    if c.excluded:
        return (Reason(kind="not a candidate", note=c.excluded),)
    if not c.measured:
        return (Reason(kind="measured on another machine",
                       note=c.elsewhere) if c.elsewhere else Reason(kind="not measured"),)
    has_quality = c.reference or (c.quality is not None and math.isfinite(c.quality))
    out = [] if has_quality else [Reason(kind="no quality figure")]
    if q.n_ctx is not None:
        out += _figure_reasons(c.memory, "context", q.n_ctx, lambda total: total > q.memory_gib * GIB, "does not fit")
    if q.depth is not None:
        out += _figure_reasons(c.tg, "depth", q.depth, lambda tps: tps < q.min_tg, "too slow")
    return tuple(out)


def _quality_point(c: Candidate, better: int) -> float | None:
    """The quality axis of the front: the reference beats every quant."""
    if c.reference:
        return -math.inf if better == ranking.LOWER else math.inf
    return c.quality


def _number(figures: Mapping[int, float | str], at: int | None) -> float | None:
    figure = figures.get(at)
    return figure if isinstance(figure, (int, float)) else None


def front(candidates: Sequence[Candidate], better: int, n_ctx: int | None, depth: int | None) -> tuple[str, ...]:
    """Labels on the front over quality (direction `better`), total memory at n_ctx (less is better) and generation
    speed at depth (more is better); an axis whose context or depth is None is left out. A candidate missing any
    figure of it is on no front."""
    axes = [better] + [ranking.LOWER] * (n_ctx is not None) + [ranking.HIGHER] * (depth is not None)

    def point(c: Candidate):
        if c.excluded or not c.measured:
            return None
        return (_quality_point(c, better), *((_number(c.memory, n_ctx),) if n_ctx is not None else ()),
                *((_number(c.tg, depth),) if depth is not None else ()))

    flags = ranking.front([point(c) for c in candidates], axes)
    return tuple(c.label for c, on in zip(candidates, flags) if on)


def choose(candidates: Sequence[Candidate], question: Question) -> Choice:
    """Answer `question` over `candidates` (a board's rows on the asked machine, in the board's order)."""
    better = question.better
    passing, ruled = [], []
    for c in candidates:
        why = reasons(c, question)
        (ruled.append((c, why)) if why else passing.append(c))

    def order(c: Candidate) -> tuple:
        quality = _quality_point(c, better)
        return (better * -quality, _number(c.memory, question.n_ctx) or 0.0, -(_number(c.tg, question.depth) or 0.0),
                c.label)

    passing.sort(key=order)
    return Choice(question=question, best=passing[0] if passing else None, passing=tuple(passing),
                  ruled_out=tuple(ruled),
                  front=front(candidates, better, question.n_ctx, question.depth))
