"""Baselines: published (or earlier qeval) numbers to hold a run against. Schema: baselines/SCHEMA.md.

A baseline file is JSON: the source of its numbers, default settings and model, and entries; each
entry is one candidate (optionally measured against a reference) with metric values under the names
and in the units of qeval.compare.metric_registry. `load_baseline` validates a file and raises QevalError naming
the bad field; `baseline_from_result` turns a qeval result (the JSON of `qeval kld --json`) into a baseline.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from qeval import __version__
from qeval.compare import metric_registry
from qeval.compare.metric_registry import METRICS, MetricValue
from qeval.compare.summary import ComparisonSummary, Side
from qeval.errors import QevalError
from qeval.present import baselines_text

SCHEMA = "qeval-baseline/1"
BASELINES_ENV = "QEVAL_BASELINES_DIR"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


_SETTINGS = {"n_ctx": int, "chunks": int, "scored_tokens": int, "corpus": str, "llama_cpp_build": str,
             "tool": str, "backend": str, "note": str}
_SOURCE = {"file": str, "title": str, "author": str, "url": str, "date": str, "via": str, "note": str}
_SIDE = {"quant": str, "kv": str, "label": str, "file": str, "imatrix": str, "note": str}
_TOP = {"schema", "title", "description", "source", "model", "settings", "entries"}
_ENTRY = {"id", "model", "candidate", "reference", "settings", "metrics", "quote", "where", "note"}
_VALUE = {"value", "se", "approx", "note"}


@dataclass
class Entry:
    id: str
    model: str | None
    candidate: dict
    reference: dict | None
    settings: dict  # the file's settings overlaid with the entry's
    metrics: dict[str, MetricValue]
    quote: list[str] = field(default_factory=list)
    where: str | None = None
    note: str | None = None


@dataclass
class Baseline:
    name: str
    path: Path | None
    title: str
    source: dict
    settings: dict
    entries: list[Entry]
    description: str | None = None

    def entry(self, entry_id: str) -> Entry:
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise QevalError(f"baseline {self.name} has no entry {entry_id!r} (entries: {', '.join(self.ids())})")

    def ids(self) -> list[str]:
        return [e.id for e in self.entries]


# --------------------------------------------------------------------------------------------------
# finding and loading
# --------------------------------------------------------------------------------------------------
def baseline_dirs() -> list[Path]:
    """$QEVAL_BASELINES_DIR, then the shipped baselines/ folder (package data: qeval.baselines, so a wheel
    install finds it as a checkout does)."""
    dirs = []
    if os.environ.get(BASELINES_ENV):
        dirs.append(Path(os.environ[BASELINES_ENV]))
    dirs.append(Path(str(resources.files("qeval.baselines"))))
    return dirs


def available() -> list[Path]:
    seen: dict[str, Path] = {}
    for d in baseline_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.json")):
                seen.setdefault(p.stem, p)
    return sorted(seen.values(), key=lambda p: p.stem)


def resolve(spec: str | os.PathLike) -> Path:
    """A baseline file path, or the NAME of baselines/NAME.json."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.exists():
        raise QevalError(f"{spec} is not a regular file")
    for d in baseline_dirs():
        p = d / f"{spec}.json"
        if p.is_file():
            return p
    names = ", ".join(p.stem for p in available()) or "none"
    raise QevalError(f"baseline {str(spec)!r} is neither a file nor a known baseline name (known: {names})")


def load_baseline(spec: str | os.PathLike) -> Baseline:
    path = resolve(spec)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise QevalError(f"cannot read baseline {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise QevalError(f"baseline {path} is not valid JSON ({exc})") from None
    return validate(doc, str(path), name=path.stem, path=path)


def validate(doc: object, where: str = "baseline", name: str = "baseline", path: Path | None = None) -> Baseline:
    """Check `doc` against the schema (baselines/SCHEMA.md); QevalError names the first bad field."""
    def bad(loc: str, msg: str) -> QevalError:
        return QevalError(f"{where}: {loc} {msg} (see baselines/SCHEMA.md)")

    if not isinstance(doc, dict):
        raise bad("the file", "must hold a JSON object")
    _no_unknown(doc, _TOP, "top level", bad)
    if doc.get("schema") != SCHEMA:
        raise bad("'schema'", f"must be {SCHEMA!r}, not {doc.get('schema')!r}")
    title = _str(doc, "title", "top level", bad, required=True)
    description = _str(doc, "description", "top level", bad)
    source = _obj(doc.get("source"), _SOURCE, "'source'", bad, required=True)
    if not source.get("title"):
        raise bad("'source.title'", "is required")
    model = _str(doc, "model", "top level", bad)
    settings = _settings(doc.get("settings"), "'settings'", bad)
    entries_doc = doc.get("entries")
    if not isinstance(entries_doc, list) or not entries_doc:
        raise bad("'entries'", "must be a non-empty list")
    entries, ids = [], set()
    for i, e in enumerate(entries_doc):
        loc = f"entries[{i}]"
        if not isinstance(e, dict):
            raise bad(loc, "must be an object")
        _no_unknown(e, _ENTRY, loc, bad)
        eid = e.get("id")
        if not isinstance(eid, str) or not _ID.match(eid):
            raise bad(f"{loc}.id", f"must be a name of letters, digits, '.', '_', '+', '-' (got {eid!r})")
        if eid in ids:
            raise bad(f"{loc}.id", f"{eid!r} is used twice")
        ids.add(eid)
        loc = f"entry {eid!r}"
        emodel = _str(e, "model", loc, bad) or model
        if not emodel:
            raise bad(f"{loc}: 'model'", "is required (in the entry or at the top level)")
        cand = _obj(e.get("candidate"), _SIDE, f"{loc}: 'candidate'", bad, required=True)
        if not cand.get("quant") and not cand.get("label"):
            raise bad(f"{loc}: 'candidate'", "needs a 'quant' or a 'label'")
        ref = _obj(e.get("reference"), _SIDE, f"{loc}: 'reference'", bad) if e.get("reference") is not None else None
        merged = {**settings, **_settings(e.get("settings"), f"{loc}: 'settings'", bad)}
        metrics_doc = e.get("metrics")
        if not isinstance(metrics_doc, dict) or not metrics_doc:
            raise bad(f"{loc}: 'metrics'", "must be a non-empty object")
        metrics = {}
        for key, v in metrics_doc.items():
            if metric_registry.lookup(key) is None:
                raise bad(f"{loc}: metric {key!r}", f"is unknown (known: {', '.join(METRICS)}, and per sampler "
                          "tvd_pct@NAME, agreement_pct@NAME, support_differs_pct@NAME)")
            metrics[key] = _metric_value(v, f"{loc}: metric {key!r}", bad)
        if ref is None and any(metric_registry.lookup(k).relative for k in metrics):
            raise bad(f"{loc}: 'reference'", "is required for metrics measured against a reference")
        quote = e.get("quote", [])
        if isinstance(quote, str):
            quote = [quote]
        if not isinstance(quote, list) or not all(isinstance(q, str) for q in quote):
            raise bad(f"{loc}: 'quote'", "must be a string or a list of strings")
        entries.append(Entry(eid, emodel, cand, ref, merged, metrics, quote, _str(e, "where", loc, bad),
                             _str(e, "note", loc, bad)))
    return Baseline(name, path, title, source, settings, entries, description)


def _no_unknown(d: dict, allowed: set, loc: str, bad) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise bad(loc, f"has unknown field(s) {', '.join(map(repr, extra))} (allowed: {', '.join(sorted(allowed))})")


def _str(d: dict, key: str, loc: str, bad, required: bool = False) -> str | None:
    v = d.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or (required and not v.strip()):
        raise bad(f"{loc}: {key!r}", f"must be {'a non-empty' if required else 'a'} string (got {v!r})")
    return v


def _obj(v: object, spec: dict, loc: str, bad, required: bool = False) -> dict:
    if v is None and not required:
        return {}
    if not isinstance(v, dict):
        raise bad(loc, f"must be an object (got {v!r})")
    _no_unknown(v, set(spec), loc, bad)
    for key, typ in spec.items():
        if v.get(key) is not None and not isinstance(v[key], typ):
            raise bad(f"{loc}.{key}", f"must be {'an integer' if typ is int else 'a string'} or null (got {v[key]!r})")
    return {k: x for k, x in v.items() if x is not None}


def _settings(v: object, loc: str, bad) -> dict:
    s = _obj(v, _SETTINGS, loc, bad)
    for key in ("n_ctx", "chunks", "scored_tokens"):
        if key in s and (isinstance(s[key], bool) or s[key] < 1):
            raise bad(f"{loc}.{key}", f"must be a positive integer or null (got {s[key]!r})")
    return s


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _metric_value(v: object, loc: str, bad) -> MetricValue:
    if _is_number(v):
        return MetricValue(float(v))
    if not isinstance(v, dict):
        raise bad(loc, f"must be a number or an object {{value, se, approx, note}} (got {v!r})")
    _no_unknown(v, _VALUE, loc, bad)
    if not _is_number(v.get("value")):
        raise bad(f"{loc}.value", f"must be a finite number (got {v.get('value')!r})")
    se = v.get("se")
    if se is not None and (not _is_number(se) or se < 0):
        raise bad(f"{loc}.se", f"must be a non-negative number or null (got {se!r})")
    if not isinstance(v.get("approx", False), bool):
        raise bad(f"{loc}.approx", "must be true or false")
    note = v.get("note")
    if note is not None and not isinstance(note, str):
        raise bad(f"{loc}.note", "must be a string")
    return MetricValue(float(v["value"]), None if se is None else float(se), v.get("approx", False), note)


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
    if not _ID.match(eid):
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
    validate(doc, "converted result")
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
            b = load_baseline(p)
            rows.append({"name": b.name, "path": str(p), "title": b.title, "entries": len(b.entries)})
        return {"baselines": rows}, baselines_text.listing_text(rows, baseline_dirs())
    b = load_baseline(spec)
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


