"""The text of a release gate (`qeval check`): a line per check, then the verdict."""

from __future__ import annotations

from qeval.compare.gate_checks import GateResult


def gate_text(r: GateResult) -> str:
    lines = [f"{r.candidate} against {r.reference}: {r.chunks} chunks, {r.scored_tokens} scored tokens"]
    if r.baseline:
        lines.append(f"baseline {r.baseline['name']}, entry {r.baseline['entry']}")
    width = max(len(c.name) for c in r.checks)
    for c in r.checks:
        lines.append(f"{'INFO' if not c.judged else 'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.reason}")
    lines += [f"note: {n}" for n in r.notes]
    failed = sum(not c.passed for c in r.checks)
    n = sum(c.judged for c in r.checks)
    lines.append((f"PASSED: all {n} checks" if n > 1 else "PASSED: 1 check") if r.passed else
                 f"FAILED: {failed} of {n} check{'s' if n > 1 else ''}")
    return "\n".join(lines)
