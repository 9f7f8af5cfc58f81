"""Where stores live: a runs directory of `<label>.qeval` files, or explicit paths. A runs directory also holds
saved comparison results in `results/<cand>.vs.<ref>.json` (qeval.storage.results reads and writes them); this module
only names them, so that a label can be looked for among everything the directory knows."""

from __future__ import annotations

import os
import re
from pathlib import Path

from qeval.errors import QevalError
from qeval.storage import reference_pack
from qeval.storage.hub_files import is_hub_spec
from qeval.storage.llamacpp import LlamaCppBaseFile, is_llamacpp_file
from qeval.storage.store import MAGIC, StoreReader

STORE_SUFFIX = ".qeval"
DEFAULT_RUNS_DIR = "qeval-runs"
RESULTS_SUBDIR = "results"
RESULT_SEPARATOR = ".vs."
LIVE_SUFFIX = " (live)"  # a live candidate has no store: its path is its GGUF's, so marked (and so a result records it)
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def runs_dir(explicit: str | os.PathLike | None = None) -> Path:
    """--runs-dir, else $QEVAL_RUNS_DIR, else ./qeval-runs."""
    return Path(explicit or os.environ.get("QEVAL_RUNS_DIR") or DEFAULT_RUNS_DIR)


def live_model_path(path: str | None) -> str | None:
    """The GGUF a live candidate ran, from the path a comparison recorded of it (None: it was no live candidate)."""
    return path[:-len(LIVE_SUFFIX)] if path and path.endswith(LIVE_SUFFIX) else None


def check_label(label: str) -> str:
    if not _LABEL.match(label):
        raise QevalError(f"label {label!r} must start with a letter or digit and use only letters, digits, '.', "
                         "'_', '+' and '-'")
    return label


def is_label(text: str) -> bool:
    return bool(_LABEL.match(text))


def store_path(label: str, directory: Path) -> Path:
    return directory / f"{check_label(label)}{STORE_SUFFIX}"


def labels(directory: Path) -> list[str]:
    return sorted(p.name[:-len(STORE_SUFFIX)] for p in directory.glob(f"*{STORE_SUFFIX}")) if directory.is_dir() else []


def result_labels(directory: Path) -> list[tuple[str, str]]:
    """(candidate label, reference label) of every result saved in the runs directory, by file name."""
    found = sorted((directory / RESULTS_SUBDIR).glob(f"*{RESULT_SEPARATOR}*.json")) if directory.is_dir() else []
    pairs = (p.name[:-len(".json")].rpartition(RESULT_SEPARATOR) for p in found)
    return [(cand, ref) for cand, _, ref in pairs if cand and ref]


def known_labels_text(directory: Path) -> str:
    """Every label the runs directory knows, by kind: its stores and its saved results (against which reference)."""
    stores = labels(directory)
    by_ref: dict[str, list[str]] = {}
    for cand, ref in result_labels(directory):
        by_ref.setdefault(ref, []).append(cand)
    kinds = [f"stores: {', '.join(stores)}" if stores else "no stores"]
    kinds += [f"results against {ref}: {', '.join(cands)}" for ref, cands in by_ref.items()]
    return "; ".join(kinds)


def resolve_path(spec: str, directory: Path) -> Path:
    """The file a store argument names: a path, a label in the runs directory, or a published reference
    `hf:USER/REPO[:LABEL]`, downloaded into huggingface_hub's cache and verified (qeval.storage.reference_pack)."""
    if is_hub_spec(spec):
        return reference_pack.pull(spec)
    path = Path(spec)
    if path.is_file():
        return path
    if path.exists():
        raise QevalError(f"{spec} is not a regular file")
    if _LABEL.match(spec):
        candidate = directory / f"{spec}{STORE_SUFFIX}"
        if candidate.is_file():
            return candidate
    raise QevalError(f"{spec!r} is neither a file nor a label in the runs directory {directory} "
                     f"({known_labels_text(directory)}). A GGUF file given as --cand runs live; `qeval kld ... "
                     "--save-result` and `qeval matrix` save results under labels")


def is_store_file(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError as exc:
        raise QevalError(f"cannot read {path}: {exc.strerror}") from None


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a file that starts as a GGUF model does (its magic bytes)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def open_source(spec: str, directory: Path):
    """A store path, a llama.cpp --kl-divergence-base path, or a label in the runs directory."""
    path = resolve_path(spec, directory)
    if is_llamacpp_file(path):
        return LlamaCppBaseFile(path)
    if not is_store_file(path):
        if is_gguf(path):
            raise QevalError(f"{path} is a GGUF model, not a store: capture its logits into one first "
                             f"(qeval capture {path} --label LABEL), then name the store by its label")
        raise QevalError(f"{path} is neither a qeval store nor a llama.cpp --kl-divergence-base file")
    return StoreReader(path)
