"""The leaderboard's plots, drawn on matplotlib Figures with the Agg canvas, without pyplot, so nothing global is
switched; `board` is a qeval.present.leaderboard.Leaderboard."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np

from qeval.compare.metric_registry import METRICS
from qeval.present.board import BoardRow, group_names

# KV cache types from most to least precise: the column order of the heatmaps.
KV_ORDER = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0")
KV_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
ZERO_LABEL = "0"  # the tick of a log axis's floor, where exact zeros are drawn (LogZero)

PLOTS = {
    "kld_vs_size": "Mean KLD vs model size, Pareto front marked",
    "heatmap_ppl": "PPL over model × KV cache type",
    "heatmap_kld": "Mean KLD over model × KV cache type",
    "kld_distribution": "Per-token KLD distributions",
    "kld_by_depth": "Mean and 99 % KLD by context depth (bands of logit position), ±1.96 SE",
    "kld_by_group": "Mean KLD by segment and by category of a conversation corpus (--score assistant), ±1.96 SE",
    "flips_vs_kld": "Task answer flips (% of items) vs mean KLD, one point per candidate and task set",
}


class LogZero:
    """A log axis that can show exact zeros (a bit-identical control, a segment the quant leaves untouched, an
    error bar reaching below zero) without inventing a value for them: they are drawn at a floor one decade below
    the smallest positive value drawn (rounded down to a power of ten), marked by a dotted line and a tick
    labelled "0". An invented constant (1e-9) would stretch the axis over decades where nothing lies.

    `values`: the points drawn; `reach`: how far their error bars reach down (they need the floor only when they
    reach zero or below); `lowest`: the smallest value worth showing, where that is not simply the smallest
    positive value (the per-token distributions take a low percentile)."""

    def __init__(self, values, reach=(), lowest: float | None = None):
        drawn = np.concatenate([_numbers(values), _numbers(reach)])
        drawn = drawn[np.isfinite(drawn)]
        positive = drawn[drawn > 0]
        self.needed = bool((drawn <= 0).any())
        if lowest is None:
            lowest = float(positive.min()) if positive.size else 1.0
        self.floor = 10.0 ** (math.floor(math.log10(lowest)) - 1)

    def place(self, values) -> np.ndarray:
        """`values` as drawn: zeros, and anything below the floor, at the floor."""
        return np.maximum(np.asarray(values, np.float64), self.floor) if self.needed else \
            np.asarray(values, np.float64)

    def below(self, values, spans) -> np.ndarray:
        """The lower error-bar lengths of `values` with half-widths `spans`, ending at the floor where the bar
        would reach zero or below."""
        values, spans = np.asarray(values, np.float64), np.nan_to_num(np.asarray(spans, np.float64))
        return self.place(values) - self.place(values - spans)

    def apply(self, ax, axis: str = "y") -> None:
        """Put `ax`'s `axis` ("x" or "y") on a log scale; with zeros drawn, end it just below the floor, mark the
        floor and label its tick "0" (the decades above it keep their labels). Call it after drawing."""
        getattr(ax, f"set_{axis}scale")("log")
        if not self.needed:
            return
        from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

        lo, hi = getattr(ax, f"get_{axis}lim")()
        hi = max(hi, 10 * self.floor)
        getattr(ax, f"set_{axis}lim")(self.floor / 10 ** 0.3, hi)
        (ax.axhline if axis == "y" else ax.axvline)(self.floor, color="grey", ls=":", lw=1.2, zorder=1)
        decades = [t for t in LogLocator(subs=(1.0,)).tick_values(10 * self.floor, hi) if 10 * self.floor <= t <= hi]
        scale = getattr(ax, f"{axis}axis")
        scale.set_major_locator(FixedLocator([self.floor, *decades]))
        scale.set_major_formatter(FuncFormatter(
            lambda x, _: ZERO_LABEL if math.isclose(x, self.floor) else f"$10^{{{round(math.log10(x))}}}$"))
        # no minor ticks between the floor and the decade above it: nothing is drawn there but the zeros' floor
        minors = LogLocator(subs=np.arange(2, 10)).tick_values(10 * self.floor, hi)
        scale.set_minor_locator(FixedLocator([t for t in minors if 10 * self.floor < t <= hi]))
        scale.set_minor_formatter(NullFormatter())


def _numbers(values) -> np.ndarray:
    """The numbers of a scalar, an array or a (ragged) list of either, as one flat float64 array."""
    if isinstance(values, (list, tuple)):
        parts = [_numbers(v) for v in values]
        return np.concatenate(parts) if parts else np.empty(0)
    return np.ravel(np.asarray(values, np.float64))


def figures(board) -> dict:
    """name -> matplotlib Figure for every plot of PLOTS (display them in a notebook, or savefig)."""
    return {"kld_vs_size": plot_kld_vs_size(board), "heatmap_ppl": plot_heatmap(board, "ppl"),
            "heatmap_kld": plot_heatmap(board, "kld_mean"), "kld_distribution": plot_kld_distribution(board),
            "kld_by_depth": plot_kld_by_depth(board), "kld_by_group": plot_kld_by_group(board),
            "flips_vs_kld": plot_flips_vs_kld(board)}


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


def _kv_marker(board) -> dict:
    kvs = _kv_columns(board)
    return {kv: KV_MARKERS[i % len(KV_MARKERS)] for i, kv in enumerate(kvs)}


def plot_kld_vs_size(board):
    """Mean KLD (± SE) against what each candidate costs, like with like: weight quants against file size, and
    (in a second panel, when the board has any) KV-cache quants against estimated memory at the context (file + KV
    cache at n_ctx: board.PARETO_NOTE); each panel's Pareto front joined and ringed; every point labelled."""
    weights = [r for r in board.rows if not r.kv_quant]
    kv_quants = [r for r in board.rows if r.kv_quant]
    panels = [(weights, "size_gib", "weight quants: model file (GiB)", "a model size")] if weights or not kv_quants \
        else []
    if kv_quants:
        n_ctx = board.settings.get("n_ctx")
        panels.append((kv_quants, "memory_estimate_gib",
                       f"KV-cache quants: estimated memory, file + KV cache at n_ctx {n_ctx} (GiB)",
                       "its KV cache's size (older results record no KV cache geometry)"))
    fig = _figure(9.0 * len(panels), 6.0)
    markers = _kv_marker(board)
    colors = dict(zip((r.label for r in board.rows), _colors(len(board.rows))))
    for i, (rows, axis, xlabel, unknown) in enumerate(panels, 1):
        _kld_vs_cost_panel(fig.add_subplot(1, len(panels), i), rows, axis, xlabel, unknown, markers, colors)
    return fig


def _kld_vs_cost_panel(ax, rows, axis: str, xlabel: str, unknown: str, markers: dict, colors: dict) -> None:
    placed = [r for r in rows if getattr(r, axis) is not None]
    ses = [r.metrics["kld_mean"].se for r in placed]
    log = LogZero([r.kld_mean for r in placed], [r.kld_mean - se for r, se in zip(placed, ses)])
    for r, se in zip(placed, ses):
        y = log.place(r.kld_mean)
        ax.errorbar(getattr(r, axis), y, yerr=[[log.below(r.kld_mean, se)], [se]] if math.isfinite(se) else None,
                    fmt=markers.get(r.type_k or "?", "o"), color=colors[r.label], ms=8, mec="black", mew=0.6,
                    capsize=3, zorder=3)
    # labels of points sharing an x (KV variants of one file) are stacked downwards from the highest
    stack: dict[float, int] = {}
    for r in sorted(placed, key=lambda r: (getattr(r, axis), -r.kld_mean)):
        x = getattr(r, axis)
        k = stack.get(x, 0)
        stack[x] = k + 1
        ax.annotate(r.label, (x, log.place(r.kld_mean)), xytext=(9, 4 - 11 * k), textcoords="offset points",
                    fontsize=8, zorder=4)
    front = sorted((r for r in placed if r.pareto), key=lambda r: (getattr(r, axis), r.kld_mean))
    if front:
        xs, ys = [getattr(r, axis) for r in front], log.place([r.kld_mean for r in front])
        ax.plot(xs, ys, "--", color="#d62728", lw=1.4, zorder=2)
        ax.scatter(xs, ys, s=260, facecolors="none", edgecolors="#d62728", linewidths=1.6, zorder=2)
    if placed:
        log.apply(ax)
        xs = [getattr(r, axis) for r in placed]
        pad = 0.08 * (max(xs) - min(xs)) or 0.1 * max(xs) or 0.1
        ax.set_xlim(min(xs) - pad, max(xs) + 2.5 * pad)
    else:
        ax.text(0.5, 0.5, f"no result records {unknown}", ha="center", va="center", transform=ax.transAxes)
    missing = len(rows) - len(placed)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean KLD (nats, log scale)" if placed else "mean KLD (nats)")
    ax.set_title("Mean KLD vs size (lower left is better)" + (f"; {missing} not shown: no size" if missing else ""))
    ax.grid(True, which="both", alpha=0.3)
    if placed:
        from matplotlib.lines import Line2D  # noqa: PLC0415

        kvs = list(dict.fromkeys(r.type_k or "?" for r in placed))
        handles = [Line2D([], [], ls="", marker=markers.get(kv, "o"), color="#bbbbbb", mec="black", ms=8,
                          label=f"KV {kv}") for kv in kvs]
        if front:
            handles.append(Line2D([], [], ls="--", color="#d62728", marker="o", mfc="none", ms=12,
                                  label="Pareto front"))
        ax.legend(handles=handles, loc="upper right", fontsize=8)


def _kv_columns(board) -> list[str]:
    kvs = {r.type_k or "?" for r in board.rows}
    ref_kv = (board.settings["reference"]["kv"] or "").split("/")[0]
    if ref_kv and _ref_row_name(board) in {_model_name(r) for r in board.rows}:
        kvs.add(ref_kv)
    known = [k for k in KV_ORDER if k in kvs]
    return known + sorted(kvs - set(known))


def _model_name(row: BoardRow) -> str:
    return (row.model_file or "").removesuffix(".gguf") or (row.quant if row.quant != "?" else row.label)


def _ref_row_name(board) -> str:
    ref = board.settings["reference"]
    return (ref["model_file"] or "").removesuffix(".gguf") or ref["quant"] or ref["label"]


def heatmap_grid(board, metric: str) -> tuple[list[str], list[str], np.ndarray, dict]:
    """(model names, KV types, values [models, kvs] with NaN where no result, {(i, j): note}) of metric
    "ppl" or "kld_mean"."""
    models: dict[str, float] = {}
    for r in board.rows:
        models.setdefault(_model_name(r), r.size_gib if r.size_gib is not None else -1.0)
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
        values[names.index(_model_name(r)), kvs.index(r.type_k or "?")] = r.value(metric)
    if ref_name in names and ref_kv in kvs:
        i, j = names.index(ref_name), kvs.index(ref_kv)
        if np.isnan(values[i, j]):
            notes[(i, j)] = "ref"
            if metric == "ppl":
                values[i, j] = ref["ppl"]
    return names, kvs, values, notes


def plot_heatmap(board, metric: str):
    """PPL or mean KLD ("ppl", "kld_mean") per model (rows, biggest first) and KV cache type (columns); cells
    without data blank."""
    from matplotlib import colormaps  # noqa: PLC0415
    from matplotlib.colors import LogNorm, Normalize  # noqa: PLC0415

    names, kvs, values, notes = heatmap_grid(board, metric)
    m = METRICS[metric]
    fig = _figure(2.6 + 0.12 * max(map(len, names)) + 1.3 * len(kvs), 1.5 + 0.5 * len(names))
    ax = fig.add_subplot()
    finite = values[np.isfinite(values)]
    # a KLD of exactly 0 (a bit-identical control) keeps the log colour scale of the others: its cell takes the
    # colour below the scale ("under", grey) and reads "0", rather than turning the whole map linear
    cmap = colormaps["YlOrRd"].with_extremes(bad="white", under="#d9d9d9")
    positive = finite[finite > 0]
    shown = values
    if metric == "kld_mean" and positive.size:
        norm = LogNorm(positive.min(), positive.max()) if positive.max() > positive.min() else None
        if norm is not None:
            shown = np.where(values > 0, values, positive.min() / 10)  # below vmin: the under colour
    else:
        norm = Normalize(finite.min(), finite.max()) if finite.size and finite.max() > finite.min() else None
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
    if norm is not None:
        fig.colorbar(im, ax=ax, label=m.title if m.unit == m.title else f"{m.title} ({m.unit})",
                     extend="min" if (shown < norm.vmin).any() else "neither")
    for i in range(len(names)):
        for j in range(len(kvs)):
            v = values[i, j]
            if not np.isfinite(v):
                continue
            shade = float(np.clip(norm(shown[i, j]), 0, 1)) if norm is not None else 0.5
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


def plot_kld_distribution(board):
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
    kld = [np.asarray(k, np.float64) for _, k, _ in series]
    # the x axes start at the lowest 0.5th percentile of a candidate's positive KLDs (a few rounding-sized values
    # would stretch them); values below it are drawn in the first bin, exact zeros (and rounding below zero: a
    # bit-identical control) in a bin of their own at the floor labelled "0"
    lows = [float(np.percentile(k[k > 0], 0.5)) for k in kld if (k > 0).any()]
    lo = min(lows) if lows else 1.0
    log = LogZero(kld, lowest=lo)
    drawn = [np.where(k > 0, np.maximum(k, lo), log.floor) for k in kld]
    hi = max(float(k.max()) for k in drawn) * 1.5
    n_bins = int(np.clip(2 * math.sqrt(min(len(k) for k in drawn)), 12, 60))
    bins = np.logspace(math.log10(lo), math.log10(max(hi, lo * 10)), n_bins + 1)
    if log.needed:
        bins = np.concatenate([[log.floor / 2, log.floor * 2], bins])
    for (r, _, c), k in zip(series, drawn):
        ax_hist.hist(np.clip(k, bins[0], bins[-1]), bins=bins, histtype="step", lw=1.6, color=c,
                     label=f"{r.label} (mean {r.kld_mean:.4g})", density=False,
                     weights=np.full(len(k), 1.0 / len(k)))
        s = np.sort(k)
        tail = 1.0 - np.arange(len(s)) / len(s)
        ax_tail.step(s, tail, where="post", color=c, lw=1.6, label=r.label)
    log.apply(ax_hist, "x")
    ax_hist.set_xlabel("per-token KLD (nats, log scale)")
    ax_hist.set_ylabel("fraction of tokens")
    ax_hist.set_title("Distribution of per-token KLD")
    log.apply(ax_tail, "x")
    ax_tail.set_yscale("log")
    ax_tail.set_xlabel("per-token KLD x (nats, log scale)")
    ax_tail.set_ylabel("P(KLD > x)")
    ax_tail.set_title("Tail: fraction of tokens above x")
    n = min(len(k) for k in drawn)
    ax_tail.set_ylim(0.5 / n, 1.05)
    for ax in (ax_hist, ax_tail):
        ax.grid(True, which="major", alpha=0.3)
    ax_hist.legend(fontsize=7, loc="upper left")
    return fig


def plot_kld_by_depth(board):
    """Per candidate, one line through its by-depth bands (x: band middle, log scale): mean KLD with a
    ±1.96 SE band (cluster-robust SEs, qeval.compare.depth) and the 99th percentile."""
    fig = _figure(13.0, 5.2)
    ax_mean, ax_p99 = fig.subplots(1, 2)
    series = [(r, res.summary.by_depth or [], c)
              for r, res, c in zip(board.rows, board.results, _colors(len(board.rows)))]
    series = [(r, bands, c) for r, bands, c in series if bands]
    if not series:
        for ax in (ax_mean, ax_p99):
            ax.text(0.5, 0.5, "no result holds by-depth figures", ha="center", va="center", transform=ax.transAxes)
        return fig
    means = [np.array([b.kld["mean"] for b in bands]) for _, bands, _ in series]
    spans = [1.96 * np.nan_to_num(np.array([b.kld["se"] for b in bands], dtype=np.float64)) for _, bands, _ in series]
    p99s = [np.array([b.kld["ladder"]["99.0%"] for b in bands]) for _, bands, _ in series]
    log_mean = LogZero(means, [m - d for m, d in zip(means, spans)])
    log_p99 = LogZero(p99s)
    for (r, bands, c), mean, span, p99 in zip(series, means, spans, p99s):
        x = np.array([(b.lo + b.hi) / 2 for b in bands])
        ax_mean.plot(x, log_mean.place(mean), "o-", color=c, lw=1.6, label=r.label)
        ax_mean.fill_between(x, log_mean.place(mean - span), mean + span, color=c, alpha=0.15)
        ax_p99.plot(x, log_p99.place(p99), "s-", color=c, lw=1.6, label=r.label)
    edges = sorted({e for _, bands, _ in series for b in bands for e in (b.lo, b.hi)})
    for ax, what, log in ((ax_mean, "mean KLD (nats)", log_mean), (ax_p99, "99th percentile KLD (nats)", log_p99)):
        ax.set_xscale("symlog", linthresh=max(edges[1] if len(edges) > 1 else 1, 1))
        log.apply(ax)
        ax.set_xlabel("context depth: logit position (band middle)")
        ax.set_ylabel(what)
        ax.set_xticks(edges)
        ax.set_xticklabels([f"{e // 1024}K" if e >= 1024 and e % 1024 == 0 else str(e) for e in edges], fontsize=7)
        ax.grid(True, which="major", alpha=0.3)
    ax_mean.set_title("Mean KLD by depth")
    ax_p99.set_title("99 % KLD by depth")
    ax_mean.legend(fontsize=7, loc="best")
    return fig


def plot_kld_by_group(board):
    """Two panels, mean KLD by segment (thinking, answer, tool_call) and by category of the conversations: per
    candidate, a marker per group it holds with ±1.96 SE error bars (cluster-robust SEs, qeval.compare.depth),
    candidates side by side within a group; log y."""
    fig = _figure(13.0, 5.2)
    colors = _colors(len(board.rows))
    for ax, (grouping, one) in zip(fig.subplots(1, 2), (("segments", "segment"), ("categories", "category"))):
        names = group_names(board.rows, grouping)
        ax.set_title(f"Mean KLD by {one}")
        if not names:
            ax.text(0.5, 0.5, f"no result holds {grouping} (conversations scored with --score assistant)",
                    ha="center", va="center", transform=ax.transAxes)
            continue
        width = 0.7 / len(board.rows)
        held = [[(j, getattr(r, grouping)[name].kld) for j, name in enumerate(names) if name in getattr(r, grouping)]
                for r in board.rows]
        means = [[k["mean"] for _, k in h] for h in held]
        spans = [1.96 * np.nan_to_num(np.array([k["se"] for _, k in h], dtype=np.float64)) for h in held]
        log = LogZero([m for row in means for m in row], [m - d for row, sp in zip(means, spans) for m, d in zip(row, sp)])
        for i, (r, c, h, mean, span) in enumerate(zip(board.rows, colors, held, means, spans)):
            if not h:
                continue
            x = np.array([j for j, _ in h]) + (i - (len(board.rows) - 1) / 2) * width
            ax.errorbar(x, log.place(mean), yerr=[log.below(mean, span), span], fmt="o",
                        color=c, ms=7, mec="black", mew=0.6, capsize=3, label=r.label)
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.6, len(names) - 0.4)
        log.apply(ax)
        ax.set_ylabel("mean KLD (nats, log scale)")
        ax.grid(True, which="major", axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return fig


def plot_flips_vs_kld(board):
    """Per task set, every candidate's answer flips (% of items, split into correct→wrong and wrong→correct)
    against its mean KLD (log axis): do the flips a user notices track the divergence?"""
    fig = _figure(9.0, 6.0)
    ax = fig.add_subplot()
    if not board.tasks:
        ax.text(0.5, 0.5, "no candidate has task stores beside its result (qeval matrix --task, qeval tasks capture)",
                ha="center", va="center", transform=ax.transAxes)
        return fig
    markers = ("o", "s", "^", "D", "v", "P")
    log = LogZero([r.kld_mean for r in board.rows if any(t in r.task_flips for t in board.tasks)])
    for task, marker, color in zip(board.tasks, markers * len(board.tasks), _colors(len(board.tasks))):
        points = [(r.kld_mean, r.task_flips[task].flips_pct, r) for r in board.rows if task in r.task_flips]
        x = log.place([k for k, _, _ in points])
        ax.plot(x, [f for _, f, _ in points], marker, color=color, ms=8, mec="black", mew=0.6, ls="none",
                label=f"{task}: flips", zorder=3)
        ax.plot(x, [100 * r.task_flips[task].correct_to_wrong / r.task_flips[task].n_tasks for _, _, r in points], marker, color=color, ms=5, mfc="none", ls="none",
                label=f"{task}: correct→wrong only", zorder=3)
        for xi, (_, f, r) in zip(x, points):
            ax.annotate(r.label, (xi, f), xytext=(5, 4), textcoords="offset points", fontsize=7)
    log.apply(ax, "x")
    ax.set_xlabel("mean KLD vs the reference (nats, log scale)")
    ax.set_ylabel("answers flipped (% of the task set's items)")
    ax.set_title("Task flips vs mean KLD")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def save_figure(fig, out: Path, name: str) -> tuple[Path, Path, str]:
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
