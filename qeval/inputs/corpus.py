"""Evaluation text: a list of documents from a local file or folder, the shipped corpora, or a Hugging Face dataset.

Chunking follows llama-perplexity within each document: a document is tokenized once (BOS at its
start only), cut into non-overlapping windows of n_ctx tokens, and the tail that does not fill a
window is dropped. A window never spans two documents (unrelated texts) unless they are
concatenated on request (`concat`), which is llama-perplexity's behaviour for a multi-text file. A
file or a hub dataset is one document (wikitext's rows are lines of articles, joined as
llama-perplexity joins them); a folder is one document per *.txt file, in name order; `shipped`
is every shipped corpus.
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
SHIPPED_SET = "shipped"  # every shipped corpus, one document each
# Short names for hub datasets: (dataset, config, split, text column).
HF_ALIASES = {"wikitext-2": ("wikitext", "wikitext-2-raw-v1", "test", "text"),
              "wikitext-103": ("wikitext", "wikitext-103-raw-v1", "test", "text")}


@dataclass(frozen=True)
class Corpus:
    name: str
    source: str
    documents: tuple[str, ...]

    @property
    def text(self) -> str:
        """The documents as one text (what `concat` tokenizes)."""
        return "".join(self.documents)

    def identity(self) -> dict:
        if len(self.documents) == 1:  # as before documents existed, so earlier stores keep their identity
            data = self.documents[0].encode("utf-8")
            return {"name": self.name, "source": self.source, "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()}
        h = hashlib.sha256()
        for doc in self.documents:
            data = doc.encode("utf-8")
            h.update(len(data).to_bytes(8, "little") + data)
        return {"name": self.name, "source": self.source, "documents": len(self.documents),
                "bytes": sum(len(d.encode("utf-8")) for d in self.documents), "sha256": h.hexdigest()}


def one(name: str, source: str, text: str) -> Corpus:
    return Corpus(name, source, (text,))


def shipped_dir():
    """The corpora/ folder, installed inside the package as qeval/corpora."""
    return resources.files("qeval.corpora")


def shipped_names() -> list[str]:
    d = shipped_dir()
    return sorted(p.name[:-4] for p in d.iterdir() if p.name.endswith(".txt")) if d.is_dir() else []


def load_corpus(spec: str | None = None, hf_loader: Callable | None = None) -> Corpus:
    """`spec`: a text file, a folder of *.txt documents, a shipped corpus name (or `shipped`: all of them),
    `wikitext-2`, or hf:DATASET[/CONFIG][:SPLIT][#COLUMN]."""
    spec = spec or DEFAULT_CORPUS
    path = Path(spec)
    if path.is_file():
        return one(path.stem, str(path), _read_text(path))
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise QevalError(f"corpus folder {path} holds no *.txt document")
        return Corpus(path.name, str(path), tuple(_read_text(f) for f in files))
    if spec in HF_ALIASES:
        return one(spec, f"hf:{'/'.join(HF_ALIASES[spec][:2])}", load_hf_text(*HF_ALIASES[spec], loader=hf_loader))
    if spec.startswith("hf:"):
        dataset, config, split, column = parse_hf_spec(spec)
        return one(spec, spec, load_hf_text(dataset, config, split, column, loader=hf_loader))
    if spec == SHIPPED_SET:
        names = shipped_names()
        return Corpus(SHIPPED_SET, "corpora/*.txt",
                      tuple((shipped_dir() / f"{n}.txt").read_text(encoding="utf-8") for n in names))
    name = spec[:-4] if spec.endswith(".txt") else spec
    shipped = shipped_dir() / f"{name}.txt"
    if shipped.is_file():
        return one(name, f"corpora/{name}.txt", shipped.read_text(encoding="utf-8"))
    raise QevalError(f"corpus {spec!r} is not a file, a folder, a shipped corpus ({', '.join(shipped_names()) or 'none'}"
                     f", or {SHIPPED_SET}), a hub alias ({', '.join(HF_ALIASES)}) or an "
                     "hf:DATASET[/CONFIG][:SPLIT][#COLUMN] spec")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise QevalError(f"corpus {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise QevalError(f"cannot read corpus {path}: {exc.strerror}") from None


def parse_hf_spec(spec: str, default_column: str = "text") -> tuple[str, str | None, str, str]:
    body = spec[3:]
    body, _, column = body.partition("#")
    body, _, split = body.partition(":")
    dataset, _, config = body.partition("/")
    if "/" in config:  # owner/name datasets: hf:owner/name/config
        owner_name, _, config = f"{dataset}/{config}".rpartition("/")
        dataset = owner_name
    if not dataset:
        raise QevalError(f"bad hub corpus spec {spec!r}: expected hf:DATASET[/CONFIG][:SPLIT][#COLUMN]")
    return dataset, config or None, split or "test", column or default_column


def load_hf_rows(dataset: str, config: str | None, split: str, column: str, loader: Callable | None = None,
                 local: str = "a local text file"):
    """A hub dataset's split (through `datasets`, or `loader` in its place), checked to hold `column`."""
    if loader is None:
        from datasets import load_dataset as loader  # noqa: PLC0415 - slow import, only when used
    try:
        rows = loader(dataset, config, split=split)
    except Exception as exc:  # datasets raises many types (connection, missing config, ...)
        raise QevalError(f"could not load hub dataset {dataset}"
                         f"{'/' + config if config else ''} split {split}: {type(exc).__name__}: {exc}. "
                         f"Without network access, pass {local} with --corpus instead") from None
    if column not in rows.column_names:
        raise QevalError(f"dataset {dataset} has no column {column!r} (columns: {', '.join(rows.column_names)}): "
                         "name it with hf:DATASET#COLUMN")
    return rows


def load_hf_text(dataset: str, config: str | None, split: str, column: str, loader: Callable | None = None) -> str:
    """Rows of one text column joined as they are (wikitext rows keep their own newlines)."""
    return "".join(load_hf_rows(dataset, config, split, column, loader)[column])


def tokenize_documents(corpus: Corpus, tokenize: Callable[[str], np.ndarray], concat: bool = False) -> list[np.ndarray]:
    """Each document's tokens (BOS at its start), or with `concat` the documents joined as one text."""
    if concat or len(corpus.documents) == 1:
        return [tokenize(corpus.text)]
    return [tokenize(doc) for doc in corpus.documents]


def check_ctx(n_ctx: int) -> None:
    """A window size every corpus accepts: even (llama-perplexity's half rule) and at least 4 tokens."""
    if n_ctx < 4 or n_ctx % 2:
        raise QevalError(f"-c/--ctx must be an even number of at least 4, not {n_ctx}")


def make_windows(tokens: np.ndarray | list[np.ndarray], n_ctx: int, max_chunks: int | None,
                 corpus_name: str = "corpus") -> np.ndarray:
    """[n_chunks, n_ctx] token windows, as tokenized (the BOS substitution happens at decode time):
    the windows of each document (an array, or a list of them) in order; no window spans two."""
    check_ctx(n_ctx)
    documents = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
    per_doc = [len(d) // n_ctx for d in documents]
    available = sum(per_doc)
    if available == 0:
        longest = max(len(d) for d in documents)
        what = (f"{corpus_name} tokenizes to only {longest} tokens" if len(documents) == 1 else
                f"no document of {corpus_name} fills a window: the longest tokenizes to {longest} tokens")
        raise QevalError(f"{what}; a window of n_ctx {n_ctx} needs {n_ctx} tokens of one document "
                         "(use a smaller -c, a longer corpus, or --concat to join documents)")
    if max_chunks is not None:
        if max_chunks < 1:
            raise QevalError("--chunks must be at least 1")
        if max_chunks > available:
            raise QevalError(f"{corpus_name} gives {available} chunks of {n_ctx} tokens "
                             f"({sum(map(len, documents))} tokens in {len(documents)} document(s)); "
                             f"--chunks {max_chunks} asks for more (use a longer corpus or fewer chunks)")
    windows = [d[:k * n_ctx].reshape(k, n_ctx) for d, k in zip(documents, per_doc) if k]
    count = available if max_chunks is None else max_chunks
    return np.ascontiguousarray(np.concatenate(windows)[:count], dtype=np.int32)
