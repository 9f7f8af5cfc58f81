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


def control_text(over: dict) -> str:
    """The line `check --control` adds: the candidate's mean KLD over the control's, and whether that is noise."""
    if over["kld_excess"] is None:
        return f"control {over['label']}: no mean KLD to compare"
    verdict = {True: "within numerical noise (2 combined SEs)", False: "beyond numerical noise",
               None: "no verdict (an SE is missing)"}[over["within_noise"]]
    return (f"control {over['label']}: mean KLD {over['kld_mean']:.6f} ± {over['kld_mean_se'] or 0:.6f}; the candidate "
            f"is {over['kld_excess']:+.6f} nats over it, {verdict}")
