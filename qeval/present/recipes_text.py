"""Recipes on paper: the sensitivity table and plot of a sweep, and the board of measured recipes with each one's
recipe written out and its paired difference against the stock type nearest in size.

Rows come as plain dicts (qeval.orchestrate.sensitivity.Sensitivity.to_json, qeval.orchestrate.recipes.Variant
rows with a `vs` block), so saved JSON renders the same as a run just finished."""

from __future__ import annotations

from qeval.compare.metric_registry import plus_minus
from qeval.present.markdown import markdown_table

MB = 1e6


def _mb(n: float | None) -> str:
    return "?" if n is None else f"{n / MB:.1f}"


def sensitivity_markdown(rows: list[dict]) -> str:
    """One line per move, cheapest bytes first (lowest KLD per MB saved; moves that add bytes last); with a held-out
    split, the cost and ratio are the tuning chunks' (the ranking's) and the held-out cost stands beside."""
    early, held = _decided_early(rows), any("held_out" in r for r in rows)
    header = ["group", "tensors", "move", "MB saved", "KLD cost ± SE", "KLD per MB saved",
              *["held-out KLD cost ± SE"] * held, *_EARLY_HEAD * early]

    def line(r: dict) -> list:
        ratio = "" if r["kld_per_mb"] is None else f"{r['kld_per_mb']:.2e}"
        return [r["group"], r["tensors"], r["types"], _mb(r["bytes_saved"]),
                plus_minus(r["kld_cost"], r["kld_cost_se"], "+.5f", ".5f"), ratio,
                *([_difference(r["held_out"])] if held else []), *_early_cells(r) * early]

    return markdown_table(header, map(line, sorted(rows, key=_cheapness)))


def _difference(d: dict) -> str:
    return plus_minus(d["diff"], d["se"], "+.5f", ".5f")


def split_line(split: dict) -> str:
    """The held-out split in a line: seed and the chunks of each set."""
    return (f"Chunks split by seed {split['seed']}: {len(split['tuning'])} tuning (every decision), "
            f"{len(split['held_out'])} held out (read by none): {split['held_out']}")


def choices_markdown(budgets: list[dict]) -> str:
    """Each budget's chosen recipe (and refined one) against its stock type as paired differences of mean KLD (± SE,
    chunks as the unit) on the tuning chunks and on the held-out ones, their difference (the optimism), and the
    refined recipe's gain over the chosen one (refined − chosen: negative is better)."""
    rows = []
    for b in budgets:
        stock = b.get("stock", {})
        rows.append(_choice_line(b["budget"], f"chosen {b['measured']['label']}", stock.get("label", ""), stock))
        refined = b.get("refined")
        if refined:
            gain = refined["gain"]
            rows.append(_choice_line(b["budget"], f"refined {refined['measured']['label']}", stock.get("label", ""),
                                     refined.get("stock", {}), gain, refined["builds"]))
    return markdown_table(["budget", "recipe", "stock", "Δ KLD tuning", "Δ KLD held-out", "optimism",
                           "refined − chosen: tuning", "held-out", "builds"], rows)


def _choice_line(budget: str, label: str, stock: str, against: dict, gain: dict | None = None,
                 builds: int | None = None) -> list[str]:
    def cell(d: dict, part: str) -> str:
        return _difference(d[part]) if part in d else ""

    optimism = f"{against['optimism']:+.5f}" if "optimism" in against else ""
    tuning = cell(against, "tuning") or (_difference(against) if "diff" in against else "")
    gains = ["", ""] if gain is None else [cell(gain, "tuning") or _difference(gain), cell(gain, "held_out")]
    return [budget, label, stock, tuning, cell(against, "held_out"), optimism, *gains,
            "" if builds is None else str(builds)]


# a board decided early (--early): the chunks each row stands on (a sweep's: those its cost is paired over) and why it
# stopped (qeval.present.board.EARLY_NOTE)
_EARLY_HEAD = ["chunks", "stopped"]


def _decided_early(rows: list[dict]) -> bool:
    return any(r.get("stopped") for r in rows)


def _early_cells(row: dict) -> list:
    return [row.get("chunks", ""), row.get("stopped", "")]


def _cheapness(row: dict) -> tuple:
    saves = row["bytes_saved"] > 0
    return (not saves, row["kld_per_mb"] if saves else -(row["kld_per_mb"] or 0.0), row["group"])


def recipes_markdown(rows: list[dict]) -> str:
    """The measured recipes by size: bytes, mean KLD ± SE, same top-1, and (`vs`) the paired difference of mean KLD
    against the stock type nearest in size, on the same tokens."""
    early = _decided_early(rows)

    def line(r: dict) -> list:
        vs = r.get("vs")
        diff = f"{vs['label']}: {plus_minus(vs['diff'], vs['se'], '+.5f', '.5f')}" if vs else ""
        top1 = "?" if r.get("same_top1_pct") is None else f"{r['same_top1_pct']:.2f}"
        return [r["label"], f"`{r['recipe']}`", _mb(r["bytes"]), plus_minus(r["kld_mean"], r["kld_mean_se"], ".5f"),
                top1, diff, *_early_cells(r) * early]

    return markdown_table(["label", "recipe", "MB", "mean KLD ± SE", "same top-1 %", "vs stock: Δ KLD ± SE",
                           *_EARLY_HEAD * early], map(line, sorted(rows, key=lambda r: r["bytes"])))


def budgets_markdown(budgets: list[dict]) -> str:
    """One line per budget: the recipe chosen (predicted, then measured) beside the stock type nearest the budget, and
    their paired difference of mean KLD."""
    rows = []
    for b in budgets:
        m, s = b["measured"], b.get("stock")
        cells = [b["budget"], m["label"], f"{_mb(b['predicted_bytes'])}, {b['predicted_kld']:.5f}", _mb(m["bytes"]),
                 plus_minus(m["kld_mean"], m["kld_mean_se"], ".5f"), f"{m['same_top1_pct']:.2f}"]
        cells += ([s["label"], _mb(s["bytes"]), plus_minus(s["kld_mean"], s["kld_mean_se"], ".5f"),
                   f"{s['same_top1_pct']:.2f}", plus_minus(s["diff"], s["se"], "+.5f", ".5f")] if s else [""] * 5)
        rows.append(cells)
    return markdown_table(["budget", "recipe", "predicted MB, KLD", "MB", "mean KLD ± SE", "same top-1 %", "stock",
                           "MB", "mean KLD ± SE", "same top-1 %", "Δ KLD ± SE (paired)"], rows)


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
