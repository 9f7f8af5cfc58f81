"""Saved comparison results on disk: what leaderboards, paired comparisons and release gates read.

A result is two files in RUNS_DIR/results/: `<cand>.vs.<ref>.json` (the comparison summary, as
`qeval kld --json` prints it, plus `"per_token_file"`) and `<cand>.vs.<ref>.npz` (the per-token
arrays, one value per scored token: kld, kld_reverse, nll_ref, nll_cand, p_ref, p_cand, same_top1,
top5_agreement, top10_agreement, chunk, position, token, kld_bound, kld_reverse_bound, p_ref_top1 (not in a result
saved before qeval kept it); with `qeval kld --sampler`, the samplers' columns tvd@NAME ... of qeval.compare.sampler).

The summary records the request it answers (qeval.identity.ComparisonRequest: reference and candidate identity,
chunks, metrics version, the samplers' settings, and its key) and the qeval version. A saved result stands for a later
request only when the keys are equal. This module reads and writes the two files as plain values (a JSON object,
named arrays); qeval.present.results gives them their types.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from qeval.errors import QevalError, WriteFailed
from qeval.identity import ComparisonRequest
from qeval.storage.runs import RESULT_SEPARATOR, RESULTS_SUBDIR


def result_path(directory: Path, cand_label: str, ref_label: str) -> Path:
    """Where the result of `cand_label` against `ref_label` is saved in a results directory."""
    return directory / f"{cand_label}{RESULT_SEPARATOR}{ref_label}.json"


def saved_request(path: Path) -> ComparisonRequest | None:
    """The request the result saved at `path` answers; None when there is none there or it records none."""
    try:
        return ComparisonRequest.from_summary(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def write_result(path: Path, summary: dict, per_token: dict[str, np.ndarray]) -> Path:
    """Write the summary JSON at `path` (its "per_token_file" set) and the per-token npz beside it; returns `path`.
    Both are written beside their places first, then moved there (the npz first): a failed write (WriteFailed: a
    full disk) leaves the result that was there, if any, as it was."""
    npz = path.with_suffix(".npz")
    summary = {**summary, "per_token_file": npz.name}
    tmp_npz, tmp_json = npz.with_suffix(".npz.part"), path.with_suffix(".json.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp_npz, "wb") as fh:  # a file object: np.savez_compressed would add ".npz" to a path
            np.savez_compressed(fh, **per_token)
        tmp_json.write_text(json.dumps(summary, indent=2))
    except OSError as exc:
        tmp_npz.unlink(missing_ok=True)
        tmp_json.unlink(missing_ok=True)
        raise WriteFailed(f"writing the result {path} failed ({exc.strerror or exc})", path, exc.errno) from None
    tmp_npz.replace(npz)
    tmp_json.replace(path)
    return path


def read_result(path: Path, with_per_token: bool,
                columns: Callable[[list[str]], Iterable[str]]) -> tuple[dict, dict | None]:
    """(the summary JSON of the result at `path`, its per-token arrays: those `columns` names, in its order, of the
    names its file holds; None without `with_per_token` or a per-token file)."""
    try:
        summary = json.loads(path.read_text())
    except OSError as exc:
        raise QevalError(f"cannot read result {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise QevalError(f"{path} is not a qeval result (invalid JSON: {exc})") from None
    if not isinstance(summary, dict) or not {"reference", "candidate", "kld", "perplexity"} <= summary.keys():
        raise QevalError(f"{path} is not a qeval result (expected the JSON of `qeval kld --json`)")
    if not with_per_token or not summary.get("per_token_file"):
        return summary, None
    npz = path.parent / summary["per_token_file"]
    try:
        with np.load(npz) as data:
            return summary, {k: data[k] for k in columns(data.files) if k in data.files}
    except (OSError, ValueError) as exc:
        raise QevalError(f"cannot read per-token file {npz} of {path}: {exc}") from None


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
