"""A GGUF model behind llama-cpp-python's low-level API: tokenize, and decode windows returning
only the logits of scored positions, as views of llama.cpp's own output buffer (no copies).

Windows are decoded the way llama-perplexity decodes them: KV cache cleared, one sequence per
window, positions from 0, the first token replaced by BOS when the vocab adds one. Unlike
llama-perplexity, a window is submitted in pieces (unscored half, then scored pieces) to bound
the output buffers; the logits agree with its own to the last printed digit (see README).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import QevalError

# GGML type ids accepted for the KV cache (llama.cpp ggml.h).
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
UNQUANTIZED_KV = ("f32", "f16", "bf16")


def _llama_cpp():
    try:
        import llama_cpp  # noqa: PLC0415 - heavy import, only when a model is used
    except ImportError as exc:  # pragma: no cover - dependency is required
        raise QevalError(f"llama-cpp-python is not importable ({exc}); see README 'Install'") from None
    return llama_cpp


_LOG_CALLBACK = None
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Serve every allocation over 1 MiB with its own mmap, returned to the OS when freed.

    glibc raises its mmap threshold after the first large block is freed, so the 16 MB blocks of
    the encoder later come from arenas that fragment: peak RSS then crept up by ~30 MB over 80
    chunks. A fixed threshold keeps it flat (measured: 0.928 GiB at 4 chunks, 0.931 at 80).
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def quiet_llama() -> None:
    """Silence llama.cpp's stderr logging (it prints hundreds of lines per model load)."""
    global _LOG_CALLBACK
    llama_cpp = _llama_cpp()
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()


@dataclass(frozen=True)
class EngineSettings:
    """How a model runs; everything that can change its logits is recorded in the store."""

    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    n_gpu_layers: int = 0
    n_threads: int | None = None

    def validate(self) -> "EngineSettings":
        for name, value in (("-ctk", self.type_k), ("-ctv", self.type_v)):
            if value not in KV_TYPES:
                raise QevalError(f"unknown KV cache type {value!r} for {name}; choose one of: "
                                 f"{', '.join(KV_TYPES)}")
        if self.flash_attn not in FLASH_ATTN:
            raise QevalError(f"-fa must be on, off or auto, not {self.flash_attn!r}")
        if self.type_v not in UNQUANTIZED_KV and self.flash_attn == "off":
            raise QevalError(f"a quantized V cache (-ctv {self.type_v}) needs flash attention: use -fa on "
                             "(llama.cpp cannot create such a context without it)")
        if self.n_threads is not None and self.n_threads < 1:
            raise QevalError("-t/--threads must be at least 1")
        return self

    def as_json(self) -> dict:
        return {"type_k": self.type_k, "type_v": self.type_v, "flash_attn": self.flash_attn}


def check_model_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise QevalError(f"model file {path} does not exist")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise QevalError(f"cannot read model file {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise QevalError(f"{path} is not a GGUF model file (bad magic {magic!r})")
    return path


class Engine:
    """One loaded model and context for windows of `n_ctx` tokens, decoded `n_batch` at a time."""

    def __init__(self, model_path: str | os.PathLike, n_ctx: int, settings: EngineSettings = EngineSettings(),
                 n_batch: int = 128):
        self.settings = settings.validate()
        self.model_path = check_model_file(model_path)
        fixed_mmap_threshold()
        self.n_ctx = n_ctx
        if n_batch < 1:
            raise QevalError("-b/--batch-size must be at least 1")
        self.n_batch = min(n_batch, n_ctx)
        quiet_llama()
        lc = self._lc = _llama_cpp()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = settings.n_gpu_layers
        self.model = lc.llama_model_load_from_file(str(self.model_path).encode(), mparams)
        if not self.model:
            raise QevalError(f"llama.cpp could not load {self.model_path} (corrupt or unsupported GGUF)")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(lc.llama_vocab_bos(self.vocab))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = 1
        cparams.type_k = KV_TYPES[settings.type_k]
        cparams.type_v = KV_TYPES[settings.type_v]
        cparams.flash_attn_type = FLASH_ATTN[settings.flash_attn]
        threads = settings.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise QevalError(f"llama.cpp could not create a context for {self.model_path.name} with KV "
                             f"{settings.type_k}/{settings.type_v}, flash attention {settings.flash_attn} "
                             f"(n_ctx {n_ctx}): out of memory, or a setting this build "
                             "does not support")
        self.first, self.n_scored = n_ctx // 2, n_ctx - 1 - n_ctx // 2
        self._batch = lc.llama_batch_init(n_ctx, 0, 1)
        self._tokens_view = np.ctypeslib.as_array(self._batch.token, shape=(n_ctx,))
        self._pos_view = np.ctypeslib.as_array(self._batch.pos, shape=(n_ctx,))
        self._nseq_view = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_ctx,))
        self._logits_view = np.ctypeslib.as_array(self._batch.logits, shape=(n_ctx,))
        self._seq_slots = [self._batch.seq_id[i] for i in range(n_ctx)]

    # -- vocab -----------------------------------------------------------------------------------
    def tokenize(self, text: str) -> np.ndarray:
        """Whole-text tokenization with BOS at the start only, like llama-perplexity."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self._lc.llama_token * cap)()
        n = self._lc.llama_tokenize(self.vocab, data, len(data), buf, cap, True, False)
        if n < 0:
            raise QevalError("tokenization failed (text too long for one call)")
        return np.ctypeslib.as_array(buf)[:n].astype(np.int32)

    def tokenizer_fingerprint(self) -> str:
        """sha256 over every token piece and the BOS setting: equal only for equal tokenizers."""
        h = hashlib.sha256(f"{self.n_vocab}:{int(self.add_bos)}:{self.bos}\n".encode())
        for i in range(self.n_vocab):
            h.update(self._lc.llama_vocab_get_text(self.vocab, i) or b"")
            h.update(b"\0")
        return h.hexdigest()

    # -- decoding --------------------------------------------------------------------------------
    def _fill_batch(self, tokens: np.ndarray, pos0: int, want_logits: np.ndarray) -> None:
        n = len(tokens)
        self._tokens_view[:n] = tokens
        self._pos_view[:n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self._nseq_view[:n] = 1
        self._logits_view[:n] = want_logits.astype(np.int8)
        for j in range(n):
            self._seq_slots[j][0] = 0
        self._batch.n_tokens = n

    def _decode(self) -> None:
        rc = self._lc.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise QevalError(f"llama_decode failed with code {rc} (out of memory or KV cache too small)")

    def iter_scored_logits(self, window: np.ndarray):
        """Decode one window; yield (first scored row, float32 [rows, n_vocab]) piece by piece.

        Pieces are n_batch tokens, so llama.cpp's output buffers hold n_batch rows, not n_ctx/2
        (at a 262K vocab, 128 MiB instead of 255 MiB, twice: compute buffer and logits copy).
        Each yielded array is a view of llama.cpp's buffer, valid until the next iteration.
        """
        if len(window) != self.n_ctx:
            raise ValueError(f"expected a window of {self.n_ctx} tokens")
        toks = np.array(window, dtype=np.int32)
        if self.add_bos:
            toks[0] = self.bos
        lc = self._lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        for start in range(0, self.first, self.n_batch):
            stop = min(start + self.n_batch, self.first)
            self._fill_batch(toks[start:stop], start, np.zeros(stop - start, dtype=bool))
            self._decode()
        for start in range(self.first, self.n_ctx, self.n_batch):
            stop = min(start + self.n_batch, self.n_ctx)
            pos = np.arange(start, stop)
            want = pos < self.n_ctx - 1
            self._fill_batch(toks[start:stop], start, want)
            self._decode()
            rows = int(want.sum())
            if rows:
                ptr = lc.llama_get_logits(self.ctx)
                yield start - self.first, np.ctypeslib.as_array(ptr, shape=(rows * self.n_vocab,)).reshape(
                    rows, self.n_vocab)

    def close(self) -> None:
        lc = self._lc
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
