"""Memory kinds beyond Gemma-3's sliding window, and the GGUFs qeval refuses.

`qwen35moe` is a hybrid: Gated-DeltaNet recurrent layers (a state carried token to token), full
attention every 4th layer (the only KV cache) and MoE feed-forward layers; `mamba` is purely
recurrent. Both are tiny random-weight models built once per session by tests/tinymodels.py with
Gemma-3's real 262,144-token tokenizer and quantized by llama.cpp. Every number is checked against
llama-cpp-python's own logits on the same tokens, as tests/test_capture.py does for Gemma.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinymodels
from conftest import assert_cli_error, kld64, log_softmax64, run_cli

from qeval import api
from qeval.engine.engine import Engine, EngineSettings
from qeval.engine.modelinfo import require_decoder_context
from qeval.errors import QevalError
from qeval.orchestrate import demo
from qeval.storage.scoring import half_span
from qeval.storage.store import StoreReader

N_CTX = 64
N_CHUNKS = 4
FIRST, N_SCORED = half_span(N_CTX)
# flash attention on CPU depends on how tokens are batched: off on both sides where logits must be equal
NO_FA = EngineSettings(flash_attn="off")
BUILDERS = {"qwen35moe": tinymodels.build_qwen35moe, "mamba": tinymodels.build_mamba}
QUANTS = {"qwen35moe": ("Q8_0", "Q4_0"), "mamba": ("Q8_0",)}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, gemma_tokenizer) -> dict[str, dict[str, Path]]:
    """arch -> quant -> model, each quantized from an F16 build by llama.cpp's quantizer."""
    directory = tmp_path_factory.mktemp("tinymodels")
    models = {}
    for arch, build in BUILDERS.items():
        f16 = build(directory / f"{arch}-F16.gguf", gemma_tokenizer)
        models[arch] = {quant: demo.quantize(f16, directory / f"{arch}-{quant}.gguf", demo.DERIVED_FTYPES[quant])
                        for quant in QUANTS[arch]}
    return models


@pytest.fixture(scope="session")
def references(tmp_path_factory, tiny) -> dict[str, Path]:
    """arch -> a store of its Q8_0 model over N_CHUNKS windows (flash attention off)."""
    runs = tmp_path_factory.mktemp("reference-runs")
    for arch, quants in tiny.items():
        api.capture_store(str(quants["Q8_0"]), arch, runs_dir=runs, n_ctx=N_CTX, chunks=N_CHUNKS, settings=NO_FA)
    return {arch: runs / f"{arch}.qeval" for arch in tiny}


@pytest.fixture(scope="session")
def refused(tmp_path_factory, gemma_tokenizer) -> dict[str, Path]:
    """GGUFs that are no causal language model; a 512-token vocab keeps them small."""
    directory = tmp_path_factory.mktemp("refused")
    small_vocab = tinymodels.truncate_tokenizer(gemma_tokenizer, 512)
    return {
        "encoder": tinymodels.build_bert(directory / "bert.gguf", small_vocab),
        "undeclared-encoder": tinymodels.build_bert(directory / "bert-undeclared.gguf", small_vocab,
                                                    declares_encoder=False),
        "mmproj": tinymodels.build_mmproj(directory / "mmproj.gguf"),
        "unknown": tinymodels.build_unknown_arch(directory / "unknown.gguf", small_vocab),
    }


def llama(model: Path, n_ctx: int = N_CTX):
    """llama-cpp-python's high-level API with every logit kept and flash attention off."""
    import llama_cpp

    return llama_cpp.Llama(str(model), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, n_threads=2,
                           flash_attn=False)


def llama_logprobs(model: Path, windows: np.ndarray) -> np.ndarray:
    """float64 log-probs [window, scored row, vocab] of each window decoded in a cleared context,
    its first token replaced by BOS."""
    llm = llama(model)
    out = np.empty((len(windows), N_SCORED, llm.n_vocab()))
    for i, window in enumerate(windows):
        tokens = window.copy()
        tokens[0] = llm.token_bos()
        llm.reset()
        llm.eval(tokens.tolist())
        out[i] = log_softmax64(llm.scores[FIRST:N_CTX - 1])
    llm.close()
    return out


def at_targets(logprobs: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """[window, row]: the log-prob of each scored row's correct next token."""
    return np.take_along_axis(logprobs, windows[:, FIRST + 1:, None], axis=2)[:, :, 0]


@pytest.mark.parametrize("arch", BUILDERS)
def test_capture_equals_llama_cpp_python(tiny, references, arch):
    # Each window is compared with a cleared llama-cpp-python context, so a recurrent state or KV
    # cache carried from one window (or sequence of a batch) into another would show here.
    with StoreReader(references[arch], verify_chunks=True) as store:
        assert store.complete and store.header.model["architecture"] == arch
        windows = np.array(store.tokens)
        chunks = [store.read_chunk(c) for c in range(N_CHUNKS)]
    expected = llama_logprobs(tiny[arch]["Q8_0"], windows)
    np.testing.assert_allclose(np.stack([c.logprob_target for c in chunks]), at_targets(expected, windows),
                               rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.stack([c.top_ids[:, 0] for c in chunks]), expected.argmax(axis=2))
    assert np.all(np.exp(expected.max(axis=2)) < 0.9)  # the random model is not degenerate


@pytest.mark.parametrize("arch", BUILDERS)
def test_window_decoded_alone_equals_window_decoded_after_others(tiny, references, tmp_path, arch):
    last = N_CHUNKS - 1
    api.capture_store(str(tiny[arch]["Q8_0"]), "alone", runs_dir=tmp_path, n_ctx=N_CTX, chunks=N_CHUNKS,
                      chunk_range=(last, N_CHUNKS), settings=NO_FA)
    with StoreReader(references[arch]) as after, StoreReader(tmp_path / "alone.qeval") as alone:
        windows = np.array(after.tokens)
        a, b = after.read_chunk(last), alone.read_chunk(last)
    np.testing.assert_allclose(b.logprob_target, a.logprob_target, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(b.top_ids, a.top_ids)
    # and the state does matter: the same tokens decoded as a continuation of the previous window
    # predict differently, far beyond the tolerance above, so a state carried over would be seen
    continued = continuation_logprobs(tiny[arch]["Q8_0"], windows[last - 1], windows[last])
    assert np.abs(continued - b.logprob_target).max() > 1e-2


def continuation_logprobs(model: Path, previous: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Log-probs of `window`'s scored targets when it follows `previous` in one context."""
    llm = llama(model, 2 * N_CTX)
    tokens = np.concatenate([previous, window])
    tokens[[0, N_CTX]] = llm.token_bos()  # as in a window of its own: only the context before differs
    llm.eval(tokens.tolist())
    logprobs = log_softmax64(llm.scores[N_CTX + FIRST:2 * N_CTX - 1])
    llm.close()
    return logprobs[np.arange(N_SCORED), window[FIRST + 1:]]


def test_live_candidate_kld_equals_float64_from_llama_cpp_python(tiny, references, tmp_path):
    cmp = api.compare(str(references["qwen35moe"]), str(tiny["qwen35moe"]["Q4_0"]), chunks=2, runs_dir=tmp_path,
                      settings=NO_FA)
    with StoreReader(references["qwen35moe"]) as store:
        windows = np.array(store.tokens[:2])
    ref = llama_logprobs(tiny["qwen35moe"]["Q8_0"], windows)
    cand = llama_logprobs(tiny["qwen35moe"]["Q4_0"], windows)
    t = cmp.per_token
    np.testing.assert_allclose(t["nll_ref"], -at_targets(ref, windows).ravel(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(t["nll_cand"], -at_targets(cand, windows).ravel(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(t["kld"], kld64(ref, cand).ravel(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(t["same_top1"], (ref.argmax(axis=2) == cand.argmax(axis=2)).ravel())
    assert t["kld"].mean() > 0.01  # Q4_0 really differs from Q8_0


@pytest.mark.parametrize("arch", BUILDERS)
def test_kv_cache_quants_reach_attention_layers_only(tiny, references, tmp_path, arch):
    kld = {}
    for kv in ("f16", "q8_0", "q4_0"):
        result, _ = api.kld_report(str(references[arch]), str(tiny[arch]["Q8_0"]), runs_dir=tmp_path,
                                   settings=EngineSettings(type_k=kv, type_v=kv, flash_attn="on"))
        kld[kv] = result["kld"]["mean"]
        assert result["candidate"]["kv"]["type_v"] == kv
    if arch == "mamba":  # no attention, no KV cache: the cache type cannot move a single logit
        # (the live candidate is not coded: against its own coded logits only the code's rounding is left)
        assert kld["q8_0"] == kld["q4_0"] == kld["f16"] < 1e-6
    else:  # one attention layer in four holds a cache
        assert 0 < kld["q8_0"] < kld["q4_0"] < 0.01


class Killed(Exception):
    """Stands for a kill -9 between two chunks."""


def test_resume_after_interruption(tiny, references, tmp_path):
    written = []

    def killed_after_two(n: int) -> None:
        written.append(n)
        if sum(written) == 2:
            raise Killed

    model = str(tiny["qwen35moe"]["Q8_0"])
    with pytest.raises(Killed):
        api.capture_store(model, "ref", runs_dir=tmp_path, n_ctx=N_CTX, chunks=N_CHUNKS, settings=NO_FA,
                          on_chunk=killed_after_two)
    path = tmp_path / "ref.qeval"
    with open(path, "ab") as fh:  # a kill during the next write leaves a torn record behind
        fh.write(b"CHNK" + bytes(100))
    with StoreReader(path, tolerate_torn_tail=True) as partial:
        assert partial.chunk_indices == [0, 1] and not partial.complete
    result, _ = api.capture_store(model, "ref", runs_dir=tmp_path, n_ctx=N_CTX, chunks=N_CHUNKS, settings=NO_FA)
    assert result["chunks_written"] == N_CHUNKS - 2
    with StoreReader(path, verify_chunks=True) as resumed, StoreReader(references["qwen35moe"]) as whole:
        assert resumed.complete and resumed.chunk_indices == list(range(N_CHUNKS))
        for c in range(N_CHUNKS):
            np.testing.assert_array_equal(resumed.read_chunk(c).codes(whole.header.n_vocab),
                                          whole.read_chunk(c).codes(whole.header.n_vocab))


def test_chunks_of_a_longer_reference_equal_a_shorter_reference(tiny, references, tmp_path):
    cand = str(tiny["qwen35moe"]["Q4_0"])
    proc = run_cli("kld", "--ref", references["qwen35moe"], "--cand", cand, "--chunks", "2", "-fa", "off", "--json",
                   "--runs-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    on_longer = json.loads(proc.stdout)
    api.capture_store(str(tiny["qwen35moe"]["Q8_0"]), "short", runs_dir=tmp_path, n_ctx=N_CTX, chunks=2,
                      settings=NO_FA)
    on_short, _ = api.kld_report("short", cand, runs_dir=tmp_path, settings=NO_FA)
    assert on_longer["scored_tokens"] == 2 * N_SCORED
    for key in ("perplexity", "kld", "same_top1", "delta_p"):
        assert on_longer[key] == on_short[key]


REFUSAL_MESSAGES = {"encoder": "encoder-only model (bert", "mmproj": "multimodal projector",
                    "unknown": "architecture 'not-a-real-arch'"}


@pytest.mark.parametrize("kind", REFUSAL_MESSAGES)
def test_what_qeval_cannot_evaluate_gets_one_clear_message(refused, references, tmp_path, kind):
    model = refused[kind]
    assert_cli_error(run_cli("capture", model, "--label", "x", "-c", N_CTX, "--runs-dir", tmp_path),
                     model.name, REFUSAL_MESSAGES[kind])
    assert_cli_error(run_cli("kld", "--ref", references["qwen35moe"], "--cand", model, "--runs-dir", tmp_path),
                     model.name, REFUSAL_MESSAGES[kind])


def test_llama_cpp_tells_an_encoder_that_metadata_hides(refused, tiny):
    # A BERT without `bert.attention.causal = false` passes the metadata rules; llama.cpp knows
    # better: its context has no memory. (Once Engine asks this itself, the constructor raises.)
    with pytest.raises(QevalError, match="bert-undeclared.gguf is an encoder-only model"):
        with Engine(refused["undeclared-encoder"], N_CTX) as engine:
            require_decoder_context(engine._lc, engine.model, engine.ctx, engine.model_path)
    for arch in BUILDERS:  # a hybrid and a recurrent memory are memories
        with Engine(tiny[arch]["Q8_0"], N_CTX) as engine:
            require_decoder_context(engine._lc, engine.model, engine.ctx, engine.model_path)
