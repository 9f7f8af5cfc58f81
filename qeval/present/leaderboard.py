"""Leaderboards from saved results: markdown (for a model card), CSV, JSON, a self-contained HTML page
(qeval.present.html_page) and plots (qeval.present.plots).

    board = leaderboard.build(["qeval-runs"])          # load + check the results, compute rows and Pareto front
    board.rows                                          # one BoardRow per candidate, sorted by mean KLD
    board.deployment                                    # speed and memory (given deployment records), or None
    board.records()                                     # the same as plain dicts: the rows of leaderboard.csv
    board = leaderboard.write(board, "leaderboard")     # leaderboard.{md,csv,json,html} + plots (PNG and SVG)
    board.paths                                         # what was written

Every result on one board must come from the same reference over the same tokens (reference label, and the
reference's identity as qeval.identity defines it: model fingerprint, settings, token ids of the chunks
compared) with this qeval's metrics version; anything else is refused.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from qeval import __version__
from qeval.compare import ranking, sampler
from qeval.compare.ranking import pareto_front  # noqa: F401 (leaderboard.pareto_front, as before)
from qeval.errors import QevalError
from qeval.identity import changes
from qeval.present import board as boardrows
from qeval.present import deployment_board, plots, results, task_flips
from qeval.present.board import BoardRow
from qeval.present.deployment_board import DeploymentBoard
from qeval.present.html_page import leaderboard_html
from qeval.storage.results import find_results

DEFAULT_OUT = "leaderboard"


@dataclass
class Leaderboard:
    rows: list[BoardRow]  # sorted by mean KLD, each with its rank, Pareto flag and result file
    results: list[results.Result]  # in the order of rows
    settings: dict  # what every row shares: reference, corpus, n_ctx, chunks, scored tokens, samplers
    title: str
    samplers: tuple[str, ...] = ()  # samplers every result holds (board.common_samplers): a TVD column each
    tasks: tuple[str, ...] = ()  # task sets with flips beside the results (qeval.present.task_flips): a column each
    paths: dict[str, Path] = field(default_factory=dict)  # filled by write(): name -> file
    deployment: DeploymentBoard | None = None  # speed and memory of the rows, when records were given
    reference_row: BoardRow | None = None  # the reference itself, on a board with speed and memory
    # a board of contributions (qeval.present.contributed_board.Sources): where rows were measured, what was left out
    sources: object | None = None

    @property
    def table_rows(self) -> list[BoardRow]:
        """The rows of the tables (markdown, CSV, JSON, HTML, card): the reference's first when the board has one."""
        return [*([self.reference_row] if self.reference_row is not None else []), *self.rows]

    @property
    def pareto(self) -> list[str]:
        """Labels on a Pareto front: weight quants, smallest file first, then KV-cache quants, least memory first."""
        front = [r for r in self.rows if r.pareto]
        return [r.label for r in sorted(front, key=lambda r: (r.kv_quant,
                                                               r.memory_estimate_gib if r.kv_quant else r.size_gib,
                                                               r.kld_mean))]

    def markdown(self) -> str:
        return markdown_page(self)

    def to_json(self) -> dict:
        return leaderboard_json(self)

    @property
    def control(self) -> bool:
        """Whether a control (the reference recomputed: the noise floor) is on the board."""
        return boardrows.has_control(self.rows)

    @property
    def segments(self) -> tuple[str, ...]:
        """The segments any row holds (conversations, --score assistant): a KLD column each."""
        return boardrows.group_names(self.rows)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns of the CSV and of the JSON rows (a TVD column per sampler, KLD and SE per segment, flips
        figures per task set)."""
        return ("rank", "label", "quant", "model_file", "type_k", "type_v", "size_gib", "bpw", "memory_estimate_gib",
                *boardrows.board_keys(self.samplers), *boardrows.BOUND_KEYS, *boardrows.DEEPEST_KEYS,
                *boardrows.segment_keys(self.segments),
                *task_flips.keys(self.tasks),
                *boardrows.CONTROL_KEYS, *boardrows.FLOOR_KEYS,
                "pareto", "result", *(("reference", *self.deployment.keys()) if self.deployment else ()))

    def records(self) -> list[dict]:
        """The rows as written (CSV, JSON): a value per column, None where a row has none."""
        return [_record(r, self.columns, self.deployment) for r in self.table_rows]

    def figures(self) -> dict:
        """name -> matplotlib Figure for every plot (display them in a notebook, or savefig)."""
        return plots.figures(self)


def _record(row: BoardRow, columns: tuple[str, ...], deployment: DeploymentBoard | None) -> dict:
    flat = {"rank": row.rank, **row.to_json(), "pareto": row.pareto, "result": row.result,
            **(deployment.values(row.label) if deployment else {})}
    return {k: flat.get(k) for k in columns}


# --------------------------------------------------------------------------------------------------
# loading and checking
# --------------------------------------------------------------------------------------------------
def load_results(runs: list[str | os.PathLike], with_per_token: bool = True) -> list[results.Result]:
    """Results named directly, or found in directories (a runs dir or its results/), each file once."""
    seen, loaded = set(), []
    for path in find_results(list(runs)):
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            loaded.append(results.load_result(path, with_per_token=with_per_token))
    return loaded


def board_identity(res: results.Result) -> dict:
    """What every result on one board shares: the reference (the label the page names it by, and its identity
    over the chunks compared: model, settings, token ids) and the chunk count. Each result must have been
    computed with this qeval's formulas (results.require_current)."""
    request = results.require_current(res)
    return {"reference label": res.ref_label, "reference": request.reference, "chunks": request.chunks}


def check_comparable(loaded: list[results.Result]) -> None:
    """Refuse stale results, results computed against different references or token sets, and two results
    for one label."""
    if not loaded:
        raise QevalError("no results to put on a leaderboard")
    first = loaded[0]
    base = board_identity(first)
    for other in loaded[1:]:
        diffs = changes(base, board_identity(other))
        if diffs:
            raise QevalError(
                f"{first.path} (reference {first.ref_label}) and {other.path} (reference {other.ref_label}) were "
                f"computed against different references or token sets ({'; '.join(diffs)}); "
                "a leaderboard needs one reference and one token set: make one leaderboard per reference")
    by_label: dict[str, Path] = {}
    for r in loaded:
        if r.label in by_label:
            raise QevalError(f"two results for candidate {r.label!r}: {by_label[r.label]} and {r.path}; "
                             "pass only one of them")
        by_label[r.label] = r.path


def settings_of(loaded: list[results.Result]) -> dict:
    s = loaded[0].summary
    ref = s.reference
    model, corpus = ref.facts, ref.corpus or {}
    p = s.perplexity
    return {
        "reference": {"label": ref.label, "model_file": model.get("file_name"), "quant": model.get("quant"),
                      "fingerprint": model.get("fingerprint"), "size_gib": model.get("size_gib"),
                      "kv": ref.kv_text() if ref.kv_types.get("type_k") else None,
                      "ppl": p["ppl_ref"], "ppl_se": p["ppl_ref_se"], "store": ref.path},
        "corpus": {"name": corpus.get("name"), "source": corpus.get("source"), "sha256": corpus.get("sha256")},
        "n_ctx": ref.n_ctx,
        "scoring": ((s.request or {}).get("reference") or {}).get("scoring", "half"),
        "n_vocab": ref.n_vocab,
        "chunks": s.chunks,
        "scored_tokens": s.scored_tokens,
        "tokens_sha256": ref.tokens_sha256,
        "qeval_version": __version__,
    }


def mark_pareto_fronts(rows: list[BoardRow]) -> None:
    """Like with like: weight quants on file size, KV-cache quants on memory at the context (board.PARETO_NOTE). A
    control and a floor are on neither: they are the reference itself, and beat every quant at the reference's size."""
    flags = ranking.on_fronts([r.kv_quant for r in rows], [boardrows.is_baseline(r) for r in rows],
                              [r.size_gib for r in rows],
                              [r.memory_estimate_gib for r in rows], [r.kld_mean for r in rows])
    for row, on_front in zip(rows, flags):
        row.pareto = on_front


def build(runs: list[str | os.PathLike] | None = None, title: str | None = None,
          loaded: list[results.Result] | None = None,
          deployment: deployment_board.Records | None = None) -> Leaderboard:
    """Load results (paths or directories), check that they share a reference and tokens, compute the rows; with
    `deployment` (the speed and memory records beside them), their speed and memory columns and a row for the
    reference."""
    if loaded is None:
        if not runs:
            raise QevalError("name at least one result file or directory of results")
        loaded = load_results(runs)
    check_comparable(loaded)
    samplers = boardrows.common_samplers([r.summary for r in loaded])
    pairs = sorted(((_row(r, samplers), r) for r in loaded), key=lambda pr: boardrows.rank_key(pr[0]))
    rows = [row for row, _ in pairs]
    mark_pareto_fronts(rows)
    boardrows.compare_with_control(rows)
    held = {id(row): res.per_token for row, res in pairs}
    boardrows.compare_with_floor(rows, lambda row: held[id(row)])
    ranked = iter(range(1, len(rows) + 1))
    for row, (_, res) in zip(rows, pairs):  # the control and the floor are no contenders
        row.rank, row.result = None if boardrows.is_baseline(row) else next(ranked), str(res.path)
    settings = {**settings_of(loaded), "samplers": {name: sampler.parse(name).settings() for name in samplers}}
    if title is None:
        ref = settings["reference"]
        title = f"Quantization leaderboard: KL divergence vs {ref['model_file'] or ref['label']}"
    board = Leaderboard(rows=rows, results=[res for _, res in pairs], settings=settings, title=title,
                        samplers=samplers, tasks=boardrows.common_tasks(rows))
    return with_deployment(board, deployment) if deployment is not None else board


def with_deployment(board: Leaderboard, deployment: deployment_board.Records) -> Leaderboard:
    """The board with the speed and memory of its rows and of the reference (a row of its own); unchanged when no
    record is any row's."""
    reference = boardrows.reference_row(board.results[0].summary)
    table = [reference, *board.rows]
    view = deployment_board.match(table, deployment.records, deployment.current, deployment.machine)
    if view is not None:
        board.deployment = deployment_board.with_front(view, table, deployment_board.QUALITIES)
        board.reference_row = reference
    return board


def _row(res: results.Result, samplers: tuple[str, ...]) -> BoardRow:
    """A result's row, with the flips of its candidate's task stores when its runs directory has them."""
    if res.path is None:
        return boardrows.board_row(res.summary, samplers)
    return boardrows.row_with_flips(res.summary, samplers, task_flips.tasks_root(res.path), str(res.path))


# --------------------------------------------------------------------------------------------------
# text outputs
# --------------------------------------------------------------------------------------------------
def markdown_page(board: Leaderboard) -> str:
    """Paste-ready for a Hugging Face model card: heading, settings, the table sorted by mean KLD, notes."""
    out = [f"## {board.title}", ""]
    out += [f"- **{k}:** {v}" for k, v in boardrows.settings_lines(board.settings, board.samplers)]
    view = board.deployment
    if view is not None:
        out += [f"- **{k}:** {v}" for k, v in view.lines()]
    out += ["", boardrows.leaderboard_markdown(board.table_rows, board.samplers, board.tasks, pareto=True,
                                               deployment=view), "",
            boardrows.notes(board.samplers, board.tasks, board.control, board.segments,
                            boardrows.has_floor(board.rows)), ""]
    if view is not None:
        out += [" ".join(view.notes()), "", *deployment_board.other_machines_markdown(view, board.table_rows)]
    if board.sources is not None:
        out += board.sources.markdown()
    return "\n".join(out)


def leaderboard_json(board: Leaderboard) -> dict:
    """Strict JSON (a NaN standard error becomes null)."""
    columns = board.columns
    return strict_json({"title": board.title, "settings": board.settings, "pareto_front": board.pareto,
                    "columns": list(columns), "rows": board.records(),
                    "by_confidence": {r.label: boardrows.confidence_figures(r) for r in board.table_rows},
                    **({"deployment": board.deployment.to_json()} if board.deployment else {}),
                    **({"sources": board.sources.to_json()} if board.sources is not None else {})})


def strict_json(v):
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def csv_text(board: Leaderboard) -> str:
    buffer = io.StringIO(newline="")
    w = csv.writer(buffer)
    w.writerow(board.columns)
    for r in board.records():
        w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in r.values()])
    return buffer.getvalue()


def json_text(board: Leaderboard) -> str:
    return json.dumps(leaderboard_json(board), indent=2, allow_nan=False)


# The files of a board beside its plots and page: a new output format is one function and one entry here.
TEXT_OUTPUTS = {"leaderboard.md": markdown_page, "leaderboard.csv": csv_text, "leaderboard.json": json_text}


# --------------------------------------------------------------------------------------------------
# writing everything
# --------------------------------------------------------------------------------------------------
def write(board: Leaderboard, out: str | os.PathLike = DEFAULT_OUT) -> Leaderboard:
    """Write leaderboard.{md,csv,json,html} and every plot as PNG and SVG into `out`; fills board.paths."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {}
        inline = {}
        for name, fig in board.figures().items():
            paths[f"{name}.png"], paths[f"{name}.svg"], inline[name] = plots.save_figure(fig, out, name)
        for name, render in TEXT_OUTPUTS.items():
            paths[name] = out / name
            paths[name].write_text(render(board), newline="")
        paths["leaderboard.html"] = out / "leaderboard.html"
        paths["leaderboard.html"].write_text(leaderboard_html(board, inline))
    except OSError as exc:
        raise QevalError(f"cannot write the leaderboard into {out}: {exc.strerror or exc}") from None
    board.paths = paths
    return board


def leaderboard(runs: list[str | os.PathLike], out: str | os.PathLike = DEFAULT_OUT,
                title: str | None = None) -> Leaderboard:
    """build() then write(): what `qeval leaderboard` runs. Returns the board (rows, settings, paths)."""
    return write(build(runs, title=title), out)
