"""A --kl-divergence-base file written by llama-perplexity itself, read by qeval.

tests/data/llamacpp-gemma3-270m-q8_0-c16.kld.zst was made with the llama-perplexity that
llama-cpp-python 0.3.36 vendors (see tests/data/README.md for the exact command): Gemma-3-270M
Q8_0 as derived by `qeval demo`, the shipped corpus, n_ctx 16, 2 chunks, flash attention off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zstandard

from qeval import api
from qeval.engine.engine import Engine
from qeval.inputs.corpus import load_corpus
from qeval.storage.llamacpp import LlamaCppBaseFile

FIXTURE = Path(__file__).parent / "data" / "llamacpp-gemma3-270m-q8_0-c16.kld.zst"


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("llamacpp") / "base.kld"
    out.write_bytes(zstandard.ZstdDecompressor().decompress(FIXTURE.read_bytes(), max_output_size=64 << 20))
    return out


def test_layout_and_tokens_match_llama_perplexity(base_file, models):
    with LlamaCppBaseFile(base_file) as f, Engine(models["Q8_0"], 16) as engine:
        assert (f.header.n_ctx, f.header.n_vocab, f.header.n_chunks, f.header.n_scored) == (16, 262144, 2, 7)
        tokens = engine.tokenize(load_corpus().text)
        # llama-perplexity stores the ids as tokenized (BOS first, no substitution): qeval's tokenizer agrees
        np.testing.assert_array_equal(f.tokens, tokens[:32].reshape(2, 16))


def raw_records(path: Path, n_vocab: int, n_records: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, min_log_prob) float32 pairs and uint16 codes, read in the test with plain numpy."""
    nv = 2 * ((n_vocab + 1) // 2) + 4
    raw = np.fromfile(path, dtype="<u2", offset=offset, count=n_records * nv).reshape(n_records, nv)
    head = raw[:, :4].copy().view("<f4")
    return head, raw[:, 4:4 + n_vocab]


# The file was written on another machine: llama.cpp's CPU kernels give slightly different logits
# per CPU (up to 0.17 nats at the target on AMD EPYC vs the Intel box that wrote it), so no test
# compares this file's numbers with a capture made here. What is machine-independent is tested:
# the layout, the tokens (above), the decoding and the clamp rule. Same-machine agreement with
# llama-perplexity's numbers is measured by bench/bench_vs_llamacpp.py.
def test_decoding_and_clamp_rule_of_the_llama_file(base_file, tmp_path):
    n_vocab, n_scored = 262144, 7
    head, codes = raw_records(base_file, n_vocab, 2 * n_scored, offset=8 + 12 + 2 * 16 * 4)
    scale, min_lp = head[:, 0].astype(np.float64), head[:, 1].astype(np.float64)
    logp = scale[:, None] * codes + min_lp[:, None]  # llama.cpp's decoding, in float64
    with LlamaCppBaseFile(base_file) as f:
        tokens = f.tokens
        for c in range(2):
            chunk = f.read_chunk(c)
            rows = slice(c * n_scored, (c + 1) * n_scored)
            targets = tokens[c, 9:16]
            np.testing.assert_allclose(chunk.logprob_target, logp[rows][np.arange(n_scored), targets], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(chunk.top_ids[:, 0], np.argmax(codes[rows], axis=1))
    # clamp rule: every code-0 entry stands for "at or below max - 16"; the same model against itself
    # reads as KLD 0 (llama.cpp's floor value, ~3 % of made-up mass at this vocab, is not summed)
    assert (codes == 0).mean() > 0.5
    imported = tmp_path / "imported.qeval"
    assert "wrote" in api.import_llamacpp_report(base_file, imported)
    result, _ = api.kld_report(str(base_file), str(imported), threads=1)
    assert result["same_top1"]["fraction"] == 1.0 and 0 <= result["kld"]["mean"] < 1e-6
    nll = -logp[np.arange(2 * n_scored), np.concatenate([tokens[0, 9:16], tokens[1, 9:16]])]
    assert result["perplexity"]["ppl_ref"] == pytest.approx(np.exp(nll.mean()), rel=1e-6)
