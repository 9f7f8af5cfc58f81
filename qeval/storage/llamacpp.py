"""Reading llama-perplexity's `--kl-divergence-base` files, so existing references need no re-run.

Layout (facts from llama.cpp tools/perplexity; no version field, little-endian):
    "_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx],
    then per scored token (n_ctx - 1 - n_ctx/2 per chunk) a record of nv = 2*((n_vocab+1)/2) + 4
    uint16: float32 scale, float32 min_log_prob, n_vocab uint16 codes (+1 pad if n_vocab is odd).
    log p_i = scale * code_i + min_log_prob; everything at or below max - 16 decodes to the minimum.

The file is read as a LogitSource: each chunk is decoded and re-coded with qeval's code on the fly,
so every metric runs through the same kernel. The target log-prob and the maximum are taken
from llama.cpp's decoded values unchanged, as llama-perplexity does, so PPL(base) matches its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from qeval.errors import StoreFormatError
from qeval.storage.codec import SqrtLogCode
from qeval.storage.scoring import half_span
from qeval.storage.store import ChunkBuilder, ChunkData, OpenFile, StoreHeader, tokens_sha256

MAGIC = b"_logits_"
_HEAD = np.dtype([("magic", "S8"), ("n_ctx", "<i4"), ("n_vocab", "<i4"), ("n_chunk", "<i4")])
BLOCK_TOKENS = 16


def is_llamacpp_file(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(8) == MAGIC
    except OSError:
        return False


def record_values(n_vocab: int) -> int:
    """uint16 values per scored-token record."""
    return 2 * ((n_vocab + 1) // 2) + 4


class LlamaCppBaseFile(OpenFile):
    """A `--kl-divergence-base` file, read chunk by chunk as if it were a qeval store."""

    complete = True

    def __init__(self, path: str | os.PathLike, code: SqrtLogCode | None = None, label: str = ""):
        self.path = Path(path)
        self.code = code or SqrtLogCode(error=None)  # the exact logits are gone: no error record
        try:
            self._fh = open(self.path, "rb")
            self.size_bytes = os.fstat(self._fh.fileno()).st_size
        except OSError as exc:
            raise StoreFormatError(f"cannot open llama.cpp logits file {self.path}: {exc.strerror}") from None
        try:
            self._read_header(label)
        except BaseException:
            self._fh.close()
            raise

    def _read_header(self, label: str) -> None:
        raw = self._fh.read(_HEAD.itemsize)
        if len(raw) < _HEAD.itemsize or raw[:8] != MAGIC:
            raise StoreFormatError(f"{self.path} is not a llama.cpp --kl-divergence-base file (bad magic)")
        head = np.frombuffer(raw, dtype=_HEAD)[0]
        n_ctx, n_vocab, n_chunk = int(head["n_ctx"]), int(head["n_vocab"]), int(head["n_chunk"])
        if not (4 <= n_ctx <= 1 << 22 and 2 <= n_vocab <= 1 << 24 and 1 <= n_chunk <= 1 << 24):
            raise StoreFormatError(f"{self.path}: implausible header (n_ctx {n_ctx}, n_vocab {n_vocab}, "
                                   f"n_chunk {n_chunk})")
        first, n_scored = half_span(n_ctx)
        self._record_bytes = 2 * record_values(n_vocab)
        self._data_offset = _HEAD.itemsize + 4 * n_chunk * n_ctx
        expected = self._data_offset + n_chunk * n_scored * self._record_bytes
        if self.size_bytes != expected:
            have = max(0, self.size_bytes - self._data_offset) // self._record_bytes
            raise StoreFormatError(
                f"{self.path}: truncated or oversized llama.cpp logits file ({self.size_bytes} bytes, expected "
                f"{expected} for {n_chunk} chunks of n_ctx {n_ctx} at vocab {n_vocab}; it holds {have} of "
                f"{n_chunk * n_scored} token records)")
        tokens = np.frombuffer(self._fh.read(4 * n_chunk * n_ctx), dtype="<i4").reshape(n_chunk, n_ctx)
        if tokens.min() < 0 or tokens.max() >= n_vocab:
            raise StoreFormatError(f"{self.path}: token ids outside the vocab of {n_vocab}")
        self.tokens = tokens
        self.lut = self.code.lut()
        self.chunk_indices = list(range(n_chunk))
        self.header = StoreHeader(
            n_vocab=n_vocab, n_ctx=n_ctx, n_chunks=n_chunk, chunk_start=0, chunk_stop=n_chunk,
            tokens_sha256=tokens_sha256(tokens), label=label or self.path.stem, codec=self.code.params(),
            source="llama.cpp --kl-divergence-base",
            capture={"imported_from": self.path.name,
                     "note": "reference decoded from llama.cpp's linear uint16 code, clamped at max-16"})

    def _decoded_block(self, chunk: int, start: int, count: int) -> np.ndarray:
        """log p, float32 [count, n_vocab], as llama-perplexity decodes it; clamped entries are -inf.

        Code 0 means "at or below max - 16": llama.cpp decodes all of them to that floor, which at a
        262K vocab puts ~3 % of made-up mass (262,144 * e^-16) in the tail, and llama-perplexity
        skips them when it computes KLD. They are read as "below the clamp" (-inf) here, so the
        re-coded distribution keeps only what the file really knows. (Measured on a real file of
        Gemma-3-270M: KLD of the model against itself 0.0875 with the floor, ~1e-5 without.)
        """
        n_vocab, n_scored = self.header.n_vocab, self.header.n_scored
        offset = self._data_offset + (chunk * n_scored + start) * self._record_bytes
        raw = os.pread(self._fh.fileno(), count * self._record_bytes, offset)  # thread-safe
        if len(raw) != count * self._record_bytes:
            raise StoreFormatError(f"{self.path}: truncated at chunk {chunk}")
        records = np.frombuffer(raw, dtype="<u2").reshape(count, -1)
        scale_min = records[:, :4].copy().view("<f4")  # [count, 2]: scale, min_log_prob
        if not np.all(np.isfinite(scale_min)) or np.any(scale_min[:, 0] < 0):
            raise StoreFormatError(f"{self.path}: chunk {chunk} holds invalid scale/min values")
        codes = records[:, 4:4 + n_vocab]
        logp = codes.astype(np.float32) * scale_min[:, :1] + scale_min[:, 1:2]
        logp[codes == 0] = -np.inf
        return logp

    def _floor(self, chunk: int, start: int, count: int) -> np.ndarray:
        """min_log_prob per record: what llama-perplexity uses for a clamped target."""
        offset = self._data_offset + (chunk * self.header.n_scored + start) * self._record_bytes
        heads = [os.pread(self._fh.fileno(), 8, offset + i * self._record_bytes) for i in range(count)]
        return np.frombuffer(b"".join(heads), dtype="<f4").reshape(count, 2)[:, 1]

    def read_chunk(self, index: int) -> ChunkData:
        if index not in range(self.header.n_chunks):
            raise StoreFormatError(f"{self.path}: chunk {index} is not in this file ({self.header.n_chunks} chunks)")
        first, n_scored = half_span(self.header.n_ctx)
        targets = self.tokens[index, first + 1:first + 1 + n_scored]
        builder = ChunkBuilder(index)
        for start in range(0, n_scored, BLOCK_TOKENS):
            count = min(BLOCK_TOKENS, n_scored - start)
            logp = self._decoded_block(index, start, count)
            block = self.code.encode_block(logp, targets[start:start + count])
            rows = np.arange(count)
            # keep llama.cpp's own (unnormalised) decoded values for the scalars, floor included
            floor = self._floor(index, start, count)
            target_logp = np.maximum(logp[rows, targets[start:start + count]], floor)
            builder.add(block.planes, target_logp.astype(np.float64),
                        logp[rows, block.top_ids[:, 0]].astype(np.float64), block.top_ids)
        return builder.finish()


def import_llamacpp(src: str | os.PathLike, out: str | os.PathLike, label: str = "", on_chunk=None,
                    replace: bool = False) -> Path:
    """Convert a `--kl-divergence-base` file into a qeval store (resumable, like a capture; a store at
    `out` that holds another capture is refused, or replaced with `replace`)."""
    from qeval.storage.store import StoreComplete, StoreWriter

    out = Path(out)
    with LlamaCppBaseFile(src, label=label or out.name.split(".")[0]) as base:
        try:
            writer = StoreWriter.open(out, base.header, base.tokens, base.lut, replace=replace)
        except StoreComplete:
            return out
        with writer:
            for i in base.chunk_indices:
                if i not in writer.done_chunks:
                    writer.write_chunk(base.read_chunk(i))
                if on_chunk:
                    on_chunk(1)
            writer.finish()
    return out
