"""A GGUF model behind llama-cpp-python's low-level API: tokenize, and decode windows returning
only the logits of scored positions.

LlamaModel is qeval's one llama.cpp wrapper: model and context set-up (RoPE scaling and the trained
context included), tokenization, the tokenizer fingerprint, decode calls and teardown. Engine decodes
corpus windows on it (the default Backend of qeval.engine.backends); qeval.capture.taskscore.TaskModel
decodes task batches on it in a context of its own shape.

Windows are decoded the way llama-perplexity decodes them: KV cache cleared, one sequence per
window, positions from 0, the first token replaced by BOS when the vocab adds one. With
n_batch >= n_ctx, n_batch // n_ctx windows go into one llama_decode call as separate sequences
(llama-perplexity's -b 2048 = 4 windows of 512); with n_batch < n_ctx a window is submitted in
pieces of n_batch tokens (unscored half, then scored pieces), which bounds llama.cpp's output
buffers to n_batch rows. The logits agree with llama-perplexity's to the last printed digit.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from qeval.engine import hidden_tap, numerics
from qeval.engine.buildflags import cpu_model
from qeval.engine.build_check import cache_type
from qeval.engine.cache_types import verified_cache
from qeval.engine.memory import allocated_cache, failed_allocation
from qeval.engine.modelinfo import model_facts, require_decoder_context
from qeval.engine.probe import ensure_llama_runs
from qeval.errors import QevalError
from qeval.storage.scoring import HALF, Scoring

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
ROPE_SCALING = {"linear": 1, "yarn": 2}  # llama_rope_scaling_type
UNQUANTIZED_KV = ("f32", "f16", "bf16")
# How scored positions are decoded. PROMPT: in prompt batches, as llama-perplexity does. GENERATE: a window's
# unscored prefix as one prompt, then every position from the first scored one a token per llama_decode call, as
# llama-server generates: llama.cpp then runs other kernels (CPU flash attention: its one-chunk path, not the tiled
# one), so its logits differ, and a store of either is its own producer.
PROMPT, GENERATE = "prompt", "generate"
DECODE_MODES = (PROMPT, GENERATE)

# Default batch sizes. On CPU, windows go in 128-token pieces: llama.cpp's output buffers then hold
# 128 rows (128 MiB each at a 262K vocab), and a capture of Gemma-3-270M peaks at 0.96 GiB RSS
# instead of 2.24 GiB with -b 2048 -ub 512, at the same speed (measured on 2 cores: 22.5 s and
# 22.9 s for 8 chunks of 512). With layers offloaded, llama-perplexity's -b 2048 -ub 512: the ubatch
# size multiplies a GPU's prompt speed, and 4 windows of 512 per call take 1 GiB of host memory for
# their logits at a 262K vocab (llama.cpp's output buffer; twice with decode-ahead's copy).
CPU_BATCH = 128
OFFLOAD_BATCH = 2048
DEFAULT_UBATCH = 512  # llama.cpp's default n_ubatch
MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ: windows per call at most
LLAMA_CPP = "llama.cpp"  # the default backend (qeval.engine.backends): Engine


def _llama_cpp():
    try:
        import llama_cpp  # noqa: PLC0415 - heavy import, only when a model is used
    except ImportError as exc:  # pragma: no cover - dependency is required
        raise QevalError(f"llama-cpp-python is not importable ({exc}); see README 'Install'") from None
    return llama_cpp


_LOG_CALLBACK = None
_LOG_RECORD: list[str] | None = None  # llama.cpp's log while a context is created (numerics reads it)
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
        _LOG_CALLBACK = llama_cpp.llama_log_callback(_record_log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()


_LOG_LEVEL_ERROR = 4  # GGML_LOG_LEVEL_ERROR


def _record_log(level, text, user) -> None:
    if _LOG_RECORD is not None and text:
        text = text.decode("utf-8", "replace")
        # an error llama.cpp logs without saying so (`quantized V cache requires flash_attn`) reads as one
        _LOG_RECORD.append(f"error: {text}" if level == _LOG_LEVEL_ERROR and "error" not in text.lower() else text)


class ContextFailed(QevalError):
    """llama.cpp could not create a context; `asked`: the bytes of the buffer it could not allocate (None: unsaid)."""

    def __init__(self, message: str, asked: int | None = None, what: str | None = None):
        super().__init__(message)
        self.asked, self.what = asked, what  # and what llama.cpp said it was making


_ERROR_LINE = re.compile(r"error[^:]*: (.+)", re.IGNORECASE)


def _logged_errors(lines: list[str]) -> str:
    """What llama.cpp's log said went wrong (its error lines, joined), empty when it said nothing."""
    found = [m.group(1).strip() for line in lines if (m := _ERROR_LINE.search(line))]
    return "; ".join(dict.fromkeys(found))


@contextlib.contextmanager
def recorded_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs (otherwise they go nowhere)."""
    global _LOG_RECORD
    _LOG_RECORD = lines = []
    try:
        yield lines
    finally:
        _LOG_RECORD = None


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How a model runs; everything that can change its logits is recorded in the store."""

    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    n_gpu_layers: int = 0
    n_threads: int | None = None  # None: every core
    n_batch: int | None = None  # tokens per llama_decode call; None: CPU_BATCH, or OFFLOAD_BATCH with -ngl
    n_ubatch: int | None = None  # tokens per physical batch; None: min(n_batch, DEFAULT_UBATCH)
    # Decode the next call while the last one is coded; None: when offloaded. On CPU both compete for
    # the cores: 5 % slower with 128-token pieces, 23 % with -b 2048 (2 cores, 8 chunks of 512).
    decode_ahead: bool | None = None
    # RoPE scaling, opted into as with llama.cpp's --rope-scaling/--rope-scale: needed beyond the trained context
    rope_scaling: str | None = None  # "linear" or "yarn"
    rope_scale: float | None = None  # context scale factor (rope_freq_scale = 1/rope_scale); None: n_ctx/trained
    backend: str = LLAMA_CPP  # what computes the logits: a name registered in qeval.engine.backends
    kv_rotation: str = "auto"  # llama.cpp's Hadamard rotation of a quantized cache: auto (its rule), on, off
    decode: str = PROMPT  # how scored positions are decoded: PROMPT or GENERATE

    def validate(self) -> "EngineSettings":
        if self.rope_scaling not in (None, *ROPE_SCALING):
            raise QevalError(f"--rope-scaling must be {' or '.join(ROPE_SCALING)}, not {self.rope_scaling!r}")
        if self.rope_scale is not None and (self.rope_scaling is None or not self.rope_scale > 0):
            raise QevalError("--rope-scale needs --rope-scaling and a positive factor")
        for name, value in (("-ctk", self.type_k), ("-ctv", self.type_v)):
            cache_type(value, name)  # the loaded build's cache types (qeval.engine.cache_types)
        if self.kv_rotation not in numerics.ROTATION_MODES:
            raise QevalError(f"--kv-rotation must be one of {', '.join(numerics.ROTATION_MODES)}, "
                             f"not {self.kv_rotation!r}")
        if self.decode not in DECODE_MODES:
            raise QevalError(f"--decode must be {' or '.join(DECODE_MODES)}, not {self.decode!r}")
        if self.flash_attn not in FLASH_ATTN:
            raise QevalError(f"-fa must be on, off or auto, not {self.flash_attn!r}")
        if self.type_v not in UNQUANTIZED_KV and self.flash_attn == "off":
            raise QevalError(f"a quantized V cache (-ctv {self.type_v}) needs flash attention: use -fa on "
                             "(llama.cpp cannot create such a context without it)")
        for flag, value in (("-t/--threads", self.n_threads), ("-b/--batch-size", self.n_batch),
                            ("-ub/--ubatch-size", self.n_ubatch)):
            if value is not None and value < 1:
                raise QevalError(f"{flag} must be at least 1")
        return self

    @property
    def offloaded(self) -> bool:
        """Layers go to a GPU: asked for (-ngl, where -1 is all) and this llama.cpp build can."""
        return self.n_gpu_layers != 0 and bool(_llama_cpp().llama_supports_gpu_offload())

    def batch_sizes(self, n_ctx: int) -> tuple[int, int]:
        """(n_batch, n_ubatch) as used for windows of n_ctx tokens.

        As llama-perplexity: n_batch >= n_ctx decodes n_batch // n_ctx whole windows per call, so
        n_batch is rounded down to a multiple of n_ctx; n_ubatch is at most n_batch. GENERATE decodes one
        window at a time (a prompt of at most n_ctx tokens, then single tokens): n_batch is at most n_ctx.
        """
        n_batch = self.n_batch or (OFFLOAD_BATCH if self.offloaded else CPU_BATCH)
        if self.decode == GENERATE:
            n_batch = min(n_batch, n_ctx)
        elif n_batch >= n_ctx:
            n_batch = min(n_batch // n_ctx, MAX_SEQUENCES) * n_ctx
        return n_batch, min(self.n_ubatch or DEFAULT_UBATCH, n_batch)

    def numerics(self, facts: dict) -> dict:
        """What this llama.cpp computes with beyond these settings (qeval.engine.numerics): build, environment,
        layers offloaded."""
        gpu_layers = numerics.offloaded_layers(facts, self.n_gpu_layers, self.offloaded)
        return numerics.numerics_block(numerics.build_info(_llama_cpp()), gpu_layers)

    @property
    def decodes_ahead(self) -> bool:
        return self.offloaded if self.decode_ahead is None else self.decode_ahead

    def as_json(self) -> dict:
        out = {"type_k": self.type_k, "type_v": self.type_v, "flash_attn": self.flash_attn}
        if self.rope_scaling:
            out.update(rope_scaling=self.rope_scaling, rope_scale=self.rope_scale)
        if self.backend != LLAMA_CPP:  # another backend's logits are another producer's (qeval.identity)
            out["backend"] = self.backend
        if self.decode != PROMPT:  # left out by default: stores made before decode modes are prompt stores
            out["decode"] = self.decode
        return out

    # the fields that choose what is computed (qeval.identity.producer records them), as against how fast it runs,
    # with the command-line flag of each (the backend has none)
    DEFINING = {"type_k": "-ctk", "type_v": "-ctv", "flash_attn": "-fa", "n_batch": "-b", "n_ubatch": "-ub",
                "rope_scaling": "--rope-scaling", "rope_scale": "--rope-scale", "backend": None,
                "kv_rotation": "--kv-rotation", "decode": "--decode"}

    def of_producer(self, producer: dict) -> "EngineSettings":
        """These settings, but for the fields that choose what is computed, which are those a store or result
        recorded (qeval.identity.producer: its KV block and batch sizes): how to compute that candidate again.
        Threads, layers offloaded and decode-ahead stay these settings' own (whether the offload still gives the
        recorded numerics is for the caller to compare)."""
        kv = producer.get("kv") or {}
        rotated = set((kv.get("rotation") or {}).values())
        rotation = "auto" if len(rotated) != 1 else "on" if rotated == {True} else "off"
        return replace(self, type_k=kv.get("type_k", "f16"), type_v=kv.get("type_v", "f16"),
                       flash_attn=kv.get("flash_attn", "auto"), n_batch=producer.get("n_batch"),
                       n_ubatch=producer.get("n_ubatch"), rope_scaling=kv.get("rope_scaling"),
                       rope_scale=kv.get("rope_scale"), backend=kv.get("backend", LLAMA_CPP), kv_rotation=rotation,
                       decode=kv.get("decode", PROMPT))

    def flags(self, names) -> str:
        """These settings' values of the fields `names`, as command-line flags ("-ctk q8_0 -fa on")."""
        return " ".join(f"{self.DEFINING[name]} {getattr(self, name)}" for name in names if self.DEFINING.get(name))

    def kv_block(self, rotation: dict[str, bool]) -> dict:
        """The KV cache as a store records it (its header's `kv`): as_json(), and for a quantized cache the rotation
        llama.cpp applied to each of K and V (what `auto` becomes is what counts, not the flag)."""
        return recorded_kv(self.as_json(), rotation)


def recorded_kv(kv: dict, rotation: dict[str, bool] | None) -> dict:
    """A KV block as a store records it: `kv` (EngineSettings.as_json()) with, for a quantized cache, `rotation`
    (None where it was not recorded: then nothing is added, and the block differs from any recorded one)."""
    out = dict(kv)
    if rotation is not None and (kv.get("type_k") not in UNQUANTIZED_KV or kv.get("type_v") not in UNQUANTIZED_KV):
        out["rotation"] = dict(rotation)
    return out


def planned_fields(facts: dict, settings: EngineSettings, n_ctx: int) -> dict:
    """What a store of the model with these facts, run with `settings` on windows of n_ctx tokens, would record of
    how it was computed (qeval.identity.planned_producer): its KV block, numerics and batch sizes, predicted by the
    rules the engine follows (the KV rotation by llama.cpp's rule; tests hold it equal to what llama.cpp reports)."""
    settings = settings.validate()
    rotation = numerics.rotation_rule(facts, settings.type_k, settings.type_v, settings.kv_rotation)
    n_batch, n_ubatch = settings.batch_sizes(n_ctx)
    return {"kv": settings.kv_block(rotation), "numerics": settings.numerics(facts), "n_batch": n_batch,
            "n_ubatch": n_ubatch}


def check_context(facts: dict, n_ctx: int, settings: EngineSettings) -> float | None:
    """Refuse a window longer than the model's trained context unless RoPE scaling is opted into;
    the scale factor used (None without scaling). Without --rope-scale the factor stretches the trained
    context to n_ctx, and never shrinks it: a task context (-c 512 per sequence) under settings that opted
    in for a long capture keeps the trained positions."""
    trained = facts.get("context_length")
    if settings.rope_scaling:
        return settings.rope_scale or (max(1.0, n_ctx / trained) if trained else 1.0)
    if isinstance(trained, int) and n_ctx > trained:
        raise QevalError(f"-c {n_ctx} is beyond {facts.get('file_name') or 'the model'}'s trained context of "
                         f"{trained} tokens: use -c {trained} or less, or opt into RoPE scaling as llama.cpp does "
                         f"(--rope-scaling yarn|linear [--rope-scale {n_ctx / trained:g}])")
    return None


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


@dataclass(frozen=True)
class ContextShape:
    """The llama.cpp context a caller decodes in: n_seq sequences of up to n_ctx_seq tokens each."""

    n_ctx_seq: int  # tokens per sequence (a window, a task's -c): what the trained context limits
    n_seq: int  # sequences (n_seq_max); the KV cache holds n_seq x n_ctx_seq cells
    n_batch: int
    n_ubatch: int
    kv_unified: bool  # one KV cache all sequences share (llama-perplexity's task batches)
    described: str  # the context and settings as the message naming a context llama.cpp cannot create says them


class LlamaModel:
    """A GGUF model on llama-cpp-python and, given a ContextShape, one context with a batch of shape.n_batch
    tokens: the one place qeval sets llama.cpp up (Engine decodes windows in it, TaskModel task batches; the Ray
    planner only tokenizes, with the vocabulary alone). Before a context is made, the model file is checked,
    refused when qeval cannot evaluate it (qeval.engine.modelinfo), its context checked against the trained
    one, and this llama.cpp build probed in a child (qeval.engine.probe)."""

    def __init__(self, model_path: str | os.PathLike, settings: EngineSettings = EngineSettings(),
                 shape: ContextShape | None = None, weights: bool | None = None):
        """weights: load the model's weights (default: when a context is asked for; without them only the
        vocabulary is there); a context is opened later with open_context."""
        self.settings = settings.validate()
        self.model_path = check_model_file(model_path)
        self.model = self.ctx = self._batch = None
        self._fingerprint: str | None = None
        self.load_log: list[str] = []  # llama.cpp's log while it loaded the model (its buffers: qeval.engine.memory)
        self.context_log: list[str] = []  # and while it created the last context
        weights = shape is not None if weights is None else weights
        if weights:
            self.facts = model_facts(self.model_path)  # refuses what qeval cannot evaluate before a child loads it
            if shape is not None:
                check_context(self.facts, shape.n_ctx_seq, self.settings)
            ensure_llama_runs(self.model_path)
        fixed_mmap_threshold()
        quiet_llama()
        self._lc = _llama_cpp()
        self.model = self._load_model(vocab_only=not weights)
        self.vocab = self._lc.llama_model_get_vocab(self.model)
        self.n_vocab = self._lc.llama_vocab_n_tokens(self.vocab)
        self.n_embd = self._lc.llama_model_n_embd(self.model)
        self.add_bos = bool(self._lc.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(self._lc.llama_vocab_bos(self.vocab))
        self.eos = int(self._lc.llama_vocab_eos(self.vocab))
        if shape is not None:
            try:
                self.open_context(shape)
            except QevalError:
                self.close()
                raise

    def _model_params(self):
        """llama_model_params for these settings (a subclass adds what it needs)."""
        mparams = self._lc.llama_model_default_params()
        mparams.n_gpu_layers = self.settings.n_gpu_layers
        return mparams

    def _load_model(self, vocab_only: bool):
        lc, mparams = self._lc, self._model_params()
        mparams.vocab_only = vocab_only
        with recorded_log() as log:
            model = lc.llama_model_load_from_file(str(self.model_path).encode(), mparams)
        self.load_log = log
        if not model:
            why = _logged_errors(log)
            raise QevalError(f"llama.cpp could not load the vocabulary of {self.model_path}" if vocab_only else
                             f"llama.cpp could not load {self.model_path} "
                             f"({why or 'corrupt or unsupported GGUF'})")
        return model

    def open_context(self, shape: ContextShape) -> None:
        """Create a context of this shape (and its batch), freeing the one before. QevalError when llama.cpp cannot
        (the message names the shape, and the bytes llama.cpp asked for where it says): the model stays loaded."""
        self.free_context()
        self.context_shape = shape  # output_hidden reopens it as it was
        self.rope_scale = check_context(self.facts, shape.n_ctx_seq, self.settings)
        lc, s = self._lc, self.settings
        rule = numerics.rotation_rule(self.facts, s.type_k, s.type_v, s.kv_rotation)  # `on` it cannot do: refused
        with numerics.rotation_env(s.kv_rotation), recorded_log() as log:
            self.ctx = lc.llama_init_from_model(self.model, self._context_params(shape))
        self.context_log = log
        # what llama.cpp says it did; its rule where it says nothing (no attention cache: nothing to rotate)
        self.kv_rotation = numerics.reported_rotation("".join(log)) or rule
        self.numerics = s.numerics(self.facts)
        if not self.ctx:
            asked, what = failed_allocation(log)
            cause = (f"llama.cpp asked for {asked / 2**20:,.2f} MiB ({asked:,} bytes)"
                     f"{f' ({what})' if what else ''} and could not allocate it" if asked is not None else
                     _logged_errors(log) or "out of memory, or a setting this build does not support")
            raise ContextFailed(f"llama.cpp could not create a context for {self.model_path.name} {shape.described}: "
                                f"{cause}", asked, what)
        try:  # an encoder decodes without complaint, returning meaningless logits
            require_decoder_context(lc, self.model, self.ctx, self.model_path)
            # what llama.cpp allocated and ran, as it says: anything but what was asked for is refused
            self.allocated = verified_cache(allocated_cache(log), s.type_k, s.type_v, s.flash_attn,
                                            bool(self.facts.get("kv_cache")), self.model_path.name,
                                            numerics.reported_rotation("".join(log)), s.kv_rotation)
        except QevalError:
            self.free_context()
            raise
        self._batch = lc.llama_batch_init(shape.n_batch, 0, shape.n_seq)

    def free_context(self) -> None:
        """Free the batch and the context (the model stays); safe to repeat."""
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            self._lc.llama_free(self.ctx)
            self.ctx = None

    def _context_params(self, shape: ContextShape):
        s, cparams = self.settings, self._lc.llama_context_default_params()
        cparams.n_ctx = shape.n_seq * shape.n_ctx_seq
        cparams.n_batch = shape.n_batch
        cparams.n_ubatch = shape.n_ubatch
        cparams.n_seq_max = shape.n_seq
        cparams.kv_unified = shape.kv_unified
        cparams.type_k = cache_type(s.type_k).id  # the loaded build's ids: a fork numbers its types its own way
        cparams.type_v = cache_type(s.type_v).id
        cparams.flash_attn_type = FLASH_ATTN[s.flash_attn]
        # llama.cpp's tools (common_params) keep a sliding-window layer's cache at n_swa + n_ubatch cells;
        # llama_context_default_params() would hold all n_ctx. Beyond n_swa + n_ubatch tokens (Gemma-3 at 4K)
        # the two lay out the cache differently and round differently: llama-perplexity's way, for parity.
        cparams.swa_full = False
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        tap = getattr(self, "_tap", None)
        if tap is not None:  # the head's input read in the graph (qeval.engine.hidden_tap)
            cparams.cb_eval = tap.callback
        elif getattr(self, "hidden", False):
            cparams.pooling_type = self._lc.LLAMA_POOLING_TYPE_NONE
        if s.rope_scaling:
            cparams.rope_scaling_type = ROPE_SCALING[s.rope_scaling]
            cparams.rope_freq_scale = 1.0 / self.rope_scale
        return cparams

    @property
    def n_threads(self) -> int:
        return self.settings.n_threads or available_cores()

    # -- vocab -----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """common_tokenize(ctx, text, add_special, parse_special). Plain text (the default): BOS at the start
        only, special-token text as text; a rendered chat parses its special tokens (<start_of_turn>, ...)."""
        lc, data = self._lc, text.encode("utf-8")
        cap = len(data) + 16
        for _ in range(2):  # a negative result is the size the tokens need: retry once with it
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n >= 0:
                return np.ctypeslib.as_array(buf)[:n].astype(np.int32)
            cap = -n
        raise QevalError("tokenization failed")

    def token_text(self, token: int) -> str:
        """A token's piece as the vocabulary spells it (special tokens too: "<bos>")."""
        return (self._lc.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        """The GGUF's tokenizer.chat_template, None when it carries none."""
        text = self._lc.llama_model_chat_template(self.model, None)
        return text.decode("utf-8", errors="replace") if text else None

    def tokenizer_fingerprint(self) -> str:
        """sha256 over every token piece and the BOS setting: equal only for equal tokenizers."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"{self.n_vocab}:{int(self.add_bos)}:{self.bos}\n".encode())
            for i in range(self.n_vocab):
                h.update(self._lc.llama_vocab_get_text(self.vocab, i) or b"")
                h.update(b"\0")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def provenance(self) -> dict:
        """How it runs, for a store header's capture block (not part of what a store is): offload, the
        llama-cpp-python version, the CPU, and the build's own report of what it was compiled with
        (llama_print_system_info: the CPU backend's instruction sets, a GPU backend when there is one)."""
        info = self._lc.llama_print_system_info()
        return {"n_gpu_layers": self.settings.n_gpu_layers, "llama_cpp_python": self._lc.__version__,
                "cpu": cpu_model(), "llama_cpp_system_info": (info or b"").decode("utf-8", "replace").strip(" |"),
                "gpu_offload_supported": bool(self._lc.llama_supports_gpu_offload()),
                # the cache as llama.cpp allocated it and whether flash attention ran, verified (open_context)
                **({"kv_allocated": self.allocated} if getattr(self, "allocated", None) else {})}

    # -- decoding --------------------------------------------------------------------------------
    def clear_memory(self) -> None:
        """Forget every sequence: what is decoded next attends to nothing decoded before."""
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.ctx), True)

    def decode(self) -> None:
        """llama_decode of the batch as filled."""
        rc = self._lc.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise QevalError(f"llama_decode failed with code {rc} (out of memory or KV cache too small)")

    def output_logits(self, n_rows: int) -> np.ndarray:
        """float32 [n_rows, n_vocab]: the rows the last decode was asked for, in batch order. A view of
        llama.cpp's own buffer, valid until the next decode."""
        return np.ctypeslib.as_array(self._lc.llama_get_logits(self.ctx), shape=(n_rows, self.n_vocab))

    def close(self) -> None:
        """Free the batch, context and model, in that order; safe to repeat."""
        self.free_context()
        if self.model:
            self._lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def token_bytes(self, token: int) -> bytes:
        """A token's detokenized bytes (llama_token_to_piece, special tokens rendered): what it adds to the text,
        so the pieces of a tokenization join into the bytes that were tokenized."""
        lc, cap = self._lc, 32
        for _ in range(2):  # a negative result is the size the piece needs: retry once with it
            buf = ctypes.create_string_buffer(cap)
            n = lc.llama_token_to_piece(self.vocab, token, buf, cap, 0, True)
            if n >= 0:
                return buf.raw[:n]
            cap = -n
        raise QevalError(f"llama_token_to_piece failed for token {token}")


@dataclass(frozen=True)
class ScoredRows:
    """Logits of scored positions of one window, as produced by one decode call."""

    window: int  # index into the windows being decoded
    first_row: int  # its first scored row held here (row r is the window's r-th scored logit position)
    positions: np.ndarray  # the logit positions of these rows
    logits: np.ndarray  # float32 [rows, n_vocab]
    hidden: np.ndarray | None = None  # float32 [rows, n_embd]: the output head's input (Engine.output_hidden)


class Backend(Protocol):
    """What a capture or a live candidate needs of a loaded model (qeval.capture.capture), opened by name through
    qeval.engine.backends: Engine, on llama-cpp-python, is the default. The scored positions of each window are
    given with the windows (a store's header.positions_of), else `scoring`'s for every window."""

    settings: EngineSettings
    scoring: Scoring
    n_ctx: int
    n_vocab: int
    n_batch: int  # tokens per decode call, recorded in the store
    n_ubatch: int
    add_bos: bool  # the first token of a window is replaced by BOS, recorded in the store
    facts: dict  # the model's facts (qeval.engine.modelinfo), recorded in the store
    provenance: dict  # how it runs, recorded in the store's capture block
    kv_rotation: dict  # {"k": bool, "v": bool}: the rotation of each quantized cache (qeval.engine.numerics)
    numerics: dict  # build, environment, offload (EngineSettings.numerics), recorded in the store

    def tokenize(self, text: str) -> np.ndarray: ...

    def tokenizer_fingerprint(self) -> str: ...

    def iter_calls(self, windows: np.ndarray, scored: list[np.ndarray] | None = None) -> Iterator[list[ScoredRows]]:
        """Decode windows [n, n_ctx] in order: the scored rows of each decode call, valid until the next.
        scored: each window's scored logit positions (ascending); None: the scoring rule's in every window."""
        ...

    def close(self) -> None: ...


Span = tuple[int, int, int]  # (window, first position, stop position) submitted in one call


def scored_mask(positions: np.ndarray, n_ctx: int) -> np.ndarray:
    """llama_batch.logits of a window: 1 where logits are wanted."""
    mask = np.zeros(n_ctx, dtype=np.int8)
    mask[positions] = 1
    return mask


class Engine(LlamaModel):
    """One loaded model and context for windows of `n_ctx` tokens, decoded as `settings` says."""

    def __init__(self, model_path: str | os.PathLike, n_ctx: int, settings: EngineSettings = EngineSettings(),
                 scoring: Scoring = HALF):
        scoring.check(n_ctx)
        self.n_ctx = n_ctx
        self.scoring = scoring
        self.n_batch, self.n_ubatch = settings.validate().batch_sizes(n_ctx)
        self.generates = settings.decode == GENERATE
        # else each window in pieces of n_batch tokens (GENERATE: its prompt), one window at a time
        self.whole_windows = self.n_batch >= n_ctx and not self.generates
        self.windows_per_call = max(1, self.n_batch // n_ctx) if self.whole_windows else 1
        self._decoder: ThreadPoolExecutor | None = None  # the decode-ahead thread, once used
        self.hidden = False  # also return the output head's input of every scored row (output_hidden)
        self._tap: hidden_tap.HiddenTap | None = None  # how, in calls of one sequence
        # As llama-perplexity sets the context up: one sequence (and n_ctx KV cells) per window of a call.
        super().__init__(model_path, settings, ContextShape(
            n_ctx_seq=n_ctx, n_seq=self.windows_per_call, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
            kv_unified=False,
            described=f"with KV {settings.type_k}/{settings.type_v}, flash attention {settings.flash_attn} "
                      f"(n_ctx {n_ctx}, -b {self.n_batch}, -ub {self.n_ubatch})"))
        self._bind_batch()

    def _bind_batch(self) -> None:
        """Views of the context's batch (made again with the context)."""
        n = self.n_batch
        self._tokens_view = np.ctypeslib.as_array(self._batch.token, shape=(n,))
        self._pos_view = np.ctypeslib.as_array(self._batch.pos, shape=(n,))
        self._nseq_view = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n,))
        self._logits_view = np.ctypeslib.as_array(self._batch.logits, shape=(n,))
        self._seq_slots = [self._batch.seq_id[i] for i in range(n)]

    def max_scored_rows(self, scored: list[np.ndarray]) -> int:
        """Scored rows one llama_decode call returns at most."""
        most = max(map(len, scored))
        return self.windows_per_call * most if self.whole_windows else min(self.n_batch, most)

    # -- decoding --------------------------------------------------------------------------------
    def _calls(self, firsts: list[int], stops: list[int]) -> Iterator[list[Span]]:
        """The spans of each llama_decode call for windows decoded up to stops[k] (firsts[k]: its first scored
        position), in order: prompt batches, or under GENERATE the prompt before firsts[k] and then one token per
        call. The one schedule both share: only where the single tokens start differs."""
        w = self.windows_per_call
        if self.whole_windows:
            for g in range(0, len(stops), w):
                yield [(k, 0, stops[k]) for k in range(g, min(g + w, len(stops)))]
            return
        for k, stop in enumerate(stops):
            generated = firsts[k] if self.generates else stop
            for start in range(0, generated, self.n_batch):  # n_batch tokens at a time, as llama-perplexity
                yield [(k, start, min(start + self.n_batch, generated))]
            for position in range(generated, stop):  # as llama-server generates: a token per call
                yield [(k, position, position + 1)]

    def _decode_stop(self, positions: np.ndarray) -> int:
        """How far a window is decoded: whole for a rule that scores the same positions in every window (as
        llama-perplexity), else up to its last scored position: what follows it (a conversation's padding)
        cannot change an earlier logit, so it is not computed."""
        return int(positions[-1]) + 1 if self.scoring.per_window else self.n_ctx

    def _fill_batch(self, windows: np.ndarray, spans: list[Span], masks: list[np.ndarray]) -> None:
        """Span i becomes sequence i; logits are asked for scored positions only."""
        at = 0
        for seq, (k, start, stop) in enumerate(spans):
            n = stop - start
            self._tokens_view[at:at + n] = windows[k, start:stop]
            if start == 0 and self.add_bos:
                self._tokens_view[at] = self.bos
            self._pos_view[at:at + n] = np.arange(start, stop, dtype=np.int32)
            self._nseq_view[at:at + n] = 1
            self._logits_view[at:at + n] = masks[k][start:stop]
            for j in range(at, at + n):
                self._seq_slots[j][0] = seq
            at += n
        self._batch.n_tokens = at

    def _decode(self, windows: np.ndarray, spans: list[Span], scored: list[np.ndarray],
                masks: list[np.ndarray]) -> list[ScoredRows]:
        if spans[0][1] == 0:  # new windows: nothing of the previous ones may be attended to
            self.clear_memory()
        self._fill_batch(windows, spans, masks)
        if self._tap is not None:
            self._tap.start()
        elif self.hidden:  # an embeddings call outputs every token: only where some are scored
            self._lc.llama_set_embeddings(self.ctx, bool(self._logits_view[:self._batch.n_tokens].any()))
        self.decode()
        # the rows [lo, hi) of each window's scored positions among its positions [start, stop)
        parts = [(k, *np.searchsorted(scored[k], (start, stop))) for k, start, stop in spans]
        total = int(sum(hi - lo for _, lo, hi in parts))
        if not total:
            return []
        # one row per requested position, in batch order (llama.cpp restores it after splitting ubatches)
        logits, hidden = self._output_rows(spans, scored, parts, total)
        out, at = [], 0
        for k, lo, hi in parts:
            if hi > lo:
                out.append(ScoredRows(window=k, first_row=int(lo), positions=scored[k][lo:hi],
                                      logits=logits[at:at + hi - lo],
                                      hidden=None if hidden is None else hidden[at:at + hi - lo]))
                at += hi - lo
        return out

    def output_hidden(self, in_graph: bool = True) -> None:
        """From now on also return each scored row's hidden state: llama.cpp's `result_norm`, the output head's
        input, from the same decode as its logits. The context is made again, either way:

        - calls of one window (n_ctx >= n_batch, or -b as large as n_ctx): read in the graph as llama.cpp computes
          it for the scored rows alone (qeval.engine.hidden_tap);
        - calls of several windows, whose ubatches interleave them, or `in_graph` False (what the tap saves is
          measured against it: bench/bench_hidden_tap.py): an embeddings context with pooling none, its embeddings
          switched on only for calls with scored rows, since llama.cpp then outputs every token of the call (the
          rows are picked out here)."""
        if not self.hidden:
            self.hidden = True
            if in_graph and self.windows_per_call == 1 and hidden_tap.available():
                self._tap = hidden_tap.HiddenTap(self.n_embd, self.n_batch, self._lc.ggml_backend_sched_eval_callback)
            self.open_context(self.context_shape)
            self._bind_batch()

    @property
    def hidden_source(self) -> str | None:
        """Where hidden rows come from (output_hidden): "graph", "embeddings", or None when none are returned."""
        return None if not self.hidden else "graph" if self._tap is not None else "embeddings"

    def _output_rows(self, spans: list[Span], scored: list[np.ndarray], parts, total: int
                     ) -> tuple[np.ndarray, np.ndarray | None]:
        """(logits, hidden or None) of the scored rows of the last decode, in batch order."""
        if not self.hidden:
            return self.output_logits(total), None
        if self._tap is not None:
            return self.output_logits(total), self._tap.rows(total)
        picked, at = [], 0
        for (k, start, stop), (_, lo, hi) in zip(spans, parts):
            picked.append(at + scored[k][lo:hi] - start)
            at += stop - start
        rows = np.concatenate(picked)  # ascending
        if rows[-1] - rows[0] + 1 == len(rows):  # one run (a window's half, a call's one span): views, as without
            rows = slice(rows[0], rows[-1] + 1)  # hidden rows, not a 1 MB copy of every row at a 262K vocabulary
        embd = np.ctypeslib.as_array(self._lc.llama_get_embeddings(self.ctx), shape=(at, self.n_embd))
        return self.output_logits(at)[rows], embd[rows]

    def iter_calls(self, windows: np.ndarray, scored: list[np.ndarray] | None = None) -> Iterator[list[ScoredRows]]:
        """Decode windows [n, n_ctx] in order; yield the scored rows of every call that has some.
        scored: each window's scored logit positions (ascending); None: the scoring rule's in every window.

        The rows are views of llama.cpp's output buffer, valid until the next iteration (its next
        decode overwrites them), or, with decode-ahead, of one copy of it.
        """
        windows = np.asarray(windows, dtype=np.int32)
        if windows.ndim != 2 or windows.shape[1] != self.n_ctx:
            raise ValueError(f"expected windows of {self.n_ctx} tokens")
        n = len(windows)
        scored = list(scored) if scored is not None else [self.scoring.positions(self.n_ctx)] * n
        if len(scored) != n or not all(len(p) for p in scored):
            raise ValueError("every window needs its scored positions, at least one")
        if self.whole_windows:
            # The last call is filled up with copies of the last window, their rows dropped: every
            # window is then decoded in the same ubatch shapes, so its logits do not depend on the
            # chunk count or a resume point (CPU flash attention and GPU kernels depend on shapes).
            fill = -n % self.windows_per_call
            windows = np.concatenate([windows, np.repeat(windows[-1:], fill, axis=0)])
            scored = scored + scored[-1:] * fill
        # one mask per distinct positions array: a fixed rule's windows share theirs (n_ctx bytes each otherwise)
        by_array = {id(p): p for p in scored}
        mask_of = {key: scored_mask(p, self.n_ctx) for key, p in by_array.items()}
        masks = [mask_of[id(p)] for p in scored]
        stops = [self._decode_stop(p) for p in scored]
        calls = (rows for spans in self._calls([int(p[0]) for p in scored], stops)
                 if (rows := [r for r in self._decode(windows, spans, scored, masks) if r.window < n]))
        if not self.settings.decodes_ahead:
            return calls
        if self._decoder is None:
            self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qeval-decode")
        return decode_ahead(calls, self._decoder, self.max_scored_rows(scored), self.n_vocab)

    def iter_scored_logits(self, window: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """One window: (first scored row, float32 [rows, n_vocab]) per call, valid until the next."""
        for call in self.iter_calls(np.asarray(window)[None]):
            for rows in call:
                yield rows.first_row, rows.logits

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)  # no decode may run on a freed context
            self._decoder = None
        super().close()


def decode_ahead(calls: Iterator[list[ScoredRows]], decoder: ThreadPoolExecutor, max_rows: int,
                 n_vocab: int) -> Iterator[list[ScoredRows]]:
    """`calls`, each copied out of llama.cpp's buffers, the next one decoding while the caller works.

    llama_decode releases the GIL (ctypes), so the next call runs on `decoder` while the caller
    encodes the copy: an accelerator need not wait for the CPU. One copy buffer (logits, and hidden rows
    where a call has them: the next decode overwrites those too), so a yielded call is valid until the next
    iteration, as without decode-ahead.
    """
    buffers: dict[str, np.ndarray] = {}
    pending = decoder.submit(next, calls, None)
    try:
        while (call := pending.result()) is not None:
            copied = _copy_rows(call, buffers, max_rows, n_vocab)
            pending = decoder.submit(next, calls, None)
            yield copied
    finally:
        wait([pending])  # a generator cannot be closed while it runs in another thread
        calls.close()


def _copy_rows(call: list[ScoredRows], buffers: dict[str, np.ndarray], max_rows: int,
               n_vocab: int) -> list[ScoredRows]:
    """The rows of `call` copied into `buffers` (made at their first use, [max_rows, width] each)."""
    def copied(name: str, rows: np.ndarray, at: int) -> np.ndarray:
        if name not in buffers:
            buffers[name] = np.empty((max_rows, n_vocab if name == "logits" else rows.shape[1]), dtype=np.float32)
        np.copyto(buffers[name][at:at + len(rows)], rows)
        return buffers[name][at:at + len(rows)]

    out, at = [], 0
    for rows in call:
        out.append(replace(rows, logits=copied("logits", rows.logits, at),
                           hidden=None if rows.hidden is None else copied("hidden", rows.hidden, at)))
        at += len(rows.logits)
    return out
