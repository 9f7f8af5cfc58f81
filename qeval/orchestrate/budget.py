"""What a long run will write and roughly how long it will take, said before it starts; refused, in one message,
when the disk it writes to has not the room.

`capture`, `kld` with a live candidate, `matrix` and `demo` describe their work as Runs (one model over the
reference's windows each) and call `check`. The estimate is a simple model with the constants below, measured on
one named machine; it is meant to tell minutes from hours and megabytes from a full disk, not to predict to the
minute. Bytes are the store format's; time is the forward pass (proportional to the GGUF's size: a dense model's
weights are all read per token; a mixture of experts runs only its active experts, so its estimate is an upper
bound) plus a cost per scored row (proportional to the vocabulary).
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from qeval.capture.capture import CaptureStart
from qeval.engine.engine import GENERATE, EngineSettings, available_cores
from qeval.errors import QevalError
from qeval.present.progress import say
from qeval.storage.codec import REPLAY_BANDS, REPLAY_ENGINES
from qeval.storage.error_record import DEFAULT_BANDS, record_bytes
from qeval.storage.hidden_form import ACTIVATIONS, AUTO, HIDDEN
from qeval.storage.store import StoreHeader

# --- bytes: the store format (docs/store-format.md) ------------------------------------------------------------
# A store keeps each scored token's logits as 16-bit codes, zstd-compressed, beside two float64 log-probs and its
# ten top ids (56 bytes): 132,203 bytes per scored token at Gemma-3's 262,144-entry vocabulary (2-core Intel Xeon
# table of docs/benchmarks.md; an earlier build's 138,386), so about half a byte per vocabulary entry; and once per
# store its token windows (int32) and the code's 65,536-entry float32 table. The demo's 9 stores of 20,400 tokens
# measured 21.7 GB (118 KB per token): these figures are an upper bound by ~12 % there.
STORE_ROW_BYTES = 8 + 8 + 10 * 4
STORE_BYTES_PER_VOCAB_ENTRY = (132_203 - STORE_ROW_BYTES) / 262_144
# Since format version 4 each scored token also has its error record (qeval.storage.error_record: KL and the
# stored row's log-normaliser, float64, and a float32 min and max per band: 272 bytes at the default 32 bands),
# plus an ERRS record's frame and head (40 bytes) per chunk piece of at most 256 rows, counted here per row.
ERROR_ROW_BYTES = record_bytes(1, DEFAULT_BANDS) - record_bytes(0, DEFAULT_BANDS) + 1
STORE_TABLE_BYTES = 65_536 * 4
# The hidden form (format versions 5 and 6, qeval.storage.hidden_form) keeps per scored token its scalars, ids and error
# record as above and the output head's input instead of the codes: zstd takes q8_0 rows (680 bytes at Gemma-3's
# d_model 640) to ~0.92 of their size (docs/why-logits.md), fp16 rows hardly at all; plus the head, once per store.
# Auto (the default) is counted as the hidden form: it keeps the logits only of a piece whose replay misses, which
# nothing foresees. Since format 6 a hidden row also
# has a replay record of one band per replay engine (24 bytes each), and each piece their 72 bytes of framing.
HIDDEN_ZSTD_RATIO = 0.95
REPLAY_ROW_BYTES = len(REPLAY_ENGINES) * (record_bytes(1, REPLAY_BANDS.count) - record_bytes(0, REPLAY_BANDS.count)) + 1
# A saved result's per-token columns (.npz): 12 float64 columns (kld, nll, p, top-k agreement ...) and 4 per
# sampler, counted uncompressed (npz files measured 52-94 bytes per token), plus its JSON summary.
RESULT_COLUMNS, SAMPLER_COLUMNS, RESULT_JSON_BYTES = 12, 4, 64_000

# --- time: 2-core Intel Xeon, AVX-512, no AMX (family 6 model 207), Gemma-3-270M, n_ctx 512 -------------------
# bench/results/vs_llamacpp-intel-avx512.json and kld-intel-avx512.json, docs/benchmarks.md:
# llama.cpp's forward pass alone: 13.8 s per 8 windows of 512 tokens with the 0.237 GB Q2_K, i.e. 14.2 ms per
# token per GB of GGUF;
FORWARD_S_PER_TOKEN_GB = 13.8 / (8 * 512) / 0.237
# a reference capture, 16 windows (8,192 tokens, 4,080 scored) of the 0.292 GB Q8_0: 38.5 s, i.e. 1.1 ms per scored
# row to code and compress it beyond the forward pass;
CODE_S_PER_ROW = (38.5 - 8192 * FORWARD_S_PER_TOKEN_GB * 0.292) / 4080
# a live candidate (not coded), the same windows with the Q2_K: 35.2 s, i.e. 1.9 ms per row to compare it.
COMPARE_S_PER_ROW = (35.2 - 8192 * FORWARD_S_PER_TOKEN_GB * 0.237) / 4080
# a capture in the hidden form (or auto) replayed the head per scored row in qeval's portable kernel and measured it
# (since format 7 only where ggml does not give llama.cpp's logits again, else `qeval certify` does when the store
# travels: an upper bound on a capture that stays lean): bench/bench_hidden_form.py sizes, 4 and 8 windows of the same Q8_0 on the same Intel Xeon, quiet
# (bench/results/hidden-form-sizes-{4,8}chunks-auto-intel.json): the 4 windows more took 33.9 s in auto against
# 6.5 s in the logits form, i.e. 26.9 ms more per scored row of 262,144 x 640 head entries.
REPLAY_S_PER_HEAD_ENTRY = (33.9 - 6.5) / 1020 / (262_144 * 640)
MEASURED_THREADS, MEASURED_VOCAB = 2, 262_144
MEASURED_ON = "2-core Intel Xeon (AVX-512)"
# --decode generate (one token per call) runs other kernels, 2-4x slower on CPU (the option's own help): the low end.
GENERATE_SLOWDOWN = 2.0


@dataclass(frozen=True)
class Run:
    """One model over the reference's windows: a capture (`live` False) or a live candidate."""

    label: str
    model_bytes: int  # the GGUF's size (every shard of a split model)
    tokens: int  # tokens decoded: windows x n_ctx
    rows: int  # scored rows
    n_vocab: int
    live: bool  # compared against the reference as it runs (else a capture)
    keeps_store: bool  # its rows are coded and written to a store
    keeps_result: bool = False  # its result (JSON + per-token npz) is saved
    samplers: int = 0
    settings: EngineSettings = EngineSettings()
    head: dict | None = None  # a store that may hold the hidden form: its header's `head` (its form and its bytes)

    @property
    def bytes(self) -> int:
        store = STORE_TABLE_BYTES + 4 * self.tokens + self.rows * (
            STORE_ROW_BYTES + ERROR_ROW_BYTES + self.row_form_bytes) + self.head_bytes if self.keeps_store else 0
        result = RESULT_JSON_BYTES + self.rows * 8 * (RESULT_COLUMNS + SAMPLER_COLUMNS * self.samplers) \
            if self.keeps_result else 0
        return math.ceil(store + result)

    @property
    def replay_s_per_row(self) -> float:
        """A hidden (or auto) capture's replay of the head, per scored row (REPLAY_S_PER_HEAD_ENTRY)."""
        if not self.keeps_store or self.head is None or self.head["form"] not in (HIDDEN, AUTO):
            return 0.0
        return REPLAY_S_PER_HEAD_ENTRY * self.n_vocab * self.head["n_embd"]

    @property
    def head_bytes(self) -> int:
        """The output head a hidden store embeds: once, whatever its number of rows."""
        return (self.head or {}).get("bytes", 0) if self.keeps_store else 0

    @property
    def row_form_bytes(self) -> float:
        """What a scored row's form costs beyond its scalars and error record: its codes, or its hidden row (auto's
        too: it keeps a piece's codes only where the replay misses, which a disk check cannot foresee; a capture
        that then fills the disk stops resumable, qeval.storage.store.WriteFailed)."""
        if self.head is not None and self.head["form"] in (HIDDEN, AUTO):
            return ACTIVATIONS[self.head["type"]].row_bytes(self.head["n_embd"]) * HIDDEN_ZSTD_RATIO + REPLAY_ROW_BYTES
        return self.n_vocab * STORE_BYTES_PER_VOCAB_ENTRY

    @property
    def seconds(self) -> float | None:
        """Rough wall time on this machine's threads; None with layers offloaded to a GPU (no GPU rate measured)."""
        if self.settings.n_gpu_layers:
            return None
        forward = self.tokens * FORWARD_S_PER_TOKEN_GB * self.model_bytes / 1e9
        if self.settings.decode == GENERATE:
            forward *= GENERATE_SLOWDOWN
        per_row = (COMPARE_S_PER_ROW if self.live else 0.0) + (CODE_S_PER_ROW if self.keeps_store else 0.0)
        rows = self.rows * (per_row * self.n_vocab / MEASURED_VOCAB + self.replay_s_per_row)
        threads = self.settings.n_threads or available_cores()
        return (forward + rows) * MEASURED_THREADS / threads


def model_bytes(path: str | os.PathLike) -> int:
    """A GGUF's size on disk, every shard of a split set (`…-00001-of-00003.gguf`) counted."""
    path = Path(path)
    split = re.match(r"^(.*-)\d{5}(-of-\d{5}\.gguf)$", path.name)
    shards = sorted(path.parent.glob(f"{glob.escape(split[1])}[0-9]*{split[2]}")) if split else [path]
    return sum(p.stat().st_size for p in shards if p.is_file())


def free_bytes(directory: Path) -> int:
    """Free space of the filesystem `directory` is (or will be created) on."""
    probe = Path(directory).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def size_text(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


def time_text(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{max(seconds, 1):.0f} s"


@dataclass(frozen=True, kw_only=True)
class Budget:
    """The runs of one command, what they write and where; `chunks`: the windows they go through, which the
    refusal scales to say how many would fit."""

    what: str  # "capture Q8_0", "matrix: reference + 8 pairs", ...
    runs: tuple[Run, ...]
    directory: Path
    chunks: int
    # a board decided early (`--early`): every live run goes through at least this many of the chunks, at most all
    # of them; the bytes stay the most it can write (the disk check), the time is said as the range
    early_min_chunks: int | None = None

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.runs)

    @property
    def seconds(self) -> float | None:
        return self._seconds(1.0)

    @property
    def least_seconds(self) -> float | None:
        """Decided early: the time when every live run stops at its minimum (a capture still runs every chunk)."""
        return self._seconds(min(self.early_min_chunks, self.chunks) / max(self.chunks, 1))

    def _seconds(self, live_share: float) -> float | None:
        times = [r.seconds for r in self.runs]
        if any(t is None for t in times):
            return None
        return sum(t * (live_share if r.live else 1.0) for r, t in zip(self.runs, times))

    def text(self, free: int) -> str:
        """One line: what it writes where, the free space there, and roughly how long it takes (decided early: from
        every pair at its minimum to every pair over every chunk)."""
        stores = sum(r.keeps_store for r in self.runs)
        rows = max((r.rows for r in self.runs), default=0)
        early = self.early_min_chunks is not None
        writes = (f"writes {'up to ' if early else ''}~{size_text(self.bytes)} to {self.directory}"
                  if self.bytes else "writes nothing") + \
            (f" ({stores} store{'s' if stores != 1 else ''} of {rows:,} scored tokens)" if stores else "") + \
            f"; {size_text(free)} free there"
        seconds = self.seconds
        roughly = f"roughly {time_text(seconds)}" if seconds is not None else ""
        if early:
            live = sum(r.live for r in self.runs)
            least = min(self.early_min_chunks, self.chunks)
            writes += (f"; decided early: each pair {least:,} to {self.chunks:,} chunks ({live * least:,} to "
                       f"{live * self.chunks:,} pair-chunks)")
            if seconds is not None:
                roughly = f"roughly {time_text(self.least_seconds)} (every pair at its minimum) to {time_text(seconds)}"
        takes = (f"{roughly} on {self.runs[0].settings.n_threads or available_cores()} CPU "
                 f"threads (rates measured on a {MEASURED_ON}; a mixture of experts takes less)") \
            if seconds is not None else "time not estimated with layers on a GPU (rates measured on CPU only)"
        return f"qeval: {self.what}: {self.chunks:,} chunks, {writes}; {takes}"

    def check(self, announce: bool = True, less: str = "--chunks", elsewhere: str = "--runs-dir") -> None:
        """Say what the run will do (on stderr, when `announce`), then refuse it when the disk lacks the room:
        one message with the bytes needed, the bytes free, `less` (the flag that writes less: with --chunks, how
        many chunks fit) and `elsewhere` (the flag that writes to another disk)."""
        free = free_bytes(self.directory)
        say(self.text(free), announce)
        once = sum(r.head_bytes for r in self.runs)  # written whatever the chunk count
        per_chunk = (self.bytes - once) / max(self.chunks, 1)
        fits = min(self.chunks, int((free - once) / per_chunk)) if per_chunk and free > once else \
            0 if per_chunk else self.chunks
        plus = f" plus ~{size_text(once)} once (the hidden form's output head)" if once else ""
        hint = less if less != "--chunks" else f"--chunks {fits} writes ~{size_text(once + per_chunk * fits)}" \
            if fits else f"--chunks N writes ~{size_text(per_chunk)} per chunk{plus}"
        require_space(self.directory, self.bytes, self.what, hint, elsewhere, free)


def require_space(directory: Path, needed: int, what: str, hint: str, elsewhere: str, free: int | None = None) -> None:
    """Refuse `what`, in one message, when `needed` bytes do not fit in the free space of `directory`'s disk."""
    free = free_bytes(directory) if free is None else free
    if needed > free:
        raise QevalError(f"not enough disk space in {directory}: {what} needs ~{size_text(needed)} ({needed:,} "
                         f"bytes), {size_text(free)} ({free:,} bytes) are free. Write less: {hint}; or point "
                         f"{elsewhere} at a larger disk")


# --- the runs of each long command --------------------------------------------------------------------------------
def capture_run(start: CaptureStart) -> Run:
    """A capture about to start (qeval.capture.capture's on_start): the chunks it still has to write."""
    return Run(label=start.header.label, model_bytes=model_bytes(start.model),
               tokens=len(start.todo) * start.header.n_ctx, rows=start.rows,
               n_vocab=start.header.n_vocab, live=False, keeps_store=True, settings=start.settings,
               head=start.header.head or None)


def check_capture(start: CaptureStart, announce: bool) -> None:
    """`qeval capture`'s budget, checked before its first window is decoded."""
    Budget(what=f"capture {start.header.label}", runs=(capture_run(start),), directory=start.path.parent,
           chunks=len(start.todo)).check(
        announce, elsewhere="--out or --runs-dir")


def live_runs(header: StoreHeader, n_chunks: int, candidates, keeps_stores: bool, keeps_results: bool,
              samplers: int = 0) -> tuple[Run, ...]:
    """Candidates run live over the first n_chunks windows of a reference with `header`; candidates: (label, GGUF
    path, EngineSettings) each. keeps_stores: their rows are coded into stores (`kld --save`; a matrix keeps them
    today); keeps_results: their results are saved."""
    rows = sum(header.n_scored_of(c) for c in range(n_chunks))
    return tuple(Run(label=label, model_bytes=model_bytes(model), tokens=n_chunks * header.n_ctx, rows=rows,
                     n_vocab=header.n_vocab, live=True,
                     keeps_store=keeps_stores, keeps_result=keeps_results, samplers=samplers, settings=settings)
                 for label, model, settings in candidates)


def check_live(header: StoreHeader, n_chunks: int, label: str, model: str, settings: EngineSettings, save: bool,
               save_result: bool, samplers: int, directory: Path, announce: bool) -> None:
    """`qeval kld` with a live candidate, checked before its model is loaded: it writes a store only with --save."""
    runs = live_runs(header, n_chunks, [(label, model, settings)], save, save_result, samplers)
    Budget(what=f"kld {label} live against {header.label}", runs=runs, directory=directory, chunks=n_chunks).check(
        announce, less="--chunks" if save else "leave out --save-result, or use --chunks")


def matrix_budget(what: str, directory: Path, header: StoreHeader, n_chunks: int, candidates,
                  reference: CaptureStart | None = None, samplers: int = 0,
                  keeps_candidate_stores: bool = True, early_min_chunks: int | None = None) -> Budget:
    """A matrix's runs from the reference's `header`: the reference capture still to do (`reference`, None when its
    store is complete) and every candidate (label, GGUF, settings) it runs live over n_chunks windows, each
    saving its result and, when `keeps_candidate_stores`, its store (what a matrix does today). early_min_chunks:
    a board decided early, whose pairs each run between that many chunks and all of them."""
    runs = (capture_run(reference),) if reference is not None else ()
    runs += live_runs(header, n_chunks, candidates, keeps_candidate_stores, True, samplers)
    return Budget(what=what, runs=runs, directory=directory, chunks=n_chunks, early_min_chunks=early_min_chunks)
