"""Baselines: published (or earlier qeval) numbers to hold a run against. The files (schema: baselines/SCHEMA.md)
are read and validated by qeval.storage.baselines; here a run is matched to an entry, and `baseline_from_result`
turns a qeval result (the JSON of `qeval kld --json`) into a baseline.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from qeval import __version__
from qeval.compare import metric_registry
from qeval.compare.summary import ComparisonSummary, Side
from qeval.errors import QevalError
from qeval.present import baselines_text
from qeval.storage.baselines import ENTRY_ID, SCHEMA, Baseline, Entry, available, baseline_dirs, load_baseline, validate


# --------------------------------------------------------------------------------------------------
# qeval results as metrics, and as baselines
# --------------------------------------------------------------------------------------------------
def _side(desc: Side) -> dict:
    """A side of a comparison as a baseline entry's side ("kv": one type when K and V share it)."""
    kv = desc.kv_text(same_once=True) if desc.kv_types.get("type_k") is not None else None
    side = {"quant": desc.facts.get("quant"), "kv": kv, "label": desc.label or None, "file": desc.facts.get("file_name")}
    return {k: v for k, v in side.items() if v}


def entry_from_result(summary: ComparisonSummary, entry_id: str | None = None) -> dict:
    """A baseline entry (JSON) holding every metric of a qeval result, with SEs where they exist."""
    ref, cand = summary.reference, summary.candidate
    model = cand.facts
    corpus = (ref.corpus or {}).get("name")
    settings = {"n_ctx": ref.n_ctx, "chunks": summary.chunks, "scored_tokens": summary.scored_tokens,
                "corpus": corpus, "tool": f"qeval {__version__}"}
    metrics = {}
    for key, mv in summary.measured().items():
        if not math.isfinite(mv.value):  # a figure the result could not give (a bound its stores do not record)
            continue
        metrics[key] = {"value": mv.value} if mv.se is None or not math.isfinite(mv.se) else \
            {"value": mv.value, "se": mv.se}
    eid = entry_id or cand.label or "result"
    if not ENTRY_ID.match(eid):
        eid = re.sub(r"[^A-Za-z0-9._+-]", "_", eid).lstrip("._+-") or "result"
    return {"id": eid, "model": model.get("name") or model.get("file_name") or cand.label or "unknown",
            "candidate": _side(cand), "reference": _side(ref),
            "settings": {k: v for k, v in settings.items() if v is not None}, "metrics": metrics}


def baseline_from_result(summary: ComparisonSummary, title: str | None = None, source_file: str | None = None,
                         entry_id: str | None = None) -> dict:
    """A whole baseline document (valid against the schema) from one qeval result."""
    return baseline_from_results([summary], title, source_file, entry_id)


def baseline_from_results(summaries: list[ComparisonSummary], title: str | None = None, source_file: str | None = None,
                          entry_id: str | None = None) -> dict:
    """One baseline document with an entry per qeval result (e.g. every pair of a matrix)."""
    ref, cand = summaries[0].reference, summaries[0].candidate
    what = cand.label if len(summaries) == 1 else f"{len(summaries)} candidates"
    doc = {
        "schema": SCHEMA,
        "title": title or f"qeval result: {what} against {ref.label}",
        "source": {"title": f"qeval {__version__} comparison {what} vs {ref.label}",
                   "file": source_file, "note": "converted from qeval results by qeval.orchestrate.baselines.baseline_from_results"},
        "entries": [entry_from_result(s, entry_id if len(summaries) == 1 else None) for s in summaries],
    }
    doc["source"] = {k: v for k, v in doc["source"].items() if v}
    validate(doc, metric_registry, "converted result")
    return doc


def result_to_baseline_file(result_path: str | os.PathLike, out: str | os.PathLike, title: str | None = None,
                            entry_id: str | None = None) -> str:
    from qeval.present.results import load_result  # noqa: PLC0415

    res = load_result(result_path, with_per_token=False)
    doc = baseline_from_result(res.summary, title, Path(result_path).name, entry_id)
    out = Path(out)
    try:
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise QevalError(f"cannot write {out}: {exc.strerror}") from None
    return f"wrote {out}: baseline entry {doc['entries'][0]['id']!r} with {len(doc['entries'][0]['metrics'])} metrics"


# --------------------------------------------------------------------------------------------------
# matching a run to an entry, and showing a baseline
# --------------------------------------------------------------------------------------------------
def _norm(x: str | None) -> str | None:
    return x.lower() if isinstance(x, str) else None


def _kv_norm(kv: str | None) -> str | None:
    if not kv:
        return None
    k, _, v = kv.lower().partition("/")
    return k if v in ("", k) else f"{k}/{v}"


def matching_entries(baseline: Baseline, candidate: Side, reference: Side) -> list[Entry]:
    """Entries about a run's candidate: same label, or same quant (and KV type, reference quant
    where the entry states them)."""
    cand, ref = _side(candidate), _side(reference)
    by_label = [e for e in baseline.entries if e.candidate.get("label") and e.candidate.get("label") == cand.get("label")]
    if by_label:
        return by_label
    out = []
    for e in baseline.entries:
        if not e.candidate.get("quant") or _norm(e.candidate.get("quant")) != _norm(cand.get("quant")):
            continue
        if e.candidate.get("kv") and _kv_norm(e.candidate["kv"]) != _kv_norm(cand.get("kv") or "f16"):
            continue
        if e.reference and e.reference.get("quant") and ref.get("quant") and \
                _norm(e.reference["quant"]) != _norm(ref["quant"]):
            continue
        out.append(e)
    return out


def pick_entry(baseline: Baseline, candidate: Side, reference: Side, entry_id: str | None = None) -> Entry:
    """The entry a run of `candidate` against `reference` is held to: `entry_id`, the only one, or the one
    matching_entries finds."""
    if entry_id:
        return baseline.entry(entry_id)
    if len(baseline.entries) == 1:
        return baseline.entries[0]
    found = matching_entries(baseline, candidate, reference)
    cand = _side(candidate)
    if len(found) == 1:
        return found[0]
    what = f"candidate {cand.get('label')!r} (quant {cand.get('quant', '?')}, KV {cand.get('kv', 'f16')})"
    if not found:
        raise QevalError(f"no entry of baseline {baseline.name} matches {what}; choose one with --baseline-entry "
                         f"({', '.join(baseline.ids())})")
    raise QevalError(f"{len(found)} entries of baseline {baseline.name} match {what}; choose one with "
                     f"--baseline-entry ({', '.join(e.id for e in found)})")


def baseline_json(b: Baseline) -> dict:
    return {"name": b.name, "path": str(b.path) if b.path else None, "title": b.title, "source": b.source,
            "settings": b.settings,
            "entries": [{"id": e.id, "model": e.model, "candidate": e.candidate, "reference": e.reference,
                         "settings": e.settings,
                         "metrics": {k: {"value": v.value, "se": v.se, "approx": v.approx, "unit": metric_registry.lookup(k).unit}
                                     for k, v in e.metrics.items()},
                         "quote": e.quote, "where": e.where, "note": e.note} for e in b.entries]}


def show_report(spec: str | None = None, run: str | None = None, entry_id: str | None = None) -> tuple[dict, str]:
    """`qeval baseline show`: the list of baselines, or one baseline's table (with a run beside it)."""
    if spec is None:
        if run:
            raise QevalError("--run needs a baseline: qeval baseline show NAME --run RESULT_JSON")
        rows = []
        for p in available():
            b = load_baseline(p, metric_registry)
            rows.append({"name": b.name, "path": str(p), "title": b.title, "entries": len(b.entries)})
        return {"baselines": rows}, baselines_text.listing_text(rows, baseline_dirs())
    b = load_baseline(spec, metric_registry)
    result = baseline_json(b)
    run_summary, matched = None, set()
    if run:
        from qeval.present.results import load_result  # noqa: PLC0415

        run_summary = load_result(run, with_per_token=False).summary
        if entry_id:
            matched = {b.entry(entry_id).id}
        else:
            matched = {e.id for e in (b.entries if len(b.entries) == 1 else
                                  matching_entries(b, run_summary.candidate, run_summary.reference))}
        result["run"] = {"path": str(run), "candidate": run_summary.candidate.label,
                         "reference": run_summary.reference.label, "matched_entries": sorted(matched),
                         "metrics": {k: {"value": v.value, "se": v.se} for k, v in run_summary.measured().items()}}
    return result, baselines_text.baseline_text(b, run_summary, matched)


