"""Evaluation text: a local file, a corpus shipped in corpora/, or a Hugging Face dataset.

Chunking follows llama-perplexity: the text is tokenized once (BOS at the start only), cut into
non-overlapping windows of n_ctx tokens, the tail that does not fill a window is dropped, and at
least 2 * n_ctx tokens are required.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from qeval.errors import QevalError

DEFAULT_CORPUS = "austen-northanger-abbey"
# Short names for hub datasets: (dataset, config, split, text column).
HF_ALIASES = {"wikitext-2": ("wikitext", "wikitext-2-raw-v1", "test", "text"),
              "wikitext-103": ("wikitext", "wikitext-103-raw-v1", "test", "text")}


@dataclass(frozen=True)
class Corpus:
    name: str
    source: str
    text: str

    def identity(self) -> dict:
        data = self.text.encode("utf-8")
        return {"name": self.name, "source": self.source, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}


def shipped_dir():
    """The corpora/ folder, installed inside the package as qeval/corpora."""
    return resources.files("qeval.corpora")


def shipped_names() -> list[str]:
    d = shipped_dir()
    return sorted(p.name[:-4] for p in d.iterdir() if p.name.endswith(".txt")) if d.is_dir() else []


def load_corpus(spec: str | None = None, hf_loader: Callable | None = None) -> Corpus:
    """`spec`: a text file path, a shipped corpus name, `wikitext-2`, or hf:DATASET[/CONFIG][:SPLIT][#COLUMN]."""
    spec = spec or DEFAULT_CORPUS
    path = Path(spec)
    if path.is_file():
        return Corpus(path.stem, str(path), _read_text(path))
    if spec in HF_ALIASES:
        return Corpus(spec, f"hf:{'/'.join(HF_ALIASES[spec][:2])}", load_hf_text(*HF_ALIASES[spec], loader=hf_loader))
    if spec.startswith("hf:"):
        dataset, config, split, column = parse_hf_spec(spec)
        return Corpus(spec, spec, load_hf_text(dataset, config, split, column, loader=hf_loader))
    name = spec[:-4] if spec.endswith(".txt") else spec
    shipped = shipped_dir() / f"{name}.txt"
    if shipped.is_file():
        return Corpus(name, f"corpora/{name}.txt", shipped.read_text(encoding="utf-8"))
    raise QevalError(f"corpus {spec!r} is not a file, a shipped corpus ({', '.join(shipped_names()) or 'none'}), "
                     f"a hub alias ({', '.join(HF_ALIASES)}) or an hf:DATASET[/CONFIG][:SPLIT][#COLUMN] spec")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise QevalError(f"corpus {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise QevalError(f"cannot read corpus {path}: {exc.strerror}") from None


def parse_hf_spec(spec: str) -> tuple[str, str | None, str, str]:
    body = spec[3:]
    body, _, column = body.partition("#")
    body, _, split = body.partition(":")
    dataset, _, config = body.partition("/")
    if "/" in config:  # owner/name datasets: hf:owner/name/config
        owner_name, _, config = f"{dataset}/{config}".rpartition("/")
        dataset = owner_name
    if not dataset:
        raise QevalError(f"bad hub corpus spec {spec!r}: expected hf:DATASET[/CONFIG][:SPLIT][#COLUMN]")
    return dataset, config or None, split or "test", column or "text"


def load_hf_text(dataset: str, config: str | None, split: str, column: str, loader: Callable | None = None) -> str:
    """Rows of one text column joined as they are (wikitext rows keep their own newlines)."""
    if loader is None:
        from datasets import load_dataset as loader  # noqa: PLC0415 - slow import, only when used
    try:
        rows = loader(dataset, config, split=split)
    except Exception as exc:  # datasets raises many types (connection, missing config, ...)
        raise QevalError(f"could not load hub dataset {dataset}"
                         f"{'/' + config if config else ''} split {split}: {type(exc).__name__}: {exc}. "
                         "Without network access, pass a local text file with --corpus instead") from None
    if column not in rows.column_names:
        raise QevalError(f"dataset {dataset} has no column {column!r} (columns: {', '.join(rows.column_names)})")
    return "".join(rows[column])


def make_windows(tokens: np.ndarray, n_ctx: int, max_chunks: int | None, corpus_name: str = "corpus") -> np.ndarray:
    """[n_chunks, n_ctx] token windows, as tokenized (the BOS substitution happens at decode time)."""
    if n_ctx < 4 or n_ctx % 2:
        raise QevalError(f"-c/--ctx must be an even number of at least 4, not {n_ctx}")
    n = len(tokens)
    available = n // n_ctx
    if n < 2 * n_ctx:
        raise QevalError(f"{corpus_name} tokenizes to only {n} tokens; n_ctx {n_ctx} needs at least "
                         f"{2 * n_ctx} (two windows, llama-perplexity's rule)")
    if max_chunks is not None:
        if max_chunks < 1:
            raise QevalError("--chunks must be at least 1")
        if max_chunks > available:
            raise QevalError(f"{corpus_name} tokenizes to {n} tokens = {available} chunks of {n_ctx}; "
                             f"--chunks {max_chunks} asks for more (use a longer corpus or fewer chunks)")
    count = available if max_chunks is None else max_chunks
    return np.ascontiguousarray(tokens[:count * n_ctx].reshape(count, n_ctx), dtype=np.int32)
