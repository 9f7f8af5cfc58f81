"""A runs directory of synthetic stores for the paired-comparison, gate and baseline tests.

REF and three candidates over the same tokens: A (light noise), B (heavier noise), A_COPY (A's logits
under another label); OTHER_TOKENS uses different tokens; SHORT holds only the first chunks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import make_tokens, perturb, synth_logits, write_store

N_CHUNKS, N_CTX, N_VOCAB = 12, 32, 300  # 15 scored tokens per chunk, 180 in all
SHORT_CHUNKS = 8


def make_runs(directory: Path, seed: int = 7, sigma_a: float = 0.25, sigma_b: float = 0.9) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tokens = make_tokens(rng, N_CHUNKS, N_CTX, N_VOCAB)
    ref = synth_logits(rng, tokens, N_VOCAB)
    a = {c: perturb(rng, x, sigma_a) for c, x in ref.items()}
    write_store(directory / "REF.qeval", tokens, ref, N_VOCAB, label="REF")
    write_store(directory / "A.qeval", tokens, a, N_VOCAB, label="A")
    write_store(directory / "A_COPY.qeval", tokens, a, N_VOCAB, label="A_COPY")
    write_store(directory / "B.qeval", tokens, {c: perturb(rng, x, sigma_b) for c, x in ref.items()}, N_VOCAB, label="B")
    write_store(directory / "SHORT.qeval", tokens[:SHORT_CHUNKS], {c: perturb(rng, ref[c], sigma_b) for c in range(SHORT_CHUNKS)},
                N_VOCAB, label="SHORT")
    other = make_tokens(np.random.default_rng(seed + 1), N_CHUNKS, N_CTX, N_VOCAB)
    write_store(directory / "OTHER_TOKENS.qeval", other, {c: perturb(rng, x, sigma_a) for c, x in ref.items()}, N_VOCAB,
                label="OTHER_TOKENS")
    return directory
