"""The leaderboard as a self-contained HTML page (plots inlined as SVG); `board` is a
qeval.present.leaderboard.Leaderboard."""

from __future__ import annotations

import html
import math

from qeval import __version__
from qeval.present.board import has_early, has_floor, leaderboard_cells, leaderboard_columns, notes, settings_lines
from qeval.present.deployment_board import other_machines_markdown
from qeval.present.deployment_page import question_html
from qeval.present.plots import PLOTS

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
#question form { display: flex; flex-wrap: wrap; gap: 8px 18px; align-items: center; background: var(--bg2);
                 border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
#question input { width: 7em; }
#answer { font-weight: 600; font-size: 15px; }
.problem { color: #b42318; font-weight: 600; }
#ruled-out, #passing { margin: 4px 0; }
td.asked, th.asked { outline: 2px solid #0969da; outline-offset: -2px; }
tr.best td { background: #d3f5dc; }
tr.ruled td { color: #8c959f; }
tr.ruled td[data-col="answer"] { color: #b42318; white-space: normal; min-width: 18em; }
"""


def table_html(board) -> str:
    """The leaderboard as an HTML <table> (also handy in a notebook: IPython.display.HTML)."""
    segments = board.segments
    floor, early, view = has_floor(board.rows), has_early(board.rows), board.deployment
    columns = (*leaderboard_columns(board.samplers, board.tasks, board.control, segments, floor, early, view),
               *((("your question", "answer"),) if view else ()))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ("#", "label", *(name for name, _ in columns)))
    klds = [r.kld_mean for r in board.rows if r.kld_mean > 0]
    lo, hi = (math.log10(min(klds)), math.log10(max(klds))) if klds else (0.0, 0.0)
    body = []
    for r in board.table_rows:
        cells = [*leaderboard_cells(r, board.tasks, board.control, segments, floor, early, view),
                 *([""] if view else [])]  # the answer's cell, filled by the page's script
        label = html.escape(cells[0]) + ('<span class="badge" title="on the size/KLD Pareto front">Pareto</span>'
                                         if r.pareto else "")
        tds = [f'<td class="num">{"" if r.rank is None else r.rank}</td>', f'<td data-col="label">{label}</td>']
        for (_, key), cell in zip(columns, cells[1:]):
            style = ""
            if key == "kld_mean" and r.kld_mean is not None and r.kld_mean > 0 and hi > lo:
                t = (math.log10(r.kld_mean) - lo) / (hi - lo)  # green (best) to red (worst)
                style = f' style="background: hsl({120 - 120 * t:.0f}, 70%, 88%)"'
            cls = "" if key in ("quant", "kv", "answer") else ' class="num"'
            tds.append(f'<td data-col="{html.escape(key)}"{cls}{style}>{html.escape(cell)}</td>')
        attrs = ' class="pareto"' if r.pareto else ""
        body.append(f'<tr data-label="{html.escape(r.label)}"{attrs}>' + "".join(tds) + "</tr>")
    return (f'<div class="table-wrap"><table id="leaderboard"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def deployment_html(board) -> str:
    """The speed and memory notes and every other machine's figures (a <pre> of their markdown tables)."""
    view = board.deployment
    if view is None:
        return ""
    lines = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in view.lines())
    others = other_machines_markdown(view, board.table_rows)
    notes_html = "".join(f'<p class="notes">{html.escape(n)}</p>' for n in view.notes())
    return (f'<dl class="settings">{lines}</dl>{notes_html}'
            + (f'<pre id="other-machines">{html.escape(chr(10).join(others))}</pre>' if others else ""))


def sources_html(board) -> str:
    """A board of contributions: the footnotes of its marked rows, the results listed apart and the files refused
    (a <pre> of their markdown)."""
    if board.sources is None:
        return ""
    return f'<pre id="sources">{html.escape(chr(10).join(board.sources.markdown()))}</pre>'


def leaderboard_html(board, inline_svgs: dict[str, str]) -> str:
    settings = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in settings_lines(board.settings, board.samplers))
    figures = "".join(
        f'<figure id="plot-{name}">{svg}<figcaption>{html.escape(PLOTS[name])}'
        f" (also {html.escape(name)}.png / {html.escape(name)}.svg)</figcaption></figure>"
        for name, svg in inline_svgs.items())
    front = ", ".join(board.pareto) or "none (no result records a model size)"
    return page_html(board.title, f"""<dl class="settings">{settings}</dl>
{question_html(board.deployment, board.table_rows) if board.deployment else ""}
<h2>Leaderboard <small>(sorted by mean KLD, {len(board.rows)} candidates)</small></h2>
{table_html(board)}
<p class="notes">{html.escape(notes(board.samplers, board.tasks, board.control, board.segments, has_floor(board.rows)))}</p>
<p class="notes"><b>Pareto front</b> (smallest first): {html.escape(front)}</p>
{deployment_html(board)}
{sources_html(board)}
<h2>Plots</h2>
{figures}""", f"from {len(board.rows)} saved results")


def page_html(title: str, body: str, source: str = "") -> str:
    """A self-contained page: the title as its heading, then `body` (HTML), and a footer naming qeval (and
    `source`, what it was generated from)."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{CSS}</style>
</head>
<body>
<main>
<h1>{html.escape(title)}</h1>
{body}
<footer>Generated by qeval {html.escape(__version__)}{" " + html.escape(source) if source else ""}.</footer>
</main>
</body>
</html>
"""
