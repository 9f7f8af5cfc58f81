"""The leaderboard's rows, each built once from a comparison summary: the board `qeval matrix` prints, the one
`qeval leaderboard` writes (qeval.present.leaderboard) and the one notebooks/leaderboard.ipynb shows.

A BoardRow keeps a sampler's figures under row.samplers[sampler name], a task set's under row.task_flips[task set]
and (conversations, --score assistant) a segment's under row.segments[segment name]; only its written form (to_json:
matrix JSON rows, leaderboard CSV and JSON columns) names them `<metric>@<sampler>`, `<figure>@<task set>` and
`kld_<segment>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qeval.compare import metric_registry, ranking, sampler
from qeval.compare.metric_registry import Metric, MetricValue, plus_minus, sampler_metrics
from qeval.compare.paired_stats import kld_excess
from qeval.compare.verdict import UNDECIDED, Verdict, excess_over, fewer_chunks, judge, written
from qeval.compare.summary import ComparisonSummary, DepthBand, TokenGroup
from qeval.engine.modelinfo import kv_cache_gib
from qeval.identity import is_control, is_floor
from qeval.present import task_flips
from qeval.present.markdown import markdown_table
from qeval.present.task_flips import FlipFigures
from qeval.storage.scoring import Scoring

DEEPEST_KEYS = ("deepest_band", "kld_deepest", "kld_deepest_se")
BOUND_KEYS = ("kld_mean_bound",)  # the certified bound of the mean KLD (docs/error-bound.md)
# a verdict (qeval.compare.verdict) is written as its state and the chunks it stands on (verdict.written)
CONTROL_KEYS = ("control", "kld_excess", "noise_verdict", "noise_verdict_chunks")
FLOOR_KEYS = ("floor", "kld_over_floor", "kld_over_floor_se", "floor_verdict", "floor_verdict_chunks")


def sampler_board_metrics(name: str) -> tuple[Metric, ...]:
    """The board metrics of sampler `name` (its mean TVD)."""
    return tuple(m for m in sampler_metrics(name) if m.board)


def board_metrics(samplers=()) -> tuple[Metric, ...]:
    """The metrics of a leaderboard's columns: metric_registry.board(), then the board metrics of each sampler in
    `samplers` (names)."""
    return (*metric_registry.board(), *(m for name in samplers for m in sampler_board_metrics(name)))


def board_keys(samplers=()) -> tuple[str, ...]:
    """The columns of board_metrics(samplers): each metric's key and, where it has an SE, its SE key."""
    return tuple(k for m in board_metrics(samplers) for k in ((m.key, m.se_key) if m.has_se else (m.key,)))


def common_samplers(summaries: list[ComparisonSummary]) -> tuple[str, ...]:
    """The samplers (as the first comparison names them) whose figures every comparison holds: a leaderboard's
    sampler columns."""
    if not summaries:
        return ()
    first, *rest = summaries
    return tuple(name for name in first.samplers if all(sampler.held_as(s.samplers, name) for s in rest))


def common_tasks(rows: list[BoardRow]) -> tuple[str, ...]:
    """Task sets any row has flips for, in name order: a flips column each."""
    return tuple(sorted({task for r in rows for task in r.task_flips}))


def group_names(rows: list[BoardRow], grouping: str = "segments") -> tuple[str, ...]:
    """The groups ("segments" or "categories") any row holds, in the order the rows' summaries list them (a name
    one row lacks goes where the rows that hold it put it): on a leaderboard, a KLD column per segment."""
    names: list[str] = []
    for r in rows:
        at = 0
        for name in getattr(r, grouping):
            if name not in names:
                names.insert(at, name)
            at = names.index(name) + 1
    return tuple(names)


def segment_keys(segments=()) -> tuple[str, ...]:
    """The written columns of the segments `segments` (names): kld_<segment> and kld_<segment>_se each."""
    return tuple(k for name in segments for k in (f"kld_{name}", f"kld_{name}_se"))


def kld_of(group: TokenGroup | None, key: str) -> dict:
    """{key: the group's mean KLD, key_se: its SE}, both None for a group not held: a depth band's or a segment's
    written columns."""
    return {key: None if group is None else group.kld["mean"], f"{key}_se": None if group is None else group.kld["se"]}


def bucket_figures(group: TokenGroup) -> dict:
    """A confidence bucket as a board writes it: its edges, token count, mean KLD ± SE, same top-1 % ± SE and share
    of the row's KLD; None for a number that is not one (the SE of a bucket on one block of positions)."""
    top1 = group.figures.blocks["same_top1"]
    out = {"lo": group.lo, "hi": group.hi, "n": group.n, **kld_of(group, "kld_mean"),
           "same_top1_pct": 100 * top1["fraction"], "same_top1_pct_se": 100 * top1["se"], "kld_share": group.kld_share}
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in out.items()}


def confidence_figures(row: "BoardRow") -> list[dict] | None:
    """A row's buckets of the reference's confidence (bucket_figures); None: not recorded (a result saved before
    qeval kept the reference's top-1 probability)."""
    return None if row.confidence is None else [bucket_figures(g) for g in row.confidence]


def kld_cell(group: TokenGroup | None) -> str:
    """A group's mean KLD ± SE in a leaderboard cell; empty for a group not held."""
    return "" if group is None else plus_minus(group.kld["mean"], group.kld["se"], ".6f")


@dataclass(kw_only=True)
class BoardRow:
    """One candidate on a board: who it is, its board metrics (None: not held), its deepest band, its segments and
    categories (conversations), its task flips, and (on a leaderboard) its place."""

    label: str
    quant: str
    kv: str  # "type_k/type_v"
    metrics: dict[str, MetricValue | None]  # metric_registry.board() by key
    model_file: str | None = None
    type_k: str | None = None
    type_v: str | None = None
    size_gib: float | None = None
    bpw: float | None = None
    # sampler name -> its board metrics by key
    samplers: dict[str, dict[str, MetricValue | None]] = field(default_factory=dict)
    deepest: DepthBand | None = None  # the band of the deepest scored positions
    task_flips: dict[str, FlipFigures] = field(default_factory=dict)  # task set -> its flips
    kv_quant: bool = False  # its KV cache types differ from the reference's: a KV-cache candidate
    # an estimate, not what llama.cpp allocates: its file plus its KV cache at the comparison's n_ctx, from the
    # GGUF's geometry (no compute buffer, sliding-window layers in full); the KV-cache quants' front axis, which
    # early decisions settle on quality alone. Measured memory: qeval.present.deployment_board.
    memory_estimate_gib: float | None = None
    rank: int | None = None
    pareto: bool | None = None  # on its Pareto front: weight quants by file size, KV-cache quants by the estimate
    result: str | None = None  # the result file it was read from
    control: bool = False  # the reference recomputed under another batch layout (qeval.identity.is_control)
    kld_excess: float | None = None  # mean KLD minus the board's control's; None: the board has no control
    noise: Verdict | None = None  # its excess over the control: "within" numerical noise, above it, or undecided
    floor: bool = False  # the reference model on another of llama.cpp's kernel paths (qeval.identity.is_floor)
    kld_over_floor: float | None = None  # a KV row's mean KLD minus the floor's, paired on the same tokens
    kld_over_floor_se: float | None = None  # its SE, chunks as the unit (qeval.compare.paired_stats.kld_excess)
    over_floor: Verdict | None = None  # its excess over the floor: above, within the floor's own KLD, or undecided
    segments: dict[str, TokenGroup] = field(default_factory=dict)  # segment name -> its figures (summary.by_segment)
    categories: dict[str, TokenGroup] = field(default_factory=dict)  # category name -> its figures (by_category)
    chunks: int | None = None  # the chunks its figures are over
    scored_tokens: int | None = None
    stopped: str | None = None  # decided early: why it stopped (qeval.compare.early; EARLY when not known); None: full
    fingerprint: str | None = None  # its model's (qeval.engine.modelinfo): a speed and memory record must match it
    reference: bool = False  # the reference itself (reference_row): a board with speed and memory shows it
    confidence: list[TokenGroup] | None = None  # summary.by_confidence; None: not recorded
    mark: str = ""  # after its label: a footnote's mark (a board of contributions: measured on another machine)

    def value(self, key: str) -> float | None:
        """The value of board metric `key` ("kld_mean", "ppl")."""
        mv = self.metrics.get(key)
        return None if mv is None else mv.value

    @property
    def kld_mean(self) -> float | None:
        return self.value("kld_mean")

    @property
    def kld_bound(self) -> MetricValue | None:
        """The mean KLD as measured, its certified bound in .bound (docs/error-bound.md)."""
        return self.metrics.get("kld_mean")

    def board_values(self) -> list[tuple[Metric, MetricValue | None]]:
        """Every board metric with its value, in column order: metric_registry.board(), then each sampler's."""
        out = [(m, self.metrics.get(m.key)) for m in metric_registry.board()]
        for name, held in self.samplers.items():
            out += [(m, held.get(m.key)) for m in sampler_board_metrics(name)]
        return out

    def to_json(self) -> dict:
        """The row as written: one entry per column, a metric's SE under `<key>_se`, a task set's figures under
        `<figure>@<task set>`."""
        out = {"label": self.label, "quant": self.quant, "kv": self.kv, "model_file": self.model_file,
               "type_k": self.type_k, "type_v": self.type_v, "size_gib": self.size_gib, "bpw": self.bpw,
               "memory_estimate_gib": self.memory_estimate_gib, "reference": self.reference}
        for m, mv in self.board_values():
            out[m.key] = None if mv is None else mv.value
            if m.has_se:
                out[m.se_key] = None if mv is None else mv.se
        out["kld_mean_bound"] = None if self.kld_bound is None else self.kld_bound.bound
        out.update(deepest_band=self.deepest.name if self.deepest else None, **kld_of(self.deepest, "kld_deepest"))
        for name, group in self.segments.items():
            out.update(kld_of(group, f"kld_{name}"))
        out.update(control=self.control, kld_excess=self.kld_excess, **written(self.noise, "noise_verdict"))
        out.update(floor=self.floor, kld_over_floor=self.kld_over_floor, kld_over_floor_se=self.kld_over_floor_se,
                   **written(self.over_floor, "floor_verdict"))
        out["by_confidence"] = confidence_figures(self)
        if self.stopped is not None:
            out.update(chunks=self.chunks, scored_tokens=self.scored_tokens, stopped=self.stopped)
        for task, figures in self.task_flips.items():
            out.update((task_flips.row_key(k, task), v) for k, v in figures.to_json().items())
        return out


def board_row(summary: ComparisonSummary, samplers=(), flips: dict[str, FlipFigures] | None = None) -> BoardRow:
    """A comparison's row, with the figures of `samplers` (names; held under that name or another of the same
    settings) and the task flips `flips`."""
    cand = summary.candidate
    model, kv = cand.facts, cand.kv_types
    held = summary.measured()
    size = model.get("size_gib")
    types = (kv.get("type_k"), kv.get("type_v"))
    kv_gib = kv_cache_gib(model, *types, summary.reference.n_ctx or 0)
    ref_kv = summary.reference.kv_types
    return BoardRow(label=cand.label, quant=model.get("quant", "?"), kv=cand.kv_text(),
                    model_file=model.get("file_name"), type_k=types[0], type_v=types[1], size_gib=size,
                    bpw=model.get("bits_per_weight"), metrics={m.key: held.get(m.key) for m in metric_registry.board()},
                    samplers={name: _sampler_figures(summary, held, name) for name in samplers},
                    deepest=summary.deepest, task_flips=flips or {},
                    kv_quant=types != (ref_kv.get("type_k"), ref_kv.get("type_v")),
                    memory_estimate_gib=None if size is None or kv_gib is None else round(size + kv_gib, 4),
                    control=is_control(summary.comparison_request()), floor=is_floor(summary.comparison_request()),
                    segments={g.name: g for g in summary.by_segment or ()},
                    categories={g.name: g for g in summary.by_category or ()}, chunks=summary.chunks,
                    scored_tokens=summary.scored_tokens, stopped=EARLY if _decided_early(summary) else None,
                    fingerprint=model.get("fingerprint"), confidence=summary.by_confidence)


def reference_row(summary: ComparisonSummary) -> BoardRow:
    """The reference itself as a row, for a board with speed and memory (the reference is measured too): its only
    quality figure is its own PPL, every other one is measured against it. Unranked, on no size front."""
    ref = summary.reference
    model, kv = ref.facts, ref.kv_types
    p = summary.perplexity
    return BoardRow(label=ref.label, quant=model.get("quant", "?"), kv=ref.kv_text(),
                    model_file=model.get("file_name"), type_k=kv.get("type_k"), type_v=kv.get("type_v"),
                    size_gib=model.get("size_gib"), bpw=model.get("bits_per_weight"),
                    metrics={"ppl": MetricValue(value=p["ppl_ref"], se=p["ppl_ref_se"])},
                    fingerprint=model.get("fingerprint"), reference=True)


def _decided_early(summary: ComparisonSummary) -> bool:
    request = summary.comparison_request()
    return request is not None and request.early is not None


def _sampler_figures(summary: ComparisonSummary, held: dict[str, MetricValue], name: str) -> dict:
    """The board metrics of sampler `name`, held under this name or under another of the same settings."""
    held_as = sampler.held_as(summary.samplers, name) or name
    return {m.key: held.get(o.key) for m, o in zip(sampler_board_metrics(name), sampler_board_metrics(held_as))}


def row_with_flips(summary: ComparisonSummary, samplers, tasks_root: Path, origin: str = "the comparison",
                   names: set[str] | None = None) -> BoardRow:
    """A comparison's row with the flips of every task set under `tasks_root` (of `names` only, when given) that
    holds stores of both its labels."""
    return board_row(summary, samplers, task_flips.flip_figures(summary, tasks_root, origin, names))


def rank_key(row: BoardRow) -> tuple:
    """A board's order: the reference (on a board with speed and memory), its control (the noise floor the rest is
    read against), then its numerics floor, then lowest mean KLD first."""
    return not row.reference, *ranking.order_key(row.control, row.kld_mean, row.label, row.floor)


def is_baseline(row: BoardRow) -> bool:
    """The reference, the control and the floor: the reference model itself, read against, never ranked, on no
    size Pareto front."""
    return row.reference or row.control or row.floor


def compare_with_floor(rows: list[BoardRow], per_token) -> None:
    """Fill kld_over_floor, its SE and over_floor of every KV-cache row against the board's floor row: the mean of
    the per-token differences of KLD on the same tokens (the chunks both hold), chunks as the unit
    (qeval.compare.paired_stats.kld_excess), judged by qeval.compare.verdict with the floor's
    own mean KLD as the margin. per_token(row): its per-token columns ({"kld", "chunk", "position"}), None when not
    at hand. Nothing when the board has no floor."""
    floor = next((r for r in rows if r.floor), None)
    base = per_token(floor) if floor is not None else None
    if base is None:
        return
    for row in rows:
        values = per_token(row) if row.kv_quant and not is_baseline(row) else None
        if values is None:
            continue
        excess = kld_excess(values, base)
        if excess is None:
            continue  # not on the floor's tokens: no paired difference
        mean, se, chunks = excess
        row.kld_over_floor, row.kld_over_floor_se = mean, se
        row.over_floor = judge(mean, se, chunks, margin=floor.kld_mean or 0.0)


def has_early(rows: list[BoardRow]) -> bool:
    """Whether the board was decided early (some row says why it stopped)."""
    return any(r.stopped is not None for r in rows)


EARLY = "decided early"  # the row of an early result whose reason its board did not say (a leaderboard of results)
# Under a board decided early (qeval matrix --early).
EARLY_NOTE = ("Decided early (--early): each pair visited the chunks in one seeded random order and stopped once its "
              "mean KLD was known to the stated precision (\"precision\") or its order against its neighbours and "
              "its Pareto status were settled (\"settled\"), chunks as the sampling unit; \"tokens (chunks)\" is "
              "what its figures stand on, of the whole corpus. A later run without --early extends each pair from "
              "its checkpoint to every chunk.")


def has_floor(rows: list[BoardRow]) -> bool:
    return any(r.floor for r in rows)


def compare_with_control(rows: list[BoardRow]) -> None:
    """Fill kld_excess and its noise verdict of every row against the board's control (the first by rank_key: the
    lowest mean KLD when several; qeval.compare.verdict.excess_over); nothing when it has none."""
    control = next((r for r in sorted(rows, key=rank_key) if r.control), None)
    for row in rows:
        if control is not None and row is not control:
            row.kld_excess, row.noise = excess_over(row.kld_bound, control.kld_bound,
                                                     fewer_chunks(row.chunks, control.chunks))


def has_control(rows: list[BoardRow]) -> bool:
    return any(r.control for r in rows)


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------
def leaderboard_columns(samplers=(), tasks=(), control: bool = False, segments=(),
                        floor: bool = False, early: bool = False, deployment=None) -> tuple[tuple[str, str], ...]:
    """(heading, written column) of the table's columns after the label: a TVD column per sampler, on a board with
    a control the KLD over it (CONTROL_NOTE), with a floor each KV row's KLD over it (FLOOR_NOTE), a KLD column per
    segment in `segments` (names, group_names), a flips column per task set, on a board decided early (has_early)
    the tokens each row stands on and why it stopped (EARLY_NOTE), and with `deployment` (a
    qeval.present.deployment_board.DeploymentBoard) its speed and memory columns."""
    return (("quant", "quant"), ("KV", "kv"), ("size GiB", "size_gib"), ("BPW", "bpw"),
            *((m.heading + (" ± SE" if m.has_se else ""), m.key) for m in board_metrics(samplers)),
            ("KLD bound", "kld_mean_bound"),
            *((("KLD over control", "kld_excess"),) if control else ()),
            *((("KLD over floor ± SE", "kld_over_floor"),) if floor else ()),
            ("KLD deepest band ± SE", "kld_deepest"), *((f"KLD {name} ± SE", f"kld_{name}") for name in segments),
            *task_flips.columns(tasks),
            *((("tokens (chunks)", "scored_tokens"), ("stopped", "stopped")) if early else ()),
            *(deployment.columns() if deployment is not None else ()))


def metric_cell(r: BoardRow, m: Metric, mv: MetricValue | None) -> str:
    """A board metric's cell; on the reference's row, blank for a figure measured against it, "reference" under
    the mean KLD."""
    if mv is None and r.reference:
        return "reference" if m.key == "kld_mean" else ""
    return m.cell(*((mv.value, mv.se) if mv else (None, None)))


def leaderboard_cells(r: BoardRow, tasks=(), control: bool = False, segments=(), floor: bool = False,
                      early: bool = False, deployment=None) -> list[str]:
    """The formatted cells of one row: label, then leaderboard_columns(its samplers, tasks, control, segments,
    floor, early, deployment)."""
    deepest = "" if r.deepest is None else f"{kld_cell(r.deepest)} ({r.deepest.name})"
    held = "" if r.scored_tokens is None else f"{r.scored_tokens:,} ({r.chunks})"
    return [f"{r.label} {r.mark}" if r.mark else r.label, r.quant, r.kv, _num(r.size_gib, ".3f"),
            _num(r.bpw, ".2f"),
            *(metric_cell(r, m, mv) for m, mv in r.board_values()),
            "" if r.kld_bound is None else r.kld_bound.bound_text(),
            *((control_cell(r),) if control else ()), *((floor_cell(r),) if floor else ()), deepest, *(kld_cell(r.segments.get(name)) for name in segments),
            *(r.task_flips[task].cell() if task in r.task_flips else "" for task in tasks),
            *((held, r.stopped or "") if early else ()),
            *(deployment.cells(r.label) if deployment is not None else ())]


def control_cell(r: BoardRow) -> str:
    """"control" on the control's row; else the excess over it and its verdict (qeval.compare.verdict): "(noise)"
    within numerical noise, "(above)" beyond it, "(undecided (N chunks))" when its interval cannot tell."""
    if r.control:
        return "control"
    if r.kld_excess is None:
        return ""
    return f"{r.kld_excess:+.6f}" + _verdict_suffix(r.noise, within="noise")


def floor_cell(r: BoardRow) -> str:
    """"floor" on the floor's row; on a KV row its paired excess over the floor ± SE and its verdict: "(above)" the
    floor, "(within)" the floor's own KLD, "(undecided (N chunks))" when its interval cannot tell."""
    if r.floor:
        return "floor"
    if r.kld_over_floor is None:
        return ""
    return plus_minus(r.kld_over_floor, r.kld_over_floor_se, '+.6f', '.6f') + _verdict_suffix(r.over_floor)


def _verdict_suffix(v: Verdict | None, within: str = "within") -> str:
    """" (above)", " (within)" ("(noise)"), or " undecided (N chunks)" (its chunks in parentheses instead)."""
    if v is None:
        return ""
    return f" {v.words()}" if v.state == UNDECIDED else f" ({v.words(within=within)})"


def pareto_mark(row: BoardRow) -> str:
    """The Pareto cell of a row: ✓ on the weight quants' front, ✓ KV on the KV-cache quants' (PARETO_NOTE)."""
    return ("✓ KV" if row.kv_quant else "✓") if row.pareto else ""


def leaderboard_markdown(rows: list[BoardRow], samplers=(), tasks=(), pareto: bool = False, deployment=None) -> str:
    """A paste-ready markdown table, sorted by mean KLD: a TVD column per sampler in `samplers` (names), a KLD
    column per segment any row holds, a flips column per task set in `tasks`, with `pareto` a column marking the
    rows on the Pareto front, and with `deployment` (a qeval.present.deployment_board.DeploymentBoard) its speed and
    memory columns."""
    control, segments, floor, early = has_control(rows), group_names(rows), has_floor(rows), has_early(rows)
    columns = leaderboard_columns(samplers, tasks, control, segments, floor, early, deployment)
    return markdown_table(["label", *(name for name, _ in columns), *(["Pareto"] if pareto else [])],
                          [[*leaderboard_cells(r, tasks, control, segments, floor, early, deployment),
                            *([pareto_mark(r)] if pareto else [])] for r in sorted(rows, key=rank_key)])


def _num(v, fmt: str) -> str:
    return "?" if v is None else f"{v:{fmt}}"


# --------------------------------------------------------------------------------------------------
# the text around a leaderboard's table (markdown and HTML)
# --------------------------------------------------------------------------------------------------
def settings_lines(settings: dict, samplers=()) -> list[tuple[str, str]]:
    """(name, text) of what every row of a board shares (qeval.present.leaderboard.settings_of)."""
    ref, corpus = settings["reference"], settings["corpus"]
    who = ref["label"] or "?"
    if ref["model_file"]:
        who += f" ({ref['model_file']}" + (f", {ref['quant']}" if ref["quant"] else "") + ")"
    if ref["kv"]:
        who += f", KV {ref['kv']}"
    corpus_text = corpus["name"] or "?"
    if corpus["sha256"]:
        corpus_text += f" (sha256 {corpus['sha256'][:16]}…)"
    lines = [("Reference", who),
             ("Reference PPL", plus_minus(ref["ppl"], ref["ppl_se"], ".4f")),
             ("Corpus", corpus_text),
             ("Context", f"n_ctx {settings['n_ctx']}, {settings['chunks']} chunks, {settings['scored_tokens']:,} "
                         f"scored tokens ({Scoring.parse(settings['scoring']).describe()})")]
    lines += [(f"Sampler {name}", sampler.parse(name).describe()) for name in samplers]
    if ref["fingerprint"]:
        lines.append(("Reference model fingerprint", ref["fingerprint"][:16] + "…"))
    lines.append(("Generated by", f"qeval {settings['qeval_version']}"))
    return lines


def _note(m: Metric) -> str:
    unit = "" if m.unit in ("%", m.title) else f", in {m.unit}"
    return f"{m.heading}: {m.description}{unit}" + (f"; {m.better} is better." if m.better else ".")


def notes(samplers=(), tasks=(), control: bool = False, segments=(), floor: bool = False) -> str:
    """What every column means, under the table."""
    return " ".join([*map(_note, board_metrics(samplers)), BOUND_NOTE, *([SEGMENT_NOTE] if segments else []),
                     *([task_flips.NOTE] if tasks else []), *baseline_notes(control, floor),
                     "± is one standard error.", PARETO_NOTE])


BOUND_NOTE = ("KLD bound: how far the mean KLD can be from the mean KLD of the exact logits llama.cpp computed, "
              "certified from the error each store measured at capture (docs/error-bound.md); \"not recorded\": a "
              "store made before qeval measured it (capture it again for a bound). PPL, Δp and same top-1 are exact; "
              "sampler figures are not bounded.")


SEGMENT_NOTE = ("KLD <segment>: mean KLD over the assistant's tokens of that segment (thinking, answer, tool_call) "
                "of a conversation corpus scored with --score assistant, its SE cluster-robust; empty where a result "
                "holds no such token.")


# Under a board with a control or a floor: why a row may read undecided (qeval.compare.verdict).
VERDICT_RULE = ("Undecided (N chunks): the 95 % interval (t with N − 1 degrees of freedom, chunks as the unit) is "
                "too wide to tell either: an interval that merely reaches 0 is no evidence that a cost is absent, so "
                "it is never read as (within) or (noise).")


def baseline_notes(control: bool, floor: bool) -> list[str]:
    """The notes of a board's or card's control and floor columns (CONTROL_NOTE, FLOOR_NOTE), then, under either,
    VERDICT_RULE."""
    return [*([CONTROL_NOTE] if control else []), *([FLOOR_NOTE] if floor else []),
            *([VERDICT_RULE] if control or floor else [])]


CONTROL_NOTE = ("KLD over control: mean KLD minus the control's, the reference model recomputed live under another "
                "batch layout (its KLD is the comparison's own noise floor, its bound what the stored reference's own "
                "error allows); (noise): the 95 % interval of that excess (both SEs combined, widened by both KLD "
                "bounds) lies below the control's own mean KLD, so the row costs no more than the noise again; "
                "(above): the interval lies above 0. The control is on no Pareto front.")


FLOOR_NOTE = ("KLD over floor: a KV-cache row's mean KLD minus the floor's, paired on the same tokens (SE over chunks); "
              "the floor is the reference model on another of llama.cpp's kernel paths (one token per call instead of "
              "prompt batches, or flash attention flipped), so its KLD is what llama.cpp's own numerics cost. (within): "
              "the 95 % interval of the excess lies below the floor's own mean KLD, so the KV quant adds no more than "
              "that floor again; (above): the interval lies above 0, it costs more than the floor. The floor is on no "
              "Pareto front (docs/numerics.md).")


# Weight quants and KV-cache quants save different memory: each is ranked against its own kind.
PARETO_NOTE = ("Pareto: a weight quant (KV cache as the reference's) that no other weight quant beats in both file "
               "size and mean KLD; a KV-cache quant (✓ KV) that no other KV-cache quant beats in both estimated "
               "memory at the context and mean KLD. The estimate (memory_estimate_gib) is file plus KV cache at the "
               "scoring n_ctx from the GGUF's geometry, sliding-window layers counted in full and no compute buffer: "
               "not what llama.cpp allocates (measured memory, where a board has it, is in its speed and memory "
               "columns).")
