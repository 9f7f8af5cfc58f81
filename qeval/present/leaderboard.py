"""Leaderboards from saved results: markdown (for a model card), CSV, JSON, a self-contained HTML page and plots.

    board = leaderboard.build(["qeval-runs"])          # load + check the results, compute rows and Pareto front
    board.rows                                          # one dict per candidate, sorted by mean KLD
    board = leaderboard.write(board, "leaderboard")     # leaderboard.{md,csv,json,html} + plots (PNG and SVG)
    board.paths                                         # what was written

Every result on one board must come from the same reference over the same tokens (reference label, and the
reference's identity as qeval.identity defines it: model fingerprint, settings, token ids of the chunks
compared) with this qeval's metrics version; anything else is refused. Plots are drawn on
matplotlib Figures with the Agg canvas, without pyplot, so nothing global is switched.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qeval import __version__
from qeval.compare import sampler
from qeval.compare.metric_registry import METRICS, Metric
from qeval.errors import QevalError
from qeval.identity import changes
from qeval.present import report, results, task_flips
from qeval.storage.scoring import Scoring

DEFAULT_OUT = "leaderboard"
# KV cache types from most to least precise: the column order of the heatmaps.
KV_ORDER = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0")
KV_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
KLD_FLOOR = 1e-9  # per-token KLDs are drawn on a log axis; exact zeros (and rounding below zero) sit here

PLOTS = {
    "kld_vs_size": "Mean KLD vs model size, Pareto front marked",
    "heatmap_ppl": "PPL over model × KV cache type",
    "heatmap_kld": "Mean KLD over model × KV cache type",
    "kld_distribution": "Per-token KLD distributions",
    "kld_by_depth": "Mean and 99 % KLD by context depth (bands of logit position), ±1.96 SE",
    "flips_vs_kld": "Task answer flips (% of items) vs mean KLD, one point per candidate and task set",
}


@dataclass
class Leaderboard:
    rows: list[dict]  # report.leaderboard_row(...) + rank, pareto, result; sorted by mean KLD
    results: list[results.Result]  # in the order of rows
    settings: dict  # what every row shares: reference, corpus, n_ctx, chunks, scored tokens, samplers
    title: str
    samplers: tuple[str, ...] = ()  # samplers every result holds (report.common_samplers): a TVD column each
    tasks: tuple[str, ...] = ()  # task sets with flips beside the results (qeval.present.task_flips): a column each
    paths: dict[str, Path] = field(default_factory=dict)  # filled by write(): name -> file

    @property
    def pareto(self) -> list[str]:
        """Labels on the size/KLD Pareto front, smallest model first."""
        front = [r for r in self.rows if r["pareto"]]
        return [r["label"] for r in sorted(front, key=lambda r: (r["size_gib"], r["kld_mean"]))]

    def markdown(self) -> str:
        return leaderboard_markdown(self)

    def to_json(self) -> dict:
        return leaderboard_json(self)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns of the CSV and of the JSON rows (a TVD column per sampler, flips figures per task set)."""
        return ("rank", "label", "quant", "model_file", "type_k", "type_v", "size_gib", "bpw",
                *report.board_keys(self.samplers), *report.DEEPEST_KEYS, *task_flips.keys(self.tasks), "pareto",
                "result")

    def figures(self) -> dict:
        """name -> matplotlib Figure for every plot (display them in a notebook, or savefig)."""
        return {"kld_vs_size": plot_kld_vs_size(self), "heatmap_ppl": plot_heatmap(self, "ppl"),
                "heatmap_kld": plot_heatmap(self, "kld_mean"), "kld_distribution": plot_kld_distribution(self),
                "kld_by_depth": plot_kld_by_depth(self), "flips_vs_kld": plot_flips_vs_kld(self)}


# --------------------------------------------------------------------------------------------------
# loading and checking
# --------------------------------------------------------------------------------------------------
def load_results(runs: list[str | os.PathLike], with_per_token: bool = True) -> list[results.Result]:
    """Results named directly, or found in directories (a runs dir or its results/), each file once."""
    seen, loaded = set(), []
    for path in results.find_results(list(runs)):
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            loaded.append(results.load_result(path, with_per_token=with_per_token))
    return loaded


def _board_identity(res: results.Result) -> dict:
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
    base = _board_identity(first)
    for other in loaded[1:]:
        diffs = changes(base, _board_identity(other))
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
    ref = s["reference"]
    model, corpus, kv = ref.get("model") or {}, ref.get("corpus") or {}, ref.get("kv") or {}
    p = s["perplexity"]
    return {
        "reference": {"label": ref.get("label"), "model_file": model.get("file_name"), "quant": model.get("quant"),
                      "fingerprint": model.get("fingerprint"), "size_gib": model.get("size_gib"),
                      "kv": f"{kv['type_k']}/{kv.get('type_v', '?')}" if kv.get("type_k") else None,
                      "ppl": p["ppl_ref"], "ppl_se": p["ppl_ref_se"], "store": ref.get("path")},
        "corpus": {"name": corpus.get("name"), "source": corpus.get("source"), "sha256": corpus.get("sha256")},
        "n_ctx": ref.get("n_ctx"),
        "scoring": ((s.get("request") or {}).get("reference") or {}).get("scoring", "half"),
        "n_vocab": ref.get("n_vocab"),
        "chunks": s.get("chunks"),
        "scored_tokens": s.get("scored_tokens"),
        "tokens_sha256": ref.get("tokens_sha256"),
        "qeval_version": __version__,
    }


def pareto_front(sizes: list, values: list) -> list[bool]:
    """True where no other point is at least as good in both (size, value) and better in one; lower is better.

    Points without a size (None or NaN) are never on the front; identical points are both on it.
    """
    def ok(v) -> bool:
        return v is not None and not (isinstance(v, float) and math.isnan(v))

    pts = [(float(s), float(v)) if ok(s) and ok(v) else None for s, v in zip(sizes, values)]
    out = []
    for i, p in enumerate(pts):
        if p is None:
            out.append(False)
            continue
        dominated = any(q is not None and j != i and q[0] <= p[0] and q[1] <= p[1] and q != p
                        for j, q in enumerate(pts))
        out.append(not dominated)
    return out


def build(runs: list[str | os.PathLike] | None = None, title: str | None = None,
          loaded: list[results.Result] | None = None) -> Leaderboard:
    """Load results (paths or directories), check that they share a reference and tokens, compute the rows."""
    if loaded is None:
        if not runs:
            raise QevalError("name at least one result file or directory of results")
        loaded = load_results(runs)
    check_comparable(loaded)
    samplers = report.common_samplers([r.summary for r in loaded])
    pairs = [(_row(r, samplers), r) for r in loaded]
    pairs.sort(key=lambda pr: (pr[0]["kld_mean"], pr[0]["label"]))
    rows = [row for row, _ in pairs]
    front = pareto_front([r["size_gib"] for r in rows], [r["kld_mean"] for r in rows])
    for rank, (row, on_front, (_, res)) in enumerate(zip(rows, front, pairs), 1):
        row.update(rank=rank, pareto=on_front, result=str(res.path))
    settings = {**settings_of(loaded), "samplers": {name: sampler.parse(name).settings() for name in samplers}}
    if title is None:
        ref = settings["reference"]
        title = f"Quantization leaderboard: KL divergence vs {ref['model_file'] or ref['label']}"
    return Leaderboard(rows, [res for _, res in pairs], settings, title, samplers, task_flips.common_tasks(rows))


def _row(res: results.Result, samplers: tuple[str, ...]) -> dict:
    """A result's leaderboard row, with the flips of its candidate's task stores when its runs directory has them."""
    row = report.leaderboard_row(res.summary, samplers)
    if res.path is not None:
        row.update(task_flips.row_figures(task_flips.task_flips(res.summary, task_flips.tasks_root(res.path),
                                                                str(res.path))))
    return row


# --------------------------------------------------------------------------------------------------
# text outputs
# --------------------------------------------------------------------------------------------------
def settings_lines(board: Leaderboard) -> list[tuple[str, str]]:
    s = board.settings
    ref, corpus = s["reference"], s["corpus"]
    who = ref["label"] or "?"
    if ref["model_file"]:
        who += f" ({ref['model_file']}" + (f", {ref['quant']}" if ref["quant"] else "") + ")"
    if ref["kv"]:
        who += f", KV {ref['kv']}"
    corpus_text = corpus["name"] or "?"
    if corpus["sha256"]:
        corpus_text += f" (sha256 {corpus['sha256'][:16]}…)"
    lines = [("Reference", who),
             ("Reference PPL", f"{ref['ppl']:.4f} ± {ref['ppl_se']:.4f}"),
             ("Corpus", corpus_text),
             ("Context", f"n_ctx {s['n_ctx']}, {s['chunks']} chunks, {s['scored_tokens']:,} scored tokens "
                         f"({Scoring.parse(s['scoring']).describe()})")]
    lines += [(f"Sampler {name}", sampler.parse(name).describe()) for name in board.samplers]
    if ref["fingerprint"]:
        lines.append(("Reference model fingerprint", ref["fingerprint"][:16] + "…"))
    lines.append(("Generated by", f"qeval {s['qeval_version']}"))
    return lines


def _note(m: Metric) -> str:
    unit = "" if m.unit in ("%", m.title) else f", in {m.unit}"
    return f"{m.heading}: {m.description}{unit}" + (f"; {m.better} is better." if m.better else ".")


def notes(samplers=(), tasks=()) -> str:
    """What every column means, under the table."""
    return " ".join([*map(_note, report.board_metrics(samplers)), *([task_flips.NOTE] if tasks else []),
                     "± is one standard error.", "Pareto: no other row is both smaller (GiB) and lower in mean KLD."])


def leaderboard_markdown(board: Leaderboard) -> str:
    """Paste-ready for a Hugging Face model card: heading, settings, the table sorted by mean KLD, notes."""
    out = [f"## {board.title}", ""]
    out += [f"- **{k}:** {v}" for k, v in settings_lines(board)]
    out += ["", report.leaderboard_markdown(board.rows, pareto=set(board.pareto), samplers=board.samplers,
                                            tasks=board.tasks), "", notes(board.samplers, board.tasks), ""]
    return "\n".join(out)


def leaderboard_json(board: Leaderboard) -> dict:
    """Strict JSON (a NaN standard error becomes null)."""
    columns = board.columns
    return _strict({"title": board.title, "settings": board.settings, "pareto_front": board.pareto,
                    "columns": list(columns), "rows": [{k: r.get(k) for k in columns} for r in board.rows]})


def _strict(v):
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def write_csv(board: Leaderboard, path: Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(board.columns)
        for r in board.rows:
            w.writerow(["" if r.get(k) is None else repr(r[k]) if isinstance(r[k], float) else r[k]
                        for k in board.columns])


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colors(n: int) -> list:
    from matplotlib import colormaps  # noqa: PLC0415

    cmap = colormaps["viridis"]
    return [cmap(0.05 + 0.85 * i / max(n - 1, 1)) for i in range(n)]


def _kv_marker(board: Leaderboard) -> dict:
    kvs = _kv_columns(board)
    return {kv: KV_MARKERS[i % len(KV_MARKERS)] for i, kv in enumerate(kvs)}


def plot_kld_vs_size(board: Leaderboard):
    """Mean KLD (± SE) against model size; Pareto front joined and ringed; every point labelled."""
    fig = _figure(9.0, 6.0)
    ax = fig.add_subplot()
    colors = _colors(len(board.rows))
    markers = _kv_marker(board)
    sized = [(r, c) for r, c in zip(board.rows, colors) if r["size_gib"] is not None]
    for r, c in sized:
        se = r["kld_mean_se"]
        ax.errorbar(r["size_gib"], r["kld_mean"], yerr=se if math.isfinite(se) else None,
                    fmt=markers.get(r["type_k"] or "?", "o"), color=c, ms=8, mec="black", mew=0.6, capsize=3,
                    zorder=3)
    # labels of points sharing a size (KV variants of one file) are stacked downwards from the highest
    stack: dict[float, int] = {}
    for r, _ in sorted(sized, key=lambda rc: (rc[0]["size_gib"], -rc[0]["kld_mean"])):
        k = stack.get(r["size_gib"], 0)
        stack[r["size_gib"]] = k + 1
        ax.annotate(r["label"], (r["size_gib"], r["kld_mean"]), xytext=(9, 4 - 11 * k), textcoords="offset points",
                    fontsize=8, zorder=4)
    front = sorted((r for r, _ in sized if r["pareto"]), key=lambda r: (r["size_gib"], r["kld_mean"]))
    if front:
        ax.plot([r["size_gib"] for r in front], [r["kld_mean"] for r in front], "--", color="#d62728", lw=1.4,
                zorder=2)
        ax.scatter([r["size_gib"] for r in front], [r["kld_mean"] for r in front], s=260, facecolors="none",
                   edgecolors="#d62728", linewidths=1.6, zorder=2)
    if sized and all(r["kld_mean"] > 0 for r, _ in sized):
        ax.set_yscale("log")
    if sized:
        xs = [r["size_gib"] for r, _ in sized]
        pad = 0.08 * (max(xs) - min(xs)) or 0.1 * max(xs) or 0.1
        ax.set_xlim(min(xs) - pad, max(xs) + 2.5 * pad)
    else:
        ax.text(0.5, 0.5, "no result records a model size", ha="center", va="center", transform=ax.transAxes)
    missing = len(board.rows) - len(sized)
    ax.set_xlabel("model size (GiB)")
    ax.set_ylabel("mean KLD (nats, log scale)" if ax.get_yscale() == "log" else "mean KLD (nats)")
    ax.set_title("Mean KLD vs size (lower left is better)" + (f"; {missing} without a size not shown" if missing else ""))
    ax.grid(True, which="both", alpha=0.3)
    if sized:
        from matplotlib.lines import Line2D  # noqa: PLC0415

        kvs = list(dict.fromkeys(r["type_k"] or "?" for r, _ in sized))
        handles = [Line2D([], [], ls="", marker=markers.get(kv, "o"), color="#bbbbbb", mec="black", ms=8,
                          label=f"KV {kv}") for kv in kvs]
        if front:
            handles.append(Line2D([], [], ls="--", color="#d62728", marker="o", mfc="none", ms=12,
                                  label="Pareto front"))
        ax.legend(handles=handles, loc="upper right", fontsize=8)
    return fig


def _kv_columns(board: Leaderboard) -> list[str]:
    kvs = {r["type_k"] or "?" for r in board.rows}
    ref_kv = (board.settings["reference"]["kv"] or "").split("/")[0]
    if ref_kv and _ref_row_name(board) in {_model_name(r) for r in board.rows}:
        kvs.add(ref_kv)
    known = [k for k in KV_ORDER if k in kvs]
    return known + sorted(kvs - set(known))


def _model_name(row: dict) -> str:
    return (row.get("model_file") or "").removesuffix(".gguf") or (row["quant"] if row["quant"] != "?" else row["label"])


def _ref_row_name(board: Leaderboard) -> str:
    ref = board.settings["reference"]
    return (ref["model_file"] or "").removesuffix(".gguf") or ref["quant"] or ref["label"]


def heatmap_grid(board: Leaderboard, metric: str) -> tuple[list[str], list[str], np.ndarray, dict]:
    """(model names, KV types, values [models, kvs] with NaN where no result, {(i, j): note}) of metric
    "ppl" or "kld_mean"."""
    models: dict[str, float] = {}
    for r in board.rows:
        models.setdefault(_model_name(r), r["size_gib"] if r["size_gib"] is not None else -1.0)
    ref = board.settings["reference"]
    ref_name, ref_kv = _ref_row_name(board), (ref["kv"] or "").split("/")[0]
    if metric == "ppl" and ref_kv:
        models.setdefault(ref_name, ref["size_gib"] if ref["size_gib"] is not None else math.inf)
    names = sorted(models, key=lambda m: (-models[m], m))  # biggest model on top
    kvs = _kv_columns(board)
    if metric == "ppl" and ref_kv and ref_kv not in kvs:
        kvs.append(ref_kv)
    values = np.full((len(names), len(kvs)), np.nan)
    notes = {}
    for r in reversed(board.rows):  # the lowest-KLD row wins a shared cell
        values[names.index(_model_name(r)), kvs.index(r["type_k"] or "?")] = r[metric]
    if ref_name in names and ref_kv in kvs:
        i, j = names.index(ref_name), kvs.index(ref_kv)
        if np.isnan(values[i, j]):
            notes[(i, j)] = "ref"
            if metric == "ppl":
                values[i, j] = ref["ppl"]
    return names, kvs, values, notes


def plot_heatmap(board: Leaderboard, metric: str):
    """PPL or mean KLD ("ppl", "kld_mean") per model (rows, biggest first) and KV cache type (columns); cells
    without data blank."""
    from matplotlib import colormaps  # noqa: PLC0415
    from matplotlib.colors import LogNorm, Normalize  # noqa: PLC0415

    names, kvs, values, notes = heatmap_grid(board, metric)
    m = METRICS[metric]
    fig = _figure(2.6 + 0.12 * max(map(len, names)) + 1.3 * len(kvs), 1.5 + 0.5 * len(names))
    ax = fig.add_subplot()
    finite = values[np.isfinite(values)]
    cmap = colormaps["YlOrRd"].with_extremes(bad="white")
    if metric == "kld_mean" and finite.size and finite.min() > 0:
        norm = LogNorm(finite.min(), finite.max()) if finite.max() > finite.min() else None
    else:
        norm = Normalize(finite.min(), finite.max()) if finite.size and finite.max() > finite.min() else None
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    if norm is not None:
        fig.colorbar(im, ax=ax, label=m.title if m.unit == m.title else f"{m.title} ({m.unit})")
    for i in range(len(names)):
        for j in range(len(kvs)):
            v = values[i, j]
            if not np.isfinite(v):
                continue
            shade = norm(v) if norm is not None else 0.5
            text = (f"{v:.3f}" if v < 1000 else f"{v:.4g}") if metric == "ppl" else f"{v:.4g}"
            if (i, j) in notes:
                text += f"\n({notes[(i, j)]})"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if shade > 0.6 else "black")
    for (i, j), note in notes.items():
        if not np.isfinite(values[i, j]):
            ax.text(j, i, note, ha="center", va="center", fontsize=8, color="grey")
    ax.set_xticks(range(len(kvs)), [f"KV {k}" for k in kvs])
    ax.set_yticks(range(len(names)), names)
    ax.set_xticks(np.arange(-0.5, len(kvs)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(names)), minor=True)
    ax.grid(which="minor", color="#cccccc", lw=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set_title(f"{m.title[0].upper()}{m.title[1:]} by model and KV cache type (K)")
    return fig


def plot_kld_distribution(board: Leaderboard):
    """Per candidate, from the per-token arrays: histogram of log KLD and the tail P(KLD > x), both on log x."""
    fig = _figure(13.0, 5.2)
    ax_hist, ax_tail = fig.subplots(1, 2)
    colors = _colors(len(board.rows))
    series = [(r, res.per_token["kld"], c) for r, res, c in zip(board.rows, board.results, colors)
              if res.per_token is not None and "kld" in res.per_token and len(res.per_token["kld"])]
    if not series:
        for ax in (ax_hist, ax_tail):
            ax.text(0.5, 0.5, "no per-token data (.npz) found", ha="center", va="center", transform=ax.transAxes)
        return fig
    clipped = [np.maximum(np.asarray(k, np.float64), KLD_FLOOR) for _, k, _ in series]
    lo = max(min(float(np.percentile(k, 0.5)) for k in clipped), KLD_FLOOR)
    hi = max(float(k.max()) for k in clipped) * 1.5
    n_bins = int(np.clip(2 * math.sqrt(min(len(k) for k in clipped)), 12, 60))
    bins = np.logspace(math.log10(lo), math.log10(max(hi, lo * 10)), n_bins + 1)
    for (r, _, c), k in zip(series, clipped):
        ax_hist.hist(np.clip(k, bins[0], bins[-1]), bins=bins, histtype="step", lw=1.6, color=c,
                     label=f"{r['label']} (mean {r['kld_mean']:.4g})", density=False,
                     weights=np.full(len(k), 1.0 / len(k)))
        s = np.sort(k)
        tail = 1.0 - np.arange(len(s)) / len(s)
        ax_tail.step(s, tail, where="post", color=c, lw=1.6, label=r["label"])
    ax_hist.set_xscale("log")
    ax_hist.set_xlabel("per-token KLD (nats, log scale)")
    ax_hist.set_ylabel("fraction of tokens")
    ax_hist.set_title("Distribution of per-token KLD")
    ax_tail.set_xscale("log")
    ax_tail.set_yscale("log")
    ax_tail.set_xlabel("per-token KLD x (nats, log scale)")
    ax_tail.set_ylabel("P(KLD > x)")
    ax_tail.set_title("Tail: fraction of tokens above x")
    n = min(len(k) for k in clipped)
    ax_tail.set_ylim(0.5 / n, 1.05)
    for ax in (ax_hist, ax_tail):
        ax.grid(True, which="major", alpha=0.3)
    ax_hist.legend(fontsize=7, loc="upper left")
    return fig


def plot_kld_by_depth(board: Leaderboard):
    """Per candidate, one line through its by-depth bands (x: band middle, log scale): mean KLD with a
    ±1.96 SE band (cluster-robust SEs, qeval.compare.depth) and the 99th percentile."""
    fig = _figure(13.0, 5.2)
    ax_mean, ax_p99 = fig.subplots(1, 2)
    series = [(r, res.summary.get("by_depth") or [], c)
              for r, res, c in zip(board.rows, board.results, _colors(len(board.rows)))]
    series = [(r, bands, c) for r, bands, c in series if bands]
    if not series:
        for ax in (ax_mean, ax_p99):
            ax.text(0.5, 0.5, "no result holds by-depth figures", ha="center", va="center", transform=ax.transAxes)
        return fig
    for r, bands, c in series:
        x = np.array([(b["lo"] + b["hi"]) / 2 for b in bands])
        mean = np.array([b["kld"]["mean"] for b in bands])
        se = np.array([b["kld"]["se"] for b in bands], dtype=np.float64)
        ax_mean.plot(x, mean, "o-", color=c, lw=1.6, label=r["label"])
        ax_mean.fill_between(x, np.maximum(mean - 1.96 * se, KLD_FLOOR), mean + 1.96 * se, color=c, alpha=0.15)
        ax_p99.plot(x, [b["kld"]["ladder"]["99.0%"] for b in bands], "s-", color=c, lw=1.6, label=r["label"])
    edges = sorted({e for _, bands, _ in series for b in bands for e in (b["lo"], b["hi"])})
    for ax, what in ((ax_mean, "mean KLD (nats)"), (ax_p99, "99th percentile KLD (nats)")):
        ax.set_xscale("symlog", linthresh=max(edges[1] if len(edges) > 1 else 1, 1))
        ax.set_yscale("log")
        ax.set_xlabel("context depth: logit position (band middle)")
        ax.set_ylabel(what)
        ax.set_xticks(edges)
        ax.set_xticklabels([f"{e // 1024}K" if e >= 1024 and e % 1024 == 0 else str(e) for e in edges], fontsize=7)
        ax.grid(True, which="major", alpha=0.3)
    ax_mean.set_title("Mean KLD by depth")
    ax_p99.set_title("99 % KLD by depth")
    ax_mean.legend(fontsize=7, loc="best")
    return fig


def plot_flips_vs_kld(board: Leaderboard):
    """Per task set, every candidate's answer flips (% of items, split into correct→wrong and wrong→correct)
    against its mean KLD (log axis): do the flips a user notices track the divergence?"""
    fig = _figure(9.0, 6.0)
    ax = fig.add_subplot()
    if not board.tasks:
        ax.text(0.5, 0.5, "no candidate has task stores beside its result (qeval matrix --task, qeval tasks capture)",
                ha="center", va="center", transform=ax.transAxes)
        return fig
    markers = ("o", "s", "^", "D", "v", "P")
    for task, marker, color in zip(board.tasks, markers * len(board.tasks), _colors(len(board.tasks))):
        points = [(r["kld_mean"], r[task_flips.row_key("flips_pct", task)], r) for r in board.rows
                  if r.get(task_flips.row_key("flips_pct", task)) is not None]
        x = [max(k, KLD_FLOOR) for k, _, _ in points]
        ax.plot(x, [f for _, f, _ in points], marker, color=color, ms=8, mec="black", mew=0.6, ls="none",
                label=f"{task}: flips", zorder=3)
        ax.plot(x, [100 * r[task_flips.row_key("correct_to_wrong", task)] / r[task_flips.row_key("n_tasks", task)]
                    for _, _, r in points], marker, color=color, ms=5, mfc="none", ls="none",
                label=f"{task}: correct→wrong only", zorder=3)
        for xi, (_, f, r) in zip(x, points):
            ax.annotate(r["label"], (xi, f), xytext=(5, 4), textcoords="offset points", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("mean KLD vs the reference (nats, log scale)")
    ax.set_ylabel("answers flipped (% of the task set's items)")
    ax.set_title("Task flips vs mean KLD")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def _save_figure(fig, out: Path, name: str) -> tuple[Path, Path, str]:
    """PNG and SVG files, plus the SVG markup to inline (XML prolog dropped, ids salted per plot)."""
    import matplotlib  # noqa: PLC0415

    png, svg = out / f"{name}.png", out / f"{name}.svg"
    fig.savefig(png, dpi=150)
    no_meta = {"Creator": None, "Date": None, "Format": None, "Type": None}
    with matplotlib.rc_context({"svg.hashsalt": f"qeval-{name}", "svg.fonttype": "path"}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata=no_meta)
    text = buf.getvalue()
    svg.write_text(text)
    inline = text[text.index("<svg"):]
    inline = re.sub(r"<metadata>.*?</metadata>", "", inline, flags=re.S)
    return png, svg, inline


# --------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------
CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg2:#f6f8fa; --front:#d62728; }
* { box-sizing: border-box; }
body { font: 14px/1.5 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: var(--fg);
       margin: 0; background: #fff; }
main { max-width: 1360px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 26px; margin: 0 0 12px; }
h2 { font-size: 19px; margin: 32px 0 10px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
dl.settings { display: grid; grid-template-columns: max-content 1fr; gap: 3px 18px; margin: 0 0 8px;
              background: var(--bg2); border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; }
dl.settings dt { font-weight: 600; color: var(--muted); }
dl.settings dd { margin: 0; }
.table-wrap { overflow-x: auto; border: 1px solid var(--line); border-radius: 8px; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; font-size: 13px; }
th, td { padding: 5px 8px; border-bottom: 1px solid var(--line); white-space: nowrap; }
th { background: var(--bg2); text-align: left; font-weight: 600; position: sticky; top: 0; }
td.num { text-align: right; }
tbody tr:nth-child(even) { background: #fbfcfd; }
tbody tr:hover { background: #eef4ff; }
tr.pareto td:first-child { box-shadow: inset 4px 0 0 var(--front); }
.badge { display: inline-block; font-size: 11px; padding: 0 6px; margin-left: 6px; border-radius: 9px;
         background: var(--front); color: #fff; vertical-align: 1px; }
.notes { color: var(--muted); font-size: 13px; max-width: 1100px; }
figure { margin: 18px 0 28px; }
figure svg { max-width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 4px; }
footer { color: var(--muted); font-size: 12px; margin-top: 36px; }
"""


def table_html(board: Leaderboard) -> str:
    """The leaderboard as an HTML <table> (also handy in a notebook: IPython.display.HTML)."""
    columns = report.leaderboard_columns(board.samplers, board.tasks)
    headings = ("#", "label", *(name for name, _ in columns))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in headings)
    klds = [r["kld_mean"] for r in board.rows if r["kld_mean"] > 0]
    lo, hi = (math.log10(min(klds)), math.log10(max(klds))) if klds else (0.0, 0.0)
    body = []
    for r in board.rows:
        cells = report.leaderboard_cells(r, board.samplers, board.tasks)
        label = html.escape(cells[0]) + ('<span class="badge" title="on the size/KLD Pareto front">Pareto</span>'
                                         if r["pareto"] else "")
        tds = [f'<td class="num">{r["rank"]}</td>', f"<td>{label}</td>"]
        for (_, key), cell in zip(columns, cells[1:]):
            style = ""
            if key == "kld_mean" and r["kld_mean"] > 0 and hi > lo:
                t = (math.log10(r["kld_mean"]) - lo) / (hi - lo)  # green (best) to red (worst)
                style = f' style="background: hsl({120 - 120 * t:.0f}, 70%, 88%)"'
            cls = "" if key in ("quant", "kv") else ' class="num"'
            tds.append(f"<td{cls}{style}>{html.escape(cell)}</td>")
        attrs = ' class="pareto"' if r["pareto"] else ""
        body.append(f'<tr data-label="{html.escape(r["label"])}"{attrs}>' + "".join(tds) + "</tr>")
    return (f'<div class="table-wrap"><table id="leaderboard"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def leaderboard_html(board: Leaderboard, inline_svgs: dict[str, str]) -> str:
    settings = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in settings_lines(board))
    figures = "".join(
        f'<figure id="plot-{name}">{svg}<figcaption>{html.escape(PLOTS[name])}'
        f" (also {html.escape(name)}.png / {html.escape(name)}.svg)</figcaption></figure>"
        for name, svg in inline_svgs.items())
    front = ", ".join(board.pareto) or "none (no result records a model size)"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(board.title)}</title>
<style>{CSS}</style>
</head>
<body>
<main>
<h1>{html.escape(board.title)}</h1>
<dl class="settings">{settings}</dl>
<h2>Leaderboard <small>(sorted by mean KLD, {len(board.rows)} candidates)</small></h2>
{table_html(board)}
<p class="notes">{html.escape(notes(board.samplers, board.tasks))}</p>
<p class="notes"><b>Pareto front</b> (smallest first): {html.escape(front)}</p>
<h2>Plots</h2>
{figures}
<footer>Generated by qeval {html.escape(__version__)} from {len(board.rows)} saved results.</footer>
</main>
</body>
</html>
"""


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
            paths[f"{name}.png"], paths[f"{name}.svg"], inline[name] = _save_figure(fig, out, name)
        paths["leaderboard.md"] = out / "leaderboard.md"
        paths["leaderboard.md"].write_text(leaderboard_markdown(board))
        paths["leaderboard.csv"] = out / "leaderboard.csv"
        write_csv(board, paths["leaderboard.csv"])
        paths["leaderboard.json"] = out / "leaderboard.json"
        paths["leaderboard.json"].write_text(json.dumps(leaderboard_json(board), indent=2, allow_nan=False))
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
