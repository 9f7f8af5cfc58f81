"""`qeval choose`'s answer as people read it: the question, the answer, every other passing row, every row ruled
out and why, the front, and the link that asks the same on the board's HTML page; and the answer as JSON. The rules
are qeval.compare.deployment_choice's; the page's script words its answer the same (tests/test_choose_rule.py)."""

from __future__ import annotations

from qeval.compare.deployment_choice import GIB, Choice, Question, Reason
from qeval.compare.metric_registry import METRICS
from qeval.present.deployment_board import DeploymentBoard, Machine
from qeval.present.deployment_page import question_link


def tokens(n: int) -> str:
    return f"{n:,}"


def beside(value: float, limit: float, decimals: int) -> str:
    """`value` with `decimals` decimals, or more (up to 6) until it does not read as the limit it missed."""
    for d in range(decimals, 7):
        text = f"{value:.{d}f}"
        if float(text) != limit:
            return text
    return text


def reason_text(r: Reason, q: Question) -> str:
    """The sentence of a reason a row is ruled out, naming its figures and the asked limit."""
    if r.kind == "not a candidate":
        return r.note
    if r.kind == "measured on another machine":
        return f"measured on another machine: {r.note}"
    if r.kind == "no quality figure":
        return f"no {METRICS[q.by].heading} figure"
    if r.axis is None:
        return "not measured: no speed or memory record"
    where = f"{r.axis} {tokens(r.at)}"
    if r.kind == "not measured":
        there = f" (measured {r.axis}s: {', '.join(map(tokens, r.measured))})" if r.measured else ""
        return f"not measured at {where}{there}"
    if r.kind == "could not be measured":
        return f"could not be measured at {where}: {r.figure}"
    if r.kind == "does not fit":
        return f"does not fit: {beside(r.figure / GIB, q.memory_gib, 2)} GiB > {q.memory_gib:g} GiB at {where}"
    return f"too slow: {beside(r.figure, q.min_tg, 1)} tokens/s < {q.min_tg:g} tokens/s at {where}"


def choice_json(choice: Choice) -> dict:
    q = choice.question
    return {"question": q.to_json(), "best": None if choice.best is None else choice.best.label,
            "passing": [c.label for c in choice.passing],
            "ruled_out": [{"label": c.label, "reasons": [{"kind": r.kind, "text": reason_text(r, q)} for r in why]}
                          for c, why in choice.ruled_out],
            "front": list(choice.front)}


def question_text(q: Question, machine: Machine) -> str:
    """The question in words."""
    asks = []
    if q.n_ctx is not None:
        asks.append(f"fits {q.memory_gib:g} GiB at context {q.n_ctx:,}")
    if q.depth is not None:
        asks.append(f"generates at least {q.min_tg:g} tokens/s at depth {q.depth:,}")
    return f"the best {METRICS[q.by].heading} that {' and '.join(asks)}, on {machine.key} ({machine.text})"


def _figures_text(board: DeploymentBoard, row, q: Question) -> str:
    """A passing row's quality, memory and speed, as the answer states them."""
    metric = METRICS[q.by]
    mv = row.metrics.get(q.by)
    parts = [f"{metric.heading} " + ("(the reference)" if row.reference else metric.cell(mv.value, mv.se))]
    m = board.on(row.label)
    if q.n_ctx is not None:
        parts.append(f"{m.memory_at(q.n_ctx) / GIB:.2f} GiB at context {q.n_ctx:,}")
    if q.depth is not None:
        parts.append(f"{m.tg_at(q.depth):.1f} tokens/s at depth {q.depth:,}")
    return ", ".join(parts)


def choice_text(board: DeploymentBoard, choice: Choice, rows, page: str = "leaderboard.html") -> str:
    """The answer as a person reads it: the question, the answer, every other passing row, every row ruled out and
    why, the front, and the link that asks the same on the board's page."""
    q, by_label = choice.question, {r.label: r for r in rows}
    named = {r.label: r.label + (" (reference)" if r.reference else "") for r in rows}
    best = choice.best
    lines = [f"Question: {question_text(q, board.machine)}",
             "Answer: " + (f"{named[best.label]}: {_figures_text(board, by_label[best.label], q)}" if best else
                           "none: no row passes")]
    lines += [f"Also passing: {named[c.label]}: {_figures_text(board, by_label[c.label], q)}"
              for c in choice.passing[1:]]
    lines += ["Ruled out:" if choice.ruled_out else "Ruled out: none"]
    lines += [f"  {named[c.label]}: {'; '.join(reason_text(r, q) for r in why)}" for c, why in choice.ruled_out]
    axes = [METRICS[q.by].heading, *([f"memory at context {q.n_ctx:,}"] if q.n_ctx is not None else []),
            *([f"generation speed at depth {q.depth:,}"] if q.depth is not None else [])]
    lines.append(f"Front ({' × '.join(axes)}): {', '.join(choice.front) or 'none'}")
    lines.append(f"Link: {page}?{question_link(q)}")
    return "\n".join(lines)
