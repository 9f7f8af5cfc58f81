"""The text of `qeval baseline show`: the baselines found, or one baseline's table with a run beside it."""

from __future__ import annotations

from pathlib import Path

from qeval.compare import metric_registry
from qeval.compare.metric_registry import MetricValue, plus_minus
from qeval.compare.summary import ComparisonSummary
from qeval.present.markdown import markdown_table
from qeval.storage.baselines import Published


def _as_printed(x: float) -> str | None:
    """A published number as its source printed it (short reprs only: 97.674, 0.0282, 2e-07 -> None)."""
    r = repr(float(x))
    return r if "e" not in r and len(r.lstrip("-").replace(".", "")) <= 8 else None


def format_value(key: str, mv: MetricValue | Published | None, as_printed: bool = False) -> str:
    """`as_printed`: keep a short published value's own digits (97.674, not 97.67)."""
    if mv is None:
        return ""
    dec = metric_registry.lookup(key).decimals(mv.value)

    def written(x: float) -> str:
        return (_as_printed(x) if as_printed else None) or f"{x:.{dec}f}"

    shown = written(mv.value) if mv.se is None else plus_minus(written(mv.value), written(mv.se), "")
    return ("~" if mv.approx else "") + shown


def _settings_text(s: dict) -> str:
    bits = []
    if s.get("n_ctx"):
        bits.append(f"ctx {s['n_ctx']}")
    if s.get("chunks"):
        bits.append(f"{s['chunks']} chunks")
    bits.append(s.get("corpus") or "corpus ?")
    if s.get("llama_cpp_build"):
        bits.append(f"llama.cpp {s['llama_cpp_build']}")
    elif s.get("tool"):
        bits.append(s["tool"])
    return ", ".join(bits)


def _side_text(side: dict | None) -> str:
    if not side:
        return "-"
    s = side.get("quant") or side.get("label")
    if side.get("kv"):
        s += f" KV {side['kv']}"
    if side.get("imatrix"):
        s += f" (imatrix {side['imatrix']})"
    return s


def listing_text(rows: list[dict], searched: list[Path]) -> str:
    """The baselines found (name, entries, title), or where none was."""
    if not rows:
        return f"no baselines in {', '.join(map(str, searched))}"
    return "\n".join([f"{'name':<40} entries  title"] +
                     [f"{r['name']:<40} {r['entries']:>7}  {r['title']}" for r in rows])


def baseline_text(b, run_summary: ComparisonSummary | None = None, matched: set | None = None) -> str:
    """A baseline (qeval.storage.baselines.Baseline) as a table, with the run `run_summary` beside the
    entries `matched`."""
    src = b.source
    who = src.get("author") or "author not named"
    lines = [f"baseline  : {b.name} — {b.title}",
             f"source    : {src.get('file') or '-'}: \"{src['title']}\" ({who}"
             f"{', ' + src['date'] if src.get('date') else ''}){' via ' + src['via'] if src.get('via') else ''}"]
    if src.get("url"):
        lines.append(f"url       : {src['url']}")
    run_metrics = run_summary.measured() if run_summary else None
    if run_summary:
        rc, rr = run_summary.candidate, run_summary.reference
        lines.append(f"run       : {rc.label} against {rr.label}, {run_summary.chunks} chunks of n_ctx "
                     f"{rr.n_ctx}, {run_summary.scored_tokens} scored tokens"
                     + ("" if matched else " — no entry matches its quant/KV (use --entry ID)"))
    header = ["entry", "model", "candidate", "reference", "metric", "value", "unit", "settings"]
    if run_summary:
        header += [f"run {run_summary.candidate.label}", "run − baseline"]
    rows = []
    for e in b.entries:
        for key, mv in e.metrics.items():
            row = [e.id, e.model or "", _side_text(e.candidate), _side_text(e.reference), key, format_value(key, mv, as_printed=True),
                   metric_registry.lookup(key).unit, _settings_text(e.settings)]
            if run_summary:
                rv = run_metrics.get(key) if e.id in matched else None
                diff = "" if rv is None else f"{rv.value - mv.value:+.{metric_registry.lookup(key).decimals(mv.value)}f}"
                row += [format_value(key, rv), diff]
            rows.append(row)
    lines += ["", markdown_table(header, rows)]
    notes = [f"{e.id}: {e.note}" for e in b.entries if e.note]
    if notes:
        lines += ["", "notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines)
