"""One candidate measured against a reference, whichever way it arrives: computed now from stores
(through `api.compare`) or loaded from a saved result (`RUNS_DIR/results/<cand>.vs.<ref>.json`).

Paired comparisons (`qeval compare`) and release gates (`qeval check`) both start here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import results, runs
from .errors import MismatchError, QevalError
from .metrics import Comparison


@dataclass
class Measured:
    summary: dict  # the comparison JSON (`qeval kld --json`): reference, candidate, chunks, kld, ...
    per_token: dict[str, np.ndarray] | None
    origin: str  # "stores" or the result file it came from

    @property
    def label(self) -> str:
        return self.summary["candidate"]["label"]

    @property
    def ref_label(self) -> str:
        return self.summary["reference"]["label"]

    @property
    def chunk_ids(self) -> np.ndarray:
        return np.unique(self.per_token["chunk"])

    def restricted(self, chunk_ids) -> "Measured":
        """The same measurement over only these chunks (summary recomputed from per-token values)."""
        if self.per_token is None:
            raise QevalError(f"{self.origin} has no per-token values: it cannot be cut to fewer chunks")
        keep = np.isin(self.per_token["chunk"], np.asarray(chunk_ids))
        per_token = {k: v[keep] for k, v in self.per_token.items()}
        return Measured(summarize(self.summary, per_token), per_token, self.origin)


def summarize(head: dict, per_token: dict[str, np.ndarray]) -> dict:
    """Comparison JSON (reference/candidate descriptions from `head`) recomputed from per-token values."""
    chunks = [int(c) for c in np.unique(per_token["chunk"])]
    body = Comparison(None, None, chunks, per_token).summary()  # summary() reads only per_token and chunks
    return {"reference": head["reference"], "candidate": head["candidate"], **body}


def is_result_spec(spec: str) -> bool:
    return str(spec).endswith(".json")


def measure(ref: str, cand: str, chunks: int | None = None, runs_dir: str | os.PathLike | None = None,
            threads: int = 2, progress: bool = False, need_per_token: bool = True) -> Measured:
    """`cand` against `ref`: a saved result file (`*.json`) is read, anything else compared now."""
    if is_result_spec(cand):
        return _from_result(ref, Path(cand), chunks, runs_dir, need_per_token or chunks is not None)
    from . import api, report  # noqa: PLC0415 - api imports the capture engine

    cmp = api.compare(ref, cand, chunks, runs_dir, threads=threads, progress=progress)
    return Measured(report.comparison_json(cmp), cmp.per_token, "stores")


def _from_result(ref: str, path: Path, chunks: int | None, runs_dir, need_per_token: bool) -> Measured:
    if not path.is_file():
        raise QevalError(f"result file {path} does not exist")
    res = results.load_result(path, with_per_token=need_per_token)
    if need_per_token and res.per_token is None:
        raise QevalError(f"{path} has no per-token file (save results with `qeval kld --save-result` or "
                         "`qeval matrix`)")
    _check_reference(ref, res, runs_dir)
    m = Measured(res.summary, res.per_token, str(path))
    if chunks is not None:
        have = int(res.summary["chunks"])
        if not 1 <= chunks <= have:
            raise QevalError(f"--chunks {chunks} is outside the {have} chunks of {path}")
        m = m.restricted(np.arange(chunks))
    return m


def _check_reference(ref: str, res: results.Result, runs_dir) -> None:
    """A saved result answers only for the reference it was measured against."""
    rd = res.summary["reference"]
    if ref == rd.get("label"):
        return
    saved = Path(rd.get("path") or "")
    try:
        named = runs.resolve_path(ref, runs.runs_dir(runs_dir))
    except QevalError:
        named = Path(ref)
    for candidate in (saved, res.path.parent / saved, res.path.parent.parent / saved.name):
        try:
            if candidate.is_file() and named.is_file() and candidate.samefile(named):
                return
        except OSError:
            pass
    raise MismatchError(f"{res.path} was measured against reference {rd.get('label')!r} ({rd.get('path')}), "
                        f"not {ref!r}")
