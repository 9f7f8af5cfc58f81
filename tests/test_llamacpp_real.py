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

from qeval import api, demo
from qeval.corpus import load_corpus
from qeval.engine import Engine, EngineSettings
from qeval.llamacpp import LlamaCppBaseFile
from qeval.store import StoreReader

FIXTURE = Path(__file__).parent / "data" / "llamacpp-gemma3-270m-q8_0-c16.kld.zst"


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("llamacpp") / "base.kld"
    out.write_bytes(zstandard.ZstdDecompressor().decompress(FIXTURE.read_bytes(), max_output_size=64 << 20))
    return out


@pytest.fixture(scope="module")
def models():
    return demo.prepare_models(demo.models_dir())


def test_layout_and_tokens_match_llama_perplexity(base_file, models):
    with LlamaCppBaseFile(base_file) as f, Engine(models["Q8_0"], 16) as engine:
        assert (f.header.n_ctx, f.header.n_vocab, f.header.n_chunks, f.header.n_scored) == (16, 262144, 2, 7)
        tokens = engine.tokenize(load_corpus().text)
        # llama-perplexity stores the ids as tokenized (BOS first, no substitution): qeval's tokenizer agrees
        np.testing.assert_array_equal(f.tokens, tokens[:32].reshape(2, 16))


def test_qeval_capture_agrees_with_the_llama_file(base_file, models, tmp_path):
    runs = tmp_path / "runs"
    api.capture_store(str(models["Q8_0"]), "q8", runs_dir=runs, n_ctx=16, chunks=2,
                      settings=EngineSettings(flash_attn="off"))
    with LlamaCppBaseFile(base_file) as f, StoreReader(runs / "q8.qeval") as store:
        for c in range(2):
            ours, theirs = store.read_chunk(c), f.read_chunk(c)
            # llama.cpp's linear code resolves log p to (max - min)/65535 <= 16/65535 near the target
            np.testing.assert_allclose(theirs.logprob_target, ours.logprob_target, atol=2e-3)
            np.testing.assert_array_equal(theirs.top_ids[:, 0], ours.top_ids[:, 0])
    result, _ = api.kld_report(str(base_file), "q8", runs_dir=runs, threads=1)
    assert result["same_top1"]["fraction"] == 1.0
    assert 0 <= result["kld"]["mean"] < 1e-3  # the same model: only llama.cpp's code and clamp differ
    assert abs(result["perplexity"]["ratio"] - 1) < 2e-3
    imported = tmp_path / "imported.qeval"
    assert "wrote" in api.import_llamacpp_report(base_file, imported)
    again, _ = api.kld_report(str(imported), "q8", runs_dir=runs, threads=1)
    assert again["kld"]["mean"] == pytest.approx(result["kld"]["mean"], rel=1e-9)
