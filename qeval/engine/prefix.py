"""A long prefix decoded once, and continuations decoded after it.

Several questions after one long text need not pay for the text again: the prefix is decoded once in one sequence,
then each continuation after it, its positions following the prefix; afterwards the continuation's cells are cut
from the cache (llama_memory_seq_rm), leaving the prefix's as they were decoded. A recurrent state cannot be cut
back, so for a recurrent or hybrid model the prefix's state is saved (llama_state_seq_get_data) and put back
instead. llama-bench caches its depth the same way. The cost per continuation is its own tokens, not the prefix's.

Pieces go to llama_decode n_batch tokens at a time from the first position decoded (a continuation's pieces start
at its first token), so a continuation decoded after the prefix and the same tokens decoded in one fresh pass
are cut into other ubatches: their logits may differ by the last bits llama.cpp's CPU kernels give other shapes
(tests/test_needles.py measures it).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from qeval.engine.engine import CPU_BATCH, DEFAULT_UBATCH, ContextShape, EngineSettings, LlamaModel
from qeval.errors import QevalError

SEQ = 0  # the one sequence


class PrefixModel(LlamaModel):
    """A model with one context of one sequence of n_ctx tokens; `decoded` counts the tokens it ran forward."""

    def __init__(self, model_path: str | os.PathLike, settings: EngineSettings, n_ctx: int):
        n_batch, n_ubatch = self.batch_sizes(settings, n_ctx)
        self.n_ctx, self.decoded = n_ctx, 0
        super().__init__(model_path, settings, ContextShape(
            n_ctx_seq=n_ctx, n_seq=1, n_batch=n_batch, n_ubatch=n_ubatch, kv_unified=False,
            described=f"with KV {settings.type_k}/{settings.type_v}, flash attention {settings.flash_attn} "
                      f"(n_ctx {n_ctx}, -b {n_batch}, -ub {n_ubatch})"))
        self.n_batch = n_batch

    @staticmethod
    def batch_sizes(settings: EngineSettings, n_ctx: int) -> tuple[int, int]:
        """(n_batch, n_ubatch) it decodes in: -b and -ub, none beyond the window."""
        n_batch = min(settings.n_batch or CPU_BATCH, n_ctx)
        return n_batch, min(settings.n_ubatch or DEFAULT_UBATCH, n_batch)

    def decode_prefix(self, tokens: np.ndarray) -> ctypes.Array | None:
        """Decode `tokens` (BOS included, as given) from an empty cache; its saved state where the memory cannot
        cut a continuation back off (a recurrent or hybrid model), else None: saving it would copy the whole cache
        per trial for nothing."""
        self.clear_memory()
        self._decode(tokens, 0, len(tokens))
        if not (self._lc.llama_model_is_recurrent(self.model) or self._lc.llama_model_is_hybrid(self.model)):
            return None
        size = self._lc.llama_state_seq_get_size(self.ctx, SEQ)
        state = (ctypes.c_uint8 * size)()
        if self._lc.llama_state_seq_get_data(self.ctx, state, size, SEQ) != size:
            raise QevalError("llama.cpp could not save the prefix's sequence state")
        return state

    def continue_from(self, state: ctypes.Array | None, at: int, tokens: np.ndarray, first_scored: int) -> np.ndarray:
        """float32 [len(tokens) - first_scored, n_vocab] (a copy): the logits of positions first_scored.. of
        `tokens` decoded after the prefix of `at` tokens whose `state` decode_prefix saved (the cache holding that
        prefix alone: decode_prefix, then continue_from, never fresh, in between). Afterwards the
        continuation is removed from the cache (llama_memory_seq_rm), which leaves the prefix's cells as they were
        decoded; where the memory cannot cut its tail (a recurrent state) the saved state is put back instead.
        The tail cut is preferred: a restored Gemma-3 cache (sliding-window layers) gave logits up to 0.63 apart
        from a fresh pass past 512 tokens of prefix, the cut ones bit-identical (measured, -fa off)."""
        logits = self._decode(tokens, at, first_scored)
        if not self._lc.llama_memory_seq_rm(self._lc.llama_get_memory(self.ctx), SEQ, at, -1):
            if state is None:
                raise QevalError("llama.cpp could not cut a continuation from the cache, and no state was saved")
            self.clear_memory()
            if not self._lc.llama_state_seq_set_data(self.ctx, state, len(state), SEQ):
                raise QevalError("llama.cpp could not restore the prefix's sequence state")
        return logits

    def fresh(self, tokens: np.ndarray, first_scored: int) -> np.ndarray:
        """The logits of positions first_scored.. of `tokens` decoded in one pass from an empty cache: what
        continue_from stands for (the naive design: a whole window per question)."""
        self.clear_memory()
        return self._decode(tokens, 0, first_scored)

    def _decode(self, tokens: np.ndarray, at: int, first_scored: int) -> np.ndarray:
        """Decode `tokens` at positions at.. in pieces of n_batch; the logits of its positions first_scored.."""
        if at + len(tokens) > self.n_ctx:
            raise QevalError(f"{at + len(tokens)} tokens do not fit the context of {self.n_ctx}")
        rows = []
        for start in range(0, len(tokens), self.n_batch):
            piece = tokens[start:start + self.n_batch]
            batch = self._batch
            for j, token in enumerate(piece):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = int(token), at + start + j, 1
                batch.seq_id[j][0] = SEQ
                batch.logits[j] = start + j >= first_scored
            batch.n_tokens = len(piece)
            self.decode()
            self.decoded += len(piece)
            wanted = len(piece) - max(first_scored - start, 0)
            if wanted > 0:
                rows.append(self.output_logits(wanted).copy())
        return np.concatenate(rows) if rows else np.empty((0, self.n_vocab), np.float32)
