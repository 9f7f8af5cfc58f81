"""Capture: run a GGUF model over corpus windows and stream its scored logits into a store.

A capture is a pure function of its CaptureSpec (serialisable, so it can run anywhere); the
store it writes is resumable, so an interrupted capture continues from its last complete chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import zstandard

from qeval import __version__
from qeval.engine.backends import open_backend
from qeval.engine.engine import LLAMA_CPP, Backend, EngineSettings, ScoredRows, available_cores
from qeval.errors import MismatchError, QevalError
from qeval.inputs.chat import parse_template_kwargs
from qeval.inputs.conversation_windows import conversation_windows, is_conversation_corpus
from qeval.inputs.corpus import load_corpus, make_windows, tokenize_documents
from qeval.pool import bounded_map
from qeval.storage.codec import BadLogits, EncodedBlock, SqrtLogCode, encode_hidden_block
from qeval.storage.error_record import ErrorRecord, rows_of
from qeval.storage.ggml_replay import GgmlHead
from qeval.storage.hidden_form import (
    AUTO,
    AUTO_REPLAY_KL,
    DEFAULT_FORM,
    FORMS,
    HIDDEN,
    LOGITS,
    NotReplayable,
    OutputHead,
    head_entry,
    read_head,
)
from qeval.storage.runs import LIVE_SUFFIX
from qeval.storage.scoring import ASSISTANT, Scoring, WindowLabels
from qeval.storage.store import (
    LEAN_VERSION,
    PIECE_ROWS,
    ChunkBuilder,
    ChunkData,
    StoreComplete,
    StoreHeader,
    StoreReader,
    StoreWriter,
    has_data,
    reblock,
    tokens_sha256,
    zstd_compressor,
)

ENCODE_BLOCK = 16


@dataclass(frozen=True)
class StoredForm:
    """What a capture stores of each piece (--reference-form): the logits code, the hidden form (the output head's
    input, replayed through `head` by a reader), or auto: a piece keeps the hidden form when every token's replay
    is within AUTO_REPLAY_KL of llama.cpp's logits, else the code. Auto codes the logits of a piece only once one of
    its blocks misses (PieceBuilder), so where the replay holds it costs what the hidden form costs. `asked`: the
    form asked for; `why_logits`: why a capture asked for auto stores logits only (a head it cannot replay)."""

    name: str = LOGITS
    head: OutputHead | None = None
    asked: str = LOGITS
    why_logits: str = ""
    ggml: GgmlHead | None = None  # the head in llama.cpp's own kernel, replaying beside the portable replay
    lean: bool = True  # no portable replay where ggml reproduces (encode_hidden_block)

    def encode(self, logits: np.ndarray, hidden: np.ndarray | None, targets: np.ndarray, code: SqrtLogCode,
               first_row: int = 0) -> EncodedBlock | dict[str, EncodedBlock | ExactRows]:
        """A logits form's block, else the hidden block by name and, for auto, the exact rows it may still need to
        code (`first_row`: the block's first row in the chunk)."""
        if self.name == LOGITS:
            return code.encode_block(logits, targets)
        blocks = {HIDDEN: encode_hidden_block(logits, hidden, targets, code, self.head, self.ggml, first_row,
                                              self.lean)}
        if self.name == AUTO:  # a copy: the engine's rows are overwritten by its next call, before the piece ends
            blocks[EXACT] = ExactRows(np.array(logits, dtype=np.float32), targets)
        return blocks

    def header_entry(self) -> dict:
        return {} if self.head is None else head_entry(self.head, self.name)

    def facts(self) -> dict:
        """What the store's capture block says of the form asked for (only when it is not the default)."""
        if self.asked == LOGITS:
            return {}
        return {"reference_form": {"asked": self.asked, **({"why_logits": self.why_logits} if self.why_logits else {})}}


def check_form(asked: str) -> None:
    if asked not in FORMS:
        raise QevalError(f"--reference-form must be one of {', '.join(FORMS)}, not {asked!r}")


def stored_form(asked: str, model: str, settings: EngineSettings, lean: bool = True) -> StoredForm:
    """The form a capture of `model` asked for `asked` stores; QevalError for a hidden form it cannot replay."""
    check_form(asked)
    if asked == LOGITS:
        return StoredForm()
    try:
        # Layers offloaded to a GPU are no reason to refuse: the replay's record measures how far the CPU replay
        # falls from the GPU's logits, and auto keeps a piece hidden only where that measure certifies it.
        if settings.backend != LLAMA_CPP:
            raise NotReplayable("the hidden form replays llama.cpp's output layer: a model run on another backend "
                                "gives no activations to replay")
        head = read_head(model)
    except NotReplayable as exc:
        if asked == HIDDEN:
            raise QevalError(f"--reference-form hidden: {exc} (--reference-form auto stores logits there)") from None
        return StoredForm(asked=asked, why_logits=str(exc))
    return StoredForm(name=asked, head=head, asked=asked, ggml=GgmlHead.of(head, settings.n_threads), lean=lean)


EXACT = "exact"  # an auto capture's block: its exact rows, kept until its piece is settled


@dataclass(frozen=True)
class ExactRows:
    """A block's exact float32 logits [b, V] and its targets, which an auto piece codes if a block misses."""

    logits: np.ndarray
    targets: np.ndarray


class PieceBuilder:
    """One piece of a chunk in a capture's form (StoredForm), and at the end the piece in the form chosen. Auto keeps
    each block's exact rows while every replay so far is within AUTO_REPLAY_KL (at most a piece: 268 MB at a 262K
    vocab); at the first block that misses, the piece's rows are coded (`code`) and it is stored as logits."""

    def __init__(self, index: int, compressor: zstandard.ZstdCompressor, first_row: int,
                 code: SqrtLogCode | None = None):
        self.index, self.compressor, self.first_row, self.code = index, compressor, first_row, code
        self.builders: dict[str, ChunkBuilder] = {}
        self.worst_replay_kl = 0.0
        self.exact: list[ExactRows] = []

    def add(self, blocks: EncodedBlock | dict[str, EncodedBlock | ExactRows]) -> None:
        blocks = dict(blocks) if isinstance(blocks, dict) else {LOGITS: blocks}
        exact = blocks.pop(EXACT, None)
        for name, block in blocks.items():
            self._add(name, block)
            for uncoded in block.uncoded:  # the portable replay's KL(exact ‖ replayed): what any machine reads
                if uncoded.engine == "portable":
                    self.worst_replay_kl = max(self.worst_replay_kl, float(uncoded.record.kl.max()))
        if exact is not None:
            self.exact.append(exact)
            if self.worst_replay_kl > AUTO_REPLAY_KL:  # this piece is stored as logits: code every row kept so far
                for rows in self.exact:
                    self._add(LOGITS, self.code.encode_block(rows.logits, rows.targets))
                self.exact.clear()

    def _add(self, name: str, block: EncodedBlock) -> None:
        if name not in self.builders:  # the hidden rows are small: a compressor of their own
            self.builders[name] = ChunkBuilder(self.index, self.compressor if name == LOGITS else None,
                                               self.first_row, hidden=name == HIDDEN)
        self.builders[name].add_block(block)

    def finish(self) -> ChunkData:
        """The piece: its logits where it has them (the logits form, or an auto piece whose replay missed)."""
        return self.builders[LOGITS if LOGITS in self.builders else HIDDEN].finish()


@dataclass(frozen=True, kw_only=True)
class CaptureSpec:
    model: str
    out: str
    label: str
    corpus: str | None = None
    n_ctx: int = 512
    chunks: int | None = None
    chunk_range: tuple[int, int] | None = None  # windows [start, stop) of the corpus, for shards
    scoring: str = "half"  # which logit positions are scored (qeval.storage.scoring)
    concat: bool = False  # join the corpus's documents into one token stream (windows may span two)
    chat_template: str | None = None  # conversations: a template file or `plain` (default: the model's own)
    chat_template_kwargs: str | None = None  # conversations: JSON object of template variables
    conversation_depths: str | None = None  # conversations: history lengths each is placed after (comma-separated)
    settings: EngineSettings = field(default_factory=EngineSettings)  # batch sizes included
    threads: int | None = None  # encoder threads (see encoder_threads)
    code: SqrtLogCode = field(default_factory=SqrtLogCode)
    replace: bool = False  # a store at `out` that holds another capture is replaced, not refused (--force)
    reference_form: str = DEFAULT_FORM  # what the store keeps of each piece: logits, hidden or auto (hidden_form)
    # hidden pieces lean where ggml reproduces llama.cpp's logits here (store.LEAN_VERSION), certified when the store
    # travels (qeval certify, publish); False for a cluster's captures, whose readers run on nodes of any kind
    lean: bool = True


@dataclass
class CaptureResult:
    path: Path
    status: str  # "complete", "already complete"
    chunks_total: int
    chunks_written: int
    seconds: float
    header: StoreHeader | None = None

    stored_form: str = ""  # an auto capture that took a complete store made in another form: that form

    def summary_line(self) -> str:
        if self.stored_form:
            return (f"{self.path} is already complete ({self.chunks_total} chunks) in the {self.stored_form} form: "
                    "nothing to do (auto takes a store of this capture in any form; --reference-form with --force "
                    "recaptures it in the one named)")
        if self.status == "already complete":
            return f"{self.path} is already complete ({self.chunks_total} chunks): nothing to do"
        if self.status == OLDER_FORM:
            return (f"{self.path} is already complete ({self.chunks_total} chunks), made before stores recorded their "
                    "error: comparisons against it show their bounds as not recorded (--force recaptures it with "
                    "them)")
        return (f"wrote {self.path}: {self.chunks_total} chunks ({self.chunks_written} captured now) "
                f"in {self.seconds:.1f} s")


OLDER_FORM = "already complete, older form"  # a capture's status: its store holds it without an error record


@dataclass(frozen=True)
class CaptureStart:
    """What a capture is about to do, once its windows are known and before it decodes one (capture's on_start):
    the store's header, the chunks still to write (a resumed capture has some already), where, with what."""

    header: StoreHeader
    todo: list[int]
    path: Path
    model: str
    settings: EngineSettings

    @property
    def rows(self) -> int:
        return sum(self.header.n_scored_of(c) for c in self.todo)


def encoder_threads(threads: int | None, settings: EngineSettings) -> int:
    """As asked, else -t, else every core: numpy, numba and zstd release the GIL, so coding scales."""
    return threads or settings.n_threads or available_cores()


def iter_encoded_blocks(engine: Backend, windows: np.ndarray, indices: list[int], scored: list[np.ndarray],
                        code: SqrtLogCode, pool: ThreadPoolExecutor, form: StoredForm = StoredForm()
                        ) -> Iterator[tuple[int, int, EncodedBlock | dict[str, EncodedBlock]]]:
    """Decode windows[j] (chunk indices[j], scored positions scored[j]); yield (chunk, first row, block) in
    order, ENCODE_BLOCK rows each.

    Blocks are coded on `pool`, one per worker in flight (two per worker is 4 % faster and 60 MB
    larger), straight from the engine's logits, never copied here: a call's rows are valid until the
    engine's next iteration, so all its blocks are coded before it. The blocks of all windows of a
    call share the pool, so it stays busy across window borders.
    """
    def encode(job: tuple[ScoredRows, int, int]) -> EncodedBlock | dict[str, EncodedBlock]:
        rows, start, stop = job
        try:
            return form.encode(rows.logits[start:stop], None if rows.hidden is None else rows.hidden[start:stop],
                               scored_targets(windows[rows.window], rows.positions[start:stop]), code,
                               rows.first_row + start)
        except BadLogits as exc:
            raise QevalError(f"chunk {indices[rows.window]}: the model produced invalid logits ({exc}); the model "
                             "file or this llama.cpp build is broken for these settings") from None

    for call in engine.iter_calls(windows, scored):
        jobs = [(rows, start, stop) for rows in call for start, stop in block_spans(rows.first_row, len(rows.logits))]
        for (rows, start, _), block in zip(jobs, bounded_map(pool, encode, jobs, pool._max_workers)):
            yield indices[rows.window], rows.first_row + start, block


def block_spans(first_row: int, n_rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of the coding blocks of rows first_row.. first_row+n_rows-1: ENCODE_BLOCK rows at most,
    never across a piece border (a multiple of PIECE_ROWS), so every piece is made of whole blocks."""
    start = 0
    while start < n_rows:
        row = first_row + start
        stop = min(n_rows, start + ENCODE_BLOCK, start + PIECE_ROWS - row % PIECE_ROWS)
        yield start, stop
        start = stop


def ends_piece(row_end: int, n_scored: int) -> bool:
    """Whether a piece of a chunk ends after row_end - 1: at the chunk's end or at a piece border."""
    return row_end == n_scored or row_end % PIECE_ROWS == 0


def iter_pieces(engine: Backend, windows: np.ndarray, indices: list[int], scored: list[np.ndarray],
                code: SqrtLogCode, pool: ThreadPoolExecutor, compressor: zstandard.ZstdCompressor,
                form: StoredForm = StoredForm()) -> Iterator[ChunkData]:
    """windows[j] decoded, coded and compressed into chunk indices[j], in order, piece by piece (a window
    of more than PIECE_ROWS scored rows is never held whole), each in the capture's form; a chunk's last piece
    has first_row + n_tokens == len(scored[j])."""
    builder = None
    n_scored = {index: len(positions) for index, positions in zip(indices, scored)}
    for index, row, blocks in iter_encoded_blocks(engine, windows, indices, scored, code, pool, form):
        if builder is None:
            builder = PieceBuilder(index, compressor, row, code)
        builder.add(blocks)
        n_rows = len(next(iter(blocks.values())) if isinstance(blocks, dict) else blocks)
        if ends_piece(row + n_rows, n_scored[index]):
            yield builder.finish()
            builder = None


def scored_targets(window: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The correct next token of every scored logit position."""
    return window[positions + 1].astype(np.int64)


def store_header(backend: Backend, label: str, windows: np.ndarray, chunk_range: tuple[int, int], corpus: dict,
                 code: SqrtLogCode, labels: WindowLabels | None = None, head: dict | None = None,
                 **capture_facts) -> StoreHeader:
    """The header of a store of `backend`'s logits over `windows` (it holds chunks chunk_range of them; `labels`:
    their per-token labels, a conversation capture's): a capture's and a live candidate's; capture_facts are
    added to its capture block."""
    return StoreHeader(
        n_vocab=backend.n_vocab, n_ctx=backend.n_ctx, n_chunks=len(windows), chunk_start=chunk_range[0],
        chunk_stop=chunk_range[1], tokens_sha256=tokens_sha256(windows), label=label, codec=code.params(),
        error=code.error_spec(), head=head or {},
        tokenizer_sha256=backend.tokenizer_fingerprint(), model=backend.facts,
        kv=backend.settings.kv_block(backend.kv_rotation),
        corpus=corpus, scoring=backend.scoring.rule, windows=labels.to_json() if labels is not None else {},
        capture={"n_batch": backend.n_batch, "n_ubatch": backend.n_ubatch, "bos_substituted": backend.add_bos,
                 "numerics": backend.numerics, **backend.provenance, "qeval": __version__, **capture_facts})


def resolve_range(chunk_range: tuple[int, int] | None, n_windows: int) -> tuple[int, int]:
    if chunk_range is None:
        return 0, n_windows
    start, stop = chunk_range
    if not 0 <= start < stop <= n_windows:
        raise QevalError(f"--chunk-range {start}:{stop} is outside the {n_windows} chunks of this corpus")
    return start, stop


def capture(spec: CaptureSpec, on_chunk: Callable[[int], None] | None = None,
            on_plan: Callable[[int, int], None] | None = None,
            on_start: Callable[[CaptureStart], None] | None = None) -> CaptureResult:
    """Write (or resume) the store for `spec`. on_plan(total, already_done); on_chunk(1) per chunk. on_start, before
    any window is decoded (before a new store's first byte: its head may be most of it), may refuse the capture by
    raising (a disk too small: qeval.orchestrate.budget); a store file this call created is then removed, so
    nothing half-made is left to conflict with the next attempt."""
    t0 = time.perf_counter()
    settings = spec.settings.validate()
    scoring = Scoring.parse(spec.scoring)
    check_corpus_kind(spec.corpus, scoring)
    check_form(spec.reference_form)
    with contextlib.closing(open_backend(spec.model, spec.n_ctx, settings, scoring)) as engine:
        form = stored_form(spec.reference_form, spec.model, settings, spec.lean)  # the model file is known good by now
        windows, labels, identity = corpus_windows(spec, engine)
        chunk_range = resolve_range(spec.chunk_range, len(windows))
        header = store_header(engine, spec.label, windows, chunk_range, identity, spec.code, labels,
                              form.header_entry(), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              **form.facts())
        out = Path(spec.out)
        fresh = not has_data(out) and not spec.replace
        if on_start and fresh:  # before a byte is written: a store whose head alone fills the disk is refused too
            on_start(CaptureStart(header=header, todo=list(range(*chunk_range)), path=out, model=spec.model,
                                  settings=settings))
        try:
            writer = StoreWriter.open(out, header, windows, spec.code.lut(), replace=spec.replace, head=form.head)
        except StoreComplete as done:
            return CaptureResult(path=out, status=OLDER_FORM if done.older_form else "already complete",
                                 chunks_total=chunk_range[1] - chunk_range[0], chunks_written=0,
                                 seconds=time.perf_counter() - t0, header=header, stored_form=done.stored_form)
        with writer:
            if writer.header.format_version < LEAN_VERSION:  # resuming or growing an older store: no lean piece
                form = dataclasses.replace(form, lean=False)
            todo = [i for i in range(*chunk_range) if i not in writer.done_chunks]
            if on_start and not fresh:
                try:
                    on_start(CaptureStart(header=header, todo=todo, path=writer.path, model=spec.model,
                                          settings=settings))
                except BaseException:
                    writer.discard()
                    raise
            if on_plan:
                on_plan(chunk_range[1] - chunk_range[0], chunk_range[1] - chunk_range[0] - len(todo))
            threads = encoder_threads(spec.threads, settings)
            if form.head is not None:
                engine.output_hidden()
            with ThreadPoolExecutor(max_workers=threads) as pool, contextlib.closing(
                    iter_pieces(engine, windows[todo], todo, [header.positions_of(c) for c in todo], spec.code, pool,
                                zstd_compressor(threads), form)) as pieces:
                for piece in pieces:
                    writer.write_chunk(piece)  # a crash loses at most the window being captured
                    if on_chunk:  # progress inside a long window: a piece is its share of the window
                        on_chunk(piece.n_tokens / header.n_scored_of(piece.index))
            writer.finish()
    return CaptureResult(path=out, status="complete", chunks_total=chunk_range[1] - chunk_range[0],
                         chunks_written=len(todo), seconds=time.perf_counter() - t0,
                         header=header)


def check_corpus_kind(corpus: str | None, scoring: Scoring) -> None:
    """Conversations are scored by role (--score assistant), text windows by position: one message otherwise."""
    conversations = is_conversation_corpus(corpus)
    if scoring.per_window and not (conversations or (corpus or "").startswith("hf:")):
        raise QevalError(f"--score {scoring.rule} scores conversations: --corpus must be a JSONL file of them, a "
                         f"folder of such files, `conversations` (the shipped suite) or an hf: dataset of messages, "
                         f"not {corpus or 'the default'}")
    if conversations and not scoring.per_window:
        raise QevalError(f"--corpus {corpus} holds conversations: score them with --score {ASSISTANT} (a text "
                         "corpus is a .txt file or a folder of them)")


def corpus_windows(spec: CaptureSpec, engine: Backend) -> tuple[np.ndarray, WindowLabels | None, dict]:
    """(token windows, their labels (conversations only), the header's corpus block) of a capture."""
    if Scoring.parse(spec.scoring).per_window:
        if spec.concat:
            raise QevalError("--concat joins text documents; a conversation is always a window of its own")
        found = conversation_windows(spec.corpus, engine, spec.n_ctx, spec.chunks, spec.chat_template,
                                     parse_template_kwargs(spec.chat_template_kwargs), spec.conversation_depths)
        return found.windows, found.labels, found.identity
    if spec.chat_template or spec.chat_template_kwargs or spec.conversation_depths is not None:
        raise QevalError("--chat-template, --chat-template-kwargs and conversation depths (--score assistant@D) "
                         "render conversations (--score assistant); a text corpus is scored as it is")
    corpus = load_corpus(spec.corpus)
    documents = tokenize_documents(corpus, engine.tokenize, spec.concat)
    windows = make_windows(documents, spec.n_ctx, spec.chunks, f"corpus {corpus.name!r}")
    identity = {**corpus.identity(), "n_tokens": int(sum(map(len, documents))),
                "chunks_available": int(sum(len(d) // spec.n_ctx for d in documents))}
    if len(corpus.documents) > 1:
        identity["concatenated"] = spec.concat
    return windows, None, identity


class LiveChunk:
    """A chunk of a live candidate whose rows are coded, read like a ChunkData but produced while it is read.

    iter_planes() codes the window block by block as the metrics kernel asks, so a whole chunk of
    codes (134 MB at a 262K vocab) is never held; its window is decoded with the others of its
    decode call when the first of them is read, and only that call's logits are held. The scalars
    are filled in as it goes and are complete once iteration ends. With a writer the chunk is also
    compressed and saved; the codes are the same either way, hence stored and live give the same
    numbers.
    """

    def __init__(self, source: "LiveSource", index: int):
        self.source, self.index = source, index
        self.n_tokens = source.header.n_scored_of(index)
        self.logprob_target = self.logprob_max = self.top_ids = self.error = None
        self._errors: list[tuple[int, ErrorRecord | None]] = []  # each coded block's record, as they are made

    def error_rows(self, start: int, stop: int) -> ErrorRecord | None:
        """The error record of rows [start, stop), once iter_planes has yielded them."""
        return rows_of(self._errors, start, stop)

    def iter_planes(self, n_vocab: int, block_tokens: int = 16, buffers: int = 1) -> Iterator[tuple[int, np.ndarray]]:
        """Blocks are fresh arrays here, so `buffers` (a ring size for stored chunks) is not needed."""
        src = self.source
        save = src.writer is not None and self.index not in src.writer.done_chunks
        builder = None
        blocks: list[EncodedBlock] = []

        def planes() -> Iterator[np.ndarray]:
            nonlocal builder
            row = 0
            for block in src.blocks_of(self.index):
                if save:  # saved piece by piece, as a capture writes it
                    builder = builder or ChunkBuilder(self.index, compressor=src.compressor, first_row=row)
                    builder.add_block(block)
                self._errors.append((row, block.error))
                row += len(block.planes)
                if builder is not None and ends_piece(row, self.n_tokens):
                    src.writer.write_chunk(builder.finish())
                    builder = None
                blocks.append(EncodedBlock(planes=None, logprob_target=block.logprob_target,
                                           logprob_max=block.logprob_max, top_ids=block.top_ids, error=block.error))
                yield block.planes

        yield from reblock(planes(), block_tokens)
        self.logprob_target = np.concatenate([b.logprob_target for b in blocks])
        self.logprob_max = np.concatenate([b.logprob_max for b in blocks])
        self.top_ids = np.concatenate([b.top_ids for b in blocks])
        self.error = None if blocks[0].error is None else ErrorRecord.concat([b.error for b in blocks])


class LiveLogitsChunk:
    """A chunk of a live candidate that is never coded: the metrics read llama.cpp's float32 rows
    (qeval.compare.kernels.pair_sums_logits) and work out the candidate's scalars themselves."""

    def __init__(self, source: "LiveSource", index: int):
        self.source, self.index = source, index
        self.n_tokens = source.header.n_scored_of(index)

    def iter_logits(self) -> Iterator[tuple[int, np.ndarray, bool]]:
        """(first row, float32 rows [b, n_vocab], ends_call) in order. Rows are views of the engine's
        output: valid until the item after one with ends_call is asked for (the next decode call)."""
        return self.source.rows_of(self.index)


class LiveSource:
    """A candidate model run over a reference's token windows, read like a store.

    Chunks are produced while the metrics read them, one chunk at a time and in order, as `compare`
    reads a live source: windows are decoded in the engine's groups. Rows are coded (LiveChunk) when
    they are saved or a sampler needs codes (`coded`), else handed over as float32 logits
    (LiveLogitsChunk): coding is then off the critical path altogether. When the store it saves to
    was left incomplete by an earlier, interrupted run, the chunks it holds are read back instead of
    being run again.
    """

    complete = True
    live = True

    def __init__(self, engine: Backend, header: StoreHeader, tokens: np.ndarray, code: SqrtLogCode,
                 writer: StoreWriter | None = None, path: str = "(live)", threads: int | None = None,
                 coded: bool = True):
        self.engine, self.header, self.tokens, self.code = engine, header, tokens, code
        self.coded = coded or writer is not None
        threads = encoder_threads(threads, engine.settings)
        self.pool = ThreadPoolExecutor(max_workers=threads) if self.coded else None
        self.compressor = zstd_compressor(threads)
        self.lut = code.lut()
        self.chunk_indices = list(header.chunk_range)
        self.writer, self.path = writer, path
        self.resumed = set(writer.done_chunks) if writer is not None else set()
        self._saved = StoreReader(writer.path, tolerate_torn_tail=True) if self.resumed else None
        self._items, self._started = None, False
        self.produce([i for i in self.chunk_indices if i not in self.resumed])

    def produce(self, chunks: list[int]) -> None:
        """Decode these chunks, in this order (by default every chunk its store does not hold yet, in order): a
        matrix pair runs only the chunks its checkpoint lacks, or visits them in another order. Asked before
        any chunk is read; a chunk its store holds is read back, never decoded."""
        if self._started:
            raise ValueError("a live source's chunks are chosen before any is read")
        if self.writer is not None and set(chunks) - self.resumed != set(self.chunk_indices) - self.resumed:
            raise ValueError("a live source that saves its store decodes every chunk the store lacks")
        self._todo = [i for i in chunks if i not in self.resumed]
        if self._items is not None:
            self._items.close()
        self._items = self._decode()  # a generator: nothing is decoded until the first chunk is read

    def _decode(self) -> Iterator[tuple]:
        self._started = True
        todo, scored = self._todo, [self.header.positions_of(c) for c in self._todo]
        if self.coded:
            yield from iter_encoded_blocks(self.engine, self.tokens[todo], todo, scored, self.code, self.pool)
        else:
            yield from iter_scored_rows(self.engine, self.tokens[todo], todo, scored)

    def _items_of(self, index: int) -> Iterator[tuple]:
        """The items (chunk, first row, ...) of chunk `index`, which must be the next live chunk; stops
        after its last row without asking for more (that would decode the next call too early)."""
        for item in self._items:
            got, row, rows = item[:3]
            if got != index:
                raise QevalError(f"live chunks are produced in order: chunk {index} was asked for, {got} is next")
            yield item
            if row + len(rows) == self.header.n_scored_of(index):
                return
        raise QevalError(f"chunk {index} is not among the chunks this live source runs")

    def blocks_of(self, index: int) -> Iterator[EncodedBlock]:
        """The coded blocks of chunk `index` (a coded source)."""
        for _, _, block in self._items_of(index):
            yield block

    def rows_of(self, index: int) -> Iterator[tuple[int, np.ndarray, bool]]:
        """(first row, float32 rows, ends_call) of chunk `index` (an uncoded source)."""
        for _, row, rows, ends_call in self._items_of(index):
            yield row, rows, ends_call

    def read_chunk(self, index: int) -> LiveChunk | LiveLogitsChunk | ChunkData:
        if index in self.resumed:
            return self._saved.read_chunk(index)
        return LiveChunk(self, index) if self.coded else LiveLogitsChunk(self, index)

    def close(self) -> None:
        self._items.close()
        if self.pool is not None:
            self.pool.shutdown()
        if self._saved is not None:
            self._saved.close()
        if self.writer is not None:
            self.writer.close()


def iter_scored_rows(engine: Backend, windows: np.ndarray, indices: list[int], scored: list[np.ndarray]
                     ) -> Iterator[tuple[int, int, np.ndarray, bool]]:
    """(chunk, first row, float32 rows, ends_call) of windows[j] (chunk indices[j], scored positions
    scored[j]), decoded in order."""
    for call in engine.iter_calls(windows, scored):
        for k, rows in enumerate(call):
            yield indices[rows.window], rows.first_row, rows.logits, k == len(call) - 1


def open_live(model: str, ref, n_chunks: int | None, settings: EngineSettings, label: str,
              save_path: Path | None, code: SqrtLogCode = SqrtLogCode(), replace: bool = False,
              coded: bool = False):
    """(engine, LiveSource) for a candidate GGUF against a reference's tokens; caller closes both.
    replace: a store at save_path that holds another capture is replaced (see StoreWriter.open).
    coded: code the rows even when nothing is saved (samplers read codes); saving always codes."""
    settings = settings.validate()
    rh = ref.header
    stop = rh.chunk_stop if n_chunks is None else n_chunks
    if n_chunks is not None and not 1 <= n_chunks <= rh.chunk_stop:
        raise QevalError(f"--chunks {n_chunks} asks for more than the reference holds ({rh.chunk_stop} chunks)")
    if rh.chunk_start != 0:
        raise QevalError("the reference is a shard (it does not start at chunk 0); merge it first")
    engine = open_backend(model, rh.n_ctx, settings, Scoring.parse(rh.scoring))
    try:
        if engine.n_vocab != rh.n_vocab:
            raise MismatchError(f"vocab size differs: reference {rh.n_vocab}, candidate model {engine.n_vocab} "
                                "(a model with another tokenizer cannot be compared)")
        if rh.tokenizer_sha256 and engine.tokenizer_fingerprint() != rh.tokenizer_sha256:
            raise MismatchError("the candidate model's tokenizer differs from the reference's (same vocab size, "
                                "different token pieces)")
        windows = np.ascontiguousarray(ref.tokens[:stop])
        labels = rh.window_labels.head(stop) if rh.window_labels is not None else None
        header = store_header(engine, label, windows, (0, stop), rh.corpus, code, labels, live_against=rh.label)
        writer = None
        if save_path is not None:
            try:
                writer = StoreWriter.open(save_path, header, windows, code.lut(), replace=replace)
            except StoreComplete:
                raise QevalError(f"{save_path} already exists and is complete; compare it with --cand "
                                 f"{label}") from None
        return engine, LiveSource(engine, header, windows, code, writer, path=f"{model}{LIVE_SUFFIX}", coded=coded)
    except BaseException:
        engine.close()
        raise
