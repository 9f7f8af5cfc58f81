"""Saved comparison results: what leaderboards, paired comparisons and release gates read.

A result is two files in RUNS_DIR/results/: `<cand>.vs.<ref>.json` (the comparison summary, as
`qeval kld --json` prints it, plus `"per_token_file"`) and `<cand>.vs.<ref>.npz` (the per-token
arrays, one value per scored token: kld, kld_reverse, nll_ref, nll_cand, p_ref, p_cand, same_top1,
top5_agreement, top10_agreement, chunk, position, token, kld_bound, kld_reverse_bound, p_ref_top1 (not in a result
saved before qeval kept it: with_reference_top1 reads it from the reference store); with `qeval kld --sampler`, the samplers'
columns tvd@NAME ... of qeval.compare.sampler).

The summary records the request it answers (qeval.identity.ComparisonRequest: reference and candidate
identity, chunks, metrics version, the samplers' settings, and its key) and the qeval version. A saved result stands for a
later request only when the keys are equal.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.compare import depth, sampler
from qeval.compare.metrics import GROUP_FIELDS, PER_TOKEN_FIELDS, Comparison, summarize_tokens, top1_probability
from qeval.compare.summary import ComparisonSummary, TokenGroup, of_figures, summarize
from qeval.errors import QevalError, WriteFailed
from qeval.identity import METRICS_VERSION, ComparisonRequest, changes, reference_identity
from qeval.storage.runs import LIVE_SUFFIX, RESULT_SEPARATOR, RESULTS_SUBDIR  # noqa: F401 - RESULTS_SUBDIR public here too



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
        return Result(recomputed(self.summary, per_token), per_token, self.path, self.note)

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
        return Result(summary, per_token, self.path, self.note)


def recomputed(head: ComparisonSummary, per_token: dict[str, np.ndarray],
               bands: list[tuple[int, int]] | None = None,
               buckets: list[tuple[float, float]] | None = None) -> ComparisonSummary:
    """The summary of these per-token values, its reference and candidate those of `head`; bands: of its by-depth
    figures (default: powers of 4 from 512); buckets: of its by-confidence ones (default:
    depth.DEFAULT_CONFIDENCE_EDGES)."""
    chunks = [int(c) for c in np.unique(per_token["chunk"])]
    bands = bands or depth.parse_bands(None, head.reference.n_ctx)
    body = Comparison(None, None, chunks, per_token, head.labels).summary(bands, buckets)  # reads per_token, chunks
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
    return Result(summary, per_token, res.path, "\n".join(filter(None, [res.note, note])), res.comparison)


def result_stem(cand_label: str, ref_label: str) -> str:
    return f"{cand_label}{RESULT_SEPARATOR}{ref_label}"


def result_path(directory: Path, cand_label: str, ref_label: str) -> Path:
    """Where the result of `cand_label` against `ref_label` is saved in a results directory."""
    return directory / f"{result_stem(cand_label, ref_label)}.json"


def saved_request(path: Path) -> ComparisonRequest | None:
    """The request the result saved at `path` answers; None when there is none there or it records none."""
    try:
        return ComparisonRequest.from_summary(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def require_current(res: Result) -> ComparisonRequest:
    """The request a saved result answers; a result that records none (an older qeval) or was computed
    with other formulas (METRICS_VERSION) is refused: its numbers may not be what this qeval computes."""
    request = res.summary.comparison_request()
    redo = (f"recompute it (qeval kld --ref {res.ref_label} --cand {res.label} --save-result, or re-run "
            "qeval matrix)")
    if request is None:
        raise QevalError(f"{res.origin} was saved by an older qeval that did not record what it measured; {redo}")
    if request.metrics_version != METRICS_VERSION:
        raise QevalError(f"{res.origin} was computed with metrics version {request.metrics_version} (qeval "
                         f"{res.summary.qeval_version or '?'}); this qeval computes version {METRICS_VERSION}: "
                         f"{redo}")
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
    """Write the summary JSON and per-token npz; returns the JSON path. Both are written beside their places
    first, then moved there (the npz first): a failed write (WriteFailed: a full disk) leaves the result that
    was there, if any, as it was."""
    directory = Path(directory)
    summary = summarize(cmp)
    path = result_path(directory, summary.candidate.label, summary.reference.label)
    npz = path.with_suffix(".npz")
    summary.per_token_file = npz.name
    tmp_npz, tmp_json = npz.with_suffix(".npz.part"), path.with_suffix(".json.part")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp_npz, "wb") as fh:  # a file object: np.savez_compressed would add ".npz" to a path
            np.savez_compressed(fh, **cmp.per_token)
        tmp_json.write_text(json.dumps(summary.to_json(), indent=2))
    except OSError as exc:
        tmp_npz.unlink(missing_ok=True)
        tmp_json.unlink(missing_ok=True)
        raise WriteFailed(f"writing the result {path} failed ({exc.strerror or exc})", path, exc.errno) from None
    tmp_npz.replace(npz)
    tmp_json.replace(path)
    return path


def load_result(path: str | os.PathLike, with_per_token: bool = True) -> Result:
    path = Path(path)
    try:
        summary = json.loads(path.read_text())
    except OSError as exc:
        raise QevalError(f"cannot read result {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise QevalError(f"{path} is not a qeval result (invalid JSON: {exc})") from None
    if not isinstance(summary, dict) or not {"reference", "candidate", "kld", "perplexity"} <= summary.keys():
        raise QevalError(f"{path} is not a qeval result (expected the JSON of `qeval kld --json`)")
    summary = ComparisonSummary.from_json(summary)
    per_token = None
    if with_per_token and summary.per_token_file:
        npz = path.parent / summary.per_token_file
        try:
            with np.load(npz) as data:
                # the group columns of conversations and the samplers' columns too
                fields = (*PER_TOKEN_FIELDS, *GROUP_FIELDS, *filter(sampler.is_column, data.files))
                per_token = {k: data[k] for k in fields if k in data.files}
        except (OSError, ValueError) as exc:
            raise QevalError(f"cannot read per-token file {npz} of {path}: {exc}") from None
    return Result(summary, per_token, path)


def runs_dir_of(result_path: Path) -> Path:
    """The runs directory a saved result lies in (RUNS_DIR/results/X.vs.Y.json), or its own folder when it lies
    elsewhere."""
    folder = Path(result_path).parent
    return folder.parent if folder.name == RESULTS_SUBDIR else folder


def find_results(paths: list[str | os.PathLike]) -> list[Path]:
    """Result JSON files named directly, or found in directories (a runs dir or its results/)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            sub = p / RESULTS_SUBDIR if (p / RESULTS_SUBDIR).is_dir() else p
            found += sorted(sub.glob("*.vs.*.json"))
        elif p.is_file():
            found.append(p)
        else:
            raise QevalError(f"{p} is neither a result file nor a directory of results")
    if not found:
        raise QevalError(f"no results found in {', '.join(map(str, paths))} (run `qeval matrix` or "
                         "`qeval kld ... --save-result` first)")
    return found
