"""Recipes on paper: the sensitivity table and plot of a sweep, and the board of measured recipes with each one's
recipe written out and its paired difference against the stock type nearest in size.

Rows come as plain dicts (qeval.orchestrate.sensitivity.Sensitivity.to_json, qeval.orchestrate.recipes.Variant
rows with a `vs` block), so saved JSON renders the same as a run just finished."""

from __future__ import annotations

from qeval.compare.metric_registry import plus_minus

MB = 1e6


def _mb(n: float | None) -> str:
    return "?" if n is None else f"{n / MB:.1f}"


def sensitivity_markdown(rows: list[dict]) -> str:
    """One line per move, cheapest bytes first (lowest KLD per MB saved; moves that add bytes last)."""
    early = _decided_early(rows)
    lines = ["| group | tensors | move | MB saved | KLD cost ± SE | KLD per MB saved |" + _EARLY_HEAD[0] * early,
             "|---|---|---|---|---|---|" + _EARLY_HEAD[1] * early]
    for r in sorted(rows, key=_cheapness):
        ratio = "" if r["kld_per_mb"] is None else f"{r['kld_per_mb']:.2e}"
        lines.append(f"| {r['group']} | {r['tensors']} | {r['types']} | {_mb(r['bytes_saved'])} | "
                     f"{plus_minus(r['kld_cost'], r['kld_cost_se'], '+.5f', '.5f')} | {ratio} |"
                     + _early_cells(r) * early)
    return "\n".join(lines)


# a board decided early (--early): the chunks each row stands on (a sweep's: those its cost is paired over) and why it
# stopped (qeval.present.board.EARLY_NOTE)
_EARLY_HEAD = (" chunks | stopped |", "---|---|")


def _decided_early(rows: list[dict]) -> bool:
    return any(r.get("stopped") for r in rows)


def _early_cells(row: dict) -> str:
    return f" {row.get('chunks', '')} | {row.get('stopped', '')} |"


def _cheapness(row: dict) -> tuple:
    saves = row["bytes_saved"] > 0
    return (not saves, row["kld_per_mb"] if saves else -(row["kld_per_mb"] or 0.0), row["group"])


def recipes_markdown(rows: list[dict]) -> str:
    """The measured recipes by size: bytes, mean KLD ± SE, same top-1, and (`vs`) the paired difference of mean KLD
    against the stock type nearest in size, on the same tokens."""
    early = _decided_early(rows)
    lines = ["| label | recipe | MB | mean KLD ± SE | same top-1 % | vs stock: Δ KLD ± SE |"
             + _EARLY_HEAD[0] * early,
             "|---|---|---|---|---|---|" + _EARLY_HEAD[1] * early]
    for r in sorted(rows, key=lambda r: r["bytes"]):
        vs = r.get("vs")
        diff = f"{vs['label']}: {plus_minus(vs['diff'], vs['se'], '+.5f', '.5f')}" if vs else ""
        top1 = "?" if r.get("same_top1_pct") is None else f"{r['same_top1_pct']:.2f}"
        lines.append(f"| {r['label']} | `{r['recipe']}` | {_mb(r['bytes'])} | "
                     f"{plus_minus(r['kld_mean'], r['kld_mean_se'], '.5f')} | {top1} | {diff} |"
                     + _early_cells(r) * early)
    return "\n".join(lines)


def budgets_markdown(budgets: list[dict]) -> str:
    """One line per budget: the recipe chosen (predicted, then measured) beside the stock type nearest the budget, and
    their paired difference of mean KLD."""
    lines = ["| budget | recipe | predicted MB, KLD | MB | mean KLD ± SE | same top-1 % | stock | MB | mean KLD ± SE | "
             "same top-1 % | Δ KLD ± SE (paired) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in budgets:
        m, s = b["measured"], b.get("stock")
        cells = [b["budget"], m["label"], f"{_mb(b['predicted_bytes'])}, {b['predicted_kld']:.5f}", _mb(m["bytes"]),
                 plus_minus(m["kld_mean"], m["kld_mean_se"], ".5f"), f"{m['same_top1_pct']:.2f}"]
        cells += ([s["label"], _mb(s["bytes"]), plus_minus(s["kld_mean"], s["kld_mean_se"], ".5f"),
                   f"{s['same_top1_pct']:.2f}", plus_minus(s["diff"], s["se"], "+.5f", ".5f")] if s else [""] * 5)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sensitivity(rows: list[dict], title: str = ""):
    """KLD cost (± 2 SE) against MB saved, one labelled point per move: the lower right is where the bytes buy the
    least damage."""
    from qeval.present.plots import _figure  # noqa: PLC0415 - matplotlib loads only for plots

    fig = _figure(9.0, 6.0)
    ax = fig.add_subplot(1, 1, 1)
    for r in rows:
        x, y = r["bytes_saved"] / MB, r["kld_cost"]
        ax.errorbar([x], [y], yerr=[2 * r["kld_cost_se"]], fmt="o", ms=4, capsize=2)
        ax.annotate(f"{r['group']}→{r['target']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.axvline(0.0, color="grey", lw=0.5)
    ax.set_xscale("symlog", linthresh=1.0)  # the embedding's tens of MB beside a layer group's one or two
    ax.set_xlabel("MB saved against the base recipe (negative: added; linear within ±1, log beyond)")
    ax.set_ylabel("mean KLD added (nats; ± 2 SE, chunks as the unit)")
    ax.set_title(title or "Tensor sensitivity: each group alone moved")
    ax.grid(True, alpha=0.3)
    return fig


def plot_recipe_front(rows: list[dict], title: str = ""):
    """Mean KLD (log scale, ± 2 SE) against file size: stock types and recipes, each set's Pareto front joined."""
    from qeval.present.plots import _figure  # noqa: PLC0415

    fig = _figure(9.0, 6.0)
    ax = fig.add_subplot(1, 1, 1)
    for kind, marker in (("stock", "s"), ("recipe", "o")):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["bytes"])
        xs, ys = [r["bytes"] / MB for r in mine], [r["kld_mean"] for r in mine]
        bars = ax.errorbar(xs, ys, yerr=[2 * r["kld_mean_se"] for r in mine], fmt=marker, ms=5, capsize=2, label=kind)
        front = _front(mine)
        ax.plot([r["bytes"] / MB for r in front], [r["kld_mean"] for r in front], lw=1, color=bars[0].get_color())
        for r in mine:
            ax.annotate(r["label"], (r["bytes"] / MB, r["kld_mean"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("mean KLD (nats, log; ± 2 SE)")
    ax.set_title(title or "Recipes and stock types")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _front(rows: list[dict]) -> list[dict]:
    """The rows no other row beats in both size and mean KLD, by size."""
    out, best = [], float("inf")
    for r in sorted(rows, key=lambda r: (r["bytes"], r["kld_mean"])):
        if r["kld_mean"] < best:
            out.append(r)
            best = r["kld_mean"]
    return out
