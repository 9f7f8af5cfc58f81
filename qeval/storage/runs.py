"""Where stores live: a runs directory of `<label>.qeval` files, or explicit paths."""

from __future__ import annotations

import os
import re
from pathlib import Path

from qeval.errors import QevalError
from qeval.storage.llamacpp import LlamaCppBaseFile, is_llamacpp_file
from qeval.storage.store import MAGIC, StoreReader

STORE_SUFFIX = ".qeval"
DEFAULT_RUNS_DIR = "qeval-runs"
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def runs_dir(explicit: str | os.PathLike | None = None) -> Path:
    """--runs-dir, else $QEVAL_RUNS_DIR, else ./qeval-runs."""
    return Path(explicit or os.environ.get("QEVAL_RUNS_DIR") or DEFAULT_RUNS_DIR)


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


def resolve_path(spec: str, directory: Path) -> Path:
    """The file a store argument names: a path, or a label in the runs directory."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.exists():
        raise QevalError(f"{spec} is not a regular file")
    if _LABEL.match(spec):
        candidate = directory / f"{spec}{STORE_SUFFIX}"
        if candidate.is_file():
            return candidate
    known = labels(directory)
    hint = f"labels in {directory}: {', '.join(known)}" if known else f"no stores in {directory}"
    raise QevalError(f"{spec!r} is neither a file nor a label in the runs directory ({hint})")


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
