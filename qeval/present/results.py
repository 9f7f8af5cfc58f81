"""Saved comparison results as qeval reads them: a result's summary and per-token values typed, cut to fewer chunks or
tokens, and checked against a request. The files themselves (where, what they hold): qeval.storage.results.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.compare import depth, sampler
from qeval.compare.metrics import GROUP_FIELDS, PER_TOKEN_FIELDS, Comparison, summarize_tokens, top1_probability
from qeval.compare.summary import ComparisonSummary, TokenGroup, of_figures, summarize
from qeval.errors import QevalError
from qeval.identity import ComparisonRequest, changes, metrics_version_of, reference_identity
from qeval.storage.results import read_result, result_path, write_result
from qeval.storage.runs import LIVE_SUFFIX


@dataclass
class Result:
    """One candidate measured against a reference: loaded from a file, or computed just now."""

    summary: ComparisonSummary
    per_token: dict[str, np.ndarray] | None
    path: Path | None  # None when computed from stores, not loaded
    note: str = ""  # how it was obtained, when a reader should know (a saved result reused, extended live)
    comparison: Comparison | None = None  # when computed just now: what save_result writes

    @property
    def label(self) -> str:
        return self.summary.candidate.label

    @property
    def ref_label(self) -> str:
        return self.summary.reference.label

    @property
    def origin(self) -> str:
        return str(self.path) if self.path is not None else "stores"

    @property
    def chunk_ids(self) -> np.ndarray:
        return np.unique(self.per_token["chunk"])

    def chunk_columns(self, chunks) -> dict[int, dict[str, np.ndarray]]:
        """The per-token columns of each of `chunks`, as qeval.compare.metrics.compare_chunk gave them (a saved
        result keeps them bit for bit): what a comparison over more chunks starts from."""
        column = self.per_token["chunk"]
        return {int(c): {k: v[column == c] for k, v in self.per_token.items()} for c in sorted(chunks)}

    def restricted(self, chunk_ids) -> "Result":
        """The same measurement over only these chunks (summary recomputed from per-token values)."""
        if self.per_token is None:
            raise QevalError(f"{self.origin} has no per-token values: it cannot be cut to fewer chunks")
        keep = np.isin(self.per_token["chunk"], np.asarray(chunk_ids))
        per_token = {k: v[keep] for k, v in self.per_token.items()}
        return Result(summary=recomputed(self.summary, per_token), per_token=per_token, path=self.path, note=self.note)

    def selected(self, selection: depth.Selection) -> "Result":
        """The same measurement over only the scored tokens `selection` picks (a depth band, a segment, a
        category; an empty selection: all)."""
        if not selection:
            return self
        if self.per_token is None:
            raise QevalError(f"{self.origin} has no per-token values: it cannot be cut to {selection.describe()}")
        per_token = selection.select(self.per_token, self.summary.labels, f"{self.label} vs {self.ref_label}")
        summary = recomputed(self.summary, per_token)
        if selection.depth is not None:
            summary.depth = {"lo": selection.depth[0], "hi": selection.depth[1]}
        summary.selection = selection.labels() or None
        return Result(summary=summary, per_token=per_token, path=self.path, note=self.note)


def recomputed(head: ComparisonSummary, per_token: dict[str, np.ndarray],
               bands: list[tuple[int, int]] | None = None,
               buckets: list[tuple[float, float]] | None = None) -> ComparisonSummary:
    """The summary of these per-token values, its reference and candidate those of `head`; bands: of its by-depth
    figures (default: powers of 4 from 512); buckets: of its by-confidence ones (default:
    depth.DEFAULT_CONFIDENCE_EDGES)."""
    chunks = [int(c) for c in np.unique(per_token["chunk"])]
    bands = bands or depth.parse_bands(None, head.reference.n_ctx)
    body = Comparison(ref=None, cand=None, chunks=chunks, per_token=per_token, label_names=head.labels).summary(bands,
                                                                                                                buckets)  # reads per_token, chunks
    return of_figures(head.reference, head.candidate, body)


def with_reference_top1(res: Result, ref) -> Result:
    """A result saved before qeval kept the per-token reference top-1 probability (p_ref_top1), with that column
    read from the open reference store `ref` it was measured against (the exact log-probability of its argmax, which
    a store keeps per scored token) and its by-confidence figures computed from it; every other figure is as saved.
    As it was when it holds the column, has no per-token values, or `ref` is not its reference (measured_against
    says why: the caller's own check then refuses it)."""
    column = depth.CONFIDENCE_COLUMN
    if res.per_token is None or column in res.per_token or measured_against(res, ref):
        return res
    chunk, position = res.per_token["chunk"], res.per_token["position"]
    top1 = np.empty(len(chunk), dtype=np.float64)
    for c in np.unique(chunk):
        rows = chunk == c
        scored = ref.header.positions_of(int(c))
        at = np.searchsorted(scored, position[rows])
        if at.max() >= len(scored) or not np.array_equal(scored[at], position[rows]):
            raise QevalError(f"{res.origin}: chunk {int(c)} holds positions the reference does not score")
        top1[rows] = top1_probability(ref.read_chunk(int(c)))[at]
    per_token = {**res.per_token, column: top1}
    groups = depth.by_confidence(per_token, depth.parse_confidence_buckets(None), summarize_tokens)
    summary = dataclasses.replace(res.summary, by_confidence=[TokenGroup.from_json(g, "by_confidence") for g in groups])
    note = f"{res.label}: its figures by the reference's confidence computed from the reference's stored top-1 " \
           "probabilities (its result was saved before qeval kept them)"
    return Result(summary=summary, per_token=per_token, path=res.path, note="\n".join(filter(None, [res.note, note])),
                  comparison=res.comparison)


def require_current(res: Result) -> ComparisonRequest:
    """The request a saved result answers; a result that records none (an older qeval) or was computed
    with other formulas (METRICS_VERSION) is refused: its numbers may not be what this qeval computes."""
    request = res.summary.comparison_request()
    redo = (f"recompute it (qeval kld --ref {res.ref_label} --cand {res.label} --save-result, or re-run "
            "qeval matrix)")
    if request is None:
        raise QevalError(f"{res.origin} was saved by an older qeval that did not record what it measured; {redo}")
    current = metrics_version_of(request.reference)
    if request.metrics_version != current:
        raise QevalError(f"{res.origin} was computed with metrics version {request.metrics_version} (qeval "
                         f"{res.summary.qeval_version or '?'}); this qeval computes version {current}: {redo}")
    return request


def reusable_chunks(res: Result, ref, candidate: dict | None, samplers) -> tuple[set[int], str]:
    """(the chunks whose per-token values in `res` stand for a comparison against the open reference `ref` whose
    candidate producer is `candidate` (None: whatever `res` measured) with `samplers` (canonical names) computed too,
    why none do when that is so). They do when `res` was computed with this qeval's formulas against the same reference
    windows (its chunks are among `ref`'s first), of that candidate run live (a store's coded rows differ from live
    float32 ones by the code's rounding), and holds every sampler's figures; an early result's visited chunks count."""
    why_not = measured_against(res, ref)
    if why_not:
        return set(), why_not
    request = res.summary.comparison_request()
    if res.per_token is None:
        return set(), f"its per-token file is missing ({res.summary.per_token_file or 'none recorded'})"
    lacking = [k for k in PER_TOKEN_FIELDS if k not in res.per_token]
    if lacking:
        return set(), f"it was saved before qeval kept per-token {', '.join(lacking)}"
    if candidate is not None and request.candidate != candidate:
        return set(), f"it was measured otherwise ({'; '.join(changes(request.candidate, candidate))}, saved vs now)"
    if not str(res.summary.candidate.path or "").endswith(LIVE_SUFFIX):
        return set(), "its candidate was read from a store, not run live"
    missing = sorted(set(samplers) - set(request.samplers))
    if missing:
        return set(), f"it holds no figures for sampler {', '.join(missing)}"
    return {int(c) for c in res.chunk_ids}, ""


def measured_against(res: Result, ref) -> str:
    """"" when `res` was computed with this qeval's formulas against the open reference `ref` (the same windows: its
    chunks are among `ref`'s first), else why not."""
    try:
        request = require_current(res)
    except QevalError as exc:
        return str(exc)
    n_saved = len(request.early["order"]) if request.early else request.chunks
    if n_saved > ref.header.chunk_stop:
        return (f"it was measured against another reference (of {n_saved} chunks or more; this one holds "
                f"{ref.header.chunk_stop})")
    differences = changes(request.reference, reference_identity(ref, n_saved))
    if differences:
        return f"it was measured against another reference ({'; '.join(differences)}, saved vs now)"
    return ""


def save_result(cmp: Comparison, directory: str | os.PathLike) -> Path:
    """Write the summary JSON and per-token npz (qeval.storage.results.write_result); returns the JSON path."""
    summary = summarize(cmp)
    path = result_path(Path(directory), summary.candidate.label, summary.reference.label)
    return write_result(path, summary.to_json(), cmp.per_token)


def load_result(path: str | os.PathLike, with_per_token: bool = True) -> Result:
    path = Path(path)
    summary, per_token = read_result(path, with_per_token, _columns)
    return Result(summary=ComparisonSummary.from_json(summary), per_token=per_token, path=path)


def _columns(files: list[str]) -> tuple[str, ...]:
    """The per-token columns a result is read with: the group columns of conversations and the samplers' columns
    too."""
    return (*PER_TOKEN_FIELDS, *GROUP_FIELDS, *filter(sampler.is_column, files))
