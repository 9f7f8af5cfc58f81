"""What a release gate (`qeval check`, qeval.orchestrate.gate) found: a Check per threshold or baseline metric, each
passed, failed or undecided (qeval.compare.verdict), and the gate's verdict over them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASS, FAIL, UNDECIDED = "pass", "fail", "undecided"  # a check's verdict
# The gate's verdict: failed where a check fails, else undecided where one is, else passed; and its exit code
# (`qeval check`; 2 is bad input, qeval.errors.QevalError).
GATE_VERDICTS = {"passed": 0, "failed": 1, "undecided": 3}


@dataclass
class Check:
    name: str  # the option or "baseline:<metric>"
    metric: str
    verdict: str  # PASS, FAIL or UNDECIDED
    value: float
    se: float | None
    limit: float
    bound: float | None  # the favourable end of the interval: past the limit, the check fails
    reason: str
    judged: bool = True  # False: shown for information only (no error bar on either side)
    worst: float | None = None  # a threshold's unfavourable end of the interval: within the limit, the check passes

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


@dataclass
class GateResult:
    candidate: str
    reference: str
    chunks: int
    scored_tokens: int
    z: float | None  # the interval's half-width in SEs (qeval.compare.verdict.multiplier); None: under 2 chunks
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    baseline: dict | None = None

    @property
    def verdict(self) -> str:
        """"failed" where a judged check fails, else "undecided" where one is, else "passed"."""
        judged = {c.verdict for c in self.checks if c.judged}
        return "failed" if FAIL in judged else "undecided" if UNDECIDED in judged else "passed"

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_json(self) -> dict:
        d = {"passed": self.passed, "verdict": self.verdict, **asdict(self)}
        d["checks"] = [c.to_json() for c in self.checks]
        return d
