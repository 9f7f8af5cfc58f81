"""A model-card block from saved results (`qeval card`): a table per quant, the KLD-vs-size Pareto plot beside it,
where the numbers come from (qeval.present.card_provenance) and a JSON sidecar of the same rows and provenance.

    card = build(["qeval-runs"])              # leaderboard.build's checks, and one corpus
    card.markdown()                           # the block, without its markers (qeval.present.card_merge adds them)
    card.to_json()                            # the sidecar
    result, text = report(["qeval-runs"], "card", merge="README.md")   # what `qeval card` runs

Rows are the leaderboard's (sorted by mean KLD), their numbers formatted by the metric registry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from qeval.compare.metric_registry import METRICS, Metric, MetricValue
from qeval.compare.summary import DepthBand
from qeval.errors import QevalError
from qeval.present import board as boardrows
from qeval.present import card_merge, card_provenance, deployment_board, leaderboard, plots, task_flips
from qeval.present.board import BoardRow
from qeval.present.markdown import markdown_table

CARD_METRICS = ("kld_mean", "kld_999", "same_top1_pct", "ppl")  # the table's metric columns, in order
PLOT = "kld_vs_size"  # the leaderboard's figure of mean KLD against size, Pareto front marked
MARKDOWN, SIDECAR, PLOT_FILE = "card.md", "card.json", f"{PLOT}.png"
DEFAULT_OUT = "card"


@dataclass
class CardRow:
    row: BoardRow
    bands: dict[str, DepthBand]  # by-depth band name ("0-512") -> its figures


@dataclass
class Card:
    board: leaderboard.Leaderboard
    rows: list[CardRow]  # in the board's order
    provenance: dict  # qeval.present.card_provenance.of_board
    bands: tuple[str, ...]  # by-depth bands with a column each: those every row holds, when there are several

    @property
    def title(self) -> str:
        return self.board.title

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.board.tasks

    @property
    def segments(self) -> tuple[str, ...]:
        """The segments any row holds (conversations, --score assistant): a column each, as on the leaderboard."""
        return self.board.segments

    @property
    def has_control(self) -> bool:
        """Whether a control row is on the card: then a column of each quant's KLD over it."""
        return boardrows.has_control([r.row for r in self.rows])

    @property
    def has_floor(self) -> bool:
        """Whether a floor row is on the card: then a column of each KV quant's KLD over it."""
        return boardrows.has_floor([r.row for r in self.rows])

    @property
    def deployment(self):
        """The speed and memory beside the rows (qeval.present.deployment_board.DeploymentBoard), or None."""
        return self.board.deployment

    def markdown(self, plot: str = PLOT_FILE, sidecar: str = SIDECAR) -> str:
        return markdown(self, plot, sidecar)

    def to_json(self) -> dict:
        # NaN (an SE over too few tokens) is not JSON: the round trip turns it into null
        view = self.deployment
        return json.loads(json.dumps({"title": self.title, "provenance": self.provenance,
                                      "pareto_front": self.board.pareto, "plot": PLOT_FILE,
                                      "rows": [record(r, self.bands, self.tasks, self.segments, view)
                                               for r in self.rows],
                                      **({"deployment": view.to_json()} if view else {})}),
                          parse_constant=lambda _: None)


def card_metrics() -> list[Metric]:
    return [METRICS[key] for key in CARD_METRICS]


def build(runs: list[str | os.PathLike], title: str | None = None, deployment=None) -> Card:
    """The card of saved results (files or directories): refused as leaderboard.build refuses, and for a corpus
    that differs between them; with `deployment` (qeval.present.deployment_board.Records), speed and memory columns
    and the reference's row."""
    board = leaderboard.build(runs, title=title, deployment=deployment)
    card_provenance.check_same_corpus(board.results)
    rows = [CardRow(row, {b.name: b for b in res.summary.by_depth or ()}) for row, res in zip(board.rows, board.results)]
    bands = depth_columns(rows)
    if board.reference_row is not None:
        rows.insert(0, CardRow(board.reference_row, {}))
    return Card(board, rows, card_provenance.of_board(board), bands)


def depth_columns(rows: list[CardRow]) -> tuple[str, ...]:
    """The bands every row holds; none when there is one band only (it is every scored token: the mean KLD)."""
    common = [name for name in rows[0].bands if all(name in r.bands for r in rows)]
    return tuple(common) if len(common) > 1 else ()


# --------------------------------------------------------------------------------------------------
# rows: the sidecar's numbers and the table's cells
# --------------------------------------------------------------------------------------------------
def _value_se(mv: MetricValue | None) -> tuple[float | None, float | None]:
    return (None, None) if mv is None else (mv.value, mv.se)


def _kld_cell(group: DepthBand | None) -> str:
    """A depth band's or segment's mean KLD ± SE; empty for a segment the row holds no token of."""
    return "" if group is None else METRICS["kld_mean"].cell(group.kld["mean"], group.kld["se"])


def record(r: CardRow, bands: tuple[str, ...], tasks: tuple[str, ...], segments: tuple[str, ...] = (),
           deployment=None) -> dict:
    """A row of the sidecar: the table's numbers unformatted (a metric's SE under `<key>_se`); "by_segment" only
    on a card with segment columns, the speed and memory columns (DeploymentBoard.keys) only with `deployment`."""
    row = r.row
    out = {"rank": row.rank, "label": row.label, "quant": row.quant, "model_file": row.model_file, "kv": row.kv,
           "size_gib": row.size_gib, "bpw": row.bpw}
    for m in card_metrics():
        value, se = _value_se(row.metrics.get(m.key))
        out[m.key] = value
        if m.has_se:
            out[m.se_key] = se
    out["kld_mean_bound"] = None if row.kld_bound is None else row.kld_bound.bound
    out["by_depth"] = {name: boardrows.kld_of(r.bands[name], "kld_mean") for name in bands if name in r.bands}
    if segments:
        out["by_segment"] = {name: boardrows.kld_of(row.segments.get(name), "kld_mean") for name in segments}
    out["by_confidence"] = boardrows.confidence_figures(row)
    out["flips"] = {task: row.task_flips[task].to_json() for task in tasks if task in row.task_flips}
    written = row.to_json()  # the control's and the floor's columns as the board writes them, verdicts included
    out.update(memory_estimate_gib=row.memory_estimate_gib, kv_quant=row.kv_quant,
               **{k: written[k] for k in (*boardrows.CONTROL_KEYS, *boardrows.FLOOR_KEYS)},
               pareto=row.pareto, result=row.result)
    if deployment is not None:
        out.update(reference=row.reference, **deployment.values(row.label))
    return out


def header(bands: tuple[str, ...], tasks: tuple[str, ...], control: bool = False, segments: tuple[str, ...] = (),
           floor: bool = False, deployment=None) -> list[str]:
    return ["label", "file", "KV", "size GiB", "BPW", *(m.heading + (" ± SE" if m.has_se else "") for m in card_metrics()),
            "KLD bound", *(["KLD over control"] if control else []), *(["KLD over floor ± SE"] if floor else []),
            *(f"mean KLD, positions {name} ± SE" for name in bands), *(f"mean KLD, {name} ± SE" for name in segments),
            *(h for h, _ in task_flips.columns(tasks)),
            *(h for h, _ in (deployment.columns() if deployment else ())), "Pareto"]


def cells(r: CardRow, bands: tuple[str, ...], tasks: tuple[str, ...], control: bool = False,
          segments: tuple[str, ...] = (), floor: bool = False, deployment=None) -> list[str]:
    row = r.row
    return [row.label, row.model_file or "?", row.kv, _fixed(row.size_gib, ".3f"), _fixed(row.bpw, ".2f"),
            *(boardrows.metric_cell(row, m, row.metrics.get(m.key)) for m in card_metrics()),
            "" if row.kld_bound is None else row.kld_bound.bound_text(),
            *([boardrows.control_cell(row)] if control else []), *([boardrows.floor_cell(row)] if floor else []),
            *(_kld_cell(r.bands.get(name)) for name in bands),
            *(_kld_cell(row.segments.get(name)) for name in segments),
            *(row.task_flips[task].cell() if task in row.task_flips else "" for task in tasks),
            *(deployment.cells(row.label) if deployment else ()), boardrows.pareto_mark(row)]


def _fixed(v: float | None, fmt: str) -> str:
    return "?" if v is None else f"{v:{fmt}}"


def table(card: Card) -> str:
    control, segments, floor, view = card.has_control, card.segments, card.has_floor, card.deployment
    return markdown_table(header(card.bands, card.tasks, control, segments, floor, view),
                          [cells(r, card.bands, card.tasks, control, segments, floor, view) for r in card.rows])


def confidence_lines(card: Card) -> list[str]:
    """The card's figure of where the damage sits: a line per quant, the mean KLD ± SE in each bucket of the
    reference's top-1 probability and the bucket's share of the quant's KLD; "not recorded" for a result saved
    before qeval kept the reference's top-1 probability. None when no row holds buckets."""
    rows = [r.row for r in card.rows if not r.row.reference]
    if not any(r.confidence for r in rows):
        return []

    def bucket(group) -> str:
        share = "" if group.kld_share is None else f" ({100 * group.kld_share:.1f} %)"
        return f"{group.name}: {_kld_cell(group)}{share}"

    return [f"- **{r.label}:** " + ("not recorded" if r.confidence is None else " · ".join(map(bucket, r.confidence)))
            for r in rows]


CONFIDENCE_HEADING = ("**Mean KLD by the reference's confidence** (buckets of the reference's top-1 probability, each "
                      "bucket's mean KLD ± its cluster-robust SE and its share of the quant's summed KLD; damage in the "
                      "top bucket is on tokens the reference was sure of; \"not recorded\": a result saved before qeval "
                      "kept the reference's top-1 probability):")


# --------------------------------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------------------------------
NOTE = ("Rows are sorted by mean KLD, KL(reference ‖ quant) in nats per scored token; 99.9% KLD is that percentile "
        "of the per-token KLD; same top-1: share of tokens where both models' most likely token is the same; ± is "
        "one standard error. " + boardrows.BOUND_NOTE + " " + boardrows.PARETO_NOTE)


def markdown(card: Card, plot: str = PLOT_FILE, sidecar: str = SIDECAR) -> str:
    """The block: heading, table, plot, provenance; plot and sidecar are links relative to where it is read."""
    note = " ".join([NOTE, *boardrows.baseline_notes(card.has_control, card.has_floor)])
    view = card.deployment
    if view is not None:
        note += " " + " ".join(view.notes())
    confidence = confidence_lines(card)
    out = [f"## {card.title}", "", *([f"- **{k}:** {v}" for k, v in view.lines()] + [""] if view else []),
           table(card), "", note, "", *([CONFIDENCE_HEADING, "", *confidence, ""] if confidence else []),
           *(deployment_board.other_machines_markdown(view, card.board.table_rows) if view else []),
           f"![Mean KLD against model size, Pareto front marked]({plot})", "",
           f"**Provenance** (as JSON: [{Path(sidecar).name}]({sidecar}))", ""]
    out += [f"- **{k}:** {v}" for k, v in card_provenance.lines(card.provenance)]
    return "\n".join(out) + "\n"


def _relative(target: Path, start: Path) -> str:
    """A link from a file in `start` to `target` (markdown wants forward slashes)."""
    return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()


# --------------------------------------------------------------------------------------------------
# files and `qeval card`
# --------------------------------------------------------------------------------------------------
def write(card: Card, out: str | os.PathLike = DEFAULT_OUT) -> dict[str, Path]:
    """card.md, card.json and the plot (PNG, and the SVG plots.save_figure writes with it) into `out`."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        png, svg, _ = plots.save_figure(card.board.figures()[PLOT], out, PLOT)
        paths = {MARKDOWN: out / MARKDOWN, SIDECAR: out / SIDECAR, PLOT_FILE: png, svg.name: svg}
        paths[MARKDOWN].write_text(f"{card_merge.BEGIN}\n{card.markdown()}{card_merge.END}\n")
        paths[SIDECAR].write_text(json.dumps(card.to_json(), indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise QevalError(f"cannot write the card into {out}: {exc.strerror or exc}") from None
    return paths


def report(runs: list[str | os.PathLike], out: str | os.PathLike = DEFAULT_OUT, merge: str | os.PathLike | None = None,
           title: str | None = None, deployment=None) -> tuple[dict, str]:
    """Build the card (with `deployment`: qeval.present.deployment_board.Records, speed and memory), write its files
    into `out`, and with `merge`, put the block into that markdown file (its links relative to it). A merge that
    would be refused is refused before anything is written."""
    card, out = build(runs, title, deployment), Path(out)
    pending = None
    if merge is not None:
        where = Path(merge).parent
        pending = card_merge.prepare(merge, card.markdown(_relative(out / PLOT_FILE, where),
                                                          _relative(out / SIDECAR, where)))
    paths = write(card, out)
    merged = None if pending is None else {"file": str(pending.path), "action": pending.apply()}
    result = {**card.to_json(), "paths": {name: str(p) for name, p in paths.items()}, "merge": merged}
    lines = [paths[MARKDOWN].read_text(), "wrote " + ", ".join(map(str, paths.values()))]
    if merged:
        lines.append(f"{merged['file']}: card block {merged['action']}")
    return result, "\n".join(lines)
