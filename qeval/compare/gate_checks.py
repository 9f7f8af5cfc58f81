"""What a release gate (`qeval check`, qeval.orchestrate.gate) found: a Check per threshold or baseline metric."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Check:
    name: str  # the option or "baseline:<metric>"
    metric: str
    passed: bool
    value: float
    se: float | None
    limit: float
    bound: float | None  # the favourable end of the interval that was compared with the limit
    reason: str
    judged: bool = True  # False: shown for information only (no error bar on either side)


@dataclass
class GateResult:
    passed: bool
    candidate: str
    reference: str
    chunks: int
    scored_tokens: int
    z: float
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    baseline: dict | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks]
        return d
