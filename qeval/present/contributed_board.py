"""A board of contributed results (`qeval board hf:USER/DATASET ...`, qeval.orchestrate.contributions): where each
row was measured, each row measured on another machine than the board's, or whose candidate ran on another backend
than the reference, marked ([1], [2], ...: one mark per machine and backend, its footnote naming them); the results
listed apart with the reason (another reference, another tokenizer or scoring, another qeval's formulas) and the
files refused (tampered, partial, unreadable), each named. The rows themselves are the leaderboard's
(qeval.present.leaderboard); speed and memory stay with their machine (qeval.present.deployment_board).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qeval.present.deployment_board import Machine
from qeval.present.markdown import markdown_table


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where one row was measured: the machine its contribution was uploaded from, the backend its candidate's
    llama.cpp build computed on, and the file it was read from (hf:USER/DATASET/PATH)."""

    machine: Machine
    backend: str
    file: str


@dataclass(kw_only=True)
class Sources:
    """What a board of contributions was built from, and what it left out."""

    datasets: tuple[str, ...]  # hf:USER/DATASET, as given
    reference: str  # the digest of the reference identity every row was measured against
    reference_backend: str  # what the reference's build computed on
    machine: Machine  # the board's machine: a row measured elsewhere is marked
    origins: dict[str, Origin]  # row label -> where it was measured
    apart: list[tuple[str, str, str]] = field(default_factory=list)  # (file, reference, why): not on this board
    refused: list[tuple[str, str]] = field(default_factory=list)  # (file, why): tampered, partial, unreadable
    marks: dict[tuple[str, str], str] = field(default_factory=dict)  # (machine key, backend) -> its mark

    def mark_of(self, label: str) -> str:
        """The mark of a row ("" on the board's machine and the reference's backend)."""
        origin = self.origins.get(label)
        if origin is None or (origin.machine.key == self.machine.key and origin.backend == self.reference_backend):
            return ""
        key = (origin.machine.key, origin.backend)
        return self.marks.setdefault(key, f"[{len(self.marks) + 1}]")

    def footnotes(self) -> list[str]:
        machines = {o.machine.key: o.machine for o in self.origins.values()}
        out = [f"Rows without a mark were measured on {self.machine.text}, their candidates computed on the "
               f"reference's backend ({self.reference_backend})."]
        for (key, backend), mark in self.marks.items():
            other = "" if backend == self.reference_backend else \
                f"; its candidate computed on {backend}, the reference on {self.reference_backend}"
            out.append(f"{mark} measured on another machine or backend: {machines[key].text}{other}. The same "
                       "reference and tokens: comparable, though another build or backend moves llama.cpp's numerics "
                       "slightly.")
        return out

    def markdown(self) -> list[str]:
        """The footnotes, then the results listed apart and the files refused, each with why."""
        out = [f"**Contributions:** {', '.join(self.datasets)}; reference identity {self.reference[:12]}.", "",
               *(f"- {line}" for line in self.footnotes()), ""]
        if self.apart:
            out += [f"**Not on this board ({len(self.apart)}):** measured against another reference, or not "
                    "comparable with it.", "",
                    markdown_table(["result", "reference", "why"], [list(row) for row in self.apart]), ""]
        if self.refused:
            out += [f"**Refused ({len(self.refused)}):** files that are not what their contribution's manifest lists, "
                    "or do not read; left out of the board.", "",
                    markdown_table(["file", "why"], [list(row) for row in self.refused]), ""]
        return out

    def to_json(self) -> dict:
        return {"datasets": list(self.datasets), "reference": self.reference, "machine": self.machine.key,
                "reference_backend": self.reference_backend,
                "rows": {label: {"machine": o.machine.key, "machine_text": o.machine.text, "backend": o.backend,
                                 "file": o.file, "mark": self.mark_of(label)} for label, o in self.origins.items()},
                "footnotes": self.footnotes(),
                "apart": [{"result": f, "reference": r, "why": w} for f, r, w in self.apart],
                "refused": [{"file": f, "why": w} for f, w in self.refused]}


def mark_rows(rows, sources: Sources) -> None:
    """Give each row (BoardRow, in the board's order) its mark."""
    for row in rows:
        row.mark = sources.mark_of(row.label)
