"""The text of a release gate (`qeval check`): a line per check, then the verdict."""

from __future__ import annotations

from qeval.compare.gate_checks import FAIL, GateResult
from qeval.compare.verdict import ABOVE, UNDECIDED, WITHIN


def gate_text(r: GateResult) -> str:
    lines = [f"{r.candidate} against {r.reference}: {r.chunks} chunks, {r.scored_tokens} scored tokens"]
    if r.baseline:
        lines.append(f"baseline {r.baseline['name']}, entry {r.baseline['entry']}")
    width = max(len(c.name) for c in r.checks)
    shown = max(len(w) for w in ("INFO", *(c.verdict for c in r.checks)))
    for c in r.checks:
        lines.append(f"{'INFO' if not c.judged else c.verdict.upper():<{shown}}  {c.name:<{width}}  {c.reason}")
    lines += [f"note: {n}" for n in r.notes]
    n = sum(c.judged for c in r.checks)
    of = f"of {n} check{'s' if n > 1 else ''}"
    count = {v: sum(c.judged and c.verdict == v for c in r.checks) for v in (FAIL, UNDECIDED)}
    if r.verdict == "passed":
        lines.append(f"PASSED: all {n} checks" if n > 1 else "PASSED: 1 check")
    elif r.verdict == "failed":
        lines.append(f"FAILED: {count[FAIL]} {of}" + (f", {count[UNDECIDED]} undecided" if count[UNDECIDED] else ""))
    else:
        lines.append(f"UNDECIDED: {count[UNDECIDED]} {of} ({r.chunks} chunks): an interval straddles its limit; "
                     "measure more chunks to decide")
    return "\n".join(lines)


def control_text(over: dict) -> str:
    """The line `check --control` adds: the candidate's mean KLD over the control's and its verdict
    (qeval.compare.verdict): within numerical noise, beyond it, or undecided on the chunks it stands on."""
    if over["kld_excess"] is None:
        return f"control {over['label']}: no mean KLD to compare"
    state, chunks = over["noise_verdict"], over["noise_verdict_chunks"]
    verdict = {ABOVE: "beyond numerical noise (its 95 % interval lies above 0)",
               WITHIN: "within numerical noise (its 95 % interval lies below the control's own mean KLD)",
               UNDECIDED: f"undecided ({chunks} chunks): its 95 % interval is too wide to tell noise from a cost",
               None: "no verdict (an SE is missing)"}[state]
    return (f"control {over['label']}: mean KLD {over['kld_mean']:.6f} ± {over['kld_mean_se'] or 0:.6f}; the candidate "
            f"is {over['kld_excess']:+.6f} nats over it, {verdict}")
