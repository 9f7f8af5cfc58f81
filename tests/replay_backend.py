"""A backend that is not llama.cpp: the logits of every position of some token windows, saved in an .npz
(save_replay), replayed through qeval.engine.engine.Backend. Its "model" is that file, its tokenizer reads
a text of whitespace-separated token ids, so a corpus file of those windows' ids tokenizes into them.

Being a backend takes this one file and one registration (register): qeval.engine.backends.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import numpy as np

from qeval.engine.backends import register_backend
from qeval.engine.engine import EngineSettings, ScoredRows
from qeval.errors import QevalError
from qeval.storage.scoring import Scoring

NAME = "replay"


def save_replay(path: Path, windows: np.ndarray, logits: np.ndarray) -> Path:
    """windows: int32 [n, n_ctx]; logits: float32 [n, n_ctx, n_vocab], the logits of every position."""
    np.savez(path, windows=windows, logits=logits)
    return Path(path)


def corpus_text(windows: np.ndarray) -> str:
    """A corpus this backend tokenizes into `windows`, in order."""
    return " ".join(map(str, np.asarray(windows).ravel()))


class ReplayBackend:
    """Each window decoded is looked up among the saved ones (by its tokens) and its scored rows handed out,
    one window per call."""

    def __init__(self, model: str, n_ctx: int, settings: EngineSettings, scoring: Scoring):
        with np.load(model) as saved:
            self.windows, self.logits = saved["windows"], saved["logits"]
        if self.windows.shape[1] != n_ctx:
            raise QevalError(f"{model} holds windows of {self.windows.shape[1]} tokens, not {n_ctx}")
        self.settings, self.scoring, self.n_ctx = settings, scoring, n_ctx
        self.n_vocab = self.logits.shape[2]
        self.n_batch = self.n_ubatch = n_ctx
        self.add_bos = False
        digest = hashlib.sha256(Path(model).read_bytes()).hexdigest()
        self.facts = {"file_name": Path(model).name, "fingerprint": digest}
        self.provenance = {}
        self.kv_rotation = {"k": False, "v": False}  # nothing is quantized: replayed logits
        self.numerics = {"replayed": True}
        self._by_tokens = {w.tobytes(): i for i, w in enumerate(self.windows.astype(np.int32))}

    def tokenize(self, text: str) -> np.ndarray:
        return np.array(text.split(), dtype=np.int32)

    def tokenizer_fingerprint(self) -> str:
        return hashlib.sha256(f"{NAME}: token ids 0..{self.n_vocab - 1}".encode()).hexdigest()

    def iter_calls(self, windows: np.ndarray, scored=None) -> Iterator[list[ScoredRows]]:
        for k, window in enumerate(np.asarray(windows, dtype=np.int32)):
            saved = self._by_tokens[window.tobytes()]
            positions = scored[k] if scored is not None else self.scoring.positions(self.n_ctx)
            yield [ScoredRows(k, 0, positions, self.logits[saved][positions])]

    def close(self) -> None:
        pass


def register() -> None:
    register_backend(NAME, ReplayBackend)
