"""Baseline files: published (or earlier qeval) numbers to hold a run against. Schema: baselines/SCHEMA.md.

A baseline file is JSON: the source of its numbers, default settings and model, and entries; each entry is one
candidate (optionally measured against a reference) with metric values under the names and in the units of a metric
catalogue (qeval.compare.metric_registry, passed in: storage knows no metric). `load_baseline` finds and validates
a file and raises QevalError naming the bad field; qeval.orchestrate.baselines matches runs to entries and turns
results into baselines.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Mapping, Protocol

from qeval.errors import QevalError

SCHEMA = "qeval-baseline/1"
BASELINES_ENV = "QEVAL_BASELINES_DIR"
ENTRY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


_SETTINGS = {"n_ctx": int, "chunks": int, "scored_tokens": int, "corpus": str, "llama_cpp_build": str,
             "tool": str, "backend": str, "note": str}
_SOURCE = {"file": str, "title": str, "author": str, "url": str, "date": str, "via": str, "note": str}
_SIDE = {"quant": str, "kv": str, "label": str, "file": str, "imatrix": str, "note": str}
_TOP = {"schema", "title", "description", "source", "model", "settings", "entries"}
_ENTRY = {"id", "model", "candidate", "reference", "settings", "metrics", "quote", "where", "note"}
_VALUE = {"value", "se", "approx", "note"}


class MetricCatalogue(Protocol):
    """The metrics a baseline may hold (qeval.compare.metric_registry): METRICS by key, and lookup(key), None for a
    key it does not know, else a metric whose `relative` says it is measured against a reference."""

    METRICS: Mapping[str, object]

    def lookup(self, key: str): ...


@dataclass(frozen=True)
class Published:
    """A metric's value as a baseline file states it."""

    value: float
    se: float | None = None
    approx: bool = False  # a published "~" value
    note: str | None = None


@dataclass
class Entry:
    id: str
    model: str | None
    candidate: dict
    reference: dict | None
    settings: dict  # the file's settings overlaid with the entry's
    metrics: dict[str, Published]
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


def load_baseline(spec: str | os.PathLike, catalogue: MetricCatalogue) -> Baseline:
    """The baseline file `spec` names (resolve), validated; its metrics those `catalogue` knows."""
    path = resolve(spec)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise QevalError(f"cannot read baseline {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise QevalError(f"baseline {path} is not valid JSON ({exc})") from None
    return validate(doc, catalogue, str(path), name=path.stem, path=path)


def validate(doc: object, catalogue: MetricCatalogue, where: str = "baseline", name: str = "baseline",
             path: Path | None = None) -> Baseline:
    """Check `doc` against the schema (baselines/SCHEMA.md), its metrics against `catalogue`; QevalError names the
    first bad field."""
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
        if not isinstance(eid, str) or not ENTRY_ID.match(eid):
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
            if catalogue.lookup(key) is None:
                raise bad(f"{loc}: metric {key!r}", f"is unknown (known: {', '.join(catalogue.METRICS)}, and per "
                          "sampler tvd_pct@NAME, agreement_pct@NAME, support_differs_pct@NAME)")
            metrics[key] = _metric_value(v, f"{loc}: metric {key!r}", bad)
        if ref is None and any(catalogue.lookup(k).relative for k in metrics):
            raise bad(f"{loc}: 'reference'", "is required for metrics measured against a reference")
        quote = e.get("quote", [])
        if isinstance(quote, str):
            quote = [quote]
        if not isinstance(quote, list) or not all(isinstance(q, str) for q in quote):
            raise bad(f"{loc}: 'quote'", "must be a string or a list of strings")
        entries.append(Entry(id=eid, model=emodel, candidate=cand, reference=ref, settings=merged, metrics=metrics,
                             quote=quote, where=_str(e, "where", loc, bad),
                             note=_str(e, "note", loc, bad)))
    return Baseline(name=name, path=path, title=title, source=source, settings=settings, entries=entries,
                    description=description)


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


def _metric_value(v: object, loc: str, bad) -> Published:
    if _is_number(v):
        return Published(float(v))
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
    return Published(float(v["value"]), None if se is None else float(se), v.get("approx", False), note)
